//! Replay of a schedule lowered to compute and communication ([`Lowered`]): every rank's
//! streams with their real semantics.
//!
//! - A stream runs its actions one at a time, in the rank's program order.
//! - A compute action starts when the compute stream is free and its inputs are there: on the
//!   rank already (a stage on the same rank, the chunk before it, its own F for I and B, its I
//!   for W), or received (the receive of its input has completed).
//! - A send is posted when its stream reaches it and the compute that produced its payload has
//!   ended (the stream waits on the compute stream's event, as PyTorch's NCCL work does); a
//!   receive is posted when its stream reaches it.
//! - A send and its receive are one transfer: it starts when both are posted and takes
//!   [`CostModel::comm_ns`] (the alpha-beta cost of the link the pair crosses); both halves hold
//!   their streams until it ends (NCCL's point-to-point kernels). A receive posted early on a
//!   shared stream therefore blocks every action behind it until its sender is ready: the
//!   head-of-line blocking PyTorch users meet on one P2P stream.
//!
//! Under [`crate::ir::lowering::Lowering::UNCONTENDED`] every receive stream holds its
//! peer's sends in their order, so each transfer starts when its payload is ready and the
//! previous transfer on the same link has ended: exactly [`crate::replay::replay`]'s FIFO links,
//! and the same timeline (a property test checks every schedule kind).
//!
//! Each action is visited a bounded number of times (a stream is woken by the one event it
//! waits on): `O(actions)`.

use super::{Cell, Outcome, Recorder, UNSET, UNSET_CELL};
use crate::costs::CostModel;
use crate::ir::comm::{
    CommAction, FsdpAction, Lowered, LoweredAction, Payload, StreamId, StreamLayout, Transfer,
    TransferIndex,
};
use crate::ir::lowering::{Lowering, RecvPosting};
use crate::ir::{Action, ActionKind, ChunkLinks, ComputeAction, Placement, Rank, Schedule};
use crate::replay::timeline::{TimedComm, TimedOp, TimedTransfer, Timeline};
use crate::{Error, Result};
use std::collections::VecDeque;

/// No stream.
const NO_STREAM: u32 = u32::MAX;

/// Replays `lowered` under `costs`: the timeline of its compute actions and transfers, each
/// rank's optimizer step after its last compute action. The lowering should have passed
/// [`Lowered::validate`].
///
/// # Errors
/// [`Error::StreamsHang`] naming every waiting stream and its head when the streams cannot
/// finish (a receive posted ahead of actions its sender waits for, or a dependency cycle).
pub fn replay_lowered<C: CostModel>(lowered: &Lowered, costs: &C) -> Result<Timeline> {
    timeline_of(&lowered.schedule, comm_streams(lowered)?, costs)
}

/// [`replay_lowered`] of `schedule` lowered under `lowering`, without building the lowered
/// program: the sweep's sends and receives go straight to their streams.
///
/// # Errors
/// As [`crate::ir::lowering::lower`] and [`replay_lowered`].
pub fn replay_lowering<C: CostModel>(
    schedule: &Schedule,
    lowering: Lowering,
    costs: &C,
) -> Result<Timeline> {
    timeline_of(schedule, swept_streams(schedule, lowering)?, costs)
}

/// The timeline of `schedule` with its transfers and collectives on `lanes`.
fn timeline_of<C: CostModel>(schedule: &Schedule, lanes: Lanes, costs: &C) -> Result<Timeline> {
    let p = schedule.placement.num_ranks as usize;
    let num_comm: usize = lanes.comm.iter().map(|c| c.ops.len()).sum();
    let timeline = Timeline {
        compute: schedule
            .ranks
            .iter()
            .map(|a| Vec::with_capacity(a.len()))
            .collect(),
        transfers: Vec::with_capacity(num_comm / 2),
        optimizer: vec![None; p],
        comm: vec![Vec::new(); p],
    };
    match run_streams(schedule, lanes, costs, timeline) {
        Ok((Outcome::Done(clock), mut timeline)) => {
            for lane in &mut timeline.comm {
                lane.sort_by_key(|c| c.start_ns);
            }
            for (r, &end) in clock.iter().enumerate() {
                let opt = costs.optimizer_ns(Rank(r as u32));
                if opt > 0 {
                    timeline.optimizer[r] = Some((end, end + opt));
                }
            }
            Ok(timeline)
        }
        Ok(_) => unreachable!("a timeline never stops a replay"),
        Err(e) => Err(e),
    }
}

/// The communication of a lowered schedule: its point-to-point streams and, with FSDP, each
/// rank's collective stream.
struct Lanes {
    comm: Vec<CommStream>,
    coll: Option<Collectives>,
}

/// No op of a collective stream.
const NO_OP: u32 = u32::MAX;

/// One op of a rank's collective stream: an all-gather (`UNSHARD`) or a reduce-scatter
/// (`REDUCE_GRAD`) of one stage, in program order.
#[derive(Clone, Copy)]
struct CollOp {
    stage: crate::ir::StageId,
    action: FsdpAction,
    /// For a reduce-scatter: the index, among the rank's compute actions, of the one it
    /// follows (the stage's last backward); [`NO_OP`] for an all-gather.
    after: u32,
}

/// FSDP's collective stream of each rank (PyTorch 2.15's runtime: `UNSHARD` starts the
/// stage's all-gather, which its compute waits for; `REDUCE_GRAD` its gradients'
/// reduce-scatter once its last backward has run; `WAIT_REDUCE_GRAD` blocks the host, so no
/// later action of the rank starts before that reduction ends; `RESHARD` frees memory and
/// takes no time). One stream per rank: its ops run one at a time in program order.
struct Collectives {
    /// Per rank, its ops.
    ops: Vec<Vec<CollOp>>,
    /// Per rank, each op's start and end, ns ([`UNSET`] until it is scheduled).
    start: Vec<Vec<u64>>,
    end: Vec<Vec<u64>>,
    /// Per rank: its first op that may still overlap the rank's next compute (compute starts
    /// do not decrease; [`interfered_end`]).
    first_live: Vec<usize>,
    /// Per rank, per compute action in order: the latest op it waits for (its stages' last
    /// all-gather, or a reduction the host waited for before it), or [`NO_OP`].
    need: Vec<Vec<u32>>,
    /// Per rank, each compute action's end, ns (a reduce-scatter reads its anchor's).
    compute_end: Vec<Vec<u64>>,
}

impl Collectives {
    /// The collective streams of `programs` (per rank: compute and FSDP entries in program
    /// order; other entries are skipped), or `None` when no rank has an FSDP action.
    fn of(programs: &[Vec<LoweredAction>]) -> Option<Collectives> {
        if !programs
            .iter()
            .flatten()
            .any(|a| matches!(a, LoweredAction::Fsdp(..)))
        {
            return None;
        }
        let p = programs.len();
        let mut c = Collectives {
            ops: vec![Vec::new(); p],
            start: vec![Vec::new(); p],
            end: vec![Vec::new(); p],
            first_live: vec![0; p],
            need: vec![Vec::new(); p],
            compute_end: vec![Vec::new(); p],
        };
        for (r, prog) in programs.iter().enumerate() {
            // Per stage of the rank: its latest all-gather and its latest reduction, op
            // indices (a handful of entries, updated in place).
            let mut gathered: Vec<(crate::ir::StageId, u32)> = Vec::new();
            let mut reduced: Vec<(crate::ir::StageId, u32)> = Vec::new();
            let latest = |list: &[(crate::ir::StageId, u32)], s| {
                list.iter().find(|e| e.0 == s).map_or(NO_OP, |e| e.1)
            };
            let set = |list: &mut Vec<(crate::ir::StageId, u32)>, s, k| match list
                .iter_mut()
                .find(|e| e.0 == s)
            {
                Some(e) => e.1 = k,
                None => list.push((s, k)),
            };
            let mut barrier = NO_OP;
            let mut computes = 0u32;
            for a in prog {
                let next = c.ops[r].len() as u32;
                match *a {
                    LoweredAction::Compute(action) => {
                        let need = action
                            .parts()
                            .map(|x| latest(&gathered, x.stage))
                            .chain([barrier])
                            .filter(|&k| k != NO_OP)
                            .max()
                            .unwrap_or(NO_OP);
                        c.need[r].push(need);
                        computes += 1;
                    }
                    LoweredAction::Fsdp(stage, FsdpAction::Unshard) => {
                        c.ops[r].push(CollOp {
                            stage,
                            action: FsdpAction::Unshard,
                            after: NO_OP,
                        });
                        set(&mut gathered, stage, next);
                    }
                    LoweredAction::Fsdp(stage, FsdpAction::ReduceGrad) => {
                        let after = computes.checked_sub(1).unwrap_or(NO_OP);
                        c.ops[r].push(CollOp {
                            stage,
                            action: FsdpAction::ReduceGrad,
                            after,
                        });
                        set(&mut reduced, stage, next);
                    }
                    LoweredAction::Fsdp(stage, FsdpAction::WaitReduceGrad) => {
                        let k = latest(&reduced, stage);
                        if k != NO_OP {
                            barrier = if barrier == NO_OP { k } else { barrier.max(k) };
                        }
                    }
                    _ => {}
                }
            }
            c.start[r] = vec![UNSET; c.ops[r].len()];
            c.end[r] = vec![UNSET; c.ops[r].len()];
            c.compute_end[r] = vec![UNSET; c.need[r].len()];
        }
        Some(c)
    }
}

/// The end of a compute of `dur` ns that starts at `start` on a rank whose collective stream
/// ran ops `(starts, ends)` (in order, one at a time; [`UNSET`] from the first op not
/// scheduled): outside the ops it advances at full rate, during one at `1 / (1 + k)`. Ops
/// ending by `start` are skipped for good (`first_live`: compute starts do not decrease).
fn interfered_end(
    (starts, ends): (&[u64], &[u64]),
    first_live: &mut usize,
    start: u64,
    dur: u64,
    k: f64,
) -> u64 {
    while *first_live < ends.len() && ends[*first_live] != UNSET && ends[*first_live] <= start {
        *first_live += 1;
    }
    let (mut t, mut left) = (start as f64, dur as f64);
    for (&a, &b) in starts.iter().zip(ends).skip(*first_live) {
        if b == UNSET || a as f64 >= t + left {
            break;
        }
        // At full rate up to the op, then at 1 / (1 + k) while it runs.
        if a as f64 > t {
            left -= a as f64 - t;
            t = a as f64;
        }
        let work = (b as f64 - t).max(0.0) / (1.0 + k);
        if left <= work {
            return (t + left * (1.0 + k)).round() as u64;
        }
        left -= work;
        t = t.max(b as f64);
    }
    (t + left).round() as u64
}

/// A communication stream of one rank: its actions in program order.
struct CommStream {
    rank: u32,
    id: StreamId,
    ops: Vec<CommAction>,
}

/// The replay's state. Streams `0..p` are the ranks' compute streams; the communication
/// streams follow.
struct Streams<'a, C: CostModel, R: Recorder> {
    index: TransferIndex,
    schedule: &'a Schedule,
    costs: &'a C,
    s_count: usize,
    m: usize,
    mfo: usize,
    rank_of: Vec<u32>,
    cells: Vec<Cell>,
    /// End of (stage, mb)'s I or B: the gradient's send waits for it; chunk chains read it.
    bwd_end: Vec<u64>,
    chunk: Option<ChunkLinks>,
    fo_end: Vec<u64>,
    fo_ready: Vec<u64>,
    comm: Vec<CommStream>,
    /// FSDP's collective streams, one per rank after the communication streams, if any.
    coll: Option<Collectives>,
    /// Per transfer ([`Streams::xid`]): when its send and its receive were posted, ns.
    send_post: Vec<u64>,
    recv_post: Vec<u64>,
    /// Per transfer: the streams its send and its receive are on.
    send_stream: Vec<u32>,
    recv_stream: Vec<u32>,
    /// Per stream: next action, and when its last action ended.
    pc: Vec<usize>,
    clock: Vec<u64>,
    queued: Vec<bool>,
    queue: VecDeque<u32>,
    rec: R,
}

/// Runs `schedule` lowered under `lowering` without building the lowered program, recording
/// into `rec`.
///
/// # Errors
/// As [`crate::ir::lowering::lower`]; [`Error::StreamsHang`] when streams stop with
/// work left.
pub(crate) fn run_lowering<C: CostModel, R: Recorder>(
    schedule: &Schedule,
    lowering: Lowering,
    costs: &C,
    rec: R,
) -> Result<(Outcome, R)> {
    run_streams(schedule, swept_streams(schedule, lowering)?, costs, rec)
}

/// Runs `schedule`'s compute streams with the communication streams `comm`, recording into
/// `rec`.
///
/// # Errors
/// [`Error::StreamsHang`] when streams stop with work left.
fn run_streams<C: CostModel, R: Recorder>(
    schedule: &Schedule,
    lanes: Lanes,
    costs: &C,
    rec: R,
) -> Result<(Outcome, R)> {
    let mut st = Streams::new(schedule, lanes, costs, rec)?;
    while let Some(sid) = st.queue.pop_front() {
        st.queued[sid as usize] = false;
        let sid = sid as usize;
        let stopped = if sid < st.num_ranks() {
            !st.advance_compute(sid)
        } else if sid < st.num_ranks() + st.comm.len() {
            st.advance_comm(sid);
            false
        } else {
            st.advance_collective(sid - st.num_ranks() - st.comm.len());
            false
        };
        if stopped {
            return Ok((Outcome::Stopped, st.rec));
        }
    }
    st.finish()
}

impl<'a, C: CostModel, R: Recorder> Streams<'a, C, R> {
    /// The state before any action ran: every stream queued, stage 0's inputs ready at 0.
    ///
    /// # Errors
    /// A malformed chunk chain.
    fn new(schedule: &'a Schedule, lanes: Lanes, costs: &'a C, rec: R) -> Result<Self> {
        let Lanes { comm, coll } = lanes;
        let s = schedule;
        let p = s.placement.num_ranks as usize;
        let streams = p + comm.len() + if coll.is_some() { p } else { 0 };
        let s_count = s.num_stages() as usize;
        let (m, mfo) = (s.num_microbatches as usize, s.num_fo_microbatches as usize);
        let chunk = s.chunk_links()?;
        let index = TransferIndex::of(s);
        let n_x = index.len();
        let mut st = Streams {
            index,
            schedule,
            costs,
            s_count,
            m,
            mfo,
            rank_of: s.placement.rank_of.iter().map(|r| r.0).collect(),
            cells: vec![UNSET_CELL; s_count * m],
            bwd_end: vec![UNSET; s_count * m],
            chunk,
            fo_end: vec![UNSET; s_count * mfo],
            fo_ready: vec![UNSET; s_count * mfo],
            send_post: vec![UNSET; n_x],
            recv_post: vec![UNSET; n_x],
            send_stream: vec![NO_STREAM; n_x],
            recv_stream: vec![NO_STREAM; n_x],
            pc: vec![0; streams],
            clock: vec![0; streams],
            queued: vec![true; streams],
            queue: (0..streams as u32).collect(),
            comm,
            coll,
            rec,
        };
        for c in &mut st.cells[..m] {
            c.act_ready = 0;
        }
        st.fo_ready[..mfo].fill(0);
        for (i, cs) in st.comm.iter().enumerate() {
            for op in &cs.ops {
                let x = st.xid(op.transfer());
                let slot = match op {
                    CommAction::Send(_) => &mut st.send_stream[x],
                    CommAction::Recv(_) => &mut st.recv_stream[x],
                };
                *slot = (p + i) as u32;
            }
        }
        Ok(st)
    }

    /// Ranks, `p`: streams `0..p` are their compute streams.
    fn num_ranks(&self) -> usize {
        self.schedule.placement.num_ranks as usize
    }

    /// The transfer's index in the per-transfer arrays.
    #[inline]
    fn xid(&self, t: Transfer) -> usize {
        self.index.get(t)
    }

    fn wake(&mut self, sid: u32) {
        if sid != NO_STREAM && !self.queued[sid as usize] {
            self.queued[sid as usize] = true;
            self.queue.push_back(sid);
        }
    }

    /// Time the data `a` needs are available, or `None` if they are not yet (as
    /// [`crate::replay`]'s, with received inputs set when their transfer ends).
    #[inline]
    fn ready(&self, a: ComputeAction) -> Option<u64> {
        let (s, mb) = (a.stage.idx(), a.microbatch.idx());
        let t = match a.kind {
            ActionKind::F => self.cells[s * self.m + mb].act_ready,
            ActionKind::Fo => self.fo_ready[s * self.mfo + mb],
            ActionKind::I | ActionKind::B => {
                let c = &self.cells[s * self.m + mb];
                if c.f_end == UNSET || c.grad_ready == UNSET {
                    UNSET
                } else {
                    c.f_end.max(c.grad_ready)
                }
            }
            ActionKind::W => self.cells[s * self.m + mb].i_end,
        };
        if t == UNSET {
            return None;
        }
        let dep = match (&self.chunk, a.kind) {
            (Some(l), ActionKind::F) if l.prev[mb] != ChunkLinks::NONE => {
                self.cells[s * self.m + l.prev[mb] as usize].f_end
            }
            (Some(l), ActionKind::I | ActionKind::B) if l.next[mb] != ChunkLinks::NONE => {
                self.bwd_end[s * self.m + l.next[mb] as usize]
            }
            _ => 0,
        };
        (dep != UNSET).then_some(t.max(dep))
    }

    /// Runs rank `r`'s compute stream as far as its inputs allow. `false` when the recorder
    /// stops the replay.
    fn advance_compute(&mut self, r: usize) -> bool {
        let schedule: &'a Schedule = self.schedule;
        let actions = &schedule.ranks[r];
        let interference = match self.coll {
            Some(_) => self.costs.collective_interference(),
            None => 0.0,
        };
        while self.pc[r] < actions.len() {
            let action = actions[self.pc[r]];
            let gate = match self.collective_gate(r) {
                Some(t) => t,
                None => return true, // woken when the collective it waits for ends
            };
            let (start, dur) = match action {
                Action::Compute(a) => match self.ready(a) {
                    Some(t) => (t.max(self.clock[r]), self.costs.compute_ns(a)),
                    None => return true,
                },
                Action::Overlap(a, b) => match (self.ready(a), self.ready(b)) {
                    (Some(ta), Some(tb)) => {
                        (ta.max(tb).max(self.clock[r]), self.costs.overlap_ns(a, b))
                    }
                    _ => return true,
                },
            };
            let start = start.max(gate);
            let end = if interference > 0.0 {
                self.interfered(r, start, dur, interference)
            } else {
                start + dur
            };
            let op = TimedOp {
                action,
                start_ns: start,
                end_ns: end,
            };
            if !self.rec.op(r, op) {
                return false;
            }
            self.clock[r] = end;
            if let Some(c) = self.coll.as_mut() {
                c.compute_end[r][self.pc[r]] = end;
                let sid = (self.num_ranks() + self.comm.len() + r) as u32;
                self.wake(sid);
            }
            self.pc[r] += 1;
            for a in action.parts() {
                self.complete_compute(r as u32, a, end);
            }
        }
        true
    }

    /// The end of rank `r`'s compute of `dur` ns from `start`, slowed by `k` while the rank's
    /// collectives run. Runs the collective stream as far as it can first: an op it cannot
    /// schedule yet waits for a compute action at or after this one, so it starts after this
    /// one ends.
    fn interfered(&mut self, r: usize, start: u64, dur: u64, k: f64) -> u64 {
        self.advance_collective(r);
        let Some(c) = self.coll.as_mut() else {
            return start + dur;
        };
        interfered_end(
            (&c.start[r], &c.end[r]),
            &mut c.first_live[r],
            start,
            dur,
            k,
        )
    }

    /// The earliest start FSDP's collectives allow rank `r`'s next compute action (0 without
    /// FSDP), or `None` while the collective it waits for has not run.
    #[inline]
    fn collective_gate(&self, r: usize) -> Option<u64> {
        let Some(c) = &self.coll else { return Some(0) };
        let k = c.need[r][self.pc[r]];
        if k == NO_OP {
            return Some(0);
        }
        let end = c.end[r][k as usize];
        (end != UNSET).then_some(end)
    }

    /// Runs rank `r`'s collective stream as far as it can: an all-gather as soon as the
    /// stream is free, a reduce-scatter once the compute action it follows has ended too.
    fn advance_collective(&mut self, r: usize) {
        let sid = self.num_ranks() + self.comm.len() + r;
        let Some(c) = self.coll.as_mut() else { return };
        let ran = self.pc[sid];
        while let Some(&op) = c.ops[r].get(self.pc[sid]) {
            let mut start = self.clock[sid];
            if op.after != NO_OP {
                let anchor = c.compute_end[r][op.after as usize];
                if anchor == UNSET {
                    break; // woken when that compute ends
                }
                start = start.max(anchor);
            }
            let end = start + self.costs.fsdp_ns(op.stage, op.action);
            c.start[r][self.pc[sid]] = start;
            c.end[r][self.pc[sid]] = end;
            self.clock[sid] = end;
            self.pc[sid] += 1;
            self.rec.comm(
                r,
                TimedComm {
                    action: LoweredAction::Fsdp(op.stage, op.action),
                    start_ns: start,
                    end_ns: end,
                },
            );
        }
        // An op's end may release the rank's compute.
        if self.pc[sid] > ran {
            self.wake(r as u32);
        }
    }

    /// Records compute action `a`'s end on rank `r`: its outputs are ready on the rank, its
    /// send (if its output crosses ranks) may be posted.
    #[inline]
    fn complete_compute(&mut self, r: u32, a: ComputeAction, end: u64) {
        let (s, mb) = (a.stage.idx(), a.microbatch.idx());
        match a.kind {
            ActionKind::F => self.cells[s * self.m + mb].f_end = end,
            ActionKind::Fo => self.fo_end[s * self.mfo + mb] = end,
            ActionKind::I | ActionKind::B => {
                if a.kind == ActionKind::I {
                    self.cells[s * self.m + mb].i_end = end;
                }
                self.bwd_end[s * self.m + mb] = end;
            }
            ActionKind::W => return,
        }
        match Transfer::of_producer(a, self.s_count as u32) {
            // The last stage's forward: the loss gradient is there once it ends.
            None if a.kind == ActionKind::F => self.cells[s * self.m + mb].grad_ready = end,
            None => {}
            Some(t) if self.rank_of[t.to_stage().idx()] == r => self.arrive(t, end),
            Some(t) => {
                let sid = self.send_stream[self.xid(t)];
                self.wake(sid);
            }
        }
    }

    /// The payload of `t` is on the receiving stage's rank at `at`.
    #[inline]
    fn arrive(&mut self, t: Transfer, at: u64) {
        let (to, mb) = (t.to_stage().idx(), t.microbatch.idx());
        match t.payload {
            Payload::Activation => self.cells[to * self.m + mb].act_ready = at,
            Payload::Gradient => self.cells[to * self.m + mb].grad_ready = at,
            Payload::ForwardOnly => self.fo_ready[to * self.mfo + mb] = at,
        }
    }

    /// When the transfer's payload reached the receiving rank, if it has.
    #[inline]
    fn arrival(&self, t: Transfer) -> u64 {
        let (to, mb) = (t.to_stage().idx(), t.microbatch.idx());
        match t.payload {
            Payload::Activation => self.cells[to * self.m + mb].act_ready,
            Payload::Gradient => self.cells[to * self.m + mb].grad_ready,
            Payload::ForwardOnly => self.fo_ready[to * self.mfo + mb],
        }
    }

    /// When the compute that produces `t`'s payload ended, or [`UNSET`].
    #[inline]
    fn produced(&self, t: Transfer) -> u64 {
        let (s, mb) = (t.stage.idx(), t.microbatch.idx());
        match t.payload {
            Payload::Activation => self.cells[s * self.m + mb].f_end,
            Payload::Gradient => self.bwd_end[s * self.m + mb],
            Payload::ForwardOnly => self.fo_end[s * self.mfo + mb],
        }
    }

    /// Runs communication stream `sid` as far as its transfers allow.
    fn advance_comm(&mut self, sid: usize) {
        let i = sid - self.num_ranks();
        while self.pc[sid] < self.comm[i].ops.len() {
            let op = self.comm[i].ops[self.pc[sid]];
            let t = op.transfer();
            let x = self.xid(t);
            let done = self.arrival(t);
            if done == UNSET {
                // Post this half, then run the transfer if the other half is posted.
                match op {
                    CommAction::Send(_) if self.send_post[x] == UNSET => {
                        let produced = self.produced(t);
                        if produced == UNSET {
                            return; // woken when the producing compute ends
                        }
                        self.send_post[x] = produced.max(self.clock[sid]);
                    }
                    CommAction::Recv(_) if self.recv_post[x] == UNSET => {
                        self.recv_post[x] = self.clock[sid];
                    }
                    _ => {}
                }
                if self.send_post[x] == UNSET || self.recv_post[x] == UNSET {
                    return; // woken when the other half posts
                }
                self.transfer(t, x);
                let other = match op {
                    CommAction::Send(_) => self.recv_stream[x],
                    CommAction::Recv(_) => self.send_stream[x],
                };
                self.wake(other);
            }
            self.clock[sid] = self.arrival(t);
            self.pc[sid] += 1;
        }
    }

    /// Runs transfer `t` (index `x`), both halves posted: it starts when the later half was
    /// posted and the payload reaches the receiving rank `comm_ns` later.
    fn transfer(&mut self, t: Transfer, x: usize) {
        let start = self.send_post[x].max(self.recv_post[x]);
        let kind = t.payload.cost_kind();
        let end = start + self.costs.comm_ns(t.stage, t.microbatch, kind);
        self.arrive(t, end);
        let (from, to) = (
            self.rank_of[t.stage.idx()],
            self.rank_of[t.to_stage().idx()],
        );
        self.rec.transfer(TimedTransfer {
            from: Rank(from),
            to: Rank(to),
            stage: t.stage,
            microbatch: t.microbatch,
            kind,
            start_ns: start,
            end_ns: end,
        });
        // Each half holds its stream from its posting to the transfer's end.
        for (rank, half, posted) in [
            (from, CommAction::Send(t), self.send_post[x]),
            (to, CommAction::Recv(t), self.recv_post[x]),
        ] {
            self.rec.comm(
                rank as usize,
                TimedComm {
                    action: LoweredAction::Comm(half),
                    start_ns: posted,
                    end_ns: end,
                },
            );
        }
        self.wake(to);
    }

    /// Each rank's compute clock when every stream finished, else [`Error::StreamsHang`] with
    /// the waiting streams' heads.
    fn finish(self) -> Result<(Outcome, R)> {
        let p = self.num_ranks();
        let mut waiting = Vec::new();
        for r in 0..p {
            if let Some(a) = self.schedule.ranks[r].get(self.pc[r]) {
                waiting.push(format!("rank {r} compute: {a}"));
            }
        }
        for (i, cs) in self.comm.iter().enumerate() {
            if let Some(op) = cs.ops.get(self.pc[p + i]) {
                waiting.push(format!("rank {} {}: {op}", cs.rank, cs.id));
            }
        }
        let first_coll = p + self.comm.len();
        if let Some(c) = &self.coll {
            for (r, ops) in c.ops.iter().enumerate() {
                if let Some(op) = ops.get(self.pc[first_coll + r]) {
                    let a = LoweredAction::Fsdp(op.stage, op.action);
                    waiting.push(format!("rank {r} collectives: {a}"));
                }
            }
        }
        if !waiting.is_empty() {
            return Err(Error::StreamsHang {
                schedule: self.schedule.name.clone(),
                waiting,
            });
        }
        // A rank's step ends with its last compute or, with FSDP, its last reduction.
        let clock = (0..p)
            .map(|r| {
                let coll = self.coll.as_ref().map_or(0, |_| self.clock[first_coll + r]);
                self.clock[r].max(coll)
            })
            .collect();
        Ok((Outcome::Done(clock), self.rec))
    }
}

/// The lowering's communication streams, each with its actions in program order, in the order
/// ranks and then first use name them.
///
/// # Errors
/// [`Error::PairOrder`] when two ranks post one direction's transfers in different orders
/// ([`crate::ir::lowering::check_pair_order`]).
fn comm_streams(lowered: &Lowered) -> Result<Lanes> {
    let mut streams = StreamSet::new(&lowered.schedule, lowered.streams);
    let mut order = crate::ir::lowering::PairOrder::new(&lowered.schedule);
    for (r, prog) in lowered.program.iter().enumerate() {
        for a in prog {
            order.see(r, *a);
            if let LoweredAction::Comm(c) = *a {
                streams.push(r, c);
            }
        }
    }
    order.check(&lowered.schedule)?;
    Ok(Lanes {
        comm: streams.done(),
        coll: Collectives::of(&lowered.program),
    })
}

/// The communication streams of `schedule` lowered under `lowering`, as [`comm_streams`] of
/// [`crate::ir::lowering::lower`]'s result.
///
/// # Errors
/// As [`crate::ir::lowering::lower`] and [`crate::ir::lowering::check_pair_order`].
fn swept_streams(schedule: &Schedule, lowering: Lowering) -> Result<Lanes> {
    let mut streams = StreamSet::new(schedule, lowering.streams);
    // With FSDP, its actions take their turns in the sweep (they move receives), as in
    // PyTorch's lowering.
    let programs = match lowering.fsdp {
        Some(window) => Some(crate::ir::lowering::fsdp_programs(
            schedule,
            window as usize,
            lowering.fsdp_defer_wait,
        )?),
        None => None,
    };
    // Receives posted ahead keep every pair's order by construction: no check to pay for.
    let mut order = (lowering.posting != RecvPosting::Ahead)
        .then(|| crate::ir::lowering::PairOrder::new(schedule));
    let emit = |r: usize, a: LoweredAction| {
        if let LoweredAction::Comm(c) = a {
            if let Some(o) = order.as_mut() {
                o.see(r, a);
            }
            streams.push(r, c);
        }
    };
    crate::ir::lowering::sweep_programs(schedule, programs.as_deref(), lowering.posting, emit)?;
    if let Some(o) = order {
        o.check(schedule)?;
    }
    Ok(Lanes {
        comm: streams.done(),
        coll: programs.as_deref().and_then(Collectives::of),
    })
}

/// A stream of [`StreamSet`]: how many actions it will hold before its first use, then its
/// index.
#[derive(Clone, Copy)]
enum Slot {
    Expected(usize),
    Used(usize),
}

/// Communication streams being filled, rank by rank in program order.
struct StreamSet<'a> {
    placement: &'a Placement,
    layout: StreamLayout,
    /// Per rank, its streams (a handful: a rank talks to its pipeline neighbours).
    of_rank: Vec<Vec<(StreamId, Slot)>>,
    streams: Vec<CommStream>,
}

impl<'a> StreamSet<'a> {
    /// Streams for `schedule`'s transfers under `layout`, each sized for its actions.
    fn new(schedule: &'a Schedule, layout: StreamLayout) -> Self {
        let placement = &schedule.placement;
        let n = schedule.num_stages();
        let mut of_rank: Vec<Vec<(StreamId, Slot)>> = vec![Vec::new(); schedule.ranks.len()];
        let mut count = |r: usize, c: CommAction| {
            let id = layout.stream_of(placement, c);
            match of_rank[r].iter_mut().find(|(s, _)| *s == id) {
                Some((_, Slot::Expected(k))) => *k += 1,
                _ => of_rank[r].push((id, Slot::Expected(1))),
            }
        };
        for (r, actions) in schedule.ranks.iter().enumerate() {
            for a in actions.iter().flat_map(|a| a.parts()) {
                if let Some(t) = Transfer::of_producer(a, n) {
                    let to = placement.rank(t.to_stage()).idx();
                    if to != r {
                        count(r, CommAction::Send(t));
                        count(to, CommAction::Recv(t));
                    }
                }
            }
        }
        StreamSet {
            placement,
            layout,
            of_rank,
            streams: Vec::new(),
        }
    }

    /// Appends `c`, posted by rank `r`, to its stream.
    #[inline]
    fn push(&mut self, r: usize, c: CommAction) {
        let id = self.layout.stream_of(self.placement, c);
        let slots = &mut self.of_rank[r];
        let slot = match slots.iter().position(|(s, _)| *s == id) {
            Some(k) => &mut slots[k].1,
            None => {
                // Not a transfer of the schedule (`Lowered::validate` rejects it).
                slots.push((id, Slot::Expected(0)));
                &mut slots.last_mut().expect("just pushed").1
            }
        };
        let i = match *slot {
            Slot::Used(i) => i,
            Slot::Expected(capacity) => {
                *slot = Slot::Used(self.streams.len());
                self.streams.push(CommStream {
                    rank: r as u32,
                    id,
                    ops: Vec::with_capacity(capacity),
                });
                self.streams.len() - 1
            }
        };
        self.streams[i].ops.push(c);
    }

    /// The streams, ranks in order, each rank's in the order of first use.
    fn done(mut self) -> Vec<CommStream> {
        self.streams.sort_by_key(|s| s.rank);
        self.streams
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::costs::{UniformCostSpec, UniformCosts};
    use crate::ir::comm::StreamLayout;
    use crate::ir::lowering::{Lowering, RecvPosting, lower};
    use crate::ir::{MicrobatchId, StageId};
    use crate::schedules::generators::{ScheduleKind, interleaved_1f1b, one_f_one_b};

    /// Every stage's F takes `f` s, its B `b` s, a transfer `comm` s.
    fn costs(f: f64, b: f64, comm: f64, v: u32) -> UniformCosts {
        let v_f = f64::from(v);
        UniformCosts::new(
            &UniformCostSpec {
                f: f * v_f,
                b: b * v_f,
                w: 0.0,
                comm,
                fb: None,
                fo: None,
                fsdp: Default::default(),
            },
            v,
        )
    }

    fn start_of(t: &Timeline, rank: usize, action: &str) -> u64 {
        t.compute[rank]
            .iter()
            .find(|o| o.action.to_string() == action)
            .unwrap()
            .start_ns
    }

    const S: u64 = 1_000_000_000;

    #[test]
    fn one_f_one_b_on_one_shared_stream_by_hand() {
        // p = 2, m = 2, f = 1 s, b = 2 s, comm = 0.5 s, PyTorch's ahead receives on one
        // stream per rank: rank 0 posts SEND_F0, SEND_F1, RECV_B0, RECV_B1; rank 1 posts
        // RECV_F0, RECV_F1, SEND_B0, SEND_B1. 0F0 [0, 1], F0 crosses [1, 1.5]; 0F1 [1, 2],
        // F1 crosses [2, 2.5] (rank 1's RECV_F1 was posted at 1.5). 1F0 [1.5, 2.5], 1B0 [2.5,
        // 4.5], B0 crosses [4.5, 5]; 1F1 [4.5, 5.5], 1B1 [5.5, 7.5], B1 crosses [7.5, 8]; 0B0
        // [5, 7], 0B1 [8, 10]: the compute schedule's own 10 s.
        let s = one_f_one_b(2, 2);
        let shared = Lowering {
            posting: RecvPosting::Ahead,
            streams: StreamLayout::Shared,
            fsdp: None,
            fsdp_defer_wait: false,
        };
        let l = lower(&s, shared).unwrap();
        let names: Vec<String> = l.program[1].iter().map(ToString::to_string).collect();
        assert_eq!(
            names,
            [
                "1RECV_F0",
                "1F0",
                "1RECV_F1",
                "1B0",
                "1SEND_B0",
                "1F1",
                "1B1",
                "1SEND_B1",
                "1WAIT_SEND_B0",
                "1WAIT_SEND_B1"
            ]
        );
        let t = replay_lowered(&l, &costs(1.0, 2.0, 0.5, 1)).unwrap();
        assert_eq!(t.makespan_ns(), 10 * S);
        assert_eq!(start_of(&t, 0, "0B1"), 8 * S);
        // Rank 1's comm lane: each half holds the one stream from its posting to its
        // transfer's end. RECV_F0 is posted at 0 and F0 arrives at 1.5; RECV_F1 is posted
        // then and F1 arrives at 2.5; SEND_B0 is posted when 1B0 ends (4.5) and rank 0's
        // RECV_B0 (posted at 2.5) is waiting: [4.5, 5]; SEND_B1 likewise [7.5, 8].
        let lane: Vec<(String, u64, u64)> = t.comm[1]
            .iter()
            .map(|c| (c.action.to_string(), c.start_ns, c.end_ns))
            .collect();
        let h = S / 2;
        assert_eq!(
            lane,
            [
                ("1RECV_F0".to_string(), 0, 3 * h),
                ("1RECV_F1".to_string(), 3 * h, 5 * h),
                ("1SEND_B0".to_string(), 9 * h, 10 * h),
                ("1SEND_B1".to_string(), 15 * h, 16 * h),
            ]
        );
    }

    #[test]
    fn fsdp_collectives_run_beside_the_compute_and_show_where_exposed() {
        // 1F1B, p = 2, m = 2, f = 1 s, b = 2 s, no transfer time; FSDP's all-gather 2 s and
        // reduce-scatter 1 s per stage. Each rank's program: UNSHARD, its four computes,
        // REDUCE_GRAD (after its second B), WAIT_REDUCE_GRAD, RESHARD. Both all-gathers run
        // [0, 2], so 0F0 runs [2, 3] and 0F1 [3, 4]; 1F0 [3, 4], 1B0 [4, 6], 1F1 [6, 7], 1B1
        // [7, 9]; 0B0 [6, 8], 0B1 [9, 11]. Reductions: rank 1's [9, 10], rank 0's [11, 12].
        // The step: 12 s, the 9 s of the plain replay plus the exposed all-gather (2 s) and
        // the exposed reduction (1 s).
        let s = one_f_one_b(2, 2);
        let mut c = UniformCostSpec {
            f: 1.0,
            b: 2.0,
            w: 0.0,
            comm: 0.0,
            fb: None,
            fo: None,
            fsdp: Default::default(),
        };
        let plain = replay_lowering(&s, Lowering::UNCONTENDED, &UniformCosts::new(&c, 1)).unwrap();
        assert_eq!(plain.makespan_ns(), 9 * S);
        c.fsdp.ag = 2.0;
        c.fsdp.rs = 1.0;
        let with_fsdp = Lowering {
            fsdp: Some(3),
            ..Lowering::UNCONTENDED
        };
        let t = replay_lowering(&s, with_fsdp, &UniformCosts::new(&c, 1)).unwrap();
        assert_eq!(t.makespan_ns(), 12 * S);
        assert_eq!(start_of(&t, 0, "0F0"), 2 * S);
        assert_eq!(start_of(&t, 0, "0B1"), 9 * S);
        let lane = |r: usize| -> Vec<(String, u64, u64)> {
            t.comm[r]
                .iter()
                .filter(|c| matches!(c.action, LoweredAction::Fsdp(..)))
                .map(|c| (c.action.to_string(), c.start_ns / S, c.end_ns / S))
                .collect()
        };
        assert_eq!(
            lane(0),
            [("0UNSHARD".into(), 0, 2), ("0REDUCE_GRAD".into(), 11, 12)]
        );
        assert_eq!(
            lane(1),
            [("1UNSHARD".into(), 0, 2), ("1REDUCE_GRAD".into(), 9, 10)]
        );
        // The lowered program replays the same.
        let l = lower(&s, with_fsdp).unwrap();
        assert_eq!(replay_lowered(&l, &UniformCosts::new(&c, 1)).unwrap(), t);
    }

    #[test]
    fn compute_slows_only_while_a_collective_overlaps_it() {
        // Work by hand: 10 s of compute from 0 beside one op [2, 6] at k = 1 runs 2 s at full
        // rate, 4 s at half (2 s of work), then the last 6 s: ends at 12.
        let mut live = 0;
        assert_eq!(interfered_end((&[2], &[6]), &mut live, 0, 10, 1.0), 12);
        // Wholly inside an op at k = 0.5: 10 s take 15.
        assert_eq!(interfered_end((&[0], &[100]), &mut 0, 0, 10, 0.5), 15);
        // An op after the compute's end, or one not scheduled yet, changes nothing.
        assert_eq!(interfered_end((&[20], &[30]), &mut 0, 0, 10, 1.0), 10);
        assert_eq!(interfered_end((&[2], &[UNSET]), &mut 0, 0, 10, 1.0), 10);
        // Two ops [1, 2] and [3, 4] at k = 1: 1 + 0.5 + 1 + 0.5 s of work by 4, then 2 s: 6.
        assert_eq!(interfered_end((&[1, 3], &[2, 4]), &mut 0, 0, 5, 1.0), 6);
        // Ops ending by the start are skipped for good.
        let mut live = 0;
        assert_eq!(interfered_end((&[0, 5], &[2, 6]), &mut live, 3, 1, 1.0), 4);
        assert_eq!(live, 1);
    }

    #[test]
    fn fsdps_collectives_slow_the_compute_they_overlap() {
        // Interleaved 1F1B, p = 1, v = 2, m = 1: per stage F 1 s, B 2 s, all-gather 2 s,
        // reduce-scatter 1 s, the reductions' waits deferred, interference k = 1 (compute at
        // half rate beside a collective). UNSHARDs [0, 2] and [2, 4]; 0F0 starts at 2 beside
        // the second all-gather: its 1 s of work takes [2, 4]; 1F0 waits for that all-gather:
        // [4, 5]; 1B0 [5, 7]; stage 1's reduction [7, 8] beside 0B0 from 7: 0.5 s of work by
        // 8, the other 1.5 s by 9.5; stage 0's reduction [9.5, 10.5]. Without interference:
        // 10 s (0F0 [2, 3], 0B0 [7, 9]).
        let (s, _) = interleaved_1f1b(1, 2, 1, None).unwrap();
        let lowering = Lowering {
            fsdp: Some(3),
            fsdp_defer_wait: true,
            ..Lowering::UNCONTENDED
        };
        let spec = |k: f64| UniformCostSpec {
            f: 2.0,
            b: 4.0,
            w: 0.0,
            comm: 0.0,
            fb: None,
            fo: None,
            fsdp: crate::costs::FsdpCostSpec {
                ag: 4.0,
                rs: 2.0,
                interference: k,
            },
        };
        let t = |k| replay_lowering(&s, lowering, &UniformCosts::new(&spec(k), 2)).unwrap();
        assert_eq!(t(0.0).makespan_ns(), 10 * S);
        let slow = t(1.0);
        assert_eq!(slow.makespan_ns(), 10 * S + S / 2);
        let span = |a: &str| {
            let o = slow.compute[0]
                .iter()
                .find(|o| o.action.to_string() == a)
                .unwrap();
            (o.start_ns, o.end_ns)
        };
        assert_eq!(span("0F0"), (2 * S, 4 * S));
        assert_eq!(span("1F0"), (4 * S, 5 * S));
        assert_eq!(span("0B0"), (7 * S, 9 * S + S / 2));
        // 1F1B at p = 2: every collective runs before the rank's first compute or after its
        // last, so interference changes nothing.
        let s = one_f_one_b(2, 2);
        let with = |k| {
            let mut c = spec(k);
            (c.f, c.b) = (1.0, 2.0);
            replay_lowering(&s, lowering, &UniformCosts::new(&c, 1)).unwrap()
        };
        assert_eq!(with(1.0), with(0.0));
    }

    #[test]
    fn a_front_loaded_receive_blocks_ready_sends_on_a_shared_stream() {
        // Interleaved 1F1B, p = 4, v = 2, m = 8, f = 1 s per stage, comm c = 0.5 s: when does
        // rank 1 start 1F1? PyTorch's sweep lowers rank 0 to 0F0 0SEND_F0 4RECV_F0 0F1
        // 0SEND_F1 ...: the receive of stage 3's output (rank 3) comes before the send of F1.
        // - Uncontended: 0F1 [1, 2], F1 crosses [2, 2 + c]; 1F0 ran [1 + c, 2 + c]: 1F1 at
        //   2 + c = 2.5 s.
        // - Ahead, shared stream: 4RECV_F0 is posted at 1 + c and completes when F0 has gone
        //   round: stage 3 sends it at 4 + 3c, it lands at 4 + 4c. 0SEND_F1 waits behind it
        //   and crosses [4 + 4c, 4 + 5c]: 1F1 at 4 + 5c = 6.5 s.
        // - Ahead, one stream per peer pair: the receive from rank 3 does not hold the send
        //   to rank 1: 2.5 s.
        // - Deferred (PR #178815), per-peer streams: 4RECV_F0 moves to just before 4F0; rank
        //   0's sends to rank 1 never wait behind it: 2.5 s.
        let (s, _) = interleaved_1f1b(4, 2, 8, None).unwrap();
        let c = costs(1.0, 2.0, 0.5, 2);
        let at = |posting, streams| {
            let l = lower(
                &s,
                Lowering {
                    posting,
                    streams,
                    fsdp: None,
                    fsdp_defer_wait: false,
                },
            )
            .unwrap();
            start_of(&replay_lowered(&l, &c).unwrap(), 1, "1F1")
        };
        use RecvPosting::{Ahead, Deferred};
        use StreamLayout::{PeerPair, PerPeer, Shared};
        assert_eq!(at(Ahead, PerPeer), 2 * S + S / 2);
        assert_eq!(at(Ahead, Shared), 6 * S + S / 2);
        assert_eq!(at(Ahead, PeerPair), 2 * S + S / 2);
        assert_eq!(at(Deferred, PerPeer), 2 * S + S / 2);
    }

    #[test]
    fn streams_that_wait_on_each_other_are_named() {
        // 1F1B, p = 2, m = 2 on one stream per rank, written by hand: rank 1 posts RECV_F1
        // before SEND_B0 and rank 0 posts RECV_B0 before SEND_F1; each receive waits for a send
        // queued behind the other.
        let s = one_f_one_b(2, 2);
        let act = |mb| Transfer {
            stage: StageId(0),
            microbatch: MicrobatchId(mb),
            payload: Payload::Activation,
        };
        let grad = |mb| Transfer {
            stage: StageId(1),
            microbatch: MicrobatchId(mb),
            payload: Payload::Gradient,
        };
        let send = |t| LoweredAction::Comm(CommAction::Send(t));
        let recv = |t| LoweredAction::Comm(CommAction::Recv(t));
        let comp = |r: usize, i: usize| LoweredAction::Compute(s.ranks[r][i]);
        let mut l = Lowered {
            program: vec![
                vec![
                    comp(0, 0),
                    send(act(0)),
                    comp(0, 1),
                    recv(grad(0)),
                    send(act(1)),
                    comp(0, 2),
                    recv(grad(1)),
                    comp(0, 3),
                ],
                vec![
                    recv(act(0)),
                    comp(1, 0),
                    comp(1, 1),
                    recv(act(1)),
                    send(grad(0)),
                    comp(1, 2),
                    comp(1, 3),
                    send(grad(1)),
                ],
            ],
            schedule: s.clone(),
            streams: StreamLayout::Shared,
        };
        l.validate().unwrap();
        let e = replay_lowered(&l, &costs(1.0, 2.0, 0.5, 1))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("hangs") && e.contains("rank 1 p2p: 1RECV_F1") && e.contains("0RECV_B0"),
            "{e}"
        );
        // On per-peer streams the same program runs.
        l.streams = StreamLayout::PerPeer;
        assert!(replay_lowered(&l, &costs(1.0, 2.0, 0.5, 1)).is_ok());
    }

    #[test]
    fn the_uncontended_lowering_replays_as_the_fifo_links() {
        for &kind in ScheduleKind::ALL {
            for (p, v, m) in [(1, 1, 3), (2, 2, 4), (3, 2, 7), (4, 2, 8), (5, 1, 9)] {
                let Ok(s) = kind.generate(p, v, m) else {
                    continue;
                };
                let v = s.num_stages() / p;
                for comm in [0.0, 0.3, 2.5] {
                    let c = costs(1.0, 2.0, comm, v);
                    let want = crate::replay::replay(&s, &c).unwrap();
                    // Per-peer streams replay as the FIFO links under either posting, where
                    // every pair keeps one order (`lowered_summary` relies on it).
                    for posting in [RecvPosting::Ahead, RecvPosting::Deferred] {
                        let lowering = Lowering {
                            posting,
                            streams: StreamLayout::PerPeer,
                            fsdp: None,
                            fsdp_defer_wait: false,
                        };
                        if crate::ir::lowering::check_pair_order(&s, posting).is_err() {
                            continue;
                        }
                        let l = lower(&s, lowering).unwrap();
                        let got = replay_lowered(&l, &c).unwrap();
                        let at = format!("{} p={p} m={m} {lowering}", s.name);
                        assert_eq!(got.compute, want.compute, "{at}");
                        assert_eq!(got.makespan_ns(), want.makespan_ns(), "{at}");
                    }
                }
            }
        }
    }

    #[test]
    fn lowering_straight_to_streams_replays_as_the_lowered_program() {
        // `replay_lowering` skips the program `lower` builds; both must give one timeline (or
        // hang on the same streams) under every policy.
        for &kind in ScheduleKind::ALL {
            let Ok(s) = kind.generate(4, 2, 8) else {
                continue;
            };
            let c = costs(1.0, 2.0, 0.3, s.num_stages() / 4);
            for policy in Lowering::ALL {
                let via_program = replay_lowered(&lower(&s, policy).unwrap(), &c);
                let direct = replay_lowering(&s, policy, &c);
                match (via_program, direct) {
                    (Ok(a), Ok(b)) => {
                        assert_eq!(a.compute, b.compute, "{} {policy}", s.name);
                        assert_eq!(a.transfers.len(), b.transfers.len());
                    }
                    (Err(a), Err(b)) => assert_eq!(a.to_string(), b.to_string()),
                    (a, b) => panic!("{} {policy}: {:?} vs {:?}", s.name, a.err(), b.err()),
                }
            }
        }
    }
}
