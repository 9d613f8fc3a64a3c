//! zb-auto's greedy list scheduler: one priority setting's order, built by walking simulated
//! time and replayed as it is built (the module doc of [`super`] gives the algorithm).
//!
//! One decision, in steps: the rank whose clock is earliest ([`EarliestRank`]) finds what it
//! can run at that time ([`Greedy::ready`]); its priority setting picks the kind
//! ([`Priority::decide`]); the action runs ([`Greedy::run`]: the replay, then the state it
//! changes, [`Greedy::complete`]), or the rank idles until its next known arrival
//! ([`Greedy::idle`]). Each step is called once per decision: keep them free of allocation.

use super::priority::{Agreement, HAS_F, HAS_I, HAS_W, Priority, TIGHT};
use super::tournament::{EarliestRank, UNSET};
use crate::costs::CostModel;
use crate::ir::{Action, ActionKind, ComputeAction, MicrobatchId, Placement, StageId};
use crate::{replay, replay::summary};
use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};

/// The greedy list schedule of one priority setting, replayed as it is built: its per-rank
/// action lists and summary, or `None` when it deadlocks under `limit` or cannot beat
/// `to_beat`. `alike` is set to the settings of `agreement` that decided as `prio` at every
/// step taken (so they would build the same order, or give up at the same point).
#[allow(clippy::too_many_arguments)]
pub(super) fn greedy<C: CostModel>(
    placement: &Placement,
    m: u32,
    costs: &C,
    limit: f64,
    prio: Priority,
    to_beat: &summary::ToBeat,
    agreement: &Agreement,
    alike: &mut u32,
) -> Option<(Vec<Vec<Action>>, summary::Summary)> {
    // The stages per rank as a constant, so each decision's loops over them unroll (loop
    // placement has one): about 2% off zb-auto's Llama-3.1-8B step at p = 16, m = 64.
    if placement.rank_of.len() == placement.num_ranks as usize {
        greedy_v::<C, 1>(placement, m, costs, limit, prio, to_beat, agreement, alike)
    } else {
        greedy_v::<C, 2>(placement, m, costs, limit, prio, to_beat, agreement, alike)
    }
}

/// [`greedy`] on a placement with `V` stages on every rank (loop: 1, V placement: 2).
#[allow(clippy::too_many_arguments)]
fn greedy_v<C: CostModel, const V: usize>(
    placement: &Placement,
    m: u32,
    costs: &C,
    limit: f64,
    prio: Priority,
    to_beat: &summary::ToBeat,
    agreement: &Agreement,
    alike: &mut u32,
) -> Option<(Vec<Vec<Action>>, summary::Summary)> {
    *alike = u32::MAX;
    let mut g = Greedy::<C, V>::new(
        placement,
        m as usize,
        costs,
        limit,
        prio.later_chunk_first,
        to_beat,
    )?;
    loop {
        // The rank with work left, not waiting, whose clock is earliest (the lowest rank on a
        // tie).
        let (earliest, r) = g.key.earliest();
        if earliest == UNSET {
            if g.left.iter().any(|&l| l > 0) {
                return None; // every rank with work waits: deadlock under this limit
            }
            break;
        }
        let t = g.clock[r];
        let ready = g.ready(r, t);
        let state = ready.state();
        *alike &= agreement.alike_in(state);
        let action = match prio.decide(state) {
            Some(ActionKind::I) => {
                let (_, s, mb) = ready.i.expect("an I is ready");
                ComputeAction::new(s as u32, ActionKind::I, mb as u32)
            }
            Some(ActionKind::F) => {
                let (s, mb) = ready.f.expect("an F is ready");
                ComputeAction::new(s as u32, ActionKind::F, mb as u32)
            }
            Some(_) => {
                let (s, mb) = g.pending_w[r].pop_front().expect("a W is pending");
                ComputeAction::new(s as u32, ActionKind::W, mb as u32)
            }
            None => {
                g.idle(r, t);
                continue;
            }
        };
        if !g.run(r, t, action) {
            return None; // this order cannot beat the best so far
        }
    }
    g.finish()
}

/// What a rank can run at its clock: the state of one greedy decision.
#[derive(Debug, Clone, Copy)]
struct Ready {
    /// The I whose input gradient arrived first among the rank's stages, `(arrival ns, stage,
    /// microbatch)` (the first stage in preference order on a tie).
    i: Option<(u64, usize, usize)>,
    /// The first F, in the rank's stage preference order, whose input has arrived and whose
    /// activations fit under the limit: `(stage, microbatch)`.
    f: Option<(usize, usize)>,
    /// No F fits, but one has its input: the limit alone holds it back.
    tight: bool,
    /// A W is pending on the rank.
    has_w: bool,
}

impl Ready {
    /// The decision state: bits [`HAS_I`] .. [`HAS_W`].
    #[inline]
    fn state(self) -> usize {
        usize::from(self.i.is_some()) * HAS_I
            + usize::from(self.f.is_some()) * HAS_F
            + usize::from(self.tight) * TIGHT
            + usize::from(self.has_w) * HAS_W
    }
}

/// The greedy's state while it builds one order over `p` ranks, `s_count` stages (`V` per
/// rank) and `m` microbatches; times in ns, memory in the cost model's unit.
struct Greedy<'a, C: CostModel, const V: usize> {
    placement: &'a Placement,
    costs: &'a C,
    /// The memory limit per rank.
    limit: f64,
    m: usize,
    /// The last stage's index.
    last: usize,
    /// Per rank, its stages in preference order (the later first under `later_chunk_first`).
    rank_stages: Vec<[usize; V]>,
    /// Per (stage, microbatch) cell (`s * m + mb`), when the F's input arrives; `UNSET` before
    /// the previous stage's F has run.
    act_ready: Vec<u64>,
    /// Per stage, the (arrival, microbatch) of the input gradients sent to it whose I is not
    /// done (on the last stage, every F done: its I needs no gradient, arrival 0), earliest
    /// first and the lower microbatch on a tie. The earliest is the only I candidate of a
    /// stage; a scan of every in-flight microbatch per decision cost the greedy a third of its
    /// time.
    arrived: Vec<BinaryHeap<Reverse<(u64, usize)>>>,
    /// Per stage, the next microbatch whose F has not run.
    next_f: Vec<usize>,
    /// Per rank, (stage, microbatch) of the I done whose W is not, in I order.
    pending_w: Vec<VecDeque<(usize, usize)>>,
    /// Per rank, the time it can next act.
    clock: Vec<u64>,
    /// Per rank, the activations it holds.
    mem: Vec<f64>,
    /// Per rank, the actions it has left to run.
    left: Vec<usize>,
    /// Per rank: idle with nothing known to arrive, until another rank sends it something.
    waiting: Vec<bool>,
    /// Per rank, its clock when it can act (work left, not waiting), else `UNSET`.
    key: EarliestRank,
    /// Per rank, the order built so far.
    out: Vec<Vec<Action>>,
    /// The replay of the order as it is built: the greedy's clocks decide, the replay's times
    /// (an action starts once its rank is free and its data are ready, transfers queue on
    /// their link) are the candidate's, exactly what `summary::replay_to_beat` would give.
    times: replay::Incremental<'a, C, summary::Lean<'a, C>>,
}

/// Per rank, its `V` stages in preference order (the later first if `later_chunk_first`);
/// `None` when a rank holds other than `V` stages (not a placement zb-auto builds,
/// [`super::placement`]).
fn rank_stages<const V: usize>(
    placement: &Placement,
    later_chunk_first: bool,
) -> Option<Vec<[usize; V]>> {
    let p = placement.num_ranks as usize;
    let mut rank_stages = vec![[0usize; V]; p];
    let mut held = vec![0usize; p];
    for (s, r) in placement.rank_of.iter().enumerate() {
        let (r, k) = (r.idx(), held[r.idx()]);
        if k == V {
            return None; // more than V stages
        }
        rank_stages[r][k] = s;
        held[r] += 1;
    }
    if held.iter().any(|&k| k != V) {
        return None;
    }
    if later_chunk_first {
        for stages in &mut rank_stages {
            stages.reverse();
        }
    }
    Some(rank_stages)
}

impl<'a, C: CostModel, const V: usize> Greedy<'a, C, V> {
    /// The state before the first decision: every stage 0 input ready at 0, every rank able to
    /// act at 0. `None` when the placement has other than `V` stages on a rank.
    fn new(
        placement: &'a Placement,
        m: usize,
        costs: &'a C,
        limit: f64,
        later_chunk_first: bool,
        to_beat: &summary::ToBeat<'a>,
    ) -> Option<Self> {
        let p = placement.num_ranks as usize;
        let s_count = placement.rank_of.len();
        let rank_stages = rank_stages::<V>(placement, later_chunk_first)?;
        let mut act_ready = vec![UNSET; s_count * m];
        act_ready[..m].fill(0);
        let mut left = vec![0usize; p];
        for r in &placement.rank_of {
            left[r.idx()] += 3 * m;
        }
        // Each rank's exact length (`vec![v; p]` would clone an empty vector's capacity away).
        let out: Vec<Vec<Action>> = left.iter().map(|&l| Vec::with_capacity(l)).collect();
        let times = replay::Incremental::new(
            placement,
            m,
            costs,
            summary::Lean::new(placement, m, costs, to_beat),
        );
        let mut key = EarliestRank::new(p);
        for (q, &l) in left.iter().enumerate() {
            if l > 0 {
                key.set(q, 0);
            }
        }
        Some(Greedy {
            placement,
            costs,
            limit,
            m,
            last: s_count - 1,
            rank_stages,
            act_ready,
            arrived: vec![BinaryHeap::new(); s_count],
            next_f: vec![0usize; s_count],
            pending_w: vec![VecDeque::new(); p],
            clock: vec![0u64; p],
            mem: vec![0.0f64; p],
            left,
            waiting: vec![false; p],
            key,
            out,
            times,
        })
    }

    /// The index of cell (stage `s`, microbatch `mb`) in [`Greedy::act_ready`].
    #[inline]
    fn cell(&self, s: usize, mb: usize) -> usize {
        s * self.m + mb
    }

    /// The activations an F of stage `s`, microbatch `mb` keeps (both parts).
    #[inline]
    fn act(&self, s: usize, mb: usize) -> f64 {
        let (a, b) = self
            .costs
            .activation(StageId(s as u32), MicrobatchId(mb as u32));
        a + b
    }

    /// The transfer time (ns) of `kind`'s output of stage `s`, microbatch `mb`, run on rank
    /// `r`, to stage `to`: 0 when `to` is on the same rank.
    #[inline]
    fn transfer_ns(&self, r: usize, to: usize, s: usize, mb: usize, kind: ActionKind) -> u64 {
        if self.placement.rank_of[to].idx() == r {
            0
        } else {
            self.costs
                .comm_ns(StageId(s as u32), MicrobatchId(mb as u32), kind)
        }
    }

    /// What rank `r` can run at its clock `t`.
    #[inline]
    fn ready(&self, r: usize, t: u64) -> Ready {
        let stages = &self.rank_stages[r];
        // Ready I: the earliest-arrived gradient among this rank's stages (the first stage in
        // preference order on a tie).
        let mut i: Option<(u64, usize, usize)> = None;
        for &s in stages {
            if let Some(&Reverse((g, mb))) = self.arrived[s].peek()
                && g <= t
                && i.is_none_or(|(g0, _, _)| g < g0)
            {
                i = Some((g, s, mb));
            }
        }
        // Ready F under the limit, in the rank's stage preference order.
        let mut f: Option<(usize, usize)> = None;
        let mut f_blocked_by_memory = false;
        for &s in stages {
            let mb = self.next_f[s];
            if mb < self.m && self.act_ready[self.cell(s, mb)] <= t {
                if self.mem[r] + self.act(s, mb) <= self.limit + 1e-9 {
                    f = Some((s, mb));
                    break;
                }
                f_blocked_by_memory = true;
            }
        }
        Ready {
            i,
            f,
            tight: f.is_none() && f_blocked_by_memory,
            has_w: !self.pending_w[r].is_empty(),
        }
    }

    /// Rank `r`, with nothing to run at its clock `t`, idles until the next arrival it can know
    /// of, else until another rank sends it something ([`Greedy::wake`]).
    #[inline]
    fn idle(&mut self, r: usize, t: u64) {
        let mut next = UNSET;
        for &s in &self.rank_stages[r] {
            let mb = self.next_f[s];
            let ready = if mb < self.m {
                self.act_ready[self.cell(s, mb)]
            } else {
                UNSET
            };
            if ready > t && ready != UNSET {
                next = next.min(ready);
            }
            // No I is ready, so each stage's earliest gradient arrives after t.
            if let Some(&Reverse((g, _))) = self.arrived[s].peek() {
                next = next.min(g);
            }
        }
        if next == UNSET {
            // Nothing known yet: wait until another rank sends this one something.
            self.waiting[r] = true;
        } else {
            self.clock[r] = next;
        }
        self.key.set(r, next);
    }

    /// A waiting rank, that of stage `s`, resumes when data for it arrive at `at`.
    #[inline]
    fn wake(&mut self, s: usize, at: u64) {
        let q = self.placement.rank_of[s].idx();
        if self.waiting[q] {
            self.waiting[q] = false;
            self.clock[q] = self.clock[q].max(at);
            self.key.set(q, self.clock[q]);
        }
    }

    /// Runs `action` on rank `r` from its clock `t`: the replay first (`false` when the order
    /// can no longer beat the best so far), then the greedy's state.
    #[inline]
    fn run(&mut self, r: usize, t: u64, action: ComputeAction) -> bool {
        let dur = self.costs.compute_ns(action);
        if !self.times.push(r, action, dur) {
            return false;
        }
        self.complete(r, action, t + dur);
        true
    }

    /// The state after `action` ran on rank `r` until `end`: its output is sent on (an F's
    /// activation to the next stage, an I's gradient to the previous one), its memory held or
    /// freed, and the rank's clock and key advance.
    #[inline]
    fn complete(&mut self, r: usize, action: ComputeAction, end: u64) {
        let (s, mb) = (action.stage.idx(), action.microbatch.idx());
        let (sid, mid) = (action.stage, action.microbatch);
        match action.kind {
            ActionKind::F => {
                if s == self.last {
                    self.arrived[s].push(Reverse((0, mb)));
                }
                self.next_f[s] += 1;
                self.mem[r] += self.act(s, mb);
                if s < self.last {
                    let at = end + self.transfer_ns(r, s + 1, s, mb, ActionKind::F);
                    let cell = self.cell(s + 1, mb);
                    self.act_ready[cell] = at;
                    self.wake(s + 1, at);
                }
            }
            ActionKind::I => {
                self.arrived[s].pop(); // the chosen I is its stage's earliest
                // I frees the dgrad-only part and holds what it recomputes until W.
                self.mem[r] += self.costs.recomputed(sid, mid) - self.costs.activation(sid, mid).0;
                if s > 0 {
                    let at = end + self.transfer_ns(r, s - 1, s, mb, ActionKind::I);
                    self.arrived[s - 1].push(Reverse((at, mb)));
                    self.wake(s - 1, at);
                }
                self.pending_w[r].push_back((s, mb));
            }
            ActionKind::W => {
                self.mem[r] -= self.costs.activation(sid, mid).1 + self.costs.recomputed(sid, mid);
            }
            _ => unreachable!("the greedy emits F, I and W"),
        }
        self.out[r].push(Action::Compute(action));
        self.left[r] -= 1;
        self.clock[r] = end;
        self.key.set(r, if self.left[r] > 0 { end } else { UNSET });
    }

    /// The order built and its replay's summary; `None` when the replay's recorder rejects it.
    fn finish(self) -> Option<(Vec<Vec<Action>>, summary::Summary)> {
        let (clock, lean) = self.times.finish();
        Some((self.out, lean.finish(&clock)?))
    }
}
