//! Microbatches: a list of sequences, flat (`[T]` tokens with `cu_seqlens`), padded
//! (`[B, S]`) or packed into rows with a dense block-causal mask.

use crate::{Error, Result};
use serde::{Deserialize, Serialize};

/// How a microbatch's sequences are laid out for the kernels, which decides what they compute.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Shape {
    /// Flat `[T]` tokens with `cu_seqlens` (varlen attention): computes exactly the true tokens
    /// and `Σ s_i (s_i + 1) / 2` attention pairs.
    #[default]
    Flat,
    /// `[B, S]`: `rows` sequences each padded to `seq_len`; computes `B * S` tokens and
    /// `B * S (S + 1) / 2` pairs (a causal kernel over the padding).
    Padded {
        /// B.
        rows: u32,
        /// S.
        seq_len: u32,
    },
    /// Greedy packing into `rows` rows of `row_len` tokens with a dense block-causal mask (the
    /// torchtune `PackedDataset` style): computes `rows * row_len` tokens and, because a dense
    /// masked kernel computes the whole block, `rows * row_len²` pairs (the seed essay's `n·M²`).
    /// A sequence longer than a row gets a row of its own length `s` (`s` tokens, `s²` pairs),
    /// so every policy trains on the same whole sequences; those rows are `long_tokens` and
    /// `long_pairs`.
    Packed {
        /// n, rows of `row_len`.
        rows: u32,
        /// M.
        row_len: u32,
        /// Σ s over the sequences longer than M (each a row of its own).
        long_tokens: u64,
        /// Σ s² over the sequences longer than M.
        long_pairs: u64,
    },
}

/// Where a chunk sits in its sequence: a sequence longer than the token budget cut along the
/// token dimension (TeraPipe, Li et al. ICML 2021; Seq1F1B, Ao et al. 2024).
///
/// Chunk `index` covers tokens `offset .. offset + len` of its sequence. Its queries attend
/// causally to themselves and to every earlier chunk's keys, so its forward on a stage needs
/// that stage's keys and values of the earlier chunks, and its input-gradient pass produces
/// their key/value gradients: on each stage a sequence's forwards run in chunk order and its
/// backwards in reverse chunk order ([`crate::ir::Schedule::chunks`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Chunk {
    /// The sequence's index in the replica's share of the step.
    pub sequence: u32,
    /// 0-based chunk index within the sequence.
    pub index: u32,
    /// Chunks the sequence was cut into.
    pub of: u32,
    /// Tokens of the sequence before this chunk (`o_k`).
    pub offset: u32,
}

/// One microbatch: the lengths of the sequences it holds and their layout.
///
/// `tokens = Σ s_i` (true tokens), `attn_pairs = Σ s_i (s_i + 1) / 2` (the query-key pairs
/// causal attention needs with no attention across sequence boundaries),
/// `cu_seqlens = [0, s_0, s_0 + s_1, ..]`. A chunk of a longer sequence ([`Chunk`]) holds one
/// sequence of `c` tokens at offset `o` and computes `c (c + 1) / 2 + c o` pairs. What the
/// kernels compute depends on the [`Shape`]: [`Microbatch::computed_tokens`] and
/// [`Microbatch::computed_attn_pairs`].
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Microbatch {
    /// Sequence lengths in tokens.
    pub seq_lens: Vec<u32>,
    /// Layout (flat unless a padded or packed policy made it).
    #[serde(default)]
    pub shape: Shape,
    /// Set when the microbatch is one chunk of a sequence longer than the token budget (it
    /// then holds exactly that chunk: `seq_lens == [len]`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub chunk: Option<Chunk>,
}

impl Microbatch {
    /// True token count `T`.
    pub fn tokens(&self) -> u64 {
        self.seq_lens.iter().map(|&s| s as u64).sum()
    }

    /// Causal attention query-key pairs: `Σ s (s + 1) / 2`; a chunk of `c` tokens at offset
    /// `o` also attends to the `o` earlier tokens of its sequence: `c (c + 1) / 2 + c o`
    /// (over a sequence's chunks these sum to the unsplit `s (s + 1) / 2`).
    pub fn attn_pairs(&self) -> u64 {
        let own = self
            .seq_lens
            .iter()
            .map(|&s| s as u64 * (s as u64 + 1) / 2)
            .fold(0, u64::saturating_add);
        match self.chunk {
            Some(c) => own.saturating_add(self.tokens() * c.offset as u64),
            None => own,
        }
    }

    /// Tokens the kernels process: true tokens plus padding.
    pub fn computed_tokens(&self) -> u64 {
        match self.shape {
            Shape::Flat => self.tokens(),
            Shape::Padded { rows, seq_len } => rows as u64 * seq_len as u64,
            Shape::Packed {
                rows,
                row_len,
                long_tokens,
                ..
            } => rows as u64 * row_len as u64 + long_tokens,
        }
    }

    /// Attention query-key pairs the kernels compute.
    pub fn computed_attn_pairs(&self) -> u64 {
        match self.shape {
            Shape::Flat => self.attn_pairs(),
            Shape::Padded { rows, seq_len } => {
                rows as u64 * (seq_len as u64 * (seq_len as u64 + 1) / 2)
            }
            Shape::Packed {
                rows,
                row_len,
                long_pairs,
                ..
            } => rows as u64 * row_len as u64 * row_len as u64 + long_pairs,
        }
    }

    /// A flat microbatch of these sequences.
    pub fn flat(seq_lens: Vec<u32>) -> Self {
        Microbatch {
            seq_lens,
            shape: Shape::Flat,
            chunk: None,
        }
    }

    /// The chunks of sequence `sequence` (`len` tokens) cut into `ceil(len / chunk_tokens)`
    /// flat microbatches of near-equal length (they differ by at most one token), each at most
    /// `chunk_tokens`, in chunk order.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when `chunk_tokens` is 0.
    pub fn chunks(sequence: u32, len: u32, chunk_tokens: u64) -> Result<Vec<Microbatch>> {
        if chunk_tokens == 0 {
            return Err(Error::invalid("chunk_tokens", 0, ">= 1 token"));
        }
        let of = (len as u64).div_ceil(chunk_tokens).max(1) as u32;
        let (base, extra) = (len / of, len % of);
        let mut offset = 0u32;
        Ok((0..of)
            .map(|index| {
                let c = base + u32::from(index < extra);
                let mb = Microbatch {
                    seq_lens: vec![c],
                    shape: Shape::Flat,
                    chunk: Some(Chunk {
                        sequence,
                        index,
                        of,
                        offset,
                    }),
                };
                offset += c;
                mb
            })
            .collect())
    }

    /// Cumulative sequence boundaries `[0, s_0, s_0 + s_1, .., T]` (length `n + 1`).
    pub fn cu_seqlens(&self) -> Vec<u64> {
        let mut out = Vec::with_capacity(self.seq_lens.len() + 1);
        let mut acc = 0u64;
        out.push(0);
        for &s in &self.seq_lens {
            acc += s as u64;
            out.push(acc);
        }
        out
    }
}

/// A sequence longer than the token budget; it got a microbatch of its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Oversize {
    /// Index of the sequence in the step.
    pub index: usize,
    /// Its length in tokens.
    pub tokens: u32,
}

/// Packs a step's sequences into the fewest microbatches of at most `budget` tokens by first-fit
/// decreasing (Johnson 1973: at most 11/9 OPT + 6/9 bins). A sequence longer than the budget gets
/// a microbatch of its own and is reported in the second return value.
///
/// # Errors
/// [`Error::InvalidArgument`] if `budget` is 0 or the step is empty.
pub fn pack_token_budget(seqs: &[u32], budget: u64) -> Result<(Vec<Microbatch>, Vec<Oversize>)> {
    if budget == 0 {
        return Err(Error::invalid("token_budget", 0, ">= 1 token"));
    }
    if seqs.is_empty() {
        return Err(Error::invalid("sequences per step", 0, ">= 1"));
    }
    let mut order: Vec<usize> = (0..seqs.len()).collect();
    order.sort_by_key(|&i| (std::cmp::Reverse(seqs[i]), i));
    let mut bins: Vec<(u64, Microbatch)> = Vec::new();
    let mut oversize = Vec::new();
    for i in order {
        let s = seqs[i] as u64;
        if s > budget {
            oversize.push(Oversize {
                index: i,
                tokens: seqs[i],
            });
            bins.push((s, Microbatch::flat(vec![seqs[i]])));
            continue;
        }
        match bins.iter_mut().find(|(t, _)| *t + s <= budget) {
            Some((t, mb)) => {
                *t += s;
                mb.seq_lens.push(seqs[i]);
            }
            None => bins.push((s, Microbatch::flat(vec![seqs[i]]))),
        }
    }
    Ok((bins.into_iter().map(|(_, mb)| mb).collect(), oversize))
}

/// Splits a step's sequences into exactly `m` microbatches balanced by predicted cost, by
/// longest-processing-time-first (Graham 1969: makespan at most 4/3 OPT): sequences in
/// decreasing cost order, each to the microbatch with the least cost so far. `cost(tokens,
/// attn_pairs)` predicts one sequence's time (attention included).
///
/// # Errors
/// [`Error::InvalidArgument`] if `m` is 0 or exceeds the number of sequences.
pub fn split_balanced(
    seqs: &[u32],
    m: usize,
    cost: impl Fn(u64, u64) -> f64,
) -> Result<Vec<Microbatch>> {
    if m == 0 || m > seqs.len() {
        return Err(Error::invalid(
            "microbatches",
            m,
            format!(
                "in 1..={} (each microbatch needs at least one of the step's {} sequences)",
                seqs.len(),
                seqs.len()
            ),
        ));
    }
    let c = |s: u32| cost(s as u64, s as u64 * (s as u64 + 1) / 2);
    let mut order: Vec<usize> = (0..seqs.len()).collect();
    order.sort_by(|&a, &b| c(seqs[b]).total_cmp(&c(seqs[a])).then(a.cmp(&b)));
    let mut load = vec![0.0f64; m];
    let mut out = vec![Microbatch::default(); m];
    for i in order {
        let (k, _) = load
            .iter()
            .enumerate()
            .min_by(|a, b| a.1.total_cmp(b.1).then(a.0.cmp(&b.0)))
            .expect("m >= 1");
        load[k] += c(seqs[i]);
        out[k].seq_lens.push(seqs[i]);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flat_accounting_uses_true_tokens() {
        // 8 documents of 1,024 tokens: 8 * 1024 * 1025 / 2 pairs, vs 8192 * 8193 / 2 for one document.
        let mb = Microbatch::flat(vec![1024; 8]);
        assert_eq!(mb.tokens(), 8192);
        assert_eq!(mb.attn_pairs(), 4_198_400);
        let one = Microbatch::flat(vec![8192]);
        assert_eq!(mb.attn_pairs() * 8193, one.attn_pairs() * 1025);
        assert_eq!(mb.cu_seqlens().last(), Some(&8192));
        assert_eq!(mb.cu_seqlens().len(), 9);
    }

    #[test]
    fn chunk_pairs_by_hand() {
        // 10 tokens in chunks of at most 4: 3 chunks of 4, 3, 3 at offsets 0, 4, 7.
        let c = Microbatch::chunks(5, 10, 4).unwrap();
        let lens: Vec<(u32, u32)> = c
            .iter()
            .map(|m| (m.seq_lens[0], m.chunk.unwrap().offset))
            .collect();
        assert_eq!(lens, vec![(4, 0), (3, 4), (3, 7)]);
        // Pairs by hand: 4*5/2 = 10; 3*4/2 + 3*4 = 18; 3*4/2 + 3*7 = 27; sum 55 = 10*11/2.
        let pairs: Vec<u64> = c.iter().map(Microbatch::attn_pairs).collect();
        assert_eq!(pairs, vec![10, 18, 27]);
        assert_eq!(pairs.iter().sum::<u64>(), 55);
        assert!(
            c.iter()
                .all(|m| m.chunk.unwrap().of == 3 && m.chunk.unwrap().sequence == 5)
        );
        // A sequence within the chunk size is one chunk at offset 0.
        assert_eq!(Microbatch::chunks(0, 4, 4).unwrap().len(), 1);
        assert!(Microbatch::chunks(0, 4, 0).is_err());
    }

    #[test]
    fn ffd_respects_budget_and_flags_oversize() {
        let (mbs, over) = pack_token_budget(&[6, 5, 4, 3, 2, 20], 10).unwrap();
        assert_eq!(
            over,
            vec![Oversize {
                index: 5,
                tokens: 20
            }]
        );
        // FFD by hand: 20 | 6+4 | 5+3+2
        assert_eq!(
            mbs.iter().map(|m| m.seq_lens.clone()).collect::<Vec<_>>(),
            vec![vec![20], vec![6, 4], vec![5, 3, 2]]
        );
    }

    #[test]
    fn lpt_makes_exactly_m() {
        let mbs = split_balanced(&[5, 5, 4, 3, 3, 1], 3, |t, _| t as f64).unwrap();
        let mut loads: Vec<u64> = mbs.iter().map(Microbatch::tokens).collect();
        loads.sort_unstable();
        // LPT by hand: 5->a, 5->b, 4->c, 3->c (7), 3->a (8), 1->b (6). (The optimum 7/7/7 is
        // within LPT's 4/3 bound.)
        assert_eq!(loads, vec![6, 7, 8]);
        assert!(split_balanced(&[1, 2], 3, |t, _| t as f64).is_err());
    }
}
