//! Microbatching policies: how one step's sequences become microbatches.
//!
//! | policy | layout | computes per microbatch |
//! |---|---|---|
//! | `padded` | `[B, S]`, S = the step's longest sequence (or `max_seq_len`) | `B·S` tokens, `B·S(S+1)/2` pairs |
//! | `packed` | rows of M tokens, greedy in order, dense block-causal mask | `n·M` tokens, `n·M²` pairs (a longer sequence: a row of its own, `s` and `s²`) |
//! | `flat-ffd` | flat `[T]` + `cu_seqlens`, first-fit decreasing by tokens | true tokens, `Σ s(s+1)/2` pairs |
//! | `flat-balanced` | flat, balanced by predicted cost (LPT) under the token budget | true tokens, `Σ s(s+1)/2` pairs |
//! | `verl-kk` | flat, verl's dynamic batch size ([`crate::batching::verl_kk`]): Karmarkar-Karp on verl's workload, count shared over data-parallel ranks | true tokens, `Σ s(s+1)/2` pairs |
//! | `flat-planned` | flat, count, contents and order chosen per step for the schedule by the predicted step time ([`crate::run::mb_plan`]) | true tokens, `Σ s(s+1)/2` pairs |
//!
//! With an exact microbatch count (`microbatches`) both flat policies split the step into
//! exactly that many microbatches balanced by predicted cost; padded takes `ceil(n / M)`
//! sequences per microbatch and packed `ceil(rows / M)` rows.
//!
//! The padded and packed costs follow the seed essay: padding computes every `[B, S]` cell and
//! a causal kernel over it; a dense block mask computes the whole `M x M` block of every row.

use crate::batching::microbatch::{Microbatch, Oversize, Shape, pack_token_budget, split_balanced};
use crate::{Error, Result};
use std::cmp::Ordering;
use std::collections::BinaryHeap;
use std::fmt;
use std::str::FromStr;

/// A microbatching policy (in a plan file: `padded`, `packed`, `flat-ffd`, `flat-balanced`).
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "kebab-case")]
pub enum Policy {
    /// `[B, S]` padded to the step's longest sequence.
    Padded,
    /// Greedy packing into rows with a dense block-causal mask.
    Packed,
    /// Flat, first-fit decreasing by tokens under the token budget.
    FlatFfd,
    /// Flat, balanced by predicted cost (attention included) under the token budget.
    FlatBalanced,
    /// Flat, verl's dynamic batch size ([`crate::batching::verl_kk`]).
    VerlKk,
    /// Flat, planned per step for the schedule ([`crate::run::mb_plan`]); cut as `flat-ffd` where
    /// no profile predicts the step.
    FlatPlanned,
}

impl Policy {
    /// Every policy.
    pub const ALL: &'static [Policy] = &[
        Policy::Padded,
        Policy::Packed,
        Policy::FlatFfd,
        Policy::FlatBalanced,
        Policy::VerlKk,
        Policy::FlatPlanned,
    ];

    /// Whether the policy makes flat `[T]` microbatches with `cu_seqlens` (what the executor
    /// runs): every one but `padded` and `packed`.
    pub fn is_flat(self) -> bool {
        !matches!(self, Policy::Padded | Policy::Packed)
    }

    /// The command-line name.
    pub fn name(self) -> &'static str {
        match self {
            Policy::Padded => "padded",
            Policy::Packed => "packed",
            Policy::FlatFfd => "flat-ffd",
            Policy::FlatBalanced => "flat-balanced",
            Policy::VerlKk => "verl-kk",
            Policy::FlatPlanned => "flat-planned",
        }
    }
}

impl fmt::Display for Policy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Policy {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        Policy::ALL
            .iter()
            .copied()
            .find(|p| p.name() == s.trim())
            .ok_or_else(|| {
                Error::invalid(
                    "policy",
                    s,
                    "one of padded, packed, flat-ffd, flat-balanced, verl-kk, flat-planned",
                )
            })
    }
}

/// Parameters of the policies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PolicyParams {
    /// Token budget per microbatch (computed tokens, padding included), >= 1.
    pub token_budget: u64,
    /// Exactly this many microbatches instead of a token budget.
    pub microbatches: Option<u32>,
    /// Row length M of the packed policy, tokens.
    pub pack_len: u32,
    /// Padded policy: cap on S (longer sequences are truncated); `None`: the step's longest.
    pub max_seq_len: Option<u32>,
    /// Flat policies under a token budget: cut a sequence longer than the budget into chunks
    /// of at most this many tokens (1..=the budget), each a microbatch of its own, pipelined
    /// along the token dimension ([`crate::batching::microbatch::Chunk`]). `None`: such a sequence gets
    /// one microbatch of its own.
    pub chunk_tokens: Option<u64>,
}

/// The default token budget of a flat microbatch, tokens: 16,384, decided here once for
/// `simulate`, `execute` and [`PolicyParams::default`] (the planner searches 4,096 to 131,072
/// around it).
pub const DEFAULT_TOKEN_BUDGET: u64 = 16_384;

impl Default for PolicyParams {
    fn default() -> Self {
        PolicyParams {
            token_budget: DEFAULT_TOKEN_BUDGET,
            microbatches: None,
            pack_len: 4096,
            max_seq_len: None,
            chunk_tokens: None,
        }
    }
}

/// One step's microbatches under a policy.
#[derive(Debug, Clone, PartialEq)]
pub struct Batched {
    /// The microbatches.
    pub microbatches: Vec<Microbatch>,
    /// Sequences longer than the token budget (flat policies: a microbatch of their own, or
    /// chunks with `chunk_tokens`).
    pub oversize: Vec<Oversize>,
    /// Tokens cut off by `max_seq_len` (padded policy).
    pub truncated_tokens: u64,
}

/// Cuts one step's sequences into microbatches under `policy`. `cost(tokens, attn_pairs)`
/// predicts one flat microbatch's time (for `flat-balanced`).
///
/// # Errors
/// [`Error::InvalidArgument`] for a zero budget, row length or microbatch count, more
/// microbatches than the step can fill, or an empty step.
pub fn batch(
    policy: Policy,
    seqs: &[u32],
    params: &PolicyParams,
    cost: &dyn Fn(u64, u64) -> f64,
) -> Result<Batched> {
    if seqs.is_empty() {
        return Err(Error::invalid("sequences per step", 0, ">= 1"));
    }
    if params.token_budget == 0 {
        return Err(Error::invalid("token_budget", 0, ">= 1 token"));
    }
    if params.microbatches == Some(0) {
        return Err(Error::invalid("microbatches", 0, ">= 1"));
    }
    if let Some(c) = params.chunk_tokens {
        if c == 0 || c > params.token_budget {
            return Err(Error::invalid(
                "chunk_tokens",
                c,
                format!("in 1..={} (the token budget)", params.token_budget),
            ));
        }
        let own = matches!(
            policy,
            Policy::FlatFfd | Policy::FlatBalanced | Policy::FlatPlanned
        );
        if own && params.microbatches.is_none() {
            return chunked(policy, seqs, params, c, cost);
        }
    }
    let plain = |microbatches| Batched {
        microbatches,
        oversize: Vec::new(),
        truncated_tokens: 0,
    };
    match policy {
        Policy::Padded => Ok(padded(seqs, params)),
        Policy::Packed => packed(seqs, params).map(plain),
        Policy::VerlKk => match params.microbatches {
            Some(m) => split_balanced(seqs, m as usize, cost).map(plain),
            None => {
                let c = crate::batching::verl_kk::cut(
                    &[seqs.to_vec()],
                    params.token_budget,
                    1,
                    params.chunk_tokens,
                )?
                .remove(0);
                Ok(Batched {
                    microbatches: c.microbatches,
                    oversize: c.oversize,
                    truncated_tokens: 0,
                })
            }
        },
        Policy::FlatFfd | Policy::FlatPlanned => match params.microbatches {
            Some(m) => split_balanced(seqs, m as usize, cost).map(plain),
            None => {
                let (microbatches, oversize) = pack_token_budget(seqs, params.token_budget)?;
                Ok(Batched {
                    microbatches,
                    oversize,
                    truncated_tokens: 0,
                })
            }
        },
        Policy::FlatBalanced => match params.microbatches {
            Some(m) => split_balanced(seqs, m as usize, cost).map(plain),
            None => flat_balanced(seqs, params.token_budget, cost),
        },
    }
}

/// A flat policy with sequences longer than the budget cut into chunks of at most
/// `chunk_tokens`: the chunks first (each sequence's in chunk order, sequences in step order),
/// then the policy's microbatches of the other sequences.
fn chunked(
    policy: Policy,
    seqs: &[u32],
    params: &PolicyParams,
    chunk_tokens: u64,
    cost: &dyn Fn(u64, u64) -> f64,
) -> Result<Batched> {
    let budget = params.token_budget;
    let mut microbatches = Vec::new();
    let mut oversize = Vec::new();
    let mut short = Vec::with_capacity(seqs.len());
    for (i, &s) in seqs.iter().enumerate() {
        if s as u64 > budget {
            oversize.push(Oversize {
                index: i,
                tokens: s,
            });
            microbatches.extend(Microbatch::chunks(i as u32, s, chunk_tokens)?);
        } else {
            short.push(s);
        }
    }
    if !short.is_empty() {
        let rest = PolicyParams {
            chunk_tokens: None,
            ..*params
        };
        microbatches.extend(batch(policy, &short, &rest, cost)?.microbatches);
    }
    Ok(Batched {
        microbatches,
        oversize,
        truncated_tokens: 0,
    })
}

fn padded(seqs: &[u32], params: &PolicyParams) -> Batched {
    let longest = *seqs.iter().max().expect("non-empty");
    let s = params
        .max_seq_len
        .map_or(longest, |cap| cap.min(longest))
        .max(1);
    let b = match params.microbatches {
        Some(m) => seqs.len().div_ceil(m as usize),
        None => (params.token_budget / s as u64).max(1) as usize,
    };
    let truncated_tokens = seqs.iter().map(|&x| x.saturating_sub(s) as u64).sum();
    let microbatches = seqs
        .chunks(b)
        .map(|c| Microbatch {
            chunk: None,
            seq_lens: c.iter().map(|&x| x.min(s)).collect(),
            shape: Shape::Padded {
                rows: c.len() as u32,
                seq_len: s,
            },
        })
        .collect();
    Batched {
        microbatches,
        oversize: Vec::new(),
        truncated_tokens,
    }
}

fn packed(seqs: &[u32], params: &PolicyParams) -> Result<Vec<Microbatch>> {
    let m_len = params.pack_len;
    if m_len == 0 {
        return Err(Error::invalid("pack_len", 0, ">= 1 token"));
    }
    // Greedy in dataset order: a sequence that does not fit the current row starts a new one;
    // one longer than a row gets a row of its own length.
    let mut rows: Vec<Vec<u32>> = Vec::new();
    let mut fill = m_len; // forces a new row first
    for &s in seqs {
        if s > m_len {
            rows.push(vec![s]);
            fill = m_len;
            continue;
        }
        if fill + s > m_len {
            rows.push(Vec::new());
            fill = 0;
        }
        rows.last_mut().expect("pushed").push(s);
        fill += s;
    }
    let per_mb = match params.microbatches {
        Some(m) if m as usize > rows.len() => {
            return Err(Error::invalid(
                "microbatches",
                m,
                format!(
                    "at most the step's {} packed rows of {m_len} tokens",
                    rows.len()
                ),
            ));
        }
        Some(m) => rows.len().div_ceil(m as usize),
        None => (params.token_budget / m_len as u64).max(1) as usize,
    };
    Ok(rows
        .chunks(per_mb)
        .map(|c| {
            let long: Vec<u64> = c
                .iter()
                .filter(|r| r.len() == 1 && r[0] > m_len)
                .map(|r| r[0] as u64)
                .collect();
            Microbatch {
                chunk: None,
                seq_lens: c.iter().flatten().copied().collect(),
                shape: Shape::Packed {
                    rows: (c.len() - long.len()) as u32,
                    row_len: m_len,
                    long_tokens: long.iter().sum(),
                    long_pairs: long.iter().map(|s| s * s).sum(),
                },
            }
        })
        .collect())
}

#[derive(PartialEq)]
struct Load(f64, usize);
impl Eq for Load {}
impl PartialOrd for Load {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Load {
    /// Reversed, so that `BinaryHeap` pops the least loaded (lowest index on ties).
    fn cmp(&self, other: &Self) -> Ordering {
        other.0.total_cmp(&self.0).then(other.1.cmp(&self.1))
    }
}

/// LPT into `k` bins by `cost`; returns the bins and whether every bin holds at most `budget`
/// tokens.
fn lpt(order: &[(f64, u32)], k: usize, budget: u64) -> (Vec<Microbatch>, bool) {
    let mut heap: BinaryHeap<Load> = (0..k).map(|i| Load(0.0, i)).collect();
    let mut bins = vec![Microbatch::default(); k];
    let mut tokens = vec![0u64; k];
    for &(c, s) in order {
        let Load(load, i) = heap.pop().expect("k >= 1");
        bins[i].seq_lens.push(s);
        tokens[i] += s as u64;
        heap.push(Load(load + c, i));
    }
    let fits = tokens.iter().all(|&t| t <= budget);
    (bins, fits)
}

/// Flat microbatches of at most `budget` tokens balanced by predicted cost: start from the
/// first-fit-decreasing count k, split by LPT (Graham 1969) on predicted cost, and add a
/// microbatch until every one fits the budget. Sequences longer than the budget get their own.
fn flat_balanced(seqs: &[u32], budget: u64, cost: &dyn Fn(u64, u64) -> f64) -> Result<Batched> {
    let (ffd, oversize) = pack_token_budget(seqs, budget)?;
    let mut order: Vec<(f64, u32)> = seqs
        .iter()
        .filter(|&&s| s as u64 <= budget)
        .map(|&s| (cost(s as u64, s as u64 * (s as u64 + 1) / 2), s))
        .collect();
    order.sort_by(|a, b| b.0.total_cmp(&a.0).then(b.1.cmp(&a.1)));
    let mut microbatches: Vec<Microbatch> = oversize
        .iter()
        .map(|o| Microbatch::flat(vec![o.tokens]))
        .collect();
    if !order.is_empty() {
        let mut k = ffd.len() - oversize.len();
        loop {
            let (bins, fits) = lpt(&order, k, budget);
            if fits || k >= order.len() {
                microbatches.extend(bins);
                break;
            }
            k += 1;
        }
    }
    Ok(Batched {
        microbatches,
        oversize,
        truncated_tokens: 0,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tok(t: u64, _: u64) -> f64 {
        t as f64
    }

    #[test]
    fn long_sequences_become_chunks() {
        let params = PolicyParams {
            token_budget: 8,
            chunk_tokens: Some(8),
            ..PolicyParams::default()
        };
        // 20 tokens > 8: chunks 7, 7, 6 at offsets 0, 7, 14; the rest by FFD: 5+3 | 2.
        let b = batch(Policy::FlatFfd, &[5, 20, 3, 2], &params, &tok).unwrap();
        let lens: Vec<Vec<u32>> = b.microbatches.iter().map(|m| m.seq_lens.clone()).collect();
        assert_eq!(lens, vec![vec![7], vec![7], vec![6], vec![5, 3], vec![2]]);
        let offs: Vec<Option<u32>> = b
            .microbatches
            .iter()
            .map(|m| m.chunk.map(|c| c.offset))
            .collect();
        assert_eq!(offs, vec![Some(0), Some(7), Some(14), None, None]);
        assert_eq!(b.oversize.len(), 1);
        assert!(b.microbatches.iter().all(|m| m.tokens() <= 8));
        // Pairs over the chunks sum to the unsplit sequence's 20 * 21 / 2.
        let pairs: u64 = b.microbatches[..3].iter().map(Microbatch::attn_pairs).sum();
        assert_eq!(pairs, 210);
        // A chunk size above the budget is refused.
        let bad = PolicyParams {
            chunk_tokens: Some(9),
            ..params
        };
        assert!(batch(Policy::FlatFfd, &[5, 20], &bad, &tok).is_err());
    }

    #[test]
    fn four_ones_in_one_row() {
        // Four sequences of length 1 packed into one row of M = 4: the dense mask computes the
        // full 4 x 4 block (16 pairs); flat attention computes 4 pairs (1 each).
        let params = PolicyParams {
            token_budget: 4,
            pack_len: 4,
            ..Default::default()
        };
        let packed = batch(Policy::Packed, &[1, 1, 1, 1], &params, &tok).unwrap();
        assert_eq!(packed.microbatches.len(), 1);
        assert_eq!(packed.microbatches[0].computed_attn_pairs(), 16);
        assert_eq!(packed.microbatches[0].computed_tokens(), 4);
        let flat = batch(Policy::FlatFfd, &[1, 1, 1, 1], &params, &tok).unwrap();
        assert_eq!(flat.microbatches[0].computed_attn_pairs(), 4);
        // Padded to S = 1 with B = 4: 4 tokens, 4 * 1 * 2 / 2 = 4 pairs.
        let padded = batch(Policy::Padded, &[1, 1, 1, 1], &params, &tok).unwrap();
        assert_eq!(padded.microbatches[0].computed_attn_pairs(), 4);
    }

    #[test]
    fn padded_by_hand() {
        // Lengths 2, 8, 3 with budget 16: S = 8, B = 2 -> [2, 8] and [3]; computed 16 + 8 tokens,
        // pairs 2 * 36 + 1 * 36; true tokens 13, true pairs 3 + 36 + 6.
        let params = PolicyParams {
            token_budget: 16,
            ..Default::default()
        };
        let b = batch(Policy::Padded, &[2, 8, 3], &params, &tok).unwrap();
        let computed: Vec<(u64, u64)> = b
            .microbatches
            .iter()
            .map(|m| (m.computed_tokens(), m.computed_attn_pairs()))
            .collect();
        assert_eq!(computed, vec![(16, 72), (8, 36)]);
        let true_pairs: u64 = b.microbatches.iter().map(Microbatch::attn_pairs).sum();
        assert_eq!(true_pairs, 45);
    }

    #[test]
    fn packed_starts_new_rows_and_gives_long_sequences_their_own() {
        // M = 4, by hand: [3]; 2 does not fit (3 + 2 > 4) -> new row [2]; 6 is longer than a
        // row -> a row of its own (6 tokens, 36 pairs); 1 -> new row [1]. Budget 8 -> 2 rows per
        // microbatch: [3 | 2] and [6 | 1].
        let params = PolicyParams {
            token_budget: 8,
            pack_len: 4,
            ..Default::default()
        };
        let b = batch(Policy::Packed, &[3, 2, 6, 1], &params, &tok).unwrap();
        let got: Vec<_> = b
            .microbatches
            .iter()
            .map(|m| {
                (
                    m.seq_lens.clone(),
                    m.computed_tokens(),
                    m.computed_attn_pairs(),
                )
            })
            .collect();
        assert_eq!(got, vec![(vec![3, 2], 8, 32), (vec![6, 1], 6 + 4, 36 + 16)]);
    }

    #[test]
    fn flat_balanced_balances_cost_within_budget() {
        // Cost = attention pairs: one 8-token sequence (36 pairs) outweighs eight 1-token ones.
        let seqs = [8, 1, 1, 1, 1, 1, 1, 1, 1];
        let params = PolicyParams {
            token_budget: 16,
            ..Default::default()
        };
        let pairs = |_: u64, a: u64| a as f64;
        let b = batch(Policy::FlatBalanced, &seqs, &params, &pairs).unwrap();
        // FFD needs one microbatch of 16 tokens; LPT on one bin is that bin.
        assert_eq!(b.microbatches.len(), 1);
        let params = PolicyParams {
            token_budget: 9,
            ..Default::default()
        };
        let b = batch(Policy::FlatBalanced, &seqs, &params, &pairs).unwrap();
        assert!(b.microbatches.iter().all(|m| m.tokens() <= 9));
        assert_eq!(
            b.microbatches.iter().map(Microbatch::tokens).sum::<u64>(),
            16
        );
    }
}
