//! `plan`'s search: the options resolved into a search space and configuration, and the search run
//! with progress.

use super::*;

/// A search resolved from `plan`'s flags: every default decided here, once.
pub(super) struct ResolvedSearch {
    /// The Gantt chart's path (`--gantt`, none for `none`).
    pub(super) chart: Option<std::path::PathBuf>,
    pub(super) profile: Profile,
    pub(super) workload: Workload,
    pub(super) workload_name: String,
    /// Per-rank memory limit, bytes.
    pub(super) limit: f64,
    pub(super) space: planner::search::SearchSpace,
    pub(super) config: planner::search::SearchConfig,
    pub(super) seed: u64,
    pub(super) size: StepSize,
}

/// Resolves `plan`'s flags into a [`ResolvedSearch`], refusing a bad output path or a search
/// too large for memory before it starts.
pub(super) fn resolve_search(a: &PlanArgs) -> Result<ResolvedSearch> {
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
    let (limit, search_limit) = limits(a, &profile)?;
    let space = search_space(a, &profile)?;
    if a.keep == 0 {
        bail!("--keep = 0 is invalid: >= 1 plan");
    }
    let size = resolve::step_size(a.seqs_per_step, a.tokens_per_step, None, &workload)?;
    warn_small_default_step(a, &space, size);
    let seed = a.seed.unwrap_or(workload.seed);
    let config = search_config(a, seed, size, search_limit)?;
    check_search_memory(a, &space, &workload, (seed, size))?;
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

/// The search space of `plan`'s flags: the default for `--ranks`, narrowed by `--pp`, `--vpp`,
/// `--schedule` (and the export's target, [`for_export_target`]), `--token-budgets`,
/// `--recompute`, `--sharding` and `--tp` (checked against `profile`'s tensor-parallel
/// degrees).
///
/// # Errors
/// A value out of range or that does not parse, naming the flag.
fn search_space(a: &PlanArgs, profile: &Profile) -> Result<planner::search::SearchSpace> {
    let mut space = planner::search::SearchSpace::default_for(a.ranks);
    if !a.pp.is_empty() {
        space.pp = dedup(a.pp.clone());
    }
    if !a.vpp.is_empty() {
        space.vpp = dedup(a.vpp.clone());
    }
    if !a.schedule.is_empty() {
        // The search keeps combined 1F1B to its expert-parallel candidates itself.
        space.kinds = parse_kinds(&a.schedule, true)?;
    }
    for_export_target(a, &mut space)?;
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
        let valid: Vec<u32> = planner::search::tensor_parallel_degrees(profile)
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
    space.ep = dedup(a.ep.clone());
    space.context_parallel = context_parallel_groups(a)?;
    let moe = profile.layers.iter().any(|l| l.shape.experts > 0);
    let ep_one = !space.ep.is_empty() && space.ep.iter().all(|&e| e <= 1);
    if space.kinds.iter().all(|&k| k == ScheduleKind::Combined1F1B) && (!moe || ep_one) {
        tracing::warn!(
            "--schedule combined-1f1b runs only with expert parallelism (ep > 1), and {}: the search has its no-pipeline candidates alone",
            if moe {
                "--ep allows only 1"
            } else {
                "the model has no mixture-of-experts layer"
            }
        );
    }
    Ok(space)
}

/// The search's configuration: sampled steps, seed and step size, the memory limit it plans
/// under (bytes), ranking, kept plans, split solver and forward-only work.
///
/// # Errors
/// `--split-solver highs` in a build without HiGHS; a bad forward-only spec.
fn search_config(
    a: &PlanArgs,
    seed: u64,
    size: StepSize,
    search_limit: f64,
) -> Result<planner::search::SearchConfig> {
    use planner::search::{RankBy, SearchConfig};
    Ok(SearchConfig {
        steps: a.steps,
        seed,
        size,
        memory_limit_bytes: search_limit,
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
    })
}

/// Refuses a search this host cannot hold: it keeps every sampled step and runs one Monte
/// Carlo per candidate, the largest candidate (most ranks per pipeline, most stages per rank,
/// smallest budget) setting the peak.
///
/// # Errors
/// The estimate against the available memory, with the numbers.
fn check_search_memory(
    a: &PlanArgs,
    space: &planner::search::SearchSpace,
    workload: &Workload,
    (seed, size): (u64, StepSize),
) -> Result<()> {
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
        workload,
        seed,
        size,
        a.steps,
        a.steps,
        &[widest],
    )
}

/// Runs the plan search with a progress bar once it takes over a second, logging what is
/// searched and how long it took.
pub(super) fn search_with_progress(
    profile: &Profile,
    workload: &Workload,
    space: &planner::search::SearchSpace,
    config: &planner::search::SearchConfig,
) -> Result<planner::search::SearchResult> {
    let bar = std::sync::Mutex::new(None::<indicatif::ProgressBar>);
    let start = std::time::Instant::now();
    // Without a terminal the bar draws nothing: a line every few seconds instead.
    let lines = crate::cli::render::ProgressLines::new("plan", "candidates");
    let progress = |done: usize, total: usize| {
        lines.report(done as u64, total as u64);
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

/// Warns when the workload's default step (neither `--seqs-per-step` nor `--tokens-per-step`
/// given) holds fewer sequences than the search's most data-parallel replicas, which it then
/// leaves out: the user names the run's global batch.
fn warn_small_default_step(a: &PlanArgs, space: &planner::search::SearchSpace, size: StepSize) {
    if let (None, None, StepSize::Seqs(n)) = (a.seqs_per_step, a.tokens_per_step, size) {
        let min_pp = space.pp.iter().copied().min().unwrap_or(1).max(1);
        let max_dp = space.ranks / min_pp;
        if max_dp > n {
            tracing::warn!(
                "the workload's default step holds {n} sequences, fewer than the up to {max_dp} \
                 data-parallel replicas of {} GPUs: layouts with more than {n} replicas are left \
                 out; give the run's global batch with --seqs-per-step or --tokens-per-step",
                space.ranks
            );
        }
    }
}

/// The memory limit per rank (`--memory-limit`, else the hardware's less a reserve) and the
/// limit the search plans under, less `--memory-margin` of it, bytes.
///
/// # Errors
/// A limit that does not parse; a margin outside [0, 1).
fn limits(a: &PlanArgs, profile: &Profile) -> Result<(f64, f64)> {
    let limit = memory_limit(a.memory_limit.as_deref(), profile)?;
    if !(a.memory_margin.is_finite() && (0.0..1.0).contains(&a.memory_margin)) {
        bail!(
            "--memory-margin {} is invalid: a fraction of the memory limit from 0 to below 1 (e.g. 0.05)",
            a.memory_margin
        );
    }
    Ok((limit, limit * (1.0 - a.memory_margin)))
}

/// The search narrowed to what `--export`'s target runs: Megatron-LM and verl (which runs
/// Megatron's layout) place no V schedule ([`restrict_to_megatron`]); verl cuts each step
/// itself (dynamic batching: Karmarkar-Karp under the token budget), so the search predicts
/// that microbatching (`verl-kk`).
fn for_export_target(a: &PlanArgs, space: &mut planner::search::SearchSpace) -> Result<()> {
    if matches!(
        a.export,
        Some(super::ExportFormat::Megatron | super::ExportFormat::Verl)
    ) {
        restrict_to_megatron(&mut space.kinds, !a.schedule.is_empty())?;
    }
    if a.export == Some(super::ExportFormat::Verl) {
        space.policy = sim::batching::policy::Policy::VerlKk;
    }
    Ok(())
}

/// `--export megatron`: without `--schedule`, the search keeps to the schedules Megatron-LM
/// runs (1F1B, interleaved 1F1B, and combined 1F1B, its `--overlap-moe-expert-parallel-comm`),
/// so that the export runs the plan it predicted. A given `--schedule` is kept, less the
/// schedules of the V placement (rank r holding stages r and 2p-1-r), which Megatron's layout
/// puts stage i on rank i mod pp cannot express; one of V schedules only is refused.
fn restrict_to_megatron(kinds: &mut Vec<ScheduleKind>, given: bool) -> Result<()> {
    if !given {
        let runs = [
            ScheduleKind::OneFOneB,
            ScheduleKind::Interleaved1F1B,
            ScheduleKind::Combined1F1B,
        ];
        let left_out: Vec<String> = kinds
            .iter()
            .filter(|k| !runs.contains(k))
            .map(|k| k.to_string())
            .collect();
        kinds.retain(|k| runs.contains(k));
        if !left_out.is_empty() {
            tracing::warn!(
                "--export megatron: the search keeps to the schedules Megatron-LM runs (1f1b, interleaved-1f1b, combined-1f1b), leaving out {}; give --schedule to plan others (exported with a warning, Megatron running its 1F1B in their place)",
                left_out.join(", ")
            );
        }
        return Ok(());
    }
    let is_v = |k: &ScheduleKind| {
        k.stages_per_rank(None)
            .is_ok_and(|v| k.placement_for(v) == sim::ir::PlacementKind::V)
    };
    let left_out: Vec<String> = kinds
        .iter()
        .filter(|k| is_v(k))
        .map(|k| k.to_string())
        .collect();
    if left_out.is_empty() {
        return Ok(());
    }
    kinds.retain(|k| !is_v(k));
    if kinds.is_empty() {
        bail!(
            "--export megatron: Megatron-LM places stage i on rank i mod pp and cannot run the V placement of {}; give --schedule with a loop-placed schedule (1f1b, interleaved-1f1b, zb-h1, ...) or export another target (--export pytorch-csv)",
            left_out.join(", ")
        );
    }
    if !given {
        tracing::info!(
            "--export megatron: the search leaves out {} (V placement, which Megatron-LM's layout cannot express)",
            left_out.join(", ")
        );
    } else {
        tracing::warn!(
            "--export megatron: {} left out of --schedule (V placement, which Megatron-LM's layout cannot express)",
            left_out.join(", ")
        );
    }
    Ok(())
}

/// The context-parallel groups `--cp` asks for: none for 1, a fixed group for each degree above
/// 1 and, with `--dynamic-cp`, a dynamic one too (empty without `--cp`: one GPU per rank).
///
/// # Errors
/// A `--cp-comm` or `--cp-balance` that is not one.
fn context_parallel_groups(
    a: &PlanArgs,
) -> Result<Vec<Option<profiles::context_parallel::ContextParallel>>> {
    let mut out = Vec::new();
    for cp in dedup(a.cp.clone()) {
        if cp == 1 {
            out.push(None);
            continue;
        }
        out.push(Some(a.cp_opts.group(cp, false)?));
        if a.cp_opts.dynamic() {
            out.push(Some(a.cp_opts.group(cp, true)?));
        }
    }
    Ok(out)
}
