//! What a layer's F keeps until its I ([`FCtx`]) and what its I keeps until its W ([`WCtx`]),
//! with none or selective recomputation, and their sizes in bytes.

use super::experts::{MoeF, MoeW, SwigluF, SwigluW};
use super::ops::OpSet;

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
    pub(crate) mlp: MlpF<T>,
}

/// What a decoder's MLP forward keeps.
#[derive(Debug)]
pub(crate) enum MlpF<T> {
    Dense(SwigluF<T>),
    Moe(Box<MoeF<T>>),
}

impl<T> MlpF<T> {
    fn tensors(&self) -> Vec<&T> {
        match self {
            MlpF::Dense(f) => vec![&f.gate, &f.up, &f.act],
            MlpF::Moe(m) => m.tensors(),
        }
    }
}

/// What a decoder's MLP dgrad keeps for its wgrad.
#[derive(Debug)]
pub(crate) enum MlpW<T> {
    Dense(SwigluW<T>),
    Moe(Box<MoeW<T>>),
}

impl<T> MlpW<T> {
    fn tensors(&self) -> Vec<&T> {
        match self {
            MlpW::Dense(w) => vec![&w.act, &w.dgate, &w.dup],
            MlpW::Moe(m) => m.tensors(),
        }
    }
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
    pub(super) xhat1: T,
    pub(super) rstd1: T,
    pub(super) q: T,
    pub(super) k: T,
    pub(super) v: T,
    pub(super) xhat2: T,
    pub(super) rstd2: T,
    pub(super) gate: T,
    pub(super) up: T,
}

impl<T> DecoderSelective<T> {
    /// Keeps what selective recomputation keeps of a forward's context.
    ///
    /// # Errors
    /// [`crate::Error::Unsupported`] for a mixture-of-experts layer (its experts' activations
    /// live on other ranks).
    pub(super) fn keep(c: DecoderF<T>) -> crate::Result<Self> {
        let MlpF::Dense(mlp) = c.mlp else {
            return Err(crate::Error::Unsupported(
                "selective recomputation of a mixture-of-experts layer".into(),
            ));
        };
        Ok(DecoderSelective {
            xhat1: c.xhat1,
            rstd1: c.rstd1,
            q: c.q,
            k: c.k,
            v: c.v,
            xhat2: c.xhat2,
            rstd2: c.rstd2,
            gate: mlp.gate,
            up: mlp.up,
        })
    }
}

/// What the head's forward keeps for its backward.
#[derive(Debug)]
pub(crate) struct HeadF<T> {
    pub(super) h: T,
    pub(super) xhat: T,
    pub(super) rstd: T,
    pub(super) logits: T,
    pub(super) lse: T,
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
    pub(super) h1: O::Tensor,
    pub(super) xhat1: O::Tensor,
    pub(super) o: O::Tensor,
    pub(super) h2: O::Tensor,
    pub(super) xhat2: O::Tensor,
    pub(super) mlp: MlpW<O::Tensor>,
    pub(super) dq: O::Tensor,
    pub(super) dk: O::Tensor,
    pub(super) dv: O::Tensor,
    pub(super) da: O::Tensor,
    pub(super) dm: O::Hidden,
    pub(super) dh1: O::Tensor,
    pub(super) dh2: O::Tensor,
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

pub(super) fn sum_bytes<O: OpSet>(ts: &[&O::Tensor]) -> usize {
    ts.iter().map(|t| O::bytes(t)).sum()
}

impl<O: OpSet> FCtx<O> {
    pub(super) fn bytes(&self) -> usize {
        match self {
            FCtx::Embedding => 0,
            FCtx::Input(x) => O::bytes(O::tensor(x)),
            FCtx::Head(c) => sum_bytes::<O>(&[&c.h, &c.xhat, &c.rstd, &c.logits, &c.lse]),
            FCtx::Decoder(c) => {
                let mut ts = vec![
                    &c.h1, &c.xhat1, &c.rstd1, &c.q, &c.k, &c.v, &c.o, &c.lse, &c.h2, &c.xhat2,
                    &c.rstd2,
                ];
                ts.extend(c.mlp.tensors());
                let host = match &c.mlp {
                    MlpF::Moe(m) => m.host_bytes(),
                    MlpF::Dense(_) => 0,
                };
                sum_bytes::<O>(&ts) + host
            }
            FCtx::Selective(c) => sum_bytes::<O>(&[
                &c.xhat1, &c.rstd1, &c.q, &c.k, &c.v, &c.xhat2, &c.rstd2, &c.gate, &c.up,
            ]),
        }
    }
}

impl<O: OpSet> WCtx<O> {
    pub(super) fn bytes(&self) -> usize {
        match self {
            WCtx::Embedding { dy } => O::bytes(O::tensor(dy)),
            WCtx::Head {
                h,
                xhat,
                dlogits,
                dh,
            } => sum_bytes::<O>(&[h, xhat, dlogits, dh]),
            WCtx::Decoder(w) => {
                let mut ts = vec![
                    &w.h1,
                    &w.xhat1,
                    &w.o,
                    &w.h2,
                    &w.xhat2,
                    &w.dq,
                    &w.dk,
                    &w.dv,
                    &w.da,
                    O::tensor(&w.dm),
                    &w.dh1,
                    &w.dh2,
                ];
                ts.extend(w.mlp.tensors());
                sum_bytes::<O>(&ts)
            }
        }
    }
}
