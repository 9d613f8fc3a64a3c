//! `verl-kk`: verl's dynamic batch size, the microbatching RL post-training runs today,
//! modelled as verl's code does it.
//!
//! Source: `verl/utils/seqlen_balancing.py` of verl 0.10.0.dev (verl-project/verl, commit
//! 1dda039b, 2026-08-22): `calculate_workload`, `karmarkar_karp`,
//! `get_seqlen_balanced_partitions` and `rearrange_micro_batches`, called by the Megatron
//! engine (`verl/workers/engine/megatron/transformer_impl.py`) with
//! `num_batches_divided_by = microbatch_group_size_per_vp_stage` (Megatron's default: the
//! pipeline size) when virtual pipeline stages are used, else none, and
//! `same_micro_num_in_dp = True`; plus verl PR #7553 (merged after that commit), which makes
//! `max_token_len` a strict bound.
//!
//! Per data-parallel rank, with that rank's `n` sequences of lengths `s_i` and the token
//! budget `B` (`max_token_len`):
//!
//! 1. `k = min(n, ceil(Σ s_i / B))` microbatches;
//! 2. the maximum of `k` over the data-parallel ranks (verl's `all_reduce(MAX)`);
//! 3. rounded up to a multiple of the divisor;
//! 4. each rank's sequences partitioned into `k` parts by the Karmarkar-Karp largest
//!    differencing method on the workload `24576·s + s²` (verl's estimate for a 7B model:
//!    `12·h²·s + 2·h·s²` with h = 4096, divided by 2h), not on tokens;
//! 5. (PR #7553) while some part holds more than `B` tokens, `k` grows (by the divisor) and
//!    every rank repartitions; verl then raises if a part still does not fit;
//! 6. parts sorted by workload, heaviest first, then reordered `[0::2]` reversed followed by
//!    `[1::2]` (verl's `use_dynamic_bsz_balance`: the lighter parts at both ends, to shorten the
//!    pipeline's warm-up and cool-down); each part's sequences in the rank's order.
//!
//! Where flatpipe departs from verl, generously: verl asserts that no sequence is longer than
//! `B`; here such a sequence gets a microbatch of its own (or its chunks, with `chunk_tokens`),
//! first, as flatpipe's other flat policies do, and the count of steps 1-5 is over the other
//! sequences. verl asserts `k <= n`; here a rank with fewer sequences than the common count is
//! an error that says so.
//!
//! The partitioner reproduces Python's `heapq` and `sorted` exactly (same comparisons, same
//! sift order), so its parts equal verl's own on the same input: `tests/verl_kk.rs` compares
//! with partitions that verl's code wrote (`scripts/verl_kk_fixture.py`).

use crate::batching::microbatch::{Microbatch, Oversize};
use crate::{Error, Result};
use std::cmp::Ordering;

/// verl's `calculate_workload`: `24576·s + s²` for a sequence of `s` tokens.
pub fn workload(s: u32) -> i128 {
    let s = s as i128;
    24_576 * s + s * s
}

/// One part of a Karmarkar-Karp state: (index, value) items and their sum.
#[derive(Clone, Debug, Default)]
struct Part {
    sum: i128,
    items: Vec<(usize, i128)>,
}

impl Part {
    /// verl's `Set.__lt__`: by sum, then item count, then the item lists lexicographically.
    fn cmp(&self, other: &Part) -> Ordering {
        self.sum
            .cmp(&other.sum)
            .then(self.items.len().cmp(&other.items.len()))
            .then_with(|| self.items.cmp(&other.items))
    }
}

#[derive(Clone, Debug)]
struct State {
    /// Always sorted heaviest first (Python's stable `sorted(reverse=True)`).
    parts: Vec<Part>,
}

impl State {
    fn spread(&self) -> i128 {
        self.parts[0].sum - self.parts[self.parts.len() - 1].sum
    }
    /// verl's `State.__lt__`: the larger spread first, then the larger heaviest part.
    fn lt(&self, other: &State) -> bool {
        let (a, b) = (self.spread(), other.spread());
        if a != b {
            return a > b;
        }
        self.parts[0].cmp(&other.parts[0]) == Ordering::Greater
    }
    fn sort(&mut self) {
        // Python's sorted(reverse=True) keeps equal elements in their order: a stable sort
        // by the reversed comparison does the same.
        self.parts.sort_by(|a, b| b.cmp(a));
    }
    fn merge(&mut self, other: State) {
        let k = self.parts.len();
        for (i, o) in other.parts.into_iter().rev().enumerate().take(k) {
            // self.parts[i] takes other.parts[k - 1 - i].
            self.parts[i].sum += o.sum;
            self.parts[i].items.extend(o.items);
        }
        self.sort();
    }
}

/// Python's `heapq.heappush` / `heappop` with the `lt` of [`State`], sift for sift.
struct PyHeap(Vec<State>);

impl PyHeap {
    fn sift_down(&mut self, start: usize, mut pos: usize) {
        while pos > start {
            let parent = (pos - 1) >> 1;
            if self.0[pos].lt(&self.0[parent]) {
                self.0.swap(pos, parent);
                pos = parent;
            } else {
                break;
            }
        }
    }
    fn sift_up(&mut self, mut pos: usize) {
        let end = self.0.len();
        let start = pos;
        let mut child = 2 * pos + 1;
        while child < end {
            let right = child + 1;
            if right < end && !self.0[child].lt(&self.0[right]) {
                child = right;
            }
            self.0.swap(pos, child);
            pos = child;
            child = 2 * pos + 1;
        }
        self.sift_down(start, pos);
    }
    fn push(&mut self, s: State) {
        self.0.push(s);
        let last = self.0.len() - 1;
        self.sift_down(0, last);
    }
    fn pop(&mut self) -> State {
        let last = self.0.pop().expect("non-empty heap");
        if self.0.is_empty() {
            return last;
        }
        let top = std::mem::replace(&mut self.0[0], last);
        self.sift_up(0);
        top
    }
}

/// verl's `get_seqlen_balanced_partitions(values, k, equal_size=False)`: `k` parts of the
/// indices of `values` by the Karmarkar-Karp largest differencing method (Karmarkar and Karp
/// 1982), each part's indices ascending, in the order verl's final state holds them.
///
/// # Errors
/// [`Error::InvalidArgument`] when `k` is 0 or exceeds the number of values (verl asserts).
pub fn karmarkar_karp(values: &[i128], k: usize) -> Result<Vec<Vec<usize>>> {
    if k == 0 || k > values.len() {
        return Err(Error::invalid(
            "verl-kk microbatches",
            k,
            format!("in 1..={} (the sequences to partition)", values.len()),
        ));
    }
    let mut sorted: Vec<(i128, usize)> = values.iter().enumerate().map(|(i, &v)| (v, i)).collect();
    sorted.sort();
    let mut heap = PyHeap(Vec::with_capacity(sorted.len()));
    for (v, i) in sorted {
        let mut parts = vec![Part::default(); k];
        parts[0] = Part {
            sum: v,
            items: vec![(i, v)],
        };
        let mut s = State { parts };
        s.sort();
        heap.push(s);
    }
    while heap.0.len() > 1 {
        let mut a = heap.pop();
        let b = heap.pop();
        a.merge(b);
        heap.push(a);
    }
    let fin = heap.pop();
    Ok(fin
        .parts
        .into_iter()
        .map(|p| {
            let mut idx: Vec<usize> = p.items.into_iter().map(|(i, _)| i).collect();
            idx.sort_unstable();
            idx
        })
        .collect())
}

/// verl's microbatch order (`use_dynamic_bsz_balance`): parts sorted by workload sum, heaviest
/// first (ties: the larger first index first), then `[0::2]` reversed followed by `[1::2]`.
pub fn verl_order(parts: Vec<Vec<usize>>, values: &[i128]) -> Vec<Vec<usize>> {
    let key = |p: &Vec<usize>| {
        (
            p.iter().map(|&i| values[i]).sum::<i128>(),
            p.first().copied(),
        )
    };
    let mut parts = parts;
    // sorted(reverse=True) is stable: equal keys keep their order.
    parts.sort_by_key(|p| std::cmp::Reverse(key(p)));
    let mut out: Vec<Vec<usize>> = parts.iter().step_by(2).rev().cloned().collect();
    out.extend(parts.iter().skip(1).step_by(2).cloned());
    out
}

/// One data-parallel rank's sequences cut by verl-kk.
#[derive(Debug, Clone, PartialEq)]
pub struct VerlCut {
    /// The microbatches, in verl's order (oversize sequences or their chunks first).
    pub microbatches: Vec<Microbatch>,
    /// Sequences longer than the budget (verl would refuse the step).
    pub oversize: Vec<Oversize>,
}

/// verl-kk over the data-parallel ranks' `shares` (each rank's sequence lengths, in its order)
/// with token budget `budget`, the count rounded up to a multiple of `divisor` (1: none), and
/// `chunk_tokens` for sequences longer than the budget (`None`: a microbatch of their own).
/// Every rank gets the same number of KK parts (steps 1-6 of the module doc).
///
/// # Errors
/// [`Error::InvalidArgument`] for a zero budget or divisor, or when a rank has fewer sequences
/// than the common microbatch count (verl asserts `k <= n`).
pub fn cut(
    shares: &[Vec<u32>],
    budget: u64,
    divisor: u32,
    chunk_tokens: Option<u64>,
) -> Result<Vec<VerlCut>> {
    if budget == 0 {
        return Err(Error::invalid("token_budget", 0, ">= 1 token"));
    }
    if divisor == 0 {
        return Err(Error::invalid("verl-kk divisor", 0, ">= 1"));
    }
    if let Some(c) = chunk_tokens.filter(|&c| c == 0 || c > budget) {
        return Err(Error::invalid(
            "chunk_tokens",
            c,
            format!("in 1..={budget} (the token budget)"),
        ));
    }
    // Sequences longer than the budget leave the partition.
    let mut fixed: Vec<VerlCut> = Vec::with_capacity(shares.len());
    let mut short: Vec<Vec<u32>> = Vec::with_capacity(shares.len());
    for share in shares {
        let mut c = VerlCut {
            microbatches: Vec::new(),
            oversize: Vec::new(),
        };
        let mut s_short = Vec::with_capacity(share.len());
        for (i, &s) in share.iter().enumerate() {
            if s as u64 > budget {
                c.oversize.push(Oversize {
                    index: i,
                    tokens: s,
                });
                match chunk_tokens {
                    Some(ct) => c.microbatches.extend(Microbatch::chunks(i as u32, s, ct)?),
                    None => c.microbatches.push(Microbatch::flat(vec![s])),
                }
            } else {
                s_short.push(s);
            }
        }
        fixed.push(c);
        short.push(s_short);
    }
    let active: Vec<usize> = (0..short.len()).filter(|&d| !short[d].is_empty()).collect();
    if active.is_empty() {
        return Ok(fixed);
    }
    // Steps 1-3.
    let mut k = active
        .iter()
        .map(|&d| {
            let total: u64 = short[d].iter().map(|&s| s as u64).sum();
            (total.div_ceil(budget) as usize).min(short[d].len())
        })
        .max()
        .expect("an active rank")
        .max(1);
    let div = divisor as usize;
    k = k.div_ceil(div) * div;
    let values: Vec<Vec<i128>> = short
        .iter()
        .map(|s| s.iter().map(|&x| workload(x)).collect())
        .collect();
    loop {
        if let Some(&d) = active.iter().find(|&&d| short[d].len() < k) {
            return Err(Error::invalid(
                "verl-kk microbatches",
                k,
                format!(
                    "at most data-parallel rank {d}'s {} sequences (verl asserts num_micro_batches <= batch size)",
                    short[d].len()
                ),
            ));
        }
        let parts: Vec<Vec<Vec<usize>>> = active
            .iter()
            .map(|&d| karmarkar_karp(&values[d], k))
            .collect::<Result<_>>()?;
        let over = active.iter().zip(&parts).any(|(&d, ps)| {
            ps.iter()
                .any(|p| p.iter().map(|&i| short[d][i] as u64).sum::<u64>() > budget)
        });
        // Step 5 (PR #7553): more microbatches until every part fits. k = n always fits
        // (every sequence is at most the budget).
        if over {
            k += div;
            continue;
        }
        for (&d, ps) in active.iter().zip(parts) {
            for p in verl_order(ps, &values[d]) {
                fixed[d]
                    .microbatches
                    .push(Microbatch::flat(p.iter().map(|&i| short[d][i]).collect()));
            }
        }
        return Ok(fixed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lens(c: &VerlCut) -> Vec<Vec<u32>> {
        c.microbatches.iter().map(|m| m.seq_lens.clone()).collect()
    }

    #[test]
    fn seven_eights_with_budget_eight_by_hand() {
        // verl PR #7553's case: ceil(56 / 8) = 7 parts, one of which must hold two 7s (14 > 8);
        // repartitioned into 8, one sequence each.
        let c = cut(&[vec![7; 8]], 8, 1, None).unwrap();
        assert_eq!(lens(&c[0]), vec![vec![7]; 8]);
    }

    #[test]
    fn two_parts_by_hand() {
        // Lengths 1, 2, 3, 4 with budget 5: k = ceil(10 / 5) = 2. Workloads w(s) = 24576 s +
        // s²: w1 = 24577, w2 = 49156, w3 = 73737, w4 = 98320. The heap pops the largest
        // spread first: {w4} and {w3} merge to {w4 | w3} (spread 24583); then {w2} (49156) and
        // {w4 | w3}: {w2 + w3 | w4} (spread 24573); then {w1} (24577) and that:
        // {w1 + w4 | w2 + w3} = {1, 4 | 2, 3}, sums 122897 and 122893. verl's order: the
        // heavier first ([0::2] reversed is just it), then the lighter.
        let c = cut(&[vec![1, 2, 3, 4]], 5, 1, None).unwrap();
        assert_eq!(lens(&c[0]), vec![vec![1, 4], vec![2, 3]]);
    }

    #[test]
    fn count_is_the_largest_over_ranks_rounded_to_the_divisor() {
        // Rank 0: 4 x 4 tokens, budget 8 -> 2; rank 1: 6 x 4 tokens -> 3; max 3, divisor 2 -> 4.
        let c = cut(&[vec![4; 4], vec![4; 6]], 8, 2, None).unwrap();
        assert_eq!(c[0].microbatches.len(), 4);
        assert_eq!(c[1].microbatches.len(), 4);
        for r in &c {
            assert!(r.microbatches.iter().all(|m| m.tokens() <= 8));
        }
        // A rank with fewer sequences than the common count: verl asserts, we say so.
        let e = cut(&[vec![1], vec![4; 6]], 8, 1, None).unwrap_err();
        assert!(e.to_string().contains("rank 0"), "{e}");
    }

    #[test]
    fn oversize_sequences_get_their_own_microbatch_first() {
        let c = cut(&[vec![3, 20, 2]], 8, 1, None).unwrap();
        assert_eq!(lens(&c[0]), vec![vec![20], vec![3, 2]]);
        assert_eq!(c[0].oversize.len(), 1);
        let c = cut(&[vec![3, 20, 2]], 8, 1, Some(8)).unwrap();
        assert_eq!(c[0].microbatches.len(), 3 + 1);
    }

    #[test]
    fn verl_order_puts_light_parts_at_both_ends() {
        // Sums 5, 4, 3, 2, 1 (one item each): sorted heaviest first [5, 4, 3, 2, 1];
        // [0::2] = [5, 3, 1] reversed = [1, 3, 5]; [1::2] = [4, 2]: 1, 3, 5, 4, 2.
        let values = [5i128, 4, 3, 2, 1];
        let parts = (0..5).map(|i| vec![i]).collect();
        let out = verl_order(parts, &values);
        let sums: Vec<i128> = out.iter().map(|p| values[p[0]]).collect();
        assert_eq!(sums, vec![1, 3, 5, 4, 2]);
    }
}
