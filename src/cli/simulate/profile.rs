//! `simulate` on a profile and workload: the compared runs' Monte Carlo, their table and charts.

use super::compare::*;
use super::rows::*;
use super::*;
use montecarlo::MonteCarlo;

/// `simulate` on a profile and workload: resolve the compared runs, run their Monte Carlo, rank
/// the rows by mean step time, draw step 0's charts, and print the table with its notes.
pub(in crate::cli) fn simulate_profile(a: &SimulateArgs, schedules: Schedules) -> Result<ExitCode> {
    let mut c = resolve_comparison(a, schedules)?;
    let (mut mc, dropped) = run_monte_carlo(&mut c)?;
    warn_cut_sequences(&c, &mc);
    let first = std::mem::take(&mut mc.first);
    // Every row is checked against the per-rank memory zb-auto was built under.
    let mut rows = comparison_rows(
        &c.configs,
        &mc.outcomes,
        first,
        c.steps,
        &c.profile,
        c.limit,
    );
    warn_underfilled_rows(&rows, c.p);
    rows.sort_by(|x, y| {
        let (a, b) = (&x.0.summary, &y.0.summary);
        a.step_time_s
            .mean
            .total_cmp(&b.step_time_s.mean)
            .then(a.peak_activation_bytes.total_cmp(&b.peak_activation_bytes))
            .then(x.0.schedule.cmp(&y.0.schedule))
    });
    let (notes, unwritten) = notes(a, &c, &mc, &rows, dropped)?;
    let reports: Vec<&McReport> = rows.iter().map(|r| &r.0).collect();
    let table = comparison_table(&reports, c.steps);
    let code = emit(a.format, &reports, &header(&c, &mc), &table, &notes)?;
    // The table is out: an output that could not be written is the error now.
    unwritten.map_or(Ok(code), Err)
}

/// Runs the comparison's Monte Carlo with a progress bar. zb-auto is built under the memory
/// limit; when it cannot be, the comparison goes on without it and the second value says why.
///
/// # Errors
/// A run that cannot be planned or simulated; a memory-limit error names where the limit came
/// from.
fn run_monte_carlo(c: &mut Comparison) -> Result<(MonteCarlo, Option<sim::Error>)> {
    tracing::info!(
        "Monte Carlo: {} sampled steps x {} (schedule, policy, capacity) combinations of {} on {}",
        c.steps,
        c.configs.len(),
        c.profile.model,
        c.profile.hardware.name
    );
    let start = std::time::Instant::now();
    let bar = Progress::new(c.steps as u64);
    let (profile, workload) = (&c.profile, &c.workload);
    let result = montecarlo::run_comparison(
        profile,
        workload,
        c.seed,
        c.size,
        c.steps,
        &mut c.configs,
        &|| bar.inc(),
    )
    .map_err(|err| match err {
        sim::Error::MemoryLimit { .. } => anyhow::Error::new(err)
            .context(format!("the per-rank memory limit is {}", c.limit_source)),
        err => err.into(),
    })?;
    bar.finish();
    tracing::info!(
        "Monte Carlo: done in {:.2} s",
        start.elapsed().as_secs_f64()
    );
    Ok(result)
}

/// Warns about the sequences longer than the token budget (cut into chunks, or alone in a
/// microbatch) and the tokens the padded policy truncated.
fn warn_cut_sequences(c: &Comparison, mc: &MonteCarlo) {
    if mc.oversize_sequences > 0 {
        tracing::warn!(
            "{} sequence(s) longer than the token budget {} {}",
            mc.oversize_sequences,
            c.token_budget,
            // The runs' chunk size: --chunk-tokens, or the plan file's.
            match c.configs.first().and_then(|c| c.params.chunk_tokens) {
                Some(c) => format!("were cut into chunks of at most {c} tokens"),
                None =>
                    "got a microbatch of their own (--chunk-tokens cuts them into chunks)".into(),
            }
        );
    }
    if mc.truncated_tokens > 0 {
        tracing::warn!(
            "the padded policy truncated {} tokens at --max-seq-len",
            mc.truncated_tokens
        );
    }
}

/// Says an under-filled pipeline whatever made m small (the workload, the budget or
/// `--microbatches`), once per number of stages per rank.
fn warn_underfilled_rows(rows: &[Row], p: u32) {
    let mut warned = Vec::new();
    for (r, _, v, _) in rows {
        let m = r.summary.microbatches_mean.floor() as u32;
        if !warned.contains(v) && m < p * v {
            warned.push(*v);
            let what = if *v == 1 {
                "the steps (mean microbatch count)".to_string()
            } else {
                format!("the steps of {v}-stage-per-rank schedules (mean microbatch count)")
            };
            warn_underfilled(&what, m, p, *v);
        }
    }
}

/// The notes under the table, in order: the charts written, the plan file's prediction against
/// this run, the rounds drawn in the charts, zb-auto left out, the histogram, the rows over the
/// memory limit, and the forward-only work hidden in the schedule.
///
/// With the notes, the first chart or histogram that could not be written (for the caller to
/// return once the table is printed).
///
/// # Errors
/// A plan file whose inputs cannot be hashed.
fn notes(
    a: &SimulateArgs,
    c: &Comparison,
    mc: &MonteCarlo,
    rows: &[Row],
    dropped: Option<sim::Error>,
) -> Result<(Vec<String>, Option<anyhow::Error>)> {
    let charted = charts(c, rows);
    let (mut notes, mut unwritten) = write_charts(a, &charted);
    // A plan file carries what the planner predicted and the hashes of what it was planned
    // on: say how this run compares, and when the inputs differ.
    if let Some(pl) = &c.plan {
        notes.extend(plan_comparison(
            pl,
            &c.base_profile,
            &c.workload,
            c.steps,
            &rows[0].0,
        )?);
    }
    if !charted.is_empty() && super::chart_path(&a.gantt, "").is_some() {
        for (r, _, _, rounds) in rows.iter().filter(|x| x.3 > 1 && x.1.is_some()) {
            notes.push(format!(
                "{} / {} / capacity {}: the first step runs {rounds} rounds of its fixed-capacity schedule, each ending in a flush; its chart draws them one after the other (microbatch ids from the step's count on are the last round's empty slots)",
                r.schedule, r.policy, r.capacity
            ));
        }
    }
    if let Some(why) = dropped {
        notes.push(format!(
            "zb-auto not built for every sampled step, so not compared: {why}; the per-rank memory is {} ({})",
            fmt_bytes(c.limit),
            c.limit_source
        ));
    }
    if let Some(path) = &a.histogram {
        match write_histogram(path, c, mc, &rows[0].0.schedule) {
            Ok(note) => notes.push(note),
            Err(e) => unwritten = unwritten.or(Some(e)),
        }
    }
    notes.extend(over_limit_note(a, c, rows));
    notes.extend(forward_only_notes(a, c, rows));
    Ok((notes, unwritten))
}

/// Step 0's chart of each row that has one: (name, title, simulation). A row is named by its
/// schedule alone when the schedule is all that varies.
fn charts<'a>(c: &Comparison, rows: &'a [Row]) -> Vec<(String, String, &'a Simulation)> {
    let by_schedule =
        c.configs.len() == rows.len() && c.policies.len() == 1 && c.capacities.len() == 1;
    rows.iter()
        .filter_map(|(r, first, v, rounds)| {
            first.as_ref().map(|(s, sim)| {
                let name = if by_schedule {
                    r.schedule.clone()
                } else {
                    format!("{}-{}-{}", r.schedule, r.policy, r.capacity)
                };
                let mut title = gantt_title(&name, s, *v, &sim.metrics);
                if *rounds > 1 {
                    title.push_str(&format!(
                        "  ({rounds} rounds of the {}-microbatch schedule)",
                        s.num_microbatches
                    ));
                }
                (name, title, sim)
            })
        })
        .collect()
}

/// Writes the histogram of the step times of the `best` schedule (one series per policy and
/// capacity) to `path`, and returns the note that says so.
///
/// # Errors
/// The histogram cannot be drawn or written.
fn write_histogram(
    path: &std::path::Path,
    c: &Comparison,
    mc: &MonteCarlo,
    best: &str,
) -> Result<String> {
    let series: Vec<(String, Vec<f64>)> = c
        .configs
        .iter()
        .zip(&mc.outcomes)
        .filter(|(c, _)| c.source.name() == best)
        .map(|(c, o)| {
            (
                format!("{} / {}", c.policy, c.capacity),
                o.iter().map(|x| x.step_time_s).collect(),
            )
        })
        .collect();
    let title = format!(
        "{best}: step time over {} steps of {} (p={})",
        c.steps, c.workload.name, c.p
    );
    sim::io::histogram::write_histogram(path, &title, &series)?;
    Ok(format!(
        "Histogram of step times of {best}: {}",
        path.display()
    ))
}

/// The note on the rows whose largest per-rank total exceeds the limit, if any.
fn over_limit_note(a: &SimulateArgs, c: &Comparison, rows: &[Row]) -> Option<String> {
    let over: Vec<String> = rows
        .iter()
        .filter(|(r, _, _, _)| !r.fits)
        .map(|(r, _, _, _)| {
            format!(
                "{} needs {} (+{})",
                if c.policies.len() > 1 || c.capacities.len() > 1 {
                    format!("{} / {} / {}", r.schedule, r.policy, r.capacity)
                } else {
                    r.schedule.clone()
                },
                fmt_bytes(r.summary.peak_memory_bytes),
                fmt_bytes(r.summary.peak_memory_bytes - c.limit)
            )
        })
        .collect();
    if over.is_empty() {
        return None;
    }
    let zb_auto = c
        .configs
        .iter()
        .any(|c| matches!(c.source, ScheduleSource::Kind(ScheduleKind::ZbAuto)));
    Some(format!(
        "does not fit {} per rank ({}): {} ({}shown as they are)",
        fmt_bytes(c.limit),
        if a.memory_limit.is_some() {
            c.limit_source.clone()
        } else {
            format!("{}; --memory-limit to change", c.limit_source)
        },
        over.join(", "),
        if zb_auto {
            "zb-auto is built under the limit; the others are "
        } else {
            "the rows are "
        }
    ))
}

/// One note per row with forward-only work: how long it takes alone and how much of it the
/// training schedule hides.
fn forward_only_notes(a: &SimulateArgs, c: &Comparison, rows: &[Row]) -> Vec<String> {
    let mode = c
        .configs
        .first()
        .and_then(|c| c.forward_only)
        .map_or(a.fo.fo_mode, |f| f.mode);
    rows.iter()
        .filter_map(|(r, _, _, _)| {
            let (sep, hidden) = (r.summary.fo_separate_s?, r.summary.fo_hidden_fraction?);
            Some(format!(
                "{} / {}: the forward-only pass alone takes {} per step; {} of it is hidden in the training schedule ({mode})",
                r.schedule,
                r.policy,
                fmt_s(sep),
                pct(hidden),
            ))
        })
        .collect()
}

/// The line above the table: model, hardware and layout, profile source, workload, seed, steps,
/// sequences per step, and the microbatch count or token budget.
fn header(c: &Comparison, mc: &MonteCarlo) -> String {
    let (p, tp) = (c.p, c.tp);
    let dp = c.configs.first().map_or(1, |c| c.dp.max(1));
    let ep = c.profile.expert_parallel;
    let cp = c.configs.first().and_then(|c| c.context_parallel);
    let cp_n = cp.map_or(1, |x| x.cp);
    let layout = if tp.0 > 1 || dp > 1 || cp_n > 1 {
        format!(
            " x {} GPUs (tp={}{}{} x dp={dp}{} x pp={p}, {})",
            tp.0 * cp_n * dp * p,
            tp.0,
            if tp.0 > 1 && tp.1 {
                " with sequence parallelism"
            } else {
                ""
            },
            match cp {
                Some(x) => format!(
                    " x cp={} ({}, {}{})",
                    x.cp,
                    x.comm,
                    x.balance,
                    x.max_seqlen_per_rank
                        .map(|m| format!(", dynamic at {m} tokens per GPU"))
                        .unwrap_or_default()
                ),
                None => String::new(),
            },
            if ep > 1 {
                format!(" with ep={ep}")
            } else {
                String::new()
            },
            c.configs.first().map(|c| c.sharding).unwrap_or_default()
        )
    } else {
        String::new()
    };
    format!(
        "{} on {}{layout} ({} profile), workload {} seed {}: {} step(s), {} sequences per step on average (step 0: {}), {}",
        c.profile.model,
        c.base_profile.hardware.name,
        format!("{:?}", c.profile.provenance.source).to_lowercase(),
        c.workload.name,
        c.seed,
        c.steps,
        mc.sequences_per_step.iter().sum::<usize>() as f64 / c.steps as f64,
        mc.sequences_per_step[0],
        match c.microbatches {
            Some(m) => format!(
                "exactly {m} microbatches per step (the flat policies balance them by predicted cost)"
            ),
            None => format!("token budget {}", c.token_budget),
        }
    )
}
