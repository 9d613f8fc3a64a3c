//! `simulate` on a profile and workload: the compared runs' Monte Carlo, their table and charts.

use super::compare::*;
use super::*;

pub(in crate::cli) fn simulate_profile(a: &SimulateArgs, schedules: Schedules) -> Result<ExitCode> {
    let Comparison {
        plan,
        profile,
        workload,
        size,
        seed,
        steps,
        microbatches,
        token_budget,
        policies,
        capacities,
        p,
        tp,
        base_profile,
        limit,
        limit_source,
        configs: mut combos,
    } = resolve_comparison(a, schedules)?;
    tracing::info!(
        "Monte Carlo: {steps} sampled steps x {} (schedule, policy, capacity) combinations of {} on {}",
        combos.len(),
        profile.model,
        profile.hardware.name
    );
    let mc_start = std::time::Instant::now();
    let bar = Progress::new(steps as u64);
    // zb-auto is built under the memory limit; when it cannot be, the comparison goes on
    // without it and says why.
    let (mc, dropped) =
        montecarlo::run_comparison(&profile, &workload, seed, size, steps, &mut combos, &|| {
            bar.inc()
        })
        .map_err(|err| match err {
            sim::Error::MemoryLimit { .. } => anyhow::Error::new(err)
                .context(format!("the per-rank memory limit is {}", limit_source)),
            err => err.into(),
        })?;
    bar.finish();
    tracing::info!(
        "Monte Carlo: done in {:.2} s",
        mc_start.elapsed().as_secs_f64()
    );
    if mc.oversize_sequences > 0 {
        tracing::warn!(
            "{} sequence(s) longer than the token budget {token_budget} {}",
            mc.oversize_sequences,
            match a.chunk_tokens {
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
    // Every row is checked against the per-rank memory zb-auto was built under.
    let mut rows = comparison_rows(&combos, &mc.outcomes, mc.first, steps, &profile, limit);
    // An under-filled pipeline is said whatever made m small (the workload, the budget or
    // --microbatches), once per number of stages per rank.
    let mut warned = Vec::new();
    for (r, _, v, _) in &rows {
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
    rows.sort_by(|x, y| {
        let (a, b) = (&x.0.summary, &y.0.summary);
        a.step_time_s
            .mean
            .total_cmp(&b.step_time_s.mean)
            .then(a.peak_activation_bytes.total_cmp(&b.peak_activation_bytes))
            .then(x.0.schedule.cmp(&y.0.schedule))
    });
    let charts: Vec<_> = rows
        .iter()
        .filter_map(|(r, first, v, rounds)| {
            first.as_ref().map(|(s, sim)| {
                let name = format!("{}-{}-{}", r.schedule, r.policy, r.capacity);
                let name =
                    if combos.len() == rows.len() && policies.len() == 1 && capacities.len() == 1 {
                        r.schedule.clone()
                    } else {
                        name
                    };
                let mut title = gantt_title(&name, s, *v, &sim.metrics);
                if *rounds > 1 {
                    title.push_str(&format!(
                        "  ({rounds} rounds of the {}-microbatch schedule)",
                        s.num_microbatches
                    ));
                }
                (name.clone(), title, sim)
            })
        })
        .collect();
    let mut notes = write_charts(a, &charts)?;
    // A plan file carries what the planner predicted and the hashes of what it was planned
    // on: say how this run compares, and when the inputs differ.
    if let Some(pl) = &plan {
        notes.extend(plan_comparison(
            pl,
            &base_profile,
            &workload,
            steps,
            &rows[0].0,
        )?);
    }
    if !charts.is_empty() && super::chart_path(&a.gantt, "").is_some() {
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
            fmt_bytes(limit),
            limit_source
        ));
    }
    if let Some(path) = &a.histogram {
        let best = &rows[0].0.schedule;
        let series: Vec<(String, Vec<f64>)> = combos
            .iter()
            .zip(&mc.outcomes)
            .filter(|(c, _)| &c.source.name() == best)
            .map(|(c, o)| {
                (
                    format!("{} / {}", c.policy, c.capacity),
                    o.iter().map(|x| x.step_time_s).collect(),
                )
            })
            .collect();
        let title = format!(
            "{best}: step time over {steps} steps of {} (p={p})",
            workload.name
        );
        sim::io::histogram::write_histogram(path, &title, &series)?;
        notes.push(format!(
            "Histogram of step times of {best}: {}",
            path.display()
        ));
    }
    let over: Vec<String> = rows
        .iter()
        .filter(|(r, _, _, _)| !r.fits)
        .map(|(r, _, _, _)| {
            format!(
                "{} needs {} (+{})",
                if policies.len() > 1 || capacities.len() > 1 {
                    format!("{} / {} / {}", r.schedule, r.policy, r.capacity)
                } else {
                    r.schedule.clone()
                },
                fmt_bytes(r.summary.peak_memory_bytes),
                fmt_bytes(r.summary.peak_memory_bytes - limit)
            )
        })
        .collect();
    if !over.is_empty() {
        notes.push(format!(
            "does not fit {} per rank ({}): {} ({}shown as they are)",
            fmt_bytes(limit),
            if a.memory_limit.is_some() {
                limit_source.clone()
            } else {
                format!("{limit_source}; --memory-limit to change")
            },
            over.join(", "),
            if combos
                .iter()
                .any(|c| matches!(c.source, ScheduleSource::Kind(ScheduleKind::ZbAuto)))
            {
                "zb-auto is built under the limit; the others are "
            } else {
                "the rows are "
            }
        ));
    }
    for (r, _, _, _) in &rows {
        if let (Some(sep), Some(hidden)) = (r.summary.fo_separate_s, r.summary.fo_hidden_fraction) {
            notes.push(format!(
                "{} / {}: the forward-only pass alone takes {} per step; {} of it is hidden in the training schedule ({})",
                r.schedule,
                r.policy,
                fmt_s(sep),
                pct(hidden),
                combos
                    .first()
                    .and_then(|c| c.forward_only)
                    .map_or(a.fo.fo_mode, |f| f.mode)
            ));
        }
    }
    let n0 = mc.sequences_per_step[0];
    let dp = combos.first().map_or(1, |c| c.dp.max(1));
    let layout = if tp.0 > 1 || dp > 1 {
        format!(
            " x {} GPUs (tp={}{} x dp={dp} x pp={p}, {})",
            tp.0 * dp * p,
            tp.0,
            if tp.0 > 1 && tp.1 {
                " with sequence parallelism"
            } else {
                ""
            },
            combos.first().map(|c| c.sharding).unwrap_or_default()
        )
    } else {
        String::new()
    };
    let header = format!(
        "{} on {}{layout} ({} profile), workload {} seed {seed}: {steps} step(s), {} sequences per step on average (step 0: {n0}), {}",
        profile.model,
        base_profile.hardware.name,
        format!("{:?}", profile.provenance.source).to_lowercase(),
        workload.name,
        mc.sequences_per_step.iter().sum::<usize>() as f64 / steps as f64,
        match microbatches {
            Some(m) => format!(
                "exactly {m} microbatches per step (the flat policies balance them by predicted cost)"
            ),
            None => format!("token budget {token_budget}"),
        }
    );
    let reports: Vec<&McReport> = rows.iter().map(|r| &r.0).collect();
    let table = comparison_table(&reports, steps);
    emit(a.format, &reports, &header, &table, &notes)
}

/// One row of the comparison: its report, step 0's schedule and simulation (for the charts),
/// stages per rank, and step 0's rounds.
pub(super) type Row = (McReport, Option<(sim::Schedule, Simulation)>, u32, u32);

/// The comparison's rows, in the configurations' order: each configuration's summary over the
/// steps, checked against the per-rank memory `limit` (bytes), with one step's metrics when a
/// single step ran as one round.
pub(super) fn comparison_rows(
    configs: &[flatpipe_simulator::run::config::RunConfig],
    outcomes: &[Vec<flatpipe_simulator::run::step::StepOutcome>],
    first: Vec<Option<(sim::Schedule, Simulation)>>,
    steps: u32,
    profile: &Profile,
    limit: f64,
) -> Vec<Row> {
    configs
        .iter()
        .zip(outcomes.iter().zip(first))
        .map(|(c, (outcomes, first))| {
            let first_rounds = outcomes.first().map_or(1, |o| o.rounds);
            let single = if steps == 1 && first_rounds == 1 {
                first.as_ref().map(|(s, sim)| SingleStep {
                    microbatches: s.num_microbatches,
                    metrics: sim.metrics.clone(),
                })
            } else {
                None
            };
            let capacity = match &c.source {
                ScheduleSource::Given(s) => s.num_microbatches.to_string(),
                ScheduleSource::Kind(_) => c.capacity.to_string(),
            };
            let summary =
                montecarlo::summarize(outcomes, c.pp * c.dp.max(1), profile.hardware.peak_flops);
            let report = McReport {
                schedule: c.source.name(),
                policy: c.policy.to_string(),
                capacity,
                pp: c.pp,
                vpp: c.v,
                fits: summary.peak_memory_bytes <= limit * (1.0 + 1e-9),
                memory_limit_bytes: limit,
                summary,
                single,
            };
            (report, first, c.v, first_rounds)
        })
        .collect()
}

/// The comparison's table: one step's metrics (lower bound and gap of its schedule), or the
/// step-time distribution over several steps.
pub(super) fn comparison_table(reports: &[&McReport], steps: u32) -> PlainTable {
    if steps == 1 {
        let mut t = new_table(&[
            "schedule",
            "policy",
            "capacity",
            "m",
            "step time",
            "bubble",
            "lower bound",
            "gap",
            "peak act.",
            "params+opt",
            "memory (max rank)",
            "tokens/s",
            "MFU",
        ]);
        for r in reports {
            let s = &r.summary;
            let (lb, gap) = match &r.single {
                // Against the step time shown beside it (with dp > 1 it holds the data-parallel
                // collectives, which the pipeline's lower bound does not).
                Some(x) => (
                    fmt_s(x.metrics.lower_bound_s),
                    format!(
                        "{:+.1}%",
                        100.0 * (s.step_time_s.mean / x.metrics.lower_bound_s - 1.0)
                    ),
                ),
                None => ("-".into(), "-".into()),
            };
            t.add_row([
                r.schedule.clone(),
                r.policy.clone(),
                r.capacity.clone(),
                format!("{}", s.microbatches_mean),
                fmt_s(s.step_time_s.mean),
                pct(s.bubble_ratio_mean),
                lb,
                gap,
                fmt_bytes(s.peak_activation_bytes),
                fmt_bytes(s.static_bytes),
                memory_cell(r),
                format!("{:.0}", s.tokens_per_s),
                pct(s.mfu),
            ]);
        }
        t
    } else {
        // flat-planned rows carry the mean per-step bound over every cut and order.
        let bound = reports
            .iter()
            .any(|r| r.summary.lower_bound_mean_s.is_some());
        let mut head = vec![
            "schedule",
            "policy",
            "capacity",
            "mean",
            "p50",
            "p90",
            "p99",
            "bubble",
            "tokens/s",
            "padding",
            "MFU",
            "peak act.",
            "memory (max rank)",
            "mean m",
        ];
        if bound {
            head.push("mean bound");
        }
        let mut t = new_table(&head);
        for r in reports {
            let s = &r.summary;
            let mut row = vec![
                r.schedule.clone(),
                r.policy.clone(),
                r.capacity.clone(),
                fmt_s(s.step_time_s.mean),
                fmt_s(s.step_time_s.p50),
                fmt_s(s.step_time_s.p90),
                fmt_s(s.step_time_s.p99),
                pct(s.bubble_ratio_mean),
                format!("{:.0}", s.tokens_per_s),
                pct(s.padding_fraction),
                pct(s.mfu),
                fmt_bytes(s.peak_activation_bytes),
                memory_cell(r),
                format!("{:.1}", s.microbatches_mean),
            ];
            if bound {
                row.push(s.lower_bound_mean_s.map_or("-".into(), fmt_s));
            }
            t.add_row(row);
        }
        t
    }
}

/// The memory cell of a row: the largest per-rank total, and by how much it exceeds the limit.
pub(super) fn memory_cell(r: &McReport) -> String {
    let need = r.summary.peak_memory_bytes;
    if r.fits {
        fmt_bytes(need)
    } else {
        format!(
            "{} OVER by {}",
            fmt_bytes(need),
            fmt_bytes(need - r.memory_limit_bytes)
        )
    }
}

/// The notes on a plan file's run: its inputs' hashes against this run's (a changed profile or
/// workload), and its predicted mean step time and bubble against this run's.
pub(super) fn plan_comparison(
    pl: &Plan,
    profile: &Profile,
    workload: &Workload,
    steps: u32,
    run: &McReport,
) -> Result<Vec<String>> {
    let mut notes = Vec::new();
    if let Some(prov) = &pl.provenance {
        let profile_now = planner::plan_file::profile_hash(profile)?;
        if prov.profile_sha256 != profile_now {
            let w = format!(
                "the plan was made on another profile (SHA-256 {}..., this run's {}...): its prediction is not this run's",
                prov.profile_sha256
                    .get(..12)
                    .unwrap_or(&prov.profile_sha256),
                &profile_now[..12]
            );
            tracing::warn!("{w}");
            notes.push(w);
        }
        let workload_now = planner::plan_file::workload_hash(workload)?;
        if prov.workload_sha256 != workload_now {
            let w = format!(
                "the plan was made on another workload (SHA-256 {}..., this run's {}...)",
                prov.workload_sha256
                    .get(..12)
                    .unwrap_or(&prov.workload_sha256),
                &workload_now[..12]
            );
            tracing::warn!("{w}");
            notes.push(w);
        }
    }
    if let Some(pred) = &pl.predicted {
        let now = run.summary.step_time_s.mean;
        notes.push(format!(
            "the plan predicted a mean step of {} and a bubble of {} over {} sampled step(s); this run: {} and {} over {steps} ({:+.1}%){}",
            fmt_s(pred.step_time_mean_s),
            pct(pred.bubble_ratio),
            pred.steps,
            fmt_s(now),
            pct(run.summary.bubble_ratio_mean),
            100.0 * (now / pred.step_time_mean_s - 1.0),
            if steps != pred.steps {
                format!("; --steps {} samples the same steps", pred.steps)
            } else {
                String::new()
            }
        ));
    }
    Ok(notes)
}
