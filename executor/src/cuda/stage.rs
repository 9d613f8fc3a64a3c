//! The CUDA stage worker: the CPU backend's decoder ([`crate::cpu`]) layer for layer on a GPU,
//! with the same F / I / W split, so every schedule runs on it through the same interpreter.
//!
//! A rank is a [`Gpu`]: its own compute stream (every kernel and GEMM of its stages), its own
//! copy stream (transfers in, [`Gpu::import`]), and its own memory accounting
//! ([`CudaStage::saved_bytes`]). Stages on the same rank (V placement) share its `Gpu`. Nothing
//! in a step waits on the host: microbatch data is uploaded before the step
//! ([`StageWorker::prepare_step`]); a tensor that crosses ranks is copied after the sender's
//! event and the receiving stream waits on the copy's event; losses stay on the device until the
//! step ends ([`StageOutput::LossPending`]); actions and copies are timed by events on the rank's
//! streams ([`DeviceClock`]).
//!
//! Weights: [`Init::Exact`] uploads the CPU backend's weights (same seed, same values: `--verify`
//! compares against the CPU reference); [`Init::Fast`] fills them on the device (for timing
//! large models, where drawing billions of normal samples on the host would take minutes).

use super::ops::{Activation, Buf, Gpu, Shared, Tiles};
use super::{driver, launch};
use crate::cpu::CpuStage;
use crate::kernels::AttnDims;
use crate::worker::{
    AdamW, CopyStamps, DeviceClock, LossSums, Misuse, StageInput, StageOutput, StageWorker,
};
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

/// A parameter on the device with its gradient and AdamW moments, `[rows, cols]`. The moments
/// are allocated at the first optimizer step (a stage that is only timed never needs them).
#[derive(Debug)]
struct Param {
    name: String,
    value: Buf,
    grad: Buf,
    moments: Option<(Buf, Buf)>,
}

impl Param {
    fn new(gpu: &Gpu, name: String, value: Buf) -> Result<Self> {
        let n = value.len();
        Ok(Param {
            name,
            value,
            grad: gpu.zeros(n)?,
            moments: None,
        })
    }
}

#[derive(Debug)]
struct Decoder {
    dims: AttnDims,
    hidden: usize,
    ffn: usize,
    attn_norm: Param,
    wq: Param,
    wk: Param,
    wv: Param,
    wo: Param,
    ffn_norm: Param,
    w1: Param,
    w3: Param,
    w2: Param,
}

impl Decoder {
    fn kv(&self) -> usize {
        self.dims.kv_heads * self.dims.head_dim
    }
}

#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
enum Layer {
    Embedding {
        table: Param,
        hidden: usize,
    },
    Decoder(Box<Decoder>),
    Head {
        norm: Param,
        out: Param,
        hidden: usize,
        vocab: usize,
    },
}

impl Layer {
    fn params(&self) -> Vec<&Param> {
        match self {
            Layer::Embedding { table, .. } => vec![table],
            Layer::Head { norm, out, .. } => vec![norm, out],
            Layer::Decoder(d) => vec![
                &d.attn_norm,
                &d.wq,
                &d.wk,
                &d.wv,
                &d.wo,
                &d.ffn_norm,
                &d.w1,
                &d.w3,
                &d.w2,
            ],
        }
    }

    fn params_mut(&mut self) -> Vec<&mut Param> {
        match self {
            Layer::Embedding { table, .. } => vec![table],
            Layer::Head { norm, out, .. } => vec![norm, out],
            Layer::Decoder(d) => {
                let d = &mut **d;
                vec![
                    &mut d.attn_norm,
                    &mut d.wq,
                    &mut d.wk,
                    &mut d.wv,
                    &mut d.wo,
                    &mut d.ffn_norm,
                    &mut d.w1,
                    &mut d.w3,
                    &mut d.w2,
                ]
            }
        }
    }
}

/// A microbatch's data on the device.
#[derive(Debug)]
struct Data {
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

/// What a decoder's forward keeps for its backward (the CPU backend's `DecoderF`).
#[derive(Debug)]
struct DecoderF {
    xhat1: Buf,
    rstd1: Buf,
    h1: Buf,
    q: Buf,
    k: Buf,
    v: Buf,
    o: Buf,
    lse: Buf,
    h2: Buf,
    xhat2: Buf,
    rstd2: Buf,
    gate: Buf,
    up: Buf,
    act: Buf,
}

#[derive(Debug)]
struct HeadF {
    h: Buf,
    xhat: Buf,
    rstd: Buf,
    logits: Buf,
    lse: Buf,
}

#[derive(Debug)]
enum FCtx {
    Embedding,
    Decoder(Box<DecoderF>),
    Head(Box<HeadF>),
    /// Full recomputation: the layer's input only.
    Input(Shared),
}

/// What a decoder's dgrad keeps for its wgrad (the CPU backend's `DecoderW`).
#[derive(Debug)]
struct DecoderW {
    h1: Buf,
    xhat1: Buf,
    o: Buf,
    h2: Buf,
    xhat2: Buf,
    act: Buf,
    dq: Buf,
    dk: Buf,
    dv: Buf,
    da: Buf,
    dgate: Buf,
    dup: Buf,
    dm: Shared,
    dh1: Buf,
    dh2: Buf,
}

// A few buffer handles per variant: boxing the head's buys nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
enum WCtx {
    Embedding {
        dy: Shared,
    },
    Decoder(Box<DecoderW>),
    Head {
        h: Buf,
        xhat: Buf,
        dlogits: Buf,
        dh: Buf,
    },
}

fn bytes(bufs: &[&Buf]) -> usize {
    bufs.iter().map(|b| b.len() * 4).sum()
}

impl FCtx {
    fn bytes(&self) -> usize {
        match self {
            FCtx::Embedding => 0,
            FCtx::Input(x) => x.len * 4,
            FCtx::Head(c) => bytes(&[&c.h, &c.xhat, &c.rstd, &c.logits, &c.lse]),
            FCtx::Decoder(c) => bytes(&[
                &c.h1, &c.xhat1, &c.rstd1, &c.q, &c.k, &c.v, &c.o, &c.lse, &c.h2, &c.xhat2,
                &c.rstd2, &c.gate, &c.up, &c.act,
            ]),
        }
    }
}

impl WCtx {
    fn bytes(&self) -> usize {
        match self {
            WCtx::Embedding { dy } => dy.len * 4,
            WCtx::Head {
                h,
                xhat,
                dlogits,
                dh,
            } => bytes(&[h, xhat, dlogits, dh]),
            WCtx::Decoder(w) => bytes(&[
                &w.h1, &w.xhat1, &w.o, &w.h2, &w.xhat2, &w.act, &w.dq, &w.dk, &w.dv, &w.da,
                &w.dgate, &w.dup, &w.dm.buf, &w.dh1, &w.dh2,
            ]),
        }
    }
}

enum Flow {
    Tokens,
    Hidden(Shared),
    Loss(CudaSlice<f64>),
}

fn decoder_forward(g: &Gpu, p: &Decoder, x: &Buf, data: &Data) -> Result<(Buf, DecoderF)> {
    let (t, h, f, kv) = (data.t, p.hidden, p.ffn, p.kv());
    let (heads, kvh) = (p.dims.heads, p.dims.kv_heads);
    let (h1, xhat1, rstd1) = g.rmsnorm(x, &p.attn_norm.value, t, h)?;
    let mut q = g.linear(&h1, &p.wq.value, t, h, h)?;
    let mut k = g.linear(&h1, &p.wk.value, t, h, kv)?;
    let v = g.linear(&h1, &p.wv.value, t, h, kv)?;
    g.rope(&mut q, &data.pos, t, heads, false)?;
    g.rope(&mut k, &data.pos, t, kvh, false)?;
    let (o, lse) = g.attention(&q, &k, &v, &data.tiles, t, heads, kvh)?;
    let mut x2 = g.linear(&o, &p.wo.value, t, h, h)?;
    g.add_inplace(&mut x2, x, t * h)?;
    let (h2, xhat2, rstd2) = g.rmsnorm(&x2, &p.ffn_norm.value, t, h)?;
    let gate = g.linear(&h2, &p.w1.value, t, h, f)?;
    let up = g.linear(&h2, &p.w3.value, t, h, f)?;
    let act = g.swiglu(&gate, &up, t * f)?;
    let mut y = g.linear(&act, &p.w2.value, t, f, h)?;
    g.add_inplace(&mut y, &x2, t * h)?;
    Ok((
        y,
        DecoderF {
            xhat1,
            rstd1,
            h1,
            q,
            k,
            v,
            o,
            lse,
            h2,
            xhat2,
            rstd2,
            gate,
            up,
            act,
        },
    ))
}

fn decoder_dgrad(
    g: &Gpu,
    p: &Decoder,
    c: DecoderF,
    dy_shared: Shared,
    data: &Data,
) -> Result<(Buf, WCtx)> {
    let (t, h, f, kv) = (data.t, p.hidden, p.ffn, p.kv());
    let (heads, kvh) = (p.dims.heads, p.dims.kv_heads);
    let dy = &dy_shared.buf;
    // MLP: y = x2 + act W2
    let mut dact = g.empty(t * f)?;
    g.linear_dx(dy, &p.w2.value, &mut dact, t, f, h, false)?;
    let (dgate, dup) = g.swiglu_backward(&dact, &c.gate, &c.up, t * f)?;
    let mut dh2 = g.empty(t * h)?;
    g.linear_dx(&dgate, &p.w1.value, &mut dh2, t, h, f, false)?;
    g.linear_dx(&dup, &p.w3.value, &mut dh2, t, h, f, true)?;
    let dx2 = g.rmsnorm_dx(&dh2, &c.xhat2, &c.rstd2, &p.ffn_norm.value, Some(dy), t, h)?;
    // Attention: x2 = x + o Wo
    let mut dout = g.empty(t * h)?;
    g.linear_dx(&dx2, &p.wo.value, &mut dout, t, h, h, false)?;
    let (mut dq, mut dk, dv) = g.attention_backward(
        &dout,
        (&c.q, &c.k, &c.v, &c.o, &c.lse),
        &data.tiles,
        t,
        heads,
        kvh,
    )?;
    g.rope(&mut dq, &data.pos, t, heads, true)?;
    g.rope(&mut dk, &data.pos, t, kvh, true)?;
    let mut dh1 = g.empty(t * h)?;
    g.linear_dx(&dq, &p.wq.value, &mut dh1, t, h, h, false)?;
    g.linear_dx(&dk, &p.wk.value, &mut dh1, t, h, kv, true)?;
    g.linear_dx(&dv, &p.wv.value, &mut dh1, t, h, kv, true)?;
    let dx = g.rmsnorm_dx(
        &dh1,
        &c.xhat1,
        &c.rstd1,
        &p.attn_norm.value,
        Some(&dx2),
        t,
        h,
    )?;
    let w = WCtx::Decoder(Box::new(DecoderW {
        h1: c.h1,
        xhat1: c.xhat1,
        o: c.o,
        h2: c.h2,
        xhat2: c.xhat2,
        act: c.act,
        dq,
        dk,
        dv,
        da: dx2,
        dgate,
        dup,
        dm: dy_shared,
        dh1,
        dh2,
    }));
    Ok((dx, w))
}

fn head_forward(
    g: &Gpu,
    (norm, out): (&Param, &Param),
    (hidden, vocab): (usize, usize),
    x: &Buf,
    data: &Data,
) -> Result<(CudaSlice<f64>, HeadF)> {
    let t = data.t;
    let (h, xhat, rstd) = g.rmsnorm(x, &norm.value, t, hidden)?;
    let logits = g.linear(&h, &out.value, t, hidden, vocab)?;
    let (lse, sums) = g.cross_entropy(&logits, &data.labels, &data.weights, t, vocab)?;
    Ok((
        sums,
        HeadF {
            h,
            xhat,
            rstd,
            logits,
            lse,
        },
    ))
}

fn head_dgrad(
    g: &Gpu,
    (norm, out): (&Param, &Param),
    (hidden, vocab): (usize, usize),
    c: HeadF,
    data: &Data,
) -> Result<(Buf, WCtx)> {
    let t = data.t;
    let dlogits =
        g.cross_entropy_backward(&c.logits, &c.lse, &data.labels, &data.weights, t, vocab)?;
    let mut dh = g.empty(t * hidden)?;
    g.linear_dx(&dlogits, &out.value, &mut dh, t, hidden, vocab, false)?;
    let dx = g.rmsnorm_dx(&dh, &c.xhat, &c.rstd, &norm.value, None, t, hidden)?;
    Ok((
        dx,
        WCtx::Head {
            h: c.h,
            xhat: c.xhat,
            dlogits,
            dh,
        },
    ))
}

/// One pipeline stage on a GPU: layers `[start, end)` of a model.
#[derive(Debug)]
pub struct CudaStage {
    gpu: Arc<Gpu>,
    layers: Vec<(usize, Layer)>,
    hidden: usize,
    recompute: Recompute,
    fctx: HashMap<u32, (Data, Vec<FCtx>)>,
    wctx: HashMap<u32, (Data, Vec<WCtx>)>,
    pending: Vec<(u32, bool, u64, CudaSlice<f64>)>,
    /// Microbatch data uploaded before the step, by (microbatch, forward-only).
    staged: HashMap<(u32, bool), Data>,
    peak_saved: usize,
}

impl CudaStage {
    /// Builds layers `range` of `model` on rank `gpu` with weights from `seed` (see [`Init`]).
    ///
    /// # Errors
    /// As [`CpuStage::new`] for the range and recomputation; [`Error::Unsupported`] for a head
    /// dimension the attention kernels do not take (even, at most 128) or a decoder of another
    /// head dimension than `gpu`'s kernels; [`Error::Cuda`] (out of memory, driver).
    pub fn new(
        gpu: Arc<Gpu>,
        model: &ModelSpec,
        range: Range<usize>,
        seed: u64,
        recompute: Recompute,
        init: Init,
    ) -> Result<Self> {
        let all = model.layers();
        if range.is_empty() || range.end > all.len() {
            return Err(Error::Invalid(format!(
                "stage layers [{}, {}) of model {} with {} layers: need 0 <= start < end <= {}",
                range.start,
                range.end,
                model.name,
                all.len(),
                all.len()
            )));
        }
        if recompute == Recompute::Selective {
            return Err(Error::Unsupported(
                "selective recomputation is not implemented by the CUDA backend yet (the CPU backend runs it); plan with recompute none or full".into(),
            ));
        }
        // Exact: the CPU backend's weights, by name and order.
        let mut exact: HashMap<String, Vec<f32>> = match init {
            Init::Exact => CpuStage::new(model, range.clone(), seed, recompute)?
                .named_params()
                .into_iter()
                .collect(),
            Init::Fast => HashMap::new(),
        };
        let mut salt = seed;
        let mut param = |name: String, n: usize, std: Option<f32>| -> Result<Param> {
            let value = match exact.remove(&name) {
                Some(v) if v.len() == n => gpu.upload(&v)?,
                Some(v) => {
                    return Err(Error::Invalid(format!(
                        "{name}: {} values from the CPU backend, {n} expected",
                        v.len()
                    )));
                }
                None if init == Init::Exact => {
                    return Err(Error::Invalid(format!(
                        "{name}: no such parameter in the CPU backend's stage"
                    )));
                }
                None => {
                    let mut b = gpu.empty(n)?;
                    match std {
                        // Uniform on [-a, a) has standard deviation a / sqrt(3).
                        Some(s) => {
                            salt = salt.wrapping_add(0x9E37_79B9_7F4A_7C15);
                            gpu.init_uniform(&mut b, salt, s * 3f32.sqrt())?;
                        }
                        None => gpu.upload_into(&vec![1.0f32; n], &mut b)?,
                    }
                    b
                }
            };
            Param::new(&gpu, name, value)
        };
        let mut layers = Vec::with_capacity(range.len());
        for l in &all[range.clone()] {
            let (h, vocab) = (l.hidden as usize, l.vocab as usize);
            let layer = match l.kind {
                LayerKind::Embedding => Layer::Embedding {
                    table: param("tok_embeddings.weight".into(), vocab * h, Some(1.0))?,
                    hidden: h,
                },
                LayerKind::Head => Layer::Head {
                    norm: param("norm.weight".into(), h, None)?,
                    out: param("output.weight".into(), h * vocab, Some(0.02))?,
                    hidden: h,
                    vocab,
                },
                LayerKind::Decoder => {
                    let (heads, kvh) = (l.heads as usize, l.kv_heads as usize);
                    if heads == 0 || kvh == 0 || h % heads != 0 || heads % kvh != 0 {
                        return Err(Error::Unsupported(format!(
                            "decoder layer {}: hidden {h}, heads {heads}, kv_heads {kvh}: need heads | hidden and kv_heads | heads",
                            l.index
                        )));
                    }
                    let d = h / heads;
                    if d != gpu.kernels.head_dim {
                        return Err(Error::Unsupported(format!(
                            "decoder layer {} has head dimension {d}; this rank's kernels were compiled for {}",
                            l.index, gpu.kernels.head_dim
                        )));
                    }
                    let (kv, ffn) = (d * kvh, l.ffn as usize);
                    let n = l.decoder_index.unwrap_or(0);
                    let name = |s: &str| format!("layers.{n}.{s}.weight");
                    Layer::Decoder(Box::new(Decoder {
                        dims: AttnDims {
                            heads,
                            kv_heads: kvh,
                            head_dim: d,
                        },
                        hidden: h,
                        ffn,
                        attn_norm: param(name("attention_norm"), h, None)?,
                        wq: param(name("attention.wq"), h * h, Some(0.02))?,
                        wk: param(name("attention.wk"), h * kv, Some(0.02))?,
                        wv: param(name("attention.wv"), h * kv, Some(0.02))?,
                        wo: param(name("attention.wo"), h * h, Some(0.02))?,
                        ffn_norm: param(name("ffn_norm"), h, None)?,
                        w1: param(name("feed_forward.w1"), h * ffn, Some(0.02))?,
                        w3: param(name("feed_forward.w3"), h * ffn, Some(0.02))?,
                        w2: param(name("feed_forward.w2"), ffn * h, Some(0.02))?,
                    }))
                }
            };
            layers.push((l.index, layer));
        }
        Ok(CudaStage {
            hidden: all[range.start].hidden as usize,
            gpu,
            layers,
            recompute,
            fctx: HashMap::new(),
            wctx: HashMap::new(),
            pending: Vec::new(),
            staged: HashMap::new(),
            peak_saved: 0,
        })
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

    /// Bytes of activations and gradients held between F and W, from the device tensors.
    pub fn saved_bytes(&self) -> usize {
        let f: usize = self
            .fctx
            .values()
            .flat_map(|(_, c)| c)
            .map(FCtx::bytes)
            .sum();
        let w: usize = self
            .wctx
            .values()
            .flat_map(|(_, c)| c)
            .map(WCtx::bytes)
            .sum();
        f + w
    }

    /// The most [`CudaStage::saved_bytes`] seen after any action (this stage's share of its
    /// rank's peak activation memory).
    pub fn peak_saved_bytes(&self) -> usize {
        self.peak_saved
    }

    /// Parameters of this stage.
    pub fn param_count(&self) -> u64 {
        self.layers
            .iter()
            .flat_map(|(_, l)| l.params())
            .map(|p| p.value.len() as u64)
            .sum()
    }

    /// The rank this stage runs on.
    pub fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
    }

    /// Uploads `[T, H]` hidden states from the host (profiling, tests).
    ///
    /// # Errors
    /// [`Error::Cuda`].
    pub fn upload_hidden(&self, x: &[f32]) -> Result<Shared> {
        Ok(Activation::shared(self.gpu.upload(x)?, x.len()))
    }

    /// Waits until this rank's streams have finished everything enqueued.
    ///
    /// # Errors
    /// [`Error::Cuda`], including errors cudarc stored from calls that could not return one.
    pub fn synchronize(&self) -> Result<()> {
        self.gpu.synchronize()
    }

    /// `(name, values)` of `pick(parameter)` for every parameter, read back from the GPU.
    fn named(&self, pick: impl Fn(&Param) -> &Buf) -> Vec<(String, Vec<f32>)> {
        self.layers
            .iter()
            .flat_map(|(_, l)| l.params())
            .map(|p| (p.name.clone(), self.download_or_nan(&p.name, pick(p))))
            .collect()
    }

    /// `buf` on the host; on a CUDA error, NaN of the same length (a comparison then fails on
    /// this tensor instead of silently passing) and the error in the log.
    fn download_or_nan(&self, name: &str, buf: &Buf) -> Vec<f32> {
        self.gpu.download(buf).unwrap_or_else(|e| {
            tracing::error!("cannot read {name} from the GPU: {e}");
            vec![f32::NAN; buf.len()]
        })
    }

    fn note_peak(&mut self) {
        self.peak_saved = self.peak_saved.max(self.saved_bytes());
    }

    fn run_layer(
        g: &Gpu,
        layer: &Layer,
        flow: Flow,
        data: &Data,
        keep: bool,
        recompute: Recompute,
    ) -> Result<(Flow, Option<FCtx>)> {
        Ok(match (layer, flow) {
            (Layer::Embedding { table, hidden }, Flow::Tokens) => (
                Flow::Hidden(Activation::shared(
                    g.embedding(&table.value, &data.ids, data.t, *hidden)?,
                    data.t * hidden,
                )),
                keep.then_some(FCtx::Embedding),
            ),
            (Layer::Decoder(d), Flow::Hidden(x)) => {
                let (y, c) = decoder_forward(g, d, &x.buf, data)?;
                let ctx = match (keep, recompute) {
                    (false, _) => None,
                    (true, Recompute::Full) => Some(FCtx::Input(x)),
                    (true, _) => Some(FCtx::Decoder(Box::new(c))),
                };
                (Flow::Hidden(Activation::shared(y, data.t * d.hidden)), ctx)
            }
            (
                Layer::Head {
                    norm,
                    out,
                    hidden,
                    vocab,
                },
                Flow::Hidden(x),
            ) => {
                let (sums, c) = head_forward(g, (norm, out), (*hidden, *vocab), &x.buf, data)?;
                let ctx = match (keep, recompute) {
                    (false, _) => None,
                    (true, Recompute::Full) => Some(FCtx::Input(x)),
                    (true, _) => Some(FCtx::Head(Box::new(c))),
                };
                (Flow::Loss(sums), ctx)
            }
            (Layer::Embedding { .. }, _) => {
                return Err(Misuse::EmbeddingWantsTokens.into());
            }
            (_, Flow::Tokens) => {
                return Err(Misuse::TokensOnlyIntoEmbedding.into());
            }
            (_, Flow::Loss(_)) => {
                return Err(Misuse::NothingAfterHead.into());
            }
        })
    }
}

impl StageWorker for CudaStage {
    type Hidden = Shared;

    fn hidden_size(&self) -> usize {
        self.hidden
    }

    fn hidden_len(h: &Shared) -> usize {
        h.len
    }

    fn forward(
        &mut self,
        mb: u32,
        data: &MicrobatchData,
        input: StageInput<Shared>,
        keep: bool,
    ) -> Result<StageOutput<Shared>> {
        let dev = match self.staged.remove(&(mb, !keep)) {
            Some(d) => d,
            None => Data::new(&self.gpu, data)?,
        };
        let mut flow = match input {
            StageInput::Tokens => Flow::Tokens,
            StageInput::Hidden(h) => Flow::Hidden(h),
        };
        let mut ctxs = Vec::with_capacity(self.layers.len());
        for (_, layer) in &self.layers {
            let (next, ctx) = Self::run_layer(&self.gpu, layer, flow, &dev, keep, self.recompute)?;
            flow = next;
            ctxs.extend(ctx);
        }
        let tokens = dev.t as u64;
        if keep {
            if self.fctx.contains_key(&mb) {
                return Err(Misuse::ForwardTwice(mb).into());
            }
            self.fctx.insert(mb, (dev, ctxs));
            self.note_peak();
        }
        match flow {
            Flow::Hidden(h) => Ok(StageOutput::Hidden(self.gpu.mark_ready(h)?)),
            Flow::Loss(sums) => {
                self.pending.push((mb, !keep, tokens, sums));
                Ok(StageOutput::LossPending)
            }
            Flow::Tokens => Err(Misuse::NoLayers.into()),
        }
    }

    fn backward_input(
        &mut self,
        mb: u32,
        _data: &MicrobatchData,
        grad: Option<Shared>,
    ) -> Result<Option<Shared>> {
        let (dev, ctxs) = self
            .fctx
            .remove(&mb)
            .ok_or(Misuse::DgradBeforeForward(mb))?;
        let g = &*self.gpu;
        let mut dy = grad;
        let mut wctxs = Vec::with_capacity(ctxs.len());
        for ((_, layer), ctx) in self.layers.iter().zip(ctxs).rev() {
            // Full recomputation: rerun this layer's forward from its saved input.
            let ctx = match ctx {
                FCtx::Input(x) => match layer {
                    Layer::Decoder(d) => {
                        FCtx::Decoder(Box::new(decoder_forward(g, d, &x.buf, &dev)?.1))
                    }
                    Layer::Head {
                        norm,
                        out,
                        hidden,
                        vocab,
                    } => FCtx::Head(Box::new(
                        head_forward(g, (norm, out), (*hidden, *vocab), &x.buf, &dev)?.1,
                    )),
                    Layer::Embedding { .. } => FCtx::Embedding,
                },
                c => c,
            };
            let (dx, w) = match (layer, ctx) {
                (
                    Layer::Head {
                        norm,
                        out,
                        hidden,
                        vocab,
                    },
                    FCtx::Head(c),
                ) => {
                    let (dx, w) = head_dgrad(g, (norm, out), (*hidden, *vocab), *c, &dev)?;
                    (Some(Activation::shared(dx, dev.t * hidden)), w)
                }
                (Layer::Decoder(d), FCtx::Decoder(c)) => {
                    let dy = dy.take().ok_or(Misuse::NoOutputGradient(mb))?;
                    let (dx, w) = decoder_dgrad(g, d, *c, dy, &dev)?;
                    (Some(Activation::shared(dx, dev.t * d.hidden)), w)
                }
                (Layer::Embedding { .. }, FCtx::Embedding) => {
                    let dy = dy.take().ok_or(Misuse::NoOutputGradient(mb))?;
                    (None, WCtx::Embedding { dy })
                }
                _ => {
                    return Err(Misuse::ActivationsOfAnotherKind.into());
                }
            };
            dy = dx;
            wctxs.push(w);
        }
        wctxs.reverse();
        self.wctx.insert(mb, (dev, wctxs));
        self.note_peak();
        dy.map(|h| self.gpu.mark_ready(h)).transpose()
    }

    fn backward_weight(&mut self, mb: u32, _data: &MicrobatchData) -> Result<()> {
        let (dev, wctxs) = self.wctx.remove(&mb).ok_or(Misuse::WgradBeforeDgrad(mb))?;
        let g = &*self.gpu;
        let t = dev.t;
        for ((_, layer), w) in self.layers.iter_mut().zip(wctxs) {
            match (layer, w) {
                (Layer::Embedding { table, hidden }, WCtx::Embedding { dy }) => {
                    g.embedding_backward(&mut table.grad, &dy.buf, &dev.ids, t, *hidden)?;
                }
                (
                    Layer::Head {
                        norm,
                        out,
                        hidden,
                        vocab,
                    },
                    WCtx::Head {
                        h,
                        xhat,
                        dlogits,
                        dh,
                    },
                ) => {
                    g.linear_dw(&mut out.grad, &h, &dlogits, t, *hidden, *vocab)?;
                    g.rmsnorm_dg(&mut norm.grad, &dh, &xhat, t, *hidden)?;
                }
                (Layer::Decoder(d), WCtx::Decoder(w)) => {
                    let d = &mut **d;
                    let (h, f, kv) = (d.hidden, d.ffn, d.kv());
                    g.linear_dw(&mut d.wq.grad, &w.h1, &w.dq, t, h, h)?;
                    g.linear_dw(&mut d.wk.grad, &w.h1, &w.dk, t, h, kv)?;
                    g.linear_dw(&mut d.wv.grad, &w.h1, &w.dv, t, h, kv)?;
                    g.linear_dw(&mut d.wo.grad, &w.o, &w.da, t, h, h)?;
                    g.linear_dw(&mut d.w1.grad, &w.h2, &w.dgate, t, h, f)?;
                    g.linear_dw(&mut d.w3.grad, &w.h2, &w.dup, t, h, f)?;
                    g.linear_dw(&mut d.w2.grad, &w.act, &w.dm.buf, t, f, h)?;
                    g.rmsnorm_dg(&mut d.attn_norm.grad, &w.dh1, &w.xhat1, t, h)?;
                    g.rmsnorm_dg(&mut d.ffn_norm.grad, &w.dh2, &w.xhat2, t, h)?;
                }
                _ => {
                    return Err(Misuse::GradientsOfAnotherKind.into());
                }
            }
        }
        Ok(())
    }

    fn zero_grads(&mut self) -> Result<()> {
        let stream = self.gpu.stream.clone();
        for (_, l) in &mut self.layers {
            for p in l.params_mut() {
                stream.memset_zeros(&mut p.grad).map_err(driver)?;
            }
        }
        Ok(())
    }

    fn visit_grads(&mut self, f: &mut dyn FnMut(&mut [f32])) -> Result<()> {
        // The data-parallel all-reduce through the host (NCCL is not wired yet): download,
        // visit, upload.
        let gpu = Arc::clone(&self.gpu);
        for (_, l) in &mut self.layers {
            for p in l.params_mut() {
                let mut host = gpu.download(&p.grad)?;
                f(&mut host);
                gpu.upload_into(&host, &mut p.grad)?;
            }
        }
        gpu.synchronize()
    }

    fn grad_sq_norm(&self) -> Result<f64> {
        let mut sum = 0.0;
        for p in self.layers.iter().flat_map(|(_, l)| l.params()) {
            sum += self.gpu.sum_squares(&p.grad)?;
        }
        Ok(sum)
    }

    fn optimizer_step(&mut self, opt: &AdamW, t: u64, grad_scale: f32) -> Result<()> {
        let gpu = Arc::clone(&self.gpu);
        for (_, l) in &mut self.layers {
            for p in l.params_mut() {
                if p.moments.is_none() {
                    let n = p.value.len();
                    p.moments = Some((gpu.zeros(n)?, gpu.zeros(n)?));
                }
                let Param {
                    value,
                    grad,
                    moments: Some((m, v)),
                    ..
                } = p
                else {
                    continue;
                };
                gpu.adamw((value, grad, m, v), opt, t, grad_scale)?;
            }
        }
        // Done when this returns: the step's optimizer time is the GPU's.
        gpu.synchronize()
    }

    fn named_params(&self) -> Vec<(String, Vec<f32>)> {
        self.named(|p| &p.value)
    }

    fn named_grads(&self) -> Vec<(String, Vec<f32>)> {
        self.named(|p| &p.grad)
    }

    fn held_microbatches(&self) -> usize {
        self.fctx.len() + self.wctx.len()
    }

    fn prepare_step(
        &mut self,
        train: &[MicrobatchData],
        forward_only: &[MicrobatchData],
    ) -> Result<()> {
        // What a failed step may have left behind.
        self.fctx.clear();
        self.wctx.clear();
        self.pending.clear();
        self.staged.clear();
        for (fo, list) in [(false, train), (true, forward_only)] {
            for (i, d) in list.iter().enumerate() {
                self.staged.insert((i as u32, fo), Data::new(&self.gpu, d)?);
            }
        }
        Ok(())
    }

    fn import(&mut self, h: Shared) -> Result<(Shared, CopyStamps)> {
        let (h, stamps) = self.gpu.import(h)?;
        Ok((h, Some(stamps)))
    }

    fn take_losses(&mut self) -> Result<Vec<(u32, bool, LossSums)>> {
        self.pending
            .drain(..)
            .map(|(mb, fo, tokens, sums)| {
                let s = self.gpu.download(&sums)?;
                Ok((
                    mb,
                    fo,
                    LossSums {
                        weighted: s[0],
                        sum: s[1],
                        tokens,
                    },
                ))
            })
            .collect()
    }

    fn device_clock(&mut self) -> Option<&mut dyn DeviceClock> {
        Some(self)
    }
}

impl DeviceClock for CudaStage {
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
