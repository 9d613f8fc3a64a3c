//! Runs that drift, simulated step by step: plans fixed before the run against plans made
//! before every step from what the run has measured so far.
//!
//! A step's truth is its sequence lengths and how many times slower than the profile each
//! pipeline rank of each replica computes ([`PhaseScale`] per `(replica, rank)`). A plan is
//! made for what the planner *believes* ([`simulate_step`]): the data-parallel shares balanced
//! for the believed replica speeds ([`crate::run::config::dp_shares_for_speeds`]), each
//! replica's microbatches and schedule planned on its believed profile
//! ([`crate::run::estimate::profile_for_ranks`]); the plan then runs at the true speeds (its
//! replay on the true profile). Believing the profile's speeds is the fixed plan; believing
//! [`SpeedEstimate`]'s factors after the last step is re-planning; believing the truth is the
//! oracle: the same planner told the true speeds, what re-planning aims at (not a bound: the
//! planner's heuristics can do worse on the truth than on a belief, by noise).
//!
//! Two drifts: GPUs that slow down ([`Stragglers`], [`straggler_run`]) and lengths that grow
//! ([`grown`], [`budget_run`]: every token budget of a grid on every step, so that a budget
//! re-chosen per step can be set against the best one fixed for the whole run).

use crate::batching::policy::Batched;
use crate::replay::timeline::Timeline;
use crate::run::config::{RunConfig, balance_cost, default_memory_limit};
use crate::run::estimate::{SpeedEstimate, profile_for_ranks};
use crate::run::step::{ReplicaPlan, StepPlan, cut_step_for_speeds, plan_share};
use crate::{Error, Result};
use flatpipe_profiles::{PhaseScale, Profile};
use rand::{RngExt, SeedableRng, rngs::ChaCha8Rng};
use rayon::prelude::*;
use std::time::Instant;

/// One step as simulated: what it cost at the true speeds and what its plan expected.
#[derive(Debug, Clone)]
pub struct DriftStep {
    /// The step time at the true speeds: the slowest replica's rounds (optimizer included)
    /// with the data-parallel collectives of the config's sharding, seconds.
    pub step_time_s: f64,
    /// The step time the plan predicted (the slowest replica, at the believed speeds, without
    /// the collectives), seconds.
    pub predicted_s: f64,
    /// The most memory any rank holds (its state and peak activations), bytes.
    pub peak_memory_bytes: f64,
    /// Per replica, its plan's timeline at the profile's speeds and at the true speeds: what
    /// a [`SpeedEstimate`] observes.
    pub observed: Vec<(Timeline, Timeline)>,
    /// Wall time of planning the step on this machine (the cut, every replica's microbatches
    /// and schedule), seconds.
    pub planning_s: f64,
}

/// A replica's pace for the data-parallel shares: its slowest rank's mean of the F, I and W
/// factors (in a pipeline the slowest stage sets the pace of every microbatch).
fn replica_speed(ranks: &[PhaseScale]) -> f64 {
    ranks
        .iter()
        .map(|s| (s.f + s.i + s.w) / 3.0)
        .fold(f64::MIN_POSITIVE, f64::max)
}

/// One replica's profile when its ranks go at `ranks` ([`profile_for_ranks`]): the optimizer
/// at the slowest rank's optimizer factor (the step ends with the last rank's optimizer).
fn ranks_profile(base: &Profile, config: &RunConfig, ranks: &[PhaseScale]) -> Result<Profile> {
    let slowest = ranks.iter().map(|s| s.optimizer).fold(1.0, f64::max);
    profile_for_ranks(base, config, ranks, slowest)
}

/// `r`'s rounds replayed under `profile` (the schedules kept, only the costs change).
fn replayed(r: &ReplicaPlan, config: &RunConfig, profile: &Profile) -> Result<ReplicaPlan> {
    let plan = StepPlan {
        step: 0,
        replicas: vec![r.clone()],
    }
    .replayed_on(config, profile)?;
    Ok(plan
        .replicas
        .into_iter()
        .next()
        .expect("one replica in, one out"))
}

/// Plans step `step` of `config` on `seqs` for the believed speeds `belief` and runs it at
/// the true speeds `truth` (both one [`PhaseScale`] per `(replica, rank)`, at `d * pp + r`,
/// against `base`): module doc. Replicas are planned in parallel.
///
/// # Errors
/// [`Error::InvalidArgument`] for speed lists that are not `dp * pp` long; the cut's,
/// planning's and replay's errors.
pub fn simulate_step(
    config: &RunConfig,
    base: &Profile,
    step: u64,
    seqs: &[u32],
    belief: &[PhaseScale],
    truth: &[PhaseScale],
) -> Result<DriftStep> {
    let (pp, dp) = (config.pp as usize, config.dp.max(1) as usize);
    for (what, v) in [("believed speeds", belief), ("true speeds", truth)] {
        if v.len() != pp * dp {
            return Err(Error::invalid(
                what,
                v.len(),
                format!("one per replica and pipeline rank ({dp} x {pp})"),
            ));
        }
    }
    let started = Instant::now();
    let speeds: Vec<f64> = belief.chunks(pp).map(replica_speed).collect();
    let cut = cut_step_for_speeds(config, seqs, &balance_cost(base), Some(&speeds))?;
    let planned: Vec<(ReplicaPlan, f64)> = cut
        .par_iter()
        .enumerate()
        .map(|(d, share): (usize, &Batched)| {
            let believed = ranks_profile(base, config, &belief[d * pp..(d + 1) * pp])?;
            let r = plan_share(config, Some(&believed), share, d)?;
            let predicted = r.outcome(config, &believed).map_or(0.0, |o| o.step_time_s);
            Ok((r, predicted))
        })
        .collect::<Result<_>>()?;
    let planning_s = started.elapsed().as_secs_f64();
    let ran: Vec<(ReplicaPlan, Timeline, f64)> = planned
        .par_iter()
        .enumerate()
        .map(|(d, (r, _))| {
            let true_profile = ranks_profile(base, config, &truth[d * pp..(d + 1) * pp])?;
            let on_base = replayed(r, config, base)?;
            let on_truth = replayed(r, config, &true_profile)?;
            let timeline = |x: &ReplicaPlan| x.chart().map(|(_, s)| s.timeline);
            let memory = on_truth.outcome(config, base).map_or(0.0, |o| {
                o.rank_memory_bytes.iter().copied().fold(0.0, f64::max)
            });
            Ok((on_truth, timeline(&on_base).unwrap_or_default(), memory))
        })
        .collect::<Result<_>>()?;
    let mut pipeline_s = 0.0f64;
    let mut observed = Vec::with_capacity(dp);
    let mut peak = 0.0f64;
    for (r, on_base, memory) in &ran {
        pipeline_s = pipeline_s.max(r.outcome(config, base).map_or(0.0, |o| o.step_time_s));
        let measured = r.chart().map(|(_, s)| s.timeline).unwrap_or_default();
        observed.push((on_base.clone(), measured));
        peak = peak.max(*memory);
    }
    let plan = StepPlan {
        step,
        replicas: ran.into_iter().map(|(r, _, _)| r).collect(),
    };
    let step_time_s = if config.grad_replicas() > 1 {
        plan.step_time_with_collectives(config, base, pipeline_s)
            .unwrap_or(pipeline_s)
    } else {
        pipeline_s
    };
    Ok(DriftStep {
        step_time_s,
        predicted_s: planned.iter().map(|x| x.1).fold(0.0, f64::max),
        peak_memory_bytes: peak,
        observed,
        planning_s,
    })
}

/// Stragglers drawn per GPU and step: every GPU has a steady speed of its own, and now and
/// then a fail-slow multiplies its time for a while. A pipeline rank of `gpus_per_rank` GPUs
/// (its tensor- and context-parallel group, whose collectives wait for the slowest) computes
/// at its slowest GPU's pace.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Stragglers {
    /// GPUs per pipeline rank, >= 1.
    pub gpus_per_rank: u32,
    /// Each GPU's steady time is `1 + U(0, spread)` times the profile's.
    pub spread: f64,
    /// Per GPU and step, the probability that a fail-slow starts, in [0, 1].
    pub onset: f64,
    /// Mean length of a fail-slow, steps (geometric), >= 1.
    pub mean_steps: f64,
    /// A fail-slow multiplies the GPU's time by `U(lo, hi)`, 1 <= lo <= hi.
    pub factor: (f64, f64),
}

impl Stragglers {
    /// The cited model, with `gpus_per_rank` GPUs per rank. Steady spread 8%: Sinha et al.,
    /// "Not All GPUs Are Created Equal" (SC '22, arXiv 2208.11035), measured an 8% average
    /// performance variation among GPUs of the same SKU in five clusters. A fail-slow takes a
    /// GPU to 1.1-1.5x its time: their outliers ran up to 1.5x slower than the median GPU.
    /// Fail-slows last from tens of seconds to about ten hours (Wu et al., "Falcon", arXiv
    /// 2410.12588, ATC '25 as Greyhound): a mean of 30 steps. The onset, 1e-4 per GPU and
    /// step (about three GPUs of 1,024 slowed at a time), is an assumption: neither paper
    /// gives a per-GPU rate.
    pub fn cited(gpus_per_rank: u32) -> Self {
        Stragglers {
            gpus_per_rank,
            spread: 0.08,
            onset: 1e-4,
            mean_steps: 30.0,
            factor: (1.1, 1.5),
        }
    }

    /// Refuses parameters outside their ranges, naming the field.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`].
    pub fn validate(&self) -> Result<()> {
        let bad = |field: &str, v: f64, allowed: &str| Err(Error::invalid(field, v, allowed));
        if self.gpus_per_rank == 0 {
            return bad("stragglers.gpus_per_rank", 0.0, ">= 1");
        }
        if !(self.spread >= 0.0 && self.spread.is_finite()) {
            return bad("stragglers.spread", self.spread, ">= 0");
        }
        if !(0.0..=1.0).contains(&self.onset) {
            return bad("stragglers.onset", self.onset, "a probability in [0, 1]");
        }
        if !(self.mean_steps >= 1.0 && self.mean_steps.is_finite()) {
            return bad("stragglers.mean_steps", self.mean_steps, ">= 1 step");
        }
        let (lo, hi) = self.factor;
        if !(lo >= 1.0 && hi >= lo && hi.is_finite()) {
            return Err(Error::invalid(
                "stragglers.factor",
                format!("{lo}:{hi}"),
                "LO:HI with 1 <= LO <= HI, finite",
            ));
        }
        Ok(())
    }

    /// Per step, each of `ranks` pipeline ranks' time factor (its slowest GPU's), for `steps`
    /// steps, drawn from `seed`: `out[step][rank]`.
    ///
    /// # Errors
    /// [`Stragglers::validate`]'s.
    pub fn draw(&self, ranks: usize, steps: usize, seed: u64) -> Result<Vec<Vec<f64>>> {
        self.validate()?;
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let gpus = ranks * self.gpus_per_rank as usize;
        let steady: Vec<f64> = (0..gpus)
            .map(|_| 1.0 + self.spread * rng.random::<f64>())
            .collect();
        // Per GPU: the slow factor and the steps it has left.
        let mut slow = vec![(1.0f64, 0u64); gpus];
        let end = 1.0 / self.mean_steps;
        let mut out = Vec::with_capacity(steps);
        for _ in 0..steps {
            for s in slow.iter_mut() {
                if s.1 == 0 && rng.random::<f64>() < self.onset {
                    let (lo, hi) = self.factor;
                    // Geometric on 1, 2, ... with mean 1 / end, by inversion: ceil(ln U /
                    // ln(1 - end)) for U in (0, 1] (a saturating cast for U near 0).
                    let u = 1.0 - rng.random::<f64>();
                    let len = if end >= 1.0 {
                        1
                    } else {
                        (u.ln() / (1.0 - end).ln()).ceil().max(1.0) as u64
                    };
                    *s = (lo + (hi - lo) * rng.random::<f64>(), len);
                }
            }
            let gpu = |g: usize| steady[g] * if slow[g].1 > 0 { slow[g].0 } else { 1.0 };
            let per_rank = self.gpus_per_rank as usize;
            out.push(
                (0..ranks)
                    .map(|r| {
                        (r * per_rank..(r + 1) * per_rank)
                            .map(gpu)
                            .fold(1.0, f64::max)
                    })
                    .collect(),
            );
            for s in slow.iter_mut() {
                s.1 = s.1.saturating_sub(1);
            }
        }
        Ok(out)
    }
}

/// A factor applied to every phase (the optimizer's too).
pub fn uniform_scale(x: f64) -> PhaseScale {
    PhaseScale {
        f: x,
        i: x,
        w: x,
        b: x,
        optimizer: x,
    }
}

/// The per-step step times of a run whose ranks slow down, four ways.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StragglerArms {
    /// Nobody slow: the plan at the profile's speeds, run at them, seconds per step.
    pub ideal: Vec<f64>,
    /// The plan at the profile's speeds, run at the true ones.
    pub fixed: Vec<f64>,
    /// Each step planned from the estimate after the last ([`SpeedEstimate`], one per
    /// replica), run at the true speeds.
    pub replanned: Vec<f64>,
    /// Each step planned knowing its true speeds.
    pub oracle: Vec<f64>,
    /// The re-planned arm's planning wall time per step on this machine, seconds.
    pub planning_s: Vec<f64>,
}

/// Runs `steps` (each its sequences and its per `(replica, rank)` time factors, at
/// `d * pp + r`) four ways ([`StragglerArms`]); the estimate forgets with `forgetting`.
/// `tick` is called after each step (progress).
///
/// # Errors
/// [`SpeedEstimate::new`]'s and [`simulate_step`]'s.
pub fn straggler_run(
    config: &RunConfig,
    base: &Profile,
    steps: &[(Vec<u32>, Vec<f64>)],
    forgetting: f64,
    tick: &dyn Fn(),
) -> Result<StragglerArms> {
    let (pp, dp) = (config.pp as usize, config.dp.max(1) as usize);
    let nominal = vec![PhaseScale::default(); pp * dp];
    let mut estimates = vec![SpeedEstimate::new(forgetting)?; dp];
    let mut out = StragglerArms::default();
    for (t, (seqs, factors)) in steps.iter().enumerate() {
        let truth: Vec<PhaseScale> = factors.iter().map(|&x| uniform_scale(x)).collect();
        let step = t as u64;
        out.ideal
            .push(simulate_step(config, base, step, seqs, &nominal, &nominal)?.step_time_s);
        out.fixed
            .push(simulate_step(config, base, step, seqs, &nominal, &truth)?.step_time_s);
        out.oracle
            .push(simulate_step(config, base, step, seqs, &truth, &truth)?.step_time_s);
        let belief: Vec<PhaseScale> = estimates
            .iter()
            .flat_map(|e| (0..pp).map(|r| e.rank_phase_scale(r)))
            .collect();
        let ran = simulate_step(config, base, step, seqs, &belief, &truth)?;
        for (e, (on_base, measured)) in estimates.iter_mut().zip(&ran.observed) {
            e.observe(on_base, measured, pp);
        }
        out.replanned.push(ran.step_time_s);
        out.planning_s.push(ran.planning_s);
        tick();
    }
    Ok(out)
}

/// `seqs` with every length times `factor` (rounded, at least one token).
pub fn grown(seqs: &[u32], factor: f64) -> Vec<u32> {
    seqs.iter()
        .map(|&s| ((f64::from(s) * factor).round() as u32).max(1))
        .collect()
}

/// One token budget over a run: each step's time and whether it fit the memory limit.
#[derive(Debug, Clone, PartialEq)]
pub struct BudgetArm {
    /// The token budget, tokens per microbatch.
    pub budget: u64,
    /// Per step, its time (seconds; NaN where zb-auto found no schedule under the limit) and
    /// whether its peak memory fit the limit.
    pub steps: Vec<(f64, bool)>,
}

impl BudgetArm {
    /// Steps over the memory limit.
    pub fn over_memory(&self) -> usize {
        self.steps.iter().filter(|s| !s.1).count()
    }

    /// Mean step time, seconds (NaN when a step has no schedule under the limit).
    pub fn mean_s(&self) -> f64 {
        self.steps.iter().map(|s| s.0).sum::<f64>() / self.steps.len().max(1) as f64
    }
}

/// Every budget over the run, and the budget re-chosen per step ([`budget_run`]).
#[derive(Debug, Clone, PartialEq)]
pub struct BudgetRun {
    /// Each budget held for the whole run.
    pub arms: Vec<BudgetArm>,
    /// Per step, the re-planned budget: the fastest that fits (`None`: none fits).
    pub chosen: Vec<Option<u64>>,
    /// Per step, the wall time of choosing it on this machine, seconds.
    pub planning_s: Vec<f64>,
}

/// A run of `steps` (each step's sequences) under every budget of `budgets` (everything
/// else as `config`; its chunk length at most the budget), at the profile's speeds, and the re-planned run: per step the budget
/// whose plan is the fastest under the memory limit (config's, else the hardware's less its
/// reserve), `None` for a step no budget fits; the time of choosing a step's budget is its
/// planning and prediction under every budget. `tick` is called after each step (progress).
///
/// # Errors
/// [`Error::InvalidArgument`] for no budgets or a zero budget; [`simulate_step`]'s.
pub fn budget_run(
    config: &RunConfig,
    base: &Profile,
    steps: &[Vec<u32>],
    budgets: &[u64],
    tick: &dyn Fn(),
) -> Result<BudgetRun> {
    if budgets.is_empty() || budgets.contains(&0) {
        return Err(Error::invalid(
            "token budgets",
            format!("{budgets:?}"),
            "one or more budgets >= 1 token",
        ));
    }
    let limit = config
        .memory_limit_bytes
        .unwrap_or_else(|| default_memory_limit(base));
    let n = (config.pp * config.dp.max(1)) as usize;
    let nominal = vec![PhaseScale::default(); n];
    let mut arms: Vec<BudgetArm> = budgets
        .iter()
        .map(|&budget| BudgetArm {
            budget,
            steps: Vec::with_capacity(steps.len()),
        })
        .collect();
    let mut chosen = Vec::with_capacity(steps.len());
    let mut planning = Vec::with_capacity(steps.len());
    for (t, seqs) in steps.iter().enumerate() {
        let mut planning_s = 0.0;
        let mut best: Option<(f64, u64)> = None;
        for arm in arms.iter_mut() {
            let mut c = config.clone();
            c.params.token_budget = arm.budget;
            c.params.microbatches = None;
            c.params.chunk_tokens = config.params.chunk_tokens.map(|x| x.min(arm.budget));
            let started = Instant::now();
            // zb-auto refusing the limit is a budget that does not fit, not a failed run.
            let (time_s, fits) = match simulate_step(&c, base, t as u64, seqs, &nominal, &nominal) {
                Ok(s) => {
                    planning_s += s.planning_s;
                    (s.step_time_s, s.peak_memory_bytes <= limit)
                }
                Err(Error::MemoryLimit { .. }) => {
                    planning_s += started.elapsed().as_secs_f64();
                    (f64::NAN, false)
                }
                Err(e) => return Err(e),
            };
            arm.steps.push((time_s, fits));
            if fits && best.is_none_or(|b| time_s < b.0) {
                best = Some((time_s, arm.budget));
            }
        }
        planning.push(planning_s);
        chosen.push(best.map(|b| b.1));
        tick();
    }
    Ok(BudgetRun {
        arms,
        chosen,
        planning_s: planning,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::batching::policy::Policy;
    use crate::run::config::{Capacity, ScheduleSource, dp_shares_for_speeds};
    use crate::run::plan::even_split;
    use crate::schedules::generators::ScheduleKind;
    use flatpipe_profiles::builtins;

    fn profile() -> Profile {
        let model = builtins::model("llama3.1-8b").unwrap();
        let hw = builtins::hardware("h100").unwrap();
        flatpipe_profiles::analytic_profile(&model, &hw, &Default::default()).unwrap()
    }

    fn config(pp: u32, dp: u32, kind: ScheduleKind, policy: Policy) -> RunConfig {
        let mut c = RunConfig::new(
            ScheduleSource::Kind(kind),
            pp,
            1,
            even_split(32, pp as usize).unwrap(),
            policy,
            Capacity::Dynamic,
        );
        c.dp = dp;
        c.params.token_budget = 8192;
        c
    }

    /// Six sequences of equal cost c on replicas of speeds 1 and 2: LPT on uniform machines
    /// puts them 1: r0 (c < 2c), 2: r0 (2c = 2c, lower index), 3: r1 (2c < 3c), 4: r0 (3c <
    /// 4c), 5: r0 (4c = 4c), 6: r1 (4c < 5c): four and two, a makespan of 4c, the optimum
    /// (6c of work at a combined speed of 1.5 per c).
    #[test]
    fn shares_for_speeds_give_the_slow_replica_less() {
        let cost = |t: u64, _| t as f64;
        let shares = dp_shares_for_speeds(&[100; 6], &[1.0, 2.0], &cost);
        assert_eq!((shares[0].len(), shares[1].len()), (4, 2));
        // Equal speeds: the unweighted LPT, three and three.
        let even = dp_shares_for_speeds(&[100; 6], &[1.0, 1.0], &cost);
        assert_eq!((even[0].len(), even[1].len()), (3, 3));
    }

    /// One rank of one replica slowed everywhere by x: a pipeline of one rank (no bubbles)
    /// costs x times its compute plus the same transfers (none on one rank), so the fixed plan
    /// takes x times the ideal step; the oracle shifts sequences to the other replica. With
    /// work W split as w and 2W - w at speeds x and 1, the best balance is x w = 2W - w, a step
    /// of 2W x / (1 + x): for x = 1.5, 1.2 W against the fixed plan's 1.5 W.
    #[test]
    fn a_slow_replica_costs_the_fixed_plan_its_factor_and_the_oracle_the_balance() {
        let p = profile();
        let c = config(1, 2, ScheduleKind::OneFOneB, Policy::FlatFfd);
        let seqs: Vec<u32> = (0..256).map(|i| 256 + (i * 37) % 512).collect();
        let nominal = vec![PhaseScale::default(); 2];
        let slow = vec![uniform_scale(1.5), PhaseScale::default()];
        let ideal = simulate_step(&c, &p, 0, &seqs, &nominal, &nominal).unwrap();
        let fixed = simulate_step(&c, &p, 0, &seqs, &nominal, &slow).unwrap();
        let oracle = simulate_step(&c, &p, 0, &seqs, &slow, &slow).unwrap();
        let (i, f, o) = (ideal.step_time_s, fixed.step_time_s, oracle.step_time_s);
        // The data-parallel all-reduce is the same in all three: set it aside.
        let tail = i - ideal.predicted_s;
        let ratio = |x: f64| (x - tail) / (i - tail);
        assert!((ratio(f) - 1.5).abs() < 0.02, "fixed {f} ideal {i}");
        assert!((ratio(o) - 1.2).abs() < 0.03, "oracle {o} ideal {i}");
        // The prediction leaves the collectives out.
        assert!(oracle.predicted_s < o);
    }

    /// From step 4 rank 1 of replica 0 computes 1.5x slower. The re-planned arm, whose
    /// estimate forgets with 0.3, reaches the oracle within a few steps (a memory of about
    /// 1.4 steps); the fixed plan stays behind it.
    #[test]
    fn replanning_follows_a_straggler_to_the_oracle() {
        let p = profile();
        let c = config(4, 2, ScheduleKind::ZbAuto, Policy::FlatPlanned);
        let steps: Vec<(Vec<u32>, Vec<f64>)> = (0..12)
            .map(|t| {
                let seqs = (0..64)
                    .map(|i| 300 + ((i * 53 + t * 7) % 900) as u32)
                    .collect();
                let slow = if t >= 4 { 1.5 } else { 1.0 };
                let mut f = vec![1.0; 8];
                f[1] = slow;
                (seqs, f)
            })
            .collect();
        let arms = straggler_run(&c, &p, &steps, 0.3, &|| ()).unwrap();
        for t in 0..4 {
            assert!((arms.replanned[t] - arms.ideal[t]).abs() < 1e-9 * arms.ideal[t]);
            assert!((arms.fixed[t] - arms.ideal[t]).abs() < 1e-9 * arms.ideal[t]);
        }
        let mean = |v: &[f64]| v[8..].iter().sum::<f64>() / v[8..].len() as f64;
        let (f, r, o) = (mean(&arms.fixed), mean(&arms.replanned), mean(&arms.oracle));
        assert!(r <= o * 1.02, "replanned {r} oracle {o}");
        assert!(f > o * 1.05, "fixed {f} oracle {o}");
    }

    #[test]
    fn stragglers_are_drawn_within_their_bounds_and_bad_ones_refused() {
        let s = Stragglers {
            onset: 0.05,
            ..Stragglers::cited(8)
        };
        let draw = s.draw(16, 200, 7).unwrap();
        let all: Vec<f64> = draw.iter().flatten().copied().collect();
        // A rank's factor: its slowest GPU's steady 1..1.08 times a fail-slow's 1.1..1.5.
        assert!(all.iter().all(|&x| (1.0..=1.08 * 1.5).contains(&x)));
        assert!(
            all.iter().any(|&x| x > 1.1 * 1.0),
            "some fail-slow at 5% per step"
        );
        // Without fail-slows: the max of 8 uniforms on 1..1.08, mean 1 + 0.08 * 8/9.
        let quiet = Stragglers {
            onset: 0.0,
            ..Stragglers::cited(8)
        }
        .draw(512, 1, 3)
        .unwrap();
        let m = quiet[0].iter().sum::<f64>() / 512.0;
        assert!((m - (1.0 + 0.08 * 8.0 / 9.0)).abs() < 0.003, "{m}");
        // A fail-slow lasts mean_steps (4) on average: on one GPU with onset 1/2, a run of L
        // slowed steps is followed by (1 - 1/2) / (1/2) = 1 quiet step on average, so 4/5 of
        // the steps are slowed.
        let runs = Stragglers {
            gpus_per_rank: 1,
            spread: 0.0,
            onset: 0.5,
            mean_steps: 4.0,
            factor: (2.0, 2.0),
        };
        let d = runs.draw(1, 40_000, 1).unwrap();
        let slowed = d.iter().filter(|x| x[0] > 1.5).count() as f64;
        assert!((slowed / 40_000.0 - 4.0 / 5.0).abs() < 0.01, "{slowed}");
        // A huge mean length does not loop.
        let long = Stragglers {
            mean_steps: 1e15,
            ..runs
        };
        assert_eq!(long.draw(1, 3, 0).unwrap().len(), 3);
        let bad = Stragglers {
            factor: (0.9, 1.2),
            ..Stragglers::cited(1)
        };
        assert!(
            bad.draw(1, 1, 0)
                .unwrap_err()
                .to_string()
                .contains("factor")
        );
    }

    /// The re-planned budget is, step by step, the fastest budget that fits; growing lengths
    /// double the mean.
    #[test]
    fn the_replanned_budget_is_the_fastest_that_fits() {
        let p = profile();
        let c = config(4, 1, ScheduleKind::OneFOneB, Policy::FlatFfd);
        let base: Vec<u32> = (0..32).map(|i| 200 + (i * 97) % 1500).collect();
        let doubled = grown(&base, 2.0);
        let mean = |v: &[u32]| v.iter().map(|&x| f64::from(x)).sum::<f64>() / v.len() as f64;
        assert!((mean(&doubled) / mean(&base) - 2.0).abs() < 1e-3);
        let steps = vec![base, doubled];
        let run = budget_run(&c, &p, &steps, &[2048, 8192, 32768], &|| ()).unwrap();
        assert_eq!(run.planning_s.len(), 2);
        for (t, pick) in run.chosen.iter().enumerate() {
            let best = run
                .arms
                .iter()
                .filter(|a| a.steps[t].1)
                .min_by(|a, b| a.steps[t].0.total_cmp(&b.steps[t].0))
                .map(|a| a.budget);
            assert_eq!(*pick, best);
        }
        assert!(budget_run(&c, &p, &steps, &[], &|| ()).is_err());
    }
}
