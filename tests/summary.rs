//! The replay without a timeline (`simulator::replay::summary`) against the full replay and
//! `metrics::metrics` (the reference: memory from `metrics::memory_events`, in-flight counts from
//! the timeline): every generator, uniform costs with transfers and zero-length W, and profile
//! costs whose output buffers are freed when their transfer ends and whose recomputation holds
//! memory from I to W.

use flatpipe::profiles::{AnalyticOptions, analytic_profile, builtins};
use flatpipe::simulator::costs::{CostModel, CostOptions, Recompute};
use flatpipe::simulator::replay::metrics::{self, Metrics};
use flatpipe::simulator::replay::summary::{
    ToBeat, metrics_without_timeline, rank_work_ns, replay_summary, replay_to_beat, replay_within,
};
use flatpipe::simulator::run::plan::even_split;
use flatpipe::simulator::{
    Microbatch, Schedule, ScheduleKind, TableCosts, UniformCostSpec, UniformCosts, replay,
};
use proptest::prelude::*;

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-9 * a.abs().max(b.abs()).max(1.0)
}

/// Same makespan, busy times and in-flight counts; peaks equal up to the summation order.
fn assert_same(want: &Metrics, got: &Metrics, what: &str) {
    assert_eq!(want.makespan_s, got.makespan_s, "{what}: makespan");
    assert_eq!(want.bubble_ratio, got.bubble_ratio, "{what}: bubble ratio");
    assert_eq!(want.lower_bound_s, got.lower_bound_s, "{what}");
    assert_eq!(want.ranks.len(), got.ranks.len(), "{what}");
    for (w, g) in want.ranks.iter().zip(&got.ranks) {
        let r = w.rank;
        assert_eq!(w.busy_s, g.busy_s, "{what}: rank {r} busy");
        assert_eq!(
            w.peak_inflight_microbatches, g.peak_inflight_microbatches,
            "{what}: rank {r} in flight"
        );
        assert_eq!(w.static_bytes, g.static_bytes, "{what}: rank {r}");
        let peak =
            |m: &metrics::RankMetrics| m.peak_activation_bytes.or(m.peak_activation_units).unwrap();
        assert!(
            close(peak(w), peak(g)),
            "{what}: rank {r} peak {} (timeline) vs {} (summary)",
            peak(w),
            peak(g)
        );
    }
}

fn reference<C: CostModel>(s: &Schedule, c: &C) -> Metrics {
    let t = replay::replay(s, c).unwrap();
    metrics::metrics(s, c, &t)
}

fn kind() -> impl Strategy<Value = ScheduleKind> {
    prop::sample::select(ScheduleKind::ALL.to_vec())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    #[test]
    fn summary_equals_the_timeline_metrics_under_uniform_costs(
        kind in kind(), p in 1u32..=8, v in 1u32..=3, m in 1u32..=24,
        f in 1u32..5, b in 1u32..5, w in 0u32..3, comm in 0u32..3,
    ) {
        let v = kind.stages_per_rank(Some(v)).unwrap_or(2);
        let spec = UniformCostSpec {
            f: f as f64, b: b as f64, w: w as f64, comm: comm as f64 * 0.5, fb: None, fo: None,
            fsdp: Default::default(),
        };
        let costs = UniformCosts::new(&spec, v);
        let s = kind.build(p, v, m, &costs, 2.0 * p as f64).unwrap();
        assert_same(&reference(&s, &costs), &metrics_without_timeline(&s, &costs).unwrap(), &s.name);
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    /// A search's replay (`replay_to_beat`) gives up only on candidates that cannot win: a
    /// schedule whose full replay has a smaller makespan than the best, or the same makespan
    /// and a smaller peak, within the memory cap, is always returned, and whatever is returned
    /// is the full replay's summary. The best's makespan and peak are placed just below, at and
    /// above the candidate's own, with and without the per-rank compute bound, for a candidate
    /// that wins a full tie (earlier in the search's order) and one that does not.
    #[test]
    fn a_replay_to_beat_gives_up_only_on_candidates_that_cannot_win(
        kind in kind(), p in 1u32..=6, v in 1u32..=2, m in 1u32..=16,
        f in 1u32..5, b in 1u32..5, w in 0u32..3, comm in 0u32..3,
        dm in -1i64..=1, dp in -1i32..=1, with_work: bool, cap_at_peak: bool, wins_full_tie: bool,
    ) {
        let v = kind.stages_per_rank(Some(v)).unwrap_or(2);
        let spec = UniformCostSpec {
            f: f as f64, b: b as f64, w: w as f64, comm: comm as f64 * 0.5, fb: None, fo: None,
            fsdp: Default::default(),
        };
        let costs = UniformCosts::new(&spec, v);
        let s = kind.build(p, v, m, &costs, 2.0 * p as f64).unwrap();
        let full = replay_summary(&s, &costs).unwrap();
        let peak = full.max_peak_activation();
        let best_makespan = (full.makespan_ns as i64 + dm * 1_000_000) as u64;
        let best_peak = peak + 0.5 * dp as f64;
        let work = if with_work { rank_work_ns(&s, &costs) } else { Vec::new() };
        let memory_cap = if cap_at_peak { peak } else { peak - 0.5 };
        let got = replay_to_beat(&s, &costs, &ToBeat {
            makespan_ns: best_makespan,
            peak: best_peak,
            memory_cap,
            rank_work_ns: &work,
            wins_full_tie,
        });
        let wins = full.makespan_ns < best_makespan
            || (full.makespan_ns == best_makespan
                && (peak < best_peak || (wins_full_tie && peak == best_peak)));
        if let Some(got) = &got {
            prop_assert_eq!(got, &full);
        }
        if wins && cap_at_peak {
            prop_assert!(got.is_some(), "{} would win and was stopped", s.name);
        }
        if !cap_at_peak {
            prop_assert!(got.is_none(), "{} passes its memory cap", s.name);
        }
    }
}

/// Two ranks, one microbatch, f = b = w = 1 s (ZB-H1): each rank's compute is 3 s by hand, and
/// a candidate that can only tie the best's makespan is refused unless its peak is smaller, or
/// the same while it wins full ties.
#[test]
fn a_tie_on_the_makespan_needs_a_smaller_peak() {
    let costs = UniformCosts::new(
        &UniformCostSpec {
            f: 1.0,
            b: 1.0,
            w: 1.0,
            comm: 0.0,
            fb: None,
            fo: None,
            fsdp: Default::default(),
        },
        1,
    );
    let s = ScheduleKind::ZbH1.generate(2, 1, 1).unwrap();
    let full = replay_summary(&s, &costs).unwrap();
    let work = rank_work_ns(&s, &costs);
    assert_eq!(work, vec![3_000_000_000, 3_000_000_000]);
    // Stage 0's F, stage 1's F and I, stage 0's I and W, one after another: 5 s.
    assert_eq!(full.makespan_ns, 5_000_000_000);
    let beat = |makespan_ns: u64, peak: f64, wins_full_tie: bool| {
        replay_to_beat(
            &s,
            &costs,
            &ToBeat {
                makespan_ns,
                peak,
                memory_cap: f64::INFINITY,
                rank_work_ns: &work,
                wins_full_tie,
            },
        )
    };
    let peak = full.max_peak_activation();
    assert_eq!(
        beat(full.makespan_ns, f64::INFINITY, false),
        Some(full.clone())
    );
    assert_eq!(
        beat(full.makespan_ns, peak + 0.5, false),
        Some(full.clone())
    );
    assert_eq!(beat(full.makespan_ns, peak, false), None);
    // Earlier in the search's order, the same makespan and peak win.
    assert_eq!(beat(full.makespan_ns, peak, true), Some(full.clone()));
    assert_eq!(beat(full.makespan_ns, peak - 0.5, true), None);
    assert_eq!(beat(full.makespan_ns - 1, f64::INFINITY, true), None);
}

/// Under a profile each rank's optimizer step follows its last op, and the makespan includes
/// it: a candidate whose compute and optimizer step can only tie the best's makespan, with no
/// smaller peak, is refused before the end of its replay, and one that ties with a smaller
/// peak is kept (Llama-3.1-8B's analytic profile, p = 4, 8 microbatches).
#[test]
fn the_optimizer_step_counts_toward_a_tie() {
    let prof = analytic_profile(
        &builtins::model("llama3.1-8b").unwrap(),
        &builtins::hardware("h200").unwrap(),
        &AnalyticOptions::default(),
    )
    .unwrap();
    let mbs: Vec<Microbatch> = (0..8)
        .map(|k| Microbatch::flat(vec![1024 + 131 * k]))
        .collect();
    for kind in [
        ScheduleKind::ZbH1,
        ScheduleKind::ZbH2,
        ScheduleKind::OneFOneB,
    ] {
        let placement = kind.placement_on(4, 1).unwrap();
        let stages = even_split(prof.layers.len(), 4).unwrap();
        let costs = TableCosts::from_profile(&prof, &stages, &placement, &mbs, &[]).unwrap();
        assert!(costs.optimizer_ns(flatpipe::simulator::Rank(0)) > 0);
        let s = kind.build(4, 1, 8, &costs, f64::INFINITY).unwrap();
        let full = replay_summary(&s, &costs).unwrap();
        let work = rank_work_ns(&s, &costs);
        let peak = full.max_peak_activation();
        let beat = |best_peak: f64| {
            replay_to_beat(
                &s,
                &costs,
                &ToBeat {
                    makespan_ns: full.makespan_ns,
                    peak: best_peak,
                    memory_cap: f64::INFINITY,
                    rank_work_ns: &work,
                    wins_full_tie: false,
                },
            )
        };
        assert_eq!(beat(peak), None, "{kind}");
        assert_eq!(beat(peak * 1.01), Some(full.clone()), "{kind}");
    }
}

/// Profile costs: activation bytes by lifetime, output buffers (freed at their transfer's end,
/// the out-of-order frees), selective and full recomputation, several stages per rank.
#[test]
fn summary_equals_the_timeline_metrics_under_profile_costs() {
    let prof = analytic_profile(
        &builtins::model("llama3.1-8b").unwrap(),
        &builtins::hardware("h200").unwrap(),
        &AnalyticOptions::default(),
    )
    .unwrap();
    let mbs: Vec<Microbatch> = (0..12)
        .map(|k| Microbatch::flat(vec![512 + 97 * k, 300 + 41 * (k % 5)]))
        .collect();
    let mut compared = 0;
    for kind in ScheduleKind::ALL.iter().copied() {
        for (p, v) in [(2u32, 1u32), (4, 1), (4, 2)] {
            let Ok(v) = kind.stages_per_rank(Some(v)) else {
                continue;
            };
            let placement = kind.placement_on(p, v).unwrap();
            let stages = even_split(prof.layers.len(), placement.num_stages() as usize).unwrap();
            for mode in Recompute::ALL {
                let recompute = vec![*mode; stages.len()];
                let opts = CostOptions {
                    recompute: &recompute,
                    ..CostOptions::default()
                };
                let costs =
                    TableCosts::with_options(&prof, &stages, &placement, &mbs, &[], &opts).unwrap();
                let s = kind
                    .build(p, v, mbs.len() as u32, &costs, f64::INFINITY)
                    .unwrap();
                let what = format!("{} p={p} v={v} {mode:?}", s.name);
                assert_same(
                    &reference(&s, &costs),
                    &metrics_without_timeline(&s, &costs).unwrap(),
                    &what,
                );
                compared += 1;
            }
        }
    }
    assert!(compared >= 40, "{compared}");
}

/// The caps stop a replay exactly when the full replay says they should: at the makespan
/// itself it finishes, one ns below it stops; at the largest peak it finishes, just below it
/// stops.
#[test]
fn caps_stop_exactly_at_the_makespan_and_the_peak() {
    let costs = UniformCosts::new(
        &UniformCostSpec {
            f: 1.0,
            b: 1.0,
            w: 1.0,
            comm: 0.25,
            fb: None,
            fo: None,
            fsdp: Default::default(),
        },
        1,
    );
    for kind in [
        ScheduleKind::OneFOneB,
        ScheduleKind::ZbH2,
        ScheduleKind::GPipe,
    ] {
        let s = kind.generate(4, 1, 8).unwrap();
        let want = reference(&s, &costs);
        let makespan = (want.makespan_s * 1e9).round() as u64;
        let peak = want
            .ranks
            .iter()
            .filter_map(|r| r.peak_activation_units)
            .fold(0.0, f64::max);
        // By hand: 1F1B and ZB-H2 hold p = 4 and 2p - 1 = 7 microbatches on rank 0 (Qi et al.
        // 2024, Table 1), GPipe all m = 8.
        let held = match kind {
            ScheduleKind::OneFOneB => 4.0,
            ScheduleKind::ZbH2 => 7.0,
            _ => 8.0,
        };
        assert_eq!(peak, held, "{kind}");
        let full = replay_summary(&s, &costs).unwrap();
        assert_eq!(full.makespan_ns, makespan);
        assert_eq!(replay_within(&s, &costs, makespan, peak), Some(full));
        assert_eq!(
            replay_within(&s, &costs, makespan - 1, peak),
            None,
            "{kind}"
        );
        assert_eq!(
            replay_within(&s, &costs, makespan, peak - 0.5),
            None,
            "{kind}"
        );
    }
}

/// A schedule that cannot finish is a deadlock error naming the cycle, as with the timeline.
#[test]
fn deadlock_is_reported() {
    let mut s = ScheduleKind::OneFOneB.generate(2, 1, 1).unwrap();
    s.ranks[1].swap(0, 1);
    let costs = UniformCosts::new(&UniformCostSpec::default(), 1);
    let e = replay_summary(&s, &costs).unwrap_err().to_string();
    assert!(e.contains("deadlocks") && e.contains("1B0"), "{e}");
}

/// Forward-only microbatches (their own ids, no memory kept) in the training schedule's
/// bubbles or as a separate pass: the summary still equals the timeline's metrics.
#[test]
fn summary_equals_the_timeline_metrics_with_forward_only_work() {
    use flatpipe::simulator::schedules::forward_only::{FoMode, with_forward_only};
    let costs = UniformCosts::new(
        &UniformCostSpec {
            f: 1.0,
            b: 2.0,
            w: 1.0,
            comm: 0.25,
            fb: None,
            fo: Some(0.5),
            fsdp: Default::default(),
        },
        1,
    );
    for kind in [
        ScheduleKind::OneFOneB,
        ScheduleKind::ZbH1,
        ScheduleKind::GPipe,
    ] {
        for mode in [FoMode::Fused, FoMode::Separate] {
            let train = kind.generate(4, 1, 8).unwrap();
            let s = with_forward_only(&train, 6, mode, false, &costs).unwrap();
            assert!(s.num_fo_microbatches == 6, "{kind} {mode:?}");
            assert_same(
                &reference(&s, &costs),
                &metrics_without_timeline(&s, &costs).unwrap(),
                &format!("{kind} {mode:?}"),
            );
        }
    }
}
