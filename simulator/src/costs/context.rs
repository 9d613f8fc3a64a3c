//! Context parallelism in the profile-driven table ([`super::TableCosts`]): a pipeline rank is a
//! group of `cp` GPUs (as a tensor-parallel group is one rank) sharing each microbatch. An
//! action takes what the group's busiest GPU computes ([`ContextParallel::share`]: its tokens
//! and attention pairs, with fixed cp `1/cp` of every document, with dynamic cp the documents
//! placed on blocks of the group), and each decoder's attention pays the exposed exchange of
//! [`CpLinks::exposed_s`] for every split that GPU takes part in. The cost model is `flatpipe_profiles::context_parallel`'s; what a
//! GPU holds follows from the tokens per GPU (activations and pipeline transfers are `1/gpus`
//! of the microbatch's).

use crate::batching::microbatch::{Microbatch, Shape};
use crate::{Error, Result};
use flatpipe_profiles::context_parallel::{ContextParallel, CpAttention, CpLinks, CpShare};
use flatpipe_profiles::{LayerKind, LayerProfile, Profile};
use std::ops::Range;

/// The attention shape of a decoder layer on one GPU of its tensor-parallel group (`tp`: its
/// heads are the group's share, its hidden size the model's), for `tokens` over its cp group;
/// `None` where the layer has no attention heads recorded. Elements are in the model's dtype
/// (`param_bytes / param_count`, 2 where unknown).
fn attention(l: &LayerProfile, tp: u32, tokens: u64) -> Option<CpAttention> {
    let s = &l.shape;
    let d = if l.param_count > 0 {
        (l.param_bytes as f64 / l.param_count as f64)
            .round()
            .max(1.0) as u32
    } else {
        2
    };
    (l.kind == LayerKind::Decoder && s.heads > 0 && s.hidden > 0).then(|| CpAttention {
        tokens,
        heads: s.heads as u32,
        kv_heads: s.kv_heads.max(1) as u32,
        head_dim: (s.hidden / (s.heads * u64::from(tp.max(1)))) as u32,
        dtype_bytes: d,
    })
}

/// The links of the profile's hardware, per node as many GPUs as its (tensor-parallel) ranks.
fn links(profile: &Profile) -> CpLinks {
    let h = &profile.hardware;
    CpLinks {
        intra: h.intra_node.clone(),
        inter: h.inter_node.clone(),
        gpus_per_node: h.gpus_per_node,
    }
}

/// Checks the run's cp against the profile and the microbatches: [`ContextParallel::validate`],
/// every group size it can use priced for every decoder (Ulysses: the size divides the query
/// heads; hierarchical: its all-to-all fits a node), and flat microbatches that are not chunks.
///
/// # Errors
/// [`Error::InvalidArgument`] naming what does not fit.
pub(crate) fn check(cp: &ContextParallel, profile: &Profile, mbs: &[Microbatch]) -> Result<()> {
    cp.validate()
        .map_err(|e| Error::invalid("cp", cp.cp, e.to_string()))?;
    if let Some(mb) = mbs
        .iter()
        .find(|m| m.shape != Shape::Flat || m.chunk.is_some())
    {
        return Err(Error::invalid(
            "cp",
            cp.cp,
            format!(
                "flat microbatches of whole sequences (one is {}): context parallelism splits a flat [T] microbatch by its cu_seqlens; chunks and padded layouts are the other answers to long sequences",
                if mb.chunk.is_some() {
                    "a chunk"
                } else {
                    "padded or packed"
                }
            ),
        ));
    }
    let sizes: Vec<u32> = match cp.max_seqlen_per_rank {
        // Dynamic cp uses the powers of two up to cp, and cp itself.
        Some(_) => (0..)
            .map(|k| 1u32 << k)
            .take_while(|&g| g < cp.cp)
            .chain([cp.cp])
            .collect(),
        None => vec![cp.cp],
    };
    let links = links(profile);
    for l in &profile.layers {
        let Some(a) = attention(l, profile.tensor_parallel, 1 << 20) else {
            continue;
        };
        for &g in &sizes {
            links
                .exposed_s(cp.comm, &a, g, (0.0, 0.0))
                .map_err(|e| Error::invalid("cp", g, format!("{} ({})", e, l.name)))?;
        }
    }
    Ok(())
}

/// A microbatch's share on its group for the stage of `layers` ([`ContextParallel::share`]),
/// documents weighed by the stage's forward costs: a pair's `Σ c_attn` over a token's `Σ c_tok`.
pub(crate) fn share(
    cp: &ContextParallel,
    profile: &Profile,
    layers: &Range<usize>,
    mb: &Microbatch,
) -> CpShare {
    let ls = &profile.layers[layers.clone()];
    let tok: f64 = ls.iter().map(|l| l.f.c_tok_s).sum();
    let attn: f64 = ls.iter().map(|l| l.f.c_attn_s).sum();
    let weight = if tok > 0.0 { attn / tok } else { 0.0 };
    cp.share(&mb.seq_lens, weight)
}

/// Exposed exchange seconds of the decoders of `layers` for one microbatch's `share`, as
/// `(forward, input gradient)`: for each split the busiest GPU takes part in, each decoder's
/// [`CpLinks::exposed_s`] against its own attention time on that split (`c_attn` of F and of I
/// times the split's pairs per GPU). Zero without a split.
pub(crate) fn exchange_s(
    cp: &ContextParallel,
    profile: &Profile,
    layers: &Range<usize>,
    share: &CpShare,
) -> (f64, f64) {
    let links = links(profile);
    let mut out = (0.0, 0.0);
    for part in &share.parts {
        for l in &profile.layers[layers.clone()] {
            let Some(a) = attention(l, profile.tensor_parallel, part.padded_tokens) else {
                continue;
            };
            let att = (l.f.c_attn_s * part.pairs, l.i.c_attn_s * part.pairs);
            // `check` priced every group size this run uses: no error is left here.
            if let Ok((f, i)) = links.exposed_s(cp.comm, &a, part.gpus, att) {
                out.0 += f;
                out.1 += i;
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::costs::{CostModel, CostOptions, TableCosts};
    use crate::ir::{ActionKind, ComputeAction, MicrobatchId, Placement, StageId};
    use flatpipe_profiles::context_parallel::{CpBalance, CpComm};
    use flatpipe_profiles::{Phase, builtins};

    fn profile(link_free: bool) -> Profile {
        let model = builtins::model("llama3.1-8b").unwrap();
        let hw = builtins::hardware("h100").unwrap();
        let mut p = flatpipe_profiles::analytic_profile(&model, &hw, &Default::default()).unwrap();
        if link_free {
            for l in [&mut p.hardware.intra_node, &mut p.hardware.inter_node] {
                l.alpha_s = 0.0;
                l.beta_bytes_per_s = 1e30;
            }
        }
        p
    }

    /// The table of one stage of layers 1..3 on one rank, one flat microbatch of `seq_lens`.
    fn table(
        p: &Profile,
        cp: Option<ContextParallel>,
        seq_lens: Vec<u32>,
    ) -> crate::Result<TableCosts> {
        let stages = [Range { start: 1, end: 3 }];
        TableCosts::with_options(
            p,
            &stages,
            &Placement::looped(1, 1),
            &[Microbatch::flat(seq_lens)],
            &[],
            &CostOptions {
                context_parallel: cp,
                ..Default::default()
            },
        )
    }

    fn f_and_i_ns(p: &Profile, cp: Option<ContextParallel>, seq_lens: Vec<u32>) -> (u64, u64) {
        let costs = table(p, cp, seq_lens).unwrap();
        let a = |kind| ComputeAction {
            stage: StageId(0),
            kind,
            microbatch: MicrobatchId(0),
        };
        (
            costs.compute_ns(a(ActionKind::F)),
            costs.compute_ns(a(ActionKind::I)),
        )
    }

    fn fixed(cp: u32, comm: CpComm) -> ContextParallel {
        ContextParallel {
            cp,
            comm,
            balance: CpBalance::Zigzag,
            max_seqlen_per_rank: None,
        }
    }

    /// With free links, one sequence of 32,768 tokens over a zigzag group of 4 costs each
    /// decoder `c0 + c_tok T / 4 + c_attn (8 c^2 + c)` with `c = T / 8`: the layer's own
    /// formula at the busiest GPU's tokens and pairs.
    #[test]
    fn a_gpu_of_the_group_computes_its_share_of_tokens_and_pairs() {
        let p = profile(true);
        let t = 32_768u64;
        let c = t / 8;
        let pairs = 8 * c * c + c;
        let want = |ph: Phase| -> f64 {
            p.layers[1..3]
                .iter()
                .map(|l| l.coeffs(ph).time_s(t as f64 / 4.0, pairs as f64))
                .sum()
        };
        let (f, i) = f_and_i_ns(&p, Some(fixed(4, CpComm::Ring)), vec![t as u32]);
        assert!((f as f64 - want(Phase::F) * 1e9).abs() <= 1.0, "{f}");
        assert!((i as f64 - want(Phase::I) * 1e9).abs() <= 1.0, "{i}");
        // cp = 1 is the run without it.
        assert_eq!(
            f_and_i_ns(&p, Some(fixed(1, CpComm::Ring)), vec![t as u32]),
            f_and_i_ns(&p, None, vec![t as u32])
        );
    }

    /// On the real links the exchange adds what `CpLinks::exposed_s` says per decoder: Ulysses'
    /// all-to-alls are never hidden, so F grows by exactly their time.
    #[test]
    fn the_exchange_is_added_per_decoder() {
        let (free, real) = (profile(true), profile(false));
        let t = 32_768u32;
        let (f0, _) = f_and_i_ns(&free, Some(fixed(4, CpComm::Ulysses)), vec![t]);
        let (f1, _) = f_and_i_ns(&real, Some(fixed(4, CpComm::Ulysses)), vec![t]);
        let a = attention(&real.layers[1], 1, u64::from(t)).unwrap();
        let per_layer = flatpipe_profiles::context_parallel::ulysses_bytes(&a, 4)
            .unwrap()
            .time_s(&real.hardware.intra_node);
        let got = (f1 - f0) as f64 * 1e-9;
        assert!(
            (got - 2.0 * per_layer).abs() < 2e-9,
            "{got} vs {}",
            2.0 * per_layer
        );
    }

    /// Dynamic cp runs a short document on one GPU (no exchange, no split) and a long one on
    /// as many as it needs; a run the model's heads do not divide for Ulysses is refused.
    #[test]
    fn dynamic_cp_places_documents_by_length_and_bad_groups_are_refused() {
        let p = profile(false);
        let dynamic = ContextParallel {
            max_seqlen_per_rank: Some(8192),
            ..fixed(8, CpComm::Ring)
        };
        // One 4,096-token document fits one GPU: the cost of the run without cp.
        assert_eq!(
            f_and_i_ns(&p, Some(dynamic), vec![4096]),
            f_and_i_ns(&p, None, vec![4096])
        );
        let s = dynamic.share(&[20_000, 100], 0.0);
        assert_eq!(s.parts.len(), 1);
        assert_eq!(s.parts[0].gpus, 4);
        // Llama-3.1-8B has 32 query heads: Ulysses over 64 GPUs cannot split them.
        let e = table(&p, Some(fixed(64, CpComm::Ulysses)), vec![4096])
            .unwrap_err()
            .to_string();
        assert!(e.contains("32 query heads"), "{e}");
    }

    /// A tensor-parallel GPU's share of the heads: Llama-3.1-70B (hidden 8,192, 64 heads of
    /// 128, 8 KV heads) at tp = 8 holds 8 heads and 1 KV head, still of 128.
    #[test]
    fn the_heads_are_the_tensor_parallel_share() {
        let model = builtins::model("llama3.1-70b").unwrap();
        let hw = builtins::hardware("h100").unwrap();
        let p = flatpipe_profiles::analytic_profile(&model, &hw, &Default::default())
            .unwrap()
            .tensor_parallel(8, true)
            .unwrap();
        assert_eq!(p.tensor_parallel, 8);
        let a = attention(&p.layers[1], p.tensor_parallel, 1024).unwrap();
        assert_eq!(
            (a.heads, a.kv_heads, a.head_dim, a.dtype_bytes),
            (8, 1, 128, 2)
        );
    }

    /// With expert parallelism too, a GPU of a cp group dispatches only its share of the
    /// tokens: each MoE layer's all-to-all at `T / cp` tokens (`c0 + c_tok T / cp`).
    #[test]
    fn the_all_to_alls_carry_the_gpus_share() {
        let model = builtins::model("mixtral-8x7b").unwrap();
        let hw = builtins::hardware("h100").unwrap();
        let p = flatpipe_profiles::analytic_profile(&model, &hw, &Default::default())
            .unwrap()
            .expert_parallel(8, 1, false)
            .unwrap();
        let costs = table(&p, Some(fixed(2, CpComm::Ring)), vec![32_768]).unwrap();
        let want: f64 = p.layers[1..3]
            .iter()
            .map(|l| l.routed.unwrap().all_to_all.time_s(16_384.0, 0.0))
            .sum();
        assert!(want > 0.0);
        let got = costs.all_to_all_ns(ComputeAction {
            stage: StageId(0),
            kind: ActionKind::F,
            microbatch: MicrobatchId(0),
        });
        assert!(
            (got as f64 - want * 1e9).abs() <= 1.0,
            "{got} vs {}",
            want * 1e9
        );
    }

    /// Every GPU of a cp group holds the whole stage, so the optimizer shards over the `dp`
    /// replicas times the group (Megatron-Core's data-parallel group with context parallel):
    /// ZeRO-1 at dp = 2 and cp = 2 holds `2 + 4 + 12 / 4` bytes per parameter, as dp = 4
    /// without cp does.
    #[test]
    fn the_optimizer_shards_over_dp_times_cp() {
        use crate::costs::sharding::Sharding;
        let p = profile(false);
        let stages = [Range { start: 1, end: 3 }];
        let params: u64 = p.layers[1..3].iter().map(|l| l.param_count).sum();
        let bytes = |dp: u32, cp: Option<ContextParallel>| {
            let t = TableCosts::with_options(
                &p,
                &stages,
                &Placement::looped(1, 1),
                &[Microbatch::flat(vec![8192])],
                &[],
                &CostOptions {
                    sharding: Sharding::Zero1,
                    dp,
                    context_parallel: cp,
                    ..Default::default()
                },
            )
            .unwrap();
            t.static_bytes(crate::ir::Rank(0))
        };
        let want = params as f64 * (2.0 + 4.0 + 12.0 / 4.0);
        let got = bytes(2, Some(fixed(2, CpComm::Ring)));
        assert!((got - want).abs() < 1e-6 * want, "{got} vs {want}");
        assert_eq!(got, bytes(4, None));
        assert!(bytes(2, None) > got);
    }
}
