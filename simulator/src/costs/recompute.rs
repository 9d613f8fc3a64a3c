//! Activation recomputation: what a stage's forward keeps, what its backward recomputes, and
//! what that costs one layer of one microbatch in time and bytes.

use flatpipe_profiles::Profile;
use serde::{Deserialize, Serialize};

/// Activation recomputation of a stage: what its forward keeps for the backward, and what the
/// backward recomputes (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
/// Transformer Models").
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default, Serialize, Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum Recompute {
    /// Keep everything: the profile's activation bytes, no extra time.
    #[default]
    None,
    /// Megatron-LM's selective recomputation on decoder layers: F keeps the tensors only dgrad
    /// needs (`act_bytes_per_token_i`: the GEMM outputs q, k, v, gate, up and the norms'
    /// statistics) and drops the wgrad inputs (`act_bytes_per_token_w`: the normed inputs, the
    /// attention core's output, the activation), which I recomputes (the attention forward,
    /// `c_attn * attn_pairs`, and elementwise work) and which then live until W. Other layers
    /// keep everything. This is what the executor's selective mode keeps
    /// (`flatpipe_executor::model`).
    Selective,
    /// Keep only each layer's input (the previous layer's output) and rerun the whole forward
    /// in dgrad: I gains the layer's forward time, and the wgrad inputs it recomputes live from
    /// I until W (PyTorch issue #136766: under zero-bubble schedules that is most of a step).
    Full,
}

impl Recompute {
    /// Every mode, cheapest in time first.
    pub const ALL: &'static [Recompute] = &[Recompute::None, Recompute::Selective, Recompute::Full];
}

/// What recomputation does to one layer of one microbatch: the time it adds to I and the bytes
/// it keeps, by lifetime.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct RecomputeEffect {
    /// Seconds I gains (the recomputed forward work).
    pub extra_i_s: f64,
    /// Bytes kept from F until I ends.
    pub act_i: f64,
    /// Bytes kept from F until W ends.
    pub act_w: f64,
    /// Bytes I recomputes that live until W ends (the wgrad inputs of a recomputed layer).
    pub act_iw: f64,
}

impl RecomputeEffect {
    /// The most one microbatch holds at once: `act_i + act_w` after F, `act_w + act_iw` after
    /// I.
    pub fn peak(&self) -> f64 {
        self.act_w + self.act_i.max(self.act_iw)
    }
}

/// The effect of `mode` on layer `l` for a microbatch of `tokens` tokens and `pairs` attention
/// pairs; `input_bytes_per_token` is what the layer's input holds per token (the previous
/// layer's `output_bytes_per_token`; token ids for the first layer), which full recomputation
/// keeps.
pub fn recompute_effect(
    l: &flatpipe_profiles::LayerProfile,
    input_bytes_per_token: f64,
    mode: Recompute,
    tokens: f64,
    pairs: f64,
) -> RecomputeEffect {
    use flatpipe_profiles::LayerKind;
    let (act_i, act_w) = (
        l.act_bytes_per_token_i * tokens,
        l.act_bytes_per_token_w * tokens,
    );
    match (mode, l.kind) {
        (Recompute::None, _) | (Recompute::Selective, LayerKind::Embedding | LayerKind::Head) => {
            RecomputeEffect {
                act_i,
                act_w,
                ..Default::default()
            }
        }
        (Recompute::Selective, LayerKind::Decoder) => RecomputeEffect {
            extra_i_s: l.f.c_attn_s * pairs,
            act_i,
            act_w: 0.0,
            act_iw: act_w,
        },
        // The embedding keeps only its token ids, which the step holds anyway.
        (Recompute::Full, LayerKind::Embedding) => RecomputeEffect {
            act_w,
            ..Default::default()
        },
        (Recompute::Full, _) => RecomputeEffect {
            extra_i_s: l.f.time_s(tokens, pairs),
            act_i: input_bytes_per_token * tokens,
            act_w: 0.0,
            act_iw: act_w,
        },
    }
}

/// What layer `j` of `profile` takes in per token: the previous layer's output, or 4-byte token
/// ids for the first.
pub fn input_bytes_per_token(profile: &Profile, j: usize) -> f64 {
    match j.checked_sub(1) {
        Some(prev) => profile.layers[prev].output_bytes_per_token,
        None => 4.0,
    }
}
