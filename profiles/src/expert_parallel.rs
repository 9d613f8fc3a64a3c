//! Expert parallelism (Megatron-LM's `--expert-model-parallel-size`, torchtitan's
//! `expert_parallel_degree`): the profile of one GPU of a group of `ep` data-parallel replicas
//! that split each mixture-of-experts layer's routed experts between them.
//!
//! [`Profile::expert_parallel`] returns the profile *one GPU of the group* sees, after
//! [`Profile::tensor_parallel`]. Per mixture-of-experts decoder, with `E` routed experts, `k`
//! per token, hidden size `H` and `d` bytes per element:
//! - Parameters: the GPU holds `E / ep` of the experts: its `param_count` loses `(1 - 1/ep)`
//!   of the experts' weights (`shape.expert_params`). Their optimizer state shards over the
//!   `dp / ep` replicas that hold the same experts (`Profile::expert_parallel` tells the cost
//!   model); the other weights' over all `dp`.
//! - Compute: the same FLOPs on taller batches. An even router sends each GPU's `E / ep` experts
//!   `k T / E` tokens from each of the `ep` GPUs, `ep k T / E` rows each: the experts' GEMMs
//!   (`LayerProfile::routed`, and the layer's phases by as much) take `1 / r` of their time,
//!   `r` the profile's `expert_batching` throughput at `ep` (priced on the GEMM curve at 4,096
//!   tokens per GPU; 1 where unknown).
//! - Communication, not overlapped here (an overlapping schedule hides it: the cost model's
//!   `overlap_ns`): an all-to-all dispatches each token's `k` copies of its hidden state to the
//!   experts' GPUs and another combines the results (the forward, and the forward-only pass),
//!   and the input-gradient pass runs both backwards. With sequence parallelism each of the
//!   `tp` GPUs sends its `1/tp` of the tokens. Inside a node the copies cross NVLink; across
//!   nodes the network, with NVLink beside it, and under node-limited routing once per node
//!   (`all_to_all_pair` has each case's formula). One all-to-all's latency is that of a
//!   pairwise exchange (Thakur, Rabenseifner and Gropp 2005). The all-to-alls join the layer's
//!   routed part (`LayerProfile::routed`), which the cost model scales by the router's
//!   imbalance.

use crate::{CostCoeffs, Error, Hardware, LayerKind, LayerShape, Profile, Result};

impl Profile {
    /// The profile of one GPU of an expert-parallel group of `ep` GPUs (see the module
    /// documentation for every term), for a profile already split `tp` ways with or without
    /// sequence parallelism. `ep = 1` returns the profile unchanged.
    ///
    /// # Errors
    /// [`Error::Invalid`] when `ep` is 0, when the profile has no mixture-of-experts layer, or
    /// when `ep` does not divide a layer's routed experts.
    pub fn expert_parallel(&self, ep: u32, tp: u32, sequence_parallel: bool) -> Result<Profile> {
        let origin = format!("expert parallelism of the {} profile", self.model);
        if ep == 0 {
            return Err(Error::invalid(&origin, "ep", 0, ">= 1"));
        }
        if ep == 1 {
            return Ok(self.clone());
        }
        let moe: Vec<&str> = self
            .layers
            .iter()
            .filter(|l| l.shape.experts > 0)
            .map(|l| l.name.as_str())
            .collect();
        if moe.is_empty() {
            return Err(Error::invalid(
                &origin,
                "ep",
                ep,
                "1: the model has no mixture-of-experts layer",
            ));
        }
        if let Some((j, l)) = self
            .layers
            .iter()
            .enumerate()
            .find(|(_, l)| l.shape.experts > 0 && l.shape.experts % u64::from(ep) != 0)
        {
            return Err(Error::invalid(
                &origin,
                "ep",
                ep,
                format!(
                    "a divisor of the {} routed experts of layer {j} of the model ({}, counting the embedding as 0)",
                    l.shape.experts, l.name
                ),
            ));
        }
        let share = if sequence_parallel {
            1.0 / f64::from(tp)
        } else {
            1.0
        };
        // The experts' GEMMs on ep times taller batches: their time times `speed_now / speed`.
        let speed = |g: u32| -> f64 {
            self.expert_batching
                .iter()
                .find(|b| b.ep == g)
                .map_or(1.0, |b| b.relative_throughput)
        };
        let batching = speed(self.expert_parallel) / speed(self.expert_parallel * ep);
        let mut out = self.clone();
        for l in out
            .layers
            .iter_mut()
            .filter(|l| l.kind == LayerKind::Decoder && l.shape.experts > 0)
        {
            let d = if l.param_count > 0 {
                l.param_bytes as f64 / l.param_count as f64
            } else {
                2.0
            };
            let local = l.shape.expert_params / u64::from(ep);
            let gone = l.shape.expert_params - local;
            l.param_count -= gone;
            l.param_bytes = l.param_bytes.saturating_sub((gone as f64 * d) as u64);
            l.shape.expert_params = local;
            if let Some(r) = l.routed.as_mut() {
                let less = 1.0 - batching;
                let cut = |c: &mut CostCoeffs, part: CostCoeffs| {
                    c.c0_s -= less * part.c0_s;
                    c.c_tok_s -= less * part.c_tok_s;
                };
                let (f, i, w) = (r.f, r.i, r.w);
                cut(&mut l.f, f);
                cut(&mut l.fo, f);
                cut(&mut l.i, i);
                cut(&mut l.w, w);
                if let Some(b) = l.b.as_mut() {
                    cut(b, i);
                    cut(b, w);
                }
                cut(&mut r.f, f);
                cut(&mut r.i, i);
                cut(&mut r.w, w);
            }
            // Dispatch and combine: (c0, c_tok) of two all-to-alls.
            let pair = all_to_all_pair(&l.shape, &self.hardware, ep, tp, share, d);
            let add = |c: &mut CostCoeffs| {
                c.c0_s += pair.0;
                c.c_tok_s += pair.1;
            };
            add(&mut l.f);
            add(&mut l.fo);
            add(&mut l.i);
            if let Some(b) = l.b.as_mut() {
                add(b);
            }
            // The busiest GPU receives and sends more of both with the tokens it is routed.
            if let Some(r) = l.routed.as_mut() {
                add(&mut r.f);
                add(&mut r.i);
                add(&mut r.all_to_all);
            }
        }
        out.expert_parallel = self.expert_parallel * ep;
        let nodes =
            (u64::from(ep) * u64::from(tp)).div_ceil(u64::from(self.hardware.gpus_per_node));
        out.provenance.notes.push_str(&format!(
            "; expert parallelism over {ep} GPUs on {nodes} node(s) ({} layers): routed experts / {ep}, two all-to-alls per forward and per input-gradient pass",
            moe.len(),
        ));
        Ok(out)
    }
}

/// Bytes per element of an FP8 payload with one FP32 scale per 128 elements (DeepSeek-V3,
/// arXiv 2412.19437, §3.3.2's 1 x 128 activation tiles).
pub const FP8_WITH_SCALES_BYTES: f64 = 1.0 + 4.0 / 128.0;

/// One pass's dispatch and combine all-to-alls on one GPU of an expert-parallel group of `ep`
/// GPUs (each of `tp`), for a layer of shape `l` whose `k` routed copies of a token carry
/// `share x hidden` elements of `d` bytes (the dispatch's FP8 with its scales under
/// `fp8_dispatch`): `(c0_s, c_tok_s)`, seconds and seconds per token. With `n` nodes of
/// `g = ep / n` group GPUs each:
/// - One node (`ep x tp <= gpus_per_node`): each all-to-all moves `(ep - 1) / ep` of the `k`
///   copies on NVLink, `(ep - 1) alpha_nv + bytes / beta_nv`.
/// - Several nodes, no node limit: of the `k` copies, `(n - 1) / n` cross the network and
///   `(g - 1) / ep` stay on the node's NVLink, both at once: `max(ib / beta_ib, nv / beta_nv)`
///   per token, `(ep - 1) alpha_ib`.
/// - Several nodes, node-limited to `M` (`max_nodes`): a token's copies reach
///   `D = m (1 - (1 - 1/m)^k)` distinct nodes of `m = min(M, n)` (uniform top-k among the
///   chosen nodes' experts), `D (n - 1) / n` of them remote; it crosses the network once per
///   remote node and NVLink forwards its `k` copies inside each node, `(g - 1) / g` of them to
///   another GPU (DeepSeek-V3 §3.2.2, DeepEP's internode kernels): `max(D (n - 1) / n bytes /
///   beta_ib, k (g - 1) / g bytes / beta_nv)` per token, `(n - 1) alpha_ib + (g - 1)
///   alpha_nv`.
fn all_to_all_pair(
    l: &LayerShape,
    hw: &Hardware,
    ep: u32,
    tp: u32,
    share: f64,
    d: f64,
) -> (f64, f64) {
    let (e, k) = (f64::from(ep), l.top_k as f64);
    let copy = l.hidden as f64 * share;
    let dispatch_d = if l.fp8_dispatch {
        FP8_WITH_SCALES_BYTES
    } else {
        d
    };
    let (nv, ib) = (
        hw.all_to_all.as_ref().unwrap_or(&hw.intra_node),
        &hw.inter_node,
    );
    let group = u64::from(ep) * u64::from(tp);
    let nodes = group.div_ceil(u64::from(hw.gpus_per_node.max(1)));
    // Per token: copies over the network and over NVLink, and the latency of one all-to-all.
    let (ib_copies, nv_copies, alpha) = if nodes <= 1 {
        (0.0, k * (e - 1.0) / e, (e - 1.0) * nv.alpha_s)
    } else {
        let n = nodes as f64;
        let g = (e / n).max(1.0);
        if l.max_nodes == 0 {
            (k * (n - 1.0) / n, k * (g - 1.0) / e, (e - 1.0) * ib.alpha_s)
        } else {
            let m = (l.max_nodes as f64).min(n);
            let distinct = m * (1.0 - (1.0 - 1.0 / m).powf(k));
            (
                distinct * (n - 1.0) / n,
                k * (g - 1.0) / g,
                (n - 1.0) * ib.alpha_s + (g - 1.0) * nv.alpha_s,
            )
        }
    };
    let per_token = |bytes: f64| {
        (ib_copies * copy * bytes / ib.beta_bytes_per_s)
            .max(nv_copies * copy * bytes / nv.beta_bytes_per_s)
    };
    (2.0 * alpha, per_token(dispatch_d) + per_token(d))
}

#[cfg(test)]
mod tests {
    use crate::{AnalyticOptions, analytic_profile, builtins};

    fn qwen() -> crate::Profile {
        let m = builtins::model("qwen3-30b-a3b").unwrap();
        let hw = builtins::hardware("h100").unwrap();
        analytic_profile(&m, &hw, &AnalyticOptions::default()).unwrap()
    }

    #[test]
    fn experts_divide_and_two_all_to_alls_follow_the_formula() {
        // Qwen3-30B-A3B: 128 experts of 768, top 8, hidden 2048, bf16; ep 8 inside an H100 node
        // (NVLink: alpha a, bandwidth b). Each all-to-all moves 8 x 2048 x 2 x 7/8 bytes per
        // token; F and I each pay two: 2 (7a + T bytes / b). (The experts' taller batches
        // apart: `expert_batching` is cleared.)
        let mut p = qwen();
        p.expert_batching.clear();
        let q = p.expert_parallel(8, 1, true).unwrap();
        let (a, b) = (
            p.hardware.intra_node.alpha_s,
            p.hardware.intra_node.beta_bytes_per_s,
        );
        let bytes = 8.0 * 2048.0 * 2.0 * 7.0 / 8.0;
        let (l0, l1) = (&p.layers[1], &q.layers[1]);
        let experts = 128 * 3 * 2048 * 768;
        assert_eq!(l0.shape.expert_params, experts);
        assert_eq!(l1.param_count, l0.param_count - experts + experts / 8);
        assert_eq!(l1.param_bytes, 2 * l1.param_count);
        for (c0, c1) in [(&l0.f, &l1.f), (&l0.i, &l1.i), (&l0.fo, &l1.fo)] {
            assert!((c1.c0_s - c0.c0_s - 2.0 * 7.0 * a).abs() < 1e-15);
            assert!((c1.c_tok_s - c0.c_tok_s - 2.0 * bytes / b).abs() < 1e-18);
        }
        assert_eq!(l1.w, l0.w);
        // The routed part holds the same all-to-alls, apart, for an overlapping schedule.
        let r = l1.routed.unwrap();
        assert!((r.all_to_all.c0_s - 2.0 * 7.0 * a).abs() < 1e-15);
        assert!((r.all_to_all.c_tok_s - 2.0 * bytes / b).abs() < 1e-18);
        assert_eq!(q.layers[0], p.layers[0]);
        assert_eq!(q.expert_parallel, 8);
        // 16 x tp 1 spans two nodes: of the 8 copies, 4 cross the network and 8 x 7/16 = 3.5
        // go to another GPU of the node, at once; 15 messages on the network's latency.
        let r = p.expert_parallel(16, 1, true).unwrap();
        let (ib, nv) = (&p.hardware.inter_node, &p.hardware.intra_node);
        let copy = 2048.0 * 2.0;
        let per_a2a = (4.0 * copy / ib.beta_bytes_per_s).max(3.5 * copy / nv.beta_bytes_per_s);
        assert!((r.layers[1].f.c_tok_s - l0.f.c_tok_s - 2.0 * per_a2a).abs() < 1e-18);
        assert!((r.layers[1].f.c0_s - l0.f.c0_s - 2.0 * 15.0 * ib.alpha_s).abs() < 1e-15);
    }

    #[test]
    fn node_limited_fp8_dispatch_crosses_the_network_once_per_node() {
        // DeepSeek-V3 (top 8 of 256, hidden 7168, at most 4 nodes a token, FP8 dispatch) at ep
        // 64 over 8 H800 nodes: the 8 copies of a token reach 4 (1 - (3/4)^8) = 3.5996 of its 4
        // chosen nodes, 7/8 of them remote; NVLink forwards the 8 copies, 7/8 of them to
        // another of the node's 8 GPUs. Dispatch: 1 + 4/128 bytes per element; combine: 2.
        let m = builtins::model("deepseek-v3").unwrap();
        let hw = builtins::hardware("h800").unwrap();
        let mut p = analytic_profile(&m, &hw, &AnalyticOptions::default()).unwrap();
        p.expert_batching.clear();
        let q = p.expert_parallel(64, 1, true).unwrap();
        let j = p.layers.iter().position(|l| l.shape.experts > 0).unwrap();
        assert_eq!(
            (p.layers[j].shape.max_nodes, p.layers[j].shape.fp8_dispatch),
            (4, true)
        );
        let (ib, nv) = (&hw.inter_node, &hw.intra_node);
        let remote = 4.0 * (1.0 - 0.75f64.powi(8)) * 7.0 / 8.0;
        let per_a2a = |bytes: f64| {
            (remote * 7168.0 * bytes / ib.beta_bytes_per_s)
                .max(8.0 * 7.0 / 8.0 * 7168.0 * bytes / nv.beta_bytes_per_s)
        };
        let want = per_a2a(1.03125) + per_a2a(2.0);
        let got = q.layers[j].i.c_tok_s - p.layers[j].i.c_tok_s;
        assert!((got - want).abs() < 1e-18, "{got} vs {want}");
        let alpha = 7.0 * ib.alpha_s + 7.0 * nv.alpha_s;
        assert!((q.layers[j].f.c0_s - p.layers[j].f.c0_s - 2.0 * alpha).abs() < 1e-15);
        // Without the node limit, in bf16, 7/8 of the 8 copies cross the network, dispatch
        // and combine alike.
        let mut plain = p.clone();
        for l in &mut plain.layers {
            l.shape.max_nodes = 0;
            l.shape.fp8_dispatch = false;
        }
        let r = plain.expert_parallel(64, 1, true).unwrap();
        let flat = 2.0 * 8.0 * 7.0 / 8.0 * 7168.0 * 2.0 / ib.beta_bytes_per_s;
        assert!((r.layers[j].f.c_tok_s - p.layers[j].f.c_tok_s - flat).abs() < 1e-18);
    }

    /// With ep 8 each GPU's experts run 8 times taller batches: the routed GEMMs take `1 / r`
    /// of their time (`r` the profile's `expert_batching` at 8), and the layer's phases lose
    /// what they lose; the all-to-alls are the same with or without it.
    #[test]
    fn taller_batches_speed_up_the_experts_gemms() {
        let p = qwen();
        let mut plain = p.clone();
        plain.expert_batching.clear();
        let r = p.expert_batching.iter().find(|b| b.ep == 8).unwrap();
        assert!(r.relative_throughput > 1.0, "{r:?}");
        let less = 1.0 - 1.0 / r.relative_throughput;
        let (q, u) = (
            p.expert_parallel(8, 1, true).unwrap(),
            plain.expert_parallel(8, 1, true).unwrap(),
        );
        let (r0, rq, ru) = (
            p.layers[1].routed.unwrap(),
            q.layers[1].routed.unwrap(),
            u.layers[1].routed.unwrap(),
        );
        for (got, want, part) in [
            (&q.layers[1].f, &u.layers[1].f, r0.f),
            (&q.layers[1].i, &u.layers[1].i, r0.i),
            (&q.layers[1].w, &u.layers[1].w, r0.w),
            (&rq.f, &ru.f, r0.f),
        ] {
            assert!((want.c_tok_s - got.c_tok_s - less * part.c_tok_s).abs() < 1e-18);
            assert!((want.c0_s - got.c0_s - less * part.c0_s).abs() < 1e-15);
        }
        assert_eq!(rq.all_to_all, ru.all_to_all);
    }

    #[test]
    fn what_cannot_split_is_refused() {
        let p = qwen();
        let e = p.expert_parallel(3, 1, true).unwrap_err().to_string();
        assert!(
            e.contains("a divisor of") && e.contains("128 routed experts"),
            "{e}"
        );
        let m = builtins::model("llama3.1-8b").unwrap();
        let hw = builtins::hardware("h100").unwrap();
        let dense = analytic_profile(&m, &hw, &AnalyticOptions::default()).unwrap();
        let e = dense.expert_parallel(2, 1, true).unwrap_err().to_string();
        assert!(e.contains("no mixture-of-experts layer"), "{e}");
        assert_eq!(dense.expert_parallel(1, 1, true).unwrap(), dense);
    }
}
