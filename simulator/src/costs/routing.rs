//! The router model: how unevenly a mixture-of-experts layer's tokens reach the GPUs of an
//! expert-parallel group.
//!
//! A true token is routed to `top_k` experts spread evenly over the experts in expectation (a
//! router trained with a load-balancing loss; the fluctuation of a microbatch's thousands of
//! routed copies around the mean is not modelled). Padding is different: every padding token
//! of a padded or packed microbatch has the same embedding, so the router gives all of them the
//! same `top_k` experts (the seed essay's point: identical inputs choose identical experts). The
//! padding's experts are drawn once per layer, uniformly without replacement (a deterministic
//! stream seeded by the layer's index: which experts a real router prefers for the pad token no
//! profile records), and the experts are laid out on the `ep` GPUs in contiguous blocks of
//! `experts / ep`, as Megatron-LM and torchtitan place them.
//!
//! With `h` of the padding's experts on the busiest GPU and a padding fraction `p` of the
//! microbatch's computed tokens, that GPU receives `(1 - p) T k / ep + p T h` routed tokens
//! against a mean of `T k / ep`: an imbalance `1 + p (ep h / k - 1)` (1 for flat microbatches,
//! which carry no padding).

/// The most of the padding token's `top_k` experts one GPU holds, for layer `layer` with
/// `experts` routed experts over `ep` GPUs (`ep` divides `experts`; `top_k <= experts`).
pub fn padding_experts_on_busiest(layer: usize, experts: u64, top_k: u64, ep: u32) -> u64 {
    let ep = u64::from(ep.max(1));
    if experts == 0 || top_k == 0 {
        return 0;
    }
    let per_gpu = (experts / ep).max(1);
    // Floyd's sampling of top_k distinct experts from a splitmix64 stream.
    let mut state = 0x9e37_79b9_7f4a_7c15u64 ^ (layer as u64).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    let mut next = |bound: u64| {
        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        (z ^ (z >> 31)) % bound
    };
    let mut chosen: Vec<u64> = Vec::with_capacity(top_k as usize);
    for j in (experts - top_k)..experts {
        let t = next(j + 1);
        chosen.push(if chosen.contains(&t) { j } else { t });
    }
    let mut per_rank = vec![0u64; ep as usize];
    for e in chosen {
        per_rank[((e / per_gpu).min(ep - 1)) as usize] += 1;
    }
    per_rank.into_iter().max().unwrap_or(0)
}

/// The busiest GPU's routed tokens over the mean: `1 + p (ep h / k - 1)` for a padding fraction
/// `p` of the computed tokens and `h` of the padding's `k` experts on that GPU.
pub fn imbalance(padding_fraction: f64, hot: u64, top_k: u64, ep: u32) -> f64 {
    if top_k == 0 {
        return 1.0;
    }
    let excess = f64::from(ep) * hot as f64 / top_k as f64 - 1.0;
    1.0 + padding_fraction.clamp(0.0, 1.0) * excess.max(0.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flat_microbatches_are_balanced_and_padding_is_not() {
        // No padding: the mean.
        assert_eq!(imbalance(0.0, 3, 8, 8), 1.0);
        // All 8 of the padding's experts on one of 8 GPUs, half the tokens padding: that GPU
        // gets 0.5 T x 8 / 8 + 0.5 T x 8 = 4.5 T routed tokens against a mean of T.
        assert!((imbalance(0.5, 8, 8, 8) - 4.5).abs() < 1e-12);
        // One of them per GPU: even, whatever the padding.
        assert_eq!(imbalance(0.9, 1, 8, 8), 1.0);
        // Without expert parallelism the one GPU holds all k: balanced.
        assert_eq!(imbalance(0.7, 8, 8, 1), 1.0);
    }

    #[test]
    fn the_padding_experts_are_k_distinct_experts_and_deterministic() {
        for layer in 0..50 {
            let h = padding_experts_on_busiest(layer, 128, 8, 8);
            assert!((1..=8).contains(&h), "{layer}: {h}");
            assert_eq!(h, padding_experts_on_busiest(layer, 128, 8, 8));
            // One GPU holds every expert: all k on it.
            assert_eq!(padding_experts_on_busiest(layer, 128, 8, 1), 8);
            // As many GPUs as experts: one each.
            assert_eq!(padding_experts_on_busiest(layer, 8, 8, 8), 1);
        }
        // Over many layers, 8 draws into 8 blocks of 16 put 2 or more on some GPU almost always
        // (8 distinct experts fall in 8 different blocks with a chance of about 0.3%).
        let spread = (0..200)
            .filter(|&l| padding_experts_on_busiest(l, 128, 8, 8) == 1)
            .count();
        assert!(spread < 20, "{spread}");
    }
}
