//! `simulate --costs`: the schedules compared on hand-given costs, one step.

use super::*;
use sim::costs::given::CostSpec;
use sim::ir::lowering::Lowering;

/// One compared schedule under uniform costs: its name, stages per rank, schedule, metrics,
/// and its full simulation (timeline and memory levels) when an output draws it.
pub(super) struct UniformRun {
    name: String,
    v: u32,
    schedule: sim::Schedule,
    metrics: sim::Metrics,
    simulation: Option<Simulation>,
}

impl UniformRun {
    /// Validates and replays `schedule` under `costs` and `lowering`, keeping the timeline or
    /// not ([`simulate_run`]).
    ///
    /// # Errors
    /// The schedule's validation error or a deadlock.
    fn simulated<C: sim::CostModel>(
        name: String,
        v: u32,
        schedule: sim::Schedule,
        costs: &C,
        (keep_timeline, lowering): (bool, Lowering),
    ) -> Result<Self> {
        let (metrics, simulation) = simulate_run(&schedule, costs, keep_timeline, lowering)?;
        Ok(UniformRun {
            name,
            v,
            schedule,
            metrics,
            simulation,
        })
    }
}

/// Whether an output of `a` needs the replay's timeline: a Gantt chart (the default), a
/// Chrome trace or the memory CSV. Without one, `simulate` replays through
/// [`sim::replay::summary::metrics_without_timeline`], which gives the same metrics and keeps no
/// per-action record (at p = 64, m = 4,096 the timeline is ~1 M entries and the memory
/// events twice that).
pub(super) fn needs_timeline(a: &SimulateArgs) -> bool {
    super::chart_path(&a.gantt, "flatpipe-gantt.png").is_some()
        || a.trace.is_some()
        || a.memory.is_some()
}

/// Validates and replays `schedule`: the full [`Simulation`] when `keep_timeline`, else the
/// metrics alone.
///
/// # Errors
/// The schedule's validation error or a deadlock.
pub(super) fn simulate_run<C: sim::CostModel>(
    schedule: &sim::Schedule,
    costs: &C,
    keep_timeline: bool,
    lowering: Lowering,
) -> Result<(sim::Metrics, Option<Simulation>)> {
    if keep_timeline {
        let simulation = sim::simulate_with(schedule, costs, lowering)?;
        return Ok((simulation.metrics.clone(), Some(simulation)));
    }
    schedule.validate()?;
    let metrics = if lowering == Lowering::UNCONTENDED {
        sim::replay::summary::metrics_without_timeline(schedule, costs)?
    } else {
        sim::replay::summary::lowered_metrics_without_timeline(schedule, lowering, costs)?
    };
    Ok((metrics, None))
}

/// One step's makespan in seconds under `lowering`, without a timeline.
pub(super) fn makespan_s<C: sim::CostModel>(
    schedule: &sim::Schedule,
    costs: &C,
    lowering: Lowering,
) -> Result<f64> {
    Ok(simulate_run(schedule, costs, false, lowering)?.0.makespan_s)
}

/// `simulate --costs`: build the compared schedules, add the forward-only work, replay each
/// under the given costs, rank the rows by makespan, and print the table with its charts.
pub(in crate::cli) fn simulate_uniform(
    a: &SimulateArgs,
    spec: &CostSpec,
    schedules: Schedules,
) -> Result<ExitCode> {
    let built = match schedules {
        Schedules::Csv(s) => vec![(s.name.clone(), s.num_stages() / s.placement.num_ranks, s)],
        Schedules::Kinds(kinds) => build_kinds(a, spec, &kinds)?,
    };
    let m = built.first().map_or(0, |(_, _, s)| s.num_microbatches);
    let k = a.fo.spec()?.map_or(0, |f| f.microbatches.unwrap_or(m));
    if let Some((_, _, s)) = built.first() {
        check_serial_range(spec, s.placement.num_ranks, m, k)?;
    }
    if let CostSpec::Uniform(u) = spec
        && u.fsdp != Default::default()
        && a.lowering().fsdp.is_none()
    {
        tracing::warn!(
            "the --costs keys ag, rs and interference are FSDP's collectives: they apply with --fsdp"
        );
    }
    let keep_timeline = needs_timeline(a);
    let mut runs = Vec::new();
    let mut fo_reports = std::collections::HashMap::new();
    let (mut hung, mut first_hang) = (Vec::new(), None);
    for (name, v, train) in built {
        match simulate_one(a, spec, (name.clone(), v, train), k, keep_timeline) {
            Ok((run, fo)) => {
                fo_reports.extend(fo.map(|r| (name, r)));
                runs.push(run);
            }
            // A lowering that hangs leaves that schedule out of the comparison, said in a note.
            Err(e) if cannot_run(&e) => {
                hung.push(format!("{name} not shown: {e}"));
                first_hang.get_or_insert(e);
            }
            Err(e) => return Err(e),
        }
    }
    if runs.is_empty()
        && let Some(e) = first_hang
    {
        return Err(e);
    }
    let exact_notes = match a.exact {
        Some(secs) => exact_row(a, spec, secs, k, keep_timeline, &mut runs)?,
        None => Vec::new(),
    };
    runs.sort_by(|x, y| {
        let (a, b) = (&x.metrics, &y.metrics);
        a.makespan_s
            .total_cmp(&b.makespan_s)
            .then(peak_of(a).total_cmp(&peak_of(b)))
            .then(x.name.cmp(&y.name))
    });
    let reports: Vec<Report> = runs
        .iter()
        .map(|run| {
            Ok(Report {
                schedule: run.name.clone(),
                pp: run.schedule.placement.num_ranks,
                vpp: run.v,
                microbatches: run.schedule.num_microbatches,
                metrics: run.metrics.clone(),
                forward_only: fo_reports.get(&run.name).cloned(),
                consecutive_steps: consecutive_report(a, spec, &run.schedule)?,
            })
        })
        .collect::<Result<_>>()?;
    let charts: Vec<_> = runs
        .iter()
        .filter_map(|r| {
            let sim = r.simulation.as_ref()?;
            let title = gantt_title(&r.name, &r.schedule, r.v, &r.metrics);
            Some((r.name.clone(), title, sim))
        })
        .collect();
    let (mut notes, unwritten) = write_charts(a, &charts);
    notes.extend(exact_notes);
    notes.extend(hung);
    let m = runs.first().map_or(0, |r| r.schedule.num_microbatches);
    let header = format!("{spec} (one rank's share per microbatch), {m} microbatches");
    let table = uniform_table(&reports, k > 0, a.consecutive_steps.is_some());
    let code = emit(a.format, &reports, &header, &table, &notes)?;
    // The table is out: an output that could not be written is the error now.
    unwritten.map_or(Ok(code), Err)
}

/// One compared schedule replayed under the lowering `a` asks for, with its forward-only work
/// (`k` microbatches) and that work's report.
///
/// # Errors
/// A cost model that does not fit the schedule, or a replay that fails (a lowering that hangs
/// among them: [`cannot_run`]).
fn simulate_one(
    a: &SimulateArgs,
    spec: &CostSpec,
    (name, v, train): (String, u32, sim::Schedule),
    k: u32,
    keep_timeline: bool,
) -> Result<(UniformRun, Option<FoReport>)> {
    let costs = spec.model(&train.placement)?;
    let (schedule, fo) = if k > 0 {
        let (combined, report) = with_forward_only_work(a, &train, k, &costs)?;
        (combined, Some(report))
    } else {
        (train, None)
    };
    let replay = (keep_timeline, a.lowering());
    Ok((
        UniformRun::simulated(name, v, schedule, &costs, replay)?,
        fo,
    ))
}

/// Whether `e` is a lowering that cannot run: its streams hang ([`sim::Error::StreamsHang`])
/// or a rank pair posts its sends and receives in different orders
/// ([`sim::Error::PairOrder`]).
fn cannot_run(e: &anyhow::Error) -> bool {
    matches!(
        e.downcast_ref::<sim::Error>(),
        Some(sim::Error::StreamsHang { .. } | sim::Error::PairOrder { .. })
    )
}

/// Builds each schedule kind at `--pp` with one microbatch count for the whole comparison
/// (`--microbatches`, else the deepest interleaving's p·v): (name, stages per rank, schedule).
///
/// # Errors
/// A kind that cannot run at these sizes, schedules too large for memory together, an invalid
/// `--max-activation-units`, or a zb-auto that cannot be built.
fn build_kinds(
    a: &SimulateArgs,
    spec: &CostSpec,
    kinds: &[ScheduleKind],
) -> Result<Vec<(String, u32, sim::Schedule)>> {
    let p = a.pp.unwrap_or(resolve::DEFAULT_PP);
    let vs = kinds
        .iter()
        .map(|k| k.stages_per_rank(a.vpp))
        .collect::<std::result::Result<Vec<_>, _>>()?;
    let m = a.microbatches.unwrap_or(default_microbatches(
        p,
        vs.iter().copied().max().unwrap_or(1),
    ));
    let pairs: f64 = vs
        .iter()
        .map(|&v| f64::from(p) * f64::from(v) * f64::from(m))
        .sum();
    super::check_schedule_memory(
        &format!(
            "--microbatches {m} with --pp {p} and {} schedule(s)",
            kinds.len()
        ),
        pairs,
    )?;
    kinds
        .iter()
        .zip(vs)
        .map(|(k, v)| {
            warn_underfilled(k.name(), m, p, v);
            // Every kind through the one building contract; only zb-auto reads the
            // costs and the activation limit.
            let units = a.max_activation_units.unwrap_or(p as f64);
            if a.max_activation_units.is_some() && !(units.is_finite() && units > 0.0) {
                bail!(
                    "--max-activation-units = {units} is invalid: > 0 units (1F1B's rank 0 holds p)"
                );
            }
            let costs = spec.model(&k.placement_on(p, v)?)?;
            let s = k.build_for(p, v, m, &costs, units, a.zb_objective.into())?;
            Ok((k.name().to_string(), v, s))
        })
        .collect()
}

/// Every action one after the other bounds the makespan; it must stay well inside u64
/// nanoseconds (1.8e10 s): `p` ranks' training work for `m` microbatches and forward-only work
/// for `k` (Fo costs f unless given).
///
/// # Errors
/// The bound is over 1e10 s, with the numbers.
fn check_serial_range(spec: &CostSpec, p: u32, m: u32, k: u32) -> Result<()> {
    let (train_s, fo_s) = spec.serial_s();
    let serial_s = f64::from(p) * (f64::from(m) * train_s + f64::from(k) * fo_s);
    if serial_s > 1e10 {
        bail!(
            "--costs with --pp {p}, {m} microbatches and {k} forward-only microbatches: a step could last up to {serial_s:.3e} s, beyond the simulator's range of 1e10 s (time is counted in u64 nanoseconds); use smaller costs or fewer microbatches"
        );
    }
    Ok(())
}

/// `train` with `k` forward-only microbatches added as `--fo-mode` says, and the report of how
/// much of the forward-only pass the training schedule hides (makespans of the training alone,
/// the forward-only pass alone, and both together).
///
/// # Errors
/// A schedule that cannot be combined or replayed.
fn with_forward_only_work<C: sim::CostModel>(
    a: &SimulateArgs,
    train: &sim::Schedule,
    k: u32,
    costs: &C,
) -> Result<(sim::Schedule, FoReport)> {
    let lowering = a.lowering();
    let t_train = makespan_s(train, costs, lowering)?;
    let pass = sim::schedules::forward_only::forward_only_pass(train, k);
    let t_fo = makespan_s(&pass, costs, lowering)?;
    let combined = sim::schedules::forward_only::with_forward_only(
        train,
        k,
        a.fo.fo_mode,
        a.fo.fo_loss_dependency,
        costs,
    )?;
    let t = makespan_s(&combined, costs, lowering)?;
    let report = FoReport {
        fo_microbatches: k,
        fo_mode: a.fo.fo_mode,
        fo_loss_dependency: a.fo.fo_loss_dependency,
        train_only_s: t_train,
        fo_separate_s: t_fo,
        fo_hidden_fraction: (t_train + t_fo - t) / t_fo,
    };
    Ok((combined, report))
}

/// `--consecutive-steps K`: the steady-state step time of `s` over K steps under both
/// synchronisations; `None` without the flag.
///
/// # Errors
/// The multistep replay fails.
fn consecutive_report(
    a: &SimulateArgs,
    spec: &CostSpec,
    s: &sim::Schedule,
) -> Result<Option<ConsecutiveReport>> {
    let Some(k) = a.consecutive_steps else {
        return Ok(None);
    };
    let costs = spec.model(&s.placement)?;
    let steady = |sync| -> Result<f64> {
        Ok(sim::costs::ns_to_s(
            sim::replay::multistep::consecutive_steps(s, &costs, k, sync)?.steady_state_step_ns,
        ))
    };
    Ok(Some(ConsecutiveReport {
        steps: k,
        global_sync_step_s: steady(sim::replay::multistep::StepSync::Global)?,
        post_validation_step_s: steady(sim::replay::multistep::StepSync::PostValidation)?,
    }))
}

/// The `--costs` table: one row per schedule, with the forward-only columns when `fo` and the
/// steady-state columns when `consecutive`.
fn uniform_table(reports: &[Report], fo: bool, consecutive: bool) -> PlainTable {
    let mut cols = vec![
        "schedule",
        "pp",
        "vpp",
        "m",
        "makespan",
        "bubble",
        "lower bound",
        "gap",
        "peak act. (max rank)",
        "peak in-flight",
    ];
    if fo {
        cols.extend(["train only", "fo separate", "fo hidden"]);
    }
    if consecutive {
        cols.extend(["steady step, sync", "steady step, post-validation"]);
    }
    let mut t = new_table(&cols);
    for r in reports {
        let m = &r.metrics;
        let inflight = m
            .ranks
            .iter()
            .map(|x| x.peak_inflight_microbatches)
            .max()
            .unwrap_or(0);
        let mut row = vec![
            r.schedule.clone(),
            r.pp.to_string(),
            r.vpp.to_string(),
            r.microbatches.to_string(),
            fmt_s(m.makespan_s),
            pct(m.bubble_ratio),
            fmt_s(m.lower_bound_s),
            format!("{:+.1}%", 100.0 * m.gap_to_lower_bound),
            format!("{:.2} units", peak_of(m)),
            inflight.to_string(),
        ];
        if let Some(f) = &r.forward_only {
            row.extend([
                fmt_s(f.train_only_s),
                fmt_s(f.fo_separate_s),
                pct(f.fo_hidden_fraction),
            ]);
        }
        if let Some(c) = &r.consecutive_steps {
            row.extend([fmt_s(c.global_sync_step_s), fmt_s(c.post_validation_step_s)]);
        }
        t.add_row(row);
    }
    t
}

/// `--exact SECONDS`: solves for the optimal schedule on zb-auto's placement (or the CSV
/// schedule's), starting from the fastest compared schedule of that placement within the
/// limit, adds it as a row and returns the notes that say what was proved.
pub(super) fn exact_row(
    a: &SimulateArgs,
    spec: &CostSpec,
    secs: f64,
    fo: u32,
    keep_timeline: bool,
    runs: &mut Vec<UniformRun>,
) -> Result<Vec<String>> {
    if !(secs.is_finite() && secs > 0.0 && secs <= 86_400.0) {
        bail!("--exact = {secs} is invalid: a time limit of > 0 to 86400 seconds");
    }
    if fo > 0 {
        bail!(
            "--exact solves training steps only; drop --fo-microbatches (the solver has no forward-only work)"
        );
    }
    let Some(UniformRun {
        schedule: first, ..
    }) = runs.first()
    else {
        return Ok(Vec::new());
    };
    let (p, m) = (first.placement.num_ranks, first.num_microbatches);
    let placement = if a.schedule_csv.is_some() {
        first.placement.clone()
    } else {
        sim::schedules::zb_auto::placement(p, a.vpp.unwrap_or(1))
            .map_err(|e| anyhow::anyhow!("--exact with --vpp: {e}"))?
    };
    let v = placement.num_stages() / p.max(1);
    let costs = spec.model(&placement)?;
    let limit = a.max_activation_units.unwrap_or(f64::from(p));
    let incumbent = runs
        .iter()
        .filter(|r| {
            r.schedule.placement == placement && peak_of(&r.metrics) <= limit * (1.0 + 1e-9)
        })
        .min_by(|x, y| x.metrics.makespan_s.total_cmp(&y.metrics.makespan_s))
        .map(|r| &r.schedule);
    let spinner = indicatif::ProgressBar::new_spinner().with_message(format!(
        "exact: searching (at most {secs} s, p = {p}, m = {m})"
    ));
    spinner.enable_steady_tick(std::time::Duration::from_millis(200));
    let started = std::time::Instant::now();
    let out = sim::schedules::exact::solve(
        &placement,
        m,
        &costs,
        limit,
        incumbent,
        &sim::schedules::exact::ExactOptions {
            time_limit: Some(std::time::Duration::from_secs_f64(secs)),
            ..Default::default()
        },
    )?;
    spinner.finish_and_clear();
    let took = started.elapsed().as_secs_f64();
    let bound = sim::costs::ns_to_s(out.lower_bound_ns);
    let Some(schedule) = out.schedule else {
        if out.optimal {
            bail!(
                "--exact: no schedule of {m} microbatches on pp = {p} fits {limit} activation units per rank (one microbatch needs 1 unit on every rank)"
            );
        }
        return Ok(vec![format!(
            "exact: no schedule found within {secs} s ({} nodes); lower bound {}",
            out.nodes,
            fmt_s(bound)
        )]);
    };
    let makespan = sim::costs::ns_to_s(out.makespan_ns.unwrap_or(0));
    let (name, note) = if out.optimal {
        (
            "exact".to_string(),
            format!(
                "exact: the optimal makespan is {} under {limit} units per rank (proved: {} search node(s) in {took:.2} s)",
                fmt_s(makespan),
                out.nodes
            ),
        )
    } else {
        (
            "exact (best found)".to_string(),
            format!(
                "exact: stopped at the {secs} s limit after {} nodes; best found {}, lower bound {}: the optimum lies between (gap {:.1}%)",
                out.nodes,
                fmt_s(makespan),
                fmt_s(bound),
                100.0 * (makespan / bound - 1.0)
            ),
        )
    };
    let replay = (keep_timeline, a.lowering());
    runs.push(UniformRun::simulated(name, v, schedule, &costs, replay)?);
    Ok(vec![note])
}
