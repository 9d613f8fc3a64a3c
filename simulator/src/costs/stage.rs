//! Per-stage costs: each stage's own F, I and W times, the same for every microbatch.

use super::{CostModel, MemoryUnit, s_to_ns};
use crate::ir::{ActionKind, ComputeAction, MicrobatchId, Rank, StageId};
use crate::{Error, Result};

/// Per-stage costs: stage s's F, I (dgrad) and W (wgrad) times, the same for every
/// microbatch, one transfer time between adjacent stages on different ranks; a microbatch's
/// activations on a stage are one unit (half freed by I, half by W), as [`UniformCosts`](super::UniformCosts). The
/// Zero Bubble repository's own cost model (`GraphConfig` in `auto_schedule.py`: `cost_f`,
/// `cost_b`, `cost_w` per stage, `cost_comm`), for heterogeneous stages on the command line
/// (`--costs f=1/2/3,...`) and the parity tests.
#[derive(Debug, Clone)]
pub struct StageCosts {
    f_ns: Vec<u64>,
    i_ns: Vec<u64>,
    w_ns: Vec<u64>,
    comm_ns: u64,
    /// Activation units one F of a stage keeps (1; 1/v for [`StageCosts::per_rank`]).
    unit_per_stage: f64,
}

impl StageCosts {
    /// Costs of stages `0..f.len()`, seconds.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when the three lists differ in length, are empty, or hold a
    /// negative or non-finite time.
    pub fn new(f: &[f64], b: &[f64], w: &[f64], comm: f64) -> Result<Self> {
        if f.is_empty() || f.len() != b.len() || f.len() != w.len() {
            return Err(Error::invalid(
                "per-stage costs",
                format!("f: {}, b: {}, w: {} stages", f.len(), b.len(), w.len()),
                "the same number of stages (>= 1) for f, b and w",
            ));
        }
        for (name, xs) in [("f", f), ("b", b), ("w", w), ("comm", &[comm][..])] {
            if let Some(x) = xs.iter().find(|x| !x.is_finite() || **x < 0.0) {
                return Err(Error::invalid(
                    format!("costs.{name}"),
                    x,
                    "a finite time >= 0 seconds",
                ));
            }
        }
        let ns = |xs: &[f64]| xs.iter().map(|&x| s_to_ns(x)).collect();
        Ok(StageCosts {
            f_ns: ns(f),
            i_ns: ns(b),
            w_ns: ns(w),
            comm_ns: s_to_ns(comm),
            unit_per_stage: 1.0,
        })
    }

    /// Costs from per-rank shares (`f[r]`, `b[r]`, `w[r]`: rank r's share of the model per
    /// microbatch, seconds, as [`UniformCostSpec`](super::UniformCostSpec)'s): on `placement` with v stages per rank,
    /// each stage of rank r costs its share / v and keeps 1/v unit of activations per
    /// microbatch (a rank's microbatch is one unit, as under [`UniformCosts`](super::UniformCosts)).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when a list's length is not the placement's rank count, or
    /// for a time [`StageCosts::new`] refuses.
    pub fn per_rank(
        f: &[f64],
        b: &[f64],
        w: &[f64],
        comm: f64,
        placement: &crate::ir::Placement,
    ) -> Result<Self> {
        let p = placement.num_ranks as usize;
        for (name, xs) in [("f", f), ("b", b), ("w", w)] {
            if xs.len() != p {
                return Err(Error::invalid(
                    format!("costs {name}"),
                    format!("{} values", xs.len()),
                    format!("one per rank ({p})"),
                ));
            }
        }
        let v = (placement.num_stages() as usize / p.max(1)).max(1) as f64;
        let per_stage = |xs: &[f64]| -> Vec<f64> {
            placement.rank_of.iter().map(|r| xs[r.idx()] / v).collect()
        };
        let mut c = StageCosts::new(&per_stage(f), &per_stage(b), &per_stage(w), comm)?;
        c.unit_per_stage = 1.0 / v;
        Ok(c)
    }

    /// The number of stages.
    pub fn num_stages(&self) -> usize {
        self.f_ns.len()
    }
}

impl CostModel for StageCosts {
    #[inline]
    fn compute_ns(&self, a: ComputeAction) -> u64 {
        let s = a.stage.idx().min(self.f_ns.len() - 1);
        match a.kind {
            ActionKind::F | ActionKind::Fo => self.f_ns[s],
            ActionKind::I => self.i_ns[s],
            ActionKind::W => self.w_ns[s],
            ActionKind::B => self.i_ns[s] + self.w_ns[s],
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
    fn memory_unit(&self) -> MemoryUnit {
        MemoryUnit::Units
    }
}
