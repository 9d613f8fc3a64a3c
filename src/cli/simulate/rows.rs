//! The rows of `simulate`'s profile comparison: one report per run, the table, the memory cell
//! and the plan file's prediction against this run.

use super::*;

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
            let mut summary =
                montecarlo::summarize(outcomes, c.pp * c.dp.max(1), profile.hardware.peak_flops);
            // A rank is a group of cp GPUs: the model FLOPs utilisation is per GPU.
            summary.mfu /= f64::from(c.context_parallel.map_or(1, |x| x.cp.max(1)));
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
    // With expert parallelism, the last column: what each schedule leaves of its all-to-alls.
    let a2a = reports.iter().any(|r| r.summary.all_to_all_mean.is_some());
    let with_a2a = |mut head: Vec<&'static str>| {
        if a2a {
            head.push("a2a exposed");
        }
        new_table(&head)
    };
    let a2a_cell = |r: &McReport, mut row: Vec<String>| {
        if a2a {
            row.push(all_to_all_cell(r.summary.all_to_all_mean));
        }
        row
    };
    if steps == 1 {
        let mut t = with_a2a(vec![
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
            t.add_row(a2a_cell(
                r,
                vec![
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
                ],
            ));
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
        let mut t = with_a2a(head);
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
            t.add_row(a2a_cell(r, row));
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
