//! The CUDA side (feature `cuda`): finding a device without ever panicking, and cuBLAS GEMMs with
//! CUDA-event timing — the first pieces of the CUDA backend.
//!
//! cudarc is built with dynamic loading and an explicit CUDA version (13.0, the H200 hosts'), so
//! this compiles on machines with no toolkit and no GPU. On a machine without the driver,
//! cudarc's `CudaContext::new` panics ("Unable to dynamically load the cuda shared library"), so
//! [`probe`] first asks whether the library can be loaded at all and returns
//! [`Error::NoDevice`] with the reason otherwise.
//!
//! Layout: flatpipe's tensors are row-major `[rows, cols]`; cuBLAS is column-major. A row-major
//! `C = A B` (`[m, k] @ [k, n]`) is the column-major `C^T = B^T A^T`, so [`gemm_f32`] calls cuBLAS
//! with the operands swapped and `(n, m, k)`, no transposition, leading dimensions `n`, `k`, `n`.
//!
//! Still to come (see the issue tracker): the CUDA `StageWorker` (NVRTC kernels for RMSNorm,
//! rotary, SwiGLU, softmax / cross-entropy and varlen attention, the dgrad / wgrad split), ranks
//! as streams with event dependencies, and the GPU profiler.
#![allow(unsafe_code)]

pub mod launch;

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
    // SAFETY: `is_culib_present` only tries to dlopen the driver library and reports whether it
    // loaded; it dereferences nothing of ours.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err(no_device(
            "the NVIDIA driver library (libcuda.so) is not installed on this machine",
        ));
    }
    let count = CudaContext::device_count()
        .map_err(|e| no_device(format!("the CUDA driver reports an error: {e:?}")))?;
    if count < 1 {
        return Err(no_device("the CUDA driver sees no GPU"));
    }
    CudaContext::new(0).map_err(|e| no_device(format!("cannot open GPU 0: {e:?}")))
}

/// Finds device 0 and describes it.
///
/// # Errors
/// [`Error::NoDevice`] with the reason.
pub fn probe() -> Result<DeviceInfo> {
    let ctx = context()?;
    let err = |e: cudarc::driver::DriverError| no_device(format!("{e:?}"));
    Ok(DeviceInfo {
        name: ctx.name().map_err(err)?,
        count: CudaContext::device_count().map_err(err)?,
        total_bytes: ctx.total_mem().map_err(err)?,
        compute_capability: ctx.compute_capability().map_err(err)?,
    })
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
    if a.len() < m * k || b.len() < k * n || c.len() < m * n {
        return Err(Error::Invalid(format!(
            "gemm [{m}, {k}] @ [{k}, {n}]: buffers of {}, {} and {} values are too small",
            a.len(),
            b.len(),
            c.len()
        )));
    }
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
    let ctx = context()?;
    let stream: Arc<CudaStream> = ctx.default_stream();
    let handle = CudaBlas::new(stream.clone()).map_err(blas)?;
    let a = stream.clone_htod(&vec![0.5f32; m * k]).map_err(driver)?;
    let b = stream.clone_htod(&vec![0.25f32; k * n]).map_err(driver)?;
    let mut c = stream.alloc_zeros::<f32>(m * n).map_err(driver)?;
    for _ in 0..warmup {
        gemm_f32(&handle, &a, &b, &mut c, (m, k, n))?;
    }
    let mut times = Vec::with_capacity(reps.max(1) as usize);
    for _ in 0..reps.max(1) {
        let flags = Some(CUevent_flags::CU_EVENT_DEFAULT);
        let start = stream.record_event(flags).map_err(driver)?;
        gemm_f32(&handle, &a, &b, &mut c, (m, k, n))?;
        let end = stream.record_event(flags).map_err(driver)?;
        times.push(start.elapsed_ms(&end).map_err(driver)? as f64);
    }
    times.sort_by(f64::total_cmp);
    let ms = times[times.len() / 2];
    Ok(GemmTiming {
        shape: (m, k, n),
        ms,
        tflops: 2.0 * (m * k * n) as f64 / (ms * 1e-3) / 1e12,
    })
}
