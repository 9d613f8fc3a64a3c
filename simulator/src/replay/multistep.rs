//! Consecutive training steps of one schedule: with a global synchronisation before the
//! optimizer, or with the Zero Bubble paper's optimizer post-validation (Qi et al., "Zero
//! Bubble Pipeline Parallelism", ICLR 2024, section 4), and the steady-state step time.
//!
//! Each step replays the same schedule ([`crate::replay`]); step j + 1's actions on a rank
//! start after that rank's optimizer step of step j (its weights are updated), and its
//! transfers queue behind step j's on the same link.
//!
//! - [`StepSync::Global`]: the usual step. Gradient-norm clipping (and the loss-scale and NaN
//!   checks of mixed precision) need every rank's gradients, so every rank's optimizer starts
//!   when the last rank's last action of the step has ended; the next step's first forward
//!   waits for it. With no optimizer time and comm = 0, k steps take exactly k times one step.
//! - [`StepSync::PostValidation`]: each rank steps its optimizer as soon as its own last action
//!   (its last W) is done, and the next step's forwards may start on it while later ranks still
//!   finish the previous step; the paper validates the global checks afterwards and rolls back
//!   in the rare step that fails them (not modelled: the optimistic path). The trailing
//!   bubbles of one step then hold the next step's warm-up, which is where ZB-H2's zero bubble
//!   lives.

use crate::costs::CostModel;
use crate::ir::{Rank, Schedule};
use crate::{Result, replay, replay::dag};
use serde::Serialize;

/// When the ranks' optimizer steps start.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum StepSync {
    /// After every rank's last action of the step (a global barrier).
    Global,
    /// Each rank after its own last action (optimizer post-validation).
    PostValidation,
}

/// The result of [`consecutive_steps`].
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ConsecutiveSteps {
    /// The synchronisation simulated.
    pub sync: StepSync,
    /// Steps simulated, `k >= 1`.
    pub steps: u32,
    /// Per step, the latest end of a rank's optimizer step (or last action, with no optimizer
    /// time), ns from the first step's start.
    pub step_end_ns: Vec<u64>,
    /// The end of the last step, ns.
    pub makespan_ns: u64,
    /// The steady-state step time, ns: `(end of step k - end of step 1) / (k - 1)`, the first
    /// step's fill excluded; the single step's time when `k = 1`.
    pub steady_state_step_ns: u64,
}

/// Replays `k` consecutive steps of `schedule` under `costs` with `sync` before the optimizer.
///
/// # Errors
/// [`crate::Error::InvalidArgument`] for `k = 0` or `k > 100_000`; [`crate::Error::Deadlock`]
/// when the schedule cannot finish.
pub fn consecutive_steps<C: CostModel>(
    schedule: &Schedule,
    costs: &C,
    k: u32,
    sync: StepSync,
) -> Result<ConsecutiveSteps> {
    if k == 0 || k > 100_000 {
        return Err(crate::Error::invalid(
            "consecutive steps",
            k,
            "1 to 100000 steps",
        ));
    }
    let p = schedule.placement.num_ranks as usize;
    let opt: Vec<u64> = (0..p).map(|r| costs.optimizer_ns(Rank(r as u32))).collect();
    let mut ready = vec![0u64; p];
    let mut links = vec![Vec::new(); p];
    let mut step_end_ns = Vec::with_capacity(k as usize);
    for _ in 0..k {
        let clock = replay::replay_from(schedule, costs, &ready, &mut links)
            .ok_or_else(|| dag::deadlock_error(schedule))?;
        let barrier = clock.iter().copied().max().unwrap_or(0);
        for r in 0..p {
            let start = match sync {
                StepSync::Global => barrier,
                StepSync::PostValidation => clock[r],
            };
            ready[r] = start + opt[r];
        }
        step_end_ns.push(ready.iter().copied().max().unwrap_or(0));
    }
    let makespan_ns = *step_end_ns.last().unwrap_or(&0);
    let steady_state_step_ns = if k == 1 {
        makespan_ns
    } else {
        (makespan_ns - step_end_ns[0]) / u64::from(k - 1)
    };
    Ok(ConsecutiveSteps {
        sync,
        steps: k,
        step_end_ns,
        makespan_ns,
        steady_state_step_ns,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ScheduleKind;
    use crate::costs::{UniformCostSpec, UniformCosts};

    fn costs(comm: f64) -> UniformCosts {
        UniformCosts::new(
            &UniformCostSpec {
                comm,
                ..UniformCostSpec::default()
            },
            1,
        )
    }

    #[test]
    fn synchronised_steps_are_k_single_steps_with_comm_zero() {
        let c = costs(0.0);
        for kind in [
            ScheduleKind::OneFOneB,
            ScheduleKind::ZbH1,
            ScheduleKind::ZbH2,
        ] {
            let s = kind.generate(4, 1, 8).unwrap();
            let one = replay::replay(&s, &c).unwrap().makespan_ns();
            let r = consecutive_steps(&s, &c, 5, StepSync::Global).unwrap();
            assert_eq!(r.makespan_ns, 5 * one, "{kind}");
            assert_eq!(r.steady_state_step_ns, one);
        }
    }

    /// ZB-H2, p = 4, m = 8, f = b = w = 1 (Qi et al. 2024, Figure 4's setting): one step takes
    /// (p - 1) f + m (f + b + w) = 3 + 24 = 27; with post-validation the next step's warm-up
    /// fills the previous step's tail and the steady step is every rank's work, m (f + b + w)
    /// = 24: zero bubble. 1F1B gains nothing (its ranks end together after the cool-down:
    /// rank 0 ends last), so its steady step stays (p - 1)(f + b + w) + m (f + b + w) = 33.
    #[test]
    fn post_validation_gives_zb_h2_its_zero_bubble() {
        let c = costs(0.0);
        let h2 = ScheduleKind::ZbH2.generate(4, 1, 8).unwrap();
        assert_eq!(
            replay::replay(&h2, &c).unwrap().makespan_ns(),
            27_000_000_000
        );
        let r = consecutive_steps(&h2, &c, 6, StepSync::PostValidation).unwrap();
        assert_eq!(r.steady_state_step_ns, 24_000_000_000);
        let g = consecutive_steps(&h2, &c, 6, StepSync::Global).unwrap();
        assert_eq!(g.steady_state_step_ns, 27_000_000_000);
        let f1 = ScheduleKind::OneFOneB.generate(4, 1, 8).unwrap();
        let r = consecutive_steps(&f1, &c, 6, StepSync::PostValidation).unwrap();
        assert_eq!(r.steady_state_step_ns, 33_000_000_000);
    }

    #[test]
    fn zero_steps_are_refused() {
        let s = ScheduleKind::OneFOneB.generate(2, 1, 2).unwrap();
        assert!(consecutive_steps(&s, &costs(0.0), 0, StepSync::Global).is_err());
    }
}
