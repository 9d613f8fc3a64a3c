//! `flatpipe import-trace`: read a PyTorch profiler trace of a pipelined run (actions labelled
//! `PP:<action>`) into a measured timeline: Gantt chart, bubble per rank, and the comparison with
//! flatpipe's prediction of the same schedule.

use super::*;
use sim::batching::microbatch::Microbatch;
use sim::io::kineto::{ImportOptions, read_traces};
use std::collections::BTreeMap;

/// Options of `flatpipe import-trace`.
#[derive(Debug, Args)]
pub(super) struct ImportTraceArgs {
    /// Trace files: one per rank in rank order, or one file whose pids are the ranks.
    #[arg(required = true)]
    traces: Vec<PathBuf>,
    /// Profile to predict with (file or model@hardware). With --model/--hardware/--plan, the
    /// trace is compared with flatpipe's prediction of the schedule it ran.
    #[arg(long, conflicts_with_all = ["model", "hardware"])]
    profile: Option<String>,
    /// Model (analytic profile on --hardware).
    #[arg(long)]
    model: Option<String>,
    /// Hardware.
    #[arg(long)]
    hardware: Option<String>,
    /// Plan file whose stages (layer ranges) the run used (default: an even split).
    #[arg(long)]
    plan: Option<PathBuf>,
    /// Tokens per microbatch of the traced run (for the prediction). Default 4096.
    #[arg(long, default_value_t = 4096)]
    tokens_per_microbatch: u32,
    /// Sequence length within a microbatch (default: one sequence of all its tokens).
    #[arg(long)]
    seq_len: Option<u32>,
    /// The training step to import, 0-based, of a trace that holds several (default: the
    /// last).
    #[arg(long)]
    step: Option<usize>,
    /// Write the Gantt chart of the measured timeline here (.svg or .png).
    #[arg(long)]
    gantt: Option<PathBuf>,
    /// Output format.
    #[arg(long, value_enum, default_value_t = Format::Table)]
    format: Format,
}

#[derive(Debug, Serialize)]
struct RankRow {
    rank: usize,
    actions: usize,
    busy_s: f64,
    measured_bubble_ratio: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    predicted_bubble_ratio: Option<f64>,
}

#[derive(Debug, Serialize)]
struct TraceReport {
    files: Vec<String>,
    steps: usize,
    step: usize,
    ranks: usize,
    stages: u32,
    microbatches: u32,
    measured_makespan_s: f64,
    measured_bubble_ratio: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    predicted_makespan_s: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    rel_error: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    profile: Option<String>,
    per_rank: Vec<RankRow>,
    /// PyTorch's other `PP:` events (sends, receives, waits, ...) by label, all steps: on the
    /// comm lanes.
    other_events: BTreeMap<String, usize>,
    /// Which of flatpipe's lowerings of the imported schedule posts the step's sends and
    /// receives in the trace's order: `ahead`, `deferred`, or the first difference from the
    /// ahead order; absent when the trace has no sends or receives.
    #[serde(skip_serializing_if = "Option::is_none")]
    posting_order: Option<String>,
    /// Per rank, the time inside action spans before their first operator (waits), seconds.
    leading_wait_s: Vec<f64>,
    warnings: Vec<String>,
}

pub(super) fn import_trace(a: ImportTraceArgs) -> Result<ExitCode> {
    // `--gantt none`: no chart, as in simulate and plan.
    let chart = a.gantt.as_ref().filter(|p| p.as_os_str() != "none");
    if let Some(c) = chart {
        super::check_outputs([c])?;
        sim::io::gantt::check_chart_path(c)?;
    }
    let mut files = Vec::with_capacity(a.traces.len());
    for p in &a.traces {
        files.push((
            p.display().to_string(),
            sim::io::kineto::read_trace_file(p)?,
        ));
    }
    let imported = read_traces(&files, &ImportOptions { step: a.step })?;
    for w in &imported.warnings {
        tracing::warn!("{w}");
    }
    let t = &imported.timeline;
    let s = &imported.schedule;
    let makespan = t.makespan_ns() as f64 * 1e-9;
    let bubbles: Vec<f64> = (0..t.num_ranks())
        .map(|r| 1.0 - t.busy_ns(r) as f64 * 1e-9 / makespan)
        .collect();
    let prediction = if a.profile.is_some() || a.model.is_some() || a.plan.is_some() {
        Some(predict(&a, s)?)
    } else {
        None
    };
    let predicted = prediction.as_ref().map(|p| p.makespan_s);
    let predicted_bubbles = prediction
        .as_ref()
        .map(|p| p.bubbles.clone())
        .unwrap_or_default();
    let profile_name = prediction.map(|p| p.profile);
    let per_rank: Vec<RankRow> = (0..t.num_ranks())
        .map(|r| RankRow {
            rank: r,
            actions: t.compute[r].len(),
            busy_s: t.busy_ns(r) as f64 * 1e-9,
            measured_bubble_ratio: bubbles[r],
            predicted_bubble_ratio: predicted_bubbles.get(r).copied(),
        })
        .collect();
    let busy: f64 = per_rank.iter().map(|r| r.busy_s).sum();
    let report = TraceReport {
        files: files.iter().map(|f| f.0.clone()).collect(),
        steps: imported.steps,
        step: imported.step,
        ranks: t.num_ranks(),
        stages: s.num_stages(),
        microbatches: s.num_microbatches,
        measured_makespan_s: makespan,
        measured_bubble_ratio: 1.0 - busy / (t.num_ranks() as f64 * makespan),
        predicted_makespan_s: predicted,
        rel_error: predicted.map(|p| (p - makespan) / makespan),
        profile: profile_name,
        per_rank,
        other_events: imported.other_events.clone(),
        posting_order: posting_order(&imported)?,
        leading_wait_s: imported
            .leading_wait_ns
            .iter()
            .map(|&w| w as f64 * 1e-9)
            .collect(),
        warnings: imported.warnings.clone(),
    };
    render(&a, &report, t, chart)
}

/// Which lowering's order the trace's sends and receives follow (`ahead`, `deferred`), or
/// where they first differ from the ahead order; `None` without sends or receives.
///
/// # Errors
/// A schedule the lowering cannot place (an input never sent).
fn posting_order(imported: &sim::io::kineto::ImportedTrace) -> Result<Option<String>> {
    use sim::ir::comm::LoweredAction;
    use sim::ir::lowering::RecvPosting;
    let any = imported
        .timeline
        .comm
        .iter()
        .flatten()
        .any(|c| matches!(c.action, LoweredAction::Comm(_)));
    if !any {
        return Ok(None);
    }
    let ahead = imported.posting_difference(RecvPosting::Ahead)?;
    let Some(d) = ahead else {
        return Ok(Some("ahead".into()));
    };
    if imported
        .posting_difference(RecvPosting::Deferred)?
        .is_none()
    {
        return Ok(Some("deferred".into()));
    }
    let name = |a: Option<LoweredAction>| a.map_or("nothing".to_string(), |a| a.to_string());
    Ok(Some(format!(
        "neither: rank {} action {} is {} where the ahead order has {}",
        d.rank,
        d.index,
        name(d.recorded),
        name(d.lowered)
    )))
}

/// The simulator's prediction of the trace's schedule.
struct Prediction {
    makespan_s: f64,
    /// Per rank.
    bubbles: Vec<f64>,
    /// `model on hardware (source)`.
    profile: String,
}

/// Predicts `s` (the schedule the trace ran) on the profile `--profile`, `--model` /
/// `--hardware` or the plan file name, with the plan's stages (else an even split) and
/// microbatches of `--tokens-per-microbatch` tokens in sequences of `--seq-len`.
///
/// # Errors
/// A profile that does not load, a plan with another stage count, a zero token count.
fn predict(a: &ImportTraceArgs, s: &sim::Schedule) -> Result<Prediction> {
    let plan = read_plan(a.plan.as_deref())?;
    let profile = resolve_profile(
        a.profile
            .as_deref()
            .or(plan.as_ref().and_then(|p| p.inputs.profile.as_deref())),
        a.model
            .as_deref()
            .or(plan.as_ref().and_then(|p| p.inputs.model.as_deref())),
        a.hardware
            .as_deref()
            .or(plan.as_ref().and_then(|p| p.inputs.hardware.as_deref())),
    )?;
    let stages = match &plan {
        Some(p) => {
            if p.run.stages.len() != s.num_stages() as usize {
                bail!(
                    "the plan has {} stages, the trace ran {}",
                    p.run.stages.len(),
                    s.num_stages()
                );
            }
            p.stage_ranges()
        }
        None => even_split(profile.layers.len(), s.num_stages() as usize)?,
    };
    if a.tokens_per_microbatch == 0 || a.seq_len == Some(0) {
        bail!("--tokens-per-microbatch and --seq-len must be >= 1 token");
    }
    let seq = a.seq_len.unwrap_or(a.tokens_per_microbatch);
    let mut lens = vec![seq; (a.tokens_per_microbatch / seq) as usize];
    if a.tokens_per_microbatch % seq != 0 {
        lens.push(a.tokens_per_microbatch % seq);
    }
    let mbs = vec![
        Microbatch {
            chunk: None,
            seq_lens: lens,
            shape: Default::default(),
        };
        s.num_microbatches as usize
    ];
    let costs = sim::TableCosts::from_profile(&profile, &stages, &s.placement, &mbs, &[])?
        .without_optimizer();
    let simulation = sim::simulate(s, &costs)?;
    Ok(Prediction {
        makespan_s: simulation.metrics.makespan_s,
        bubbles: simulation
            .metrics
            .ranks
            .iter()
            .map(|r| r.bubble_ratio)
            .collect(),
        profile: format!(
            "{} on {} ({:?})",
            profile.model, profile.hardware.name, profile.provenance.source
        ),
    })
}

/// The notes (the step read, the skipped events, the waits, the chart, the prediction), the
/// header and the per-rank table of an imported trace.
///
/// # Errors
/// A chart that cannot be written; stdout closed.
fn render(
    a: &ImportTraceArgs,
    report: &TraceReport,
    t: &sim::Timeline,
    chart: Option<&PathBuf>,
) -> Result<ExitCode> {
    let makespan = report.measured_makespan_s;
    let mut notes = Vec::new();
    if report.steps > 1 {
        notes.push(format!(
            "step {} of the trace's {} (--step N for another)",
            report.step, report.steps
        ));
    }
    if !report.other_events.is_empty() {
        notes.push(format!(
            "communication actions on the comm lanes (all steps): {}",
            report
                .other_events
                .iter()
                .map(|(k, n)| format!("{k} x{n}"))
                .collect::<Vec<_>>()
                .join(", ")
        ));
    }
    match report.posting_order.as_deref() {
        Some("ahead") => notes.push("sends and receives posted in PyTorch's eager lowering order (_add_send_recv, receives ahead): simulate with --p2p-posting ahead".into()),
        Some("deferred") => notes.push("sends and receives posted in PyTorch's deferred-receive order (_defer_recv_ops): simulate with --p2p-posting deferred".into()),
        Some(other) => notes.push(format!("sends and receives in neither of flatpipe's lowering orders ({other})")),
        None => {}
    }
    notes.push(format!(
        "busy time counts from each action's first nested operator: waits inside the action spans left out, per rank {}",
        report
            .leading_wait_s
            .iter()
            .map(|&w| fmt_s(w))
            .collect::<Vec<_>>()
            .join(", ")
    ));
    if let Some(path) = chart {
        let title = format!(
            "imported trace: {} ranks, {} stages, m={}",
            report.ranks, report.stages, report.microbatches
        );
        sim::io::gantt::write_gantt(path, &title, t)?;
        notes.push(format!("Gantt chart of the trace: {}", path.display()));
    }
    match (report.predicted_makespan_s, &report.profile) {
        (Some(p), Some(name)) => notes.push(format!(
            "predicted makespan {} with {name} ({} tokens per microbatch), relative error {:+.1}% (measured: first to last PP: action; the prediction leaves out the optimizer step)",
            fmt_s(p),
            a.tokens_per_microbatch,
            100.0 * (p - makespan) / makespan
        )),
        _ => notes.push(
            "give --profile, --model/--hardware or --plan to compare with flatpipe's prediction"
                .into(),
        ),
    }
    let header = format!(
        "{}: {} ranks, {} stages, {} microbatches, measured makespan {}, bubble {}",
        report.files.join(", "),
        report.ranks,
        report.stages,
        report.microbatches,
        fmt_s(makespan),
        pct(report.measured_bubble_ratio)
    );
    let mut tab = new_table(&[
        "rank",
        "actions",
        "busy",
        "bubble (measured)",
        "bubble (predicted)",
    ]);
    for r in &report.per_rank {
        tab.add_row([
            r.rank.to_string(),
            r.actions.to_string(),
            fmt_s(r.busy_s),
            pct(r.measured_bubble_ratio),
            r.predicted_bubble_ratio.map_or("-".into(), pct),
        ]);
    }
    emit(a.format, report, &header, &tab, &notes)
}
