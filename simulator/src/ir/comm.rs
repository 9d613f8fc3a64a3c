//! Communication as actions: the sends and receives a schedule's transfers become, the streams
//! they are posted on, and a schedule lowered to compute plus communication.
//!
//! A compute schedule ([`Schedule`]) leaves its transfers implicit ([`ComputeAction::sends`]).
//! PyTorch's runtime lowers it (`torch.distributed.pipelining.schedules._add_send_recv`) into one
//! list per rank that also holds `SEND_F` / `RECV_F` / `SEND_B` / `RECV_B` actions, and runs
//! the P2P ones on a communication stream where they execute in posting order. [`Lowered`] is
//! that list; [`crate::ir::lowering`] builds it under a policy and
//! [`crate::replay::streams`] replays it with the streams' semantics.
//!
//! Notation (PyTorch's, `_Action.__repr__`): the stage index is the stage that posts the action.
//! Stage 0's forward output of microbatch 3 crosses as `0SEND_F3` on stage 0's rank and
//! `1RECV_F3` on stage 1's; stage 2's input gradient as `2SEND_B3` and `1RECV_B3`. The
//! forward-only extension writes `SEND_Fo` / `RECV_Fo`.

use super::{Action, ActionKind, ComputeAction, MicrobatchId, Placement, Rank, Schedule, StageId};
use crate::{Error, Result};
use std::fmt;
use std::str::FromStr;

/// What a point-to-point transfer carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Payload {
    /// A forward's output activations, to the next stage (sent by F).
    Activation,
    /// A backward's input gradient, to the previous stage (sent by I or B).
    Gradient,
    /// A forward-only pass's output activations, to the next stage (sent by Fo).
    ForwardOnly,
}

impl Payload {
    /// What a compute action of `kind` sends or receives: activations for F, gradients for I
    /// and B, forward-only activations for Fo; nothing for W.
    pub fn of(kind: ActionKind) -> Option<Payload> {
        match kind {
            ActionKind::F => Some(Payload::Activation),
            ActionKind::Fo => Some(Payload::ForwardOnly),
            ActionKind::I | ActionKind::B => Some(Payload::Gradient),
            ActionKind::W => None,
        }
    }

    /// The compute kind whose transfer cost [`crate::costs::CostModel::comm_ns`] gives for it
    /// (I and B send the same gradient).
    pub fn cost_kind(self) -> ActionKind {
        match self {
            Payload::Activation => ActionKind::F,
            Payload::Gradient => ActionKind::B,
            Payload::ForwardOnly => ActionKind::Fo,
        }
    }

    /// PyTorch's suffix: `F` (activations forward), `B` (gradients back), our `Fo`.
    fn suffix(self) -> &'static str {
        match self {
            Payload::Activation => "F",
            Payload::Gradient => "B",
            Payload::ForwardOnly => "Fo",
        }
    }
}

/// One transfer of the step: `payload` of `microbatch` leaving `stage` (the stage whose compute
/// produced it) for its neighbour stage.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Transfer {
    /// The sending stage.
    pub stage: StageId,
    /// The microbatch (forward-only microbatches have their own id space).
    pub microbatch: MicrobatchId,
    /// What crosses.
    pub payload: Payload,
}

impl Transfer {
    /// The transfer `producer`'s output makes in a pipeline of `num_stages` stages, if any
    /// ([`ComputeAction::sends`]).
    pub fn of_producer(producer: ComputeAction, num_stages: u32) -> Option<Transfer> {
        producer.sends(num_stages)?;
        Some(Transfer {
            stage: producer.stage,
            microbatch: producer.microbatch,
            payload: Payload::of(producer.kind)?,
        })
    }

    /// The transfer `consumer` waits for in a pipeline of `num_stages` stages, if any
    /// ([`ComputeAction::receives`]).
    pub fn of_consumer(consumer: ComputeAction, num_stages: u32) -> Option<Transfer> {
        Some(Transfer {
            stage: consumer.receives(num_stages)?,
            microbatch: consumer.microbatch,
            payload: Payload::of(consumer.kind)?,
        })
    }

    /// The receiving stage: the next for activations, the previous for gradients (`u32::MAX`,
    /// no stage, for a gradient of stage 0).
    pub fn to_stage(self) -> StageId {
        match self.payload {
            Payload::Activation | Payload::ForwardOnly => StageId(self.stage.0.saturating_add(1)),
            Payload::Gradient => StageId(self.stage.0.wrapping_sub(1)),
        }
    }
}

/// Dense indices of a schedule's transfers, for per-transfer arrays: activations, then
/// gradients, then forward-only activations, each by (sending stage, microbatch).
#[derive(Debug, Clone, Copy)]
pub struct TransferIndex {
    s_count: usize,
    m: usize,
    mfo: usize,
}

impl TransferIndex {
    /// The index of `schedule`'s transfers.
    pub fn of(schedule: &Schedule) -> Self {
        TransferIndex {
            s_count: schedule.num_stages() as usize,
            m: schedule.num_microbatches as usize,
            mfo: schedule.num_fo_microbatches as usize,
        }
    }

    /// Number of indices (every (stage, microbatch, payload), crossing ranks or not).
    pub fn len(&self) -> usize {
        2 * self.s_count * self.m + self.s_count * self.mfo
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// `t`'s index, `< self.len()` for a transfer of the schedule.
    #[inline]
    pub fn get(&self, t: Transfer) -> usize {
        let (s, mb) = (t.stage.idx(), t.microbatch.idx());
        match t.payload {
            Payload::Activation => s * self.m + mb,
            Payload::Gradient => (self.s_count + s) * self.m + mb,
            Payload::ForwardOnly => 2 * self.s_count * self.m + s * self.mfo + mb,
        }
    }

    /// Whether `t` names a stage and microbatch of the schedule.
    pub fn contains(&self, t: Transfer) -> bool {
        let to = t.to_stage().idx();
        let count = match t.payload {
            Payload::ForwardOnly => self.mfo,
            _ => self.m,
        };
        t.stage.idx() < self.s_count && to < self.s_count && t.microbatch.idx() < count
    }
}

/// One half of a point-to-point transfer, posted on a communication stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CommAction {
    /// The sending stage's rank posts the send (`0SEND_F3`).
    Send(Transfer),
    /// The receiving stage's rank posts the matching receive (`1RECV_F3`).
    Recv(Transfer),
}

impl CommAction {
    /// The transfer this half belongs to.
    pub fn transfer(self) -> Transfer {
        match self {
            CommAction::Send(t) | CommAction::Recv(t) => t,
        }
    }

    /// The stage that posts it: the sending stage for a send, the receiving one for a receive.
    pub fn stage(self) -> StageId {
        match self {
            CommAction::Send(t) => t.stage,
            CommAction::Recv(t) => t.to_stage(),
        }
    }
}

impl fmt::Display for CommAction {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (what, t) = match self {
            CommAction::Send(t) => ("SEND", t),
            CommAction::Recv(t) => ("RECV", t),
        };
        write!(
            f,
            "{}{what}_{}{}",
            self.stage(),
            t.payload.suffix(),
            t.microbatch
        )
    }
}

impl FromStr for CommAction {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        let err = |reason: &str| Error::ParseAction {
            text: s.to_string(),
            reason: reason.to_string(),
        };
        let t = s.trim();
        let d = t
            .find(|c: char| !c.is_ascii_digit())
            .ok_or_else(|| err("no action name"))?;
        let stage: u32 = t[..d]
            .parse()
            .map_err(|_| err("must start with the stage number"))?;
        let rest = &t[d..];
        let (send, rest) = if let Some(r) = rest.strip_prefix("SEND_") {
            (true, r)
        } else if let Some(r) = rest.strip_prefix("RECV_") {
            (false, r)
        } else {
            return Err(err("not a SEND_ or RECV_ action"));
        };
        let l = rest
            .find(|c: char| c.is_ascii_digit())
            .ok_or_else(|| err("no microbatch number after the direction"))?;
        let payload = match &rest[..l] {
            "F" => Payload::Activation,
            "B" => Payload::Gradient,
            "Fo" => Payload::ForwardOnly,
            other => {
                return Err(err(&format!(
                    "unknown direction `{other}` (F, B, or flatpipe's Fo)"
                )));
            }
        };
        let microbatch: u32 = rest[l..]
            .parse()
            .map_err(|_| err("microbatch number out of range or trailing characters"))?;
        // A receive names the receiving stage; the transfer is keyed by the sending one.
        let sending = match (send, payload) {
            (true, _) => Some(stage),
            (false, Payload::Gradient) => stage.checked_add(1),
            (false, _) => stage.checked_sub(1),
        }
        .ok_or_else(|| err("stage 0 receives no activations"))?;
        let t = Transfer {
            stage: StageId(sending),
            microbatch: MicrobatchId(microbatch),
            payload,
        };
        Ok(if send {
            CommAction::Send(t)
        } else {
            CommAction::Recv(t)
        })
    }
}

/// One entry of a lowered rank's program: compute, one half of a transfer, or the host's wait
/// for a send.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LoweredAction {
    /// A compute action (or overlapped pair), on the rank's compute stream.
    Compute(Action),
    /// A send or receive, on the stream [`Lowered::stream_of`] names.
    Comm(CommAction),
    /// PyTorch 2.15's `WAIT_SEND_F` / `WAIT_SEND_B` (`_add_wait_send`): the host waits for its
    /// send of this transfer and frees the buffer, after the local backward that proves the
    /// peer has the activations, or at the end of the step. The replay does not delay compute
    /// for it: the send it waits for has ended by then, except a step's last sends, which the
    /// timeline's makespan holds anyway.
    WaitSend(Transfer),
    /// One of FSDP's per-stage actions in PyTorch 2.15's runtime, on the rank that holds the
    /// stage (`0UNSHARD`, `1REDUCE_GRAD`, ...).
    Fsdp(StageId, FsdpAction),
    /// An expert-parallel all-to-all of one mixture-of-experts layer, measured inside a compute
    /// action (the executor's; the replay prices it within the action's cost).
    AllToAll(AllToAll),
}

/// An expert-parallel all-to-all: one mixture-of-experts layer's dispatch of a microbatch's
/// token rows to the ranks of their experts, or the combine of the experts' outputs back, in
/// a forward (`F`, `Fo`) or the same two for the gradients in an input-gradient pass (`I`).
/// Named `{stage}{DISPATCH|COMBINE}_{kind}{microbatch}_L{layer}` (`1DISPATCH_F3_L6`); PyTorch's
/// runtime has no action for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct AllToAll {
    /// The stage whose layer runs it.
    pub stage: StageId,
    /// The microbatch.
    pub microbatch: MicrobatchId,
    /// The pass it runs in: `F` or `Fo` (tokens out, outputs back) or `I` (their gradients).
    pub kind: ActionKind,
    /// Which exchange.
    pub exchange: Exchange,
    /// The layer's global index (0 the embedding).
    pub layer: u32,
}

/// Which exchange of a mixture-of-experts layer an [`AllToAll`] is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Exchange {
    /// Token rows (or, in `I`, output gradients) to the experts' ranks.
    Dispatch,
    /// Expert outputs (or, in `I`, input gradients) back to the tokens' ranks.
    Combine,
}

impl Exchange {
    /// The name in an action's text.
    pub fn name(self) -> &'static str {
        match self {
            Exchange::Dispatch => "DISPATCH",
            Exchange::Combine => "COMBINE",
        }
    }
}

impl fmt::Display for AllToAll {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}{}_{}{}_L{}",
            self.stage,
            self.exchange.name(),
            self.kind.letter(),
            self.microbatch,
            self.layer
        )
    }
}

impl FromStr for AllToAll {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        let bad = |reason: &str| Error::ParseAction {
            text: s.to_string(),
            reason: reason.into(),
        };
        let t = s.trim();
        let d = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
        let stage = t[..d]
            .parse()
            .map_err(|_| bad("must start with the stage number"))?;
        let rest = &t[d..];
        let (exchange, rest) = [Exchange::Dispatch, Exchange::Combine]
            .into_iter()
            .find_map(|e| rest.strip_prefix(e.name()).map(|r| (e, r)))
            .ok_or_else(|| bad("expected DISPATCH or COMBINE after the stage"))?;
        let rest = rest
            .strip_prefix('_')
            .ok_or_else(|| bad("expected `_` after DISPATCH or COMBINE"))?;
        let (pass, layer) = rest
            .split_once("_L")
            .ok_or_else(|| bad("expected `_L` and the layer at the end"))?;
        let layer = layer
            .parse()
            .map_err(|_| bad("the layer after `_L` must be a number"))?;
        let (kind, mb) = [
            (ActionKind::Fo, "Fo"),
            (ActionKind::F, "F"),
            (ActionKind::I, "I"),
        ]
        .into_iter()
        .find_map(|(k, l)| pass.strip_prefix(l).map(|r| (k, r)))
        .ok_or_else(|| bad("the pass must be F, Fo or I"))?;
        let microbatch = mb
            .parse()
            .map_err(|_| bad("expected the microbatch number after the pass"))?;
        Ok(AllToAll {
            stage: StageId(stage),
            microbatch: MicrobatchId(microbatch),
            kind,
            exchange,
            layer,
        })
    }
}

/// FSDP's per-stage actions in PyTorch 2.15's pipeline runtime
/// (`torch/distributed/pipelining/schedules.py`: `_ComputationType`, inserted by
/// `_add_unshard_reshard` and `_add_reduce_grad`). PyTorch's runtime records them (`PP:0UNSHARD`)
/// whether or not the stage is sharded; on an unsharded stage they do nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FsdpAction {
    /// `UNSHARD`: all-gather the stage's parameters before its compute.
    Unshard,
    /// `RESHARD`: free the gathered parameters (no communication).
    Reshard,
    /// `REDUCE_GRAD`: start the reduce-scatter of the stage's gradients after its last backward.
    ReduceGrad,
    /// `WAIT_REDUCE_GRAD`: the host waits for that reduction.
    WaitReduceGrad,
}

impl FsdpAction {
    /// Every action, in the order PyTorch's parser tries their names (longest first).
    pub const ALL: [FsdpAction; 4] = [
        FsdpAction::WaitReduceGrad,
        FsdpAction::ReduceGrad,
        FsdpAction::Unshard,
        FsdpAction::Reshard,
    ];

    /// PyTorch's name.
    pub fn name(self) -> &'static str {
        match self {
            FsdpAction::Unshard => "UNSHARD",
            FsdpAction::Reshard => "RESHARD",
            FsdpAction::ReduceGrad => "REDUCE_GRAD",
            FsdpAction::WaitReduceGrad => "WAIT_REDUCE_GRAD",
        }
    }
}

impl LoweredAction {
    /// The stage whose rank runs it (the first stage of an overlapped pair).
    pub fn stage(self) -> StageId {
        match self {
            LoweredAction::Compute(a) => a.parts().next().map_or(StageId(0), |c| c.stage),
            LoweredAction::Comm(c) => c.stage(),
            LoweredAction::WaitSend(t) => t.stage,
            LoweredAction::Fsdp(s, _) => s,
            LoweredAction::AllToAll(a) => a.stage,
        }
    }
}

impl fmt::Display for LoweredAction {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LoweredAction::Compute(a) => a.fmt(f),
            LoweredAction::Comm(c) => c.fmt(f),
            LoweredAction::WaitSend(t) => {
                write!(
                    f,
                    "{}WAIT_SEND_{}{}",
                    t.stage,
                    t.payload.suffix(),
                    t.microbatch
                )
            }
            LoweredAction::Fsdp(s, a) => write!(f, "{s}{}", a.name()),
            LoweredAction::AllToAll(a) => a.fmt(f),
        }
    }
}

impl FromStr for LoweredAction {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        let t = s.trim();
        let d = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
        if let Some(a) = FsdpAction::ALL.into_iter().find(|a| &t[d..] == a.name()) {
            let stage = t[..d].parse().map_err(|_| Error::ParseAction {
                text: s.to_string(),
                reason: "must start with the stage number".into(),
            })?;
            return Ok(LoweredAction::Fsdp(StageId(stage), a));
        }
        if t.contains("DISPATCH_") || t.contains("COMBINE_") {
            return Ok(LoweredAction::AllToAll(t.parse()?));
        }
        if let Some(i) = t.find("WAIT_") {
            // `0WAIT_SEND_F3` reads as the send it waits for, `0SEND_F3`.
            let send: CommAction = format!("{}{}", &t[..i], &t[i + "WAIT_".len()..]).parse()?;
            match send {
                CommAction::Send(tr) => Ok(LoweredAction::WaitSend(tr)),
                CommAction::Recv(_) => Err(Error::ParseAction {
                    text: s.to_string(),
                    reason: "only sends are waited for (WAIT_SEND_F, WAIT_SEND_B)".into(),
                }),
            }
        } else if t.contains("SEND_") || t.contains("RECV_") {
            Ok(LoweredAction::Comm(t.parse()?))
        } else {
            Ok(LoweredAction::Compute(t.parse()?))
        }
    }
}

/// How a rank's sends and receives are spread over communication streams. Within a stream,
/// operations run one at a time in posting order; a send and its receive run together once both
/// are posted (NCCL's point-to-point semantics).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum StreamLayout {
    /// One point-to-point stream per rank for every send and receive: PyTorch 2.15's pipeline
    /// stages on an eagerly initialised NCCL process group, whose one communicator carries all
    /// their traffic (`torch/distributed/pipelining/_p2p.py`, `_warn_if_eager_nccl`).
    Shared,
    /// One stream per peer rank for both directions: the two-rank communicators NCCL creates
    /// lazily per peer pair (PyTorch's `backend="nccl-lazy"`). A receive from a peer blocks a
    /// later send to it.
    PeerPair,
    /// One stream per directed rank edge: sends to rank q on one, receives from rank q on
    /// another (PyTorch 2.15's `torch.distributed.config.pipeline_per_edge_p2p`, on by default
    /// with TorchComms: "opposite directions and distinct rank pairs are isolated"). Nothing
    /// queues behind another link's traffic: the uncontended links of
    /// [`crate::replay::replay`].
    PerPeer,
}

impl StreamLayout {
    /// The stream `c` runs on under this layout, with stages placed by `placement`.
    pub fn stream_of(self, placement: &Placement, c: CommAction) -> StreamId {
        let t = c.transfer();
        let peer = match c {
            CommAction::Send(_) => placement.rank(t.to_stage()),
            CommAction::Recv(_) => placement.rank(t.stage),
        };
        match (self, c) {
            (StreamLayout::Shared, _) => StreamId::P2p,
            (StreamLayout::PeerPair, _) => StreamId::Peer(peer),
            (StreamLayout::PerPeer, CommAction::Send(_)) => StreamId::SendTo(peer),
            (StreamLayout::PerPeer, CommAction::Recv(_)) => StreamId::RecvFrom(peer),
        }
    }
}

/// A stream of one rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum StreamId {
    /// The compute stream.
    Compute,
    /// The shared point-to-point stream ([`StreamLayout::Shared`]).
    P2p,
    /// Sends to and receives from this rank ([`StreamLayout::PeerPair`]).
    Peer(Rank),
    /// Sends to this rank ([`StreamLayout::PerPeer`]).
    SendTo(Rank),
    /// Receives from this rank ([`StreamLayout::PerPeer`]).
    RecvFrom(Rank),
}

impl fmt::Display for StreamId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StreamId::Compute => f.write_str("compute"),
            StreamId::P2p => f.write_str("p2p"),
            StreamId::Peer(r) => write!(f, "p2p with {r}"),
            StreamId::SendTo(r) => write!(f, "send to {r}"),
            StreamId::RecvFrom(r) => write!(f, "recv from {r}"),
        }
    }
}

/// A schedule lowered to compute and communication: per rank, the program order in which the
/// rank posts its actions, and the streams they run on. A stream runs its actions in program
/// order; a compute action waits for the receive of its input.
#[derive(Debug, Clone, PartialEq)]
pub struct Lowered {
    /// The compute schedule (placement, microbatch counts, chunk chains, compute order).
    pub schedule: Schedule,
    /// `program[r]`: rank r's actions in posting order. Its compute actions are
    /// `schedule.ranks[r]` in order.
    pub program: Vec<Vec<LoweredAction>>,
    /// How the sends and receives are spread over streams.
    pub streams: StreamLayout,
}

impl Lowered {
    /// The stream `c`, posted by `rank`, runs on.
    pub fn stream_of(&self, c: CommAction) -> StreamId {
        self.streams.stream_of(&self.schedule.placement, c)
    }

    /// Number of send and receive actions.
    pub fn num_comm_actions(&self) -> usize {
        self.program
            .iter()
            .flatten()
            .filter(|a| matches!(a, LoweredAction::Comm(_)))
            .count()
    }

    /// Checks that the program holds the schedule's compute in order, and that every transfer
    /// between two ranks has exactly one send on the sending stage's rank and one receive on the
    /// receiving stage's rank (none for stages on one rank).
    ///
    /// # Errors
    /// [`Error::InvalidSchedule`] naming the rank and the action.
    pub fn validate(&self) -> Result<()> {
        let fail = |reason: String| {
            Err(Error::InvalidSchedule {
                schedule: self.schedule.name.clone(),
                reason,
            })
        };
        let s = &self.schedule;
        if self.program.len() != s.ranks.len() {
            return fail(format!(
                "{} lowered programs for {} ranks",
                self.program.len(),
                s.ranks.len()
            ));
        }
        let index = TransferIndex::of(s);
        // Per transfer: bit 0 its send posted, bit 1 its receive.
        let mut posted = vec![0u8; index.len()];
        let mut waits = vec![0u8; index.len()];
        for (r, prog) in self.program.iter().enumerate() {
            let mut compute = prog.iter().filter_map(|a| match a {
                LoweredAction::Compute(c) => Some(c),
                _ => None,
            });
            if !compute.by_ref().eq(s.ranks[r].iter()) {
                return fail(format!(
                    "rank {r}'s lowered program does not hold its compute actions in order"
                ));
            }
            check_send_waits(r, prog, &index, &mut waits).or_else(fail)?;
            for a in prog {
                if let LoweredAction::Fsdp(stage, _) = a
                    && (stage.0 >= s.num_stages() || s.placement.rank(*stage).idx() != r)
                {
                    return fail(format!("rank {r} posts {a}, whose stage is not on it"));
                }
                let LoweredAction::Comm(c) = a else { continue };
                let t = c.transfer();
                if !index.contains(t) {
                    return fail(format!(
                        "rank {r}: {c} names a stage or microbatch past the schedule"
                    ));
                }
                if s.placement.rank(c.stage()).idx() != r {
                    return fail(format!(
                        "rank {r} posts {c}, whose stage is on another rank"
                    ));
                }
                let bit = if matches!(c, CommAction::Send(_)) {
                    1
                } else {
                    2
                };
                let slot = &mut posted[index.get(t)];
                if *slot & bit != 0 {
                    return fail(format!("rank {r} posts {c} twice"));
                }
                *slot |= bit;
            }
        }
        for r in &s.ranks {
            for a in r.iter().flat_map(Action::parts) {
                let Some(t) = Transfer::of_producer(a, s.num_stages()) else {
                    continue;
                };
                let crosses = s.placement.rank(t.stage) != s.placement.rank(t.to_stage());
                let slot = &mut posted[index.get(t)];
                for (bit, half) in [(1, CommAction::Send(t)), (2, CommAction::Recv(t))] {
                    if crosses != (*slot & bit != 0) {
                        return fail(if crosses {
                            format!("{half} is missing: {a}'s output crosses ranks")
                        } else {
                            format!("{half} joins two stages on one rank")
                        });
                    }
                }
                *slot = 4;
            }
        }
        // Any half left without its producer's mark names a transfer no compute makes.
        for prog in &self.program {
            for a in prog {
                if let LoweredAction::Comm(c) = a
                    && posted[index.get(c.transfer())] != 4
                {
                    return fail(format!("{c} matches no compute action's output"));
                }
            }
        }
        Ok(())
    }
}

/// Rank `r`'s program waits for each of its sends exactly once, after posting it (PyTorch's
/// `_validate_send_waits`), or waits for none of them.
/// `state` is scratch of [`TransferIndex::len`] entries, all 0; the sends of `prog` are left
/// marked.
fn check_send_waits(
    r: usize,
    prog: &[LoweredAction],
    index: &TransferIndex,
    state: &mut [u8],
) -> std::result::Result<(), String> {
    if !prog.iter().any(|a| matches!(a, LoweredAction::WaitSend(_))) {
        return Ok(());
    }
    // Per transfer: 1 posted and not waited for, 2 waited for (each send is on one rank only,
    // so the marks of other ranks' sends never meet these).
    for a in prog {
        match a {
            LoweredAction::Comm(CommAction::Send(t)) if index.contains(*t) => {
                state[index.get(*t)] = 1;
            }
            LoweredAction::WaitSend(t) => {
                let send = CommAction::Send(*t);
                if !index.contains(*t) || state[index.get(*t)] != 1 {
                    return Err(format!(
                        "rank {r} waits for {send} before posting it, or twice"
                    ));
                }
                state[index.get(*t)] = 2;
            }
            _ => {}
        }
    }
    for a in prog {
        if let LoweredAction::Comm(CommAction::Send(t)) = a
            && index.contains(*t)
            && state[index.get(*t)] == 1
        {
            return Err(format!("rank {r} never waits for {}", CommAction::Send(*t)));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn all_to_all_names_round_trip_and_bad_ones_say_what_is_wrong() {
        let a = |stage, kind, exchange, microbatch, layer| AllToAll {
            stage: StageId(stage),
            microbatch: MicrobatchId(microbatch),
            kind,
            exchange,
            layer,
        };
        for (x, text) in [
            (
                a(1, ActionKind::F, Exchange::Dispatch, 3, 6),
                "1DISPATCH_F3_L6",
            ),
            (
                a(0, ActionKind::I, Exchange::Combine, 12, 1),
                "0COMBINE_I12_L1",
            ),
            (
                a(2, ActionKind::Fo, Exchange::Combine, 0, 4),
                "2COMBINE_Fo0_L4",
            ),
        ] {
            assert_eq!(x.to_string(), text);
            assert_eq!(
                text.parse::<LoweredAction>().unwrap(),
                LoweredAction::AllToAll(x)
            );
        }
        for (text, why) in [
            ("DISPATCH_F3_L6", "stage number"),
            ("1DISPATCH_W3_L6", "F, Fo or I"),
            ("1DISPATCH_F3", "`_L`"),
            ("1COMBINE_F3_Lx", "layer"),
            ("1DISPATCH_F_L2", "microbatch"),
        ] {
            let e = text.parse::<LoweredAction>().unwrap_err().to_string();
            assert!(e.contains(why) && e.contains(text), "{text}: {e}");
        }
    }

    #[test]
    fn pytorchs_names_round_trip_and_key_the_transfer_by_its_sender() {
        let f = Transfer {
            stage: StageId(0),
            microbatch: MicrobatchId(3),
            payload: Payload::Activation,
        };
        let b = Transfer {
            stage: StageId(2),
            microbatch: MicrobatchId(3),
            payload: Payload::Gradient,
        };
        for (c, text) in [
            (CommAction::Send(f), "0SEND_F3"),
            (CommAction::Recv(f), "1RECV_F3"),
            (CommAction::Send(b), "2SEND_B3"),
            (CommAction::Recv(b), "1RECV_B3"),
        ] {
            assert_eq!(c.to_string(), text);
            assert_eq!(text.parse::<CommAction>().unwrap(), c);
            assert_eq!(
                text.parse::<LoweredAction>().unwrap(),
                LoweredAction::Comm(c)
            );
        }
        for (text, a) in [
            ("0UNSHARD", FsdpAction::Unshard),
            ("3RESHARD", FsdpAction::Reshard),
            ("12REDUCE_GRAD", FsdpAction::ReduceGrad),
            ("1WAIT_REDUCE_GRAD", FsdpAction::WaitReduceGrad),
        ] {
            let parsed: LoweredAction = text.parse().unwrap();
            assert_eq!(parsed.to_string(), text);
            assert!(matches!(parsed, LoweredAction::Fsdp(_, x) if x == a));
        }
        assert!("UNSHARD".parse::<LoweredAction>().is_err());
        assert!("0RECV_F1".parse::<CommAction>().is_err());
        assert!("1SEND_X1".parse::<CommAction>().is_err());
        assert_eq!(
            "1F2".parse::<LoweredAction>().unwrap(),
            LoweredAction::Compute(Action::new(1, ActionKind::F, 2))
        );
    }
}
