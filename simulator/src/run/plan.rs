//! The plan file: everything needed to run one pipeline configuration on a workload.

use crate::batching::policy::{DEFAULT_TOKEN_BUDGET, Policy, PolicyParams};
use crate::costs::Recompute;
use crate::costs::sharding::Sharding;
use crate::ir::PlacementKind;
use crate::ir::lowering::Lowering;
use crate::run::config::{Capacity, ForwardOnlySpec, RunConfig, ScheduleSource};
use crate::schedules::generators::ScheduleKind;
use crate::{Error, Result};
use serde::{Deserialize, Serialize};
use std::ops::Range;

/// How a step's sequences become microbatches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Microbatching {
    /// Exactly this many microbatches, balanced by predicted cost (attention included).
    Microbatches(u32),
    /// The fewest microbatches of at most this many tokens (first-fit decreasing).
    TokenBudget(u64),
}

/// A contiguous range of the model's layer list `[start, end)` (0 is the embedding, the last
/// is the head).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StageLayers {
    /// First layer of the stage.
    pub start: usize,
    /// One past the last layer of the stage.
    pub end: usize,
}

/// A pipeline plan: one run ([`RunConfig`]), the inputs it was planned on, and what the planner
/// predicted for it. `flatpipe plan -o` writes it, `simulate --plan` and `execute --plan` read
/// it. Its file is flat YAML ([`PlanFile`], every field in docs/reference.md):
///
/// ```yaml
/// model: llama3.1-8b        # or `profile: my-profile.yaml`
/// hardware: h200
/// workload: sharegpt-v3
/// pp: 4
/// placement: loop
/// schedule: 1f1b
/// stages:                   # layer ranges [start, end) of stages 0..pp*vpp
///   - {start: 0, end: 9}
///   - {start: 9, end: 18}
///   - {start: 18, end: 26}
///   - {start: 26, end: 34}
/// token_budget: 16384            # or `microbatches: 8`
/// seqs_per_step: 128
/// seed: 0
/// ```
///
/// Reading a file checks what the file alone decides (the schedule runs the vpp and placement
/// given, exactly one of `token_budget` and `microbatches`, `tp >= 1`); [`Plan::validate`]
/// checks the run against the model. Writing and reading a plan gives the same plan (a
/// property test).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(try_from = "PlanFile", into = "PlanFile")]
pub struct Plan {
    /// How the plan's inputs were named and how its steps are sampled.
    pub inputs: PlanInputs,
    /// The run: a schedule family ([`ScheduleSource::Kind`]; a plan file cannot hold a given
    /// schedule), dynamic capacity, the default padded / packed parameters, and zb-auto's
    /// memory limit equal to the prediction's (`None` without one).
    pub run: RunConfig,
    /// Tensor-parallel degree: GPUs per rank, each running a `1/tp` slice of every layer
    /// (`flatpipe_profiles::Profile::tensor_parallel`), >= 1.
    pub tp: u32,
    /// Sequence parallelism with `tp > 1` (true when `tp` is 1).
    pub sequence_parallel: bool,
    /// Expert-parallel degree: data-parallel replicas that split each mixture-of-experts
    /// layer's routed experts (`flatpipe_profiles::Profile::expert_parallel`), >= 1, a divisor
    /// of `dp`.
    pub ep: u32,
    /// What the planner predicted (informational; `simulate --plan` recomputes).
    pub predicted: Option<Predicted>,
    /// Where the plan came from: hashes of the profile and workload it was planned on.
    pub provenance: Option<PlanProvenance>,
}

/// What a plan file names besides its run: how its inputs were given (built-in names or
/// paths, as the user typed them) and how its steps are sampled.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct PlanInputs {
    /// Model (file or built-in name); with `hardware`, selects the analytic profile.
    pub model: Option<String>,
    /// Hardware (file or built-in name).
    pub hardware: Option<String>,
    /// A profile file or built-in profile name; overrides `model` and `hardware`.
    pub profile: Option<String>,
    /// Workload (file or built-in name).
    pub workload: String,
    /// Sequences per step (default: the workload's).
    pub seqs_per_step: Option<u32>,
    /// Tokens per step (instead of sequences).
    pub tokens_per_step: Option<u64>,
    /// Seed of the step sampler.
    pub seed: u64,
}

/// A plan file as written: flat YAML, each field optional where it has a default. The one
/// place the file format is spelled out; [`Plan`] is what it means.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PlanFile {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    model: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    hardware: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    profile: Option<String>,
    workload: String,
    /// Data-parallel degree (default 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    dp: Option<u32>,
    /// Tensor-parallel degree (default 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    tp: Option<u32>,
    /// Sequence parallelism with `tp > 1` (default true).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    sequence_parallel: Option<bool>,
    /// Expert-parallel degree (default 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    ep: Option<u32>,
    pp: u32,
    /// Stages per rank; default: the schedule's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    vpp: Option<u32>,
    placement: PlacementKind,
    schedule: ScheduleKind,
    stages: Vec<StageLayers>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    microbatches: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    token_budget: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    seqs_per_step: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    chunk_tokens: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    tokens_per_step: Option<u64>,
    /// Default flat-ffd.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    policy: Option<Policy>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    recompute: Vec<Recompute>,
    #[serde(default, skip_serializing_if = "is_ddp")]
    sharding: Sharding,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    forward_only: Option<ForwardOnlySpec>,
    /// Context parallelism: `{cp, comm, balance[, max_seqlen_per_rank]}` (default none: one
    /// GPU per pipeline rank and tensor-parallel slice).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    context_parallel: Option<flatpipe_profiles::context_parallel::ContextParallel>,
    /// How the pipeline's transfers are posted and on which streams (default: ahead receives on
    /// per-peer streams, the uncontended links).
    #[serde(default, skip_serializing_if = "is_uncontended")]
    lowering: Lowering,
    #[serde(default)]
    seed: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    predicted: Option<Predicted>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    provenance: Option<PlanProvenance>,
}

fn is_ddp(s: &Sharding) -> bool {
    *s == Sharding::Ddp
}

fn is_uncontended(l: &Lowering) -> bool {
    *l == Lowering::UNCONTENDED
}

impl TryFrom<PlanFile> for Plan {
    type Error = Error;

    /// What the file means: its run with every default filled in.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] naming the field: `tp` 0, a vpp or placement the schedule
    /// does not run, neither or both of `token_budget` and `microbatches` (or either 0).
    fn try_from(f: PlanFile) -> Result<Plan> {
        if f.tp == Some(0) {
            return Err(Error::invalid("tp", 0, ">= 1 GPU per rank"));
        }
        let v = f.schedule.stages_per_rank(f.vpp).map_err(|e| match e {
            Error::InvalidArgument { value, allowed, .. } => Error::InvalidArgument {
                field: "vpp".into(),
                value,
                allowed,
            },
            other => other,
        })?;
        if let Some(asked) = f.vpp
            && asked != v
        {
            return Err(Error::invalid(
                "vpp",
                asked,
                format!(
                    "{v}: schedule {} runs {v} stage(s) per rank (interleaved-1f1b and looped-bfs take any vpp, zb-auto 1 or 2)",
                    f.schedule
                ),
            ));
        }
        if f.placement != f.schedule.placement_for(v) {
            return Err(Error::invalid(
                "placement",
                format!("{:?}", f.placement).to_lowercase(),
                format!(
                    "schedule {} uses {:?} placement",
                    f.schedule,
                    f.schedule.placement_for(v)
                )
                .to_lowercase(),
            ));
        }
        let microbatches = match (f.microbatches, f.token_budget) {
            (Some(0), None) => return Err(Error::invalid("microbatches", 0, ">= 1")),
            (None, Some(0)) => return Err(Error::invalid("token_budget", 0, ">= 1 token")),
            (Some(m), None) => Microbatching::Microbatches(m),
            (None, Some(t)) => Microbatching::TokenBudget(t),
            _ => {
                return Err(Error::invalid(
                    "microbatches / token_budget",
                    "both or neither",
                    "give exactly one of the two",
                ));
            }
        };
        let mut run = RunConfig::new(
            ScheduleSource::Kind(f.schedule),
            f.pp,
            v,
            f.stages.iter().map(|s| s.start..s.end).collect(),
            f.policy.unwrap_or(Policy::FlatFfd),
            Capacity::Dynamic,
        );
        run.params = PolicyParams {
            token_budget: match microbatches {
                Microbatching::TokenBudget(t) => t,
                Microbatching::Microbatches(_) => DEFAULT_TOKEN_BUDGET,
            },
            microbatches: match microbatches {
                Microbatching::Microbatches(m) => Some(m),
                Microbatching::TokenBudget(_) => None,
            },
            chunk_tokens: f.chunk_tokens,
            ..PolicyParams::default()
        };
        run.dp = f.dp.unwrap_or(1);
        run.recompute = f.recompute;
        run.sharding = f.sharding;
        run.forward_only = f.forward_only;
        run.lowering = f.lowering;
        run.context_parallel = f.context_parallel;
        // zb-auto plans were searched under the prediction's memory limit: built under it too.
        run.memory_limit_bytes = f.predicted.as_ref().map(|p| p.memory_limit_bytes);
        let tp = f.tp.unwrap_or(1);
        Ok(Plan {
            inputs: PlanInputs {
                model: f.model,
                hardware: f.hardware,
                profile: f.profile,
                workload: f.workload,
                seqs_per_step: f.seqs_per_step,
                tokens_per_step: f.tokens_per_step,
                seed: f.seed,
            },
            run,
            tp,
            sequence_parallel: tp == 1 || f.sequence_parallel.unwrap_or(true),
            ep: f.ep.unwrap_or(1),
            predicted: f.predicted,
            provenance: f.provenance,
        })
    }
}

impl From<Plan> for PlanFile {
    /// The file of a plan: every field of its run written out (dp, vpp and the policy too),
    /// `tp` and `sequence_parallel` only with `tp > 1`. A run of a given schedule (not a
    /// family) writes its schedule's name as 1F1B's; [`Plan::to_yaml`] refuses it first.
    fn from(p: Plan) -> PlanFile {
        let schedule = p.schedule().unwrap_or(ScheduleKind::OneFOneB);
        let run = p.run;
        let (microbatches, token_budget) = match run.params.microbatches {
            Some(m) => (Some(m), None),
            None => (None, Some(run.params.token_budget)),
        };
        PlanFile {
            model: p.inputs.model,
            hardware: p.inputs.hardware,
            profile: p.inputs.profile,
            workload: p.inputs.workload,
            dp: Some(run.dp),
            tp: (p.tp > 1).then_some(p.tp),
            sequence_parallel: (p.tp > 1).then_some(p.sequence_parallel),
            ep: (p.ep > 1).then_some(p.ep),
            pp: run.pp,
            vpp: Some(run.v),
            placement: schedule.placement_for(run.v),
            schedule,
            stages: run
                .stages
                .iter()
                .map(|r| StageLayers {
                    start: r.start,
                    end: r.end,
                })
                .collect(),
            microbatches,
            token_budget,
            seqs_per_step: p.inputs.seqs_per_step,
            chunk_tokens: run.params.chunk_tokens,
            tokens_per_step: p.inputs.tokens_per_step,
            policy: Some(run.policy),
            recompute: run.recompute,
            sharding: run.sharding,
            forward_only: run.forward_only,
            context_parallel: run.context_parallel,
            lowering: run.lowering,
            seed: p.inputs.seed,
            predicted: p.predicted,
            provenance: p.provenance,
        }
    }
}

/// The planner's prediction for a plan.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Predicted {
    /// Mean step time over the sampled steps, seconds.
    pub step_time_mean_s: f64,
    /// 90th percentile step time, seconds.
    pub step_time_p90_s: f64,
    /// Mean bubble ratio.
    pub bubble_ratio: f64,
    /// Lower bound on the mean step time (perfectly balanced stages, no bubble), seconds.
    pub lower_bound_s: f64,
    /// Peak memory per pipeline rank (parameters, gradients, optimizer state, activations), bytes.
    pub peak_memory_bytes: Vec<f64>,
    /// The per-rank memory limit planned against, bytes.
    pub memory_limit_bytes: f64,
    /// Steps sampled.
    pub steps: u32,
}

/// Hashes of a plan's inputs (SHA-256 of their canonical YAML / samples).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PlanProvenance {
    /// SHA-256 of the profile as YAML.
    pub profile_sha256: String,
    /// SHA-256 of the workload's definition and samples.
    pub workload_sha256: String,
    /// flatpipe version that planned it.
    pub flatpipe_version: String,
}

impl Plan {
    /// A plan of `schedule` on `pp` ranks over `stages` (layer ranges `[start, end)`, in stage
    /// order) on `workload` at the token budget `token_budget` (tokens), with the schedule's
    /// default stages per rank and every other field at its default: one replica, no tensor
    /// parallelism, flat-ffd, no recomputation, no forward-only work, seed 0, no prediction or
    /// provenance. Nothing is checked here ([`Plan::validate`] does).
    pub fn new(
        workload: &str,
        schedule: ScheduleKind,
        pp: u32,
        stages: &[Range<usize>],
        token_budget: u64,
    ) -> Self {
        let v = schedule.stages_per_rank(None).unwrap_or(1);
        let mut run = RunConfig::new(
            ScheduleSource::Kind(schedule),
            pp,
            v,
            stages.to_vec(),
            Policy::FlatFfd,
            Capacity::Dynamic,
        );
        run.params.token_budget = token_budget;
        Plan {
            inputs: PlanInputs {
                workload: workload.into(),
                ..PlanInputs::default()
            },
            run,
            tp: 1,
            sequence_parallel: true,
            ep: 1,
            predicted: None,
            provenance: None,
        }
    }

    /// The schedule family the plan runs (`None` for a run of a given schedule, which a plan
    /// file cannot hold).
    pub fn schedule(&self) -> Option<ScheduleKind> {
        match &self.run.source {
            ScheduleSource::Kind(k) => Some(*k),
            ScheduleSource::Given(_) => None,
        }
    }

    /// The stage -> rank layout of the plan's schedule at its stages per rank.
    pub fn placement(&self) -> PlacementKind {
        match &self.run.source {
            ScheduleSource::Kind(k) => k.placement_for(self.run.v),
            ScheduleSource::Given(s) => s.placement.kind,
        }
    }

    /// The tensor-parallel degree and whether sequence parallelism is on.
    pub fn tensor_parallel(&self) -> (u32, bool) {
        (self.tp, self.sequence_parallel)
    }

    /// The per-GPU profile of this plan's layout: `profile` split by its tensor parallelism,
    /// then by its expert parallelism.
    ///
    /// # Errors
    /// [`flatpipe_profiles::Error::Invalid`] from either split.
    pub fn per_gpu(
        &self,
        profile: &flatpipe_profiles::Profile,
    ) -> flatpipe_profiles::Result<flatpipe_profiles::Profile> {
        profile
            .tensor_parallel(self.tp, self.sequence_parallel)?
            .expert_parallel(self.ep, self.tp, self.sequence_parallel)
    }

    /// Parses a plan file's text. `origin` names the file in errors.
    ///
    /// # Errors
    /// [`flatpipe_profiles::Error::Yaml`] (wrapped) for malformed YAML, an unknown field, or a
    /// field [`PlanFile`]'s conversion refuses (named in the message).
    pub fn from_yaml(text: &str, origin: &str) -> Result<Self> {
        serde_yaml::from_str(text).map_err(|e| {
            flatpipe_profiles::Error::Yaml {
                path: origin.into(),
                message: e.to_string(),
            }
            .into()
        })
    }

    /// The plan as YAML text.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a run of a given schedule (a plan file names a schedule
    /// family); [`flatpipe_profiles::Error::Yaml`] (wrapped) if serialization fails.
    pub fn to_yaml(&self) -> Result<String> {
        if self.schedule().is_none() {
            return Err(Error::invalid(
                "schedule",
                self.run.source.name(),
                "a schedule family (a plan file cannot hold a given schedule)",
            ));
        }
        serde_yaml::to_string(self).map_err(|e| {
            flatpipe_profiles::Error::Yaml {
                path: "plan".into(),
                message: e.to_string(),
            }
            .into()
        })
    }

    /// How the step is cut into microbatches (`token_budget` or `microbatches`).
    pub fn microbatching(&self) -> Microbatching {
        match self.run.params.microbatches {
            Some(m) => Microbatching::Microbatches(m),
            None => Microbatching::TokenBudget(self.run.params.token_budget),
        }
    }

    /// The run this plan describes (a copy of [`Plan::run`]).
    ///
    /// # Errors
    /// None today; kept fallible for the front ends that call it.
    pub fn run_config(&self) -> Result<RunConfig> {
        Ok(self.run.clone())
    }

    /// The stages' layer ranges.
    pub fn stage_ranges(&self) -> Vec<Range<usize>> {
        self.run.stages.clone()
    }

    /// Checks the plan against a model of `num_layers` layers ([`RunConfig::validate`]), with
    /// `origin` (the file) before every field's name.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] naming the field and the allowed range.
    pub fn validate(&self, origin: &str, num_layers: usize) -> Result<()> {
        let in_file = |e: Error| match e {
            Error::InvalidArgument {
                field,
                value,
                allowed,
            } => Error::InvalidArgument {
                field: format!("{origin}: {field}"),
                value,
                allowed,
            },
            other => other,
        };
        if self.tp == 0 {
            return Err(in_file(Error::invalid("tp", 0, ">= 1 GPU per rank")));
        }
        if self.ep == 0 || self.run.dp % self.ep != 0 {
            return Err(in_file(Error::invalid(
                "ep",
                self.ep,
                format!(
                    "a divisor of dp = {} (the expert-parallel group is made of data-parallel replicas)",
                    self.run.dp
                ),
            )));
        }
        self.run.validate(num_layers).map_err(in_file)
    }
}

/// Splits `num_layers` layers into `num_stages` contiguous stages whose layer counts differ by
/// at most one (earlier stages get the extra layers).
///
/// # Errors
/// [`Error::InvalidArgument`] if there are more stages than layers or no stages.
pub fn even_split(num_layers: usize, num_stages: usize) -> Result<Vec<Range<usize>>> {
    if num_stages == 0 {
        return Err(Error::invalid("stages", 0, ">= 1"));
    }
    if num_stages > num_layers {
        return Err(Error::invalid(
            "stages (pp x vpp)",
            num_stages,
            format!(
                "at most the model's {num_layers} layers (embedding, decoders and head), one layer or more per stage"
            ),
        ));
    }
    let (q, r) = (num_layers / num_stages, num_layers % num_stages);
    let mut start = 0;
    Ok((0..num_stages)
        .map(|s| {
            let len = q + usize::from(s < r);
            let range = start..start + len;
            start += len;
            range
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn even_split_covers_every_layer_once() {
        assert_eq!(
            even_split(34, 4).unwrap(),
            vec![0..9, 9..18, 18..26, 26..34]
        );
        assert_eq!(even_split(10, 3).unwrap(), vec![0..4, 4..7, 7..10]);
        let e = even_split(34, 35).unwrap_err().to_string();
        assert!(e.contains("35") && e.contains("34 layers"), "{e}");
    }

    fn plan(stages: &[(usize, usize)]) -> Plan {
        let ranges: Vec<Range<usize>> = stages.iter().map(|&(a, b)| a..b).collect();
        Plan::new("w", ScheduleKind::OneFOneB, 2, &ranges, 1024)
    }

    /// A 1F1B plan file on 2 ranks with `extra` lines appended.
    fn file(extra: &str) -> String {
        format!(
            "workload: w\npp: 2\nplacement: loop\nschedule: 1f1b\nstages:\n- {{start: 0, end: 5}}\n- {{start: 5, end: 10}}\n{extra}"
        )
    }

    /// Each way a hand-edited stage list goes wrong is named as it is (every one was reported
    /// as "must start at N" even when it did start there).
    #[test]
    fn a_bad_stage_list_says_what_is_wrong() {
        let e = |p: Plan| p.validate("p.yaml", 10).unwrap_err().to_string();
        let past = e(plan(&[(0, 5), (5, 11)]));
        assert!(
            past.contains("at most 10") && !past.contains("must start"),
            "{past}"
        );
        let empty = e(plan(&[(0, 5), (5, 5)]));
        assert!(
            empty.contains("empty") && !empty.contains("must start"),
            "{empty}"
        );
        let gap = e(plan(&[(0, 5), (6, 10)]));
        assert!(
            gap.contains("p.yaml: stages[1]") && gap.contains("must start at 5"),
            "{gap}"
        );
        plan(&[(0, 5), (5, 10)]).validate("p.yaml", 10).unwrap();
    }

    /// What the file alone decides is refused as it is read, naming the file and the field: a
    /// vpp the schedule does not run (instead of ignored), a placement it does not use, neither
    /// or both of the microbatchings, a field the format does not have.
    #[test]
    fn expert_parallelism_round_trips_and_divides_dp() {
        let p = Plan::from_yaml(&file("token_budget: 8\ndp: 4\nep: 2\n"), "p.yaml").unwrap();
        assert_eq!(p.ep, 2);
        p.validate("p.yaml", 10).unwrap();
        let again = Plan::from_yaml(&p.to_yaml().unwrap(), "q.yaml").unwrap();
        assert_eq!(again.ep, 2);
        let q = Plan::from_yaml(&file("token_budget: 8\ndp: 4\nep: 3\n"), "p.yaml").unwrap();
        let e = q.validate("p.yaml", 10).unwrap_err().to_string();
        assert!(
            e.contains("p.yaml: ep") && e.contains("a divisor of dp = 4"),
            "{e}"
        );
        // Without it, 1 and nothing written.
        let r = Plan::from_yaml(&file("token_budget: 8\n"), "p.yaml").unwrap();
        assert_eq!(r.ep, 1);
        assert!(!r.to_yaml().unwrap().lines().any(|l| l.starts_with("ep:")));
    }

    /// Context parallelism is one field of the file, its communication written as its flag
    /// value; a group the file cannot run is refused by validation, naming the field.
    #[test]
    fn context_parallelism_round_trips_and_is_checked() {
        use flatpipe_profiles::context_parallel::{CpBalance, CpComm};
        let text = file(
            "token_budget: 8\ncontext_parallel: {cp: 4, comm: a2a+p2p:2, balance: zigzag, max_seqlen_per_rank: 8192}\n",
        );
        let p = Plan::from_yaml(&text, "p.yaml").unwrap();
        let cp = p.run.context_parallel.unwrap();
        assert_eq!(
            (cp.cp, cp.comm, cp.balance, cp.max_seqlen_per_rank),
            (
                4,
                CpComm::Hierarchical { a2a: 2 },
                CpBalance::Zigzag,
                Some(8192)
            )
        );
        p.validate("p.yaml", 10).unwrap();
        let yaml = p.to_yaml().unwrap();
        assert!(yaml.contains("comm: a2a+p2p:2"), "{yaml}");
        assert_eq!(Plan::from_yaml(&yaml, "q.yaml").unwrap(), p);
        let bad = Plan::from_yaml(
            &file("token_budget: 8\ncontext_parallel: {cp: 6, comm: a2a+p2p:4, balance: zigzag}\n"),
            "p.yaml",
        )
        .unwrap();
        let e = bad.validate("p.yaml", 10).unwrap_err().to_string();
        assert!(
            e.contains("p.yaml: context_parallel") && e.contains("a divisor of cp = 6"),
            "{e}"
        );
        let comm = Plan::from_yaml(
            &file("token_budget: 8\ncontext_parallel: {cp: 2, comm: ring, balance: zigzag}\n"),
            "p.yaml",
        )
        .unwrap_err()
        .to_string();
        assert!(comm.contains("p2p (ring)"), "{comm}");
    }

    #[test]
    fn a_file_the_schedule_cannot_run_is_refused_as_it_is_read() {
        let e = |extra: &str| {
            Plan::from_yaml(&file(extra), "p.yaml")
                .unwrap_err()
                .to_string()
        };
        let vpp = e("vpp: 2\ntoken_budget: 8\n");
        assert!(
            vpp.contains("p.yaml") && vpp.contains("vpp") && vpp.contains("1 stage(s) per rank"),
            "{vpp}"
        );
        let neither = e("");
        assert!(neither.contains("exactly one of the two"), "{neither}");
        let both = e("token_budget: 8\nmicrobatches: 2\n");
        assert!(both.contains("exactly one of the two"), "{both}");
        let unknown = e("token_budget: 8\nbudget: 9\n");
        assert!(unknown.contains("unknown field `budget`"), "{unknown}");
        let placement = Plan::from_yaml(
            &file("token_budget: 8\n").replace("placement: loop", "placement: v"),
            "p.yaml",
        )
        .unwrap_err()
        .to_string();
        assert!(placement.contains("uses loop placement"), "{placement}");
        Plan::from_yaml(&file("vpp: 1\ntoken_budget: 8\n"), "p.yaml").unwrap();
    }

    /// A plan file is one run: what `simulate --plan` and `execute --plan` both start from,
    /// with the defaults a file leaves out (one replica, flat-ffd, the default token budget
    /// when an exact count is given, dynamic capacity, zb-auto's limit the prediction's).
    #[test]
    fn a_plan_file_is_one_run_config() {
        let p = Plan::from_yaml(
            &file("dp: 2\nmicrobatches: 6\npolicy: flat-balanced\n"),
            "p.yaml",
        )
        .unwrap();
        let c = &p.run;
        assert_eq!((c.pp, c.v, c.dp), (2, 1, 2));
        assert_eq!(c.stages, vec![0..5, 5..10]);
        assert_eq!(c.params.microbatches, Some(6));
        assert_eq!(c.params.token_budget, DEFAULT_TOKEN_BUDGET);
        assert_eq!(c.policy, Policy::FlatBalanced);
        assert_eq!(c.capacity, Capacity::Dynamic);
        assert_eq!(c.memory_limit_bytes, None);
        let q = Plan::from_yaml(&file("token_budget: 512\n"), "p.yaml").unwrap();
        assert_eq!((q.run.dp, q.run.policy), (1, Policy::FlatFfd));
        assert_eq!(
            (q.run.params.microbatches, q.run.params.token_budget),
            (None, 512)
        );
        assert_eq!(q.tensor_parallel(), (1, true));
    }

    mod round_trip {
        use super::super::*;
        use crate::batching::policy::Policy;
        use crate::costs::Recompute;
        use crate::costs::sharding::Sharding;
        use crate::run::config::ForwardOnlySpec;
        use crate::schedules::forward_only::FoMode;
        use proptest::prelude::*;

        /// Text a user may put in a plan's names: letters, digits, YAML's special characters
        /// (`:`, `#`, quotes, `@`, a leading `-`), spaces and non-ASCII.
        fn name() -> impl Strategy<Value = String> {
            "[-a-zA-Z0-9_.:#@' \"/é中]{0,24}"
        }

        fn predicted() -> impl Strategy<Value = Predicted> {
            (
                (0.0..1e6f64, 0.0..1e6f64, 0.0..1.0f64, 0.0..1e6f64),
                prop::collection::vec(0.0..1e15f64, 1..9),
                0.0..1e15f64,
                1..10_000u32,
            )
                .prop_map(|((mean, p90, bubble, bound), peaks, limit, steps)| {
                    Predicted {
                        step_time_mean_s: mean,
                        step_time_p90_s: p90,
                        bubble_ratio: bubble,
                        lower_bound_s: bound,
                        peak_memory_bytes: peaks,
                        memory_limit_bytes: limit,
                        steps,
                    }
                })
        }

        fn plan() -> impl Strategy<Value = Plan> {
            let inputs = (
                prop::option::of(name()),
                prop::option::of(name()),
                prop::option::of(name()),
                name(),
                prop::option::of(1..1_000_000u32),
                prop::option::of(1..u64::MAX),
                any::<u64>(),
            );
            let layout = (
                prop::sample::select(ScheduleKind::ALL.to_vec()),
                1..64u32,
                prop::option::of(1..8u32),
                prop::collection::vec((0..1000usize, 1..100usize), 1..12),
                prop::option::of(1..1024u32),
                prop::option::of(1..64u32),
                prop::option::of(any::<bool>()),
            );
            let batching = (
                prop::option::of(1..4096u32),
                prop::option::of(1..u64::MAX),
                prop::option::of(1..u64::MAX),
                prop::option::of(prop::sample::select(Policy::ALL.to_vec())),
                prop::collection::vec(prop::sample::select(Recompute::ALL.to_vec()), 0..12),
                prop::sample::select(Sharding::ALL.to_vec()),
                prop::option::of((prop::option::of(1..1000u32), any::<bool>(), any::<bool>())),
            );
            let outcome = (
                prop::option::of(predicted()),
                prop::option::of((name(), name(), name())),
            );
            (inputs, layout, batching, outcome).prop_map(
                |(
                    (model, hardware, profile, workload, seqs, tokens, seed),
                    (schedule, pp, vpp, stages, dp, tp, sp),
                    (microbatches, budget, chunk, policy, recompute, sharding, fo),
                    (predicted, provenance),
                )| {
                    let ranges: Vec<Range<usize>> = stages.iter().map(|&(a, n)| a..a + n).collect();
                    let mut p = Plan::new(&workload, schedule, pp, &ranges, 1);
                    p.inputs = PlanInputs {
                        model,
                        hardware,
                        profile,
                        workload,
                        seqs_per_step: seqs,
                        tokens_per_step: tokens,
                        seed,
                    };
                    // The schedule's own stages per rank when it takes only one value.
                    p.run.v = vpp
                        .filter(|&v| schedule.stages_per_rank(Some(v)).ok() == Some(v))
                        .unwrap_or(p.run.v);
                    p.run.dp = dp.unwrap_or(1);
                    // Sequence parallelism means something only with tp > 1.
                    p.tp = tp.unwrap_or(1);
                    p.sequence_parallel = p.tp == 1 || sp.unwrap_or(true);
                    p.run.policy = policy.unwrap_or(Policy::FlatFfd);
                    p.run.params = crate::batching::policy::PolicyParams {
                        microbatches,
                        token_budget: if microbatches.is_some() {
                            DEFAULT_TOKEN_BUDGET
                        } else {
                            budget.unwrap_or(1)
                        },
                        chunk_tokens: chunk,
                        ..Default::default()
                    };
                    p.run.recompute = recompute;
                    p.run.sharding = sharding;
                    p.run.forward_only =
                        fo.map(
                            |(microbatches, separate, loss_dependency)| ForwardOnlySpec {
                                microbatches,
                                mode: if separate {
                                    FoMode::Separate
                                } else {
                                    FoMode::Fused
                                },
                                loss_dependency,
                            },
                        );
                    p.run.memory_limit_bytes =
                        predicted.as_ref().map(|p: &Predicted| p.memory_limit_bytes);
                    p.predicted = predicted;
                    p.provenance = provenance.map(|(a, b, c)| PlanProvenance {
                        profile_sha256: a,
                        workload_sha256: b,
                        flatpipe_version: c,
                    });
                    p
                },
            )
        }

        proptest! {
            /// A plan written as YAML reads back as the same plan, every field (names with
            /// YAML's special characters, the largest integers, floats to the last bit).
            #[test]
            fn a_plan_survives_its_yaml(p in plan()) {
                let text = p.to_yaml().unwrap();
                let back = Plan::from_yaml(&text, "plan.yaml").unwrap();
                prop_assert_eq!(&back, &p, "{}", text);
            }
        }
    }
}
