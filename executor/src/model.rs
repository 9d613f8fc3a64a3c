//! The model, written once over an op set: a Llama-style decoder-only transformer over flat `[T]`
//! tokens, split into pipeline stages by layer range, with separate F, I (dgrad) and W (wgrad) so
//! zero-bubble schedules run for real, and with no, selective or full recomputation.
//!
//! A backend implements [`OpSet`]: its tensor type and the kernels the layers call (GEMMs,
//! RMSNorm, rotary, varlen causal attention, SwiGLU, embedding, cross-entropy, AdamW), as candle
//! has a model written once over `Tensor` and each device implement `BackendStorage`. The CPU op
//! set is [`crate::cpu::CpuOps`] (ndarray), the CUDA one `crate::cuda::stage::CudaOps` (NVRTC
//! kernels and cuBLAS). [`Stage`] is the [`StageWorker`] over any op set: what F keeps until I,
//! what I keeps until W, the recomputation, the parameters and the optimizer step live here
//! once, so a fix to the model is a fix on both backends.
//!
//! Layer parameters are named as torchtitan's Llama (`layers.N.attention.wq.weight`); linear
//! weights are stored `[in, out]` (`y = x W`), row-major on every backend.

use crate::kernels::AttnDims;
use crate::worker::{
    AdamW, CopyStamps, DeviceClock, LossSums, Misuse, StageInput, StageOutput, StageWorker,
};
use crate::{Error, MicrobatchData, Result};
use flatpipe_profiles::{LayerKind, ModelSpec};
use flatpipe_simulator::costs::Recompute;
use rand::{SeedableRng, rngs::ChaCha8Rng};
use std::collections::HashMap;
use std::fmt::Debug;
use std::ops::Range;

/// The kernels a backend provides to the model. Every tensor is fp32, row-major `[rows, cols]`;
/// shapes are passed explicitly (`t` tokens, `h` hidden, `din` / `dout` of a linear layer) so a
/// backend whose buffers are flat needs no layout of its own. Kernels may run asynchronously
/// (CUDA enqueues on the rank's stream); a result is ready for the next kernel of the same op
/// set.
pub trait OpSet: Send + Debug + 'static {
    /// A tensor on the device.
    type Tensor: Debug + Send;
    /// A `[T, H]` tensor that crosses stages (CUDA: shared with the rank's transfer list).
    type Hidden: Debug + Send;
    /// A microbatch's token ids, labels, loss weights and `cu_seqlens` on the device.
    type Data: Debug + Send;
    /// The head's loss sums as the cross-entropy kernel leaves them.
    type Loss: Debug + Send;
    /// Whether losses stay on the device until the step ends ([`StageOutput::LossPending`]).
    const DEFERRED_LOSS: bool;

    /// Moves a microbatch's data to the device.
    ///
    /// # Errors
    /// A backend failure (out of memory).
    fn upload_data(&self, d: &MicrobatchData) -> Result<Self::Data>;
    /// Tokens `T` of a microbatch.
    fn tokens(d: &Self::Data) -> usize;
    /// Wraps a `[T, H]` tensor of `len` values for a transfer.
    fn hidden(&self, t: Self::Tensor, len: usize) -> Self::Hidden;
    /// The tensor of a transferred hidden state.
    fn tensor(h: &Self::Hidden) -> &Self::Tensor;
    /// Values of a hidden state (`T * H`).
    fn hidden_len(h: &Self::Hidden) -> usize;
    /// Bytes of a tensor.
    fn bytes(t: &Self::Tensor) -> usize;
    /// Marks a stage's output ready for another rank to read (CUDA records an event).
    ///
    /// # Errors
    /// A backend failure.
    fn ready(&self, h: Self::Hidden) -> Result<Self::Hidden> {
        Ok(h)
    }
    /// Takes a hidden state another rank sent ([`StageWorker::import`]).
    ///
    /// # Errors
    /// A backend failure.
    fn import(&self, h: Self::Hidden) -> Result<(Self::Hidden, CopyStamps)> {
        Ok((h, None))
    }
    /// Waits for everything enqueued (after the optimizer and the gradient all-reduce).
    ///
    /// # Errors
    /// A backend failure.
    fn synchronize(&self) -> Result<()> {
        Ok(())
    }
    /// The rank's device clock, for a backend that runs asynchronously.
    fn clock(&mut self) -> Option<&mut dyn DeviceClock> {
        None
    }

    /// Zeros `[rows, cols]`.
    ///
    /// # Errors
    /// A backend failure (out of memory).
    fn zeros(&self, rows: usize, cols: usize) -> Result<Self::Tensor>;
    /// Sets `t` to zero.
    ///
    /// # Errors
    /// A backend failure.
    fn fill_zero(&self, t: &mut Self::Tensor) -> Result<()>;
    /// Calls `f` on `t`'s values (through the host where the device's memory is not the host's).
    ///
    /// # Errors
    /// A backend failure.
    fn visit(&self, t: &mut Self::Tensor, f: &mut dyn FnMut(&mut [f32])) -> Result<()>;
    /// `t`'s values on the host; NaN where they cannot be read (the error is logged).
    fn to_host(&self, t: &Self::Tensor) -> Vec<f32>;
    /// `Σ x²` in f64.
    ///
    /// # Errors
    /// A backend failure.
    fn sum_squares(&self, t: &Self::Tensor) -> Result<f64>;
    /// One AdamW update of `value` with `grad * grad_scale` and moments `m`, `v` at step `t`.
    ///
    /// # Errors
    /// A backend failure.
    fn adamw(
        &self,
        state: (
            &mut Self::Tensor,
            &Self::Tensor,
            &mut Self::Tensor,
            &mut Self::Tensor,
        ),
        opt: &AdamW,
        t: u64,
        grad_scale: f32,
    ) -> Result<()>;

    /// `x [t, din] @ w [din, dout]`.
    ///
    /// # Errors
    /// A backend failure.
    fn linear(
        &self,
        x: &Self::Tensor,
        w: &Self::Tensor,
        t: usize,
        din: usize,
        dout: usize,
    ) -> Result<Self::Tensor>;
    /// `dy [t, dout] @ w^T` -> `[t, din]` (dgrad of a linear layer).
    ///
    /// # Errors
    /// A backend failure.
    fn linear_dx(
        &self,
        dy: &Self::Tensor,
        w: &Self::Tensor,
        t: usize,
        din: usize,
        dout: usize,
    ) -> Result<Self::Tensor>;
    /// `dx += dy [t, dout] @ w^T`.
    ///
    /// # Errors
    /// A backend failure.
    #[allow(clippy::too_many_arguments)]
    fn linear_dx_acc(
        &self,
        dx: &mut Self::Tensor,
        dy: &Self::Tensor,
        w: &Self::Tensor,
        t: usize,
        din: usize,
        dout: usize,
    ) -> Result<()>;
    /// `dw [din, dout] += x^T @ dy` (wgrad of a linear layer).
    ///
    /// # Errors
    /// A backend failure.
    #[allow(clippy::too_many_arguments)]
    fn linear_dw(
        &self,
        dw: &mut Self::Tensor,
        x: &Self::Tensor,
        dy: &Self::Tensor,
        t: usize,
        din: usize,
        dout: usize,
    ) -> Result<()>;
    /// `y += x` over `n` values.
    ///
    /// # Errors
    /// A backend failure.
    fn add_inplace(&self, y: &mut Self::Tensor, x: &Self::Tensor, n: usize) -> Result<()>;
    /// RMSNorm of `x [t, h]` with weight `g [h]`: `(y, xhat = x * rstd, rstd [t])`.
    ///
    /// # Errors
    /// A backend failure.
    #[allow(clippy::type_complexity)]
    fn rmsnorm(
        &self,
        x: &Self::Tensor,
        g: &Self::Tensor,
        t: usize,
        h: usize,
    ) -> Result<(Self::Tensor, Self::Tensor, Self::Tensor)>;
    /// RMSNorm dgrad, plus `residual` when given (the residual stream's gradient).
    ///
    /// # Errors
    /// A backend failure.
    #[allow(clippy::too_many_arguments)]
    fn rmsnorm_dx(
        &self,
        dy: &Self::Tensor,
        xhat: &Self::Tensor,
        rstd: &Self::Tensor,
        g: &Self::Tensor,
        residual: Option<&Self::Tensor>,
        t: usize,
        h: usize,
    ) -> Result<Self::Tensor>;
    /// `dg += Σ_t dy * xhat` (RMSNorm wgrad).
    ///
    /// # Errors
    /// A backend failure.
    fn rmsnorm_dg(
        &self,
        dg: &mut Self::Tensor,
        dy: &Self::Tensor,
        xhat: &Self::Tensor,
        t: usize,
        h: usize,
    ) -> Result<()>;
    /// `xhat [t, h] * g [h]` per row (an RMSNorm's output again from its `xhat`).
    ///
    /// # Errors
    /// A backend failure; [`Error::Unsupported`] where the backend lacks the kernel.
    fn scale_rows(
        &self,
        xhat: &Self::Tensor,
        g: &Self::Tensor,
        t: usize,
        h: usize,
    ) -> Result<Self::Tensor>;
    /// Rotary embedding of `x [t, heads * head_dim]` in place (`inverse`: its transpose, for
    /// the backward), positions restarting in every sequence (a chunk's starting at its
    /// offset, [`MicrobatchData::chunk`]).
    ///
    /// # Errors
    /// A backend failure.
    fn rope(
        &self,
        x: &mut Self::Tensor,
        data: &Self::Data,
        heads: usize,
        head_dim: usize,
        inverse: bool,
    ) -> Result<()>;
    /// Varlen causal grouped-query attention: `(o [t, heads * d], lse [t, heads])`. For a chunk
    /// of a longer sequence ([`MicrobatchData::chunk`] at offset `o`), `k` and `v` hold the
    /// `o` earlier rows of its sequence then its own `t`.
    ///
    /// # Errors
    /// A backend failure.
    fn attention(
        &self,
        q: &Self::Tensor,
        k: &Self::Tensor,
        v: &Self::Tensor,
        data: &Self::Data,
        dims: AttnDims,
    ) -> Result<(Self::Tensor, Self::Tensor)>;
    /// Attention dgrad: `(dq, dk, dv)` from `dout` and the forward's `(q, k, v, o, lse)`.
    ///
    /// # Errors
    /// A backend failure.
    #[allow(clippy::type_complexity)]
    fn attention_backward(
        &self,
        dout: &Self::Tensor,
        saved: (
            &Self::Tensor,
            &Self::Tensor,
            &Self::Tensor,
            &Self::Tensor,
            &Self::Tensor,
        ),
        data: &Self::Data,
        dims: AttnDims,
    ) -> Result<(Self::Tensor, Self::Tensor, Self::Tensor)>;
    /// `[rows_0 + rows_1 + .., cols]`: the parts one under the other (a chunk's keys after the
    /// earlier chunks'). Default: unsupported (chunked sequences need it).
    ///
    /// # Errors
    /// [`Error::Unsupported`] on a backend without it; a backend failure.
    fn concat_rows(&self, parts: &[&Self::Tensor], cols: usize) -> Result<Self::Tensor> {
        let _ = (parts, cols);
        Err(Error::Unsupported(
            "chunked sequences (keys of earlier chunks) run on the CPU backend only".into(),
        ))
    }
    /// Rows `rows` of a `[_, cols]` tensor, as a tensor of their own. Default: unsupported.
    ///
    /// # Errors
    /// [`Error::Unsupported`] on a backend without it; a backend failure.
    fn slice_rows(
        &self,
        t: &Self::Tensor,
        rows: Range<usize>,
        cols: usize,
    ) -> Result<Self::Tensor> {
        let _ = (t, rows, cols);
        Err(Error::Unsupported(
            "chunked sequences (keys of earlier chunks) run on the CPU backend only".into(),
        ))
    }
    /// `silu(gate) * up` over `n` values.
    ///
    /// # Errors
    /// A backend failure.
    fn swiglu(&self, gate: &Self::Tensor, up: &Self::Tensor, n: usize) -> Result<Self::Tensor>;
    /// SwiGLU dgrad over `n` values: `(dgate, dup)`.
    ///
    /// # Errors
    /// A backend failure.
    fn swiglu_backward(
        &self,
        d: &Self::Tensor,
        gate: &Self::Tensor,
        up: &Self::Tensor,
        n: usize,
    ) -> Result<(Self::Tensor, Self::Tensor)>;
    /// Rows `ids` of `table [vocab, h]`.
    ///
    /// # Errors
    /// A backend failure.
    fn embedding(&self, table: &Self::Tensor, data: &Self::Data, h: usize) -> Result<Self::Tensor>;
    /// `dtable[ids[t]] += dy[t]`.
    ///
    /// # Errors
    /// A backend failure.
    fn embedding_backward(
        &self,
        dtable: &mut Self::Tensor,
        dy: &Self::Tensor,
        data: &Self::Data,
        h: usize,
    ) -> Result<()>;
    /// Weighted cross-entropy of `logits [t, vocab]` against the labels: the loss sums and the
    /// rows' log-sum-exps.
    ///
    /// # Errors
    /// A backend failure.
    fn cross_entropy(
        &self,
        logits: &Self::Tensor,
        data: &Self::Data,
        vocab: usize,
    ) -> Result<(Self::Loss, Self::Tensor)>;
    /// Cross-entropy dgrad: `dlogits [t, vocab]`.
    ///
    /// # Errors
    /// A backend failure.
    fn cross_entropy_backward(
        &self,
        logits: &Self::Tensor,
        lse: &Self::Tensor,
        data: &Self::Data,
        vocab: usize,
    ) -> Result<Self::Tensor>;
    /// The loss sums on the host.
    ///
    /// # Errors
    /// A backend failure.
    fn read_loss(&self, loss: &Self::Loss, tokens: u64) -> Result<LossSums>;
}

/// A parameter with its gradient and AdamW moments (allocated at the first optimizer step, so
/// a stage that is only timed never holds them).
#[derive(Debug)]
pub(crate) struct Param<T> {
    pub(crate) name: String,
    pub(crate) shape: (usize, usize),
    pub(crate) value: T,
    pub(crate) grad: T,
    pub(crate) moments: Option<(T, T)>,
}

/// How a parameter is initialised: normal with a standard deviation, or ones (norm weights).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ParamInit {
    /// `N(0, std²)`.
    Normal(f32),
    /// All ones.
    Ones,
}

/// A decoder layer's parameters and sizes.
#[derive(Debug)]
pub(crate) struct Decoder<T> {
    pub(crate) dims: AttnDims,
    pub(crate) hidden: usize,
    pub(crate) ffn: usize,
    pub(crate) attn_norm: Param<T>,
    pub(crate) wq: Param<T>,
    pub(crate) wk: Param<T>,
    pub(crate) wv: Param<T>,
    pub(crate) wo: Param<T>,
    pub(crate) ffn_norm: Param<T>,
    pub(crate) w1: Param<T>,
    pub(crate) w3: Param<T>,
    pub(crate) w2: Param<T>,
}

impl<T> Decoder<T> {
    fn kv(&self) -> usize {
        self.dims.kv_heads * self.dims.head_dim
    }
}

/// One layer of a stage.
// A few hundred bytes per layer next to megabytes of tensors: boxing buys nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
pub(crate) enum Layer<T> {
    Embedding {
        table: Param<T>,
        hidden: usize,
    },
    Decoder(Box<Decoder<T>>),
    Head {
        norm: Param<T>,
        out: Param<T>,
        hidden: usize,
        vocab: usize,
    },
}

impl<T> Layer<T> {
    pub(crate) fn params(&self) -> Vec<&Param<T>> {
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

    pub(crate) fn params_mut(&mut self) -> Vec<&mut Param<T>> {
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

/// What a decoder's forward keeps for its backward, all `[T, X]` (`rstd` `[T]`, `lse`
/// `[T, heads]`).
#[derive(Debug)]
pub(crate) struct DecoderF<T> {
    pub(crate) h1: T,
    pub(crate) xhat1: T,
    pub(crate) rstd1: T,
    pub(crate) q: T,
    pub(crate) k: T,
    pub(crate) v: T,
    pub(crate) o: T,
    pub(crate) lse: T,
    pub(crate) h2: T,
    pub(crate) xhat2: T,
    pub(crate) rstd2: T,
    pub(crate) gate: T,
    pub(crate) up: T,
    pub(crate) act: T,
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
pub(crate) struct DecoderSelective<T> {
    xhat1: T,
    rstd1: T,
    q: T,
    k: T,
    v: T,
    xhat2: T,
    rstd2: T,
    gate: T,
    up: T,
}

impl<T> DecoderSelective<T> {
    /// Keeps what selective recomputation keeps of a forward's context.
    fn keep(c: DecoderF<T>) -> Self {
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
    fn restore<O: OpSet<Tensor = T>>(
        self,
        ops: &O,
        p: &Decoder<T>,
        data: &O::Data,
    ) -> Result<DecoderF<T>> {
        let (t, h) = (O::tokens(data), p.hidden);
        let h1 = ops.scale_rows(&self.xhat1, &p.attn_norm.value, t, h)?;
        let (o, lse) = ops.attention(&self.q, &self.k, &self.v, data, p.dims)?;
        let h2 = ops.scale_rows(&self.xhat2, &p.ffn_norm.value, t, h)?;
        let act = ops.swiglu(&self.gate, &self.up, t * p.ffn)?;
        Ok(DecoderF {
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
        })
    }
}

/// What the head's forward keeps for its backward.
#[derive(Debug)]
pub(crate) struct HeadF<T> {
    h: T,
    xhat: T,
    rstd: T,
    logits: T,
    lse: T,
}

/// Per layer, what F keeps until I.
#[derive(Debug)]
pub(crate) enum FCtx<O: OpSet> {
    Embedding,
    Decoder(Box<DecoderF<O::Tensor>>),
    Head(Box<HeadF<O::Tensor>>),
    /// Full recomputation: only the layer's input, the forward reruns in I.
    Input(O::Hidden),
    /// Selective recomputation of a decoder ([`DecoderSelective`]).
    Selective(Box<DecoderSelective<O::Tensor>>),
}

/// What a decoder's dgrad keeps for its wgrad: the GEMM inputs (normed inputs, attention
/// output, activation) and the gradients of the GEMM outputs.
#[derive(Debug)]
pub(crate) struct DecoderW<O: OpSet> {
    h1: O::Tensor,
    xhat1: O::Tensor,
    o: O::Tensor,
    h2: O::Tensor,
    xhat2: O::Tensor,
    act: O::Tensor,
    dq: O::Tensor,
    dk: O::Tensor,
    dv: O::Tensor,
    da: O::Tensor,
    dgate: O::Tensor,
    dup: O::Tensor,
    dm: O::Hidden,
    dh1: O::Tensor,
    dh2: O::Tensor,
}

/// Per layer, what I keeps until W.
// A few handles per variant on a GPU: boxing the head's buys nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
pub(crate) enum WCtx<O: OpSet> {
    Embedding {
        dy: O::Hidden,
    },
    Decoder(Box<DecoderW<O>>),
    Head {
        h: O::Tensor,
        xhat: O::Tensor,
        dlogits: O::Tensor,
        dh: O::Tensor,
    },
}

fn sum_bytes<O: OpSet>(ts: &[&O::Tensor]) -> usize {
    ts.iter().map(|t| O::bytes(t)).sum()
}

impl<O: OpSet> FCtx<O> {
    fn bytes(&self) -> usize {
        match self {
            FCtx::Embedding => 0,
            FCtx::Input(x) => O::bytes(O::tensor(x)),
            FCtx::Head(c) => sum_bytes::<O>(&[&c.h, &c.xhat, &c.rstd, &c.logits, &c.lse]),
            FCtx::Decoder(c) => sum_bytes::<O>(&[
                &c.h1, &c.xhat1, &c.rstd1, &c.q, &c.k, &c.v, &c.o, &c.lse, &c.h2, &c.xhat2,
                &c.rstd2, &c.gate, &c.up, &c.act,
            ]),
            FCtx::Selective(c) => sum_bytes::<O>(&[
                &c.xhat1, &c.rstd1, &c.q, &c.k, &c.v, &c.xhat2, &c.rstd2, &c.gate, &c.up,
            ]),
        }
    }
}

impl<O: OpSet> WCtx<O> {
    fn bytes(&self) -> usize {
        match self {
            WCtx::Embedding { dy } => O::bytes(O::tensor(dy)),
            WCtx::Head {
                h,
                xhat,
                dlogits,
                dh,
            } => sum_bytes::<O>(&[h, xhat, dlogits, dh]),
            WCtx::Decoder(w) => sum_bytes::<O>(&[
                &w.h1,
                &w.xhat1,
                &w.o,
                &w.h2,
                &w.xhat2,
                &w.act,
                &w.dq,
                &w.dk,
                &w.dv,
                &w.da,
                &w.dgate,
                &w.dup,
                O::tensor(&w.dm),
                &w.dh1,
                &w.dh2,
            ]),
        }
    }
}

/// A decoder's forward: pre-norm attention then pre-norm SwiGLU MLP, each on the residual
/// stream (Llama 3 as torchtitan implements it). `x [T, H]` -> `y [T, H]` and what I needs.
///
/// `prefix`: for a chunk of a longer sequence, the earlier chunks' rotated keys and values on
/// this layer `[offset, kv]` (the forward keeps only the chunk's own).
pub(crate) fn decoder_forward<O: OpSet>(
    ops: &O,
    p: &Decoder<O::Tensor>,
    x: &O::Tensor,
    data: &O::Data,
    prefix: Option<(&O::Tensor, &O::Tensor)>,
) -> Result<(O::Tensor, DecoderF<O::Tensor>)> {
    let (t, h, f, kv) = (O::tokens(data), p.hidden, p.ffn, p.kv());
    let d = p.dims;
    let (h1, xhat1, rstd1) = ops.rmsnorm(x, &p.attn_norm.value, t, h)?;
    let mut q = ops.linear(&h1, &p.wq.value, t, h, h)?;
    let mut k = ops.linear(&h1, &p.wk.value, t, h, kv)?;
    let v = ops.linear(&h1, &p.wv.value, t, h, kv)?;
    ops.rope(&mut q, data, d.heads, d.head_dim, false)?;
    ops.rope(&mut k, data, d.kv_heads, d.head_dim, false)?;
    let (o, lse) = match prefix {
        Some((kp, vp)) => {
            let kf = ops.concat_rows(&[kp, &k], kv)?;
            let vf = ops.concat_rows(&[vp, &v], kv)?;
            ops.attention(&q, &kf, &vf, data, d)?
        }
        None => ops.attention(&q, &k, &v, data, d)?,
    };
    let mut x2 = ops.linear(&o, &p.wo.value, t, h, h)?;
    ops.add_inplace(&mut x2, x, t * h)?;
    let (h2, xhat2, rstd2) = ops.rmsnorm(&x2, &p.ffn_norm.value, t, h)?;
    let gate = ops.linear(&h2, &p.w1.value, t, h, f)?;
    let up = ops.linear(&h2, &p.w3.value, t, h, f)?;
    let act = ops.swiglu(&gate, &up, t * f)?;
    let mut y = ops.linear(&act, &p.w2.value, t, f, h)?;
    ops.add_inplace(&mut y, &x2, t * h)?;
    Ok((
        y,
        DecoderF {
            h1,
            xhat1,
            rstd1,
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

/// What a chunk's dgrad adds to a decoder's: the earlier chunks' keys and values on this layer
/// (`[offset, kv]`, `None` for the first chunk) and the gradients of this chunk's own keys and
/// values that the later chunks' dgrads produced (`None` for the last).
pub(crate) struct ChunkDgrad<'a, T> {
    /// The chunk's offset in its sequence: the rows of `prefix`.
    pub(crate) offset: usize,
    pub(crate) prefix: Option<(&'a T, &'a T)>,
    pub(crate) later: Option<(T, T)>,
}

/// A decoder's dgrad: from `dy [T, H]` (kept for W as the MLP output GEMM's gradient) to the
/// input gradient, and what W needs. For a chunk, also the gradients of the earlier chunks'
/// keys and values `[offset, kv]` (rotated; each earlier chunk adds its rows to its own in its
/// dgrad).
#[allow(clippy::type_complexity)]
pub(crate) fn decoder_dgrad<O: OpSet>(
    ops: &O,
    p: &Decoder<O::Tensor>,
    c: DecoderF<O::Tensor>,
    dy_hidden: O::Hidden,
    data: &O::Data,
    chunk: Option<ChunkDgrad<'_, O::Tensor>>,
) -> Result<(O::Tensor, WCtx<O>, Option<(O::Tensor, O::Tensor)>)> {
    let (t, h, f, kv) = (O::tokens(data), p.hidden, p.ffn, p.kv());
    let d = p.dims;
    let dy = O::tensor(&dy_hidden);
    // MLP: y = x2 + act W2
    let dact = ops.linear_dx(dy, &p.w2.value, t, f, h)?;
    let (dgate, dup) = ops.swiglu_backward(&dact, &c.gate, &c.up, t * f)?;
    let mut dh2 = ops.linear_dx(&dgate, &p.w1.value, t, h, f)?;
    ops.linear_dx_acc(&mut dh2, &dup, &p.w3.value, t, h, f)?;
    let dx2 = ops.rmsnorm_dx(&dh2, &c.xhat2, &c.rstd2, &p.ffn_norm.value, Some(dy), t, h)?;
    // Attention: x2 = x + o Wo
    let dout = ops.linear_dx(&dx2, &p.wo.value, t, h, h)?;
    let (mut dq, mut dk, mut dv, earlier) = match &chunk {
        Some(ChunkDgrad {
            offset: o,
            prefix: Some((kp, vp)),
            ..
        }) => {
            let o = *o;
            let kf = ops.concat_rows(&[kp, &c.k], kv)?;
            let vf = ops.concat_rows(&[vp, &c.v], kv)?;
            let (dq, dkf, dvf) =
                ops.attention_backward(&dout, (&c.q, &kf, &vf, &c.o, &c.lse), data, d)?;
            let own = |x: &O::Tensor| ops.slice_rows(x, o..o + t, kv);
            let before = |x: &O::Tensor| ops.slice_rows(x, 0..o, kv);
            (
                dq,
                own(&dkf)?,
                own(&dvf)?,
                Some((before(&dkf)?, before(&dvf)?)),
            )
        }
        _ => {
            let (dq, dk, dv) =
                ops.attention_backward(&dout, (&c.q, &c.k, &c.v, &c.o, &c.lse), data, d)?;
            (dq, dk, dv, None)
        }
    };
    if let Some(ChunkDgrad {
        later: Some((lk, lv)),
        ..
    }) = &chunk
    {
        ops.add_inplace(&mut dk, lk, t * kv)?;
        ops.add_inplace(&mut dv, lv, t * kv)?;
    }
    ops.rope(&mut dq, data, d.heads, d.head_dim, true)?;
    ops.rope(&mut dk, data, d.kv_heads, d.head_dim, true)?;
    let mut dh1 = ops.linear_dx(&dq, &p.wq.value, t, h, h)?;
    ops.linear_dx_acc(&mut dh1, &dk, &p.wk.value, t, h, kv)?;
    ops.linear_dx_acc(&mut dh1, &dv, &p.wv.value, t, h, kv)?;
    let dx = ops.rmsnorm_dx(
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
        dm: dy_hidden,
        dh1,
        dh2,
    }));
    Ok((dx, w, earlier))
}

/// The head's forward: final RMSNorm, LM head, weighted cross-entropy.
pub(crate) fn head_forward<O: OpSet>(
    ops: &O,
    (norm, out): (&Param<O::Tensor>, &Param<O::Tensor>),
    (hidden, vocab): (usize, usize),
    x: &O::Tensor,
    data: &O::Data,
) -> Result<(O::Loss, HeadF<O::Tensor>)> {
    let t = O::tokens(data);
    let (h, xhat, rstd) = ops.rmsnorm(x, &norm.value, t, hidden)?;
    let logits = ops.linear(&h, &out.value, t, hidden, vocab)?;
    let (loss, lse) = ops.cross_entropy(&logits, data, vocab)?;
    Ok((
        loss,
        HeadF {
            h,
            xhat,
            rstd,
            logits,
            lse,
        },
    ))
}

/// The head's dgrad: from the loss to the input gradient, and what W needs.
fn head_dgrad<O: OpSet>(
    ops: &O,
    (norm, out): (&Param<O::Tensor>, &Param<O::Tensor>),
    (hidden, vocab): (usize, usize),
    c: HeadF<O::Tensor>,
    data: &O::Data,
) -> Result<(O::Tensor, WCtx<O>)> {
    let t = O::tokens(data);
    let dlogits = ops.cross_entropy_backward(&c.logits, &c.lse, data, vocab)?;
    let dh = ops.linear_dx(&dlogits, &out.value, t, hidden, vocab)?;
    let dx = ops.rmsnorm_dx(&dh, &c.xhat, &c.rstd, &norm.value, None, t, hidden)?;
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

/// Checks a decoder's attention shape: heads divide the hidden size, kv heads divide the heads,
/// and the head dimension is even (rotary rotates pairs).
///
/// # Errors
/// [`Error::Unsupported`] naming the layer and its sizes.
pub(crate) fn attn_dims(l: &flatpipe_profiles::Layer) -> Result<AttnDims> {
    let (h, heads, kvh) = (l.hidden as usize, l.heads as usize, l.kv_heads as usize);
    if heads == 0 || kvh == 0 || h % heads != 0 || heads % kvh != 0 || (h / heads) % 2 != 0 {
        return Err(Error::Unsupported(format!(
            "decoder layer {}: hidden {h}, heads {heads}, kv_heads {kvh}: the kernels need heads | hidden, kv_heads | heads and an even head dimension",
            l.index
        )));
    }
    Ok(AttnDims {
        heads,
        kv_heads: kvh,
        head_dim: h / heads,
    })
}

/// Makes a parameter's value from its name, shape `[rows, cols]`, initialisation and the
/// layer's random generator ([`build_layers`]).
pub(crate) type MakeParam<'a, T> =
    dyn FnMut(&str, (usize, usize), ParamInit, &mut ChaCha8Rng) -> Result<T> + 'a;

/// Builds layers `range` of `model`: each parameter's value from `make(name, shape, init,
/// rng)`, where `rng` is the layer's generator, seeded from `(seed, layer index)` so that any
/// split of the model draws the same weights; parameters are made in a fixed order per layer.
///
/// # Errors
/// [`Error::Invalid`] for an empty or out-of-range layer range; [`attn_dims`]'s; `make`'s.
pub(crate) fn build_layers<O: OpSet>(
    ops: &O,
    model: &ModelSpec,
    range: Range<usize>,
    seed: u64,
    make: &mut MakeParam<'_, O::Tensor>,
) -> Result<Vec<(usize, Layer<O::Tensor>)>> {
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
    let std = 0.02;
    let mut layers = Vec::with_capacity(range.len());
    for l in &all[range] {
        let mut rng = ChaCha8Rng::seed_from_u64(
            seed ^ (l.index as u64 + 1).wrapping_mul(0xA076_1D64_78BD_642F),
        );
        let mut param = |name: String, shape: (usize, usize), init: ParamInit| -> Result<_> {
            let value = make(&name, shape, init, &mut rng)?;
            Ok(Param {
                grad: ops.zeros(shape.0, shape.1)?,
                name,
                shape,
                value,
                moments: None,
            })
        };
        let (h, vocab) = (l.hidden as usize, l.vocab as usize);
        let layer = match l.kind {
            LayerKind::Embedding => Layer::Embedding {
                table: param(
                    "tok_embeddings.weight".into(),
                    (vocab, h),
                    ParamInit::Normal(1.0),
                )?,
                hidden: h,
            },
            LayerKind::Head => Layer::Head {
                norm: param("norm.weight".into(), (1, h), ParamInit::Ones)?,
                out: param("output.weight".into(), (h, vocab), ParamInit::Normal(std))?,
                hidden: h,
                vocab,
            },
            LayerKind::Decoder => {
                let dims = attn_dims(l)?;
                let kv = dims.kv_heads * dims.head_dim;
                let ffn = l.ffn as usize;
                let n = l.decoder_index.unwrap_or(0);
                let name = |s: &str| format!("layers.{n}.{s}.weight");
                // Output projections scaled by 1/sqrt(2 * layers) in GPT-2 style would depend on
                // the depth; a plain std keeps a stage's weights independent of the whole model.
                let normal = ParamInit::Normal(std);
                Layer::Decoder(Box::new(Decoder {
                    dims,
                    hidden: h,
                    ffn,
                    attn_norm: param(name("attention_norm"), (1, h), ParamInit::Ones)?,
                    wq: param(name("attention.wq"), (h, h), normal)?,
                    wk: param(name("attention.wk"), (h, kv), normal)?,
                    wv: param(name("attention.wv"), (h, kv), normal)?,
                    wo: param(name("attention.wo"), (h, h), normal)?,
                    ffn_norm: param(name("ffn_norm"), (1, h), ParamInit::Ones)?,
                    w1: param(name("feed_forward.w1"), (h, ffn), normal)?,
                    w3: param(name("feed_forward.w3"), (h, ffn), normal)?,
                    w2: param(name("feed_forward.w2"), (ffn, h), normal)?,
                }))
            }
        };
        layers.push((l.index, layer));
    }
    Ok(layers)
}

/// Data flowing through a stage's layers.
enum Flow<O: OpSet> {
    Tokens,
    Hidden(O::Hidden),
    Loss(O::Loss),
}

/// One pipeline stage: layers `[start, end)` of a model on one rank, over the op set `O`.
#[derive(Debug)]
pub struct Stage<O: OpSet> {
    pub(crate) ops: O,
    pub(crate) layers: Vec<(usize, Layer<O::Tensor>)>,
    hidden: usize,
    recompute: Recompute,
    fctx: HashMap<u32, (O::Data, Vec<FCtx<O>>)>,
    wctx: HashMap<u32, (O::Data, Vec<WCtx<O>>)>,
    pending: Vec<(u32, bool, u64, O::Loss)>,
    /// Microbatch data moved to the device before the step, by (microbatch, forward-only).
    staged: HashMap<(u32, bool), O::Data>,
    peak_saved: usize,
    /// Chunked sequences on this stage: sequence -> its chunks' `(index, offset, tokens,
    /// microbatch)` as their forwards ran.
    chains: HashMap<u32, Vec<(u32, usize, usize, u32)>>,
    /// Per (chunk microbatch, layer position): the gradients of its rotated keys and values
    /// that its later chunks' dgrads produced, summed, `[tokens, kv]` each.
    later_kv: HashMap<(u32, usize), (O::Tensor, O::Tensor)>,
}

impl<O: OpSet> Stage<O> {
    /// A stage of `layers` on `ops`, recomputing per `recompute`.
    pub(crate) fn from_layers(
        ops: O,
        layers: Vec<(usize, Layer<O::Tensor>)>,
        hidden: usize,
        recompute: Recompute,
    ) -> Self {
        Stage {
            ops,
            layers,
            hidden,
            recompute,
            fctx: HashMap::new(),
            wctx: HashMap::new(),
            pending: Vec::new(),
            staged: HashMap::new(),
            peak_saved: 0,
            chains: HashMap::new(),
            later_kv: HashMap::new(),
        }
    }

    /// Bytes of activations and gradients this stage holds for microbatches between F and W
    /// (what F keeps until I plus what I keeps until W), from the real tensors.
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
        let kv: usize = self
            .later_kv
            .values()
            .map(|(k, v)| O::bytes(k) + O::bytes(v))
            .sum();
        f + w + kv
    }

    /// The most [`Stage::saved_bytes`] seen after any action (this stage's share of its rank's
    /// peak activation memory).
    pub fn peak_saved_bytes(&self) -> usize {
        self.peak_saved
    }

    /// Parameters of this stage.
    pub fn param_count(&self) -> u64 {
        self.layers
            .iter()
            .flat_map(|(_, l)| l.params())
            .map(|p| (p.shape.0 * p.shape.1) as u64)
            .sum()
    }

    /// Global layer indices held by this stage.
    pub fn layer_indices(&self) -> Vec<usize> {
        self.layers.iter().map(|(i, _)| *i).collect()
    }

    /// The stage's op set.
    pub fn ops(&self) -> &O {
        &self.ops
    }

    fn note_peak(&mut self) {
        self.peak_saved = self.peak_saved.max(self.saved_bytes());
    }

    /// The earlier chunks' rotated keys and values of every layer (`None` for a layer that is
    /// not a decoder), from their saved forwards, for chunk `c` (microbatch `mb`); `None` when
    /// `c` is the first chunk. Their forwards ran and their dgrads have not (the schedule runs a
    /// sequence's forwards in chunk order and its backwards in reverse).
    #[allow(clippy::type_complexity)]
    fn chunk_prefix(
        &self,
        mb: u32,
        c: flatpipe_simulator::batching::microbatch::Chunk,
    ) -> Result<Option<Vec<Option<(O::Tensor, O::Tensor)>>>> {
        if c.index == 0 {
            return Ok(None);
        }
        let misuse = |why| Misuse::ChunkOrder {
            mb,
            sequence: c.sequence,
            index: c.index,
            why,
        };
        let mut earlier: Vec<(u32, u32)> = self
            .chains
            .get(&c.sequence)
            .map(|v| {
                v.iter()
                    .filter(|x| x.0 < c.index)
                    .map(|x| (x.0, x.3))
                    .collect()
            })
            .unwrap_or_default();
        earlier.sort_unstable();
        if earlier.len() != c.index as usize {
            return Err(misuse("an earlier chunk's forward has not run on this stage").into());
        }
        let mut ctxs = Vec::with_capacity(earlier.len());
        for (_, m) in &earlier {
            let (_, c) = self.fctx.get(m).ok_or(misuse(
                "an earlier chunk's backward ran before this chunk's",
            ))?;
            ctxs.push(c);
        }
        let mut out = Vec::with_capacity(self.layers.len());
        for (l, (_, layer)) in self.layers.iter().enumerate() {
            let Layer::Decoder(d) = layer else {
                out.push(None);
                continue;
            };
            let mut ks = Vec::with_capacity(ctxs.len());
            let mut vs = Vec::with_capacity(ctxs.len());
            for c in &ctxs {
                match c.get(l) {
                    Some(FCtx::Decoder(f)) => {
                        ks.push(&f.k);
                        vs.push(&f.v);
                    }
                    _ => return Err(Misuse::ActivationsOfAnotherKind.into()),
                }
            }
            out.push(Some((
                self.ops.concat_rows(&ks, d.kv())?,
                self.ops.concat_rows(&vs, d.kv())?,
            )));
        }
        Ok(Some(out))
    }

    fn run_layer(
        ops: &O,
        layer: &Layer<O::Tensor>,
        flow: Flow<O>,
        data: &O::Data,
        keep: bool,
        recompute: Recompute,
        prefix: Option<(&O::Tensor, &O::Tensor)>,
    ) -> Result<(Flow<O>, Option<FCtx<O>>)> {
        let t = O::tokens(data);
        Ok(match (layer, flow) {
            (Layer::Embedding { table, hidden }, Flow::Tokens) => (
                Flow::Hidden(ops.hidden(ops.embedding(&table.value, data, *hidden)?, t * hidden)),
                keep.then_some(FCtx::Embedding),
            ),
            (Layer::Decoder(d), Flow::Hidden(x)) => {
                let (y, c) = decoder_forward(ops, d, O::tensor(&x), data, prefix)?;
                let ctx = match (keep, recompute) {
                    (false, _) => None,
                    (true, Recompute::Full) => Some(FCtx::Input(x)),
                    (true, Recompute::Selective) => {
                        Some(FCtx::Selective(Box::new(DecoderSelective::keep(c))))
                    }
                    (true, Recompute::None) => Some(FCtx::Decoder(Box::new(c))),
                };
                (Flow::Hidden(ops.hidden(y, t * d.hidden)), ctx)
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
                let (loss, c) =
                    head_forward(ops, (norm, out), (*hidden, *vocab), O::tensor(&x), data)?;
                // The head keeps everything under selective recomputation (the simulator's cost
                // model has it so).
                let ctx = match (keep, recompute) {
                    (false, _) => None,
                    (true, Recompute::Full) => Some(FCtx::Input(x)),
                    (true, _) => Some(FCtx::Head(Box::new(c))),
                };
                (Flow::Loss(loss), ctx)
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

    /// `(name, values)` of `pick(parameter)` for every parameter, on the host.
    fn named(&self, pick: impl Fn(&Param<O::Tensor>) -> &O::Tensor) -> Vec<(String, Vec<f32>)> {
        self.layers
            .iter()
            .flat_map(|(_, l)| l.params())
            .map(|p| (p.name.clone(), self.ops.to_host(pick(p))))
            .collect()
    }
}

impl<O: OpSet> StageWorker for Stage<O> {
    type Hidden = O::Hidden;

    fn hidden_size(&self) -> usize {
        self.hidden
    }

    fn hidden_len(h: &O::Hidden) -> usize {
        O::hidden_len(h)
    }

    fn forward(
        &mut self,
        mb: u32,
        data: &MicrobatchData,
        input: StageInput<O::Hidden>,
        keep: bool,
    ) -> Result<StageOutput<O::Hidden>> {
        let dev = match self.staged.remove(&(mb, !keep)) {
            Some(d) => d,
            None => self.ops.upload_data(data)?,
        };
        let mut flow = match input {
            StageInput::Tokens => Flow::Tokens,
            StageInput::Hidden(h) => Flow::Hidden(h),
        };
        let prefix = match data.chunk {
            Some(c) => {
                if !keep || self.recompute != Recompute::None {
                    return Err(Error::Unsupported(format!(
                        "chunk {} of {} (microbatch {mb}): chunked sequences run only as training microbatches without recomputation (their later chunks read this chunk's saved keys and values)",
                        c.index, c.of
                    )));
                }
                let prefix = self.chunk_prefix(mb, c)?;
                self.chains.entry(c.sequence).or_default().push((
                    c.index,
                    c.offset as usize,
                    data.tokens(),
                    mb,
                ));
                prefix
            }
            None => None,
        };
        let mut ctxs = Vec::with_capacity(self.layers.len());
        for (l, (_, layer)) in self.layers.iter().enumerate() {
            let p = prefix
                .as_ref()
                .and_then(|p| p[l].as_ref())
                .map(|(k, v)| (k, v));
            let (next, ctx) =
                Self::run_layer(&self.ops, layer, flow, &dev, keep, self.recompute, p)?;
            flow = next;
            ctxs.extend(ctx);
        }
        let tokens = O::tokens(&dev) as u64;
        if keep {
            if self.fctx.contains_key(&mb) {
                return Err(Misuse::ForwardTwice(mb).into());
            }
            self.fctx.insert(mb, (dev, ctxs));
            self.note_peak();
        }
        match flow {
            Flow::Hidden(h) => Ok(StageOutput::Hidden(self.ops.ready(h)?)),
            Flow::Loss(loss) if O::DEFERRED_LOSS => {
                self.pending.push((mb, !keep, tokens, loss));
                Ok(StageOutput::LossPending)
            }
            Flow::Loss(loss) => Ok(StageOutput::Loss(self.ops.read_loss(&loss, tokens)?)),
            Flow::Tokens => Err(Misuse::NoLayers.into()),
        }
    }

    fn backward_input(
        &mut self,
        mb: u32,
        data: &MicrobatchData,
        grad: Option<O::Hidden>,
    ) -> Result<Option<O::Hidden>> {
        // A chunk: every later chunk's dgrad ran (they produced this chunk's key/value
        // gradients); the earlier chunks' keys and values are still saved.
        let (chunk, prefix) = match data.chunk {
            Some(c) => {
                let chain = self.chains.get(&c.sequence).cloned().unwrap_or_default();
                let later_pending = chain
                    .iter()
                    .any(|x| x.0 > c.index && self.fctx.contains_key(&x.3));
                if later_pending || chain.len() != c.of as usize {
                    return Err(Misuse::ChunkOrder {
                        mb,
                        sequence: c.sequence,
                        index: c.index,
                        why: "a later chunk's backward has not run on this stage (a sequence's backwards run in reverse chunk order)",
                    }
                    .into());
                }
                (Some((c, chain)), self.chunk_prefix(mb, c)?)
            }
            None => (None, None),
        };
        let (dev, ctxs) = self
            .fctx
            .remove(&mb)
            .ok_or(Misuse::DgradBeforeForward(mb))?;
        let ops = &self.ops;
        let t = O::tokens(&dev);
        let mut dy = grad;
        let mut wctxs = Vec::with_capacity(ctxs.len());
        for (pos, ((_, layer), ctx)) in self.layers.iter().zip(ctxs).enumerate().rev() {
            let ctx = match (ctx, layer) {
                // Full recomputation: rerun this layer's forward from its saved input.
                (FCtx::Input(x), Layer::Decoder(d)) => FCtx::Decoder(Box::new(
                    decoder_forward(ops, d, O::tensor(&x), &dev, None)?.1,
                )),
                (
                    FCtx::Input(x),
                    Layer::Head {
                        norm,
                        out,
                        hidden,
                        vocab,
                    },
                ) => FCtx::Head(Box::new(
                    head_forward(ops, (norm, out), (*hidden, *vocab), O::tensor(&x), &dev)?.1,
                )),
                (FCtx::Input(_), Layer::Embedding { .. }) => FCtx::Embedding,
                // Selective: the attention core and the elementwise work again.
                (FCtx::Selective(c), Layer::Decoder(d)) => {
                    FCtx::Decoder(Box::new(c.restore(ops, d, &dev)?))
                }
                (FCtx::Selective(_), _) => return Err(Misuse::ActivationsOfAnotherKind.into()),
                (c, _) => c,
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
                    let (dx, w) = head_dgrad(ops, (norm, out), (*hidden, *vocab), *c, &dev)?;
                    (Some(ops.hidden(dx, t * hidden)), w)
                }
                (Layer::Decoder(d), FCtx::Decoder(c)) => {
                    let dy = dy.take().ok_or(Misuse::NoOutputGradient(mb))?;
                    let cg = chunk.as_ref().map(|(ch, _)| ChunkDgrad {
                        offset: ch.offset as usize,
                        prefix: prefix
                            .as_ref()
                            .and_then(|p| p[pos].as_ref())
                            .map(|(k, v)| (k, v)),
                        later: self.later_kv.remove(&(mb, pos)),
                    });
                    let (dx, w, earlier) = decoder_dgrad(ops, d, *c, dy, &dev, cg)?;
                    // Hand each earlier chunk its rows of the key/value gradients.
                    if let (Some((dkp, dvp)), Some((ch, chain))) = (earlier, &chunk) {
                        let kv = d.kv();
                        for &(_, off, len, m) in chain.iter().filter(|x| x.0 < ch.index) {
                            let gk = ops.slice_rows(&dkp, off..off + len, kv)?;
                            let gv = ops.slice_rows(&dvp, off..off + len, kv)?;
                            match self.later_kv.get_mut(&(m, pos)) {
                                Some((k, v)) => {
                                    ops.add_inplace(k, &gk, len * kv)?;
                                    ops.add_inplace(v, &gv, len * kv)?;
                                }
                                None => {
                                    self.later_kv.insert((m, pos), (gk, gv));
                                }
                            }
                        }
                    }
                    (Some(ops.hidden(dx, t * d.hidden)), w)
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
        if let Some((c, _)) = chunk
            && c.index == 0
        {
            // The sequence's last backward on this stage.
            self.chains.remove(&c.sequence);
        }
        self.wctx.insert(mb, (dev, wctxs));
        self.note_peak();
        dy.map(|h| self.ops.ready(h)).transpose()
    }

    fn backward_weight(&mut self, mb: u32, _data: &MicrobatchData) -> Result<()> {
        let (dev, wctxs) = self.wctx.remove(&mb).ok_or(Misuse::WgradBeforeDgrad(mb))?;
        let ops = &self.ops;
        let t = O::tokens(&dev);
        for ((_, layer), w) in self.layers.iter_mut().zip(wctxs) {
            match (layer, w) {
                (Layer::Embedding { table, hidden }, WCtx::Embedding { dy }) => {
                    ops.embedding_backward(&mut table.grad, O::tensor(&dy), &dev, *hidden)?;
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
                    ops.linear_dw(&mut out.grad, &h, &dlogits, t, *hidden, *vocab)?;
                    ops.rmsnorm_dg(&mut norm.grad, &dh, &xhat, t, *hidden)?;
                }
                (Layer::Decoder(d), WCtx::Decoder(w)) => {
                    let d = &mut **d;
                    let (h, f, kv) = (d.hidden, d.ffn, d.kv());
                    ops.linear_dw(&mut d.wq.grad, &w.h1, &w.dq, t, h, h)?;
                    ops.linear_dw(&mut d.wk.grad, &w.h1, &w.dk, t, h, kv)?;
                    ops.linear_dw(&mut d.wv.grad, &w.h1, &w.dv, t, h, kv)?;
                    ops.linear_dw(&mut d.wo.grad, &w.o, &w.da, t, h, h)?;
                    ops.linear_dw(&mut d.w1.grad, &w.h2, &w.dgate, t, h, f)?;
                    ops.linear_dw(&mut d.w3.grad, &w.h2, &w.dup, t, h, f)?;
                    ops.linear_dw(&mut d.w2.grad, &w.act, O::tensor(&w.dm), t, f, h)?;
                    ops.rmsnorm_dg(&mut d.attn_norm.grad, &w.dh1, &w.xhat1, t, h)?;
                    ops.rmsnorm_dg(&mut d.ffn_norm.grad, &w.dh2, &w.xhat2, t, h)?;
                }
                _ => {
                    return Err(Misuse::GradientsOfAnotherKind.into());
                }
            }
        }
        Ok(())
    }

    fn zero_grads(&mut self) -> Result<()> {
        for (_, l) in &mut self.layers {
            for p in l.params_mut() {
                self.ops.fill_zero(&mut p.grad)?;
            }
        }
        Ok(())
    }

    fn visit_grads(&mut self, f: &mut dyn FnMut(&mut [f32])) -> Result<()> {
        for (_, l) in &mut self.layers {
            for p in l.params_mut() {
                self.ops.visit(&mut p.grad, f)?;
            }
        }
        self.ops.synchronize()
    }

    fn grad_sq_norm(&self) -> Result<f64> {
        let mut sum = 0.0;
        for p in self.layers.iter().flat_map(|(_, l)| l.params()) {
            sum += self.ops.sum_squares(&p.grad)?;
        }
        Ok(sum)
    }

    fn optimizer_step(&mut self, opt: &AdamW, t: u64, grad_scale: f32) -> Result<()> {
        for (_, l) in &mut self.layers {
            for p in l.params_mut() {
                if p.moments.is_none() {
                    let (r, c) = p.shape;
                    p.moments = Some((self.ops.zeros(r, c)?, self.ops.zeros(r, c)?));
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
                self.ops.adamw((value, grad, m, v), opt, t, grad_scale)?;
            }
        }
        // Done when this returns: the step's optimizer time is the device's.
        self.ops.synchronize()
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
                self.staged.insert((i as u32, fo), self.ops.upload_data(d)?);
            }
        }
        Ok(())
    }

    fn import(&mut self, h: O::Hidden) -> Result<(O::Hidden, CopyStamps)> {
        self.ops.import(h)
    }

    fn take_losses(&mut self) -> Result<Vec<(u32, bool, LossSums)>> {
        let pending = std::mem::take(&mut self.pending);
        pending
            .into_iter()
            .map(|(mb, fo, tokens, loss)| Ok((mb, fo, self.ops.read_loss(&loss, tokens)?)))
            .collect()
    }

    fn device_clock(&mut self) -> Option<&mut dyn DeviceClock> {
        self.ops.clock()
    }
}
