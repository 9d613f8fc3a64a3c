//! Backend selection and dispatch: which backend runs the stages, its GEMM arithmetic, and one
//! executor type over both backends ([`AnyExecutor`]). The CUDA side is [`crate::cuda`]: built
//! without the `cuda` feature, that is a stand-in whose every item returns
//! [`Error::CudaNotCompiled`], so neither this module nor its callers need a `cfg`.

use crate::cpu::CpuStage;
use crate::cuda;
use crate::cuda::stage::{CudaStage, Init};
use crate::interpreter::StepRun;
use crate::precision::Precision;
use crate::profiler::{self, ProfileConfig};
use crate::runner::{Executor, PreparedStep, Setup};
use crate::{Error, Result};
use flatpipe_profiles::{Hardware, MIN_FIT_R2, ModelSpec, Profile, ProfileSource};
use std::collections::BTreeMap;

/// The backend that runs a plan's kernels.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Backend {
    /// One thread per rank with single-threaded fp32 kernels (matrixmultiply GEMMs).
    Cpu,
    /// NVIDIA GPUs through cudarc: NVRTC-compiled kernels, cuBLAS GEMMs, each rank its own
    /// streams.
    Cuda,
}

impl Backend {
    /// `cpu` or `cuda`.
    pub fn name(self) -> &'static str {
        match self {
            Backend::Cpu => "cpu",
            Backend::Cuda => "cuda",
        }
    }

    /// Whether this backend can run here.
    ///
    /// # Errors
    /// On CUDA: [`Error::CudaNotCompiled`] without the `cuda` feature, [`Error::NoDevice`] (the
    /// reason) without a GPU with a CUDA 13 driver, NVRTC and cuBLAS.
    pub fn check_usable(self) -> Result<()> {
        match self {
            Backend::Cpu => Ok(()),
            Backend::Cuda => cuda_usable(),
        }
    }

    /// CUDA when it is usable here, else the CPU with the reason CUDA is not.
    pub fn auto() -> (Backend, Option<Error>) {
        match cuda_usable() {
            Ok(()) => (Backend::Cuda, None),
            Err(why) => (Backend::Cpu, Some(why)),
        }
    }

    /// The built-in hardware a profile measured on this backend starts from (`cpu`, `h200`).
    pub fn default_hardware(self) -> &'static str {
        match self {
            Backend::Cpu => "cpu",
            Backend::Cuda => "h200",
        }
    }

    /// The profiling grid for this backend: the CPU's quick or full grid
    /// ([`ProfileConfig::quick`], [`ProfileConfig::full`]), or on a GPU T in {1024, 4096,
    /// 16384}.
    pub fn profile_config(self, quick: bool) -> ProfileConfig {
        match self {
            Backend::Cuda => ProfileConfig::gpu(),
            Backend::Cpu if quick => ProfileConfig::quick(),
            Backend::Cpu => ProfileConfig::full(),
        }
    }

    /// Whether `profile` was measured on this backend (its provenance's device names it).
    pub fn measured(self, profile: &Profile) -> bool {
        let device = profile.provenance.device.to_lowercase();
        profile.provenance.source == ProfileSource::Measured && device.contains(self.name())
    }
}

/// Whether the CUDA backend can run here.
fn cuda_usable() -> Result<()> {
    cuda::usable().map(drop)
}

impl Precision {
    /// Whether `backend` has this arithmetic.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] (field `precision`) for bf16 on the CPU.
    pub fn check(self, backend: Backend) -> Result<()> {
        if self == Precision::Bf16 && backend != Backend::Cuda {
            return Err(Error::InvalidArgument {
                field: "precision",
                value: self.name().into(),
                allowed: format!(
                    "bf16 runs only on the cuda backend (this run is on the {} backend, fp32)",
                    backend.name()
                ),
            });
        }
        Ok(())
    }
}

/// How a plan's ranks run: the backend, its arithmetic, the GPUs the ranks spread over, and
/// where the weights are drawn.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BackendConfig {
    /// The backend.
    pub backend: Backend,
    /// GEMM arithmetic (bf16 only on CUDA).
    pub precision: Precision,
    /// GPUs the ranks spread over, round-robin (1 on the CPU).
    pub gpus: usize,
    /// Draw the weights on the device (fast, for timing; CUDA only) instead of uploading the
    /// CPU backend's weights for the same seed.
    pub init_on_device: bool,
}

impl BackendConfig {
    /// fp32 on `backend`, one GPU, the CPU backend's weights.
    pub fn new(backend: Backend) -> Self {
        BackendConfig {
            backend,
            precision: Precision::Fp32,
            gpus: 1,
            init_on_device: false,
        }
    }

    /// Refuses GPU-only options on the CPU backend.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] naming `precision`, `gpus` (0, or more than 1 off CUDA) or
    /// `init_on_device`.
    pub fn check(&self) -> Result<()> {
        self.precision.check(self.backend)?;
        if self.gpus == 0 {
            return Err(Error::InvalidArgument {
                field: "gpus",
                value: "0".into(),
                allowed: ">= 1 GPU".into(),
            });
        }
        if self.backend != Backend::Cuda {
            if self.gpus != 1 {
                return Err(Error::InvalidArgument {
                    field: "gpus",
                    value: self.gpus.to_string(),
                    allowed: format!(
                        "more than 1 GPU needs the cuda backend (this run is on the {} backend)",
                        self.backend.name()
                    ),
                });
            }
            if self.init_on_device {
                return Err(Error::InvalidArgument {
                    field: "init_on_device",
                    value: "true".into(),
                    allowed: "drawing weights on the device needs the cuda backend".into(),
                });
            }
        }
        Ok(())
    }

    /// The backend as a report names it: `cpu`, `cuda (fp32 GEMMs)`.
    pub fn describe(&self) -> String {
        match self.backend {
            Backend::Cpu => "cpu".into(),
            Backend::Cuda => format!("cuda ({} GEMMs)", self.precision.name()),
        }
    }
}

/// A plan's ranks on either backend: one type for the callers, the dispatch here.
#[derive(Debug)]
pub enum AnyExecutor {
    /// The CPU backend.
    Cpu(Executor<CpuStage>),
    /// The CUDA backend (never built without the `cuda` feature).
    Cuda(Executor<CudaStage>),
}

impl AnyExecutor {
    /// Builds the ranks of `setup` as `backend` says.
    ///
    /// # Errors
    /// [`BackendConfig::check`]'s; [`Error::CudaNotCompiled`] or [`Error::NoDevice`] for CUDA
    /// where it cannot run; the runner's (a setup that does not fit the model).
    pub fn new(backend: &BackendConfig, setup: &Setup) -> Result<Self> {
        backend.check()?;
        if setup.cp() > 1 && backend.backend != Backend::Cpu {
            return Err(Error::Unsupported(format!(
                "context parallelism (cp = {}) on the {} backend: its attention gathers keys and values through host copies, on the CPU backend only",
                setup.cp(),
                backend.backend.name()
            )));
        }
        match backend.backend {
            Backend::Cpu => Ok(AnyExecutor::Cpu(Executor::cpu(setup)?)),
            Backend::Cuda => Self::cuda(backend, setup),
        }
    }

    /// The CUDA ranks of `setup` ([`Executor::cuda`]).
    fn cuda(backend: &BackendConfig, setup: &Setup) -> Result<Self> {
        let init = if backend.init_on_device {
            Init::Fast
        } else {
            Init::Exact
        };
        Ok(AnyExecutor::Cuda(Executor::cuda(
            setup,
            backend.precision,
            init,
            backend.gpus,
        )?))
    }

    /// Runs one training step ([`Executor::train_step`]).
    ///
    /// # Errors
    /// The interpreter's and the backend's.
    pub fn train_step(&mut self, setup: &Setup, step: &PreparedStep) -> Result<StepRun> {
        match self {
            AnyExecutor::Cpu(e) => e.train_step(setup, step),
            AnyExecutor::Cuda(e) => e.train_step(setup, step),
        }
    }

    /// Sets the straggler test hook ([`crate::interpreter::Slowdown`]) for the steps trained
    /// from now on (`None`: every rank at full speed).
    pub fn set_slowdown(&mut self, s: Option<crate::interpreter::Slowdown>) {
        match self {
            AnyExecutor::Cpu(e) => e.slowdown = s,
            AnyExecutor::Cuda(e) => e.slowdown = s,
        }
    }

    /// Every parameter's gradient of the last step, by name.
    pub fn named_grads(&self) -> BTreeMap<String, Vec<f32>> {
        match self {
            AnyExecutor::Cpu(e) => e.named_grads(),
            AnyExecutor::Cuda(e) => e.named_grads(),
        }
    }

    /// Every parameter, by name.
    pub fn named_params(&self) -> BTreeMap<String, Vec<f32>> {
        match self {
            AnyExecutor::Cpu(e) => e.named_params(),
            AnyExecutor::Cuda(e) => e.named_params(),
        }
    }
}

/// Measures `model`'s kernels on `backend` with the grid `cfg` and returns the profile: every
/// layer kind's F / I / W fits, the link between two ranks (on CUDA with `gpus > 1` a peer copy
/// between two GPUs) and the optimizer, over `hardware`'s other figures. `progress` is called
/// before each measurement with what is measured; `date` is the provenance's date.
///
/// # Errors
/// [`BackendConfig::check`]'s, [`Error::CudaNotCompiled`] / [`Error::NoDevice`] on CUDA where it
/// cannot run, the profiler's (fits, out of memory).
pub fn profile(
    backend: &BackendConfig,
    model: &ModelSpec,
    hardware: &Hardware,
    cfg: &ProfileConfig,
    date: Option<String>,
    progress: &(dyn Fn(&str) + Sync),
) -> Result<Profile> {
    backend.check()?;
    let (measured, device) = match backend.backend {
        Backend::Cpu => {
            let m = profiler::profile_cpu(model, cfg, progress)?;
            let device = format!(
                "{} (1 thread per rank, {} busy)",
                device_name(backend)?,
                cfg.concurrency
            );
            (m, device)
        }
        Backend::Cuda => profile_cuda(backend, model, cfg, progress)?,
    };
    let mut p = profiler::to_profile(model, hardware, &device, date, cfg, &measured)?;
    let tokens = cfg.tokens.iter().copied().max().unwrap_or(1024);
    p.gemm_split = match backend.backend {
        Backend::Cpu => profiler::gemm_split(
            model,
            tokens,
            &mut |shape| Ok(profiler::time_cpu_gemm(shape, cfg.reps as usize)),
            progress,
        )?,
        Backend::Cuda => cuda_gemm_split(backend, model, tokens, progress)?,
    };
    p.validate("measured profile")?;
    Ok(p)
}

/// The profile's `gemm_split` ratios timed with cuBLAS ([`profiler::gemm_split`]).
fn cuda_gemm_split(
    backend: &BackendConfig,
    model: &ModelSpec,
    tokens: usize,
    progress: &(dyn Fn(&str) + Sync),
) -> Result<Vec<flatpipe_profiles::GemmSplit>> {
    let bf16 = backend.precision == Precision::Bf16;
    profiler::gemm_split(
        model,
        tokens,
        &mut |shape| {
            let t = if bf16 {
                cuda::time_gemm_bf16(shape, 2, 5)?
            } else {
                cuda::time_gemm_f32(shape, 2, 5)?
            };
            Ok(t.ms * 1e-3)
        },
        progress,
    )
}

/// The device `backend` runs on as a measured profile names it, without the measurement's
/// concurrency: `cpu: AMD EPYC 7B13`, `NVIDIA H200 (CUDA, cc 9.0, fp32 GEMMs)`.
///
/// # Errors
/// On CUDA: [`Error::CudaNotCompiled`], [`Error::NoDevice`].
pub fn device_name(backend: &BackendConfig) -> Result<String> {
    match backend.backend {
        Backend::Cpu => Ok(format!("cpu: {}", profiler::cpu_name())),
        Backend::Cuda => cuda_device_name(backend),
    }
}

/// The GPU's name as a measured profile names it.
fn cuda_device_name(backend: &BackendConfig) -> Result<String> {
    Ok(cuda::profile::device_name(
        &cuda::probe()?,
        backend.precision,
    ))
}

/// Why a measured `profile` may not predict a run on `backend` with `busy` threads (CPU) or
/// streams per GPU (CUDA) busy at once, one sentence each: it was measured on another device,
/// under another concurrency (ranks contend for cores and memory bandwidth, so a kernel's time
/// depends on how many run at once), or one of its fits that weighs in a step is poor
/// ([`Profile::poor_fits`], R² below [`MIN_FIT_R2`]). Empty for an analytic profile (it
/// predicts no run here) or when nothing differs.
pub fn condition_warnings(profile: &Profile, backend: &BackendConfig, busy: usize) -> Vec<String> {
    let mut out = Vec::new();
    let p = &profile.provenance;
    if p.source != ProfileSource::Measured {
        return out;
    }
    if let Ok(here) = device_name(backend)
        && !p.device.starts_with(&here)
    {
        out.push(format!(
            "the profile was measured on `{}`, this run is on `{here}`: its times describe another device",
            p.device
        ));
    }
    if let Some(c) = p.concurrency
        && c as usize != busy
    {
        let unit = match backend.backend {
            Backend::Cpu => "thread(s)",
            Backend::Cuda => "stream(s) per GPU",
        };
        out.push(format!(
            "the profile was measured with {c} {unit} busy at once, this run keeps {busy} busy: kernels contend for cores and memory bandwidth differently (measure a profile with `concurrency` {busy})"
        ));
    }
    for f in profile.poor_fits() {
        out.push(format!(
            "the profile's {} {:?} fit has R² {:.3}, below {MIN_FIT_R2}: that phase's predicted times are uncertain (measure again on an idle machine, or with the full grid)",
            format!("{:?}", f.kind).to_lowercase(),
            f.phase,
            f.r2
        ));
    }
    out
}

/// The CUDA profiler's measurements and the device as the profile names it.
fn profile_cuda(
    backend: &BackendConfig,
    model: &ModelSpec,
    cfg: &ProfileConfig,
    progress: &(dyn Fn(&str) + Sync),
) -> Result<(profiler::Measured, String)> {
    use cuda::profile as gpu;
    let (m, info) = gpu::profile_cuda(model, cfg, backend.precision, backend.gpus, progress)?;
    let mut device = gpu::device_name(&info, backend.precision);
    if cfg.concurrency > 1 {
        device.push_str(&format!(", {} streams busy", cfg.concurrency));
    }
    Ok((m, device))
}

/// cuBLAS GEMM rates at Llama-3.1-8B's layer shapes (fp32, and bf16 math with fp32
/// accumulation), one line per token count, for a profile report's notes; none on the CPU.
///
/// # Errors
/// The CUDA backend's (no device, out of memory).
pub fn gemm_rates(backend: Backend) -> Result<Vec<String>> {
    match backend {
        Backend::Cpu => Ok(Vec::new()),
        Backend::Cuda => cuda_gemm_rates(),
    }
}

/// [`gemm_rates`] on CUDA.
fn cuda_gemm_rates() -> Result<Vec<String>> {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpu_only_options_on_the_cpu_are_refused_by_field() {
        let field = |c: BackendConfig| match c.check() {
            Err(Error::InvalidArgument { field, .. }) => field,
            other => panic!("{other:?}"),
        };
        let cpu = BackendConfig::new(Backend::Cpu);
        assert!(cpu.check().is_ok());
        let bf16 = BackendConfig {
            precision: Precision::Bf16,
            ..cpu
        };
        assert_eq!(field(bf16), "precision");
        assert_eq!(field(BackendConfig { gpus: 2, ..cpu }), "gpus");
        assert_eq!(field(BackendConfig { gpus: 0, ..cpu }), "gpus");
        let dev = BackendConfig {
            init_on_device: true,
            ..cpu
        };
        assert_eq!(field(dev), "init_on_device");
        // The same options on CUDA pass the check (whether CUDA runs here is another question).
        let cuda = BackendConfig {
            backend: Backend::Cuda,
            precision: Precision::Bf16,
            gpus: 2,
            init_on_device: true,
        };
        assert!(cuda.check().is_ok());
    }

    #[test]
    fn a_profile_used_off_its_conditions_is_said_to_be() {
        use flatpipe_profiles::{FitQuality, LayerKind, Phase, builtins};
        let model = builtins::model("tiny").unwrap();
        let hw = builtins::hardware("cpu").unwrap();
        let mut p = flatpipe_profiles::analytic_profile(&model, &hw, &Default::default()).unwrap();
        let cpu = BackendConfig::new(Backend::Cpu);
        // An analytic profile predicts no run here: nothing to say.
        assert!(condition_warnings(&p, &cpu, 2).is_empty());
        p.provenance.source = ProfileSource::Measured;
        p.provenance.device = format!("{} (1 thread per rank, 2 busy)", device_name(&cpu).unwrap());
        p.provenance.concurrency = Some(2);
        let fit = |kind, r2| FitQuality {
            kind,
            phase: Phase::F,
            r2,
            max_rel_residual: 0.1,
            samples: 10,
        };
        // A poor fit of the embedding (microseconds of a step) is not worth a warning.
        p.provenance.fits = vec![
            fit(LayerKind::Embedding, 0.3),
            fit(LayerKind::Decoder, 0.99),
        ];
        assert!(condition_warnings(&p, &cpu, 2).is_empty());
        // Another concurrency, another device, a poor decoder fit: one sentence each.
        p.provenance.fits.push(fit(LayerKind::Decoder, 0.9));
        p.provenance.device = "cpu: another processor (1 thread per rank, 2 busy)".into();
        let w = condition_warnings(&p, &cpu, 1);
        assert_eq!(w.len(), 3, "{w:?}");
        assert!(w[0].contains("another processor"), "{}", w[0]);
        assert!(
            w[1].contains("2 thread(s) busy at once, this run keeps 1"),
            "{}",
            w[1]
        );
        assert!(w[2].contains("decoder F fit has R² 0.900"), "{}", w[2]);
    }

    #[cfg(not(feature = "cuda"))]
    #[test]
    fn without_the_feature_cuda_is_a_clear_error_everywhere() {
        assert!(matches!(
            Backend::Cuda.check_usable(),
            Err(Error::CudaNotCompiled)
        ));
        assert_eq!(Backend::auto().0, Backend::Cpu);
        assert!(matches!(
            gemm_rates(Backend::Cuda),
            Err(Error::CudaNotCompiled)
        ));
        let msg = Error::CudaNotCompiled.to_string();
        assert!(msg.contains("--features cuda"), "{msg}");
    }
}
