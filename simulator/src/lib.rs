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
//! The crate is in rooms, one folder an idea, each depending only on the rooms above it:
//!
//! - [`ir`]: [`Action`]s in PyTorch's notation (`0F1`, `3I0`, `3W0`, `2B1`), [`Placement`],
//!   [`Schedule`], its validation, the transfer rule ([`ComputeAction::sends`]) and PyTorch's
//!   pipeline-order CSV ([`ir::pytorch_csv`]).
//! - [`batching`]: the flat [`Microbatch`] and the policies that cut a step into microbatches.
//! - [`costs`]: the [`CostModel`] trait, [`UniformCosts`], [`StageCosts`] and [`TableCosts`],
//!   and data-parallel sharding ([`costs::sharding`]: DDP, ZeRO-1/2, FSDP, HSDP).
//! - [`replay`]: the longest path through the step's DAG of compute ops and transfers (one
//!   FIFO link per ordered rank pair; a cycle is a deadlock naming its ops), the [`Timeline`],
//!   the metrics (makespan, bubble ratio, peak memory, the lower bound), a replay that keeps no
//!   timeline ([`replay::summary`]) and steps in a row ([`replay::multistep`]).
//! - [`schedules`]: the generators (GPipe, 1F1B, interleaved 1F1B, looped BFS, ZB-H1, ZB-H2,
//!   ZB-V, DualPipeV for any `p, m >= 1`), zb-auto, the exact solver, chunk ordering and
//!   forward-only work.
//! - [`run`]: what a run is ([`run::config::RunConfig`]), one step planned once ([`run::step`]:
//!   what the Monte Carlo, the planner, `execute` and `calibrate` consume), the per-step
//!   microbatch plan, the Monte Carlo, and the [`Plan`] file.
//! - [`io`]: Gantt charts, Chrome traces, histograms and PyTorch profiler traces.
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

pub mod batching;
pub mod costs;
mod error;
pub mod io;
pub mod ir;
pub mod replay;
pub mod run;
pub mod schedules;

pub use batching::microbatch::Microbatch;
pub use costs::{
    CostModel, MemoryUnit, PerRankCostSpec, StageCosts, TableCosts, UniformCostSpec, UniformCosts,
};
pub use error::{Error, Result};
pub use ir::{
    Action, ActionKind, ComputeAction, MicrobatchId, Placement, PlacementKind, Rank, Schedule,
    StageId,
};
pub use replay::metrics::{AllToAllTime, Metrics};
pub use replay::timeline::Timeline;
pub use run::plan::{Microbatching, Plan};
pub use schedules::generators::ScheduleKind;

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

/// Validates a schedule lowered to compute and communication, replays its streams under `costs`
/// ([`replay::streams`]) and computes its metrics (the compute schedule's, on the lowered
/// timeline).
///
/// # Errors
/// [`Error::InvalidSchedule`] or [`Error::StreamsHang`].
pub fn simulate_lowered<C: CostModel>(
    lowered: &ir::comm::Lowered,
    costs: &C,
) -> Result<Simulation> {
    lowered.schedule.validate()?;
    lowered.validate()?;
    let timeline = replay::streams::replay_lowered(lowered, costs)?;
    Ok(simulation_of(&lowered.schedule, costs, timeline))
}

/// [`simulate`] with the transfers lowered to sends and receives under `lowering`: the plain
/// replay for [`ir::lowering::Lowering::UNCONTENDED`] (the same timeline, faster), the
/// streams' replay for any other.
///
/// # Errors
/// As [`simulate`] and [`simulate_lowered`].
pub fn simulate_with<C: CostModel>(
    schedule: &Schedule,
    costs: &C,
    lowering: ir::lowering::Lowering,
) -> Result<Simulation> {
    if lowering == ir::lowering::Lowering::UNCONTENDED {
        return simulate(schedule, costs);
    }
    schedule.validate()?;
    let timeline = replay::streams::replay_lowering(schedule, lowering, costs)?;
    Ok(simulation_of(schedule, costs, timeline))
}

/// Validates `schedule`, replays it under `costs` and computes its metrics.
///
/// # Errors
/// [`Error::InvalidSchedule`] or [`Error::Deadlock`].
pub fn simulate<C: CostModel>(schedule: &Schedule, costs: &C) -> Result<Simulation> {
    schedule.validate()?;
    let timeline = replay::replay(schedule, costs)?;
    Ok(simulation_of(schedule, costs, timeline))
}

/// `timeline` of `schedule` under `costs` with its metrics and memory levels.
fn simulation_of<C: CostModel>(schedule: &Schedule, costs: &C, timeline: Timeline) -> Simulation {
    let events = replay::metrics::memory_events(schedule, costs, &timeline);
    let metrics = replay::metrics::metrics_with_events(schedule, costs, &timeline, &events);
    Simulation {
        timeline,
        metrics,
        memory: replay::metrics::memory_levels(events),
    }
}
