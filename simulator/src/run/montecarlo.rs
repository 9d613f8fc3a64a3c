//! Monte Carlo over sampled steps: each step's sequences, microbatches and schedule, simulated
//! in parallel, summarised as a step-time distribution.
//!
//! Schedule capacity (`--capacity`):
//! - `dynamic` (default): each step's schedule is built for that step's microbatch count
//!   (design point 3 in docs/design.md).
//! - `K` (the torchtitan-style baseline): the schedule is built once for K microbatches. A
//!   step with n microbatches runs `ceil(n / K)` rounds of that schedule one after the other,
//!   each ending with a pipeline flush (the next round starts when the previous one has
//!   finished on every rank); the first rounds carry microbatches `0..K`, `K..2K`, ..., the last
//!   round the rest (possibly one). Slots a round has no microbatch for are **empty
//!   microbatches**: zero tokens, so each of their actions still costs its fixed `c0` (kernel
//!   launches) and nothing else, and they hold no activations. Only the last round ends with
//!   the optimizer step. The step time is the sum of the rounds' makespans.

use crate::batching::microbatch::Microbatch;
use crate::batching::policy::{Batched, Policy};
use crate::costs::{CostModel, TableCosts};
use crate::ir::{Rank, Schedule};
use crate::run::config::{RunConfig, ScheduleSource, balance_cost};
use crate::run::step::StepOutcome;
use crate::schedules::generators::ScheduleKind;
use crate::{Error, Result, Simulation};
use flatpipe_profiles::{Profile, StepSize, Workload};
use rayon::prelude::*;
use serde::Serialize;

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

/// [`simulate_step`] for replica `replica` (0-based; see [`crate::costs::sharding::global_rank`]): the
/// replica's [`crate::run::step::plan_replica`] and its predicted outcome.
///
/// # Errors
/// Generation, cost or simulation errors.
pub fn simulate_replica(
    profile: &Profile,
    config: &RunConfig,
    mbs: &[Microbatch],
    replica: usize,
) -> Result<(StepOutcome, Option<(Schedule, Simulation)>)> {
    let plan = crate::run::step::plan_replica(config, Some(profile), mbs.to_vec(), replica)?;
    let outcome = plan
        .outcome(config, profile)
        .expect("a replica planned with a profile is predicted");
    Ok((outcome, plan.chart()))
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
    /// With expert parallelism: the mean over steps of the all-to-all time of the rank that
    /// exposes the most (in all, and exposed; [`crate::AllToAllTime`]), seconds.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub all_to_all_mean: Option<crate::AllToAllTime>,
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
        all_to_all_mean: outcomes.iter().any(|o| o.all_to_all.is_some()).then(|| {
            let (t, e) = outcomes
                .iter()
                .filter_map(|o| o.all_to_all)
                .fold((0.0, 0.0), |acc, x| {
                    (acc.0 + x.total_s, acc.1 + x.exposed_s)
                });
            crate::AllToAllTime {
                total_s: t / n,
                exposed_s: e / n,
            }
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
    // Forward-only microbatches are (stage, microbatch) pairs too: `--fo-microbatches K`, or
    // one per training microbatch.
    let fo = |c: &RunConfig| match &c.forward_only {
        Some(f) => f.microbatches.map_or_else(|| microbatches(c), f64::from),
        None => 0.0,
    };
    let pairs = |c: &RunConfig| f64::from(c.pp) * f64::from(c.v.max(1)) * (microbatches(c) + fo(c));
    let ranks = configs.iter().map(|c| c.pp as usize).max().unwrap_or(1);
    let outcome =
        (std::mem::size_of::<(StepOutcome, Option<(Schedule, Simulation)>)>() + 8 * ranks) as f64;
    let kept = 2.0 * f64::from(steps) * configs.len() as f64 * outcome;
    let first: f64 = configs.iter().map(pairs).sum::<f64>() * BYTES_PER_STAGE_MICROBATCH;
    let mut cuts: Vec<crate::run::config::CutKey> = Vec::new();
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
/// distinct (dp, policy, policy parameters) of the configurations ([`crate::run::step::cut_step`]),
/// plans every configuration on every step ([`crate::run::step::plan_step`]) and keeps its
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
            let mut cuts: Vec<(crate::run::config::CutKey, Vec<Batched>)> = Vec::new();
            for c in configs {
                let key = c.cut_key();
                if !cuts.iter().any(|(k, _)| *k == key) {
                    cuts.push((key, crate::run::step::cut_step(c, &seqs, &cost)?));
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
                let plan = crate::run::step::plan_step(c, Some(profile), i as u64, cut)?;
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
    /// ([`crate::run::step::StepPlan::rank_times`]).
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
            let params = crate::run::step::rank_params(config, profile, &placement);
            let (end, start, opt) = &self.rank_times;
            crate::run::step::collectives_tail(
                config,
                profile,
                &params,
                self.pipeline_s,
                (end, start, opt),
                false,
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
            let cut = crate::run::step::cut_step(config, &seqs, &cost)?;
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
            let replica = crate::run::step::plan_replica(
                config,
                Some(profile),
                heaviest.microbatches.clone(),
                d,
            )?;
            let o = replica
                .outcome(config, profile)
                .expect("a replica planned with a profile is predicted");
            let plan = crate::run::step::StepPlan {
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
