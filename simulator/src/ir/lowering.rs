//! Lowering a compute schedule to compute plus communication ([`Lowered`]): where each rank
//! posts its sends and receives, and on which streams.
//!
//! Sends always follow the compute that produces their payload. Receives are posted by one of
//! two rules ([`RecvPosting`]):
//!
//! - **Ahead**: PyTorch's `_add_send_recv` (`torch/distributed/pipelining/schedules.py`). It
//!   sweeps the ranks in order, placing each rank's next compute action once its input is
//!   placed; a send goes right after its producer and the matching receive is appended to the
//!   receiver's list at that moment, as early as the sender's progress allows. Each receiving
//!   rank therefore posts its receives from a peer in the order that peer sends them.
//! - **Deferred**: PyTorch's `_defer_recv_ops` (PR #178815; the runtime's `defer_pp_recv=True`
//!   in 2.15): each receive moves to just before the compute that consumes it, and a rank
//!   flushes the receives it deferred from a higher-numbered peer before its next send to that
//!   peer, so the lower rank of a pair posts its receive first.
//!
//! On a shared stream, an ahead receive sits in front of sends that are ready: the head-of-line
//! bubble of pytorch issue #188833. [`Lowering::UNCONTENDED`] (ahead receives on per-peer,
//! per-direction streams) replays exactly as [`crate::replay::replay`]'s FIFO links.

use crate::ir::comm::{
    CommAction, Lowered, LoweredAction, Payload, StreamLayout, Transfer, TransferIndex,
};
use crate::ir::{Action, ComputeAction, Schedule};
use crate::{Error, Result};
use serde::{Deserialize, Serialize};
use std::fmt;

/// Where a rank posts its receives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum RecvPosting {
    /// As soon as the sender's progress allows (PyTorch's `_add_send_recv`).
    Ahead,
    /// Just before the consuming compute, lower rank of a pair first (PyTorch's
    /// `_defer_recv_ops`).
    Deferred,
}

/// A lowering policy: receive posting and stream layout. In a plan file:
/// `lowering: {posting: deferred, streams: shared}`, each field defaulting to
/// [`Lowering::UNCONTENDED`]'s.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Lowering {
    /// Where receives are posted.
    pub posting: RecvPosting,
    /// How sends and receives are spread over streams.
    pub streams: StreamLayout,
    /// FSDP under the pipeline: each rank also runs FSDP's per-stage actions
    /// ([`fsdp_programs`]) on a collective stream, keeping at most this many stages gathered
    /// (PyTorch's `max_active_stages`, 3 by default); `None`: no FSDP actions.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fsdp: Option<u32>,
    /// With `fsdp`: each `WAIT_REDUCE_GRAD` deferred to just before the rank's next
    /// `REDUCE_GRAD` or the end of the step (PyTorch's `defer_reduce_grad_wait`), so a
    /// stage's reduction no longer holds the host while the rank's other stages compute.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub fsdp_defer_wait: bool,
}

impl Lowering {
    /// Ahead receives on per-peer, per-direction streams: the replay of the compute schedule
    /// itself (every transfer waits only for its payload and the previous transfer on its link).
    pub const UNCONTENDED: Lowering = Lowering {
        posting: RecvPosting::Ahead,
        streams: StreamLayout::PerPeer,
        fsdp: None,
        fsdp_defer_wait: false,
    };
    /// Every policy, for comparisons and tests.
    pub const ALL: [Lowering; 6] = [
        Lowering::UNCONTENDED,
        Lowering {
            posting: RecvPosting::Ahead,
            streams: StreamLayout::PeerPair,
            fsdp: None,
            fsdp_defer_wait: false,
        },
        Lowering {
            posting: RecvPosting::Ahead,
            streams: StreamLayout::Shared,
            fsdp: None,
            fsdp_defer_wait: false,
        },
        Lowering {
            posting: RecvPosting::Deferred,
            streams: StreamLayout::PerPeer,
            fsdp: None,
            fsdp_defer_wait: false,
        },
        Lowering {
            posting: RecvPosting::Deferred,
            streams: StreamLayout::PeerPair,
            fsdp: None,
            fsdp_defer_wait: false,
        },
        Lowering {
            posting: RecvPosting::Deferred,
            streams: StreamLayout::Shared,
            fsdp: None,
            fsdp_defer_wait: false,
        },
    ];
}

impl Default for Lowering {
    fn default() -> Self {
        Lowering::UNCONTENDED
    }
}

impl fmt::Display for Lowering {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let posting = match self.posting {
            RecvPosting::Ahead => "ahead",
            RecvPosting::Deferred => "deferred",
        };
        let streams = match self.streams {
            StreamLayout::Shared => "shared",
            StreamLayout::PeerPair => "peer-pair",
            StreamLayout::PerPeer => "per-peer",
        };
        write!(f, "{posting} receives, {streams} streams")?;
        if let Some(k) = self.fsdp {
            write!(f, ", FSDP with {k} stages gathered")?;
            if self.fsdp_defer_wait {
                write!(f, ", reduction waits deferred")?;
            }
        }
        Ok(())
    }
}

/// Lowers `schedule` under `lowering` (with FSDP's actions where it asks for them:
/// [`lower_with_fsdp`]).
///
/// # Errors
/// [`Error::InvalidSchedule`] when no rank's next compute action can be placed (its input is
/// never sent: PyTorch's "Malformed compute schedule"), naming each rank's next action.
pub fn lower(schedule: &Schedule, lowering: Lowering) -> Result<Lowered> {
    if let Some(window) = lowering.fsdp {
        return lower_with_fsdp(schedule, lowering, window as usize);
    }
    let mut program: Vec<Vec<LoweredAction>> = program_lengths(schedule)
        .into_iter()
        .map(Vec::with_capacity)
        .collect();
    sweep(schedule, lowering.posting, |r, a| program[r].push(a))?;
    Ok(Lowered {
        schedule: schedule.clone(),
        program,
        streams: lowering.streams,
    })
}

/// Checks that every rank posts its sends to each peer in the order that peer posts their
/// receives: NCCL and gloo match the point-to-point operations of a rank pair (one
/// communicator, one tag) in posting order, so any other order hands a receive another
/// transfer's bytes. Receives posted [`RecvPosting::Ahead`] agree by construction (the sweep
/// posts each receive in the step that posts its send); [`RecvPosting::Deferred`] posts them in
/// the receiver's consumption order, which can differ where one peer sends a rank two kinds of
/// transfer (ZB-V on 2 ranks: rank 1 sends rank 0 stage 2's activations and stage 1's
/// gradients).
///
/// # Errors
/// As [`sweep`]; [`Error::PairOrder`] naming the pair and the first two actions that differ.
pub fn check_pair_order(schedule: &Schedule, posting: RecvPosting) -> Result<()> {
    if posting == RecvPosting::Ahead || consumed_in_send_order(schedule) {
        return Ok(());
    }
    let mut order = PairOrder::new(schedule);
    sweep(schedule, posting, |r, a| order.see(r, a))?;
    order.check(schedule)
}

/// Whether every rank reads each peer's transfers in the order the peer sends them (its
/// compute order), without lowering: `O(actions)`. Then the deferred order keeps every pair's
/// order too: a deferred receive is posted before the compute that reads it, or flushed with
/// the peer's other deferred receives in their ahead order, which is the send order; a
/// receive read later than another was sent later, so it is posted ahead later, and neither
/// rule can post it first. (The converse does not hold: a flush can restore an order the
/// reads do not follow, so `false` leaves it to the sweep.)
fn consumed_in_send_order(schedule: &Schedule) -> bool {
    let index = TransferIndex::of(schedule);
    let n = schedule.num_stages();
    let rank_of = |s: crate::ir::StageId| schedule.placement.rank(s).0;
    let mut sent = vec![0u32; index.len()];
    let mut read = vec![0u32; index.len()];
    for (r, actions) in schedule.ranks.iter().enumerate() {
        let r = r as u32;
        // Per peer: sends to it and reads from it so far.
        let mut counts: Vec<(u32, u32, u32)> = Vec::new();
        let mut bump = |peer: u32, send: bool| {
            let at = match counts.iter().position(|c| c.0 == peer) {
                Some(i) => i,
                None => {
                    counts.push((peer, 0, 0));
                    counts.len() - 1
                }
            };
            let c = &mut counts[at];
            let k = if send { &mut c.1 } else { &mut c.2 };
            *k += 1;
            *k
        };
        for a in actions.iter().flat_map(|a| a.parts()) {
            if let Some(t) = Transfer::of_producer(a, n)
                && rank_of(t.to_stage()) != r
                && index.contains(t)
            {
                sent[index.get(t)] = bump(rank_of(t.to_stage()), true);
            }
            if let Some(t) = Transfer::of_consumer(a, n)
                && rank_of(t.stage) != r
                && index.contains(t)
            {
                read[index.get(t)] = bump(rank_of(t.stage), false);
            }
        }
    }
    sent == read
}

/// Per transfer, its position among its rank pair's sends and among the pair's receives,
/// filled action by action ([`PairOrder::see`]) and compared by [`PairOrder::check`]. Dense
/// arrays: a few bytes per transfer, no map.
#[derive(Debug)]
pub struct PairOrder {
    index: TransferIndex,
    rank_of: Vec<u32>,
    /// Per transfer: its send's and its receive's position in the pair's order, plus one
    /// (0: not posted).
    send_seq: Vec<u32>,
    recv_seq: Vec<u32>,
    /// Per rank: (peer, sends to it so far) and (peer, receives from it so far).
    sends: Vec<Vec<(u32, u32)>>,
    recvs: Vec<Vec<(u32, u32)>>,
}

impl PairOrder {
    /// Empty counts for `schedule`'s transfers.
    pub fn new(schedule: &Schedule) -> Self {
        let index = TransferIndex::of(schedule);
        let p = schedule.ranks.len();
        PairOrder {
            index,
            rank_of: schedule.placement.rank_of.iter().map(|r| r.0).collect(),
            send_seq: vec![0; index.len()],
            recv_seq: vec![0; index.len()],
            sends: vec![Vec::new(); p],
            recvs: vec![Vec::new(); p],
        }
    }

    /// Notes rank `r`'s next action `a`.
    #[inline]
    pub fn see(&mut self, r: usize, a: LoweredAction) {
        let LoweredAction::Comm(c) = a else { return };
        let t = c.transfer();
        if !self.index.contains(t) {
            return; // `Lowered::validate` names it
        }
        let (list, peer, seq) = match c {
            CommAction::Send(_) => (
                &mut self.sends[r],
                self.rank_of[t.to_stage().idx()],
                &mut self.send_seq,
            ),
            CommAction::Recv(_) => (
                &mut self.recvs[r],
                self.rank_of[t.stage.idx()],
                &mut self.recv_seq,
            ),
        };
        let count = match list.iter_mut().find(|(q, _)| *q == peer) {
            Some((_, n)) => n,
            None => {
                list.push((peer, 0));
                &mut list.last_mut().expect("pushed").1
            }
        };
        *count += 1;
        seq[self.index.get(t)] = *count;
    }

    /// `Ok` when every pair's receives came in its sends' order; else the first pair (by
    /// sending rank, then receiving rank) and position where they differ.
    ///
    /// # Errors
    /// [`Error::PairOrder`] naming the pair and the two actions.
    pub fn check(&self, schedule: &Schedule) -> Result<()> {
        if self.send_seq == self.recv_seq {
            return Ok(());
        }
        // Rebuild each pair's two orders from the positions, for the message.
        let n = schedule.num_stages();
        let mut pairs: std::collections::BTreeMap<(u32, u32), (Vec<Transfer>, Vec<Transfer>)> =
            Default::default();
        for a in schedule.ranks.iter().flatten().flat_map(|a| a.parts()) {
            let Some(t) = Transfer::of_producer(a, n) else {
                continue;
            };
            let x = self.index.get(t);
            let key = (
                self.rank_of[t.stage.idx()],
                self.rank_of[t.to_stage().idx()],
            );
            let (sends, recvs) = pairs.entry(key).or_default();
            for (list, seq) in [(sends, self.send_seq[x]), (recvs, self.recv_seq[x])] {
                if seq > 0 {
                    let at = seq as usize - 1;
                    if list.len() <= at {
                        list.resize(at + 1, t);
                    }
                    list[at] = t;
                }
            }
        }
        for ((from, to), (sent, got)) in pairs {
            let len = sent.len().max(got.len());
            if let Some(index) = (0..len).find(|&i| sent.get(i) != got.get(i)) {
                let name = |t: Option<&Transfer>, half: fn(Transfer) -> CommAction| {
                    t.map_or("-".to_string(), |t| half(*t).to_string())
                };
                return Err(Error::PairOrder {
                    schedule: schedule.name.clone(),
                    from,
                    to,
                    index,
                    sent: name(sent.get(index), CommAction::Send),
                    received: name(got.get(index), CommAction::Recv),
                });
            }
        }
        Ok(())
    }
}

/// The lowering of `schedule` under `posting`, action by action: `emit(r, a)` appends `a` to
/// rank `r`'s program (each rank's actions come in its program's order; ranks interleave).
/// [`lower`] collects them; the streams' replay keeps only the sends and receives.
///
/// # Errors
/// As [`lower`].
pub fn sweep(
    schedule: &Schedule,
    posting: RecvPosting,
    emit: impl FnMut(usize, LoweredAction),
) -> Result<()> {
    sweep_programs(schedule, None, posting, emit)
}

/// [`sweep`] over `fsdp`'s programs when given ([`fsdp_programs`]), else `schedule`'s
/// compute.
///
/// # Errors
/// As [`lower`].
pub fn sweep_programs(
    schedule: &Schedule,
    fsdp: Option<&[Vec<LoweredAction>]>,
    posting: RecvPosting,
    mut emit: impl FnMut(usize, LoweredAction),
) -> Result<()> {
    match posting {
        RecvPosting::Ahead => lower_ahead(schedule, fsdp, emit),
        RecvPosting::Deferred => {
            let mut deferral = Deferral::new(schedule);
            lower_ahead(schedule, fsdp, |r, a| deferral.push(r, a, &mut emit))?;
            deferral.finish(emit);
            Ok(())
        }
    }
}

/// [`lower`] with FSDP's per-stage actions, as PyTorch 2.15's runtime lowers a compute-only
/// schedule (`_PipelineScheduleRuntime._load_actions`): per rank `_add_unshard_reshard` and
/// `_add_reduce_grad` ([`fsdp_programs`]), then the same sweep, waits and (deferred)
/// receives. The replay does not run FSDP's actions yet: this is the program PyTorch runs,
/// for the `compute_comms` CSV and for comparing with a trace.
///
/// # Errors
/// As [`lower`]; [`Error::InvalidArgument`] for `max_active_stages` 0 or below the stages of
/// one overlapped action.
pub fn lower_with_fsdp(
    schedule: &Schedule,
    lowering: Lowering,
    max_active_stages: usize,
) -> Result<Lowered> {
    let programs = fsdp_programs(schedule, max_active_stages, lowering.fsdp_defer_wait)?;
    let mut program: Vec<Vec<LoweredAction>> = vec![Vec::new(); schedule.ranks.len()];
    sweep_programs(schedule, Some(&programs), lowering.posting, |r, a| {
        program[r].push(a)
    })?;
    Ok(Lowered {
        schedule: schedule.clone(),
        program,
        streams: lowering.streams,
    })
}

/// Per rank, its compute actions with FSDP's: PyTorch 2.15's `_add_unshard_reshard`
/// (residency and prefetch window `max_active_stages`, its default 3, lookahead "full": before
/// each action, reshard the active stages that are not among the next `max_active_stages`
/// distinct stages to run, unshard those of them not active; reshard what is left at the end)
/// and `_add_reduce_grad` (after the action that completes a stage's `m`-th W or B, that
/// stage's `REDUCE_GRAD` and `WAIT_REDUCE_GRAD`).
///
/// # Errors
/// [`Error::InvalidArgument`] for `max_active_stages` 0 or below the stages of one action.
pub fn fsdp_programs(
    schedule: &Schedule,
    max_active_stages: usize,
    defer_wait: bool,
) -> Result<Vec<Vec<LoweredAction>>> {
    if max_active_stages == 0 {
        return Err(Error::invalid(
            "max_active_stages",
            0,
            ">= 1 (stages whose parameters are gathered at once)",
        ));
    }
    schedule
        .ranks
        .iter()
        .map(|actions| {
            let with_unshard = unshard_reshard(actions, max_active_stages)?;
            Ok(reduce_grad(
                with_unshard,
                schedule.num_microbatches,
                defer_wait,
            ))
        })
        .collect()
}

/// `_add_unshard_reshard` on one rank's `actions` (see [`fsdp_programs`]).
fn unshard_reshard(actions: &[Action], window: usize) -> Result<Vec<LoweredAction>> {
    use crate::ir::comm::FsdpAction::{Reshard, Unshard};
    // Per action from the end: each stage's next action index at or after it, and its part
    // position there (ties within an overlapped pair go in part order).
    let mut next_at: Vec<(crate::ir::StageId, usize, usize)> = Vec::new();
    let mut windows: Vec<Vec<crate::ir::StageId>> = vec![Vec::new(); actions.len()];
    for (i, a) in actions.iter().enumerate().rev() {
        for (k, c) in a.parts().enumerate().collect::<Vec<_>>().into_iter().rev() {
            next_at.retain(|e| e.0 != c.stage);
            next_at.push((c.stage, i, k));
        }
        let mut order = next_at.clone();
        order.sort_by_key(|e| (e.1, e.2));
        // The first `window` distinct stages, extended to the end of the action that reaches
        // the count (PyTorch's `next_stage_indices`).
        let cut = order
            .get(window.saturating_sub(1))
            .map_or(order.len(), |e| {
                order.iter().take_while(|x| x.1 <= e.1).count()
            });
        windows[i] = order[..cut].iter().map(|e| e.0).collect();
    }
    let mut active: Vec<crate::ir::StageId> = Vec::new();
    let mut out = Vec::with_capacity(actions.len() + 4);
    for (i, a) in actions.iter().enumerate() {
        let mut stages: Vec<crate::ir::StageId> = a.parts().map(|c| c.stage).collect();
        stages.dedup();
        if stages.len() > window {
            return Err(Error::invalid(
                "max_active_stages",
                window,
                format!(">= {} ({a} needs its stages at once)", stages.len()),
            ));
        }
        let resident = &windows[i];
        for s in active.clone() {
            if !resident.contains(&s) {
                active.retain(|x| *x != s);
                out.push(LoweredAction::Fsdp(s, Reshard));
            }
        }
        for &s in resident {
            if !active.contains(&s) {
                active.push(s);
                out.push(LoweredAction::Fsdp(s, Unshard));
            }
        }
        out.push(LoweredAction::Compute(*a));
    }
    out.extend(active.into_iter().map(|s| LoweredAction::Fsdp(s, Reshard)));
    Ok(out)
}

/// `_add_reduce_grad` over one rank's program with FSDP's unshards: after the entry that
/// completes a stage's `m`-th W or B, that stage's `REDUCE_GRAD`, and its `WAIT_REDUCE_GRAD`
/// right after it, or with `defer_wait` (PyTorch's `defer_reduce_grad_wait`) just before the
/// rank's next `REDUCE_GRAD` or at the end of the program.
fn reduce_grad(program: Vec<LoweredAction>, m: u32, defer_wait: bool) -> Vec<LoweredAction> {
    use crate::ir::comm::FsdpAction::{ReduceGrad, WaitReduceGrad};
    let mut count: Vec<(crate::ir::StageId, u32)> = Vec::new();
    let mut pending: Option<crate::ir::StageId> = None;
    let mut out = Vec::with_capacity(program.len() + 8);
    for entry in program {
        out.push(entry);
        let LoweredAction::Compute(a) = entry else {
            continue;
        };
        for c in a.parts() {
            if !matches!(c.kind, crate::ir::ActionKind::W | crate::ir::ActionKind::B) {
                continue;
            }
            let n = match count.iter_mut().find(|e| e.0 == c.stage) {
                Some(e) => {
                    e.1 += 1;
                    e.1
                }
                None => {
                    count.push((c.stage, 1));
                    1
                }
            };
            if n != m {
                continue;
            }
            if defer_wait {
                if let Some(p) = pending.replace(c.stage) {
                    out.push(LoweredAction::Fsdp(p, WaitReduceGrad));
                }
                out.push(LoweredAction::Fsdp(c.stage, ReduceGrad));
            } else {
                out.push(LoweredAction::Fsdp(c.stage, ReduceGrad));
                out.push(LoweredAction::Fsdp(c.stage, WaitReduceGrad));
            }
        }
    }
    if let Some(p) = pending {
        out.push(LoweredAction::Fsdp(p, WaitReduceGrad));
    }
    out
}

/// Per rank, the length of its lowered program: its compute actions, a send and a wait per
/// transfer it sends to another rank, a receive per transfer it receives from one.
fn program_lengths(schedule: &Schedule) -> Vec<usize> {
    let n = schedule.num_stages();
    let rank_of = |s| schedule.placement.rank(s).idx();
    let mut len: Vec<usize> = schedule.ranks.iter().map(Vec::len).collect();
    for (r, actions) in schedule.ranks.iter().enumerate() {
        for a in actions.iter().flat_map(|a| a.parts()) {
            if let Some(t) = Transfer::of_producer(a, n) {
                let to = rank_of(t.to_stage());
                if to != r {
                    len[r] += 2;
                    len[to] += 1;
                }
            }
        }
    }
    len
}

/// A send's progress towards its wait (PyTorch 2.15's `_add_wait_send`).
#[derive(Clone, Copy, PartialEq, Eq)]
enum SendState {
    NotPosted,
    Posted,
    Waited,
}

/// PyTorch's `_add_send_recv` sweep, with `_add_wait_send`'s waits: per rank the program with
/// ahead receives. It sweeps the ranks in order, placing each rank's next compute action once
/// its input is placed; each send goes right after its producer, its receive at the end of the
/// receiver's program so far. A forward send's wait goes right after the local backward (I or
/// B) of its stage and microbatch, every other send's at the end of the step in the order they
/// were posted.
///
/// With `fsdp` (per rank its compute actions with FSDP's, [`fsdp_programs`]), the sweep runs
/// over those lists: an FSDP action is always ready and takes its rank's turn, as in
/// PyTorch's sweep.
fn lower_ahead(
    schedule: &Schedule,
    fsdp: Option<&[Vec<LoweredAction>]>,
    mut emit: impl FnMut(usize, LoweredAction),
) -> Result<()> {
    let entry = |r: usize, i: usize| match fsdp {
        Some(programs) => programs[r].get(i).copied(),
        None => schedule.ranks[r].get(i).map(|&a| LoweredAction::Compute(a)),
    };
    let index = TransferIndex::of(schedule);
    let p = schedule.ranks.len();
    let n = schedule.num_stages();
    let rank_of = |s| schedule.placement.rank(s).idx();
    // Whether each transfer's payload is placed on its receiving rank (its receive, or the
    // producing compute when both stages are on one rank).
    let mut placed = vec![false; index.len()];
    let mut sent = vec![SendState::NotPosted; index.len()];
    // Per rank, its sends in posting order, for the waits at the end of the step.
    let mut posted: Vec<Vec<Transfer>> = vec![Vec::new(); p];
    let mut next = vec![0usize; p];
    loop {
        let mut progress = false;
        let mut left = false;
        for r in 0..p {
            let action = match entry(r, next[r]) {
                None => continue,
                Some(LoweredAction::Compute(action)) => action,
                Some(other) => {
                    // FSDP's actions need nothing placed first.
                    left = true;
                    emit(r, other);
                    next[r] += 1;
                    progress = true;
                    continue;
                }
            };
            left = true;
            let input_placed =
                |a: ComputeAction| Transfer::of_consumer(a, n).is_none_or(|t| placed[index.get(t)]);
            if !action.parts().all(input_placed) {
                continue;
            }
            emit(r, LoweredAction::Compute(action));
            for c in action.parts().filter(|c| c.kind.is_input_backward()) {
                let forward = Transfer {
                    stage: c.stage,
                    microbatch: c.microbatch,
                    payload: Payload::Activation,
                };
                if index.contains(forward) && sent[index.get(forward)] == SendState::Posted {
                    sent[index.get(forward)] = SendState::Waited;
                    emit(r, LoweredAction::WaitSend(forward));
                }
            }
            for a in action.parts() {
                let Some(t) = Transfer::of_producer(a, n) else {
                    continue;
                };
                let to = rank_of(t.to_stage());
                if to != r {
                    emit(r, LoweredAction::Comm(CommAction::Send(t)));
                    emit(to, LoweredAction::Comm(CommAction::Recv(t)));
                    sent[index.get(t)] = SendState::Posted;
                    posted[r].push(t);
                }
                placed[index.get(t)] = true;
            }
            next[r] += 1;
            progress = true;
        }
        if !left {
            break;
        }
        if !progress {
            let heads: Vec<String> = (0..p)
                .filter_map(|r| entry(r, next[r]).map(|a| format!("rank {r}: {a}")))
                .collect();
            return Err(stuck(schedule, &heads));
        }
    }
    for (r, sends) in posted.into_iter().enumerate() {
        for t in sends {
            if sent[index.get(t)] == SendState::Posted {
                emit(r, LoweredAction::WaitSend(t));
            }
        }
    }
    Ok(())
}

/// The error of a compute order no sweep can place, given each rank's next action (`heads`).
fn stuck(schedule: &Schedule, heads: &[String]) -> Error {
    Error::InvalidSchedule {
        schedule: schedule.name.clone(),
        reason: format!(
            "its sends and receives cannot be placed: every rank's next compute action waits for an input no rank has sent yet ({})",
            heads.join(", ")
        ),
    }
}

/// PyTorch's `_defer_recv_ops` (PR #178815) over the ahead programs, action by action: each
/// receive moves to just before the compute that consumes it; before a send to a
/// higher-numbered peer, the receives deferred from that peer go first.
struct Deferral<'a> {
    schedule: &'a Schedule,
    /// Per rank, its receives not posted yet, in their ahead order.
    deferred: Vec<Vec<Transfer>>,
}

impl<'a> Deferral<'a> {
    fn new(schedule: &'a Schedule) -> Self {
        Deferral {
            schedule,
            deferred: vec![Vec::new(); schedule.ranks.len()],
        }
    }

    /// Takes rank `r`'s next ahead action `a`, emitting what the deferred program holds by then.
    fn push(&mut self, r: usize, a: LoweredAction, emit: &mut impl FnMut(usize, LoweredAction)) {
        let n = self.schedule.num_stages();
        let rank_of = |s| self.schedule.placement.rank(s).idx();
        let deferred = &mut self.deferred[r];
        match a {
            LoweredAction::Comm(CommAction::Recv(t)) => deferred.push(t),
            LoweredAction::Compute(action) => {
                for c in action.parts() {
                    if let Some(t) = Transfer::of_consumer(c, n) {
                        if let Some(i) = deferred.iter().position(|d| *d == t) {
                            emit(r, LoweredAction::Comm(CommAction::Recv(deferred.remove(i))));
                        }
                    }
                }
                emit(r, a);
            }
            LoweredAction::WaitSend(_) | LoweredAction::Fsdp(..) | LoweredAction::AllToAll(_) => {
                emit(r, a)
            }
            LoweredAction::Comm(CommAction::Send(t)) => {
                let peer = rank_of(t.to_stage());
                if r < peer {
                    deferred.retain(|d| {
                        let from_peer = rank_of(d.stage) == peer;
                        if from_peer {
                            emit(r, LoweredAction::Comm(CommAction::Recv(*d)));
                        }
                        !from_peer
                    });
                }
                emit(r, a);
            }
        }
    }

    /// The receives no compute consumed, at the end of their ranks' programs (none in a valid
    /// schedule).
    fn finish(self, mut emit: impl FnMut(usize, LoweredAction)) {
        for (r, deferred) in self.deferred.into_iter().enumerate() {
            for t in deferred {
                emit(r, LoweredAction::Comm(CommAction::Recv(t)));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schedules::generators::{ScheduleKind, interleaved_1f1b};

    fn names(prog: &[LoweredAction]) -> Vec<String> {
        prog.iter().map(ToString::to_string).collect()
    }

    #[test]
    fn ahead_receives_follow_pytorchs_sweep() {
        // PyTorch issue #172668 quotes rank 0 of Interleaved1F1B, pp 2, 4 microbatches, as
        // lowered by `_add_send_recv` (its UNSHARD actions aside):
        // 0F0, 0SEND_F0, 2RECV_F0, 0F1, 0SEND_F1, 2RECV_F1, 2F0, 2SEND_F0, 2F1, ...
        let (s, _) = interleaved_1f1b(2, 2, 4, None).unwrap();
        let l = lower(&s, Lowering::UNCONTENDED).unwrap();
        l.validate().unwrap();
        assert_eq!(
            names(&l.program[0])[..9],
            [
                "0F0", "0SEND_F0", "2RECV_F0", "0F1", "0SEND_F1", "2RECV_F1", "2F0", "2SEND_F0",
                "2F1"
            ]
        );
    }

    #[test]
    fn deferred_receives_sit_before_their_consumer_lower_rank_first() {
        // The same case deferred: 2RECV_F0 leaves its ahead place for 2F0, but rank 0 is the
        // lower rank of its pair with rank 1, so it flushes the receives it deferred from rank 1
        // before each send to rank 1: 2RECV_F0 before 0SEND_F1, 2RECV_F1 before 2SEND_F0.
        let (s, _) = interleaved_1f1b(2, 2, 4, None).unwrap();
        let l = lower(
            &s,
            Lowering {
                posting: RecvPosting::Deferred,
                streams: StreamLayout::Shared,
                fsdp: None,
                fsdp_defer_wait: false,
            },
        )
        .unwrap();
        l.validate().unwrap();
        let r0 = names(&l.program[0]);
        assert_eq!(
            r0[..8],
            [
                "0F0", "0SEND_F0", "0F1", "2RECV_F0", "0SEND_F1", "2F0", "2RECV_F1", "2SEND_F0"
            ]
        );
        // Rank 1 is the higher rank: its receives of stage 0's outputs come just before 1F0
        // and 1F1.
        let r1 = names(&l.program[1]);
        let at = |x: &str| r1.iter().position(|a| a == x).unwrap();
        assert!(at("1RECV_F0") + 1 == at("1F0") && at("1RECV_F1") + 1 == at("1F1"));
    }

    #[test]
    fn every_kind_lowers_and_validates_under_every_policy() {
        for &kind in ScheduleKind::ALL {
            let Ok(s) = kind.generate(4, 2, 8) else {
                continue;
            };
            for policy in Lowering::ALL {
                let l = lower(&s, policy).unwrap();
                l.validate()
                    .unwrap_or_else(|e| panic!("{} {policy}: {e}", s.name));
            }
        }
    }

    #[test]
    fn fsdp_actions_follow_pytorchs_residency_window() {
        use crate::ir::comm::FsdpAction;
        let fsdp_only = |prog: &[LoweredAction]| -> Vec<String> {
            prog.iter()
                .filter(|a| matches!(a, LoweredAction::Fsdp(..) | LoweredAction::Compute(_)))
                .map(ToString::to_string)
                .collect()
        };
        // 1F1B, p = 2, m = 2, rank 0 (stage 0): gathered before its first action, its
        // gradients reduced after its second (the m-th) B, resharded at the end.
        let s = ScheduleKind::OneFOneB.generate(2, 1, 2).unwrap();
        let p = fsdp_programs(&s, 3, false).unwrap();
        assert_eq!(
            fsdp_only(&p[0]),
            [
                "0UNSHARD",
                "0F0",
                "0F1",
                "0B0",
                "0B1",
                "0REDUCE_GRAD",
                "0WAIT_REDUCE_GRAD",
                "0RESHARD"
            ]
        );
        // Interleaved, p = 2, v = 4, m = 4: rank 0 holds stages 0, 2, 4 and 6 and runs
        // 0F0 0F1 2F0 2F1 4F0 ... At 0F0 the next three distinct stages are 0, 2, 4: all
        // gathered. At 2F0 they are 2, 4, 6: stage 0 is resharded, 6 gathered. At 4F0: 4, 6
        // and 0 (the next round's 0F2): 2 out, 0 back in.
        let (s, _) = interleaved_1f1b(2, 4, 4, None).unwrap();
        let p = fsdp_programs(&s, 3, false).unwrap();
        assert_eq!(
            fsdp_only(&p[0])[..12],
            [
                "0UNSHARD", "2UNSHARD", "4UNSHARD", "0F0", "0F1", "0RESHARD", "6UNSHARD", "2F0",
                "2F1", "2RESHARD", "0UNSHARD", "4F0"
            ]
        );
        // Every stage of the rank is reduced once and left resharded.
        for a in [FsdpAction::ReduceGrad, FsdpAction::WaitReduceGrad] {
            let n = p[0]
                .iter()
                .filter(|x| matches!(x, LoweredAction::Fsdp(_, y) if *y == a))
                .count();
            assert_eq!(n, 4);
        }
        assert!(matches!(
            p[0].last(),
            Some(LoweredAction::Fsdp(_, FsdpAction::Reshard))
        ));
        assert!(fsdp_programs(&s, 0, false).is_err());
        // Deferred waits (PyTorch's defer_reduce_grad_wait), interleaved p = 2, v = 2, m = 4,
        // rank 0 (stages 0 and 2): stage 2's backwards end first, so its REDUCE_GRAD comes
        // first; its wait moves to just before stage 0's REDUCE_GRAD, and stage 0's wait to
        // the end of the program, after the last RESHARD.
        let (s, _) = interleaved_1f1b(2, 2, 4, None).unwrap();
        let p = fsdp_programs(&s, 3, true).unwrap();
        let tail: Vec<String> = fsdp_only(&p[0])
            .into_iter()
            .filter(|a| a.contains("REDUCE") || a.contains("RESHARD"))
            .collect();
        assert_eq!(
            tail,
            [
                "2REDUCE_GRAD",
                "2RESHARD",
                "2WAIT_REDUCE_GRAD",
                "0REDUCE_GRAD",
                "0RESHARD",
                "0WAIT_REDUCE_GRAD"
            ]
        );
    }

    #[test]
    fn a_deferred_v_posts_one_pairs_receives_out_of_its_send_order() {
        // ZB-V, p = 2, m = 4: rank 0 holds stages 0 and 3, rank 1 stages 1 and 2. Rank 0
        // sends rank 1 stage 0's activations (0SEND_F*) and stage 3's gradients (3SEND_B*),
        // in its compute order: 0F0 0F1 0F2 ... the forwards first, so its sends to rank 1
        // start 0SEND_F0 0SEND_F1 0SEND_F2. Deferred, rank 1 posts each receive just before
        // the compute that reads it, and its first backward, 2I0, reads 3's gradient of
        // microbatch 0 before 1F2 reads activations 2: receive 2 is 2RECV_B0 where send 2 is
        // 0SEND_F2.
        let s = ScheduleKind::ZbV.generate(2, 2, 4).unwrap();
        let e = check_pair_order(&s, RecvPosting::Deferred).unwrap_err();
        match e {
            Error::PairOrder {
                from,
                to,
                index,
                ref sent,
                ref received,
                ..
            } => {
                assert_eq!((from, to, index), (0, 1, 2), "{e}");
                assert_eq!((sent.as_str(), received.as_str()), ("0SEND_F2", "2RECV_B0"));
            }
            other => panic!("{other}"),
        }
        // Where every rank reads in its peers' send order, the sweep agrees that the deferred
        // order keeps every pair's order.
        for &kind in ScheduleKind::ALL {
            for (p, v, m) in [(2, 2, 4), (3, 2, 7), (4, 2, 8), (4, 1, 9)] {
                if let Ok(s) = kind.generate(p, v, m)
                    && consumed_in_send_order(&s)
                {
                    let mut order = PairOrder::new(&s);
                    sweep(&s, RecvPosting::Deferred, |r, a| order.see(r, a)).unwrap();
                    order.check(&s).unwrap();
                }
            }
        }
        assert!(!consumed_in_send_order(
            &ScheduleKind::ZbV.generate(2, 2, 4).unwrap()
        ));
        // Receives posted ahead keep every pair's order, by construction.
        for &kind in ScheduleKind::ALL {
            for (p, m) in [(2, 4), (4, 8)] {
                if let Ok(s) = kind.generate(p, 2, m) {
                    check_pair_order(&s, RecvPosting::Ahead).unwrap();
                    let mut order = PairOrder::new(&s);
                    sweep(&s, RecvPosting::Ahead, |r, a| order.see(r, a)).unwrap();
                    order.check(&s).unwrap();
                }
            }
        }
    }
}
