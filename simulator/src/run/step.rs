//! One training step, planned once: the object that the Monte Carlo, the planner's evaluation,
//! `execute`, `calibrate` and the prediction of an executed step all consume.
//!
//! ```text
//! RunConfig + the step's sequence lengths
//!   --cut_step-->   per replica its microbatches (dp shares, then the policy; flat [T] + cu_seqlens)
//!   --plan_step-->  StepPlan: per replica, per round: the slots, the forward-only microbatches,
//!                   the schedule that runs (forward-only work fused or appended) and, with a
//!                   profile, its predicted timeline and memory (the replay of that schedule)
//! ```
//!
//! Sampling the lengths from a workload and a seed is separate
//! ([`flatpipe_profiles::Workload::sample_step`]): the executor samples, cuts, plans and attaches
//! tensors to the [`StepPlan`]; it never derives a schedule of its own, so a prediction is the
//! replay of the schedule that ran.

use crate::batching::microbatch::Microbatch;
use crate::batching::policy::{Batched, Policy, batch};
use crate::costs::sharding::StepCollectives;
use crate::costs::{CostModel, TableCosts, UniformCostSpec, UniformCosts, ns_to_s};
use crate::ir::lowering::Lowering;
use crate::ir::{Placement, Rank, Schedule};
use crate::run::config::{
    Capacity, RunConfig, ScheduleSource, cached_schedule, dp_shares, dp_shares_for_speeds,
    round_costs, zb_auto_activation_limit,
};
use crate::schedules::forward_only::{forward_only_pass, with_forward_only};
use crate::schedules::generators::ScheduleKind;
use crate::{Error, Result, Simulation, replay};
use flatpipe_profiles::Profile;
use serde::Serialize;
use std::sync::Arc;

/// One round of a replica's step: the schedule that runs and what it runs on.
#[derive(Debug, Clone)]
pub struct RoundPlan {
    /// The round's microbatches: the step's, or under a fixed capacity K exactly K slots, those
    /// past the step's last being empty (zero tokens).
    pub slots: Vec<Microbatch>,
    /// Forward-only microbatches (first round only): the slots cycled to K.
    pub fo: Vec<Microbatch>,
    /// The training schedule alone (without the forward-only work).
    pub train: Arc<Schedule>,
    /// The schedule that runs: the training schedule with the forward-only work fused into its
    /// bubbles or appended as a separate pass.
    pub schedule: Arc<Schedule>,
    /// With a profile: the replay of `schedule` under the profile's costs of these slots.
    pub prediction: Option<RoundPrediction>,
}

/// The predicted timeline and memory of one round.
#[derive(Debug, Clone)]
pub struct RoundPrediction {
    /// The replay of the round's schedule: timeline and metrics.
    pub simulation: Simulation,
    /// Parameters, gradients and optimizer state per pipeline rank, bytes.
    pub static_bytes: Vec<f64>,
    /// With forward-only work: the training schedule alone and the forward-only pass alone,
    /// seconds.
    pub fo_alone_s: Option<(f64, f64)>,
}

/// One data-parallel replica's share of a planned step.
#[derive(Debug, Clone)]
pub struct ReplicaPlan {
    /// The replica's index (its pipeline rank r is global rank `r * dp + replica`,
    /// [`crate::costs::sharding::global_rank`]).
    pub replica: usize,
    /// The replica's microbatches, in order (flat `[T]` with `cu_seqlens`).
    pub microbatches: Vec<Microbatch>,
    /// The rounds, in order (one unless a fixed capacity overflowed).
    pub rounds: Vec<RoundPlan>,
    /// Under `flat-planned`: the replica's step-time bound over every cut and order of its
    /// sequences ([`crate::run::mb_plan::lower_bound_s`]), seconds.
    pub lower_bound_s: Option<f64>,
}

/// One step, planned: what every replica runs and, with a profile, what it is predicted to
/// cost.
#[derive(Debug, Clone)]
pub struct StepPlan {
    /// Step number (the sampler's step id).
    pub step: u64,
    /// Replicas in order.
    pub replicas: Vec<ReplicaPlan>,
}

/// Cuts a step's sequence lengths (tokens) for `config`: `dp` shares balanced by `cost`
/// (LPT), then each share into microbatches under the config's policy.
///
/// # Errors
/// [`Error::InvalidArgument`] when a replica gets no sequence (fewer sequences than `dp`) and
/// the policy's errors ([`batch`]).
pub fn cut_step(
    config: &RunConfig,
    seqs: &[u32],
    cost: &dyn Fn(u64, u64) -> f64,
) -> Result<Vec<Batched>> {
    cut_step_for_speeds(config, seqs, cost, None)
}

/// [`cut_step`] with the data-parallel shares balanced for replicas going at `speeds` (one
/// per replica, time per unit of `cost`; [`dp_shares_for_speeds`]); `None`: equal speeds.
///
/// # Errors
/// [`cut_step`]'s, and [`Error::InvalidArgument`] for a speed list that is not one finite,
/// positive speed per replica.
pub fn cut_step_for_speeds(
    config: &RunConfig,
    seqs: &[u32],
    cost: &dyn Fn(u64, u64) -> f64,
    speeds: Option<&[f64]>,
) -> Result<Vec<Batched>> {
    let dp = config.dp.max(1);
    let shares = match speeds {
        None => dp_shares(seqs, dp, cost),
        Some(v) => {
            if v.len() != dp as usize || v.iter().any(|x| !(x.is_finite() && *x > 0.0)) {
                return Err(Error::invalid(
                    "replica speeds",
                    format!("{v:?}"),
                    format!("one finite speed > 0 per replica ({dp})"),
                ));
            }
            dp_shares_for_speeds(seqs, v, cost)
        }
    };
    if let Some(d) = shares.iter().position(Vec::is_empty) {
        return Err(Error::invalid(
            "data-parallel degree",
            dp,
            format!(
                "at most the step's {} sequences (replica {d} gets none)",
                seqs.len()
            ),
        ));
    }
    if config.policy == Policy::VerlKk && config.params.microbatches.is_none() {
        // verl's count is shared over the data-parallel ranks and, with virtual stages,
        // rounded to Megatron's microbatch group (the pipeline size).
        return Ok(crate::batching::verl_kk::cut(
            &shares,
            config.params.token_budget,
            config.verl_divisor(),
            config.params.chunk_tokens,
        )?
        .into_iter()
        .map(|c| Batched {
            microbatches: c.microbatches,
            oversize: c.oversize,
            truncated_tokens: 0,
        })
        .collect());
    }
    shares
        .iter()
        .map(|share| batch(config.policy, share, &config.params, cost))
        .collect()
}

/// Plans step `step` from its cut ([`cut_step`]): every replica's rounds and schedules and,
/// with `profile`, their predicted timelines.
///
/// # Errors
/// [`plan_replica`]'s.
pub fn plan_step(
    config: &RunConfig,
    profile: Option<&Profile>,
    step: u64,
    cut: &[Batched],
) -> Result<StepPlan> {
    let replicas = cut
        .iter()
        .enumerate()
        .map(|(d, b)| plan_share(config, profile, b, d))
        .collect::<Result<_>>()?;
    Ok(StepPlan { step, replicas })
}

/// Plans replica `replica`'s share `cut` of a step ([`plan_step`] for one replica): under
/// `flat-planned` with a profile, its microbatches planned first ([`crate::run::mb_plan::plan`]).
///
/// # Errors
/// [`plan_replica`]'s and the microbatch plan's.
pub fn plan_share(
    config: &RunConfig,
    profile: Option<&Profile>,
    cut: &Batched,
    replica: usize,
) -> Result<ReplicaPlan> {
    match (config.policy, profile) {
        (Policy::FlatPlanned, Some(profile)) => {
            let planned = crate::run::mb_plan::plan(config, profile, &cut.microbatches, replica)?;
            let mut r = plan_replica(config, Some(profile), planned.microbatches, replica)?;
            r.lower_bound_s = Some(planned.lower_bound_s);
            Ok(r)
        }
        _ => plan_replica(config, profile, cut.microbatches.clone(), replica),
    }
}

/// Builds the training schedule of one round: every kind from the same inputs (placement,
/// microbatch count, costs, memory limit). zb-auto is built from the round's costs under the
/// memory limit (with a profile), or from unit costs under 1F1B's memory (without one); the
/// other kinds depend on the count only (cached).
fn training_schedule(
    config: &RunConfig,
    profile: Option<&Profile>,
    k: u32,
    costs: Option<&TableCosts>,
) -> Result<Arc<Schedule>> {
    match (&config.source, profile, costs) {
        (ScheduleSource::Kind(ScheduleKind::ZbAuto), Some(profile), Some(costs)) => {
            let limit =
                zb_auto_activation_limit(profile, config.memory_limit_bytes, costs, config.pp)?;
            Ok(Arc::new(
                ScheduleKind::ZbAuto.build(config.pp, config.v, k, costs, limit)?,
            ))
        }
        (ScheduleSource::Kind(kind), _, _) => cached_schedule(*kind, config.pp, config.v, k),
        (ScheduleSource::Given(s), _, _) => Ok(Arc::new(s.clone())),
    }
}

/// Plans one replica's share of a step: its rounds (one per `K` microbatches under a fixed
/// capacity K, empty slots filling the last), each round's training schedule, its forward-only
/// work (first round, fused by the same costs that predict it), and with `profile` the replay
/// under the profile's costs of the round's slots (only the last round carries the optimizer
/// step). `replica` is the replica's index ([`crate::costs::sharding::global_rank`]).
///
/// # Errors
/// [`Error::InvalidArgument`] for no microbatches; generation, cost-table, forward-only and
/// replay errors; [`Error::MemoryLimit`] when zb-auto finds no schedule under the memory limit.
pub fn plan_replica(
    config: &RunConfig,
    profile: Option<&Profile>,
    microbatches: Vec<Microbatch>,
    replica: usize,
) -> Result<ReplicaPlan> {
    let p = config.pp;
    let n = microbatches.len() as u32;
    if n == 0 {
        return Err(Error::invalid(
            "microbatches",
            0,
            ">= 1 per replica and step",
        ));
    }
    let (k, rounds) = match config.effective_capacity() {
        Capacity::Dynamic => (n, 1),
        Capacity::Fixed(k) => (k, n.div_ceil(k).max(1)),
    };
    let zb_auto = config.source == ScheduleSource::Kind(ScheduleKind::ZbAuto);
    // Every round but zb-auto's (built from each round's costs) shares one schedule.
    let shared = if zb_auto && profile.is_some() {
        None
    } else {
        Some(training_schedule(config, profile, k, None)?)
    };
    let placement = match &shared {
        Some(s) => s.placement.clone(),
        None => crate::schedules::zb_auto::placement(p, config.v)?,
    };
    let mut out = Vec::with_capacity(rounds as usize);
    for round in 0..rounds {
        let start = (round * k) as usize;
        let mut slots: Vec<Microbatch> =
            microbatches[start..(start + k as usize).min(microbatches.len())].to_vec();
        slots.resize(k as usize, Microbatch::default());
        // Forward-only work rides in the first round.
        let fo_spec = config
            .forward_only
            .map(|f| (f, f.microbatches.unwrap_or(k)))
            .filter(|(_, kf)| *kf > 0 && round == 0);
        let fo: Vec<Microbatch> = match fo_spec {
            Some((_, kf)) => (0..kf as usize)
                .map(|i| slots[i % slots.len()].clone())
                .collect(),
            None => Vec::new(),
        };
        let costs = match profile {
            Some(profile) => Some(round_costs(
                config,
                profile,
                &placement,
                (&slots, &fo),
                replica,
                round + 1 == rounds,
            )?),
            None => None,
        };
        let train = match &shared {
            Some(s) => Arc::clone(s),
            None => training_schedule(config, profile, k, costs.as_ref())?,
        };
        // Sequences cut into chunks: the same schedule, ordered for their dependencies.
        let chains = crate::schedules::chunks::chains(&slots)?;
        if !chains.is_empty() && !fo.is_empty() {
            return Err(Error::invalid(
                "forward-only work with chunked sequences",
                format!("{} chunked sequence(s)", chains.len()),
                "not supported: a chunk's forward-only pass would need the earlier chunks' keys and values, which a forward-only pass does not keep; plan without chunks",
            ));
        }
        let train = if chains.is_empty() {
            train
        } else {
            Arc::new(crate::schedules::chunks::order_chunks(&train, &chains)?)
        };
        let schedule = match fo_spec {
            Some((f, kf)) => Arc::new(match &costs {
                Some(costs) => with_forward_only(&train, kf, f.mode, f.loss_dependency, costs)?,
                None => with_forward_only(
                    &train,
                    kf,
                    f.mode,
                    f.loss_dependency,
                    &UniformCosts::new(&UniformCostSpec::default(), config.v),
                )?,
            }),
            None => Arc::clone(&train),
        };
        let prediction = match &costs {
            Some(costs) => Some(predict_round(
                costs,
                &train,
                &schedule,
                fo.len() as u32,
                config.lowering,
            )?),
            None => None,
        };
        out.push(RoundPlan {
            slots,
            fo,
            train,
            schedule,
            prediction,
        });
    }
    Ok(ReplicaPlan {
        replica,
        microbatches,
        rounds: out,
        lower_bound_s: None,
    })
}

/// The replay of a round's `schedule` under `costs`, and with `k_fo` forward-only microbatches
/// the training schedule alone and the forward-only pass alone (no optimizer step) for
/// comparison.
fn predict_round(
    costs: &TableCosts,
    train: &Schedule,
    schedule: &Schedule,
    k_fo: u32,
    lowering: Lowering,
) -> Result<RoundPrediction> {
    let fo_alone_s = if k_fo > 0 {
        let t_train = replay::replay(train, costs)?.makespan_ns();
        let pass = forward_only_pass(train, k_fo);
        let t_fo = replay::replay(&pass, &costs.clone().without_optimizer())?.makespan_ns();
        Some((crate::costs::ns_to_s(t_train), crate::costs::ns_to_s(t_fo)))
    } else {
        None
    };
    Ok(RoundPrediction {
        simulation: crate::simulate_with(schedule, costs, lowering)?,
        static_bytes: (0..schedule.placement.num_ranks)
            .map(|r| costs.static_bytes(Rank(r)))
            .collect(),
        fo_alone_s,
    })
}

impl StepPlan {
    /// The step as an expert-parallel group runs it: groups of `ep` consecutive replicas
    /// exchange every mixture-of-experts layer's tokens microbatch by microbatch, so each waits
    /// for the group's slowest at every layer, and its k-th microbatch costs what the group's
    /// costliest k-th microbatch costs. Every member's round slots (and forward-only slots)
    /// become, slot by slot, the group's costliest by the profile's model FLOPs (tokens and
    /// attention pairs); its own microbatches (what it computes) stay. Replay it with
    /// [`StepPlan::replayed_on`]. `ep <= 1`, or members with different slot counts (which the
    /// executor refuses): the plan unchanged.
    pub fn expert_coupled(&self, ep: u32, profile: &Profile) -> StepPlan {
        let mut plan = self.clone();
        let ep = ep.max(1) as usize;
        if ep == 1 {
            return plan;
        }
        let cost = |m: &Microbatch| profile.model_flops(m.tokens() as f64, m.attn_pairs() as f64);
        for group in plan.replicas.chunks_mut(ep) {
            let rounds = group[0].rounds.len();
            if group.iter().any(|r| r.rounds.len() != rounds) {
                continue;
            }
            for i in 0..rounds {
                let same = |f: fn(&RoundPlan) -> &Vec<Microbatch>| {
                    group
                        .iter()
                        .all(|r| f(&r.rounds[i]).len() == f(&group[0].rounds[i]).len())
                };
                if !same(|r| &r.slots) || !same(|r| &r.fo) {
                    continue;
                }
                let costliest = |f: fn(&RoundPlan) -> &Vec<Microbatch>| -> Vec<Microbatch> {
                    (0..f(&group[0].rounds[i]).len())
                        .map(|k| {
                            group
                                .iter()
                                .map(|r| &f(&r.rounds[i])[k])
                                .max_by(|a, b| cost(a).total_cmp(&cost(b)))
                                .cloned()
                                .unwrap_or_default()
                        })
                        .collect()
                };
                let (slots, fo) = (costliest(|r| &r.slots), costliest(|r| &r.fo));
                for r in group.iter_mut() {
                    r.rounds[i].slots = slots.clone();
                    r.rounds[i].fo = fo.clone();
                }
            }
        }
        plan
    }

    /// This plan with every round's prediction replayed under `profile`: the schedules stay
    /// the ones planned (the ones that ran, for an executed step), only their costs change.
    ///
    /// # Errors
    /// Cost-table or replay errors (a profile whose layers do not match the stages).
    pub fn replayed_on(&self, config: &RunConfig, profile: &Profile) -> Result<StepPlan> {
        let mut plan = self.clone();
        for r in &mut plan.replicas {
            let n = r.rounds.len();
            for (i, round) in r.rounds.iter_mut().enumerate() {
                let costs = round_costs(
                    config,
                    profile,
                    &round.schedule.placement,
                    (&round.slots, &round.fo),
                    r.replica,
                    i + 1 == n,
                )?;
                round.prediction = Some(predict_round(
                    &costs,
                    &round.train,
                    &round.schedule,
                    round.fo.len() as u32,
                    config.lowering,
                )?);
            }
        }
        Ok(plan)
    }
}

impl ReplicaPlan {
    /// The replica's predicted outcome, its rounds one after the other. `None` without a
    /// prediction (planned without a profile).
    pub fn outcome(&self, config: &RunConfig, profile: &Profile) -> Option<StepOutcome> {
        let p = config.pp as usize;
        let mbs = &self.microbatches;
        let mut out = StepOutcome {
            step_time_s: 0.0,
            busy_s: 0.0,
            true_tokens: mbs.iter().map(Microbatch::tokens).sum(),
            computed_tokens: mbs.iter().map(Microbatch::computed_tokens).sum(),
            model_flops: mbs
                .iter()
                .map(|m| profile.model_flops(m.tokens() as f64, m.attn_pairs() as f64))
                .sum(),
            peak_activation_bytes: 0.0,
            static_bytes: 0.0,
            rank_memory_bytes: vec![0.0; p],
            microbatches: mbs.len() as u32,
            rounds: self.rounds.len() as u32,
            fo: None,
            lower_bound_s: self.lower_bound_s,
            all_to_all: None,
        };
        for round in &self.rounds {
            let pred = round.prediction.as_ref()?;
            let sim = &pred.simulation;
            out.step_time_s += sim.metrics.makespan_s;
            out.busy_s += sim.metrics.ranks.iter().map(|r| r.busy_s).sum::<f64>();
            let peak = sim
                .metrics
                .ranks
                .iter()
                .filter_map(|r| r.peak_activation_bytes)
                .fold(0.0, f64::max);
            out.peak_activation_bytes = out.peak_activation_bytes.max(peak);
            out.static_bytes = pred.static_bytes.iter().copied().fold(0.0, f64::max);
            for (r, m) in sim.metrics.ranks.iter().enumerate() {
                let total = pred.static_bytes[r] + m.peak_activation_bytes.unwrap_or(0.0);
                out.rank_memory_bytes[r] = out.rank_memory_bytes[r].max(total);
            }
            if pred.fo_alone_s.is_some() {
                out.fo = pred.fo_alone_s;
            }
            if let Some(x) = sim.metrics.all_to_all {
                let acc = out.all_to_all.get_or_insert(crate::AllToAllTime {
                    total_s: 0.0,
                    exposed_s: 0.0,
                });
                acc.total_s += x.total_s;
                acc.exposed_s += x.exposed_s;
            }
        }
        if out.fo.is_some() {
            // The frozen model's weights (the profile's dtype) live on every rank for the whole
            // step, besides its own state and activations: static memory, counted with the
            // rank's parameters and optimizer state so that the columns add up.
            let first = self.rounds.first()?;
            let placement = &first.schedule.placement;
            let state = &first.prediction.as_ref()?.static_bytes;
            out.static_bytes = 0.0;
            for (r, mem) in out.rank_memory_bytes.iter_mut().enumerate() {
                let frozen = frozen_bytes(config, profile, placement, r);
                *mem += frozen;
                out.static_bytes = out.static_bytes.max(state[r] + frozen);
            }
        }
        Some(out)
    }

    /// The schedule that ran and its predicted simulation, for a chart: several rounds drawn
    /// one after the other ([`concat_rounds`]). `None` without a prediction.
    pub fn chart(&self) -> Option<(Schedule, Simulation)> {
        let sims = self
            .rounds
            .iter()
            .map(|r| r.prediction.as_ref().map(|p| p.simulation.clone()))
            .collect::<Option<Vec<_>>>()?;
        let last = self.rounds.last()?;
        let sim = if sims.len() == 1 {
            sims.into_iter().next()?
        } else {
            concat_rounds(sims, last.schedule.num_microbatches)
        };
        Some(((*last.schedule).clone(), sim))
    }
}

impl StepPlan {
    /// The step's predicted outcome: the slower replica's step time with the data-parallel
    /// collectives of the config's sharding ([`StepPlan::step_time_with_collectives`]), tokens,
    /// FLOPs and busy time summed, memory the larger. `None` without a prediction (planned
    /// without a profile).
    pub fn outcome(&self, config: &RunConfig, profile: &Profile) -> Option<StepOutcome> {
        let mut total: Option<StepOutcome> = None;
        for r in &self.replicas {
            let o = r.outcome(config, profile)?;
            total = Some(match total {
                None => o,
                Some(t) => merge_replicas(t, o),
            });
        }
        let mut o = total?;
        if config.grad_replicas() > 1 {
            o.step_time_s = self.step_time_with_collectives(config, profile, o.step_time_s)?;
        }
        Some(o)
    }

    /// The step time `pipeline_s` (the slower replica's rounds, optimizer included) with the
    /// per-step data-parallel collectives of `config.sharding` on every pipeline rank's own
    /// timeline ([`StepCollectives`]): rank r's gradient reduction starts at its last compute
    /// (the latest over replicas), then its optimizer, then its weight all-gather (ZeRO-1/2); the
    /// step ends when the last rank is done. FSDP's all-gather before the first forward overlaps
    /// the rank's wait for its first input and delays the step by what it does not hide:
    /// `max(pipeline_s, max_r(end_r + reduce_r + opt_r + gather_r)) + max_r max(0, ag_r -
    /// start_r)`. Seconds; `None` without a prediction.
    pub fn step_time_with_collectives(
        &self,
        config: &RunConfig,
        profile: &Profile,
        pipeline_s: f64,
    ) -> Option<f64> {
        let placement = &self.replicas.first()?.rounds.first()?.schedule.placement;
        let params = rank_params(config, profile, placement);
        let (end, start, opt) = self.rank_times()?;
        Some(collectives_tail(
            config,
            profile,
            &params,
            pipeline_s,
            (&end, &start, &opt),
            config.lowering.fsdp.is_some(),
        ))
    }
}

impl StepPlan {
    /// Per pipeline rank: its last compute end (or last gradient reduction, when the lowering
    /// ran the collectives as actions; latest over replicas, the rounds one after the other),
    /// its first compute start (earliest) and its optimizer time (longest), seconds.
    /// `None` without a prediction.
    pub fn rank_times(&self) -> Option<(Vec<f64>, Vec<f64>, Vec<f64>)> {
        let placement = &self.replicas.first()?.rounds.first()?.schedule.placement;
        let p = placement.num_ranks as usize;
        let (mut end, mut start, mut opt) =
            (vec![0.0f64; p], vec![f64::INFINITY; p], vec![0.0f64; p]);
        for replica in &self.replicas {
            let mut offset = 0u64;
            let n = replica.rounds.len();
            for (i, round) in replica.rounds.iter().enumerate() {
                let tl = &round.prediction.as_ref()?.simulation.timeline;
                for r in 0..p {
                    if i == 0 {
                        let first = tl.compute[r].first().map_or(0, |o| o.start_ns);
                        start[r] = start[r].min(ns_to_s(first));
                    }
                    if i + 1 == n {
                        // The rank's work ends with its last compute or, when the lowering
                        // ran the data-parallel collectives as actions, its last reduction.
                        let last = tl.compute[r].last().map_or(0, |o| o.end_ns);
                        let reduced = tl.comm.get(r).map_or(0, |lane| {
                            lane.iter()
                                .filter(|c| {
                                    matches!(c.action, crate::ir::comm::LoweredAction::Fsdp(..))
                                })
                                .map(|c| c.end_ns)
                                .max()
                                .unwrap_or(0)
                        });
                        end[r] = end[r].max(ns_to_s(offset + last.max(reduced)));
                        if let Some((a, b)) = tl.optimizer[r] {
                            opt[r] = opt[r].max(ns_to_s(b - a));
                        }
                    }
                }
                offset += tl.makespan_ns();
            }
        }
        Some((end, start, opt))
    }
}

/// The parameters each pipeline rank of `placement` holds under `config`'s stages.
pub fn rank_params(config: &RunConfig, profile: &Profile, placement: &Placement) -> Vec<f64> {
    let mut params = vec![0.0f64; placement.num_ranks as usize];
    for (s, r) in config.stages.iter().enumerate() {
        params[placement.rank_of[s].idx()] += profile.layers[r.clone()]
            .iter()
            .map(|l| l.param_count as f64)
            .sum::<f64>();
    }
    params
}

/// The step time of [`StepPlan::step_time_with_collectives`] from its per-rank figures: the
/// parameters of each pipeline rank, the pipeline's time, and per rank its last compute end,
/// first compute start and optimizer time (latest, earliest and longest over replicas),
/// seconds. With `fsdp_in_replay` (the lowering ran FSDP's per-stage all-gathers and gradient
/// reductions as actions, [`crate::costs::sharding::StageCollectives`]), those are in
/// `pipeline_s` already and the tail leaves them out.
pub fn collectives_tail(
    config: &RunConfig,
    profile: &Profile,
    params: &[f64],
    pipeline_s: f64,
    (end, start, opt): (&[f64], &[f64], &[f64]),
    fsdp_in_replay: bool,
) -> f64 {
    let (mut tail, mut delay) = (pipeline_s, 0.0f64);
    let hw = &profile.hardware;
    let (pp, dp) = (config.pp, config.grad_replicas());
    let as_actions =
        fsdp_in_replay && crate::costs::sharding::StageCollectives::runs(config.sharding, pp);
    for r in 0..params.len() {
        let mut c = StepCollectives::of(config.sharding, hw, pp, dp, r as u32, params[r]);
        if as_actions {
            // In the replay already: FSDP's all-gather and every mode's gradient reduction
            // (ZeRO-1's all-gather after the optimizer stays here).
            (c.before_first_forward_s, c.gradient_reduction_s) = (0.0, 0.0);
        }
        tail = tail.max(end[r] + c.gradient_reduction_s + opt[r] + c.after_optimizer_s);
        delay = delay.max(c.before_first_forward_s - start[r]);
    }
    tail + delay
}

/// The frozen model's weights on pipeline rank `r`, bytes (the forward-only work's model, in
/// the profile's dtype).
fn frozen_bytes(config: &RunConfig, profile: &Profile, placement: &Placement, r: usize) -> f64 {
    config
        .stages
        .iter()
        .enumerate()
        .filter(|(s, _)| placement.rank_of[*s].idx() == r)
        .flat_map(|(_, l)| profile.layers[l.clone()].iter())
        .map(|l| l.param_bytes as f64)
        .sum()
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
    /// Largest parameters + gradients + optimizer state of a rank (with forward-only work, plus
    /// the frozen model's weights it holds), bytes.
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
    /// sequences (the slower replica's, [`crate::run::mb_plan::lower_bound_s`]), seconds.
    pub lower_bound_s: Option<f64>,
    /// The expert-parallel all-to-alls of the rank that exposes the most, summed over the
    /// rounds (the slower-exposing replica's); `None` without any.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub all_to_all: Option<crate::AllToAllTime>,
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
        all_to_all: match (a.all_to_all, b.all_to_all) {
            (Some(x), Some(y)) => Some(if y.exposed_s > x.exposed_s { y } else { x }),
            (x, y) => x.or(y),
        },
    }
}
