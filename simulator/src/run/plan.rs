//! The plan file: everything needed to run one pipeline configuration on a workload.

use crate::ir::PlacementKind;
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

/// A pipeline plan (YAML), read by `flatpipe simulate --plan` (and later written by the planner
/// and run by the executor).
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
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Plan {
    /// Model (file or built-in name); with `hardware`, selects the analytic profile.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// Hardware (file or built-in name).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hardware: Option<String>,
    /// A profile file or built-in profile name; overrides `model` and `hardware`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub profile: Option<String>,
    /// Workload (file or built-in name).
    pub workload: String,
    /// Data-parallel degree: pipeline replicas, each taking its share of the step's sequences
    /// (default 1). Ranks = dp x pp, GPUs = tp x dp x pp.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dp: Option<u32>,
    /// Tensor-parallel degree: GPUs per rank, each running a `1/tp` slice of every layer
    /// (default 1; `flatpipe_profiles::Profile::tensor_parallel`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tp: Option<u32>,
    /// Sequence parallelism with `tp > 1` (default true).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sequence_parallel: Option<bool>,
    /// Pipeline-parallel degree: ranks per replica.
    pub pp: u32,
    /// Stages per rank (virtual stages); default: the schedule's (1, 2 for interleaved and V
    /// schedules).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vpp: Option<u32>,
    /// Stage -> rank layout.
    pub placement: PlacementKind,
    /// Schedule family.
    pub schedule: ScheduleKind,
    /// Layer range of every stage, in stage order.
    pub stages: Vec<StageLayers>,
    /// Exactly this many microbatches per step, balanced by predicted cost (give this or
    /// `token_budget`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub microbatches: Option<u32>,
    /// The fewest microbatches of at most this many tokens (first-fit decreasing).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_budget: Option<u64>,
    /// Sequences per step (default: the workload's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seqs_per_step: Option<u32>,
    /// Sequences longer than the token budget are cut into chunks of at most this many
    /// tokens ([`crate::batching::policy::PolicyParams::chunk_tokens`]); absent: not cut.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub chunk_tokens: Option<u64>,
    /// Tokens per step (instead of sequences).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens_per_step: Option<u64>,
    /// Microbatching policy (`flat-ffd` when absent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub policy: Option<crate::batching::policy::Policy>,
    /// Activation recomputation per stage (none everywhere when absent).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub recompute: Vec<crate::costs::Recompute>,
    /// How the data-parallel replicas shard their state (`ddp`, `zero1`, `zero2`, `fsdp`,
    /// `fsdp-mb`, `hsdp`; `ddp` when absent).
    #[serde(default, skip_serializing_if = "is_ddp")]
    pub sharding: crate::costs::sharding::Sharding,
    /// Forward-only work each step carries (a frozen reference or teacher forward), planned with
    /// the training schedule.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub forward_only: Option<crate::run::config::ForwardOnlySpec>,
    /// Seed of the step sampler.
    #[serde(default)]
    pub seed: u64,
    /// What the planner predicted for this plan (informational; `simulate --plan` recomputes).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub predicted: Option<Predicted>,
    /// Where the plan came from: hashes of the profile and workload it was planned on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub provenance: Option<PlanProvenance>,
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
    /// The tensor-parallel degree (1 when absent) and whether sequence parallelism is on.
    pub fn tensor_parallel(&self) -> (u32, bool) {
        (self.tp.unwrap_or(1), self.sequence_parallel.unwrap_or(true))
    }
}

fn is_ddp(s: &crate::costs::sharding::Sharding) -> bool {
    *s == crate::costs::sharding::Sharding::Ddp
}

impl Plan {
    /// A plan of `schedule` on `pp` ranks over `stages` (layer ranges `[start, end)`, in stage
    /// order) on `workload` at the token budget `token_budget` (tokens), with the schedule's
    /// placement for its default stages per rank and every other field absent: one replica,
    /// no recomputation, no forward-only work, seed 0, no prediction or provenance. Nothing is
    /// checked here ([`Plan::validate`] does).
    pub fn new(
        workload: &str,
        schedule: ScheduleKind,
        pp: u32,
        stages: &[Range<usize>],
        token_budget: u64,
    ) -> Self {
        Plan {
            model: None,
            hardware: None,
            profile: None,
            workload: workload.into(),
            dp: None,
            tp: None,
            sequence_parallel: None,
            pp,
            vpp: None,
            placement: schedule.placement(),
            schedule,
            stages: stages
                .iter()
                .map(|r| StageLayers {
                    start: r.start,
                    end: r.end,
                })
                .collect(),
            microbatches: None,
            token_budget: Some(token_budget),
            seqs_per_step: None,
            chunk_tokens: None,
            tokens_per_step: None,
            policy: None,
            recompute: Vec::new(),
            sharding: Default::default(),
            forward_only: None,
            seed: 0,
            predicted: None,
            provenance: None,
        }
    }

    /// Parses a plan file's text. `origin` names the file in errors.
    ///
    /// # Errors
    /// [`flatpipe_profiles::Error::Yaml`] (wrapped) for malformed YAML.
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
    /// [`flatpipe_profiles::Error::Yaml`] (wrapped) if serialization fails.
    pub fn to_yaml(&self) -> Result<String> {
        serde_yaml::to_string(self).map_err(|e| {
            flatpipe_profiles::Error::Yaml {
                path: "plan".into(),
                message: e.to_string(),
            }
            .into()
        })
    }

    /// How the step is cut into microbatches (`token_budget` or `microbatches`).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] unless exactly one of the two is given, and it is >= 1.
    pub fn microbatching(&self) -> Result<Microbatching> {
        match (self.microbatches, self.token_budget) {
            (Some(0), None) => Err(Error::invalid("microbatches", 0, ">= 1")),
            (None, Some(0)) => Err(Error::invalid("token_budget", 0, ">= 1 token")),
            (Some(m), None) => Ok(Microbatching::Microbatches(m)),
            (None, Some(t)) => Ok(Microbatching::TokenBudget(t)),
            _ => Err(Error::invalid(
                "microbatches / token_budget",
                "both or neither",
                "give exactly one of the two",
            )),
        }
    }

    /// The run this plan file describes: schedule, layout, microbatching (`token_budget`, or
    /// exactly `microbatches` balanced by cost), policy (`flat-ffd` when absent), data
    /// parallelism, recomputation, forward-only work, and zb-auto's memory limit (the one the
    /// plan was searched under, when its prediction records it); dynamic capacity.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a vpp the schedule does not run or a microbatching that
    /// gives neither or both of `token_budget` and `microbatches`.
    pub fn run_config(&self) -> Result<crate::run::config::RunConfig> {
        use crate::batching::policy::{Policy, PolicyParams};
        use crate::run::config::{Capacity, ScheduleSource};
        let v = self.schedule.stages_per_rank(self.vpp)?;
        let (microbatches, token_budget) = match self.microbatching()? {
            Microbatching::Microbatches(m) => {
                (Some(m), crate::batching::policy::DEFAULT_TOKEN_BUDGET)
            }
            Microbatching::TokenBudget(t) => (None, t),
        };
        let mut c = crate::run::config::RunConfig::new(
            ScheduleSource::Kind(self.schedule),
            self.pp,
            v,
            self.stage_ranges(),
            self.policy.unwrap_or(Policy::FlatFfd),
            Capacity::Dynamic,
        );
        c.params = PolicyParams {
            token_budget,
            microbatches,
            chunk_tokens: self.chunk_tokens,
            ..PolicyParams::default()
        };
        c.dp = self.dp.unwrap_or(1);
        c.recompute = self.recompute.clone();
        c.sharding = self.sharding;
        c.forward_only = self.forward_only;
        c.memory_limit_bytes = self.predicted.as_ref().map(|p| p.memory_limit_bytes);
        Ok(c)
    }

    /// The stages' layer ranges.
    pub fn stage_ranges(&self) -> Vec<Range<usize>> {
        self.stages.iter().map(|s| s.start..s.end).collect()
    }

    /// Checks the plan against a model of `num_layers` layers.
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
        if self.tp == Some(0) {
            return Err(in_file(Error::invalid("tp", 0, ">= 1 GPU per rank")));
        }
        if self.pp == 0 {
            return Err(in_file(Error::invalid("pp", 0, ">= 1 rank")));
        }
        let v = self
            .schedule
            .stages_per_rank(self.vpp)
            .map_err(|e| match e {
                Error::InvalidArgument { value, allowed, .. } => in_file(Error::InvalidArgument {
                    field: "vpp".into(),
                    value,
                    allowed,
                }),
                other => other,
            })?;
        if let Some(asked) = self.vpp
            && asked != v
        {
            return Err(in_file(Error::invalid(
                "vpp",
                asked,
                format!(
                    "{v}: schedule {} runs {v} stage(s) per rank (interleaved-1f1b and looped-bfs take any vpp, zb-auto 1 or 2)",
                    self.schedule
                ),
            )));
        }
        self.microbatching().map_err(in_file)?;
        // Every check of the run itself, once (stages, dp, recomputation, sizes).
        self.run_config()
            .and_then(|run| run.validate(num_layers))
            .map_err(in_file)?;
        if self.placement != self.schedule.placement_for(v) {
            return Err(in_file(Error::invalid(
                "placement",
                format!("{:?}", self.placement).to_lowercase(),
                format!(
                    "schedule {} uses {:?} placement",
                    self.schedule,
                    self.schedule.placement_for(v)
                )
                .to_lowercase(),
            )));
        }
        Ok(())
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

    fn plan(stages: &[(usize, usize)], vpp: Option<u32>) -> Plan {
        let ranges: Vec<Range<usize>> = stages.iter().map(|&(a, b)| a..b).collect();
        let mut p = Plan::new("w", ScheduleKind::OneFOneB, 2, &ranges, 1024);
        p.vpp = vpp;
        p
    }

    /// Each way a hand-edited stage list goes wrong is named as it is (every one was reported
    /// as "must start at N" even when it did start there); a vpp the schedule does not run is
    /// refused instead of ignored.
    #[test]
    fn a_bad_stage_list_says_what_is_wrong() {
        let e = |p: Plan| p.validate("p.yaml", 10).unwrap_err().to_string();
        let past = e(plan(&[(0, 5), (5, 11)], None));
        assert!(
            past.contains("at most 10") && !past.contains("must start"),
            "{past}"
        );
        let empty = e(plan(&[(0, 5), (5, 5)], None));
        assert!(
            empty.contains("empty") && !empty.contains("must start"),
            "{empty}"
        );
        let gap = e(plan(&[(0, 5), (6, 10)], None));
        assert!(gap.contains("must start at 5"), "{gap}");
        let vpp = e(plan(&[(0, 5), (5, 10)], Some(2)));
        assert!(
            vpp.contains("vpp") && vpp.contains("1 stage(s) per rank"),
            "{vpp}"
        );
        plan(&[(0, 5), (5, 10)], Some(1))
            .validate("p.yaml", 10)
            .unwrap();
    }

    /// A plan file is one run: what `simulate --plan` and `execute --plan` both start from.
    #[test]
    fn a_plan_file_is_one_run_config() {
        let mut p = plan(&[(0, 5), (5, 10)], None);
        p.dp = Some(2);
        p.token_budget = None;
        p.microbatches = Some(6);
        p.policy = Some(crate::batching::policy::Policy::FlatBalanced);
        let c = p.run_config().unwrap();
        assert_eq!((c.pp, c.v, c.dp), (2, 1, 2));
        assert_eq!(c.stages, vec![0..5, 5..10]);
        assert_eq!(c.params.microbatches, Some(6));
        assert_eq!(c.policy, crate::batching::policy::Policy::FlatBalanced);
        assert_eq!(c.capacity, crate::run::config::Capacity::Dynamic);
        p.microbatches = None;
        assert!(
            p.run_config().is_err(),
            "neither token_budget nor microbatches"
        );
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
                    p.model = model;
                    p.hardware = hardware;
                    p.profile = profile;
                    p.seqs_per_step = seqs;
                    p.tokens_per_step = tokens;
                    p.seed = seed;
                    p.vpp = vpp;
                    p.dp = dp;
                    p.tp = tp;
                    p.sequence_parallel = sp;
                    p.microbatches = microbatches;
                    p.token_budget = budget;
                    p.chunk_tokens = chunk;
                    p.policy = policy;
                    p.recompute = recompute;
                    p.sharding = sharding;
                    p.forward_only =
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
