//! A step's real input: token ids, labels and loss weights of every microbatch, and the explicit
//! loss reduction (DESIGN point 5).

use rand::{RngExt, SeedableRng, rngs::ChaCha8Rng};
use serde::{Deserialize, Serialize};

/// How token losses become the step's loss.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum LossReduction {
    /// `Σ token losses over every microbatch / true token count of the step` (the default; what
    /// one big batch computes).
    #[default]
    PerToken,
    /// Mean over sequences of each sequence's mean token loss.
    PerSequence,
}

impl LossReduction {
    /// The command-line name.
    pub fn name(self) -> &'static str {
        match self {
            LossReduction::PerToken => "per-token",
            LossReduction::PerSequence => "per-sequence",
        }
    }
}

/// Reduces per-microbatch `(loss sum, token count)` pairs with the per-token rule:
/// `Σ loss_sum / Σ tokens`. Not the mean of per-microbatch means: microbatches of 2 tokens with
/// loss sum 2.0 and of 8 tokens with loss sum 4.0 give 6 / 10 = 0.6, not (1.0 + 0.5) / 2 = 0.75.
pub fn per_token_mean(parts: &[(f64, u64)]) -> f64 {
    let (sum, tokens) = parts
        .iter()
        .fold((0.0, 0u64), |(s, t), &(ls, n)| (s + ls, t + n));
    if tokens == 0 {
        0.0
    } else {
        sum / tokens as f64
    }
}

/// One microbatch's data: a flat `[T]` token list with `cu_seqlens`.
#[derive(Debug, Clone, PartialEq)]
pub struct MicrobatchData {
    /// Sequence lengths.
    pub seq_lens: Vec<u32>,
    /// `[0, s_0, s_0 + s_1, .., T]`, length `seq_lens.len() + 1`.
    pub cu_seqlens: Vec<usize>,
    /// Input token ids `[T]`.
    pub ids: Vec<u32>,
    /// Next-token labels `[T]` (every input token has one: sequence `i` draws `s_i + 1` ids).
    pub labels: Vec<u32>,
    /// Loss weight of every token `[T]`, from the step's [`LossReduction`]: the step's loss is
    /// `Σ_t weight_t * loss_t` over all microbatches, so gradients need no later rescaling.
    pub loss_weights: Vec<f32>,
}

impl MicrobatchData {
    /// True token count `T`.
    pub fn tokens(&self) -> usize {
        self.ids.len()
    }
}

/// Token ids of one sequence: a seeded Markov chain over `vocab` ids (next = `(31 prev + 7) mod V`
/// with probability 3/4, else uniform), so that a model can learn it and the loss falls.
fn sequence_ids(rng: &mut ChaCha8Rng, len: usize, vocab: u32) -> Vec<u32> {
    let mut ids = Vec::with_capacity(len);
    let mut prev = rng.random_range(0..vocab);
    ids.push(prev);
    for _ in 1..len {
        prev = if rng.random_range(0..4u32) < 3 {
            (prev.wrapping_mul(31).wrapping_add(7)) % vocab
        } else {
            rng.random_range(0..vocab)
        };
        ids.push(prev);
    }
    ids
}

/// Builds every replica's microbatches of one step. `replicas[d][k]` holds the sequence lengths
/// of replica d's microbatch k. Token ids come from `(seed, step, d, k, sequence)`; loss weights
/// come from `reduction` over the whole step (all replicas), so summing the replicas' gradients
/// gives the step's gradient.
pub fn build_step(
    replicas: &[Vec<Vec<u32>>],
    vocab: u32,
    seed: u64,
    step: u64,
    reduction: LossReduction,
) -> Vec<Vec<MicrobatchData>> {
    let all = replicas.iter().flatten().flatten();
    let total_tokens: u64 = all.clone().map(|&s| s as u64).sum();
    let total_seqs = all.count() as u64;
    replicas
        .iter()
        .enumerate()
        .map(|(d, mbs)| {
            mbs.iter()
                .enumerate()
                .map(|(k, seqs)| {
                    let mut data = MicrobatchData {
                        seq_lens: seqs.clone(),
                        cu_seqlens: vec![0],
                        ids: Vec::new(),
                        labels: Vec::new(),
                        loss_weights: Vec::new(),
                    };
                    for (i, &s) in seqs.iter().enumerate() {
                        let key = seed
                            ^ step.wrapping_mul(0x9E37_79B9_7F4A_7C15)
                            ^ ((d as u64) << 48)
                            ^ ((k as u64) << 24)
                            ^ i as u64;
                        let mut rng = ChaCha8Rng::seed_from_u64(key);
                        let ids = sequence_ids(&mut rng, s as usize + 1, vocab);
                        data.ids.extend_from_slice(&ids[..s as usize]);
                        data.labels.extend_from_slice(&ids[1..]);
                        let w = match reduction {
                            LossReduction::PerToken => 1.0 / total_tokens as f64,
                            LossReduction::PerSequence => 1.0 / (total_seqs as f64 * s as f64),
                        };
                        data.loss_weights
                            .extend(std::iter::repeat_n(w as f32, s as usize));
                        data.cu_seqlens.push(data.ids.len());
                    }
                    data
                })
                .collect()
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn per_token_mean_is_not_the_mean_of_means() {
        // The bug class of DESIGN point 5: 2 tokens with loss sum 2.0, 8 tokens with 4.0.
        let parts = [(2.0, 2), (4.0, 8)];
        assert!((per_token_mean(&parts) - 0.6).abs() < 1e-12);
        let mean_of_means = (2.0 / 2.0 + 4.0 / 8.0) / 2.0;
        assert!((mean_of_means - 0.75f64).abs() < 1e-12);
    }

    #[test]
    fn weights_reduce_like_one_big_batch() {
        let step = build_step(
            &[vec![vec![2], vec![5, 3]], vec![vec![4]]],
            100,
            1,
            0,
            LossReduction::PerToken,
        );
        // Per token: every weight 1/14, summing to 1 over the step.
        let sum: f64 = step
            .iter()
            .flatten()
            .flat_map(|m| &m.loss_weights)
            .map(|&w| w as f64)
            .sum();
        assert!((sum - 1.0).abs() < 1e-6, "{sum}");
        // Per sequence: each sequence's weights sum to 1 / 4.
        let seq = build_step(&[vec![vec![2, 6]]], 100, 1, 0, LossReduction::PerSequence);
        let w = &seq[0][0].loss_weights;
        let first: f32 = w[..2].iter().sum();
        let second: f32 = w[2..].iter().sum();
        assert!((first - 0.5).abs() < 1e-6 && (second - 0.5).abs() < 1e-6);
        assert_eq!(seq[0][0].cu_seqlens, vec![0, 2, 8]);
        // Labels are the next ids: within a sequence, label[t] == id[t + 1].
        let m = &seq[0][0];
        assert_eq!(m.labels[0], m.ids[1]);
        assert_eq!(m.labels[2], m.ids[3]);
    }
}
