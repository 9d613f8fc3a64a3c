//! The CUDA backend (feature `cuda`): the executor and the profiler on NVIDIA GPUs.
//!
//! - [`context`] / [`probe`]: device 0, or why there is none, never a panic. cudarc is built with
//!   dynamic loading and an explicit CUDA version (13.0, the H200 hosts'), so this compiles on
//!   machines with no toolkit and no GPU; on a machine without the driver cudarc's
//!   `CudaContext::new` would panic ("Unable to dynamically load the cuda shared library"), so
//!   [`context`] first asks whether the library loads and returns [`Error::NoDevice`] otherwise.
//!   NVRTC is checked the same way ([`nvrtc_present`]).
//! - `kernels.cu` ([`ops::SOURCE`]): RMSNorm, rotary, SwiGLU, embedding, cross-entropy, varlen
//!   causal GQA attention forward and backward over `cu_seqlens`, sum of squares and AdamW, as
//!   CUDA C compiled at run time by NVRTC; [`launch`] has their launch shapes. The same source is
//!   compiled on the CPU with an emulation header in `tests/cuda_emulated.rs` and checked against
//!   the CPU backend's kernels, so its logic is tested where there is no GPU.
//! - [`ops`]: one rank's [`ops::Gpu`] (compute stream, copy stream, cuBLAS handle) and the
//!   launches; row-major GEMMs through cuBLAS in fp32 or with bf16 tensor-core math.
//! - [`stage`]: [`stage::CudaStage`], the [`crate::StageWorker`] of the CUDA backend.
//! - [`profile`]: the profiler on a GPU (CUDA events).
//!
//! Layout: flatpipe's tensors are row-major `[rows, cols]`; cuBLAS is column-major. A row-major
//! `C = A B` (`[m, k] @ [k, n]`) is the column-major `C^T = B^T A^T`, so [`gemm_f32`] calls cuBLAS
//! with the operands swapped and `(n, m, k)`, no transposition, leading dimensions `n`, `k`, `n`.
#![allow(unsafe_code)]

pub mod launch;
pub mod ops;
pub mod profile;
pub mod stage;

use crate::{Error, Result};
use cudarc::cublas::{CudaBlas, Gemm, GemmConfig, sys::cublasOperation_t};
use cudarc::driver::{CudaContext, CudaSlice, CudaStream, sys::CUevent_flags};
use std::sync::Arc;

/// What the driver reports about device 0.
#[derive(Debug, Clone, PartialEq)]
pub struct DeviceInfo {
    /// Device name, e.g. `NVIDIA H200`.
    pub name: String,
    /// Devices visible.
    pub count: i32,
    /// Memory of device 0, bytes.
    pub total_bytes: usize,
    /// Compute capability (major, minor).
    pub compute_capability: (i32, i32),
}

fn no_device(reason: impl Into<String>) -> Error {
    Error::NoDevice(reason.into())
}

/// Device 0's context, or why there is none (no driver library, no device, a driver error).
///
/// # Errors
/// [`Error::NoDevice`] naming the reason; never panics.
pub fn context() -> Result<Arc<CudaContext>> {
    context_on(0)
}

/// Device `ordinal`'s context, or why there is none.
///
/// # Errors
/// [`Error::NoDevice`] naming the reason (also when `ordinal` is not below the device count);
/// never panics.
pub fn context_on(ordinal: usize) -> Result<Arc<CudaContext>> {
    // SAFETY: `is_culib_present` only tries to dlopen the driver library and reports whether it
    // loaded; it dereferences nothing of ours.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err(no_device(
            "the NVIDIA driver library (libcuda.so) is not installed on this machine",
        ));
    }
    // cudarc panics when the library lacks a function it looks up (an old or partial driver):
    // the first calls run under a guard that turns such a panic into an error.
    let version = guarded("the NVIDIA driver library", || {
        let mut v = 0i32;
        // SAFETY: cuDriverGetVersion writes one int.
        let r = unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut v) };
        (r == cudarc::driver::sys::CUresult::CUDA_SUCCESS).then_some(v)
    })?
    .ok_or_else(|| no_device("the NVIDIA driver does not report its version"))?;
    if version < MIN_DRIVER_API {
        return Err(no_device(format!(
            "the NVIDIA driver supports CUDA {}.{}; this flatpipe is built against the CUDA {}.{} API (cudarc's cuda-13000): update the driver",
            version / 1000,
            version % 1000 / 10,
            MIN_DRIVER_API / 1000,
            MIN_DRIVER_API % 1000 / 10
        )));
    }
    let count = guarded("the NVIDIA driver library", CudaContext::device_count)?
        .map_err(|e| no_device(format!("the CUDA driver reports an error: {e:?}")))?;
    if count < 1 {
        return Err(no_device("the CUDA driver sees no GPU"));
    }
    if ordinal >= count as usize {
        return Err(no_device(format!(
            "GPU {ordinal} was asked for; the CUDA driver sees {count} (0 to {})",
            count - 1
        )));
    }
    guarded("the NVIDIA driver library", || CudaContext::new(ordinal))?
        .map_err(|e| no_device(format!("cannot open GPU {ordinal}: {e:?}")))
}

/// The CUDA API version the build is bound to (cudarc's `cuda-13000`): drivers older than this
/// lack functions it calls.
const MIN_DRIVER_API: i32 = 13000;

/// Runs `f`, turning a panic (cudarc's "Missing symbol ...: dlsym failed" from a library that
/// lacks a function) into [`Error::NoDevice`] naming `what`; the panic message is not printed.
fn guarded<T>(what: &str, f: impl FnOnce() -> T) -> Result<T> {
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
    std::panic::set_hook(hook);
    r.map_err(|p| {
        let msg = p
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_else(|| "a panic".into());
        no_device(format!(
            "{what} lacks what this build needs (the CUDA 13.0 API): {msg}"
        ))
    })
}

/// Whether the CUDA backend can run here: a GPU with a CUDA 13 driver, NVRTC and cuBLAS.
/// Returns device 0's description.
///
/// # Errors
/// [`Error::NoDevice`] naming the first thing missing; never panics.
pub fn usable() -> Result<DeviceInfo> {
    let info = probe()?;
    nvrtc_present()?;
    cublas_present()?;
    Ok(info)
}

/// Whether cuBLAS (`libcublas.so`) can be loaded.
///
/// # Errors
/// [`Error::NoDevice`] naming the missing library.
pub fn cublas_present() -> Result<()> {
    // SAFETY: only tries to dlopen libcublas and reports whether it loaded.
    if unsafe { cudarc::cublas::sys::is_culib_present() } {
        Ok(())
    } else {
        Err(no_device(
            "cuBLAS (libcublas.so, part of the CUDA toolkit) is not installed: the CUDA backend's GEMMs need it",
        ))
    }
}

/// Finds device 0 and describes it.
///
/// # Errors
/// [`Error::NoDevice`] with the reason.
pub fn probe() -> Result<DeviceInfo> {
    let ctx = context()?;
    let err = |e: cudarc::driver::DriverError| no_device(format!("{e:?}"));
    guarded("the NVIDIA driver library", || {
        Ok(DeviceInfo {
            name: ctx.name().map_err(err)?,
            count: CudaContext::device_count().map_err(err)?,
            total_bytes: ctx.total_mem().map_err(err)?,
            compute_capability: ctx.compute_capability().map_err(err)?,
        })
    })?
}

/// Whether NVRTC (`libnvrtc.so`) can be loaded: the CUDA backend compiles its kernels at run
/// time.
///
/// # Errors
/// [`Error::NoDevice`] naming the missing library.
pub fn nvrtc_present() -> Result<()> {
    // SAFETY: only tries to dlopen libnvrtc and reports whether it loaded.
    if unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        Ok(())
    } else {
        Err(no_device(
            "NVRTC (libnvrtc.so, part of the CUDA toolkit) is not installed: the CUDA backend compiles its kernels at run time",
        ))
    }
}

fn driver(e: cudarc::driver::DriverError) -> Error {
    Error::Cuda(format!("driver: {e:?}"))
}

fn blas(e: cudarc::cublas::result::CublasError) -> Error {
    Error::Cuda(format!("cuBLAS: {e:?}"))
}

/// Row-major `c [m, n] = a [m, k] @ b [k, n]` in fp32 on `stream` through cuBLAS.
///
/// # Errors
/// [`Error::Invalid`] when a buffer is smaller than its shape; [`Error::Cuda`] from cuBLAS.
pub fn gemm_f32(
    blas_handle: &CudaBlas,
    a: &CudaSlice<f32>,
    b: &CudaSlice<f32>,
    c: &mut CudaSlice<f32>,
    (m, k, n): (usize, usize, usize),
) -> Result<()> {
    check_gemm((a.len(), b.len(), c.len()), (m, k, n))?;
    let cfg = GemmConfig {
        transa: cublasOperation_t::CUBLAS_OP_N,
        transb: cublasOperation_t::CUBLAS_OP_N,
        m: n as i32,
        n: m as i32,
        k: k as i32,
        alpha: 1.0f32,
        lda: n as i32,
        ldb: k as i32,
        beta: 0.0f32,
        ldc: n as i32,
    };
    // SAFETY: the shapes were checked against the buffers' lengths above; cuBLAS reads
    // `k x n` of `b` and `m x k` of `a` and writes `m x n` of `c`, all on the handle's stream.
    unsafe { blas_handle.gemm(cfg, b, a, c) }.map_err(blas)
}

/// Checks that buffers of `lens` values hold a GEMM of `(m, k, n)`.
///
/// # Errors
/// [`Error::Invalid`] naming the shapes and sizes.
pub(crate) fn check_gemm(
    lens: (usize, usize, usize),
    (m, k, n): (usize, usize, usize),
) -> Result<()> {
    if lens.0 < m * k || lens.1 < k * n || lens.2 < m * n {
        return Err(Error::Invalid(format!(
            "gemm [{m}, {k}] @ [{k}, {n}]: buffers of {}, {} and {} values are too small",
            lens.0, lens.1, lens.2
        )));
    }
    Ok(())
}

/// The median milliseconds of `reps` runs of `run` on `stream` (CUDA events), after `warmup`
/// untimed runs.
fn median_ms(
    stream: &Arc<CudaStream>,
    warmup: u32,
    reps: u32,
    mut run: impl FnMut() -> Result<()>,
) -> Result<f64> {
    for _ in 0..warmup {
        run()?;
    }
    let mut times = Vec::with_capacity(reps.max(1) as usize);
    for _ in 0..reps.max(1) {
        let flags = Some(CUevent_flags::CU_EVENT_DEFAULT);
        let start = stream.record_event(flags).map_err(driver)?;
        run()?;
        let end = stream.record_event(flags).map_err(driver)?;
        end.synchronize().map_err(driver)?;
        times.push(start.elapsed_ms(&end).map_err(driver)? as f64);
    }
    Ok(crate::profiler::median(times))
}

/// A GEMM measured on the GPU.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GemmTiming {
    /// `(m, k, n)`.
    pub shape: (usize, usize, usize),
    /// Median milliseconds per GEMM (CUDA events).
    pub ms: f64,
    /// `2 m k n / time`, TFLOP/s.
    pub tflops: f64,
}

/// Uploads row-major host matrices, multiplies them with [`gemm_f32`] and downloads the result.
///
/// # Errors
/// [`Error::NoDevice`] / [`Error::Cuda`].
pub fn matmul_f32(a: &[f32], b: &[f32], (m, k, n): (usize, usize, usize)) -> Result<Vec<f32>> {
    let ctx = context()?;
    let stream = ctx.default_stream();
    let handle = CudaBlas::new(stream.clone()).map_err(blas)?;
    let da = stream.clone_htod(a).map_err(driver)?;
    let db = stream.clone_htod(b).map_err(driver)?;
    let mut dc = stream.alloc_zeros::<f32>(m * n).map_err(driver)?;
    gemm_f32(&handle, &da, &db, &mut dc, (m, k, n))?;
    stream.clone_dtoh(&dc).map_err(driver)
}

/// Times an fp32 GEMM of `(m, k, n)` on device 0 with CUDA events: `warmup` untimed runs, then the
/// median of `reps`.
///
/// # Errors
/// [`Error::NoDevice`] / [`Error::Cuda`].
pub fn time_gemm_f32(
    (m, k, n): (usize, usize, usize),
    warmup: u32,
    reps: u32,
) -> Result<GemmTiming> {
    time_gemm((m, k, n), (0.5f32, 0.25f32), warmup, reps, |h, a, b, c| {
        gemm_f32(h, a, b, c, (m, k, n))
    })
}

/// Times a GEMM of `(m, k, n)` with bf16 operands and result and fp32 accumulation
/// (`cublasGemmEx`, `CUDA_R_16BF`, `CUBLAS_COMPUTE_32F`) on device 0 with CUDA events: `warmup`
/// untimed runs, then the median of `reps`. What a bf16 training run's GEMMs achieve.
///
/// # Errors
/// [`Error::NoDevice`] / [`Error::Cuda`].
pub fn time_gemm_bf16(
    (m, k, n): (usize, usize, usize),
    warmup: u32,
    reps: u32,
) -> Result<GemmTiming> {
    use cudarc::cublas::sys as cs;
    use cudarc::driver::{DevicePtr, DevicePtrMut};
    // bf16 bit patterns of 0.5 and 0.25.
    time_gemm(
        (m, k, n),
        (0x3F00u16, 0x3E80u16),
        warmup,
        reps,
        |h, a, b, c| {
            let stream = a.stream();
            let (bp, _rb) = b.device_ptr(stream);
            let (ap, _ra) = a.device_ptr(stream);
            let (cp, _rc) = c.device_ptr_mut(stream);
            let bf16 = cs::cudaDataType_t::CUDA_R_16BF;
            let (alpha, beta) = (1.0f32, 0.0f32);
            // SAFETY: the buffers hold k x n, m x k and m x n bf16 values; column-major
            // C^T [n, m] = B^T A^T as in `gemm_f32`; all on the handle's stream.
            unsafe {
                cudarc::cublas::result::gemm_ex(
                    *h.handle(),
                    cs::cublasOperation_t::CUBLAS_OP_N,
                    cs::cublasOperation_t::CUBLAS_OP_N,
                    n as i32,
                    m as i32,
                    k as i32,
                    (&alpha) as *const f32 as *const _,
                    bp as *const _,
                    bf16,
                    n as i32,
                    ap as *const _,
                    bf16,
                    k as i32,
                    (&beta) as *const f32 as *const _,
                    cp as *mut _,
                    bf16,
                    n as i32,
                    cs::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                    cs::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
                )
            }
            .map_err(blas)
        },
    )
}

/// The GEMM timers' common part: device 0's default stream and a cuBLAS handle on it, `a [m, k]`
/// and `b [k, n]` filled with `fill` and `c [m, n]`, then [`median_ms`] of `run` and the rate
/// `2 m k n / time`.
fn time_gemm<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits + Copy>(
    (m, k, n): (usize, usize, usize),
    fill: (T, T),
    warmup: u32,
    reps: u32,
    mut run: impl FnMut(&CudaBlas, &CudaSlice<T>, &CudaSlice<T>, &mut CudaSlice<T>) -> Result<()>,
) -> Result<GemmTiming> {
    let ctx = context()?;
    let stream: Arc<CudaStream> = ctx.default_stream();
    let handle = CudaBlas::new(stream.clone()).map_err(blas)?;
    let a = stream.clone_htod(&vec![fill.0; m * k]).map_err(driver)?;
    let b = stream.clone_htod(&vec![fill.1; k * n]).map_err(driver)?;
    let mut c = stream.alloc_zeros::<T>(m * n).map_err(driver)?;
    let ms = median_ms(&stream, warmup, reps, || run(&handle, &a, &b, &mut c))?;
    Ok(GemmTiming {
        shape: (m, k, n),
        ms,
        tflops: 2.0 * (m * k * n) as f64 / (ms * 1e-3) / 1e12,
    })
}
