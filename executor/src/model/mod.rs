//! The model, written once over an op set: a Llama-style decoder-only transformer over flat `[T]`
//! tokens, split into pipeline stages by layer range, with separate F, I (dgrad) and W (wgrad) so
//! zero-bubble schedules run for real, and with no, selective or full recomputation.
//!
//! A backend implements [`OpSet`]: its tensor type and the kernels the layers call (GEMMs,
//! RMSNorm, rotary, varlen causal attention, SwiGLU, embedding, cross-entropy, AdamW), as candle
//! has a model written once over `Tensor` and each device implement `BackendStorage`. The CPU op
//! set is [`crate::cpu::CpuOps`] (ndarray), the CUDA one `crate::cuda::stage::CudaOps` (NVRTC
//! kernels and cuBLAS). [`Stage`] is the [`crate::worker::StageWorker`] over any op set: what F keeps until I,
//! what I keeps until W, the recomputation, the parameters and the optimizer step live here
//! once, so a fix to the model is a fix on both backends.
//!
//! Layer parameters are named as torchtitan's Llama (`layers.N.attention.wq.weight`); linear
//! weights are stored `[in, out]` (`y = x W`), row-major on every backend.
//!
//! - [`ops`]: the [`OpSet`] trait a backend implements.
//! - [`experts`]: the decoder's MLP, dense or mixture of experts, and the expert-parallel
//!   token exchange ([`experts::ExpertLink`]).
//! - `context`: a decoder's attention over a context-parallel group's shares (the keys and
//!   values gathered, their gradients scattered back).
//! - [`params`]: a parameter with its gradient and moments, and how it is initialised.
//! - `saved`: what F keeps until I and what I keeps until W, per layer.
//! - `layers`: the layers' parameters, their construction from a layer range, and each
//!   layer's forward and dgrad (written once over the op set).
//! - [`stage`]: [`Stage`], the [`crate::worker::StageWorker`] over any op set.

pub(crate) mod context;
pub mod experts;
pub(crate) mod layers;
pub mod ops;
pub mod params;
pub(crate) mod saved;
pub mod stage;

pub use ops::OpSet;
pub use params::ParamInit;
pub use stage::Stage;
