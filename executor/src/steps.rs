//! The step loop every command that runs a plan shares: warm-up steps (the [`WarmUp`] policy),
//! then the reported steps `0..steps` in order, each handed to the caller with what it ran
//! ([`run_steps`]). `flatpipe execute` reports each step (and checks it against the reference);
//! [`crate::calibrate`] puts each beside its prediction.
//!
//! Why a warm-up at all: a step's time depends on whether its memory was touched before. The
//! process keeps what it frees ([`crate::alloc`]), but the first time a step needs more than any
//! step before, the operating system faults in and zeroes the new pages (and a GPU library
//! initialises itself on its first calls). Training pays that once, in its first steps.

use crate::backend::AnyExecutor;
use crate::interpreter::StepRun;
use crate::runner::{PreparedStep, Reference, Setup};
use crate::{Error, Result};
use flatpipe_profiles::Profile;
use std::sync::Arc;

/// Which steps run, unreported, before the reported steps `0..steps`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WarmUp {
    /// `n` further steps of the sampler, drawn after the reported ones (step ids `steps..steps
    /// + n`), so the reported steps' data is the same with or without them; they train the
    /// model (and the reference, if any) like any step. `flatpipe execute`'s warm-up.
    Following(u64),
    /// The reported steps themselves, `n` rounds over, so each reported step finds its own
    /// memory touched: a measurement of the warm steady state, which is what a prediction
    /// describes ([`crate::calibrate::measure_steps`]).
    Repeat(u64),
}

impl WarmUp {
    /// The step ids the warm-up runs, in order, before reported steps `0..steps`.
    pub fn step_ids(self, steps: u64) -> Vec<u64> {
        match self {
            WarmUp::Following(n) => (steps..steps + n).collect(),
            WarmUp::Repeat(n) => (0..n).flat_map(|_| 0..steps).collect(),
        }
    }
}

/// One reported step as it ran, handed to [`run_steps`]' caller.
#[derive(Debug)]
pub struct StepDone<'a> {
    /// The step id (`0..steps`).
    pub step: u64,
    /// The step's plan and data.
    pub prepared: PreparedStep,
    /// What the step measured and computed.
    pub run: StepRun,
    /// The executor after the step (its gradients and parameters).
    pub exec: &'a AnyExecutor,
    /// The single-rank reference, not yet stepped for this step (the caller checks the step
    /// against it, [`crate::verify::verify_step`]).
    pub reference: Option<&'a mut Reference>,
    /// The setup the step was planned with: the run's, or with the profile the previous
    /// step's caller returned (re-planning).
    pub setup: &'a Setup,
    /// Seconds the step's planning took ([`Setup::prepare`]: sampling, the cut, the schedule,
    /// the prediction, the data); `None` for a step prepared before the loop.
    pub prepare_s: Option<f64>,
}

/// Runs `warmup`'s steps, then steps `0..steps` of `setup` on `exec`, calling `each` with every
/// reported step in order and `progress` after every step, warm-up included. Warm-up steps
/// train `reference` too (with its optimizer step), so it stays in step with `exec`. `first`,
/// when given, is step 0 already prepared. `steps = 0` runs the warm-up alone.
///
/// Re-planning: when `each` returns a profile, the following steps are planned with it
/// ([`Setup::prepare`] under [`Setup::profile`] = that profile: zb-auto's schedule, the
/// cost-balanced cuts and the prediction follow it); `None` keeps the current one.
///
/// # Errors
/// The step preparation's and the executor's, converted into `E`; the first error of `each`.
#[allow(clippy::too_many_arguments)]
pub fn run_steps<E: From<Error>>(
    exec: &mut AnyExecutor,
    setup: &Setup,
    mut reference: Option<&mut Reference>,
    warmup: WarmUp,
    steps: u64,
    first: Option<PreparedStep>,
    progress: &dyn Fn(),
    mut each: impl FnMut(StepDone<'_>) -> std::result::Result<Option<Arc<Profile>>, E>,
) -> std::result::Result<(), E> {
    for id in warmup.step_ids(steps) {
        let prepared = setup.prepare(id)?;
        exec.train_step(setup, &prepared)?;
        if let Some(re) = reference.as_deref_mut() {
            re.step(setup, &prepared, true)?;
        }
        progress();
    }
    let mut first = first;
    let mut replanned: Option<Setup> = None;
    for step in 0..steps {
        let now = replanned.as_ref().unwrap_or(setup);
        let t = std::time::Instant::now();
        let (prepared, prepare_s) = match first.take() {
            Some(p) if step == 0 => (p, None),
            _ => (now.prepare(step)?, Some(t.elapsed().as_secs_f64())),
        };
        let run = exec.train_step(now, &prepared)?;
        let next = each(StepDone {
            step,
            prepared,
            run,
            exec,
            reference: reference.as_deref_mut(),
            setup: now,
            prepare_s,
        })?;
        if let Some(profile) = next {
            replanned = Some(Setup {
                profile: Some(profile),
                ..setup.clone()
            });
        }
        progress();
    }
    Ok(())
}

/// Prepares step `step` of `setup` and trains it on `exec`.
///
/// # Errors
/// The preparation's and the executor's.
pub fn train(exec: &mut AnyExecutor, setup: &Setup, step: u64) -> Result<(PreparedStep, StepRun)> {
    let prepared = setup.prepare(step)?;
    let run = exec.train_step(setup, &prepared)?;
    Ok((prepared, run))
}
