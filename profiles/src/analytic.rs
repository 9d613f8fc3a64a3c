//! The analytic cost profile: FLOP counts over datasheet peaks.
//!
//! For a decoder layer with hidden size `h`, SwiGLU size `f`, `a` query heads and `k` key/value
//! heads (`kv = h / a * k`), per token (a GEMM `[m, k] x [k, n]` costs `2mnk` FLOPs):
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
//! Time per phase is `FLOPs / (efficiency * peak_flops)` plus memory-bound elementwise work
//! (norms, rotary, SwiGLU, residual adds, softmax of the loss) as bytes over `hbm_bytes_per_s`,
//! plus a fixed launch overhead `c0`. The default efficiency 0.40 is calibrated so that a
//! Llama-3.1-8B step on one device reaches 33-39% MFU, the range torchtitan reports for
//! Llama-3.1-8B on H100 in bf16 without Float8 (the H200 has the H100's 989 TFLOP/s).
//!
//! Activation bytes per token of a decoder layer (`d` = dtype bytes), after Korthikanti et al.
//! 2022 ("Reducing Activation Recomputation in Large Transformer Models") adapted to RMSNorm,
//! GQA, SwiGLU and FlashAttention (no `s²` term):
//! - kept until W (the GEMM inputs wgrad needs): `d * (3h + f)` (attention norm output,
//!   attention output, MLP norm output, SwiGLU output);
//! - kept until I only: `d * (3h + 2kv + 2f) + 4a` (layer input, Q/K/V, mid residual, gate and
//!   up outputs, fp32 log-sum-exp per head).
//!
//! The gradient buffers dgrad produces for wgrad are not modelled.

use crate::{
    CostCoeffs, Error, Hardware, LayerKind, LayerProfile, LayerShape, ModelSpec, Profile,
    ProfileSource, Provenance, Result,
};

/// Assumptions of [`analytic_profile`].
#[derive(Debug, Clone, PartialEq)]
pub struct AnalyticOptions {
    /// Fraction of `peak_flops` that GEMMs and attention reach, in (0, 1]. Default 0.40.
    pub efficiency: f64,
    /// Fixed overhead per layer and phase (kernel launches), seconds. Default 20 µs.
    pub launch_overhead_s: f64,
    /// HBM bytes the optimizer reads and writes per parameter (mixed-precision AdamW: fp32
    /// master, m, v and gradient read, master, m, v and bf16 weight written). Default 30.
    pub optimizer_bytes_per_param: f64,
}

impl Default for AnalyticOptions {
    fn default() -> Self {
        AnalyticOptions {
            efficiency: 0.40,
            launch_overhead_s: 20e-6,
            optimizer_bytes_per_param: 30.0,
        }
    }
}

/// Derives a cost profile of `model` on `hw` from FLOP counts (see the module docs for every
/// formula).
///
/// # Errors
/// [`Error::Invalid`] if `opts.efficiency` is not in (0, 1] or the overhead is negative.
pub fn analytic_profile(
    model: &ModelSpec,
    hw: &Hardware,
    opts: &AnalyticOptions,
) -> Result<Profile> {
    let origin = format!("analytic profile of {} on {}", model.name, hw.name);
    if !(opts.efficiency > 0.0 && opts.efficiency <= 1.0) {
        return Err(Error::invalid(
            &origin,
            "efficiency",
            opts.efficiency,
            "in (0, 1]",
        ));
    }
    if !(opts.launch_overhead_s.is_finite() && opts.launch_overhead_s >= 0.0) {
        return Err(Error::invalid(
            &origin,
            "launch_overhead_s",
            opts.launch_overhead_s,
            ">= 0 seconds",
        ));
    }
    let d = model.dtype.bytes() as f64;
    let flop_s = 1.0 / (opts.efficiency * hw.peak_flops); // seconds per FLOP
    let byte_s = 1.0 / hw.hbm_bytes_per_s; // seconds per HBM byte
    let c0 = opts.launch_overhead_s;
    let coeffs = |c0_s: f64, tok_flops: f64, tok_bytes: f64, pair_flops: f64| CostCoeffs {
        c0_s,
        c_tok_s: tok_flops * flop_s + tok_bytes * byte_s,
        c_attn_s: pair_flops * flop_s,
    };
    let layers = model
        .layers()
        .iter()
        .map(|l| {
            let h = l.hidden as f64;
            let (f, i, w, fo, act_i, act_w, out) = match l.kind {
                LayerKind::Embedding => {
                    // Gather H values per token (read + write); W scatter-adds them back.
                    let bytes = 2.0 * h * d;
                    let zero = CostCoeffs::default();
                    (
                        coeffs(c0, 0.0, bytes, 0.0),
                        zero,
                        coeffs(c0, 0.0, 2.0 * bytes, 0.0),
                        coeffs(c0, 0.0, bytes, 0.0),
                        0.0,
                        4.0,
                        h * d,
                    )
                }
                LayerKind::Decoder => {
                    let ffn = l.ffn as f64;
                    let kv = h / l.heads as f64 * l.kv_heads as f64;
                    let gemm = 2.0 * h * (h + 2.0 * kv) + 2.0 * h * h + 6.0 * h * ffn;
                    // Elementwise traffic per token (read + write, dtype bytes): two RMSNorms
                    // (4h), rotary on Q and K (2(h + kv)), two residual adds (6h), SwiGLU (3f).
                    let elem_f = d * (4.0 * h + 2.0 * (h + kv) + 6.0 * h + 3.0 * ffn);
                    (
                        coeffs(c0, gemm, elem_f, 4.0 * h),
                        coeffs(c0, gemm, 2.0 * elem_f, 10.0 * h),
                        coeffs(c0, gemm, 0.0, 0.0),
                        coeffs(c0, gemm, elem_f, 4.0 * h),
                        d * (3.0 * h + 2.0 * kv + 2.0 * ffn) + 4.0 * l.heads as f64,
                        d * (3.0 * h + ffn),
                        h * d,
                    )
                }
                LayerKind::Head => {
                    let v = l.vocab as f64;
                    let gemm = 2.0 * h * v;
                    // Norm (2h) and the fp32 softmax / cross-entropy over V logits (read + write).
                    let elem = 2.0 * h * d + 2.0 * v * 4.0;
                    (
                        coeffs(c0, gemm, elem, 0.0),
                        coeffs(c0, gemm, elem, 0.0),
                        coeffs(c0, gemm, 0.0, 0.0),
                        coeffs(c0, gemm, elem, 0.0),
                        d * (h + v), // norm input and the logits for the loss backward
                        d * h,       // norm output, the LM head's GEMM input
                        4.0,         // one fp32 loss per token
                    )
                }
            };
            let params = l.param_count();
            let (flops_tok, flops_pair) = match l.kind {
                LayerKind::Embedding => (0.0, 0.0),
                LayerKind::Decoder => {
                    let kv = h / l.heads as f64 * l.kv_heads as f64;
                    let matmul = h * (h + 2.0 * kv) + h * h + 3.0 * h * l.ffn as f64;
                    (6.0 * matmul, 12.0 * h)
                }
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
                },
            }
        })
        .collect();
    Ok(Profile {
        model: model.name.clone(),
        hardware: hw.clone(),
        layers,
        optimizer_s_per_param: opts.optimizer_bytes_per_param * byte_s,
        provenance: Provenance {
            source: ProfileSource::Analytic,
            device: hw.name.clone(),
            date: None,
            flatpipe_version: crate::VERSION.to_string(),
            notes: format!(
                "FLOP counts / ({} x peak {:.3e} FLOP/s) + elementwise bytes / {:.3e} B/s + {} s per layer and phase",
                opts.efficiency, hw.peak_flops, hw.hbm_bytes_per_s, opts.launch_overhead_s
            ),
            grid: None,
            repetitions: None,
            fits: Vec::new(),
            concurrency: None,
        },
        gemm_split: Vec::new(),
        action_overhead: Default::default(),
        first_stage_backward_in_w: false,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::builtins;

    /// Model FLOPs utilisation of a one-device step of one sequence of `s` tokens: model
    /// FLOPs (counted independently below) over the analytic time times the peak.
    fn mfu(s: f64) -> f64 {
        let model = builtins::model("llama3.1-8b").unwrap();
        let hw = builtins::hardware("h200").unwrap();
        let p = analytic_profile(&model, &hw, &AnalyticOptions::default()).unwrap();
        let pairs = s * (s + 1.0) / 2.0;
        let t: f64 = p
            .layers
            .iter()
            .map(|l| l.f.time_s(s, pairs) + l.i.time_s(s, pairs) + l.w.time_s(s, pairs))
            .sum();
        // Independent FLOP count: 6 * matmul parameters * tokens + attention 12 * L * h per pair
        // (4h forward + 8h backward, the convention of Narayanan et al. 2021, eq. 3).
        let (h, l, v, ffn, kv) = (4096.0, 32.0, 128256.0, 14336.0, 1024.0);
        let matmul_params = l * (h * (h + 2.0 * kv) + h * h + 3.0 * h * ffn) + h * v;
        let flops = 6.0 * matmul_params * s + 12.0 * l * h * pairs;
        flops / t / hw.peak_flops
    }

    #[test]
    fn llama8b_mfu_matches_torchtitan_anchor() {
        // torchtitan: 33-39% MFU for Llama-3.1-8B on H100 (bf16, no Float8), seq len 8192.
        let m = mfu(8192.0);
        assert!((0.33..=0.39).contains(&m), "MFU {m}");
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
            efficiency: 0.0,
            ..Default::default()
        };
        let e = analytic_profile(&model, &hw, &opts)
            .unwrap_err()
            .to_string();
        assert!(e.contains("efficiency") && e.contains("(0, 1]"), "{e}");
    }
}
