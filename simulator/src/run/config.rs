//! What a run is, once: [`RunConfig`] and its vocabulary. The schedule's source
//! ([`ScheduleSource`]), its capacity ([`Capacity`]), forward-only work ([`ForwardOnlySpec`]),
//! the cost that balances microbatches and data-parallel shares ([`balance_cost`],
//! [`dp_shares`]), the memory limits, and the generated schedules' cache. A plan file, a
//! planner candidate, a comparison row of `simulate` and an executed run are each one
//! `RunConfig`; [`crate::run::step`] plans a step of it and [`crate::run::montecarlo`] many.

use crate::batching::microbatch::Microbatch;
use crate::batching::policy::{Policy, PolicyParams};
use crate::costs::sharding::{Sharding, StateBytes};
use crate::costs::{CostModel, CostOptions, Recompute, TableCosts};
use crate::ir::lowering::Lowering;
use crate::ir::{Placement, Rank, Schedule};
use crate::schedules::generators::ScheduleKind;
use crate::{Error, Result};
use flatpipe_profiles::Profile;
use std::collections::HashMap;
use std::fmt;
use std::ops::Range;
use std::str::FromStr;
use std::sync::{Arc, Mutex, OnceLock};

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
    /// ([`crate::costs::sharding`]): memory per rank and the data-parallel collectives.
    pub sharding: Sharding,
    /// Bytes per parameter in place of the sharding mode's (`None`: the mode's mixed-precision
    /// layout; the CPU executor sets its fp32 one).
    pub state_bytes: Option<StateBytes>,
    /// How the pipeline's transfers become sends and receives on streams
    /// ([`crate::ir::lowering`]); the default is the uncontended links.
    pub lowering: Lowering,
    /// Context parallelism: every pipeline rank a group of `cp` GPUs sharing each microbatch's
    /// tokens ([`crate::costs::context`]); `None`: one GPU per rank.
    pub context_parallel: Option<flatpipe_profiles::context_parallel::ContextParallel>,
}

/// [`RunConfig::cut_key`]: data-parallel degree, policy, its parameters, verl-kk's divisor.
pub type CutKey = (u32, Policy, PolicyParams, u32);

impl RunConfig {
    /// Stage `stage`'s recomputation: its entry of [`RunConfig::recompute`], none past its end.
    pub fn recompute_of(&self, stage: usize) -> Recompute {
        self.recompute.get(stage).copied().unwrap_or_default()
    }

    /// GPUs that hold the same stage and reduce its gradients: `dp` replicas times the cp
    /// group's GPUs ([`crate::costs::CostOptions::grad_replicas`]), >= 1.
    pub fn grad_replicas(&self) -> u32 {
        self.dp.max(1) * self.context_parallel.map_or(1, |c| c.cp.max(1))
    }

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
            lowering: Lowering::UNCONTENDED,
            context_parallel: None,
        }
    }

    /// Checks the run against a model of `num_layers` layers, every check in one place: pp and
    /// dp at least 1; `v` runnable by the schedule (a given schedule: its own stage count);
    /// `pp x v` stages that cover layers `0..num_layers` in order, each non-empty; one
    /// recomputation mode per stage (or none); a microbatch count, token budget, chunk length
    /// and forward-only count of at least 1.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] naming the field (`pp`, `dp`, `vpp`, `stages`, `stages[i]`,
    /// `recompute`, `microbatches`, `token_budget`, `chunk_tokens`,
    /// `forward_only.microbatches`), its value and the allowed range.
    pub fn validate(&self, num_layers: usize) -> Result<()> {
        if self.pp == 0 {
            return Err(Error::invalid("pp", 0, ">= 1 rank"));
        }
        if self.dp == 0 {
            return Err(Error::invalid("dp", 0, ">= 1 replica"));
        }
        if let Some(cp) = &self.context_parallel {
            cp.validate()
                .map_err(|e| Error::invalid("context_parallel", cp.cp, e.to_string()))?;
        }
        self.validate_v()?;
        let want = self.pp as usize * self.v as usize;
        if self.stages.len() != want {
            return Err(Error::invalid(
                "stages",
                format!("{} stages", self.stages.len()),
                format!(
                    "{} x {} = {want} stages for schedule {}",
                    self.pp,
                    self.v,
                    self.source_name()
                ),
            ));
        }
        validate_stage_ranges(&self.stages, num_layers)?;
        if !self.recompute.is_empty() && self.recompute.len() != self.stages.len() {
            return Err(Error::invalid(
                "recompute",
                format!("{} entries", self.recompute.len()),
                format!("one per stage ({})", self.stages.len()),
            ));
        }
        self.validate_sizes()
    }

    /// `v` against the schedule: a kind's stages per rank, or a given schedule's stage count.
    fn validate_v(&self) -> Result<()> {
        match &self.source {
            ScheduleSource::Kind(k) => {
                let v = k.stages_per_rank(Some(self.v))?;
                if v != self.v {
                    return Err(Error::invalid(
                        "vpp",
                        self.v,
                        format!("{v}: schedule {k} runs {v} stage(s) per rank"),
                    ));
                }
            }
            ScheduleSource::Given(s) => {
                if s.num_stages() != self.pp * self.v {
                    return Err(Error::invalid(
                        "stages (pp x vpp)",
                        self.pp * self.v,
                        format!("{}, the given schedule's stage count", s.num_stages()),
                    ));
                }
            }
        }
        Ok(())
    }

    /// Counts and lengths that must be at least 1 when given.
    fn validate_sizes(&self) -> Result<()> {
        if self.params.microbatches == Some(0) {
            return Err(Error::invalid("microbatches", 0, ">= 1"));
        }
        if self.params.microbatches.is_none() && self.params.token_budget == 0 {
            return Err(Error::invalid("token_budget", 0, ">= 1 token"));
        }
        if self.params.chunk_tokens == Some(0) {
            return Err(Error::invalid("chunk_tokens", 0, ">= 1 token"));
        }
        if let Some(fo) = &self.forward_only
            && fo.microbatches == Some(0)
        {
            return Err(Error::invalid(
                "forward_only.microbatches",
                0,
                ">= 1 (leave the forward-only work out instead)",
            ));
        }
        Ok(())
    }

    /// The schedule's name for messages.
    fn source_name(&self) -> String {
        match &self.source {
            ScheduleSource::Kind(k) => k.to_string(),
            ScheduleSource::Given(_) => "given as a file".into(),
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

    /// What decides this configuration's cut of a step ([`crate::run::step::cut_step`]): two configurations
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
    /// `num_batches_divided_by`, [`crate::batching::verl_kk`]).
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

/// Checks that `stages` (layer ranges `[start, end)`, in stage order) cover layers
/// `0..num_layers` in order, each non-empty.
///
/// # Errors
/// [`Error::InvalidArgument`] for `stages[i]` (the first range that breaks the order, is empty
/// or leaves the model) or `stages` (they end before the last layer).
pub fn validate_stage_ranges(stages: &[Range<usize>], num_layers: usize) -> Result<()> {
    let mut next = 0;
    for (i, s) in stages.iter().enumerate() {
        let why = if s.start != next {
            format!("this one must start at {next}, where the previous one ends")
        } else if s.end <= s.start {
            format!(
                "this one is empty: its end must be more than its start {}",
                s.start
            )
        } else if s.end > num_layers {
            format!("its end must be at most {num_layers}, the model's layer count")
        } else {
            next = s.end;
            continue;
        };
        return Err(Error::invalid(
            format!("stages[{i}]"),
            format!("{{start: {}, end: {}}}", s.start, s.end),
            format!("stages must cover layers 0..{num_layers} in order, each non-empty; {why}"),
        ));
    }
    if next != num_layers {
        return Err(Error::invalid(
            "stages",
            format!("ends at layer {next}"),
            format!("must cover all {num_layers} layers"),
        ));
    }
    Ok(())
}

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

/// Forward-only microbatches of each step (see [`crate::schedules::forward_only`]); in a plan file:
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
    pub mode: crate::schedules::forward_only::FoMode,
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
    dp_shares_for_speeds(seqs, &vec![1.0; dp.max(1) as usize], cost)
}

/// Splits a step's sequences into one share per replica, replica `d` taking `speeds[d]` times
/// the predicted cost of what it gets (1: the profile's speed; a straggler's is larger): LPT on
/// uniform machines, each sequence, longest first, to the replica on which it would finish
/// first (Gonzalez, Ibarra and Sahni 1977, "Bounds for LPT schedules on uniform processors",
/// SIAM J. Comput. 6(1)). With equal speeds this is [`dp_shares`]'s LPT. `speeds` must be
/// non-empty, each finite and > 0.
pub fn dp_shares_for_speeds(
    seqs: &[u32],
    speeds: &[f64],
    cost: &dyn Fn(u64, u64) -> f64,
) -> Vec<Vec<u32>> {
    if speeds.len() <= 1 {
        return vec![seqs.to_vec()];
    }
    let mut order: Vec<u32> = seqs.to_vec();
    order.sort_by(|a, b| b.cmp(a));
    let mut load = vec![0.0f64; speeds.len()];
    let mut out = vec![Vec::new(); speeds.len()];
    for s in order {
        let c = cost(s as u64, s as u64 * (s as u64 + 1) / 2);
        let (k, _) = load
            .iter()
            .zip(speeds)
            .map(|(l, v)| l + c * v)
            .enumerate()
            .min_by(|a, b| a.1.total_cmp(&b.1).then(a.0.cmp(&b.0)))
            .expect("two replicas or more");
        load[k] += c * speeds[k];
        out[k].push(s);
    }
    out
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

/// The profile's costs of one round: its slots and forward-only microbatches on the
/// replica `replica` ([`crate::costs::sharding::global_rank`]); only the `last` round carries the
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
            fsdp_actions: config.lowering.fsdp.is_some(),
            context_parallel: config.context_parallel,
        },
    )?;
    Ok(if last { c } else { c.without_optimizer() })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(kind: ScheduleKind, pp: u32, v: u32, stages: Vec<Range<usize>>) -> RunConfig {
        RunConfig::new(
            ScheduleSource::Kind(kind),
            pp,
            v,
            stages,
            Policy::FlatFfd,
            Capacity::Dynamic,
        )
    }

    /// Each check names its field: a hand-made run of 6 layers broken one way at a time.
    #[test]
    fn validate_names_the_broken_field() {
        let good = run(ScheduleKind::OneFOneB, 2, 1, vec![0..3, 3..6]);
        good.validate(6).unwrap();
        let field = |c: &RunConfig| match c.validate(6) {
            Err(Error::InvalidArgument { field, .. }) => field,
            other => panic!("{other:?}"),
        };
        let mut c = good.clone();
        c.pp = 0;
        assert_eq!(field(&c), "pp");
        let mut c = good.clone();
        c.dp = 0;
        assert_eq!(field(&c), "dp");
        assert_eq!(
            field(&run(ScheduleKind::ZbV, 2, 1, vec![0..3, 3..6])),
            "vpp"
        );
        assert_eq!(
            field(&run(
                ScheduleKind::OneFOneB,
                2,
                1,
                std::iter::once(0..6).collect()
            )),
            "stages"
        );
        assert_eq!(
            field(&run(ScheduleKind::OneFOneB, 2, 1, vec![0..2, 3..6])),
            "stages[1]"
        );
        assert_eq!(
            field(&run(ScheduleKind::OneFOneB, 2, 1, vec![0..3, 3..3])),
            "stages[1]"
        );
        assert_eq!(
            field(&run(ScheduleKind::OneFOneB, 2, 1, vec![0..3, 3..7])),
            "stages[1]"
        );
        assert_eq!(
            field(&run(ScheduleKind::OneFOneB, 2, 1, vec![0..2, 2..5])),
            "stages"
        );
        let mut c = good.clone();
        c.recompute = vec![Recompute::Full];
        assert_eq!(field(&c), "recompute");
        let mut c = good.clone();
        c.params.chunk_tokens = Some(0);
        assert_eq!(field(&c), "chunk_tokens");
        let mut c = good.clone();
        c.params.microbatches = Some(0);
        assert_eq!(field(&c), "microbatches");
        let mut c = good;
        c.forward_only = Some(ForwardOnlySpec {
            microbatches: Some(0),
            mode: Default::default(),
            loss_dependency: false,
        });
        assert_eq!(field(&c), "forward_only.microbatches");
    }
}
