//! # flatpipe-profiles: what things cost
//!
//! The inputs of every flatpipe computation, each a YAML file or a built-in name:
//!
//! - [`ModelSpec`]: a model architecture as a list of layers by kind (`embedding`, `decoder`,
//!   `head`), expanded by [`ModelSpec::layers`] into the flat layer list that stages cut into
//!   contiguous ranges.
//! - [`Hardware`]: one device type (memory, peak dense FLOP/s, HBM bandwidth) and its links
//!   (latency `alpha_s`, bandwidth `beta_bytes_per_s`, within and across nodes).
//! - [`Profile`]: per layer and phase (F, I, W, Fo) the cost model
//!   `t = c0 + c_tok * tokens + c_attn * attn_pairs` in seconds, activation and parameter bytes,
//!   link costs and the optimizer-step time. [`analytic_profile`] derives one from a model and a
//!   hardware by counting FLOPs; the profiler (executor crate) will measure one.
//! - [`Profile::tensor_parallel`]: the profile of one GPU of a Megatron-style tensor-parallel
//!   group (split compute, parameters and activations, the group's collectives).
//! - [`Workload`]: how one step's sequence lengths are drawn (fixed, lognormal, or an empirical
//!   sample such as the shipped ShareGPT token counts), seeded and reproducible.
//!
//! ```
//! use flatpipe_profiles::{builtins, analytic_profile, AnalyticOptions};
//! let model = builtins::model("llama3.1-8b").unwrap();
//! let hw = builtins::hardware("h200").unwrap();
//! let profile = analytic_profile(&model, &hw, &AnalyticOptions::default()).unwrap();
//! assert_eq!(profile.layers.len(), 34); // embedding + 32 decoder layers + head
//! ```
#![deny(missing_docs)]

mod analytic;
pub mod builtins;
pub mod context_parallel;
mod decoder;
mod error;
mod expert_parallel;
pub mod gemm;
mod hardware;
mod model;
mod profile;
mod speed;
mod tensor_parallel;
mod workload;
mod yaml;

pub use analytic::{AnalyticOptions, FLAT_EFFICIENCY, analytic_profile};
pub use error::{Error, Result};
pub use gemm::{AttentionSpec, GemmCurve, GemmSpec};
pub use hardware::{Hardware, Link};
pub use model::{AttentionImpl, Dtype, Gating, Layer, LayerGroup, LayerKind, Mla, ModelSpec, Moe};
pub use profile::{
    ActionOverhead, CostCoeffs, ExpertBatching, FitQuality, GemmSplit, LayerProfile, LayerShape,
    MIN_FIT_R2, Phase, Profile, ProfileSource, Provenance, RoutedCosts,
};
pub use speed::PhaseScale;
pub use workload::{LengthDistribution, StepSize, Workload};
pub use yaml::{check_writable, read_to_string, write_atomic};

/// The crate version, recorded in profiles' provenance.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
