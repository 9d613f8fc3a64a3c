//! The analytic cost profile: each GEMM priced by shape on the hardware's GEMM curve, attention
//! by kernel, elementwise work over HBM bandwidth.
//!
//! For a dense decoder layer with hidden size `h`, SwiGLU size `f`, `a` query heads and `k`
//! key/value heads (`kv = h / a * k`), per token (a GEMM `[m, k] x [k, n]` costs `2mnk` FLOPs;
//! latent attention, a head dimension of its own, mixtures of experts and MTP modules change
//! the GEMMs and widths as [`crate::decoder`] lists them):
//!
//! | phase | GEMM FLOPs per token | attention FLOPs per query-key pair |
//! |---|---|---|
//! | F  | `2h(h + 2kv) + 2h² + 6hf` (Q/K/V, O, gate/up/down) | `4h` (`QKᵀ` and `PV`) |
//! | I  | same as F (one dgrad GEMM per forward GEMM)         | `10h` (FlashAttention-2 backward: 5 GEMMs of the 2 in F, Dao 2023) |
//! | W  | same as F (one wgrad GEMM per forward GEMM)         | 0 (attention has no weights) |
//! | Fo | same as F                                          | `4h` |
//!
//! The head (final norm, LM head `[h, V]`, cross-entropy) costs `2hV` GEMM FLOPs per token in each
//! of F, I and W; the embedding is a gather (F) and a scatter-add (W), memory-bound, with no I.
//!
//! Time per phase is the layer's GEMMs priced one by one, plus attention per query-key pair,
//! plus memory-bound elementwise work (norms, rotary, SwiGLU, residual adds, softmax of the
//! loss) as bytes over `hbm_bytes_per_s`, plus a fixed launch overhead `c0`:
//! - GEMMs: each of a decoder's `[T, h] x [h, h + 2kv]` (Q/K/V), `[T, h] x [h, h]` (O),
//!   `[T, h] x [h, 2f]` (gate/up) and `[T, f] x [f, h]` (down), and the head's `[T, h] x [h, V]`,
//!   at the hardware's GEMM curve ([`crate::gemm`]): F and Fo as written, I (dgrad) as `[T, n] x
//!   [n, k]`, W (wgrad) as `[k, T] x [T, n]`. The sum over a grid of `T` from 512 to 16,384 tokens
//!   is fitted by `c0 + c_tok·T` in least relative squares (`c0 >= 0`), as a measured profile's
//!   timings are. The profile's `gemm_split` holds, for each tensor-parallel size that divides a
//!   node, the split GEMMs' throughput relative to the unsplit ones at 4,096 tokens (Q/K/V and
//!   gate/up split by columns, O and down by rows).
//! - Fused attention (the model's `attention: fused`): the hardware file's forward and backward
//!   rates, or the GEMM curve's at `(4096, 4096, 128)`.
//! - Unfused attention (`attention: unfused`): the whole `s x s` square, twice the causal pairs,
//!   as batched GEMMs over the heads at a 2,048-token sequence (`QKᵀ` and `PV` in F; four in I),
//!   and the softmax reading and writing the scores (`2d` bytes per score in F, `3d` in I; no
//!   attention dropout).
//! - A hardware file without a GEMM curve, or `AnalyticOptions::efficiency` given, runs every
//!   GEMM and attention kernel at that flat fraction of `peak_flops` ([`FLAT_EFFICIENCY`] by
//!   default), a linear time with no fixed part.
//!
//! Activation bytes per token of a decoder layer (`d` = dtype bytes), after Korthikanti et al.
//! 2022 ("Reducing Activation Recomputation in Large Transformer Models") adapted to RMSNorm,
//! GQA, SwiGLU and FlashAttention (no `s²` term):
//! - kept until W (the GEMM inputs wgrad needs): `d * (3h + f)` (attention norm output,
//!   attention output, MLP norm output, SwiGLU output);
//! - kept until I only: `d * (3h + 2kv + 2f) + 4a` (layer input, Q/K/V, mid residual, gate and
//!   up outputs, fp32 log-sum-exp per head).
//!
//! With [`crate::decoder::Widths`] in general: `d (2h + q + kv + 2 mlp) + 4a` until I and
//! `d (2h + o_in + top_k h + mlp)` until W (a mixture of experts keeps each routed copy of the MLP
//! norm's output for its expert's wgrad). A mixture-of-experts layer's routed experts' GEMMs
//! are also kept apart as its `routed` costs, which the cost model scales by the router's
//! imbalance.
//!
//! The gradient buffers dgrad produces for wgrad are not modelled.

use crate::decoder::{self, Gemm};
use crate::gemm::GemmCurve;
use crate::{
    AttentionImpl, CostCoeffs, Error, ExpertBatching, GemmSplit, Hardware, Layer, LayerKind,
    LayerProfile, LayerShape, ModelSpec, Profile, ProfileSource, Provenance, Result, RoutedCosts,
};

/// The flat fraction of `peak_flops` for GEMMs and attention on hardware without a GEMM curve.
pub const FLAT_EFFICIENCY: f64 = 0.40;
/// Tokens per microbatch over which the GEMM curve's times are fitted (see the module docs).
const TOKEN_GRID: [f64; 6] = [512.0, 1024.0, 2048.0, 4096.0, 8192.0, 16384.0];
/// Tokens at which the tensor-parallel GEMM split is priced.
const SPLIT_TOKENS: u64 = 4096;
/// Sequence length at which unfused attention's batched GEMMs are priced.
const UNFUSED_SEQ: f64 = 2048.0;
/// Head dimension at which fused attention runs at the GEMM curve's rate.
const ATTENTION_SHAPE: (f64, f64, f64) = (4096.0, 4096.0, 128.0);

/// Assumptions of [`analytic_profile`].
#[derive(Debug, Clone, PartialEq)]
pub struct AnalyticOptions {
    /// A flat fraction of `peak_flops` for every GEMM and attention kernel, in (0, 1], instead of
    /// the hardware's GEMM curve. Default `None`: the curve, or [`FLAT_EFFICIENCY`] on hardware
    /// without one.
    pub efficiency: Option<f64>,
    /// Fixed overhead per layer and phase (kernel launches), seconds. Default 20 µs.
    pub launch_overhead_s: f64,
    /// HBM bytes the optimizer reads and writes per parameter (mixed-precision AdamW: fp32
    /// master, m, v and gradient read, master, m, v and bf16 weight written). Default 30.
    pub optimizer_bytes_per_param: f64,
}

impl Default for AnalyticOptions {
    fn default() -> Self {
        AnalyticOptions {
            efficiency: None,
            launch_overhead_s: 20e-6,
            optimizer_bytes_per_param: 30.0,
        }
    }
}

/// How the profile prices kernels: the GEMM curve or a flat rate, and attention.
struct Kernels {
    /// `None`: the flat rate.
    curve: Option<GemmCurve>,
    /// Seconds per FLOP at the flat rate.
    flat_s: f64,
    /// Fused attention's forward and backward seconds per FLOP.
    attention_s: (f64, f64),
    unfused: bool,
    /// Seconds per HBM byte.
    byte_s: f64,
    /// Bytes per element.
    d: f64,
}

impl Kernels {
    fn new(model: &ModelSpec, hw: &Hardware, opts: &AnalyticOptions) -> Result<Kernels> {
        let eff = opts.efficiency.unwrap_or(FLAT_EFFICIENCY);
        let curve = match opts.efficiency {
            Some(_) => None,
            None => hw.gemm_curve()?,
        };
        let flat_s = 1.0 / (eff * hw.peak_flops);
        let attention_s = match (&curve, &hw.attention) {
            (None, _) => (flat_s, flat_s),
            (Some(_), Some(a)) => (1.0 / a.forward_flops, 1.0 / a.backward_flops),
            (Some(c), None) => {
                let (m, n, k) = ATTENTION_SHAPE;
                let s = 1.0 / c.flops_per_s(m, n, k);
                (s, s)
            }
        };
        Ok(Kernels {
            curve,
            flat_s,
            attention_s,
            unfused: model.attention == AttentionImpl::Unfused,
            byte_s: 1.0 / hw.hbm_bytes_per_s,
            d: model.dtype.bytes() as f64,
        })
    }

    /// Seconds of `gemms` in `phase` at `t` tokens.
    fn gemm_s(&self, gemms: &[Gemm], phase: Phase, t: f64) -> f64 {
        gemms
            .iter()
            .map(|g| {
                let m = g.rows * t;
                match &self.curve {
                    None => 2.0 * g.count * m * g.n * g.k * self.flat_s,
                    Some(c) => match phase {
                        Phase::Forward => c.grouped_time_s(g.count, m, g.n, g.k),
                        Phase::Dgrad => c.grouped_time_s(g.count, m, g.k, g.n),
                        Phase::Wgrad => c.grouped_time_s(g.count, g.k, g.n, m),
                    },
                }
            })
            .sum()
    }

    /// `(c0, c_tok)` of the GEMMs in `phase`: fitted over [`TOKEN_GRID`] in least relative
    /// squares with `c0 >= 0` (exact for the flat rate, which has no fixed part).
    fn gemm_fit(&self, gemms: &[Gemm], phase: Phase) -> (f64, f64) {
        let ys: Vec<(f64, f64)> = TOKEN_GRID
            .iter()
            .map(|&t| (t, self.gemm_s(gemms, phase, t)))
            .filter(|&(_, y)| y > 0.0)
            .collect();
        if ys.is_empty() {
            return (0.0, 0.0);
        }
        // Minimise sum(((a + b t) / y - 1)^2): the normal equations with weights u = 1 / y.
        let (mut s00, mut s01, mut s11, mut r0, mut r1) = (0.0, 0.0, 0.0, 0.0, 0.0);
        for &(t, y) in &ys {
            let u = 1.0 / y;
            s00 += u * u;
            s01 += t * u * u;
            s11 += t * t * u * u;
            r0 += u;
            r1 += t * u;
        }
        let det = s00 * s11 - s01 * s01;
        let (a, b) = ((r0 * s11 - r1 * s01) / det, (s00 * r1 - s01 * r0) / det);
        if a >= 0.0 && det.abs() > 0.0 {
            (a, b)
        } else {
            (0.0, r1 / s11)
        }
    }

    /// Seconds per causal query-key pair of a decoder with attention width `h` (its forward's
    /// FLOPs per pair over 4: [`decoder::Widths::attention`]) and `heads` heads, in the forward
    /// (`backward = false`) or the input-gradient pass.
    fn attention_pair_s(&self, h: f64, heads: f64, backward: bool) -> f64 {
        let (flops, rate) = if backward {
            (10.0 * h, self.attention_s.1)
        } else {
            (4.0 * h, self.attention_s.0)
        };
        match (&self.curve, self.unfused) {
            (Some(c), true) => {
                // The whole square (2 per causal pair), heads stacked along the batched GEMMs.
                let (s, dh) = (UNFUSED_SEQ, h / heads);
                let scores = c.time_s(heads * s, s, dh);
                let values = c.time_s(heads * s, dh, s);
                let (gemms, bytes) = if backward {
                    (scores + 3.0 * values, 3.0 * self.d)
                } else {
                    (scores + values, 2.0 * self.d)
                };
                2.0 * (gemms / (s * s) + heads * bytes * self.byte_s)
            }
            (None, true) => 2.0 * flops * self.flat_s,
            (_, false) => flops * rate,
        }
    }

    /// The relative throughput of a decoder's GEMMs split `tp` ways (see the module docs).
    /// The routed experts' GEMM throughput of `l` (a mixture-of-experts decoder) on one GPU of
    /// an expert-parallel group of each power of two `ep` dividing its experts, relative to
    /// `ep = 1`, at [`SPLIT_TOKENS`] tokens per GPU: `E / ep` experts of `ep T k / E` rows
    /// each against `E` of `T k / E`, forward, dgrad and wgrad together.
    fn expert_batching(&self, l: &Layer) -> Vec<ExpertBatching> {
        let experts = decoder::routed_gemms(l);
        let t = SPLIT_TOKENS as f64;
        let time = |ep: f64| -> f64 {
            let gs: Vec<Gemm> = experts
                .iter()
                .map(|g| Gemm {
                    rows: g.rows * ep,
                    count: g.count / ep,
                    ..*g
                })
                .collect();
            [Phase::Forward, Phase::Dgrad, Phase::Wgrad]
                .into_iter()
                .map(|p| self.gemm_s(&gs, p, t))
                .sum()
        };
        let (e, one) = (l.moe.map_or(1, |m| m.experts), time(1.0));
        (1..)
            .map(|i| 1u64 << i)
            .take_while(|&ep| ep <= e)
            // At most MAX_EXPERTS (4,096): a u32.
            .filter(|&ep| e % ep == 0)
            .map(|ep| ExpertBatching {
                ep: ep as u32,
                relative_throughput: (one / time(ep as f64)).clamp(1e-3, 1e3),
                tokens: SPLIT_TOKENS,
            })
            .collect()
    }

    fn split_throughput(&self, l: &Layer, tp: f64) -> f64 {
        let (whole, parts) = (decoder::gemms(l, 1.0), decoder::gemms(l, tp));
        let t = SPLIT_TOKENS as f64;
        let flops = |g: &[Gemm]| -> f64 { g.iter().map(|x| x.rows * x.count * x.n * x.k).sum() };
        // Throughput (FLOPs / time) split over whole: the split GEMMs do `flops(parts)` each.
        let ratio = (flops(&parts) / self.gemm_s(&parts, Phase::Forward, t))
            / (flops(&whole) / self.gemm_s(&whole, Phase::Forward, t));
        ratio.clamp(1e-3, 2.0)
    }
}

#[derive(Clone, Copy)]
enum Phase {
    Forward,
    Dgrad,
    Wgrad,
}

/// Derives a cost profile of `model` on `hw` from FLOP counts and the hardware's kernel curves
/// (see the module docs for every formula).
///
/// # Errors
/// [`Error::Invalid`] if `opts.efficiency` is not in (0, 1], the overhead is negative, or the
/// hardware's GEMM curve cannot be read.
pub fn analytic_profile(
    model: &ModelSpec,
    hw: &Hardware,
    opts: &AnalyticOptions,
) -> Result<Profile> {
    let origin = format!("analytic profile of {} on {}", model.name, hw.name);
    if let Some(e) = opts.efficiency
        && !(e > 0.0 && e <= 1.0)
    {
        return Err(Error::invalid(&origin, "efficiency", e, "in (0, 1]"));
    }
    if !(opts.launch_overhead_s.is_finite() && opts.launch_overhead_s >= 0.0) {
        return Err(Error::invalid(
            &origin,
            "launch_overhead_s",
            opts.launch_overhead_s,
            ">= 0 seconds",
        ));
    }
    let k = Kernels::new(model, hw, opts)?;
    let layers = model
        .layers()
        .iter()
        .map(|l| layer_profile(l, model, &k, opts.launch_overhead_s))
        .collect();
    let gemm_split = match (
        &k.curve,
        model.layers().iter().find(|l| l.kind == LayerKind::Decoder),
    ) {
        (Some(_), Some(l)) => (2..=hw.gpus_per_node)
            .filter(|tp| hw.gpus_per_node % tp == 0)
            .map(|tp| GemmSplit {
                tp,
                relative_throughput: k.split_throughput(l, f64::from(tp)),
                tokens: SPLIT_TOKENS,
            })
            .collect(),
        _ => Vec::new(),
    };
    let expert_batching = match (
        &k.curve,
        model
            .layers()
            .iter()
            .find(|l| l.kind == LayerKind::Decoder && l.moe.is_some()),
    ) {
        (Some(_), Some(l)) => k.expert_batching(l),
        _ => Vec::new(),
    };
    let kernels = match (&k.curve, &hw.gemm) {
        (Some(_), Some(g)) => format!(
            "GEMMs by shape ({}), attention {}",
            g.table.as_deref().map_or_else(
                || format!("roofline of {:.4e} FLOP/s", g.max_flops.unwrap_or(0.0)),
                |t| format!("table {t}")
            ),
            match (model.attention, &hw.attention) {
                (AttentionImpl::Unfused, _) => "unfused (batched GEMMs and softmax)".to_string(),
                (_, Some(a)) => format!(
                    "{} at {:.3e} / {:.3e} FLOP/s",
                    a.kernel, a.forward_flops, a.backward_flops
                ),
                (_, None) => "at the GEMM curve's rate".to_string(),
            }
        ),
        _ => format!(
            "FLOP counts / ({} x peak {:.3e} FLOP/s)",
            opts.efficiency.unwrap_or(FLAT_EFFICIENCY),
            hw.peak_flops
        ),
    };
    Ok(Profile {
        model: model.name.clone(),
        hardware: hw.clone(),
        layers,
        optimizer_s_per_param: opts.optimizer_bytes_per_param * k.byte_s,
        provenance: Provenance {
            source: ProfileSource::Analytic,
            device: hw.name.clone(),
            date: None,
            flatpipe_version: crate::VERSION.to_string(),
            notes: format!(
                "{kernels} + elementwise bytes / {:.3e} B/s + {} s per layer and phase",
                hw.hbm_bytes_per_s, opts.launch_overhead_s
            ),
            grid: None,
            repetitions: None,
            fits: Vec::new(),
            concurrency: None,
        },
        gemm_split,
        action_overhead: Default::default(),
        first_stage_backward_in_w: false,
        expert_parallel: 1,
        tensor_parallel: 1,
        expert_batching,
    })
}

/// One layer's profile: its phases' costs, activations, parameters and model FLOPs.
fn layer_profile(l: &Layer, model: &ModelSpec, k: &Kernels, c0: f64) -> LayerProfile {
    let (h, d) = (l.hidden as f64, k.d);
    let coeffs = |gemms: &[Gemm], phase: Phase, tok_bytes: f64, pair_s: f64| {
        let (a, b) = k.gemm_fit(gemms, phase);
        CostCoeffs {
            c0_s: c0 + a,
            c_tok_s: b + tok_bytes * k.byte_s,
            c_attn_s: pair_s,
        }
    };
    let (f, i, w, fo, act_i, act_w, out) = match l.kind {
        LayerKind::Embedding => {
            // Gather H values per token (read + write); W scatter-adds them back.
            let bytes = 2.0 * h * d;
            let f = coeffs(&[], Phase::Forward, bytes, 0.0);
            let w = coeffs(&[], Phase::Wgrad, 2.0 * bytes, 0.0);
            (f, CostCoeffs::default(), w, f, 0.0, 4.0, h * d)
        }
        LayerKind::Decoder => {
            let gemms = decoder::gemms(l, 1.0);
            let wd = decoder::widths(l);
            // Elementwise traffic per token (read + write, dtype bytes): two RMSNorms (4h),
            // rotary on Q and K (2 rotary), two residual adds (6h), SwiGLU (3 mlp), and a
            // mixture of experts' dispatch and combine copies (4 top_k h).
            let elem_f = d * (10.0 * h + 2.0 * wd.rotary + 3.0 * wd.mlp + 4.0 * wd.routed * h);
            let heads = l.heads as f64;
            let f = coeffs(
                &gemms,
                Phase::Forward,
                elem_f,
                k.attention_pair_s(wd.attention, heads, false),
            );
            // Kept for dgrad: the layer input, Q, K/V, the mid residual, gate/up outputs and
            // the fp32 log-sum-exp per head; for wgrad: both norms' outputs (a routed copy per
            // expert a token goes to), the attention output and the SwiGLU output.
            (
                f,
                coeffs(
                    &gemms,
                    Phase::Dgrad,
                    2.0 * elem_f,
                    k.attention_pair_s(wd.attention, heads, true),
                ),
                coeffs(&gemms, Phase::Wgrad, 0.0, 0.0),
                f,
                d * (2.0 * h + wd.q + wd.kv + 2.0 * wd.mlp) + 4.0 * heads,
                d * (2.0 * h + wd.o_in + wd.routed * h + wd.mlp),
                h * d,
            )
        }
        LayerKind::Head => {
            let gemms = [Gemm {
                rows: 1.0,
                n: l.vocab as f64,
                k: h,
                count: 1.0,
            }];
            // Norm (2h) and the fp32 softmax / cross-entropy over V logits (read + write).
            let elem = 2.0 * h * d + 2.0 * l.vocab as f64 * 4.0;
            let f = coeffs(&gemms, Phase::Forward, elem, 0.0);
            (
                f,
                coeffs(&gemms, Phase::Dgrad, elem, 0.0),
                coeffs(&gemms, Phase::Wgrad, 0.0, 0.0),
                f,
                d * (h + l.vocab as f64), // norm input and the logits for the loss backward
                d * h,                    // norm output, the LM head's GEMM input
                4.0,                      // one fp32 loss per token
            )
        }
    };
    let routed = (l.kind == LayerKind::Decoder && l.moe.is_some()).then(|| {
        // The routed experts' GEMMs alone, fitted as the layer's are (no fixed launch cost).
        let experts = decoder::routed_gemms(l);
        let part = |phase: Phase| {
            let (a, b) = k.gemm_fit(&experts, phase);
            CostCoeffs {
                c0_s: a,
                c_tok_s: b,
                c_attn_s: 0.0,
            }
        };
        RoutedCosts {
            f: part(Phase::Forward),
            i: part(Phase::Dgrad),
            w: part(Phase::Wgrad),
            all_to_all: CostCoeffs::default(),
        }
    });
    let params = l.param_count();
    let (flops_tok, flops_pair) = match l.kind {
        LayerKind::Embedding => (0.0, 0.0),
        LayerKind::Decoder => (
            6.0 * decoder::macs_per_token(l),
            12.0 * decoder::widths(l).attention,
        ),
        LayerKind::Head => (6.0 * h * l.vocab as f64, 0.0),
    };
    LayerProfile {
        model_flops_per_token: flops_tok,
        model_flops_per_attn_pair: flops_pair,
        name: l.fqn(),
        kind: l.kind,
        f,
        i,
        w,
        fo,
        b: None,
        act_bytes_per_token_i: act_i,
        act_bytes_per_token_w: act_w,
        output_bytes_per_token: out,
        param_count: params,
        param_bytes: params * model.dtype.bytes(),
        shape: LayerShape {
            hidden: l.hidden,
            heads: l.heads,
            kv_heads: l.kv_heads,
            vocab: l.vocab,
            experts: l.moe.map_or(0, |m| m.experts),
            top_k: l.moe.map_or(0, |m| m.top_k),
            expert_params: l.moe.map_or(0, |m| m.experts * 3 * l.hidden * m.expert_ffn),
            max_nodes: l.moe.map_or(0, |m| m.max_nodes),
            fp8_dispatch: l.moe.is_some_and(|m| m.fp8_dispatch),
            mtp: l.mtp,
        },
        routed,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::builtins;

    /// The A100's roofline GEMM (271.2e12 FLOP/s MAMF, 2.039e12 B/s, 6 µs), written out.
    fn a100_gemm_s(m: f64, n: f64, k: f64) -> f64 {
        (2.0 * m * n * k / 271.2e12).max(2.0 * (m * k + k * n + m * n) / 2.039e12) + 6e-6
    }

    fn llama8b_on(hw: &str, attention: AttentionImpl) -> Profile {
        let mut model = builtins::model("llama3.1-8b").unwrap();
        model.attention = attention;
        let hw = builtins::hardware(hw).unwrap();
        analytic_profile(&model, &hw, &AnalyticOptions::default()).unwrap()
    }

    #[test]
    fn decoder_forward_is_its_gemms_on_the_curve() {
        // Llama-3.1-8B (h 4096, f 14336, kv 1024) on the A100's roofline, one sequence of 4096.
        let p = llama8b_on("a100", AttentionImpl::Fused);
        let (t, h, f, kv) = (4096.0, 4096.0, 14336.0, 1024.0);
        let pairs = t * (t + 1.0) / 2.0;
        let gemms = a100_gemm_s(t, h + 2.0 * kv, h)
            + a100_gemm_s(t, h, h)
            + a100_gemm_s(t, 2.0 * f, h)
            + a100_gemm_s(t, h, f);
        let elementwise = 2.0 * (4.0 * h + 2.0 * (h + kv) + 6.0 * h + 3.0 * f) * t / 2.039e12;
        // Fused attention at the curve's rate for (4096, 4096, 128): no A100 kernel table.
        let rate = 2.0 * 4096.0 * 4096.0 * 128.0 / a100_gemm_s(4096.0, 4096.0, 128.0);
        let expected = gemms + elementwise + pairs * 4.0 * h / rate + 20e-6;
        let got = p.layers[1].f.time_s(t, pairs);
        // The profile is a line fitted over 512..16384 tokens: within 3% at one point.
        assert!((got / expected - 1.0).abs() < 0.03, "{got} vs {expected}");
    }

    #[test]
    fn unfused_attention_prices_the_whole_square() {
        // 32 heads of 128 at a 2,048-token sequence: QKᵀ and PV as GEMMs over the stacked
        // heads, the softmax reading and writing 2 bytes per score; twice per causal pair.
        let p = llama8b_on("a100", AttentionImpl::Unfused);
        let (s, heads, dh) = (2048.0, 32.0, 128.0);
        let gemms = a100_gemm_s(heads * s, s, dh) + a100_gemm_s(heads * s, dh, s);
        let expected = 2.0 * (gemms / (s * s) + heads * 4.0 / 2.039e12);
        let got = p.layers[1].f.c_attn_s;
        assert!((got / expected - 1.0).abs() < 1e-9, "{got} vs {expected}");
        assert!(
            got > llama8b_on("a100", AttentionImpl::Fused).layers[1]
                .f
                .c_attn_s
        );
    }

    #[test]
    fn tensor_parallel_split_is_priced_on_the_curve() {
        // tp 8 at 4,096 tokens: Q/K/V and gate/up split by columns, O and down by rows.
        let p = llama8b_on("a100", AttentionImpl::Fused);
        let (t, h, f, kv) = (4096.0, 4096.0, 14336.0, 1024.0);
        let whole = a100_gemm_s(t, h + 2.0 * kv, h)
            + a100_gemm_s(t, h, h)
            + a100_gemm_s(t, 2.0 * f, h)
            + a100_gemm_s(t, h, f);
        let split = a100_gemm_s(t, (h + 2.0 * kv) / 8.0, h)
            + a100_gemm_s(t, h, h / 8.0)
            + a100_gemm_s(t, 2.0 * f / 8.0, h)
            + a100_gemm_s(t, h, f / 8.0);
        let g = p.gemm_split.iter().find(|g| g.tp == 8).unwrap();
        assert!((g.relative_throughput / (whole / (8.0 * split)) - 1.0).abs() < 1e-9);
        assert!(g.relative_throughput < 1.0, "{g:?}");
        assert_eq!(
            p.gemm_split.iter().map(|g| g.tp).collect::<Vec<_>>(),
            [2, 4, 8]
        );
    }

    /// Qwen3-30B-A3B's routed experts (128 of width 768, top 8, hidden 2048) at 4,096 tokens
    /// per A100: `E / ep` grouped GEMMs of `ep T k / E` rows (forward `[m, 2048] x [2048,
    /// 1536]` and `[m, 768] x [768, 2048]`, dgrad and wgrad their transposes) on the
    /// roofline, which pays the fixed cost once per grouped kernel.
    #[test]
    fn expert_batching_is_the_grouped_gemms_at_taller_batches() {
        let model = builtins::model("qwen3-30b-a3b").unwrap();
        let hw = builtins::hardware("a100").unwrap();
        let p = analytic_profile(&model, &hw, &AnalyticOptions::default()).unwrap();
        let grouped =
            |count: f64, m: f64, n: f64, k: f64| count * (a100_gemm_s(m, n, k) - 6e-6) + 6e-6;
        let time = |ep: f64| {
            let (count, m) = (128.0 / ep, 4096.0 * 8.0 * ep / 128.0);
            [(1536.0, 2048.0), (2048.0, 768.0)]
                .iter()
                .map(|&(n, k)| {
                    grouped(count, m, n, k) + grouped(count, m, k, n) + grouped(count, k, n, m)
                })
                .sum::<f64>()
        };
        let b = p.expert_batching.iter().find(|b| b.ep == 8).unwrap();
        assert!(
            (b.relative_throughput / (time(1.0) / time(8.0)) - 1.0).abs() < 1e-9,
            "{b:?}"
        );
        assert!(b.relative_throughput > 1.0, "{b:?}");
        assert_eq!(
            p.expert_batching.iter().map(|b| b.ep).collect::<Vec<_>>(),
            [2, 4, 8, 16, 32, 64, 128]
        );
        // A dense model has none.
        assert!(
            llama8b_on("a100", AttentionImpl::Fused)
                .expert_batching
                .is_empty()
        );
    }

    #[test]
    fn flat_efficiency_is_exact_and_linear() {
        // With a flat efficiency the GEMMs cost FLOPs / (0.4 x peak), nothing fixed.
        let model = builtins::model("llama3.1-8b").unwrap();
        let hw = builtins::hardware("h200").unwrap();
        let opts = AnalyticOptions {
            efficiency: Some(0.4),
            ..Default::default()
        };
        let p = analytic_profile(&model, &hw, &opts).unwrap();
        let (h, f, kv) = (4096.0, 14336.0, 1024.0);
        let gemm = 2.0 * h * (h + 2.0 * kv) + 2.0 * h * h + 6.0 * h * f;
        let elementwise = 2.0 * (4.0 * h + 2.0 * (h + kv) + 6.0 * h + 3.0 * f) / 4.8e12;
        let l = &p.layers[1];
        assert!((l.f.c_tok_s / (gemm / (0.4 * 989e12) + elementwise) - 1.0).abs() < 1e-12);
        assert_eq!(l.f.c0_s, 20e-6);
        assert!((l.i.c_attn_s / (10.0 * h / (0.4 * 989e12)) - 1.0).abs() < 1e-12);
        assert!(p.gemm_split.is_empty());
    }

    #[test]
    fn decoder_param_count_matches_llama8b() {
        // Llama-3.1-8B has 8.03e9 parameters (Meta's model card).
        let model = builtins::model("llama3.1-8b").unwrap();
        let n = model.param_count() as f64;
        assert!((n / 8.03e9 - 1.0).abs() < 0.005, "{n}");
        let model = builtins::model("llama3.1-70b").unwrap();
        let n = model.param_count() as f64;
        assert!((n / 70.6e9 - 1.0).abs() < 0.005, "{n}");
        // Llama-3.1-405B: 405,853,388,800 in its safetensors index (Hugging Face).
        let model = builtins::model("llama3.1-405b").unwrap();
        assert_eq!(model.param_count(), 405_853_388_800);
    }

    #[test]
    fn every_builtin_hardware_loads_with_its_datasheet_peak() {
        // Dense bf16 (datasheets, without sparsity) and memory as the driver reports it.
        for (name, flops, mib) in [
            ("h200", 989e12, 143_771u64),
            ("h100", 989e12, 81_559),
            ("h800", 989e12, 81_559),
            ("a100", 312e12, 81_920),
            ("b200", 2.25e15, 183_359),
        ] {
            let hw = builtins::hardware(name).unwrap();
            assert_eq!(hw.peak_flops, flops, "{name}");
            assert_eq!(hw.memory_bytes, mib << 20, "{name}");
            assert_eq!(hw.gpus_per_node, 8, "{name}");
        }
    }

    #[test]
    fn rejects_bad_efficiency() {
        let model = builtins::model("llama3.1-8b").unwrap();
        let hw = builtins::hardware("h200").unwrap();
        let opts = AnalyticOptions {
            efficiency: Some(0.0),
            ..Default::default()
        };
        let e = analytic_profile(&model, &hw, &opts)
            .unwrap_err()
            .to_string();
        assert!(e.contains("efficiency") && e.contains("(0, 1]"), "{e}");
    }
}
