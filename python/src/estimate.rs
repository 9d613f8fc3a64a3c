//! Python's `SpeedEstimate`: how fast a run goes against its pipeline's profile, from the
//! compute time of every action each step measured, and the pipeline to plan the next step
//! with (the core's [`SpeedEstimate`], as `flatpipe execute --replan` uses it).

use super::*;
use flatpipe_simulator::replay::timeline::{TimedOp, Timeline};
use flatpipe_simulator::run::estimate::SpeedEstimate;
use std::str::FromStr;

/// Per pipeline rank and phase, the measured over the predicted busy time of the steps seen,
/// exponentially weighted (forgetting factor in (0, 1]).
#[pyclass(module = "flatpipe._core", name = "SpeedEstimate")]
#[derive(Debug)]
pub struct PySpeedEstimate {
    pipeline: PyPipeline,
    base: Arc<Profile>,
    inner: SpeedEstimate,
}

/// The measured timeline of `timings` (`(rank, action, compute_s)`) on the ranks of
/// `schedule` (the replica's round that ran): each rank's actions one after the other, each as
/// long as its compute time. Every timing must be an action the schedule puts on its rank, at
/// most once.
fn measured_timeline(
    timings: &[(i128, String, f64)],
    schedule: &flatpipe_simulator::ir::Schedule,
) -> PyResult<Timeline> {
    if timings.is_empty() {
        return Err(err(
            "timings is empty: give every rank's (rank, action, compute_s) of the step",
        ));
    }
    let pp = schedule.ranks.len();
    let mut seen = std::collections::HashSet::new();
    let mut compute: Vec<Vec<TimedOp>> = vec![Vec::new(); pp];
    for (k, (rank, text, secs)) in timings.iter().enumerate() {
        let r: usize = nat(&format!("timings[{k}] rank"), *rank)?;
        if r >= pp {
            return Err(invalid(
                &format!("timings[{k}] rank"),
                r,
                &format!("a pipeline rank below {pp}"),
            ));
        }
        if !(secs.is_finite() && *secs >= 0.0) {
            return Err(invalid(
                &format!("timings[{k}] compute_s"),
                secs,
                "seconds, finite and >= 0",
            ));
        }
        let action = Action::from_str(text).map_err(err)?;
        if !schedule.ranks[r].contains(&action) {
            return Err(invalid(
                &format!("timings[{k}] action"),
                text,
                &format!("an action the plan puts on rank {r}"),
            ));
        }
        if !seen.insert((r, action)) {
            return Err(invalid(
                &format!("timings[{k}] action"),
                text,
                &format!("each of rank {r}'s actions once"),
            ));
        }
        let start_ns = compute[r].last().map_or(0, |op| op.end_ns);
        compute[r].push(TimedOp {
            action,
            start_ns,
            end_ns: start_ns + (secs * 1e9).round() as u64,
        });
    }
    Ok(Timeline {
        compute,
        ..Timeline::default()
    })
}

#[pymethods]
impl PySpeedEstimate {
    /// An estimate for `pipeline` (which must have a profile: what every step is set against),
    /// forgetting with `forgetting` in (0, 1] (a step one step older weighs this much; 1: all
    /// alike).
    #[new]
    #[pyo3(signature = (pipeline, forgetting = 1.0))]
    fn new(pipeline: PyRef<'_, PyPipeline>, forgetting: f64) -> PyResult<Self> {
        let base = pipeline.profile.clone().ok_or_else(|| {
            err("SpeedEstimate needs a pipeline with a profile: Pipeline(..., profile=...)")
        })?;
        Ok(PySpeedEstimate {
            pipeline: pipeline.clone(),
            base,
            inner: SpeedEstimate::new(forgetting).map_err(err)?,
        })
    }

    /// Adds one step: `plan` (planned by this pipeline or by :meth:`planning_pipeline`) and
    /// what replica `replica`'s ranks measured, `(rank, action, compute_s)` per action (every
    /// rank's: `flatpipe.replan.gather_timings`). The plan's schedules are replayed on the
    /// pipeline's profile and each rank's busy time per phase set against the measured one.
    /// One estimate follows one replica: with dp > 1, keep one per replica. Refuses empty
    /// timings, an action the plan does not put on that rank, an action given twice.
    #[pyo3(signature = (plan, timings, replica = 0))]
    fn observe(
        &mut self,
        plan: PyRef<'_, PyStepPlan>,
        timings: Vec<(i128, String, f64)>,
        replica: i128,
    ) -> PyResult<()> {
        let replica: usize = nat("replica", replica)?;
        let config = &self.pipeline.config;
        let pp = config.pp as usize;
        if plan.placement.num_ranks as usize != pp || replica >= plan.plan.replicas.len() {
            return Err(err(format!(
                "the plan (pp = {}, {} replicas) is not one of this pipeline's (pp = {pp}) or has no replica {replica}",
                plan.placement.num_ranks,
                plan.plan.replicas.len()
            )));
        }
        let on_base = plan.plan.replayed_on(config, &self.base).map_err(err)?;
        let predicted = on_base.replicas[replica]
            .chart()
            .map(|(_, s)| s.timeline)
            .ok_or_else(|| err("the plan has no prediction to set the timings against"))?;
        let ran = &plan.plan.replicas[replica].rounds;
        let schedule = match ran.as_slice() {
            [round] => &round.schedule,
            _ => {
                return Err(err(
                    "the plan's replica runs several rounds; the runtime runs one",
                ));
            }
        };
        let measured = measured_timeline(&timings, schedule)?;
        self.inner.observe(&predicted, &measured, pp);
        Ok(())
    }

    /// Steps observed.
    #[getter]
    fn steps(&self) -> u64 {
        self.inner.steps()
    }

    /// Per pipeline rank, its measured over predicted busy time over all phases.
    fn rank_factors(&self) -> Vec<f64> {
        self.inner.rank_factors()
    }

    /// Pipeline rank `rank`'s factor per phase: ``{"f", "i", "w", "b", "optimizer"}``.
    fn phase_factors<'py>(&self, py: Python<'py>, rank: i128) -> PyResult<Bound<'py, PyDict>> {
        let rank: usize = nat("rank", rank)?;
        let pp = self.pipeline.config.pp as usize;
        if rank >= pp {
            return Err(invalid(
                "rank",
                rank,
                &format!("a pipeline rank below {pp}"),
            ));
        }
        let s = self.inner.rank_phase_scale(rank);
        let d = PyDict::new(py);
        for (k, v) in [
            ("f", s.f),
            ("i", s.i),
            ("w", s.w),
            ("b", s.b),
            ("optimizer", s.optimizer),
        ] {
            d.set_item(k, v)?;
        }
        Ok(d)
    }

    /// The pipeline to plan the next step with: this one with each rank's stages scaled by
    /// that rank's factors (zb-auto's schedule, the cost-balanced cuts and the prediction
    /// follow a rank that slows down).
    fn planning_pipeline(&self) -> PyResult<PyPipeline> {
        let profile = self
            .inner
            .planning_profile(&self.base, &self.pipeline.config)
            .map_err(err)?;
        Ok(PyPipeline {
            profile: Some(Arc::new(profile)),
            ..self.pipeline.clone()
        })
    }

    /// A layer split for the rank speeds measured so far, when a rank stays more than 10%
    /// slower than another (the planner's `partition::speeds::propose_split`: each layer's
    /// F + I + W at a microbatch of `tokens` tokens and `pairs` causal pairs, each rank's stage
    /// times its factor, the slowest stage minimised exactly): the stages as `(start, end)`
    /// layer ranges, or `None` (no rank slow enough, several stages per rank, or no faster
    /// split). It is for the next launch: moving layers mid-run moves weights and optimizer
    /// state.
    #[pyo3(signature = (tokens, pairs = 0.0))]
    fn propose_split(&self, tokens: f64, pairs: f64) -> PyResult<Option<Vec<(usize, usize)>>> {
        if !(tokens.is_finite() && tokens > 0.0 && pairs.is_finite() && pairs >= 0.0) {
            return Err(invalid(
                "tokens, pairs",
                format!("{tokens}, {pairs}"),
                "a microbatch's tokens (> 0) and causal pairs (>= 0)",
            ));
        }
        let config = &self.pipeline.config;
        let speeds = self.inner.rank_factors();
        if config.v != 1 || speeds.len() != config.pp as usize {
            return Ok(None);
        }
        Ok(flatpipe_planner::partition::speeds::propose_split(
            &self.base,
            &config.stages,
            &speeds,
            (tokens, pairs),
        )
        .map(|(stages, _, _)| stages.into_iter().map(|r| (r.start, r.end)).collect()))
    }

    fn __repr__(&self) -> String {
        format!(
            "SpeedEstimate(steps={}, rank_factors={:?})",
            self.inner.steps(),
            self.inner.rank_factors()
        )
    }
}
