//! `--verify` as a library: a pipelined step against the single-rank reference
//! ([`crate::runner::Reference`], the oracle), with the tolerances the command line and the
//! tests share.
//!
//! The tolerances are fp32's: the pipelined and the single-rank runs compute the same sums in
//! other orders (per-microbatch partial sums, cross-rank gradient accumulation), so they agree
//! to a few ulps of the largest element, not bit for bit. Differences are normwise relative
//! (`max |a - b| / max |b|` per tensor, [`compare`]) so that tiny elements do not dominate.
//!
//! The parameters after the optimizer step are compared with the reference's AdamW applied to
//! the *pipelined run's* gradients, not to the reference's own; the gradients are compared with
//! the reference's own. AdamW moves an element by about `lr * sign(g)` whatever `|g|` (once
//! `|g|` is well above `eps`; Loshchilov and Hutter 2019, Algorithm 2), so a gradient element
//! near zero whose sign differs by rounding moves the parameter `2 lr` away. Pipelined against
//! single-rank on the CPU that is rare (the same kernels, other accumulation orders); fp32 cuBLAS
//! on an H200 against the CPU reference (2026-12-04, `tiny`, zb-h2, p = 2) gave gradients
//! 1.1e-6 apart and parameters 1.5e-4 apart at lr 1e-3, 1.6e-7 at lr 1e-6: the optimizer
//! amplifying rounding, not a wrong update. Checked this way, the parameters test the optimizer
//! step itself (the global norm over ranks, clipping, AdamW on every rank's tensors and moments)
//! at fp32's tolerance, and the reference's next step starts from where the pipelined run's
//! does, up to rounding, so each step's gradients are checked from the same point.

use crate::Result;
use crate::interpreter::StepRun;
use crate::runner::{Diff, PreparedStep, Reference, Setup, compare};
use serde::Serialize;
use std::collections::BTreeMap;

/// Relative tolerance of the step's loss and of the forward-only loss sums.
pub const LOSS_RTOL: f64 = 1e-5;
/// Normwise relative tolerance of gradients, parameters and the global gradient norm.
pub const TENSOR_RTOL: f64 = 1e-4;

/// Parameters or gradients by name (as [`crate::runner::Executor::named_grads`] returns them).
pub type Named = BTreeMap<String, Vec<f32>>;

/// How one pipelined step compares with the single-rank reference.
#[derive(Debug, Clone, Serialize)]
pub struct Verification {
    /// The reference's loss.
    pub reference_loss: f64,
    /// `|loss - reference| / |reference|`.
    pub loss_rel_diff: f64,
    /// Gradients against the reference's.
    pub grads: Diff,
    /// Parameters after the optimizer step against the reference's (when it ran).
    pub params: Option<Diff>,
    /// `|grad norm - reference| / reference`.
    pub grad_norm_rel_diff: f64,
    /// Largest relative difference of a forward-only microbatch's loss sum from the training
    /// forward of the same microbatch (forward-only microbatch k is training microbatch k mod
    /// m, run with the same weights).
    pub fo_loss_rel_diff: f64,
    /// Every difference within [`LOSS_RTOL`] / [`TENSOR_RTOL`].
    pub within_tolerance: bool,
}

/// Runs `prepared` on `reference` and compares it with the pipelined run `run` and its
/// gradients `grads`; when `params` is given (the pipelined run's parameters after its own
/// optimizer step), the reference then takes its optimizer step on `grads`
/// ([`Reference::optimizer_step_with`]) and the parameters are compared.
///
/// # Errors
/// The reference's errors; [`crate::Error::Invalid`] when the runs hold different tensors.
pub fn verify_step(
    run: &StepRun,
    grads: &Named,
    params: Option<&Named>,
    reference: &mut Reference,
    setup: &Setup,
    prepared: &PreparedStep,
) -> Result<Verification> {
    let r = reference.step(setup, prepared, false)?;
    let g = compare(grads, &reference.named_grads())?;
    let p = match params {
        Some(params) => {
            // The reference's optimizer on the pipelined run's gradients (see the module doc).
            reference.optimizer_step_with(setup, grads)?;
            Some(compare(params, &reference.named_params())?)
        }
        None => None,
    };
    let rel = |a: f64, b: f64| (a - b).abs() / b.abs().max(f64::MIN_POSITIVE);
    let loss_rel = rel(run.loss, r.loss);
    let norm_rel = rel(run.grad_norm, r.grad_norm);
    let mut fo_rel: f64 = 0.0;
    for (d, fo) in run.fo_losses.iter().enumerate() {
        let train = &run.microbatch_losses[d];
        for (k, l) in fo.iter().enumerate() {
            fo_rel = fo_rel.max(rel(l.sum, train[k % train.len()].sum));
        }
    }
    let within_tolerance = loss_rel <= LOSS_RTOL
        && g.max_rel <= TENSOR_RTOL
        && p.as_ref().is_none_or(|p| p.max_rel <= TENSOR_RTOL)
        && norm_rel <= TENSOR_RTOL
        && fo_rel <= LOSS_RTOL;
    Ok(Verification {
        reference_loss: r.loss,
        loss_rel_diff: loss_rel,
        grads: g,
        params: p,
        grad_norm_rel_diff: norm_rel,
        fo_loss_rel_diff: fo_rel,
        within_tolerance,
    })
}
