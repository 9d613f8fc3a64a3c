//! Model architectures: a list of layers by kind.

use crate::{Error, Result, yaml};
use serde::{Deserialize, Serialize};

/// The most layers a model may have, all kinds together: far above published models (Llama
/// 3.1 405B has 128 with its embedding and head), and low enough that every per-layer table
/// stays small; a count past it is a typo, refused before anything is built.
pub const MAX_LAYERS: u32 = 4096;
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
    /// Decoder: `H*(H + 2*kv_dim)` (Q, K, V) + `H*H` (O) + `3*H*FFN` (SwiGLU) + `2*H` (norms),
    /// with `kv_dim = H / heads * kv_heads`. Embedding: `V*H`. Head: `V*H + H` (untied LM head
    /// and the final norm).
    pub fn param_count(&self) -> u64 {
        let h = self.hidden;
        match self.kind {
            LayerKind::Embedding => self.vocab * h,
            LayerKind::Head => self.vocab * h + h,
            LayerKind::Decoder => {
                let kv_dim = h / self.heads * self.kv_heads;
                h * (h + 2 * kv_dim) + h * h + 3 * h * self.ffn + 2 * h
            }
        }
    }
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
            let need = |name: &str, v: Option<u64>| -> Result<u64> {
                match v {
                    Some(x) if x >= 1 => Ok(x),
                    Some(x) => Err(Error::invalid(
                        origin,
                        format!("layers[{i}].{name}"),
                        x,
                        ">= 1",
                    )),
                    None => Err(Error::invalid(
                        origin,
                        format!("layers[{i}].{name}"),
                        "missing",
                        format!("required for kind {:?}", g.kind).to_lowercase(),
                    )),
                }
            };
            let forbid = |name: &str, v: Option<u64>| -> Result<()> {
                match v {
                    Some(x) => Err(Error::invalid(
                        origin,
                        format!("layers[{i}].{name}"),
                        x,
                        format!("not allowed for kind {:?}", g.kind).to_lowercase(),
                    )),
                    None => Ok(()),
                }
            };
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
                LayerKind::Decoder => {
                    let h = need("hidden", g.hidden)?;
                    need("ffn", g.ffn)?;
                    let heads = need("heads", g.heads)?;
                    let kv = need("kv_heads", g.kv_heads)?;
                    forbid("vocab", g.vocab)?;
                    if h % heads != 0 {
                        return bad(
                            format!("layers[{i}].heads"),
                            heads.to_string(),
                            &format!("must divide hidden = {h}"),
                        );
                    }
                    if kv > heads || heads % kv != 0 {
                        return bad(
                            format!("layers[{i}].kv_heads"),
                            kv.to_string(),
                            &format!("must divide heads = {heads}"),
                        );
                    }
                }
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

    /// Total parameter count.
    pub fn param_count(&self) -> u64 {
        self.layers().iter().map(Layer::param_count).sum()
    }
}
