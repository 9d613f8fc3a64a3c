//! `flatpipe plan`: search dp x pp, v, schedule, token budget and split; write and export the plan.

mod export;
mod notes;
mod search;
mod table;
use super::*;
#[allow(unused_imports)]
use export::*;
#[allow(unused_imports)]
use notes::*;
#[allow(unused_imports)]
use search::*;
#[allow(unused_imports)]
use table::*;

/// What `plan --export` writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(super) enum ExportFormat {
    Torchtitan,
    Megatron,
    PytorchCsv,
    Verl,
}

impl ExportFormat {
    /// The name `--export` takes.
    fn name(self) -> &'static str {
        match self {
            ExportFormat::Torchtitan => "torchtitan",
            ExportFormat::Megatron => "megatron",
            ExportFormat::PytorchCsv => "pytorch-csv",
            ExportFormat::Verl => "verl",
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
    /// GPUs in all (tp x cp x dp x pp: each pipeline rank is tp x cp GPUs). Default 8 (one
    /// 8-GPU node).
    #[arg(long, default_value_t = 8)]
    ranks: u32,
    /// Memory limit per rank, e.g. 120GiB (default: the hardware's memory minus a reserve for
    /// the CUDA context, communication buffers and fragmentation: 4 GiB, at most 1/8 of it).
    #[arg(long)]
    memory_limit: Option<String>,
    /// Keep this fraction of the memory limit free: the search plans under limit x (1 -
    /// margin), a headroom for steps longer than the sampled ones (e.g. 0.05; default 0).
    #[arg(long, default_value_t = 0.0)]
    memory_margin: f64,
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
    /// Expert-parallel degrees to try on a mixture-of-experts model, each dividing a
    /// candidate's dp (default: 1 and every power of two that divides the routed experts).
    #[arg(long, value_delimiter = ',', value_parser = clap::value_parser!(u32).range(1..))]
    ep: Vec<u32>,
    /// Context-parallel degrees to try: GPUs per rank that split each microbatch's sequences
    /// along their length (default 1; GPUs = tp x cp x dp x pp), beside chunks of long
    /// sequences. With --dynamic-cp each degree above 1 is tried fixed and dynamic.
    #[arg(long, value_delimiter = ',', value_parser = clap::value_parser!(u32).range(1..))]
    cp: Vec<u32>,
    #[command(flatten)]
    cp_opts: super::cp::CpArgs,
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
    /// plan.megatron.txt, plan.pytorch.csv, plan.verl.txt).
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

/// Above this fraction of the memory limit, `plan` notes that the chosen plan has little margin
/// (and its export says so).
const MARGIN_NOTE_FRACTION: f64 = 0.95;

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

/// `flatpipe plan`: resolve the search ([`resolve_search`]), search, write the chosen plan
/// and its exports ([`write_outputs`]), draw its first step ([`draw_chosen`]), then print
/// ([`print_plans`]).
pub(super) fn plan_cmd(a: PlanArgs) -> Result<ExitCode> {
    let r = resolve_search(&a)?;
    let result = search_with_progress(&r.profile, &r.workload, &r.space, &r.config)?;
    let best = &result.ranked[0];
    let baseline = fsdp_baseline(
        &r.profile,
        &r.workload,
        &r.space,
        &r.config,
        best,
        &result.ranked,
    );
    let plan = chosen_plan(&a, &r, best)?;
    let mut notes = sizing_notes(&a, &r.workload, r.seed, r.size, best, r.limit);
    notes.push(baseline.note.clone());
    notes.extend(long_sequence_note(best, &result.strategies));
    let export_inline = write_outputs(&a, &r, best, &plan, &mut notes)?;
    notes.extend(draw_chosen(&r, best, &plan)?);
    print_plans(&a, &r, &result, &plan, &baseline, &notes, export_inline)
}

/// The chosen candidate as a plan file, naming its inputs as the user gave them (the default
/// model and hardware by name when neither a profile nor they were given).
///
/// # Errors
/// As [`planner::plan_file::candidate_plan`].
fn chosen_plan(
    a: &PlanArgs,
    r: &ResolvedSearch,
    best: &planner::search::Candidate,
) -> Result<Plan> {
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
    Ok(planner::plan_file::candidate_plan(
        best,
        &planner::plan_file::PlanInputs {
            model: model_ref,
            hardware: hardware_ref,
            profile: a.inputs.profile.clone(),
            workload: r.workload_name.clone(),
            seqs_per_step: a.seqs_per_step,
            tokens_per_step: a.tokens_per_step,
            seed: r.seed,
        },
        &r.profile,
        &r.workload,
        &r.config,
    )?)
}

/// Writes the plan file (`-o`) and the export (`--export`: next to the plan file, or returned
/// to be printed when there is no `-o`), saying each path in `notes`.
///
/// # Errors
/// A file that cannot be written; an export the target cannot express.
fn write_outputs(
    a: &PlanArgs,
    r: &ResolvedSearch,
    best: &planner::search::Candidate,
    plan: &Plan,
    notes: &mut Vec<String>,
) -> Result<Option<String>> {
    let (workload, seed, size) = (&r.workload, r.seed, r.size);
    if let Some(path) = &a.output {
        profiles::write_atomic(path, plan.to_yaml()?.as_bytes())?;
        notes.push(format!(
            "Plan written to {} (run it: flatpipe simulate --plan {})",
            path.display(),
            path.display()
        ));
    }
    let exported = match a.export {
        Some(_) => Some(planner::export::exported_step(
            plan,
            &best.profile(&r.profile)?,
            workload,
            size,
            r.config.steps,
        )?),
        None => None,
    };
    let (mut export_text, extra_files) = match &exported {
        Some(step) => export(a, plan, &r.profile, step)?,
        None => (None, Vec::new()),
    };
    // Little headroom: said in the export too, with the re-plan that keeps a margin.
    if let (Some(w), Some((ext, text))) = (headroom_warning(best, r.limit), &mut export_text)
        && *ext != "pytorch.csv"
    {
        let at = text.find('\n').map_or(0, |i| i + 1);
        text.insert_str(at, &format!("# warning: {w}\n"));
    }
    // torchtitan trains on rows of seq_len = the token budget: a longer sequence is cut across
    // rows there, where flatpipe predicted it as a microbatch of its own. Said in the file.
    if let (Some(ExportFormat::Torchtitan), Some((_, text))) = (a.export, &mut export_text) {
        let (longer, total) = longer_than_budget(a, workload, seed, size, best.token_budget());
        if longer > 0 {
            let warning = format!(
                "# warning: {longer} of the {total} sampled sequences are longer than seq_len = {}: torchtitan cuts them across rows, where flatpipe's prediction {} (plan with --token-budgets at least the longest and --no-chunk to train what was predicted)\n",
                best.token_budget(),
                if best.chunk_tokens().is_some() {
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
    Ok(export_inline)
}

/// The Gantt chart of the chosen plan's first step (replica 0), simulated from its plan file's
/// run (memory limit and forward-only work included); the note that says where it went.
///
/// # Errors
/// A simulation or chart that fails.
fn draw_chosen(
    r: &ResolvedSearch,
    best: &planner::search::Candidate,
    plan: &Plan,
) -> Result<Option<String>> {
    let Some(gantt) = &r.chart else {
        return Ok(None);
    };
    let per_gpu = best.profile(&r.profile)?;
    let chosen = plan.run_config()?;
    let first = montecarlo::run(&per_gpu, &r.workload, r.seed, r.size, 1, &[chosen], &|| {})?;
    let Some((s, simulation)) = &first.first[0] else {
        return Ok(None);
    };
    let title = format!(
        "chosen plan: {} dp={} (step 0, replica 0)",
        gantt_title(&best.schedule_name(), s, best.run.v, &simulation.metrics),
        best.run.dp
    );
    sim::io::gantt::write_gantt(gantt, &title, &simulation.timeline)?;
    Ok(Some(format!(
        "Gantt chart of the chosen plan: {}",
        gantt.display()
    )))
}

/// Prints the ranked plans: JSON (plans, the chosen plan, the FSDP baseline, the rejected
/// candidates, the export) with the header and notes on stderr, or the table with the chosen
/// plan and the notes (on stderr when an export without `-o` takes stdout).
///
/// # Errors
/// Stdout closed.
fn print_plans(
    a: &PlanArgs,
    r: &ResolvedSearch,
    result: &planner::search::SearchResult,
    plan: &Plan,
    baseline: &Baseline,
    notes: &[String],
    export_inline: Option<String>,
) -> Result<ExitCode> {
    let (profile, workload, limit, seed) = (&r.profile, &r.workload, r.limit, r.seed);
    let best = &result.ranked[0];
    let gib = |b: f64| b / (1u64 << 30) as f64;
    let rows: Vec<PlanRow> = result
        .ranked
        .iter()
        .enumerate()
        .map(|(i, c)| PlanRow {
            rank: i + 1,
            candidate: c.clone(),
            stages: c.run.stages.iter().map(|r| [r.start, r.end]).collect(),
            recompute: c.run.recompute.clone(),
            gap_to_lower_bound: c.summary.step_time_s.mean / c.lower_bound_s - 1.0,
        })
        .collect();
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
            for n in notes {
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
                slash_list(best.run.stages.iter().map(|x| x.len())),
                fmt_s(best.summary.step_time_s.mean),
                fmt_s(best.summary.step_time_s.p90)
            ))?;
            for n in notes {
                say(n)?;
            }
            if let Some(text) = &export_inline {
                out!("{text}");
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}
