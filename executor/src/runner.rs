//! A plan's steps end to end: sample the step's sequences, then the simulator's `cut_step` /
//! `plan_step` split them over data-parallel replicas, cut microbatches and bring each replica's
//! schedule for its microbatch count in a `StepPlan` (dynamic capacity, design point 3 in
//! docs/design.md); the executor builds the data for that plan, attaches it to the plan's schedules
//! and runs the interpreter. Also the single-rank reference that the step check (`verify`) and the
//! tests compare against.

use crate::cpu::CpuStage;
use crate::data::{LossReduction, MicrobatchData, build_step_of, join_chunks};
use crate::interpreter::{Replica, StepOptions, StepRun, run_step};
use crate::model::experts::{ExpertLink, ExpertShard};
use crate::worker::{AdamW, StageInput, StageWorker};
use crate::{Error, Result};
use flatpipe_profiles::Profile;
use flatpipe_profiles::{ModelSpec, StepSize, Workload};
use flatpipe_simulator::batching::microbatch::Microbatch;
use flatpipe_simulator::costs::Recompute;
use flatpipe_simulator::ir::{Placement, Rank, Schedule};
use flatpipe_simulator::run::config::{Capacity, ScheduleSource};
use flatpipe_simulator::run::{
    config::RunConfig,
    step::{StepPlan, cut_step, plan_step},
};
use std::collections::BTreeMap;
use std::sync::Arc;

/// Predicted cost of a flat microbatch `(tokens, attention pairs)`, any unit: balances
/// microbatches (`flat-balanced`, exact counts) and data-parallel shares.
pub type BalanceCost = Arc<dyn Fn(u64, u64) -> f64 + Send + Sync>;

/// Everything a run needs besides the backend: the run's [`RunConfig`] (the one the simulator
/// and the planner use) and what only a real run has (the model's weights, data, optimizer).
#[derive(Clone)]
pub struct Setup {
    /// The model (the stages are built from its layer list).
    pub model: ModelSpec,
    /// What runs: schedule, pp, v, dp, layer split, recomputation, microbatching, forward-only
    /// work, zb-auto's memory limit. The executor runs flat policies with dynamic capacity (a
    /// given schedule: steps of exactly its microbatch count).
    pub config: RunConfig,
    /// Where the step's sequence lengths come from.
    pub workload: Workload,
    /// Sequences or tokens per step.
    pub step_size: StepSize,
    /// Seed of the step sampler and of the token ids.
    pub seed: u64,
    /// Seed of the weights.
    pub init_seed: u64,
    /// Expert parallelism: each group of `ep` consecutive data-parallel replicas splits every
    /// mixture-of-experts layer's routed experts (`E / ep` per replica) and exchanges their
    /// tokens by all-to-all; 1: every replica holds every expert. Divides dp.
    pub ep: u32,
    /// How token losses become the step's loss.
    pub reduction: LossReduction,
    /// Optimizer.
    pub adamw: AdamW,
    /// Clip the global gradient norm to this (none: no clipping).
    pub max_grad_norm: Option<f64>,
    /// Cost used to balance microbatches and replicas.
    pub balance: BalanceCost,
    /// The profile each step is planned with ([`flatpipe_simulator::run::step::plan_step`]): zb-auto
    /// is built from its costs of the step's microbatches under the config's memory limit, the
    /// forward-only work fused by them, and the step predicted. Without one, zb-auto is built
    /// for unit costs under 1F1B's memory, forward-only work fused by unit costs, and nothing
    /// is predicted.
    pub profile: Option<Arc<Profile>>,
}

impl std::fmt::Debug for Setup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Setup")
            .field("model", &self.model.name)
            .field("stages", &self.config.stages)
            .field("schedule", &self.config.source.name())
            .field("pp", &self.config.pp)
            .field("v", &self.config.v)
            .field("dp", &self.config.dp)
            .field("ep", &self.ep)
            .finish_non_exhaustive()
    }
}

/// One replica's share of a prepared step.
#[derive(Debug, Clone)]
pub struct PreparedReplica {
    /// The schedule for this replica's microbatch count.
    pub schedule: Schedule,
    /// Microbatch lengths (for the simulator's prediction of the same step).
    pub lengths: Vec<Microbatch>,
    /// Microbatch data.
    pub microbatches: Vec<MicrobatchData>,
    /// Forward-only microbatch data (empty without forward-only work).
    pub fo_microbatches: Vec<MicrobatchData>,
    /// With context parallelism, each GPU of the replica's group: its shares of the training
    /// and forward-only microbatches ([`MicrobatchData::cp_share`]); empty without.
    pub cp_shares: Vec<(Vec<MicrobatchData>, Vec<MicrobatchData>)>,
}

/// A step ready to run: its [`StepPlan`] and every replica's schedule and data.
#[derive(Debug, Clone)]
pub struct PreparedStep {
    /// Step number.
    pub step: u64,
    /// The step as planned (schedules and, with a profile, their predicted timelines).
    pub plan: StepPlan,
    /// Replicas in order: the plan's schedule with the tensors attached.
    pub replicas: Vec<PreparedReplica>,
}

impl PreparedStep {
    /// True tokens of the step.
    pub fn tokens(&self) -> u64 {
        self.replicas
            .iter()
            .flat_map(|r| &r.microbatches)
            .map(|m| m.tokens() as u64)
            .sum()
    }

    /// Every microbatch of every replica, in order (what the reference runs).
    pub fn all_microbatches(&self) -> impl Iterator<Item = &MicrobatchData> {
        self.replicas.iter().flat_map(|r| &r.microbatches)
    }
}

/// The simulator's prediction of a prepared step: the replay of the schedules that run.
#[derive(Debug, Clone, PartialEq)]
pub struct Prediction {
    /// The slowest replica's makespan with the data-parallel collectives
    /// ([`flatpipe_simulator::run::step::StepPlan::step_time_with_collectives`]), seconds.
    pub makespan_s: f64,
    /// Replica 0's bubble ratio per rank, `1 - busy / makespan`.
    pub bubbles: Vec<f64>,
    /// Replica 0's predicted timeline (its first round), to set beside the measured one action
    /// by action; `None` when the step has no prediction.
    pub timeline: Option<flatpipe_simulator::Timeline>,
    /// The predicted expert-parallel all-to-all time of the rank that exposes the most
    /// ([`flatpipe_simulator::run::step::StepOutcome::all_to_all`]); `None` without any.
    pub all_to_all: Option<flatpipe_simulator::replay::metrics::AllToAllTime>,
}

impl PreparedStep {
    /// Predicts this step on `profile`: the replay of each replica's schedule, the very one the
    /// interpreter runs (forward-only work included), under the profile's costs of that
    /// replica's microbatches. A step planned with this profile ([`Setup::profile`]) carries
    /// its prediction already; on another profile the same schedules are replayed
    /// ([`StepPlan::replayed_on`]).
    ///
    /// # Errors
    /// Cost-table or replay errors (a profile whose layers do not match the stages).
    pub fn predict(&self, setup: &Setup, profile: &Profile) -> Result<Prediction> {
        let same = setup
            .profile
            .as_deref()
            .is_some_and(|p| std::ptr::eq(p, profile));
        let replayed;
        let plan = if same && setup.ep <= 1 {
            &self.plan
        } else {
            // An expert-parallel group runs in step with its slowest member, microbatch by
            // microbatch.
            replayed = self
                .plan
                .expert_coupled(setup.ep, profile)
                .replayed_on(&setup.config, profile)?;
            &replayed
        };
        let outcome = plan
            .outcome(&setup.config, profile)
            .ok_or_else(|| Error::Invalid("the step has no prediction".into()))?;
        let first = plan
            .replicas
            .first()
            .and_then(|r| r.rounds.first())
            .and_then(|r| r.prediction.as_ref());
        let bubbles = first
            .map(|p| {
                p.simulation
                    .metrics
                    .ranks
                    .iter()
                    .map(|m| m.bubble_ratio)
                    .collect()
            })
            .unwrap_or_default();
        Ok(Prediction {
            makespan_s: outcome.step_time_s,
            bubbles,
            timeline: first.map(|p| p.simulation.timeline.clone()),
            all_to_all: outcome.all_to_all,
        })
    }
}

impl Setup {
    /// The stage -> rank placement (the same for every step).
    ///
    /// # Errors
    /// Schedule generation errors.
    pub fn placement(&self) -> Result<Placement> {
        Ok(self.config.placement()?)
    }

    /// GPUs of a rank's context-parallel group (1 without one): the executor runs
    /// `dp x cp` replicas, each group of `cp` consecutive ones sharing every microbatch.
    pub fn cp(&self) -> u32 {
        self.config.context_parallel.map_or(1, |c| c.cp.max(1))
    }

    /// Replicas the executor runs: `dp x cp`.
    pub fn replicas(&self) -> usize {
        self.config.dp as usize * self.cp() as usize
    }

    /// Checks that the setup can run: the run's own checks ([`RunConfig::validate`]), then what
    /// the executor adds: a flat policy, dynamic capacity, ddp across replicas, and context
    /// parallelism only as a fixed zigzag group gathering keys and values, without expert
    /// parallelism or selective recomputation.
    ///
    /// # Errors
    /// [`Error::Invalid`] / [`Error::Unsupported`] naming what is wrong.
    pub fn check(&self) -> Result<()> {
        let c = &self.config;
        if !c.policy.is_flat() {
            return Err(Error::Unsupported(format!(
                "policy {}: the executor runs flat [T] microbatches with cu_seqlens (flat-ffd, flat-balanced, verl-kk or flat-planned); padded and packed are simulated baselines",
                c.policy
            )));
        }
        if c.capacity != Capacity::Dynamic {
            return Err(Error::Unsupported(format!(
                "capacity {}: the executor builds each step's schedule for its microbatch count (dynamic capacity); fixed capacities are simulated baselines",
                c.capacity
            )));
        }
        // The run's own checks (pp, dp, v, stage ranges, recomputation, sizes), once.
        c.validate(self.model.layers().len())?;
        if c.dp > 1 && c.sharding != flatpipe_simulator::costs::sharding::Sharding::Ddp {
            return Err(Error::Unsupported(format!(
                "sharding {}: the executor's replicas each hold the full weights, gradients and optimizer state (ddp); sharded data parallelism is priced by the simulator and the planner, not executed (set the plan's sharding to ddp to run it)",
                c.sharding
            )));
        }
        self.check_context_parallel()?;
        if self.ep == 0 || c.dp % self.ep != 0 {
            return Err(Error::Invalid(format!(
                "ep = {}: expert parallelism splits the experts over groups of replicas, so it must divide dp = {}",
                self.ep, c.dp
            )));
        }
        if self.ep > 1 {
            for l in self.model.layers() {
                if let Some(m) = l.moe
                    && m.experts % u64::from(self.ep) != 0
                {
                    return Err(Error::Invalid(format!(
                        "ep = {}: layer {} of {} has {} routed experts, which ep must divide",
                        self.ep, l.index, self.model.name, m.experts
                    )));
                }
            }
            if !self.model.layers().iter().any(|l| l.moe.is_some()) {
                return Err(Error::Invalid(format!(
                    "ep = {}: model {} has no mixture-of-experts layer to split",
                    self.ep, self.model.name
                )));
            }
        }
        Ok(())
    }

    /// What the executor runs of `config.context_parallel`: a fixed group (`p2p` or
    /// `allgather`: at cp = 2 the ring's one step is the all-gather) split zigzag, without
    /// expert parallelism or selective recomputation.
    fn check_context_parallel(&self) -> Result<()> {
        use flatpipe_profiles::context_parallel::{CpBalance, CpComm};
        let Some(cp) = self.config.context_parallel.filter(|c| c.cp > 1) else {
            return Ok(());
        };
        let why = if !matches!(cp.comm, CpComm::Ring | CpComm::AllGather) {
            Some(format!(
                "cp communication {}: the executor gathers keys and values (p2p or allgather)",
                cp.comm
            ))
        } else if cp.balance != CpBalance::Zigzag {
            Some("a contiguous split: the executor splits zigzag".to_string())
        } else if cp.max_seqlen_per_rank.is_some() {
            Some("dynamic cp: the executor runs a fixed group".to_string())
        } else if self.ep > 1 {
            Some("expert parallelism as well".to_string())
        } else if self.config.recompute.contains(&Recompute::Selective) {
            Some("selective recomputation (its attention would gather the keys again outside the layer)".to_string())
        } else {
            None
        };
        match why {
            Some(w) => Err(Error::Unsupported(format!(
                "context parallelism cp = {} with {w}",
                cp.cp
            ))),
            None => Ok(()),
        }
    }

    /// Samples step `step`, plans it ([`cut_step`], [`plan_step`]: the same functions the
    /// simulator's Monte Carlo uses) and attaches every replica's data to the plan's
    /// schedule.
    ///
    /// # Errors
    /// Microbatching and schedule generation errors; a given schedule whose microbatch count
    /// differs from the step's.
    pub fn prepare(&self, step: u64) -> Result<PreparedStep> {
        let seqs = self.workload.sample_step(self.seed, step, self.step_size);
        let cost = |t: u64, a: u64| (self.balance)(t, a);
        let cut = cut_step(&self.config, &seqs, &cost).map_err(|e| match e {
            flatpipe_simulator::Error::InvalidArgument { field, .. }
                if field == "data-parallel degree" =>
            {
                Error::Invalid(format!(
                    "step {step} has {} sequences, too few for dp = {} replicas (a replica gets none)",
                    seqs.len(),
                    self.config.dp
                ))
            }
            e => e.into(),
        })?;
        if let ScheduleSource::Given(s) = &self.config.source
            && let Some(b) = cut
                .iter()
                .find(|b| b.microbatches.len() as u32 != s.num_microbatches)
        {
            return Err(Error::Invalid(format!(
                "the loaded schedule `{}` has {} microbatches, step {step} has {}; set the microbatch count (`params.microbatches`) to {}",
                s.name,
                s.num_microbatches,
                b.microbatches.len(),
                s.num_microbatches
            )));
        }
        let plan = plan_step(&self.config, self.profile.as_deref(), step, &cut)?;
        let planned: Vec<Vec<Microbatch>> = plan
            .replicas
            .iter()
            .map(|r| r.microbatches.clone())
            .collect();
        let vocab = self
            .model
            .layers()
            .first()
            .map(|l| l.vocab as u32)
            .unwrap_or(1);
        let data = build_step_of(&planned, vocab, self.seed, step, self.reduction);
        let replicas = plan
            .replicas
            .iter()
            .zip(data)
            .map(|(r, microbatches)| {
                // Dynamic capacity (checked): one round, the step's own microbatches.
                let round = &r.rounds[0];
                let fo_microbatches: Vec<MicrobatchData> = (0..round.fo.len())
                    .map(|k| microbatches[k % microbatches.len()].clone())
                    .collect();
                let cp_shares = cp_shares(&microbatches, &fo_microbatches, self.cp() as usize)?;
                Ok(PreparedReplica {
                    schedule: (*round.schedule).clone(),
                    lengths: r.microbatches.clone(),
                    microbatches,
                    fo_microbatches,
                    cp_shares,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(PreparedStep {
            step,
            plan,
            replicas,
        })
    }
}

/// Every GPU's shares of a replica's training and forward-only microbatches in a
/// context-parallel group of `cp` (empty for cp = 1).
///
/// # Errors
/// [`MicrobatchData::cp_share`]'s (a chunk of a longer sequence).
#[allow(clippy::type_complexity)]
fn cp_shares(
    microbatches: &[MicrobatchData],
    fo: &[MicrobatchData],
    cp: usize,
) -> Result<Vec<(Vec<MicrobatchData>, Vec<MicrobatchData>)>> {
    if cp <= 1 {
        return Ok(Vec::new());
    }
    let shares = |mbs: &[MicrobatchData], j: usize| {
        mbs.iter()
            .map(|m| m.cp_share(j, cp))
            .collect::<Result<Vec<_>>>()
    };
    (0..cp)
        .map(|j| Ok((shares(microbatches, j)?, shares(fo, j)?)))
        .collect()
}

/// A plan's ranks with their stages, run step after step.
#[derive(Debug)]
pub struct Executor<W> {
    /// `ranks[d * pp + r]`: replica d's pipeline rank r, its stages as `(stage id, worker)`.
    pub ranks: Vec<Vec<(u32, W)>>,
    pp: usize,
    ep: usize,
    steps_done: u64,
    fo_feeds_loss: bool,
    /// The straggler test hook ([`crate::interpreter::Slowdown`]): applied to the steps whose id
    /// is at least its `from_step`.
    pub slowdown: Option<crate::interpreter::Slowdown>,
}

impl Executor<CpuStage> {
    /// Builds every rank's CPU stages from their layer ranges.
    ///
    /// # Errors
    /// [`Setup::check`] errors; stage construction errors.
    pub fn cpu(setup: &Setup) -> Result<Self> {
        setup.check()?;
        let placement = setup.placement()?;
        let (ep, cp) = (setup.ep as usize, setup.cp() as usize);
        // One exchange per (group, stage): an expert-parallel group's replica d is index d mod ep
        // of group d / ep; a context-parallel group's (cp > 1, no ep) likewise by cp.
        let group = ep.max(cp);
        let groups = setup.replicas() / group;
        let abort = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let mut links: Vec<Vec<Option<ExpertLink>>> = (0..groups * setup.config.stages.len())
            .map(|_| {
                if group > 1 {
                    ExpertLink::group(group, &abort)
                        .into_iter()
                        .map(Some)
                        .collect()
                } else {
                    Vec::new()
                }
            })
            .collect();
        let num_stages = setup.config.stages.len();
        Executor::build_ranked(setup, &placement, |d, _, s| {
            let mode = setup.config.recompute_of(s);
            let shard = ExpertShard { index: d % ep, ep };
            let stage = CpuStage::sharded(
                &setup.model,
                setup.config.stages[s].clone(),
                setup.init_seed,
                mode,
                shard,
            )?;
            let link = links
                .get_mut((d / group) * num_stages + s)
                .and_then(|g| g.get_mut(d % group))
                .and_then(Option::take);
            Ok(match link {
                Some(l) if stage.has_moe() || cp > 1 => stage.with_link(l),
                _ => stage,
            })
        })
    }
}

impl<W: StageWorker> Executor<W> {
    /// Builds every rank's stages with `make(stage index)`.
    ///
    /// # Errors
    /// The first error of `make`.
    pub fn build(
        setup: &Setup,
        placement: &Placement,
        mut make: impl FnMut(usize) -> Result<W>,
    ) -> Result<Self> {
        Self::build_ranked(setup, placement, |_, _, s| make(s))
    }

    /// Builds every rank's stages with `make(replica, pipeline rank, stage index)`.
    ///
    /// # Errors
    /// The first error of `make`.
    pub fn build_ranked(
        setup: &Setup,
        placement: &Placement,
        mut make: impl FnMut(usize, usize, usize) -> Result<W>,
    ) -> Result<Self> {
        let pp = setup.config.pp as usize;
        let mut ranks = Vec::with_capacity(pp * setup.replicas());
        for d in 0..setup.replicas() {
            for r in 0..pp {
                let stages = placement
                    .stages_of(Rank(r as u32))
                    .into_iter()
                    .map(|s| Ok((s.0, make(d, r, s.idx())?)))
                    .collect::<Result<Vec<_>>>()?;
                ranks.push(stages);
            }
        }
        Ok(Executor {
            ranks,
            pp,
            ep: setup.ep.max(1) as usize,
            steps_done: 0,
            fo_feeds_loss: setup.config.forward_only.is_some_and(|f| f.loss_dependency),
            slowdown: None,
        })
    }

    /// The interpreter's view of a prepared step's replicas.
    /// With context parallelism, each replica's group of GPUs in turn, each running the
    /// replica's schedule on its shares.
    fn replicas<'a>(&self, step: &'a PreparedStep) -> Vec<Replica<'a>> {
        let mut out = Vec::new();
        for r in &step.replicas {
            let replica =
                |(microbatches, fo_microbatches): (&'a [MicrobatchData], &'a [MicrobatchData])| {
                    Replica {
                        schedule: &r.schedule,
                        microbatches,
                        fo_microbatches,
                        fo_feeds_loss: self.fo_feeds_loss,
                    }
                };
            if r.cp_shares.is_empty() {
                out.push(replica((&r.microbatches, &r.fo_microbatches)));
            } else {
                out.extend(r.cp_shares.iter().map(|(m, f)| replica((m, f))));
            }
        }
        out
    }

    /// Runs one training step (forward, backward, all-reduce, AdamW).
    ///
    /// # Errors
    /// Any interpreter or backend error.
    pub fn train_step(&mut self, setup: &Setup, step: &PreparedStep) -> Result<StepRun> {
        let replicas = self.replicas(step);
        let opts = StepOptions {
            optimizer: Some((setup.adamw, self.steps_done + 1)),
            max_grad_norm: setup.max_grad_norm,
            ep: self.ep,
            slowdown: self.slowdown.filter(|s| step.step >= s.from_step),
        };
        let run = run_step(&mut self.ranks, &replicas, &opts)?;
        self.steps_done += 1;
        Ok(run)
    }

    /// Runs one training step's forward and backward without the optimizer (the gradients stay
    /// for inspection).
    ///
    /// # Errors
    /// Any interpreter or backend error.
    pub fn gradients(&mut self, step: &PreparedStep) -> Result<StepRun> {
        let replicas = self.replicas(step);
        let opts = self.options();
        run_step(&mut self.ranks, &replicas, &opts)
    }

    /// No optimizer, this executor's expert parallelism.
    fn options(&self) -> StepOptions {
        StepOptions {
            ep: self.ep,
            ..StepOptions::default()
        }
    }

    /// Runs a forward-only (evaluation) step over the step's microbatches: `Fo` on every stage,
    /// nothing kept, no backward; the loss sums are in [`StepRun::fo_losses`].
    ///
    /// # Errors
    /// Any interpreter or backend error.
    pub fn eval_step(&mut self, step: &PreparedStep) -> Result<StepRun> {
        let schedules: Vec<Schedule> = step
            .replicas
            .iter()
            .map(|r| {
                flatpipe_simulator::schedules::forward_only::forward_only_pass(
                    &r.schedule,
                    r.microbatches.len() as u32,
                )
            })
            .collect();
        let replicas: Vec<Replica<'_>> = step
            .replicas
            .iter()
            .zip(&schedules)
            .map(|(r, s)| Replica {
                schedule: s,
                microbatches: &[],
                fo_microbatches: &r.microbatches,
                fo_feeds_loss: false,
            })
            .collect();
        let opts = self.options();
        run_step(&mut self.ranks, &replicas, &opts)
    }

    /// Replica 0's gradients by parameter name (and its expert-parallel group's routed
    /// experts').
    pub fn named_grads(&self) -> BTreeMap<String, Vec<f32>> {
        self.ranks[..self.pp * self.ep]
            .iter()
            .flatten()
            .flat_map(|(_, w)| w.named_grads())
            .collect()
    }

    /// Replica 0's parameters by name (and its expert-parallel group's routed experts').
    pub fn named_params(&self) -> BTreeMap<String, Vec<f32>> {
        self.ranks[..self.pp * self.ep]
            .iter()
            .flatten()
            .flat_map(|(_, w)| w.named_params())
            .collect()
    }

    /// Every replica's parameters by name (replica-major), to check that replicas agree.
    pub fn replica_params(&self) -> Vec<BTreeMap<String, Vec<f32>>> {
        self.ranks
            .chunks(self.pp)
            .map(|c| {
                c.iter()
                    .flatten()
                    .flat_map(|(_, w)| w.named_params())
                    .collect()
            })
            .collect()
    }
}

/// The single-rank reference: the whole model as one stage on one thread, every microbatch of
/// the step (all replicas) run as F, I, W in turn, then the same AdamW. No schedule, no
/// interpreter, no transfers.
#[derive(Debug)]
pub struct Reference {
    stage: CpuStage,
    steps_done: u64,
}

/// What the reference computed for one step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ReferenceStep {
    /// The step's loss.
    pub loss: f64,
    /// Global gradient norm (before clipping).
    pub grad_norm: f64,
}

impl Reference {
    /// The whole model of `setup` with the same initial weights.
    ///
    /// # Errors
    /// Stage construction errors.
    pub fn new(setup: &Setup) -> Result<Self> {
        let n = setup.model.layers().len();
        Ok(Reference {
            stage: CpuStage::new(&setup.model, 0..n, setup.init_seed, Recompute::None)?,
            steps_done: 0,
        })
    }

    /// Forward and backward of every microbatch of `step`; with `optimize`, then AdamW.
    ///
    /// # Errors
    /// Backend errors.
    pub fn step(
        &mut self,
        setup: &Setup,
        step: &PreparedStep,
        optimize: bool,
    ) -> Result<ReferenceStep> {
        self.stage.zero_grads()?;
        let mut loss = 0.0;
        // A chunked sequence runs whole: the reference is the unsplit run on the same tokens.
        let whole: Vec<MicrobatchData> = step
            .replicas
            .iter()
            .flat_map(|r| join_chunks(&r.microbatches))
            .collect();
        for (i, mb) in whole.iter().enumerate() {
            let i = i as u32;
            match self.stage.forward(i, mb, StageInput::Tokens, true)? {
                crate::worker::StageOutput::Loss(l) => loss += l.weighted,
                crate::worker::StageOutput::Hidden(_) | crate::worker::StageOutput::LossPending => {
                    return Err(Error::Invalid(
                        "the CPU reference ends in the loss, computed on the host".into(),
                    ));
                }
            }
            self.stage.backward_input(i, mb, None)?;
            self.stage.backward_weight(i, mb)?;
        }
        let grad_norm = self.grad_norm()?;
        if optimize {
            self.optimize(setup, grad_norm)?;
        }
        Ok(ReferenceStep { loss, grad_norm })
    }

    /// The global gradient norm of the whole model, routed experts included.
    fn grad_norm(&self) -> Result<f64> {
        Ok((self.stage.grad_sq_norm()? + self.stage.expert_grad_sq_norm()?).sqrt())
    }

    /// The optimizer step on the gradients held: clipping to `setup.max_grad_norm` by the
    /// global norm `grad_norm`, then AdamW.
    fn optimize(&mut self, setup: &Setup, grad_norm: f64) -> Result<()> {
        self.steps_done += 1;
        let scale = match setup.max_grad_norm {
            Some(c) if grad_norm > c => (c / (grad_norm + 1e-6)) as f32,
            _ => 1.0,
        };
        self.stage
            .optimizer_step(&setup.adamw, self.steps_done, scale)
    }

    /// Replaces the reference's gradients with `grads` (by parameter name: another run's, as
    /// [`Executor::named_grads`] returns them) and takes the optimizer step on them (global
    /// norm, clipping, AdamW), so the parameters that follow are this reference's optimizer
    /// applied to those gradients. `--verify` checks the pipelined run's optimizer step this
    /// way ([`crate::verify::verify_step`]). Returns the global norm of `grads`.
    ///
    /// # Errors
    /// [`Error::Invalid`] when `grads` names other tensors or holds another number of values
    /// than the model's; backend errors.
    pub fn optimizer_step_with(
        &mut self,
        setup: &Setup,
        grads: &BTreeMap<String, Vec<f32>>,
    ) -> Result<f64> {
        // The names in the order visit_grads walks the buffers; everything is checked before
        // a gradient is replaced.
        let held = self.stage.named_grads();
        if held.len() != grads.len() || held.iter().any(|(n, _)| !grads.contains_key(n)) {
            return Err(Error::Invalid(format!(
                "the gradients given name other tensors than the model's ({} given, {} in the model)",
                grads.len(),
                held.len()
            )));
        }
        if let Some((name, h)) = held.iter().find(|(n, h)| grads[n].len() != h.len()) {
            return Err(Error::Invalid(format!(
                "{name}: {} gradient values given, the model holds {}",
                grads[name].len(),
                h.len()
            )));
        }
        self.stage
            .visit_named_grads(&mut |name, buf| buf.copy_from_slice(&grads[name]))?;
        let grad_norm = self.grad_norm()?;
        self.optimize(setup, grad_norm)?;
        Ok(grad_norm)
    }

    /// Gradients by parameter name.
    pub fn named_grads(&self) -> BTreeMap<String, Vec<f32>> {
        self.stage.named_grads().into_iter().collect()
    }

    /// Parameters by name.
    pub fn named_params(&self) -> BTreeMap<String, Vec<f32>> {
        self.stage.named_params().into_iter().collect()
    }
}

/// The largest difference between two sets of named tensors.
#[derive(Debug, Clone, PartialEq, Default, serde::Serialize)]
pub struct Diff {
    /// `max |a - b|` over every element.
    pub max_abs: f64,
    /// `max over tensors of max|a - b| / max|b|` (normwise relative, so tiny elements do not
    /// dominate).
    pub max_rel: f64,
    /// The tensor with the largest relative difference.
    pub worst: String,
}

/// Compares `a` against the reference `b`, tensor by tensor; a tensor holding a value that is
/// not finite differs infinitely.
///
/// # Errors
/// [`Error::Invalid`] when the names or sizes differ.
pub fn compare(a: &BTreeMap<String, Vec<f32>>, b: &BTreeMap<String, Vec<f32>>) -> Result<Diff> {
    if a.len() != b.len() || a.keys().zip(b.keys()).any(|(x, y)| x != y) {
        return Err(Error::Invalid(format!(
            "the runs hold different tensors ({} vs {})",
            a.len(),
            b.len()
        )));
    }
    let mut d = Diff::default();
    for ((name, x), y) in a.iter().zip(b.values()) {
        if x.len() != y.len() {
            return Err(Error::Invalid(format!(
                "{name}: {} vs {} values",
                x.len(),
                y.len()
            )));
        }
        // A value that is not finite makes the difference infinite: NaN must not compare as
        // equal (f64::max would drop it).
        let finite = x.iter().chain(y).all(|v| v.is_finite());
        let abs = x
            .iter()
            .zip(y)
            .map(|(p, q)| (*p as f64 - *q as f64).abs())
            .fold(0.0, f64::max);
        let scale = y.iter().map(|q| (*q as f64).abs()).fold(0.0, f64::max);
        let (abs, rel) = if !finite {
            (f64::INFINITY, f64::INFINITY)
        } else if scale > 0.0 {
            (abs, abs / scale)
        } else {
            (abs, abs)
        };
        d.max_abs = d.max_abs.max(abs);
        if rel > d.max_rel || d.worst.is_empty() {
            d.max_rel = d.max_rel.max(rel);
            d.worst = name.clone();
        }
    }
    Ok(d)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn compare_reports_the_largest_normwise_difference_and_never_hides_a_nan() {
        let a: BTreeMap<String, Vec<f32>> = [
            ("w".to_string(), vec![1.0, 2.0]),
            ("v".to_string(), vec![4.0]),
        ]
        .into();
        let mut b = a.clone();
        b.get_mut("w").unwrap()[1] = 2.5;
        let d = compare(&b, &a).unwrap();
        // |2.5 - 2| / max(|1|, |2|) = 0.25, on w.
        assert_eq!((d.max_abs, d.max_rel, d.worst.as_str()), (0.5, 0.25, "w"));
        b.get_mut("v").unwrap()[0] = f32::NAN;
        let d = compare(&b, &a).unwrap();
        assert!(d.max_rel.is_infinite() && d.worst == "v", "{d:?}");
        b.remove("v");
        assert!(compare(&b, &a).is_err());
    }
}
