//! What `execute`, `calibrate` and `profile` share (not a subcommand): the backend and GEMM
//! precision flags (the selection and the dispatch are the executor's, [`executor::backend`]),
//! and profiling with a progress bar.

use super::*;
use flatpipe_executor::BackendConfig;
use flatpipe_executor::profiler::{self, ProfileConfig};

/// The backend that runs the kernels, as the command line names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(super) enum Backend {
    /// Threads with single-threaded fp32 kernels (matrixmultiply GEMMs).
    Cpu,
    /// NVIDIA GPUs through cudarc: NVRTC-compiled kernels, cuBLAS GEMMs, each rank its own
    /// streams (see --gpus).
    Cuda,
    /// CUDA when a GPU with a CUDA 13 driver, NVRTC and cuBLAS is usable here, else CPU.
    Auto,
}

/// GEMM arithmetic of the CUDA backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Default)]
pub(super) enum GemmPrecision {
    /// fp32 (the correctness path, comparable with the CPU backend).
    #[default]
    Fp32,
    /// bf16 tensor-core math with fp32 accumulation on fp32 tensors (the speed of bf16 GEMMs;
    /// fp32 tolerances against the CPU do not hold).
    Bf16,
}

impl From<GemmPrecision> for executor::Precision {
    fn from(p: GemmPrecision) -> Self {
        match p {
            GemmPrecision::Fp32 => executor::Precision::Fp32,
            GemmPrecision::Bf16 => executor::Precision::Bf16,
        }
    }
}

impl Backend {
    /// The backend that will run stages (the library's selection, [`executor::Backend::auto`]):
    /// `cuda` when a GPU is usable here, else a clear error naming why; `auto` picks CUDA when a
    /// GPU is usable, else the CPU (and says why).
    pub(super) fn resolve_for_stages(self) -> Result<executor::Backend> {
        match self {
            Backend::Cpu => Ok(executor::Backend::Cpu),
            Backend::Cuda => match executor::Backend::Cuda.check_usable() {
                Ok(()) => Ok(executor::Backend::Cuda),
                Err(why) => bail!("--backend cuda: {why}; run on --backend cpu instead"),
            },
            Backend::Auto => {
                let (backend, why) = executor::Backend::auto();
                if let Some(why) = why {
                    tracing::warn!("--backend auto: {why}; running on the CPU backend");
                }
                Ok(backend)
            }
        }
    }
}

/// The backend configuration of the flags: `backend` resolved, the rest as given.
pub(super) fn backend_config(
    backend: executor::Backend,
    precision: GemmPrecision,
    gpus: u32,
    init_on_device: bool,
) -> Result<BackendConfig> {
    let c = BackendConfig {
        backend,
        precision: precision.into(),
        gpus: gpus as usize,
        init_on_device,
    };
    c.check()?;
    Ok(c)
}

/// Today's date (UTC) as ISO 8601.
pub(super) fn today() -> String {
    time::OffsetDateTime::now_utc().date().to_string()
}

/// Measures `model` on `backend` with `cfg` ([`executor::backend::profile`], a progress bar on
/// stderr) and returns the profile; `hardware` defaults to the backend's built-in (`cpu`,
/// `h200`).
pub(super) fn measure(
    backend: &BackendConfig,
    model: &profiles::ModelSpec,
    hardware: Option<&str>,
    cfg: &ProfileConfig,
) -> Result<Profile> {
    backend.check()?;
    let hardware = builtins::hardware(hardware.unwrap_or(backend.backend.default_hardware()))?;
    let bar = indicatif::ProgressBar::new(profiler::grid_points(model, cfg));
    if let Ok(style) =
        indicatif::ProgressStyle::with_template("{bar:30} {pos}/{len} {elapsed} profiling {msg}")
    {
        bar.set_style(style);
    }
    // Without a terminal (a batch job, a pipe) the bar draws nothing, and a GPU profile runs
    // minutes (181 s for scripts/gpu-check.sh's on an H200): one line per measurement instead.
    let plain = !std::io::IsTerminal::is_terminal(&std::io::stderr());
    let progress = |what: &str| {
        tracing::info!("profile: {what}");
        if plain {
            eprintln!(
                "profiling {}/{} at {:.0} s: {what}",
                bar.position() + 1,
                bar.length().unwrap_or(0),
                bar.elapsed().as_secs_f64()
            );
        }
        bar.set_message(what.to_string());
        bar.inc(1);
    };
    let profile =
        executor::backend::profile(backend, model, &hardware, cfg, Some(today()), &progress);
    bar.finish_and_clear();
    Ok(profile?)
}
