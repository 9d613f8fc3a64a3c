//! One evaluated candidate ([`Candidate`]): the run configuration the search evaluated it with,
//! its tensor parallelism, what the split solver reported about its layer split, and its
//! simulated distribution.

use super::{RankBy, SearchConfig};
use crate::partition::Partition;
use crate::{Error, Result};
use flatpipe_profiles::Profile;
use flatpipe_simulator::ScheduleKind;
use flatpipe_simulator::batching::policy::{Policy, PolicyParams};
use flatpipe_simulator::costs::sharding::Sharding;
use flatpipe_simulator::run::config::{Capacity, RunConfig, ScheduleSource};
use flatpipe_simulator::run::montecarlo::Summary;
use serde::{Serialize, Serializer};

/// One evaluated candidate: the run the search simulated (`run`, the single description of its
/// layout, token budget, chunk size, sharding, layer split and recomputation), what a run
/// configuration does not describe (tensor parallelism, which transforms the profile, and the
/// split solver's report), and the search's results.
///
/// Serialized (`plan --format json`) as the flat fields `tp`, `sequence_parallel`, `ep`,
/// `context_parallel` (only with a group), `dp`, `pp`,
/// `vpp`, `schedule`, `token_budget`, `chunk_tokens`, `sharding`, `lower_bound_s`, `summary`,
/// `peak_memory_bytes`, in that order.
#[derive(Debug, Clone)]
pub struct Candidate {
    /// The run configuration the search evaluated this candidate with: schedule kind
    /// ([`ScheduleSource::Kind`]), pp, v, dp, sharding, layer range and recomputation of every
    /// stage, the search's microbatching policy with the token budget and chunk size, the
    /// search's memory limit (which zb-auto builds under), state bytes and forward-only work,
    /// dynamic capacity. It runs on [`Candidate::profile`] (one GPU's profile), not on the
    /// searched one when `tp > 1`.
    pub run: RunConfig,
    /// Tensor-parallel degree: GPUs per rank (the candidate's profile is one GPU's,
    /// [`Profile::tensor_parallel`]).
    pub tp: u32,
    /// Sequence parallelism with `tp > 1`.
    pub sequence_parallel: bool,
    /// Expert-parallel degree: data-parallel replicas that split each mixture-of-experts
    /// layer's routed experts ([`Profile::expert_parallel`]; 1 for a dense model).
    pub ep: u32,
    /// What the split solver reported about the split `run` holds.
    pub split: SplitReport,
    /// Lower bound on the mean step time, seconds.
    pub lower_bound_s: f64,
    /// The simulated distribution over the sampled steps.
    pub summary: Summary,
    /// Per pipeline rank: static + peak activation memory (largest over steps), bytes.
    pub peak_memory_bytes: Vec<f64>,
}

/// What the split solver reported about a candidate's split beyond its stages and
/// recomputation (which the candidate's run holds): the rest of its [`Partition`].
#[derive(Debug, Clone, PartialEq)]
pub struct SplitReport {
    /// The largest stage time under the split's cost model, seconds.
    pub bottleneck_s: f64,
    /// Memory of every rank under the split's model, bytes.
    pub rank_memory_bytes: Vec<f64>,
    /// Which solver produced it ([`Partition::solver`]).
    pub solver: &'static str,
    /// A certified lower bound on the optimal bottleneck (the memory-free optimum), seconds.
    pub lower_bound_s: f64,
    /// Whether the split is proven optimal.
    pub optimal: bool,
}

impl SplitReport {
    /// `partition`'s report, its stages and recomputation left out.
    pub fn of(partition: Partition) -> Self {
        SplitReport {
            bottleneck_s: partition.bottleneck_s,
            rank_memory_bytes: partition.rank_memory_bytes,
            solver: partition.solver,
            lower_bound_s: partition.lower_bound_s,
            optimal: partition.optimal,
        }
    }
}

impl Candidate {
    /// The ranking statistic, seconds.
    pub fn score(&self, by: RankBy) -> f64 {
        match by {
            RankBy::Mean => self.summary.step_time_s.mean,
            RankBy::P90 => self.summary.step_time_s.p90,
        }
    }

    /// The profile this candidate is simulated on: one GPU of its tensor-parallel group and
    /// expert-parallel group ([`Profile::tensor_parallel`], then [`Profile::expert_parallel`],
    /// of the searched `base`).
    ///
    /// # Errors
    /// As those (not for a profile the search accepted this tp and ep on).
    pub fn profile(&self, base: &Profile) -> Result<Profile> {
        base.tensor_parallel(self.tp, self.sequence_parallel)
            .and_then(|p| p.expert_parallel(self.ep, self.tp, self.sequence_parallel))
            .map_err(|e| Error::Simulator(e.into()))
    }

    /// The schedule kind of `run` (`None` for a schedule given as data, which the search
    /// never builds).
    pub fn schedule(&self) -> Option<ScheduleKind> {
        match &self.run.source {
            ScheduleSource::Kind(k) => Some(*k),
            ScheduleSource::Given(_) => None,
        }
    }

    /// Token budget per microbatch (`run`'s policy parameters).
    pub fn token_budget(&self) -> u64 {
        self.run.params.token_budget
    }

    /// Sequences longer than the budget cut into chunks of at most this many tokens (`None`:
    /// each gets a microbatch of its own; `run`'s policy parameters).
    pub fn chunk_tokens(&self) -> Option<u64> {
        self.run.params.chunk_tokens
    }

    /// `schedule tp=.. ep=.. cp=.. dp=.. pp=.. v=.. budget=..[ chunk=..] sharding` (`tp=..`
    /// and `ep=..` only above 1, `cp=N comm balance[ dynamic=T]` only with a context-parallel
    /// group, `chunk=..` only when long sequences are cut).
    pub fn describe(&self) -> String {
        format!(
            "{} {}{}{}dp={} pp={} v={} budget={}{} {}",
            self.schedule_name(),
            if self.tp > 1 {
                format!("tp={} ", self.tp)
            } else {
                String::new()
            },
            if self.ep > 1 {
                format!("ep={} ", self.ep)
            } else {
                String::new()
            },
            super::enumerate::cp_prefix(self.run.context_parallel),
            self.run.dp,
            self.run.pp,
            self.run.v,
            self.token_budget(),
            self.chunk_tokens()
                .map_or(String::new(), |c| format!(" chunk={c}")),
            self.run.sharding
        )
    }

    /// Its answer to sequences longer than the token budget: `whole sequences` (a microbatch
    /// each), `chunks`, `cp N comm` (a fixed context-parallel group) or `dynamic cp N comm`.
    pub fn long_sequences(&self) -> String {
        match (self.run.context_parallel, self.chunk_tokens()) {
            (Some(c), _) if c.max_seqlen_per_rank.is_some() => {
                format!("dynamic cp {} {}", c.cp, c.comm)
            }
            (Some(c), _) => format!("cp {} {}", c.cp, c.comm),
            (None, Some(_)) => "chunks".into(),
            (None, None) => "whole sequences".into(),
        }
    }

    /// The schedule's name, or `no pipeline` for pp = 1 (one rank runs F then B of each
    /// microbatch in turn, whatever the schedule kind says).
    pub fn schedule_name(&self) -> String {
        if self.run.pp == 1 {
            "no pipeline".into()
        } else {
            self.run.source.name()
        }
    }
}

/// The fields `plan --format json` writes of a candidate, in their order.
#[derive(Serialize)]
struct CandidateJson<'a> {
    tp: u32,
    sequence_parallel: bool,
    ep: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    context_parallel: Option<flatpipe_profiles::context_parallel::ContextParallel>,
    dp: u32,
    pp: u32,
    vpp: u32,
    schedule: Option<ScheduleKind>,
    token_budget: u64,
    chunk_tokens: Option<u64>,
    sharding: Sharding,
    lower_bound_s: f64,
    summary: &'a Summary,
    peak_memory_bytes: &'a [f64],
}

impl Serialize for Candidate {
    fn serialize<S: Serializer>(&self, serializer: S) -> std::result::Result<S::Ok, S::Error> {
        CandidateJson {
            tp: self.tp,
            sequence_parallel: self.sequence_parallel,
            ep: self.ep,
            context_parallel: self.run.context_parallel,
            dp: self.run.dp,
            pp: self.run.pp,
            vpp: self.run.v,
            schedule: self.schedule(),
            token_budget: self.token_budget(),
            chunk_tokens: self.chunk_tokens(),
            sharding: self.run.sharding,
            lower_bound_s: self.lower_bound_s,
            summary: &self.summary,
            peak_memory_bytes: &self.peak_memory_bytes,
        }
        .serialize(serializer)
    }
}

/// The run configuration of (kind, dp, pp, v, token budget) with `partition`'s layers and
/// recomputation, microbatched by `policy`, with `config`'s memory limit (which zb-auto builds
/// under), state bytes and forward-only work: the run a candidate is evaluated with and keeps
/// ([`Candidate::run`]).
pub(super) fn run_config(
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
