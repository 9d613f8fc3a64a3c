//! Model architectures: a list of layers by kind.

use crate::{Error, Result, yaml};
use serde::{Deserialize, Serialize};

/// The most layers a model may have, all kinds together: far above published models (Llama
/// 3.1 405B has 128 with its embedding and head), and low enough that every per-layer table
/// stays small; a count past it is a typo, refused before anything is built.
pub const MAX_LAYERS: u32 = 4096;
/// The largest width a model file may give (hidden, FFN, vocabulary, an expert's FFN, a latent
/// rank): 2^24, far above any published model's (Llama 3.1 405B's FFN is 53,248), and small
/// enough that a layer's parameter count stays exact in 64 bits.
pub const MAX_WIDTH: u64 = 1 << 24;
/// The most attention heads, key-value heads or dimensions per head: 2^16.
pub const MAX_HEADS: u64 = 1 << 16;
/// The most routed (or shared) experts per layer, and nodes per token: 4,096 (the published
/// models have at most a few hundred: DeepSeek-V3 256, Kimi K2 384, Qwen3-Next 512).
pub const MAX_EXPERTS: u64 = 4096;
/// Element type of weights and activations.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Dtype {
    /// bfloat16, 2 bytes.
    Bf16,
    /// IEEE half, 2 bytes.
    Fp16,
    /// IEEE single, 4 bytes.
    Fp32,
}

impl Dtype {
    /// Size of one element in bytes.
    pub fn bytes(self) -> u64 {
        match self {
            Dtype::Bf16 | Dtype::Fp16 => 2,
            Dtype::Fp32 => 4,
        }
    }
}

/// The kind of one layer of a decoder-only model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LayerKind {
    /// Token embedding lookup: `[T]` token ids to `[T, H]` hidden states.
    Embedding,
    /// One transformer block: RMSNorm, grouped-query causal attention, RMSNorm, SwiGLU MLP.
    Decoder,
    /// Final RMSNorm, LM head `[H, V]` and the cross-entropy loss.
    Head,
}

/// One entry of a model file's `layers` list: a kind, its sizes, and how many times it repeats.
///
/// Which fields are required depends on the kind: `embedding` and `head` need `vocab` and
/// `hidden`; `decoder` needs `hidden`, `ffn`, `heads` and `kv_heads`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LayerGroup {
    /// The layer kind.
    pub kind: LayerKind,
    /// How many consecutive layers of this kind (default 1; only decoders may repeat).
    #[serde(default = "one", skip_serializing_if = "is_one")]
    pub count: u32,
    /// Hidden size H.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hidden: Option<u64>,
    /// MLP intermediate size (SwiGLU), decoder only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ffn: Option<u64>,
    /// Number of query heads, decoder only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub heads: Option<u64>,
    /// Number of key/value heads (grouped-query attention), decoder only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_heads: Option<u64>,
    /// Vocabulary size V, embedding and head only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vocab: Option<u64>,
    /// Dimension of one attention head, decoder only (default `hidden / heads`; Qwen3 sets it
    /// apart from the hidden size).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub head_dim: Option<u64>,
    /// Multi-head latent attention (DeepSeek-V2/V3) instead of grouped-query attention.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mla: Option<Mla>,
    /// A mixture-of-experts MLP instead of the dense SwiGLU one (then no `ffn`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub moe: Option<Moe>,
    /// A multi-token-prediction module (DeepSeek-V3 §2.2): a decoder block on the main
    /// model's last hidden state and the next token's embedding, joined by a `[2H, H]`
    /// projection after two RMSNorms; it shares the embedding and the output head. MTP groups
    /// come after every other decoder.
    #[serde(default, skip_serializing_if = "is_false")]
    pub mtp: bool,
}

/// Multi-head latent attention's sizes (DeepSeek-V2, arXiv 2405.04434, §2.1; Hugging Face's
/// `DeepseekV3Config` names): queries and keys/values compressed to low-rank latents, each
/// head's query and key split into a part without and a part with rotary embedding.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Mla {
    /// Rank of the query latent (`q_lora_rank`; 0: queries projected from the hidden state).
    #[serde(default)]
    pub q_lora_rank: u64,
    /// Rank of the key-value latent (`kv_lora_rank`).
    pub kv_lora_rank: u64,
    /// Per-head query/key dimension without rotary (`qk_nope_head_dim`).
    pub qk_nope_head_dim: u64,
    /// Per-head query/key dimension with rotary, the key's shared by all heads
    /// (`qk_rope_head_dim`).
    pub qk_rope_head_dim: u64,
    /// Per-head value dimension (`v_head_dim`).
    pub v_head_dim: u64,
}

/// A mixture-of-experts MLP: `experts` routed SwiGLU experts of width `expert_ffn`, each token
/// sent to `top_k` of them by a linear router, plus `shared_experts` of the same width that
/// every token runs (Hugging Face's `num_experts` / `n_routed_experts`, `num_experts_per_tok`,
/// `moe_intermediate_size`, `n_shared_experts`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Moe {
    /// Routed experts.
    pub experts: u64,
    /// Experts each token is routed to.
    pub top_k: u64,
    /// Intermediate size of one expert's SwiGLU.
    pub expert_ffn: u64,
    /// Experts every token runs, each of width `expert_ffn` (default 0).
    #[serde(default)]
    pub shared_experts: u64,
    /// Node-limited routing: each token goes to experts on at most this many nodes (DeepSeek-V3's
    /// `M`, arXiv 2412.19437 §3.2.2; Hugging Face's `topk_group` where its expert groups map to
    /// nodes), and its dispatch crosses the network once per node, then NVLink to each expert's
    /// GPU. 0 (the default): no limit, one plain all-to-all.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub max_nodes: u64,
    /// Dispatch in FP8 with one FP32 scale per 128 elements (DeepSeek-V3 §3.3: `1 + 4/128`
    /// bytes per element); the combine stays in the model's dtype. Default false: both in the
    /// model's dtype.
    #[serde(default, skip_serializing_if = "is_false")]
    pub fp8_dispatch: bool,
    /// How the router turns its logits into scores (default softmax).
    #[serde(default, skip_serializing_if = "Gating::is_softmax")]
    pub gating: Gating,
    /// Whether each token's `top_k` weights are divided by their sum (Hugging Face's
    /// `norm_topk_prob`; default true, as Qwen3-MoE, Mixtral and DeepSeek-V3 route).
    #[serde(default = "yes", skip_serializing_if = "is_true")]
    pub normalise_top_k: bool,
}

/// How a mixture-of-experts router scores the experts from its logits `x Wr`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Gating {
    /// `softmax(logits)` over the experts (Mixtral, Qwen3-MoE).
    #[default]
    Softmax,
    /// `sigmoid(logits)` per expert (DeepSeek-V3, arXiv 2412.19437 §2.1.2).
    Sigmoid,
}

impl Gating {
    fn is_softmax(&self) -> bool {
        *self == Gating::Softmax
    }
}

fn yes() -> bool {
    true
}

fn is_true(b: &bool) -> bool {
    *b
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

fn is_false(b: &bool) -> bool {
    !*b
}

fn one() -> u32 {
    1
}
fn is_one(n: &u32) -> bool {
    *n == 1
}

/// A model architecture file (YAML).
///
/// ```yaml
/// name: llama3.1-8b
/// dtype: bf16
/// layers:
///   - {kind: embedding, vocab: 128256, hidden: 4096}
///   - {kind: decoder, count: 32, hidden: 4096, ffn: 14336, heads: 32, kv_heads: 8}
///   - {kind: head, vocab: 128256, hidden: 4096}
/// ```
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelSpec {
    /// Model name, e.g. `llama3.1-8b`.
    pub name: String,
    /// Element type of weights and activations.
    pub dtype: Dtype,
    /// Layers in order: one embedding first, decoders, one head last.
    pub layers: Vec<LayerGroup>,
    /// How the decoders compute attention (default `fused`).
    #[serde(default, skip_serializing_if = "AttentionImpl::is_fused")]
    pub attention: AttentionImpl,
}

/// How a model's attention runs: which kernels the analytic profile prices.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AttentionImpl {
    /// One fused kernel over the causal half of the scores (FlashAttention, cuDNN; the
    /// hardware file's `attention` rates).
    #[default]
    Fused,
    /// The scores materialised: `QKᵀ` and `PV` as batched GEMMs over the whole `s x s` square,
    /// the causal mask and softmax as a separate memory-bound kernel (Megatron-LM before
    /// FlashAttention, Hugging Face's `eager`).
    Unfused,
}

impl AttentionImpl {
    fn is_fused(&self) -> bool {
        *self == AttentionImpl::Fused
    }
}

/// One layer of the expanded layer list, with all sizes resolved.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layer {
    /// Position in the expanded layer list (0-based; the embedding is 0).
    pub index: usize,
    /// Layer kind.
    pub kind: LayerKind,
    /// Hidden size H.
    pub hidden: u64,
    /// SwiGLU intermediate size (0 for non-decoders).
    pub ffn: u64,
    /// Query heads (0 for non-decoders).
    pub heads: u64,
    /// Key/value heads (0 for non-decoders).
    pub kv_heads: u64,
    /// Vocabulary size (0 for decoders).
    pub vocab: u64,
    /// Index among decoder layers (torchtitan's `layers.N`), for decoders.
    pub decoder_index: Option<usize>,
    /// Dimension of one attention head (0 for non-decoders).
    pub head_dim: u64,
    /// Multi-head latent attention, where the decoder has it.
    pub mla: Option<Mla>,
    /// The mixture-of-experts MLP, where the decoder has one (then `ffn` is 0).
    pub moe: Option<Moe>,
    /// Whether this decoder is a multi-token-prediction module.
    pub mtp: bool,
}

impl Layer {
    /// The module name torchtitan uses for this layer in Llama models
    /// (`tok_embeddings`, `layers.N`, `output`).
    pub fn fqn(&self) -> String {
        match self.kind {
            LayerKind::Embedding => "tok_embeddings".into(),
            LayerKind::Decoder => format!("layers.{}", self.decoder_index.unwrap_or(0)),
            LayerKind::Head => "output".into(),
        }
    }

    /// Parameter count of this layer.
    ///
    /// Decoder: attention + MLP + `2H` (norms), and for an MTP module `2H·H + 2H` more (its
    /// projection and two norms). Grouped-query attention with head dimension `d`: `H·heads·d`
    /// (Q) + `2·H·kv_heads·d` (K, V) + `heads·d·H` (O). Multi-head latent attention (`r_q`,
    /// `r_kv` the latent ranks, `n`, `r`, `v` the per-head dimensions): `H·r_q + r_q +
    /// r_q·heads·(n + r)` (Q; `H·heads·(n + r)` without a query latent) + `H·(r_kv + r) + r_kv
    /// + r_kv·heads·(n + v)` (KV) + `heads·v·H` (O). MLP: dense `3·H·FFN`; mixture of experts
    /// `(experts + shared)·3·H·expert_ffn + experts·H` (the router). Embedding: `V·H`. Head:
    /// `V·H + H` (untied LM head and the final norm).
    pub fn param_count(&self) -> u64 {
        let h = self.hidden;
        match self.kind {
            LayerKind::Embedding => self.vocab * h,
            LayerKind::Head => self.vocab * h + h,
            LayerKind::Decoder => {
                let mlp = match self.moe {
                    Some(m) => {
                        (m.experts + m.shared_experts) * 3 * h * m.expert_ffn + m.experts * h
                    }
                    None => 3 * h * self.ffn,
                };
                let mtp = if self.mtp { 2 * h * h + 2 * h } else { 0 };
                self.attention_params() + mlp + 2 * h + mtp
            }
        }
    }

    /// Parameters one token runs through in this layer: all of them but the routed experts it
    /// is not sent to (`top_k` of `experts` run).
    pub fn active_param_count(&self) -> u64 {
        match (self.kind, self.moe) {
            (LayerKind::Decoder, Some(m)) => {
                self.param_count() - (m.experts - m.top_k) * 3 * self.hidden * m.expert_ffn
            }
            _ => self.param_count(),
        }
    }

    /// The attention's weights (Q, K, V, O and the latents' norms), decoders only.
    fn attention_params(&self) -> u64 {
        let (h, heads) = (self.hidden, self.heads);
        match self.mla {
            Some(m) => {
                let qk = m.qk_nope_head_dim + m.qk_rope_head_dim;
                let q = if m.q_lora_rank > 0 {
                    h * m.q_lora_rank + m.q_lora_rank + m.q_lora_rank * heads * qk
                } else {
                    h * heads * qk
                };
                let kv = h * (m.kv_lora_rank + m.qk_rope_head_dim)
                    + m.kv_lora_rank
                    + m.kv_lora_rank * heads * (m.qk_nope_head_dim + m.v_head_dim);
                q + kv + heads * m.v_head_dim * h
            }
            None => {
                let d = self.head_dim;
                h * heads * d + 2 * h * self.kv_heads * d + heads * d * h
            }
        }
    }
}

/// Field `name` of layer group `i` (of `kind`), which the kind requires: its value, >= 1.
fn need_field(origin: &str, i: usize, kind: LayerKind, name: &str, v: Option<u64>) -> Result<u64> {
    let field = format!("layers[{i}].{name}");
    let most = if matches!(name, "heads" | "kv_heads" | "head_dim") {
        MAX_HEADS
    } else {
        MAX_WIDTH
    };
    match v {
        Some(x) if (1..=most).contains(&x) => Ok(x),
        Some(x) => Err(Error::invalid(origin, field, x, format!("in 1..={most}"))),
        None => Err(Error::invalid(
            origin,
            field,
            "missing",
            format!("required for kind {kind:?}").to_lowercase(),
        )),
    }
}

/// Field `name` of layer group `i` (of `kind`), which the kind does not take: absent.
fn forbid_field(origin: &str, i: usize, kind: LayerKind, name: &str, v: Option<u64>) -> Result<()> {
    match v {
        Some(x) => Err(Error::invalid(
            origin,
            format!("layers[{i}].{name}"),
            x,
            format!("not allowed for kind {kind:?}").to_lowercase(),
        )),
        None => Ok(()),
    }
}

/// Checks a mixture-of-experts MLP: every size >= 1 and at most [`MAX_EXPERTS`] experts (and
/// nodes, shared experts) or [`MAX_WIDTH`] wide, and `top_k <= experts`.
fn check_moe(m: &Moe, origin: &str, i: usize) -> Result<()> {
    for (name, v, least, most) in [
        ("experts", m.experts, 1, MAX_EXPERTS),
        ("top_k", m.top_k, 1, MAX_EXPERTS),
        ("expert_ffn", m.expert_ffn, 1, MAX_WIDTH),
        ("shared_experts", m.shared_experts, 0, MAX_EXPERTS),
        ("max_nodes", m.max_nodes, 0, MAX_EXPERTS),
    ] {
        if !(least..=most).contains(&v) {
            return Err(Error::invalid(
                origin,
                format!("layers[{i}].moe.{name}"),
                v,
                format!("in {least}..={most}"),
            ));
        }
    }
    if m.top_k > m.experts {
        return Err(Error::invalid(
            origin,
            format!("layers[{i}].moe.top_k"),
            m.top_k,
            format!("at most experts = {}", m.experts),
        ));
    }
    Ok(())
}

/// Checks latent attention: the key-value rank and the head dimensions >= 1, no `head_dim`
/// (the MLA dimensions replace it), and `kv_heads == heads` (every head has its own key and
/// value once the latent is projected up).
fn check_mla(m: &Mla, g: &LayerGroup, origin: &str, i: usize) -> Result<()> {
    for (name, v, most) in [
        ("kv_lora_rank", m.kv_lora_rank, MAX_WIDTH),
        ("q_lora_rank", m.q_lora_rank.max(1), MAX_WIDTH),
        ("qk_nope_head_dim", m.qk_nope_head_dim, MAX_HEADS),
        ("qk_rope_head_dim", m.qk_rope_head_dim, MAX_HEADS),
        ("v_head_dim", m.v_head_dim, MAX_HEADS),
    ] {
        if !(1..=most).contains(&v) {
            return Err(Error::invalid(
                origin,
                format!("layers[{i}].mla.{name}"),
                v,
                format!("in 1..={most}"),
            ));
        }
    }
    if let Some(d) = g.head_dim {
        return Err(Error::invalid(
            origin,
            format!("layers[{i}].head_dim"),
            d,
            "absent with mla (its qk_nope_head_dim, qk_rope_head_dim and v_head_dim give the heads' sizes)",
        ));
    }
    if g.kv_heads != g.heads {
        return Err(Error::invalid(
            origin,
            format!("layers[{i}].kv_heads"),
            g.kv_heads.unwrap_or(0),
            format!("equal to heads = {} with mla", g.heads.unwrap_or(0)),
        ));
    }
    Ok(())
}

impl ModelSpec {
    /// Parses and validates a model file's text. `origin` names the file in errors.
    ///
    /// # Errors
    /// [`Error::Yaml`] for malformed YAML, [`Error::Invalid`] for a field out of range.
    pub fn from_yaml(text: &str, origin: &str) -> Result<Self> {
        let spec: ModelSpec = yaml::parse(text, origin)?;
        spec.validate(origin)?;
        Ok(spec)
    }

    /// Checks every field; `origin` names the file in errors.
    ///
    /// # Errors
    /// [`Error::Invalid`] naming the field, its value and the allowed range.
    pub fn validate(&self, origin: &str) -> Result<()> {
        let bad = |field: String, value: String, allowed: &str| {
            Err(Error::invalid(origin, field, value, allowed))
        };
        if self.layers.is_empty() {
            return bad(
                "layers".into(),
                "[]".into(),
                "needs an embedding, decoders and a head",
            );
        }
        for (i, g) in self.layers.iter().enumerate() {
            let need = |name: &str, v: Option<u64>| need_field(origin, i, g.kind, name, v);
            let forbid = |name: &str, v: Option<u64>| forbid_field(origin, i, g.kind, name, v);
            if g.count == 0 {
                return bad(format!("layers[{i}].count"), "0".into(), ">= 1");
            }
            let before: u64 = self.layers[..i].iter().map(|x| u64::from(x.count)).sum();
            if before + u64::from(g.count) > u64::from(MAX_LAYERS) {
                return bad(
                    format!("layers[{i}].count"),
                    g.count.to_string(),
                    &format!(
                        "at most {} here: {MAX_LAYERS} layers in all (the deepest published models have a few hundred; every layer is profiled and split over stages)",
                        u64::from(MAX_LAYERS).saturating_sub(before)
                    ),
                );
            }
            match g.kind {
                LayerKind::Embedding | LayerKind::Head => {
                    need("vocab", g.vocab)?;
                    need("hidden", g.hidden)?;
                    forbid("ffn", g.ffn)?;
                    forbid("heads", g.heads)?;
                    forbid("kv_heads", g.kv_heads)?;
                    forbid("head_dim", g.head_dim)?;
                    if g.mla.is_some() || g.moe.is_some() || g.mtp {
                        return bad(
                            format!("layers[{i}]"),
                            "mla, moe or mtp".into(),
                            "decoder layers only",
                        );
                    }
                    if g.count != 1 {
                        return bad(
                            format!("layers[{i}].count"),
                            g.count.to_string(),
                            "1 for embedding and head",
                        );
                    }
                    let want_pos = if g.kind == LayerKind::Embedding {
                        0
                    } else {
                        self.layers.len() - 1
                    };
                    if i != want_pos {
                        return bad(
                            format!("layers[{i}].kind"),
                            format!("{:?}", g.kind).to_lowercase(),
                            "the embedding must be the first layer and the head the last",
                        );
                    }
                }
                LayerKind::Decoder => self.check_decoder(i, origin)?,
            }
        }
        if self.layers.first().map(|g| g.kind) != Some(LayerKind::Embedding) {
            return bad(
                "layers[0].kind".into(),
                format!("{:?}", self.layers[0].kind).to_lowercase(),
                "must be embedding",
            );
        }
        let last = self.layers.len() - 1;
        if self.layers[last].kind != LayerKind::Head {
            return bad(
                format!("layers[{last}].kind"),
                format!("{:?}", self.layers[last].kind).to_lowercase(),
                "must be head",
            );
        }
        Ok(())
    }

    /// Checks decoder group `i`: its sizes, a dense or a mixture-of-experts MLP, its attention,
    /// and an MTP module's place after every other decoder.
    fn check_decoder(&self, i: usize, origin: &str) -> Result<()> {
        let g = &self.layers[i];
        let bad = |field: String, value: String, allowed: &str| {
            Err(Error::invalid(origin, field, value, allowed))
        };
        let need = |name: &str, v: Option<u64>| need_field(origin, i, g.kind, name, v);
        let forbid = |name: &str, v: Option<u64>| forbid_field(origin, i, g.kind, name, v);
        let h = need("hidden", g.hidden)?;
        let heads = need("heads", g.heads)?;
        let kv = need("kv_heads", g.kv_heads)?;
        forbid("vocab", g.vocab)?;
        match g.moe {
            Some(m) => {
                forbid("ffn", g.ffn)?;
                check_moe(&m, origin, i)?;
            }
            None => {
                need("ffn", g.ffn)?;
            }
        }
        if let Some(d) = g.head_dim {
            need("head_dim", Some(d))?;
        } else if g.mla.is_none() && h % heads != 0 {
            return bad(
                format!("layers[{i}].heads"),
                heads.to_string(),
                &format!("must divide hidden = {h} (or give head_dim)"),
            );
        }
        if kv > heads || heads % kv != 0 {
            return bad(
                format!("layers[{i}].kv_heads"),
                kv.to_string(),
                &format!("must divide heads = {heads}"),
            );
        }
        if let Some(m) = g.mla {
            check_mla(&m, g, origin, i)?;
        }
        let later_plain = self.layers[i + 1..]
            .iter()
            .any(|x| x.kind == LayerKind::Decoder && !x.mtp);
        if g.mtp && later_plain {
            return bad(
                format!("layers[{i}].mtp"),
                "true".into(),
                "only after every other decoder (the MTP modules follow the main model)",
            );
        }
        Ok(())
    }

    /// The expanded layer list: embedding, each decoder layer, head. Stages are contiguous
    /// ranges of this list.
    pub fn layers(&self) -> Vec<Layer> {
        let mut out = Vec::new();
        let mut decoder_index = 0;
        for g in &self.layers {
            for _ in 0..g.count {
                let is_dec = g.kind == LayerKind::Decoder;
                out.push(Layer {
                    index: out.len(),
                    kind: g.kind,
                    hidden: g.hidden.unwrap_or(0),
                    ffn: g.ffn.unwrap_or(0),
                    heads: g.heads.unwrap_or(0),
                    kv_heads: g.kv_heads.unwrap_or(0),
                    vocab: g.vocab.unwrap_or(0),
                    decoder_index: is_dec.then_some(decoder_index),
                    head_dim: match (g.head_dim, g.heads) {
                        (Some(d), _) => d,
                        (None, Some(heads)) if heads > 0 => g.hidden.unwrap_or(0) / heads,
                        _ => 0,
                    },
                    mla: g.mla,
                    moe: g.moe,
                    mtp: g.mtp,
                });
                if is_dec {
                    decoder_index += 1;
                }
            }
        }
        out
    }

    /// Number of decoder layers.
    pub fn num_decoder_layers(&self) -> usize {
        self.layers
            .iter()
            .filter(|g| g.kind == LayerKind::Decoder)
            .map(|g| g.count as usize)
            .sum()
    }

    /// Total parameter count, multi-token-prediction modules included.
    pub fn param_count(&self) -> u64 {
        self.layers().iter().map(Layer::param_count).sum()
    }

    /// Parameters of the main model: without its multi-token-prediction modules (the count
    /// DeepSeek-V3 reports as its size).
    pub fn main_param_count(&self) -> u64 {
        self.layers()
            .iter()
            .filter(|l| !l.mtp)
            .map(Layer::param_count)
            .sum()
    }

    /// Parameters of the main model one token runs through (the "activated" count of a
    /// mixture-of-experts model).
    pub fn active_param_count(&self) -> u64 {
        self.layers()
            .iter()
            .filter(|l| !l.mtp)
            .map(Layer::active_param_count)
            .sum()
    }

    /// Whether any decoder is a mixture of experts, has latent attention, a head dimension
    /// other than `hidden / heads`, or is an MTP module: what the executor's kernels do not run.
    pub fn beyond_dense_gqa(&self) -> bool {
        self.layers().iter().any(|l| {
            l.kind == LayerKind::Decoder
                && (l.moe.is_some() || l.mla.is_some() || l.mtp || l.head_dim * l.heads != l.hidden)
        })
    }
}

#[cfg(test)]
mod tests {
    use crate::builtins;

    /// `(total, activated)` against the published figures, each within `tol` (relative).
    fn near(got: u64, published: f64, tol: f64) -> bool {
        (got as f64 / published - 1.0).abs() <= tol
    }

    #[test]
    fn deepseek_v3_counts_match_the_report_with_and_without_mtp() {
        let m = builtins::model("deepseek-v3").unwrap();
        // The report: 671B total, 37B activated per token, both without the MTP module.
        assert!(
            near(m.main_param_count(), 671e9, 0.005),
            "{}",
            m.main_param_count()
        );
        assert!(
            near(m.active_param_count(), 37e9, 0.03),
            "{}",
            m.active_param_count()
        );
        // The released checkpoint (685B) also stores the MTP module's own copies of the
        // embedding and the head (129280 x 7168 each), which training shares.
        let copies = 2 * 129_280 * 7168;
        assert!(
            near(m.param_count() + copies, 685e9, 0.005),
            "{}",
            m.param_count() + copies
        );
        // The MTP module: one MoE decoder, a [2H, H] projection and two norms.
        let mtp = m.param_count() - m.main_param_count();
        let moe_layer = m
            .layers()
            .iter()
            .find(|l| l.moe.is_some() && !l.mtp)
            .unwrap()
            .param_count();
        assert_eq!(mtp, moe_layer + 2 * 7168 * 7168 + 2 * 7168);
    }

    #[test]
    fn moe_counts_match_the_model_cards() {
        // Qwen3-30B-A3B: 30.5B, 3.3B activated; Qwen3-235B-A22B: 235B, 22B; Mixtral-8x7B:
        // 46.7B, 12.9B (Mistral's announcement).
        for (name, total, active) in [
            ("qwen3-30b-a3b", 30.5e9, 3.3e9),
            ("qwen3-235b-a22b", 235e9, 22e9),
            ("mixtral-8x7b", 46.7e9, 12.9e9),
        ] {
            let m = builtins::model(name).unwrap();
            assert!(
                near(m.param_count(), total, 0.01),
                "{name}: {}",
                m.param_count()
            );
            assert!(
                near(m.active_param_count(), active, 0.03),
                "{name}: {}",
                m.active_param_count()
            );
            assert_eq!(m.param_count(), m.main_param_count(), "{name} has no MTP");
        }
    }

    #[test]
    fn a_qwen3_layer_counted_by_hand() {
        // hidden 2048, 32 heads and 4 kv heads of 128, 128 experts of 768: Q 2048 x 4096, K and
        // V 2048 x 512 each, O 4096 x 2048, experts 128 x 3 x 2048 x 768, router 128 x 2048,
        // two norms of 2048.
        let m = builtins::model("qwen3-30b-a3b").unwrap();
        let l = m.layers()[1];
        let want = 2048 * 4096
            + 2 * 2048 * 512
            + 4096 * 2048
            + 128 * 3 * 2048 * 768
            + 128 * 2048
            + 2 * 2048;
        assert_eq!(l.param_count(), want);
        assert_eq!(l.active_param_count(), want - 120 * 3 * 2048 * 768);
    }

    #[test]
    fn bad_moe_and_mla_fields_are_refused() {
        let base = "name: x\ndtype: bf16\nlayers:\n  - {kind: embedding, vocab: 10, hidden: 8}\n";
        let head = "  - {kind: head, vocab: 10, hidden: 8}\n";
        for (decoder, field) in [
            (
                "{kind: decoder, hidden: 8, heads: 2, kv_heads: 1, moe: {experts: 4, top_k: 5, expert_ffn: 8}}",
                "moe.top_k",
            ),
            (
                "{kind: decoder, hidden: 8, ffn: 8, heads: 2, kv_heads: 1, moe: {experts: 4, top_k: 2, expert_ffn: 8}}",
                "ffn",
            ),
            ("{kind: decoder, hidden: 8, heads: 2, kv_heads: 1}", "ffn"),
            (
                "{kind: decoder, hidden: 8, ffn: 8, heads: 2, kv_heads: 1, mla: {kv_lora_rank: 4, qk_nope_head_dim: 4, qk_rope_head_dim: 2, v_head_dim: 4}}",
                "kv_heads",
            ),
            (
                "{kind: decoder, hidden: 8, ffn: 8, heads: 3, kv_heads: 1}",
                "heads",
            ),
            // Sizes past what fits a parameter count in 64 bits, or the memory to route them.
            (
                "{kind: decoder, hidden: 8, heads: 2, kv_heads: 1, moe: {experts: 4294967296, top_k: 2, expert_ffn: 8}}",
                "moe.experts",
            ),
            (
                "{kind: decoder, hidden: 8, heads: 2, kv_heads: 1, moe: {experts: 4, top_k: 2, expert_ffn: 18446744073709551615}}",
                "moe.expert_ffn",
            ),
            (
                "{kind: decoder, hidden: 8, heads: 2, kv_heads: 1, moe: {experts: 4, top_k: 2, expert_ffn: 8, max_nodes: 5000}}",
                "moe.max_nodes",
            ),
            (
                "{kind: decoder, hidden: 33554432, ffn: 8, heads: 2, kv_heads: 1}",
                "hidden",
            ),
            (
                "{kind: decoder, hidden: 8, ffn: 8, heads: 2, kv_heads: 1, head_dim: 100000}",
                "head_dim",
            ),
        ] {
            let text = format!("{base}  - {decoder}\n{head}");
            let e = crate::ModelSpec::from_yaml(&text, "m.yaml")
                .unwrap_err()
                .to_string();
            assert!(e.contains(&format!("layers[1].{field}")), "{field}: {e}");
        }
        // An MTP module before a plain decoder.
        let text = format!(
            "{base}  - {{kind: decoder, hidden: 8, ffn: 8, heads: 2, kv_heads: 1, mtp: true}}\n  - {{kind: decoder, hidden: 8, ffn: 8, heads: 2, kv_heads: 1}}\n{head}"
        );
        let e = crate::ModelSpec::from_yaml(&text, "m.yaml")
            .unwrap_err()
            .to_string();
        assert!(e.contains("layers[1].mtp"), "{e}");
        // head_dim lets heads not divide hidden.
        let text = format!(
            "{base}  - {{kind: decoder, hidden: 8, ffn: 8, heads: 3, kv_heads: 1, head_dim: 4}}\n{head}"
        );
        assert!(crate::ModelSpec::from_yaml(&text, "m.yaml").is_ok());
    }
}
