//! What each action, transfer and activation costs in one simulated step.
//!
//! Three cost models implement [`CostModel`]:
//! - [`UniformCosts`]: the `--costs f=..,b=..,w=..,comm=..` model of the papers' formulas. Costs
//!   are **one rank's share of the model per microbatch** in seconds: with `v` stages per rank
//!   each stage costs `f/v`, `b/v`, `w/v`; `comm` is one transfer between adjacent stages on
//!   different ranks. Memory is counted in units: one unit is one rank's share of one
//!   microbatch's activations, so an F of one of `v` stages adds `1/v`, its I frees half of
//!   that, its W the rest, and a fused B all of it.
//! - [`StageCosts`]: each stage's own F, I and W times (the `--costs f=1/2/..` lists and the
//!   Zero Bubble repository's model), memory in units as above.
//! - [`TableCosts`]: per (stage, microbatch) times from a
//!   [`Profile`](flatpipe_profiles::Profile) and the step's flat microbatches; transfers over
//!   the hardware's links; memory in bytes.
//!
//! Simulated time is integer nanoseconds, so replays are exact and deterministic.
//!
//! One file per idea: [`spec`] parses the `--costs` strings, [`uniform`] and [`stage`] are the
//! two unit-memory models, [`recompute`] says what activation recomputation keeps and costs,
//! [`table`] builds the profile-driven table, [`sharding`] prices data-parallel state, and
//! [`given`] is the model of hand-given costs (`simulate --costs`), uniform or per rank.

pub mod context;
pub mod given;
pub mod recompute;
pub mod routing;
pub mod sharding;
pub mod spec;
pub mod stage;
pub mod table;
pub mod uniform;

pub use recompute::{Recompute, RecomputeEffect, input_bytes_per_token, recompute_effect};
pub use spec::{FsdpCostSpec, MAX_COST_S, MIN_COST_S, PerRankCostSpec, UniformCostSpec};
pub use stage::StageCosts;
pub use table::{CostOptions, TableCosts};
pub use uniform::UniformCosts;

use crate::ir::{ActionKind, ComputeAction, MicrobatchId, Rank, StageId};

/// Seconds to integer nanoseconds (rounded to nearest).
pub fn s_to_ns(s: f64) -> u64 {
    (s * 1e9).round().max(0.0) as u64
}

/// Integer nanoseconds to seconds (a division, so whole multiples of 1e9 stay exact).
pub fn ns_to_s(ns: u64) -> f64 {
    ns as f64 / 1e9
}

/// The unit activation memory is reported in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MemoryUnit {
    /// Bytes (profile-driven costs).
    Bytes,
    /// One rank's share of one microbatch's activations (uniform costs).
    Units,
}

/// Costs the replay asks for. Implementations are cheap to query: the replay calls them once
/// per op.
pub trait CostModel: Sync {
    /// Duration of one compute action, ns. A fused B costs I + W.
    fn compute_ns(&self, a: ComputeAction) -> u64;
    /// Duration of an overlapped forward + backward pair run together, ns (default: their sum).
    fn overlap_ns(&self, f: ComputeAction, b: ComputeAction) -> u64 {
        self.compute_ns(f) + self.compute_ns(b)
    }
    /// Of [`CostModel::compute_ns`] of `a`, the expert-parallel all-to-alls (dispatch and
    /// combine) it pays when it runs alone, ns; 0 for a dense layer and for W (default: 0).
    fn all_to_all_ns(&self, _a: ComputeAction) -> u64 {
        0
    }
    /// Whether any action pays all-to-alls ([`CostModel::all_to_all_ns`]); `false` lets the
    /// metrics skip looking (default: `false`).
    fn has_all_to_all(&self) -> bool {
        false
    }
    /// Duration of the transfer that action `kind` of `stage` sends for microbatch `mb`, ns:
    /// after F or Fo the activations go to stage + 1, after I or B the gradient goes to
    /// stage - 1. Only asked when the two stages are on different ranks.
    fn comm_ns(&self, stage: StageId, mb: MicrobatchId, kind: ActionKind) -> u64;
    /// Activation memory one F of `stage` keeps for `mb`: (part freed by I, part freed by W),
    /// in [`CostModel::memory_unit`].
    fn activation(&self, stage: StageId, mb: MicrobatchId) -> (f64, f64);
    /// What a fused B of `stage` holds of its recomputation for `mb` while it runs: it
    /// recomputes layer by layer and frees each layer's wgrad inputs with that layer's weight
    /// gradient, so one layer's at a time (the largest), as PyTorch's autograd backward does
    /// (flatpipe's executor runs a B as the stage's I then its W, and holds them all); by
    /// default all of [`CostModel::recomputed`].
    fn recomputed_in_b(&self, stage: StageId, mb: MicrobatchId) -> f64 {
        self.recomputed(stage, mb)
    }
    /// Memory that I of `stage` recomputes for `mb` and that lives until W ends (the wgrad
    /// inputs of a recomputed layer), in [`CostModel::memory_unit`]. 0 without recomputation.
    fn recomputed(&self, _stage: StageId, _mb: MicrobatchId) -> f64 {
        0.0
    }
    /// Bytes of the output buffer an F of `stage` holds for `mb` until its transfer to the next
    /// stage completes (0 under uniform costs).
    fn output_bytes(&self, _stage: StageId, _mb: MicrobatchId) -> f64 {
        0.0
    }
    /// Memory of `rank` that is constant over the step (parameters, gradients, optimizer
    /// state), bytes (0 under uniform costs).
    fn static_bytes(&self, _rank: Rank) -> f64 {
        0.0
    }
    /// Optimizer-step time of `rank` at the end of the step, ns (0 for none).
    fn optimizer_ns(&self, rank: Rank) -> u64;
    /// Time of one of FSDP's per-stage actions on the rank's collective stream, ns: the
    /// all-gather of `stage`'s parameters (`UNSHARD`) or the reduce-scatter of its gradients
    /// (`REDUCE_GRAD`); 0 for the others and for models without FSDP (the default).
    fn fsdp_ns(&self, _stage: StageId, _action: crate::ir::comm::FsdpAction) -> u64 {
        0
    }
    /// How much longer a compute action runs while one of the rank's collectives (FSDP's
    /// all-gathers and reduce-scatters on its collective stream) runs, as a fraction: over the
    /// time they overlap, compute advances at `1 / (1 + k)` of its rate. 0 (the default): no
    /// interference. Source of the profiles' value: `Hardware::collective_interference`.
    fn collective_interference(&self) -> f64 {
        0.0
    }
    /// The unit of [`CostModel::activation`].
    fn memory_unit(&self) -> MemoryUnit;
}
