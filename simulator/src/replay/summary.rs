//! A replay that keeps only what the metrics need: the makespan and, per rank, the busy time,
//! the peak activation memory and the most microbatches in flight. No [`crate::Timeline`] is
//! built, so a step that needs no chart costs the replay's arithmetic alone (the timeline of a
//! p = 64, m = 4096 1F1B step is ~45 MB of stores; without it the replay runs ~1.6x faster,
//! docs/performance.md).
//!
//! The numbers equal those [`crate::replay::metrics::metrics`] computes from the full timeline, the
//! peaks up to the order of their floating-point sums (the property tests in
//! `tests/summary.rs` check it on every generator, to a relative 1e-9):
//! memory follows [`crate::replay::metrics::memory_events`]'s rules, the level being a step function of
//! time whose peak is taken after all the changes at one instant (frees before allocations
//! at equal times). Per rank, compute ops come in program order with non-decreasing times, and
//! the only changes out of that order are the output buffers freed when their transfer ends:
//! they wait in a small heap until the rank's clock reaches them.
//!
//! [`replay_within`] also stops a replay as soon as it cannot matter to a search: an op ends
//! after a makespan to beat, or a rank's memory passes a limit. [`replay_to_beat`] stops
//! sooner, on lower bounds: a rank's clock plus the compute it has left and its optimizer step
//! already exceeds the makespan to beat, or that bound reaches it while the peak so far is no
//! smaller than the best's (zb-auto replays ~15 candidates per call this way).

use crate::costs::CostModel;
use crate::ir::comm::StreamLayout;
use crate::ir::lowering::Lowering;
use crate::ir::{Action, ActionKind, ComputeAction, Placement, Rank, Schedule};
use crate::replay::metrics::{self, Metrics, PartMemory};
use crate::replay::timeline::{TimedOp, TimedTransfer};
use crate::replay::{self, Outcome, Recorder};
use crate::{Result, replay::dag};
use std::cmp::Reverse;
use std::collections::BinaryHeap;

/// What a replay keeps without its timeline. Times in ns, memory in the cost model's unit
/// (bytes, or units under uniform costs).
#[derive(Debug, Clone, PartialEq)]
pub struct Summary {
    /// End of the last op (compute, transfer or optimizer), ns.
    pub makespan_ns: u64,
    /// Per rank: compute and optimizer time, ns.
    pub busy_ns: Vec<u64>,
    /// Per rank: peak activation memory.
    pub peak_activation: Vec<f64>,
    /// Per rank: most microbatches in flight at once (as [`crate::replay::metrics::RankMetrics`]).
    pub peak_inflight: Vec<u32>,
}

impl Summary {
    /// The largest peak activation over the ranks.
    pub fn max_peak_activation(&self) -> f64 {
        self.peak_activation.iter().copied().fold(0.0, f64::max)
    }
}

/// One rank's activation memory as the replay goes.
#[derive(Debug, Clone, Default)]
struct RankMemory {
    level: f64,
    peak: f64,
    /// The instant whose changes are being applied, ns.
    now: u64,
    /// Output buffers freed when their transfer ends: (end ns, bytes as f64 bits).
    pending: BinaryHeap<Reverse<(u64, u64)>>,
}

impl RankMemory {
    /// Moves to instant `t` (>= the current one): applies the pending frees before or at `t`,
    /// closing each earlier instant (its level is a candidate peak).
    #[inline]
    fn advance(&mut self, t: u64) {
        while let Some(&Reverse((at, bits))) = self.pending.peek() {
            if at > t {
                break;
            }
            self.pending.pop();
            self.to(at);
            self.level -= f64::from_bits(bits);
        }
        self.to(t);
    }

    #[inline]
    fn to(&mut self, t: u64) {
        if t > self.now {
            self.peak = self.peak.max(self.level);
            self.now = t;
        }
    }

    /// Closes the last instant (with the frees due at it).
    fn finish(&mut self) {
        self.advance(self.now);
        self.peak = self.peak.max(self.level);
    }
}

/// `Lean::mb_state`'s flag: the microbatch's first F ran on the rank.
const SEEN: u32 = 1 << 31;

/// The recorder of a [`Summary`], with the bounds of [`replay_to_beat`].
pub(crate) struct Lean<'a, C: CostModel> {
    placement: &'a Placement,
    costs: &'a C,
    last_stage: u32,
    /// A rank's bound on the makespan (its clock, the compute it has left, its optimizer step)
    /// passing this stops the replay, ns.
    makespan_cap: u64,
    /// A rank whose memory passes this stops the replay.
    memory_cap: f64,
    /// Per rank, the compute time of all its ops, ns ([`ToBeat::rank_work_ns`]); empty when
    /// unknown.
    work: &'a [u64],
    /// A replay that cannot end before `makespan_cap` stops once its peak reaches this (passes
    /// it, with `wins_full_tie`).
    tie_peak: f64,
    wins_full_tie: bool,
    /// Per rank, its optimizer step's time, ns.
    optimizer: Vec<u64>,
    /// Some rank's clock plus the compute it has left and its optimizer step reached
    /// `makespan_cap`.
    cannot_end_sooner: bool,
    /// The largest closed-instant peak over the ranks so far.
    max_peak: f64,
    end_ns: u64,
    busy: Vec<u64>,
    mem: Vec<RankMemory>,
    inflight: Vec<u32>,
    peak_inflight: Vec<u32>,
    /// With several stages per rank: per (rank, microbatch), whether its first F ran here
    /// (`SEEN`) and how many of its W or B remain (the other bits). Empty with one stage per
    /// rank.
    mb_state: Vec<u32>,
    m: usize,
}

impl<C: CostModel> Lean<'_, C> {
    /// Applies `d` at instant `t` of rank `r`.
    #[inline]
    fn change(&mut self, r: usize, t: u64, d: f64) {
        let mem = &mut self.mem[r];
        mem.advance(t);
        mem.level += d;
    }

    /// What a part allocates at its start on rank `r` ([`metrics::part_memory`]).
    #[inline]
    fn allocate(&mut self, r: usize, pm: &PartMemory, start: u64) {
        if pm.at_start > 0.0 {
            self.change(r, start, pm.at_start);
        }
        if pm.out > 0.0 {
            self.change(r, start, pm.out);
        }
    }

    /// A microbatch enters rank `r`'s in-flight count at its first F there.
    #[inline]
    fn count_f(&mut self, r: usize, a: ComputeAction) {
        if a.kind != ActionKind::F {
            return;
        }
        if self.mb_state.is_empty() {
            self.inflight[r] += 1;
        } else {
            let st = &mut self.mb_state[r * self.m + a.microbatch.idx()];
            if *st & SEEN == 0 {
                *st |= SEEN;
                self.inflight[r] += 1;
            }
        }
    }

    /// What part `a` frees at its end on rank `r` ([`metrics::part_memory`]), and the
    /// in-flight count after its last W or B there.
    #[inline]
    fn free(&mut self, r: usize, a: ComputeAction, pm: &PartMemory, end: u64) {
        if pm.out_freed_at_end {
            self.change(r, end, -pm.out);
        }
        if pm.at_end > 0.0 {
            self.change(r, end, -pm.at_end);
        }
        if !matches!(a.kind, ActionKind::W | ActionKind::B) {
            return;
        }
        if self.mb_state.is_empty() {
            self.inflight[r] = self.inflight[r].saturating_sub(1);
        } else {
            let st = &mut self.mb_state[r * self.m + a.microbatch.idx()];
            let left = (*st & !SEEN).saturating_sub(1);
            *st = (*st & SEEN) | left;
            if left == 0 {
                self.inflight[r] = self.inflight[r].saturating_sub(1);
            }
        }
    }
}

impl<C: CostModel> Recorder for Lean<'_, C> {
    #[inline]
    fn op(&mut self, r: usize, op: TimedOp) -> bool {
        let (start, end) = (op.start_ns, op.end_ns);
        self.end_ns = self.end_ns.max(end);
        self.busy[r] += end - start;
        // The rank's later ops and then its optimizer step run after `end`: the makespan is at
        // least `end` plus their time.
        let left = match self.work.get(r) {
            Some(&w) => w.saturating_sub(self.busy[r]),
            None => 0,
        };
        let bound = end + left + self.optimizer[r];
        if bound > self.makespan_cap {
            return false;
        }
        self.cannot_end_sooner |= bound == self.makespan_cap;
        // As `metrics::memory_events`: every part's allocations at the start, then the
        // in-flight count, then every part's frees at the end.
        match op.action {
            Action::Compute(a) => {
                let pa = metrics::part_memory(self.placement, self.costs, self.last_stage, r, a);
                self.allocate(r, &pa, start);
                self.count_f(r, a);
                self.peak_inflight[r] = self.peak_inflight[r].max(self.inflight[r]);
                self.free(r, a, &pa, end);
            }
            Action::Overlap(a, b) => {
                let pa = metrics::part_memory(self.placement, self.costs, self.last_stage, r, a);
                let pb = metrics::part_memory(self.placement, self.costs, self.last_stage, r, b);
                self.allocate(r, &pa, start);
                self.allocate(r, &pb, start);
                self.count_f(r, a);
                self.count_f(r, b);
                self.peak_inflight[r] = self.peak_inflight[r].max(self.inflight[r]);
                self.free(r, a, &pa, end);
                self.free(r, b, &pb, end);
            }
        }
        // Instants before `start` are closed: their levels are final (an instant's level is
        // only known once all its changes are in, so the caps are checked one instant late).
        let peak = self.mem[r].peak;
        self.max_peak = self.max_peak.max(peak);
        let loses_tie = self.max_peak > self.tie_peak
            || (!self.wins_full_tie && self.max_peak >= self.tie_peak);
        peak <= self.memory_cap && !(self.cannot_end_sooner && loses_tie)
    }

    #[inline]
    fn transfer(&mut self, t: TimedTransfer) {
        self.end_ns = self.end_ns.max(t.end_ns);
        if t.kind == ActionKind::F {
            let out = self.costs.output_bytes(t.stage, t.microbatch);
            if out > 0.0 {
                self.mem[t.from.idx()]
                    .pending
                    .push(Reverse((t.end_ns, out.to_bits())));
            }
        }
    }
}

/// Replays `schedule` under `costs` and returns its [`Summary`]; the same numbers as
/// [`crate::replay::replay`] followed by [`crate::replay::metrics::metrics`] (peaks up to the order of
/// their floating-point sums), without the timeline.
///
/// # Errors
/// [`crate::Error::Deadlock`] naming the actions on a dependency cycle.
pub fn replay_summary<C: CostModel>(schedule: &Schedule, costs: &C) -> Result<Summary> {
    replay_within(schedule, costs, u64::MAX, f64::INFINITY)
        .ok_or_else(|| dag::deadlock_error(schedule))
}

/// [`replay_summary`] that stops as soon as an op ends after `makespan_cap` ns, or would leave
/// its rank's optimizer step ending after it, or a rank's activation memory passes
/// `memory_cap` (cost model's unit), and returns `None` then, or when the schedule cannot
/// finish. A returned summary has `makespan_ns <= makespan_cap` unless a last transfer carries
/// it over (transfers are not capped), and every rank's peak within `memory_cap`. The caps only
/// stop work: a summary that is returned is exact.
pub fn replay_within<C: CostModel>(
    schedule: &Schedule,
    costs: &C,
    makespan_cap: u64,
    memory_cap: f64,
) -> Option<Summary> {
    replay_to_beat(
        schedule,
        costs,
        &ToBeat {
            makespan_ns: makespan_cap,
            peak: f64::INFINITY,
            memory_cap,
            rank_work_ns: &[],
            wins_full_tie: false,
        },
    )
}

/// What a candidate of a search must beat to win: a makespan no later than the best's, and
/// when it cannot end sooner, a smaller peak, or the same one if it wins full ties (zb-auto's
/// order: the makespan, then the peak, then the order of preference).
#[derive(Debug, Clone, Copy)]
pub struct ToBeat<'a> {
    /// The best makespan so far (each rank's optimizer step included, [`Summary::makespan_ns`]),
    /// ns.
    pub makespan_ns: u64,
    /// The best candidate's peak activation (cost model's unit); `f64::INFINITY` for none.
    pub peak: f64,
    /// No rank's activation memory may pass this (cost model's unit).
    pub memory_cap: f64,
    /// Per rank, the compute time of all the candidate's ops on it, ns (the sum of
    /// [`CostModel::compute_ns`], or `overlap_ns` for an overlapped pair), or empty when not
    /// known: with it, a rank at clock `t` bounds the makespan from below by `t` plus the
    /// compute it has left and its optimizer step, and the replay stops when that bound passes
    /// `makespan_ns`. It must be exact: a larger figure would stop a replay that could win.
    pub rank_work_ns: &'a [u64],
    /// Whether a candidate that ties the best on both the makespan and the peak wins (it comes
    /// earlier in the search's order of preference).
    pub wins_full_tie: bool,
}

/// [`replay_summary`] of `schedule` lowered to compute and communication under `lowering`
/// ([`crate::replay::streams`]).
///
/// On per-peer streams ([`StreamLayout::PerPeer`]) this is [`replay_summary`] itself once
/// every rank pair posts its receives in its sends' order
/// ([`crate::ir::lowering::check_pair_order`]): a receive stream from peer q then holds
/// exactly the sends of q's stream to this rank, in their order, so each transfer starts
/// when its payload is ready and the link's previous transfer has ended, wherever the
/// program posts it (the FIFO links of [`crate::replay::replay`]; a property test checks
/// every kind under both postings).
///
/// # Errors
/// As [`crate::ir::lowering::lower`]; [`crate::Error::StreamsHang`] when the streams
/// cannot finish; [`crate::Error::PairOrder`] when a rank pair posts its sends and
/// receives in different orders.
pub fn lowered_summary<C: CostModel>(
    schedule: &Schedule,
    lowering: Lowering,
    costs: &C,
) -> Result<Summary> {
    if lowering.streams == StreamLayout::PerPeer && lowering.fsdp.is_none() {
        crate::ir::lowering::check_pair_order(schedule, lowering.posting)?;
        return replay_summary(schedule, costs);
    }
    let to_beat = ToBeat {
        makespan_ns: u64::MAX,
        peak: f64::INFINITY,
        memory_cap: f64::INFINITY,
        rank_work_ns: &[],
        wins_full_tie: false,
    };
    let s = schedule;
    let lean = Lean::new(&s.placement, s.num_microbatches as usize, costs, &to_beat);
    match crate::replay::streams::run_lowering(schedule, lowering, costs, lean)? {
        (Outcome::Done(clock), lean) => Ok(lean
            .finish(&clock)
            .expect("an unbounded summary always finishes")),
        _ => unreachable!("an unbounded summary never stops a replay"),
    }
}

/// [`metrics_without_timeline`] of `schedule` lowered under `lowering`: the metrics
/// [`crate::simulate_with`] gives, without the timeline.
///
/// # Errors
/// As [`lowered_summary`].
pub fn lowered_metrics_without_timeline<C: CostModel>(
    schedule: &Schedule,
    lowering: Lowering,
    costs: &C,
) -> Result<Metrics> {
    let s = lowered_summary(schedule, lowering, costs)?;
    Ok(summary_metrics(schedule, costs, &s))
}

/// Per rank, the compute time of all its ops in `schedule`, ns: [`ToBeat::rank_work_ns`].
pub fn rank_work_ns<C: CostModel>(schedule: &Schedule, costs: &C) -> Vec<u64> {
    schedule
        .ranks
        .iter()
        .map(|actions| {
            actions
                .iter()
                .map(|a| match *a {
                    Action::Compute(c) => costs.compute_ns(c),
                    Action::Overlap(f, b) => costs.overlap_ns(f, b),
                })
                .sum()
        })
        .collect()
}

/// [`replay_within`] for a candidate that must beat `to_beat`: `None` as soon as it cannot
/// (its makespan will pass `to_beat.makespan_ns`, or will not be sooner while its peak is
/// already no smaller than `to_beat.peak`), when a rank's memory passes `to_beat.memory_cap`,
/// or when the schedule cannot finish. A returned summary is exact, and may still lose to the
/// best (a tie on both, or a last transfer or optimizer step past the makespan).
pub fn replay_to_beat<C: CostModel>(
    schedule: &Schedule,
    costs: &C,
    to_beat: &ToBeat,
) -> Option<Summary> {
    let p = schedule.placement.num_ranks as usize;
    let lean = Lean::new(
        &schedule.placement,
        schedule.num_microbatches as usize,
        costs,
        to_beat,
    );
    let mut links = vec![Vec::new(); p];
    let (outcome, lean) = replay::run(schedule, costs, &vec![0; p], &mut links, lean);
    let Outcome::Done(clock) = outcome else {
        return None;
    };
    lean.finish(&clock)
}

impl<'a, C: CostModel> Lean<'a, C> {
    /// The recorder of a replay of `m` microbatches over `placement` that must beat `to_beat`.
    pub(crate) fn new(
        placement: &'a Placement,
        m: usize,
        costs: &'a C,
        to_beat: &ToBeat<'a>,
    ) -> Self {
        let p = placement.num_ranks as usize;
        let one_stage_each = (0..p as u32).all(|r| placement.stages_of(Rank(r)).len() == 1);
        let mb_state = if !one_stage_each {
            let mut st = vec![0u32; p * m];
            for (r, chunk) in st.chunks_mut(m.max(1)).enumerate() {
                let v = placement.stages_of(Rank(r as u32)).len() as u32;
                chunk.fill(v & !SEEN);
            }
            st
        } else {
            Vec::new()
        };
        Lean {
            placement,
            costs,
            last_stage: (placement.rank_of.len() as u32).saturating_sub(1),
            makespan_cap: to_beat.makespan_ns,
            memory_cap: to_beat.memory_cap,
            work: to_beat.rank_work_ns,
            tie_peak: to_beat.peak,
            wins_full_tie: to_beat.wins_full_tie,
            cannot_end_sooner: false,
            max_peak: 0.0,
            optimizer: (0..p as u32).map(|r| costs.optimizer_ns(Rank(r))).collect(),
            end_ns: 0,
            busy: vec![0; p],
            mem: vec![RankMemory::default(); p],
            inflight: vec![0; p],
            peak_inflight: vec![0; p],
            mb_state,
            m,
        }
    }

    /// The summary of a replay that ran every action, each rank's last action ending at
    /// `clock[r]` ns (each rank's optimizer step follows it); `None` when a rank's peak passed
    /// the memory cap.
    pub(crate) fn finish(mut self, clock: &[u64]) -> Option<Summary> {
        let mut makespan = self.end_ns;
        // A rank's clock is its last compute's end, or (FSDP) its last reduction's.
        for (r, &end) in clock.iter().enumerate() {
            let opt = self.optimizer[r];
            self.busy[r] += opt;
            makespan = makespan.max(end + opt);
        }
        let peak_activation = self
            .mem
            .iter_mut()
            .map(|mem| {
                mem.finish();
                mem.peak
            })
            .collect::<Vec<f64>>();
        if peak_activation.iter().any(|&peak| peak > self.memory_cap) {
            return None;
        }
        Some(Summary {
            makespan_ns: makespan,
            busy_ns: self.busy,
            peak_activation,
            peak_inflight: self.peak_inflight,
        })
    }
}

/// The [`Metrics`] of a [`Summary`] of `schedule` under `costs`: what
/// [`crate::replay::metrics::metrics`] gives for the full timeline.
pub fn summary_metrics<C: CostModel>(schedule: &Schedule, costs: &C, summary: &Summary) -> Metrics {
    let ranks = (0..summary.busy_ns.len())
        .map(|r| metrics::RankTotals {
            busy_ns: summary.busy_ns[r],
            peak_activation: summary.peak_activation[r],
            peak_inflight: summary.peak_inflight[r],
        })
        .collect::<Vec<_>>();
    metrics::assemble(schedule, costs, summary.makespan_ns, &ranks)
}

/// [`replay_summary`] then [`summary_metrics`]: validates nothing (see [`crate::simulate`]).
///
/// # Errors
/// [`crate::Error::Deadlock`].
pub fn metrics_without_timeline<C: CostModel>(schedule: &Schedule, costs: &C) -> Result<Metrics> {
    let s = replay_summary(schedule, costs)?;
    Ok(summary_metrics(schedule, costs, &s))
}
