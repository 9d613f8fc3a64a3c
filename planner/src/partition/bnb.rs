//! The exact split under per-rank memory limits by branch and bound: the default solver of
//! [`crate::partition::solve`], in pure Rust (no cmake, no C++ solver to build).
//!
//! The optimal bottleneck is the time of some stage, so it is one of the range times
//! `t(j, l, m) = Σ_{i in j..l} time_s[i][m]`. A binary search over those candidate values `T`
//! (between a lower bound and a known split) asks "is there a split whose every stage takes at
//! most `T`?", which is monotone in `T`. For a fixed `T` a stage holding layers `j..l` takes
//! its least memory-hungry mode among those within `T`, so the question becomes a pure
//! feasibility problem over the stage boundaries, answered by a depth-first search over
//! stages in model order with three prunings:
//! - **time reach**: the layers left must be coverable by the stages left, each within `T`
//!   (greedy farthest-reach cover, optimal for contiguous ranges with monotone times) and with
//!   at least one layer each;
//! - **memory**: a stage's memory only grows with its end layer, so its rank's limit caps the
//!   end; the layers left need at least their static bytes plus the smallest in-flight count
//!   times their leanest activations, which must fit the room left on the ranks that still
//!   have stages; and, layers being indivisible, a rank with room `R` takes at most as many of
//!   the layers left as the smallest of them fit in `R`, so these counts over the ranks must
//!   reach the number of layers left (the bound that proves, at the root, that Llama-3.1-70B's
//!   82 layers of ~13 GiB do not fit 8 ranks of 136 GiB, though their average does);
//! - **dominance**: a (stage, first layer) state that failed with rank memories `m` fails
//!   with any `m' >= m` (componentwise, over the ranks that still have stages), so failed
//!   memory vectors are remembered per state.
//!
//! The search is exponential in the worst case (the problem contains multiprocessor
//! scheduling), so every feasibility question has a node budget; an undecided one is treated
//! as infeasible for the search's direction but not for the certificate: the result's lower
//! bound only rises on proven infeasibility, so its gap to optimal stays certified. The budget
//! is counted in nodes, not seconds, so the same problem gives the same split on any machine.
//!
//! This is the textbook "bottleneck objective by parametric search" (e.g. Pinar and Aykanat,
//! "Fast optimal load balancing algorithms for 1D partitioning", JPDC 2004, for the unlimited
//! case) with a branch-and-bound feasibility test for the memory coupling between the stages
//! of one rank.

use crate::partition::{PartitionProblem, mode_index};
use flatpipe_simulator::costs::Recompute;
use std::ops::Range;

/// Default node budget of one feasibility question.
pub const NODE_BUDGET: u64 = 50_000;

/// Questions' budgets one search may spend in all: undecided questions stop the search once
/// `TOTAL_BUDGETS x budget` nodes are spent (bounding the time per problem; ~0.1 s per
/// budget of 200,000 nodes on one core).
pub const TOTAL_BUDGETS: u64 = 4;

/// What the search found.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Outcome {
    /// The best split found (stage ranges and modes), if any.
    pub split: Option<(Vec<Range<usize>>, Vec<Recompute>)>,
    /// Its bottleneck, seconds (`INFINITY` without a split).
    pub bottleneck_s: f64,
    /// A certified lower bound on the optimal bottleneck, seconds (`INFINITY` when no split
    /// can fit at all).
    pub lower_bound_s: f64,
    /// Every feasibility question was decided within its budget.
    pub decided: bool,
    /// Search nodes visited over all questions.
    pub nodes: u64,
}

/// Prefix sums of one problem.
struct Prefix {
    /// `time[m][i]`: time of layers `0..i` in mode index `m` (of `Recompute::ALL`), seconds.
    time: Vec<Vec<f64>>,
    /// `act[m][i]`: activation bytes of layers `0..i` in mode `m`.
    act: Vec<Vec<f64>>,
    /// `stat[i]`: static bytes of layers `0..i`.
    stat: Vec<f64>,
    /// `lean[i]`: leanest allowed activation bytes of layers `0..i` (per layer minimum).
    lean: Vec<f64>,
}

impl Prefix {
    fn new(problem: &PartitionProblem, modes: &[usize]) -> Self {
        let l_count = problem.layers.len();
        let nm = Recompute::ALL.len();
        let mut time = vec![vec![0.0; l_count + 1]; nm];
        let mut act = vec![vec![0.0; l_count + 1]; nm];
        let mut stat = vec![0.0; l_count + 1];
        let mut lean = vec![0.0; l_count + 1];
        let per_param = problem.static_bytes.total();
        for (i, layer) in problem.layers.iter().enumerate() {
            for m in 0..nm {
                time[m][i + 1] = time[m][i] + layer.time_s[m];
                act[m][i + 1] = act[m][i] + layer.act_bytes[m];
            }
            stat[i + 1] = stat[i] + layer.params as f64 * per_param;
            let a = modes
                .iter()
                .map(|&m| layer.act_bytes[m])
                .fold(f64::INFINITY, f64::min);
            lean[i + 1] = lean[i] + a;
        }
        Prefix {
            time,
            act,
            stat,
            lean,
        }
    }

    fn time(&self, m: usize, r: Range<usize>) -> f64 {
        self.time[m][r.end] - self.time[m][r.start]
    }
}

/// One feasibility question's answer.
enum Answer {
    Yes(Vec<usize>, Vec<usize>),
    No,
    Undecided,
}

struct Search<'a> {
    problem: &'a PartitionProblem,
    pre: &'a Prefix,
    modes: &'a [usize],
    /// Ranks that hold a stage `>= s`, per `s` (length S + 1).
    live_ranks: Vec<Vec<usize>>,
    /// Smallest in-flight count of the stages `>= s` (length S + 1).
    k_min: Vec<f64>,
    /// `counts[k_slot[s]][e]`: ascending prefix sums of the least memory of each layer of
    /// `e..L` (static bytes + `k_min[s]` x leanest activations), for the layer-count bound.
    counts: Vec<Vec<Vec<f64>>>,
    k_slot: Vec<usize>,
    // Per question:
    t: f64,
    max_end: Vec<usize>,
    need: Vec<usize>,
    /// Failed memory vectors per (stage, first layer).
    failed: Vec<Vec<Vec<f64>>>,
    nodes: u64,
    budget: u64,
    out_of_budget: bool,
    ends: Vec<usize>,
    chosen: Vec<usize>,
    mem: Vec<f64>,
}

/// Failed vectors kept per state; beyond it a state stops learning (the search stays exact).
const FAILED_PER_STATE: usize = 64;

impl<'a> Search<'a> {
    fn new(problem: &'a PartitionProblem, pre: &'a Prefix, modes: &'a [usize]) -> Self {
        let s_count = problem.placement.num_stages() as usize;
        let p = problem.placement.num_ranks as usize;
        let mut live_ranks = vec![Vec::new(); s_count + 1];
        let mut k_min = vec![f64::INFINITY; s_count + 1];
        for s in (0..s_count).rev() {
            let mut live = vec![false; p];
            for s2 in s..s_count {
                live[problem.placement.rank_of[s2].idx()] = true;
            }
            live_ranks[s] = (0..p).filter(|&r| live[r]).collect();
            k_min[s] = k_min[s + 1].min(problem.inflight[s]);
        }
        let l_count = problem.layers.len();
        let mut slots: Vec<f64> = Vec::new();
        let mut counts = Vec::new();
        let k_slot = k_min
            .iter()
            .map(|&k| {
                let k = if k.is_finite() { k } else { 0.0 };
                if let Some(i) = slots.iter().position(|&x| x == k) {
                    return i;
                }
                slots.push(k);
                let least: Vec<f64> = (0..l_count)
                    .map(|i| (pre.stat[i + 1] - pre.stat[i]) + k * (pre.lean[i + 1] - pre.lean[i]))
                    .collect();
                counts.push(
                    (0..=l_count)
                        .map(|e| {
                            let mut v = least[e..].to_vec();
                            v.sort_by(f64::total_cmp);
                            let mut acc = 0.0;
                            std::iter::once(0.0)
                                .chain(v.iter().map(|x| {
                                    acc += x;
                                    acc
                                }))
                                .collect()
                        })
                        .collect(),
                );
                slots.len() - 1
            })
            .collect();
        Search {
            problem,
            pre,
            modes,
            live_ranks,
            k_min,
            counts,
            k_slot,
            t: 0.0,
            max_end: Vec::new(),
            need: Vec::new(),
            failed: Vec::new(),
            nodes: 0,
            budget: 0,
            out_of_budget: false,
            ends: vec![0; s_count],
            chosen: vec![0; s_count],
            mem: vec![0.0; p],
        }
    }

    /// Fastest allowed time of layers `r`.
    fn fastest(&self, r: Range<usize>) -> f64 {
        self.modes
            .iter()
            .map(|&m| self.pre.time(m, r.clone()))
            .fold(f64::INFINITY, f64::min)
    }

    /// Least memory of stage `s` holding `r` within time `self.t`, and its mode.
    fn stage_memory(&self, s: usize, r: Range<usize>) -> Option<(f64, usize)> {
        let k = self.problem.inflight[s];
        let stat = self.pre.stat[r.end] - self.pre.stat[r.start];
        self.modes
            .iter()
            .filter(|&&m| self.pre.time(m, r.clone()) <= self.t)
            .map(|&m| {
                let a = self.pre.act[m][r.end] - self.pre.act[m][r.start];
                (stat + k * a, m)
            })
            .min_by(|a, b| a.0.total_cmp(&b.0))
    }

    /// Is there a split with every stage within `t`?
    fn ask(&mut self, t: f64, budget: u64) -> Answer {
        let l_count = self.problem.layers.len();
        let s_count = self.problem.placement.num_stages() as usize;
        self.t = t;
        // Farthest end of a stage starting at j within t (monotone in j).
        self.max_end = vec![0; l_count + 1];
        let mut l = 0;
        for j in 0..l_count {
            l = l.max(j);
            while l < l_count && self.fastest(j..l + 1) <= t {
                l += 1;
            }
            self.max_end[j] = l;
        }
        self.max_end[l_count] = l_count;
        // Fewest stages covering j..L within t (greedy farthest reach is optimal).
        const NEVER: usize = usize::MAX / 2;
        self.need = vec![NEVER; l_count + 1];
        self.need[l_count] = 0;
        for j in (0..l_count).rev() {
            let e = self.max_end[j];
            if e > j {
                self.need[j] = self.need[e].saturating_add(1).min(NEVER);
            }
        }
        self.mem.iter_mut().for_each(|m| *m = 0.0);
        if self.need[0] > s_count || !self.enough_room(0, 0) {
            return Answer::No;
        }
        self.failed = vec![Vec::new(); s_count * (l_count + 1)];
        self.nodes = 0;
        self.budget = budget;
        self.out_of_budget = false;
        if self.dfs(0, 0) {
            let mut ends = self.ends.clone();
            ends.truncate(s_count);
            Answer::Yes(ends, self.chosen.clone())
        } else if self.out_of_budget {
            Answer::Undecided
        } else {
            Answer::No
        }
    }

    /// The layer-count bound: can the ranks that hold stages `>= s` take the layers `e..L` at
    /// all, given that a rank with room `R` takes at most the number of the smallest of them
    /// whose memory sums to `R`?
    fn enough_room(&self, s: usize, e: usize) -> bool {
        let sums = &self.counts[self.k_slot[s]][e];
        let remaining = sums.len() - 1;
        let limit = self.problem.memory_limit_bytes;
        let mut fit = 0;
        for &r in &self.live_ranks[s] {
            let room = limit - self.mem[r];
            fit += sums.partition_point(|&x| x <= room).saturating_sub(1);
            if fit >= remaining {
                return true;
            }
        }
        fit >= remaining
    }

    fn dominated(&self, s: usize, j: usize) -> bool {
        let l_count = self.problem.layers.len();
        let live = &self.live_ranks[s];
        self.failed[s * (l_count + 1) + j]
            .iter()
            .any(|f| live.iter().zip(f).all(|(&r, &fm)| fm <= self.mem[r]))
    }

    fn remember_failure(&mut self, s: usize, j: usize) {
        let l_count = self.problem.layers.len();
        let key = s * (l_count + 1) + j;
        if self.failed[key].len() < FAILED_PER_STATE {
            let v = self.live_ranks[s].iter().map(|&r| self.mem[r]).collect();
            self.failed[key].push(v);
        }
    }

    /// Stages `s..` from layer `j` with the current rank memories: can they be placed?
    fn dfs(&mut self, s: usize, j: usize) -> bool {
        let l_count = self.problem.layers.len();
        let s_count = self.problem.placement.num_stages() as usize;
        if s == s_count {
            return j == l_count;
        }
        self.nodes += 1;
        if self.nodes > self.budget {
            self.out_of_budget = true;
            return false;
        }
        if self.dominated(s, j) {
            return false;
        }
        let limit = self.problem.memory_limit_bytes;
        let rank = self.problem.placement.rank_of[s].idx();
        let left = s_count - s - 1;
        let hi = self.max_end[j].min(l_count - left);
        // The smallest end whose rest the remaining stages can still cover.
        let mut lo = j + 1;
        while lo <= hi && self.need[lo] > left {
            lo += 1;
        }
        if left == 0 {
            lo = l_count;
        }
        // The room left on the ranks that still have stages after this one, before this
        // stage's memory (which comes off it when its rank is among them).
        let (room0, rank_live_next) = if left == 0 {
            (0.0, false)
        } else {
            let live = &self.live_ranks[s + 1];
            (
                live.iter().map(|&r| limit - self.mem[r]).sum::<f64>(),
                live.contains(&rank),
            )
        };
        // Longest stage first: it leaves the least to the stages after it.
        let mut end = hi;
        while end >= lo && end > j {
            if let Some((m, mode)) = self.stage_memory(s, j..end)
                && self.mem[rank] + m <= limit
            {
                self.mem[rank] += m;
                // Room the layers after `end` need at least, against the room left on the
                // ranks that still have stages.
                let rest = (self.pre.stat[l_count] - self.pre.stat[end])
                    + self.k_min[s + 1] * (self.pre.lean[l_count] - self.pre.lean[end]);
                let room = if rank_live_next { room0 - m } else { room0 };
                if left == 0 || (rest <= room && self.enough_room(s + 1, end)) {
                    self.ends[s] = end;
                    self.chosen[s] = mode;
                    if self.dfs(s + 1, end) {
                        return true;
                    }
                }
                self.mem[rank] -= m;
                if self.out_of_budget {
                    return false;
                }
            }
            end -= 1;
        }
        self.remember_failure(s, j);
        false
    }
}

/// The smallest bottleneck split of `problem` (memory limits included) with a bottleneck in
/// `[lower_bound_s, upper.bottleneck]`, by binary search over the candidate stage times.
///
/// `upper` is a known feasible split (ranges, modes) or `None`; `lower_bound_s` a certified
/// lower bound (the memory-free optimum). `budget` caps the search nodes of each feasibility
/// question.
pub(crate) fn solve(
    problem: &PartitionProblem,
    lower_bound_s: f64,
    upper: Option<(&[Range<usize>], &[Recompute])>,
    budget: u64,
) -> Outcome {
    let modes: Vec<usize> = problem.modes.iter().map(|&m| mode_index(m)).collect();
    let pre = Prefix::new(problem, &modes);
    let l_count = problem.layers.len();
    let upper_t = upper.map(|(stages, rec)| {
        stages
            .iter()
            .zip(rec)
            .map(|(r, &m)| pre.time(mode_index(m), r.clone()))
            .fold(0.0, f64::max)
    });
    // Candidate bottlenecks: every range time in [lower bound, upper].
    let top = upper_t.unwrap_or(f64::INFINITY);
    let mut cands: Vec<f64> = Vec::new();
    for j in 0..l_count {
        for l in j + 1..=l_count {
            for &m in &modes {
                let t = pre.time(m, j..l);
                if t >= lower_bound_s && t <= top {
                    cands.push(t);
                }
            }
        }
    }
    cands.sort_by(f64::total_cmp);
    cands.dedup();
    let mut search = Search::new(problem, &pre, &modes);
    let mut best: Option<(Vec<Range<usize>>, Vec<Recompute>)> =
        upper.map(|(s, r)| (s.to_vec(), r.to_vec()));
    let mut best_t = upper_t.unwrap_or(f64::INFINITY);
    // Invariant: candidates below `lo` have no split (proven, or below the lower bound);
    // `hi` is the index of the best known split's bottleneck (cands.len() when none).
    // `certified_lo` only rises on a proven "no"; `search_lo` also passes undecided questions.
    let mut hi = match upper_t {
        Some(t) => cands.partition_point(|&c| c < t),
        None => cands.len(),
    };
    let (mut certified_lo, mut search_lo) = (0usize, 0usize);
    let mut decided = true;
    let mut nodes = 0;
    // Without a known split, the loosest question first: if even the largest candidate has
    // no split (or cannot be decided), no smaller one is worth asking.
    if best.is_none() && !cands.is_empty() {
        let top = cands.len() - 1;
        match search.ask(cands[top], budget) {
            Answer::Yes(..) => {}
            Answer::No => {
                search_lo = cands.len();
                certified_lo = cands.len();
            }
            Answer::Undecided => {
                decided = false;
                search_lo = cands.len();
            }
        }
        nodes += search.nodes;
    }
    while search_lo < hi && nodes < TOTAL_BUDGETS * budget {
        let mid = search_lo + (hi - search_lo) / 2;
        let answer = search.ask(cands[mid], budget);
        nodes += search.nodes;
        match answer {
            Answer::Yes(ends, modes_of) => {
                let mut start = 0;
                let stages: Vec<Range<usize>> = ends
                    .iter()
                    .map(|&e| {
                        let r = start..e;
                        start = e;
                        r
                    })
                    .collect();
                let rec: Vec<Recompute> = modes_of.iter().map(|&m| Recompute::ALL[m]).collect();
                best_t = stages
                    .iter()
                    .zip(&modes_of)
                    .map(|(r, &m)| pre.time(m, r.clone()))
                    .fold(0.0, f64::max);
                best = Some((stages, rec));
                hi = mid;
            }
            Answer::No => {
                // Monotone in t: no split within any candidate up to mid.
                search_lo = mid + 1;
                certified_lo = mid + 1;
            }
            Answer::Undecided => {
                decided = false;
                search_lo = mid + 1;
            }
        }
    }
    if search_lo < hi {
        // Stopped by the total budget.
        decided = false;
    }
    // No candidate in range: the certificate is the bound itself, or infinity when even the
    // largest candidate has no split.
    let lower = if best.is_none() && decided {
        f64::INFINITY
    } else if certified_lo < cands.len() {
        cands[certified_lo].max(lower_bound_s)
    } else {
        lower_bound_s
    };
    Outcome {
        split: best,
        bottleneck_s: best_t,
        lower_bound_s: lower.min(best_t),
        decided,
        nodes,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::partition::{LayerCost, StaticBytes};
    use flatpipe_simulator::Placement;

    /// `n` layers of time 1 whose memory is `bytes` static bytes each (no activations).
    fn uniform(n: usize, bytes: u64, p: u32, v: u32, limit: f64) -> PartitionProblem {
        PartitionProblem {
            layers: (0..n)
                .map(|_| LayerCost {
                    time_s: [1.0; 3],
                    act_bytes: [0.0; 3],
                    params: bytes,
                })
                .collect(),
            placement: Placement::looped(p, v),
            inflight: vec![1.0; (p * v) as usize],
            memory_limit_bytes: limit,
            static_bytes: StaticBytes {
                params: 1.0,
                grads: 0.0,
                optimizer: 0.0,
            },
            modes: vec![Recompute::None],
        }
    }

    #[test]
    fn indivisible_layers_are_refused_at_the_root() {
        // 10 layers of 10 bytes on 3 ranks with 35 bytes each: the average (33.3) fits, but a
        // rank holds at most 3 layers (30 bytes), 9 < 10 layers: no split, proven without
        // search.
        let pr = uniform(10, 10, 3, 2, 35.0);
        let out = solve(&pr, 2.0, None, 1);
        assert!(out.split.is_none() && out.decided, "{out:?}");
        assert_eq!(out.nodes, 0);
        // With 40 bytes a rank holds 4 layers; 6 stages of at most 2 layers (10 / 6 rounded
        // up) is the optimum: bottleneck 2.
        let pr = uniform(10, 10, 3, 2, 40.0);
        let out = solve(&pr, 2.0, None, 10_000);
        assert!(out.decided);
        assert_eq!(out.bottleneck_s, 2.0);
        let (stages, _) = out.split.unwrap();
        let mut per_rank = [0usize; 3];
        for (s, r) in stages.iter().enumerate() {
            per_rank[s % 3] += r.len();
        }
        assert!(per_rank.iter().all(|&n| n <= 4), "{per_rank:?}");
    }

    #[test]
    fn a_spent_budget_keeps_the_certificate() {
        // 12 layers, 2 ranks x 3 stages, 70 bytes per rank: a rank holds at most 7 layers.
        // The optimum is 2 (six stages of two layers, 6 layers per rank); with a budget of one
        // node no question is decided, so the known split stays and the bound stays at the
        // bound given.
        let pr = uniform(12, 10, 2, 3, 70.0);
        let upper: Vec<Range<usize>> = vec![0..3, 3..6, 6..8, 8..10, 10..11, 11..12];
        let modes = vec![Recompute::None; 6];
        let out = solve(&pr, 2.0, Some((&upper, &modes)), 1);
        assert!(!out.decided);
        assert_eq!(out.lower_bound_s, 2.0);
        assert!(out.bottleneck_s <= 3.0);
        let out = solve(&pr, 2.0, Some((&upper, &modes)), 10_000);
        assert!(out.decided);
        assert_eq!((out.bottleneck_s, out.lower_bound_s), (2.0, 2.0));
    }
}
