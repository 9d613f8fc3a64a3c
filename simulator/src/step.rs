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

use crate::costs::{
    CostModel, CostOptions, Recompute, TableCosts, UniformCostSpec, UniformCosts, ns_to_s,
};
use crate::forward_only::{forward_only_pass, with_forward_only};
use crate::generators::ScheduleKind;
use crate::ir::{Placement, Rank, Schedule};
use crate::microbatch::Microbatch;
use crate::montecarlo::{
    Capacity, ForwardOnlySpec, ScheduleSource, StepOutcome, cached_schedule, concat_rounds,
    dp_shares, merge_replicas, zb_auto_activation_limit,
};
use crate::policy::{Batched, Policy, PolicyParams, batch};
use crate::sharding::{Sharding, StateBytes, StepCollectives};
use crate::{Error, Result, Simulation, replay, simulate};
use flatpipe_profiles::Profile;
use std::ops::Range;
use std::sync::Arc;

/// What a run is, once: the fields a plan file, a Monte Carlo configuration and the executor
/// share. The planner's candidates, `simulate`'s comparison rows and `execute`'s run are each
/// one `RunConfig`.
#[derive(Debug, Clone, PartialEq)]
pub struct RunConfig {
    /// Schedule family or given schedule.
    pub source: ScheduleSource,
    /// Ranks per pipeline (pipeline-parallel degree), >= 1.
    pub pp: u32,
    /// Stages per rank (virtual stages), >= 1.
    pub v: u32,
    /// Layer range of every stage, in stage order (`pp * v` of them).
    pub stages: Vec<Range<usize>>,
    /// Microbatching policy.
    pub policy: Policy,
    /// Token budget or exact microbatch count, and the padded / packed policies' parameters.
    pub params: PolicyParams,
    /// Schedule capacity (a given schedule always has the fixed capacity of its microbatch
    /// count).
    pub capacity: Capacity,
    /// Data-parallel replicas (each runs the pipeline on its share of the step), >= 1.
    pub dp: u32,
    /// Recomputation per stage (empty: none).
    pub recompute: Vec<Recompute>,
    /// zb-auto's per-rank memory limit, bytes: its activations may use this minus the largest
    /// rank's parameters, gradients and optimizer state (`None`: the hardware's memory minus a
    /// reserve of 4 GiB, at most 1/8 of it).
    pub memory_limit_bytes: Option<f64>,
    /// Forward-only work per replica and step (a frozen reference or teacher forward over the
    /// step's own microbatches, cycled to K).
    pub forward_only: Option<ForwardOnlySpec>,
    /// How the `dp` replicas shard weights, gradients and optimizer state
    /// ([`crate::sharding`]): memory per rank and the data-parallel collectives.
    pub sharding: Sharding,
    /// Bytes per parameter in place of the sharding mode's (`None`: the mode's mixed-precision
    /// layout; the CPU executor sets its fp32 one).
    pub state_bytes: Option<StateBytes>,
}

impl RunConfig {
    /// A configuration with one replica, no recomputation, no forward-only work and the default
    /// policy parameters.
    pub fn new(
        source: ScheduleSource,
        pp: u32,
        v: u32,
        stages: Vec<Range<usize>>,
        policy: Policy,
        capacity: Capacity,
    ) -> Self {
        RunConfig {
            source,
            pp,
            v,
            stages,
            policy,
            params: PolicyParams::default(),
            capacity,
            dp: 1,
            recompute: Vec::new(),
            memory_limit_bytes: None,
            forward_only: None,
            sharding: Sharding::Ddp,
            state_bytes: None,
        }
    }

    /// The stage -> rank placement (the same for every step).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a kind that does not run `v` stages per rank.
    pub fn placement(&self) -> Result<Placement> {
        match &self.source {
            ScheduleSource::Kind(k) => k.placement_on(self.pp, self.v),
            ScheduleSource::Given(s) => Ok(s.placement.clone()),
        }
    }

    /// What decides this configuration's cut of a step ([`cut_step`]): two configurations
    /// with the same key cut every step the same way. The data-parallel degree, the policy
    /// and its parameters, and verl-kk's count divisor ([`RunConfig::verl_divisor`]).
    pub fn cut_key(&self) -> CutKey {
        (
            self.dp.max(1),
            self.policy,
            self.params,
            self.verl_divisor(),
        )
    }

    /// verl-kk's microbatch-count divisor: Megatron's microbatch group per virtual stage (the
    /// pipeline size) with virtual stages (`v > 1`), else 1 (verl's
    /// `num_batches_divided_by`, [`crate::verl_kk`]).
    pub fn verl_divisor(&self) -> u32 {
        if self.policy == Policy::VerlKk && self.v > 1 {
            self.pp.max(1)
        } else {
            1
        }
    }

    /// The capacity the schedule is built for: a given schedule's is its microbatch count.
    pub fn effective_capacity(&self) -> Capacity {
        match &self.source {
            ScheduleSource::Given(s) => Capacity::Fixed(s.num_microbatches),
            ScheduleSource::Kind(_) => self.capacity,
        }
    }
}

/// [`RunConfig::cut_key`]: data-parallel degree, policy, its parameters, verl-kk's divisor.
pub type CutKey = (u32, Policy, PolicyParams, u32);

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
    /// [`crate::sharding::global_rank`]).
    pub replica: usize,
    /// The replica's microbatches, in order (flat `[T]` with `cu_seqlens`).
    pub microbatches: Vec<Microbatch>,
    /// The rounds, in order (one unless a fixed capacity overflowed).
    pub rounds: Vec<RoundPlan>,
    /// Under `flat-planned`: the replica's step-time bound over every cut and order of its
    /// sequences ([`crate::mb_plan::lower_bound_s`]), seconds.
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
    let dp = config.dp.max(1);
    let shares = dp_shares(seqs, dp, cost);
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
        return Ok(crate::verl_kk::cut(
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
        .map(|(d, b)| match (config.policy, profile) {
            (Policy::FlatPlanned, Some(profile)) => {
                let planned = crate::mb_plan::plan(config, profile, &b.microbatches, d)?;
                let mut r = plan_replica(config, Some(profile), planned.microbatches, d)?;
                r.lower_bound_s = Some(planned.lower_bound_s);
                Ok(r)
            }
            _ => plan_replica(config, profile, b.microbatches.clone(), d),
        })
        .collect::<Result<_>>()?;
    Ok(StepPlan { step, replicas })
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
/// step). `replica` is the replica's index ([`crate::sharding::global_rank`]).
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
        None => crate::zb_auto::placement(p, config.v)?,
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
        let chains = crate::chunks::chains(&slots)?;
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
            Arc::new(crate::chunks::order_chunks(&train, &chains)?)
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
            Some(costs) => Some(predict_round(costs, &train, &schedule, fo.len() as u32)?),
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

/// The profile's costs of one round: its slots and forward-only microbatches on the
/// replica `replica` ([`crate::sharding::global_rank`]); only the `last` round carries the
/// optimizer step.
pub(crate) fn round_costs(
    config: &RunConfig,
    profile: &Profile,
    placement: &Placement,
    (slots, fo): (&[Microbatch], &[Microbatch]),
    replica: usize,
    last: bool,
) -> Result<TableCosts> {
    let c = TableCosts::with_options(
        profile,
        &config.stages,
        placement,
        slots,
        fo,
        &CostOptions {
            recompute: &config.recompute,
            replica,
            sharding: config.sharding,
            dp: config.dp,
            state_bytes: config.state_bytes,
        },
    )?;
    Ok(if last { c } else { c.without_optimizer() })
}

/// The replay of a round's `schedule` under `costs`, and with `k_fo` forward-only microbatches
/// the training schedule alone and the forward-only pass alone (no optimizer step) for
/// comparison.
fn predict_round(
    costs: &TableCosts,
    train: &Schedule,
    schedule: &Schedule,
    k_fo: u32,
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
        simulation: simulate(schedule, costs)?,
        static_bytes: (0..schedule.placement.num_ranks)
            .map(|r| costs.static_bytes(Rank(r)))
            .collect(),
        fo_alone_s,
    })
}

impl StepPlan {
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
        }
        if out.fo.is_some() {
            // The frozen model's weights (the profile's dtype) live on every rank for the whole
            // step, besides its own state and activations.
            let placement = &self.rounds.first()?.schedule.placement;
            for (r, mem) in out.rank_memory_bytes.iter_mut().enumerate() {
                *mem += frozen_bytes(config, profile, placement, r);
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
        if config.dp > 1 {
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
        ))
    }
}

impl StepPlan {
    /// Per pipeline rank: its last compute end (latest over replicas, the rounds one after the
    /// other), its first compute start (earliest) and its optimizer time (longest), seconds.
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
                        let last = tl.compute[r].last().map_or(0, |o| o.end_ns);
                        end[r] = end[r].max(ns_to_s(offset + last));
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
/// seconds.
pub fn collectives_tail(
    config: &RunConfig,
    profile: &Profile,
    params: &[f64],
    pipeline_s: f64,
    (end, start, opt): (&[f64], &[f64], &[f64]),
) -> f64 {
    let (mut tail, mut delay) = (pipeline_s, 0.0f64);
    for r in 0..params.len() {
        let c = StepCollectives::of(
            config.sharding,
            &profile.hardware,
            config.pp,
            config.dp,
            r as u32,
            params[r],
        );
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
