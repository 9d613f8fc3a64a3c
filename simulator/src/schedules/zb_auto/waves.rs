//! The wave construction of the Zero Bubble authors' heuristic scheduler, one of zb-auto's
//! candidate families (loop placement, one stage per rank).
//!
//! Source of the method: Qi et al., "Zero Bubble Pipeline Parallelism" (ICLR 2024), and its
//! public implementation's `Graph.manual_order` (sail-sg/zero-bubble-pipeline-parallelism,
//! tag zero-bubble-v0.1.0, `megatron/core/pipeline_parallel/auto_schedule.py`), written here
//! afresh over flatpipe's cost model (costs and memory per stage and microbatch, transfers by
//! the cost model). Microbatch by microbatch, each stage's clock advances as actions are put:
//!
//! - microbatch 0: every stage's F, then as many further F per stage as fit before the first
//!   backward can arrive (or, `allow_bubble_before_first_b`, as long as they end by then) and
//!   under the memory limit, at most as many as the stage before; then B (dgrad) from the last
//!   stage down;
//! - microbatch i > 0: an F on every stage that should take one (with `prioritize_b`, a stage
//!   two or more F ahead of the next one skips its F when that would delay the next stage's
//!   B, or when the bubble it would leave is at most the largest bubble so far less its own),
//!   never more than the next stage; before an F or a B, the W that fit before its input
//!   arrives, and W to make room under the limit (`no_bubble_greedy`: also a W that overruns
//!   the arrival when the bubble is within the largest so far); then B of microbatch i from the
//!   last stage down (the first stage finishes its W once every F is done);
//! - finally every stage's remaining W.
//!
//! Eight settings of the three switches; [`wave_orders`] returns each one's per-rank action
//! lists and the makespan its construction's clocks reach. A setting that cannot keep the limit
//! gives none; one whose order is not a valid schedule (the heuristic's own assertions fail on
//! some per-stage costs) is rejected by zb-auto's validation and replay like any candidate.

use crate::costs::CostModel;
use crate::ir::{Action, ActionKind, ComputeAction, MicrobatchId, StageId};

/// One setting of the wave construction's three switches.
#[derive(Debug, Clone, Copy)]
struct Switches {
    allow_bubble_before_first_b: bool,
    prioritize_b: bool,
    no_bubble_greedy: bool,
}

/// The switches' bits in a setting's index (`0..8`) and in [`Waves::mattered`].
const ALLOW_BUBBLE_BEFORE_FIRST_B: u8 = 1;
const PRIORITIZE_B: u8 = 2;
const NO_BUBBLE_GREEDY: u8 = 4;

impl Switches {
    fn of(bits: u8) -> Self {
        Switches {
            allow_bubble_before_first_b: bits & ALLOW_BUBBLE_BEFORE_FIRST_B != 0,
            prioritize_b: bits & PRIORITIZE_B != 0,
            no_bubble_greedy: bits & NO_BUBBLE_GREEDY != 0,
        }
    }
}

/// The wave state of `p` stages (one per rank) and `m` microbatches.
struct Waves<'a, C: CostModel> {
    costs: &'a C,
    p: usize,
    m: usize,
    limit: f64,
    /// Per stage: F, I and W put so far.
    nf: Vec<usize>,
    ni: Vec<usize>,
    nw: Vec<usize>,
    /// Per stage: its clock (the end of its last action), its activation memory, the idle time
    /// its actions waited since its first F.
    clock: Vec<u64>,
    mem: Vec<f64>,
    bubble: Vec<u64>,
    /// The largest of `bubble` (bubbles only grow, so a running maximum).
    max_bubble: u64,
    /// Per stage, whether it takes an F in the current wave (kept to reuse its allocation).
    take: Vec<bool>,
    /// Completion times of F and I per (stage, microbatch).
    done_f: Vec<u64>,
    done_i: Vec<u64>,
    order: Vec<Vec<Action>>,
    /// The switches (bits as in a setting's index) whose value decided something so far: at
    /// every other decision both values of the switch agree (for the first wave's switch: on
    /// every stage's count of extra F, after the clamp), so the settings that differ from this
    /// one only in switches outside `mattered` take the same path and build the same order
    /// (each decision reads one switch and the state, and the state is the same).
    mattered: u8,
}

impl<C: CostModel> Waves<'_, C> {
    fn cost(&self, kind: ActionKind, s: usize, mb: usize) -> u64 {
        self.costs
            .compute_ns(ComputeAction::new(s as u32, kind, mb as u32))
    }
    /// The activation change of `kind` on (s, mb): F keeps both parts, I frees its part, W
    /// the rest.
    fn delta(&self, kind: ActionKind, s: usize, mb: usize) -> f64 {
        let (ai, aw) = self
            .costs
            .activation(StageId(s as u32), MicrobatchId(mb as u32));
        match kind {
            ActionKind::F => ai + aw,
            ActionKind::I => -ai,
            _ => -aw,
        }
    }
    /// The transfer into stage `to` from its neighbour (F from `to - 1`, I from `to + 1`).
    fn comm(&self, from: usize, mb: usize, kind: ActionKind) -> u64 {
        self.costs
            .comm_ns(StageId(from as u32), MicrobatchId(mb as u32), kind)
    }
    /// Puts the next `kind` action of stage `s`; `None` when it would exceed the limit.
    fn put(&mut self, s: usize, kind: ActionKind) -> Option<()> {
        let mb = match kind {
            ActionKind::F => self.nf[s],
            ActionKind::I => self.ni[s],
            _ => self.nw[s],
        };
        if mb >= self.m {
            return None;
        }
        let d = self.delta(kind, s, mb);
        if self.mem[s] + d > self.limit * (1.0 + 1e-9) + 1e-9 {
            return None;
        }
        let cost = self.cost(kind, s, mb);
        let packed = self.clock[s] + cost;
        let mut end = packed;
        if kind == ActionKind::F && s > 0 {
            end = end.max(self.done_f[(s - 1) * self.m + mb] + self.comm(s - 1, mb, kind) + cost);
        }
        if kind == ActionKind::I && s + 1 < self.p {
            end = end.max(self.done_i[(s + 1) * self.m + mb] + self.comm(s + 1, mb, kind) + cost);
        }
        if self.nf[s] > 0 {
            self.bubble[s] += end - packed;
            self.max_bubble = self.max_bubble.max(self.bubble[s]);
        }
        self.clock[s] = end;
        self.mem[s] += d;
        match kind {
            ActionKind::F => {
                self.done_f[s * self.m + mb] = end;
                self.nf[s] += 1;
            }
            ActionKind::I => {
                self.done_i[s * self.m + mb] = end;
                self.ni[s] += 1;
            }
            _ => self.nw[s] += 1,
        }
        self.order[s].push(Action::Compute(ComputeAction::new(
            s as u32, kind, mb as u32,
        )));
        Some(())
    }
    /// Before stage `s`'s next action whose input arrives at `arrive`: the W that fit before
    /// it, and one more that overruns it unless the bubble it avoids is within the largest so
    /// far and `no_bubble_greedy` is off.
    fn fill_with_w(&mut self, s: usize, arrive: u64, sw: Switches) -> Option<()> {
        while self.nw[s] < self.ni[s]
            && self.clock[s] + self.cost(ActionKind::W, s, self.nw[s]) <= arrive
        {
            self.put(s, ActionKind::W)?;
        }
        if self.nw[s] < self.ni[s] && self.clock[s] < arrive {
            let within = arrive - self.clock[s] <= self.max_bubble.saturating_sub(self.bubble[s]);
            if within {
                self.mattered |= NO_BUBBLE_GREEDY;
            }
            if !within || sw.no_bubble_greedy {
                self.put(s, ActionKind::W)?;
            }
        }
        Some(())
    }
    /// W until `kind`'s next action on `s` fits the limit; `None` when no W is left.
    fn make_room(&mut self, s: usize, kind: ActionKind, mb: usize) -> Option<()> {
        let d = self.delta(kind, s, mb);
        while self.mem[s] + d > self.limit * (1.0 + 1e-9) + 1e-9 {
            if self.nw[s] >= self.ni[s] {
                return None;
            }
            self.put(s, ActionKind::W)?;
        }
        Some(())
    }

    fn first_wave(&mut self, sw: Switches) -> Option<()> {
        let p = self.p;
        for s in 0..p {
            self.put(s, ActionKind::F)?;
        }
        // The switch decides only how many F each stage adds; both answers are worked out, and
        // it matters only when they differ (often they differ at some stage and not after the
        // clamp below, and the settings then build the same order).
        let extra = self.first_wave_extra(sw.allow_bubble_before_first_b);
        if extra != self.first_wave_extra(!sw.allow_bubble_before_first_b) {
            self.mattered |= ALLOW_BUBBLE_BEFORE_FIRST_B;
        }
        for (s, &k) in extra.iter().enumerate() {
            for _ in 0..k {
                self.put(s, ActionKind::F)?;
            }
        }
        for s in (0..p).rev() {
            self.put(s, ActionKind::I)?;
        }
        Some(())
    }

    /// After microbatch 0's F on every stage: the further F each stage takes before the first
    /// backward can arrive (`allow_bubble`: as long as they end by then; else as long as they
    /// start before it) under the memory limit, at most as many as the stage before.
    fn first_wave_extra(&self, allow_bubble: bool) -> Vec<usize> {
        let (p, m) = (self.p, self.m);
        let mut extra = vec![0usize; p];
        let mut last = 0u64;
        for s in (0..p).rev() {
            if s == p - 1 {
                last = self.done_f[s * m] + self.cost(ActionKind::I, s, 0);
                continue;
            }
            let comm = self.comm(s + 1, 0, ActionKind::I);
            let (mut mem, mut clock) = (self.mem[s], self.clock[s]);
            loop {
                let mb = self.nf[s] + extra[s];
                if mb >= m || mem + self.delta(ActionKind::F, s, mb) > self.limit {
                    break;
                }
                let c = self.cost(ActionKind::F, s, mb);
                let stop = if allow_bubble {
                    clock + c > last + comm
                } else {
                    clock >= last + comm
                };
                if stop {
                    break;
                }
                mem += self.delta(ActionKind::F, s, mb);
                clock += c;
                extra[s] += 1;
            }
            last = clock.max(last + comm) + self.cost(ActionKind::I, s, 0);
        }
        for s in 1..p {
            while extra[s] > 0 && extra[s] >= extra[s - 1] && self.nf[s] + extra[s] < m {
                extra[s] -= 1;
            }
        }
        extra
    }

    /// Whether stage `s` takes an F in this wave (before the next stage's limit).
    fn wants_f(&mut self, s: usize, sw: Switches) -> bool {
        if self.nf[s] >= self.m {
            return false;
        }
        if !(s + 1 < self.p && self.nf[s] >= self.nf[s + 1] + 2) {
            return true;
        }
        // Two or more F ahead of the next stage: `prioritize_b` decides when its rule says no.
        let prioritized = self.prioritized_wants_f(s);
        if !prioritized {
            self.mattered |= PRIORITIZE_B;
        }
        prioritized || !sw.prioritize_b
    }

    /// `prioritize_b`'s answer for stage `s`, two or more F ahead of stage `s + 1`: no F when
    /// it would delay the next stage's B, or when the bubble it would leave is at most the
    /// largest so far less its own.
    fn prioritized_wants_f(&self, s: usize) -> bool {
        let m = self.m;
        let next = self.clock[s + 1]
            + self.cost(ActionKind::F, s + 1, self.nf[s + 1].min(m - 1))
            + self.cost(ActionKind::I, s + 1, self.ni[s + 1].min(m - 1))
            + self.comm(s + 1, self.ni[s + 1].min(m - 1), ActionKind::I);
        if self.clock[s] >= next {
            return false;
        }
        let mb = self.nf[s];
        let mut mem = self.mem[s] + self.delta(ActionKind::F, s, mb);
        let (mut w_cost, mut k) = (0u64, 0usize);
        while mem > self.limit && self.nw[s] + k < self.ni[s] {
            w_cost += self.cost(ActionKind::W, s, self.nw[s] + k);
            mem += self.delta(ActionKind::W, s, self.nw[s] + k);
            k += 1;
        }
        if self.clock[s] + self.cost(ActionKind::F, s, mb) + w_cost <= next {
            return true;
        }
        next - self.clock[s] > self.max_bubble.saturating_sub(self.bubble[s])
    }

    fn wave(&mut self, i: usize, sw: Switches) -> Option<()> {
        let (p, m) = (self.p, self.m);
        let mut take = std::mem::take(&mut self.take);
        take.clear();
        for s in 0..p {
            let t = self.wants_f(s, sw);
            take.push(t);
        }
        for s in (0..p.saturating_sub(1)).rev() {
            take[s] = take[s] && take[s + 1];
        }
        for (s, &t) in take.iter().enumerate() {
            if !t {
                continue;
            }
            let mb = self.nf[s];
            self.make_room(s, ActionKind::F, mb)?;
            if s > 0 {
                let arrive = self.done_f[(s - 1) * m + mb] + self.comm(s - 1, mb, ActionKind::F);
                self.fill_with_w(s, arrive, sw)?;
            }
            self.put(s, ActionKind::F)?;
        }
        self.take = take;
        for s in (0..p).rev() {
            self.make_room(s, ActionKind::I, i)?;
            if s + 1 < p {
                let arrive = self.done_i[(s + 1) * m + i] + self.comm(s + 1, i, ActionKind::I);
                self.fill_with_w(s, arrive, sw)?;
            }
            if s == 0 && self.nf[s] == m {
                while self.nw[s] < self.ni[s] {
                    self.put(s, ActionKind::W)?;
                }
            }
            self.put(s, ActionKind::I)?;
        }
        Some(())
    }
}

/// One setting's order from the wave construction.
#[derive(Debug, Clone, PartialEq)]
pub struct WaveOrder {
    /// Per rank (= stage), its actions in order.
    pub ranks: Vec<Vec<Action>>,
    /// The latest stage clock of the construction (ns): the makespan of `ranks` when no
    /// transfer waits for its link (the construction does not queue transfers; a replay does,
    /// so a replay's makespan is never less). zb-auto replays the orders in this order, the
    /// likely best first, so the others stop early.
    pub makespan_estimate_ns: u64,
}

/// The wave construction's per-rank action lists for `p` stages in loop placement (one per
/// rank) and `m` microbatches under `costs` and the per-rank activation `limit`, per setting of
/// its switches (index = the switches' bits) that keeps the limit: `Some(order)`, or `None` for
/// a setting whose order is the same as an earlier setting's in the list (not built: it differs
/// from it only in switches that decided nothing on the way; `Waves::mattered`). Settings
/// that cannot keep the limit are left out, as are their copies.
pub fn wave_orders<C: CostModel>(p: u32, m: u32, costs: &C, limit: f64) -> Vec<Option<WaveOrder>> {
    wave_orders_with(p, m, costs, limit, true)
}

/// [`wave_orders`], or with `skip_copies` off every setting built (each copy as `Some`).
fn wave_orders_with<C: CostModel>(
    p: u32,
    m: u32,
    costs: &C,
    limit: f64,
    skip_copies: bool,
) -> Vec<Option<WaveOrder>> {
    let (p, m) = (p as usize, m as usize);
    let mut out = Vec::new();
    if p == 0 || m == 0 {
        return out;
    }
    // Per setting not built: whether the setting whose copy it is kept the limit.
    let mut copy_of_built: [Option<bool>; 8] = [None; 8];
    for bits in 0..8u8 {
        if let Some(built) = copy_of_built[bits as usize] {
            if built {
                out.push(None);
            }
            continue;
        }
        let sw = Switches::of(bits);
        let mut w = Waves {
            costs,
            p,
            m,
            limit,
            nf: vec![0; p],
            ni: vec![0; p],
            nw: vec![0; p],
            clock: vec![0; p],
            mem: vec![0.0; p],
            bubble: vec![0; p],
            max_bubble: 0,
            take: Vec::with_capacity(p),
            done_f: vec![0; p * m],
            done_i: vec![0; p * m],
            order: (0..p).map(|_| Vec::with_capacity(3 * m)).collect(),
            mattered: 0,
        };
        let built = (|| {
            w.first_wave(sw)?;
            for i in 1..m {
                w.wave(i, sw)?;
            }
            for s in 0..p {
                while w.nw[s] < m {
                    w.put(s, ActionKind::W)?;
                }
            }
            Some(())
        })();
        let built = built.is_some() && w.nf.iter().all(|&n| n == m) && w.ni.iter().all(|&n| n == m);
        if skip_copies {
            for other in bits + 1..8 {
                if (other ^ bits) & w.mattered == 0 {
                    copy_of_built[other as usize] = Some(built);
                }
            }
        }
        if built {
            out.push(Some(WaveOrder {
                makespan_estimate_ns: w.clock.iter().copied().max().unwrap_or(0),
                ranks: w.order,
            }));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::costs::{MemoryUnit, StageCosts, UniformCostSpec, UniformCosts};
    use crate::ir::Rank;

    /// Costs per (stage, microbatch) from a fixed hash, as a step of variable-length
    /// microbatches gives: F in [1, 3) ms, I = 1.1-2 F, W = 0.3-1.3 F, activations in proportion
    /// to F (units: F's milliseconds), comm 0.1 ms.
    struct Varied;

    impl Varied {
        fn f(s: StageId, mb: MicrobatchId) -> u64 {
            let h = (s.0 as u64 * 0x9e37_79b9 + mb.0 as u64 * 0x85eb_ca6b) % 2000;
            1_000_000 + h * 1000
        }
    }

    impl CostModel for Varied {
        fn compute_ns(&self, a: ComputeAction) -> u64 {
            let f = Self::f(a.stage, a.microbatch);
            let x = (a.stage.0 as u64 * 7 + a.microbatch.0 as u64 * 13) % 10;
            match a.kind {
                ActionKind::F | ActionKind::Fo => f,
                ActionKind::I => f * (11 + x) / 10,
                ActionKind::W => f * (3 + x) / 10,
                ActionKind::B => f * (11 + x) / 10 + f * (3 + x) / 10,
            }
        }
        fn comm_ns(&self, _: StageId, _: MicrobatchId, _: ActionKind) -> u64 {
            100_000
        }
        fn activation(&self, s: StageId, mb: MicrobatchId) -> (f64, f64) {
            let a = Self::f(s, mb) as f64 / 1e6;
            (0.4 * a, 0.6 * a)
        }
        fn optimizer_ns(&self, _: Rank) -> u64 {
            0
        }
        fn memory_unit(&self) -> MemoryUnit {
            MemoryUnit::Units
        }
    }

    /// The construction's makespan is the replay's when no transfer takes time (both compute
    /// the same as-soon-as-possible times), and never more than the replay's when transfers do
    /// (the replay also queues them on their link): uniform, per-stage and per-microbatch
    /// costs, p = 2-8, limits from tight to none.
    #[test]
    fn the_makespan_estimate_is_the_replays_without_transfer_time() {
        for p in 2..=8u32 {
            for m in [1, p, 2 * p + 1, 24] {
                for comm in [0.0, 0.1] {
                    let spec = UniformCostSpec {
                        f: 1.0,
                        b: 1.2,
                        w: 0.5,
                        comm,
                        fb: None,
                        fo: None,
                        fsdp: Default::default(),
                    };
                    estimate_vs_replay(p, m, &UniformCosts::new(&spec, 1), comm == 0.0);
                    let f: Vec<f64> = (0..p).map(|s| 1.0 + 0.5 * f64::from(s % 3)).collect();
                    let b: Vec<f64> = f.iter().map(|x| 2.0 * x).collect();
                    let w: Vec<f64> = (0..p).map(|s| 0.5 + 0.25 * f64::from(s)).collect();
                    let c = StageCosts::new(&f, &b, &w, comm).unwrap();
                    estimate_vs_replay(p, m, &c, comm == 0.0);
                }
                estimate_vs_replay(p, m, &Varied, false);
            }
        }
    }

    fn estimate_vs_replay<C: CostModel>(p: u32, m: u32, c: &C, exact: bool) {
        for limit in [p as f64, 2.0 * p as f64, 1e9] {
            for order in wave_orders_with(p, m, c, limit, false)
                .into_iter()
                .flatten()
            {
                let s = crate::ir::Schedule {
                    name: "waves".into(),
                    placement: crate::ir::Placement::looped(p, 1),
                    num_microbatches: m,
                    num_fo_microbatches: 0,
                    chunks: Vec::new(),
                    ranks: order.ranks,
                };
                let replayed = crate::replay::replay(&s, c).unwrap().makespan_ns();
                let estimate = order.makespan_estimate_ns;
                if exact {
                    assert_eq!(estimate, replayed, "p={p} m={m} limit={limit}");
                } else {
                    assert!(
                        estimate <= replayed,
                        "p={p} m={m} limit={limit}: {estimate} > {replayed}"
                    );
                }
            }
        }
    }

    /// Skipping the settings that take an earlier one's path leaves every other setting's
    /// order as it was, and each skipped one is a copy of an earlier order: on uniform,
    /// per-stage and per-microbatch costs, p = 2-8, m = 1-24, limits from tight to none.
    #[test]
    fn skipped_settings_are_copies_of_earlier_orders() {
        let (mut skipped, mut settings) = (0, 0);
        let mut count = |(s, n): (usize, usize)| {
            skipped += s;
            settings += n;
        };
        for p in 2..=8u32 {
            for m in [1, 2, p - 1, p, p + 1, 2 * p, 24] {
                for (f, b, w) in [
                    (1.0, 1.0, 1.0),
                    (1.0, 2.0, 1.0),
                    (1.0, 1.2, 0.5),
                    (2.0, 1.0, 3.0),
                ] {
                    let spec = UniformCostSpec {
                        f,
                        b,
                        w,
                        comm: 0.1,
                        fb: None,
                        fo: None,
                        fsdp: Default::default(),
                    };
                    let c = UniformCosts::new(&spec, 1);
                    for limit in [
                        p as f64 / 2.0,
                        p as f64,
                        1.5 * p as f64,
                        2.0 * p as f64,
                        1e9,
                    ] {
                        count(compare(p, m, &c, limit));
                    }
                }
                // Uneven stages: the first and last heavier, as with an embedding and a head.
                let f: Vec<f64> = (0..p)
                    .map(|s| if s == 0 || s == p - 1 { 1.5 } else { 1.0 })
                    .collect();
                let b: Vec<f64> = f.iter().map(|x| 2.0 * x).collect();
                let w: Vec<f64> = (0..p).map(|s| 0.5 + 0.25 * s as f64).collect();
                let c = StageCosts::new(&f, &b, &w, 0.05).unwrap();
                for limit in [p as f64, 2.0 * p as f64, 1e9] {
                    count(compare(p, m, &c, limit));
                }
                for limit in [2.0 * p as f64, 4.0 * p as f64, 1e9] {
                    count(compare(p, m, &Varied, limit));
                }
            }
        }
        // The skipping is worth having: a share of the settings are copies.
        assert!(skipped > 0 && skipped < settings, "{skipped} of {settings}");
    }

    /// At p = 16, m = 64, f = b = w = 1 (comm 0.05) under p units the first wave's switch gives
    /// other extra F at some stage before the clamp to "no more than the stage before" and the
    /// same after it, so its two values build the same order: 8 settings, 2 distinct orders,
    /// and only those 2 are built (the switch was counted as deciding, and 4 were built,
    /// before the first wave compared the clamped answers).
    #[test]
    fn only_distinct_orders_are_built_when_the_first_wave_clamp_agrees() {
        let spec = UniformCostSpec {
            f: 1.0,
            b: 1.0,
            w: 1.0,
            comm: 0.05,
            fb: None,
            fo: None,
            fsdp: Default::default(),
        };
        let c = UniformCosts::new(&spec, 1);
        let all = wave_orders_with(16, 64, &c, 16.0, false);
        let mut distinct: Vec<&WaveOrder> = Vec::new();
        for o in all.iter().flatten() {
            if !distinct.contains(&o) {
                distinct.push(o);
            }
        }
        assert_eq!((all.len(), distinct.len()), (8, 2));
        let built = wave_orders(16, 64, &c, 16.0);
        assert_eq!(built.iter().flatten().count(), 2);
        // Exactly the distinct orders, each once.
        assert_eq!(built.iter().flatten().count(), distinct.len());
        assert!(
            distinct
                .iter()
                .all(|d| built.iter().flatten().any(|b| b == *d))
        );
        compare(16, 64, &c, 16.0);
    }

    /// (settings skipped, settings built or skipped) for one case, after checking it.
    fn compare<C: CostModel>(p: u32, m: u32, c: &C, limit: f64) -> (usize, usize) {
        let all = wave_orders_with(p, m, c, limit, false);
        let fast = wave_orders(p, m, c, limit);
        assert_eq!(all.len(), fast.len(), "p={p} m={m} limit={limit}");
        let mut skipped = 0;
        for (j, (a, f)) in all.iter().zip(&fast).enumerate() {
            let a = a.as_ref().expect("every setting built");
            match f {
                Some(f) => assert_eq!(a, f, "p={p} m={m} limit={limit} setting {j}"),
                None => {
                    skipped += 1;
                    assert!(
                        fast[..j].iter().flatten().any(|e| e == a),
                        "p={p} m={m} limit={limit}: skipped setting {j} is no copy of an earlier order"
                    );
                }
            }
        }
        (skipped, all.len())
    }
}
