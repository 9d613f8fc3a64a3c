//! `flatpipe._core`: the Python package's native module over the Rust core (PyO3).
//!
//! What Python gets: cost profiles ([`PyProfile`]), a pipeline configuration ([`PyPipeline`],
//! the Rust [`RunConfig`]) that plans each step from its sequence lengths into a
//! [`PyStepPlan`] (microbatches with `cu_seqlens` as numpy arrays, every rank's actions in
//! PyTorch's notation and as structured [`PyAction`]s whose parts say which stage each sends
//! to and receives from, the predicted timeline and memory), Monte Carlo simulation over a
//! workload, and the planner's search. Every Rust error becomes a `flatpipe.FlatpipeError`
//! carrying the Rust message. The torch.distributed runtime that executes a step plan is pure
//! Python (`flatpipe/torch.py`).

use flatpipe_planner::search::{self, RankBy, SearchConfig, SearchSpace};
use flatpipe_profiles::{
    AnalyticOptions, CostCoeffs, LayerKind, Profile, ProfileSource, analytic_profile, builtins,
};
use flatpipe_simulator::batching::microbatch::Microbatch;
use flatpipe_simulator::batching::policy::{Policy, PolicyParams};
use flatpipe_simulator::ir::{Action, ComputeAction, Placement, Rank, StageId};
use flatpipe_simulator::run::plan::{Plan, even_split};
use flatpipe_simulator::run::{
    config::RunConfig,
    step::{StepPlan, cut_step, plan_step},
};
use flatpipe_simulator::run::{
    config::{Capacity, ForwardOnlySpec, ScheduleSource, balance_cost, default_memory_limit},
    montecarlo::summarize,
    step::StepOutcome,
};
use flatpipe_simulator::schedules::forward_only::FoMode;
use flatpipe_simulator::schedules::generators::ScheduleKind;
use numpy::{PyArray1, ToPyArray};
use pyo3::create_exception;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;
use std::fmt::Display;
use std::ops::Range;
use std::sync::Arc;

mod actions;
mod estimate;
mod functions;
mod microbatch;
mod pipeline;
mod profile;
mod step_plan;
mod workload;
pub use actions::*;
use functions::*;
pub use microbatch::*;
pub use pipeline::*;
pub use profile::*;
pub use step_plan::*;
pub use workload::*;

create_exception!(
    _core,
    FlatpipeError,
    PyValueError,
    "An error from flatpipe's Rust core (a `ValueError`): the message names the file, field, value \
     and allowed range; `field` and `value` hold the two where the error is about one field \
     (else `None`)."
);

/// `flatpipe.results.<class_name>(**fields)`: a typed result (a frozen dataclass of
/// `flatpipe/results.py`) from the fields the core filled in.
fn typed_result<'py>(fields: &Bound<'py, PyDict>, class_name: &str) -> PyResult<Bound<'py, PyAny>> {
    let py = fields.py();
    py.import("flatpipe.results")?
        .getattr(class_name)?
        .call((), Some(fields))
}

/// The field and the value an error of the core names, where it is about one.
fn field_of(e: &dyn std::any::Any) -> Option<(String, String)> {
    use flatpipe_simulator::Error as SimError;
    if let Some(SimError::InvalidArgument { field, value, .. }) = e.downcast_ref::<SimError>() {
        return Some((field.clone(), value.clone()));
    }
    let profiles = match e.downcast_ref::<SimError>() {
        Some(SimError::Profiles(p)) => Some(p),
        _ => e.downcast_ref::<flatpipe_profiles::Error>(),
    };
    match profiles {
        Some(flatpipe_profiles::Error::Invalid { field, value, .. }) => {
            Some((field.clone(), value.clone()))
        }
        _ => None,
    }
}

/// `e` as a [`FlatpipeError`] with its message, and its `field` and `value` attributes.
fn err<E: Display + 'static>(e: E) -> PyErr {
    let (field, value) = field_of(&e).unzip();
    let e = FlatpipeError::new_err(e.to_string());
    Python::attach(|py| {
        let v = e.value(py);
        // Setting an attribute on a fresh exception instance cannot fail.
        let _ = v.setattr("field", field);
        let _ = v.setattr("value", value);
    });
    e
}

/// An unsigned integer type an argument converts to ([`nat`]).
pub(crate) trait Nat: Sized + TryFrom<i128> {
    /// The largest value, for the error's range.
    const MAX: u128;
}
impl Nat for u32 {
    const MAX: u128 = u32::MAX as u128;
}
impl Nat for u64 {
    const MAX: u128 = u64::MAX as u128;
}
impl Nat for usize {
    const MAX: u128 = usize::MAX as u128;
}

/// The integer argument `field` as a `T`: Python's ints arrive as `i128` so that a negative or
/// oversized one is a [`FlatpipeError`] naming the argument and its range, not PyO3's
/// `OverflowError` without a name.
fn nat<T: Nat>(field: &str, v: i128) -> PyResult<T> {
    T::try_from(v).map_err(|_| invalid(field, v, &format!("an integer from 0 to {}", T::MAX)))
}

/// [`nat`] of an optional argument.
fn nat_opt<T: Nat>(field: &str, v: Option<i128>) -> PyResult<Option<T>> {
    v.map(|v| nat(field, v)).transpose()
}

/// `field = value is invalid: allowed`, as the core words it ([`FlatpipeError`] with `field`
/// and `value` set).
fn invalid(field: &str, value: impl Display, allowed: &str) -> PyErr {
    err(flatpipe_simulator::Error::invalid(field, value, allowed))
}

/// The native module `flatpipe._core`.
#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("FlatpipeError", m.py().get_type::<FlatpipeError>())?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    // The names `Pipeline(schedule=..., policy=...)` accepts, in the core's order (the Python
    // package's `Schedule` and `Policy` enums are checked against them).
    let schedules: Vec<&str> = ScheduleKind::ALL.iter().map(|k| k.name()).collect();
    let policies: Vec<&str> = Policy::ALL.iter().map(|p| p.name()).collect();
    m.add("SCHEDULES", schedules)?;
    m.add("POLICIES", policies)?;
    m.add_class::<PyProfile>()?;
    m.add_class::<PyPipeline>()?;
    m.add_class::<PyWorkload>()?;
    m.add_class::<PyMicrobatch>()?;
    m.add_class::<PyStepPlan>()?;
    m.add_class::<estimate::PySpeedEstimate>()?;
    m.add_class::<PyComputeAction>()?;
    m.add_class::<PyAction>()?;
    m.add_class::<PyCommAction>()?;
    m.add_function(wrap_pyfunction!(parse_action, m)?)?;
    m.add_function(wrap_pyfunction!(plan, m)?)?;
    m.add_function(wrap_pyfunction!(import_trace, m)?)?;
    Ok(())
}
