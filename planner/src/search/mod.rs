//! Plan search: enumerate (tp, pp, v, schedule, token budget, chunk size, sharding), split the
//! layers for each, and evaluate the candidates with the simulator's Monte Carlo over sampled
//! steps. [`search`] is a sequence of steps, one module each:
//!
//! ```text
//! enumerate  the layouts: tp x pp (dp = ranks / tp / pp), token budget x chunk size, schedule,
//!            v, sharding; the sampled steps cut as each layout's run cuts them (the
//!            simulator's cut_step) and summarized (mean microbatch, most microbatches, work)
//! bound      a lower bound on each one's mean step time; evaluation in increasing order
//! (split)    the layers split under the memory limit (partition::solve_with), in parallel
//! screen     the heaviest replica of each step alone: over the limit rejects, no better
//!            than the keep-th best prunes
//! evaluate   every replica's Monte Carlo; the simulated peak of every rank must fit
//! rank       best first, keep of them; zb-auto and cut sequences for the finalists' layouts
//! ```
//!
//! For every candidate:
//! 1. `dp = ranks / pp` replicas, each taking its cost-balanced share of every step, sharding
//!    weights, gradients and optimizer state as the candidate's mode says
//!    ([`flatpipe_simulator::costs::sharding`]): bytes per parameter and the data-parallel collectives.
//! 2. The schedule's peak in-flight microbatches per stage come from a replay of the
//!    schedule (uniform costs, the largest sampled microbatch count).
//! 3. [`crate::partition::solve`] splits the layers and picks recomputation under the memory
//!    limit, with per-layer costs of a representative microbatch (mean tokens and attention
//!    pairs of the sampled microbatches; activations at the token budget).
//! 4. A lower bound on the mean step time: every replica's compute divided over its pp ranks
//!    (no bubble), plus without a pipeline the step's data-parallel collectives (with one, a
//!    rank's gradient reduction may hide in its cool-down bubble, so none is counted). Candidates are evaluated in increasing order of
//!    this bound; once `keep` candidates are known, one whose bound is no better than the
//!    `keep`-th best is pruned unevaluated.
//! 5. Evaluation: the Monte Carlo on the same sampled steps; the simulated peak memory of every
//!    rank (static + activations, largest over steps) must fit the limit.

mod bound;
mod candidate;
mod enumerate;
mod evaluate;
mod rank;
mod rounds;
mod screen;
mod split;
mod stats;

pub use candidate::{Candidate, SplitReport};

use crate::partition::ExactSplit;
use crate::{Error, Result};
use flatpipe_profiles::context_parallel::ContextParallel;
use flatpipe_profiles::{Profile, StepSize, Workload};
use flatpipe_simulator::ScheduleKind;
use flatpipe_simulator::batching::policy::Policy;
use flatpipe_simulator::costs::Recompute;
use flatpipe_simulator::costs::sharding::{Sharding, StateBytes};
use flatpipe_simulator::run::config::RunConfig;

/// What to enumerate.
#[derive(Debug, Clone, PartialEq)]
pub struct SearchSpace {
    /// Ranks in all (dp x pp).
    pub ranks: u32,
    /// Pipeline degrees to try (each must divide `ranks`).
    pub pp: Vec<u32>,
    /// Stages per rank to try for interleaved schedules (V schedules always use 2, the others 1).
    pub vpp: Vec<u32>,
    /// Schedules to try.
    pub kinds: Vec<ScheduleKind>,
    /// Token budgets per microbatch to try.
    pub token_budgets: Vec<u64>,
    /// Recomputation modes the partition may choose from.
    pub recompute: Vec<Recompute>,
    /// Microbatching policy.
    pub policy: Policy,
    /// Data-parallel sharding modes to try (`hsdp` only where it differs from `fsdp`: a
    /// data-parallel group across nodes).
    pub sharding: Vec<Sharding>,
    /// Tensor-parallel degrees to try (empty: every divisor of the GPUs per node that divides
    /// every decoder's heads and key-value heads, [`tensor_parallel_degrees`]); `ranks` counts
    /// GPUs, so a candidate has `ranks / tp` ranks of `tp` GPUs each.
    pub tp: Vec<u32>,
    /// Sequence parallelism with tensor parallelism (Korthikanti et al. 2022).
    pub sequence_parallel: bool,
    /// Expert-parallel degrees to try on a mixture-of-experts model (empty: 1 and every power
    /// of two that divides every such layer's routed experts, [`expert_parallel_degrees`]; a
    /// degree must also divide a candidate's dp). Dense models run at 1.
    pub ep: Vec<u32>,
    /// Where a sampled step holds a sequence longer than a token budget, also try cutting
    /// such sequences into chunks of the budget and of half of it
    /// ([`flatpipe_simulator::batching::policy::PolicyParams::chunk_tokens`]).
    pub chunk: bool,
    /// Context-parallel groups to try (`None`: one GPU per rank; empty: only that). A group of
    /// `cp` GPUs takes a candidate's `ranks / (tp x cp)` ranks ([`flatpipe_profiles::context_parallel`]),
    /// never with chunks (the other answer to long sequences) and only with a flat policy.
    pub context_parallel: Vec<Option<ContextParallel>>,
}

impl SearchSpace {
    /// Every divisor of `ranks` as pp, v in {1, 2, 4}, every handcrafted schedule, budgets
    /// 4k..128k tokens, every recomputation mode, flat-ffd microbatching.
    pub fn default_for(ranks: u32) -> Self {
        SearchSpace {
            ranks,
            pp: (1..=ranks).filter(|p| ranks % p == 0).collect(),
            vpp: vec![1, 2, 4],
            kinds: ScheduleKind::ALL.to_vec(),
            token_budgets: vec![4096, 8192, 16_384, 32_768, 65_536, 131_072],
            recompute: Recompute::ALL.to_vec(),
            policy: Policy::FlatFfd,
            sharding: vec![
                Sharding::Ddp,
                Sharding::Zero1,
                Sharding::Fsdp,
                Sharding::Hsdp,
            ],
            tp: Vec::new(),
            sequence_parallel: true,
            ep: Vec::new(),
            chunk: true,
            context_parallel: Vec::new(),
        }
    }
}

/// Which statistic ranks the candidates.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RankBy {
    /// Mean step time.
    Mean,
    /// 90th percentile step time.
    P90,
}

/// How to evaluate.
#[derive(Debug, Clone, PartialEq)]
pub struct SearchConfig {
    /// Sampled steps per candidate.
    pub steps: u32,
    /// Seed of the step sampler.
    pub seed: u64,
    /// Step size.
    pub size: StepSize,
    /// Memory limit per rank, bytes.
    pub memory_limit_bytes: f64,
    /// Bytes per parameter in place of each sharding mode's own (`None`: the mode's
    /// mixed-precision layout).
    pub state_bytes: Option<StateBytes>,
    /// Ranking statistic.
    pub rank_by: RankBy,
    /// How many evaluated candidates to keep (best and runners-up); pruning keeps this many.
    pub keep: usize,
    /// The exact split search per candidate where memory forces a split away from the fastest
    /// one; [`ExactSplit::Off`] keeps the DP-based split with its certified gap.
    pub exact_split: ExactSplit,
    /// Forward-only work each step carries (fused or separate), planned with the training.
    pub forward_only: Option<flatpipe_simulator::run::config::ForwardOnlySpec>,
}

/// The best layout of one schedule kind on `pp` ranks of one replica, the plan `calibrate` runs
/// on this machine: v = 2 for the kinds that take it, the fastest of `token_budgets` and layer
/// splits by the mean over 16 sampled steps, no recomputation, no memory limit, and the
/// executor's fp32 state (weights 4 + gradients 4 + AdamW moments 8 bytes per parameter). The
/// candidate and its run configuration ([`Candidate::run`] with no memory limit recorded).
///
/// # Errors
/// [`Error::NoFeasiblePlan`] (e.g. more stages than layers), the search's.
pub fn plan_schedule(
    profile: &Profile,
    workload: &Workload,
    kind: ScheduleKind,
    pp: u32,
    token_budgets: &[u64],
    size: StepSize,
) -> Result<(Candidate, RunConfig)> {
    let mut space = SearchSpace::default_for(pp);
    space.pp = vec![pp];
    space.vpp = vec![2];
    space.kinds = vec![kind];
    space.token_budgets = token_budgets.to_vec();
    space.recompute = vec![Recompute::None];
    space.sharding = vec![Sharding::Ddp];
    space.tp = vec![1];
    // The CUDA executor does not run chunked sequences yet, and calibrate compares schedules on
    // the same microbatches.
    space.chunk = false;
    let config = SearchConfig {
        steps: 16,
        seed: workload.seed,
        size,
        memory_limit_bytes: f64::INFINITY,
        state_bytes: Some(StateBytes {
            params: 4.0,
            grads: 4.0,
            optimizer: 8.0,
        }),
        rank_by: RankBy::Mean,
        keep: 1,
        exact_split: ExactSplit::Off,
        forward_only: None,
    };
    let mut result = search(profile, workload, &space, &config, &|_, _| {})?;
    if result.ranked.is_empty() {
        return Err(Error::NoFeasiblePlan(format!(
            "no {kind} plan on {pp} ranks"
        )));
    }
    let best = result.ranked.swap_remove(0);
    let mut run = best.run.clone();
    // No limit: nothing to record (zb-auto builds unbounded).
    run.memory_limit_bytes = None;
    Ok((best, run))
}

/// What the search found.
#[derive(Debug, Clone)]
pub struct SearchResult {
    /// Evaluated, feasible candidates, best first (at most `keep`).
    pub ranked: Vec<Candidate>,
    /// The best evaluated candidate of each answer to long sequences (whole, chunks, each
    /// context-parallel group; [`Candidate::long_sequences`]), best first. Candidates pruned
    /// by their bound are not in it.
    pub strategies: Vec<Candidate>,
    /// Candidates rejected, with the reason (memory, too many stages, ...).
    pub rejected: Vec<(String, String)>,
    /// Candidates pruned by their lower bound without evaluation.
    pub pruned: usize,
    /// Candidates evaluated with the Monte Carlo (screened, then in full where the screen did
    /// not prune them).
    pub evaluated: usize,
    /// zb-auto candidates not built: their layout was not a finalist's.
    pub zb_auto_not_finalist: usize,
    /// zb-auto finalists not built: [`ZB_AUTO_MAX_FINALISTS`] were built already.
    pub zb_auto_over_limit: usize,
    /// Candidates cutting long sequences into chunks not evaluated: their layout was not a
    /// finalist's.
    pub chunked_not_finalist: usize,
}

/// Branch-and-bound nodes one search spends on its splits at most, spread evenly over its
/// candidates (see [`MIN_NODE_BUDGET`]): a search of 700 candidates keeps the full
/// [`crate::partition::bnb::NODE_BUDGET`] per question, one of 6,600 (Llama-3.1-405B on 1,024 GPUs) about
/// 3,000.
pub const SEARCH_NODE_BUDGET: u64 = 20_000_000;

/// The fewest branch-and-bound nodes a feasibility question gets in a search.
pub const MIN_NODE_BUDGET: u64 = 2_000;

/// The most zb-auto finalists a search builds and evaluates (in order of their lower bound);
/// it reports the rest. A count, not a time: the same search gives the same plan on a busy
/// machine (a 5 s wall-clock limit made `plan` depend on the machine's load).
pub const ZB_AUTO_MAX_FINALISTS: usize = 128;

/// Searches `space` for the best plan of `profile` on `workload`. `progress(done, total)` is
/// called as candidates finish.
///
/// # Errors
/// [`Error::InvalidArgument`] for an empty space or a pp that does not divide the ranks;
/// [`Error::NoFeasiblePlan`] (with the reasons) when nothing fits; simulator errors.
pub fn search(
    base: &Profile,
    workload: &Workload,
    space: &SearchSpace,
    config: &SearchConfig,
    progress: &(dyn Fn(usize, usize) + Sync),
) -> Result<SearchResult> {
    let tps = enumerate::checked_tps(base, space, config)?;
    let mut layouts = enumerate::layouts(base, workload, space, config, tps)?;
    bound::bound_and_order(&mut layouts);
    let ctx = Context {
        workload,
        space,
        config: bound::split_budget(config, layouts.pending.len()),
        profiles: layouts.profiles,
        stats: layouts.stats,
        inflight: split::InflightCache::default(),
    };
    let (ranking, tally) =
        rounds::evaluate_in_rounds(&ctx, layouts.pending, layouts.rejected, progress)?;
    if ranking.ranked.is_empty() {
        return Err(rank::nothing_fits(&ctx, &tally.rejected));
    }
    Ok(SearchResult {
        ranked: ranking.ranked,
        strategies: ranking.strategies,
        rejected: tally.rejected,
        pruned: tally.pruned,
        evaluated: tally.evaluated,
        zb_auto_not_finalist: tally.zb_auto_not_finalist,
        zb_auto_over_limit: tally.zb_auto_over_limit,
        chunked_not_finalist: tally.chunked_not_finalist,
    })
}

/// What the steps after the enumeration read: the inputs, the tensor-parallel profiles and the
/// sampled steps' statistics that the candidates index, and the in-flight counts computed so
/// far.
struct Context<'a> {
    workload: &'a Workload,
    space: &'a SearchSpace,
    /// The search's configuration with the split's node budget per question
    /// ([`bound::split_budget`]).
    config: SearchConfig,
    /// (tp, one GPU's profile of that tensor-parallel degree).
    profiles: Vec<(u32, Profile)>,
    /// Statistics of the sampled steps, one per distinct cut.
    stats: Vec<stats::BatchStats>,
    /// Peak in-flight microbatches per schedule shape.
    inflight: split::InflightCache,
}

/// The tensor-parallel degrees `profile` allows: the divisors of the GPUs per node that divide
/// every decoder's attention heads and key-value heads (Megatron requires both), 1 for a profile
/// whose layer shapes are unknown.
pub fn tensor_parallel_degrees(profile: &Profile) -> Vec<u32> {
    let g = profile.hardware.gpus_per_node.max(1);
    (1..=g)
        .filter(|t| g % t == 0)
        .filter(|&t| t == 1 || profile.tensor_parallel(t, true).is_ok())
        .collect()
}

/// Bytes per parameter of `sharding` on pipeline rank 0 of `pp` x `dp`, or the config's override.
/// The expert-parallel degrees the search tries by default on `profile`'s model: 1 and every
/// power of two that divides every mixture-of-experts layer's routed experts (just 1 for a dense
/// model).
pub fn expert_parallel_degrees(profile: &Profile) -> Vec<u32> {
    let experts: Vec<u64> = profile
        .layers
        .iter()
        .map(|l| l.shape.experts)
        .filter(|&e| e > 0)
        .collect();
    if experts.is_empty() {
        return vec![1];
    }
    (0..16)
        .map(|i| 1u32 << i)
        .take_while(|&e| experts.iter().all(|&x| x % u64::from(e) == 0))
        .collect()
}

/// The state bytes per parameter of `profile`'s routed experts on a candidate: sharded over the
/// `dp / ep` replicas that hold the same experts.
fn expert_state_bytes(
    profile: &Profile,
    config: &SearchConfig,
    sharding: Sharding,
    pp: u32,
    dp: u32,
) -> StateBytes {
    let ep = profile.expert_parallel.max(1);
    state_bytes(profile, config, sharding, pp, (dp / ep).max(1))
}

fn state_bytes(
    profile: &Profile,
    config: &SearchConfig,
    sharding: Sharding,
    pp: u32,
    dp: u32,
) -> StateBytes {
    config
        .state_bytes
        .unwrap_or_else(|| sharding.state_bytes_on(&profile.hardware, pp, dp))
}
