//! Python's `ComputeAction` and `Action`: a rank's actions, structured, with the stages
//! each sends to and receives from; `parse_action` for PyTorch's notation.

use super::*;

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
