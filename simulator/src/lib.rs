//! # flatpipe-simulator
//!
//! Predicts one pipeline-parallel training step: which op runs where and when, and what that
//! costs in time and memory.
//!
//! ```text
//! Workload --sample--> sequence lengths --microbatch--> [Microbatch] (flat [T] + cu_seqlens)
//! ScheduleKind --generate--> Schedule (per-rank Vec<Action>, Placement)
//! Profile + stages + microbatches --> TableCosts   (or UniformCosts from --costs)
//! replay(Schedule, costs) --> Timeline --> Metrics, Gantt (plotters), Chrome trace
//! ```
//!
//! - [`ir`]: [`Action`]s in PyTorch's notation (`0F1`, `3I0`, `3W0`, `2B1`), [`Placement`],
//!   [`Schedule`] and its validation.
//! - [`generators`]: GPipe, 1F1B, interleaved 1F1B, looped BFS, ZB-H1, ZB-H2, ZB-V and
//!   DualPipeV for any `p, m >= 1`; [`pytorch_csv`] reads and writes PyTorch's pipeline-order CSV.
//! - [`costs`]: the [`CostModel`] trait, [`UniformCosts`] and [`TableCosts`].
//! - [`replay`] and [`dag`]: the longest path through the step's DAG of compute ops and
//!   transfers (one FIFO link per ordered rank pair); a cycle is a deadlock naming its ops.
//! - [`summary`]: the same metrics from a replay that keeps no timeline (faster; no charts).
//! - [`metrics`]: makespan, bubble ratio, peak activation memory and in-flight microbatches per
//!   rank, and the lower bound.
//! - [`gantt`], [`trace`]: charts and Perfetto traces of a [`Timeline`].
//! - [`plan`]: the [`Plan`] file.
//! - [`sharding`]: DDP, ZeRO-1/2, FSDP (per step under PP, or per microbatch) and HSDP: bytes
//!   per parameter and the data-parallel collectives.
//! - [`step`]: one step planned once ([`step::RunConfig`] -> [`step::StepPlan`]): what the
//!   Monte Carlo, the planner, `execute` and `calibrate` consume.
//!
//! ```
//! use flatpipe_simulator::{ScheduleKind, UniformCostSpec, UniformCosts, simulate};
//! // 1F1B, p = 4, m = 8, f = b = w = 1 s: (m + p - 1)(f + b + w) = 33 s.
//! let schedule = ScheduleKind::OneFOneB.generate(4, 1, 8).unwrap();
//! let costs = UniformCosts::new(&UniformCostSpec::default(), 1);
//! let sim = simulate(&schedule, &costs).unwrap();
//! assert_eq!(sim.metrics.makespan_s, 33.0);
//! assert_eq!(sim.metrics.ranks[0].peak_inflight_microbatches, 4);
//! ```
#![deny(missing_docs)]

pub mod chunks;
pub mod costs;
pub mod dag;
mod error;
pub mod exact;
pub mod forward_only;
pub mod gantt;
pub mod generators;
pub mod histogram;
pub mod ir;
pub mod kineto;
pub mod mb_plan;
pub mod metrics;
pub mod microbatch;
pub mod montecarlo;
pub mod multistep;
pub mod plan;
pub mod policy;
pub mod pytorch_csv;
pub mod replay;
pub mod sharding;
pub mod step;
pub mod summary;
pub mod timeline;
pub mod trace;
pub mod verl_kk;
pub mod zb_auto;
pub mod zb_waves;

pub use costs::{
    CostModel, MemoryUnit, PerRankCostSpec, StageCosts, TableCosts, UniformCostSpec, UniformCosts,
};
pub use error::{Error, Result};
pub use generators::ScheduleKind;
pub use ir::{
    Action, ActionKind, ComputeAction, MicrobatchId, Placement, PlacementKind, Rank, Schedule,
    StageId,
};
pub use metrics::Metrics;
pub use microbatch::Microbatch;
pub use plan::{Microbatching, Plan};
pub use timeline::Timeline;

/// A simulated step: the timeline and its metrics.
#[derive(Debug, Clone)]
pub struct Simulation {
    /// What ran where and when.
    pub timeline: Timeline,
    /// Makespan, bubble ratio, memory, lower bound.
    pub metrics: Metrics,
    /// Activation memory per rank over the step: `(time_ns, level)` after each change, in the
    /// cost model's unit (bytes, or units under uniform costs).
    pub memory: Vec<Vec<(u64, f64)>>,
}

/// Validates `schedule`, replays it under `costs` and computes its metrics.
///
/// # Errors
/// [`Error::InvalidSchedule`] or [`Error::Deadlock`].
pub fn simulate<C: CostModel>(schedule: &Schedule, costs: &C) -> Result<Simulation> {
    schedule.validate()?;
    let timeline = replay::replay(schedule, costs)?;
    let events = metrics::memory_events(schedule, costs, &timeline);
    let metrics = metrics::metrics_with_events(schedule, costs, &timeline, &events);
    Ok(Simulation {
        timeline,
        metrics,
        memory: metrics::memory_levels(events),
    })
}
