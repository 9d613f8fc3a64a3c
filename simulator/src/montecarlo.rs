//! Monte Carlo over sampled steps: each step's sequences, microbatches and schedule, simulated
//! in parallel, summarised as a step-time distribution.
//!
//! Schedule capacity (`--capacity`):
//! - `dynamic` (default): each step's schedule is built for that step's microbatch count
//!   (DESIGN point 3).
//! - `K` (the torchtitan-style baseline): the schedule is built once for K microbatches. A
//!   step with n microbatches runs `ceil(n / K)` rounds of that schedule one after the other,
//!   each ending with a pipeline flush (the next round starts when the previous one has
//!   finished on every rank); the first rounds carry microbatches `0..K`, `K..2K`, ..., the last
//!   round the rest (possibly one). Slots a round has no microbatch for are **empty
//!   microbatches**: zero tokens, so each of their actions still costs its fixed `c0` (kernel
//!   launches) and nothing else, and they hold no activations. Only the last round ends with
//!   the optimizer step. The step time is the sum of the rounds' makespans.

use crate::costs::{CostModel, TableCosts, ns_to_s};
use crate::generators::ScheduleKind;
use crate::ir::{Rank, Schedule};
use crate::microbatch::Microbatch;
use crate::policy::{Batched, Policy};
pub use crate::step::RunConfig;
use crate::{Error, Result, Simulation};
use flatpipe_profiles::{Profile, StepSize, Workload};
use rayon::prelude::*;
use serde::Serialize;
use std::collections::HashMap;
use std::fmt;
use std::str::FromStr;
use std::sync::{Arc, Mutex, OnceLock};

/// How many microbatches a step's schedule holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Capacity {
    /// Built per step for that step's microbatch count.
    Dynamic,
    /// Built once for K microbatches; overflow runs extra rounds, missing slots run empty.
    Fixed(u32),
}

impl fmt::Display for Capacity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Capacity::Dynamic => f.write_str("dynamic"),
            Capacity::Fixed(k) => write!(f, "{k}"),
        }
    }
}

impl FromStr for Capacity {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        let t = s.trim();
        if t == "dynamic" {
            return Ok(Capacity::Dynamic);
        }
        match t.parse::<u32>() {
            Ok(k) if k >= 1 => Ok(Capacity::Fixed(k)),
            _ => Err(Error::invalid(
                "capacity",
                s,
                "`dynamic` or a number of microbatches >= 1",
            )),
        }
    }
}

/// Where a configuration's schedule comes from.
#[derive(Debug, Clone, PartialEq)]
pub enum ScheduleSource {
    /// Generated for the step (or for the fixed capacity).
    Kind(ScheduleKind),
    /// Given as data (e.g. a PyTorch CSV): a fixed-capacity schedule of its microbatch count.
    Given(Schedule),
}

impl ScheduleSource {
    /// The schedule's name.
    pub fn name(&self) -> String {
        match self {
            ScheduleSource::Kind(k) => k.name().to_string(),
            ScheduleSource::Given(s) => s.name.clone(),
        }
    }
}

/// Forward-only microbatches of each step (see [`crate::forward_only`]); in a plan file:
///
/// ```yaml
/// forward_only: {mode: fused, loss_dependency: true}   # microbatches: K, or absent = one per
///                                                      # training microbatch
/// ```
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ForwardOnlySpec {
    /// K forward-only microbatches per replica: the step's microbatches, cycled; `None`: one
    /// per training microbatch (a reference model over the same batch).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub microbatches: Option<u32>,
    /// Fused into bubbles or a separate pass.
    #[serde(default)]
    pub mode: crate::forward_only::FoMode,
    /// Training microbatch i's loss needs forward-only microbatch i.
    #[serde(default)]
    pub loss_dependency: bool,
}

/// zb-auto's activation budget per rank, bytes: the memory limit (default
/// [`default_memory_limit`]) minus the largest rank's parameters, gradients and optimizer state.
///
/// # Errors
/// [`Error::MemoryLimit`] when the limit leaves nothing for activations.
pub fn zb_auto_activation_limit(
    profile: &Profile,
    memory_limit_bytes: Option<f64>,
    costs: &TableCosts,
    p: u32,
) -> Result<f64> {
    let static_max = (0..p)
        .map(|r| costs.static_bytes(Rank(r)))
        .fold(0.0, f64::max);
    let total = memory_limit_bytes.unwrap_or_else(|| default_memory_limit(profile));
    if total <= static_max {
        let gib = |b: f64| b / (1u64 << 30) as f64;
        return Err(Error::MemoryLimit {
            schedule: "zb-auto".into(),
            limit: format!("{:.2} GiB", gib(total)),
            reason: format!(
                "a rank's parameters, gradients and optimizer state alone need {:.2} GiB, which leaves no room for activations",
                gib(static_max)
            ),
        });
    }
    Ok(total - static_max)
}

/// The default memory limit of a rank: the hardware's memory minus a reserve (CUDA context,
/// communication buffers, fragmentation) of 4 GiB, at most an eighth of the memory.
pub fn default_memory_limit(profile: &Profile) -> f64 {
    let memory = profile.hardware.memory_bytes as f64;
    memory - (4.0 * (1u64 << 30) as f64).min(memory / 8.0)
}

/// The predicted compute time (F + I + W over every layer, seconds) of a flat microbatch of
/// `tokens` tokens and `attn_pairs` causal pairs, without fixed costs: what `flat-balanced`
/// microbatching and the data-parallel shares balance.
pub fn balance_cost(profile: &Profile) -> impl Fn(u64, u64) -> f64 + Send + Sync + Clone + 'static {
    let (tok, pair) = profile.layers.iter().fold((0.0, 0.0), |acc, l| {
        (
            acc.0 + l.f.c_tok_s + l.i.c_tok_s + l.w.c_tok_s,
            acc.1 + l.f.c_attn_s + l.i.c_attn_s + l.w.c_attn_s,
        )
    });
    move |t: u64, a: u64| tok * t as f64 + pair * a as f64
}

/// Splits a step's sequences into `dp` shares balanced by predicted cost (LPT; Graham 1969).
pub fn dp_shares(seqs: &[u32], dp: u32, cost: &dyn Fn(u64, u64) -> f64) -> Vec<Vec<u32>> {
    if dp <= 1 {
        return vec![seqs.to_vec()];
    }
    let mut order: Vec<u32> = seqs.to_vec();
    order.sort_by(|a, b| b.cmp(a));
    let mut load = vec![0.0f64; dp as usize];
    let mut out = vec![Vec::new(); dp as usize];
    for s in order {
        let (k, _) = load
            .iter()
            .enumerate()
            .min_by(|a, b| a.1.total_cmp(b.1).then(a.0.cmp(&b.0)))
            .expect("dp >= 1");
        load[k] += cost(s as u64, s as u64 * (s as u64 + 1) / 2);
        out[k].push(s);
    }
    out
}

/// What one simulated step cost.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct StepOutcome {
    /// Step time (sum of the rounds' makespans), seconds.
    pub step_time_s: f64,
    /// Busy time summed over ranks, seconds.
    pub busy_s: f64,
    /// True tokens of the step.
    pub true_tokens: u64,
    /// Tokens the kernels computed (padding included).
    pub computed_tokens: u64,
    /// Model FLOPs of the step from true tokens and true attention pairs.
    pub model_flops: f64,
    /// Peak activation memory over ranks and rounds, bytes.
    pub peak_activation_bytes: f64,
    /// Largest parameters + gradients + optimizer state of a rank, bytes.
    pub static_bytes: f64,
    /// Per pipeline rank: parameters, gradients and optimizer state plus the peak activation
    /// memory (largest over replicas and rounds), bytes.
    pub rank_memory_bytes: Vec<f64>,
    /// Microbatches of the step.
    pub microbatches: u32,
    /// Rounds of the schedule (1 unless a fixed capacity overflowed).
    pub rounds: u32,
    /// With forward-only work: the training schedule alone and the forward-only pass alone,
    /// seconds (the step time is the combined schedule's).
    pub fo: Option<(f64, f64)>,
    /// Under `flat-planned`: the step-time bound over every cut and order of the step's
    /// sequences (the slower replica's, [`crate::mb_plan::lower_bound_s`]), seconds.
    pub lower_bound_s: Option<f64>,
}

/// Generated schedules by (kind, p, v, m): steps of a Monte Carlo share their microbatch counts,
/// and interleaved 1F1B's deadlock-free group size search is worth doing once.
pub(crate) fn cached_schedule(kind: ScheduleKind, p: u32, v: u32, m: u32) -> Result<Arc<Schedule>> {
    type Cache = Mutex<HashMap<(ScheduleKind, u32, u32, u32), Arc<Schedule>>>;
    static CACHE: OnceLock<Cache> = OnceLock::new();
    let cache = CACHE.get_or_init(Default::default);
    let key = (kind, p, v, m);
    if let Some(s) = cache.lock().expect("schedule cache").get(&key) {
        return Ok(Arc::clone(s));
    }
    let s = Arc::new(kind.generate(p, v, m)?);
    let mut c = cache.lock().expect("schedule cache");
    if c.len() > 4096 {
        c.clear();
    }
    c.insert(key, Arc::clone(&s));
    Ok(s)
}

/// Simulates one step of `mbs` under `config` (one replica). Returns the outcome and the
/// schedule that ran with its simulation (several rounds drawn one after the other).
///
/// # Errors
/// Generation, cost or simulation errors.
pub fn simulate_step(
    profile: &Profile,
    config: &RunConfig,
    mbs: &[Microbatch],
) -> Result<(StepOutcome, Option<(Schedule, Simulation)>)> {
    simulate_replica(profile, config, mbs, 0)
}

/// [`simulate_step`] for replica `replica` (0-based; see [`crate::sharding::global_rank`]): the
/// replica's [`crate::step::plan_replica`] and its predicted outcome.
///
/// # Errors
/// Generation, cost or simulation errors.
pub fn simulate_replica(
    profile: &Profile,
    config: &RunConfig,
    mbs: &[Microbatch],
    replica: usize,
) -> Result<(StepOutcome, Option<(Schedule, Simulation)>)> {
    let plan = crate::step::plan_replica(config, Some(profile), mbs.to_vec(), replica)?;
    let outcome = plan
        .outcome(config, profile)
        .expect("a replica planned with a profile is predicted");
    Ok((outcome, plan.chart()))
}

/// The rounds of one step under a fixed capacity `k`, one after the other as they run (each
/// starts when the previous one has flushed): round `r`'s times shift by the makespans of the
/// rounds before it and its microbatch ids by `r·k` (ids `>= n` are the empty slots of the last
/// round). Makespan and busy times add up, lower bounds too (every round ends with a flush);
/// memory peaks are the largest round's.
pub fn concat_rounds(rounds: Vec<Simulation>, k: u32) -> Simulation {
    use crate::ir::{Action, ComputeAction, MicrobatchId};
    let mut it = rounds.into_iter();
    let Some(mut all) = it.next() else {
        unreachable!("concat_rounds of no rounds")
    };
    let p = all.timeline.num_ranks();
    let mut offset = all.timeline.makespan_ns();
    let mut lower_bound_s = all.metrics.lower_bound_s;
    for (r, sim) in it.enumerate() {
        let shift_mb = |a: ComputeAction| ComputeAction {
            microbatch: MicrobatchId(a.microbatch.0 + (r as u32 + 1) * k),
            ..a
        };
        for (rank, ops) in sim.timeline.compute.into_iter().enumerate() {
            all.timeline.compute[rank].extend(ops.into_iter().map(|mut o| {
                o.action = match o.action {
                    Action::Compute(a) => Action::Compute(shift_mb(a)),
                    Action::Overlap(f, b) => Action::Overlap(shift_mb(f), shift_mb(b)),
                };
                o.start_ns += offset;
                o.end_ns += offset;
                o
            }));
        }
        all.timeline
            .transfers
            .extend(sim.timeline.transfers.into_iter().map(|mut t| {
                t.microbatch = MicrobatchId(t.microbatch.0 + (r as u32 + 1) * k);
                t.start_ns += offset;
                t.end_ns += offset;
                t
            }));
        // Only the last round has the optimizer step.
        for (rank, o) in sim.timeline.optimizer.into_iter().enumerate() {
            if let Some((a, b)) = o {
                all.timeline.optimizer[rank] = Some((a + offset, b + offset));
            }
        }
        for (rank, events) in sim.memory.into_iter().enumerate() {
            all.memory[rank].extend(events.into_iter().map(|(t, l)| (t + offset, l)));
        }
        for (a, b) in all.metrics.ranks.iter_mut().zip(&sim.metrics.ranks) {
            a.busy_s += b.busy_s;
            let max = |x: Option<f64>, y: Option<f64>| match (x, y) {
                (Some(x), Some(y)) => Some(x.max(y)),
                (x, y) => x.or(y),
            };
            a.peak_activation_bytes = max(a.peak_activation_bytes, b.peak_activation_bytes);
            a.peak_activation_units = max(a.peak_activation_units, b.peak_activation_units);
            a.peak_inflight_microbatches = a
                .peak_inflight_microbatches
                .max(b.peak_inflight_microbatches);
        }
        lower_bound_s += sim.metrics.lower_bound_s;
        offset = all.timeline.makespan_ns();
    }
    let makespan_s = ns_to_s(offset);
    let m = &mut all.metrics;
    m.makespan_s = makespan_s;
    for r in &mut m.ranks {
        r.bubble_ratio = 1.0 - r.busy_s / makespan_s;
    }
    m.bubble_ratio = 1.0 - m.ranks.iter().map(|r| r.busy_s).sum::<f64>() / (p as f64 * makespan_s);
    m.lower_bound_s = lower_bound_s;
    m.gap_to_lower_bound = makespan_s / lower_bound_s - 1.0;
    all
}

/// Combines two replicas' outcomes of one step: the step ends with the slower replica; tokens,
/// FLOPs and busy time add up; memory is the larger.
pub(crate) fn merge_replicas(a: StepOutcome, b: StepOutcome) -> StepOutcome {
    StepOutcome {
        step_time_s: a.step_time_s.max(b.step_time_s),
        busy_s: a.busy_s + b.busy_s,
        true_tokens: a.true_tokens + b.true_tokens,
        computed_tokens: a.computed_tokens + b.computed_tokens,
        model_flops: a.model_flops + b.model_flops,
        peak_activation_bytes: a.peak_activation_bytes.max(b.peak_activation_bytes),
        static_bytes: a.static_bytes.max(b.static_bytes),
        rank_memory_bytes: a
            .rank_memory_bytes
            .iter()
            .zip(&b.rank_memory_bytes)
            .map(|(x, y)| x.max(*y))
            .collect(),
        microbatches: a.microbatches.max(b.microbatches),
        rounds: a.rounds.max(b.rounds),
        fo: match (a.fo, b.fo) {
            (Some(x), Some(y)) => Some((x.0.max(y.0), x.1.max(y.1))),
            (x, y) => x.or(y),
        },
        lower_bound_s: match (a.lower_bound_s, b.lower_bound_s) {
            (Some(x), Some(y)) => Some(x.max(y)),
            (x, y) => x.or(y),
        },
    }
}

/// Mean and nearest-rank percentiles.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Quantiles {
    /// Mean.
    pub mean: f64,
    /// Median (nearest rank).
    pub p50: f64,
    /// 90th percentile (nearest rank).
    pub p90: f64,
    /// 99th percentile (nearest rank).
    pub p99: f64,
}

impl Quantiles {
    /// Of `xs` (not empty).
    pub fn of(xs: &[f64]) -> Self {
        let mut v = xs.to_vec();
        v.sort_by(f64::total_cmp);
        let q = |p: f64| v[((p * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1];
        Quantiles {
            mean: v.iter().sum::<f64>() / v.len() as f64,
            p50: q(0.5),
            p90: q(0.9),
            p99: q(0.99),
        }
    }
}

/// The distribution of one configuration over the sampled steps.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Summary {
    /// Steps sampled.
    pub steps: u32,
    /// Step time, seconds.
    pub step_time_s: Quantiles,
    /// Mean over steps of `1 - busy / (ranks * step time)`.
    pub bubble_ratio_mean: f64,
    /// True tokens per second of the pipeline: Σ true tokens / Σ step time.
    pub tokens_per_s: f64,
    /// Fraction of computed tokens that are padding: `1 - Σ true / Σ computed`.
    pub padding_fraction: f64,
    /// Model FLOPs utilisation from true tokens and attention pairs:
    /// `Σ model FLOPs / (Σ step time * ranks * peak FLOP/s)`.
    pub mfu: f64,
    /// Largest peak activation memory of any rank in any step, bytes.
    pub peak_activation_bytes: f64,
    /// Largest parameters + gradients + optimizer state of a rank, bytes.
    pub static_bytes: f64,
    /// Largest per-rank total, parameters + gradients + optimizer state + peak activations of
    /// the same rank, over the steps, bytes (what must fit the rank's memory).
    pub peak_memory_bytes: f64,
    /// Mean microbatches per step.
    pub microbatches_mean: f64,
    /// Under `flat-planned`: the mean per-step lower bound over every cut and order of the
    /// step's sequences, seconds.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lower_bound_mean_s: Option<f64>,
    /// With forward-only work: mean time of the forward-only pass alone, seconds.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fo_separate_s: Option<f64>,
    /// With forward-only work: `(Σ T_train + Σ T_fo_separate - Σ T_combined) / Σ T_fo_separate`
    /// over the steps.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fo_hidden_fraction: Option<f64>,
}

/// Summarises `outcomes` of one configuration on `p` ranks in all (dp x pp) of `peak_flops`
/// FLOP/s each.
pub fn summarize(outcomes: &[StepOutcome], p: u32, peak_flops: f64) -> Summary {
    let n = outcomes.len().max(1) as f64;
    let times: Vec<f64> = outcomes.iter().map(|o| o.step_time_s).collect();
    let total_time: f64 = times.iter().sum();
    let true_tokens: u64 = outcomes.iter().map(|o| o.true_tokens).sum();
    let computed: u64 = outcomes.iter().map(|o| o.computed_tokens).sum();
    Summary {
        steps: outcomes.len() as u32,
        step_time_s: Quantiles::of(&times),
        bubble_ratio_mean: outcomes
            .iter()
            .map(|o| 1.0 - o.busy_s / (p as f64 * o.step_time_s))
            .sum::<f64>()
            / n,
        tokens_per_s: true_tokens as f64 / total_time,
        padding_fraction: if computed == 0 {
            0.0
        } else {
            1.0 - true_tokens as f64 / computed as f64
        },
        mfu: outcomes.iter().map(|o| o.model_flops).sum::<f64>()
            / (total_time * p as f64 * peak_flops),
        peak_activation_bytes: outcomes
            .iter()
            .map(|o| o.peak_activation_bytes)
            .fold(0.0, f64::max),
        static_bytes: outcomes.iter().map(|o| o.static_bytes).fold(0.0, f64::max),
        peak_memory_bytes: outcomes
            .iter()
            .flat_map(|o| o.rank_memory_bytes.iter().copied())
            .fold(0.0, f64::max),
        microbatches_mean: outcomes.iter().map(|o| o.microbatches as f64).sum::<f64>() / n,
        lower_bound_mean_s: outcomes
            .iter()
            .map(|o| o.lower_bound_s)
            .sum::<Option<f64>>()
            .map(|s| s / n),
        fo_separate_s: outcomes.iter().all(|o| o.fo.is_some()).then(|| {
            outcomes
                .iter()
                .filter_map(|o| o.fo)
                .map(|f| f.1)
                .sum::<f64>()
                / n
        }),
        fo_hidden_fraction: outcomes.iter().all(|o| o.fo.is_some()).then(|| {
            let (tr, fo, comb) = outcomes.iter().fold((0.0, 0.0, 0.0), |acc, o| {
                let (a, b) = o.fo.unwrap_or((0.0, 0.0));
                (acc.0 + a, acc.1 + b, acc.2 + o.step_time_s)
            });
            (tr + fo - comb) / fo
        }),
    }
}

/// [`run`] for a comparison: when zb-auto cannot be built under the memory limit on some
/// sampled step ([`Error::MemoryLimit`]) and other configurations remain, zb-auto's
/// configurations are dropped from `configs`, the others run, and the reason is returned
/// with the results (one unbuildable schedule never aborts a comparison).
///
/// # Errors
/// [`run`]'s; [`Error::MemoryLimit`] when zb-auto is the only schedule compared.
pub fn run_comparison(
    profile: &Profile,
    workload: &Workload,
    seed: u64,
    size: StepSize,
    steps: u32,
    configs: &mut Vec<RunConfig>,
    progress: &(dyn Fn() + Sync),
) -> Result<(MonteCarlo, Option<Error>)> {
    let is_zb_auto = |c: &RunConfig| c.source == ScheduleSource::Kind(ScheduleKind::ZbAuto);
    match run(profile, workload, seed, size, steps, configs, progress) {
        Err(err @ Error::MemoryLimit { .. })
            if configs.iter().any(is_zb_auto) && !configs.iter().all(is_zb_auto) =>
        {
            configs.retain(|c| !is_zb_auto(c));
            let mc = run(profile, workload, seed, size, steps, configs, progress)?;
            Ok((mc, Some(err)))
        }
        other => other.map(|mc| (mc, None)),
    }
}

/// Memory one (stage, microbatch) pair of one schedule costs a simulation: its F / I / W
/// actions, their transfers, the replay's state, the metrics and the Gantt chart's boxes,
/// bytes. Measured with `/usr/bin/time -f %M` on `flatpipe simulate --costs f=1,b=2 --schedule
/// 1f1b --pp 64 --microbatches 4096` (273.5 MB peak resident for 262,144 pairs: ~1,070 bytes
/// each) and rounded up.
pub const BYTES_PER_STAGE_MICROBATCH: f64 = 1_200.0;

/// Sequences drawn (from the step id `u64::MAX`, which no run samples) to estimate a
/// workload's mean and longest length for [`estimated_memory_bytes`].
pub const ESTIMATE_DRAWS: u32 = 4096;

/// A step's expected size under `size`, from [`ESTIMATE_DRAWS`] draws of `workload`:
/// (sequences, mean length in tokens, longest length drawn in tokens).
pub fn estimated_step(workload: &Workload, seed: u64, size: StepSize) -> (f64, f64, f64) {
    let draws = workload.sample_step(seed, u64::MAX, StepSize::Seqs(ESTIMATE_DRAWS));
    let mean = draws.iter().map(|&l| f64::from(l)).sum::<f64>() / draws.len().max(1) as f64;
    let longest = f64::from(draws.iter().copied().max().unwrap_or(1));
    let seqs = match size {
        StepSize::Seqs(n) => f64::from(n),
        StepSize::Tokens(t) => t as f64 / mean.max(1.0) + 1.0,
    };
    (seqs, mean, longest)
}

/// Memory [`run`] is expected to hold, bytes, so that a request too large for the machine is
/// refused before anything is allocated:
///
/// - the outcomes it keeps, twice (the per-step rows and the per-combo columns exist together
///   for a moment): `steps x configurations` [`StepOutcome`]s with one `f64` per rank;
/// - step 0's schedule and simulation of every configuration (kept for the charts);
/// - on each of rayon's worker threads, one step in flight: its sequence lengths (once, and once per
///   (policy, dp) cut) and the largest configuration's schedule.
///
/// A schedule costs [`BYTES_PER_STAGE_MICROBATCH`] per (stage, microbatch) pair. A step's size
/// and microbatch count are estimated from [`ESTIMATE_DRAWS`] draws of the workload: its
/// sequences (given, or the token target over the mean length), its tokens over the token
/// budget (flat and packed policies), its sequences over the rows of the longest draw that fit
/// the budget (padded), or the given microbatch count.
///
/// An upper bound, not a prediction: against the peak resident set of `flatpipe simulate
/// --gantt none` (default llama3.1-8b on 4 H200, 9 schedules) it was 1.0x (20,000 steps: 0.13
/// GiB vs 0.13 GiB), 3.5x (one step of 200,000 sequences: 1.31 vs 0.37 GiB) and 2.8x (4 padded
/// steps of 20,000 sequences: 1.52 vs 0.54 GiB).
pub fn estimated_memory_bytes(
    workload: &Workload,
    seed: u64,
    size: StepSize,
    steps: u32,
    configs: &[RunConfig],
) -> f64 {
    let (seqs, mean, longest) = estimated_step(workload, seed, size);
    let microbatches = |c: &RunConfig| {
        let budget = c.params.token_budget.max(1) as f64;
        match c.params.microbatches {
            Some(m) => f64::from(m),
            None if c.policy == Policy::Padded => {
                (seqs / (budget / longest).floor().max(1.0)).ceil()
            }
            None => (seqs * mean / budget).ceil() + 1.0,
        }
    };
    let pairs = |c: &RunConfig| f64::from(c.pp) * f64::from(c.v.max(1)) * microbatches(c);
    let ranks = configs.iter().map(|c| c.pp as usize).max().unwrap_or(1);
    let outcome =
        (std::mem::size_of::<(StepOutcome, Option<(Schedule, Simulation)>)>() + 8 * ranks) as f64;
    let kept = 2.0 * f64::from(steps) * configs.len() as f64 * outcome;
    let first: f64 = configs.iter().map(pairs).sum::<f64>() * BYTES_PER_STAGE_MICROBATCH;
    let mut cuts: Vec<crate::step::CutKey> = Vec::new();
    for c in configs {
        let key = c.cut_key();
        if !cuts.contains(&key) {
            cuts.push(key);
        }
    }
    let in_flight = seqs * 4.0 * (1.0 + cuts.len() as f64)
        + configs.iter().map(pairs).fold(0.0, f64::max) * BYTES_PER_STAGE_MICROBATCH;
    kept + first + rayon::current_num_threads().max(1) as f64 * in_flight
}

/// What a Monte Carlo run produced.
#[derive(Debug, Clone)]
pub struct MonteCarlo {
    /// `outcomes[c][i]`: configuration `c` on step `i`.
    pub outcomes: Vec<Vec<StepOutcome>>,
    /// For each configuration, step 0's schedule and simulation of replica 0 (several rounds
    /// drawn one after the other).
    pub first: Vec<Option<(Schedule, Simulation)>>,
    /// Sequences longer than the token budget, over all steps (each counted once, whatever the
    /// number of flat policies and data-parallel degrees compared).
    pub oversize_sequences: usize,
    /// Tokens cut by the padded policy's `max_seq_len`, over all steps.
    pub truncated_tokens: u64,
    /// The steps' sequence counts.
    pub sequences_per_step: Vec<usize>,
}

/// Samples `steps` steps of `workload` (step `i` from `(seed, i)`), cuts each for every
/// distinct (dp, policy, policy parameters) of the configurations ([`crate::step::cut_step`]),
/// plans every configuration on every step ([`crate::step::plan_step`]) and keeps its
/// predicted outcome, in parallel (rayon). `progress` is called once per finished step. Results
/// are independent of the thread count.
///
/// # Errors
/// The first batching, generation or simulation error.
pub fn run(
    profile: &Profile,
    workload: &Workload,
    seed: u64,
    size: StepSize,
    steps: u32,
    configs: &[RunConfig],
    progress: &(dyn Fn() + Sync),
) -> Result<MonteCarlo> {
    let cost = balance_cost(profile);
    type StepResult = (
        Vec<(StepOutcome, Option<(Schedule, Simulation)>)>,
        usize,
        u64,
        usize,
    );
    let per_step: Vec<StepResult> = (0..steps)
        .into_par_iter()
        .map(|i| -> Result<StepResult> {
            let seqs = workload.sample_step(seed, i as u64, size);
            // (dp, policy, parameters) -> each replica's microbatches, cut once per step.
            let mut cuts: Vec<(crate::step::CutKey, Vec<Batched>)> = Vec::new();
            for c in configs {
                let key = c.cut_key();
                if !cuts.iter().any(|(k, _)| *k == key) {
                    cuts.push((key, crate::step::cut_step(c, &seqs, &cost)?));
                }
            }
            // Every cut sees the same sequences: count them once, as the most any one cut
            // flagged (the replicas of one cut partition the step).
            let oversize = cuts
                .iter()
                .map(|(_, b)| b.iter().map(|r| r.oversize.len()).sum::<usize>())
                .max()
                .unwrap_or(0);
            let truncated = cuts
                .iter()
                .map(|(_, b)| b.iter().map(|r| r.truncated_tokens).sum::<u64>())
                .max()
                .unwrap_or(0);
            let mut row = Vec::with_capacity(configs.len());
            for c in configs {
                let key = c.cut_key();
                let cut = &cuts
                    .iter()
                    .find(|(k, _)| *k == key)
                    .expect("every configuration's cut is made")
                    .1;
                let plan = crate::step::plan_step(c, Some(profile), i as u64, cut)?;
                let o = plan
                    .outcome(c, profile)
                    .expect("a step planned with a profile is predicted");
                let chart = if i == 0 {
                    plan.replicas.first().and_then(|r| r.chart())
                } else {
                    None
                };
                row.push((o, chart));
            }
            progress();
            Ok((row, oversize, truncated, seqs.len()))
        })
        .collect::<Result<_>>()?;
    let mut mc = MonteCarlo {
        outcomes: vec![Vec::with_capacity(steps as usize); configs.len()],
        first: vec![None; configs.len()],
        oversize_sequences: 0,
        truncated_tokens: 0,
        sequences_per_step: Vec::with_capacity(steps as usize),
    };
    for (row, oversize, truncated, n) in per_step {
        mc.oversize_sequences += oversize;
        mc.truncated_tokens += truncated;
        mc.sequences_per_step.push(n);
        for (c, (o, sim)) in row.into_iter().enumerate() {
            mc.outcomes[c].push(o);
            if sim.is_some() {
                mc.first[c] = sim;
            }
        }
    }
    Ok(mc)
}

/// One step's screen ([`screen_base`], then [`ScreenBase::finish`]): the heaviest replica's
/// predicted step time and memory.
#[derive(Debug, Clone, PartialEq)]
pub struct Screened {
    /// The replica's step time with the data-parallel collectives, seconds: at most the
    /// step's (the slowest replica's).
    pub step_time_s: f64,
    /// Its per-rank memory (state plus peak activations), bytes: at most the step's.
    pub rank_memory_bytes: Vec<f64>,
}

/// What a screen measured of one step before the data-parallel state and collectives are
/// applied ([`ScreenBase::finish`]): the same for every sharding mode that adds no
/// per-microbatch collective (ddp, zero1, and fsdp / hsdp under PP), so the planner screens a
/// layout once for all of them.
#[derive(Debug, Clone, PartialEq)]
pub struct ScreenBase {
    /// The replica's rounds, optimizer included, seconds.
    pub pipeline_s: f64,
    /// Per pipeline rank: last compute end, first compute start, optimizer time, seconds
    /// ([`crate::step::StepPlan::rank_times`]).
    pub rank_times: (Vec<f64>, Vec<f64>, Vec<f64>),
    /// Per pipeline rank: its memory less its parameters, gradients and optimizer state (peak
    /// activations, and a frozen model's weights), bytes.
    pub activation_bytes: Vec<f64>,
}

impl ScreenBase {
    /// The screen of `config` (whose sharding may differ from the one screened, as long as
    /// neither adds per-microbatch collectives): the state bytes of `config.sharding` plus the
    /// screened activations, and the step time with its collectives.
    ///
    /// # Errors
    /// As [`TableCosts::with_options`] (the stages against the profile).
    pub fn finish(&self, config: &RunConfig, profile: &Profile) -> Result<Screened> {
        let placement = config.placement()?;
        let costs = TableCosts::with_options(
            profile,
            &config.stages,
            &placement,
            &[],
            &[],
            &crate::costs::CostOptions {
                recompute: &config.recompute,
                sharding: config.sharding,
                dp: config.dp,
                state_bytes: config.state_bytes,
                ..Default::default()
            },
        )?;
        let step_time_s = if config.dp > 1 {
            let params = crate::step::rank_params(config, profile, &placement);
            let (end, start, opt) = &self.rank_times;
            crate::step::collectives_tail(
                config,
                profile,
                &params,
                self.pipeline_s,
                (end, start, opt),
            )
        } else {
            self.pipeline_s
        };
        Ok(Screened {
            step_time_s,
            rank_memory_bytes: self
                .activation_bytes
                .iter()
                .enumerate()
                .map(|(r, a)| a + costs.static_bytes(Rank(r as u32)))
                .collect(),
        })
    }
}

/// A lower bound on each sampled step of `config`, from one replica per step: the one with the
/// most predicted work ([`balance_cost`]), planned and predicted as [`run`] would, alone, before
/// the state and collectives of the sharding ([`ScreenBase::finish`] applies them). A step's time
/// is its slowest replica's and its memory the largest, so each screened figure is at most the
/// full one, and a screened memory over a limit is an exact rejection. Costs one replica instead
/// of `dp` per step: what the planner evaluates first.
///
/// # Errors
/// As [`run`].
pub fn screen_base(
    profile: &Profile,
    workload: &Workload,
    seed: u64,
    size: StepSize,
    steps: u32,
    config: &RunConfig,
) -> Result<Vec<ScreenBase>> {
    let cost = balance_cost(profile);
    (0..steps)
        .into_par_iter()
        .map(|i| -> Result<ScreenBase> {
            let seqs = workload.sample_step(seed, i as u64, size);
            let cut = crate::step::cut_step(config, &seqs, &cost)?;
            let work = |b: &Batched| -> f64 {
                b.microbatches
                    .iter()
                    .map(|m| cost(m.computed_tokens(), m.computed_attn_pairs()))
                    .sum()
            };
            let (d, heaviest) = cut
                .iter()
                .enumerate()
                .max_by(|a, b| work(a.1).total_cmp(&work(b.1)).then(b.0.cmp(&a.0)))
                .expect("cut_step gives every replica a share");
            let replica =
                crate::step::plan_replica(config, Some(profile), heaviest.microbatches.clone(), d)?;
            let o = replica
                .outcome(config, profile)
                .expect("a replica planned with a profile is predicted");
            let plan = crate::step::StepPlan {
                step: i as u64,
                replicas: vec![replica],
            };
            let rank_times = plan.rank_times().expect("predicted");
            let statics = plan.replicas[0].rounds[0]
                .prediction
                .as_ref()
                .expect("predicted")
                .static_bytes
                .clone();
            Ok(ScreenBase {
                pipeline_s: o.step_time_s,
                rank_times,
                activation_bytes: o
                    .rank_memory_bytes
                    .iter()
                    .zip(&statics)
                    .map(|(m, s)| m - s)
                    .collect(),
            })
        })
        .collect()
}
