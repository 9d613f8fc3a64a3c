//! The CPU backend: a Llama-style decoder-only transformer in fp32 over flat `[T]` tokens, with
//! separate dgrad (I) and wgrad (W) so zero-bubble schedules run for real.
//!
//! A [`CpuStage`] is built from its layer range `[start, end)` of the model's expanded layer list
//! (0 = embedding, then decoders, the last = final norm + LM head + cross-entropy); nothing
//! builds the whole model and removes parts. Parameters are initialised from `(seed, layer
//! index)`, so any split of the model holds exactly the same weights as a single-rank run.
//!
//! Linear weights are stored `[in, out]` (`y = x W`); torchtitan stores `[out, in]`. Names follow
//! torchtitan's Llama (`layers.N.attention.wq.weight`, `layers.N.feed_forward.w1.weight`, ...).

use crate::kernels::{self as k, AttnDims};
use crate::worker::{AdamW, LossSums, Misuse, StageInput, StageOutput, StageWorker};
use crate::{Error, MicrobatchData, Result};
use flatpipe_profiles::{Layer, LayerKind, ModelSpec};
use flatpipe_simulator::costs::Recompute;
use ndarray::{Array1, Array2, ArrayView1};
use rand::{SeedableRng, rngs::ChaCha8Rng};
use rand_distr::{Distribution, Normal};
use std::collections::HashMap;
use std::ops::Range;

/// A parameter with its gradient and AdamW moments, all `[rows, cols]`.
#[derive(Debug, Clone)]
struct Param {
    name: String,
    value: Array2<f32>,
    grad: Array2<f32>,
    m: Array2<f32>,
    v: Array2<f32>,
}

impl Param {
    fn new(name: String, value: Array2<f32>) -> Self {
        let z = Array2::zeros(value.raw_dim());
        Param {
            name,
            grad: z.clone(),
            m: z.clone(),
            v: z,
            value,
        }
    }
    fn normal(name: String, shape: (usize, usize), std: f32, rng: &mut ChaCha8Rng) -> Self {
        let d = Normal::new(0.0f32, std).expect("std > 0");
        Param::new(name, Array2::from_shape_fn(shape, |_| d.sample(rng)))
    }
    fn ones(name: String, n: usize) -> Self {
        Param::new(name, Array2::ones((1, n)))
    }
    fn row(&self) -> ArrayView1<'_, f32> {
        self.value.row(0)
    }
}

#[derive(Debug)]
struct Decoder {
    dims: AttnDims,
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

// A few hundred bytes per layer next to megabytes of tensors: boxing buys nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
enum LayerParams {
    Embedding { table: Param },
    Decoder(Box<Decoder>),
    Head { norm: Param, out: Param },
}

/// What a decoder's forward keeps for its backward.
#[derive(Debug)]
struct DecoderF {
    h1: Array2<f32>,
    xhat1: Array2<f32>,
    rstd1: Array1<f32>,
    q: Array2<f32>,
    k: Array2<f32>,
    v: Array2<f32>,
    o: Array2<f32>,
    lse: Array2<f32>,
    h2: Array2<f32>,
    xhat2: Array2<f32>,
    rstd2: Array1<f32>,
    gate: Array2<f32>,
    up: Array2<f32>,
    act: Array2<f32>,
}

#[derive(Debug)]
struct HeadF {
    h: Array2<f32>,
    xhat: Array2<f32>,
    rstd: Array1<f32>,
    logits: Array2<f32>,
    lse: Array1<f32>,
}

/// Per layer, what F keeps until I.
#[derive(Debug)]
enum FCtx {
    Embedding,
    Decoder(Box<DecoderF>),
    Head(Box<HeadF>),
    /// Full recomputation: only the layer's input, the forward reruns in I.
    Input(Array2<f32>),
    /// Selective recomputation of a decoder: what F keeps without the attention core's outputs
    /// and the elementwise results, which I recomputes ([`DecoderSelective::restore`]).
    Selective(Box<DecoderSelective>),
}

/// What a decoder's forward keeps under selective recomputation: the GEMM outputs (q and k after
/// rotary, v, gate, up) and the norms' `xhat`, `rstd`. Dropped, and recomputed in I: the
/// attention core's output `o` and log-sum-exp (the attention forward, the `c_attn *
/// attn_pairs` term of the profile: the recomputation time the simulator charges I,
/// `flatpipe_simulator::costs::recompute_effect`), the normed inputs `h = xhat * g` and the
/// SwiGLU activation. In Megatron-LM's terms (Korthikanti et al. 2022, "Reducing Activation
/// Recomputation in Large Transformer Models", section 5) the core attention is recomputed and
/// the GEMM outputs are kept; with a FlashAttention-style core the saving is `o`, `h1`, `h2` and
/// the activation: `3 * hidden + ffn` floats per token of the `5 * hidden + 2 * kv + 3 * ffn`
/// that no recomputation keeps.
#[derive(Debug)]
struct DecoderSelective {
    xhat1: Array2<f32>,
    rstd1: Array1<f32>,
    q: Array2<f32>,
    k: Array2<f32>,
    v: Array2<f32>,
    xhat2: Array2<f32>,
    rstd2: Array1<f32>,
    gate: Array2<f32>,
    up: Array2<f32>,
}

impl DecoderSelective {
    /// Keeps what selective recomputation keeps of a forward's context.
    fn keep(c: DecoderF) -> Self {
        DecoderSelective {
            xhat1: c.xhat1,
            rstd1: c.rstd1,
            q: c.q,
            k: c.k,
            v: c.v,
            xhat2: c.xhat2,
            rstd2: c.rstd2,
            gate: c.gate,
            up: c.up,
        }
    }

    /// The forward's whole context again: the same kernels on the same inputs as the forward
    /// ran them, so the gradients are bitwise those of no recomputation.
    fn restore(self, p: &Decoder, cu: &[usize]) -> DecoderF {
        let h1 = &self.xhat1 * &p.attn_norm.row();
        let (o, lse) = k::attention(self.q.view(), self.k.view(), self.v.view(), cu, p.dims);
        let h2 = &self.xhat2 * &p.ffn_norm.row();
        let act = k::swiglu(self.gate.view(), self.up.view());
        DecoderF {
            h1,
            xhat1: self.xhat1,
            rstd1: self.rstd1,
            q: self.q,
            k: self.k,
            v: self.v,
            o,
            lse,
            h2,
            xhat2: self.xhat2,
            rstd2: self.rstd2,
            gate: self.gate,
            up: self.up,
            act,
        }
    }
}

/// What a decoder's dgrad keeps for its wgrad: the GEMM inputs (normed inputs, attention
/// output, activation) and the gradients of the GEMM outputs, all `[T, X]`.
#[derive(Debug)]
struct DecoderW {
    h1: Array2<f32>,
    xhat1: Array2<f32>,
    o: Array2<f32>,
    h2: Array2<f32>,
    xhat2: Array2<f32>,
    act: Array2<f32>,
    dq: Array2<f32>,
    dk: Array2<f32>,
    dv: Array2<f32>,
    da: Array2<f32>,
    dgate: Array2<f32>,
    dup: Array2<f32>,
    dm: Array2<f32>,
    dh1: Array2<f32>,
    dh2: Array2<f32>,
}

/// Per layer, what I keeps until W: the GEMM inputs and output gradients wgrad needs.
#[derive(Debug)]
enum WCtx {
    Embedding {
        dy: Array2<f32>,
    },
    Decoder(Box<DecoderW>),
    Head {
        h: Array2<f32>,
        xhat: Array2<f32>,
        dlogits: Array2<f32>,
        dh: Array2<f32>,
    },
}

fn nbytes<const N: usize>(arrays: [&dyn ArrayBytes; N]) -> usize {
    arrays.iter().map(|a| a.bytes()).sum()
}

trait ArrayBytes {
    fn bytes(&self) -> usize;
}
impl<D: ndarray::Dimension> ArrayBytes for ndarray::Array<f32, D> {
    fn bytes(&self) -> usize {
        self.len() * 4
    }
}

impl FCtx {
    fn bytes(&self) -> usize {
        match self {
            FCtx::Embedding => 0,
            FCtx::Input(x) => x.bytes(),
            FCtx::Selective(c) => nbytes([
                &c.xhat1, &c.rstd1, &c.q, &c.k, &c.v, &c.xhat2, &c.rstd2, &c.gate, &c.up,
            ]),
            FCtx::Head(c) => nbytes([&c.h, &c.xhat, &c.rstd, &c.logits, &c.lse]),
            FCtx::Decoder(c) => nbytes([
                &c.h1, &c.xhat1, &c.rstd1, &c.q, &c.k, &c.v, &c.o, &c.lse, &c.h2, &c.xhat2,
                &c.rstd2, &c.gate, &c.up, &c.act,
            ]),
        }
    }
}

impl WCtx {
    fn bytes(&self) -> usize {
        match self {
            WCtx::Embedding { dy } => dy.bytes(),
            WCtx::Head {
                h,
                xhat,
                dlogits,
                dh,
            } => nbytes([h, xhat, dlogits, dh]),
            WCtx::Decoder(w) => nbytes([
                &w.h1, &w.xhat1, &w.o, &w.h2, &w.xhat2, &w.act, &w.dq, &w.dk, &w.dv, &w.da,
                &w.dgate, &w.dup, &w.dm, &w.dh1, &w.dh2,
            ]),
        }
    }
}

fn decoder_forward(p: &Decoder, x: &Array2<f32>, cu: &[usize]) -> (Array2<f32>, DecoderF) {
    let d = p.dims.head_dim;
    let (h1, xhat1, rstd1) = k::rmsnorm(x.view(), p.attn_norm.row());
    let mut q = k::matmul(h1.view(), p.wq.value.view());
    let mut kk = k::matmul(h1.view(), p.wk.value.view());
    let v = k::matmul(h1.view(), p.wv.value.view());
    k::rope(&mut q.view_mut(), cu, d, false);
    k::rope(&mut kk.view_mut(), cu, d, false);
    let (o, lse) = k::attention(q.view(), kk.view(), v.view(), cu, p.dims);
    let mut x2 = k::matmul(o.view(), p.wo.value.view());
    x2 += x;
    let (h2, xhat2, rstd2) = k::rmsnorm(x2.view(), p.ffn_norm.row());
    let gate = k::matmul(h2.view(), p.w1.value.view());
    let up = k::matmul(h2.view(), p.w3.value.view());
    let act = k::swiglu(gate.view(), up.view());
    let mut y = k::matmul(act.view(), p.w2.value.view());
    y += &x2;
    let ctx = DecoderF {
        h1,
        xhat1,
        rstd1,
        q,
        k: kk,
        v,
        o,
        lse,
        h2,
        xhat2,
        rstd2,
        gate,
        up,
        act,
    };
    (y, ctx)
}

fn decoder_dgrad(p: &Decoder, c: DecoderF, dy: Array2<f32>, cu: &[usize]) -> (Array2<f32>, WCtx) {
    let d = p.dims.head_dim;
    // MLP: y = x2 + act W2
    let dact = k::matmul(dy.view(), p.w2.value.t());
    let (dgate, dup) = k::swiglu_backward(dact.view(), c.gate.view(), c.up.view());
    let mut dh2 = k::matmul(dgate.view(), p.w1.value.t());
    k::matmul_acc(&mut dh2.view_mut(), dup.view(), p.w3.value.t());
    let mut dx2 = k::rmsnorm_dx(dh2.view(), c.xhat2.view(), c.rstd2.view(), p.ffn_norm.row());
    dx2 += &dy;
    // Attention: x2 = x + o Wo
    let dout = k::matmul(dx2.view(), p.wo.value.t());
    let (mut dq, mut dk, dv) = k::attention_backward(
        dout.view(),
        c.q.view(),
        c.k.view(),
        c.v.view(),
        c.o.view(),
        c.lse.view(),
        cu,
        p.dims,
    );
    k::rope(&mut dq.view_mut(), cu, d, true);
    k::rope(&mut dk.view_mut(), cu, d, true);
    let mut dh1 = k::matmul(dq.view(), p.wq.value.t());
    k::matmul_acc(&mut dh1.view_mut(), dk.view(), p.wk.value.t());
    k::matmul_acc(&mut dh1.view_mut(), dv.view(), p.wv.value.t());
    let mut dx = k::rmsnorm_dx(
        dh1.view(),
        c.xhat1.view(),
        c.rstd1.view(),
        p.attn_norm.row(),
    );
    dx += &dx2;
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
        dm: dy,
        dh1,
        dh2,
    }));
    (dx, w)
}

fn head_forward(
    norm: &Param,
    out: &Param,
    x: &Array2<f32>,
    data: &MicrobatchData,
) -> (LossSums, HeadF) {
    let (h, xhat, rstd) = k::rmsnorm(x.view(), norm.row());
    let logits = k::matmul(h.view(), out.value.view());
    let (weighted, sum, lse) = k::cross_entropy(logits.view(), &data.labels, &data.loss_weights);
    let loss = LossSums {
        weighted,
        sum,
        tokens: data.tokens() as u64,
    };
    (
        loss,
        HeadF {
            h,
            xhat,
            rstd,
            logits,
            lse,
        },
    )
}

fn head_dgrad(norm: &Param, out: &Param, c: HeadF, data: &MicrobatchData) -> (Array2<f32>, WCtx) {
    let dlogits = k::cross_entropy_backward(
        c.logits.view(),
        c.lse.view(),
        &data.labels,
        &data.loss_weights,
    );
    let dh = k::matmul(dlogits.view(), out.value.t());
    let dx = k::rmsnorm_dx(dh.view(), c.xhat.view(), c.rstd.view(), norm.row());
    (
        dx,
        WCtx::Head {
            h: c.h,
            xhat: c.xhat,
            dlogits,
            dh,
        },
    )
}

/// `param.grad += a^T b` (the wgrad GEMM).
fn wgrad(param: &mut Param, a: &Array2<f32>, b: &Array2<f32>) {
    k::matmul_acc(&mut param.grad.view_mut(), a.t(), b.view());
}

fn norm_grad(param: &mut Param, dy: &Array2<f32>, xhat: &Array2<f32>) {
    let mut g = param.grad.row(0).to_owned();
    k::rmsnorm_dg(&mut g, dy.view(), xhat.view());
    param.grad.row_mut(0).assign(&g);
}

impl LayerParams {
    fn build(layer: &Layer, seed: u64) -> Result<Self> {
        let mut rng = ChaCha8Rng::seed_from_u64(
            seed ^ (layer.index as u64 + 1).wrapping_mul(0xA076_1D64_78BD_642F),
        );
        let (h, std) = (layer.hidden as usize, 0.02);
        Ok(match layer.kind {
            LayerKind::Embedding => LayerParams::Embedding {
                table: Param::normal(
                    "tok_embeddings.weight".into(),
                    (layer.vocab as usize, h),
                    1.0,
                    &mut rng,
                ),
            },
            LayerKind::Head => LayerParams::Head {
                norm: Param::ones("norm.weight".into(), h),
                out: Param::normal(
                    "output.weight".into(),
                    (h, layer.vocab as usize),
                    std,
                    &mut rng,
                ),
            },
            LayerKind::Decoder => {
                let (heads, kvh) = (layer.heads as usize, layer.kv_heads as usize);
                if h % heads != 0 || heads % kvh != 0 || (h / heads) % 2 != 0 {
                    return Err(Error::Unsupported(format!(
                        "decoder layer {}: hidden {h}, heads {heads}, kv_heads {kvh}: the CPU backend needs heads | hidden, kv_heads | heads and an even head dimension",
                        layer.index
                    )));
                }
                let d = h / heads;
                let kv = d * kvh;
                let ffn = layer.ffn as usize;
                let n = layer.decoder_index.unwrap_or(0);
                let name = |s: &str| format!("layers.{n}.{s}.weight");
                // Output projections scaled by 1/sqrt(2 * layers) in GPT-2 style would depend on the
                // depth; a plain std keeps a stage's weights independent of the whole model.
                LayerParams::Decoder(Box::new(Decoder {
                    dims: AttnDims {
                        heads,
                        kv_heads: kvh,
                        head_dim: d,
                    },
                    attn_norm: Param::ones(name("attention_norm"), h),
                    wq: Param::normal(name("attention.wq"), (h, h), std, &mut rng),
                    wk: Param::normal(name("attention.wk"), (h, kv), std, &mut rng),
                    wv: Param::normal(name("attention.wv"), (h, kv), std, &mut rng),
                    wo: Param::normal(name("attention.wo"), (h, h), std, &mut rng),
                    ffn_norm: Param::ones(name("ffn_norm"), h),
                    w1: Param::normal(name("feed_forward.w1"), (h, ffn), std, &mut rng),
                    w3: Param::normal(name("feed_forward.w3"), (h, ffn), std, &mut rng),
                    w2: Param::normal(name("feed_forward.w2"), (ffn, h), std, &mut rng),
                }))
            }
        })
    }

    fn params(&self) -> Vec<&Param> {
        match self {
            LayerParams::Embedding { table } => vec![table],
            LayerParams::Head { norm, out } => vec![norm, out],
            LayerParams::Decoder(d) => vec![
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
            LayerParams::Embedding { table } => vec![table],
            LayerParams::Head { norm, out } => vec![norm, out],
            LayerParams::Decoder(d) => {
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

/// Data flowing through a stage's layers.
enum Flow {
    Tokens,
    Hidden(Array2<f32>),
    Loss(LossSums),
}

/// One pipeline stage of the CPU backend: layers `[start, end)` of a model.
#[derive(Debug)]
pub struct CpuStage {
    layers: Vec<(usize, LayerParams)>,
    hidden: usize,
    recompute: Recompute,
    fctx: HashMap<u32, Vec<FCtx>>,
    wctx: HashMap<u32, Vec<WCtx>>,
}

impl CpuStage {
    /// Builds layers `range` of `model` with weights from `seed`, recomputing per `recompute`.
    ///
    /// Selective recomputation applies to decoder layers ([`DecoderSelective`]); the embedding
    /// and the head keep everything, as the simulator's cost model has it.
    ///
    /// # Errors
    /// [`Error::Invalid`] for an empty or out-of-range layer range; [`Error::Unsupported`] for a
    /// layer shape the kernels cannot run.
    pub fn new(
        model: &ModelSpec,
        range: Range<usize>,
        seed: u64,
        recompute: Recompute,
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
        let layers = all[range.clone()]
            .iter()
            .map(|l| Ok((l.index, LayerParams::build(l, seed)?)))
            .collect::<Result<Vec<_>>>()?;
        Ok(CpuStage {
            hidden: all[range.start].hidden as usize,
            layers,
            recompute,
            fctx: HashMap::new(),
            wctx: HashMap::new(),
        })
    }

    /// Bytes of activations and gradients this stage holds for microbatches between F and W
    /// (what F keeps until I plus what I keeps until W), from the real tensors.
    pub fn saved_bytes(&self) -> usize {
        let f: usize = self.fctx.values().flatten().map(FCtx::bytes).sum();
        let w: usize = self.wctx.values().flatten().map(WCtx::bytes).sum();
        f + w
    }

    /// Global layer indices held by this stage.
    pub fn layer_indices(&self) -> Vec<usize> {
        self.layers.iter().map(|(i, _)| *i).collect()
    }

    fn run_layer(
        p: &LayerParams,
        flow: Flow,
        data: &MicrobatchData,
        keep: bool,
        recompute: Recompute,
    ) -> Result<(Flow, Option<FCtx>)> {
        let cu = &data.cu_seqlens;
        Ok(match (p, flow) {
            (LayerParams::Embedding { table }, Flow::Tokens) => (
                Flow::Hidden(k::embedding(table.value.view(), &data.ids)),
                keep.then_some(FCtx::Embedding),
            ),
            (LayerParams::Decoder(d), Flow::Hidden(x)) => {
                let (y, c) = decoder_forward(d, &x, cu);
                let ctx = match (keep, recompute) {
                    (false, _) => None,
                    (true, Recompute::Full) => Some(FCtx::Input(x)),
                    (true, Recompute::Selective) => {
                        Some(FCtx::Selective(Box::new(DecoderSelective::keep(c))))
                    }
                    (true, Recompute::None) => Some(FCtx::Decoder(Box::new(c))),
                };
                (Flow::Hidden(y), ctx)
            }
            (LayerParams::Head { norm, out }, Flow::Hidden(x)) => {
                let (loss, c) = head_forward(norm, out, &x, data);
                let ctx = match (keep, recompute) {
                    (false, _) => None,
                    (true, Recompute::Full) => Some(FCtx::Input(x)),
                    (true, _) => Some(FCtx::Head(Box::new(c))),
                };
                (Flow::Loss(loss), ctx)
            }
            (LayerParams::Embedding { .. }, _) => {
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

impl StageWorker for CpuStage {
    type Hidden = Array2<f32>;

    fn hidden_size(&self) -> usize {
        self.hidden
    }

    fn hidden_len(h: &Array2<f32>) -> usize {
        h.len()
    }

    fn forward(
        &mut self,
        mb: u32,
        data: &MicrobatchData,
        input: StageInput<Array2<f32>>,
        keep: bool,
    ) -> Result<StageOutput<Array2<f32>>> {
        let mut flow = match input {
            StageInput::Tokens => Flow::Tokens,
            StageInput::Hidden(h) => Flow::Hidden(h),
        };
        let mut ctxs = Vec::with_capacity(self.layers.len());
        for (_, p) in &self.layers {
            let (next, ctx) = Self::run_layer(p, flow, data, keep, self.recompute)?;
            flow = next;
            ctxs.extend(ctx);
        }
        if keep && self.fctx.insert(mb, ctxs).is_some() {
            return Err(Misuse::ForwardTwice(mb).into());
        }
        match flow {
            Flow::Hidden(h) => Ok(StageOutput::Hidden(h)),
            Flow::Loss(l) => Ok(StageOutput::Loss(l)),
            Flow::Tokens => Err(Misuse::NoLayers.into()),
        }
    }

    fn backward_input(
        &mut self,
        mb: u32,
        data: &MicrobatchData,
        grad: Option<Array2<f32>>,
    ) -> Result<Option<Array2<f32>>> {
        let ctxs = self
            .fctx
            .remove(&mb)
            .ok_or(Misuse::DgradBeforeForward(mb))?;
        let cu = &data.cu_seqlens;
        let mut dy = grad;
        let mut wctxs = Vec::with_capacity(ctxs.len());
        for ((_, p), ctx) in self.layers.iter().zip(ctxs).rev() {
            // Full recomputation: rerun this layer's forward from its saved input.
            let ctx = match ctx {
                FCtx::Input(x) => match p {
                    LayerParams::Decoder(d) => {
                        FCtx::Decoder(Box::new(decoder_forward(d, &x, cu).1))
                    }
                    LayerParams::Head { norm, out } => {
                        FCtx::Head(Box::new(head_forward(norm, out, &x, data).1))
                    }
                    LayerParams::Embedding { .. } => FCtx::Embedding,
                },
                // Selective: the attention core and the elementwise work again.
                FCtx::Selective(c) => match p {
                    LayerParams::Decoder(d) => FCtx::Decoder(Box::new(c.restore(d, cu))),
                    _ => return Err(Misuse::ActivationsOfAnotherKind.into()),
                },
                c => c,
            };
            let (dx, w) = match (p, ctx) {
                (LayerParams::Head { norm, out }, FCtx::Head(c)) => {
                    let (dx, w) = head_dgrad(norm, out, *c, data);
                    (Some(dx), w)
                }
                (LayerParams::Decoder(d), FCtx::Decoder(c)) => {
                    let dy = dy.take().ok_or(Misuse::NoOutputGradient(mb))?;
                    let (dx, w) = decoder_dgrad(d, *c, dy, cu);
                    (Some(dx), w)
                }
                (LayerParams::Embedding { .. }, FCtx::Embedding) => {
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
        self.wctx.insert(mb, wctxs);
        Ok(dy)
    }

    fn backward_weight(&mut self, mb: u32, data: &MicrobatchData) -> Result<()> {
        let wctxs = self.wctx.remove(&mb).ok_or(Misuse::WgradBeforeDgrad(mb))?;
        for ((_, p), w) in self.layers.iter_mut().zip(wctxs) {
            match (p, w) {
                (LayerParams::Embedding { table }, WCtx::Embedding { dy }) => {
                    k::embedding_backward(&mut table.grad, dy.view(), &data.ids);
                }
                (
                    LayerParams::Head { norm, out },
                    WCtx::Head {
                        h,
                        xhat,
                        dlogits,
                        dh,
                    },
                ) => {
                    wgrad(out, &h, &dlogits);
                    norm_grad(norm, &dh, &xhat);
                }
                (LayerParams::Decoder(d), WCtx::Decoder(w)) => {
                    let d = &mut **d;
                    wgrad(&mut d.wq, &w.h1, &w.dq);
                    wgrad(&mut d.wk, &w.h1, &w.dk);
                    wgrad(&mut d.wv, &w.h1, &w.dv);
                    wgrad(&mut d.wo, &w.o, &w.da);
                    wgrad(&mut d.w1, &w.h2, &w.dgate);
                    wgrad(&mut d.w3, &w.h2, &w.dup);
                    wgrad(&mut d.w2, &w.act, &w.dm);
                    norm_grad(&mut d.attn_norm, &w.dh1, &w.xhat1);
                    norm_grad(&mut d.ffn_norm, &w.dh2, &w.xhat2);
                }
                _ => {
                    return Err(Misuse::GradientsOfAnotherKind.into());
                }
            }
        }
        Ok(())
    }

    fn prepare_step(&mut self, _train: &[MicrobatchData], _fo: &[MicrobatchData]) -> Result<()> {
        // What a failed step may have left behind.
        self.fctx.clear();
        self.wctx.clear();
        Ok(())
    }

    fn zero_grads(&mut self) -> Result<()> {
        for (_, l) in &mut self.layers {
            for p in l.params_mut() {
                p.grad.fill(0.0);
            }
        }
        Ok(())
    }

    fn visit_grads(&mut self, f: &mut dyn FnMut(&mut [f32])) -> Result<()> {
        for (_, l) in &mut self.layers {
            for p in l.params_mut() {
                f(p.grad.as_slice_mut().expect("standard layout"));
            }
        }
        Ok(())
    }

    fn grad_sq_norm(&self) -> Result<f64> {
        Ok(self
            .layers
            .iter()
            .flat_map(|(_, l)| l.params())
            .flat_map(|p| p.grad.iter())
            .map(|&g| g as f64 * g as f64)
            .sum())
    }

    fn optimizer_step(&mut self, opt: &AdamW, t: u64, grad_scale: f32) -> Result<()> {
        for (_, l) in &mut self.layers {
            for p in l.params_mut() {
                let Param {
                    value, grad, m, v, ..
                } = p;
                opt.update(
                    value.as_slice_mut().expect("standard layout"),
                    grad.as_slice().expect("standard layout"),
                    m.as_slice_mut().expect("standard layout"),
                    v.as_slice_mut().expect("standard layout"),
                    t,
                    grad_scale,
                );
            }
        }
        Ok(())
    }

    fn named_params(&self) -> Vec<(String, Vec<f32>)> {
        self.layers
            .iter()
            .flat_map(|(_, l)| l.params())
            .map(|p| (p.name.clone(), p.value.iter().copied().collect()))
            .collect()
    }

    fn named_grads(&self) -> Vec<(String, Vec<f32>)> {
        self.layers
            .iter()
            .flat_map(|(_, l)| l.params())
            .map(|p| (p.name.clone(), p.grad.iter().copied().collect()))
            .collect()
    }

    fn held_microbatches(&self) -> usize {
        self.fctx.len() + self.wctx.len()
    }
}

/// What the CPU backend must hold at the least to train `model`, bytes, counted from the tensors
/// it allocates: [`MemoryFloor::state`] (fp32 weights, gradients and AdamW's two moments: 16 bytes
/// per parameter, [`ModelSpec::param_count`]) and [`MemoryFloor::activations`] (what forward keeps
/// until backward for one microbatch of `microbatch_tokens` tokens in every layer at once, as at
/// the peak of a full pipeline: per decoder token `4H` (both RMSNorms' inputs and outputs) + `2H`
/// (Q, attention output) + `2·kv_dim` (K, V) + `3·FFN` (gate, up, SwiGLU), per head token `2H +
/// V` (norm input, output and logits), fp32; see [`DecoderF`] and [`HeadF`]). A floor, not a
/// peak: schedules that keep several microbatches in flight per stage hold more.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MemoryFloor {
    /// Weights, gradients and optimizer state, bytes.
    pub state: f64,
    /// Saved activations, bytes.
    pub activations: f64,
}

impl MemoryFloor {
    /// The floor of `model` for microbatches of `microbatch_tokens` tokens.
    pub fn of(model: &ModelSpec, microbatch_tokens: u64) -> Self {
        const F32: f64 = 4.0;
        let t = microbatch_tokens as f64;
        let activations: f64 = model
            .layers()
            .iter()
            .map(|l| {
                let (h, ffn) = (l.hidden as f64, l.ffn as f64);
                let per_token = match l.kind {
                    LayerKind::Embedding => 0.0,
                    LayerKind::Head => 2.0 * h + l.vocab as f64,
                    LayerKind::Decoder => {
                        let kv_dim = h / l.heads.max(1) as f64 * l.kv_heads as f64;
                        6.0 * h + 2.0 * kv_dim + 3.0 * ffn
                    }
                };
                per_token * t * F32
            })
            .sum();
        MemoryFloor {
            state: model.param_count() as f64 * 4.0 * F32,
            activations,
        }
    }
}

/// Sum of a stage's parameter counts (for checks against the profile's).
pub fn param_count(stage: &CpuStage) -> u64 {
    stage
        .layers
        .iter()
        .flat_map(|(_, l)| l.params())
        .map(|p| p.value.len() as u64)
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::{LossReduction, build_step};
    use crate::kernels::tests::{directional, directional_eps};
    use flatpipe_profiles::builtins;

    fn small_model() -> ModelSpec {
        ModelSpec::from_yaml(
            "name: t\ndtype: fp32\nlayers:\n  - {kind: embedding, vocab: 32, hidden: 16}\n  - {kind: decoder, count: 2, hidden: 16, ffn: 24, heads: 4, kv_heads: 2}\n  - {kind: head, vocab: 32, hidden: 16}\n",
            "test",
        )
        .unwrap()
    }

    #[test]
    fn decoder_layer_dgrad_matches_finite_differences() {
        let model = small_model();
        let mut stage = CpuStage::new(&model, 1..2, 3, Recompute::None).unwrap();
        let data = &build_step(&[vec![vec![3, 4]]], 32, 0, 0, LossReduction::PerToken)[0][0];
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        let x = crate::kernels::tests::randn(&mut rng, (7, 16), 1.0);
        let r = crate::kernels::tests::randn(&mut rng, (7, 16), 1.0);
        let dec = match &stage.layers[0].1 {
            LayerParams::Decoder(d) => d,
            _ => unreachable!(),
        };
        let f = |x: &Array2<f32>| -> f64 {
            let (y, _) = decoder_forward(dec, x, &data.cu_seqlens);
            y.iter().zip(r.iter()).map(|(a, b)| (*a * *b) as f64).sum()
        };
        let (_, c) = decoder_forward(dec, &x, &data.cu_seqlens);
        let (dx, _) = decoder_dgrad(dec, c, r.clone(), &data.cu_seqlens);
        let e = directional(&x, &dx, &f, 2);
        assert!(e < 2e-3, "{e}");
        // The wgrad of every parameter against finite differences of that parameter.
        let _ = stage
            .forward(0, data, StageInput::Hidden(x.clone()), true)
            .unwrap();
        stage.backward_input(0, data, Some(r.clone())).unwrap();
        stage.backward_weight(0, data).unwrap();
        let grads = stage.named_grads();
        for (pi, (name, g)) in grads.iter().enumerate() {
            let shape = stage.layers[0].1.params()[pi].value.raw_dim();
            let g = Array2::from_shape_vec(shape, g.clone()).unwrap();
            let base = stage.layers[0].1.params()[pi].value.clone();
            let loss = |w: &Array2<f32>| -> f64 {
                let mut st = CpuStage::new(&model, 1..2, 3, Recompute::None).unwrap();
                st.layers[0].1.params_mut()[pi].value.assign(w);
                let dec = match &st.layers[0].1 {
                    LayerParams::Decoder(d) => d,
                    _ => unreachable!(),
                };
                let (y, _) = decoder_forward(dec, &x, &data.cu_seqlens);
                y.iter().zip(r.iter()).map(|(a, b)| (*a * *b) as f64).sum()
            };
            // Norm weights act through the small MLP / attention branches next to the residual
            // stream, so their finite difference needs a larger step to rise above f32 rounding.
            let eps = if name.contains("norm") { 0.1 } else { 1e-2 };
            let e = directional_eps(&base, &g, &loss, 10 + pi as u64, eps);
            assert!(e < 2e-3, "{name}: rel err {e}");
        }
    }

    #[test]
    fn head_and_embedding_gradients_match_finite_differences() {
        let model = small_model();
        let data = &build_step(&[vec![vec![2, 5]]], 32, 0, 0, LossReduction::PerToken)[0][0];
        let mut rng = ChaCha8Rng::seed_from_u64(5);
        let x = crate::kernels::tests::randn(&mut rng, (7, 16), 1.0);
        let mut head = CpuStage::new(&model, 3..4, 3, Recompute::None).unwrap();
        let loss_of = |st: &mut CpuStage, x: &Array2<f32>| match st
            .forward(9, data, StageInput::Hidden(x.clone()), false)
            .unwrap()
        {
            StageOutput::Loss(l) => l.weighted,
            _ => unreachable!(),
        };
        head.forward(0, data, StageInput::Hidden(x.clone()), true)
            .unwrap();
        let dx = head.backward_input(0, data, None).unwrap().unwrap();
        let e = directional(
            &x,
            &dx,
            &|x| {
                loss_of(
                    &mut CpuStage::new(&model, 3..4, 3, Recompute::None).unwrap(),
                    x,
                )
            },
            3,
        );
        assert!(e < 2e-3, "head dx {e}");
        head.backward_weight(0, data).unwrap();
        let out_grad = head.named_grads()[1].1.clone();
        let base = head.layers[0].1.params()[1].value.clone();
        let g = Array2::from_shape_vec(base.raw_dim(), out_grad).unwrap();
        let e = directional(
            &base,
            &g,
            &|w| {
                let mut st = CpuStage::new(&model, 3..4, 3, Recompute::None).unwrap();
                st.layers[0].1.params_mut()[1].value.assign(w);
                loss_of(&mut st, &x)
            },
            4,
        );
        assert!(e < 2e-3, "output.weight {e}");
        // Embedding wgrad: d<r, E[ids]>/dE.
        let mut emb = CpuStage::new(&model, 0..1, 3, Recompute::None).unwrap();
        let r = crate::kernels::tests::randn(&mut rng, (7, 16), 1.0);
        emb.forward(0, data, StageInput::Tokens, true).unwrap();
        assert!(
            emb.backward_input(0, data, Some(r.clone()))
                .unwrap()
                .is_none()
        );
        emb.backward_weight(0, data).unwrap();
        let g = Array2::from_shape_vec((32, 16), emb.named_grads()[0].1.clone()).unwrap();
        let base = emb.layers[0].1.params()[0].value.clone();
        let e = directional(
            &base,
            &g,
            &|w| {
                let y = k::embedding(w.view(), &data.ids);
                y.iter().zip(r.iter()).map(|(a, b)| (*a * *b) as f64).sum()
            },
            5,
        );
        assert!(e < 2e-3, "embedding {e}");
    }

    #[test]
    fn recomputation_gives_the_same_gradients_and_keeps_less() {
        let model = builtins::model("tiny").unwrap();
        let data = &build_step(&[vec![vec![9, 4]]], 4096, 0, 0, LossReduction::PerToken)[0][0];
        let run = |mode| {
            let mut st = CpuStage::new(&model, 0..10, 7, mode).unwrap();
            st.forward(0, data, StageInput::Tokens, true).unwrap();
            let kept = st.saved_bytes();
            st.backward_input(0, data, None).unwrap();
            st.backward_weight(0, data).unwrap();
            (st.named_grads(), kept)
        };
        let (none, kept_none) = run(Recompute::None);
        let (full, kept_full) = run(Recompute::Full);
        let (selective, kept_selective) = run(Recompute::Selective);
        assert_eq!(
            none, full,
            "recomputation reruns the same kernels on the same input"
        );
        assert_eq!(none, selective, "selective reruns the same kernels too");
        // What F keeps, from the tiny model's shapes (hidden 256, ffn 688, 4 heads; 8 decoders;
        // 13 tokens), 4 bytes a float: per decoder token, no recomputation keeps
        // h1 xhat1 q k v o h2 xhat2 gate up act = 5h + 2kv + 3ffn floats and 2 rstd + heads
        // lse; selective drops h1 o h2 act (3h + ffn) and lse (heads). The head keeps the same
        // in both.
        let spec = &model.layers()[1];
        let (h, ffn, heads) = (spec.hidden as usize, spec.ffn as usize, spec.heads as usize);
        let decoders = model
            .layers()
            .iter()
            .filter(|l| l.kind == LayerKind::Decoder)
            .count();
        let dropped = decoders * 13 * 4 * (3 * h + ffn + heads);
        assert_eq!(kept_none - kept_selective, dropped);
        assert!(kept_full < kept_selective);
    }

    /// The floor counts what forward really keeps: one microbatch through every layer of the
    /// tiny model holds, in real tensors, between the floor and 5% more (the per-row norms and
    /// log-sum-exps the floor leaves out).
    #[test]
    fn memory_floor_matches_the_tensors_forward_keeps() {
        let model = builtins::model("tiny").unwrap();
        let n = model.layers().len();
        let data = &build_step(&[vec![vec![40, 24]]], 4096, 0, 0, LossReduction::PerToken)[0][0];
        let mut st = CpuStage::new(&model, 0..n, 7, Recompute::None).unwrap();
        st.forward(0, data, StageInput::Tokens, true).unwrap();
        let floor = MemoryFloor::of(&model, 64);
        let held = st.saved_bytes() as f64;
        assert!(
            held >= floor.activations && held <= 1.05 * floor.activations,
            "held {held} B, floor {} B",
            floor.activations
        );
        assert_eq!(floor.state, 16.0 * model.param_count() as f64);
    }

    #[test]
    fn parameter_counts_match_the_model_spec() {
        let model = builtins::model("tiny").unwrap();
        let st = CpuStage::new(&model, 0..10, 0, Recompute::None).unwrap();
        let expect: u64 = model.layers().iter().map(|l| l.param_count()).sum();
        assert_eq!(param_count(&st), expect);
    }
}
