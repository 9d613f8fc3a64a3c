//! Step 2, bound: a lower bound on every candidate's mean step time, the order of evaluation
//! (increasing bound), and the split's node budget shared over the candidates.

use super::enumerate::Layouts;
use super::{MIN_NODE_BUDGET, SEARCH_NODE_BUDGET, SearchConfig};
use crate::partition::ExactSplit;
use flatpipe_profiles::Profile;
use flatpipe_simulator::ScheduleKind;
use flatpipe_simulator::costs::sharding::{Sharding, StepCollectives};

/// Sets every candidate's lower bound on the mean step time, seconds: its heaviest replica's
/// compute per step (less its expert-parallel all-to-alls for the schedules that may overlap a
/// forward with a backward: DualPipeV, combined 1F1B, and zb-auto, which may run DualPipeV's
/// order), averaged
/// over the sampled steps and divided over its pp ranks (no bubble) and its cp group's GPUs,
/// plus without a pipeline
/// the step's data-parallel collectives ([`collectives_lb`]); then orders the candidates by it
/// (stable: ties keep the enumeration order).
pub(super) fn bound_and_order(layouts: &mut Layouts) {
    for c in &mut layouts.pending {
        let stats = &layouts.stats[c.stats];
        let work = if matches!(
            c.kind,
            ScheduleKind::DualPipeV | ScheduleKind::Combined1F1B | ScheduleKind::ZbAuto
        ) {
            &stats.replica_compute_s
        } else {
            &stats.replica_work_s
        };
        // A cp group shares each microbatch's work over its GPUs at best evenly.
        let work_lb = work.iter().sum::<f64>()
            / work.len().max(1) as f64
            / c.pp as f64
            / f64::from(c.cp_gpus());
        let profile = &layouts.profiles[c.tpi].1;
        c.lower_bound_s = work_lb + collectives_lb(profile, c.sharding, c.pp, c.dp * c.cp_gpus());
    }
    layouts
        .pending
        .sort_by(|a, b| a.lower_bound_s.total_cmp(&b.lower_bound_s));
}

/// A lower bound on the step's data-parallel collectives, seconds: without a pipeline, the one
/// rank's reduction and all-gathers follow its compute ([`StepCollectives`]); with one, 0 (a
/// rank's reduction may hide in its cool-down bubble).
fn collectives_lb(profile: &Profile, sharding: Sharding, pp: u32, dp: u32) -> f64 {
    if pp > 1 {
        return 0.0;
    }
    let params: f64 = profile.layers.iter().map(|l| l.param_count as f64).sum();
    let c = StepCollectives::of(sharding, &profile.hardware, pp, dp, 0, params);
    c.before_first_forward_s + c.gradient_reduction_s + c.after_optimizer_s
}

/// `config` with the branch and bound's node budget per feasibility question shared over the
/// search's `candidates`: [`SEARCH_NODE_BUDGET`] nodes spread over them, at least
/// [`MIN_NODE_BUDGET`] and at most the configured budget (deterministic: it depends on the
/// space, not on the machine). Other split solvers are unchanged.
pub(super) fn split_budget(config: &SearchConfig, candidates: usize) -> SearchConfig {
    match config.exact_split {
        ExactSplit::BranchAndBound { node_budget } => SearchConfig {
            exact_split: ExactSplit::BranchAndBound {
                node_budget: (SEARCH_NODE_BUDGET / candidates.max(1) as u64)
                    .clamp(MIN_NODE_BUDGET.min(node_budget), node_budget),
            },
            ..config.clone()
        },
        _ => config.clone(),
    }
}
