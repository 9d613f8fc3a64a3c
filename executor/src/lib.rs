//! # flatpipe-executor
//!
//! This crate will run plans for real: a decoder-only transformer over flat `[T]` token lists
//! with `cu_seqlens`, real forward (F), dgrad (I) and wgrad (W) kernels on a CPU backend (one
//! thread per rank, channels for links) and a CUDA backend (cudarc: cuBLAS GEMMs and NVRTC
//! kernels), one interpreter for every schedule, and the profiler that measures the same kernels
//! and fits a [`flatpipe_planner::flatpipe_simulator`] cost profile.
//!
//! Nothing is implemented yet.
#![deny(missing_docs)]

pub use flatpipe_planner;
