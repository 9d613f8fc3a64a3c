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
    fn replica(&self, replica: i128) -> PyResult<&flatpipe_simulator::run::step::ReplicaPlan> {
        let replica: usize = nat("replica", replica)?;
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
        replica: i128,
    ) -> PyResult<Option<&flatpipe_simulator::run::step::RoundPrediction>> {
        Ok(self.replica(replica)?.rounds[0].prediction.as_ref())
    }

    /// `rank` checked against the pipeline's ranks.
    fn check_rank(&self, rank: i128) -> PyResult<u32> {
        let rank: u32 = nat("rank", rank)?;
        let p = self.placement.num_ranks;
        if rank >= p {
            return Err(err(format!(
                "rank = {rank} is out of range: the pipeline has {p} ranks (0..{p})"
            )));
        }
        Ok(rank)
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
    fn stages_of(&self, rank: i128) -> PyResult<Vec<u32>> {
        let rank = self.check_rank(rank)?;
        Ok(self
            .placement
            .stages_of(Rank(rank))
            .into_iter()
            .map(|s: StageId| s.0)
            .collect())
    }

    /// The replica's microbatches, in id order.
    #[pyo3(signature = (replica = 0))]
    fn microbatches(&self, replica: i128) -> PyResult<Vec<PyMicrobatch>> {
        let r = self.replica(replica)?;
        Ok(PyMicrobatch::numbered(&r.microbatches))
    }

    /// The forward-only microbatches of the replica's step (their own id space), if any.
    #[pyo3(signature = (replica = 0))]
    fn forward_only_microbatches(&self, replica: i128) -> PyResult<Vec<PyMicrobatch>> {
        let r = self.replica(replica)?;
        Ok(PyMicrobatch::numbered(&r.rounds[0].fo))
    }

    /// `rank`'s actions in the replica's step, in the order it runs them.
    #[pyo3(signature = (rank, replica = 0))]
    fn actions(&self, rank: i128, replica: i128) -> PyResult<Vec<String>> {
        let rank = self.check_rank(rank)?;
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
    fn actions_of(&self, rank: i128, replica: i128) -> PyResult<Vec<PyAction>> {
        let rank = self.check_rank(rank)?;
        let r = self.replica(replica)?;
        let num_stages = self.placement.num_stages();
        Ok(r.rounds[0].schedule.ranks[rank as usize]
            .iter()
            .map(|&action| PyAction { action, num_stages })
            .collect())
    }

    /// `rank`'s program with its communication: the entries of [`PyStepPlan::actions_of`]
    /// (as [`PyAction`]s) with the sends, receives and send waits ([`PyCommAction`]s) between
    /// them, in the order the core's lowering posts them (`ir::lowering::sweep`, PyTorch
    /// 2.15's `_add_send_recv` + `_add_wait_send`; `posting = "deferred"` adds
    /// `_defer_recv_ops`). With `forward_only`, the program of the F parts alone, in the
    /// same order (an evaluation step).
    ///
    /// # Errors
    /// `ValueError` for a `posting` other than `"ahead"` / `"deferred"`; `FlatpipeError` for a
    /// rank or replica out of range, a schedule whose lowering cannot place an action, or a
    /// deferred order in which a rank pair's sends and receives differ (NCCL and gloo match
    /// them in posting order: `ir::lowering::check_pair_order`).
    #[pyo3(signature = (rank, replica = 0, posting = "ahead", forward_only = false))]
    fn lowered_actions_of(
        &self,
        py: Python<'_>,
        rank: i128,
        replica: i128,
        posting: &str,
        forward_only: bool,
    ) -> PyResult<Vec<Py<PyAny>>> {
        use flatpipe_simulator::ir::comm::LoweredAction;
        use flatpipe_simulator::ir::lowering::{RecvPosting, sweep};
        let posting = match posting {
            "ahead" => RecvPosting::Ahead,
            "deferred" => RecvPosting::Deferred,
            other => {
                return Err(PyValueError::new_err(format!(
                    "posting = {other:?}: one of \"ahead\" (PyTorch's _add_send_recv), \"deferred\" (_defer_recv_ops)"
                )));
            }
        };
        let rank = self.check_rank(rank)?;
        let r = self.replica(replica)?;
        let mut schedule = (*r.rounds[0].schedule).clone();
        if forward_only {
            for acts in &mut schedule.ranks {
                *acts = acts
                    .iter()
                    .flat_map(Action::parts)
                    .filter(|a| a.kind == flatpipe_simulator::ir::ActionKind::F)
                    .map(Action::Compute)
                    .collect();
            }
        }
        flatpipe_simulator::ir::lowering::check_pair_order(&schedule, posting).map_err(err)?;
        let num_stages = self.placement.num_stages();
        let mut mine = Vec::new();
        sweep(&schedule, posting, |q, a| {
            if q == rank as usize {
                mine.push(a);
            }
        })
        .map_err(err)?;
        let peer = |a: LoweredAction| {
            let t = match a {
                LoweredAction::Comm(c) => c.transfer(),
                LoweredAction::WaitSend(t) => t,
                _ => return rank,
            };
            let (from, to) = (
                self.placement.rank(t.stage).0,
                self.placement.rank(t.to_stage()).0,
            );
            if from == rank { to } else { from }
        };
        mine.into_iter()
            .map(|a| match a {
                LoweredAction::Compute(action) => {
                    Ok(Py::new(py, PyAction { action, num_stages })?.into_any())
                }
                LoweredAction::Comm(_) | LoweredAction::WaitSend(_) => Ok(Py::new(
                    py,
                    PyCommAction {
                        action: a,
                        peer: peer(a),
                    },
                )?
                .into_any()),
                LoweredAction::Fsdp(..) => Err(err(format!("{a}: FSDP actions are not run here"))),
                LoweredAction::AllToAll(_) => Err(err(format!(
                    "{a}: all-to-alls run inside their compute actions, not as actions of the program"
                ))),
            })
            .collect()
    }

    /// The schedule's name.
    #[pyo3(signature = (replica = 0))]
    fn schedule_name(&self, replica: i128) -> PyResult<String> {
        Ok(self.replica(replica)?.rounds[0].schedule.name.clone())
    }

    /// Predicted step time of the replica's pipeline (the replay's makespan, optimizer
    /// included), seconds; `None` without a profile.
    #[pyo3(signature = (replica = 0))]
    fn predicted_step_time_s(&self, replica: i128) -> PyResult<Option<f64>> {
        Ok(self
            .prediction(replica)?
            .map(|p| p.simulation.metrics.makespan_s))
    }

    /// Predicted bubble ratio of the replica's pipeline; `None` without a profile.
    #[pyo3(signature = (replica = 0))]
    fn predicted_bubble_ratio(&self, replica: i128) -> PyResult<Option<f64>> {
        Ok(self
            .prediction(replica)?
            .map(|p| p.simulation.metrics.bubble_ratio))
    }

    /// Predicted peak memory per rank (parameters, gradients, optimizer state and the peak of
    /// activations), bytes; `None` without a profile.
    #[pyo3(signature = (replica = 0))]
    fn predicted_peak_bytes(&self, replica: i128) -> PyResult<Option<Vec<f64>>> {
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
    fn timeline(&self, replica: i128) -> PyResult<Vec<(u32, String, f64, f64)>> {
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
