//! The stand-in for the CUDA backend in a build without the `cuda` feature, mounted as
//! `crate::cuda` (as candle mounts its `dummy_cuda_backend`): the items of the real module that
//! [`crate::backend`] calls, with the same signatures, each returning
//! [`Error::CudaNotCompiled`]. Its values cannot exist: [`DeviceInfo`] has none, and
//! [`Executor::cuda`] never returns a [`stage::CudaStage`] executor, so no caller needs a `cfg`.

use crate::precision::Precision;
use crate::runner::{Executor, Setup};
use crate::{Error, Result};

/// What the driver reports about a device: none in this build.
#[derive(Debug, Clone, PartialEq)]
pub enum DeviceInfo {}

/// A GEMM measured on the GPU (never, in this build).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GemmTiming {
    /// `(m, k, n)`.
    pub shape: (usize, usize, usize),
    /// Median milliseconds per GEMM.
    pub ms: f64,
    /// `2 m k n / time`, TFLOP/s.
    pub tflops: f64,
}

/// Whether the CUDA backend can run here.
///
/// # Errors
/// Always [`Error::CudaNotCompiled`].
pub fn usable() -> Result<DeviceInfo> {
    Err(Error::CudaNotCompiled)
}

/// Device 0's description.
///
/// # Errors
/// Always [`Error::CudaNotCompiled`].
pub fn probe() -> Result<DeviceInfo> {
    Err(Error::CudaNotCompiled)
}

/// Times an fp32 GEMM `(m, k, n)` on the GPU.
///
/// # Errors
/// Always [`Error::CudaNotCompiled`].
pub fn time_gemm_f32(
    _shape: (usize, usize, usize),
    _warmup: u32,
    _reps: u32,
) -> Result<GemmTiming> {
    Err(Error::CudaNotCompiled)
}

/// Times a GEMM `(m, k, n)` with bf16 math on the GPU.
///
/// # Errors
/// Always [`Error::CudaNotCompiled`].
pub fn time_gemm_bf16(
    _shape: (usize, usize, usize),
    _warmup: u32,
    _reps: u32,
) -> Result<GemmTiming> {
    Err(Error::CudaNotCompiled)
}

/// The profiler on a GPU.
pub mod profile {
    use super::DeviceInfo;
    use crate::precision::Precision;
    use crate::profiler::{Measured, ProfileConfig};
    use crate::{Error, Result};
    use flatpipe_profiles::ModelSpec;

    /// The device's name as a profile records it (no device exists in this build).
    pub fn device_name(info: &DeviceInfo, _precision: Precision) -> String {
        match *info {}
    }

    /// Measures `model`'s kernels on the GPU.
    ///
    /// # Errors
    /// Always [`Error::CudaNotCompiled`].
    pub fn profile_cuda(
        _model: &ModelSpec,
        _cfg: &ProfileConfig,
        _precision: Precision,
        _devices: usize,
        _progress: &(dyn Fn(&str) + Sync),
    ) -> Result<(Measured, DeviceInfo)> {
        Err(Error::CudaNotCompiled)
    }
}

/// The CUDA stage and where its weights come from.
pub mod stage {
    /// The CUDA stage type: the do-nothing [`crate::null::NullStage`] in this build, where no
    /// CUDA executor is ever built.
    pub type CudaStage = crate::null::NullStage;

    /// Where a CUDA stage's weights come from.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum Init {
        /// The CPU backend's weights for the same seed.
        Exact,
        /// Values drawn on the device.
        Fast,
    }
}

impl Executor<stage::CudaStage> {
    /// Builds every rank's stages on `devices` GPUs.
    ///
    /// # Errors
    /// Always [`Error::CudaNotCompiled`].
    pub fn cuda(
        _setup: &Setup,
        _precision: Precision,
        _init: stage::Init,
        _devices: usize,
    ) -> Result<Self> {
        Err(Error::CudaNotCompiled)
    }
}
