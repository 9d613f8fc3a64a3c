//! The exact optimum of one step: a branch and bound over every schedule of F, I and W actions
//! under a per-rank activation-memory limit, for small instances (the tests use p <= 4,
//! m <= 8) and, with a time limit, as `flatpipe simulate --exact` on larger ones, where it
//! reports the best schedule found and the best bound.
//!
//! **Model.** The replay's ([`crate::replay`]): every stage runs F, I (dgrad) and W (wgrad) of
//! each microbatch on its rank, one action at a time; F(s) needs F(s-1)'s output, I(s) needs
//! I(s+1)'s gradient (the last stage's needs its own F), W needs I; a transfer between stages
//! on different ranks takes the cost model's time on the link of that ordered rank pair, links
//! carrying their transfers one at a time in the order the sender issues them; a rank runs its
//! optimizer step after its last action. Memory follows [`crate::replay::metrics`]: F allocates its
//! activations at its start, I allocates what it recomputes at its start and frees the part only
//! dgrad needed at its end, W frees the rest at its end. A fused B is I then W at once, so the
//! split schedules include every fused one; overlapped F + B pairs are not searched.
//!
//! **Search.** A schedule is fixed by each rank's action order: given the orders, starting each
//! action as early as its data, its rank and its link allow is optimal (the makespan is a
//! longest path and memory depends only on the orders). The search appends one action at a
//! time to some rank's order, at its earliest start (every semi-active schedule is reachable).
//! Costs and activations must not vary by microbatch; then, on every stage, running each kind
//! (F, I, W) in microbatch order loses nothing: in any schedule, relabel the k-th F (I, W) of
//! each stage as microbatch k's; since equal-cost actions that start in order end in order,
//! the k-th F of stage s starts after k outputs of stage s - 1 have arrived, so after the k-th
//! of them, and likewise for I and W; rank times, link use and memory (which depends only on
//! the counts of actions done) are unchanged. So a node branches on at most three actions per
//! stage: the next F, I and W.
//!
//! **Pruning.**
//! - Bound: per rank, the preemptive one-machine schedule with release times and tails
//!   (Jackson's rule; Carlier 1982, "The one-machine sequencing problem", EJOR 11): the heads
//!   are each remaining action's earliest start with resources relaxed except its own rank's
//!   clock and its stage's order, the tails the longest path from its end through its
//!   microbatch's remaining chain (transfers and the last rank's optimizer included). Its value
//!   bounds every completion below, and at the root it bounds the optimum.
//! - Dominance: two partial schedules with the same action counts per stage hold the same
//!   memory; if one's rank clocks, link clocks and pending arrival times are all no later than
//!   the other's, every completion of the other is no better on it. Visited states are kept
//!   (up to [`ExactOptions::memo_states`]) and a dominated one is cut.
//! - An incumbent (zb-auto's schedule, say) starts the search with its makespan.

use crate::costs::CostModel;
use crate::ir::{Action, ActionKind, ComputeAction, MicrobatchId, Placement, Schedule, StageId};
use crate::{Error, Result, replay, replay::metrics};
use std::collections::{BinaryHeap, HashMap};
use std::time::{Duration, Instant};

/// Limits of [`solve`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ExactOptions {
    /// Stop after this long and report the best schedule found and the root bound.
    pub time_limit: Option<Duration>,
    /// Stop after this many search nodes (deterministic, unlike the time limit).
    pub node_limit: Option<u64>,
    /// Most partial schedules kept for the dominance test (each ~100-400 bytes).
    pub memo_states: usize,
}

impl Default for ExactOptions {
    fn default() -> Self {
        ExactOptions {
            time_limit: None,
            node_limit: None,
            memo_states: 1 << 20,
        }
    }
}

/// Why the search stopped before proving optimality.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stop {
    /// [`ExactOptions::time_limit`] was reached.
    TimeLimit,
    /// [`ExactOptions::node_limit`] was reached.
    NodeLimit,
}

/// The result of [`solve`].
#[derive(Debug, Clone)]
pub struct ExactOutcome {
    /// The best schedule found (the incumbent if the search found none better), named `exact`
    /// when the search found it; `None` when no schedule fits the limit (then
    /// [`ExactOutcome::optimal`] says that none exists, if the search finished).
    pub schedule: Option<Schedule>,
    /// Its makespan, ns (the replay's).
    pub makespan_ns: Option<u64>,
    /// A lower bound on every schedule's makespan under the limit, ns: the makespan itself when
    /// optimal, else the root bound.
    pub lower_bound_ns: u64,
    /// True when the search finished: the schedule is optimal (or none fits).
    pub optimal: bool,
    /// Where the search stopped early.
    pub stopped: Option<Stop>,
    /// Search nodes visited.
    pub nodes: u64,
}

const NONE: usize = usize::MAX;

/// One stage's and one microbatch's costs, read once.
struct Inst {
    s_count: usize,
    m: usize,
    rank_of: Vec<usize>,
    stages_of: Vec<Vec<usize>>,
    f: Vec<u64>,
    i: Vec<u64>,
    w: Vec<u64>,
    /// Transfer after F of s to s + 1 (0 on one rank or after the last stage).
    comm_f: Vec<u64>,
    /// Transfer after I of s to s - 1 (0 on one rank or at stage 0).
    comm_b: Vec<u64>,
    /// The stage F of s sends its activations to ([`ComputeAction::sends`]), or [`NONE`].
    to_f: Vec<usize>,
    /// The stage I of s sends its input gradient to, or [`NONE`].
    to_b: Vec<usize>,
    /// The link (ordered rank pair) F of s sends on, or [`NONE`].
    link_f: Vec<usize>,
    link_b: Vec<usize>,
    num_links: usize,
    alloc_f: Vec<f64>,
    alloc_i: Vec<f64>,
    free_i: Vec<f64>,
    free_w: Vec<f64>,
    opt: Vec<u64>,
    limit: f64,
    /// Longest path from an action's end to the end of the step (its chain, then the last
    /// rank's optimizer), ns.
    tail_f: Vec<u64>,
    tail_i: Vec<u64>,
    tail_w: Vec<u64>,
}

impl Inst {
    /// The instance of `m` microbatches over `placement` under `costs`, each rank's
    /// activations at most `limit` (the cost model's unit), read once: arguments checked
    /// ([`check_arguments`], [`check_microbatch_independent`]), then per stage its compute,
    /// its transfers and links ([`Transfers`]), its memory effects and its tails ([`tails`]).
    ///
    /// # Errors
    /// As [`solve`]'s, but the incumbent's.
    fn new<C: CostModel>(placement: &Placement, m: u32, costs: &C, limit: f64) -> Result<Self> {
        let s_count = placement.num_stages() as usize;
        let p = placement.num_ranks as usize;
        check_arguments(s_count, m, limit)?;
        check_microbatch_independent(costs, s_count, m)?;
        let rank_of: Vec<usize> = placement.rank_of.iter().map(|r| r.idx()).collect();
        let mut stages_of = vec![Vec::new(); p];
        for (s, &r) in rank_of.iter().enumerate() {
            stages_of[r].push(s);
        }
        let get = |kind| {
            (0..s_count)
                .map(|s| costs.compute_ns(ComputeAction::new(s as u32, kind, 0)))
                .collect::<Vec<u64>>()
        };
        let (f, i, w) = (get(ActionKind::F), get(ActionKind::I), get(ActionKind::W));
        let Transfers {
            comm_f,
            comm_b,
            to_f,
            to_b,
            link_f,
            link_b,
            num_links,
        } = Transfers::new(costs, &rank_of, p);
        let (mut alloc_f, mut alloc_i, mut free_i, mut free_w) = (vec![], vec![], vec![], vec![]);
        for s in 0..s_count {
            let sid = StageId(s as u32);
            let (ai, aw) = costs.activation(sid, MicrobatchId(0));
            let rec = costs.recomputed(sid, MicrobatchId(0));
            alloc_f.push(ai + aw);
            alloc_i.push(rec);
            free_i.push(ai);
            free_w.push(aw + rec);
        }
        let opt: Vec<u64> = (0..p)
            .map(|r| costs.optimizer_ns(crate::ir::Rank(r as u32)))
            .collect();
        let [tail_f, tail_i, tail_w] = tails(&rank_of, [&f, &i, &w], &comm_f, &comm_b, &opt);
        Ok(Inst {
            s_count,
            m: m as usize,
            rank_of,
            stages_of,
            f,
            i,
            w,
            comm_f,
            comm_b,
            to_f,
            to_b,
            link_f,
            link_b,
            num_links,
            alloc_f,
            alloc_i,
            free_i,
            free_w,
            opt,
            limit: limit * (1.0 + 1e-9) + 1e-9,
            tail_f,
            tail_i,
            tail_w,
        })
    }
}

/// The exact solver's own limits on an instance of `s_count` stages and `m` microbatches under
/// an activation `limit`.
///
/// # Errors
/// [`Error::InvalidArgument`] for no stages or no microbatches, more than 65535 microbatches, or
/// a limit that is not finite and > 0.
fn check_arguments(s_count: usize, m: u32, limit: f64) -> Result<()> {
    if s_count == 0 || m == 0 {
        return Err(Error::invalid(
            "exact solver",
            format!("{s_count} stages, {m} microbatches"),
            ">= 1 stage and >= 1 microbatch",
        ));
    }
    if m > u32::from(u16::MAX) {
        return Err(Error::invalid(
            "microbatches",
            m,
            "<= 65535 for the exact solver",
        ));
    }
    if !(limit.is_finite() && limit > 0.0) {
        return Err(Error::invalid(
            "activation limit",
            limit,
            "a finite limit > 0",
        ));
    }
    Ok(())
}

/// Costs and activations must be the same for every microbatch (the FIFO argument of the
/// module docs needs it), and no stage may keep an output buffer: checked over `s_count`
/// stages and `m` microbatches against microbatch 0.
///
/// # Errors
/// [`Error::InvalidArgument`] naming the first stage and kind (or its activations, or its
/// output buffer) that differs.
fn check_microbatch_independent<C: CostModel>(costs: &C, s_count: usize, m: u32) -> Result<()> {
    let ca = |s: usize, kind, mb: u32| ComputeAction {
        stage: StageId(s as u32),
        microbatch: MicrobatchId(mb),
        kind,
    };
    for s in 0..s_count {
        for mb in 1..m {
            for kind in [ActionKind::F, ActionKind::I, ActionKind::W] {
                let (a, b) = (
                    costs.compute_ns(ca(s, kind, 0)),
                    costs.compute_ns(ca(s, kind, mb)),
                );
                if a != b {
                    return Err(Error::invalid(
                        format!("costs of stage {s}'s {}", kind.letter()),
                        format!("{a} ns for microbatch 0, {b} ns for microbatch {mb}"),
                        "the same for every microbatch (the exact solver's instances)",
                    ));
                }
            }
            let sid = StageId(s as u32);
            if costs.activation(sid, MicrobatchId(0)) != costs.activation(sid, MicrobatchId(mb))
                || costs.recomputed(sid, MicrobatchId(0)) != costs.recomputed(sid, MicrobatchId(mb))
            {
                return Err(Error::invalid(
                    format!("activations of stage {s}"),
                    format!("different for microbatches 0 and {mb}"),
                    "the same for every microbatch (the exact solver's instances)",
                ));
            }
        }
        if costs.output_bytes(StageId(s as u32), MicrobatchId(0)) != 0.0 {
            return Err(Error::invalid(
                format!("output buffer of stage {s}"),
                costs.output_bytes(StageId(s as u32), MicrobatchId(0)),
                "0 (the exact solver models activations only)",
            ));
        }
    }
    Ok(())
}

/// Per stage, where its F and its I send ([`ComputeAction::sends`]), how long the transfer
/// takes and on which link: the fields of [`Inst`] of the same names.
struct Transfers {
    comm_f: Vec<u64>,
    comm_b: Vec<u64>,
    to_f: Vec<usize>,
    to_b: Vec<usize>,
    link_f: Vec<usize>,
    link_b: Vec<usize>,
    num_links: usize,
}

impl Transfers {
    /// The transfers of the stages placed on the ranks `rank_of` (one per stage, `p` ranks),
    /// their times of microbatch 0 under `costs` (ns); a transfer within a rank takes 0 and
    /// has no link. The links in use (ordered rank pairs) are numbered 0.. in the order of
    /// their pair: the dominance test compares their clocks.
    fn new<C: CostModel>(costs: &C, rank_of: &[usize], p: usize) -> Self {
        let s_count = rank_of.len();
        let mut comm_f = vec![0; s_count];
        let mut comm_b = vec![0; s_count];
        let mut link_f = vec![NONE; s_count];
        let mut link_b = vec![NONE; s_count];
        let to = |s: usize, kind| {
            let a = ComputeAction::new(s as u32, kind, 0);
            a.sends(s_count as u32).map_or(NONE, StageId::idx)
        };
        let to_f: Vec<usize> = (0..s_count).map(|s| to(s, ActionKind::F)).collect();
        let to_b: Vec<usize> = (0..s_count).map(|s| to(s, ActionKind::I)).collect();
        for s in 0..s_count {
            if to_f[s] != NONE && rank_of[s] != rank_of[to_f[s]] {
                comm_f[s] = costs.comm_ns(StageId(s as u32), MicrobatchId(0), ActionKind::F);
                link_f[s] = rank_of[s] * p + rank_of[to_f[s]];
            }
            if to_b[s] != NONE && rank_of[s] != rank_of[to_b[s]] {
                comm_b[s] = costs.comm_ns(StageId(s as u32), MicrobatchId(0), ActionKind::I);
                link_b[s] = rank_of[s] * p + rank_of[to_b[s]];
            }
        }
        let mut ids: Vec<usize> = link_f.iter().chain(&link_b).copied().collect();
        ids.retain(|&l| l != NONE);
        ids.sort_unstable();
        ids.dedup();
        for l in link_f.iter_mut().chain(link_b.iter_mut()) {
            if *l != NONE {
                *l = ids.binary_search(l).expect("a link in use");
            }
        }
        Transfers {
            comm_f,
            comm_b,
            to_f,
            to_b,
            link_f,
            link_b,
            num_links: ids.len(),
        }
    }
}

/// Per stage, the longest path from the end of its F, I and W to the end of the step (its
/// chain, then the last rank's optimizer), ns: `[tail_f, tail_i, tail_w]` of [`Inst`], from the
/// stages' ranks `rank_of`, their compute `[f, i, w]`, transfers `comm_f` and `comm_b` and the
/// ranks' optimizer steps `opt` (ns).
fn tails(
    rank_of: &[usize],
    [f, i, w]: [&[u64]; 3],
    comm_f: &[u64],
    comm_b: &[u64],
    opt: &[u64],
) -> [Vec<u64>; 3] {
    let s_count = rank_of.len();
    let mut tail_w = vec![0; s_count];
    let mut tail_i = vec![0; s_count];
    let mut tail_f = vec![0; s_count];
    for s in 0..s_count {
        tail_w[s] = opt[rank_of[s]];
        tail_i[s] = w[s] + tail_w[s];
        if s > 0 {
            tail_i[s] = tail_i[s].max(comm_b[s] + i[s - 1] + tail_i[s - 1]);
        }
    }
    for s in (0..s_count).rev() {
        tail_f[s] = i[s] + tail_i[s];
        if s + 1 < s_count {
            tail_f[s] = tail_f[s].max(comm_f[s] + f[s + 1] + tail_f[s + 1]);
        }
    }
    [tail_f, tail_i, tail_w]
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Kind {
    I = 0,
    F = 1,
    W = 2,
}

/// What one append changed, to undo it.
struct Undo {
    rank: usize,
    free: u64,
    mem: f64,
    link: usize,
    link_free: u64,
}

struct Search<'a> {
    inst: &'a Inst,
    nf: Vec<usize>,
    ni: Vec<usize>,
    nw: Vec<usize>,
    /// Arrival of (stage, mb)'s input at that stage (stage > 0).
    act_ready: Vec<u64>,
    /// Arrival of (stage, mb)'s output gradient (the last stage: its own F's end).
    grad_ready: Vec<u64>,
    f_end: Vec<u64>,
    i_end: Vec<u64>,
    free: Vec<u64>,
    mem: Vec<f64>,
    link_free: Vec<u64>,
    order: Vec<Vec<(usize, Kind, usize)>>,
    left: usize,
    best: u64,
    best_order: Option<Vec<Vec<(usize, Kind, usize)>>>,
    nodes: u64,
    stopped: Option<Stop>,
    deadline: Option<Instant>,
    node_limit: u64,
    memo: HashMap<Box<[u16]>, Vec<Box<[u64]>>>,
    memo_len: usize,
    memo_cap: usize,
    // Scratch for the bound.
    ef: Vec<u64>,
    ei: Vec<u64>,
    jobs: Vec<(u64, u64, u64)>,
}

impl<'a> Search<'a> {
    fn new(inst: &'a Inst, opts: &ExactOptions) -> Self {
        let n = inst.s_count * inst.m;
        let p = inst.stages_of.len();
        Search {
            inst,
            nf: vec![0; inst.s_count],
            ni: vec![0; inst.s_count],
            nw: vec![0; inst.s_count],
            act_ready: vec![0; n],
            grad_ready: vec![0; n],
            f_end: vec![0; n],
            i_end: vec![0; n],
            free: vec![0; p],
            mem: vec![0.0; p],
            link_free: vec![0; inst.num_links],
            order: vec![Vec::new(); p],
            left: 3 * n,
            best: u64::MAX,
            best_order: None,
            nodes: 0,
            stopped: None,
            deadline: opts.time_limit.map(|d| Instant::now() + d),
            node_limit: opts.node_limit.unwrap_or(u64::MAX),
            memo: HashMap::new(),
            memo_len: 0,
            memo_cap: opts.memo_states,
            ef: vec![0; n],
            ei: vec![0; n],
            jobs: Vec::new(),
        }
    }

    /// The next action of each kind on stage `s` that may be appended now, with its earliest
    /// start; F only when its activations fit.
    fn candidates(&self, out: &mut Vec<(u64, Kind, usize)>) {
        let (inst, m) = (self.inst, self.inst.m);
        for s in 0..inst.s_count {
            let r = inst.rank_of[s];
            let k = self.nf[s];
            if k < m
                && (s == 0 || self.nf[s - 1] > k)
                && self.mem[r] + inst.alloc_f[s] <= inst.limit
            {
                let ready = if s == 0 { 0 } else { self.act_ready[s * m + k] };
                out.push((self.free[r].max(ready), Kind::F, s));
            }
            let k = self.ni[s];
            if k < self.nf[s]
                && (s + 1 == inst.s_count || self.ni[s + 1] > k)
                && self.mem[r] + inst.alloc_i[s] <= inst.limit
            {
                let ready = self.grad_ready[s * m + k].max(self.f_end[s * m + k]);
                out.push((self.free[r].max(ready), Kind::I, s));
            }
            let k = self.nw[s];
            if k < self.ni[s] {
                out.push((self.free[r].max(self.i_end[s * m + k]), Kind::W, s));
            }
        }
    }

    fn send(&mut self, link: usize, end: u64, comm: u64) -> (usize, u64, u64) {
        if link == NONE {
            return (NONE, 0, end);
        }
        let old = self.link_free[link];
        let arrive = end.max(old) + comm;
        self.link_free[link] = arrive;
        (link, old, arrive)
    }

    fn apply(&mut self, start: u64, kind: Kind, s: usize) -> Undo {
        let inst = self.inst;
        let m = inst.m;
        let r = inst.rank_of[s];
        let mut undo = Undo {
            rank: r,
            free: self.free[r],
            mem: self.mem[r],
            link: NONE,
            link_free: 0,
        };
        match kind {
            Kind::F => {
                let k = self.nf[s];
                let end = start + inst.f[s];
                self.f_end[s * m + k] = end;
                self.mem[r] += inst.alloc_f[s];
                if inst.to_f[s] != NONE {
                    let (l, old, arrive) = self.send(inst.link_f[s], end, inst.comm_f[s]);
                    (undo.link, undo.link_free) = (l, old);
                    self.act_ready[inst.to_f[s] * m + k] = arrive;
                } else {
                    self.grad_ready[s * m + k] = end;
                }
                self.nf[s] += 1;
                self.free[r] = end;
            }
            Kind::I => {
                let k = self.ni[s];
                let end = start + inst.i[s];
                self.i_end[s * m + k] = end;
                self.mem[r] += inst.alloc_i[s] - inst.free_i[s];
                if inst.to_b[s] != NONE {
                    let (l, old, arrive) = self.send(inst.link_b[s], end, inst.comm_b[s]);
                    (undo.link, undo.link_free) = (l, old);
                    self.grad_ready[inst.to_b[s] * m + k] = arrive;
                }
                self.ni[s] += 1;
                self.free[r] = end;
            }
            Kind::W => {
                self.mem[r] -= inst.free_w[s];
                self.nw[s] += 1;
                self.free[r] = start + inst.w[s];
            }
        }
        self.order[r].push((s, kind, 0));
        self.left -= 1;
        undo
    }

    fn revert(&mut self, kind: Kind, s: usize, u: Undo) {
        match kind {
            Kind::F => self.nf[s] -= 1,
            Kind::I => self.ni[s] -= 1,
            Kind::W => self.nw[s] -= 1,
        }
        self.free[u.rank] = u.free;
        self.mem[u.rank] = u.mem;
        if u.link != NONE {
            self.link_free[u.link] = u.link_free;
        }
        self.order[u.rank].pop();
        self.left += 1;
    }

    /// The bound of the module docs over every completion of the current partial schedule.
    fn bound(&mut self) -> u64 {
        let inst = self.inst;
        let (m, sc) = (inst.m, inst.s_count);
        // Heads: earliest ends with only the rank's clock, the stage's order and the data.
        for s in 0..sc {
            let r = inst.rank_of[s];
            let mut prev = 0;
            for k in 0..m {
                if k < self.nf[s] {
                    self.ef[s * m + k] = self.f_end[s * m + k];
                    continue;
                }
                let ready = if s == 0 {
                    0
                } else if k < self.nf[s - 1] {
                    self.act_ready[s * m + k]
                } else {
                    self.ef[(s - 1) * m + k] + inst.comm_f[s - 1]
                };
                let start = self.free[r].max(ready).max(prev);
                prev = start + inst.f[s];
                self.ef[s * m + k] = prev;
            }
        }
        for s in (0..sc).rev() {
            let r = inst.rank_of[s];
            let mut prev = 0;
            for k in 0..m {
                if k < self.ni[s] {
                    self.ei[s * m + k] = self.i_end[s * m + k];
                    continue;
                }
                let ready = if s + 1 == sc {
                    self.ef[s * m + k]
                } else if k < self.ni[s + 1] {
                    self.grad_ready[s * m + k]
                } else {
                    self.ei[(s + 1) * m + k] + inst.comm_b[s + 1]
                };
                let start = self.free[r].max(ready).max(self.ef[s * m + k]).max(prev);
                prev = start + inst.i[s];
                self.ei[s * m + k] = prev;
            }
        }
        let mut lb = 0;
        for (r, stages) in inst.stages_of.iter().enumerate() {
            self.jobs.clear();
            for &s in stages {
                for k in self.nf[s]..m {
                    self.jobs
                        .push((self.ef[s * m + k] - inst.f[s], inst.f[s], inst.tail_f[s]));
                }
                for k in self.ni[s]..m {
                    self.jobs
                        .push((self.ei[s * m + k] - inst.i[s], inst.i[s], inst.tail_i[s]));
                }
                let mut prev = 0;
                for k in self.nw[s]..m {
                    let start = self.free[r].max(self.ei[s * m + k]).max(prev);
                    prev = start + inst.w[s];
                    self.jobs.push((start, inst.w[s], inst.tail_w[s]));
                }
            }
            let v = if self.jobs.is_empty() {
                self.free[r] + inst.opt[r]
            } else {
                let (cmax, with_tails) = jackson_preemptive(&mut self.jobs);
                with_tails.max(cmax + inst.opt[r])
            };
            lb = lb.max(v);
        }
        lb
    }

    /// False when a visited state with the same counts dominates this one (then it is cut);
    /// otherwise records it.
    fn fresh(&mut self) -> bool {
        let inst = self.inst;
        let m = inst.m;
        let mut key = Vec::with_capacity(3 * inst.s_count);
        for s in 0..inst.s_count {
            key.extend([self.nf[s] as u16, self.ni[s] as u16, self.nw[s] as u16]);
        }
        let mut sig: Vec<u64> = Vec::with_capacity(self.free.len() + self.link_free.len() + 8);
        sig.extend(&self.free);
        sig.extend(&self.link_free);
        for s in 0..inst.s_count {
            if s > 0 {
                sig.extend((self.nf[s]..self.nf[s - 1]).map(|k| self.act_ready[s * m + k]));
            }
            if s + 1 < inst.s_count {
                sig.extend((self.ni[s]..self.ni[s + 1]).map(|k| self.grad_ready[s * m + k]));
            }
        }
        let list = self.memo.entry(key.into_boxed_slice()).or_default();
        if list
            .iter()
            .any(|old| old.iter().zip(&sig).all(|(a, b)| a <= b))
        {
            return false;
        }
        let before = list.len();
        list.retain(|old| !old.iter().zip(&sig).all(|(a, b)| a >= b));
        self.memo_len -= before - list.len();
        if self.memo_len < self.memo_cap {
            list.push(sig.into_boxed_slice());
            self.memo_len += 1;
        }
        true
    }

    fn dfs(&mut self) {
        if self.stopped.is_some() {
            return;
        }
        self.nodes += 1;
        if self.nodes >= self.node_limit {
            self.stopped = Some(Stop::NodeLimit);
            return;
        }
        if self.nodes % 1024 == 0 && self.deadline.is_some_and(|d| Instant::now() >= d) {
            self.stopped = Some(Stop::TimeLimit);
            return;
        }
        if self.left == 0 {
            let t = (0..self.free.len())
                .map(|r| self.free[r] + self.inst.opt[r])
                .max()
                .unwrap_or(0);
            if t < self.best {
                self.best = t;
                self.best_order = Some(self.order.clone());
            }
            return;
        }
        if self.bound() >= self.best || !self.fresh() {
            return;
        }
        let mut cands = Vec::with_capacity(3 * self.inst.s_count);
        self.candidates(&mut cands);
        cands.sort_unstable();
        for (start, kind, s) in cands {
            let u = self.apply(start, kind, s);
            self.dfs();
            self.revert(kind, s, u);
            if self.stopped.is_some() {
                return;
            }
        }
    }
}

/// Preemptive one-machine schedule of `jobs` = (release, duration, tail) by Jackson's rule
/// (at every release or completion run the released job with the longest tail): returns
/// (its completion time, max over jobs of completion + tail), both lower bounds of any
/// non-preemptive schedule of the jobs on one machine (Carlier 1982).
fn jackson_preemptive(jobs: &mut [(u64, u64, u64)]) -> (u64, u64) {
    jobs.sort_unstable_by_key(|j| j.0);
    let mut heap: BinaryHeap<(u64, u64)> = BinaryHeap::new();
    let (mut t, mut i, mut best) = (0u64, 0usize, 0u64);
    while i < jobs.len() || !heap.is_empty() {
        if heap.is_empty() {
            t = t.max(jobs[i].0);
        }
        while i < jobs.len() && jobs[i].0 <= t {
            heap.push((jobs[i].2, jobs[i].1));
            i += 1;
        }
        let (q, rem) = heap.pop().expect("a released job");
        let next = jobs.get(i).map_or(u64::MAX, |j| j.0);
        let run = rem.min(next.saturating_sub(t));
        t += run;
        if run == rem {
            best = best.max(t + q);
        } else {
            heap.push((q, rem - run));
        }
    }
    (t, best)
}

fn peak_of(m: &metrics::Metrics) -> f64 {
    m.ranks
        .iter()
        .map(|r| {
            r.peak_activation_units
                .or(r.peak_activation_bytes)
                .unwrap_or(0.0)
        })
        .fold(0.0, f64::max)
}

/// The optimal schedule of `m` microbatches on `placement` under `costs`, keeping every
/// rank's peak activation memory at most `limit` (the cost model's unit: units under uniform
/// or per-stage costs, where 1F1B's rank 0 holds p), by the branch and bound of the module
/// docs. `incumbent`, if given and within the limit, starts the search with its makespan (it
/// is returned when nothing better exists). Exponential in the worst case: small instances
/// (p <= 4, m <= 8) finish in well under a second when the incumbent is near the optimum;
/// larger ones need `opts`' limits.
///
/// # Errors
/// [`Error::InvalidArgument`] when costs or activations vary by microbatch, a stage has an
/// output buffer, the limit is not > 0, there are no stages or microbatches, or the incumbent
/// does not match the placement and microbatch count.
pub fn solve<C: CostModel>(
    placement: &Placement,
    m: u32,
    costs: &C,
    limit: f64,
    incumbent: Option<&Schedule>,
    opts: &ExactOptions,
) -> Result<ExactOutcome> {
    let inst = Inst::new(placement, m, costs, limit)?;
    let mut search = Search::new(&inst, opts);
    let mut best_schedule = None;
    if let Some(s) = incumbent {
        if s.placement != *placement || s.num_microbatches != m || s.num_fo_microbatches != 0 {
            return Err(Error::invalid(
                "exact solver's incumbent",
                format!("{} ({} microbatches)", s.name, s.num_microbatches),
                format!("a schedule of the same placement and {m} microbatches"),
            ));
        }
        let t = replay::replay(s, costs)?;
        if peak_of(&metrics::metrics(s, costs, &t)) <= inst.limit {
            search.best = t.makespan_ns();
            best_schedule = Some(s.clone());
        }
    }
    let root = search.bound();
    search.dfs();
    let order = search.best_order.take();
    if let Some(order) = order {
        best_schedule = Some(schedule_of(&order, placement, m));
    }
    let optimal = search.stopped.is_none();
    let makespan_ns = best_schedule.as_ref().map(|_| search.best);
    Ok(ExactOutcome {
        schedule: best_schedule,
        makespan_ns,
        lower_bound_ns: if optimal {
            makespan_ns.unwrap_or(root)
        } else {
            root.min(search.best)
        },
        optimal,
        stopped: search.stopped,
        nodes: search.nodes,
    })
}

/// The per-rank orders as a schedule: the k-th action of each kind on a stage is microbatch k's.
fn schedule_of(order: &[Vec<(usize, Kind, usize)>], placement: &Placement, m: u32) -> Schedule {
    let mut count = vec![[0u32; 3]; placement.num_stages() as usize];
    let ranks = order
        .iter()
        .map(|acts| {
            acts.iter()
                .map(|&(s, kind, _)| {
                    let c = &mut count[s][kind as usize];
                    let mb = *c;
                    *c += 1;
                    let k = match kind {
                        Kind::F => ActionKind::F,
                        Kind::I => ActionKind::I,
                        Kind::W => ActionKind::W,
                    };
                    Action::new(s as u32, k, mb)
                })
                .collect()
        })
        .collect();
    Schedule {
        name: "exact".into(),
        placement: placement.clone(),
        num_microbatches: m,
        num_fo_microbatches: 0,
        ranks,
        chunks: Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jackson_matches_hand_schedules() {
        // One job: release 2, 3 long, tail 4: ends at 5, 9 with the tail.
        assert_eq!(jackson_preemptive(&mut [(2, 3, 4)]), (5, 9));
        // Two jobs at 0: (5, tail 0) and (1, tail 10): the long tail first: 1 + 10 = 11, then
        // the other ends at 6.
        assert_eq!(jackson_preemptive(&mut [(0, 5, 0), (0, 1, 10)]), (6, 11));
        // Preemption: A (0, 4, 0), B released at 1 (1, tail 5): A runs 0-1, B 1-2 (+5 = 7),
        // A resumes 2-5.
        assert_eq!(jackson_preemptive(&mut [(0, 4, 0), (1, 1, 5)]), (5, 7));
        // A gap: (0, 1, 0) then (10, 1, 0).
        assert_eq!(jackson_preemptive(&mut [(10, 1, 0), (0, 1, 0)]), (11, 11));
    }
}
