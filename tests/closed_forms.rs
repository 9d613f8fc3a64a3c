//! Simulated makespans and memory against the published closed forms.

use flatpipe::simulator::replay::dag::Dag;
use flatpipe::simulator::{ScheduleKind, UniformCostSpec, UniformCosts, simulate};

fn costs(f: f64, b: f64, w: f64, comm: f64) -> UniformCosts {
    UniformCosts::new(
        &UniformCostSpec {
            f,
            b,
            w,
            comm,
            fb: None,
            fo: None,
            fsdp: Default::default(),
        },
        1,
    )
}

/// GPipe (Huang et al. 2019) and 1F1B (Narayanan et al. 2021) with uniform costs and no
/// communication: makespan = (m + p - 1)(f + b + w), for p in 1..=16 and m in 1..=64.
#[test]
fn gpipe_and_1f1b_makespan_grid() {
    let (f, b, w) = (1.0, 2.0, 1.0);
    let c = costs(f, b, w, 0.0);
    for kind in [ScheduleKind::GPipe, ScheduleKind::OneFOneB] {
        for p in 1..=16u32 {
            for m in 1..=64u32 {
                let s = kind.generate(p, 1, m).unwrap();
                let sim = simulate(&s, &c).unwrap();
                let want = (m + p - 1) as f64 * (f + b + w);
                assert_eq!(sim.metrics.makespan_s, want, "{kind} p={p} m={m}");
                // Bubble ratio of both: (p - 1) / (m + p - 1).
                let bubble = (p - 1) as f64 / (m + p - 1) as f64;
                assert!(
                    (sim.metrics.bubble_ratio - bubble).abs() < 1e-12,
                    "{kind} p={p} m={m}"
                );
            }
        }
    }
}

/// Peak in-flight microbatches on rank r: 1F1B min(p - r, m); GPipe m. With one stage per rank
/// the peak activation memory in units equals the in-flight count.
#[test]
fn in_flight_microbatches() {
    let c = costs(1.0, 1.0, 1.0, 0.0);
    for p in 1..=12u32 {
        for m in 1..=40u32 {
            let one = simulate(&ScheduleKind::OneFOneB.generate(p, 1, m).unwrap(), &c).unwrap();
            let gpipe = simulate(&ScheduleKind::GPipe.generate(p, 1, m).unwrap(), &c).unwrap();
            for r in 0..p as usize {
                let want = (p - r as u32).min(m);
                assert_eq!(
                    one.metrics.ranks[r].peak_inflight_microbatches, want,
                    "1f1b p={p} m={m} r={r}"
                );
                assert_eq!(
                    one.metrics.ranks[r].peak_activation_units,
                    Some(want as f64)
                );
                assert_eq!(
                    gpipe.metrics.ranks[r].peak_inflight_microbatches, m,
                    "gpipe p={p} m={m} r={r}"
                );
            }
        }
    }
}

/// The lower bound of 1F1B with uniform costs is the largest of (p - 1) f + m (f + b + w) (the
/// last rank waits p - 1 forwards, then has m (f + b + w) of work), p (f + b + w) (one
/// microbatch's critical path) and p f + (p - 1)(b + w) + m (b + w) (rank 0's first backward
/// waits for a forward through all p stages and a backward through the other p - 1, and all
/// its m backwards follow).
#[test]
fn lower_bound_closed_form() {
    let (f, b, w) = (1.0, 3.0, 2.0);
    let c = costs(f, b, w, 0.0);
    for p in 1..=8u32 {
        for m in 1..=16u32 {
            let sim = simulate(&ScheduleKind::OneFOneB.generate(p, 1, m).unwrap(), &c).unwrap();
            let (pf, mf) = (p as f64, m as f64);
            let want = ((pf - 1.0) * f + mf * (f + b + w))
                .max(pf * (f + b + w))
                .max(pf * f + (pf - 1.0 + mf) * (b + w));
            assert_eq!(sim.metrics.lower_bound_s, want, "p={p} m={m}");
        }
    }
}

/// Issue 26's case: p = 8, m = 8, f = 1, b = 3 (I), w = 1, comm 0. Rank 0's first input
/// gradient cannot start before microbatch 0's forward has crossed the 8 stages and its
/// backward has come back through 7 (8 + 21 = 29), and all of rank 0's I and W, m (b + w) = 32,
/// come after it: 61, where fill + work gives 7 + 40 = 47. Every split schedule's makespan is
/// at least that; a bound of r's first backward + its backward work holds on every rank.
#[test]
fn first_backward_bound_of_the_zero_bubble_case() {
    let c = costs(1.0, 3.0, 1.0, 0.0);
    for kind in [ScheduleKind::ZbH1, ScheduleKind::ZbH2] {
        let sim = simulate(&kind.generate(8, 1, 8).unwrap(), &c).unwrap();
        assert_eq!(sim.metrics.lower_bound_s, 61.0, "{kind:?}");
        assert!(
            sim.metrics.makespan_s >= 61.0,
            "{kind:?}: {}",
            sim.metrics.makespan_s
        );
    }
    // Fused backwards (B = b + w = 4) pass back through 7 stages: 8 + 28 + 32.
    let sim = simulate(&ScheduleKind::OneFOneB.generate(8, 1, 8).unwrap(), &c).unwrap();
    assert_eq!(sim.metrics.lower_bound_s, 68.0);
}

/// With communication: one microbatch through p ranks costs p (f + b) + 2 (p - 1) comm; GPipe
/// with m microbatches and comm <= f (links never the bottleneck) costs
/// (m + p - 1)(f + b) + 2 (p - 1) comm.
#[test]
fn communication_on_the_critical_path() {
    let (f, b, comm) = (1.0, 2.0, 0.5);
    let c = costs(f, b, 0.0, comm);
    for p in 1..=8u32 {
        for m in 1..=12u32 {
            let sim = simulate(&ScheduleKind::GPipe.generate(p, 1, m).unwrap(), &c).unwrap();
            let want = (m + p - 1) as f64 * (f + b) + 2.0 * (p - 1) as f64 * comm;
            assert_eq!(sim.metrics.makespan_s, want, "p={p} m={m}");
        }
    }
}

/// The petgraph DAG's longest path gives the same makespan as the replay.
#[test]
fn dag_longest_path_matches_replay() {
    let c = costs(1.0, 2.0, 1.0, 0.25);
    for kind in [ScheduleKind::GPipe, ScheduleKind::OneFOneB] {
        for (p, m) in [(1, 1), (2, 5), (4, 8), (5, 3), (8, 16)] {
            let s = kind.generate(p, 1, m).unwrap();
            let sim = simulate(&s, &c).unwrap();
            let dag = Dag::build(&s).replay_makespan_ns(&c).unwrap();
            assert_eq!(dag, sim.timeline.makespan_ns(), "{kind} p={p} m={m}");
        }
    }
}
