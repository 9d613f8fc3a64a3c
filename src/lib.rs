//! # flatpipe
//!
//! A toolkit for pipeline parallelism in LLM training and post-training: profile a model on
//! your hardware, simulate and compare schedules on your real input-length distribution, plan,
//! execute, and look at where the bubbles are. This crate is the `flatpipe` command-line tool
//! and a facade over the library crates:
//!
//! - [`profiles`]: models, hardware, cost profiles, workloads.
//! - [`simulator`]: schedule IR, generators, replay, metrics, Gantt charts, traces, plans.
//! - [`planner`]: layer partitioning (exact DP and MILP) and plan search.
//! - [`executor`]: running plans for real: a transformer with F / I / W kernels, one interpreter.
#![deny(missing_docs)]

pub use flatpipe_executor as executor;
pub use flatpipe_planner as planner;
pub use flatpipe_profiles as profiles;
pub use flatpipe_simulator as simulator;
