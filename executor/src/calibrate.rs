//! The closed loop's measuring half: run a planned [`Setup`] for some steps on a backend and put
//! each step's measured makespan and bubble ratios beside the simulator's prediction of the very
//! schedules that ran ([`PreparedStep::predict`]). `flatpipe calibrate` plans each schedule
//! (`flatpipe_planner::search::plan_schedule`), then calls [`measure_steps`].

use crate::backend::AnyExecutor;
use crate::runner::{PreparedStep, Setup};
use crate::{Error, Result};
use flatpipe_profiles::Profile;
use flatpipe_simulator::Timeline;

/// One executed step beside its prediction.
#[derive(Debug, Clone, PartialEq)]
pub struct StepComparison {
    /// Predicted makespan (slowest replica plus the data-parallel all-reduce), seconds.
    pub predicted_makespan_s: f64,
    /// Measured makespan, seconds.
    pub measured_makespan_s: f64,
    /// Predicted bubble ratio of every rank of replica 0.
    pub predicted_bubbles: Vec<f64>,
    /// Measured bubble ratio of every rank ([`bubble_ratios`]).
    pub measured_bubbles: Vec<f64>,
}

/// The measured steps of one setup, each beside its prediction.
#[derive(Debug, Clone, PartialEq)]
pub struct Comparison {
    /// The measured steps, in order (warm-up steps excluded).
    pub steps: Vec<StepComparison>,
}

impl Comparison {
    /// Median predicted makespan over the steps, seconds.
    pub fn predicted_makespan_s(&self) -> f64 {
        median(self.steps.iter().map(|s| s.predicted_makespan_s).collect())
    }

    /// Median measured makespan over the steps, seconds.
    pub fn measured_makespan_s(&self) -> f64 {
        median(self.steps.iter().map(|s| s.measured_makespan_s).collect())
    }

    /// `(predicted - measured) / measured` of the medians: negative when the simulator
    /// under-predicts.
    pub fn rel_error(&self) -> f64 {
        let m = self.measured_makespan_s();
        (self.predicted_makespan_s() - m) / m
    }

    /// Median predicted bubble ratio of every rank.
    pub fn predicted_bubbles(&self) -> Vec<f64> {
        per_rank_median(self.steps.iter().map(|s| &s.predicted_bubbles))
    }

    /// Median measured bubble ratio of every rank.
    pub fn measured_bubbles(&self) -> Vec<f64> {
        per_rank_median(self.steps.iter().map(|s| &s.measured_bubbles))
    }
}

/// Runs `warmup` unmeasured steps (allocator, page faults, caches), then `steps` measured ones,
/// each predicted on `profile` by the replay of the schedules that ran. Warm-up steps draw
/// sequences from step indices `steps..steps + warmup`, so the measured steps are steps
/// `0..steps` of the setup's sampler, as `execute` runs them.
///
/// # Errors
/// [`Error::Invalid`] for `steps = 0`; the executor's; prediction errors (a profile that does not
/// match the setup's stages).
pub fn measure_steps(
    exec: &mut AnyExecutor,
    setup: &Setup,
    profile: &Profile,
    warmup: u64,
    steps: u64,
) -> Result<Comparison> {
    if steps == 0 {
        return Err(Error::InvalidArgument {
            field: "steps",
            value: "0".into(),
            allowed: ">= 1 measured step".into(),
        });
    }
    for w in 0..warmup {
        exec.train_step(setup, &setup.prepare(steps + w)?)?;
    }
    let mut out = Vec::with_capacity(steps as usize);
    for step in 0..steps {
        let prepared: PreparedStep = setup.prepare(step)?;
        let run = exec.train_step(setup, &prepared)?;
        let p = prepared.predict(setup, profile)?;
        out.push(StepComparison {
            predicted_makespan_s: p.makespan_s,
            measured_makespan_s: run.timeline.makespan_ns() as f64 * 1e-9,
            predicted_bubbles: p.bubbles,
            measured_bubbles: bubble_ratios(&run.timeline),
        });
    }
    Ok(Comparison { steps: out })
}

/// Bubble ratio of every rank of a timeline: `1 - busy / makespan` (0 for an empty timeline).
pub fn bubble_ratios(t: &Timeline) -> Vec<f64> {
    let m = t.makespan_ns() as f64;
    (0..t.num_ranks())
        .map(|r| {
            if m > 0.0 {
                1.0 - t.busy_ns(r) as f64 / m
            } else {
                0.0
            }
        })
        .collect()
}

/// The median of `v` (mean of the middle two for an even count; NaN for none).
pub fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// Per rank, the median over the steps of that rank's value (ranks a step lacks are skipped).
fn per_rank_median<'a>(steps: impl Iterator<Item = &'a Vec<f64>> + Clone) -> Vec<f64> {
    let ranks = steps.clone().map(Vec::len).max().unwrap_or(0);
    (0..ranks)
        .map(|r| median(steps.clone().filter_map(|x| x.get(r).copied()).collect()))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn medians_and_the_sign_of_the_error() {
        assert_eq!(median(vec![3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(vec![4.0, 1.0, 2.0, 3.0]), 2.5);
        assert!(median(Vec::new()).is_nan());
        let step = |p: f64, m: f64, pb: Vec<f64>| StepComparison {
            predicted_makespan_s: p,
            measured_makespan_s: m,
            predicted_bubbles: pb.clone(),
            measured_bubbles: pb,
        };
        let c = Comparison {
            steps: vec![
                step(0.9, 1.0, vec![0.1, 0.3]),
                step(1.8, 2.0, vec![0.2, 0.5]),
                step(2.7, 3.0, vec![0.3, 0.4]),
            ],
        };
        // Medians 1.8 and 2.0: 10% under-predicted.
        assert!((c.rel_error() + 0.1).abs() < 1e-12);
        assert_eq!(c.predicted_bubbles(), vec![0.2, 0.4]);
    }
}
