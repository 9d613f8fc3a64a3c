//! The one interpreter (design point 6 in docs/design.md): every schedule, `pp = 1` included, runs
//! through [`run_step`].
//!
//! One worker thread per rank (and per data-parallel replica) walks its action list from the
//! schedule IR in order. An action starts as soon as its inputs are there: F of stage `s > 0`
//! waits for stage `s - 1`'s activations of that microbatch, I of a non-last stage for stage
//! `s + 1`'s gradient; nothing else synchronises the ranks. Transfers go through one channel per
//! receiving rank; messages that arrive before they are needed wait in the rank's mailbox, keyed
//! by (direction, stage, microbatch). A transfer between two stages on the same rank (V
//! placement) is a hand-off in that rank's mailbox.
//!
//! No shape handshake: every rank holds the step's microbatch plan (each microbatch's `T` and
//! `cu_seqlens`) before the step starts, so a receiver knows that microbatch k's activations are
//! `T_k x H`; a transfer of any other size is [`Error::TransferMismatch`], never truncated.
//!
//! Asynchronous backends (CUDA) plug in through three hooks of the worker: `prepare_step`
//! (uploads the step's data before the clock starts), `import` (the receiver copies a tensor from
//! another rank and times the copy), and a `DeviceClock` (actions are stamped with events on the
//! rank's stream and resolved to nanoseconds when the rank's last action has been enqueued;
//! losses left on the device are read then too). The host clock times the CPU backend.
//!
//! After the last action of every rank, the step ends with the data-parallel gradient all-reduce
//! (a sum over replicas of each pipeline rank's gradients), the global gradient norm over all
//! stages (what clipping needs), and the optimizer step on every rank in parallel.

use crate::data::MicrobatchData;
use crate::worker::{
    AdamW, AllToAllSpan, ComputeStream, LossSums, StageInput, StageOutput, StageWorker,
};
use crate::{Error, Result};
use flatpipe_simulator::ir::comm::{AllToAll, Exchange, LoweredAction};
use flatpipe_simulator::ir::{ActionKind, ComputeAction, MicrobatchId, Rank, Schedule, StageId};
use flatpipe_simulator::replay::metrics::AllToAllTime;
use flatpipe_simulator::replay::timeline::{TimedComm, TimedOp, TimedTransfer, Timeline};
use std::collections::HashMap;
use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Barrier};
use std::time::Instant;

/// One data-parallel replica's step: its schedule and its microbatches' data.
#[derive(Debug, Clone, Copy)]
pub struct Replica<'a> {
    /// The schedule (generated for this replica's microbatch count).
    pub schedule: &'a Schedule,
    /// Training microbatches `0..m`.
    pub microbatches: &'a [MicrobatchData],
    /// Forward-only microbatches `0..m_fo` (evaluation, reference or teacher forwards).
    pub fo_microbatches: &'a [MicrobatchData],
    /// Training microbatch i's loss (the last stage's F) waits for forward-only microbatch i's
    /// last-stage result.
    pub fo_feeds_loss: bool,
}

/// What the step does after the pipeline.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct StepOptions {
    /// Run AdamW with this configuration as step number `t >= 1`; `None`: keep the gradients.
    pub optimizer: Option<(AdamW, u64)>,
    /// Clip the global gradient norm to this value.
    pub max_grad_norm: Option<f64>,
    /// Expert parallelism: replicas `[g ep, (g + 1) ep)` form an expert-parallel group whose
    /// stages split the routed experts ([`crate::model::experts::ExpertLink`]); 0 or 1: none.
    pub ep: usize,
    /// A test hook: one rank computing slower than the others ([`Slowdown`]); `None`: none.
    pub slowdown: Option<Slowdown>,
}

/// A test hook that makes one rank slow, as a straggler (thermal throttling, a noisy neighbour)
/// would: after each compute action of rank `rank` (`d * pp + r`, replica-major), the rank
/// thread sleeps `(factor - 1)` times the action's compute time, so its actions take `factor`
/// times as long. Not part of any public step signature: `flatpipe execute --slow-rank` and the
/// re-planning tests set it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Slowdown {
    /// The slowed rank, `d * pp + r`.
    pub rank: usize,
    /// How much slower its compute runs, >= 1.
    pub factor: f64,
    /// The first step id it applies to (earlier steps run at full speed).
    pub from_step: u64,
}

/// What one step measured and computed.
#[derive(Debug, Clone)]
pub struct StepRun {
    /// Measured timeline of every rank (`dp * pp` rows, replica-major: rank `d * pp + r`),
    /// nanoseconds from the first action's start.
    pub timeline: Timeline,
    /// The step's loss: `Σ weight_t loss_t` over all training microbatches of all replicas.
    pub loss: f64,
    /// Loss sums of the training microbatches, per replica in microbatch order.
    pub microbatch_losses: Vec<Vec<LossSums>>,
    /// Loss sums of the forward-only microbatches, per replica.
    pub fo_losses: Vec<Vec<LossSums>>,
    /// Global gradient L2 norm over every stage (after the all-reduce, before clipping).
    pub grad_norm: f64,
    /// `all_to_all[g]`: rank g's expert-parallel all-to-alls, as `(stage, span)` with the
    /// span's start and end in nanoseconds from the timeline's origin; empty without experts.
    pub all_to_all: Vec<Vec<MeasuredAllToAll>>,
    /// `exposed_all_to_all_ns[g]`: the time rank g's actions waited on all-to-alls while none
    /// of their parts computed (an overlapped pair hides one half's all-to-all under the other
    /// half's compute), nanoseconds.
    pub exposed_all_to_all_ns: Vec<u64>,
}

impl StepRun {
    /// The measured expert-parallel all-to-all time of the rank with the most exposed, as
    /// [`flatpipe_simulator::replay::metrics::Metrics::all_to_all`] reports the predicted one:
    /// `total_s` the exchanges themselves summed (each from the group's last member entering
    /// it to its last receive), `exposed_s` the part of them during which none of the action's
    /// parts computed. `None` without expert parallelism.
    pub fn all_to_all_time(&self) -> Option<AllToAllTime> {
        self.all_to_all
            .iter()
            .zip(&self.exposed_all_to_all_ns)
            .filter(|(spans, _)| !spans.is_empty())
            .map(|(spans, &exposed)| AllToAllTime {
                total_s: spans.iter().map(|a| a.end_ns - a.ready_ns).sum::<u64>() as f64 * 1e-9,
                exposed_s: exposed as f64 * 1e-9,
            })
            .max_by(|a, b| a.exposed_s.total_cmp(&b.exposed_s))
    }

    /// The most time a rank's all-to-alls waited for a slower member of their group to enter
    /// them (each from its first send to the last member's), seconds; `None` without expert
    /// parallelism. The simulator prices this wait as the group's costliest microbatch
    /// ([`flatpipe_simulator::run::step::StepPlan::expert_coupled`]).
    pub fn all_to_all_wait_s(&self) -> Option<f64> {
        self.all_to_all
            .iter()
            .filter(|spans| !spans.is_empty())
            .map(|spans| spans.iter().map(|a| a.ready_ns - a.start_ns).sum::<u64>() as f64 * 1e-9)
            .max_by(f64::total_cmp)
    }
}

/// One expert-parallel all-to-all as its rank measured it (host clock).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MeasuredAllToAll {
    /// The stage whose layer ran it.
    pub stage: u32,
    /// Global layer index.
    pub layer: usize,
    /// Microbatch.
    pub microbatch: u32,
    /// Of a forward-only microbatch.
    pub forward_only: bool,
    /// Which exchange.
    pub phase: crate::worker::Phase,
    /// Values sent to other ranks.
    pub values_sent: usize,
    /// From its first send, ns.
    pub start_ns: u64,
    /// When the group's last member entered it (the wait for a slower partner ends), ns.
    pub ready_ns: u64,
    /// To its last receive, ns.
    pub end_ns: u64,
}

/// Which way a message goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Dir {
    /// Activations of F into stage `s`.
    Forward,
    /// Gradient of I / B into stage `s`.
    Backward,
    /// Activations of Fo into stage `s`.
    ForwardOnly,
}

impl Dir {
    fn what(self) -> &'static str {
        match self {
            Dir::Backward => "the gradient",
            _ => "the activations",
        }
    }
}

type Key = (Dir, u32, u32);

/// A tensor in flight: the sending rank and action, and the tensor.
struct Sent<H> {
    from: u32,
    action: ComputeAction,
    h: H,
}

enum Msg<H> {
    Data(Key, Sent<H>),
    Abort,
}

/// A rank's incoming messages: the channel and what arrived before it was needed.
struct Mailbox<H> {
    rank: u32,
    rx: Receiver<Msg<H>>,
    early: HashMap<Key, Sent<H>>,
}

impl<H> Mailbox<H> {
    fn take(&mut self, key: Key) -> Result<Sent<H>> {
        if let Some(h) = self.early.remove(&key) {
            return Ok(h);
        }
        loop {
            match self.rx.recv() {
                Ok(Msg::Data(k, h)) if k == key => return Ok(h),
                Ok(Msg::Data(k, h)) => {
                    self.early.insert(k, h);
                }
                Ok(Msg::Abort) => return Err(Error::Aborted(self.rank)),
                Err(_) => {
                    return Err(Error::NeverSent {
                        rank: self.rank,
                        what: key.0.what(),
                        stage: key.1,
                        microbatch: key.2,
                    });
                }
            }
        }
    }
}

#[derive(Default)]
struct RankOut {
    ops: Vec<TimedOp>,
    transfers: Vec<TimedTransfer>,
    losses: Vec<(u32, LossSums)>,
    fo_losses: Vec<(u32, LossSums)>,
    all_to_all: Vec<MeasuredAllToAll>,
    exposed_all_to_all_ns: u64,
}

struct RankCtx<'a, W: StageWorker> {
    global: u32,
    first_rank: u32,
    schedule: &'a Schedule,
    replica: Replica<'a>,
    stages: &'a mut [(u32, W)],
    index: HashMap<u32, usize>,
    mailbox: Mailbox<W::Hidden>,
    peers: Vec<Option<Sender<Msg<W::Hidden>>>>,
    t0: Instant,
    /// Actions are timed with the first stage's device clock (timestamps are stamp indices
    /// until the end of the rank's run).
    device: bool,
    /// The [`Slowdown`] factor of this rank (1: full speed).
    slow: f64,
    out: RankOut,
}

impl<'a, W: StageWorker> RankCtx<'a, W> {
    /// The time now: host nanoseconds since `t0`, or the index of a stamp recorded on the rank's
    /// stream when the backend runs asynchronously.
    fn clock(&mut self) -> Result<u64> {
        if self.device
            && let Some(c) = self.stages.first_mut().and_then(|(_, w)| w.device_clock())
        {
            return Ok(c.stamp()? as u64);
        }
        Ok(self.t0.elapsed().as_nanos() as u64)
    }

    fn data(&self, a: &ComputeAction) -> Result<&'a MicrobatchData> {
        let (list, what): (&'a [MicrobatchData], _) = if a.kind == ActionKind::Fo {
            (self.replica.fo_microbatches, "forward-only microbatches")
        } else {
            (self.replica.microbatches, "microbatches")
        };
        list.get(a.microbatch.idx()).ok_or_else(|| {
            Error::Invalid(format!(
                "action {a} on rank {}: the step has {} {what}",
                self.global,
                list.len()
            ))
        })
    }

    fn recv(&mut self, dir: Dir, a: &ComputeAction) -> Result<W::Hidden> {
        let Sent { from, action, h } = self.mailbox.take((dir, a.stage.0, a.microbatch.0))?;
        let tokens = self.data(a)?.tokens();
        let hidden = self.stage(a.stage.0)?.hidden_size();
        let got = W::hidden_len(&h);
        if got != tokens * hidden {
            return Err(Error::TransferMismatch {
                rank: self.global,
                what: dir.what(),
                stage: a.stage.0,
                microbatch: a.microbatch.0,
                got,
                tokens,
                hidden,
                expected: tokens * hidden,
            });
        }
        if from == self.global {
            // A hand-off between two stages of this rank (V placement): no transfer.
            return Ok(h);
        }
        let (h, stamps) = self.stage(a.stage.0)?.import(h)?;
        if let Some((start, end)) = stamps {
            // The copy timed on this rank's device clock (the sender recorded nothing).
            self.out.transfers.push(TimedTransfer {
                from: Rank(from),
                to: Rank(self.global),
                stage: action.stage,
                microbatch: action.microbatch,
                kind: action.kind,
                start_ns: start as u64,
                end_ns: end as u64,
            });
        }
        Ok(h)
    }

    fn send(&mut self, dir: Dir, from: &ComputeAction, to_stage: u32, h: W::Hidden) -> Result<()> {
        let to = self.schedule.placement.rank_of[to_stage as usize].0 + self.first_rank;
        let key = (dir, to_stage, from.microbatch.0);
        let sent = Sent {
            from: self.global,
            action: *from,
            h,
        };
        if to == self.global {
            self.mailbox.early.insert(key, sent);
            return Ok(());
        }
        if !self.device {
            // Host clock: the hand-off itself (the receiver times a device copy instead).
            let t = self.clock()?;
            self.out.transfers.push(TimedTransfer {
                from: Rank(self.global),
                to: Rank(to),
                stage: from.stage,
                microbatch: from.microbatch,
                kind: from.kind,
                start_ns: t,
                end_ns: t,
            });
        }
        let peer = self.peers[to as usize]
            .as_ref()
            .ok_or_else(|| Error::Invalid(format!("rank {to} is not a peer")))?;
        peer.send(Msg::Data(key, sent))
            .map_err(|_| Error::Aborted(self.global))
    }

    fn stage(&mut self, s: u32) -> Result<&mut W> {
        let i = *self.index.get(&s).ok_or_else(|| {
            Error::Invalid(format!(
                "rank {} runs an action of stage {s}, which it does not hold",
                self.global
            ))
        })?;
        Ok(&mut self.stages[i].1)
    }

    /// Gets the inputs of one compute action (blocking on receives).
    fn inputs(&mut self, a: &ComputeAction) -> Result<Option<W::Hidden>> {
        if a.receives(self.schedule.num_stages()).is_none() {
            return Ok(None);
        }
        let dir = match a.kind {
            ActionKind::F => Dir::Forward,
            ActionKind::Fo => Dir::ForwardOnly,
            _ => Dir::Backward,
        };
        Ok(Some(self.recv(dir, a)?))
    }

    /// Refuses a loss that needs a forward-only result not yet computed.
    fn precheck(&self, a: &ComputeAction) -> Result<()> {
        let last = self.schedule.num_stages() - 1;
        let mb = a.microbatch.0;
        if a.kind == ActionKind::F
            && a.stage.0 == last
            && self.replica.fo_feeds_loss
            && !self.out.fo_losses.iter().any(|(k, _)| *k == mb)
        {
            return Err(Error::Invalid(format!(
                "rank {}: {a} computes microbatch {mb}'s loss, which needs forward-only microbatch {mb}'s result ({last}Fo{mb}), not yet run",
                self.global
            )));
        }
        Ok(())
    }

    /// Runs one compute action on its inputs and sends its output.
    fn compute(&mut self, a: &ComputeAction, input: Option<W::Hidden>) -> Result<()> {
        self.precheck(a)?;
        let data = self.data(a)?;
        let t = Instant::now();
        let out = work(self.stage(a.stage.0)?, a, data, input)?;
        if self.slow > 1.0 {
            std::thread::sleep(t.elapsed().mul_f64(self.slow - 1.0));
        }
        self.deliver(a, out)
    }

    /// Runs an overlapped pair whose stages exchange tokens with an expert-parallel group:
    /// each half on its own thread, sharing one [`ComputeStream`] that a half holds while it
    /// computes and lets go while it waits on an all-to-all, so one half's dispatch and combine
    /// are on the wire while the other half computes (DualPipe; Megatron-LM's combined 1F1B),
    /// and the rank never computes two things at once. Returns each half's `(start, end)`.
    ///
    /// # Errors
    /// Either half's error (the other half is stopped through the expert-parallel links).
    fn compute_overlapped(
        &mut self,
        parts: &[ComputeAction],
        inputs: Vec<Option<W::Hidden>>,
    ) -> Result<[(Instant, Instant); 2]> {
        let (a0, a1) = (parts[0], parts[1]);
        self.precheck(&a0)?;
        self.precheck(&a1)?;
        let (d0, d1) = (self.data(&a0)?, self.data(&a1)?);
        let index = |s: u32| {
            self.index.get(&s).copied().ok_or_else(|| {
                Error::Invalid(format!(
                    "rank {} runs an action of stage {s}, which it does not hold",
                    self.global
                ))
            })
        };
        let (i0, i1) = (index(a0.stage.0)?, index(a1.stage.0)?);
        let (w0, w1) = two_mut(self.stages, i0, i1);
        let stream = Arc::new(ComputeStream::default());
        w0.1.set_compute_stream(Some(Arc::clone(&stream)));
        w1.1.set_compute_stream(Some(Arc::clone(&stream)));
        let mut inputs = inputs.into_iter();
        let (in0, in1) = (inputs.next().flatten(), inputs.next().flatten());
        let half = |w: &mut W, a: &ComputeAction, d, input| {
            let t = Instant::now();
            stream.acquire();
            let out = work(w, a, d, input);
            stream.release();
            if out.is_err() {
                w.abort_step();
            }
            (out, t, Instant::now())
        };
        let (r0, r1) = std::thread::scope(|scope| {
            let other = scope.spawn(|| half(&mut w1.1, &a1, d1, in1));
            let r0 = half(&mut w0.1, &a0, d0, in0);
            let t = r0.1;
            let r1 = other.join().unwrap_or_else(|_| {
                (
                    Err(Error::Invalid(
                        "an overlapped half's thread panicked".into(),
                    )),
                    t,
                    t,
                )
            });
            (r0, r1)
        });
        w0.1.set_compute_stream(None);
        w1.1.set_compute_stream(None);
        let (o0, s0, e0) = r0;
        let (o1, s1, e1) = r1;
        let (o0, o1) = match (o0, o1) {
            (Ok(a), Ok(b)) => (a, b),
            (Err(e), _) | (_, Err(e)) => return Err(e),
        };
        self.deliver(&a0, o0)?;
        self.deliver(&a1, o1)?;
        Ok([(s0, e0), (s1, e1)])
    }

    /// Whether a part's stage exchanges tokens with an expert-parallel group.
    fn exchanges(&mut self, parts: &[ComputeAction]) -> bool {
        parts
            .iter()
            .any(|a| self.stage(a.stage.0).is_ok_and(|w| w.exchanges_tokens()))
    }

    /// Sends a computed action's output on, or keeps its loss.
    fn deliver(&mut self, a: &ComputeAction, out: Worked<W::Hidden>) -> Result<()> {
        let last = self.schedule.num_stages() - 1;
        let (s, mb) = (a.stage.0, a.microbatch.0);
        let to = a.sends(self.schedule.num_stages());
        match out {
            Worked::Forward(out) => {
                let keep = a.kind == ActionKind::F;
                match (out, to) {
                    (StageOutput::Hidden(h), Some(to)) => {
                        let dir = if keep { Dir::Forward } else { Dir::ForwardOnly };
                        self.send(dir, a, to.0, h)?;
                    }
                    (StageOutput::Loss(l), None) => {
                        if keep {
                            self.out.losses.push((mb, l));
                        } else {
                            self.out.fo_losses.push((mb, l));
                        }
                    }
                    // Filled in by `take_losses` at the end of the rank's run.
                    (StageOutput::LossPending, None) => {
                        if keep {
                            self.out.losses.push((mb, LossSums::default()));
                        } else {
                            self.out.fo_losses.push((mb, LossSums::default()));
                        }
                    }
                    _ => {
                        return Err(Error::Invalid(format!(
                            "stage {s}: only the last stage ({last}) may end in the loss"
                        )));
                    }
                }
            }
            Worked::Backward(dx) => {
                if let Some(to) = to {
                    let dx = dx.ok_or_else(|| {
                        Error::Invalid(format!("stage {s} produced no input gradient"))
                    })?;
                    self.send(Dir::Backward, a, to.0, dx)?;
                }
            }
            Worked::Weight => {}
        }
        Ok(())
    }

    /// Moves the all-to-alls that `parts` ran (from their stages' links) to the rank's output,
    /// and adds the time the action waited on them with no part computing to its exposed
    /// all-to-all time. `windows`: each part's `(start, end)`.
    fn note_all_to_alls(&mut self, parts: &[ComputeAction], windows: &[(Instant, Instant)]) {
        let t0 = self.t0;
        let ns = |i: Instant| i.saturating_duration_since(t0).as_nanos() as u64;
        let mut per_part = Vec::with_capacity(parts.len());
        for a in parts {
            let spans = match self.stage(a.stage.0) {
                Ok(w) => w.take_all_to_alls(),
                Err(_) => Vec::new(),
            };
            per_part.push(spans);
        }
        self.out.exposed_all_to_all_ns += exposed_ns(windows, &per_part);
        for (a, spans) in parts.iter().zip(per_part) {
            for x in spans {
                self.out.all_to_all.push(MeasuredAllToAll {
                    stage: a.stage.0,
                    layer: x.layer,
                    microbatch: x.microbatch,
                    forward_only: x.forward_only,
                    phase: x.phase,
                    values_sent: x.values_sent,
                    start_ns: ns(x.start),
                    ready_ns: ns(x.ready),
                    end_ns: ns(x.end),
                });
            }
        }
    }

    fn run(&mut self, r: usize) -> Result<()> {
        let (train, fo) = (self.replica.microbatches, self.replica.fo_microbatches);
        for (_, w) in self.stages.iter_mut() {
            w.prepare_step(train, fo)?;
        }
        if let Some(c) = self.stages.first_mut().and_then(|(_, w)| w.device_clock()) {
            c.start()?;
            self.device = true;
        }
        let actions = &self.schedule.ranks[r];
        for action in actions {
            let parts: Vec<ComputeAction> = action.parts().collect();
            let mut inputs = Vec::with_capacity(parts.len());
            for a in &parts {
                inputs.push(self.inputs(a)?);
            }
            let start = self.clock()?;
            let overlap = parts.len() == 2
                && parts[0].stage != parts[1].stage
                && !self.device
                && self.exchanges(&parts);
            let windows = if overlap {
                self.compute_overlapped(&parts, inputs)?.to_vec()
            } else {
                let mut w = Vec::with_capacity(parts.len());
                for (a, input) in parts.iter().zip(inputs) {
                    let t = Instant::now();
                    self.compute(a, input)?;
                    w.push((t, Instant::now()));
                }
                w
            };
            let end = self.clock()?;
            self.note_all_to_alls(&parts, &windows);
            self.out.ops.push(TimedOp {
                action: *action,
                start_ns: start,
                end_ns: end,
            });
        }
        self.finish()
    }

    /// Resolves device timestamps and losses left on the device, once the rank's actions are
    /// all enqueued.
    fn finish(&mut self) -> Result<()> {
        if self.device
            && let Some(c) = self.stages.first_mut().and_then(|(_, w)| w.device_clock())
        {
            let times = c.finish(self.t0)?;
            let at = |i: u64| {
                times
                    .get(i as usize)
                    .copied()
                    .ok_or_else(|| Error::Invalid(format!("the device clock lost timestamp {i}")))
            };
            for op in &mut self.out.ops {
                op.start_ns = at(op.start_ns)?;
                op.end_ns = at(op.end_ns)?;
            }
            for tr in &mut self.out.transfers {
                tr.start_ns = at(tr.start_ns)?;
                tr.end_ns = at(tr.end_ns)?;
            }
        }
        for (_, w) in self.stages.iter_mut() {
            for (mb, fo, l) in w.take_losses()? {
                let list = if fo {
                    &mut self.out.fo_losses
                } else {
                    &mut self.out.losses
                };
                if let Some(e) = list.iter_mut().find(|(k, _)| *k == mb) {
                    e.1 = l;
                }
            }
        }
        Ok(())
    }
}

/// What a worker computed for one action, before it is sent on.
enum Worked<H> {
    Forward(StageOutput<H>),
    Backward(Option<H>),
    Weight,
}

/// Runs one compute action on its stage's worker.
fn work<W: StageWorker>(
    w: &mut W,
    a: &ComputeAction,
    data: &MicrobatchData,
    input: Option<W::Hidden>,
) -> Result<Worked<W::Hidden>> {
    let mb = a.microbatch.0;
    Ok(match a.kind {
        ActionKind::F | ActionKind::Fo => {
            let input = match input {
                Some(h) => StageInput::Hidden(h),
                None => StageInput::Tokens,
            };
            Worked::Forward(w.forward(mb, data, input, a.kind == ActionKind::F)?)
        }
        ActionKind::I | ActionKind::B => {
            let dx = w.backward_input(mb, data, input)?;
            if a.kind == ActionKind::B {
                w.backward_weight(mb, data)?;
            }
            Worked::Backward(dx)
        }
        ActionKind::W => {
            w.backward_weight(mb, data)?;
            Worked::Weight
        }
    })
}

/// Two distinct elements of a slice, mutably.
fn two_mut<T>(v: &mut [T], i: usize, j: usize) -> (&mut T, &mut T) {
    if i < j {
        let (a, b) = v.split_at_mut(j);
        (&mut a[i], &mut b[0])
    } else {
        let (a, b) = v.split_at_mut(i);
        (&mut b[0], &mut a[j])
    }
}

/// The time an action's all-to-alls ran while none of its parts computed: the union of the
/// parts' exchanges (each from the group's last member entering it to its end), less the
/// instants where some part was inside its window and not in one of its own all-to-alls
/// (waiting for a partner included). `windows[p]`: part p's `(start, end)`; `spans[p]`: its
/// all-to-alls.
fn exposed_ns(windows: &[(Instant, Instant)], spans: &[Vec<AllToAllSpan>]) -> u64 {
    let Some(origin) = windows.iter().map(|w| w.0).min() else {
        return 0;
    };
    let ns = |i: Instant| i.saturating_duration_since(origin).as_nanos() as u64;
    // Elementary intervals between every boundary.
    let mut cuts: Vec<u64> = windows.iter().flat_map(|w| [ns(w.0), ns(w.1)]).collect();
    cuts.extend(
        spans
            .iter()
            .flatten()
            .flat_map(|s| [ns(s.start), ns(s.ready), ns(s.end)]),
    );
    cuts.sort_unstable();
    cuts.dedup();
    let inside = |t: u64, a: Instant, b: Instant| ns(a) <= t && t < ns(b);
    let mut exposed = 0;
    for w in cuts.windows(2) {
        let mid = w[0]; // the interval [w0, w1) is uniform; test its start
        let waiting = spans.iter().flatten().any(|s| inside(mid, s.ready, s.end));
        let computing = windows.iter().zip(spans).any(|((a, b), sp)| {
            inside(mid, *a, *b) && !sp.iter().any(|s| inside(mid, s.start, s.end))
        });
        if waiting && !computing {
            exposed += w[1] - w[0];
        }
    }
    exposed
}

/// Runs one step of every replica on `ranks` (`ranks[d * pp + r]`: the stages of replica d's
/// pipeline rank r, as `(global stage id, worker)`).
///
/// The steps, in order: check that ranks, stages and schedules fit (`check_fit`); zero the
/// gradients; run every rank's action list on its own thread (`run_pipelines`); the
/// data-parallel all-reduce (`all_reduce_grads`); the global gradient norm
/// (`global_grad_norm`); the optimizer on every rank (`optimizer_steps`); the timeline and
/// losses from the first action's start (`collect_step`).
///
/// # Errors
/// [`Error::Invalid`] when the ranks, stages and schedules do not fit together;
/// [`Error::TransferMismatch`] / [`Error::NeverSent`] from the transfers; any backend error.
/// The first failing rank's error is returned; the other ranks stop.
pub fn run_step<W: StageWorker>(
    ranks: &mut [Vec<(u32, W)>],
    replicas: &[Replica<'_>],
    opts: &StepOptions,
) -> Result<StepRun> {
    let pp = check_fit(ranks, replicas)?;
    let dp = replicas.len();
    for rank in ranks.iter_mut() {
        for (_, w) in rank.iter_mut() {
            w.zero_grads()?;
        }
    }
    let t0 = Instant::now();
    let ep = opts.ep.max(1);
    if dp % ep != 0 {
        return Err(Error::Invalid(format!(
            "expert parallelism ep = {ep} must divide the {dp} data-parallel replicas"
        )));
    }
    check_expert_partners(replicas, ep)?;
    let outs = run_pipelines(ranks, replicas, pp, t0, opts.slowdown)?;
    let opt_start = t0.elapsed().as_nanos() as u64;
    all_reduce_grads(ranks, dp, pp, ep)?;
    let grad_norm = global_grad_norm(&mut ranks[..pp * ep], pp)?;
    let optimizer = match opts.optimizer {
        Some((adamw, t)) => {
            let scale = match opts.max_grad_norm {
                Some(c) if grad_norm > c => (c / (grad_norm + 1e-6)) as f32,
                _ => 1.0,
            };
            optimizer_steps(ranks, &adamw, t, scale, t0)?
                .into_iter()
                .map(|(a, b)| Some((a.min(opt_start), b)))
                .collect()
        }
        None => vec![None; ranks.len()],
    };
    Ok(collect_step(outs, optimizer, dp, pp, opt_start, grad_norm))
}

/// Checks that `ranks` (`dp * pp` of them, replica-major) hold the stages each replica's
/// schedule places on them, that the replicas' schedules place stages alike and are valid, and
/// that each schedule is for its replica's microbatch counts. Returns `pp`.
///
/// # Errors
/// [`Error::Invalid`] naming the replica or rank that does not fit; the schedule's validation
/// error.
fn check_fit<W>(ranks: &[Vec<(u32, W)>], replicas: &[Replica<'_>]) -> Result<usize> {
    let dp = replicas.len();
    let first = replicas
        .first()
        .ok_or_else(|| Error::Invalid("a step needs at least one replica".into()))?;
    let pp = first.schedule.placement.num_ranks as usize;
    if ranks.len() != dp * pp {
        return Err(Error::Invalid(format!(
            "{} ranks given for dp = {dp} x pp = {pp}",
            ranks.len()
        )));
    }
    for (d, rep) in replicas.iter().enumerate() {
        let s = rep.schedule;
        if s.placement.rank_of != first.schedule.placement.rank_of {
            return Err(Error::Invalid(format!(
                "replica {d}'s schedule places stages differently from replica 0's"
            )));
        }
        if s.num_microbatches as usize != rep.microbatches.len()
            || s.num_fo_microbatches as usize != rep.fo_microbatches.len()
        {
            return Err(Error::Invalid(format!(
                "replica {d}: the schedule `{}` is for {} microbatches (+{} forward-only), the step has {} (+{})",
                s.name,
                s.num_microbatches,
                s.num_fo_microbatches,
                rep.microbatches.len(),
                rep.fo_microbatches.len()
            )));
        }
        s.validate()?;
        for r in 0..pp {
            let mut want: Vec<u32> = s
                .placement
                .stages_of(Rank(r as u32))
                .iter()
                .map(|x| x.0)
                .collect();
            let mut have: Vec<u32> = ranks[d * pp + r].iter().map(|x| x.0).collect();
            want.sort_unstable();
            have.sort_unstable();
            if want != have {
                return Err(Error::Invalid(format!(
                    "rank {} holds stages {have:?}, the placement gives it {want:?}",
                    d * pp + r
                )));
            }
        }
    }
    Ok(pp)
}

/// Runs every rank's action list on its own thread (rank `g` is replica `g / pp`'s pipeline
/// rank `g % pp`), all starting together after a barrier; times are nanoseconds since `t0` (or
/// resolved device stamps). Returns each rank's output in rank order.
///
/// # Errors
/// The first failing rank's error (the others are told to stop and their
/// [`Error::Aborted`] is dropped); [`Error::Invalid`] for a rank thread that panicked.
fn run_pipelines<W: StageWorker>(
    ranks: &mut [Vec<(u32, W)>],
    replicas: &[Replica<'_>],
    pp: usize,
    t0: Instant,
    slowdown: Option<Slowdown>,
) -> Result<Vec<RankOut>> {
    let n = ranks.len();
    let (txs, rxs): (Vec<_>, Vec<_>) = (0..n).map(|_| channel::<Msg<W::Hidden>>()).unzip();
    let barrier = Arc::new(Barrier::new(n));
    let results: Vec<Result<RankOut>> = std::thread::scope(|scope| {
        let mut handles = Vec::with_capacity(n);
        for ((g, stages), rx) in ranks.iter_mut().enumerate().zip(rxs) {
            let (d, r) = (g / pp, g % pp);
            let replica = replicas[d];
            let peers: Vec<Option<Sender<Msg<W::Hidden>>>> = txs
                .iter()
                .enumerate()
                .map(|(i, t)| (i != g).then(|| t.clone()))
                .collect();
            let barrier = Arc::clone(&barrier);
            handles.push(scope.spawn(move || {
                let index = stages
                    .iter()
                    .enumerate()
                    .map(|(i, (s, _))| (*s, i))
                    .collect();
                let mut ctx = RankCtx {
                    global: g as u32,
                    first_rank: (d * pp) as u32,
                    schedule: replica.schedule,
                    replica,
                    stages: stages.as_mut_slice(),
                    index,
                    mailbox: Mailbox {
                        rank: g as u32,
                        rx,
                        early: HashMap::new(),
                    },
                    peers,
                    t0,
                    device: false,
                    slow: slowdown
                        .filter(|s| s.rank == g)
                        .map_or(1.0, |s| s.factor.max(1.0)),
                    out: RankOut::default(),
                };
                barrier.wait();
                let res = ctx.run(r);
                if res.is_err() {
                    for p in ctx.peers.iter().flatten() {
                        let _ = p.send(Msg::Abort);
                    }
                    for (_, w) in ctx.stages.iter() {
                        w.abort_step();
                    }
                }
                res.map(|()| ctx.out)
            }));
        }
        drop(txs);
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(Error::Invalid("a rank's thread panicked".into())))
            })
            .collect()
    });
    let mut outs = Vec::with_capacity(n);
    let mut first_err = None;
    for res in results {
        match res {
            Ok(o) => outs.push(o),
            Err(Error::Aborted(_)) => {}
            Err(e) => {
                first_err.get_or_insert(e);
            }
        }
    }
    if let Some(e) = first_err {
        return Err(e);
    }
    if outs.len() != n {
        return Err(Error::Invalid("ranks stopped without an error".into()));
    }
    Ok(outs)
}

/// The data-parallel all-reduce of the gradients: for each pipeline rank r, the first
/// replica of a group sums its peers' gradients (parameter by parameter, in each worker's
/// visiting order), then every replica of the group takes the sum. The routed experts' over
/// their expert-data-parallel group (replicas `d` with the same `d mod ep`, holding the same
/// experts), every other gradient over all replicas (DeepSpeed-MoE and Megatron-LM reduce them
/// so). Nothing to do for `dp = 1`.
///
/// # Errors
/// A worker's [`StageWorker::visit_grads`] / [`StageWorker::visit_expert_grads`] error.
fn all_reduce_grads<W: StageWorker>(
    ranks: &mut [Vec<(u32, W)>],
    dp: usize,
    pp: usize,
    ep: usize,
) -> Result<()> {
    for r in 0..pp {
        let all: Vec<usize> = (0..dp).map(|d| d * pp + r).collect();
        sum_over(ranks, &all, false)?;
        for e in 0..ep {
            let group: Vec<usize> = (e..dp).step_by(ep).map(|d| d * pp + r).collect();
            sum_over(ranks, &group, true)?;
        }
    }
    Ok(())
}

/// Sums the gradients of `group` (rank indices) and gives every member the sum: the routed
/// experts' (`experts`) or every other.
fn sum_over<W: StageWorker>(
    ranks: &mut [Vec<(u32, W)>],
    group: &[usize],
    experts: bool,
) -> Result<()> {
    if group.len() <= 1 {
        return Ok(());
    }
    let visit = |w: &mut W, f: &mut dyn FnMut(&mut [f32])| {
        if experts {
            w.visit_expert_grads(f)
        } else {
            w.visit_grads(f)
        }
    };
    let mut sum: Vec<Vec<f32>> = Vec::new();
    for (i, &g) in group.iter().enumerate() {
        let mut k = 0;
        for (_, w) in ranks[g].iter_mut() {
            visit(w, &mut |buf| {
                if i == 0 {
                    sum.push(buf.to_vec());
                } else if let Some(s) = sum.get_mut(k) {
                    for (a, b) in s.iter_mut().zip(buf.iter()) {
                        *a += *b;
                    }
                }
                k += 1;
            })?;
        }
    }
    for &g in group {
        let mut k = 0;
        for (_, w) in ranks[g].iter_mut() {
            visit(w, &mut |buf| {
                if let Some(s) = sum.get(k).filter(|s| s.len() == buf.len()) {
                    buf.copy_from_slice(s);
                }
                k += 1;
            })?;
        }
    }
    Ok(())
}

/// The replicas of an expert-parallel group run the same schedule for the same microbatch
/// counts: every all-to-all of microbatch k pairs the group's k-th microbatches.
///
/// # Errors
/// [`Error::Invalid`] naming the replicas whose counts differ.
fn check_expert_partners(replicas: &[Replica<'_>], ep: usize) -> Result<()> {
    for (g, group) in replicas.chunks(ep).enumerate() {
        let first = &group[0];
        for (i, r) in group.iter().enumerate().skip(1) {
            if r.microbatches.len() != first.microbatches.len()
                || r.fo_microbatches.len() != first.fo_microbatches.len()
                || r.schedule.ranks != first.schedule.ranks
            {
                return Err(Error::Invalid(format!(
                    "replicas {} and {} of an expert-parallel group run {} and {} microbatches (+{} and {} forward-only) or different schedules; the group's all-to-alls pair their microbatches one to one, so they need the same counts (a fixed microbatch count per replica)",
                    g * ep,
                    g * ep + i,
                    first.microbatches.len(),
                    r.microbatches.len(),
                    first.fo_microbatches.len(),
                    r.fo_microbatches.len()
                )));
            }
        }
    }
    Ok(())
}

/// The global gradient L2 norm over the stages of `ranks` (the first `ep` replicas' pipeline
/// ranks, `pp` each: after the all-reduce every replica holds the same gradients, and the
/// first expert-parallel group holds every expert once): every gradient but the routed
/// experts' from the first replica, the routed experts' from all of them.
///
/// Each rank's share of the squared norm on its own thread, then their sum (the all-reduce
/// of one scalar): as frameworks clip, and as the profile's optimizer time (norm + AdamW
/// per parameter, every rank at once) assumes. Summed on one thread, the norm of the whole
/// model ran serially and the optimizer phase measured 1.3-1.6x its prediction.
///
/// # Errors
/// A worker's [`StageWorker::grad_sq_norm`] error; [`Error::Invalid`] for a thread that
/// panicked.
fn global_grad_norm<W: StageWorker>(ranks: &mut [Vec<(u32, W)>], pp: usize) -> Result<f64> {
    let partial: Vec<Result<f64>> = std::thread::scope(|scope| {
        let hs: Vec<_> = ranks
            .iter_mut()
            .enumerate()
            .map(|(g, rank)| {
                scope.spawn(move || -> Result<f64> {
                    let mut sq = 0.0;
                    for (_, w) in rank.iter() {
                        if g < pp {
                            sq += w.grad_sq_norm()?;
                        }
                        sq += w.expert_grad_sq_norm()?;
                    }
                    Ok(sq)
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| {
                h.join().unwrap_or_else(|_| {
                    Err(Error::Invalid(
                        "a rank's gradient-norm thread panicked".into(),
                    ))
                })
            })
            .collect()
    });
    let mut grad_sq = 0.0;
    for p in partial {
        grad_sq += p?;
    }
    Ok(grad_sq.sqrt())
}

/// AdamW step `t` with the gradients scaled by `scale` (clipping) on every rank at once, one
/// thread per rank. Returns each rank's optimizer `(start, end)`, nanoseconds since `t0`.
///
/// # Errors
/// A worker's [`StageWorker::optimizer_step`] error; [`Error::Invalid`] for a thread that
/// panicked.
fn optimizer_steps<W: StageWorker>(
    ranks: &mut [Vec<(u32, W)>],
    adamw: &AdamW,
    t: u64,
    scale: f32,
    t0: Instant,
) -> Result<Vec<(u64, u64)>> {
    let results: Vec<Result<(u64, u64)>> = std::thread::scope(|scope| {
        let hs: Vec<_> = ranks
            .iter_mut()
            .map(|rank| {
                scope.spawn(move || -> Result<(u64, u64)> {
                    let a = t0.elapsed().as_nanos() as u64;
                    for (_, w) in rank.iter_mut() {
                        w.optimizer_step(adamw, t, scale)?;
                    }
                    Ok((a, t0.elapsed().as_nanos() as u64))
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| {
                h.join().unwrap_or_else(|_| {
                    Err(Error::Invalid("a rank's optimizer thread panicked".into()))
                })
            })
            .collect()
    });
    results.into_iter().collect()
}

/// The step's result from the ranks' outputs (rank order, `dp * pp`), their optimizer spans
/// and the gradient norm: the timeline with times from the first action's start (thread
/// start-up is not the step's; `opt_start`, nanoseconds since the step's clock, bounds it), and
/// the losses per replica in microbatch order.
fn collect_step(
    outs: Vec<RankOut>,
    optimizer: Vec<Option<(u64, u64)>>,
    dp: usize,
    pp: usize,
    opt_start: u64,
    grad_norm: f64,
) -> StepRun {
    let mut timeline = Timeline {
        compute: Vec::with_capacity(outs.len()),
        transfers: Vec::new(),
        optimizer,
        comm: Vec::new(),
    };
    let mut microbatch_losses = vec![Vec::new(); dp];
    let mut fo_losses = vec![Vec::new(); dp];
    let mut all_to_all = Vec::with_capacity(outs.len());
    let mut exposed_all_to_all_ns = Vec::with_capacity(outs.len());
    for (g, o) in outs.into_iter().enumerate() {
        let d = g / pp;
        all_to_all.push(o.all_to_all);
        exposed_all_to_all_ns.push(o.exposed_all_to_all_ns);
        timeline.compute.push(o.ops);
        timeline.transfers.extend(o.transfers);
        microbatch_losses[d].extend(o.losses);
        fo_losses[d].extend(o.fo_losses);
    }
    let origin = timeline
        .compute
        .iter()
        .filter_map(|ops| ops.first())
        .map(|o| o.start_ns)
        .min()
        .unwrap_or(0)
        .min(opt_start);
    for ops in &mut timeline.compute {
        for o in ops {
            o.start_ns -= origin;
            o.end_ns -= origin;
        }
    }
    for t in &mut timeline.transfers {
        t.start_ns -= origin;
        t.end_ns -= origin;
    }
    for (a, b) in timeline.optimizer.iter_mut().flatten() {
        *a -= origin;
        *b -= origin;
    }
    for a in all_to_all.iter_mut().flatten() {
        a.start_ns = a.start_ns.saturating_sub(origin);
        a.ready_ns = a.ready_ns.saturating_sub(origin);
        a.end_ns = a.end_ns.saturating_sub(origin);
    }
    if all_to_all.iter().any(|v| !v.is_empty()) {
        timeline.comm = all_to_all.iter().map(|v| comm_lane(v)).collect();
    }
    let sort = |v: &mut Vec<(u32, LossSums)>| {
        v.sort_by_key(|x| x.0);
        v.iter().map(|x| x.1).collect::<Vec<_>>()
    };
    let microbatch_losses: Vec<Vec<LossSums>> = microbatch_losses.iter_mut().map(sort).collect();
    let fo_losses: Vec<Vec<LossSums>> = fo_losses.iter_mut().map(sort).collect();
    let loss = microbatch_losses.iter().flatten().map(|l| l.weighted).sum();
    StepRun {
        timeline,
        loss,
        microbatch_losses,
        fo_losses,
        grad_norm,
        all_to_all,
        exposed_all_to_all_ns,
    }
}

/// A rank's all-to-alls as actions on its comm lane ([`Timeline::comm`]), in start order: each
/// from its first send to its last receive.
fn comm_lane(spans: &[MeasuredAllToAll]) -> Vec<TimedComm> {
    use crate::worker::Phase;
    let mut lane: Vec<TimedComm> = spans
        .iter()
        .filter_map(|a| {
            let (exchange, kind) = match a.phase {
                Phase::Dispatch => (Exchange::Dispatch, ActionKind::F),
                Phase::Combine => (Exchange::Combine, ActionKind::F),
                Phase::GradDispatch => (Exchange::Dispatch, ActionKind::I),
                Phase::GradCombine => (Exchange::Combine, ActionKind::I),
                // A context-parallel group's exchanges are not expert all-to-alls.
                Phase::KeysValues | Phase::KeysValuesAgain | Phase::KeyValueGrads => return None,
            };
            let kind = if a.forward_only { ActionKind::Fo } else { kind };
            Some(TimedComm {
                action: LoweredAction::AllToAll(AllToAll {
                    stage: StageId(a.stage),
                    microbatch: MicrobatchId(a.microbatch),
                    kind,
                    exchange,
                    layer: a.layer as u32,
                }),
                start_ns: a.start_ns,
                end_ns: a.end_ns,
            })
        })
        .collect();
    lane.sort_by_key(|c| c.start_ns);
    lane
}
