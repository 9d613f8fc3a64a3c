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

/// A lowering policy: receive posting and stream layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
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
    let index = TransferIndex::of(schedule);
    let mut slot = vec![u32::MAX; index.len()];
    let ahead: Vec<Vec<LoweredAction>> = lower_ahead(schedule, &index)?
        .iter()
        .map(|prog| add_send_waits(prog, &index, &mut slot))
        .collect();
    let program = match lowering.posting {
        RecvPosting::Ahead => ahead,
        RecvPosting::Deferred => ahead
            .iter()
            .enumerate()
            .map(|(r, prog)| defer_receives(schedule, r, prog))
            .collect(),
    };
    Ok(Lowered {
        schedule: schedule.clone(),
        program,
        streams: lowering.streams,
    })
}

/// PyTorch's `_add_send_recv` sweep: per rank the program with ahead receives.
fn lower_ahead(schedule: &Schedule, index: &TransferIndex) -> Result<Vec<Vec<LoweredAction>>> {
    let p = schedule.ranks.len();
    let n = schedule.num_stages();
    let rank_of = |s| schedule.placement.rank(s).idx();
    let mut program: Vec<Vec<LoweredAction>> = schedule
        .ranks
        .iter()
        .map(|a| Vec::with_capacity(2 * a.len()))
        .collect();
    // Whether each transfer's payload is placed on its receiving rank (its receive, or the
    // producing compute when both stages are on one rank).
    let mut placed = vec![false; index.len()];
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
            program[r].push(LoweredAction::Compute(action));
            for a in action.parts() {
                let Some(t) = Transfer::of_producer(a, n) else {
                    continue;
                };
                let to = rank_of(t.to_stage());
                if to != r {
                    program[r].push(LoweredAction::Comm(CommAction::Send(t)));
                    program[to].push(LoweredAction::Comm(CommAction::Recv(t)));
                }
                placed[index.get(t)] = true;
            }
            next[r] += 1;
            progress = true;
        }
        if !left {
            return Ok(program);
        }
        if !progress {
            return Err(stuck(schedule, &next));
        }
    }
}

/// `prog` with a wait after each send (PyTorch 2.15's `_add_wait_send`): a forward send's wait
/// right after the local backward (I or B) of its stage and microbatch, every other send's at
/// the end of the step in the order they were posted.
/// `slot` is scratch of [`TransferIndex::len`] entries, all `u32::MAX`, and left so.
fn add_send_waits(
    prog: &[LoweredAction],
    index: &TransferIndex,
    slot: &mut [u32],
) -> Vec<LoweredAction> {
    let mut out = Vec::with_capacity(prog.len() * 3 / 2);
    // The sends not waited for yet, in posting order (`None` once waited for); `slot` says
    // where each send sits in that list.
    let mut pending: Vec<Option<Transfer>> = Vec::new();
    let mut posted: Vec<usize> = Vec::new();
    for &a in prog {
        out.push(a);
        match a {
            LoweredAction::Comm(CommAction::Send(t)) => {
                slot[index.get(t)] = pending.len() as u32;
                posted.push(index.get(t));
                pending.push(Some(t));
            }
            LoweredAction::Compute(action) => {
                for c in action.parts().filter(|c| c.kind.is_input_backward()) {
                    let forward = Transfer {
                        stage: c.stage,
                        microbatch: c.microbatch,
                        payload: Payload::Activation,
                    };
                    if !index.contains(forward) {
                        continue;
                    }
                    let i = slot[index.get(forward)];
                    if let Some(t) = pending.get_mut(i as usize).and_then(Option::take) {
                        out.push(LoweredAction::WaitSend(t));
                    }
                }
            }
            _ => {}
        }
    }
    out.extend(pending.into_iter().flatten().map(LoweredAction::WaitSend));
    for x in posted {
        slot[x] = u32::MAX;
    }
    out
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

/// Rank `r`'s ahead program with its receives deferred (PR #178815): each receive just before
/// the compute that consumes it; before a send to a higher-numbered peer, the receives deferred
/// from that peer first.
fn defer_receives(schedule: &Schedule, r: usize, prog: &[LoweredAction]) -> Vec<LoweredAction> {
    let n = schedule.num_stages();
    let rank_of = |s| schedule.placement.rank(s).idx();
    let mut deferred: Vec<Transfer> = Vec::new();
    let mut out = Vec::with_capacity(prog.len());
    for &a in prog {
        match a {
            LoweredAction::Comm(CommAction::Recv(t)) => deferred.push(t),
            LoweredAction::Compute(action) => {
                for c in action.parts() {
                    if let Some(t) = Transfer::of_consumer(c, n) {
                        if let Some(i) = deferred.iter().position(|d| *d == t) {
                            out.push(LoweredAction::Comm(CommAction::Recv(deferred.remove(i))));
                        }
                    }
                }
                out.push(a);
            }
            LoweredAction::WaitSend(_) => out.push(a),
            LoweredAction::Comm(CommAction::Send(t)) => {
                let peer = rank_of(t.to_stage());
                if r < peer {
                    deferred.retain(|d| {
                        let from_peer = rank_of(d.stage) == peer;
                        if from_peer {
                            out.push(LoweredAction::Comm(CommAction::Recv(*d)));
                        }
                        !from_peer
                    });
                }
                out.push(a);
            }
        }
    }
    // A receive no compute consumes cannot exist in a valid schedule; keep any at the end.
    out.extend(
        deferred
            .into_iter()
            .map(|t| LoweredAction::Comm(CommAction::Recv(t))),
    );
    out
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
}
