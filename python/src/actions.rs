//! Python's `ComputeAction` and `Action`: a rank's actions, structured, with the stages
//! each sends to and receives from; `parse_action` for PyTorch's notation.

use super::*;
use flatpipe_simulator::ir::comm::{CommAction, LoweredAction, Payload, Transfer};

/// One compute action of a step plan: stage `stage` runs `kind` (`"F"`, `"I"`, `"W"`, `"B"`,
/// `"Fo"`) on microbatch `microbatch`, with the pipeline's transfers it takes part in: the stage
/// its result goes to (`sends_to`: F and Fo send activations `[T, H]` to stage s + 1, I and B
/// the input gradient `[T, H]` to stage s - 1) and the stage whose result it waits on
/// (`receives_from`). Both are the core's rule (`ComputeAction::sends` / `receives`), given the
/// plan's stage count; `None` at the ends of the pipeline and for W.
#[pyclass(module = "flatpipe._core", name = "ComputeAction", frozen, eq, hash)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PyComputeAction {
    pub(crate) action: ComputeAction,
    pub(crate) num_stages: u32,
}

#[pymethods]
impl PyComputeAction {
    /// The stage (global index over all virtual stages).
    #[getter]
    fn stage(&self) -> u32 {
        self.action.stage.0
    }

    /// What is done: `"F"`, `"I"`, `"W"`, `"B"` or `"Fo"` (PyTorch's letters, plus
    /// forward-only).
    #[getter]
    fn kind(&self) -> &'static str {
        self.action.kind.letter()
    }

    /// The microbatch (forward-only microbatches, `Fo`, have their own id space).
    #[getter]
    fn microbatch(&self) -> u32 {
        self.action.microbatch.0
    }

    /// The stage this action's result is sent to, or `None` (W, the last stage's forward,
    /// stage 0's backward).
    #[getter]
    fn sends_to(&self) -> Option<u32> {
        self.action.sends(self.num_stages).map(|s| s.0)
    }

    /// The stage whose result this action waits on, or `None` (W, stage 0's forward, the last
    /// stage's backward).
    #[getter]
    fn receives_from(&self) -> Option<u32> {
        self.action.receives(self.num_stages).map(|s| s.0)
    }

    /// PyTorch's notation: `0F3`, `1I2`, `2Fo0`.
    fn __str__(&self) -> String {
        self.action.to_string()
    }

    fn __repr__(&self) -> String {
        let opt = |s: Option<u32>| s.map_or_else(|| "None".to_string(), |s| s.to_string());
        format!(
            "ComputeAction({:?}, sends_to={}, receives_from={})",
            self.action.to_string(),
            opt(self.sends_to()),
            opt(self.receives_from())
        )
    }
}

/// One entry of a rank's action list: a compute action, or an overlapped pair (DualPipe's
/// `(0F3;1B2)OVERLAP_F_B`: a forward and a backward the rank runs together, forward first).
#[pyclass(module = "flatpipe._core", name = "Action", frozen, eq, hash)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PyAction {
    pub(crate) action: Action,
    pub(crate) num_stages: u32,
}

#[pymethods]
impl PyAction {
    /// The entry in PyTorch's notation, as [`PyStepPlan::actions`] gives it (`0F3`,
    /// `(0F3;1B2)OVERLAP_F_B`).
    #[getter]
    fn text(&self) -> String {
        self.action.to_string()
    }

    /// Its compute actions: one, or an overlapped pair's forward then backward.
    #[getter]
    fn parts(&self) -> Vec<PyComputeAction> {
        self.action
            .parts()
            .map(|action| PyComputeAction {
                action,
                num_stages: self.num_stages,
            })
            .collect()
    }

    /// Whether this is an overlapped pair.
    #[getter]
    fn is_overlap(&self) -> bool {
        matches!(self.action, Action::Overlap(..))
    }

    fn __str__(&self) -> String {
        self.text()
    }

    fn __repr__(&self) -> String {
        format!("Action({:?})", self.text())
    }
}

/// One communication action of a rank's lowered program
/// (`StepPlan.lowered_actions_of`): the rank posts a send (`"SEND"`) or a receive
/// (`"RECV"`) of one transfer, or waits for its send (`"WAIT_SEND"`: the buffer may be
/// freed). The transfer carries `carries` (`"F"` activations, `"B"` an input gradient, `"Fo"`
/// forward-only activations, each `[T, H]` of microbatch `microbatch`) from stage
/// `sending_stage` to stage `receiving_stage`; `peer` is the other rank. `str()` gives PyTorch's name
/// (`0SEND_F3`, `1RECV_F3`, `0WAIT_SEND_F3`), numbered by the stage that posts it.
#[pyclass(module = "flatpipe._core", name = "CommAction", frozen, eq, hash)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PyCommAction {
    pub(crate) action: LoweredAction,
    pub(crate) peer: u32,
}

impl PyCommAction {
    fn transfer(&self) -> Transfer {
        match self.action {
            LoweredAction::Comm(c) => c.transfer(),
            LoweredAction::WaitSend(t) => t,
            _ => unreachable!("a CommAction holds a send, a receive or a send's wait"),
        }
    }
}

#[pymethods]
impl PyCommAction {
    /// `"SEND"`, `"RECV"` or `"WAIT_SEND"`.
    #[getter]
    fn kind(&self) -> &'static str {
        match self.action {
            LoweredAction::Comm(CommAction::Send(_)) => "SEND",
            LoweredAction::Comm(CommAction::Recv(_)) => "RECV",
            _ => "WAIT_SEND",
        }
    }

    /// What crosses: `"F"`, `"B"` or `"Fo"`.
    #[getter]
    fn carries(&self) -> &'static str {
        match self.transfer().payload {
            Payload::Activation => "F",
            Payload::Gradient => "B",
            Payload::ForwardOnly => "Fo",
        }
    }

    /// The microbatch (forward-only ones have their own id space).
    #[getter]
    fn microbatch(&self) -> u32 {
        self.transfer().microbatch.0
    }

    /// The stage whose compute produced the payload.
    #[getter]
    fn sending_stage(&self) -> u32 {
        self.transfer().stage.0
    }

    /// The stage that consumes it.
    #[getter]
    fn receiving_stage(&self) -> u32 {
        self.transfer().to_stage().0
    }

    /// The other rank of the transfer.
    #[getter]
    fn peer(&self) -> u32 {
        self.peer
    }

    /// PyTorch's name.
    fn __str__(&self) -> String {
        self.action.to_string()
    }

    fn __repr__(&self) -> String {
        format!(
            "CommAction({:?}, peer={})",
            self.action.to_string(),
            self.peer
        )
    }
}

/// One action in PyTorch's notation, read by the core's parser (`Action::from_str`):
/// `"0F3"` -> `[(0, "F", 3)]`, an overlapped pair `"(0F3;1B2)OVERLAP_F_B"` -> both halves,
/// forward first, as `(stage, kind, microbatch)`.
///
/// # Errors
/// `ValueError` (the text is the caller's value) naming the text and what is wrong with it.
#[pyfunction]
pub(crate) fn parse_action(text: &str) -> PyResult<Vec<(u32, &'static str, u32)>> {
    let action: Action = text.parse().map_err(|e| match &e {
        flatpipe_simulator::Error::ParseAction { text: part, .. } if part != text => {
            PyValueError::new_err(format!("{text:?}: {e}"))
        }
        _ => PyValueError::new_err(e.to_string()),
    })?;
    Ok(action
        .parts()
        .map(|a| (a.stage.0, a.kind.letter(), a.microbatch.0))
        .collect())
}
