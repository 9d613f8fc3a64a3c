//! zb-auto's unit tests: the objectives, the lower bound, ZB-H1 and the error.

use super::*;
use crate::schedules::generators::ScheduleKind;
use crate::{replay, replay::metrics};

/// zb-auto as every caller builds it: through the schedule-building contract.
fn zb_auto<C: CostModel>(p: u32, v: u32, m: u32, costs: &C, limit: f64) -> Result<Schedule> {
    ScheduleKind::ZbAuto.build(p, v, m, costs, limit)
}
use crate::costs::{UniformCostSpec, UniformCosts};

fn uni(f: f64, b: f64, w: f64) -> UniformCosts {
    UniformCosts::new(
        &UniformCostSpec {
            f,
            b,
            w,
            comm: 0.0,
            fb: None,
            fo: None,
            fsdp: Default::default(),
        },
        1,
    )
}

fn makespan(s: &Schedule, c: &UniformCosts) -> u64 {
    replay::replay(s, c).unwrap().makespan_ns()
}

fn steady(s: &Schedule, c: &UniformCosts) -> u64 {
    multistep::consecutive_steps(s, c, 6, multistep::StepSync::PostValidation)
        .unwrap()
        .steady_state_step_ns
}

/// Under optimizer post-validation no step can be shorter than a rank's own work,
/// `m (f + b + w)` with one stage per rank; ZB-H2's shape reaches it at p = 4, m = 8,
/// f = b = w = 1 under 2p units (Qi et al. 2024, section 4: the zero bubble lives across
/// steps). Ranking by one step, zb-auto keeps ZB-H1's lighter shape (27 s across steps).
#[test]
fn post_validation_objective_reaches_each_ranks_work() {
    let c = uni(1.0, 1.0, 1.0);
    let (p, m) = (4, 8);
    let work = 24_000_000_000;
    let pv = ScheduleKind::ZbAuto
        .build_for(p, 1, m, &c, 8.0, Objective::PostValidation)
        .unwrap();
    assert_eq!(steady(&pv, &c), work);
    let step = zb_auto(p, 1, m, &c, 8.0).unwrap();
    assert_eq!(steady(&step, &c), 27_000_000_000);
    // Both are optimal for one step: (p - 1) f + m (f + b + w) = 27 s.
    assert_eq!(makespan(&pv, &c), 27_000_000_000);
    assert_eq!(makespan(&step, &c), 27_000_000_000);
    // Under p units ZB-H2's shape does not fit; nothing reaches 24 s there.
    let tight = ScheduleKind::ZbAuto
        .build_for(p, 1, m, &c, 4.0, Objective::PostValidation)
        .unwrap();
    assert!(steady(&tight, &c) > work);
}

/// The post-validation objective's pick is never slower across steps than a handcrafted
/// candidate that fits (they compete), and never below a rank's work.
#[test]
fn post_validation_pick_beats_the_handcrafted_across_steps() {
    for (p, m, f, b, w, units) in [
        (4u32, 8u32, 1.0, 1.0, 1.0, 8.0),
        (4, 12, 1.0, 2.0, 1.0, 8.0),
        (6, 12, 2.0, 3.0, 1.0, 12.0),
        (8, 16, 1.0, 1.0, 1.0, 8.0),
        (3, 9, 1.0, 1.5, 0.5, 6.0),
    ] {
        let c = uni(f, b, w);
        let pick = ScheduleKind::ZbAuto
            .build_for(p, 1, m, &c, units, Objective::PostValidation)
            .unwrap();
        let t = steady(&pick, &c);
        let work = (f64::from(m) * (f + b + w) * 1e9).round() as u64;
        assert!(t >= work, "p={p} m={m}: {t} < {work}");
        for kind in [
            ScheduleKind::OneFOneB,
            ScheduleKind::ZbH1,
            ScheduleKind::ZbH2,
        ] {
            let s = kind.generate(p, 1, m).unwrap();
            let peak = metrics::peak_activation(&s, &c, &replay::replay(&s, &c).unwrap());
            if peak <= units {
                assert!(t <= steady(&s, &c), "p={p} m={m}: {kind} is faster");
            }
        }
    }
}

#[test]
fn two_p_units_reach_the_lower_bound() {
    // (p - 1) f + m (f + b + w) when b <= 2w and b <= 2f, m >= 2p - 1.
    for (p, m, f, b, w) in [
        (4u32, 8u32, 1.0, 1.0, 1.0),
        (4, 7, 1.0, 1.5, 1.0),
        (3, 6, 2.0, 2.0, 1.5),
    ] {
        let c = uni(f, b, w);
        let s = zb_auto(p, 1, m, &c, 2.0 * p as f64).unwrap();
        let bound = (p as f64 - 1.0) * f + m as f64 * (f + b + w);
        assert_eq!(
            makespan(&s, &c),
            (bound * 1e9).round() as u64,
            "p={p} m={m}"
        );
    }
}

#[test]
fn p_units_are_no_worse_than_zb_h1() {
    let c = uni(1.0, 1.2, 0.8);
    for (p, m) in [(4u32, 8u32), (4, 3), (6, 13)] {
        let s = zb_auto(p, 1, m, &c, p as f64).unwrap();
        let h1 = ScheduleKind::ZbH1.generate(p, 1, m).unwrap();
        assert!(makespan(&s, &c) <= makespan(&h1, &c));
    }
}

#[test]
fn too_small_a_limit_is_a_clear_error() {
    let c = uni(1.0, 1.0, 1.0);
    let e = zb_auto(4, 1, 8, &c, 0.5).unwrap_err().to_string();
    assert!(
        e.contains("0.50 units") && e.contains("at least 1.00 units"),
        "{e}"
    );
    // One microbatch at a time fits in one unit.
    let s = zb_auto(4, 1, 8, &c, 1.0).unwrap();
    let t = replay::replay(&s, &c).unwrap();
    let peak = metrics::metrics(&s, &c, &t)
        .ranks
        .iter()
        .map(|r| r.peak_activation_units.unwrap())
        .fold(0.0, f64::max);
    assert!(peak <= 1.0 + 1e-9);
}
