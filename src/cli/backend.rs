//! What `execute`, `calibrate` and `profile` share (not a subcommand): the backend and GEMM
//! precision choices, the dispatch over the backends' executors, and the prediction and
//! measurement of an executed step.

use super::*;
use flatpipe_executor::cpu::CpuStage;
use flatpipe_executor::interpreter::StepRun;
use flatpipe_executor::profiler::{self, ProfileConfig};
use flatpipe_executor::runner::{Executor, PreparedStep, Setup};
use profiles::ProfileSource;
use std::collections::BTreeMap;

/// The backend that runs the kernels.
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

impl GemmPrecision {
    pub(super) fn name(self) -> &'static str {
        match self {
            GemmPrecision::Fp32 => "fp32",
            GemmPrecision::Bf16 => "bf16",
        }
    }

    #[cfg(feature = "cuda")]
    pub(super) fn cuda(self) -> flatpipe_executor::cuda::ops::Precision {
        match self {
            GemmPrecision::Fp32 => flatpipe_executor::cuda::ops::Precision::Fp32,
            GemmPrecision::Bf16 => flatpipe_executor::cuda::ops::Precision::Bf16,
        }
    }

    /// `bf16` is an error on the CPU backend.
    pub(super) fn check(self, backend: Backend) -> Result<()> {
        if self == GemmPrecision::Bf16 && backend != Backend::Cuda {
            bail!(
                "--precision bf16 runs only on --backend cuda (this run is on the {} backend, fp32)",
                backend.name()
            );
        }
        Ok(())
    }
}

/// A plan's ranks on the backend that was chosen.
pub(super) enum AnyExecutor {
    Cpu(Executor<CpuStage>),
    #[cfg(feature = "cuda")]
    Cuda(Executor<flatpipe_executor::cuda::stage::CudaStage>),
}

impl AnyExecutor {
    /// Builds the ranks of `setup` on `backend` (a resolved one: cpu or cuda); on CUDA over
    /// `gpus` devices, with the CPU backend's weights, or with weights drawn on the device when
    /// `on_device`.
    pub(super) fn new(
        backend: Backend,
        setup: &Setup,
        precision: GemmPrecision,
        on_device: bool,
        gpus: usize,
    ) -> Result<Self> {
        precision.check(backend)?;
        if gpus != 1 && backend != Backend::Cuda {
            bail!("--gpus {gpus} needs --backend cuda");
        }
        match backend {
            #[cfg(feature = "cuda")]
            Backend::Cuda => {
                use flatpipe_executor::cuda::stage::Init;
                let init = if on_device { Init::Fast } else { Init::Exact };
                Ok(AnyExecutor::Cuda(Executor::cuda(
                    setup,
                    precision.cuda(),
                    init,
                    gpus,
                )?))
            }
            _ => {
                if on_device {
                    bail!("--init-on-device needs --backend cuda");
                }
                Ok(AnyExecutor::Cpu(Executor::cpu(setup)?))
            }
        }
    }

    pub(super) fn train_step(&mut self, setup: &Setup, step: &PreparedStep) -> Result<StepRun> {
        Ok(match self {
            AnyExecutor::Cpu(e) => e.train_step(setup, step)?,
            #[cfg(feature = "cuda")]
            AnyExecutor::Cuda(e) => e.train_step(setup, step)?,
        })
    }

    pub(super) fn named_grads(&self) -> BTreeMap<String, Vec<f32>> {
        match self {
            AnyExecutor::Cpu(e) => e.named_grads(),
            #[cfg(feature = "cuda")]
            AnyExecutor::Cuda(e) => e.named_grads(),
        }
    }

    pub(super) fn named_params(&self) -> BTreeMap<String, Vec<f32>> {
        match self {
            AnyExecutor::Cpu(e) => e.named_params(),
            #[cfg(feature = "cuda")]
            AnyExecutor::Cuda(e) => e.named_params(),
        }
    }
}

impl Backend {
    pub(super) fn name(self) -> &'static str {
        match self {
            Backend::Cpu => "cpu",
            Backend::Cuda => "cuda",
            Backend::Auto => "auto",
        }
    }

    /// The backend that will run stages: `cuda` when a GPU is usable here, else a clear error
    /// naming why; `auto` picks CUDA when a GPU is usable, else the CPU (and says why).
    pub(super) fn resolve_for_stages(self) -> Result<Backend> {
        match self {
            Backend::Cpu => Ok(Backend::Cpu),
            Backend::Cuda => match cuda_usable() {
                Ok(()) => Ok(Backend::Cuda),
                Err(why) => bail!("--backend cuda: {why}; run on --backend cpu instead"),
            },
            Backend::Auto => match cuda_usable() {
                Ok(()) => Ok(Backend::Cuda),
                Err(why) => {
                    tracing::warn!("--backend auto: {why}; running on the CPU backend");
                    Ok(Backend::Cpu)
                }
            },
        }
    }
}

/// Whether the CUDA backend can run here (a GPU with a CUDA 13 driver, NVRTC and cuBLAS), or
/// why not.
fn cuda_usable() -> std::result::Result<(), String> {
    #[cfg(feature = "cuda")]
    {
        flatpipe_executor::cuda::usable()
            .map(drop)
            .map_err(|e| e.to_string())
    }
    #[cfg(not(feature = "cuda"))]
    {
        Err("this flatpipe was built without the `cuda` feature".to_string())
    }
}

/// The simulator's prediction of a prepared step on the setup's profile (the one the step was
/// planned with; `profile` without one): the slowest replica's makespan
/// plus the data-parallel all-reduce (seconds), and replica 0's per-rank bubble ratios; the
/// replay of the schedules that run ([`PreparedStep::predict`]).
pub(super) fn predict_step(
    profile: &Profile,
    setup: &Setup,
    prepared: &PreparedStep,
) -> Result<(f64, Vec<f64>)> {
    // The setup's profile is this profile (an Arc of it): the step carries its prediction.
    let p = prepared.predict(setup, setup.profile.as_deref().unwrap_or(profile))?;
    Ok((p.makespan_s, p.bubbles))
}

/// Measured bubble ratio of every rank: `1 - busy / makespan`.
pub(super) fn measured_bubbles(t: &sim::Timeline) -> Vec<f64> {
    let m = t.makespan_ns() as f64;
    (0..t.num_ranks())
        .map(|r| 1.0 - t.busy_ns(r) as f64 / m)
        .collect()
}

/// Whether `profile` was measured on `backend`.
pub(super) fn measured_on(profile: &Profile, backend: Backend) -> bool {
    profile.provenance.source == ProfileSource::Measured
        && match backend {
            Backend::Cpu | Backend::Auto => {
                profile.provenance.device.to_lowercase().contains("cpu")
            }
            Backend::Cuda => profile.provenance.device.to_lowercase().contains("cuda"),
        }
}

/// Today's date (UTC) as ISO 8601.
pub(super) fn today() -> String {
    time::OffsetDateTime::now_utc().date().to_string()
}

/// The grid for `backend` (already resolved: cpu or cuda): the CPU's quick or full grid, or on a
/// GPU T in {1024, 4096, 16384}.
pub(super) fn default_config(backend: Backend, quick: bool) -> ProfileConfig {
    #[cfg(feature = "cuda")]
    if backend == Backend::Cuda {
        return flatpipe_executor::cuda::profile::gpu_config();
    }
    let _ = backend;
    if quick {
        ProfileConfig::quick()
    } else {
        ProfileConfig::full()
    }
}

/// Measures `model` on `backend` (resolved: cpu or cuda) with `cfg` (progress bar on stderr)
/// and returns the profile; on CUDA with `gpus > 1` the link is a peer copy between two GPUs.
/// `hardware` defaults to the built-in `cpu` or `h200`.
pub(super) fn measure(
    backend: Backend,
    precision: GemmPrecision,
    gpus: usize,
    model: &profiles::ModelSpec,
    hardware: Option<&str>,
    cfg: &ProfileConfig,
) -> Result<Profile> {
    precision.check(backend)?;
    let bar = indicatif::ProgressBar::new(profiler::grid_points(model, cfg));
    if let Ok(style) =
        indicatif::ProgressStyle::with_template("{bar:30} {pos}/{len} {elapsed} profiling {msg}")
    {
        bar.set_style(style);
    }
    let progress = |what: &str| {
        tracing::info!("profile: {what}");
        bar.set_message(what.to_string());
        bar.inc(1);
    };
    let (measured, device, hw) = match backend {
        #[cfg(feature = "cuda")]
        Backend::Cuda => {
            use flatpipe_executor::cuda::profile as gpu;
            let (m, info) = gpu::profile_cuda(model, cfg, precision.cuda(), gpus, &progress)?;
            let mut device = gpu::device_name(&info, precision.cuda());
            if cfg.concurrency > 1 {
                device.push_str(&format!(", {} streams busy", cfg.concurrency));
            }
            (m, device, hardware.unwrap_or("h200"))
        }
        _ => {
            if gpus != 1 {
                bail!("--gpus {gpus} needs --backend cuda");
            }
            let m = profiler::profile_cpu(model, cfg, &progress)?;
            let device = format!(
                "cpu: {} (1 thread per rank, {} busy)",
                profiler::cpu_name(),
                cfg.concurrency
            );
            (m, device, hardware.unwrap_or("cpu"))
        }
    };
    bar.finish_and_clear();
    let hardware = builtins::hardware(hw)?;
    Ok(profiler::to_profile(
        model,
        &hardware,
        &device,
        Some(today()),
        cfg,
        &measured,
    )?)
}

/// cuBLAS GEMM rates at Llama-3.1-8B's layer shapes (fp32, and bf16 storage with fp32
/// accumulation), for the report's notes.
#[cfg(feature = "cuda")]
pub(super) fn gemm_rates() -> Result<Vec<String>> {
    use flatpipe_executor::cuda;
    let mut lines = Vec::new();
    for t in [4096usize, 16384] {
        let mut parts = Vec::new();
        for (name, k, n) in [
            ("qkv", 4096, 6144),
            ("o", 4096, 4096),
            ("gate+up", 4096, 28672),
            ("down", 14336, 4096),
        ] {
            let f = cuda::time_gemm_f32((t, k, n), 2, 5)?;
            let b = cuda::time_gemm_bf16((t, k, n), 2, 5)?;
            parts.push(format!("{name} {:.0}/{:.0}", f.tflops, b.tflops));
        }
        lines.push(format!(
            "cuBLAS TFLOP/s at Llama-3.1-8B shapes, T = {t}, fp32/bf16: {}",
            parts.join(", ")
        ));
    }
    Ok(lines)
}
