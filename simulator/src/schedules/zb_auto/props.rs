//! zb-auto's property tests over per-stage costs: never worse than the handcrafted
//! schedules, settings that decide alike build the same order, and the search picks what
//! replaying every candidate picks.

use super::priority::{Priority, WRule};
use super::*;
use crate::costs::MemoryUnit;
use crate::schedules::generators::ScheduleKind;

fn zb_auto<C: CostModel>(p: u32, v: u32, m: u32, costs: &C, limit: f64) -> Result<Schedule> {
    ScheduleKind::ZbAuto.build(p, v, m, costs, limit)
}
use crate::ir::Rank;
use crate::{replay, replay::metrics};
use proptest::prelude::*;

/// Per-stage (f, i, w) costs in ns, uniform over microbatches, unit activations per stage.
#[derive(Debug, Clone)]
struct StageCosts {
    pub f: Vec<u64>,
    pub i: Vec<u64>,
    pub w: Vec<u64>,
    pub comm: u64,
}

impl CostModel for StageCosts {
    fn compute_ns(&self, a: ComputeAction) -> u64 {
        let s = a.stage.idx();
        match a.kind {
            ActionKind::F | ActionKind::Fo => self.f[s],
            ActionKind::I => self.i[s],
            ActionKind::W => self.w[s],
            ActionKind::B => self.i[s] + self.w[s],
        }
    }
    fn comm_ns(&self, _: StageId, _: MicrobatchId, _: ActionKind) -> u64 {
        self.comm
    }
    fn activation(&self, _: StageId, _: MicrobatchId) -> (f64, f64) {
        (0.5, 0.5)
    }
    fn optimizer_ns(&self, _: Rank) -> u64 {
        0
    }
    fn memory_unit(&self) -> MemoryUnit {
        MemoryUnit::Units
    }
}

fn eval(s: &Schedule, c: &StageCosts) -> (u64, f64) {
    let t = replay::replay(s, c).unwrap();
    let m = metrics::metrics(s, c, &t);
    let peak = m
        .ranks
        .iter()
        .map(|r| r.peak_activation_units.unwrap_or(0.0))
        .fold(0.0, f64::max);
    (t.makespan_ns(), peak)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]
    /// Never worse than the best handcrafted schedule (1F1B, ZB-H1, ZB-H2) that fits the same
    /// limit, over random per-stage costs, p, m and limits of p..2p units.
    #[test]
    fn never_worse_than_the_best_fitting_handcrafted(
        p in 2u32..6,
        m in 1u32..12,
        extra in 0u32..6,
        costs in proptest::collection::vec((1u64..40, 1u64..40, 1u64..40), 6),
        comm in 0u64..5,
    ) {
        let c = StageCosts {
            f: costs.iter().map(|x| x.0).collect(),
            i: costs.iter().map(|x| x.1).collect(),
            w: costs.iter().map(|x| x.2).collect(),
            comm,
        };
        let limit = (p + extra.min(p)) as f64;
        let auto = zb_auto(p, 1, m, &c, limit).unwrap();
        let (t_auto, peak) = eval(&auto, &c);
        prop_assert!(peak <= limit + 1e-9);
        for k in [ScheduleKind::OneFOneB, ScheduleKind::ZbH1, ScheduleKind::ZbH2] {
            let s = k.generate(p, 1, m).unwrap();
            let (t, pk) = eval(&s, &c);
            if pk <= limit + 1e-9 {
                prop_assert!(t_auto <= t, "{}: {} < zb-auto {}", k.name(), t, t_auto);
            }
        }
    }
}

/// Nothing to beat: a greedy runs to its end (or its deadlock).
const UNBOUNDED: summary::ToBeat<'static> = summary::ToBeat {
    makespan_ns: u64::MAX,
    peak: f64::INFINITY,
    memory_cap: f64::INFINITY,
    rank_work_ns: &[],
    wins_full_tie: false,
};

/// The greedy of every priority setting, unbounded: (the settings that decided alike at
/// every step, its order or `None`).
fn every_greedy(
    p: u32,
    v: u32,
    m: u32,
    c: &StageCosts,
    limit: f64,
) -> Vec<(u32, Option<Vec<Vec<Action>>>)> {
    let settings = priority_settings(v);
    let unbounded = UNBOUNDED;
    let pl = placement(p, v).unwrap();
    settings
        .iter()
        .map(|&prio| {
            let mut alike = 0;
            let built = greedy(
                &pl,
                m,
                c,
                limit,
                prio,
                &unbounded,
                &Agreement::new(&settings, prio),
                &mut alike,
            );
            (alike, built.map(|(ranks, _)| ranks))
        })
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]
    /// Settings that decided alike at every step build the same order (or none), so
    /// zb-auto skips them: per-stage costs, loop and V placement, memory limits from tight
    /// to none.
    #[test]
    fn settings_that_decide_alike_build_the_same_order(
        p in 2u32..6,
        v in 1u32..3,
        m in 1u32..12,
        f in proptest::collection::vec(1u64..40, 12),
        i in proptest::collection::vec(1u64..40, 12),
        w in proptest::collection::vec(1u64..40, 12),
        comm in 0u64..5,
        limit_units in prop_oneof![Just(1.0), Just(2.0), Just(3.0), Just(1e9)],
    ) {
        let n = (p * v) as usize;
        let c = StageCosts { f: f[..n].to_vec(), i: i[..n].to_vec(), w: w[..n].to_vec(), comm };
        let limit = limit_units * p as f64;
        let runs = every_greedy(p, v, m, &c, limit);
        for (k, (alike, order)) in runs.iter().enumerate() {
            prop_assert!(alike & (1 << k) != 0, "setting {k} disagrees with itself");
            for (j, (_, other)) in runs.iter().enumerate() {
                if alike & (1 << j) != 0 {
                    prop_assert_eq!(order, other, "settings {} and {} decided alike", k, j);
                }
            }
        }
    }
}

/// zb-auto's choice by the definition: every candidate built to its end and replayed in
/// full, the fastest that fits, then the smaller peak, then the earlier place in the order
/// of preference (list schedules, wave orders, 1F1B, ZB-H1, ZB-H2 or ZB-V). `None` when
/// nothing fits.
fn reference_choice(p: u32, v: u32, m: u32, c: &StageCosts, limit: f64) -> Option<Schedule> {
    let pl = placement(p, v).unwrap();
    let of_ranks = |ranks| Schedule {
        name: "zb-auto".into(),
        placement: pl.clone(),
        num_microbatches: m,
        num_fo_microbatches: 0,
        chunks: Vec::new(),
        ranks,
    };
    let mut candidates: Vec<Option<Schedule>> = every_greedy(p, v, m, c, limit)
        .into_iter()
        .map(|(_, ranks)| ranks.map(of_ranks))
        .collect();
    if v == 1 {
        let waves = waves::wave_orders(p, m, c, limit);
        candidates.extend(waves.into_iter().map(|w| w.map(|w| of_ranks(w.ranks))));
    }
    candidates.extend(
        ScheduleKind::zb_auto_handcrafted(v)
            .iter()
            .map(|k| k.generate(p, v, m).ok()),
    );
    let cap = limit * (1.0 + 1e-9) + 1e-9;
    candidates
        .into_iter()
        .enumerate()
        .filter_map(|(order, s)| {
            let s = s?;
            let sum = summary::replay_summary(&s, c).ok()?;
            let peak = sum.max_peak_activation();
            (peak <= cap).then_some(((sum.makespan_ns, peak, order), s))
        })
        .min_by(|a, b| a.0.partial_cmp(&b.0).unwrap())
        .map(|(_, s)| s)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]
    /// zb-auto's search (copies skipped, wave orders replayed best-estimate first,
    /// candidates stopped once they cannot win) picks the schedule the definition picks:
    /// per-stage costs (many ties), loop and V placement, limits from tight to none.
    #[test]
    fn the_search_picks_what_replaying_every_candidate_picks(
        p in 2u32..7,
        v in 1u32..3,
        m in 1u32..14,
        f in proptest::collection::vec(1u64..12, 14),
        i in proptest::collection::vec(1u64..12, 14),
        w in proptest::collection::vec(1u64..12, 14),
        comm in 0u64..4,
        limit_units in prop_oneof![Just(0.75), Just(1.0), Just(1.5), Just(2.0), Just(1e9)],
    ) {
        let n = (p * v) as usize;
        let c = StageCosts { f: f[..n].to_vec(), i: i[..n].to_vec(), w: w[..n].to_vec(), comm };
        let limit = limit_units * p as f64;
        let reference = reference_choice(p, v, m, &c, limit);
        match zb_auto(p, v, m, &c, limit) {
            Ok(s) => prop_assert_eq!(Some(&s.ranks), reference.as_ref().map(|r| &r.ranks)),
            Err(e) => prop_assert!(reference.is_none(), "{e}, but the reference fits"),
        }
    }
}

/// The skipping pays on the uniform and uneven stages zb-auto sees: a share of the
/// settings decide alike with an earlier one.
#[test]
fn some_settings_decide_alike() {
    let (mut alike, mut all) = (0, 0);
    for p in [2u32, 4, 8] {
        for v in [1u32, 2] {
            let n = (p * v) as usize;
            let c = StageCosts {
                f: (0..n as u64).map(|s| 10 + s % 3).collect(),
                i: vec![12; n],
                w: vec![7; n],
                comm: 1,
            };
            for limit in [p as f64, 2.0 * p as f64, 1e9] {
                let runs = every_greedy(p, v, 2 * p, &c, limit);
                for (k, (a, _)) in runs.iter().enumerate() {
                    all += 1;
                    if a & ((1u32 << k) - 1) != 0 {
                        alike += 1;
                    }
                }
            }
        }
    }
    assert!(alike > 0 && alike < all, "{alike} of {all}");
}

#[test]
fn the_greedy_reaches_the_bound_on_uneven_stages() {
    // A heavy last stage (the LM head): its 8 microbatches take 8 x (25 + 25 + 20) = 560 ns
    // once its first input arrives after stages 0..2's forwards and 3 transfers, 33 ns: no
    // schedule can beat 593 ns. The greedy's own first priority setting reaches it.
    let c = StageCosts {
        f: vec![10, 10, 10, 25],
        i: vec![10, 10, 10, 25],
        w: vec![8, 8, 8, 20],
        comm: 1,
    };
    let (p, m) = (4, 8);
    let prio = Priority {
        i_first: true,
        w: WRule::BubblesOnly,
        later_chunk_first: false,
    };
    let unbounded = UNBOUNDED;
    let (ranks, own) = greedy(
        &placement(p, 1).unwrap(),
        m,
        &c,
        2.0 * p as f64,
        prio,
        &unbounded,
        &Agreement::new(&[prio], prio),
        &mut 0,
    )
    .unwrap();
    // The replay the greedy runs as it builds its order gives the bound too.
    assert_eq!(own.makespan_ns, 593);
    let s = Schedule {
        name: "greedy".into(),
        placement: placement(p, 1).unwrap(),
        num_microbatches: m,
        num_fo_microbatches: 0,
        chunks: Vec::new(),
        ranks,
    };
    s.validate().unwrap();
    assert_eq!(eval(&s, &c).0, 593);
    assert_eq!(
        eval(&zb_auto(p, 1, m, &c, 2.0 * p as f64).unwrap(), &c).0,
        593
    );
}

#[test]
fn v_placement_is_no_worse_than_zb_v() {
    let c = StageCosts {
        f: vec![5, 5, 5, 5, 5, 12],
        i: vec![5, 5, 5, 5, 5, 12],
        w: vec![4, 4, 4, 4, 4, 9],
        comm: 1,
    };
    for m in [2u32, 6, 9] {
        let auto = zb_auto(3, 2, m, &c, 6.0).unwrap();
        assert_eq!(auto.placement, Placement::v_shape(3));
        let zbv = ScheduleKind::ZbV.generate(3, 2, m).unwrap();
        let (tz, pz) = eval(&zbv, &c);
        let (ta, pa) = eval(&auto, &c);
        assert!(pa <= 6.0 + 1e-9);
        if pz <= 6.0 + 1e-9 {
            assert!(ta <= tz, "m={m}: {ta} > {tz}");
        }
    }
}
