//! Tensor parallelism (Megatron-style, inside a node): the profile of one tensor-parallel rank.
//!
//! A tensor-parallel group of `t` GPUs runs every layer together: the attention heads, the MLP's
//! intermediate columns and the vocabulary are split `t` ways (Shoeybi et al. 2019,
//! "Megatron-LM"), and the group exchanges activations with collectives on the node's link.
//! [`Profile::tensor_parallel`] returns the profile *one GPU of the group* sees, so that the
//! simulator and the planner, which know ranks, stages and data parallelism, plan groups as
//! ranks unchanged: times, parameters, activations, pipeline transfers and model FLOPs are per
//! GPU, and the hardware holds `gpus_per_node / t` groups per node.
//!
//! Per layer, for `t` ranks (`sp` = sequence parallelism, Korthikanti et al. 2022, "Reducing
//! Activation Recomputation in Large Transformer Models"):
//! - Compute: the token and attention-pair terms divide by `t` (the GEMMs and heads split; the
//!   elementwise work over replicated activations is divided too, a small optimism without
//!   `sp`); the fixed cost per kernel stays. The GEMM efficiency of the narrower matrices comes
//!   from the profile where measured ([`crate::GemmSplit`], which `flatpipe profile` records):
//!   the per-token term of the decoders and the head divides by `t x relative_throughput`
//!   instead of `t`. The per-token term also holds the elementwise work, which the split does
//!   not slow, so this overstates the loss by that share. An analytic profile prices the split on
//!   its hardware's GEMM curve; a tp the profile did not measure or price loses nothing, and the
//!   profile's notes say so.
//! - Collectives, on the intra-node link, not overlapped with compute (Megatron's
//!   `--tp-comm-overlap` is off by default), ring costs over `t` of `B = [T, H]` activations in the
//!   model's dtype: a decoder's forward has two all-reduces (after the attention output and the
//!   MLP down projection), its input-gradient pass two more (Shoeybi et al. 2019, §3); with `sp`
//!   each all-reduce becomes a reduce-scatter plus an all-gather (same bytes on a ring), and the
//!   weight-gradient pass re-gathers the two sequence-sharded GEMM inputs (two all-gathers;
//!   Korthikanti et al. 2022, §4.2.2). The vocabulary-parallel embedding all-reduces (or, with
//!   `sp`, reduce-scatters) its output; the head all-gathers its input with `sp`, all-reduces its
//!   input gradient (reduce-scatters with `sp`), and its parallel cross-entropy all-reduces three
//!   fp32 values per token (the logit max, the sum of exponentials and the target logit;
//!   Megatron's `vocab_parallel_cross_entropy`).
//! - Parameters divide by `t` except the RMSNorm weights (`H` per norm), which every rank holds.
//! - Activations: with `sp` everything divides by `t`. Without it the two RMSNorm inputs (kept
//!   for dgrad) and the two GEMM inputs after them (kept for wgrad) are whole `[T, H]` tensors on
//!   every rank: `2 H` elements of each part stay, the rest divides by `t` (Korthikanti et al.
//!   2022, §4.1: `sbh (10 + 24/t)`, of which the 2 sbh dropout masks do not exist in Llama).
//!   The head's logits divide by `t` (vocabulary-parallel).
//! - Pipeline transfers carry `1/t` of a stage's output per GPU: sharded along the sequence with
//!   `sp`, and by Megatron's scatter-gather optimization without it (Narayanan et al. 2021, §4.1,
//!   on by default; its all-gather over NVLink on arrival is not priced).

use crate::{CostCoeffs, Error, LayerKind, Profile, Result};

/// Ring all-reduce coefficients of `bytes_per_token` over `t` ranks on a link (alpha `a`,
/// bandwidth `b`) as `(c0, c_tok)`: `2 (t - 1) (a + T bytes / (t b))`.
fn all_reduce(t: f64, a: f64, b: f64, bytes_per_token: f64) -> (f64, f64) {
    let (c0, c_tok) = reduce_scatter(t, a, b, bytes_per_token);
    (2.0 * c0, 2.0 * c_tok)
}

/// Ring reduce-scatter (or all-gather) of `bytes_per_token` (unsharded) over `t` ranks:
/// `(t - 1) (a + T bytes / (t b))`.
fn reduce_scatter(t: f64, a: f64, b: f64, bytes_per_token: f64) -> (f64, f64) {
    if t <= 1.0 {
        return (0.0, 0.0);
    }
    ((t - 1.0) * a, (t - 1.0) * bytes_per_token / (t * b))
}

/// `c` split `t` ways with the GEMMs at `gemm` of their unsplit throughput, plus `comm`'s
/// `(c0, c_tok)`.
fn split(c: &CostCoeffs, t: f64, gemm: f64, comm: (f64, f64)) -> CostCoeffs {
    CostCoeffs {
        c0_s: c.c0_s + comm.0,
        c_tok_s: c.c_tok_s / (t * gemm) + comm.1,
        c_attn_s: c.c_attn_s / t,
    }
}

impl Profile {
    /// Checks every layer can be split `tp` ways: its shape is known, and `tp` divides a
    /// decoder's attention heads and key-value heads.
    fn check_splittable(&self, tp: u32, origin: &str) -> Result<()> {
        let origin = origin.to_string();
        for l in &self.layers {
            let s = &l.shape;
            if s.hidden == 0 || (l.kind == LayerKind::Decoder && s.heads == 0) {
                return Err(Error::invalid(
                    &origin,
                    format!("layers[{}].shape", l.name),
                    "unknown",
                    "the layer's hidden size, heads and key-value heads (an analytic profile records them)",
                ));
            }
            if l.kind == LayerKind::Decoder
                && (s.heads % u64::from(tp) != 0 || s.kv_heads % u64::from(tp) != 0)
            {
                return Err(Error::invalid(
                    &origin,
                    "tp",
                    tp,
                    format!(
                        "a divisor of {}'s {} attention heads and {} key-value heads (Megatron requires both)",
                        l.name, s.heads, s.kv_heads
                    ),
                ));
            }
        }
        Ok(())
    }

    /// The profile of one GPU of a tensor-parallel group of `tp` GPUs, with or without sequence
    /// parallelism (see the module documentation for every term and its source). `tp = 1`
    /// returns the profile unchanged.
    ///
    /// # Errors
    /// [`Error::Invalid`] when `tp` is 0, does not divide the hardware's `gpus_per_node` (a group
    /// stays inside a node), or does not divide a decoder's attention heads and key-value heads
    /// (Megatron requires both: `megatron/core/transformer/transformer_config.py`), or when a
    /// layer's shape is unknown (a profile without `shape`: the hidden size, heads and vocabulary
    /// that the split needs).
    pub fn tensor_parallel(&self, tp: u32, sequence_parallel: bool) -> Result<Profile> {
        let origin = format!("tensor parallelism of the {} profile", self.model);
        let g = self.hardware.gpus_per_node;
        if tp == 0 || g % tp != 0 {
            return Err(Error::invalid(
                &origin,
                "tp",
                tp,
                format!(
                    "a divisor of the {g} GPUs per node of {} (a tensor-parallel group stays inside a node)",
                    self.hardware.name
                ),
            ));
        }
        if tp == 1 {
            return Ok(self.clone());
        }
        self.check_splittable(tp, &origin)?;
        let t = f64::from(tp);
        let link = &self.hardware.intra_node;
        let (a, b) = (link.alpha_s, link.beta_bytes_per_s);
        let ar = |bytes: f64| all_reduce(t, a, b, bytes);
        let rs = |bytes: f64| reduce_scatter(t, a, b, bytes);
        let add = |x: (f64, f64), y: (f64, f64)| (x.0 + y.0, x.1 + y.1);
        let times = |x: (f64, f64), k: f64| (k * x.0, k * x.1);
        let none = (0.0, 0.0);
        let measured = self.gemm_split.iter().find(|g| g.tp == tp);
        let gemm = measured.map_or(1.0, |g| g.relative_throughput);
        let mut out = self.clone();
        let mut input_bytes = 4.0; // token ids into the embedding
        for l in &mut out.layers {
            let s = l.shape;
            // The model's dtype, bytes per element.
            let d = if l.param_count > 0 {
                l.param_bytes as f64 / l.param_count as f64
            } else {
                2.0
            };
            // One [T, H] activation per token, bytes (the decoder's and embedding's output).
            let act = s.hidden as f64 * d;
            // An all-reduce of [T, H], or with sp its reduce-scatter + all-gather (same cost).
            let exchange = ar(act);
            match l.kind {
                LayerKind::Decoder => {
                    let (f, i, w) = (
                        times(exchange, 2.0),
                        times(exchange, 2.0),
                        if sequence_parallel {
                            times(rs(act), 2.0)
                        } else {
                            none
                        },
                    );
                    l.f = split(&l.f, t, gemm, f);
                    l.i = split(&l.i, t, gemm, i);
                    l.w = split(&l.w, t, gemm, w);
                    l.fo = split(&l.fo, t, gemm, f);
                    l.b = l.b.map(|b| split(&b, t, gemm, add(i, w)));
                    l.routed = l.routed.map(|r| crate::RoutedCosts {
                        f: split(&r.f, t, gemm, none),
                        i: split(&r.i, t, gemm, none),
                        w: split(&r.w, t, gemm, none),
                        all_to_all: r.all_to_all,
                    });
                    let keep = if sequence_parallel { 0.0 } else { 2.0 * act };
                    l.act_bytes_per_token_i = (l.act_bytes_per_token_i - keep).max(0.0) / t + keep;
                    l.act_bytes_per_token_w = (l.act_bytes_per_token_w - keep).max(0.0) / t + keep;
                    let norms = 2 * s.hidden;
                    l.param_count = (l.param_count.saturating_sub(norms)) / u64::from(tp) + norms;
                    l.shape.heads /= u64::from(tp);
                    l.shape.kv_heads /= u64::from(tp);
                    // The experts split as the dense MLP does (Megatron's expert tensor
                    // parallelism at its default, the tensor-parallel size).
                    l.shape.expert_params /= u64::from(tp);
                }
                LayerKind::Embedding => {
                    let f = if sequence_parallel { rs(act) } else { exchange };
                    l.f = split(&l.f, t, 1.0, f);
                    l.i = split(&l.i, t, 1.0, none);
                    l.w = split(&l.w, t, 1.0, none);
                    l.fo = split(&l.fo, t, 1.0, f);
                    l.b = l.b.map(|b| split(&b, t, 1.0, none));
                    l.param_count /= u64::from(tp);
                }
                LayerKind::Head => {
                    // Its input is the previous layer's output, [T, H].
                    let input = input_bytes;
                    let ce = ar(3.0 * 4.0);
                    let f = add(if sequence_parallel { rs(input) } else { none }, ce);
                    let i = if sequence_parallel {
                        rs(input)
                    } else {
                        ar(input)
                    };
                    let w = if sequence_parallel { rs(input) } else { none };
                    l.f = split(&l.f, t, gemm, f);
                    l.i = split(&l.i, t, gemm, i);
                    l.w = split(&l.w, t, gemm, w);
                    l.fo = split(&l.fo, t, gemm, f);
                    l.b = l.b.map(|b| split(&b, t, gemm, add(i, w)));
                    // The norm input and the GEMM input are [T, H]: replicated without sp.
                    let hidden_part = if sequence_parallel { input / t } else { input };
                    let logits = (l.act_bytes_per_token_i - input).max(0.0) / t;
                    l.act_bytes_per_token_i = hidden_part + logits;
                    l.act_bytes_per_token_w = hidden_part;
                    let norm = s.hidden;
                    l.param_count = (l.param_count.saturating_sub(norm)) / u64::from(tp) + norm;
                }
            }
            input_bytes = l.output_bytes_per_token;
            if l.kind != LayerKind::Head {
                l.output_bytes_per_token /= t;
            }
            l.param_bytes = l.param_count * d as u64;
            l.model_flops_per_token /= t;
            l.model_flops_per_attn_pair /= t;
        }
        out.hardware.gpus_per_node = g / tp;
        out.provenance.notes = format!(
            "{}; one GPU of a tensor-parallel group of {tp}{}, {}",
            out.provenance.notes,
            if sequence_parallel {
                " with sequence parallelism"
            } else {
                ""
            },
            match measured {
                Some(g) => format!(
                    "GEMMs at {:.3} of the unsplit throughput (measured at {} tokens)",
                    g.relative_throughput, g.tokens
                ),
                None => format!("GEMM efficiency at tp = {tp} not measured: no loss assumed"),
            }
        );
        out.tensor_parallel = self.tensor_parallel * tp;
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use crate::{AnalyticOptions, analytic_profile, builtins};

    fn profile() -> crate::Profile {
        let m = builtins::model("llama3.1-70b").unwrap();
        let hw = builtins::hardware("h200").unwrap();
        analytic_profile(&m, &hw, &AnalyticOptions::default()).unwrap()
    }

    #[test]
    fn refuses_what_megatron_refuses() {
        let p = profile();
        // 64 heads, 8 KV heads, 8 GPUs per node.
        for (tp, what) in [
            (3, "GPUs per node"),
            (0, "GPUs per node"),
            (16, "GPUs per node"),
        ] {
            let e = p.tensor_parallel(tp, true).unwrap_err().to_string();
            assert!(e.contains("tp") && e.contains(what), "{tp}: {e}");
        }
        let mut hw = p.hardware.clone();
        hw.gpus_per_node = 16;
        let mut q = p.clone();
        q.hardware = hw;
        let e = q.tensor_parallel(16, true).unwrap_err().to_string();
        assert!(e.contains("8 key-value heads"), "{e}");
        assert_eq!(p.tensor_parallel(1, false).unwrap(), p);
    }

    #[test]
    fn measured_gemm_split_slows_the_gemm_term_only() {
        let mut p = profile();
        p.gemm_split.clear(); // the analytic profile's own split, priced on its GEMM curve
        let mut q = p.clone();
        q.gemm_split = vec![crate::GemmSplit {
            tp: 4,
            relative_throughput: 0.8,
            tokens: 4096,
        }];
        let (a, b) = (
            p.tensor_parallel(4, true).unwrap(),
            q.tensor_parallel(4, true).unwrap(),
        );
        for ((orig, lost), none) in p.layers.iter().zip(&b.layers).zip(&a.layers) {
            // Same collectives, so the per-token difference is the GEMM term's:
            // c_tok (1 / (4 x 0.8) - 1 / 4), and nothing for the embedding's gather.
            let extra = match orig.kind {
                crate::LayerKind::Embedding => 0.0,
                _ => orig.f.c_tok_s * (1.0 / 3.2 - 0.25),
            };
            let got = lost.f.c_tok_s - none.f.c_tok_s;
            assert!(
                (got - extra).abs() <= 1e-12 * orig.f.c_tok_s.max(1e-30),
                "{}",
                orig.name
            );
            assert_eq!(lost.f.c_attn_s, none.f.c_attn_s);
            assert_eq!(lost.f.c0_s, none.f.c0_s);
        }
        assert!(b.provenance.notes.contains("0.800 of the unsplit"));
        assert!(a.provenance.notes.contains("not measured: no loss assumed"));
        // A tp the profile did not measure loses nothing.
        assert_eq!(
            q.tensor_parallel(2, true).unwrap().layers,
            p.tensor_parallel(2, true).unwrap().layers
        );
    }
}
