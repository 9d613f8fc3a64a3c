//! `zb-auto`: a zero-bubble schedule built for the step's own costs under a per-rank
//! activation-memory limit, in the spirit of the automatic scheduler of Qi et al., "Zero Bubble
//! Pipeline Parallelism" (ICLR 2024, section 3).
//!
//! Algorithm. A list scheduler walks simulated time. The rank whose clock is earliest picks its
//! next action among those whose data are ready at that time:
//!
//! - **I** (dgrad) of a microbatch whose output gradient has arrived: it is on the critical path
//!   (the previous stage waits for its result) and frees the activations only dgrad needs;
//! - **F** of the next microbatch of one of its stages, if its input has arrived and the
//!   activations it would keep fit under the limit (memory headroom);
//! - **W** (wgrad) of a microbatch whose I is done: never urgent, so it fills bubbles (a W runs
//!   when nothing else is ready, or, under some priority settings, when memory is tight).
//!
//! Nothing ready and no W pending: the rank idles until the next arrival it can know of. Costs may
//! differ by stage and microbatch (variable-length steps); transfers take the cost model's time.
//! Several priority settings are tried (I or F first; W only in bubbles, or also when headroom is
//! short, or as soon as possible; on V placement, the later or the earlier chunk's F first), each
//! is replayed under the real cost model, and the fastest that fits the limit is kept, together
//! with the handcrafted schedules of the same placement (1F1B, ZB-H1, ZB-H2 in loop placement;
//! ZB-V in V placement) and, in loop placement, the eight orders of the Zero Bubble authors'
//! wave construction ([`waves`]) when they fit: zb-auto is never worse than the best
//! of them. "Fastest" is one step's makespan ([`Objective::Step`], the default) or, with
//! [`Objective::PostValidation`], the steady-state step time across consecutive steps under
//! optimizer post-validation ([`crate::replay::multistep`]). When nothing fits, the error names the
//! limit and the smallest peak found.
//!
//! Speed (it is rebuilt per step and per candidate by the planner). Every candidate is replayed
//! under bounds that stop it once it cannot win ([`summary::replay_to_beat`]); a list schedule
//! is replayed as the greedy builds it (`replay::Incremental`), so a losing one is not even
//! finished. The wave orders (the one whose construction reaches the least makespan first; none
//! whose construction is already slower than the best) and the handcrafted schedules are
//! replayed first, the list schedules last; on a full tie (makespan and peak) the order of
//! preference decides, list schedules first, so the choice does not depend on the order of
//! evaluation.
//!
//! Expected quality (one step, comm = 0): with a limit of 2p units and m >= 2p - 1 it reaches the
//! lower bound `(p - 1) f + m (f + b + w)` when `b <= 2w` and `b <= 2f` (ZB-H2's regime); with p
//! units it is no worse than ZB-H1 (Qi et al. 2024, Table 1's ZB-1p and ZB-2p).

//!
//! Files: this module holds the entry points and the search over the candidates; `greedy` the
//! list scheduler, `priority` its priority settings and the table of settings that decide
//! alike, `tournament` the tree that finds the earliest rank, [`waves`] the wave construction.

mod greedy;
mod priority;
mod tournament;
pub mod waves;

use crate::costs::CostModel;
use crate::ir::{Action, ActionKind, ComputeAction, MicrobatchId, Placement, Schedule, StageId};
use crate::{Error, Result, replay::multistep, replay::summary};
use greedy::greedy;
use priority::{Agreement, priority_settings};

/// The placement zb-auto uses for `v` stages per rank: loop for 1, V for 2.
///
/// # Errors
/// [`Error::InvalidArgument`] for another `v`.
pub fn placement(p: u32, v: u32) -> Result<Placement> {
    match v {
        1 => Ok(Placement::looped(p, 1)),
        2 => Ok(Placement::v_shape(p)),
        _ => Err(Error::invalid(
            "vpp",
            v,
            "1 (loop) or 2 (V) stages per rank for zb-auto",
        )),
    }
}

/// A candidate's rank: (objective ns, one step's makespan ns, peak activation, place in the
/// order of preference: list schedules, then wave orders, then handcrafted ones).
type Key = (u64, u64, f64, usize);

/// A 64-bit fingerprint of per-rank action lists (a multiply-xorshift mix over each action's
/// stage, microbatch and kind, and each rank's length): equal lists give equal fingerprints,
/// distinct ones collide with probability ~2^-64. Several times cheaper than SipHash here.
fn fingerprint(ranks: &[Vec<Action>]) -> u64 {
    let mut h: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut mix = |x: u64| {
        h = (h ^ x).wrapping_mul(0xff51_afd7_ed55_8ccd);
        h ^= h >> 33;
    };
    let word = |a: &ComputeAction| {
        (u64::from(a.stage.0) << 40) ^ (u64::from(a.microbatch.0) << 8) ^ a.kind as u64
    };
    for actions in ranks {
        mix(actions.len() as u64);
        for a in actions {
            match a {
                Action::Compute(c) => mix(word(c)),
                Action::Overlap(f, b) => {
                    mix(word(f) | 1 << 63);
                    mix(word(b));
                }
            }
        }
    }
    h
}

/// Builds the zb-auto schedule for `p` ranks, `v` stages per rank (1: loop, 2: V placement) and
/// `m` microbatches under `costs` (built for [`placement`]`(p, v)`), keeping every rank's peak
/// activation memory at most `limit` (in the cost model's unit: bytes, or units under uniform
/// costs where 1F1B's rank 0 holds p). `handcrafted` are schedules of the same `(p, v, m)`
/// that compete with the list schedules (the handcrafted zero-bubble schedules; the caller
/// generates them, so this module does not depend on the generators). Called through
/// [`crate::ScheduleKind::build`].
///
/// # Errors
/// [`Error::InvalidArgument`] for `p`, `m` or `v` out of range; [`Error::MemoryLimit`] for a
/// limit too small for any schedule (naming the limit and the smallest peak found).
pub fn zb_auto<C: CostModel>(
    p: u32,
    v: u32,
    m: u32,
    costs: &C,
    limit: f64,
    handcrafted: Vec<Schedule>,
) -> Result<Schedule> {
    zb_auto_for(p, v, m, costs, limit, handcrafted, Objective::Step)
}

/// What zb-auto minimises among the candidates that fit the memory limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Objective {
    /// One step's makespan (then the smaller peak): the step as trained with a global
    /// synchronisation before the optimizer (gradient clipping), where the next step cannot
    /// start early.
    #[default]
    Step,
    /// The steady-state step time of consecutive steps under the Zero Bubble paper's optimizer
    /// post-validation (each rank steps its optimizer after its own last action and starts the
    /// next step's forwards; [`crate::replay::multistep`]), over [`STEADY_STATE_STEPS`] steps (then the
    /// single step's makespan, then the smaller peak). This is where ZB-H2's shape pays: at
    /// p = 4, m = 8, f = b = w = 1 under 2p units it reaches `m (f + b + w)` = 24 s per step,
    /// which [`Objective::Step`] (27 s for one step either way) does not prefer.
    PostValidation,
}

/// Steps replayed to rank candidates by [`Objective::PostValidation`]: the first step's fill is
/// excluded, the other three give the period.
pub const STEADY_STATE_STEPS: u32 = 4;

/// Per rank, the compute of every F, I and W of its stages (ns): each list schedule and wave
/// order runs exactly these ops, so its replay can stop as soon as a rank's clock plus the
/// compute it has left cannot beat the best ([`summary::ToBeat::rank_work_ns`]).
fn full_work<C: CostModel>(placement: &Placement, m: u32, costs: &C) -> Vec<u64> {
    let mut work = vec![0; placement.num_ranks as usize];
    for (s, r) in placement.rank_of.iter().enumerate() {
        for mb in 0..m {
            for kind in [ActionKind::F, ActionKind::I, ActionKind::W] {
                work[r.idx()] += costs.compute_ns(ComputeAction::new(s as u32, kind, mb));
            }
        }
    }
    work
}

/// zb-auto's choice among its candidates as they come.
struct Search<'a, C: CostModel> {
    costs: &'a C,
    objective: Objective,
    /// Whether handcrafted candidates are validated before their replay (off for flatpipe's
    /// own generators).
    validate_handcrafted: bool,
    /// The memory limit with a relative 1e-9 of slack for float sums.
    cap: f64,
    best: Option<(Key, Schedule)>,
    /// The smallest peak of any candidate replayed: the error's figure when none fits.
    smallest_peak: f64,
    /// Fingerprints of the candidates replayed: several settings often build the same order.
    seen: std::collections::HashSet<u64>,
    full_work: Vec<u64>,
}

impl<C: CostModel> Search<'_, C> {
    /// What a candidate running `rank_work_ns`, at place `order` in the order of preference,
    /// must beat. A replay that cannot beat the best so far is stopped early, unless no
    /// candidate fits yet: then its peak is wanted for the error message.
    fn to_beat<'w>(&self, rank_work_ns: &'w [u64], order: usize) -> summary::ToBeat<'w> {
        match &self.best {
            Some((key, _)) if self.objective == Objective::Step => summary::ToBeat {
                makespan_ns: key.0,
                peak: key.2,
                memory_cap: self.cap,
                rank_work_ns,
                // A candidate earlier in the order wins a tie on both the makespan and the peak.
                wins_full_tie: order < key.3,
            },
            Some(_) => summary::ToBeat {
                makespan_ns: u64::MAX,
                peak: f64::INFINITY,
                memory_cap: self.cap,
                rank_work_ns,
                wins_full_tie: false,
            },
            None => summary::ToBeat {
                makespan_ns: u64::MAX,
                peak: f64::INFINITY,
                memory_cap: f64::INFINITY,
                rank_work_ns,
                wins_full_tie: false,
            },
        }
    }

    /// Replays candidate `s`, at place `order` in the order of preference, and keeps it if it
    /// is the best so far. `built`: a wave order, valid by construction (the tests validate
    /// them) and running every F, I and W of its ranks' stages; the handcrafted ones are
    /// checked here.
    fn consider(&mut self, s: Schedule, built: bool, order: usize) {
        // A copy can only lose the tie to the candidate replayed before it, which is at an
        // earlier place in the order of preference: identical wave orders have the same
        // estimate, so they are replayed in place order, and the handcrafted ones come last.
        if !self.seen.insert(fingerprint(&s.ranks)) {
            return;
        }
        debug_assert!(
            (!built && self.validate_handcrafted) || s.validate().is_ok(),
            "{}",
            s.grid()
        );
        if !built && self.validate_handcrafted && s.validate().is_err() {
            return;
        }
        let handcrafted_work;
        let rank_work_ns: &[u64] = if built {
            debug_assert_eq!(summary::rank_work_ns(&s, self.costs), self.full_work);
            &self.full_work
        } else {
            handcrafted_work = summary::rank_work_ns(&s, self.costs);
            &handcrafted_work
        };
        let to_beat = self.to_beat(rank_work_ns, order);
        if let Some(summary) = summary::replay_to_beat(&s, self.costs, &to_beat) {
            self.judge(s, summary, order);
        }
    }

    /// Keeps candidate `s`, whose replay gave `summary`, if it fits the limit and is the best
    /// so far: fastest first (by the objective, then one step's makespan); on a tie, the
    /// smaller peak, then the earlier `order`.
    fn judge(&mut self, s: Schedule, summary: summary::Summary, order: usize) {
        let peak = summary.max_peak_activation();
        self.smallest_peak = self.smallest_peak.min(peak);
        if peak > self.cap {
            return;
        }
        let first = match self.objective {
            Objective::Step => summary.makespan_ns,
            Objective::PostValidation => {
                match multistep::consecutive_steps(
                    &s,
                    self.costs,
                    STEADY_STATE_STEPS,
                    multistep::StepSync::PostValidation,
                ) {
                    Ok(c) => c.steady_state_step_ns,
                    Err(_) => return,
                }
            }
        };
        let key = (first, summary.makespan_ns, peak, order);
        if self.best.as_ref().is_none_or(|(b, _)| {
            (key.0, key.1) < (b.0, b.1)
                || ((key.0, key.1) == (b.0, b.1) && (key.2 < b.2 || (key.2 == b.2 && key.3 < b.3)))
        }) {
            self.best = Some((key, s));
        }
    }
}

/// [`zb_auto`] minimising `objective`.
///
/// # Errors
/// As [`zb_auto`].
pub fn zb_auto_for<C: CostModel>(
    p: u32,
    v: u32,
    m: u32,
    costs: &C,
    limit: f64,
    handcrafted: Vec<Schedule>,
    objective: Objective,
) -> Result<Schedule> {
    search(p, v, m, costs, limit, handcrafted, objective, true)
}

/// [`zb_auto_for`]; with `validate_handcrafted` off, the handcrafted schedules are taken as
/// valid (those of flatpipe's own generators, which the tests validate: `ScheduleKind::build`
/// passes them; validating them was 4-6% of a build at p = 16, m = 64).
#[allow(clippy::too_many_arguments)]
pub(crate) fn search<C: CostModel>(
    p: u32,
    v: u32,
    m: u32,
    costs: &C,
    limit: f64,
    handcrafted: Vec<Schedule>,
    objective: Objective,
    validate_handcrafted: bool,
) -> Result<Schedule> {
    if p == 0 {
        return Err(Error::invalid("pp", 0, ">= 1 rank"));
    }
    if m == 0 {
        return Err(Error::invalid("microbatches", 0, ">= 1"));
    }
    let placement = placement(p, v)?;
    let mut search = Search {
        costs,
        objective,
        validate_handcrafted,
        cap: limit * (1.0 + 1e-9) + 1e-9,
        best: None,
        smallest_peak: f64::INFINITY,
        seen: std::collections::HashSet::new(),
        full_work: full_work(&placement, m, costs),
    };
    // A candidate's per-rank action lists as a zb-auto schedule.
    let of_ranks = |ranks| Schedule {
        name: "zb-auto".into(),
        placement: placement.clone(),
        num_microbatches: m,
        num_fo_microbatches: 0,
        chunks: Vec::new(),
        ranks,
    };
    let settings = priority_settings(v);
    // The order of preference on a full tie: the list schedules, then the wave orders, then
    // the handcrafted ones. The last two are replayed first: they are often the best on
    // uniform costs, and a list schedule built after them stops as soon as it cannot beat them
    // (its greedy gives up), where the other way round each list schedule was built to its end.
    let g = settings.len();
    // The Zero Bubble authors' wave construction (loop placement), its eight settings.
    let waves = if v == 1 {
        waves::wave_orders(p, m, costs, limit)
    } else {
        Vec::new()
    };
    let nw = waves.len();
    // A wave setting that would build an earlier one's order is not built (`None`): it would
    // lose the tie to that order. The others are replayed in the order of their construction's
    // makespan, the likely best first, so that the rest stop early; the choice does not depend
    // on the order of evaluation (ties go by place in the order of preference).
    let mut waves: Vec<(usize, waves::WaveOrder)> = waves
        .into_iter()
        .enumerate()
        .filter_map(|(j, w)| Some((j, w?)))
        .collect();
    waves.sort_by_key(|(j, w)| (w.makespan_estimate_ns, *j));
    for (j, w) in waves {
        // The estimate is at most the replay's makespan (which also queues transfers on their
        // link): an order whose estimate is past the best single step cannot win by it, nor
        // can the orders after it.
        if objective == Objective::Step
            && search
                .best
                .as_ref()
                .is_some_and(|(key, _)| w.makespan_estimate_ns > key.1)
        {
            break;
        }
        search.consider(of_ranks(w.ranks), true, g + j);
    }
    for (k, mut s) in handcrafted.into_iter().enumerate() {
        if s.placement != placement || s.num_microbatches != m {
            continue;
        }
        s.name = "zb-auto".into();
        search.consider(s, false, g + nw + k);
    }
    // Settings that would build an earlier setting's order (they decided alike at every step)
    // are not built: they would give up as it did, or lose the tie to it.
    let mut copies = 0u32;
    for (order, &prio) in settings.iter().enumerate() {
        if copies & (1 << order) != 0 {
            continue;
        }
        // The greedy replays its order as it builds it, and gives up as soon as the order
        // cannot beat the best so far.
        let to_beat = search.to_beat(&search.full_work, order);
        let agreement = Agreement::new(&settings, prio);
        let mut alike = 0;
        let built = greedy(
            &placement, m, costs, limit, prio, &to_beat, &agreement, &mut alike,
        );
        copies |= alike & !((2u32 << order) - 1);
        if let Some((ranks, summary)) = built {
            let s = of_ranks(ranks);
            debug_assert!(s.validate().is_ok(), "{}", s.grid());
            debug_assert_eq!(
                summary::replay_summary(&s, costs).ok().as_ref(),
                Some(&summary)
            );
            // Not deduplicated: its replay is done, and a copy of a candidate already judged
            // differs from it only in its place in the order.
            search.judge(s, summary, order);
        }
    }
    let smallest_peak = search.smallest_peak;
    search
        .best
        .map(|(_, s)| s)
        .ok_or_else(|| no_fit(&placement, m, costs, limit, smallest_peak))
}

/// The error when no candidate fits `limit`: it names the limit, the least any schedule of `m`
/// microbatches over `placement` needs (one microbatch's activations of the largest stage) and
/// `smallest_peak`, the smallest peak of any candidate replayed (in the cost model's unit,
/// shown in GiB or units).
fn no_fit<C: CostModel>(
    placement: &Placement,
    m: u32,
    costs: &C,
    limit: f64,
    smallest_peak: f64,
) -> Error {
    let show = |x: f64| match costs.memory_unit() {
        crate::costs::MemoryUnit::Bytes => format!("{:.2} GiB", x / (1u64 << 30) as f64),
        crate::costs::MemoryUnit::Units => format!("{x:.2} units"),
    };
    // The least any schedule needs: one microbatch's activations of the largest stage.
    let one = (0..placement.rank_of.len() as u32)
        .flat_map(|s| {
            (0..m).map(move |mb| {
                let (a, b) = costs.activation(StageId(s), MicrobatchId(mb));
                let rec = costs.recomputed(StageId(s), MicrobatchId(mb));
                b + a.max(rec)
            })
        })
        .fold(0.0, f64::max);
    Error::MemoryLimit {
        schedule: "zb-auto".into(),
        limit: format!("{} of activations", show(limit)),
        reason: format!(
            "it needs at least {} (one microbatch's activations of the largest stage; the cheapest handcrafted candidate needs {}); with a profile the activations get the memory limit minus parameters, gradients and optimizer state",
            show(one),
            show(smallest_peak)
        ),
    }
}

#[cfg(test)]
mod tests;

#[cfg(test)]
mod props;
