//! What one decoder layer computes, by shape: its GEMMs and the widths its costs and
//! activations follow, for grouped-query or multi-head latent attention and a dense or
//! mixture-of-experts MLP ([`crate::Layer`]).
//!
//! GEMMs `[m, k] x [k, n]` per token on one of `tp` tensor-parallel GPUs (Megatron-LM's split:
//! Shoeybi et al. 2019, §3; the latent down-projections and the router are replicated):
//! - grouped-query attention, head dimension `d`: Q/K/V `[H, (heads + 2 kv_heads) d / tp]`,
//!   O `[heads d / tp, H]`;
//! - latent attention (DeepSeek-V2, arXiv 2405.04434, §2.1): `[H, r_q]`, `[r_q, heads (n + r)
//!   / tp]` (or `[H, heads (n + r) / tp]` without a query latent), `[H, r_kv + r]`, `[r_kv,
//!   heads (n + v) / tp]`, O `[heads v / tp, H]`;
//! - dense MLP: gate/up `[H, 2 F / tp]`, down `[F / tp, H]`;
//! - mixture of experts: the router `[H, experts]`; each routed expert's gate/up and down on
//!   the `top_k / experts` of the tokens an even router sends it (so `experts` GEMMs of
//!   `m = T top_k / experts` rows: small batches lose efficiency on the GEMM curve); the shared
//!   experts as one dense MLP of width `shared x expert_ffn`;
//! - an MTP module adds its `[2H, H]` projection.

use crate::Layer;

/// `count` GEMMs of `[rows·T, k] x [k, n]` for a microbatch of `T` tokens.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Gemm {
    /// Rows per token (1; `top_k / experts` for one routed expert).
    pub rows: f64,
    /// Output columns.
    pub n: f64,
    /// Reduction dimension.
    pub k: f64,
    /// How many such GEMMs (the routed experts: one grouped kernel).
    pub count: f64,
}

fn gemm(n: f64, k: f64) -> Gemm {
    Gemm {
        rows: 1.0,
        n,
        k,
        count: 1.0,
    }
}

/// The widths per token a decoder's costs and activations follow.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Widths {
    /// Query width (`heads d`, or `heads (n + r)` with latent attention).
    pub q: f64,
    /// Key and value elements kept per token for the attention's backward (`2 kv_heads d`; with
    /// latent attention the up-projected keys and values and both latents).
    pub kv: f64,
    /// The output projection's input width (`heads d`, or `heads v`).
    pub o_in: f64,
    /// Elements rotary embedding rotates per token: the queries and keys (`(heads + kv_heads)
    /// d`; with latent attention only their rotary parts, `(heads + 1) r`).
    pub rotary: f64,
    /// Attention FLOPs per causal query-key pair in the forward, over 4 (`heads d`; with latent
    /// attention `heads (n + r + v) / 2`: `QKᵀ` over `n + r`, `PV` over `v`).
    pub attention: f64,
    /// SwiGLU intermediate elements per token (`F`; `(top_k + shared) expert_ffn`).
    pub mlp: f64,
    /// Copies of the hidden state the MoE dispatch makes per token (`top_k`; 0 for dense).
    pub routed: f64,
}

/// The decoder's GEMMs on one of `tp` GPUs (see the module docs).
pub(crate) fn gemms(l: &Layer, tp: f64) -> Vec<Gemm> {
    let h = l.hidden as f64;
    let heads = l.heads as f64;
    let mut out = match l.mla {
        Some(m) => {
            let (rq, rkv) = (m.q_lora_rank as f64, m.kv_lora_rank as f64);
            let (n, r, v) = (
                m.qk_nope_head_dim as f64,
                m.qk_rope_head_dim as f64,
                m.v_head_dim as f64,
            );
            let mut g = if rq > 0.0 {
                vec![gemm(rq, h), gemm(heads * (n + r) / tp, rq)]
            } else {
                vec![gemm(heads * (n + r) / tp, h)]
            };
            g.extend([
                gemm(rkv + r, h),
                gemm(heads * (n + v) / tp, rkv),
                gemm(h, heads * v / tp),
            ]);
            g
        }
        None => {
            let d = l.head_dim as f64;
            let kv = l.kv_heads as f64;
            vec![
                gemm((heads + 2.0 * kv) * d / tp, h),
                gemm(h, heads * d / tp),
            ]
        }
    };
    match l.moe {
        Some(m) => {
            let (e, k, f) = (m.experts as f64, m.top_k as f64, m.expert_ffn as f64);
            out.push(gemm(e, h));
            for (n, kk) in [(2.0 * f / tp, h), (h, f / tp)] {
                out.push(Gemm {
                    rows: k / e,
                    n,
                    k: kk,
                    count: e,
                });
            }
            let s = m.shared_experts as f64;
            if s > 0.0 {
                out.extend([gemm(2.0 * s * f / tp, h), gemm(h, s * f / tp)]);
            }
        }
        None => {
            let f = l.ffn as f64;
            out.extend([gemm(2.0 * f / tp, h), gemm(h, f / tp)]);
        }
    }
    if l.mtp {
        out.push(gemm(h / tp, 2.0 * h));
    }
    out
}

/// The routed experts' grouped GEMMs of [`gemms`] (`l`'s on one GPU, `tp = 1`): empty for a
/// dense MLP.
pub(crate) fn routed_gemms(l: &Layer) -> Vec<Gemm> {
    gemms(l, 1.0)
        .into_iter()
        .filter(|g| g.count > 1.0 || g.rows < 1.0)
        .collect()
}

/// The decoder's widths (see [`Widths`]).
pub(crate) fn widths(l: &Layer) -> Widths {
    let heads = l.heads as f64;
    let (q, kv, o_in, attention, rotary) = match l.mla {
        Some(m) => {
            let (n, r, v) = (
                m.qk_nope_head_dim as f64,
                m.qk_rope_head_dim as f64,
                m.v_head_dim as f64,
            );
            let latents = (m.q_lora_rank + m.kv_lora_rank + m.qk_rope_head_dim) as f64;
            (
                heads * (n + r),
                heads * (n + r + v) + latents,
                heads * v,
                heads * (n + r + v) / 2.0,
                (heads + 1.0) * r,
            )
        }
        None => {
            let d = l.head_dim as f64;
            let kv = l.kv_heads as f64 * d;
            (heads * d, 2.0 * kv, heads * d, heads * d, heads * d + kv)
        }
    };
    let (mlp, routed) = match l.moe {
        Some(m) => (
            ((m.top_k + m.shared_experts) * m.expert_ffn) as f64,
            m.top_k as f64,
        ),
        None => (l.ffn as f64, 0.0),
    };
    Widths {
        q,
        kv,
        o_in,
        attention,
        rotary,
        mlp,
        routed,
    }
}

/// Multiply-accumulates per token of the GEMMs (one of each, unsplit): the model FLOPs of a
/// token's training are 6 times this.
pub(crate) fn macs_per_token(l: &Layer) -> f64 {
    gemms(l, 1.0)
        .iter()
        .map(|g| g.rows * g.count * g.n * g.k)
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::builtins;

    #[test]
    fn a_token_runs_through_its_active_weights() {
        // A token's multiply-accumulates are its active parameters, each weight met once, but
        // for the norms (the RMSNorms, MLA's latent norms and an MTP module's two), which are
        // no GEMMs.
        for name in [
            "llama3.1-8b",
            "qwen3-30b-a3b",
            "mixtral-8x7b",
            "deepseek-v3",
        ] {
            let m = builtins::model(name).unwrap();
            for l in m
                .layers()
                .iter()
                .filter(|l| l.kind == crate::LayerKind::Decoder)
            {
                let norms = 2 * l.hidden
                    + l.mla.map_or(0, |a| a.q_lora_rank + a.kv_lora_rank)
                    + if l.mtp { 2 * l.hidden } else { 0 };
                let want = (l.active_param_count() - norms) as f64;
                let got = macs_per_token(l);
                assert!(
                    (got / want - 1.0).abs() < 1e-12,
                    "{name} {}: {got} vs {want}",
                    l.index
                );
            }
        }
    }
}
