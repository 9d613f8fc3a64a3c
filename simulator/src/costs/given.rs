//! Costs given by hand (`flatpipe simulate --costs`): one value per phase for every stage, or
//! one per rank. The text forms are [`UniformCostSpec`]'s and [`PerRankCostSpec`]'s.

use crate::Result;
use crate::costs::{
    CostModel, MemoryUnit, PerRankCostSpec, StageCosts, UniformCostSpec, UniformCosts,
};
use crate::ir::{ActionKind, ComputeAction, MicrobatchId, Placement, Rank, StageId};
use std::str::FromStr;

/// Hand-given costs as written: one value per key (`f=1,b=2,w=1,comm=0`), or per-rank lists
/// (`f=1/2/1/1,...`), seconds.
#[derive(Debug, Clone, PartialEq)]
pub enum CostSpec {
    /// Every stage costs the same.
    Uniform(UniformCostSpec),
    /// Each rank's stages cost that rank's values.
    PerRank(PerRankCostSpec),
}

impl FromStr for CostSpec {
    type Err = crate::Error;
    /// A text with a `/` is per-rank ([`PerRankCostSpec`]), else uniform ([`UniformCostSpec`]).
    fn from_str(s: &str) -> Result<Self> {
        Ok(if s.contains('/') {
            CostSpec::PerRank(s.parse()?)
        } else {
            CostSpec::Uniform(s.parse()?)
        })
    }
}

impl CostSpec {
    /// The cost model on `placement` (its ranks and stages per rank).
    ///
    /// # Errors
    /// A per-rank list whose length is neither 1 nor the number of ranks
    /// ([`PerRankCostSpec::for_ranks`]); [`StageCosts::per_rank`]'s.
    pub fn model(&self, placement: &Placement) -> Result<GivenCosts> {
        let p = placement.num_ranks;
        Ok(match self {
            CostSpec::Uniform(spec) => {
                GivenCosts::Uniform(UniformCosts::new(spec, placement.num_stages() / p.max(1)))
            }
            CostSpec::PerRank(spec) => {
                let [f, b, w] = spec.for_ranks(p)?;
                GivenCosts::PerRank(StageCosts::per_rank(&f, &b, &w, spec.comm, placement)?)
            }
        })
    }

    /// The longest a rank's share of one microbatch can take, training (f + b + w + two
    /// transfers) and forward-only, seconds.
    pub fn serial_s(&self) -> (f64, f64) {
        match self {
            CostSpec::Uniform(s) => (s.f + s.b + s.w + 2.0 * s.comm, s.fo.unwrap_or(s.f)),
            CostSpec::PerRank(s) => {
                let most = |xs: &[f64]| xs.iter().copied().fold(0.0, f64::max);
                (
                    most(&s.f) + most(&s.b) + most(&s.w) + 2.0 * s.comm,
                    most(&s.f),
                )
            }
        }
    }
}

impl std::fmt::Display for CostSpec {
    fn fmt(&self, out: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let list = |xs: &[f64]| {
            xs.iter()
                .map(|x| x.to_string())
                .collect::<Vec<_>>()
                .join("/")
        };
        match self {
            CostSpec::Uniform(s) => {
                write!(
                    out,
                    "uniform costs f={} b={} w={} comm={}",
                    s.f, s.b, s.w, s.comm
                )?;
                if (s.fsdp.ag, s.fsdp.rs) != (0.0, 0.0) {
                    write!(out, " ag={} rs={}", s.fsdp.ag, s.fsdp.rs)?;
                }
                write!(out, " s")?;
                if s.fsdp.interference != 0.0 {
                    write!(out, ", interference {}", s.fsdp.interference)?;
                }
                Ok(())
            }
            CostSpec::PerRank(s) => write!(
                out,
                "per-rank costs f={} b={} w={} comm={} s",
                list(&s.f),
                list(&s.b),
                list(&s.w),
                s.comm
            ),
        }
    }
}

/// The cost model of a [`CostSpec`]: uniform, or per rank.
#[derive(Debug, Clone)]
pub enum GivenCosts {
    /// [`CostSpec::Uniform`]'s model.
    Uniform(UniformCosts),
    /// [`CostSpec::PerRank`]'s model.
    PerRank(StageCosts),
}

macro_rules! delegate {
    ($self:ident, $c:ident => $e:expr) => {
        match $self {
            GivenCosts::Uniform($c) => $e,
            GivenCosts::PerRank($c) => $e,
        }
    };
}

impl CostModel for GivenCosts {
    fn compute_ns(&self, a: ComputeAction) -> u64 {
        delegate!(self, c => c.compute_ns(a))
    }
    fn overlap_ns(&self, f: ComputeAction, b: ComputeAction) -> u64 {
        delegate!(self, c => c.overlap_ns(f, b))
    }
    fn comm_ns(&self, s: StageId, mb: MicrobatchId, kind: ActionKind) -> u64 {
        delegate!(self, c => c.comm_ns(s, mb, kind))
    }
    fn activation(&self, s: StageId, mb: MicrobatchId) -> (f64, f64) {
        delegate!(self, c => c.activation(s, mb))
    }
    fn optimizer_ns(&self, r: Rank) -> u64 {
        delegate!(self, c => c.optimizer_ns(r))
    }
    fn memory_unit(&self) -> MemoryUnit {
        delegate!(self, c => c.memory_unit())
    }
    fn fsdp_ns(&self, s: StageId, action: crate::ir::comm::FsdpAction) -> u64 {
        delegate!(self, c => c.fsdp_ns(s, action))
    }
    fn collective_interference(&self) -> f64 {
        delegate!(self, c => c.collective_interference())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The text picks the form: a `/` makes per-rank lists; the serial bound adds f, b, w and
    /// two transfers (uniform) or each phase's slowest rank (per rank).
    #[test]
    fn the_text_picks_the_form_and_the_serial_bound() {
        let u: CostSpec = "f=1,b=2,w=0.5,comm=0.25".parse().unwrap();
        assert!(matches!(u, CostSpec::Uniform(_)));
        assert_eq!(u.serial_s(), (1.0 + 2.0 + 0.5 + 0.5, 1.0));
        let p: CostSpec = "f=1/3,b=2/1,w=1,comm=0".parse().unwrap();
        assert!(matches!(p, CostSpec::PerRank(_)));
        assert_eq!(p.serial_s(), (3.0 + 2.0 + 1.0, 3.0));
        assert_eq!(u.to_string(), "uniform costs f=1 b=2 w=0.5 comm=0.25 s");
    }
}
