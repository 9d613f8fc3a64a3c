//! The closed loop's measuring half: run a planned [`Setup`] for some steps on a backend and put
//! each step's measured makespan and bubble ratios beside the simulator's prediction of the very
//! schedules that ran ([`PreparedStep::predict`]). `flatpipe calibrate` plans each schedule
//! (`flatpipe_planner::search::plan_schedule`), then calls [`measure_setups`] (each setup's steps
//! through [`measure_steps`], or all setups' side by side).

use crate::backend::{AnyExecutor, BackendConfig};
use crate::interpreter::StepRun;
use crate::runner::{PreparedStep, Setup};
use crate::steps::{StepDone, WarmUp, run_steps, train};
use crate::{Error, Result};
use flatpipe_profiles::Profile;
use flatpipe_simulator::Timeline;
use flatpipe_simulator::ir::{Action, ActionKind};

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
    /// Per phase, the busy seconds of replica 0's ranks, predicted and measured
    /// ([`phase_busy_s`]): where a makespan error comes from (slower kernels, or waits).
    pub phases: Vec<PhaseTime>,
}

/// The busy time of one phase over a replica's ranks in one step.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct PhaseTime {
    /// `F`, `I`, `W`, `B`, `Fo`, `F&B` (an overlapped pair) or `optimizer`.
    pub phase: &'static str,
    /// Predicted busy seconds, summed over the ranks.
    pub predicted_s: f64,
    /// Measured busy seconds, summed over the ranks.
    pub measured_s: f64,
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

    /// Per phase, the medians over the steps of the predicted and measured busy seconds.
    pub fn phases(&self) -> Vec<PhaseTime> {
        let mut out: Vec<PhaseTime> = Vec::new();
        for name in PHASES {
            let of = |pick: fn(&PhaseTime) -> f64| -> Vec<f64> {
                self.steps
                    .iter()
                    .filter_map(|s| s.phases.iter().find(|p| p.phase == name).map(pick))
                    .collect()
            };
            let (p, m) = (of(|p| p.predicted_s), of(|p| p.measured_s));
            if !p.is_empty() {
                out.push(PhaseTime {
                    phase: name,
                    predicted_s: median(p),
                    measured_s: median(m),
                });
            }
        }
        out
    }
}

/// The phases [`phase_busy_s`] reports, in order.
const PHASES: [&str; 7] = ["F", "I", "W", "B", "Fo", "F&B", "optimizer"];

/// Busy seconds per phase over ranks `0..ranks` of a timeline (compute actions by kind, an
/// overlapped pair as `F&B`, and the optimizer step), in the order F, I, W, B, Fo, F&B, optimizer, phases with no
/// action left out.
pub fn phase_busy_s(t: &Timeline, ranks: usize) -> Vec<(&'static str, f64)> {
    let mut busy = [0u64; PHASES.len()];
    for r in 0..ranks.min(t.num_ranks()) {
        for op in &t.compute[r] {
            let i = match op.action {
                Action::Compute(c) => match c.kind {
                    ActionKind::F => 0,
                    ActionKind::I => 1,
                    ActionKind::W => 2,
                    ActionKind::B => 3,
                    ActionKind::Fo => 4,
                },
                Action::Overlap(..) => 5,
            };
            busy[i] += op.end_ns.saturating_sub(op.start_ns);
        }
        if let Some(Some((a, b))) = t.optimizer.get(r) {
            busy[6] += b.saturating_sub(*a);
        }
    }
    PHASES
        .iter()
        .zip(busy)
        .filter(|(_, ns)| *ns > 0)
        .map(|(name, ns)| (*name, ns as f64 * 1e-9))
        .collect()
}

/// How many times the measured steps run unmeasured first ([`WarmUp::Repeat`]): the very
/// steps measured, once over.
///
/// The warm-up runs the very steps it precedes because a step's time depends on whether its
/// memory was touched before ([`crate::steps`]). Measured on this project's 2-core machine
/// (2026-12-01, ZB-H2, pp = 2, `tiny`): the first three steps of a run came out 35%, 15% and
/// -17% off their prediction with no warm-up, 4%, 3% and -10% after three warm-up steps. The
/// profile's repeated kernels never pay that, so a prediction describes the warm steady state,
/// and so does this measurement.
pub const WARM_UP_ROUNDS: u64 = 1;

/// Runs steps `0..steps` of the setup's sampler `warmup` times unmeasured, then once measured
/// ([`WarmUp::Repeat`], see [`WARM_UP_ROUNDS`]), each measured step predicted on `profile` by the
/// replay of the schedules that ran. `progress` is called after every step, warm-up included.
///
/// # Errors
/// [`Error::InvalidArgument`] for `steps = 0`; the executor's; prediction errors (a profile that
/// does not match the setup's stages).
pub fn measure_steps(
    exec: &mut AnyExecutor,
    setup: &Setup,
    profile: &Profile,
    warmup: u64,
    steps: u64,
    progress: &dyn Fn(),
) -> Result<Comparison> {
    check_steps(steps)?;
    let mut out = Vec::with_capacity(steps as usize);
    run_steps(
        exec,
        setup,
        None,
        WarmUp::Repeat(warmup),
        steps,
        None,
        progress,
        |done: StepDone<'_>| -> Result<Option<std::sync::Arc<Profile>>> {
            out.push(compare_step(setup, profile, &done.prepared, &done.run)?);
            Ok(None)
        },
    )?;
    Ok(Comparison { steps: out })
}

/// The order several setups' measured steps run in ([`measure_setups`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Order {
    /// One setup's steps after another's, one executor at a time.
    Sequential,
    /// Every setup's step i before any setup's step i + 1, all executors side by side: a drift
    /// of the host's speed hits every setup alike.
    Interleaved,
}

/// Measures `steps` steps of every setup on `backend` ([`measure_steps`], warmed up per
/// [`WARM_UP_ROUNDS`]), in `order`; one [`Comparison`] per setup, in order. `progress` is called
/// after every step, warm-up included (`2 * steps` per setup).
///
/// # Errors
/// [`Error::InvalidArgument`] for `steps = 0`; [`AnyExecutor::new`]'s; the executor's and the
/// prediction's.
pub fn measure_setups(
    backend: &BackendConfig,
    setups: &[&Setup],
    profile: &Profile,
    steps: u64,
    order: Order,
    progress: &dyn Fn(),
) -> Result<Vec<Comparison>> {
    check_steps(steps)?;
    match order {
        Order::Sequential => setups
            .iter()
            .map(|setup| {
                let mut exec = AnyExecutor::new(backend, setup)?;
                measure_steps(&mut exec, setup, profile, WARM_UP_ROUNDS, steps, progress)
            })
            .collect(),
        Order::Interleaved => {
            let mut execs = setups
                .iter()
                .map(|setup| AnyExecutor::new(backend, setup))
                .collect::<Result<Vec<_>>>()?;
            for id in WarmUp::Repeat(WARM_UP_ROUNDS).step_ids(steps) {
                for (setup, exec) in setups.iter().zip(&mut execs) {
                    train(exec, setup, id)?;
                    progress();
                }
            }
            let mut out = vec![Vec::with_capacity(steps as usize); setups.len()];
            for step in 0..steps {
                for ((setup, exec), measured) in setups.iter().zip(&mut execs).zip(&mut out) {
                    measured.push(measure_step(exec, setup, profile, step)?);
                    progress();
                }
            }
            Ok(out.into_iter().map(|steps| Comparison { steps }).collect())
        }
    }
}

/// Refuses `steps = 0`: a comparison needs a measured step.
fn check_steps(steps: u64) -> Result<()> {
    if steps == 0 {
        return Err(Error::InvalidArgument {
            field: "steps",
            value: "0".into(),
            allowed: ">= 1 measured step".into(),
        });
    }
    Ok(())
}

/// Runs step `step` of `setup` once on `exec` and compares it with its prediction on
/// `profile`: makespan, bubbles per rank and busy time per phase.
///
/// # Errors
/// As [`AnyExecutor::train_step`] and the prediction.
pub fn measure_step(
    exec: &mut AnyExecutor,
    setup: &Setup,
    profile: &Profile,
    step: u64,
) -> Result<StepComparison> {
    let (prepared, run) = train(exec, setup, step)?;
    compare_step(setup, profile, &prepared, &run)
}

/// A step that ran beside its prediction on `profile`: makespan, bubbles per rank and busy
/// time per phase.
///
/// # Errors
/// The prediction's (a profile that does not match the setup's stages).
pub fn compare_step(
    setup: &Setup,
    profile: &Profile,
    prepared: &PreparedStep,
    run: &StepRun,
) -> Result<StepComparison> {
    let p = prepared.predict(setup, profile)?;
    let pp = setup.config.pp as usize;
    let measured = phase_busy_s(&run.timeline, pp);
    let phases = p
        .timeline
        .as_ref()
        .map(|t| phase_busy_s(t, pp))
        .unwrap_or_default()
        .into_iter()
        .map(|(phase, predicted_s)| PhaseTime {
            phase,
            predicted_s,
            measured_s: measured
                .iter()
                .find(|(n, _)| *n == phase)
                .map_or(0.0, |(_, s)| *s),
        })
        .collect();
    Ok(StepComparison {
        predicted_makespan_s: p.makespan_s,
        measured_makespan_s: run.timeline.makespan_ns() as f64 * 1e-9,
        predicted_bubbles: p.bubbles,
        measured_bubbles: bubble_ratios(&run.timeline),
        phases,
    })
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
    fn busy_time_per_phase_sums_the_ranks_actions() {
        use flatpipe_simulator::replay::timeline::TimedOp;
        let op = |kind, start_ns, end_ns| TimedOp {
            action: Action::new(0, kind, 0),
            start_ns,
            end_ns,
        };
        let t = Timeline {
            compute: vec![
                vec![op(ActionKind::F, 0, 10), op(ActionKind::B, 20, 50)],
                vec![op(ActionKind::F, 10, 25), op(ActionKind::B, 30, 40)],
                // A third rank (another replica): left out with ranks = 2.
                vec![op(ActionKind::F, 0, 1000)],
            ],
            transfers: Vec::new(),
            optimizer: vec![Some((50, 60)), Some((50, 58)), None],
            comm: Vec::new(),
        };
        let got = phase_busy_s(&t, 2);
        let want = [("F", 25e-9), ("B", 40e-9), ("optimizer", 18e-9)];
        assert_eq!(got.len(), want.len(), "{got:?}");
        for ((n, s), (wn, ws)) in got.iter().zip(want) {
            assert_eq!(*n, wn);
            assert!((s - ws).abs() < 1e-18, "{n}: {s}");
        }
    }

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
            phases: vec![PhaseTime {
                phase: "F",
                predicted_s: p,
                measured_s: m,
            }],
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
        assert_eq!(
            c.phases(),
            vec![PhaseTime {
                phase: "F",
                predicted_s: 1.8,
                measured_s: 2.0
            }]
        );
    }
}
