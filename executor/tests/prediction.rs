//! The schedule `execute` runs is the schedule the simulator predicts for the same step: with a
//! profile, forward-only work is fused into the bubbles by the profile's costs in both (it used
//! to be fused with uniform costs in the executor and the profile's in the Monte Carlo, so the
//! executed and the predicted schedules differed).

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
    }
}
