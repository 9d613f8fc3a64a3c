//! The profiler on a GPU: the CUDA stage worker's F / I / W / Fo per layer kind timed with CUDA
//! events over the token grid, the copy link between two ranks' streams, and AdamW.

use super::ops::{Gpu, Precision};
use super::stage::{CudaStage, Init};
use super::{DeviceInfo, context, context_on, driver, probe};
use crate::profiler::{
    DECODERS_PER_STAGE, Measured, ProfileConfig, Profiled, Sample, StageFactory, median,
    profile_kinds,
};
use crate::worker::{AdamW, StageWorker};
use crate::{Error, Result};
use cudarc::driver::sys::CUevent_flags;
use flatpipe_profiles::{LayerKind, Link, ModelSpec};
use flatpipe_simulator::costs::Recompute;
use ndarray::Array2;
use std::sync::Arc;
use std::time::Instant;

impl Profiled for CudaStage {
    fn hidden_from(&self, x: &Array2<f32>) -> Result<Self::Hidden> {
        let v: Vec<f32> = x.iter().copied().collect();
        self.upload_hidden(&v)
    }

    fn saved_bytes(&self) -> usize {
        CudaStage::saved_bytes(self)
    }

    fn param_count(&self) -> u64 {
        CudaStage::param_count(self)
    }

    fn timed(&mut self, f: impl FnOnce(&mut Self) -> Result<()>) -> Result<f64> {
        self.synchronize()?;
        let stream = Arc::clone(&self.gpu().stream);
        let flags = Some(CUevent_flags::CU_EVENT_DEFAULT);
        let start = stream.record_event(flags).map_err(driver)?;
        f(self)?;
        let end = stream.record_event(flags).map_err(driver)?;
        end.synchronize().map_err(driver)?;
        Ok(start.elapsed_ms(&end).map_err(driver)? as f64 * 1e-3)
    }
}

/// The device's name as a profile records it: `NVIDIA H200 (CUDA, cc 9.0, bf16 GEMMs)`.
pub fn device_name(info: &DeviceInfo, precision: Precision) -> String {
    format!(
        "{} (CUDA, cc {}.{}, {} GEMMs)",
        info.name,
        info.compute_capability.0,
        info.compute_capability.1,
        match precision {
            Precision::Fp32 => "fp32",
            Precision::Bf16 => "bf16",
        }
    )
}

/// Measures every layer kind of `model` on GPU 0 (weights drawn on the device, [`Init::Fast`]),
/// the link between two ranks (with `devices > 1` a peer copy from GPU 1 to GPU 0, else a copy
/// between two streams of GPU 0), and the gradient norm + AdamW per parameter. `progress` is
/// called before each measurement.
///
/// # Errors
/// [`Error::NoDevice`] without a GPU or NVRTC; [`Error::Cuda`] (out of memory: use a smaller grid
/// or model); fit errors.
pub fn profile_cuda(
    model: &ModelSpec,
    cfg: &ProfileConfig,
    precision: Precision,
    devices: usize,
    progress: &(dyn Fn(&str) + Sync),
) -> Result<(Measured, DeviceInfo)> {
    let info = probe()?;
    let ctx = context()?;
    let head_dim = CudaStage::head_dim_of(model)?;
    let m = model.clone();
    let c = Arc::clone(&ctx);
    let make: StageFactory<CudaStage> = Arc::new(move |range, seed| {
        let gpu = Arc::new(Gpu::new(&c, head_dim, precision)?);
        CudaStage::new(gpu, &m, range, seed, Recompute::None, Init::Fast)
    });
    let kinds = profile_kinds(model, cfg, &make, progress)?;
    progress("links");
    let gpu = Gpu::new(&ctx, head_dim, precision)?;
    let link = if devices > 1 {
        let peer = Gpu::new(&context_on(1)?, head_dim, precision)?;
        profile_copy_link(
            &gpu,
            &peer,
            "peer copy from GPU 1 to GPU 0 (one GPU per rank)".into(),
            cfg,
        )?
    } else {
        let other = Gpu::new(&ctx, head_dim, precision)?;
        profile_copy_link(
            &gpu,
            &other,
            "device-to-device copy between two ranks' streams on one GPU".into(),
            cfg,
        )?
    };
    progress("optimizer");
    let optimizer_s_per_param = profile_optimizer(model, cfg.reps, &make)?;
    let notes = format!(
        "measured by `flatpipe profile` on the CUDA backend's kernels (NVRTC-compiled CUDA C, cuBLAS {} GEMMs), timed with CUDA events: t = c0 + c_tok * tokens + c_attn * attn_pairs per layer kind and phase, non-negative least squares on relative residuals; weights drawn on the device; activation bytes from the saved device tensors (F -> I -> W, fp32); link = {}; optimizer = gradient norm + AdamW over {} decoder layers. FLOPs per token (MFU) are the analytic counts.",
        match precision {
            Precision::Fp32 => "fp32",
            Precision::Bf16 => "bf16-math (CUBLAS_COMPUTE_32F_FAST_16BF)",
        },
        link.name,
        DECODERS_PER_STAGE
    );
    Ok((
        Measured {
            kinds,
            link,
            all_to_all: None,
            optimizer_s_per_param,
            notes,
        },
        info,
    ))
}

/// Times a device-to-device copy from a buffer on `src` into one on `dst` (a peer copy when
/// they are different GPUs) on `dst`'s copy stream, as a transfer between ranks runs, with events
/// around the copy alone; fits `alpha + bytes / beta`.
fn profile_copy_link(dst: &Gpu, src: &Gpu, name: String, cfg: &ProfileConfig) -> Result<Link> {
    let flags = Some(CUevent_flags::CU_EVENT_DEFAULT);
    let cs = &dst.copy_stream;
    let mut samples = Vec::new();
    for &bytes in &cfg.link_sizes {
        let from = src.zeros(bytes / 4)?;
        src.synchronize()?;
        let mut times = Vec::new();
        for round in 0..cfg.warmup + cfg.reps.max(5) {
            let mut to = cs.alloc_zeros::<f32>(from.len()).map_err(driver)?;
            cs.synchronize().map_err(driver)?;
            let start = cs.record_event(flags).map_err(driver)?;
            cs.memcpy_dtod(&from, &mut to).map_err(driver)?;
            let end = cs.record_event(flags).map_err(driver)?;
            end.synchronize().map_err(driver)?;
            if round >= cfg.warmup {
                times.push(start.elapsed_ms(&end).map_err(driver)? as f64 * 1e-3);
            }
        }
        samples.push(Sample {
            tokens: bytes as f64,
            pairs: 0.0,
            seconds: median(times).max(1e-9),
        });
    }
    crate::profiler::fit_link(&name, &samples)
}

/// Seconds per parameter of the gradient norm and AdamW over a stage of the first decoders
/// (memory-bound: the weights, gradients and both moments stream through once).
fn profile_optimizer(model: &ModelSpec, reps: u32, make: &StageFactory<CudaStage>) -> Result<f64> {
    let layers = model.layers();
    let first = layers
        .iter()
        .position(|l| l.kind == LayerKind::Decoder)
        .unwrap_or(0);
    let n = layers[first..]
        .iter()
        .take_while(|l| l.kind == layers[first].kind)
        .count()
        .clamp(1, DECODERS_PER_STAGE);
    let mut stage = make(first..first + n, 0)?;
    let params = stage.param_count() as f64;
    if params == 0.0 {
        return Err(Error::Invalid(
            "the optimizer profile found no parameters".into(),
        ));
    }
    let opt = AdamW::default();
    let mut times = Vec::new();
    for t in 1..=reps.max(3) as u64 + 1 {
        stage.synchronize()?;
        let s = Instant::now();
        let norm = stage.grad_sq_norm()?;
        stage.optimizer_step(&opt, t, (1.0 / (1.0 + norm)) as f32)?;
        stage.synchronize()?;
        if t > 1 {
            times.push(s.elapsed().as_secs_f64());
        }
    }
    Ok(median(times) / params)
}
