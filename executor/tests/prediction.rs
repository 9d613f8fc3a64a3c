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
