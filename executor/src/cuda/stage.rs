//! The CUDA op set: the model of [`crate::model`] (the same code the CPU backend runs) over
//! device buffers, NVRTC-compiled kernels and cuBLAS GEMMs, so every schedule runs on it through
//! the same interpreter.
//!
//! A rank is a [`Gpu`]: its own compute stream (every kernel and GEMM of its stages), its own
//! copy stream (transfers in, [`Gpu::import`]), and its own memory accounting
//! ([`CudaStage::saved_bytes`]). Stages on the same rank (V placement) share its `Gpu`. Nothing
//! in a step waits on the host: microbatch data is uploaded before the step
//! ([`StageWorker::prepare_step`]); a tensor that crosses ranks is copied after the sender's
//! event and the receiving stream waits on the copy's event; losses stay on the device until the
//! step ends ([`crate::worker::StageOutput::LossPending`]); actions and copies are timed by events on the rank's
//! streams ([`DeviceClock`]).
//!
//! Weights: [`Init::Exact`] uploads the CPU backend's weights (same seed, same values: `--verify`
//! compares against the CPU reference); [`Init::Fast`] fills them on the device (for timing
//! large models, where drawing billions of normal samples on the host would take minutes).
//!
//! [`Executor::cuda`] builds a plan's ranks of such stages, spread over the GPUs.

use super::driver;
use super::launch;
use super::ops::{Activation, Buf, Gpu, Shared, Tiles};
use crate::cpu::CpuStage;
use crate::kernels::AttnDims;
use crate::model::layers::{attn_dims, build_layers};
use crate::model::{OpSet, ParamInit, Stage};
use crate::precision::Precision;
use crate::runner::{Executor, Setup};
use crate::worker::{AdamW, CopyStamps, DeviceClock, LossSums, StageWorker};
use crate::{Error, MicrobatchData, Result};
use cudarc::driver::CudaSlice;
use flatpipe_profiles::{LayerKind, ModelSpec};
use flatpipe_simulator::costs::Recompute;
use std::collections::HashMap;
use std::ops::Range;
use std::sync::Arc;
use std::time::Instant;

/// How a [`CudaStage`]'s weights are made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Init {
    /// The CPU backend's weights for the same seed (drawn on the host, uploaded).
    Exact,
    /// Uniform values of the same standard deviation drawn on the device (fast; for timing).
    Fast,
}

/// A microbatch's data on the device.
#[derive(Debug)]
pub struct Data {
    t: usize,
    ids: CudaSlice<u32>,
    labels: CudaSlice<u32>,
    weights: Buf,
    pos: CudaSlice<i32>,
    tiles: Tiles,
}

impl Data {
    fn new(gpu: &Gpu, d: &MicrobatchData) -> Result<Self> {
        let pad = |v: &[u32]| if v.is_empty() { vec![0] } else { v.to_vec() };
        let pos = launch::positions(&d.cu_seqlens);
        Ok(Data {
            t: d.tokens(),
            ids: gpu.upload(&pad(&d.ids))?,
            labels: gpu.upload(&pad(&d.labels))?,
            weights: gpu.upload(if d.loss_weights.is_empty() {
                &[0.0][..]
            } else {
                &d.loss_weights
            })?,
            pos: gpu.upload(if pos.is_empty() { &[0][..] } else { &pos })?,
            tiles: Tiles::new(gpu, &d.cu_seqlens)?,
        })
    }
}

/// The CUDA op set of one rank: its [`Gpu`] (streams, kernels, cuBLAS handle, clock). Tensors
/// are flat device buffers holding at least one value; shapes come with every call.
#[derive(Debug, Clone)]
pub struct CudaOps {
    gpu: Arc<Gpu>,
}

/// One pipeline stage on a GPU: layers `[start, end)` of a model.
pub type CudaStage = Stage<CudaOps>;

impl CudaStage {
    /// Builds layers `range` of `model` on rank `gpu` with weights from `seed` (see [`Init`]).
    ///
    /// # Errors
    /// As [`CpuStage::new`] for the range and the layer shapes; [`Error::Unsupported`] for
    /// selective recomputation (the CUDA op set has no row-scale kernel yet) or a decoder of
    /// another head dimension than `gpu`'s kernels; [`Error::Cuda`] (out of memory, driver).
    pub fn new(
        gpu: Arc<Gpu>,
        model: &ModelSpec,
        range: Range<usize>,
        seed: u64,
        recompute: Recompute,
        init: Init,
    ) -> Result<Self> {
        if recompute == Recompute::Selective {
            return Err(Error::Unsupported(
                "selective recomputation is not implemented by the CUDA backend yet (the CPU backend runs it); plan with recompute none or full".into(),
            ));
        }
        for l in model.layers().get(range.clone()).unwrap_or_default() {
            if l.kind == LayerKind::Decoder {
                let d = attn_dims(l)?.head_dim;
                if d != gpu.kernels.head_dim {
                    return Err(Error::Unsupported(format!(
                        "decoder layer {} has head dimension {d}; this rank's kernels were compiled for {}",
                        l.index, gpu.kernels.head_dim
                    )));
                }
            }
        }
        // Exact: the CPU backend's weights, by name and order.
        let mut exact: HashMap<String, Vec<f32>> = match init {
            Init::Exact => CpuStage::new(model, range.clone(), seed, recompute)?
                .named_params()
                .into_iter()
                .collect(),
            Init::Fast => HashMap::new(),
        };
        let ops = CudaOps { gpu };
        let mut salt = seed;
        let g = Arc::clone(&ops.gpu);
        let layers = build_layers(
            &ops,
            model,
            range.clone(),
            seed,
            crate::model::experts::ExpertShard::ALL,
            &mut |name, shape, how, _| {
                let n = shape.0 * shape.1;
                match exact.remove(name) {
                    Some(v) if v.len() == n => g.upload(&v),
                    Some(v) => Err(Error::Invalid(format!(
                        "{name}: {} values from the CPU backend, {n} expected",
                        v.len()
                    ))),
                    None if init == Init::Exact => Err(Error::Invalid(format!(
                        "{name}: no such parameter in the CPU backend's stage"
                    ))),
                    None => {
                        let mut b = g.empty(n)?;
                        match how {
                            // Uniform on [-a, a) has standard deviation a / sqrt(3).
                            ParamInit::Normal(s) => {
                                salt = salt.wrapping_add(0x9E37_79B9_7F4A_7C15);
                                g.init_uniform(&mut b, salt, s * 3f32.sqrt())?;
                            }
                            ParamInit::Ones => g.upload_into(&vec![1.0f32; n], &mut b)?,
                        }
                        Ok(b)
                    }
                }
            },
        )?;
        let hidden = model.layers()[range.start].hidden as usize;
        Ok(Stage::from_layers(ops, layers, hidden, recompute))
    }

    /// The head dimension of `model`'s decoders (what a rank's kernels are compiled for); 64
    /// for a model without decoders.
    ///
    /// # Errors
    /// [`Error::Unsupported`] when decoders differ in head dimension.
    pub fn head_dim_of(model: &ModelSpec) -> Result<usize> {
        let mut dims = model
            .layers()
            .iter()
            .filter(|l| l.kind == LayerKind::Decoder && l.heads > 0)
            .map(|l| (l.hidden / l.heads) as usize)
            .collect::<Vec<_>>();
        dims.dedup();
        match dims.as_slice() {
            [] => Ok(64),
            [d] => Ok(*d),
            _ => Err(Error::Unsupported(format!(
                "model {}: decoders of head dimensions {dims:?}; the CUDA backend compiles one per rank",
                model.name
            ))),
        }
    }

    /// The rank this stage runs on.
    pub fn gpu(&self) -> &Arc<Gpu> {
        &self.ops.gpu
    }

    /// Uploads `[T, H]` hidden states from the host (profiling, tests).
    ///
    /// # Errors
    /// [`Error::Cuda`].
    pub fn upload_hidden(&self, x: &[f32]) -> Result<Shared> {
        Ok(Activation::shared(self.ops.gpu.upload(x)?, x.len()))
    }

    /// Waits until this rank's streams have finished everything enqueued.
    ///
    /// # Errors
    /// [`Error::Cuda`], including errors cudarc stored from calls that could not return one.
    pub fn synchronize(&self) -> Result<()> {
        self.ops.gpu.synchronize()
    }
}

impl OpSet for CudaOps {
    type Tensor = Buf;
    type Hidden = Shared;
    type Data = Data;
    type Loss = CudaSlice<f64>;
    // Reading a loss now would make the host wait for the GPU inside the step.
    const DEFERRED_LOSS: bool = true;

    fn upload_data(&self, d: &MicrobatchData) -> Result<Data> {
        // The CUDA rotary and attention kernels know no position offset or earlier keys.
        if let Some(c) = d.chunk {
            return Err(crate::Error::Unsupported(format!(
                "a chunk of a longer sequence (chunk {} of {}, offset {}): the CUDA backend does not run chunked sequences yet; run on the CPU backend or plan without chunks",
                c.index, c.of, c.offset
            )));
        }
        Data::new(&self.gpu, d)
    }
    fn tokens(d: &Data) -> usize {
        d.t
    }
    fn hidden(&self, t: Buf, len: usize) -> Shared {
        Activation::shared(t, len)
    }
    fn tensor(h: &Shared) -> &Buf {
        &h.buf
    }
    fn hidden_len(h: &Shared) -> usize {
        h.len
    }
    fn bytes(t: &Buf) -> usize {
        t.len() * 4
    }
    fn ready(&self, h: Shared) -> Result<Shared> {
        self.gpu.mark_ready(h)
    }
    fn import(&self, h: Shared) -> Result<(Shared, CopyStamps)> {
        let (h, stamps) = self.gpu.import(h)?;
        Ok((h, Some(stamps)))
    }
    fn synchronize(&self) -> Result<()> {
        self.gpu.synchronize()
    }
    fn clock(&mut self) -> Option<&mut dyn DeviceClock> {
        Some(self)
    }

    fn zeros(&self, rows: usize, cols: usize) -> Result<Buf> {
        self.gpu.zeros(rows * cols)
    }
    fn fill_zero(&self, t: &mut Buf) -> Result<()> {
        self.gpu.stream.memset_zeros(t).map_err(driver)
    }
    fn visit(&self, t: &mut Buf, f: &mut dyn FnMut(&mut [f32])) -> Result<()> {
        // The data-parallel all-reduce through the host (NCCL is not wired yet): download,
        // visit, upload.
        let mut host = self.gpu.download(t)?;
        f(&mut host);
        self.gpu.upload_into(&host, t)
    }
    fn to_host(&self, t: &Buf) -> Vec<f32> {
        // On a CUDA error, NaN of the same length: a comparison then fails on this tensor
        // instead of silently passing.
        self.gpu.download(t).unwrap_or_else(|e| {
            tracing::error!(
                "cannot read a tensor of {} values from the GPU: {e}",
                t.len()
            );
            vec![f32::NAN; t.len()]
        })
    }
    fn sum_squares(&self, t: &Buf) -> Result<f64> {
        self.gpu.sum_squares(t)
    }
    fn adamw(
        &self,
        state: (&mut Buf, &Buf, &mut Buf, &mut Buf),
        opt: &AdamW,
        t: u64,
        grad_scale: f32,
    ) -> Result<()> {
        self.gpu.adamw(state, opt, t, grad_scale)
    }

    fn linear(&self, x: &Buf, w: &Buf, t: usize, din: usize, dout: usize) -> Result<Buf> {
        self.gpu.linear(x, w, t, din, dout)
    }
    fn linear_dx(&self, dy: &Buf, w: &Buf, t: usize, din: usize, dout: usize) -> Result<Buf> {
        let mut dx = self.gpu.empty(t * din)?;
        self.gpu.linear_dx(dy, w, &mut dx, t, din, dout, false)?;
        Ok(dx)
    }
    fn linear_dx_acc(
        &self,
        dx: &mut Buf,
        dy: &Buf,
        w: &Buf,
        t: usize,
        din: usize,
        dout: usize,
    ) -> Result<()> {
        self.gpu.linear_dx(dy, w, dx, t, din, dout, true)
    }
    fn linear_dw(
        &self,
        dw: &mut Buf,
        x: &Buf,
        dy: &Buf,
        t: usize,
        din: usize,
        dout: usize,
    ) -> Result<()> {
        self.gpu.linear_dw(dw, x, dy, t, din, dout)
    }
    fn add_inplace(&self, y: &mut Buf, x: &Buf, n: usize) -> Result<()> {
        self.gpu.add_inplace(y, x, n)
    }
    fn rmsnorm(&self, x: &Buf, g: &Buf, t: usize, h: usize) -> Result<(Buf, Buf, Buf)> {
        self.gpu.rmsnorm(x, g, t, h)
    }
    fn rmsnorm_dx(
        &self,
        dy: &Buf,
        xhat: &Buf,
        rstd: &Buf,
        g: &Buf,
        residual: Option<&Buf>,
        t: usize,
        h: usize,
    ) -> Result<Buf> {
        self.gpu.rmsnorm_dx(dy, xhat, rstd, g, residual, t, h)
    }
    fn rmsnorm_dg(&self, dg: &mut Buf, dy: &Buf, xhat: &Buf, t: usize, h: usize) -> Result<()> {
        self.gpu.rmsnorm_dg(dg, dy, xhat, t, h)
    }
    fn scale_rows(&self, _xhat: &Buf, _g: &Buf, _t: usize, _h: usize) -> Result<Buf> {
        Err(Error::Unsupported(
            "selective recomputation on the CUDA backend (no row-scale kernel yet)".into(),
        ))
    }
    fn rope(
        &self,
        x: &mut Buf,
        data: &Data,
        heads: usize,
        _head_dim: usize,
        inverse: bool,
    ) -> Result<()> {
        self.gpu.rope(x, &data.pos, data.t, heads, inverse)
    }
    fn attention(
        &self,
        q: &Buf,
        k: &Buf,
        v: &Buf,
        data: &Data,
        dims: AttnDims,
    ) -> Result<(Buf, Buf)> {
        self.gpu
            .attention(q, k, v, &data.tiles, data.t, dims.heads, dims.kv_heads)
    }
    fn attention_backward(
        &self,
        dout: &Buf,
        saved: (&Buf, &Buf, &Buf, &Buf, &Buf),
        data: &Data,
        dims: AttnDims,
    ) -> Result<(Buf, Buf, Buf)> {
        self.gpu
            .attention_backward(dout, saved, &data.tiles, data.t, dims.heads, dims.kv_heads)
    }
    fn swiglu(&self, gate: &Buf, up: &Buf, n: usize) -> Result<Buf> {
        self.gpu.swiglu(gate, up, n)
    }
    fn swiglu_backward(&self, d: &Buf, gate: &Buf, up: &Buf, n: usize) -> Result<(Buf, Buf)> {
        self.gpu.swiglu_backward(d, gate, up, n)
    }
    fn embedding(&self, table: &Buf, data: &Data, h: usize) -> Result<Buf> {
        self.gpu.embedding(table, &data.ids, data.t, h)
    }
    fn embedding_backward(&self, dtable: &mut Buf, dy: &Buf, data: &Data, h: usize) -> Result<()> {
        self.gpu
            .embedding_backward(dtable, dy, &data.ids, data.t, h)
    }
    fn cross_entropy(
        &self,
        logits: &Buf,
        data: &Data,
        vocab: usize,
    ) -> Result<(CudaSlice<f64>, Buf)> {
        let (lse, sums) =
            self.gpu
                .cross_entropy(logits, &data.labels, &data.weights, data.t, vocab)?;
        Ok((sums, lse))
    }
    fn cross_entropy_backward(
        &self,
        logits: &Buf,
        lse: &Buf,
        data: &Data,
        vocab: usize,
    ) -> Result<Buf> {
        self.gpu
            .cross_entropy_backward(logits, lse, &data.labels, &data.weights, data.t, vocab)
    }
    fn read_loss(&self, loss: &CudaSlice<f64>, tokens: u64) -> Result<LossSums> {
        let s = self.gpu.download(loss)?;
        Ok(LossSums {
            weighted: s[0],
            sum: s[1],
            tokens,
        })
    }
}

impl DeviceClock for CudaOps {
    fn start(&mut self) -> Result<()> {
        self.gpu.clock_start()
    }

    fn stamp(&mut self) -> Result<usize> {
        self.gpu.stamp(&self.gpu.stream)
    }

    fn finish(&mut self, t0: Instant) -> Result<Vec<u64>> {
        self.gpu.clock_finish(t0)
    }
}

impl Executor<CudaStage> {
    /// Builds every rank's stages on `devices` GPUs: rank `g` (replica-major, `d * pp + r`)
    /// runs on GPU `g mod devices` with its own streams ([`Gpu`]), shared by
    /// its stages; with one device every rank is a stream of GPU 0, with one per rank every
    /// transfer is a peer copy. With [`Init::Exact`] the weights are the CPU
    /// backend's, so a comparison with the CPU reference compares like with like.
    ///
    /// # Errors
    /// [`Setup::check`](crate::runner::Setup::check) errors; [`Error::NoDevice`] without a GPU or NVRTC, or with fewer GPUs
    /// than `devices`; [`Error::Invalid`] for `devices = 0`; stage errors.
    pub fn cuda(setup: &Setup, precision: Precision, init: Init, devices: usize) -> Result<Self> {
        setup.check()?;
        if devices == 0 {
            return Err(Error::Invalid("GPUs = 0: use at least 1".into()));
        }
        let placement = setup.placement()?;
        let contexts = (0..devices)
            .map(super::context_on)
            .collect::<Result<Vec<_>>>()?;
        let head_dim = CudaStage::head_dim_of(&setup.model)?;
        let pp = setup.config.pp as usize;
        let mut gpus: HashMap<(usize, usize), Arc<Gpu>> = HashMap::new();
        Executor::build_ranked(setup, &placement, |d, r, s| {
            let gpu = match gpus.get(&(d, r)) {
                Some(g) => Arc::clone(g),
                None => {
                    let ctx = &contexts[(d * pp + r) % devices];
                    let g = Arc::new(Gpu::new(ctx, head_dim, precision)?);
                    gpus.insert((d, r), Arc::clone(&g));
                    g
                }
            };
            let mode = setup.config.recompute_of(s);
            CudaStage::new(
                gpu,
                &setup.model,
                setup.config.stages[s].clone(),
                setup.init_seed,
                mode,
                init,
            )
        })
    }
}
