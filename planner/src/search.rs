//! Plan search: enumerate (pp, v, schedule, token budget, sharding), split the layers for each,
//! and evaluate the candidates with the simulator's Monte Carlo over sampled steps.
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

use crate::partition::{ExactSplit, LayerCost, Partition, PartitionProblem, solve_with};
use crate::{Error, Result};
use flatpipe_profiles::{Profile, StepSize, Workload};
use flatpipe_simulator::batching::policy::{Policy, PolicyParams, batch};
use flatpipe_simulator::costs::sharding::{DpGroup, Sharding, StateBytes, StepCollectives};
use flatpipe_simulator::costs::{
    Recompute, UniformCostSpec, UniformCosts, input_bytes_per_token, recompute_effect,
};
use flatpipe_simulator::replay::metrics::stage_inflight_peaks;
use flatpipe_simulator::run::{
    config::{Capacity, RunConfig, ScheduleSource, dp_shares},
    montecarlo::{self, Summary},
};
use flatpipe_simulator::{ScheduleKind, replay};
use rayon::prelude::*;
use serde::Serialize;
use std::ops::Range;

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
    /// Where a sampled step holds a sequence longer than a token budget, also try cutting
    /// such sequences into chunks of the budget and of half of it
    /// ([`flatpipe_simulator::batching::policy::PolicyParams::chunk_tokens`]).
    pub chunk: bool,
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
            chunk: true,
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

/// One evaluated candidate.
#[derive(Debug, Clone, Serialize)]
pub struct Candidate {
    /// Tensor-parallel degree: GPUs per rank (the candidate's profile is one GPU's,
    /// [`Profile::tensor_parallel`]).
    pub tp: u32,
    /// Sequence parallelism with `tp > 1`.
    pub sequence_parallel: bool,
    /// Data-parallel replicas.
    pub dp: u32,
    /// Pipeline ranks per replica.
    pub pp: u32,
    /// Stages per rank.
    pub vpp: u32,
    /// Schedule.
    pub schedule: ScheduleKind,
    /// Token budget per microbatch.
    pub token_budget: u64,
    /// Sequences longer than the budget cut into chunks of at most this many tokens (`None`:
    /// each gets a microbatch of its own).
    pub chunk_tokens: Option<u64>,
    /// How the replicas shard weights, gradients and optimizer state.
    pub sharding: Sharding,
    /// Layer range of every stage.
    #[serde(skip)]
    pub partition: Partition,
    /// Lower bound on the mean step time, seconds.
    pub lower_bound_s: f64,
    /// The simulated distribution over the sampled steps.
    pub summary: Summary,
    /// Per pipeline rank: static + peak activation memory (largest over steps), bytes.
    pub peak_memory_bytes: Vec<f64>,
}

impl Candidate {
    /// The ranking statistic, seconds.
    pub fn score(&self, by: RankBy) -> f64 {
        match by {
            RankBy::Mean => self.summary.step_time_s.mean,
            RankBy::P90 => self.summary.step_time_s.p90,
        }
    }

    /// The profile this candidate is simulated on: one GPU of its tensor-parallel group
    /// ([`Profile::tensor_parallel`] of the searched `base`).
    ///
    /// # Errors
    /// As [`Profile::tensor_parallel`] (not for a profile the search accepted this tp on).
    pub fn profile(&self, base: &Profile) -> Result<Profile> {
        base.tensor_parallel(self.tp, self.sequence_parallel)
            .map_err(|e| Error::Simulator(e.into()))
    }

    /// The run configuration the search evaluated this candidate with: its layout, token
    /// budget and recomputation, microbatched by `policy`, with `config`'s memory limit (which
    /// zb-auto builds under) and forward-only work. It runs on [`Candidate::profile`] (one
    /// GPU's profile), not on the searched one when `tp > 1`.
    pub fn run_config(&self, policy: Policy, config: &SearchConfig) -> RunConfig {
        run_config(
            (self.schedule, self.dp, self.pp, self.vpp, self.token_budget),
            self.chunk_tokens,
            self.sharding,
            &self.partition,
            policy,
            config,
        )
    }

    /// `schedule tp=.. dp=.. pp=.. v=.. budget=..[ chunk=..] sharding` (`tp=..` only above 1,
    /// `chunk=..` only when long sequences are cut).
    pub fn describe(&self) -> String {
        format!(
            "{} {}dp={} pp={} v={} budget={}{} {}",
            self.schedule_name(),
            if self.tp > 1 {
                format!("tp={} ", self.tp)
            } else {
                String::new()
            },
            self.dp,
            self.pp,
            self.vpp,
            self.token_budget,
            self.chunk_tokens
                .map_or(String::new(), |c| format!(" chunk={c}")),
            self.sharding
        )
    }

    /// The schedule's name, or `no pipeline` for pp = 1 (one rank runs F then B of each
    /// microbatch in turn, whatever the schedule kind says).
    pub fn schedule_name(&self) -> String {
        if self.pp == 1 {
            "no pipeline".into()
        } else {
            self.schedule.to_string()
        }
    }
}

/// The run configuration of (kind, dp, pp, v, token budget) with `partition`'s layers and
/// recomputation ([`Candidate::run_config`]).
fn run_config(
    (kind, dp, pp, v, budget): (ScheduleKind, u32, u32, u32, u64),
    chunk_tokens: Option<u64>,
    sharding: Sharding,
    partition: &Partition,
    policy: Policy,
    config: &SearchConfig,
) -> RunConfig {
    let mut run = RunConfig::new(
        ScheduleSource::Kind(kind),
        pp,
        v,
        partition.stages.clone(),
        policy,
        Capacity::Dynamic,
    );
    run.dp = dp;
    run.sharding = sharding;
    run.state_bytes = config.state_bytes;
    run.recompute = partition.recompute.clone();
    run.memory_limit_bytes = Some(config.memory_limit_bytes);
    run.forward_only = config.forward_only;
    run.params = PolicyParams {
        token_budget: budget,
        chunk_tokens,
        ..Default::default()
    };
    run
}

/// The best layout of one schedule kind on `pp` ranks of one replica, the plan `calibrate` runs
/// on this machine: v = 2 for the kinds that take it, the fastest of `token_budgets` and layer
/// splits by the mean over 16 sampled steps, no recomputation, no memory limit, and the
/// executor's fp32 state (weights 4 + gradients 4 + AdamW moments 8 bytes per parameter). The
/// candidate and its run configuration ([`Candidate::run_config`]).
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
    let mut run = best.run_config(space.policy, &config);
    // No limit: nothing to record (zb-auto builds unbounded).
    run.memory_limit_bytes = None;
    Ok((best, run))
}

/// What the search found.
#[derive(Debug, Clone)]
pub struct SearchResult {
    /// Evaluated, feasible candidates, best first (at most `keep`).
    pub ranked: Vec<Candidate>,
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

/// What evaluating one candidate came to.
enum Evaluation {
    /// It fits: its split, its simulated steps and each rank's peak memory, bytes.
    Fits(
        Partition,
        Vec<flatpipe_simulator::run::step::StepOutcome>,
        Vec<f64>,
    ),
    /// Pruned by its screen: no better than the keep-th best (not a rejection).
    Screened,
    /// Rejected, with the reason.
    Rejected(String),
}

#[derive(Clone)]
struct Pending {
    /// Index into the tensor-parallel profiles.
    tpi: usize,
    sharding: Sharding,
    dp: u32,
    pp: u32,
    v: u32,
    kind: ScheduleKind,
    budget: u64,
    chunk: Option<u64>,
    stats: usize,
    lower_bound_s: f64,
}

/// Microbatch statistics of the sampled steps under one (dp, budget).
struct BatchStats {
    mean_tokens: f64,
    mean_pairs: f64,
    max_count: u32,
    /// The most tokens any sampled microbatch computes.
    max_tokens: f64,
    /// Per step: the largest replica's total F + I + W time over all layers, seconds.
    replica_work_s: Vec<f64>,
}

fn batch_stats(
    profile: &Profile,
    steps: &[Vec<u32>],
    dp: u32,
    policy: Policy,
    (budget, chunk_tokens): (u64, Option<u64>),
) -> Result<BatchStats> {
    let (tok, pair) = profile.layers.iter().fold((0.0, 0.0), |acc, l| {
        (
            acc.0 + l.f.c_tok_s + l.i.c_tok_s + l.w.c_tok_s,
            acc.1 + l.f.c_attn_s + l.i.c_attn_s + l.w.c_attn_s,
        )
    });
    let c0: f64 = profile
        .layers
        .iter()
        .map(|l| l.f.c0_s + l.i.c0_s + l.w.c0_s)
        .sum();
    let cost = move |t: u64, a: u64| tok * t as f64 + pair * a as f64;
    let params = PolicyParams {
        token_budget: budget,
        chunk_tokens,
        ..Default::default()
    };
    let (mut n, mut t_sum, mut a_sum, mut max_count) = (0usize, 0.0, 0.0, 0u32);
    let mut max_tokens = 0.0f64;
    let mut replica_work_s = Vec::with_capacity(steps.len());
    for seqs in steps {
        let mut worst = 0.0f64;
        for share in dp_shares(seqs, dp, &cost) {
            let b = batch(policy, &share, &params, &cost)?;
            max_count = max_count.max(b.microbatches.len() as u32);
            let mut work = 0.0;
            for mb in &b.microbatches {
                let (t, a) = (mb.computed_tokens() as f64, mb.computed_attn_pairs() as f64);
                n += 1;
                max_tokens = max_tokens.max(t);
                t_sum += t;
                a_sum += a;
                work += c0 + tok * t + pair * a;
            }
            worst = worst.max(work);
        }
        replica_work_s.push(worst);
    }
    Ok(BatchStats {
        mean_tokens: t_sum / n.max(1) as f64,
        mean_pairs: a_sum / n.max(1) as f64,
        max_count: max_count.max(1),
        max_tokens,
        replica_work_s,
    })
}

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
    if space.ranks == 0 {
        return Err(Error::invalid("ranks", 0, ">= 1"));
    }
    base.hardware
        .check_gpus(u64::from(space.ranks))
        .map_err(|e| Error::Simulator(e.into()))?;
    let tps = if space.tp.is_empty() {
        tensor_parallel_degrees(base)
    } else {
        space.tp.clone()
    };
    if let Some(t) = tps.iter().find(|t| **t == 0) {
        return Err(Error::invalid("tp", t, ">= 1 GPU per rank"));
    }
    if let Some(p) = space.pp.iter().find(|p| **p == 0 || space.ranks % **p != 0) {
        return Err(Error::invalid(
            "pp",
            p,
            format!("a divisor of --ranks {}", space.ranks),
        ));
    }
    if config.steps == 0 {
        return Err(Error::invalid("steps", 0, ">= 1"));
    }
    let steps: Vec<Vec<u32>> = (0..config.steps)
        .map(|i| workload.sample_step(config.seed, i as u64, config.size))
        .collect();
    let n_layers = base.layers.len();
    let mut rejected = Vec::new();
    let mut pending = Vec::new();
    let mut all_stats = Vec::new();
    let fewest_seqs = steps.iter().map(Vec::len).min().unwrap_or(0);
    let mut profiles: Vec<(u32, Profile)> = Vec::new();
    for tp in tps {
        if space.ranks % tp != 0 {
            rejected.push((
                format!("tp={tp}"),
                format!("{tp} GPUs per rank do not divide the {} GPUs", space.ranks),
            ));
            continue;
        }
        match base.tensor_parallel(tp, space.sequence_parallel) {
            Ok(p) => profiles.push((tp, p)),
            Err(e) => rejected.push((format!("tp={tp}"), e.to_string())),
        }
    }
    for (tpi, (tp, profile)) in profiles.iter().enumerate() {
        let (tp, ranks) = (*tp, space.ranks / *tp);
        for &pp in space.pp.iter().filter(|&&pp| ranks % pp == 0) {
            let dp = ranks / pp;
            let tp_prefix = if tp > 1 {
                format!("tp={tp} ")
            } else {
                String::new()
            };
            if fewest_seqs < dp as usize {
                rejected.push((
                format!("{tp_prefix}dp={dp} pp={pp}"),
                format!(
                    "{dp} replicas, but a sampled step has only {fewest_seqs} sequence(s): a replica would get none"
                ),
            ));
                continue;
            }
            let shardings = shardings_for(profile, space, pp, dp);
            let longest = steps.iter().flatten().copied().max().unwrap_or(0) as u64;
            let options = space.token_budgets.iter().flat_map(|&budget| {
                // Long sequences: whole (a microbatch each), or in chunks of the budget or half
                // (with a pipeline to fill: pp = 1 runs the chunks one after the other).
                let chunks = if space.chunk && pp > 1 && longest > budget {
                    vec![None, Some(budget), Some(budget / 2)]
                } else {
                    vec![None]
                };
                chunks
                    .into_iter()
                    .filter(|c| *c != Some(0))
                    .map(move |c| (budget, c))
            });
            for (budget, chunk) in options {
                let stats = batch_stats(profile, &steps, dp, space.policy, (budget, chunk))?;
                let work_lb = stats.replica_work_s.iter().sum::<f64>()
                    / stats.replica_work_s.len().max(1) as f64
                    / pp as f64;
                all_stats.push(stats);
                let stats_idx = all_stats.len() - 1;
                // pp = 1 is no pipeline: one rank runs F then B of each microbatch in turn
                // (gradient accumulation), whatever the schedule; one candidate, as 1F1B on one stage.
                let kinds: Vec<ScheduleKind> = if pp == 1 {
                    vec![ScheduleKind::OneFOneB]
                } else {
                    space.kinds.clone()
                };
                for &kind in &kinds {
                    let vs: Vec<u32> = match kind {
                        _ if pp == 1 => vec![1],
                        ScheduleKind::Interleaved1F1B | ScheduleKind::LoopedBfs => {
                            space.vpp.iter().copied().filter(|v| *v >= 2).collect()
                        }
                        _ => vec![kind.stages_per_rank(None)?],
                    };
                    for v in vs {
                        let s_count = (pp * v) as usize;
                        if s_count > n_layers {
                            let what =
                                format!("{kind} {tp_prefix}dp={dp} pp={pp} v={v} budget={budget}");
                            rejected
                                .push((what, format!("{s_count} stages for {n_layers} layers")));
                            continue;
                        }
                        for &sharding in &shardings {
                            pending.push(Pending {
                                tpi,
                                sharding,
                                dp,
                                pp,
                                v,
                                kind,
                                budget,
                                chunk,
                                stats: stats_idx,
                                lower_bound_s: work_lb + collectives_lb(profile, sharding, pp, dp),
                            });
                        }
                    }
                }
            }
        }
    }

    pending.sort_by(|a, b| a.lower_bound_s.total_cmp(&b.lower_bound_s));
    let total = pending.len();
    // The branch and bound's node budget per feasibility question, shared over the search:
    // SEARCH_NODE_BUDGET nodes spread over the candidates, at least MIN_NODE_BUDGET and at most
    // the configured budget (deterministic: it depends on the space, not on the machine).
    let split_config = match config.exact_split {
        ExactSplit::BranchAndBound { node_budget } => SearchConfig {
            exact_split: ExactSplit::BranchAndBound {
                node_budget: (SEARCH_NODE_BUDGET / total.max(1) as u64)
                    .clamp(MIN_NODE_BUDGET.min(node_budget), node_budget),
            },
            ..config.clone()
        },
        _ => config.clone(),
    };
    let config = &split_config;
    let mut ranked: Vec<Candidate> = Vec::new();
    let (mut pruned, mut evaluated) = (0, 0);
    // zb-auto builds every step's schedule by list scheduling, far costlier than a handcrafted
    // schedule: it runs for the finalists only, the layouts (tp, dp, pp, budget, sharding) of
    // the candidates ranked once the others are evaluated, in order of their lower bound, until
    // ZB_AUTO_MAX_FINALISTS were built.
    // Cutting long sequences into chunks refines a layout: those variants too run for the
    // finalists' layouts only.
    let (deferred, mut queue): (Vec<Pending>, Vec<Pending>) = pending
        .into_iter()
        .partition(|c| c.kind == ScheduleKind::ZbAuto || c.chunk.is_some());
    let (mut finals, mut done) = (false, 0usize);
    let mut zb_auto_built = 0usize;
    let inflight = InflightCache::default();
    type ScreenKey = (
        usize,
        u32,
        u32,
        ScheduleKind,
        (u64, Option<u64>),
        Vec<Range<usize>>,
        Vec<Recompute>,
    );
    let mut screens: std::collections::HashMap<ScreenKey, Vec<montecarlo::ScreenBase>> =
        Default::default();
    let (mut zb_auto_not_finalist, mut zb_auto_over_limit) = (0usize, 0usize);
    let mut chunked_not_finalist = 0usize;
    loop {
        let items = std::mem::take(&mut queue);
        // The splits of the next few candidates are solved in parallel (independent of the
        // ranking; one that the ranking then prunes was solved for nothing, never wrongly).
        let width = rayon::current_num_threads().max(1);
        for chunk in items.chunks(width) {
            let kth = (ranked.len() >= config.keep)
                .then(|| ranked[config.keep - 1].score(config.rank_by));
            let mut first: Vec<Option<Result<Partition>>> = chunk
                .par_iter()
                .map(|c| {
                    if kth.is_some_and(|k| c.lower_bound_s >= k) || c.kind == ScheduleKind::ZbAuto {
                        return None;
                    }
                    let profile = &profiles[c.tpi].1;
                    Some(plan_candidate(
                        profile,
                        space,
                        config,
                        &all_stats[c.stats],
                        (c.pp, c.v, c.kind, c.budget as f64),
                        state_bytes(profile, config, c.sharding, c.pp, c.dp),
                        &inflight,
                    ))
                })
                .collect();
            for (ci, c) in chunk.iter().enumerate() {
                done += 1;
                let i = done - 1;
                if ranked.len() >= config.keep
                    && c.lower_bound_s >= ranked[config.keep - 1].score(config.rank_by)
                {
                    pruned += 1;
                    progress(i + 1, total);
                    continue;
                }
                if c.kind == ScheduleKind::ZbAuto {
                    zb_auto_built += 1;
                }
                if c.kind == ScheduleKind::ZbAuto && zb_auto_built > ZB_AUTO_MAX_FINALISTS {
                    zb_auto_over_limit += 1;
                    progress(i + 1, total);
                    continue;
                }
                let (tp, profile) = (profiles[c.tpi].0, &profiles[c.tpi].1);
                let what = format!(
                    "{} {}dp={} pp={} v={} budget={}{} {}",
                    c.kind,
                    if tp > 1 {
                        format!("tp={tp} ")
                    } else {
                        String::new()
                    },
                    c.dp,
                    c.pp,
                    c.v,
                    c.budget,
                    c.chunk.map_or(String::new(), |n| format!(" chunk={n}")),
                    c.sharding
                );
                let state = state_bytes(profile, config, c.sharding, c.pp, c.dp);
                let stats = &all_stats[c.stats];
                // Activations are reserved for microbatches of the token budget; a sequence longer than
                // the budget makes a larger microbatch of its own. When the simulated peak then exceeds
                // the limit, the split is solved once more reserving the longest sampled microbatch
                // for every in-flight one (conservative), which may choose more recomputation.
                let mut act_tokens = c.budget as f64;
                let mut solved = first[ci].take();
                let evaluation = loop {
                    let split = match solved.take() {
                        Some(s) => s,
                        None => plan_candidate(
                            profile,
                            space,
                            config,
                            stats,
                            (c.pp, c.v, c.kind, act_tokens),
                            state,
                            &inflight,
                        ),
                    };
                    let partition = match split {
                        Ok(p) => p,
                        Err(Error::InfeasibleMemory { explanation, .. }) => {
                            break Evaluation::Rejected(explanation);
                        }
                        Err(e) => return Err(e),
                    };
                    evaluated += 1;
                    // zb-auto builds each step's schedule under the same memory limit.
                    let run = run_config(
                        (c.kind, c.dp, c.pp, c.v, c.budget),
                        c.chunk,
                        c.sharding,
                        &partition,
                        space.policy,
                        config,
                    );
                    // The screen first: the heaviest replica of each step alone, a lower bound on the
                    // step time and on the memory. Its memory over the limit rejects exactly; its score
                    // no better than the keep-th best prunes exactly; only the rest run every replica.
                    // Sharding modes without per-microbatch collectives leave the replica's
                    // timeline as it is: one screen of a layout serves them all.
                    let shareable = c.kind != ScheduleKind::ZbAuto
                        && c.sharding != Sharding::Zero2
                        && !c.sharding.per_microbatch(c.pp);
                    let key = (
                        c.tpi,
                        c.pp,
                        c.v,
                        c.kind,
                        (c.budget, c.chunk),
                        partition.stages.clone(),
                        partition.recompute.clone(),
                    );
                    let base = match screens.get(&key).filter(|_| shareable) {
                        Some(b) => Ok(b.clone()),
                        None => montecarlo::screen_base(
                            profile,
                            workload,
                            config.seed,
                            config.size,
                            config.steps,
                            &run,
                        ),
                    };
                    let screened = match base.and_then(|b| {
                        let s = b
                            .iter()
                            .map(|x| x.finish(&run, profile))
                            .collect::<flatpipe_simulator::Result<Vec<_>>>()?;
                        if shareable {
                            screens.insert(key, b);
                        }
                        Ok(s)
                    }) {
                        Ok(s) => s,
                        // A schedule that cannot order a step's chunks: a rejected candidate too.
                        Err(e) if c.kind == ScheduleKind::ZbAuto || c.chunk.is_some() => {
                            break Evaluation::Rejected(e.to_string());
                        }
                        Err(e) => return Err(e.into()),
                    };
                    let mut screen_peak = vec![0.0f64; c.pp as usize];
                    for s in &screened {
                        for (r, m) in s.rank_memory_bytes.iter().enumerate() {
                            screen_peak[r] = screen_peak[r].max(*m);
                        }
                    }
                    if let Some((r, m)) = screen_peak
                        .iter()
                        .enumerate()
                        .find(|(_, m)| **m > config.memory_limit_bytes)
                    {
                        if stats.max_tokens > act_tokens {
                            act_tokens = stats.max_tokens;
                            continue;
                        }
                        let gib = |b: f64| b / (1u64 << 30) as f64;
                        break Evaluation::Rejected(format!(
                            "simulated peak on rank {r} is {:.1} GiB, over the limit {:.1} GiB",
                            gib(*m),
                            gib(config.memory_limit_bytes)
                        ));
                    }
                    let times: Vec<f64> = screened.iter().map(|s| s.step_time_s).collect();
                    let q = montecarlo::Quantiles::of(&times);
                    let screen_score = match config.rank_by {
                        RankBy::Mean => q.mean,
                        RankBy::P90 => q.p90,
                    };
                    if ranked.len() >= config.keep
                        && screen_score >= ranked[config.keep - 1].score(config.rank_by)
                    {
                        break Evaluation::Screened;
                    }
                    let mc = match montecarlo::run(
                        profile,
                        workload,
                        config.seed,
                        config.size,
                        config.steps,
                        &[run],
                        &|| {},
                    ) {
                        Ok(mc) => mc,
                        // zb-auto finds no schedule under the limit on some step: a rejected candidate.
                        // A schedule that cannot order a step's chunks: a rejected candidate too.
                        Err(e) if c.kind == ScheduleKind::ZbAuto || c.chunk.is_some() => {
                            break Evaluation::Rejected(e.to_string());
                        }
                        Err(e) => return Err(e.into()),
                    };
                    let outcomes = &mc.outcomes[0];
                    let mut peak = vec![0.0f64; c.pp as usize];
                    for o in outcomes {
                        for (r, m) in o.rank_memory_bytes.iter().enumerate() {
                            peak[r] = peak[r].max(*m);
                        }
                    }
                    match peak
                        .iter()
                        .enumerate()
                        .find(|(_, m)| **m > config.memory_limit_bytes)
                    {
                        None => break Evaluation::Fits(partition, outcomes.clone(), peak),
                        Some(_) if stats.max_tokens > act_tokens => act_tokens = stats.max_tokens,
                        Some((r, m)) => {
                            let gib = |b: f64| b / (1u64 << 30) as f64;
                            break Evaluation::Rejected(format!(
                                "simulated peak on rank {r} is {:.1} GiB, over the limit {:.1} GiB",
                                gib(*m),
                                gib(config.memory_limit_bytes)
                            ));
                        }
                    }
                };
                progress(i + 1, total);
                let (partition, outcomes, peak) = match evaluation {
                    Evaluation::Fits(partition, outcomes, peak) => (partition, outcomes, peak),
                    Evaluation::Screened => {
                        pruned += 1;
                        continue;
                    }
                    Evaluation::Rejected(reason) => {
                        rejected.push((what, reason));
                        continue;
                    }
                };
                let outcomes = &outcomes;
                let cand = Candidate {
                    tp,
                    sequence_parallel: space.sequence_parallel && tp > 1,
                    dp: c.dp,
                    pp: c.pp,
                    vpp: c.v,
                    schedule: c.kind,
                    token_budget: c.budget,
                    chunk_tokens: c.chunk,
                    sharding: c.sharding,
                    lower_bound_s: c.lower_bound_s,
                    partition,
                    summary: montecarlo::summarize(
                        outcomes,
                        c.dp * c.pp,
                        profile.hardware.peak_flops,
                    ),
                    peak_memory_bytes: peak,
                };
                // Ties go to the larger token budget (it cuts fewer sequences into microbatches
                // of their own, and an export then trains on the rows that were predicted).
                let pos = ranked.partition_point(|x| {
                    let (a, b) = (x.score(config.rank_by), cand.score(config.rank_by));
                    a < b || (a == b && x.token_budget >= cand.token_budget)
                });
                ranked.insert(pos, cand);
                ranked.truncate(config.keep.max(1));
            }
        }
        if finals {
            break;
        }
        finals = true;
        let layout = |tp: u32, dp: u32, pp: u32, budget: u64, sharding: Sharding| {
            ranked.iter().any(|r| {
                (r.tp, r.dp, r.pp, r.token_budget, r.sharding) == (tp, dp, pp, budget, sharding)
            })
        };
        for c in &deferred {
            if ranked.is_empty() || layout(profiles[c.tpi].0, c.dp, c.pp, c.budget, c.sharding) {
                queue.push(c.clone());
            } else if c.kind != ScheduleKind::ZbAuto {
                chunked_not_finalist += 1;
                done += 1;
                progress(done, total);
            } else {
                zb_auto_not_finalist += 1;
                done += 1;
                progress(done, total);
            }
        }
        if queue.is_empty() {
            break;
        }
    }
    if ranked.is_empty() {
        let mut reasons: Vec<String> = rejected
            .iter()
            .take(6)
            .map(|(w, r)| format!("{w}: {r}"))
            .collect();
        if rejected.len() > 6 {
            reasons.push(format!("... and {} more", rejected.len() - 6));
        }
        // When the static state alone cannot fit even split over the most pipeline ranks
        // searched, that is the reason, before any candidate's details.
        // The least any layout searched holds per rank: its state bytes per parameter over its
        // pp ranks.
        let mut least: Option<(f64, u32, u32, Sharding, f64, u32, f64)> = None;
        for (tp, profile) in &profiles {
            let ranks = space.ranks / tp;
            let total_params: f64 = profile.layers.iter().map(|l| l.param_count as f64).sum();
            for &pp in space.pp.iter().filter(|&&pp| ranks % pp == 0) {
                let dp = ranks / pp;
                for m in shardings_for(profile, space, pp, dp) {
                    let per_param = state_bytes(profile, config, m, pp, dp).total();
                    let bytes = total_params * per_param / f64::from(pp);
                    if least.is_none_or(|l| bytes < l.0) {
                        least = Some((bytes, pp, dp, m, per_param, *tp, total_params));
                    }
                }
            }
        }
        if let Some((static_floor, pp, dp, m, per_param, tp, total_params)) = least
            && static_floor > config.memory_limit_bytes
        {
            let gib = |b: f64| b / (1u64 << 30) as f64;
            reasons.insert(
                0,
                format!(
                    "parameters, gradients and optimizer state alone need at least {:.1} GiB per GPU in every layout searched (the least: {}pp = {pp}, dp = {dp}, {m}: {:.2} bytes per parameter over {pp} rank(s), {:.2e} parameters per GPU of a rank), above the {:.1} GiB limit: more ranks, more sharding or a larger memory limit",
                    gib(static_floor),
                    if tp > 1 { format!("tp = {tp}, ") } else { String::new() },
                    per_param,
                    total_params,
                    gib(config.memory_limit_bytes)
                ),
            );
        }
        return Err(Error::NoFeasiblePlan(reasons.join("; ")));
    }
    Ok(SearchResult {
        ranked,
        rejected,
        pruned,
        evaluated,
        zb_auto_not_finalist,
        zb_auto_over_limit,
        chunked_not_finalist,
    })
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

/// The sharding modes to search for `pp` x `dp`: the space's, without `hsdp` where it is `fsdp`
/// (every data-parallel group in one node) and `fsdp` is searched, and only `ddp` for dp = 1
/// (nothing to shard).
fn shardings_for(profile: &Profile, space: &SearchSpace, pp: u32, dp: u32) -> Vec<Sharding> {
    if dp <= 1 {
        return vec![Sharding::Ddp];
    }
    space
        .sharding
        .iter()
        .copied()
        .filter(|&m| {
            m != Sharding::Hsdp
                || !space.sharding.contains(&Sharding::Fsdp)
                || (0..pp).any(|r| {
                    DpGroup::of(Sharding::Hsdp, &profile.hardware, pp, dp, r).replicate > 1
                })
        })
        .collect()
}

/// Bytes per parameter of `sharding` on pipeline rank 0 of `pp` x `dp`, or the config's override.
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

/// A lower bound on the step's data-parallel collectives: without a pipeline, the one rank's
/// reduction and all-gathers follow its compute ([`StepCollectives`]); with one, 0 (a rank's
/// reduction may hide in its cool-down bubble).
fn collectives_lb(profile: &Profile, sharding: Sharding, pp: u32, dp: u32) -> f64 {
    if pp > 1 {
        return 0.0;
    }
    let params: f64 = profile.layers.iter().map(|l| l.param_count as f64).sum();
    let c = StepCollectives::of(sharding, &profile.hardware, pp, dp, 0, params);
    c.before_first_forward_s + c.gradient_reduction_s + c.after_optimizer_s
}

/// Peak in-flight microbatches per stage, computed once per (kind, pp, v, m) within a search.
type InflightCache =
    std::sync::Mutex<std::collections::HashMap<(ScheduleKind, u32, u32, u32), Vec<f64>>>;

/// The peak in-flight microbatches of every stage of `kind` on `pp` ranks with `v` stages each
/// and `m` microbatches, from a replay under uniform costs; the same for every candidate of
/// that shape, so computed once per shape in `cache` (a 512-rank schedule is not rebuilt per
/// budget and sharding mode).
fn inflight_peaks(
    cache: &InflightCache,
    kind: ScheduleKind,
    pp: u32,
    v: u32,
    m: u32,
) -> Result<Vec<f64>> {
    if let Some(p) = cache
        .lock()
        .ok()
        .and_then(|c| c.get(&(kind, pp, v, m)).cloned())
    {
        return Ok(p);
    }
    let schedule = kind.generate(pp, v, m)?;
    let uniform = replay::replay(
        &schedule,
        &UniformCosts::new(&UniformCostSpec::default(), v),
    )?;
    let peaks: Vec<f64> = stage_inflight_peaks(&schedule, &uniform)
        .into_iter()
        .map(f64::from)
        .collect();
    if let Ok(mut c) = cache.lock() {
        c.insert((kind, pp, v, m), peaks.clone());
    }
    Ok(peaks)
}

fn plan_candidate(
    profile: &Profile,
    space: &SearchSpace,
    config: &SearchConfig,
    stats: &BatchStats,
    (pp, v, kind, act_tokens): (u32, u32, ScheduleKind, f64),
    state: StateBytes,
    cache: &InflightCache,
) -> Result<Partition> {
    // Quick reject, before the schedule is built: the static memory alone, spread perfectly
    // over pp ranks, must fit.
    let static_total: f64 = profile
        .layers
        .iter()
        .map(|l| l.param_count as f64)
        .sum::<f64>()
        * state.total();
    if static_total / pp as f64 > config.memory_limit_bytes {
        let gib = |b: f64| b / (1u64 << 30) as f64;
        return Err(Error::InfeasibleMemory {
            layers: profile.layers.len(),
            stages: (pp * v) as usize,
            limit_gib: gib(config.memory_limit_bytes),
            explanation: format!(
                "parameters, gradients and optimizer state alone need {:.1} GiB per rank over {pp} ranks; limit {:.1} GiB",
                gib(static_total / pp as f64),
                gib(config.memory_limit_bytes)
            ),
        });
    }
    let inflight = inflight_peaks(cache, kind, pp, v, stats.max_count)?;
    let layers = profile
        .layers
        .iter()
        .enumerate()
        .map(|(j, l)| {
            let input = input_bytes_per_token(profile, j);
            let mut time_s = [0.0; 3];
            let mut act_bytes = [0.0; 3];
            for (mi, &m) in Recompute::ALL.iter().enumerate() {
                let e = recompute_effect(l, input, m, stats.mean_tokens, stats.mean_pairs);
                time_s[mi] = l.f.time_s(stats.mean_tokens, stats.mean_pairs)
                    + l.i.time_s(stats.mean_tokens, stats.mean_pairs)
                    + l.w.time_s(stats.mean_tokens, stats.mean_pairs)
                    + e.extra_i_s;
                // An in-flight microbatch holds at most its peak (after F, or after I with
                // what I recomputed); the simulated peak, which decides, is exact.
                act_bytes[mi] = recompute_effect(l, input, m, act_tokens, 0.0).peak();
            }
            LayerCost {
                time_s,
                act_bytes,
                params: l.param_count,
            }
        })
        .collect();
    let placement = kind.placement_on(pp, v)?;
    let problem = PartitionProblem {
        layers,
        placement,
        inflight,
        memory_limit_bytes: config.memory_limit_bytes,
        static_bytes: state,
        modes: space.recompute.clone(),
    };
    solve_with(&problem, config.exact_split)
}
