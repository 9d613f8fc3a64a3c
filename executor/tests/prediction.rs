//! The schedule `execute` runs is the schedule the simulator predicts for the same step: with a
//! profile, forward-only work is fused into the bubbles by the profile's costs in both (it used
//! to be fused with uniform costs in the executor and the profile's in the Monte Carlo, so the
//! executed and the predicted schedules differed), and `execute`'s prediction is the replay of
//! the schedule that runs, forward-only work included.

mod common;

use flatpipe_profiles::{AnalyticOptions, analytic_profile, builtins};
use flatpipe_simulator::ScheduleKind;
use flatpipe_simulator::forward_only::FoMode;
use flatpipe_simulator::montecarlo::{
    Capacity, Combo, ForwardOnlySpec, ScheduleSource, simulate_replica,
};
use std::sync::Arc;

#[test]
fn executed_and_predicted_schedules_are_the_same_with_forward_only_work() {
    let model = builtins::model("tiny").unwrap();
    let hw = builtins::hardware("h200").unwrap();
    let profile = analytic_profile(&model, &hw, &AnalyticOptions::default()).unwrap();
    for kind in [
        ScheduleKind::OneFOneB,
        ScheduleKind::ZbH1,
        ScheduleKind::Interleaved1F1B,
        ScheduleKind::ZbV,
    ] {
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
        s.forward_only = Some(fo);
        s.profile = Some(Arc::new(profile.clone()));
        let step = s.prepare(0).unwrap();
        let r = &step.replicas[0];
        let mut combo = Combo::new(
            s.source.clone(),
            v,
            s.stages.clone(),
            s.policy,
            Capacity::Dynamic,
        );
        combo.forward_only = Some(fo);
        let (_, sim) = simulate_replica(&profile, 2, &combo, &r.lengths, 0).unwrap();
        let (predicted, _) = sim.unwrap();
        assert_eq!(
            r.schedule.ranks,
            predicted.ranks,
            "{}: the executed schedule differs from the predicted one",
            kind.name()
        );
        // `execute`'s prediction replays that schedule: the Monte Carlo's step time with the
        // forward-only work (dp = 1: no all-reduce), more than without it (what `execute`
        // used to predict, its Combo having no forward-only part).
        let p = step.predict(&s, &profile).unwrap();
        let (with_fo, _) = simulate_replica(&profile, 2, &combo, &r.lengths, 0).unwrap();
        combo.forward_only = None;
        let (without, _) = simulate_replica(&profile, 2, &combo, &r.lengths, 0).unwrap();
        assert!(
            (p.makespan_s - with_fo.step_time_s).abs() <= 1e-9 * with_fo.step_time_s,
            "{}: predicted {} vs {}",
            kind.name(),
            p.makespan_s,
            with_fo.step_time_s
        );
        assert!(p.makespan_s > without.step_time_s, "{}", kind.name());
        assert_eq!(p.bubbles.len(), 2);
    }
}
