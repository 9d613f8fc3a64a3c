//! `flatpipe plan`: search dp x pp, v, schedule, token budget and split; write and export the plan.

use super::*;

/// What `plan --export` writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(super) enum ExportFormat {
    Torchtitan,
    Megatron,
    PytorchCsv,
}

impl ExportFormat {
    /// The name `--export` takes.
    fn name(self) -> &'static str {
        match self {
            ExportFormat::Torchtitan => "torchtitan",
            ExportFormat::Megatron => "megatron",
            ExportFormat::PytorchCsv => "pytorch-csv",
        }
    }
}

/// `--rank-by`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(super) enum RankByArg {
    /// Mean step time.
    Mean,
    /// 90th-percentile step time.
    P90,
}

/// `--split-solver`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(super) enum SplitSolver {
    /// The built-in branch and bound.
    Bnb,
    /// HiGHS's MILP (a build with `--features highs`).
    Highs,
    /// The DP split with per-stage shares of each rank's limit.
    Dp,
}

/// Options of `flatpipe plan`.
#[derive(Debug, Args)]
pub(super) struct PlanArgs {
    #[command(flatten)]
    inputs: Inputs,
    /// Ranks in all (dp x pp). Default 8 (one 8-GPU node).
    #[arg(long, default_value_t = 8)]
    ranks: u32,
    /// Memory limit per rank, e.g. 120GiB (default: the hardware's memory minus a reserve for
    /// the CUDA context, communication buffers and fragmentation: 4 GiB, at most 1/8 of it).
    #[arg(long)]
    memory_limit: Option<String>,
    /// Pipeline degrees to try, comma-separated (default: every divisor of --ranks).
    #[arg(long, value_delimiter = ',')]
    pp: Vec<u32>,
    /// Stages per rank to try for interleaved schedules (default 2,4).
    #[arg(long, value_delimiter = ',', value_parser = clap::value_parser!(u32).range(1..))]
    vpp: Vec<u32>,
    /// Schedules to try (default: every handcrafted schedule).
    #[arg(long, value_delimiter = ',')]
    schedule: Vec<String>,
    /// Token budgets per microbatch to try (default 4096,8192,16384,32768,65536,131072).
    #[arg(long, value_delimiter = ',')]
    token_budgets: Vec<u64>,
    /// Never cut a sequence longer than the token budget into chunks (by default the search
    /// also tries chunks of the budget and of half of it for the finalists' layouts).
    #[arg(long)]
    no_chunk: bool,
    /// Recomputation modes the split may use per stage (default none,selective,full).
    #[arg(long, value_delimiter = ',')]
    recompute: Vec<String>,
    /// Data-parallel sharding modes to try: ddp, zero1, zero2, fsdp, fsdp-mb, hsdp (default
    /// ddp,zero1,fsdp,hsdp; hsdp only where the data-parallel group crosses nodes).
    #[arg(long, value_delimiter = ',')]
    sharding: Vec<String>,
    /// Tensor-parallel degrees to try, GPUs per rank (default: every divisor of the GPUs per
    /// node that divides the attention and key-value heads).
    #[arg(long, value_delimiter = ',', value_parser = clap::value_parser!(u32).range(1..))]
    tp: Vec<u32>,
    /// Tensor parallelism without sequence parallelism (the norm and GEMM-input activations
    /// then stay whole on every GPU of a group).
    #[arg(long)]
    no_sequence_parallel: bool,
    /// Sampled steps per candidate. Default 64.
    #[arg(long, default_value_t = 64)]
    steps: u32,
    /// Sequences per step (default: the workload's, 128).
    #[arg(long, conflicts_with = "tokens_per_step")]
    seqs_per_step: Option<u32>,
    /// Tokens per step.
    #[arg(long)]
    tokens_per_step: Option<u64>,
    /// Seed of the step sampler (default 0). Printed.
    #[arg(long)]
    seed: Option<u64>,
    /// Rank candidates by mean or p90 step time.
    #[arg(long, value_enum, default_value_t = RankByArg::Mean)]
    rank_by: RankByArg,
    /// Where memory forces a split away from the fastest one: `bnb` searches the optimal split
    /// by branch and bound (built in, milliseconds per candidate); `highs` by HiGHS's MILP
    /// (0.5 s per candidate, needs a build with `--features highs`); `dp` keeps the DP split
    /// with per-stage shares of each rank's limit and its certified gap.
    #[arg(long, value_enum, default_value_t = SplitSolver::Bnb)]
    split_solver: SplitSolver,
    #[command(flatten)]
    fo: FoArgs,
    /// How many plans to report (the best and its runners-up).
    #[arg(long, default_value_t = 5)]
    keep: usize,
    /// Write the chosen plan here (YAML, atomically).
    #[arg(short, long)]
    output: Option<PathBuf>,
    /// Export the chosen plan; printed, or written next to -o (plan.torchtitan.toml,
    /// plan.megatron.txt, plan.pytorch.csv).
    #[arg(long, value_enum)]
    export: Option<ExportFormat>,
    /// Write the Gantt chart of the chosen plan's first step here (default flatpipe-plan.png;
    /// `none` writes no chart).
    #[arg(long)]
    gantt: Option<PathBuf>,
    /// Output format.
    #[arg(long, value_enum, default_value_t = Format::Table)]
    format: Format,
}

/// Above this fraction of the memory limit, `plan` notes that the chosen plan has little margin.
const MARGIN_NOTE_FRACTION: f64 = 0.98;

/// One row of `plan`'s output.
#[derive(Debug, Serialize)]
pub(super) struct PlanRow {
    rank: usize,
    #[serde(flatten)]
    candidate: planner::search::Candidate,
    stages: Vec<[usize; 2]>,
    recompute: Vec<sim::costs::Recompute>,
    gap_to_lower_bound: f64,
}

/// A search resolved from `plan`'s flags: every default decided here, once.
struct ResolvedSearch {
    /// The Gantt chart's path (`--gantt`, none for `none`).
    chart: Option<std::path::PathBuf>,
    profile: Profile,
    workload: Workload,
    workload_name: String,
    /// Per-rank memory limit, bytes.
    limit: f64,
    space: planner::search::SearchSpace,
    config: planner::search::SearchConfig,
    seed: u64,
    size: StepSize,
}

/// Resolves `plan`'s flags into a [`ResolvedSearch`], refusing a bad output path or a search
/// too large for memory before it starts.
fn resolve_search(a: &PlanArgs) -> Result<ResolvedSearch> {
    use planner::search::{RankBy, SearchConfig, SearchSpace};
    // A bad output path is found before the search, not after it.
    let chart = super::chart_path(&a.gantt, "flatpipe-plan.png");
    super::check_outputs(chart.iter().chain(&a.output))?;
    if let Some(c) = &chart {
        sim::io::gantt::check_chart_path(c)?;
    }
    let profile = resolve_profile(
        a.inputs.profile.as_deref(),
        a.inputs.model.as_deref(),
        a.inputs.hardware.as_deref(),
    )?;
    let workload_name = a
        .inputs
        .workload
        .clone()
        .unwrap_or_else(|| builtins::DEFAULT_WORKLOAD.to_string());
    let workload = builtins::workload(&workload_name)?;
    let limit = memory_limit(a.memory_limit.as_deref(), &profile)?;
    let mut space = SearchSpace::default_for(a.ranks);
    if !a.pp.is_empty() {
        space.pp = dedup(a.pp.clone());
    }
    if !a.vpp.is_empty() {
        space.vpp = dedup(a.vpp.clone());
    }
    if !a.schedule.is_empty() {
        space.kinds = parse_kinds(&a.schedule)?;
    }
    if !a.token_budgets.is_empty() {
        if a.token_budgets.contains(&0) {
            bail!("--token-budgets: 0 is invalid: every budget >= 1 token");
        }
        space.token_budgets = dedup(a.token_budgets.clone());
    }
    if !a.recompute.is_empty() {
        space.recompute = a
            .recompute
            .iter()
            .map(|r| match r.trim() {
                "none" => Ok(sim::costs::Recompute::None),
                "selective" => Ok(sim::costs::Recompute::Selective),
                "full" => Ok(sim::costs::Recompute::Full),
                other => Err(anyhow::anyhow!(
                    "--recompute `{other}` is invalid: one of none, selective, full"
                )),
            })
            .collect::<Result<_>>()?;
    }
    if !a.sharding.is_empty() {
        space.sharding = dedup(
            a.sharding
                .iter()
                .map(|m| m.trim().parse::<sim::costs::sharding::Sharding>())
                .collect::<std::result::Result<Vec<_>, _>>()
                .map_err(|e| anyhow::anyhow!("--sharding: {e}"))?,
        );
    }
    if !a.tp.is_empty() {
        let valid: Vec<u32> = planner::search::tensor_parallel_degrees(&profile)
            .into_iter()
            .filter(|t| a.ranks % t == 0)
            .collect();
        if let Some(t) = a.tp.iter().find(|t| !valid.contains(t)) {
            bail!(
                "--tp {t} is invalid: one of {} (divisors of the {} GPUs per node of {} that divide {}'s attention and key-value heads and --ranks {})",
                valid
                    .iter()
                    .map(u32::to_string)
                    .collect::<Vec<_>>()
                    .join(", "),
                profile.hardware.gpus_per_node,
                profile.hardware.name,
                profile.model,
                a.ranks
            );
        }
        space.tp = dedup(a.tp.clone());
    }
    space.sequence_parallel = !a.no_sequence_parallel;
    space.chunk = !a.no_chunk;
    if a.keep == 0 {
        bail!("--keep = 0 is invalid: >= 1 plan");
    }
    let size = resolve::step_size(a.seqs_per_step, a.tokens_per_step, None, &workload)?;
    let seed = a.seed.unwrap_or(workload.seed);
    let config = SearchConfig {
        steps: a.steps,
        seed,
        size,
        memory_limit_bytes: limit,
        state_bytes: None,
        rank_by: match a.rank_by {
            RankByArg::Mean => RankBy::Mean,
            RankByArg::P90 => RankBy::P90,
        },
        keep: a.keep,
        exact_split: match a.split_solver {
            SplitSolver::Dp => planner::partition::ExactSplit::Off,
            SplitSolver::Highs => {
                if !planner::HIGHS {
                    bail!(
                        "--split-solver highs: this flatpipe was built without HiGHS; rebuild with `cargo build --release --features highs` (needs cmake and libclang), or use the built-in `bnb`"
                    );
                }
                planner::partition::ExactSplit::Highs {
                    time_limit_s: planner::partition::MILP_TIME_LIMIT_S,
                }
            }
            SplitSolver::Bnb => planner::partition::ExactSplit::DEFAULT,
        },
        forward_only: a.fo.spec()?,
    };
    // The search keeps every sampled step and runs one Monte Carlo per candidate: the largest
    // candidate (most ranks per pipeline, most stages per rank, smallest budget) sets the peak.
    let mut widest = flatpipe_simulator::run::config::RunConfig::new(
        ScheduleSource::Kind(ScheduleKind::OneFOneB),
        space.pp.iter().copied().max().unwrap_or(1),
        space.vpp.iter().copied().max().unwrap_or(1).max(2),
        Vec::new(),
        space.policy,
        Capacity::Dynamic,
    );
    widest.params.token_budget = space.token_budgets.iter().copied().min().unwrap_or(1);
    super::check_monte_carlo_memory(
        "the plan search",
        &workload,
        seed,
        size,
        a.steps,
        a.steps,
        &[widest],
    )?;
    Ok(ResolvedSearch {
        chart,
        profile,
        workload,
        workload_name,
        limit,
        space,
        config,
        seed,
        size,
    })
}

pub(super) fn plan_cmd(a: PlanArgs) -> Result<ExitCode> {
    let ResolvedSearch {
        chart,
        profile,
        workload,
        workload_name,
        limit,
        space,
        config,
        seed,
        size,
    } = resolve_search(&a)?;
    let result = search_with_progress(&profile, &workload, &space, &config)?;
    let best = &result.ranked[0];
    let baseline = fsdp_baseline(&profile, &workload, &space, &config, best, &result.ranked);
    let gib = |b: f64| b / (1u64 << 30) as f64;
    let rows: Vec<PlanRow> = result
        .ranked
        .iter()
        .enumerate()
        .map(|(i, c)| PlanRow {
            rank: i + 1,
            candidate: c.clone(),
            stages: c
                .partition
                .stages
                .iter()
                .map(|r| [r.start, r.end])
                .collect(),
            recompute: c.partition.recompute.clone(),
            gap_to_lower_bound: c.summary.step_time_s.mean / c.lower_bound_s - 1.0,
        })
        .collect();
    // The chosen plan as a Plan file.
    let (model_ref, hardware_ref) = match &a.inputs.profile {
        Some(_) => (None, None),
        None => (
            Some(
                a.inputs
                    .model
                    .clone()
                    .unwrap_or_else(|| builtins::DEFAULT_MODEL.into()),
            ),
            Some(
                a.inputs
                    .hardware
                    .clone()
                    .unwrap_or_else(|| builtins::DEFAULT_HARDWARE.into()),
            ),
        ),
    };
    let plan = planner::plan_file::candidate_plan(
        best,
        &planner::plan_file::PlanInputs {
            model: model_ref,
            hardware: hardware_ref,
            profile: a.inputs.profile.clone(),
            workload: workload_name.clone(),
            seqs_per_step: a.seqs_per_step,
            tokens_per_step: a.tokens_per_step,
            seed,
        },
        &profile,
        &workload,
        &config,
        space.policy,
    )?;
    let mut notes = sizing_notes(&a, &workload, seed, size, best, limit);
    notes.push(baseline.note.clone());
    if let Some(path) = &a.output {
        profiles::write_atomic(path, plan.to_yaml()?.as_bytes())?;
        notes.push(format!(
            "Plan written to {} (run it: flatpipe simulate --plan {})",
            path.display(),
            path.display()
        ));
    }
    let per_gpu = profile.tensor_parallel(best.tp, best.sequence_parallel)?;
    let exported = match a.export {
        Some(_) => Some(planner::export::exported_step(
            &plan,
            &per_gpu,
            &workload,
            size,
            config.steps,
        )?),
        None => None,
    };
    let (mut export_text, extra_files) = match &exported {
        Some(step) => export(&a, &plan, &profile, step)?,
        None => (None, Vec::new()),
    };
    // torchtitan trains on rows of seq_len = the token budget: a longer sequence is cut across
    // rows there, where flatpipe predicted it as a microbatch of its own. Said in the file.
    if let (Some(ExportFormat::Torchtitan), Some((_, text))) = (a.export, &mut export_text) {
        let (longer, total) = longer_than_budget(&a, &workload, seed, size, best.token_budget);
        if longer > 0 {
            let warning = format!(
                "# warning: {longer} of the {total} sampled sequences are longer than seq_len = {}: torchtitan cuts them across rows, where flatpipe's prediction {} (plan with --token-budgets at least the longest and --no-chunk to train what was predicted)\n",
                best.token_budget,
                if best.chunk_tokens.is_some() {
                    "pipelines them in chunks that attend to the earlier chunks"
                } else {
                    "gives each a microbatch of its own"
                }
            );
            let at = text.find('\n').map_or(0, |i| i + 1);
            text.insert_str(at, &warning);
        }
    }
    let mut export_inline = None;
    if let Some((ext, text)) = &export_text {
        match &a.output {
            Some(path) => {
                for (p, body) in &extra_files {
                    profiles::write_atomic(p, body.as_bytes())?;
                    notes.push(format!("Export written to {}", p.display()));
                }
                let p = path.with_extension(ext);
                profiles::write_atomic(&p, text.as_bytes())?;
                notes.push(format!("Export written to {}", p.display()));
            }
            None => export_inline = Some(text.clone()),
        }
    }
    // Gantt of the chosen plan's first step (replica 0).
    // The chosen plan's run as its plan file describes it (memory limit and forward-only work
    // included).
    let chosen = plan.run_config()?;
    let first = montecarlo::run(&per_gpu, &workload, seed, size, 1, &[chosen], &|| {})?;
    if let Some((s, simulation)) = &first.first[0]
        && let Some(gantt) = &chart
    {
        let title = format!(
            "chosen plan: {} dp={} (step 0, replica 0)",
            gantt_title(&best.schedule_name(), s, best.vpp, &simulation.metrics),
            best.dp
        );
        sim::io::gantt::write_gantt(gantt, &title, &simulation.timeline)?;
        notes.push(format!(
            "Gantt chart of the chosen plan: {}",
            gantt.display()
        ));
    }
    let header = format!(
        "{} on {} x {} ({} profile), workload {} seed {seed}, {} sampled steps, memory limit {:.1} GiB per rank: {} candidates evaluated, {} pruned by their lower bound or screen, {} rejected{}{}",
        profile.model,
        a.ranks,
        profile.hardware.name,
        format!("{:?}", profile.provenance.source).to_lowercase(),
        workload.name,
        a.steps,
        gib(limit),
        result.evaluated,
        result.pruned,
        result.rejected.len(),
        match (result.zb_auto_not_finalist, result.zb_auto_over_limit) {
            (0, 0) => String::new(),
            (n, 0) =>
                format!(", zb-auto built for the finalists' layouts only ({n} others not built)"),
            (n, t) => format!(
                ", zb-auto built for the finalists' layouts only ({n} others not built, {t} finalists past the limit of {} builds)",
                planner::search::ZB_AUTO_MAX_FINALISTS
            ),
        },
        match result.chunked_not_finalist {
            0 => String::new(),
            n => format!(
                ", chunked long sequences tried for the finalists' layouts only ({n} others not tried)"
            ),
        }
    );
    match a.format {
        Format::Json => {
            let doc = serde_json::json!({
                "plans": rows,
                "chosen": plan,
                "fsdp_baseline": baseline.json,
                "rejected": result.rejected.iter().map(|(w, r)| serde_json::json!({"candidate": w, "reason": r})).collect::<Vec<_>>(),
                "export": export_inline,
            });
            outln!("{}", serde_json::to_string_pretty(&doc)?);
            eprintln!("{header}");
            for n in &notes {
                eprintln!("{n}");
            }
        }
        Format::Table => {
            // An export without -o is printed alone on stdout (`plan --export pytorch-csv >
            // schedule.csv` is a usable file); the table and notes go to stderr then.
            let alone = export_inline.is_some();
            let say = |line: &dyn std::fmt::Display| -> Result<()> {
                if alone {
                    eprintln!("{line}");
                } else {
                    outln!("{line}");
                }
                Ok(())
            };
            say(&header)?;
            let t = plan_table(&rows, limit);
            say(&t)?;
            say(&format!(
                "chosen: {} (layers per stage {}), predicted mean step {} (p90 {})",
                best.describe(),
                slash_list(best.partition.stages.iter().map(|x| x.len())),
                fmt_s(best.summary.step_time_s.mean),
                fmt_s(best.summary.step_time_s.p90)
            ))?;
            for n in &notes {
                say(n)?;
            }
            if let Some(text) = &export_inline {
                out!("{text}");
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// Of the search's sampled sequences: how many are longer than `budget` tokens, and how many
/// there are.
fn longer_than_budget(
    a: &PlanArgs,
    workload: &Workload,
    seed: u64,
    size: StepSize,
    budget: u64,
) -> (usize, usize) {
    (0..u64::from(a.steps))
        .map(|step| workload.sample_step(seed, step, size))
        .fold((0, 0), |(longer, total), seqs| {
            (
                longer + seqs.iter().filter(|&&x| u64::from(x) > budget).count(),
                total + seqs.len(),
            )
        })
}

/// The no-pipeline FSDP configuration a torchtitan user runs first, against the chosen plan.
struct Baseline {
    /// One line for the notes.
    note: String,
    /// The baseline's candidate (`null` when it does not fit), for `--format json`.
    json: serde_json::Value,
}

/// Searches the no-pipeline FSDP configuration (pp = 1, dp = every rank, torchtitan's default
/// FSDP2: resharded per microbatch without a pipeline) over the same budgets, recomputation and
/// memory limit, and says how much `best` gains or loses against it. Already the chosen plan,
/// it says how the best pipelined plan (among `ranked`, else searched) compares; impossible, it
/// says why.
fn fsdp_baseline(
    profile: &Profile,
    workload: &Workload,
    space: &planner::search::SearchSpace,
    config: &planner::search::SearchConfig,
    best: &planner::search::Candidate,
    ranked: &[planner::search::Candidate],
) -> Baseline {
    use sim::costs::sharding::Sharding;
    let what = format!("no pipeline, FSDP over dp={}", space.ranks);
    if best.pp == 1 && best.tp == 1 && best.sharding == Sharding::Fsdp {
        // The best pipelined plan, against it: among the runners-up, else searched.
        let piped = ranked.iter().find(|c| c.pp > 1).cloned().or_else(|| {
            let mut s = space.clone();
            s.pp.retain(|p| *p > 1);
            let mut c = config.clone();
            c.keep = 1;
            planner::search::search(profile, workload, &s, &c, &|_, _| {})
                .ok()
                .and_then(|r| r.ranked.into_iter().next())
        });
        let t = best.summary.step_time_s.mean;
        let versus = match &piped {
            Some(p) => {
                let tp = p.summary.step_time_s.mean;
                format!(
                    "; the best pipelined plan ({}: mean step {}) is {:.1}% {}",
                    p.describe(),
                    fmt_s(tp),
                    100.0 * (tp / t - 1.0).abs(),
                    if tp >= t { "slower" } else { "faster" }
                )
            }
            None => "; no pipelined plan fits".into(),
        };
        return Baseline {
            note: format!(
                "The chosen plan is the no-pipeline FSDP configuration a torchtitan user runs first ({what}){versus}."
            ),
            json: serde_json::json!({"candidate": best.describe(), "mean_s": t, "chosen_vs_baseline": 0.0,
                "best_pipelined": piped.as_ref().map(|p| serde_json::json!({"candidate": p.describe(), "mean_s": p.summary.step_time_s.mean}))}),
        };
    }
    let mut s = space.clone();
    s.pp = vec![1];
    s.tp = vec![1];
    s.sharding = vec![Sharding::Fsdp];
    let mut c = config.clone();
    c.keep = 1;
    match planner::search::search(profile, workload, &s, &c, &|_, _| {}) {
        Ok(r) if !r.ranked.is_empty() => {
            let b = &r.ranked[0];
            let (t_best, t_base) = (best.summary.step_time_s.mean, b.summary.step_time_s.mean);
            let change = t_best / t_base - 1.0;
            Baseline {
                note: format!(
                    "Against the no-pipeline FSDP configuration a torchtitan user runs first ({}: mean step {}): the chosen plan is {:.1}% {} ({}).",
                    b.describe(),
                    fmt_s(t_base),
                    100.0 * change.abs(),
                    if change <= 0.0 { "faster" } else { "slower" },
                    fmt_s(t_best)
                ),
                json: serde_json::json!({
                    "fits": true,
                    "candidate": b.describe(),
                    "mean_s": t_base,
                    "p90_s": b.summary.step_time_s.p90,
                    "peak_memory_bytes": b.peak_memory_bytes.iter().copied().fold(0.0, f64::max),
                    "recompute": b.partition.recompute,
                    "chosen_vs_baseline": change,
                }),
            }
        }
        Ok(_) => Baseline {
            note: format!("The no-pipeline FSDP configuration ({what}) has no feasible plan."),
            json: serde_json::json!({"fits": false, "reason": "no feasible plan"}),
        },
        Err(e) => Baseline {
            note: format!("The no-pipeline FSDP configuration ({what}) does not fit: {e}"),
            json: serde_json::json!({"fits": false, "reason": e.to_string()}),
        },
    }
}

/// Runs the plan search with a progress bar once it takes over a second, logging what is
/// searched and how long it took.
fn search_with_progress(
    profile: &Profile,
    workload: &Workload,
    space: &planner::search::SearchSpace,
    config: &planner::search::SearchConfig,
) -> Result<planner::search::SearchResult> {
    let bar = std::sync::Mutex::new(None::<indicatif::ProgressBar>);
    let start = std::time::Instant::now();
    let progress = |done: usize, total: usize| {
        let mut b = bar.lock().expect("progress lock");
        if b.is_none() && start.elapsed() > std::time::Duration::from_secs(1) {
            let pb = indicatif::ProgressBar::new(total as u64);
            if let Ok(style) = indicatif::ProgressStyle::with_template(
                "{bar:40} {pos}/{len} candidates  {elapsed}",
            ) {
                pb.set_style(style);
            }
            *b = Some(pb);
        }
        if let Some(pb) = b.as_ref() {
            pb.set_position(done as u64);
        }
    };
    tracing::info!(
        "plan: searching pp {:?}, token budgets {:?}, {} schedule(s) on {} ranks over {} sampled steps",
        space.pp,
        space.token_budgets,
        space.kinds.len(),
        space.ranks,
        config.steps
    );
    let search_start = std::time::Instant::now();
    let result = planner::search::search(profile, workload, space, config, &progress)?;
    tracing::info!(
        "plan: {} candidate(s) ranked, {} rejected, in {:.2} s",
        result.ranked.len(),
        result.rejected.len(),
        search_start.elapsed().as_secs_f64()
    );
    if let Some(pb) = bar.lock().expect("progress lock").take() {
        pb.finish_and_clear();
    }
    Ok(result)
}

/// The notes on the chosen plan's sizing: sequences longer than its token budget (each a
/// microbatch of its own) over `a.steps` sampled steps, and a busiest rank within
/// [`MARGIN_NOTE_FRACTION`] of the memory `limit` (bytes).
fn sizing_notes(
    a: &PlanArgs,
    workload: &Workload,
    seed: u64,
    size: StepSize,
    best: &planner::search::Candidate,
    limit: f64,
) -> Vec<String> {
    let mut notes = Vec::new();
    // Sequences longer than the chosen token budget get a microbatch of their own.
    let (longer, total) = longer_than_budget(a, workload, seed, size, best.token_budget);
    if longer > 0 {
        notes.push(format!(
            "{longer} of the {total} sampled sequences are longer than the chosen token budget of {} tokens: {}",
            best.token_budget,
            match best.chunk_tokens {
                Some(c) => format!("each is cut into chunks of at most {c} tokens"),
                None => "each gets a microbatch of its own".into(),
            }
        ));
    }
    // The sampled steps' peak is not every step's: say when the chosen plan leaves little room.
    let peak = best.peak_memory_bytes.iter().copied().fold(0.0, f64::max);
    if peak > MARGIN_NOTE_FRACTION * limit {
        notes.push(format!(
            "the chosen plan's busiest rank needs {} of the {} limit ({:.1}%) on the {} sampled steps; a rarer, longer step may need more: a lower --memory-limit keeps a margin",
            fmt_bytes(peak),
            fmt_bytes(limit),
            100.0 * peak / limit,
            a.steps
        ));
    }
    notes
}

/// A file `--export` writes: its extension beside the plan, and its text.
type ExportText = (&'static str, String);

/// Files an export references, each with its path and text.
type ExtraFiles = Vec<(PathBuf, String)>;

/// The `--export` of the chosen `plan` (on `profile`) and the files it references (a
/// torchtitan schedule CSV), each with its path. The schedule exported is the one the plan's
/// prediction ran on its median sampled step (`planner::export::exported_step`, on the per-GPU
/// profile `per_gpu`), so a zb-auto plan exports the order its prediction searched; what the
/// target runs instead of the plan (chunks, forward-only work, a per-step microbatch count) is
/// said on stderr (CSV, torchtitan) and in `# warning:` lines (Megatron).
///
/// # Errors
/// A torchtitan export of a schedule without a torchtitan name and no `-o` (the CSV needs a
/// place); the exporters'.
fn export(
    a: &PlanArgs,
    plan: &Plan,
    profile: &Profile,
    step: &planner::export::ExportedStep,
) -> Result<(Option<ExportText>, ExtraFiles)> {
    let mut extra_files: ExtraFiles = Vec::new();
    let Some(format) = a.export else {
        return Ok((None, extra_files));
    };
    let warn_stderr = || {
        for w in &step.warnings {
            eprintln!("warning: --export {}: {w}", format.name());
        }
    };
    let export_text = match format {
        ExportFormat::Torchtitan => {
            warn_stderr();
            // A schedule without a torchtitan name runs from a CSV written next to the TOML.
            let csv = if planner::export::torchtitan_needs_csv(plan) {
                let Some(path) = &a.output else {
                    bail!(
                        "--export torchtitan: {} has no torchtitan name, so the configuration references a schedule CSV; give -o PLAN.yaml to write plan.torchtitan.toml and plan.torchtitan.csv next to it",
                        plan.schedule
                    );
                };
                let csv_path = path.with_extension("torchtitan.csv");
                extra_files.push((
                    csv_path.clone(),
                    sim::ir::pytorch_csv::write_pytorch_csv(&step.schedule, false)?,
                ));
                Some(
                    csv_path
                        .file_name()
                        .map(|n| n.to_string_lossy().into_owned())
                        .unwrap_or_default(),
                )
            } else {
                None
            };
            (
                "torchtitan.toml",
                planner::export::torchtitan(plan, profile, step.microbatches, csv.as_deref())?,
            )
        }
        ExportFormat::Megatron => {
            let mut text = planner::export::megatron(plan, profile)?;
            let at = text.find('\n').map_or(0, |i| i + 1);
            let warnings: String = step
                .warnings
                .iter()
                .map(|w| format!("# warning: {w}\n"))
                .collect();
            text.insert_str(at, &warnings);
            ("megatron.txt", text)
        }
        ExportFormat::PytorchCsv => {
            warn_stderr();
            (
                "pytorch.csv",
                sim::ir::pytorch_csv::write_pytorch_csv(&step.schedule, false)?,
            )
        }
    };
    Ok((Some(export_text), extra_files))
}

/// `plan`'s table: the ranked plans, best first, each with its layout, predicted step time,
/// lower bound and peak memory against the per-rank `limit` (bytes).
fn plan_table(rows: &[PlanRow], limit: f64) -> PlainTable {
    let gib = |b: f64| b / (1u64 << 30) as f64;
    let mut t = new_table(&[
        "#",
        "schedule",
        "tp",
        "dp",
        "pp",
        "v",
        "budget",
        "chunk",
        "sharding",
        "mean",
        "p90",
        "bubble",
        "lower bound",
        "gap",
        "peak mem (max rank)",
        "layers per stage",
        "recompute",
    ]);
    for r in rows {
        let c = &r.candidate;
        let sizes: Vec<String> = c
            .partition
            .stages
            .iter()
            .map(|x| x.len().to_string())
            .collect();
        let rec = recompute_summary(&c.partition.recompute);
        t.add_row([
            r.rank.to_string(),
            c.schedule_name(),
            c.tp.to_string(),
            c.dp.to_string(),
            c.pp.to_string(),
            c.vpp.to_string(),
            c.token_budget.to_string(),
            c.chunk_tokens.map_or("-".into(), |n| n.to_string()),
            c.sharding.to_string(),
            fmt_s(c.summary.step_time_s.mean),
            fmt_s(c.summary.step_time_s.p90),
            pct(c.summary.bubble_ratio_mean),
            fmt_s(c.lower_bound_s),
            format!("{:+.1}%", 100.0 * r.gap_to_lower_bound),
            format!(
                "{:.1} / {:.1} GiB",
                gib(c.peak_memory_bytes.iter().copied().fold(0.0, f64::max)),
                gib(limit)
            ),
            sizes.join("/"),
            rec,
        ]);
    }
    t
}

/// `none x6, full x2` (run-length counts of the per-stage modes, in stage order).
pub(super) fn recompute_summary(modes: &[sim::costs::Recompute]) -> String {
    let mut parts: Vec<(sim::costs::Recompute, usize)> = Vec::new();
    for &m in modes {
        match parts.last_mut() {
            Some((last, n)) if *last == m => *n += 1,
            _ => parts.push((m, 1)),
        }
    }
    parts
        .iter()
        .map(|(m, n)| format!("{} x{n}", format!("{m:?}").to_lowercase()))
        .collect::<Vec<_>>()
        .join(", ")
}
