//! Metrics of a replayed step: makespan, bubble ratio, memory, in-flight microbatches and the
//! lower bound.

use crate::costs::{CostModel, MemoryUnit, ns_to_s};
use crate::ir::{
    Action, ActionKind, ComputeAction, MicrobatchId, Placement, Rank, Schedule, StageId,
};
use crate::replay::timeline::Timeline;
use serde::Serialize;

/// Per-rank metrics.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RankMetrics {
    /// The rank.
    pub rank: u32,
    /// Compute (and optimizer) time, seconds.
    pub busy_s: f64,
    /// `1 - busy / makespan`.
    pub bubble_ratio: f64,
    /// Peak activation memory in bytes (profile costs).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub peak_activation_bytes: Option<f64>,
    /// Peak activation memory in units of one rank's share of one microbatch (uniform costs).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub peak_activation_units: Option<f64>,
    /// Parameters, gradients and optimizer state of this rank's stages, bytes (constant over
    /// the step; mixed-precision AdamW, 16 bytes per parameter). Profile costs only.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub static_bytes: Option<f64>,
    /// Most microbatches in flight at once: from the end of a microbatch's first F on this rank
    /// to the end of its last W or B here.
    pub peak_inflight_microbatches: u32,
    /// The expert-parallel all-to-alls this rank's actions pay ([`all_to_all_time`]); `None`
    /// without any.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub all_to_all: Option<AllToAllTime>,
}

/// Expert-parallel all-to-all time of one rank over a step, seconds.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct AllToAllTime {
    /// Dispatch and combine of every F, I and B, as each would pay them run alone.
    pub total_s: f64,
    /// What stays on the rank's compute time: all of an action run alone's; of an overlapped
    /// pair, its time beyond its compute (`overlap - (f + b - a)`, the all-to-alls `a` that
    /// the other chunk's compute did not hide, and the interference they cause).
    pub exposed_s: f64,
}

/// The expert-parallel all-to-all time of `actions` (one rank's) under `costs`
/// ([`AllToAllTime`]); `None` when they pay none.
pub fn all_to_all_time<C: CostModel>(actions: &[Action], costs: &C) -> Option<AllToAllTime> {
    if !costs.has_all_to_all() {
        return None;
    }
    let (mut total, mut exposed) = (0u64, 0u64);
    for a in actions {
        match *a {
            Action::Compute(c) => {
                let x = costs.all_to_all_ns(c);
                total += x;
                exposed += x;
            }
            Action::Overlap(f, b) => {
                let x = costs.all_to_all_ns(f) + costs.all_to_all_ns(b);
                let compute = (costs.compute_ns(f) + costs.compute_ns(b)).saturating_sub(x);
                total += x;
                exposed += costs.overlap_ns(f, b).saturating_sub(compute);
            }
        }
    }
    (total > 0).then(|| AllToAllTime {
        total_s: ns_to_s(total),
        exposed_s: ns_to_s(exposed),
    })
}

/// Metrics of one simulated step.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Metrics {
    /// Step time: end of the last op, seconds.
    pub makespan_s: f64,
    /// `1 - Σ busy / (ranks * makespan)`.
    pub bubble_ratio: f64,
    /// The lower bound of [`lower_bound_ns`] (critical path, fill + work, first backward +
    /// backward work), seconds.
    pub lower_bound_s: f64,
    /// `makespan / lower_bound - 1`.
    pub gap_to_lower_bound: f64,
    /// Per rank.
    pub ranks: Vec<RankMetrics>,
    /// The expert-parallel all-to-alls of the rank with the most exposed ([`AllToAllTime`]);
    /// `None` without any.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub all_to_all: Option<AllToAllTime>,
}

/// The terms of the makespan's lower bound ([`lower_bound_ns`] is their largest), ns; each holds
/// for every schedule with the same placement, microbatches, split of the backward (I + W or
/// fused B) and costs, whatever its action order (DESIGN.md; laid out after dslab-dag's
/// `makespan_lower_bound.rs`). `tests/exact.rs` checks each against the exact optimum
/// ([`crate::schedules::exact`]) on random small instances.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
pub struct LowerBoundTerms {
    /// The critical path of one microbatch: its forwards and transfers through every stage,
    /// then its backwards back (I then W where the schedule splits them, a fused B otherwise);
    /// the longest over the microbatches.
    pub critical_path_ns: u64,
    /// Per rank r, `fill_r + work_r` (the largest): the least forward time (with transfers)
    /// any microbatch needs to reach rank r's first stage, then all of rank r's compute and
    /// its optimizer step.
    pub fill_and_work_ns: u64,
    /// Per rank r, `first_backward_r + backward_work_r` (the largest): no backward pass of rank
    /// r can start before some microbatch's forward has crossed every stage and its backward
    /// has come back through the stages after rank r's stage (the least such time over the
    /// rank's stages and the microbatches, transfers included), and all of the rank's I, W and
    /// B (and overlapped pairs, which hold a backward) come after that, then its optimizer
    /// step. With one stage per rank, uniform costs and no comm it is
    /// `p f + (p - 1 - r) b + m (b + w)` (Zero Bubble's B = our I). The general form (per-stage
    /// costs, comm, several stages per rank as in V placement) takes, per rank, the least over
    /// its stages s and the microbatches of `Σ_{t >= 0} (f_t + comm) + Σ_{t > s} (b_t + comm)`
    /// along the stage chain: it holds for any placement since it only uses each stage's own
    /// chain. At p = 8, m = 8, f = 1, b = 3, w = 1 it gives 61 on rank 0 where the others give
    /// 47 (`tests/closed_forms.rs`); zb-auto and the Zero Bubble repository's heuristic reach
    /// 61 there, which is then optimal.
    pub first_backward_and_backward_work_ns: u64,
    /// With chunked sequences ([`Schedule::chunks`]), the critical path through each
    /// sequence's chunks: on every stage the forwards run in chunk order and the backwards in
    /// reverse, so the earliest end of F(s, k) is `EF[s][k] = max(EF[s][k-1], EF[s-1][k] +
    /// comm) + f(s, k)` and of its backward `EB[s][k] = max(EB[s][k+1], EB[s+1][k] + comm,
    /// EF[S-1][k] if s is last) + b(s, k)` (then its W): the longest path of that grid DAG,
    /// resources ignored. Its backward starts also sharpen `first_backward_r`. 0 without
    /// chunks.
    pub chunk_chains_ns: u64,
    /// Per link (ordered rank pair; the replay runs its transfers one at a time): the least
    /// time any of its transfers can be sent (its microbatch's path up to the sending action's
    /// end), plus all its transfers, plus the least of what follows a transfer's arrival on its
    /// microbatch's path (through stage 0's backward and W): a one-machine bound on the link.
    /// 0 without transfers.
    pub link_ns: u64,
}

impl LowerBoundTerms {
    /// The largest term, ns.
    pub fn max(&self) -> u64 {
        self.critical_path_ns
            .max(self.fill_and_work_ns)
            .max(self.first_backward_and_backward_work_ns)
            .max(self.chunk_chains_ns)
            .max(self.link_ns)
    }
}

/// The lower bound on the makespan, ns: the largest of [`LowerBoundTerms`] (critical path,
/// fill + work, first backward + backward work, chunk chains, links).
pub fn lower_bound_ns<C: CostModel>(schedule: &Schedule, costs: &C) -> u64 {
    lower_bound_terms(schedule, costs).max()
}

/// The terms of the lower bound of `schedule` under `costs`, ns (see [`LowerBoundTerms`]).
pub fn lower_bound_terms<C: CostModel>(schedule: &Schedule, costs: &C) -> LowerBoundTerms {
    let layout = BoundLayout::new(schedule);
    let chains = layout.chunk_chains(costs);
    let mut paths = MicrobatchPaths::new(&layout);
    paths.walk(costs, ActionKind::F, schedule.num_microbatches, &chains);
    paths.walk(costs, ActionKind::Fo, schedule.num_fo_microbatches, &chains);
    let mut terms = LowerBoundTerms {
        critical_path_ns: paths.critical_ns,
        chunk_chains_ns: chains.critical_ns,
        link_ns: paths.link_ns(),
        ..LowerBoundTerms::default()
    };
    for (r, actions) in schedule.ranks.iter().enumerate() {
        let opt = costs.optimizer_ns(Rank(r as u32));
        let work: u64 = actions
            .iter()
            .map(|a| match *a {
                Action::Compute(c) => costs.compute_ns(c),
                Action::Overlap(f, b) => costs.overlap_ns(f, b),
            })
            .sum::<u64>()
            + opt;
        let f = if paths.fill[r] == u64::MAX {
            0
        } else {
            paths.fill[r]
        };
        terms.fill_and_work_ns = terms.fill_and_work_ns.max(f + work);
        if paths.first_backward[r] != u64::MAX {
            terms.first_backward_and_backward_work_ns = terms
                .first_backward_and_backward_work_ns
                .max(paths.first_backward[r] + backward_work_ns(actions, costs) + opt);
        }
    }
    terms
}

/// What the lower bound's steps share: the schedule, how each (stage, microbatch) runs its
/// backward, and which actions run in an overlapped pair.
struct BoundLayout<'a> {
    schedule: &'a Schedule,
    /// Per (stage s, microbatch k), at `s * m + k`: whether the schedule splits its backward
    /// into I then W (else it runs a fused B).
    split: Vec<bool>,
    /// Each half of an overlapped pair, with its pair: both halves end when the pair does, so
    /// along a microbatch's path a half costs at most the pair ([`BoundLayout::cost`]).
    paired: std::collections::HashMap<ComputeAction, (ComputeAction, ComputeAction)>,
}

impl<'a> BoundLayout<'a> {
    /// The layout of `schedule`.
    fn new(schedule: &'a Schedule) -> Self {
        let m = schedule.num_microbatches;
        let mut split = vec![false; (schedule.num_stages() * m) as usize];
        let mut paired = std::collections::HashMap::new();
        for a in schedule.ranks.iter().flatten() {
            if let Action::Overlap(f, b) = *a {
                paired.insert(f, (f, b));
                paired.insert(b, (f, b));
            }
            for a in a.parts() {
                if a.kind == ActionKind::I {
                    split[(a.stage.0 * m + a.microbatch.0) as usize] = true;
                }
            }
        }
        BoundLayout {
            schedule,
            split,
            paired,
        }
    }

    /// The least time action `a` adds to its microbatch's path, ns: its own duration, or the
    /// pair's where it runs in an overlapped pair that takes less (a pair of duration `fb`
    /// delivers both halves `fb` after it starts).
    fn cost<C: CostModel>(&self, costs: &C, a: ComputeAction) -> u64 {
        let own = costs.compute_ns(a);
        match self.paired.get(&a) {
            Some(&(f, b)) => own.min(costs.overlap_ns(f, b)),
            None => own,
        }
    }

    /// Whether a transfer from stage `s` to stage `t` crosses ranks.
    fn crosses(&self, s: u32, t: u32) -> bool {
        let rank_of = &self.schedule.placement.rank_of;
        rank_of[s as usize] != rank_of[t as usize]
    }

    /// Whether stage `s` splits the backward of microbatch `mb` (see `split`).
    fn is_split(&self, s: usize, mb: MicrobatchId) -> bool {
        self.split[s * self.schedule.num_microbatches as usize + mb.idx()]
    }

    /// The backward kind stage `s` runs for microbatch `mb`: I when split, else B.
    fn backward_kind(&self, s: usize, mb: MicrobatchId) -> ActionKind {
        if self.is_split(s, mb) {
            ActionKind::I
        } else {
            ActionKind::B
        }
    }

    /// The grid DAG of each chunked sequence ([`LowerBoundTerms::chunk_chains_ns`]): its
    /// longest path and the earliest start of every (stage, chunk)'s backward.
    fn chunk_chains<C: CostModel>(&self, costs: &C) -> ChunkChains {
        let schedule = self.schedule;
        let (s_count, m) = (schedule.num_stages() as usize, schedule.num_microbatches);
        let mut chains = ChunkChains {
            critical_ns: 0,
            backward_start_ns: vec![
                0u64;
                if schedule.chunks.is_empty() {
                    0
                } else {
                    s_count * m as usize
                }
            ],
        };
        for ch in &schedule.chunks {
            let ef = self.chunk_forward_ends(costs, ch);
            self.chunk_backward(costs, ch, &ef, &mut chains);
        }
        chains
    }

    /// The earliest end of each chunk's forward on each stage along the sequence's chain
    /// `ch`, ns, at `s * ch.len() + k`: `EF[s][k] = max(EF[s][k-1], EF[s-1][k] + comm) +
    /// f(s, k)`.
    fn chunk_forward_ends<C: CostModel>(&self, costs: &C, ch: &[MicrobatchId]) -> Vec<u64> {
        let (sc, n) = (self.schedule.num_stages() as usize, ch.len());
        let mut ef = vec![0u64; sc * n];
        for s in 0..sc {
            for k in 0..n {
                let mut start = if k > 0 { ef[s * n + k - 1] } else { 0 };
                if s > 0 {
                    let c = if self.crosses(s as u32 - 1, s as u32) {
                        costs.comm_ns(StageId(s as u32 - 1), ch[k], ActionKind::F)
                    } else {
                        0
                    };
                    start = start.max(ef[(s - 1) * n + k] + c);
                }
                ef[s * n + k] =
                    start + self.cost(costs, ComputeAction::new(s as u32, ActionKind::F, ch[k].0));
            }
        }
        ef
    }

    /// The backwards of the sequence `ch` in reverse chunk order, from the forward ends `ef`
    /// ([`BoundLayout::chunk_forward_ends`]): `EB[s][k] = max(EB[s][k+1], EB[s+1][k] + comm,
    /// EF[S-1][k] if s is last) + b(s, k)`, then its W; records each backward's start and the
    /// longest path in `chains`.
    fn chunk_backward<C: CostModel>(
        &self,
        costs: &C,
        ch: &[MicrobatchId],
        ef: &[u64],
        chains: &mut ChunkChains,
    ) {
        let (sc, n) = (self.schedule.num_stages() as usize, ch.len());
        let m = self.schedule.num_microbatches as usize;
        let id = |s: usize, k: usize, kind| ComputeAction {
            stage: StageId(s as u32),
            microbatch: ch[k],
            kind,
        };
        let mut eb = vec![0u64; sc * n];
        for s in (0..sc).rev() {
            for k in (0..n).rev() {
                let mut start = if k + 1 < n { eb[s * n + k + 1] } else { 0 };
                if s + 1 < sc {
                    let c = if self.crosses(s as u32 + 1, s as u32) {
                        let kind = self.backward_kind(s + 1, ch[k]);
                        costs.comm_ns(StageId(s as u32 + 1), ch[k], kind)
                    } else {
                        0
                    };
                    start = start.max(eb[(s + 1) * n + k] + c);
                } else {
                    start = start.max(ef[s * n + k]);
                }
                chains.backward_start_ns[s * m + ch[k].idx()] = start;
                eb[s * n + k] = start + self.cost(costs, id(s, k, self.backward_kind(s, ch[k])));
                let w = if self.is_split(s, ch[k]) {
                    costs.compute_ns(id(s, k, ActionKind::W))
                } else {
                    0
                };
                chains.critical_ns = chains.critical_ns.max(eb[s * n + k] + w);
            }
        }
    }
}

/// The chunked sequences' part of the bound ([`LowerBoundTerms::chunk_chains_ns`]).
struct ChunkChains {
    /// The longest path through any sequence's chunk grid, ns (0 without chunks).
    critical_ns: u64,
    /// Per (stage s, microbatch k), at `s * m + k`: the earliest start of its backward on its
    /// sequence's chain, ns (empty without chunks).
    backward_start_ns: Vec<u64>,
}

/// Each microbatch's path alone, resources ignored: forward through every stage with its
/// transfers, then (for training microbatches) its backward back to stage 0 and that stage's
/// W. What the critical-path, fill, first-backward and link terms take from it, ns.
struct MicrobatchPaths<'a> {
    layout: &'a BoundLayout<'a>,
    /// Per rank: the first of its stages (`u32::MAX` for a rank without stages).
    first_stage: Vec<u32>,
    /// Per rank: the least time any path reaches its first stage (`u64::MAX`: never).
    fill: Vec<u64>,
    /// Per rank: the earliest start of any of its backward passes, I or B (`u64::MAX`: none).
    first_backward: Vec<u64>,
    /// The longest path, with its last W.
    critical_ns: u64,
    /// Per ordered rank pair (sender * p + receiver): (Σ transfer time, least head, least
    /// tail).
    links: Vec<(u64, u64, u64)>,
    /// The current path's transfers: (link, head, transfer time).
    sends: Vec<(usize, u64, u64)>,
}

impl<'a> MicrobatchPaths<'a> {
    /// No path walked yet.
    fn new(layout: &'a BoundLayout<'a>) -> Self {
        let placement = &layout.schedule.placement;
        let first_stage: Vec<u32> = (0..placement.num_ranks)
            .map(|r| {
                placement
                    .stages_of(Rank(r))
                    .first()
                    .map_or(u32::MAX, |s| s.0)
            })
            .collect();
        let p = placement.num_ranks as usize;
        MicrobatchPaths {
            layout,
            fill: vec![u64::MAX; first_stage.len()],
            first_backward: vec![u64::MAX; first_stage.len()],
            first_stage,
            critical_ns: 0,
            links: vec![(0u64, u64::MAX, u64::MAX); p * p],
            sends: Vec::new(),
        }
    }

    /// Walks the paths of microbatches `0..count` whose forward is `kind` (F, with a backward;
    /// Fo, forward only), the chunk chains' backward starts sharpening the first backwards.
    fn walk<C: CostModel>(
        &mut self,
        costs: &C,
        kind: ActionKind,
        count: u32,
        chains: &ChunkChains,
    ) {
        for mb in 0..count {
            let mb = MicrobatchId(mb);
            self.sends.clear();
            let mut t = self.forward(costs, kind, mb);
            if kind != ActionKind::Fo {
                t = self.backward(costs, mb, t, chains);
            }
            // `t` is now the length of this microbatch's path; each transfer's tail is what
            // of the path follows its arrival.
            for &(l, head, c) in &self.sends {
                let e = &mut self.links[l];
                e.0 += c;
                e.1 = e.1.min(head);
                e.2 = e.2.min(t - head - c);
            }
        }
    }

    /// Microbatch `mb`'s forward (`kind` F or Fo) through every stage with its transfers;
    /// returns its end, ns.
    fn forward<C: CostModel>(&mut self, costs: &C, kind: ActionKind, mb: MicrobatchId) -> u64 {
        let layout = self.layout;
        let rank_of = &layout.schedule.placement.rank_of;
        let (s_count, p) = (layout.schedule.num_stages(), self.first_stage.len());
        let mut t = 0u64;
        for s in 0..s_count {
            let r = rank_of[s as usize].idx();
            if self.first_stage[r] == s {
                self.fill[r] = self.fill[r].min(t);
            }
            t += layout.cost(costs, ComputeAction::new(s, kind, mb.0));
            if s + 1 < s_count && layout.crosses(s, s + 1) {
                let c = costs.comm_ns(StageId(s), mb, kind);
                self.sends
                    .push((r * p + rank_of[s as usize + 1].idx(), t, c));
                t += c;
            }
        }
        self.critical_ns = self.critical_ns.max(t);
        t
    }

    /// Microbatch `mb`'s backward from the last stage (starting at `t`, the forward's end)
    /// back to stage 0, then stage 0's W; returns the path's end, ns.
    fn backward<C: CostModel>(
        &mut self,
        costs: &C,
        mb: MicrobatchId,
        mut t: u64,
        chains: &ChunkChains,
    ) -> u64 {
        let layout = self.layout;
        let rank_of = &layout.schedule.placement.rank_of;
        let (s_count, p) = (layout.schedule.num_stages(), self.first_stage.len());
        let m = layout.schedule.num_microbatches;
        for s in (0..s_count).rev() {
            let is_split = layout.is_split(s as usize, mb);
            let r = rank_of[s as usize].idx();
            let chained = chains
                .backward_start_ns
                .get((s * m + mb.0) as usize)
                .copied()
                .unwrap_or(0);
            self.first_backward[r] = self.first_backward[r].min(t.max(chained));
            let bwd = layout.backward_kind(s as usize, mb);
            t += layout.cost(costs, ComputeAction::new(s, bwd, mb.0));
            let w = if is_split {
                costs.compute_ns(ComputeAction::new(s, ActionKind::W, mb.0))
            } else {
                0
            };
            self.critical_ns = self.critical_ns.max(t + w);
            if s == 0 {
                // The path's end: stage 0's backward, then its W.
                t += w;
            } else if layout.crosses(s, s - 1) {
                let c = costs.comm_ns(StageId(s), mb, bwd);
                self.sends
                    .push((r * p + rank_of[s as usize - 1].idx(), t, c));
                t += c;
            }
        }
        t
    }

    /// [`LowerBoundTerms::link_ns`]: per link with transfers, least head + all transfers +
    /// least tail; the largest, 0 without transfers.
    fn link_ns(&self) -> u64 {
        self.links
            .iter()
            .filter(|e| e.0 > 0)
            .map(|e| e.1 + e.0 + e.2)
            .max()
            .unwrap_or(0)
    }
}

/// The compute of a rank's actions that cannot start before the rank's first backward pass:
/// its I, W and B (a W follows its I) and its overlapped pairs (a pair starts when both its
/// halves may), ns.
fn backward_work_ns<C: CostModel>(actions: &[Action], costs: &C) -> u64 {
    actions
        .iter()
        .map(|a| match *a {
            Action::Compute(c) => match c.kind {
                ActionKind::I | ActionKind::W | ActionKind::B => costs.compute_ns(c),
                ActionKind::F | ActionKind::Fo => 0,
            },
            Action::Overlap(f, b) => costs.overlap_ns(f, b),
        })
        .sum()
}

/// What one compute action does to the activation memory of its rank, in the cost model's unit:
/// the rules of [`memory_events`], in one place for it and for [`crate::replay::summary`].
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct PartMemory {
    /// Allocated at the action's start: an F's activations, what an I recomputes (until its
    /// W ends) or a fused B (while it runs).
    pub(crate) at_start: f64,
    /// An F's output buffer, allocated at its start (0 on the last stage and for other kinds).
    pub(crate) out: f64,
    /// The output buffer is freed at the F's end (its next stage is on the same rank) rather
    /// than when its transfer ends.
    pub(crate) out_freed_at_end: bool,
    /// Freed at the action's end: I the part only dgrad needed, W the rest and what I
    /// recomputed, a fused B all of it.
    pub(crate) at_end: f64,
}

/// The [`PartMemory`] of `a` on rank `r` (`last`: the last stage's index). Forward-only
/// microbatches have their own ids and keep nothing: they are never looked up among the
/// training microbatches.
#[inline]
pub(crate) fn part_memory<C: CostModel>(
    placement: &Placement,
    costs: &C,
    last: u32,
    r: usize,
    a: ComputeAction,
) -> PartMemory {
    let (s, mb) = (a.stage, a.microbatch);
    match a.kind {
        ActionKind::Fo => PartMemory::default(),
        ActionKind::F => {
            let (ai, aw) = costs.activation(s, mb);
            let out = if s.0 < last {
                costs.output_bytes(s, mb).max(0.0)
            } else {
                0.0
            };
            PartMemory {
                at_start: ai + aw,
                out,
                out_freed_at_end: out > 0.0 && placement.rank_of[s.idx() + 1].idx() == r,
                at_end: 0.0,
            }
        }
        ActionKind::I => {
            let (ai, _) = costs.activation(s, mb);
            PartMemory {
                at_start: costs.recomputed(s, mb),
                at_end: ai,
                ..PartMemory::default()
            }
        }
        ActionKind::W => {
            let (_, aw) = costs.activation(s, mb);
            PartMemory {
                at_end: aw + costs.recomputed(s, mb),
                ..PartMemory::default()
            }
        }
        ActionKind::B => {
            let (ai, aw) = costs.activation(s, mb);
            let rec = costs.recomputed_in_b(s, mb);
            PartMemory {
                at_start: rec,
                at_end: ai + aw + rec,
                ..PartMemory::default()
            }
        }
    }
}

/// Activation memory events of each rank: `(time_ns, change)` in the cost model's unit, in time
/// order (frees before allocations at equal times). An F allocates its stage's activations for
/// the microbatch, and its output buffer when it sends to another rank, at its start; I
/// allocates what it recomputes ([`CostModel::recomputed`]; a fused B one layer's,
/// [`CostModel::recomputed_in_b`]) at its start; I frees the part only dgrad needed, W the rest
/// and the recomputed part, a fused B all of it, at their ends; an output buffer
/// is freed when its transfer completes (a stage whose next stage is on the same rank hands its
/// output over at the F's end).
pub fn memory_events<C: CostModel>(
    schedule: &Schedule,
    costs: &C,
    timeline: &Timeline,
) -> Vec<Vec<(u64, f64)>> {
    let p = timeline.num_ranks();
    let last = schedule.num_stages().saturating_sub(1);
    let mut events: Vec<Vec<(u64, f64)>> = vec![Vec::new(); p];
    for (r, ops) in timeline.compute.iter().enumerate() {
        let ev = &mut events[r];
        ev.reserve(2 * ops.len());
        for op in ops {
            for a in op.action.parts().filter(|a| a.kind == ActionKind::F) {
                let pm = part_memory(&schedule.placement, costs, last, r, a);
                ev.push((op.start_ns, pm.at_start));
                if pm.out > 0.0 {
                    ev.push((op.start_ns, pm.out));
                    if pm.out_freed_at_end {
                        ev.push((op.end_ns, -pm.out));
                    }
                }
            }
            for a in op.action.parts().filter(|a| a.kind != ActionKind::F) {
                let pm = part_memory(&schedule.placement, costs, last, r, a);
                if pm.at_start > 0.0 {
                    ev.push((op.start_ns, pm.at_start));
                }
                if pm.at_end > 0.0 {
                    ev.push((op.end_ns, -pm.at_end));
                }
            }
        }
    }
    for t in &timeline.transfers {
        if t.kind == ActionKind::F {
            let out = costs.output_bytes(t.stage, t.microbatch);
            if out > 0.0 {
                events[t.from.idx()].push((t.end_ns, -out));
            }
        }
    }
    // Program order is time order except for transfer-end frees and ties (a zero-length op's
    // own free): the sort is stable and near-linear on such runs.
    let order = |a: &(u64, f64), b: &(u64, f64)| a.0.cmp(&b.0).then(a.1.total_cmp(&b.1));
    for ev in &mut events {
        if !ev.is_sorted_by(|a, b| order(a, b).is_le()) {
            ev.sort_by(order);
        }
    }
    events
}

/// Per stage, the most microbatches whose activations of that stage are alive at once (from
/// the start of their F to the end of their W or B there): the in-flight count the planner's
/// memory constraint multiplies each stage's activation bytes by.
pub fn stage_inflight_peaks(schedule: &Schedule, timeline: &Timeline) -> Vec<u32> {
    let mut alive = vec![0u32; schedule.num_stages() as usize];
    let mut peak = alive.clone();
    for ops in &timeline.compute {
        for op in ops {
            for a in op.action.parts().filter(|a| a.kind == ActionKind::F) {
                let s = a.stage.idx();
                alive[s] += 1;
                peak[s] = peak[s].max(alive[s]);
            }
            for a in op
                .action
                .parts()
                .filter(|a| matches!(a.kind, ActionKind::W | ActionKind::B))
            {
                alive[a.stage.idx()] -= 1;
            }
        }
    }
    peak
}

/// Activation memory of each rank over the step, from [`memory_events`]: `(time_ns, level
/// after the change)` steps.
pub fn memory_levels(events: Vec<Vec<(u64, f64)>>) -> Vec<Vec<(u64, f64)>> {
    events
        .into_iter()
        .map(|ev| {
            let mut level = 0.0;
            ev.into_iter()
                .map(|(t, d)| {
                    level += d;
                    (t, level)
                })
                .collect()
        })
        .collect()
}

/// The largest peak activation memory over the ranks of `timeline` (the replay of `schedule`
/// under `costs`), in the cost model's unit: what [`metrics`] reports per rank, without the
/// rest (zb-auto ranks its candidates by it).
pub fn peak_activation<C: CostModel>(schedule: &Schedule, costs: &C, timeline: &Timeline) -> f64 {
    memory_events(schedule, costs, timeline)
        .iter()
        .map(|events| {
            let (mut level, mut peak) = (0.0f64, 0.0f64);
            for &(_, d) in events {
                level += d;
                peak = peak.max(level);
            }
            peak
        })
        .fold(0.0, f64::max)
}

/// Computes the metrics of `timeline`, the replay of `schedule` under `costs`.
pub fn metrics<C: CostModel>(schedule: &Schedule, costs: &C, timeline: &Timeline) -> Metrics {
    metrics_with_events(
        schedule,
        costs,
        timeline,
        &memory_events(schedule, costs, timeline),
    )
}

/// [`metrics`] given the [`memory_events`] of the same replay.
pub fn metrics_with_events<C: CostModel>(
    schedule: &Schedule,
    costs: &C,
    timeline: &Timeline,
    events: &[Vec<(u64, f64)>],
) -> Metrics {
    let m = schedule.num_microbatches as usize;
    let mut seen = vec![false; m];
    let mut remaining = vec![0u32; m];
    let mut totals = Vec::with_capacity(events.len());
    for (r, rank_events) in events.iter().enumerate() {
        let v = schedule.placement.stages_of(Rank(r as u32)).len() as u32;
        seen.fill(false);
        remaining.fill(v);
        let (mut inflight, mut peak_inflight) = (0u32, 0u32);
        for op in &timeline.compute[r] {
            for a in op.action.parts() {
                let k = a.microbatch.idx();
                if a.kind == ActionKind::F && !seen[k] {
                    seen[k] = true;
                    inflight += 1;
                }
            }
            peak_inflight = peak_inflight.max(inflight);
            for a in op
                .action
                .parts()
                .filter(|a| matches!(a.kind, ActionKind::W | ActionKind::B))
            {
                let k = a.microbatch.idx();
                remaining[k] -= 1;
                if remaining[k] == 0 {
                    inflight -= 1;
                }
            }
        }
        let (mut level, mut peak) = (0.0f64, 0.0f64);
        for &(_, d) in rank_events {
            level += d;
            peak = peak.max(level);
        }
        totals.push(RankTotals {
            busy_ns: timeline.busy_ns(r),
            peak_activation: peak,
            peak_inflight,
        });
    }
    assemble(schedule, costs, timeline.makespan_ns(), &totals)
}

/// One rank's totals over a replayed step, from its timeline or from
/// [`crate::replay::summary::Summary`].
pub(crate) struct RankTotals {
    /// Compute and optimizer time, ns.
    pub busy_ns: u64,
    /// Peak activation memory, cost model's unit.
    pub peak_activation: f64,
    /// Most microbatches in flight.
    pub peak_inflight: u32,
}

/// The [`Metrics`] of a step of makespan `makespan` ns with per-rank `totals`.
pub(crate) fn assemble<C: CostModel>(
    schedule: &Schedule,
    costs: &C,
    makespan: u64,
    totals: &[RankTotals],
) -> Metrics {
    let p = totals.len();
    let unit = costs.memory_unit();
    let mut ranks = Vec::with_capacity(p);
    let mut total_busy = 0u64;
    for (r, t) in totals.iter().enumerate() {
        let busy = t.busy_ns;
        total_busy += busy;
        let peak = t.peak_activation;
        let (bytes, units) = match unit {
            MemoryUnit::Bytes => (Some(peak), None),
            MemoryUnit::Units => (None, Some(peak)),
        };
        let static_bytes = costs.static_bytes(Rank(r as u32));
        ranks.push(RankMetrics {
            rank: r as u32,
            busy_s: ns_to_s(busy),
            bubble_ratio: if makespan == 0 {
                0.0
            } else {
                1.0 - busy as f64 / makespan as f64
            },
            peak_activation_bytes: bytes,
            peak_activation_units: units,
            static_bytes: (unit == MemoryUnit::Bytes).then_some(static_bytes),
            peak_inflight_microbatches: t.peak_inflight,
            all_to_all: all_to_all_time(&schedule.ranks[r], costs),
        });
    }
    let lb = lower_bound_ns(schedule, costs);
    let all_to_all = ranks
        .iter()
        .filter_map(|r| r.all_to_all)
        .max_by(|a, b| a.exposed_s.total_cmp(&b.exposed_s));
    Metrics {
        makespan_s: ns_to_s(makespan),
        bubble_ratio: if makespan == 0 {
            0.0
        } else {
            1.0 - total_busy as f64 / (p as f64 * makespan as f64)
        },
        lower_bound_s: ns_to_s(lb),
        gap_to_lower_bound: if lb == 0 {
            0.0
        } else {
            makespan as f64 / lb as f64 - 1.0
        },
        ranks,
        all_to_all,
    }
}
