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
//! - Compute: unchanged. An even router sends each GPU's experts `k T / E` tokens from each of
//!   the `ep` GPUs, the FLOPs of `T` tokens' share; the profile does not re-price the experts'
//!   GEMMs at the `ep` times taller batches they then see (a slight pessimism).
//! - Communication, on the intra-node link when the group's `ep x tp` GPUs fit a node and the
//!   inter-node link otherwise, not overlapped: an all-to-all dispatches each token's `k`
//!   copies of its hidden state to the experts' GPUs and another combines the results (the
//!   forward, and the forward-only pass), and the input-gradient pass runs both backwards. An
//!   even router leaves `(ep - 1) / ep` of the `k T H d` bytes on other GPUs; with sequence
//!   parallelism each of the `tp` GPUs sends its `1/tp` of the tokens. One all-to-all costs
//!   `(ep - 1) alpha + bytes / beta` (pairwise exchange, Thakur, Rabenseifner and Gropp 2005).
//!   The all-to-alls join the layer's routed part (`LayerProfile::routed`), which the cost
//!   model scales by the router's imbalance.

use crate::{CostCoeffs, Error, LayerKind, Profile, Result};

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
        if let Some(l) = self
            .layers
            .iter()
            .find(|l| l.shape.experts > 0 && l.shape.experts % u64::from(ep) != 0)
        {
            return Err(Error::invalid(
                &origin,
                "ep",
                ep,
                format!(
                    "a divisor of {}'s {} routed experts",
                    l.name, l.shape.experts
                ),
            ));
        }
        let e = f64::from(ep);
        let group = u64::from(ep) * u64::from(tp);
        let link = if group <= u64::from(self.hardware.gpus_per_node) {
            &self.hardware.intra_node
        } else {
            &self.hardware.inter_node
        };
        let share = if sequence_parallel {
            1.0 / f64::from(tp)
        } else {
            1.0
        };
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
            // Dispatch and combine: (c0, c_tok) of two all-to-alls.
            let bytes = l.shape.top_k as f64 * l.shape.hidden as f64 * d * share * (e - 1.0) / e;
            let pair = (
                2.0 * (e - 1.0) * link.alpha_s,
                2.0 * bytes / link.beta_bytes_per_s,
            );
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
        out.provenance.notes.push_str(&format!(
            "; expert parallelism over {ep} GPUs ({} layers): routed experts / {ep}, two all-to-alls per forward and per input-gradient pass on {}",
            moe.len(),
            link.name
        ));
        Ok(out)
    }
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
        // token; F and I each pay two: 2 (7a + T bytes / b).
        let p = qwen();
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
        // 16 x tp 1 leaves the node: the inter-node link.
        let r = p.expert_parallel(16, 1, true).unwrap();
        let (a, b) = (
            p.hardware.inter_node.alpha_s,
            p.hardware.inter_node.beta_bytes_per_s,
        );
        let bytes = 8.0 * 2048.0 * 2.0 * 15.0 / 16.0;
        assert!((r.layers[1].f.c_tok_s - l0.f.c_tok_s - 2.0 * bytes / b).abs() < 1e-18);
        assert!((r.layers[1].f.c0_s - l0.f.c0_s - 2.0 * 15.0 * a).abs() < 1e-15);
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
