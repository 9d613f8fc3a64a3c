//! # flatpipe-planner
//!
//! Chooses a pipeline plan: how many replicas (dp) and pipeline ranks (pp), how many stages
//! per rank (v), which schedule, which token budget, how to split the layers and where to
//! recompute activations, under a per-rank memory limit, for a model, a hardware and an
//! input-length distribution.
//!
//! - [`partition`]: the contiguous layer split: an exact DP, a branch and bound ([`partition::bnb`]) and
//!   a MILP (good_lp; HiGHS with the `highs` feature).
//! - [`search`]: the enumeration of candidates, each evaluated with the simulator's Monte
//!   Carlo over sampled steps, pruned by lower bounds.
//! - [`export`]: torchtitan, Megatron-LM and PyTorch pipeline-order CSV exports.
//!
//! The planner never executes anything.
#![deny(missing_docs)]

mod error;
pub mod export;
pub mod partition;
pub mod plan_file;
pub mod search;

pub use error::{Error, Result};

/// Whether HiGHS (the `highs` feature) is built in.
pub const HIGHS: bool = cfg!(feature = "highs");
pub use flatpipe_simulator;
