//! Replay: the step's timeline as the longest path through its dependency DAG.
//!
//! The DAG (see [`crate::replay::dag`]) has one node per compute action and per transfer, and edges for
//! (1) data dependencies: F(s) -> F(s+1); I or B of stage s+1 -> I or B of s; F -> I or B and
//! I -> W on one stage; between the chunks of one sequence ([`crate::ir::Schedule::chunks`]),
//! on each stage F(k-1) -> F(k) and backward(k) -> backward(k-1); (2) each rank's action order; (3) each link's FIFO order: one link per
//! ordered rank pair, transfers in the order the sender issues them. An op starts when all its
//! predecessors have ended; its end is its start plus its duration.
//!
//! This module computes exactly that longest path without materialising the graph: every
//! rank's predecessor in program order is its previous op, and a link's FIFO predecessor is the
//! previous transfer the same sender issued on it, so a topological order is produced by
//! advancing each rank's program counter while its next action's data are ready, waking a rank
//! when data it waits for arrive. Each op is visited once: `O(ops)`. The petgraph DAG in
//! [`crate::replay::dag`] computes the same times and is the cross-check in the tests; when ranks stop
//! with work left, it finds the dependency cycle to report.

pub mod dag;
pub mod metrics;
pub mod multistep;
pub mod streams;
pub mod summary;
pub mod timeline;

use crate::Result;
use crate::costs::CostModel;
use crate::ir::{
    Action, ActionKind, ChunkLinks, ComputeAction, Placement, Rank, Schedule, StageId,
};
use crate::replay::timeline::{TimedOp, TimedTransfer, Timeline};
use std::collections::VecDeque;

const UNSET: u64 = u64::MAX;

/// One (stage, microbatch)'s times, ns (`UNSET` until known).
#[derive(Clone, Copy)]
#[repr(align(32))]
struct Cell {
    /// The activation is available at this stage.
    act_ready: u64,
    /// The output gradient is available at this stage.
    grad_ready: u64,
    f_end: u64,
    i_end: u64,
}

const UNSET_CELL: Cell = Cell {
    act_ready: UNSET,
    grad_ready: UNSET,
    f_end: UNSET,
    i_end: UNSET,
};

/// What a replay keeps of each op as it computes the times: the whole [`Timeline`], or only
/// what the metrics need ([`crate::replay::summary::Summary`]).
pub(crate) trait Recorder {
    /// Compute op `op` of `rank` (in the rank's program order). `false` stops the replay
    /// (the caller no longer needs it: too slow or over the memory limit).
    fn op(&mut self, rank: usize, op: TimedOp) -> bool;
    /// A transfer, when the replay issues it (in each sender's program order).
    fn transfer(&mut self, t: TimedTransfer);
    /// A send or receive of `rank` with the time it held its stream (the streams' replay
    /// only), when its transfer runs. Default: not recorded.
    #[inline]
    fn comm(&mut self, rank: usize, c: timeline::TimedComm) {
        let _ = (rank, c);
    }
}

impl Recorder for Timeline {
    #[inline]
    fn op(&mut self, rank: usize, op: TimedOp) -> bool {
        self.compute[rank].push(op);
        true
    }
    #[inline]
    fn transfer(&mut self, t: TimedTransfer) {
        self.transfers.push(t);
    }
    /// Kept where the timeline was made with comm lanes (`comm` holds one per rank).
    #[inline]
    fn comm(&mut self, rank: usize, c: timeline::TimedComm) {
        if let Some(lane) = self.comm.get_mut(rank) {
            lane.push(c);
        }
    }
}

/// Hints the cache to load the line at `p` (no effect on results; never faults, so a pointer
/// past the end is harmless).
#[inline(always)]
#[allow(unsafe_code)]
fn prefetch<T>(p: *const T) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: prefetching is a hint that never dereferences `p` architecturally and never faults.
    unsafe {
        core::arch::x86_64::_mm_prefetch::<{ core::arch::x86_64::_MM_HINT_T0 }>(p.cast::<i8>());
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

/// How far ahead the replay prefetches a rank's actions and a stage's cells.
const PREFETCH_ACTIONS: usize = 16;
const PREFETCH_CELLS: usize = 2;

/// How a replay ended.
pub(crate) enum Outcome {
    /// Every action ran: each rank's clock at its last action's end, ns.
    Done(Vec<u64>),
    /// Ranks stopped with work left (a dependency cycle).
    Stuck,
    /// The recorder stopped it.
    Stopped,
}

struct State<'a, C: CostModel, R: Recorder> {
    costs: &'a C,
    s_count: usize,
    m: usize,
    mfo: usize,
    rank_of: Vec<u32>,
    /// Per (stage, mb), `s * m + mb`: the times one action reads and writes, side by side
    /// (one cache line holds two cells; separate arrays cost 4 cache misses per I where this
    /// costs 2: the step's state far exceeds the cache at p = 64, m = 4096).
    cells: Vec<Cell>,
    /// End of (stage, mb)'s I or B (read only for chunk chains).
    bwd_end: Vec<u64>,
    /// The chunk chains' links, when a sequence was cut.
    chunk: Option<ChunkLinks>,
    fo_ready: Vec<u64>,
    /// Per sender rank: (receiver, time the link is free).
    links: Vec<Vec<(u32, u64)>>,
    rec: R,
    wake: Vec<u32>,
}

impl<C: CostModel, R: Recorder> State<'_, C, R> {
    /// Time the data `a` needs are available, or None if they are not yet.
    #[inline]
    fn ready(&self, a: ComputeAction) -> Option<u64> {
        let (s, mb) = (a.stage.idx(), a.microbatch.idx());
        let t = match a.kind {
            ActionKind::F => self.cells[s * self.m + mb].act_ready,
            ActionKind::Fo => self.fo_ready[s * self.mfo + mb],
            ActionKind::I | ActionKind::B => {
                let c = &self.cells[s * self.m + mb];
                let (f, g) = (c.f_end, c.grad_ready);
                if f == UNSET || g == UNSET {
                    UNSET
                } else {
                    f.max(g)
                }
            }
            ActionKind::W => self.cells[s * self.m + mb].i_end,
        };
        if t == UNSET {
            return None;
        }
        match &self.chunk {
            None => Some(t),
            Some(c) => self.chunk_ready(c, (s, mb), a.kind, t),
        }
    }

    /// [`State::ready`] for a schedule with chunk chains: a chunk's F also waits for the
    /// previous chunk's F, its backward for the next chunk's (kept out of the common path).
    #[inline(never)]
    fn chunk_ready(
        &self,
        c: &ChunkLinks,
        (s, mb): (usize, usize),
        kind: ActionKind,
        t: u64,
    ) -> Option<u64> {
        let dep = match kind {
            ActionKind::F if c.prev[mb] != ChunkLinks::NONE => {
                self.cells[s * self.m + c.prev[mb] as usize].f_end
            }
            ActionKind::I | ActionKind::B if c.next[mb] != ChunkLinks::NONE => {
                self.bwd_end[s * self.m + c.next[mb] as usize]
            }
            _ => 0,
        };
        (dep != UNSET).then_some(t.max(dep))
    }

    #[inline]
    fn send(&mut self, from: u32, to_stage: usize, a: ComputeAction, end: u64) -> u64 {
        let to = self.rank_of[to_stage];
        if to == from {
            return end;
        }
        let dur = self.costs.comm_ns(a.stage, a.microbatch, a.kind);
        let links = &mut self.links[from as usize];
        let slot = match links.iter().position(|(r, _)| *r == to) {
            Some(i) => i,
            None => {
                links.push((to, 0));
                links.len() - 1
            }
        };
        let start = end.max(links[slot].1);
        let arrive = start + dur;
        links[slot].1 = arrive;
        self.rec.transfer(TimedTransfer {
            from: Rank(from),
            to: Rank(to),
            stage: a.stage,
            microbatch: a.microbatch,
            kind: a.kind,
            start_ns: start,
            end_ns: arrive,
        });
        self.wake.push(to);
        arrive
    }

    #[inline]
    fn complete(&mut self, r: u32, a: ComputeAction, end: u64) {
        let (s, mb) = (a.stage.idx(), a.microbatch.idx());
        let to = a.sends(self.s_count as u32).map(StageId::idx);
        match a.kind {
            ActionKind::F => {
                self.cells[s * self.m + mb].f_end = end;
                if let Some(to) = to {
                    let t = self.send(r, to, a, end);
                    self.cells[to * self.m + mb].act_ready = t;
                } else {
                    // The loss gradient is available once the last stage's forward ends.
                    self.cells[s * self.m + mb].grad_ready = end;
                }
            }
            ActionKind::Fo => {
                if let Some(to) = to {
                    let t = self.send(r, to, a, end);
                    self.fo_ready[to * self.mfo + mb] = t;
                }
            }
            ActionKind::I | ActionKind::B => {
                if a.kind == ActionKind::I {
                    self.cells[s * self.m + mb].i_end = end;
                }
                if self.chunk.is_some() {
                    self.bwd_end[s * self.m + mb] = end;
                }
                if let Some(to) = to {
                    let t = self.send(r, to, a, end);
                    self.cells[to * self.m + mb].grad_ready = t;
                }
            }
            ActionKind::W => {}
        }
    }
}

/// Replays `schedule` under `costs` and returns its timeline. The schedule should have passed
/// [`Schedule::validate`]; each rank's optimizer step (if its cost is non-zero) follows its last
/// action.
///
/// # Errors
/// [`crate::Error::Deadlock`] naming the actions on a dependency cycle when the schedule
/// cannot finish.
pub fn replay<C: CostModel>(schedule: &Schedule, costs: &C) -> Result<Timeline> {
    replay_or_stuck(schedule, costs).ok_or_else(|| dag::deadlock_error(schedule))
}

/// Whether `schedule` finishes (no dependency cycle), without building the deadlock report.
pub fn is_deadlock_free(schedule: &Schedule) -> bool {
    use crate::costs::{UniformCostSpec, UniformCosts};
    replay_or_stuck(schedule, &UniformCosts::new(&UniformCostSpec::default(), 1)).is_some()
}

/// The replay, or `None` when ranks stop with work left.
fn replay_or_stuck<C: CostModel>(schedule: &Schedule, costs: &C) -> Option<Timeline> {
    let p = schedule.placement.num_ranks as usize;
    let mut links = vec![Vec::new(); p];
    let timeline = Timeline {
        compute: schedule
            .ranks
            .iter()
            .map(|a| Vec::with_capacity(a.len()))
            .collect(),
        transfers: Vec::with_capacity(schedule.num_compute_actions()),
        optimizer: vec![None; p],
        comm: Vec::new(),
    };
    let (Outcome::Done(clock), mut timeline) =
        run(schedule, costs, &vec![0; p], &mut links, timeline)
    else {
        return None;
    };
    for (r, &end) in clock.iter().enumerate() {
        let opt = costs.optimizer_ns(Rank(r as u32));
        if opt > 0 {
            timeline.optimizer[r] = Some((end, end + opt));
        }
    }
    Some(timeline)
}

/// Link clocks carried from one step to the next: per sender rank, (receiver, time the link is
/// free), ns.
pub(crate) type LinkClocks = Vec<Vec<(u32, u64)>>;

/// Records nothing: for replays that only need each rank's clock at the end.
pub(crate) struct NoRecord;

impl Recorder for NoRecord {
    #[inline]
    fn op(&mut self, _: usize, _: TimedOp) -> bool {
        true
    }
    #[inline]
    fn transfer(&mut self, _: TimedTransfer) {}
}

/// The replay of one step whose ranks may start no earlier than `ready[r]` (ns) and whose links
/// are busy until `links` says (updated in place): each rank's clock at its last action's end,
/// without optimizer steps and without a timeline. `None` when ranks stop with work left. Used
/// by [`crate::replay::multistep`] to chain consecutive steps.
pub(crate) fn replay_from<C: CostModel>(
    schedule: &Schedule,
    costs: &C,
    ready: &[u64],
    links: &mut LinkClocks,
) -> Option<Vec<u64>> {
    match run(schedule, costs, ready, links, NoRecord) {
        (Outcome::Done(clock), _) => Some(clock),
        _ => None,
    }
}

/// The replay loop, recording into `rec` (returned with the outcome). `links` is updated in
/// place: after [`Outcome::Stuck`] or [`Outcome::Stopped`] it holds the clocks of the
/// transfers issued so far (no caller reuses them then).
pub(crate) fn run<C: CostModel, R: Recorder>(
    schedule: &Schedule,
    costs: &C,
    ready: &[u64],
    links: &mut LinkClocks,
    rec: R,
) -> (Outcome, R) {
    let p = schedule.placement.num_ranks as usize;
    let s_count = schedule.num_stages() as usize;
    let m = schedule.num_microbatches as usize;
    let mfo = schedule.num_fo_microbatches as usize;
    // A malformed chain is a schedule no replay can finish.
    let Ok(chunk) = schedule.chunk_links() else {
        return (Outcome::Stuck, rec);
    };
    let mut st = State {
        costs,
        s_count,
        m,
        mfo,
        rank_of: schedule.placement.rank_of.iter().map(|r| r.0).collect(),
        cells: vec![UNSET_CELL; s_count * m],
        bwd_end: if chunk.is_some() {
            vec![UNSET; s_count * m]
        } else {
            Vec::new()
        },
        chunk,
        fo_ready: vec![UNSET; s_count * mfo],
        links: std::mem::take(links),
        rec,
        wake: Vec::new(),
    };
    for c in &mut st.cells[..m] {
        c.act_ready = 0;
    }
    st.fo_ready[..mfo].fill(0);
    let mut pc = vec![0usize; p];
    let mut clock = ready.to_vec();
    let mut queued = vec![true; p];
    let mut queue: VecDeque<u32> = (0..p as u32).collect();
    while let Some(r) = queue.pop_front() {
        let ri = r as usize;
        queued[ri] = false;
        let actions = &schedule.ranks[ri];
        while pc[ri] < actions.len() {
            // The step's actions and cells far exceed the cache, and 64 ranks' streams are more
            // than the hardware prefetcher follows: ask for this rank's next lines ahead.
            prefetch(actions.as_ptr().wrapping_add(pc[ri] + PREFETCH_ACTIONS));
            let action = actions[pc[ri]];
            if let Action::Compute(a) = action {
                // This stage's cell of a later microbatch (prefetching the neighbour stage's
                // too measured no better).
                let k = a.stage.idx() * st.m + a.microbatch.idx() + PREFETCH_CELLS;
                prefetch(st.cells.as_ptr().wrapping_add(k));
            }
            let (start, dur) = match action {
                Action::Compute(a) => match st.ready(a) {
                    Some(t) => (t.max(clock[ri]), st.costs.compute_ns(a)),
                    None => break,
                },
                Action::Overlap(a, b) => match (st.ready(a), st.ready(b)) {
                    (Some(ta), Some(tb)) => (ta.max(tb).max(clock[ri]), st.costs.overlap_ns(a, b)),
                    _ => break,
                },
            };
            let end = start + dur;
            if !st.rec.op(
                ri,
                TimedOp {
                    action,
                    start_ns: start,
                    end_ns: end,
                },
            ) {
                *links = std::mem::take(&mut st.links);
                return (Outcome::Stopped, st.rec);
            }
            clock[ri] = end;
            pc[ri] += 1;
            match action {
                Action::Compute(a) => st.complete(r, a, end),
                Action::Overlap(a, b) => {
                    st.complete(r, a, end);
                    st.complete(r, b, end);
                }
            }
            for w in st.wake.drain(..) {
                if !queued[w as usize] {
                    queued[w as usize] = true;
                    queue.push_back(w);
                }
            }
        }
    }
    *links = std::mem::take(&mut st.links);
    if (0..p).any(|r| pc[r] < schedule.ranks[r].len()) {
        return (Outcome::Stuck, st.rec);
    }
    (Outcome::Done(clock), st.rec)
}

/// The replay of a schedule built action by action (zb-auto's list scheduler): each action is
/// pushed, in its rank's program order, once every action it depends on has been pushed, so its
/// times are final at once: the same longest path as [`replay`], with no pass over a finished
/// schedule. Loop or V placement, F, I and W actions, no chunk chains and no forward-only work.
pub(crate) struct Incremental<'a, C: CostModel, R: Recorder> {
    st: State<'a, C, R>,
    clock: Vec<u64>,
}

impl<'a, C: CostModel, R: Recorder> Incremental<'a, C, R> {
    /// `m` microbatches over `placement`, recording into `rec`.
    pub(crate) fn new(placement: &Placement, m: usize, costs: &'a C, rec: R) -> Self {
        let p = placement.num_ranks as usize;
        let s_count = placement.rank_of.len();
        let mut cells = vec![UNSET_CELL; s_count * m];
        for c in &mut cells[..m] {
            c.act_ready = 0;
        }
        Incremental {
            st: State {
                costs,
                s_count,
                m,
                mfo: 0,
                rank_of: placement.rank_of.iter().map(|r| r.0).collect(),
                cells,
                bwd_end: Vec::new(),
                chunk: None,
                fo_ready: Vec::new(),
                links: vec![Vec::new(); p],
                rec,
                wake: Vec::new(),
            },
            clock: vec![0; p],
        }
    }

    /// Runs `a` (compute time `dur` ns, [`CostModel::compute_ns`]) next on rank `r`: it starts
    /// when the rank is free and its data are ready. `false` when the recorder stops the replay.
    ///
    /// # Panics
    /// When an action `a` depends on was not pushed before it (a bug of the caller).
    #[inline]
    pub(crate) fn push(&mut self, r: usize, a: ComputeAction, dur: u64) -> bool {
        let ready = self
            .st
            .ready(a)
            .expect("an action is pushed after the actions it depends on");
        let start = ready.max(self.clock[r]);
        let end = start + dur;
        let op = TimedOp {
            action: Action::Compute(a),
            start_ns: start,
            end_ns: end,
        };
        if !self.st.rec.op(r, op) {
            return false;
        }
        self.clock[r] = end;
        self.st.complete(r as u32, a, end);
        self.st.wake.clear();
        true
    }

    /// Each rank's clock at its last action's end (ns) and the recorder.
    pub(crate) fn finish(self) -> (Vec<u64>, R) {
        (self.clock, self.st.rec)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::costs::{UniformCostSpec, UniformCosts};
    use crate::ir::{Placement, Schedule};
    use crate::schedules::generators::{gpipe, one_f_one_b};

    fn uniform(f: f64, b: f64, w: f64, comm: f64) -> UniformCosts {
        UniformCosts::new(
            &UniformCostSpec {
                f,
                b,
                w,
                comm,
                fb: None,
                fo: None,
                fsdp: Default::default(),
            },
            1,
        )
    }

    #[test]
    fn closed_forms_small() {
        // (m + p - 1)(f + b + w): GPipe, Huang et al. 2019; 1F1B, Narayanan et al. 2021.
        for (p, m) in [(1, 1), (4, 8), (4, 2), (3, 7)] {
            for s in [gpipe(p, m), one_f_one_b(p, m)] {
                let t = replay(&s, &uniform(1.0, 2.0, 1.0, 0.0)).unwrap();
                assert_eq!(
                    t.makespan_ns(),
                    (m + p - 1) as u64 * 4_000_000_000,
                    "{} p={p} m={m}",
                    s.name
                );
            }
        }
    }

    #[test]
    fn comm_delays_each_hop() {
        // One microbatch through p ranks: p forwards, p backwards, 2(p - 1) transfers.
        let t = replay(&one_f_one_b(4, 1), &uniform(1.0, 1.0, 0.0, 0.5)).unwrap();
        assert_eq!(t.makespan_ns(), 8_000_000_000 + 6 * 500_000_000);
        assert_eq!(t.transfers.len(), 6);
    }

    #[test]
    fn wrong_order_deadlocks_and_names_the_cycle() {
        // Rank 1 wants the backward of microbatch 0 before running its forward.
        let mut s: Schedule = one_f_one_b(2, 1);
        s.ranks[1].swap(0, 1);
        assert_eq!(s.placement, Placement::looped(2, 1));
        let e = replay(&s, &uniform(1.0, 1.0, 1.0, 0.0))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("deadlocks") && e.contains("1B0") && e.contains("1F0"),
            "{e}"
        );
    }
}
