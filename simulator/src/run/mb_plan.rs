//! `flat-planned`: one step's microbatches planned for the schedule that runs them.
//!
//! The flat policies fill microbatches to the token budget; none of them decides how many
//! microbatches a step should have or in which order the pipeline should meet them, and both
//! decide the bubbles: in 1F1B the first microbatch's forward makes every later rank wait
//! (the fill) and the last one's backward makes every earlier rank wait (the drain), and with
//! fewer microbatches than ranks whole ranks idle. [`plan`] searches, per replica and step:
//!
//! - **count**: the first-fit-decreasing count m₀ (the fewest the budget allows, within
//!   11/9 of optimal), m₀ + 1, and the multiples of the pipeline size p from m₀ up
//!   (`ceil(m₀/p)·p` and one and two p more: more, smaller microbatches shorten the fill and
//!   drain by what they add in fixed costs), at most the number of sequences;
//! - **contents**: LPT (Graham 1969) on each sequence's predicted time (attention included,
//!   [`crate::run::config::balance_cost`]) under the token budget, into bins of equal target,
//!   or with targets ramped up over the first r bins and down over the last r (r = 2 for every
//!   count, then 1 and 4 for the best count): a short first microbatch shortens the fill, a
//!   short last one the drain;
//! - **order**: verl's (light microbatches at both ends, [`crate::batching::verl_kk::verl_order`]) for
//!   equal targets, the ramp's own for ramped ones; then the best count's equal-target bins
//!   heaviest first and lightest first; and the best candidate with its chunked sequences
//!   moved from first to the middle or last;
//!
//! plus the step's own first-fit-decreasing cut (so the result is never slower than
//! `flat-ffd` on the same step). Each candidate is priced by the replay of the schedule kind
//! on it under the profile's costs (the prediction every other policy gets); the fastest
//! whose peak memory (state plus activations, the most of any rank) fits the memory limit,
//! or the cut's own peak where the cut is over it, wins; ties to the earlier. zb-auto, whose
//! schedule is searched per step under the limit, is ranked with ZB-H1 (v = 1) or ZB-V
//! (v = 2), then the winner and the first-fit-decreasing cut are both built with zb-auto and
//! the faster kept. A given schedule (fixed microbatch count), a fixed capacity or an exact
//! microbatch count (`microbatches`) keeps the cut.
//!
//! Sequences longer than the budget (a microbatch of their own, or their chunks) keep their
//! microbatches.
//!
//! [`lower_bound_s`] is the replica's step-time bound that holds for *every* way of cutting
//! and ordering its sequences, so the gap between any policy's step time and it is what any
//! microbatching could still gain.

use crate::batching::microbatch::Microbatch;
use crate::costs::{CostModel, TableCosts, ns_to_s};
use crate::ir::{ActionKind, ComputeAction, MicrobatchId, Placement, Rank, Schedule, StageId};
use crate::run::config::{
    Capacity, RunConfig, ScheduleSource, balance_cost, cached_schedule, round_costs,
    zb_auto_activation_limit,
};
use crate::schedules::generators::ScheduleKind;
use crate::{Result, replay};
use flatpipe_profiles::Profile;
use std::collections::HashMap;
use std::sync::Arc;

/// One replica's planned microbatches.
#[derive(Debug, Clone, PartialEq)]
pub struct MicrobatchPlan {
    /// The microbatches, in the order the schedule runs them.
    pub microbatches: Vec<Microbatch>,
    /// The replay's step time of the chosen candidate (the kind that ranked it), seconds.
    pub predicted_s: f64,
    /// [`lower_bound_s`] of the replica, seconds.
    pub lower_bound_s: f64,
    /// Candidates priced.
    pub candidates: u32,
}

/// How a candidate's bins are put in order.
#[derive(Clone, Copy)]
enum Order {
    Verl,
    HeaviestFirst,
    LightestFirst,
    /// Ramped bins: the first and last `ramp` bins in place, the rest heaviest first.
    Ends(usize),
}

/// Plans one replica's microbatches for `config`'s schedule (module doc). `cut` is the
/// replica's first-fit-decreasing cut ([`crate::run::step::cut_step`] under `flat-planned`).
///
/// # Errors
/// Generation, cost-table and replay errors.
pub fn plan(
    config: &RunConfig,
    profile: &Profile,
    cut: &[Microbatch],
    replica: usize,
) -> Result<MicrobatchPlan> {
    // An exact microbatch count (`microbatches`) has no token budget: nothing is fixed.
    let exact = config.params.microbatches.is_some();
    let budget = if exact {
        u64::MAX
    } else {
        config.params.token_budget
    };
    let (fixed, short): (Vec<&Microbatch>, Vec<&Microbatch>) = cut
        .iter()
        .partition(|m| m.chunk.is_some() || m.tokens() > budget);
    let fixed: Vec<Microbatch> = fixed.into_iter().cloned().collect();
    let seqs: Vec<u32> = short
        .iter()
        .flat_map(|m| m.seq_lens.iter().copied())
        .collect();
    let kind = match (&config.source, config.effective_capacity()) {
        (ScheduleSource::Kind(k), Capacity::Dynamic) => Some(*k),
        _ => None,
    };
    let rank_kind = kind.map(|k| ranking_kind(k, config.v));
    let placement = config.placement()?;
    let lower_bound_s = lower_bound_s(config, profile, &placement, &fixed, &seqs, replica)?;
    let keep = |predicted_s| MicrobatchPlan {
        microbatches: cut.to_vec(),
        predicted_s,
        lower_bound_s,
        candidates: 0,
    };
    // A given schedule, a fixed capacity or an exact microbatch count keeps the cut.
    let Some(rank_kind) = rank_kind.filter(|_| !exact) else {
        return Ok(keep(f64::NAN));
    };
    let mut pricer = Pricer {
        config,
        profile,
        replica,
        schedules: HashMap::new(),
    };
    if seqs.len() <= 1 {
        let t = pricer.price(rank_kind, cut, None)?;
        return Ok(keep(ns_to_s(t)));
    }
    let cost = balance_cost(profile);
    let item_cost = |s: u32| cost(s as u64, s as u64 * (s as u64 + 1) / 2);
    let mut items: Vec<(f64, u32)> = seqs.iter().map(|&s| (item_cost(s), s)).collect();
    items.sort_by(|a, b| b.0.total_cmp(&a.0).then(b.1.cmp(&a.1)));
    // The candidates, each priced as made: the cut; LPT bins per count, ramp and order; the
    // fastest's chunked sequences moved. Then the choice under memory (or zb-auto's own).
    let counts = candidate_counts(short.len().max(1), config.pp.max(1) as usize, seqs.len());
    let mut search = Candidates::new(&mut pricer, rank_kind, items, budget, fixed, cut)?;
    search.counts_and_ramps(&counts)?;
    search.chunk_positions()?;
    let Candidates {
        pool, candidates, ..
    } = search;
    let (t, chosen) = if kind == Some(ScheduleKind::ZbAuto) {
        // zb-auto keeps its own schedules under the limit.
        let best = pool.into_iter().min_by_key(|c| c.0).expect("the cut");
        zb_auto_decides(&mut pricer, best, cut)?
    } else {
        let limit = config
            .memory_limit_bytes
            .unwrap_or_else(|| crate::run::config::default_memory_limit(profile));
        fastest_within_memory(&mut pricer, rank_kind, pool, cut, limit)?
    };
    Ok(MicrobatchPlan {
        microbatches: chosen,
        predicted_s: ns_to_s(t),
        lower_bound_s,
        candidates,
    })
}

/// The microbatch counts [`plan`] tries (module doc): the first-fit-decreasing count `m0`,
/// `m0 + 1`, and the multiples of the pipeline size `p` from `m0` up (and one and two `p`
/// more), at most `n_seqs` (the sequences), ascending and distinct.
fn candidate_counts(m0: usize, p: usize, n_seqs: usize) -> Vec<usize> {
    let mut counts: Vec<usize> = vec![m0, m0 + 1];
    let up = m0.div_ceil(p) * p;
    counts.extend([up, up + p, up + 2 * p]);
    counts.retain(|&m| m >= 1 && m <= n_seqs);
    counts.sort_unstable();
    counts.dedup();
    counts
}

/// [`plan`]'s candidates, priced as they are made: every one in pricing order (the cut first)
/// and the fastest of the LPT bins.
struct Candidates<'p, 'a> {
    pricer: &'p mut Pricer<'a>,
    /// The kind that prices them ([`ranking_kind`]).
    rank_kind: ScheduleKind,
    /// The short sequences' (balance cost, tokens), heaviest first: LPT's input.
    items: Vec<(f64, u32)>,
    /// The token budget of a microbatch (`u64::MAX`: none).
    budget: u64,
    /// The microbatches kept as cut (chunks, sequences over the budget), first in every bin
    /// candidate.
    fixed: Vec<Microbatch>,
    /// The fastest candidate so far of the cut and the bins (step time ns, microbatches).
    best: (u64, Vec<Microbatch>),
    /// Every candidate priced, the cut first.
    pool: Vec<(u64, Vec<Microbatch>)>,
    /// Candidates priced.
    candidates: u32,
}

impl<'p, 'a> Candidates<'p, 'a> {
    /// The pool with the cut alone, priced.
    ///
    /// # Errors
    /// The pricer's.
    fn new(
        pricer: &'p mut Pricer<'a>,
        rank_kind: ScheduleKind,
        items: Vec<(f64, u32)>,
        budget: u64,
        fixed: Vec<Microbatch>,
        cut: &[Microbatch],
    ) -> Result<Self> {
        let best = (pricer.price(rank_kind, cut, None)?, cut.to_vec());
        Ok(Candidates {
            pricer,
            rank_kind,
            items,
            budget,
            fixed,
            pool: vec![best.clone()],
            best,
            candidates: 1,
        })
    }

    /// Prices the LPT bins of `m` microbatches with `ramp` ([`lpt_under_budget`]) after the
    /// fixed microbatches, in each of `orders`; `true` when one of them is the fastest so far.
    /// No candidate when the bins do not fit the budget.
    ///
    /// # Errors
    /// The pricer's.
    fn try_bins(&mut self, m: usize, ramp: usize, orders: &[Order]) -> Result<bool> {
        let Some(bins) = lpt_under_budget(&self.items, m, self.budget, ramp) else {
            return Ok(false);
        };
        // One cost table per cut, permuted per order.
        let nf = self.fixed.len();
        let mut mbs = self.fixed.clone();
        mbs.extend(bins.iter().map(|(_, mb)| mb.clone()));
        let base = self.pricer.costs(self.rank_kind, &mbs)?;
        let mut won = false;
        for &o in orders {
            let perm: Vec<usize> = (0..nf)
                .chain(ordered(&bins, o).into_iter().map(|j| nf + j))
                .collect();
            let t = self
                .pricer
                .price(self.rank_kind, &mbs, Some((&base, &perm)))?;
            self.candidates += 1;
            let ordered: Vec<Microbatch> = perm.iter().map(|&k| mbs[k].clone()).collect();
            if t < self.best.0 {
                self.best = (t, ordered.clone());
                won = true;
            }
            self.pool.push((t, ordered));
        }
        Ok(won)
    }

    /// Every count of `counts` in verl's order and with the middle ramp; then the best count
    /// with the other ramps, and its bins heaviest and lightest first (these rarely win:
    /// measured on sampled ShareGPT steps, 1F1B, ZB-H1, ZB-V and interleaved 1F1B at p = 8).
    ///
    /// # Errors
    /// The pricer's.
    fn counts_and_ramps(&mut self, counts: &[usize]) -> Result<()> {
        let mut best_count: Option<usize> = None;
        for &m in counts {
            if self.try_bins(m, 0, &[Order::Verl])? {
                best_count = Some(m);
            }
            let ramp = RAMPS[1];
            if m > 2 * ramp && self.try_bins(m, ramp, &[Order::Ends(ramp)])? {
                best_count = Some(m);
            }
        }
        if let Some(m) = best_count {
            for ramp in [RAMPS[0], RAMPS[2]] {
                if m > 2 * ramp {
                    self.try_bins(m, ramp, &[Order::Ends(ramp)])?;
                }
            }
            self.try_bins(m, 0, &[Order::HeaviestFirst, Order::LightestFirst])?;
        }
        Ok(())
    }

    /// The fastest candidate's chunked sequences, first (as it is), moved last or to the
    /// middle: their chains hold memory and order the stages differently in each place. Into
    /// the pool only (not [`Candidates::best`]).
    ///
    /// # Errors
    /// The chunk chains' and the pricer's.
    fn chunk_positions(&mut self) -> Result<()> {
        if crate::schedules::chunks::chains(&self.best.1)?.is_empty() {
            return Ok(());
        }
        let (chunked, rest): (Vec<Microbatch>, Vec<Microbatch>) =
            self.best.1.iter().cloned().partition(|m| m.chunk.is_some());
        let half = rest.len() / 2;
        for at in [rest.len(), half] {
            let mut mbs = rest[..at].to_vec();
            mbs.extend(chunked.iter().cloned());
            mbs.extend(rest[at..].iter().cloned());
            let t = self.pricer.price(self.rank_kind, &mbs, None)?;
            self.candidates += 1;
            self.pool.push((t, mbs));
        }
        Ok(())
    }
}

/// The fastest candidate of `pool` (the cut first, as [`Candidates::pool`]) whose peak memory
/// under `rank_kind` (bytes, [`Pricer::peak_bytes`]) is within `limit`, or within the `cut`'s
/// own peak where the cut is over it (more, smaller microbatches can hold more in flight);
/// the cut when none is; ties to the earlier. Returns its step time (ns) and microbatches.
///
/// # Errors
/// The pricer's.
fn fastest_within_memory(
    pricer: &mut Pricer,
    rank_kind: ScheduleKind,
    mut pool: Vec<(u64, Vec<Microbatch>)>,
    cut: &[Microbatch],
    limit: f64,
) -> Result<(u64, Vec<Microbatch>)> {
    // The cut's peak only when a faster candidate is over the limit.
    let mut cap: Option<f64> = None;
    let mut order: Vec<usize> = (0..pool.len()).collect();
    order.sort_by_key(|&i| (pool[i].0, i));
    let mut pick = 0;
    for i in order {
        if i == 0 {
            break;
        }
        let peak = pricer.peak_bytes(rank_kind, &pool[i].1)?;
        if peak <= limit {
            pick = i;
            break;
        }
        let cap = match cap {
            Some(c) => c,
            None => *cap.insert(pricer.peak_bytes(rank_kind, cut)?),
        };
        if peak <= cap {
            pick = i;
            break;
        }
    }
    Ok(pool.swap_remove(pick))
}

/// zb-auto's own choice between `ranked`, the candidate a handcrafted proxy ranked fastest
/// (step time ns, microbatches), and the first-fit-decreasing `cut`, both built with zb-auto:
/// the faster, the cut on a tie or where zb-auto cannot schedule the winner under the memory
/// limit. Returns its zb-auto step time (ns) and microbatches.
///
/// # Errors
/// The pricer's on the cut.
fn zb_auto_decides(
    pricer: &mut Pricer,
    ranked: (u64, Vec<Microbatch>),
    cut: &[Microbatch],
) -> Result<(u64, Vec<Microbatch>)> {
    let chosen = ranked.1;
    let t_win = pricer.price(ScheduleKind::ZbAuto, &chosen, None).ok();
    let t_cut = pricer.price(ScheduleKind::ZbAuto, cut, None)?;
    Ok(match t_win {
        Some(w) if w < t_cut => (w, chosen),
        _ => (t_cut, cut.to_vec()),
    })
}

/// The kind that prices candidates for `kind` with `v` stages per rank: zb-auto, searched per
/// step, by the handcrafted zero-bubble schedule of its placement (ZB-H1 in loop, ZB-V in V).
fn ranking_kind(kind: ScheduleKind, v: u32) -> ScheduleKind {
    match (kind, v) {
        (ScheduleKind::ZbAuto, 1) => ScheduleKind::ZbH1,
        (ScheduleKind::ZbAuto, _) => ScheduleKind::ZbV,
        (k, _) => k,
    }
}

/// The ramps tried at both ends of a count's bins (besides none).
const RAMPS: [usize; 3] = [1, 2, 4];

/// Prices candidates: the schedule of each microbatch count (chunk chains ordered) built once.
struct Pricer<'a> {
    config: &'a RunConfig,
    profile: &'a Profile,
    replica: usize,
    /// (count, positions of the chunk microbatches) -> the schedule.
    schedules: HashMap<(u32, Vec<u32>), Arc<Schedule>>,
}

impl Pricer<'_> {
    /// `kind`'s schedule for `mbs` (reordered by `perm`), chunk chains ordered; built once per
    /// count and chunk positions.
    fn schedule(
        &mut self,
        kind: ScheduleKind,
        mbs: &[Microbatch],
        perm: Option<&[usize]>,
    ) -> Result<Arc<Schedule>> {
        let m = mbs.len() as u32;
        let order: Vec<usize> = match perm {
            Some(perm) => perm.to_vec(),
            None => (0..mbs.len()).collect(),
        };
        let key: Vec<u32> = order
            .iter()
            .enumerate()
            .filter(|(_, k)| mbs[**k].chunk.is_some())
            .map(|(j, _)| j as u32)
            .collect();
        if let Some(s) = self.schedules.get(&(m, key.clone())) {
            return Ok(Arc::clone(s));
        }
        let s = cached_schedule(kind, self.config.pp, self.config.v, m)?;
        let ordered: Vec<Microbatch> = order.iter().map(|&k| mbs[k].clone()).collect();
        let chains = crate::schedules::chunks::chains(&ordered)?;
        let s = if chains.is_empty() {
            s
        } else {
            Arc::new(crate::schedules::chunks::order_chunks(&s, &chains)?)
        };
        self.schedules.insert((m, key), Arc::clone(&s));
        Ok(s)
    }

    /// The most memory a rank holds running `kind` on `mbs`: parameters, gradients and
    /// optimizer state plus its peak activations, bytes.
    fn peak_bytes(&mut self, kind: ScheduleKind, mbs: &[Microbatch]) -> Result<f64> {
        let schedule = self.schedule(kind, mbs, None)?;
        let costs = self.costs(kind, mbs)?;
        let timeline = replay::replay(&schedule, &costs)?;
        let levels = crate::replay::metrics::memory_levels(crate::replay::metrics::memory_events(
            &schedule, &costs, &timeline,
        ));
        Ok(levels
            .iter()
            .enumerate()
            .map(|(r, l)| {
                let peak = l.iter().map(|&(_, x)| x).fold(0.0, f64::max);
                costs.static_bytes(Rank(r as u32)) + peak
            })
            .fold(0.0, f64::max))
    }

    /// The cost table of `mbs` on `kind`'s placement.
    fn costs(&self, kind: ScheduleKind, mbs: &[Microbatch]) -> Result<TableCosts> {
        let placement = kind.placement_on(self.config.pp, self.config.v)?;
        round_costs(
            self.config,
            self.profile,
            &placement,
            (mbs, &[]),
            self.replica,
            true,
        )
    }

    /// The replay's makespan of `kind` on `mbs`, ns; with `permuted`, on `mbs` reordered by the
    /// permutation, whose cost table (of `mbs` in their order) is given.
    fn price(
        &mut self,
        kind: ScheduleKind,
        mbs: &[Microbatch],
        permuted: Option<(&TableCosts, &[usize])>,
    ) -> Result<u64> {
        let m = mbs.len() as u32;
        if kind == ScheduleKind::ZbAuto {
            let costs = self.costs(kind, mbs)?;
            let limit = zb_auto_activation_limit(
                self.profile,
                self.config.memory_limit_bytes,
                &costs,
                self.config.pp,
            )?;
            let s = kind.build(self.config.pp, self.config.v, m, &costs, limit)?;
            let chains = crate::schedules::chunks::chains(mbs)?;
            let s = if chains.is_empty() {
                s
            } else {
                crate::schedules::chunks::order_chunks(&s, &chains)?
            };
            return Ok(replay::replay(&s, &costs)?.makespan_ns());
        }
        let schedule = self.schedule(kind, mbs, permuted.map(|p| p.1))?;
        let t = match permuted {
            Some((base, perm)) => replay::replay(&schedule, &base.permuted(perm))?,
            None => replay::replay(&schedule, &self.costs(kind, mbs)?)?,
        };
        Ok(t.makespan_ns())
    }
}

/// LPT of `order` (cost, tokens; heaviest first) into `m` bins of at most `budget` tokens:
/// each sequence to the bin with the least load per target among those it fits. Targets ramp
/// up over the first `ramp` bins and down over the last `ramp` (bin j's is
/// `min(j + 1, m - j, ramp + 1) / (ramp + 1)`; `ramp` 0: all equal). `None` when a sequence
/// fits no bin, or for a ramp when the bins must be filled by the budget's rule.
/// Returns each bin's load and microbatch.
fn lpt_under_budget(
    order: &[(f64, u32)],
    m: usize,
    budget: u64,
    ramp: usize,
) -> Option<Vec<(f64, Microbatch)>> {
    // Without the budget first (each sequence to its heap's top: O(log m)); where that
    // overfills a bin, again with the budget checked (O(m log m) per sequence when the bins are
    // nearly full: only for equal targets, the ramps skip such a count).
    if let Some(bins) = lpt_levels(order, m, None, ramp) {
        if bins.iter().all(|(_, b)| b.tokens() <= budget) {
            return Some(bins);
        }
    }
    if ramp > 0 {
        return None;
    }
    lpt_levels(order, m, Some(budget), ramp)
}

/// [`lpt_under_budget`]'s LPT, with the budget checked (`Some`) or not.
fn lpt_levels(
    order: &[(f64, u32)],
    m: usize,
    budget: Option<u64>,
    ramp: usize,
) -> Option<Vec<(f64, Microbatch)>> {
    let budget = budget.unwrap_or(u64::MAX);
    use std::cmp::Reverse;
    use std::collections::BinaryHeap;
    /// A bin in a heap: least load first, then lowest index.
    #[derive(Clone, Copy, PartialEq)]
    struct Bin(f64, usize);
    impl Eq for Bin {}
    impl PartialOrd for Bin {
        fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
            Some(self.cmp(o))
        }
    }
    impl Ord for Bin {
        fn cmp(&self, o: &Self) -> std::cmp::Ordering {
            self.0.total_cmp(&o.0).then(self.1.cmp(&o.1))
        }
    }
    // Bin j's level: its distance from the nearer end, at most ramp + 1 (target 1). One heap
    // per level, by load, so each sequence finds the least `(load + c) / target` among the
    // bins it fits in O(levels · log m).
    let level = |j: usize| (j + 1).min(m - j).min(ramp + 1);
    let target = |h: usize| h as f64 / (ramp + 1) as f64;
    let mut heaps: Vec<BinaryHeap<Reverse<Bin>>> =
        (0..ramp + 2).map(|_| BinaryHeap::new()).collect();
    for j in 0..m {
        heaps[level(j)].push(Reverse(Bin(0.0, j)));
    }
    let mut tokens = vec![0u64; m];
    let mut bins = vec![Microbatch::default(); m];
    let mut stash: Vec<Reverse<Bin>> = Vec::new();
    let mut tops: Vec<(usize, Bin)> = Vec::with_capacity(heaps.len());
    for &(c, s) in order {
        if budget == u64::MAX {
            // No budget: the least `(load + c) / target` of the heaps' tops.
            let mut pick: Option<(f64, usize, usize)> = None;
            for (h, heap) in heaps.iter().enumerate() {
                if let Some(&Reverse(Bin(load, j))) = heap.peek() {
                    let key = (load + c) / target(h);
                    if pick.is_none_or(|(k, pj, _)| key < k || (key == k && j < pj)) {
                        pick = Some((key, j, h));
                    }
                }
            }
            let (_, j, h) = pick?;
            let Reverse(Bin(load, _)) = heaps[h].pop().expect("peeked");
            tokens[j] += s as u64;
            bins[j].seq_lens.push(s);
            heaps[h].push(Reverse(Bin(load + c, j)));
            continue;
        }
        // Each heap's least-loaded bin that the sequence fits, popped; the bins above it that
        // it does not fit wait in the stash.
        tops.clear();
        for (h, heap) in heaps.iter_mut().enumerate() {
            while let Some(Reverse(bin)) = heap.pop() {
                if tokens[bin.1] + s as u64 <= budget {
                    tops.push((h, bin));
                    break;
                }
                stash.push(Reverse(bin));
            }
            for b in stash.drain(..) {
                heap.push(b);
            }
        }
        let key = |&(h, Bin(load, j)): &(usize, Bin)| ((load + c) / target(h), j);
        let pick = tops.iter().copied().min_by(|a, b| {
            let (ka, ja) = key(a);
            let (kb, jb) = key(b);
            ka.total_cmp(&kb).then(ja.cmp(&jb))
        });
        let (h, Bin(load, j)) = pick?;
        for &(g, bin) in &tops {
            if bin.1 != j {
                heaps[g].push(Reverse(bin));
            }
        }
        tokens[j] += s as u64;
        bins[j].seq_lens.push(s);
        heaps[h].push(Reverse(Bin(load + c, j)));
    }
    if bins.iter().any(|b| b.seq_lens.is_empty()) {
        return None;
    }
    let mut load = vec![0.0f64; m];
    for heap in heaps {
        for Reverse(Bin(l, j)) in heap {
            load[j] = l;
        }
    }
    Some(load.into_iter().zip(bins).collect())
}

/// The bins of one candidate in order `o`: their indices.
fn ordered(bins: &[(f64, Microbatch)], o: Order) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..bins.len()).collect();
    let heavy_first = |idx: &mut Vec<usize>| {
        idx.sort_by(|&a, &b| bins[b].0.total_cmp(&bins[a].0).then(a.cmp(&b)));
    };
    match o {
        Order::HeaviestFirst => heavy_first(&mut idx),
        Order::LightestFirst => {
            heavy_first(&mut idx);
            idx.reverse();
        }
        Order::Verl => {
            heavy_first(&mut idx);
            let mut out: Vec<usize> = idx.iter().step_by(2).rev().copied().collect();
            out.extend(idx.iter().skip(1).step_by(2).copied());
            idx = out;
        }
        Order::Ends(ramp) => {
            let m = bins.len();
            let mut mid: Vec<usize> = (ramp..m - ramp).collect();
            heavy_first(&mut mid);
            idx = (0..ramp).chain(mid).chain(m - ramp..m).collect();
        }
    }
    idx
}

/// A lower bound on one replica's step time (seconds) that holds for every cut and order of
/// its sequences: the microbatches `fixed` (chunks and sequences over the budget, as they
/// are) and the sequences `short` cut in any way into microbatches of at most the token
/// budget. Per rank r, `fill_r + work_r + optimizer_r`, the most over ranks:
///
/// - `work_r`: everything r computes, `Σ_{stages on r} F + min(B, I + W)` over the step.
///   Stage time is affine in (tokens, pairs) (`c0 + c_tok·t + c_attn·a`, [`crate::costs`]), so
///   over any cut of `short` into m microbatches it is the cost of one microbatch holding all
///   of them plus `m - 1` times an empty one's (`c0`), and `m >= ceil(Σ short / budget)`;
/// - `fill_r`: r computes nothing before a first microbatch has crossed every stage before
///   r's first (forward and transfers); every microbatch holds at least one sequence (or is
///   one of `fixed`), and time grows with tokens and pairs, so the shortest sequence alone
///   (or the cheapest of `fixed`) bounds it;
/// - `optimizer_r`: r's optimizer step after its last compute.
///
/// Per-microbatch data-parallel collectives (`fsdp-mb`) are priced as the profile's costs
/// price them; the bound does not include the per-step collectives of `dp > 1`. A few ns of
/// rounding slack per cell are subtracted (stage times are whole ns).
///
/// # Errors
/// Cost-table errors (stages not matching the profile).
pub fn lower_bound_s(
    config: &RunConfig,
    profile: &Profile,
    placement: &Placement,
    fixed: &[Microbatch],
    short: &[u32],
    replica: usize,
) -> Result<f64> {
    let budget = config.params.token_budget.max(1);
    let mut mbs: Vec<Microbatch> = fixed.to_vec();
    let n_fixed = mbs.len();
    let total: u64 = short.iter().map(|&s| s as u64).sum();
    // The fewest microbatches `short` can make: under the budget, or the exact count asked for
    // (which ignores the budget).
    let m_short = match config.params.microbatches {
        Some(m) => (m as usize).saturating_sub(n_fixed).max(1),
        None => total.div_ceil(budget) as usize,
    };
    if !short.is_empty() {
        mbs.push(Microbatch::flat(short.to_vec()));
        mbs.push(Microbatch::default());
        mbs.push(Microbatch::flat(vec![
            *short.iter().min().expect("non-empty"),
        ]));
    }
    if mbs.is_empty() {
        return Ok(0.0);
    }
    let costs = round_costs(config, profile, placement, (&mbs, &[]), replica, true)?;
    let stages = placement.num_stages();
    let cell = |s: u32, mb: usize, kind| {
        costs.compute_ns(ComputeAction {
            stage: StageId(s),
            microbatch: MicrobatchId(mb as u32),
            kind,
        })
    };
    let step_work = |s: u32, mb: usize| {
        let split = cell(s, mb, ActionKind::I) + cell(s, mb, ActionKind::W);
        cell(s, mb, ActionKind::F) + split.min(cell(s, mb, ActionKind::B))
    };
    // The items that can open the pipeline: each fixed microbatch and the shortest sequence.
    let mut openers: Vec<usize> = (0..n_fixed).collect();
    if !short.is_empty() {
        openers.push(n_fixed + 2);
    }
    let crosses = |s: u32| placement.rank_of[s as usize] != placement.rank_of[s as usize + 1];
    let mut best = 0u64;
    for r in 0..placement.num_ranks {
        let mine = placement.stages_of(Rank(r));
        let Some(first) = mine.first().map(|s| s.0) else {
            continue;
        };
        let mut work = 0u64;
        for s in &mine {
            for mb in 0..n_fixed {
                work += step_work(s.0, mb);
            }
            if !short.is_empty() {
                work += step_work(s.0, n_fixed);
                work += (m_short.saturating_sub(1)) as u64 * step_work(s.0, n_fixed + 1);
            }
        }
        let fill = openers
            .iter()
            .map(|&mb| {
                (0..first)
                    .map(|s| {
                        cell(s, mb, ActionKind::F)
                            + if crosses(s) {
                                costs.comm_ns(StageId(s), MicrobatchId(mb as u32), ActionKind::F)
                            } else {
                                0
                            }
                    })
                    .sum::<u64>()
            })
            .min()
            .unwrap_or(0);
        let slack = 4 * (n_fixed + m_short.max(1)) as u64 * stages as u64;
        let t = (fill + work + costs.optimizer_ns(Rank(r))).saturating_sub(slack);
        best = best.max(t);
    }
    Ok(ns_to_s(
        best.max(chain_bound_ns(config, profile, fixed, replica)?),
    ))
}

/// The bound of the chunked sequences alone: [`crate::replay::metrics::lower_bound_ns`] of the
/// schedule kind run on the `fixed` microbatches only (its chunk chains' critical paths, their
/// fill and work). Every term of it holds in any schedule of the whole step, which runs the
/// same chains and more work on the same ranks. 0 without chains, for a given schedule, or
/// when the kind cannot run that few microbatches.
fn chain_bound_ns(
    config: &RunConfig,
    profile: &Profile,
    fixed: &[Microbatch],
    replica: usize,
) -> Result<u64> {
    let chains = crate::schedules::chunks::chains(fixed)?;
    let ScheduleSource::Kind(kind) = config.source else {
        return Ok(0);
    };
    if chains.is_empty() {
        return Ok(0);
    }
    let kind = ranking_kind(kind, config.v);
    let Ok(schedule) = cached_schedule(kind, config.pp, config.v, fixed.len() as u32) else {
        return Ok(0);
    };
    let Ok(schedule) = crate::schedules::chunks::order_chunks(&schedule, &chains) else {
        return Ok(0);
    };
    let costs = round_costs(
        config,
        profile,
        &schedule.placement,
        (fixed, &[]),
        replica,
        true,
    )?;
    // Whole-ns rounding of each cell: a few ns per action of slack.
    let slack = 4 * schedule.num_compute_actions() as u64;
    Ok(crate::replay::metrics::lower_bound_ns(&schedule, &costs).saturating_sub(slack))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::batching::policy::Policy;
    use crate::run::config::Capacity;

    fn setup(kind: ScheduleKind) -> (RunConfig, Profile) {
        let model = flatpipe_profiles::builtins::model("llama3.1-8b").unwrap();
        let hw = flatpipe_profiles::builtins::hardware("h200").unwrap();
        let profile =
            flatpipe_profiles::analytic_profile(&model, &hw, &Default::default()).unwrap();
        let v = kind.stages_per_rank(None).unwrap();
        let stages = crate::run::plan::even_split(profile.layers.len(), (4 * v) as usize).unwrap();
        let c = RunConfig::new(
            ScheduleSource::Kind(kind),
            4,
            v,
            stages,
            Policy::FlatPlanned,
            Capacity::Dynamic,
        );
        (c, profile)
    }

    /// The memory rule's peak (replay + memory events) is `simulate`'s: the most of any rank's
    /// state plus peak activations.
    #[test]
    fn peak_bytes_is_the_simulated_peak() {
        for kind in [ScheduleKind::OneFOneB, ScheduleKind::ZbV] {
            let (c, profile) = setup(kind);
            let mut mbs: Vec<Microbatch> = [900u32, 5_000, 3_000, 12_000, 700, 2_500, 8_000]
                .iter()
                .map(|&s| Microbatch::flat(vec![s]))
                .collect();
            mbs.extend(Microbatch::chunks(7, 40_000, 16_384).unwrap());
            let mut pricer = Pricer {
                config: &c,
                profile: &profile,
                replica: 0,
                schedules: HashMap::new(),
            };
            let got = pricer.peak_bytes(kind, &mbs).unwrap();
            let schedule = pricer.schedule(kind, &mbs, None).unwrap();
            let costs = pricer.costs(kind, &mbs).unwrap();
            let sim = crate::simulate(&schedule, &costs).unwrap();
            let want = sim
                .metrics
                .ranks
                .iter()
                .enumerate()
                .map(|(r, m)| costs.static_bytes(Rank(r as u32)) + m.peak_activation_bytes.unwrap())
                .fold(0.0, f64::max);
            assert!((got - want).abs() <= 1e-6 * want, "{kind}: {got} vs {want}");
        }
    }

    /// Under a limit every cut is over, the planned microbatches hold at most the cut's peak.
    #[test]
    fn over_the_limit_the_plan_keeps_within_the_cuts_peak() {
        let (mut c, profile) = setup(ScheduleKind::ZbV);
        c.memory_limit_bytes = Some(1.0);
        let seqs: Vec<u32> = (0..48).map(|i| 200 + (i * 7919 % 5_000) as u32).collect();
        let cut = crate::batching::policy::batch(
            Policy::FlatFfd,
            &seqs,
            &c.params,
            &balance_cost(&profile),
        )
        .unwrap()
        .microbatches;
        let planned = plan(&c, &profile, &cut, 0).unwrap();
        let mut pricer = Pricer {
            config: &c,
            profile: &profile,
            replica: 0,
            schedules: HashMap::new(),
        };
        let cap = pricer.peak_bytes(ScheduleKind::ZbV, &cut).unwrap();
        let got = pricer
            .peak_bytes(ScheduleKind::ZbV, &planned.microbatches)
            .unwrap();
        assert!(got <= cap, "{got} > {cap}");
        assert!(planned.candidates > 1);
    }

    /// An exact microbatch count is the user's: the plan keeps the cut (the old planner changed
    /// the count), and the bound counts the fixed costs of that many microbatches.
    #[test]
    fn an_exact_count_keeps_the_cut() {
        let (mut c, profile) = setup(ScheduleKind::OneFOneB);
        c.params.microbatches = Some(2);
        let seqs = [20_000u32, 15_000, 9_000, 4_000, 3_000];
        let cut = crate::batching::policy::batch(
            Policy::FlatPlanned,
            &seqs,
            &c.params,
            &balance_cost(&profile),
        )
        .unwrap()
        .microbatches;
        assert_eq!(cut.len(), 2);
        let planned = plan(&c, &profile, &cut, 0).unwrap();
        assert_eq!(planned.microbatches, cut);
        let r = crate::run::step::plan_replica(&c, Some(&profile), cut, 0).unwrap();
        let t = r.outcome(&c, &profile).unwrap().step_time_s;
        assert!(
            planned.lower_bound_s <= t,
            "{} > {t}",
            planned.lower_bound_s
        );
    }
}
