//! # flatpipe-planner
//!
//! This crate will hold flatpipe's planner: the contiguous layer partition of a model into
//! `p * v` stages under per-rank memory limits (a MILP through `good_lp`, cross-checked against an
//! exact dynamic program), and the plan search over data- and pipeline-parallel degrees, virtual
//! stages, schedule kinds, token budgets and recomputation, evaluated with
//! [`flatpipe_simulator`] on sampled steps of a workload. It will also export plans to
//! torchtitan, Megatron-LM and PyTorch's pipeline-order CSV.
//!
//! Nothing is implemented yet: the plan file type it will read and write,
//! [`flatpipe_simulator::plan::Plan`], lives in the simulator crate so that
//! `flatpipe simulate --plan` can run plans today.
#![deny(missing_docs)]

pub use flatpipe_simulator;
