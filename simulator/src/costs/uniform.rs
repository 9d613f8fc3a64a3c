//! Uniform costs: every stage of every microbatch costs the same, the papers' formulas.

use super::spec::UniformCostSpec;
use super::{CostModel, MemoryUnit, s_to_ns};
use crate::ir::{ActionKind, ComputeAction, MicrobatchId, Rank, StageId};

/// Uniform costs: every stage of every microbatch costs the same (one rank's share / v).
#[derive(Debug, Clone)]
pub struct UniformCosts {
    f_ns: u64,
    i_ns: u64,
    w_ns: u64,
    fo_ns: u64,
    fb_ns: u64,
    comm_ns: u64,
    ag_ns: u64,
    rs_ns: u64,
    interference: f64,
    unit_per_stage: f64,
}

impl UniformCosts {
    /// Costs for `v` stages per rank.
    pub fn new(spec: &UniformCostSpec, v: u32) -> Self {
        let v = v.max(1) as f64;
        UniformCosts {
            f_ns: s_to_ns(spec.f / v),
            i_ns: s_to_ns(spec.b / v),
            w_ns: s_to_ns(spec.w / v),
            fo_ns: s_to_ns(spec.fo.unwrap_or(spec.f) / v),
            fb_ns: s_to_ns(spec.fb.unwrap_or(spec.f + spec.b + spec.w) / v),
            comm_ns: s_to_ns(spec.comm),
            ag_ns: s_to_ns(spec.fsdp.ag / v),
            rs_ns: s_to_ns(spec.fsdp.rs / v),
            interference: spec.fsdp.interference,
            unit_per_stage: 1.0 / v,
        }
    }
}

impl CostModel for UniformCosts {
    #[inline]
    fn compute_ns(&self, a: ComputeAction) -> u64 {
        match a.kind {
            ActionKind::F => self.f_ns,
            ActionKind::I => self.i_ns,
            ActionKind::W => self.w_ns,
            ActionKind::B => self.i_ns + self.w_ns,
            ActionKind::Fo => self.fo_ns,
        }
    }
    fn overlap_ns(&self, _f: ComputeAction, b: ComputeAction) -> u64 {
        // fb is a pair of F and a full backward; a pair with I alone saves W.
        if b.kind == ActionKind::I {
            self.fb_ns.saturating_sub(self.w_ns)
        } else {
            self.fb_ns
        }
    }
    #[inline]
    fn comm_ns(&self, _: StageId, _: MicrobatchId, _: ActionKind) -> u64 {
        self.comm_ns
    }
    #[inline]
    fn activation(&self, _: StageId, _: MicrobatchId) -> (f64, f64) {
        (self.unit_per_stage / 2.0, self.unit_per_stage / 2.0)
    }
    fn optimizer_ns(&self, _: Rank) -> u64 {
        0
    }
    fn fsdp_ns(&self, _: StageId, action: crate::ir::comm::FsdpAction) -> u64 {
        match action {
            crate::ir::comm::FsdpAction::Unshard => self.ag_ns,
            crate::ir::comm::FsdpAction::ReduceGrad => self.rs_ns,
            _ => 0,
        }
    }
    fn collective_interference(&self) -> f64 {
        self.interference
    }
    fn memory_unit(&self) -> MemoryUnit {
        MemoryUnit::Units
    }
}
