//! # flatpipe-executor
//!
//! Runs flatpipe plans for real. A decoder-only transformer over flat `[T]` token lists with
//! `cu_seqlens` ([`cpu`], fp32, GEMMs by `matrixmultiply` through `ndarray`), with forward (F),
//! dgrad (I) and wgrad (W) kernels ([`kernels`], each backward checked against finite
//! differences), and one interpreter ([`interpreter`]) for every schedule of the simulator's IR:
//! one thread per rank runs its action list and waits only on real data dependencies; transfers
//! go through channels and are checked against the step's microbatch plan (no shape handshake).
//!
//! ```text
//! Plan / inline options --> Setup --> per step: sequences -> simulator's cut_step / plan_step
//!   (StepPlan: microbatches, the schedule for this m) -> MicrobatchData (ids, labels, loss
//!   weights) attached to the plan's schedules -> interpreter: thread per rank, F / I / W / B / Fo -> loss, gradients, measured Timeline
//!   -> all-reduce over dp, global grad norm, AdamW
//! ```
//!
//! - [`data`]: token ids, labels and loss weights; the explicit loss reduction.
//! - [`worker`]: the [`StageWorker`] trait a backend implements, and [`AdamW`].
//! - [`cpu`]: the CPU backend; [`null`]: a backend whose kernels do nothing (measures the
//!   interpreter's own overhead); [`cuda`]: with the feature `cuda`, the CUDA backend
//!   (NVRTC-compiled kernels, cuBLAS GEMMs, each rank its own streams, transfers as device
//!   copies timed by events); without it, a stand-in with the items the backend dispatch calls,
//!   each returning [`Error::CudaNotCompiled`].
//! - [`alloc`]: the host allocator's policy (freed memory stays in the process).
//! - [`backend`]: backend selection and [`AnyExecutor`], the dispatch over both backends
//!   (without the `cuda` feature a stand-in that says so).
//! - [`steps`]: the step loop a run shares (the warm-up policy, then the reported steps);
//!   [`calibrate`]: measured steps beside the prediction of the schedules that ran.
//! - [`runner`]: a plan's steps end to end, and the single-rank reference run that `--verify`
//!   and the tests compare against; [`verify`]: that comparison and its tolerances.
#![deny(missing_docs)]

pub mod alloc;
pub mod backend;
pub mod calibrate;
pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
/// The CUDA backend's stand-in in a build without the `cuda` feature: the same items, each
/// returning [`Error::CudaNotCompiled`].
#[cfg(not(feature = "cuda"))]
#[path = "no_cuda.rs"]
pub mod cuda;
pub mod data;
mod error;
pub mod interpreter;

pub mod kernels;
pub mod model;
pub mod moe;
pub mod null;
pub mod precision;
pub mod profiler;
pub mod runner;
pub mod steps;
pub mod verify;

pub mod worker;

pub use backend::{AnyExecutor, Backend, BackendConfig};
pub use data::{LossReduction, MicrobatchData};
pub use error::{Error, Result};
pub use precision::Precision;
pub use worker::{AdamW, StageWorker};
