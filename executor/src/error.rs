//! Errors of the executor.

use thiserror::Error;

/// What can go wrong when running a plan.
#[derive(Debug, Error)]
pub enum Error {
    /// A request that cannot run as given (names the field and the allowed range).
    #[error("{0}")]
    Invalid(String),
    /// A field out of its allowed range, in the library's words (the command line maps the
    /// field to its flag).
    #[error("{field} = {value} is invalid: {allowed}")]
    InvalidArgument {
        /// The field (`gpus`, `precision`, ...).
        field: &'static str,
        /// The value given.
        value: String,
        /// What is allowed, and why.
        allowed: String,
    },
    /// The CUDA backend was asked for in a build without it.
    #[error(
        "this flatpipe was built without the `cuda` feature (build with `cargo build --release --features cuda`)"
    )]
    CudaNotCompiled,
    /// Something the executor does not do yet, with what to use instead.
    #[error("not supported: {0}")]
    Unsupported(String),
    /// A transfer whose size does not match the step's microbatch plan (never truncated).
    #[error(
        "rank {rank}: {what} of microbatch {microbatch} for stage {stage} holds {got} values, the step's plan says T = {tokens} x H = {hidden} = {expected}"
    )]
    TransferMismatch {
        /// Receiving rank.
        rank: u32,
        /// `activations` or `gradient`.
        what: &'static str,
        /// Receiving stage.
        stage: u32,
        /// Microbatch.
        microbatch: u32,
        /// Values received.
        got: usize,
        /// Tokens of the microbatch in the plan.
        tokens: usize,
        /// Hidden size.
        hidden: usize,
        /// `tokens * hidden`.
        expected: usize,
    },
    /// A rank waited for data that no rank will send (the schedule lacks an action).
    #[error(
        "rank {rank} waits for {what} of microbatch {microbatch} for stage {stage}, but every rank that could send it has finished: the schedule is missing the action that produces it"
    )]
    NeverSent {
        /// Waiting rank.
        rank: u32,
        /// `activations` or `gradient`.
        what: &'static str,
        /// Stage.
        stage: u32,
        /// Microbatch.
        microbatch: u32,
    },
    /// No usable GPU: no driver library (or one too old), no device, no NVRTC or cuBLAS, or the
    /// driver refused (the reason).
    #[error("CUDA is not usable here: {0}")]
    NoDevice(String),
    /// A CUDA driver or cuBLAS call failed.
    #[error("CUDA: {0}")]
    Cuda(String),
    /// Another rank failed first; this rank stopped.
    #[error("rank {0} stopped because another rank failed")]
    Aborted(u32),
    /// An error of the simulator (schedule generation, validation, microbatching).
    #[error(transparent)]
    Simulator(#[from] flatpipe_simulator::Error),
    /// An error of the profiles crate (model, workload).
    #[error(transparent)]
    Profiles(#[from] flatpipe_profiles::Error),
}

/// Result with [`enum@Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
