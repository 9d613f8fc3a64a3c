//! The layers: a decoder's, the embedding's and the head's parameters, built from a layer range
//! ([`build_layers`]), and each layer's forward and dgrad written once over the op set (the
//! selective recomputation's restore too: the forward's kernels again).

use super::experts::{
    Exchange, ExpertShard, MoeMlp, Swiglu, moe_dgrad, moe_forward, swiglu_dgrad, swiglu_forward,
};
use super::ops::OpSet;
use super::params::{MakeParam, Param, ParamInit};
use super::saved::{DecoderF, DecoderSelective, DecoderW, HeadF, MlpF, MlpW, WCtx};
use crate::kernels::AttnDims;
use crate::{Error, Result};
use flatpipe_profiles::{LayerKind, ModelSpec};
use rand::{SeedableRng, rngs::ChaCha8Rng};
use std::ops::Range;

/// A decoder layer's parameters and sizes.
#[derive(Debug)]
pub(crate) struct Decoder<T> {
    pub(crate) dims: AttnDims,
    pub(crate) hidden: usize,
    pub(crate) attn_norm: Param<T>,
    pub(crate) wq: Param<T>,
    pub(crate) wk: Param<T>,
    pub(crate) wv: Param<T>,
    pub(crate) wo: Param<T>,
    pub(crate) ffn_norm: Param<T>,
    pub(crate) mlp: Mlp<T>,
}

/// A decoder's MLP: dense SwiGLU or mixture of experts.
#[derive(Debug)]
pub(crate) enum Mlp<T> {
    Dense(Swiglu<T>),
    Moe(Box<MoeMlp<T>>),
}

impl<T> Decoder<T> {
    /// The parameters replicated over the data-parallel group (all but the routed experts).
    fn replicated(&self) -> Vec<&Param<T>> {
        let mut v = vec![
            &self.attn_norm,
            &self.wq,
            &self.wk,
            &self.wv,
            &self.wo,
            &self.ffn_norm,
        ];
        match &self.mlp {
            Mlp::Dense(s) => v.extend(s.params()),
            Mlp::Moe(m) => v.extend(m.replicated()),
        }
        v
    }

    fn replicated_mut(&mut self) -> Vec<&mut Param<T>> {
        let mut v = vec![
            &mut self.attn_norm,
            &mut self.wq,
            &mut self.wk,
            &mut self.wv,
            &mut self.wo,
            &mut self.ffn_norm,
        ];
        match &mut self.mlp {
            Mlp::Dense(s) => v.extend(s.params_mut()),
            Mlp::Moe(m) => v.extend(m.replicated_mut()),
        }
        v
    }
}

impl<T> Decoder<T> {
    pub(super) fn kv(&self) -> usize {
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
    /// Every parameter: the replicated ones, then the routed experts this rank holds.
    pub(crate) fn params(&self) -> Vec<&Param<T>> {
        let mut v = self.replicated();
        v.extend(self.routed());
        v
    }

    pub(crate) fn params_mut(&mut self) -> Vec<&mut Param<T>> {
        match self {
            Layer::Decoder(d) => {
                let d = &mut **d;
                let mut v = vec![
                    &mut d.attn_norm,
                    &mut d.wq,
                    &mut d.wk,
                    &mut d.wv,
                    &mut d.wo,
                    &mut d.ffn_norm,
                ];
                match &mut d.mlp {
                    Mlp::Dense(s) => v.extend(s.params_mut()),
                    Mlp::Moe(m) => {
                        let m = &mut **m;
                        v.push(&mut m.router);
                        v.extend(
                            m.shared
                                .iter_mut()
                                .flat_map(Swiglu::params_mut)
                                .chain(m.experts.iter_mut().flat_map(Swiglu::params_mut)),
                        );
                    }
                }
                v
            }
            other => other.replicated_mut(),
        }
    }

    /// The parameters replicated over the data-parallel group (every one but the routed
    /// experts).
    pub(crate) fn replicated(&self) -> Vec<&Param<T>> {
        match self {
            Layer::Embedding { table, .. } => vec![table],
            Layer::Head { norm, out, .. } => vec![norm, out],
            Layer::Decoder(d) => d.replicated(),
        }
    }

    pub(crate) fn replicated_mut(&mut self) -> Vec<&mut Param<T>> {
        match self {
            Layer::Embedding { table, .. } => vec![table],
            Layer::Head { norm, out, .. } => vec![norm, out],
            Layer::Decoder(d) => d.replicated_mut(),
        }
    }

    /// The routed experts' parameters this rank holds (split over the expert-parallel group,
    /// replicated over the expert-data-parallel group).
    pub(crate) fn routed(&self) -> Vec<&Param<T>> {
        match self {
            Layer::Decoder(d) => match &d.mlp {
                Mlp::Moe(m) => m.routed().collect(),
                Mlp::Dense(_) => Vec::new(),
            },
            _ => Vec::new(),
        }
    }

    pub(crate) fn routed_mut(&mut self) -> Vec<&mut Param<T>> {
        match self {
            Layer::Decoder(d) => match &mut d.mlp {
                Mlp::Moe(m) => m.routed_mut().collect(),
                Mlp::Dense(_) => Vec::new(),
            },
            _ => Vec::new(),
        }
    }
}

impl<T> DecoderSelective<T> {
    /// The forward's whole context again: the same kernels on the same inputs as the forward
    /// ran them, so the gradients are bitwise those of no recomputation.
    pub(super) fn restore<O: OpSet<Tensor = T>>(
        self,
        ops: &O,
        p: &Decoder<T>,
        data: &O::Data,
    ) -> Result<DecoderF<T>> {
        let (t, h) = (O::tokens(data), p.hidden);
        if O::cp_share(data).is_some() {
            return Err(Error::Unsupported(
                "selective recomputation with context parallelism (its attention gathers the group's keys again)".into(),
            ));
        }
        let h1 = ops.scale_rows(&self.xhat1, &p.attn_norm.value, t, h)?;
        let (o, lse) = ops.attention(&self.q, &self.k, &self.v, data, p.dims)?;
        let h2 = ops.scale_rows(&self.xhat2, &p.ffn_norm.value, t, h)?;
        let Mlp::Dense(mlp) = &p.mlp else {
            return Err(Error::Unsupported(
                "selective recomputation of a mixture-of-experts layer".into(),
            ));
        };
        let act = ops.swiglu(&self.gate, &self.up, t * mlp.ffn)?;
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
            mlp: MlpF::Dense(super::experts::SwigluF {
                gate: self.gate,
                up: self.up,
                act,
            }),
        })
    }
}

/// A decoder's forward: pre-norm attention then pre-norm SwiGLU MLP, each on the residual
/// stream (Llama 3 as torchtitan implements it). `x [T, H]` -> `y [T, H]` and what I needs.
///
/// `prefix`: for a chunk of a longer sequence, the earlier chunks' rotated keys and values on
/// this layer `[offset, kv]` (the forward keeps only the chunk's own). `ex`: where a
/// mixture-of-experts MLP sends its tokens.
pub(crate) fn decoder_forward<O: OpSet>(
    ops: &O,
    p: &Decoder<O::Tensor>,
    x: &O::Tensor,
    data: &O::Data,
    prefix: Option<(&O::Tensor, &O::Tensor)>,
    ex: &mut Exchange<'_>,
) -> Result<(O::Tensor, DecoderF<O::Tensor>)> {
    let (t, h, kv) = (O::tokens(data), p.hidden, p.kv());
    let d = p.dims;
    let (h1, xhat1, rstd1) = ops.rmsnorm(x, &p.attn_norm.value, t, h)?;
    let mut q = ops.linear(&h1, &p.wq.value, t, h, h)?;
    let mut k = ops.linear(&h1, &p.wk.value, t, h, kv)?;
    let v = ops.linear(&h1, &p.wv.value, t, h, kv)?;
    ops.rope(&mut q, data, d.heads, d.head_dim, false)?;
    ops.rope(&mut k, data, d.kv_heads, d.head_dim, false)?;
    let (o, lse) = match (prefix, O::cp_share(data)) {
        (Some(_), Some(_)) => {
            return Err(Error::Unsupported(
                "a chunk of a sequence under context parallelism (chunks and cp are two answers to long sequences)".into(),
            ));
        }
        (None, Some(share)) => {
            super::context::attention_forward(ops, share, (&q, &k, &v), (h, kv, d), ex)?
        }
        (Some((kp, vp)), None) => {
            let kf = ops.concat_rows(&[kp, &k], kv)?;
            let vf = ops.concat_rows(&[vp, &v], kv)?;
            ops.attention(&q, &kf, &vf, data, d)?
        }
        (None, None) => ops.attention(&q, &k, &v, data, d)?,
    };
    let mut x2 = ops.linear(&o, &p.wo.value, t, h, h)?;
    ops.add_inplace(&mut x2, x, t * h)?;
    let (h2, xhat2, rstd2) = ops.rmsnorm(&x2, &p.ffn_norm.value, t, h)?;
    let (mut y, mlp) = match &p.mlp {
        Mlp::Dense(s) => {
            let (y, f) = swiglu_forward(ops, s, &h2, t, h)?;
            (y, MlpF::Dense(f))
        }
        Mlp::Moe(m) => {
            let (y, f) = moe_forward(ops, m, &h2, (t, h), ex)?;
            (y, MlpF::Moe(Box::new(f)))
        }
    };
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
            mlp,
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
    ex: &mut Exchange<'_>,
) -> Result<(O::Tensor, WCtx<O>, Option<(O::Tensor, O::Tensor)>)> {
    let (t, h, kv) = (O::tokens(data), p.hidden, p.kv());
    let d = p.dims;
    let dy = O::tensor(&dy_hidden);
    // MLP: y = x2 + mlp(h2)
    let (dh2, mlp) = match (&p.mlp, c.mlp) {
        (Mlp::Dense(s), MlpF::Dense(f)) => {
            let (dh2, w) = swiglu_dgrad(ops, s, f, dy, t, h)?;
            (dh2, MlpW::Dense(w))
        }
        (Mlp::Moe(m), MlpF::Moe(f)) => {
            let (dh2, w) = moe_dgrad(ops, m, *f, dy, (t, h), ex)?;
            (dh2, MlpW::Moe(Box::new(w)))
        }
        _ => return Err(crate::worker::Misuse::ActivationsOfAnotherKind.into()),
    };
    let dx2 = ops.rmsnorm_dx(&dh2, &c.xhat2, &c.rstd2, &p.ffn_norm.value, Some(dy), t, h)?;
    // Attention: x2 = x + o Wo
    let dout = ops.linear_dx(&dx2, &p.wo.value, t, h, h)?;
    let (mut dq, mut dk, mut dv, earlier) = match &chunk {
        _ if O::cp_share(data).is_some() => {
            let share = O::cp_share(data).expect("checked");
            let (dq, dk, dv) = super::context::attention_backward(
                ops,
                share,
                &dout,
                (&c.q, &c.k, &c.v, &c.o, &c.lse),
                (h, kv, d),
                ex,
            )?;
            (dq, dk, dv, None)
        }
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
        mlp,
        dq,
        dk,
        dv,
        da: dx2,
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
pub(super) fn head_dgrad<O: OpSet>(
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
    if l.mla.is_some() || l.mtp || l.head_dim * l.heads != l.hidden {
        return Err(Error::Unsupported(format!(
            "decoder layer {}: the executor's kernels run grouped-query decoders with head dimension hidden / heads; this one has {}",
            l.index,
            [
                l.mla.map(|_| "latent attention".to_string()),
                l.mtp.then(|| "a multi-token-prediction module".to_string()),
                (l.head_dim * l.heads != l.hidden)
                    .then(|| format!("head dimension {}", l.head_dim)),
            ]
            .into_iter()
            .flatten()
            .collect::<Vec<_>>()
            .join(", ")
        )));
    }
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

/// Builds layers `range` of `model`: each parameter's value from `make(name, shape, init,
/// rng)`, where `rng` is the layer's generator, seeded from `(seed, layer index)` so that any
/// split of the model draws the same weights; parameters are made in a fixed order per layer.
/// A routed expert draws from its own generator, seeded from `(seed, layer, expert)`, so that
/// any expert-parallel `shard` holds the same experts as a single rank.
///
/// # Errors
/// [`Error::Invalid`] for an empty or out-of-range layer range, or experts that `shard.ep`
/// does not divide; [`Error::Unsupported`] for a mixture-of-experts layer on a backend without
/// them; [`attn_dims`]'s; `make`'s.
pub(crate) fn build_layers<O: OpSet>(
    ops: &O,
    model: &ModelSpec,
    range: Range<usize>,
    seed: u64,
    shard: ExpertShard,
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
                let n = l.decoder_index.unwrap_or(0);
                let name = |s: &str| format!("layers.{n}.{s}.weight");
                // Output projections scaled by 1/sqrt(2 * layers) in GPT-2 style would depend on
                // the depth; a plain std keeps a stage's weights independent of the whole model.
                let normal = ParamInit::Normal(std);
                let attn_norm = param(name("attention_norm"), (1, h), ParamInit::Ones)?;
                let wq = param(name("attention.wq"), (h, h), normal)?;
                let wk = param(name("attention.wk"), (h, kv), normal)?;
                let wv = param(name("attention.wv"), (h, kv), normal)?;
                let wo = param(name("attention.wo"), (h, h), normal)?;
                let ffn_norm = param(name("ffn_norm"), (1, h), ParamInit::Ones)?;
                let mlp = match l.moe {
                    None => Mlp::Dense(swiglu_params(
                        &mut param,
                        &|w| name(&format!("feed_forward.{w}")),
                        h,
                        l.ffn as usize,
                    )?),
                    Some(moe) => {
                        let router = param(name("moe.router"), (h, moe.experts as usize), normal)?;
                        let shared = (moe.shared_experts > 0)
                            .then(|| {
                                swiglu_params(
                                    &mut param,
                                    &|w| name(&format!("moe.shared_experts.{w}")),
                                    h,
                                    (moe.shared_experts * moe.expert_ffn) as usize,
                                )
                            })
                            .transpose()?;
                        let experts = routed_experts(ops, l, moe, shard, seed, &name, &mut *make)?;
                        Mlp::Moe(Box::new(MoeMlp {
                            spec: moe,
                            router,
                            shared,
                            experts,
                        }))
                    }
                };
                Layer::Decoder(Box::new(Decoder {
                    dims,
                    hidden: h,
                    attn_norm,
                    wq,
                    wk,
                    wv,
                    wo,
                    ffn_norm,
                    mlp,
                }))
            }
        };
        layers.push((l.index, layer));
    }
    Ok(layers)
}

/// A SwiGLU's weights `w1`, `w3` `[h, ffn]` and `w2` `[ffn, h]`, named `name("w1")` ...
fn swiglu_params<T>(
    param: &mut dyn FnMut(String, (usize, usize), ParamInit) -> Result<Param<T>>,
    name: &dyn Fn(&str) -> String,
    h: usize,
    ffn: usize,
) -> Result<Swiglu<T>> {
    let normal = ParamInit::Normal(0.02);
    Ok(Swiglu {
        ffn,
        w1: param(name("w1"), (h, ffn), normal)?,
        w3: param(name("w3"), (h, ffn), normal)?,
        w2: param(name("w2"), (ffn, h), normal)?,
    })
}

/// The routed experts of MoE layer `l` that `shard` holds, each from its own generator.
///
/// # Errors
/// [`Error::Unsupported`] on a backend without MoE layers; [`Error::Invalid`] when `shard.ep`
/// does not divide the experts; `make`'s.
fn routed_experts<O: OpSet>(
    ops: &O,
    l: &flatpipe_profiles::Layer,
    moe: flatpipe_profiles::Moe,
    shard: ExpertShard,
    seed: u64,
    name: &dyn Fn(&str) -> String,
    make: &mut MakeParam<'_, O::Tensor>,
) -> Result<Vec<Swiglu<O::Tensor>>> {
    if !ops.supports_moe() {
        return Err(Error::Unsupported(format!(
            "decoder layer {}: mixture-of-experts layers ({} experts) run on the CPU backend; the CUDA kernels for routing and the token exchange are not written",
            l.index, moe.experts
        )));
    }
    let (e, ep) = (moe.experts as usize, shard.ep.max(1));
    if e % ep != 0 || shard.index >= ep {
        return Err(Error::Invalid(format!(
            "decoder layer {}: {e} experts over an expert-parallel group of {ep} (rank {}): ep must divide the experts",
            l.index, shard.index
        )));
    }
    let (h, f) = (l.hidden as usize, moe.expert_ffn as usize);
    let local = e / ep;
    let first = shard.index * local;
    let mut experts = Vec::with_capacity(local);
    for x in first..first + local {
        let mut rng = ChaCha8Rng::seed_from_u64(
            seed ^ (l.index as u64 + 1).wrapping_mul(0xA076_1D64_78BD_642F)
                ^ (x as u64 + 1).wrapping_mul(0xE703_7ED1_A0B4_28DB),
        );
        let mut param = |pname: String, shape: (usize, usize), init| -> Result<Param<O::Tensor>> {
            let value = make(&pname, shape, init, &mut rng)?;
            Ok(Param {
                grad: ops.zeros(shape.0, shape.1)?,
                name: pname,
                shape,
                value,
                moments: None,
            })
        };
        experts.push(swiglu_params(
            &mut param,
            &|w| name(&format!("moe.experts.{x}.{w}")),
            h,
            f,
        )?);
    }
    Ok(experts)
}

#[cfg(test)]
mod tests {
    use flatpipe_profiles::builtins;

    #[test]
    fn decoders_the_kernels_do_not_run_are_refused_by_name() {
        for (model, what) in [
            ("qwen3-30b-a3b", "head dimension 128"),
            ("deepseek-v3", "latent attention"),
        ] {
            let m = builtins::model(model).unwrap();
            let l = m.layers()[m.layers().len() - 2];
            let e = super::attn_dims(&l).unwrap_err().to_string();
            assert!(
                e.contains(what) && e.contains("grouped-query decoders"),
                "{model}: {e}"
            );
        }
        let llama = builtins::model("llama3.1-8b").unwrap();
        assert!(super::attn_dims(&llama.layers()[1]).is_ok());
    }
}
