//! The kernels of `kernels.cu` compiled with NVRTC and launched on a stream, and row-major GEMMs
//! through cuBLAS: the building blocks of [`super::stage::CudaStage`].
//!
//! Every tensor is an fp32 [`CudaSlice`] holding a row-major `[rows, cols]` matrix. Launches are
//! asynchronous on the [`Gpu`]'s stream; cudarc records a read and a write event on every slice a
//! launch touches, so a tensor made on one rank's stream and used on another's makes the second
//! stream wait on the first's event (no host synchronisation).

use super::launch::{self, Shape};
use super::{blas, driver};
use crate::{Error, Result};
use cudarc::cublas::{CudaBlas, sys as cublas_sys};
use cudarc::driver::{
    CudaContext, CudaEvent, CudaFunction, CudaModule, CudaSlice, CudaStream, DevicePtr,
    DevicePtrMut, LaunchConfig, PushKernelArg, sys::CUevent_flags,
};
use cudarc::nvrtc::{CompileOptions, Ptx};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;

/// The kernels' CUDA C source.
pub const SOURCE: &str = include_str!("kernels.cu");

/// Every kernel of [`SOURCE`].
pub const KERNELS: &[&str] = &[
    "add_inplace",
    "swiglu_fwd",
    "swiglu_bwd",
    "rmsnorm_fwd",
    "rmsnorm_dx",
    "rmsnorm_dg",
    "rope",
    "embedding_fwd",
    "embedding_bwd",
    "cross_entropy_fwd",
    "loss_sums",
    "cross_entropy_bwd",
    "attn_fwd",
    "attn_bwd_delta",
    "attn_bwd_dq",
    "attn_bwd_dkdv",
    "sum_squares",
    "adamw",
    "init_uniform",
];

/// Compiles [`SOURCE`] to PTX with NVRTC for head dimension `head_dim` and, when given, compute
/// capability `arch` (`(9, 0)` for an H200). Needs only NVRTC (`libnvrtc.so`), no GPU.
///
/// # Errors
/// [`Error::NoDevice`] when NVRTC is not installed; [`Error::Cuda`] with NVRTC's log on a compile
/// error; [`Error::Unsupported`] for a head dimension outside `2..=128` or odd.
pub fn compile(head_dim: usize, arch: Option<(i32, i32)>) -> Result<Ptx> {
    if !(2..=launch::MAX_HEAD_DIM).contains(&head_dim) || head_dim % 2 != 0 {
        return Err(Error::Unsupported(format!(
            "head dimension {head_dim}: the CUDA attention kernels take even head dimensions up to {}",
            launch::MAX_HEAD_DIM
        )));
    }
    super::nvrtc_present()?;
    let mut options = vec![format!("-DHEAD_DIM={head_dim}")];
    if let Some((major, minor)) = arch {
        options.push(format!("--gpu-architecture=compute_{major}{minor}"));
    }
    let opts = CompileOptions {
        options,
        name: Some("flatpipe_kernels.cu".into()),
        ..Default::default()
    };
    cudarc::nvrtc::compile_ptx_with_opts(SOURCE, opts)
        .map_err(|e| Error::Cuda(format!("NVRTC could not compile the kernels: {e:?}")))
}

/// The compiled kernels of one head dimension, loaded into a context.
#[derive(Debug)]
pub struct Kernels {
    _module: Arc<CudaModule>,
    fns: HashMap<&'static str, CudaFunction>,
    /// The head dimension the attention kernels were compiled for.
    pub head_dim: usize,
}

impl Kernels {
    /// The kernels for `head_dim` in `ctx`, compiled once per process, device and head
    /// dimension.
    ///
    /// # Errors
    /// See [`compile`]; [`Error::Cuda`] when the driver cannot load the module.
    pub fn get(ctx: &Arc<CudaContext>, head_dim: usize) -> Result<Arc<Kernels>> {
        // Keyed by device and head dimension: a module belongs to its device's context.
        static CACHE: OnceLock<Mutex<ModuleCache>> = OnceLock::new();
        let cache = CACHE.get_or_init(Default::default);
        let key = (ctx.ordinal(), head_dim);
        if let Some(k) = cache.lock().map_err(poisoned)?.get(&key) {
            return Ok(Arc::clone(k));
        }
        let cc = ctx.compute_capability().map_err(driver)?;
        let module = ctx
            .load_module(compile(head_dim, Some(cc))?)
            .map_err(driver)?;
        let mut fns = HashMap::new();
        for &name in KERNELS {
            fns.insert(name, module.load_function(name).map_err(driver)?);
        }
        let k = Arc::new(Kernels {
            _module: module,
            fns,
            head_dim,
        });
        cache.lock().map_err(poisoned)?.insert(key, Arc::clone(&k));
        Ok(k)
    }

    fn f(&self, name: &str) -> &CudaFunction {
        // Every name used below is in KERNELS, all loaded in `get`.
        &self.fns[name]
    }
}

/// Loaded kernels by (device ordinal, head dimension).
type ModuleCache = HashMap<(usize, usize), Arc<Kernels>>;

fn poisoned<T>(_: T) -> Error {
    Error::Cuda("a thread panicked while compiling the kernels".into())
}

fn cfg(s: Shape) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (s.grid.0, s.grid.1, 1),
        block_dim: (s.block, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// GEMM arithmetic (defined with the backend selection, so that it exists without CUDA).
pub use crate::precision::Precision;

/// One rank: its streams, compiled kernels, cuBLAS handle, device clock and the transfer
/// buffers it holds until the step ends.
#[derive(Debug)]
pub struct Gpu {
    /// The rank's compute stream.
    pub stream: Arc<CudaStream>,
    /// The stream transfers into this rank are copied on.
    pub copy_stream: Arc<CudaStream>,
    /// The kernels.
    pub kernels: Arc<Kernels>,
    /// cuBLAS bound to `stream`.
    pub blas: CudaBlas,
    /// GEMM arithmetic.
    pub precision: Precision,
    clock: Mutex<EventClock>,
    /// Tensors other ranks sent, kept until their copy here has finished (the event), so their
    /// free on the sender's stream never waits.
    parked: Mutex<Vec<(Shared, CudaEvent)>>,
}

impl Drop for Gpu {
    fn drop(&mut self) {
        // A copy may still read a parked tensor (after a failed step): wait for the streams
        // before the tensors are freed. Errors here have nowhere to go.
        let _ = self.copy_stream.synchronize();
        let _ = self.stream.synchronize();
        if let Ok(mut p) = self.parked.lock() {
            p.clear();
        }
    }
}

/// A device tensor (fp32).
pub type Buf = CudaSlice<f32>;

/// A tensor that crosses stages: the buffer and its logical length (`T x H`; the buffer holds
/// at least one value, so a microbatch of 0 tokens still has one).
#[derive(Debug)]
pub struct Activation {
    /// The device buffer.
    pub buf: Buf,
    /// Values in use.
    pub len: usize,
    /// An event recorded on the producing stream right after the tensor was written (a stage's
    /// output): a copy to another GPU waits on it, not on everything the sender has queued since.
    pub ready: Option<CudaEvent>,
}

/// An [`Activation`] shared between a stage and its rank's list of transfer buffers.
pub type Shared = Arc<Activation>;

impl Activation {
    /// `buf` holding `len` values.
    pub fn shared(buf: Buf, len: usize) -> Shared {
        Arc::new(Activation {
            buf,
            len,
            ready: None,
        })
    }
}

/// Device timestamps of one rank: an anchor event recorded when the rank's streams were idle,
/// at a known host instant, then one event per stamp (on the compute or the copy stream; events
/// of one context share a clock).
#[derive(Debug, Default)]
struct EventClock {
    anchor: Option<(CudaEvent, Instant)>,
    events: Vec<CudaEvent>,
}

fn locked<T>(m: &Mutex<T>) -> Result<std::sync::MutexGuard<'_, T>> {
    m.lock()
        .map_err(|_| Error::Cuda("a rank's thread panicked while holding its GPU state".into()))
}

impl Gpu {
    /// A new rank on `ctx`: its own compute and copy streams.
    ///
    /// # Errors
    /// [`Error::Cuda`] from the driver, cuBLAS or NVRTC.
    pub fn new(ctx: &Arc<CudaContext>, head_dim: usize, precision: Precision) -> Result<Self> {
        let kernels = Kernels::get(ctx, head_dim)?;
        let stream = ctx.new_stream().map_err(driver)?;
        let copy_stream = ctx.new_stream().map_err(driver)?;
        let blas = CudaBlas::new(stream.clone()).map_err(blas)?;
        no_cross_stream_reuse(ctx)?;
        Ok(Gpu {
            stream,
            copy_stream,
            kernels,
            blas,
            precision,
            clock: Mutex::new(EventClock::default()),
            parked: Mutex::new(Vec::new()),
        })
    }

    /// `h` with a ready event recorded on this rank's stream now (after the kernels that wrote
    /// it); `h` itself when it is shared (then a copy waits on the sender's stream instead).
    ///
    /// # Errors
    /// [`Error::Cuda`].
    pub fn mark_ready(&self, h: Shared) -> Result<Shared> {
        match Arc::try_unwrap(h) {
            Ok(a) => Ok(Arc::new(Activation {
                ready: Some(self.stream.record_event(None).map_err(driver)?),
                ..a
            })),
            Err(h) => Ok(h),
        }
    }

    /// Waits for both streams and reports any error cudarc stored from calls that could not
    /// return one (event records and frees on drop).
    ///
    /// # Errors
    /// [`Error::Cuda`].
    pub fn synchronize(&self) -> Result<()> {
        self.stream.synchronize().map_err(driver)?;
        self.copy_stream.synchronize().map_err(driver)?;
        self.stream.context().check_err().map_err(driver)
    }

    /// Starts the step's device clock: waits for both streams, records the anchor and frees the
    /// last step's transfer buffers.
    ///
    /// # Errors
    /// [`Error::Cuda`].
    pub fn clock_start(&self) -> Result<()> {
        self.synchronize()?;
        locked(&self.parked)?.clear();
        let ev = self
            .stream
            .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(driver)?;
        ev.synchronize().map_err(driver)?;
        let mut c = locked(&self.clock)?;
        c.anchor = Some((ev, Instant::now()));
        c.events.clear();
        Ok(())
    }

    /// Records a stamp on `on` (this rank's compute or copy stream); returns its index.
    ///
    /// # Errors
    /// [`Error::Cuda`].
    pub fn stamp(&self, on: &Arc<CudaStream>) -> Result<usize> {
        let ev = on
            .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(driver)?;
        let mut c = locked(&self.clock)?;
        c.events.push(ev);
        Ok(c.events.len() - 1)
    }

    /// Waits for both streams, then returns every stamp in nanoseconds after `t0` (host clock)
    /// and frees the step's transfer buffers.
    ///
    /// # Errors
    /// [`Error::Cuda`]; [`Error::Invalid`] when the clock was not started.
    pub fn clock_finish(&self, t0: Instant) -> Result<Vec<u64>> {
        self.synchronize()?;
        locked(&self.parked)?.clear();
        let c = locked(&self.clock)?;
        let (anchor, at) = c
            .anchor
            .as_ref()
            .ok_or_else(|| Error::Invalid("the device clock was not started".into()))?;
        let base = at.saturating_duration_since(t0).as_nanos() as f64;
        c.events
            .iter()
            .map(|e| {
                let ms = anchor.elapsed_ms(e).map_err(driver)? as f64;
                Ok((base + ms * 1e6).max(0.0) as u64)
            })
            .collect()
    }

    /// Receives `src` from another rank: a device-to-device copy (a peer copy when `src` is on
    /// another GPU) on this rank's copy stream (after the sender's write of `src`), timed by two
    /// stamps on the copy stream; this rank's compute stream then waits for the copy. `src` is
    /// kept until the copy has finished, so its free on the sender's stream never waits for this
    /// rank. Returns the copy and the `(start, end)` stamps.
    ///
    /// # Errors
    /// [`Error::Cuda`].
    pub fn import(&self, src: Shared) -> Result<(Shared, (usize, usize))> {
        let cs = &self.copy_stream;
        // SAFETY: the copy below writes all of it before anyone reads it.
        let mut dst = unsafe { cs.alloc::<f32>(src.buf.len()) }.map_err(driver)?;
        let (start, end);
        if src.buf.stream().context() == cs.context() {
            {
                // The copy stream waits for the sender's write before the start stamp.
                let (_ptr, _record) = src.buf.device_ptr(cs);
            }
            start = self.stamp(cs)?;
            cs.memcpy_dtod(&src.buf, &mut dst).map_err(driver)?;
            end = self.stamp(cs)?;
        } else {
            // Another GPU: a peer copy. An event may not be recorded on a stream of another
            // context, but one may be waited on: the tensor's ready event, else one recorded on
            // the sender's stream now (which also waits for what the sender queued since).
            match &src.ready {
                Some(ev) => cs.wait(ev).map_err(driver)?,
                None => {
                    let ev = src.buf.stream().record_event(None).map_err(driver)?;
                    cs.wait(&ev).map_err(driver)?;
                }
            }
            start = self.stamp(cs)?;
            {
                let src_ctx = src.buf.stream().context().cu_ctx();
                let (sp, _rs) = src.buf.device_ptr(src.buf.stream());
                let (dp, _rd) = dst.device_ptr_mut(cs);
                cs.context().bind_to_thread().map_err(driver)?;
                // SAFETY: both buffers hold src.buf.len() values (dst was allocated with that
                // length); the copy is ordered on `cs` after the sender's ready event; `src` stays
                // alive (parked) until the copy has finished.
                unsafe {
                    cudarc::driver::result::memcpy_peer_async(
                        cs.context().cu_ctx(),
                        dp,
                        src_ctx,
                        sp,
                        src.buf.num_bytes(),
                        cs.cu_stream(),
                    )
                }
                .map_err(driver)?;
            }
            end = self.stamp(cs)?;
        }
        {
            // The compute stream waits for the copy before this rank's next stamp.
            let (_ptr, _record) = dst.device_ptr(&self.stream);
        }
        let done = cs.record_event(None).map_err(driver)?;
        let len = src.len;
        let mut parked = locked(&self.parked)?;
        // Tensors whose copy has finished can go now (their free waits on nothing).
        parked.retain(|(_, ev)| !matches!(ev.try_is_complete(), Ok(true)));
        parked.push((src, done));
        Ok((Activation::shared(dst, len), (start, end)))
    }

    /// An uninitialised `[n]` tensor (every caller's kernel writes all of it).
    ///
    /// # Errors
    /// [`Error::Cuda`] (out of memory).
    pub fn empty(&self, n: usize) -> Result<Buf> {
        // SAFETY: the memory is only read after a kernel or copy has written all of it.
        unsafe { self.stream.alloc::<f32>(n.max(1)) }.map_err(driver)
    }

    /// A `[n]` tensor of zeros.
    ///
    /// # Errors
    /// [`Error::Cuda`].
    pub fn zeros(&self, n: usize) -> Result<Buf> {
        self.stream.alloc_zeros::<f32>(n.max(1)).map_err(driver)
    }

    /// Uploads `v`.
    ///
    /// # Errors
    /// [`Error::Cuda`].
    pub fn upload<T: cudarc::driver::DeviceRepr>(&self, v: &[T]) -> Result<CudaSlice<T>> {
        self.stream.clone_htod(v).map_err(driver)
    }

    /// Copies `v` into `dst` (`dst.len() >= v.len()`).
    ///
    /// # Errors
    /// [`Error::Cuda`].
    pub fn upload_into(&self, v: &[f32], dst: &mut Buf) -> Result<()> {
        if dst.len() < v.len() {
            return Err(Error::Invalid(format!(
                "upload of {} values into a buffer of {}",
                v.len(),
                dst.len()
            )));
        }
        self.stream.memcpy_htod(v, dst).map_err(driver)
    }

    /// Downloads `v` (waits for the stream).
    ///
    /// # Errors
    /// [`Error::Cuda`].
    pub fn download<T: cudarc::driver::DeviceRepr>(&self, v: &CudaSlice<T>) -> Result<Vec<T>> {
        self.stream.clone_dtoh(v).map_err(driver)
    }

    /// Row-major `c [m, n] = op(a) op(b) + beta c` with `op(a)` `[m, k]` (`a` stored `[k, m]`
    /// when `ta`) and `op(b)` `[k, n]` (`b` stored `[n, k]` when `tb`), through cuBLAS's
    /// column-major GEMM as `c^T = op(b)^T op(a)^T` ([`launch::row_major_gemm`], tested against
    /// the reference BLAS definition).
    ///
    /// # Errors
    /// [`Error::Invalid`] when a buffer is smaller than its shape; [`Error::Cuda`] from cuBLAS.
    #[allow(clippy::too_many_arguments)]
    pub fn gemm(
        &self,
        a: &Buf,
        ta: bool,
        b: &Buf,
        tb: bool,
        c: &mut Buf,
        (m, k, n): (usize, usize, usize),
        beta: f32,
    ) -> Result<()> {
        super::check_gemm((a.len(), b.len(), c.len()), (m, k, n))?;
        if m == 0 || n == 0 {
            return Ok(());
        }
        use cublas_sys::cublasOperation_t::{CUBLAS_OP_N, CUBLAS_OP_T};
        let op = |t: bool| if t { CUBLAS_OP_T } else { CUBLAS_OP_N };
        let g = launch::row_major_gemm(ta, tb, (m, k, n));
        let compute = match self.precision {
            Precision::Fp32 => cublas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            Precision::Bf16 => cublas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_16BF,
        };
        let alpha = 1.0f32;
        let stream = &self.stream;
        // cuBLAS runs on the device current to this thread: after a peer copy that can be the
        // sender's.
        stream.context().bind_to_thread().map_err(driver)?;
        let (bp, _rb) = b.device_ptr(stream);
        let (ap, _ra) = a.device_ptr(stream);
        let (cp, _rc) = c.device_ptr_mut(stream);
        let f32t = cublas_sys::cudaDataType_t::CUDA_R_32F;
        // SAFETY: the shapes were checked against the buffers' lengths above; cuBLAS reads
        // op(b) and op(a) and writes c, all on this stream, whose handle `blas` is; the
        // SyncOnDrop guards record the accesses after the call is enqueued.
        unsafe {
            cudarc::cublas::result::gemm_ex(
                *self.blas.handle(),
                op(g.trans_first),
                op(g.trans_second),
                g.m as i32,
                g.n as i32,
                g.k as i32,
                (&alpha) as *const f32 as *const _,
                bp as *const _,
                f32t,
                g.ld_first as i32,
                ap as *const _,
                f32t,
                g.ld_second as i32,
                (&beta) as *const f32 as *const _,
                cp as *mut _,
                f32t,
                g.ldc as i32,
                compute,
                cublas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(blas)
    }

    /// `x [t, din] @ w [din, dout]` -> `[t, dout]` (a linear layer's forward).
    ///
    /// # Errors
    /// As [`Gpu::gemm`].
    pub fn linear(&self, x: &Buf, w: &Buf, t: usize, din: usize, dout: usize) -> Result<Buf> {
        let mut y = self.empty(t * dout)?;
        self.gemm(x, false, w, false, &mut y, (t, din, dout), 0.0)?;
        Ok(y)
    }

    /// `dy [t, dout] @ w^T` accumulated into (`beta = 1`) or written to `dx [t, din]` (dgrad).
    ///
    /// # Errors
    /// As [`Gpu::gemm`].
    #[allow(clippy::too_many_arguments)]
    pub fn linear_dx(
        &self,
        dy: &Buf,
        w: &Buf,
        dx: &mut Buf,
        t: usize,
        din: usize,
        dout: usize,
        accumulate: bool,
    ) -> Result<()> {
        let beta = if accumulate { 1.0 } else { 0.0 };
        self.gemm(dy, false, w, true, dx, (t, dout, din), beta)
    }

    /// `dw [din, dout] += x^T [din, t] @ dy [t, dout]` (wgrad).
    ///
    /// # Errors
    /// As [`Gpu::gemm`].
    pub fn linear_dw(
        &self,
        dw: &mut Buf,
        x: &Buf,
        dy: &Buf,
        t: usize,
        din: usize,
        dout: usize,
    ) -> Result<()> {
        self.gemm(x, true, dy, false, dw, (din, t, dout), 1.0)
    }

    /// `y += x` over `n` values.
    ///
    /// # Errors
    /// [`Error::Cuda`].
    pub fn add_inplace(&self, y: &mut Buf, x: &Buf, n: usize) -> Result<()> {
        let n64 = n as i64;
        let mut b = self.stream.launch_builder(self.kernels.f("add_inplace"));
        b.arg(y).arg(x).arg(&n64);
        // SAFETY: `add_inplace(float* y, const float* x, i64 n)`, both of at least n values.
        unsafe { b.launch(cfg(launch::elementwise(n))) }.map_err(driver)?;
        Ok(())
    }

    /// RMSNorm of `x [t, h]` with weight `g [h]`: `(y, xhat, rstd [t])`.
    ///
    /// # Errors
    /// [`Error::Cuda`].
    pub fn rmsnorm(&self, x: &Buf, g: &Buf, t: usize, h: usize) -> Result<(Buf, Buf, Buf)> {
        let (mut y, mut xhat, mut rstd) = (self.empty(t * h)?, self.empty(t * h)?, self.empty(t)?);
        let (ti, hi) = (t as i32, h as i32);
        let mut b = self.stream.launch_builder(self.kernels.f("rmsnorm_fwd"));
        b.arg(x)
            .arg(g)
            .arg(&mut y)
            .arg(&mut xhat)
            .arg(&mut rstd)
            .arg(&ti)
            .arg(&hi);
        // SAFETY: the kernel's signature; every buffer holds t * h (rstd: t) values.
        unsafe { b.launch(cfg(launch::per_row(t))) }.map_err(driver)?;
        Ok((y, xhat, rstd))
    }

    /// RMSNorm dgrad `[t, h]`, plus `residual` when given.
    ///
    /// # Errors
    /// [`Error::Cuda`].
    #[allow(clippy::too_many_arguments)]
    pub fn rmsnorm_dx(
        &self,
        dy: &Buf,
        xhat: &Buf,
        rstd: &Buf,
        g: &Buf,
        residual: Option<&Buf>,
        t: usize,
        h: usize,
    ) -> Result<Buf> {
        let mut dx = self.empty(t * h)?;
        let (ti, hi) = (t as i32, h as i32);
        let null = 0u64;
        let mut b = self.stream.launch_builder(self.kernels.f("rmsnorm_dx"));
        b.arg(dy).arg(xhat).arg(rstd).arg(g);
        match residual {
            Some(r) => b.arg(r),
            None => b.arg(&null),
        };
        b.arg(&mut dx).arg(&ti).arg(&hi);
        // SAFETY: the kernel's signature (a null residual pointer skips the add).
        unsafe { b.launch(cfg(launch::per_row(t))) }.map_err(driver)?;
        Ok(dx)
    }

    /// RMSNorm wgrad: `dg [h] += Σ_t dy * xhat`.
    ///
    /// # Errors
    /// [`Error::Cuda`].
    pub fn rmsnorm_dg(&self, dg: &mut Buf, dy: &Buf, xhat: &Buf, t: usize, h: usize) -> Result<()> {
        let (ti, hi, rows) = (t as i32, h as i32, launch::DG_ROWS as i32);
        let mut b = self.stream.launch_builder(self.kernels.f("rmsnorm_dg"));
        b.arg(dg).arg(dy).arg(xhat).arg(&ti).arg(&hi).arg(&rows);
        // SAFETY: the kernel's signature.
        unsafe { b.launch(cfg(launch::norm_dg(t, h))) }.map_err(driver)?;
        Ok(())
    }

    /// Rotary embedding in place on `x [t, heads * d]`; `pos [t]`.
    ///
    /// # Errors
    /// [`Error::Cuda`].
    pub fn rope(
        &self,
        x: &mut Buf,
        pos: &CudaSlice<i32>,
        t: usize,
        heads: usize,
        inverse: bool,
    ) -> Result<()> {
        let d = self.kernels.head_dim;
        let (ti, hi, di, inv) = (t as i32, heads as i32, d as i32, inverse as i32);
        let mut b = self.stream.launch_builder(self.kernels.f("rope"));
        b.arg(x).arg(pos).arg(&ti).arg(&hi).arg(&di).arg(&inv);
        // SAFETY: the kernel's signature.
        unsafe { b.launch(cfg(launch::elementwise(t * heads * d / 2))) }.map_err(driver)?;
        Ok(())
    }

    /// `silu(gate) * up` over `n` values.
    ///
    /// # Errors
    /// [`Error::Cuda`].
    pub fn swiglu(&self, gate: &Buf, up: &Buf, n: usize) -> Result<Buf> {
        let mut act = self.empty(n)?;
        let n64 = n as i64;
        let mut b = self.stream.launch_builder(self.kernels.f("swiglu_fwd"));
        b.arg(gate).arg(up).arg(&mut act).arg(&n64);
        // SAFETY: the kernel's signature.
        unsafe { b.launch(cfg(launch::elementwise(n))) }.map_err(driver)?;
        Ok(act)
    }

    /// SwiGLU backward: `(dgate, dup)`.
    ///
    /// # Errors
    /// [`Error::Cuda`].
    pub fn swiglu_backward(&self, d: &Buf, gate: &Buf, up: &Buf, n: usize) -> Result<(Buf, Buf)> {
        let (mut dg, mut du) = (self.empty(n)?, self.empty(n)?);
        let n64 = n as i64;
        let mut b = self.stream.launch_builder(self.kernels.f("swiglu_bwd"));
        b.arg(d)
            .arg(gate)
            .arg(up)
            .arg(&mut dg)
            .arg(&mut du)
            .arg(&n64);
        // SAFETY: the kernel's signature.
        unsafe { b.launch(cfg(launch::elementwise(n))) }.map_err(driver)?;
        Ok((dg, du))
    }

    /// Rows `ids [t]` of `table [V, h]`.
    ///
    /// # Errors
    /// [`Error::Cuda`].
    pub fn embedding(&self, table: &Buf, ids: &CudaSlice<u32>, t: usize, h: usize) -> Result<Buf> {
        let mut y = self.empty(t * h)?;
        let (ti, hi) = (t as i32, h as i32);
        let mut b = self.stream.launch_builder(self.kernels.f("embedding_fwd"));
        b.arg(table).arg(ids).arg(&mut y).arg(&ti).arg(&hi);
        // SAFETY: the kernel's signature; ids < V was checked when the data was built.
        unsafe { b.launch(cfg(launch::per_row(t))) }.map_err(driver)?;
        Ok(y)
    }

    /// `dtable[ids[t]] += dy[t]`.
    ///
    /// # Errors
    /// [`Error::Cuda`].
    pub fn embedding_backward(
        &self,
        dtable: &mut Buf,
        dy: &Buf,
        ids: &CudaSlice<u32>,
        t: usize,
        h: usize,
    ) -> Result<()> {
        let (ti, hi) = (t as i32, h as i32);
        let mut b = self.stream.launch_builder(self.kernels.f("embedding_bwd"));
        b.arg(dtable).arg(dy).arg(ids).arg(&ti).arg(&hi);
        // SAFETY: the kernel's signature.
        unsafe { b.launch(cfg(launch::per_row(t))) }.map_err(driver)?;
        Ok(())
    }

    /// Cross-entropy of `logits [t, v]`: `(lse [t], per-token loss [t], loss sums [2] as
    /// (Σ w loss, Σ loss) in f64)`; nothing is read back (the sums stay on the device).
    ///
    /// # Errors
    /// [`Error::Cuda`].
    pub fn cross_entropy(
        &self,
        logits: &Buf,
        labels: &CudaSlice<u32>,
        weights: &Buf,
        t: usize,
        v: usize,
    ) -> Result<(Buf, CudaSlice<f64>)> {
        let (mut lse, mut loss) = (self.empty(t)?, self.empty(t)?);
        let (ti, vi) = (t as i32, v as i32);
        let mut b = self
            .stream
            .launch_builder(self.kernels.f("cross_entropy_fwd"));
        b.arg(logits)
            .arg(labels)
            .arg(&mut lse)
            .arg(&mut loss)
            .arg(&ti)
            .arg(&vi);
        // SAFETY: the kernel's signature; labels < V.
        unsafe { b.launch(cfg(launch::per_row(t))) }.map_err(driver)?;
        let mut sums = self.stream.alloc_zeros::<f64>(2).map_err(driver)?;
        let mut b = self.stream.launch_builder(self.kernels.f("loss_sums"));
        b.arg(&loss).arg(weights).arg(&ti).arg(&mut sums);
        let one = Shape {
            grid: (1, 1),
            block: launch::NT_ROW,
        };
        // SAFETY: the kernel's signature; one block.
        unsafe { b.launch(cfg(one)) }.map_err(driver)?;
        Ok((lse, sums))
    }

    /// Cross-entropy dgrad `[t, v]`.
    ///
    /// # Errors
    /// [`Error::Cuda`].
    #[allow(clippy::too_many_arguments)]
    pub fn cross_entropy_backward(
        &self,
        logits: &Buf,
        lse: &Buf,
        labels: &CudaSlice<u32>,
        weights: &Buf,
        t: usize,
        v: usize,
    ) -> Result<Buf> {
        let mut d = self.empty(t * v)?;
        let (ti, vi) = (t as i32, v as i32);
        let mut b = self
            .stream
            .launch_builder(self.kernels.f("cross_entropy_bwd"));
        b.arg(logits)
            .arg(lse)
            .arg(labels)
            .arg(weights)
            .arg(&mut d)
            .arg(&ti)
            .arg(&vi);
        // SAFETY: the kernel's signature.
        unsafe { b.launch(cfg(launch::elementwise(t * v))) }.map_err(driver)?;
        Ok(d)
    }

    /// Varlen causal GQA attention: `(o [t, heads*d], lse [t, heads])` from `q [t, heads*d]`,
    /// `k, v [t, kv_heads*d]` and the microbatch's `tiles` ([`launch::tiles`]).
    ///
    /// # Errors
    /// [`Error::Cuda`].
    #[allow(clippy::too_many_arguments)]
    pub fn attention(
        &self,
        q: &Buf,
        k: &Buf,
        v: &Buf,
        tiles: &Tiles,
        t: usize,
        heads: usize,
        kv_heads: usize,
    ) -> Result<(Buf, Buf)> {
        let d = self.kernels.head_dim;
        let (mut o, mut lse) = (self.empty(t * heads * d)?, self.empty(t * heads)?);
        let (hi, kvi, scale) = (heads as i32, kv_heads as i32, 1.0 / (d as f32).sqrt());
        let mut b = self.stream.launch_builder(self.kernels.f("attn_fwd"));
        b.arg(q)
            .arg(k)
            .arg(v)
            .arg(&mut o)
            .arg(&mut lse)
            .arg(&tiles.dev)
            .arg(&hi)
            .arg(&kvi)
            .arg(&scale);
        // SAFETY: the kernel's signature; tiles cover [0, t) without crossing a sequence.
        unsafe { b.launch(cfg(tiles.shape(heads))) }.map_err(driver)?;
        Ok((o, lse))
    }

    /// Attention backward: `(dq, dk, dv)` (FlashAttention-2's, Dao 2023).
    ///
    /// # Errors
    /// [`Error::Cuda`].
    #[allow(clippy::too_many_arguments)]
    pub fn attention_backward(
        &self,
        dout: &Buf,
        (q, k, v, o, lse): (&Buf, &Buf, &Buf, &Buf, &Buf),
        tiles: &Tiles,
        t: usize,
        heads: usize,
        kv_heads: usize,
    ) -> Result<(Buf, Buf, Buf)> {
        let d = self.kernels.head_dim;
        let (ti, hi, kvi, scale) = (
            t as i32,
            heads as i32,
            kv_heads as i32,
            1.0 / (d as f32).sqrt(),
        );
        let mut delta = self.empty(t * heads)?;
        let mut b = self.stream.launch_builder(self.kernels.f("attn_bwd_delta"));
        b.arg(dout).arg(o).arg(&mut delta).arg(&ti).arg(&hi);
        // SAFETY: the kernel's signature.
        unsafe { b.launch(cfg(launch::elementwise(t * heads))) }.map_err(driver)?;
        let mut dq = self.empty(t * heads * d)?;
        let mut b = self.stream.launch_builder(self.kernels.f("attn_bwd_dq"));
        b.arg(q)
            .arg(k)
            .arg(v)
            .arg(dout)
            .arg(lse)
            .arg(&delta)
            .arg(&mut dq)
            .arg(&tiles.dev)
            .arg(&hi)
            .arg(&kvi)
            .arg(&scale);
        // SAFETY: the kernel's signature.
        unsafe { b.launch(cfg(tiles.shape(heads))) }.map_err(driver)?;
        let (mut dk, mut dv) = (self.empty(t * kv_heads * d)?, self.empty(t * kv_heads * d)?);
        let mut b = self.stream.launch_builder(self.kernels.f("attn_bwd_dkdv"));
        b.arg(q)
            .arg(k)
            .arg(v)
            .arg(dout)
            .arg(lse)
            .arg(&delta)
            .arg(&mut dk)
            .arg(&mut dv)
            .arg(&tiles.dev)
            .arg(&hi)
            .arg(&kvi)
            .arg(&scale);
        // SAFETY: the kernel's signature.
        unsafe { b.launch(cfg(tiles.shape(kv_heads))) }.map_err(driver)?;
        Ok((dq, dk, dv))
    }

    /// `Σ x²` in f64 (reads the partial sums back: synchronises this stream).
    ///
    /// # Errors
    /// [`Error::Cuda`].
    pub fn sum_squares(&self, x: &Buf) -> Result<f64> {
        let mut partial = self
            .stream
            .alloc_zeros::<f64>(launch::SUM_BLOCKS as usize)
            .map_err(driver)?;
        let n = x.len() as i64;
        let mut b = self.stream.launch_builder(self.kernels.f("sum_squares"));
        b.arg(x).arg(&n).arg(&mut partial);
        // SAFETY: the kernel's signature; SUM_BLOCKS partial sums.
        unsafe { b.launch(cfg(launch::sum_squares())) }.map_err(driver)?;
        Ok(self.download(&partial)?.iter().sum())
    }

    /// One AdamW update of `p` (see [`crate::AdamW::update`]).
    ///
    /// # Errors
    /// [`Error::Cuda`].
    pub fn adamw(
        &self,
        (p, grad, m, v): (&mut Buf, &Buf, &mut Buf, &mut Buf),
        opt: &crate::AdamW,
        t: u64,
        grad_scale: f32,
    ) -> Result<()> {
        let n = p.len();
        let n64 = n as i64;
        let bc1 = 1.0 - opt.beta1.powi(t as i32);
        let bc2 = 1.0 - opt.beta2.powi(t as i32);
        let mut b = self.stream.launch_builder(self.kernels.f("adamw"));
        b.arg(p)
            .arg(grad)
            .arg(m)
            .arg(v)
            .arg(&n64)
            .arg(&opt.lr)
            .arg(&opt.beta1)
            .arg(&opt.beta2)
            .arg(&opt.eps)
            .arg(&opt.weight_decay)
            .arg(&bc1)
            .arg(&bc2)
            .arg(&grad_scale);
        // SAFETY: the kernel's signature; the four buffers have the same length n.
        unsafe { b.launch(cfg(launch::elementwise(n))) }.map_err(driver)?;
        Ok(())
    }

    /// Fills `p` with values uniform in `[-scale, scale)` from a hash of `(seed, index)` (fast
    /// initialisation of large models for timing; not the CPU backend's weights).
    ///
    /// # Errors
    /// [`Error::Cuda`].
    pub fn init_uniform(&self, p: &mut Buf, seed: u64, scale: f32) -> Result<()> {
        let n = p.len();
        let n64 = n as i64;
        let mut b = self.stream.launch_builder(self.kernels.f("init_uniform"));
        b.arg(p).arg(&n64).arg(&seed).arg(&scale);
        // SAFETY: the kernel's signature.
        unsafe { b.launch(cfg(launch::elementwise(n))) }.map_err(driver)?;
        Ok(())
    }
}

/// A microbatch's attention tiles on the device ([`launch::tiles`]).
#[derive(Debug)]
pub struct Tiles {
    dev: CudaSlice<i32>,
    count: usize,
}

impl Tiles {
    /// Uploads the tiles of `cu_seqlens`.
    ///
    /// # Errors
    /// [`Error::Cuda`].
    pub fn new(gpu: &Gpu, cu_seqlens: &[usize]) -> Result<Self> {
        let host = launch::tiles(cu_seqlens);
        Ok(Tiles {
            count: host.len() / 4,
            dev: gpu.upload(if host.is_empty() { &[0; 4] } else { &host })?,
        })
    }

    fn shape(&self, heads: usize) -> Shape {
        launch::attention_tiles(self.count, heads)
    }
}

/// Makes `ctx`'s device's default memory pool never insert waits on other streams to reuse
/// memory they freed (`CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES = 0`): ranks sharing a
/// GPU allocate from one pool, and such a hidden wait would make one rank's stream wait for
/// another's.
fn no_cross_stream_reuse(ctx: &Arc<CudaContext>) -> Result<()> {
    use cudarc::driver::sys;
    if !ctx.has_async_alloc() {
        // No stream-ordered pool on this device: cudarc allocates synchronously.
        return Ok(());
    }
    ctx.bind_to_thread().map_err(driver)?;
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    let mut zero: i32 = 0;
    // SAFETY: `pool` receives the device's default pool handle; the attribute takes an int.
    let r = unsafe {
        let r = sys::cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device());
        if r != sys::CUresult::CUDA_SUCCESS {
            r
        } else {
            sys::cuMemPoolSetAttribute(
                pool,
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES,
                (&mut zero) as *mut i32 as *mut std::ffi::c_void,
            )
        }
    };
    if r == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(Error::Cuda(format!(
            "cannot configure the device's memory pool: {r:?}"
        )))
    }
}
