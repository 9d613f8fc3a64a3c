//! What `execute` prints and writes: per-step rows, the verification row, the table, charts and the
//! note on the prediction.

use super::*;

/// One step's row of `execute`'s output.
#[derive(Debug, Serialize)]
pub(super) struct StepRow {
    pub(super) step: u64,
    pub(super) microbatches: Vec<usize>,
    pub(super) tokens: u64,
    pub(super) loss: f64,
    pub(super) grad_norm: f64,
    pub(super) measured_makespan_s: f64,
    pub(super) tokens_per_s: f64,
    pub(super) bubble_ratio: f64,
    /// Each rank's busy time (its compute actions), seconds, ranks replica-major: a step can
    /// be no shorter than the busiest's.
    pub(super) rank_busy_s: Vec<f64>,
    /// Forward-only microbatches of the step (all replicas).
    pub(super) fo_microbatches: usize,
    /// Time the ranks spent on forward-only actions, summed over ranks, seconds.
    pub(super) fo_busy_s: f64,
    /// The measured expert-parallel all-to-all time of the rank with the most exposed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) all_to_all: Option<sim::AllToAllTime>,
    /// The predicted one, likewise.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) predicted_all_to_all: Option<sim::AllToAllTime>,
    /// The most time a rank's all-to-alls waited for a slower partner, seconds.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) all_to_all_wait_s: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) predicted_makespan_s: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) rel_error: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) verify: Option<VerifyRow>,
}

/// Differences against the single-rank reference on one step.
#[derive(Debug, Serialize, Clone)]
pub(super) struct VerifyRow {
    pub(super) reference_loss: f64,
    pub(super) loss_rel_diff: f64,
    pub(super) grad_max_abs_diff: f64,
    pub(super) grad_max_rel_diff: f64,
    pub(super) grad_worst: String,
    pub(super) param_max_abs_diff: f64,
    pub(super) param_max_rel_diff: f64,
    pub(super) grad_norm_rel_diff: f64,
    pub(super) fo_loss_rel_diff: f64,
    pub(super) within_tolerance: bool,
}

#[derive(Debug, Serialize)]
pub(super) struct ExecuteReport {
    pub(super) model: String,
    pub(super) workload: String,
    pub(super) schedule: String,
    pub(super) dp: u32,
    pub(super) pp: u32,
    pub(super) vpp: u32,
    pub(super) backend: String,
    pub(super) steps: Vec<StepRow>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) median_abs_rel_error: Option<f64>,
    pub(super) prediction: String,
    /// Why the profile may not predict this run ([`executor::backend::condition_warnings`]).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub(super) profile_warnings: Vec<String>,
    /// `--fit-profile`: the measured over predicted busy time per phase it applied.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) fitted_scale: Option<profiles::PhaseScale>,
}

/// One `--verify` row from the library's comparison.
pub(super) fn verify_row(v: flatpipe_executor::verify::Verification) -> VerifyRow {
    let p = v.params.clone().unwrap_or_default();
    VerifyRow {
        reference_loss: v.reference_loss,
        loss_rel_diff: v.loss_rel_diff,
        grad_max_abs_diff: v.grads.max_abs,
        grad_max_rel_diff: v.grads.max_rel,
        grad_worst: v.grads.worst,
        param_max_abs_diff: p.max_abs,
        param_max_rel_diff: p.max_rel,
        grad_norm_rel_diff: v.grad_norm_rel_diff,
        fo_loss_rel_diff: v.fo_loss_rel_diff,
        within_tolerance: v.within_tolerance,
    }
}

/// One step's row: what ran (microbatches, tokens, loss, grad norm), its measured makespan,
/// throughput, bubble ratio and forward-only time, and the prediction and `--verify` figures.
pub(super) fn step_row(
    step: u64,
    prepared: &PreparedStep,
    run: &flatpipe_executor::interpreter::StepRun,
    prediction: Option<&flatpipe_executor::runner::Prediction>,
    verify: Option<VerifyRow>,
) -> StepRow {
    let predicted = prediction.map(|p| p.makespan_s);
    let makespan_s = run.timeline.makespan_ns() as f64 * 1e-9;
    let fo_s: f64 = run
        .timeline
        .compute
        .iter()
        .flatten()
        .filter(|o| o.action.parts().any(|p| p.kind == sim::ActionKind::Fo))
        .map(|o| (o.end_ns - o.start_ns) as f64 * 1e-9)
        .sum::<f64>()
        + 0.0; // an empty sum is -0.0
    let n = run.timeline.num_ranks();
    let busy: f64 = (0..n).map(|r| run.timeline.busy_ns(r) as f64 * 1e-9).sum();
    let tokens = prepared.tokens();
    StepRow {
        step,
        microbatches: prepared
            .replicas
            .iter()
            .map(|r| r.microbatches.len())
            .collect(),
        tokens,
        loss: run.loss,
        grad_norm: run.grad_norm,
        measured_makespan_s: makespan_s,
        tokens_per_s: tokens as f64 / makespan_s,
        bubble_ratio: 1.0 - busy / (n as f64 * makespan_s),
        rank_busy_s: (0..n)
            .map(|r| run.timeline.busy_ns(r) as f64 * 1e-9)
            .collect(),
        fo_microbatches: prepared
            .replicas
            .iter()
            .map(|r| r.fo_microbatches.len())
            .sum(),
        fo_busy_s: fo_s,
        all_to_all: run.all_to_all_time(),
        predicted_all_to_all: prediction.and_then(|p| p.all_to_all),
        all_to_all_wait_s: run.all_to_all_wait_s(),
        predicted_makespan_s: predicted,
        rel_error: predicted.map(|p| (p - makespan_s) / makespan_s),
        verify,
    }
}

/// `execute`'s table: one row per reported step, with the forward-only, prediction and
/// `--verify` columns when they apply.
pub(super) fn execute_table(
    steps: &[StepRow],
    with_fo: bool,
    predict: bool,
    verify: bool,
) -> PlainTable {
    let mut cols = vec![
        "step",
        "m",
        "tokens",
        "loss",
        "grad norm",
        "measured",
        "tokens/s",
        "bubble",
    ];
    if with_fo {
        cols.extend(["Fo", "Fo busy"]);
    }
    let a2a = steps.iter().any(|r| r.all_to_all.is_some());
    if a2a {
        cols.extend(["a2a exposed", "a2a wait"]);
    }
    if predict {
        cols.extend(["predicted", "error"]);
        if a2a {
            cols.push("a2a predicted");
        }
    }
    if verify {
        cols.extend(["ref. loss", "grad diff (rel)", "param diff (rel)", "ok"]);
    }
    let mut t = new_table(&cols);
    for r in steps {
        let mut row = vec![
            r.step.to_string(),
            slash_list(&r.microbatches),
            r.tokens.to_string(),
            format!("{:.4}", r.loss),
            format!("{:.3}", r.grad_norm),
            fmt_s(r.measured_makespan_s),
            format!("{:.0}", r.tokens_per_s),
            pct(r.bubble_ratio),
        ];
        if with_fo {
            row.extend([r.fo_microbatches.to_string(), fmt_s(r.fo_busy_s)]);
        }
        if a2a {
            row.push(all_to_all_cell(r.all_to_all));
            row.push(r.all_to_all_wait_s.map_or("-".into(), fmt_s));
        }
        if let (Some(p), Some(e)) = (r.predicted_makespan_s, r.rel_error) {
            row.extend([fmt_s(p), format!("{:+.1}%", 100.0 * e)]);
            if a2a {
                row.push(all_to_all_cell(r.predicted_all_to_all));
            }
        }
        if let Some(v) = &r.verify {
            row.extend([
                format!("{:.4}", v.reference_loss),
                format!("{:.1e}", v.grad_max_rel_diff),
                format!("{:.1e}", v.param_max_rel_diff),
                if v.within_tolerance { "yes" } else { "NO" }.to_string(),
            ]);
        }
        t.add_row(row);
    }
    t
}

/// Writes the last step's measured timeline as a Gantt chart and a Chrome trace where asked, and
/// says where. Both show each rank's expert-parallel all-to-alls on its comm lane (the
/// timeline's `comm`; in the trace, threads `comm k`).
pub(super) fn write_step_charts(
    title: &str,
    run: &flatpipe_executor::interpreter::StepRun,
    gantt: Option<&Path>,
    trace: Option<&Path>,
) -> Result<Vec<String>> {
    let mut notes = Vec::new();
    if let Some(path) = gantt {
        sim::io::gantt::write_gantt(path, title, &run.timeline)?;
        notes.push(format!("Gantt chart of the last step: {}", path.display()));
    }
    if let Some(path) = trace {
        let doc = sim::io::trace::chrome_trace(&run.timeline);
        profiles::write_atomic(path, serde_json::to_string(&doc)?.as_bytes())?;
        notes.push(format!("Chrome trace of the last step: {}", path.display()));
    }
    Ok(notes)
}

/// What the prediction column stands on: the profile (`profile_arg` as the user named it) and
/// where it was measured when it was measured on `backend` (`predict`), else why there is no
/// prediction and what to give.
pub(super) fn prediction_note(
    predict: bool,
    profile_arg: Option<&str>,
    profile: &Profile,
    backend: executor::Backend,
) -> String {
    if predict {
        format!(
            "predicted with the profile {}measured on {} ({})",
            profile_arg.map(|p| format!("{p} ")).unwrap_or_default(),
            profile.provenance.device,
            profile.provenance.date.as_deref().unwrap_or("undated")
        )
    } else {
        let what = if profile.provenance.source == ProfileSource::Measured {
            format!(
                "the profile of {} was measured on {}, not on this backend",
                profile.model, profile.provenance.device
            )
        } else {
            format!(
                "the {} profile of {} on {} is not a measurement",
                format!("{:?}", profile.provenance.source).to_lowercase(),
                profile.model,
                profile.provenance.device
            )
        };
        format!(
            "No profile measured on the {} backend was given ({what}), so no predicted vs measured makespan; give --profile FILE with a profile measured on this backend",
            backend.name(),
        )
    }
}

/// Writes `--fit-profile`: `profile` scaled by the estimate's phase factors
/// ([`profiles::Profile::scaled`]), atomically; returns the factors and the note saying so.
///
/// # Errors
/// No step measured; the file cannot be written.
pub(super) fn write_fitted_profile(
    path: &std::path::Path,
    profile: &profiles::Profile,
    estimate: &flatpipe_simulator::run::estimate::SpeedEstimate,
    per_rank: Option<&sim::run::config::RunConfig>,
) -> Result<(profiles::PhaseScale, String)> {
    if estimate.steps() == 0 {
        bail!(
            "--fit-profile {}: no measured step had a prediction to fit against (run at least one step)",
            path.display()
        );
    }
    let s = estimate.phase_scale();
    // Re-planning: each rank's stages scaled by that rank's factors (what the next step would
    // be planned with), else every layer by the run's.
    let fitted = match per_rank {
        Some(config) => estimate.planning_profile(profile, config)?,
        None => profile.scaled(&s)?,
    };
    profiles::write_atomic(path, fitted.to_yaml()?.as_bytes())?;
    let note = format!(
        "wrote {}: the profile refitted on {} measured step(s){}, measured / predicted busy time F x{:.3}, I x{:.3}, W x{:.3}, B x{:.3}, optimizer x{:.3}",
        path.display(),
        estimate.steps(),
        if per_rank.is_some() {
            " per pipeline rank (each rank's stages by its own factors; over all ranks)"
        } else {
            ""
        },
        s.f,
        s.i,
        s.w,
        s.b,
        s.optimizer
    );
    Ok((s, note))
}

/// One `--estimate-log` line: the step, its predicted and measured makespan (seconds), the
/// seconds its planning took (`null` for the first step, planned before the loop), and the
/// estimate after it: `phase_scale` (measured over predicted busy time per phase),
/// `rank_factors` (per rank of replica 0, over all phases), `kind_factors` (per layer kind and
/// phase, `sim::run::kind_estimate`) and `link` (the fitted alpha and beta, `null` without
/// timed transfers).
///
/// # Errors
/// JSON serialisation.
pub(super) fn estimate_line(
    step: u64,
    (prediction, run): (
        &flatpipe_executor::runner::Prediction,
        &flatpipe_executor::interpreter::StepRun,
    ),
    (estimate, link, kinds): (
        &flatpipe_simulator::run::estimate::SpeedEstimate,
        Option<sim::run::link_estimate::FittedLink>,
        Vec<(profiles::LayerKind, profiles::PhaseScale)>,
    ),
    prepare_s: Option<f64>,
) -> Result<String> {
    let kinds: serde_json::Map<String, serde_json::Value> = kinds
        .into_iter()
        .map(|(k, s)| Ok((format!("{k:?}").to_lowercase(), serde_json::to_value(s)?)))
        .collect::<Result<_>>()?;
    Ok(serde_json::to_string(&serde_json::json!({
        "step": step,
        "predicted_makespan_s": prediction.makespan_s,
        "measured_makespan_s": run.timeline.makespan_ns() as f64 * 1e-9,
        "planning_s": prepare_s,
        "phase_scale": estimate.phase_scale(),
        "rank_factors": estimate.rank_factors(),
        "kind_factors": kinds,
        "link": link.map(|l| serde_json::json!({
            "alpha_s": l.alpha_s, "beta_bytes_per_s": l.beta_bytes_per_s,
        })),
    }))?)
}

/// Writes `--estimate-log`'s `lines` (JSON lines, atomically); returns the note saying so.
///
/// # Errors
/// The file cannot be written.
pub(super) fn write_estimate_log(
    path: &std::path::Path,
    lines: &[String],
    forgetting: f64,
) -> Result<String> {
    let text: String = lines.iter().map(|l| format!("{l}\n")).collect();
    profiles::write_atomic(path, text.as_bytes())?;
    Ok(format!(
        "wrote {}: the estimate after each of {} measured step(s), forgetting factor {forgetting}",
        path.display(),
        lines.len()
    ))
}

/// `cp=N ` for a run with a context-parallel group (its rows in a chart: each replica's group,
/// GPU by GPU), else nothing.
pub(super) fn cp_label(config: &sim::run::config::RunConfig) -> String {
    config
        .context_parallel
        .map_or(String::new(), |c| format!("cp={} ", c.cp))
}
