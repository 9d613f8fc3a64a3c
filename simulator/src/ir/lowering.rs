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
use crate::ir::{ComputeAction, Schedule};
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
}

impl Lowering {
    /// Ahead receives on per-peer, per-direction streams: the replay of the compute schedule
    /// itself (every transfer waits only for its payload and the previous transfer on its link).
    pub const UNCONTENDED: Lowering = Lowering {
        posting: RecvPosting::Ahead,
        streams: StreamLayout::PerPeer,
    };
    /// Every policy, for comparisons and tests.
    pub const ALL: [Lowering; 6] = [
        Lowering::UNCONTENDED,
        Lowering {
            posting: RecvPosting::Ahead,
            streams: StreamLayout::PeerPair,
        },
        Lowering {
            posting: RecvPosting::Ahead,
            streams: StreamLayout::Shared,
        },
        Lowering {
            posting: RecvPosting::Deferred,
            streams: StreamLayout::PerPeer,
        },
        Lowering {
            posting: RecvPosting::Deferred,
            streams: StreamLayout::PeerPair,
        },
        Lowering {
            posting: RecvPosting::Deferred,
            streams: StreamLayout::Shared,
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
        write!(f, "{posting} receives, {streams} streams")
    }
}

/// Lowers `schedule` under `lowering`.
///
/// # Errors
/// [`Error::InvalidSchedule`] when no rank's next compute action can be placed (its input is
/// never sent: PyTorch's "Malformed compute schedule"), naming each rank's next action.
pub fn lower(schedule: &Schedule, lowering: Lowering) -> Result<Lowered> {
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
    mut emit: impl FnMut(usize, LoweredAction),
) -> Result<()> {
    match posting {
        RecvPosting::Ahead => lower_ahead(schedule, emit),
        RecvPosting::Deferred => {
            let mut deferral = Deferral::new(schedule);
            lower_ahead(schedule, |r, a| deferral.push(r, a, &mut emit))?;
            deferral.finish(emit);
            Ok(())
        }
    }
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
fn lower_ahead(schedule: &Schedule, mut emit: impl FnMut(usize, LoweredAction)) -> Result<()> {
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
            let Some(&action) = schedule.ranks[r].get(next[r]) else {
                continue;
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
            return Err(stuck(schedule, &next));
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

/// The error of a compute order no sweep can place: each rank's next action.
fn stuck(schedule: &Schedule, next: &[usize]) -> Error {
    let heads: Vec<String> = next
        .iter()
        .enumerate()
        .filter_map(|(r, &i)| schedule.ranks[r].get(i).map(|a| format!("rank {r}: {a}")))
        .collect();
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
            LoweredAction::WaitSend(_) | LoweredAction::Fsdp(..) => emit(r, a),
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
