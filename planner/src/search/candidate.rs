//! One evaluated candidate ([`Candidate`]): its layout, its split, its simulated distribution,
//! and the run configuration it was evaluated with ([`run_config`]).

use super::{RankBy, SearchConfig};
use crate::partition::Partition;
use crate::{Error, Result};
use flatpipe_profiles::Profile;
use flatpipe_simulator::ScheduleKind;
use flatpipe_simulator::batching::policy::{Policy, PolicyParams};
use flatpipe_simulator::costs::sharding::Sharding;
use flatpipe_simulator::run::config::{Capacity, RunConfig, ScheduleSource};
use flatpipe_simulator::run::montecarlo::Summary;
use serde::Serialize;

/// One evaluated candidate.
#[derive(Debug, Clone, Serialize)]
pub struct Candidate {
    /// Tensor-parallel degree: GPUs per rank (the candidate's profile is one GPU's,
    /// [`Profile::tensor_parallel`]).
    pub tp: u32,
    /// Sequence parallelism with `tp > 1`.
    pub sequence_parallel: bool,
    /// Data-parallel replicas.
    pub dp: u32,
    /// Pipeline ranks per replica.
    pub pp: u32,
    /// Stages per rank.
    pub vpp: u32,
    /// Schedule.
    pub schedule: ScheduleKind,
    /// Token budget per microbatch.
    pub token_budget: u64,
    /// Sequences longer than the budget cut into chunks of at most this many tokens (`None`:
    /// each gets a microbatch of its own).
    pub chunk_tokens: Option<u64>,
    /// How the replicas shard weights, gradients and optimizer state.
    pub sharding: Sharding,
    /// Layer range of every stage.
    #[serde(skip)]
    pub partition: Partition,
    /// Lower bound on the mean step time, seconds.
    pub lower_bound_s: f64,
    /// The simulated distribution over the sampled steps.
    pub summary: Summary,
    /// Per pipeline rank: static + peak activation memory (largest over steps), bytes.
    pub peak_memory_bytes: Vec<f64>,
}

impl Candidate {
    /// The ranking statistic, seconds.
    pub fn score(&self, by: RankBy) -> f64 {
        match by {
            RankBy::Mean => self.summary.step_time_s.mean,
            RankBy::P90 => self.summary.step_time_s.p90,
        }
    }

    /// The profile this candidate is simulated on: one GPU of its tensor-parallel group
    /// ([`Profile::tensor_parallel`] of the searched `base`).
    ///
    /// # Errors
    /// As [`Profile::tensor_parallel`] (not for a profile the search accepted this tp on).
    pub fn profile(&self, base: &Profile) -> Result<Profile> {
        base.tensor_parallel(self.tp, self.sequence_parallel)
            .map_err(|e| Error::Simulator(e.into()))
    }

    /// The run configuration the search evaluated this candidate with: its layout, token
    /// budget and recomputation, microbatched by `policy`, with `config`'s memory limit (which
    /// zb-auto builds under) and forward-only work. It runs on [`Candidate::profile`] (one
    /// GPU's profile), not on the searched one when `tp > 1`.
    pub fn run_config(&self, policy: Policy, config: &SearchConfig) -> RunConfig {
        run_config(
            (self.schedule, self.dp, self.pp, self.vpp, self.token_budget),
            self.chunk_tokens,
            self.sharding,
            &self.partition,
            policy,
            config,
        )
    }

    /// `schedule tp=.. dp=.. pp=.. v=.. budget=..[ chunk=..] sharding` (`tp=..` only above 1,
    /// `chunk=..` only when long sequences are cut).
    pub fn describe(&self) -> String {
        format!(
            "{} {}dp={} pp={} v={} budget={}{} {}",
            self.schedule_name(),
            if self.tp > 1 {
                format!("tp={} ", self.tp)
            } else {
                String::new()
            },
            self.dp,
            self.pp,
            self.vpp,
            self.token_budget,
            self.chunk_tokens
                .map_or(String::new(), |c| format!(" chunk={c}")),
            self.sharding
        )
    }

    /// The schedule's name, or `no pipeline` for pp = 1 (one rank runs F then B of each
    /// microbatch in turn, whatever the schedule kind says).
    pub fn schedule_name(&self) -> String {
        if self.pp == 1 {
            "no pipeline".into()
        } else {
            self.schedule.to_string()
        }
    }
}

/// The run configuration of (kind, dp, pp, v, token budget) with `partition`'s layers and
/// recomputation ([`Candidate::run_config`]).
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
