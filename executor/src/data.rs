//! A step's real input: token ids, labels and loss weights of every microbatch, and the explicit
//! loss reduction (design point 5 in docs/design.md).

use flatpipe_simulator::Microbatch;
use flatpipe_simulator::batching::microbatch::Chunk;
use rand::{RngExt, SeedableRng, rngs::ChaCha8Rng};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;

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
    /// Set when the microbatch is one chunk of a longer sequence: it holds that sequence's tokens
    /// `offset .. offset + T` (ids, labels and weights those of the whole sequence), and its
    /// queries sit at positions `offset ..` and attend to the earlier chunks' keys.
    pub chunk: Option<Chunk>,
    /// Set when the microbatch is one GPU's share of a microbatch under context parallelism:
    /// its rows are the pieces [`CpShare::pieces`] of the whole microbatch's documents, each
    /// piece a sequence of `cu_seqlens` whose queries sit at positions `offset ..` of its
    /// document and attend to that document's keys, gathered from the group.
    pub cp: Option<CpShare>,
}

/// `len` tokens of document `doc` of a microbatch, from position `offset` of that document.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CpPiece {
    /// The document's index in the whole microbatch.
    pub doc: usize,
    /// First position in the document.
    pub offset: usize,
    /// Tokens.
    pub len: usize,
}

/// One GPU's share of a microbatch in a context-parallel group of `cp`: the zigzag split of
/// every document (Megatron-LM's load-balanced split, `get_batch_on_this_cp_rank`; THD
/// packing splits each document alike): a document of `L` tokens is cut into `2 cp` chunks,
/// chunk `j` its positions `[L j / 2cp, L (j + 1) / 2cp)`, and GPU `i` takes chunks `i` and
/// `2 cp - 1 - i`, so every GPU gets about the same causal work.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CpShare {
    /// This GPU's index in the group.
    pub index: usize,
    /// GPUs in the group, >= 1.
    pub cp: usize,
    /// Tokens of every document of the whole microbatch.
    pub doc_lens: Vec<usize>,
    /// This GPU's pieces, in row order (document by document, earlier chunk first; empty
    /// chunks of short documents left out).
    pub pieces: Vec<CpPiece>,
}

impl CpShare {
    /// The pieces GPU `index` of `cp` takes of documents of `doc_lens` tokens (see
    /// [`CpShare`]).
    pub fn zigzag_pieces(doc_lens: &[usize], index: usize, cp: usize) -> Vec<CpPiece> {
        let n = 2 * cp.max(1);
        let mut out = Vec::new();
        for (doc, &len) in doc_lens.iter().enumerate() {
            let bound = |j: usize| len * j / n;
            for j in [index, n - 1 - index] {
                let (a, b) = (bound(j), bound(j + 1));
                if b > a
                    && !out.contains(&CpPiece {
                        doc,
                        offset: a,
                        len: b - a,
                    })
                {
                    out.push(CpPiece {
                        doc,
                        offset: a,
                        len: b - a,
                    });
                }
            }
        }
        out
    }

    /// The pieces of GPU `index` of this group.
    pub fn pieces_of(&self, index: usize) -> Vec<CpPiece> {
        Self::zigzag_pieces(&self.doc_lens, index, self.cp)
    }
}

impl MicrobatchData {
    /// True token count `T`.
    pub fn tokens(&self) -> usize {
        self.ids.len()
    }

    /// GPU `index`'s share of this microbatch in a context-parallel group of `cp`
    /// ([`CpShare`]): its rows of the ids, labels and loss weights (the step's weights, so the
    /// group's gradients add up to the whole microbatch's), its pieces as sequences.
    ///
    /// # Errors
    /// [`crate::Error::Invalid`] for a chunk of a longer sequence or a share already, `cp` 0 or
    /// `index >= cp`.
    pub fn cp_share(&self, index: usize, cp: usize) -> crate::Result<MicrobatchData> {
        if self.chunk.is_some() || self.cp.is_some() || cp == 0 || index >= cp {
            return Err(crate::Error::Invalid(format!(
                "context-parallel share {index} of {cp}: a whole microbatch (not a chunk or a share) and an index below cp >= 1"
            )));
        }
        let doc_lens: Vec<usize> = self.cu_seqlens.windows(2).map(|w| w[1] - w[0]).collect();
        let pieces = CpShare::zigzag_pieces(&doc_lens, index, cp);
        let mut out = MicrobatchData {
            seq_lens: Vec::with_capacity(pieces.len()),
            cu_seqlens: vec![0],
            ids: Vec::new(),
            labels: Vec::new(),
            loss_weights: Vec::new(),
            chunk: None,
            cp: None,
        };
        for p in &pieces {
            let rows = self.cu_seqlens[p.doc] + p.offset..self.cu_seqlens[p.doc] + p.offset + p.len;
            out.ids.extend_from_slice(&self.ids[rows.clone()]);
            out.labels.extend_from_slice(&self.labels[rows.clone()]);
            out.loss_weights.extend_from_slice(&self.loss_weights[rows]);
            out.seq_lens.push(p.len as u32);
            out.cu_seqlens.push(out.ids.len());
        }
        out.cp = Some(CpShare {
            index,
            cp,
            doc_lens,
            pieces,
        });
        Ok(out)
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
    let flat: Vec<Vec<Microbatch>> = replicas
        .iter()
        .map(|mbs| mbs.iter().map(|s| Microbatch::flat(s.clone())).collect())
        .collect();
    build_step_of(&flat, vocab, seed, step, reduction)
}

/// [`build_step`] from the planned microbatches, chunks of longer sequences included. A
/// sequence's ids are drawn from `(seed, step, its length, j)`, j counting the step's earlier
/// sequences of that length (over every replica, in microbatch order): the step's multiset of
/// (length, tokens) is the same however the plan packs, splits over replicas or chunks it, so
/// its loss does not depend on the plan. A chunk's ids, labels and weights are its rows of its
/// whole sequence (the chunks of a sequence and the sequence unsplit hold the same tokens), and
/// under the per-sequence reduction a chunked sequence counts once, with its whole length.
pub fn build_step_of(
    replicas: &[Vec<Microbatch>],
    vocab: u32,
    seed: u64,
    step: u64,
    reduction: LossReduction,
) -> Vec<Vec<MicrobatchData>> {
    // Whole length of every chunked sequence, by (replica, sequence).
    let mut whole: HashMap<(usize, u32), u64> = HashMap::new();
    let (mut total_tokens, mut total_seqs) = (0u64, 0u64);
    for (d, mbs) in replicas.iter().enumerate() {
        for mb in mbs {
            total_tokens += mb.tokens();
            match mb.chunk {
                Some(c) => {
                    *whole.entry((d, c.sequence)).or_default() += mb.tokens();
                    total_seqs += u64::from(c.index == 0);
                }
                None => total_seqs += mb.seq_lens.len() as u64,
            }
        }
    }
    let base = seed ^ step.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    // Per length: how many of the step's sequences of that length have had their ids drawn; a
    // chunked sequence's draw is kept for its later chunks.
    let mut drawn: HashMap<u64, u64> = HashMap::new();
    let mut chunk_key: HashMap<(usize, u32), u64> = HashMap::new();
    let mut key_of = |len: u64| -> u64 {
        let j = drawn.entry(len).or_default();
        let key =
            base ^ len.wrapping_mul(0xD6E8_FEB8_6659_FD93) ^ j.wrapping_mul(0xA076_1D64_78BD_642F);
        *j += 1;
        key
    };
    let weight = |s: u64| match reduction {
        LossReduction::PerToken => 1.0 / total_tokens as f64,
        LossReduction::PerSequence => 1.0 / (total_seqs as f64 * s as f64),
    };
    replicas
        .iter()
        .enumerate()
        .map(|(d, mbs)| {
            mbs.iter()
                .map(|mb| {
                    let mut data = MicrobatchData {
                        seq_lens: mb.seq_lens.clone(),
                        cu_seqlens: vec![0],
                        ids: Vec::new(),
                        labels: Vec::new(),
                        loss_weights: Vec::new(),
                        chunk: mb.chunk,
                        cp: None,
                    };
                    for &s in &mb.seq_lens {
                        let (key, len, from) = match mb.chunk {
                            Some(c) => {
                                let len = whole[&(d, c.sequence)];
                                let key = *chunk_key
                                    .entry((d, c.sequence))
                                    .or_insert_with(|| key_of(len));
                                (key, len as usize, c.offset as usize)
                            }
                            None => (key_of(u64::from(s)), s as usize, 0),
                        };
                        let mut rng = ChaCha8Rng::seed_from_u64(key);
                        let ids = sequence_ids(&mut rng, len + 1, vocab);
                        let rows = from..from + s as usize;
                        data.ids.extend_from_slice(&ids[rows.clone()]);
                        data.labels
                            .extend_from_slice(&ids[rows.start + 1..rows.end + 1]);
                        let w = weight(len as u64);
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

/// One replica's microbatches with every chunked sequence's chunks joined back into one
/// microbatch of the whole sequence (in the place of its first chunk): what a run without
/// chunks computes on the same tokens (the `--verify` reference).
pub fn join_chunks(microbatches: &[MicrobatchData]) -> Vec<MicrobatchData> {
    let mut out: Vec<MicrobatchData> = Vec::with_capacity(microbatches.len());
    // sequence -> its index in `out`; chunks are joined in chunk order.
    let mut at: HashMap<u32, usize> = HashMap::new();
    let mut chunks: Vec<&MicrobatchData> =
        microbatches.iter().filter(|m| m.chunk.is_some()).collect();
    chunks.sort_by_key(|m| m.chunk.map(|c| (c.sequence, c.index)));
    for mb in microbatches {
        match mb.chunk {
            None => out.push(mb.clone()),
            Some(c) if c.index == 0 => {
                at.insert(c.sequence, out.len());
                let mut whole = mb.clone();
                whole.chunk = None;
                out.push(whole);
            }
            Some(_) => {}
        }
    }
    for mb in chunks {
        let c = mb.chunk.expect("filtered");
        if c.index == 0 {
            continue;
        }
        if let Some(&i) = at.get(&c.sequence) {
            let w = &mut out[i];
            w.ids.extend_from_slice(&mb.ids);
            w.labels.extend_from_slice(&mb.labels);
            w.loss_weights.extend_from_slice(&mb.loss_weights);
            w.seq_lens[0] += mb.seq_lens[0];
            w.cu_seqlens = vec![0, w.ids.len()];
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The zigzag split by hand: 8 tokens over cp = 2 are chunks [0,2) [2,4) [4,6) [6,8), GPU 0
    /// taking the first and last, GPU 1 the middle two; a 3-token document gives GPU 0 chunks
    /// [0,0) and [2,3), GPU 1 [0,1) and [1,2). Every token is in exactly one share, and the
    /// causal pairs of a long document split evenly.
    #[test]
    fn the_zigzag_split_covers_every_token_once_and_balances_pairs() {
        let p = |doc, offset, len| CpPiece { doc, offset, len };
        assert_eq!(
            CpShare::zigzag_pieces(&[8, 3], 0, 2),
            vec![p(0, 0, 2), p(0, 6, 2), p(1, 2, 1)]
        );
        assert_eq!(
            CpShare::zigzag_pieces(&[8, 3], 1, 2),
            vec![p(0, 2, 2), p(0, 4, 2), p(1, 0, 1), p(1, 1, 1)]
        );
        let lens = [1000usize, 7, 5, 1];
        for cp in [1, 2, 4] {
            let mut seen: Vec<Vec<bool>> = lens.iter().map(|&l| vec![false; l]).collect();
            let mut pairs = Vec::new();
            for i in 0..cp {
                let mut mine = 0usize;
                for q in CpShare::zigzag_pieces(&lens, i, cp) {
                    for (t, s) in seen[q.doc]
                        .iter_mut()
                        .enumerate()
                        .skip(q.offset)
                        .take(q.len)
                    {
                        assert!(!*s, "token {t} of doc {} twice", q.doc);
                        *s = true;
                        if q.doc == 0 {
                            mine += t + 1;
                        }
                    }
                }
                pairs.push(mine as f64);
            }
            assert!(seen.iter().flatten().all(|&s| s));
            let (lo, hi) = pairs
                .iter()
                .fold((f64::MAX, 0.0f64), |(a, b), &x| (a.min(x), b.max(x)));
            // 1000 = 2 cp chunks of 1000 / 2cp tokens: equal pairs up to one chunk's rounding.
            assert!(hi / lo < 1.01, "cp {cp}: {pairs:?}");
        }
        let whole = build_step(&[vec![vec![6, 3]]], 32, 1, 0, LossReduction::PerToken)
            .remove(0)
            .remove(0);
        // 6 tokens: chunks [0,1) [1,3) [3,4) [4,6); 3 tokens: [0,0) [0,1) [1,2) [2,3).
        let half = whole.cp_share(1, 2).unwrap();
        let rows = [1, 2, 3, 6, 7];
        assert_eq!(half.ids, rows.map(|r| whole.ids[r]).to_vec());
        assert_eq!(half.labels, rows.map(|r| whole.labels[r]).to_vec());
        assert_eq!(half.cu_seqlens, vec![0, 2, 3, 4, 5]);
        assert!(half.cp_share(0, 2).is_err() && whole.cp_share(2, 2).is_err());
    }

    #[test]
    fn per_token_mean_is_not_the_mean_of_means() {
        // The bug class of design point 5 in docs/design.md: 2 tokens with loss sum 2.0, 8 tokens with 4.0.
        let parts = [(2.0, 2), (4.0, 8)];
        assert!((per_token_mean(&parts) - 0.6).abs() < 1e-12);
        let mean_of_means = (2.0 / 2.0 + 4.0 / 8.0) / 2.0;
        assert!((mean_of_means - 0.75f64).abs() < 1e-12);
    }

    #[test]
    fn chunks_hold_the_rows_of_their_whole_sequence() {
        let whole = vec![vec![Microbatch::flat(vec![3]), Microbatch::flat(vec![10])]];
        let mut cut = vec![Microbatch::flat(vec![3])];
        cut.extend(Microbatch::chunks(1, 10, 4).unwrap());
        // The chunked sequence is drawn from (d, sequence): compare with a sequence drawn the
        // same way at full length, i.e. the chunks joined back.
        for reduction in [LossReduction::PerToken, LossReduction::PerSequence] {
            let step = build_step_of(&[cut.clone()], 64, 5, 2, reduction);
            assert_eq!(step[0].len(), 4);
            assert_eq!(step[0][2].chunk.unwrap().offset, 4);
            let joined = join_chunks(&step[0]);
            assert_eq!(joined.len(), 2);
            assert_eq!(joined[1].seq_lens, vec![10]);
            assert_eq!(joined[1].cu_seqlens, vec![0, 10]);
            // Labels continue across chunk boundaries: label[t] == id[t + 1].
            for t in 0..9 {
                assert_eq!(joined[1].labels[t], joined[1].ids[t + 1]);
            }
            // Weights: per token 1/13 everywhere; per sequence 1/(2 * 3) and 1/(2 * 10).
            let want = match reduction {
                LossReduction::PerToken => (1.0 / 13.0, 1.0 / 13.0),
                LossReduction::PerSequence => (1.0 / 6.0, 1.0 / 20.0),
            };
            assert!((joined[0].loss_weights[0] as f64 - want.0).abs() < 1e-7);
            assert!(
                joined[1]
                    .loss_weights
                    .iter()
                    .all(|&w| (w as f64 - want.1).abs() < 1e-7)
            );
            let plain = build_step_of(&whole, 64, 5, 2, reduction);
            assert_eq!(plain[0][1].loss_weights, joined[1].loss_weights);
        }
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
