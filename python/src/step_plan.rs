//! Python's `StepPlan`: one step planned (microbatches, every rank's actions, the
//! predicted timeline and memory).

use super::*;

/// One step, planned: per data-parallel replica its microbatches and every rank's actions in
/// PyTorch's notation (`0F3`, `1I2`, `1W2`, `0B1`, `(0F3;1B2)OVERLAP_F_B`), and with a profile
/// the predicted timeline and memory.
#[pyclass(module = "flatpipe._core", name = "StepPlan", frozen)]
#[derive(Debug)]
pub struct PyStepPlan {
    pub(crate) plan: Arc<StepPlan>,
    pub(crate) placement: Placement,
}

impl PyStepPlan {
    fn replica(&self, replica: usize) -> PyResult<&flatpipe_simulator::run::step::ReplicaPlan> {
        let n = self.plan.replicas.len();
        let r = self.plan.replicas.get(replica).ok_or_else(|| {
            err(format!(
                "replica = {replica} is out of range: the step has {n} replicas (0..{n})"
            ))
        })?;
        if r.rounds.len() != 1 {
            return Err(err(format!(
                "replica {replica} runs {} rounds; the Python runtime runs one round per step",
                r.rounds.len()
            )));
        }
        Ok(r)
    }

    /// The replica's predicted timeline and memory (`None` without a profile).
    fn prediction(
        &self,
        replica: usize,
    ) -> PyResult<Option<&flatpipe_simulator::run::step::RoundPrediction>> {
        Ok(self.replica(replica)?.rounds[0].prediction.as_ref())
    }

    fn check_rank(&self, rank: u32) -> PyResult<()> {
        let p = self.placement.num_ranks;
        if rank >= p {
            return Err(err(format!(
                "rank = {rank} is out of range: the pipeline has {p} ranks (0..{p})"
            )));
        }
        Ok(())
    }
}

#[pymethods]
impl PyStepPlan {
    /// The step's number.
    #[getter]
    fn step(&self) -> u64 {
        self.plan.step
    }

    /// Data-parallel replicas.
    #[getter]
    fn num_replicas(&self) -> usize {
        self.plan.replicas.len()
    }

    /// Ranks per pipeline.
    #[getter]
    fn num_ranks(&self) -> u32 {
        self.placement.num_ranks
    }

    /// Stages (`pp x vpp`).
    #[getter]
    fn num_stages(&self) -> u32 {
        self.placement.num_stages()
    }

    /// The rank that runs each stage, in stage order.
    #[getter]
    fn stage_ranks(&self) -> Vec<u32> {
        self.placement.rank_of.iter().map(|r| r.0).collect()
    }

    /// The stages `rank` runs, in stage order.
    fn stages_of(&self, rank: u32) -> PyResult<Vec<u32>> {
        self.check_rank(rank)?;
        Ok(self
            .placement
            .stages_of(Rank(rank))
            .into_iter()
            .map(|s: StageId| s.0)
            .collect())
    }

    /// The replica's microbatches, in id order.
    #[pyo3(signature = (replica = 0))]
    fn microbatches(&self, replica: usize) -> PyResult<Vec<PyMicrobatch>> {
        let r = self.replica(replica)?;
        Ok(PyMicrobatch::numbered(&r.microbatches))
    }

    /// The forward-only microbatches of the replica's step (their own id space), if any.
    #[pyo3(signature = (replica = 0))]
    fn forward_only_microbatches(&self, replica: usize) -> PyResult<Vec<PyMicrobatch>> {
        let r = self.replica(replica)?;
        Ok(PyMicrobatch::numbered(&r.rounds[0].fo))
    }

    /// `rank`'s actions in the replica's step, in the order it runs them.
    #[pyo3(signature = (rank, replica = 0))]
    fn actions(&self, rank: u32, replica: usize) -> PyResult<Vec<String>> {
        self.check_rank(rank)?;
        let r = self.replica(replica)?;
        Ok(r.rounds[0].schedule.ranks[rank as usize]
            .iter()
            .map(ToString::to_string)
            .collect())
    }

    /// `rank`'s actions in the replica's step, in the order it runs them, as structured
    /// [`PyAction`]s: the same entries as [`PyStepPlan::actions`], each with its one or two
    /// compute actions and the stages they send to and receive from (the core's
    /// `ComputeAction::sends` / `receives` over this plan's stages).
    ///
    /// # Errors
    /// `FlatpipeError` for a rank or replica out of range, or a replica of several rounds.
    #[pyo3(signature = (rank, replica = 0))]
    fn actions_of(&self, rank: u32, replica: usize) -> PyResult<Vec<PyAction>> {
        self.check_rank(rank)?;
        let r = self.replica(replica)?;
        let num_stages = self.placement.num_stages();
        Ok(r.rounds[0].schedule.ranks[rank as usize]
            .iter()
            .map(|&action| PyAction { action, num_stages })
            .collect())
    }

    /// The schedule's name.
    #[pyo3(signature = (replica = 0))]
    fn schedule_name(&self, replica: usize) -> PyResult<String> {
        Ok(self.replica(replica)?.rounds[0].schedule.name.clone())
    }

    /// Predicted step time of the replica's pipeline (the replay's makespan, optimizer
    /// included), seconds; `None` without a profile.
    #[pyo3(signature = (replica = 0))]
    fn predicted_step_time_s(&self, replica: usize) -> PyResult<Option<f64>> {
        Ok(self
            .prediction(replica)?
            .map(|p| p.simulation.metrics.makespan_s))
    }

    /// Predicted bubble ratio of the replica's pipeline; `None` without a profile.
    #[pyo3(signature = (replica = 0))]
    fn predicted_bubble_ratio(&self, replica: usize) -> PyResult<Option<f64>> {
        Ok(self
            .prediction(replica)?
            .map(|p| p.simulation.metrics.bubble_ratio))
    }

    /// Predicted peak memory per rank (parameters, gradients, optimizer state and the peak of
    /// activations), bytes; `None` without a profile.
    #[pyo3(signature = (replica = 0))]
    fn predicted_peak_bytes(&self, replica: usize) -> PyResult<Option<Vec<f64>>> {
        Ok(self.prediction(replica)?.map(|p| {
            p.simulation
                .metrics
                .ranks
                .iter()
                .zip(&p.static_bytes)
                .map(|(m, s)| m.peak_activation_bytes.unwrap_or(0.0) + s)
                .collect()
        }))
    }

    /// The predicted timeline: `(rank, action, start_s, end_s)` per compute action, rank by
    /// rank in run order; empty without a profile.
    #[pyo3(signature = (replica = 0))]
    fn timeline(&self, replica: usize) -> PyResult<Vec<(u32, String, f64, f64)>> {
        let Some(p) = self.prediction(replica)? else {
            return Ok(Vec::new());
        };
        Ok(p.simulation
            .timeline
            .compute
            .iter()
            .enumerate()
            .flat_map(|(rank, ops)| {
                ops.iter().map(move |op| {
                    (
                        rank as u32,
                        op.action.to_string(),
                        op.start_ns as f64 * 1e-9,
                        op.end_ns as f64 * 1e-9,
                    )
                })
            })
            .collect())
    }

    fn __repr__(&self) -> String {
        format!(
            "StepPlan(step={}, replicas={}, ranks={}, microbatches={:?})",
            self.plan.step,
            self.plan.replicas.len(),
            self.placement.num_ranks,
            self.plan
                .replicas
                .iter()
                .map(|r| r.microbatches.len())
                .collect::<Vec<_>>()
        )
    }
}
