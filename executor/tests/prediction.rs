//! The schedule `execute` runs is the schedule the simulator predicts for the same step: with a
//! profile, forward-only work is fused into the bubbles by the profile's costs in both (it used
//! to be fused with uniform costs in the executor and the profile's in the Monte Carlo, so the
//! executed and the predicted schedules differed), and `execute`'s prediction is the replay of
//! the schedule that runs, forward-only work included.

mod common;

use flatpipe_profiles::{AnalyticOptions, analytic_profile, builtins};
use flatpipe_simulator::ScheduleKind;
use flatpipe_simulator::run::{
    config::{ForwardOnlySpec, ScheduleSource},
    montecarlo::simulate_replica,
};
use flatpipe_simulator::schedules::forward_only::FoMode;
use std::sync::Arc;

/// For every schedule kind, with and without forward-only work, the schedule `execute` runs
/// and the one the simulator predicts for the same step are the same (both come from one
/// `StepPlan`), and the predicted makespan is the replay of that schedule, whether the step
/// carries its prediction (planned with this profile) or is replayed on an equal profile.
#[test]
fn executed_and_predicted_schedules_are_the_same_with_forward_only_work() {
    let model = builtins::model("tiny").unwrap();
    let hw = builtins::hardware("h200").unwrap();
    let profile = analytic_profile(&model, &hw, &AnalyticOptions::default()).unwrap();
    for &kind in ScheduleKind::ALL {
        for with_fo in [false, true] {
            let v = kind.stages_per_rank(None).unwrap();
            let mut s = common::setup(
                model.clone(),
                common::workload(200.0, 2048),
                ScheduleSource::Kind(kind),
                (2, v, 6),
            );
            let fo = ForwardOnlySpec {
                microbatches: Some(6),
                mode: FoMode::Fused,
                loss_dependency: false,
            };
            s.config.forward_only = with_fo.then_some(fo);
            s.profile = Some(Arc::new(profile.clone()));
            let name = format!("{} fo={with_fo}", kind.name());
            let step = s.prepare(0).unwrap();
            let r = &step.replicas[0];
            // The Monte Carlo's path for the same configuration and microbatches.
            let (mc, sim) = simulate_replica(&profile, &s.config, &r.lengths, 0).unwrap();
            let (predicted, _) = sim.unwrap();
            assert_eq!(
                r.schedule.ranks, predicted.ranks,
                "{name}: the executed schedule differs from the predicted one"
            );
            assert_eq!(
                r.schedule.num_fo_microbatches,
                if with_fo { 6 } else { 0 },
                "{name}"
            );
            // `execute`'s prediction replays that schedule: the Monte Carlo's step time (dp =
            // 1: no all-reduce), carried by the step or replayed on a copy of the profile.
            let carried = step.predict(&s, s.profile.as_deref().unwrap()).unwrap();
            let replayed = step.predict(&s, &profile).unwrap();
            for p in [&carried, &replayed] {
                assert!(
                    (p.makespan_s - mc.step_time_s).abs() <= 1e-9 * mc.step_time_s,
                    "{name}: predicted {} vs {}",
                    p.makespan_s,
                    mc.step_time_s
                );
                assert_eq!(p.bubbles.len(), 2, "{name}");
            }
            assert_eq!(carried.bubbles, replayed.bubbles, "{name}");
            if with_fo {
                // More than without the forward-only work (what `execute` used to predict).
                let mut train_only = s.config.clone();
                train_only.forward_only = None;
                let (without, _) = simulate_replica(&profile, &train_only, &r.lengths, 0).unwrap();
                assert!(mc.step_time_s > without.step_time_s, "{name}");
            }
        }
    }
}

/// The closed loop's refit, on timings whose truth is known: the "measured" timeline is the
/// replay on the profile scaled by known factors, and the estimate from it
/// ([`SpeedEstimate`]) recovers those factors, so the step replayed on the refitted profile is
/// the measured one. With ZB-H1 (F, I and W apart) every factor comes back; with 1F1B (fused
/// backwards) I and W come back as B's one factor, so there they are taken equal.
#[test]
fn a_profile_refitted_on_a_step_predicts_that_step() {
    use flatpipe_profiles::PhaseScale;
    use flatpipe_simulator::run::estimate::SpeedEstimate;
    let model = builtins::model("tiny-moe").unwrap();
    let hw = builtins::hardware("h200").unwrap();
    let base = analytic_profile(&model, &hw, &AnalyticOptions::default()).unwrap();
    let cases = [
        (ScheduleKind::ZbH1, (1.3, 0.8, 1.6)),
        (ScheduleKind::OneFOneB, (0.7, 1.25, 1.25)),
    ];
    for (kind, (f, i, w)) in cases {
        let truth = PhaseScale {
            f,
            i,
            w,
            b: 1.0,
            optimizer: 2.0,
        };
        let measured_profile = base.scaled(&truth).unwrap();
        let mut s = common::setup(
            model.clone(),
            common::workload(200.0, 2048),
            ScheduleSource::Kind(kind),
            (2, 1, 6),
        );
        s.profile = Some(Arc::new(base.clone()));
        let step = s.prepare(0).unwrap();
        let measured = step.predict(&s, &measured_profile).unwrap();
        let predicted = step.predict(&s, &base).unwrap();
        let mut e = SpeedEstimate::new(1.0).unwrap();
        e.observe(
            predicted.timeline.as_ref().unwrap(),
            measured.timeline.as_ref().unwrap(),
            2,
        );
        let got = e.phase_scale();
        // The replay rounds each action to whole nanoseconds (an optimizer step of a few
        // microseconds here).
        let close = |a: f64, b: f64| (a - b).abs() <= 1e-4 * b;
        for (name, a, b) in [
            ("F", got.f, f),
            ("I", got.i, i),
            ("W", got.w, w),
            ("optimizer", got.optimizer, 2.0),
        ] {
            assert!(close(a, b), "{}: {name} {a} vs {b}", kind.name());
        }
        let refitted = step.predict(&s, &base.scaled(&got).unwrap()).unwrap();
        assert!(
            close(refitted.makespan_s, measured.makespan_s),
            "{}: {} vs {}",
            kind.name(),
            refitted.makespan_s,
            measured.makespan_s
        );
        assert!(!close(predicted.makespan_s, measured.makespan_s));
    }
}
