//! `execute`'s inputs resolved: the run (flags or a plan file), the model, the data, and the host-
//! memory check before anything is allocated.

use super::*;

/// `--loss-reduction`: the command line's names of [`LossReduction`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(super) enum LossReductionArg {
    /// Σ token losses / the step's true tokens.
    PerToken,
    /// Mean over sequences of each sequence's mean token loss.
    PerSequence,
}

impl From<LossReductionArg> for LossReduction {
    fn from(a: LossReductionArg) -> Self {
        match a {
            LossReductionArg::PerToken => LossReduction::PerToken,
            LossReductionArg::PerSequence => LossReduction::PerSequence,
        }
    }
}

/// Refuses, before anything is allocated, a CPU run whose floor
/// ([`flatpipe_executor::cpu::MemoryFloor`]: fp32 weights, gradients and AdamW state, plus one
/// microbatch of `microbatch_tokens` tokens in every layer; twice the state with `--verify`'s
/// single-rank reference) exceeds `available` bytes (the host's available memory; `None`: not
/// known, no check).
pub(super) fn check_host_memory(
    model: &flatpipe_profiles::ModelSpec,
    microbatch_tokens: u64,
    verify: bool,
    available: Option<f64>,
) -> Result<()> {
    let floor = flatpipe_executor::cpu::MemoryFloor::of(model, microbatch_tokens);
    let copies = if verify { 2.0 } else { 1.0 };
    let need = floor.state * copies + floor.activations;
    if let Some(have) = available
        && need > have
    {
        bail!(
            "{} on the CPU backend needs at least {}: {} of fp32 weights, gradients and AdamW state ({} parameters x 16 bytes{}) and {} of activations (one microbatch of {microbatch_tokens} tokens in every layer); this machine has {} available. {}",
            model.name,
            fmt_bytes(need),
            fmt_bytes(floor.state * copies),
            model.param_count(),
            if verify {
                ", twice: --verify's single-rank reference holds its own copy"
            } else {
                ""
            },
            fmt_bytes(floor.activations),
            fmt_bytes(have),
            if floor.state * copies > have {
                "Execute a smaller model (--model tiny), or simulate this one"
            } else {
                "Use fewer tokens per microbatch (--token-budget or more --microbatches) or fewer sequences per step"
            }
        );
    }
    Ok(())
}

/// A run resolved from `execute`'s flags and an optional plan file: every default decided
/// here, once.
pub(super) struct ResolvedRun {
    /// The profile as the user named it (a file or built-in), when one was given.
    pub(super) profile_arg: Option<String>,
    /// The profile the steps are planned and predicted on (an expert-parallel rank's with ep > 1).
    pub(super) profile: Profile,
    /// The profile as loaded, before expert parallelism split it (what `--fit-profile` rescales).
    pub(super) loaded_profile: Profile,
    pub(super) model: flatpipe_profiles::ModelSpec,
    pub(super) workload: Workload,
    /// The Gantt chart's path (`--gantt`, none for `none`).
    pub(super) gantt: Option<std::path::PathBuf>,
    pub(super) setup: Setup,
    pub(super) backend: BackendConfig,
}

/// The profile (as the user named it, and loaded), the model's architecture and the workload of
/// `execute`: the plan's, else the flags', else `tiny` on `cpu` with `tiny-chat` (the model
/// the CPU executor runs in seconds).
///
/// # Errors
/// A profile, model or workload that does not load; a profile of another model.
fn resolve_model(
    a: &ExecuteArgs,
    plan: Option<&Plan>,
) -> Result<(
    Option<String>,
    Profile,
    flatpipe_profiles::ModelSpec,
    Workload,
)> {
    let profile_arg = plan
        .and_then(|p| p.inputs.profile.clone())
        .or_else(|| a.inputs.profile.clone());
    let hardware = plan
        .and_then(|p| p.inputs.hardware.clone())
        .or_else(|| a.inputs.hardware.clone())
        .unwrap_or_else(|| "cpu".into());
    let model_arg = plan
        .and_then(|p| p.inputs.model.clone())
        .or_else(|| a.inputs.model.clone());
    // With a profile, --model (if any) must be its model; without, the default is tiny.
    let profile = resolve_profile(
        profile_arg.as_deref(),
        match profile_arg {
            Some(_) => model_arg.as_deref(),
            None => Some(model_arg.as_deref().unwrap_or("tiny")),
        },
        Some(&hardware),
    )?;
    // The architecture: the plan's or --model, else the profile's model (a built-in name).
    let model_name = match (&model_arg, &profile_arg) {
        (Some(m), _) => m.clone(),
        (None, Some(_)) => profile.model.clone(),
        (None, None) => "tiny".into(),
    };
    let model = builtins::model(&model_name).map_err(|e| {
        anyhow::anyhow!(
            "execute needs the model's architecture: {e} (the profile is of model `{}`; give `model:` in the plan, or --model without --profile)",
            profile.model
        )
    })?;
    if profile.layers.len() != model.layers().len() {
        bail!(
            "the profile of {} has {} layers, the model {} has {}: they must describe the same model",
            profile.model,
            profile.layers.len(),
            model.name,
            model.layers().len()
        );
    }
    let workload_name = a
        .inputs
        .workload
        .clone()
        .or_else(|| plan.map(|p| p.inputs.workload.clone()))
        .unwrap_or_else(|| "tiny-chat".into());
    let workload = builtins::workload(&workload_name)?;
    Ok((profile_arg, profile, model, workload))
}

/// `--steps`, `--lr` and `--max-grad-norm` in their ranges.
///
/// # Errors
/// The flag, its value and the allowed range.
fn check_training_options(a: &ExecuteArgs) -> Result<()> {
    if a.steps == 0 {
        bail!("--steps = 0 is invalid: >= 1 step");
    }
    if !(a.lr.is_finite() && a.lr > 0.0) {
        bail!("--lr = {} is invalid: a finite learning rate > 0", a.lr);
    }
    if !(a.max_grad_norm.is_finite() && a.max_grad_norm >= 0.0) {
        bail!(
            "--max-grad-norm = {} is invalid: >= 0 (0: no clipping)",
            a.max_grad_norm
        );
    }
    Ok(())
}

/// Resolves `execute`'s flags and plan file into a [`ResolvedRun`], refusing what cannot run
/// before anything is allocated.
pub(super) fn resolve_run(a: &ExecuteArgs) -> Result<ResolvedRun> {
    let plan = read_plan(a.plan.as_deref())?;
    if let Some(p) = &plan
        && p.tensor_parallel().0 > 1
    {
        bail!(
            "{}: tp = {}: the executor runs every rank on one device (no tensor parallelism); tensor parallelism is priced by the simulator and the planner, not executed (plan with --tp 1 to run it)",
            a.plan
                .as_deref()
                .map(|p| p.display().to_string())
                .unwrap_or_default(),
            p.tensor_parallel().0
        );
    }
    let (profile_arg, profile, model, workload) = resolve_model(a, plan.as_ref())?;
    let num_layers = model.layers().len();
    if let (Some(p), Some(path)) = (&plan, &a.plan) {
        p.validate(&path.display().to_string(), num_layers)?;
    }
    check_training_options(a)?;
    let fo = a.fo.spec()?;
    // No chart unless asked for; `--gantt none` as in the other commands.
    let gantt = a
        .gantt
        .clone()
        .and_then(|p| super::chart_path(&Some(p), ""));
    for p in gantt
        .iter()
        .chain(&a.trace)
        .chain(&a.est.fit_profile)
        .chain(&a.est.estimate_log)
    {
        profiles::check_writable(p)?;
    }
    if let Some(c) = &gantt {
        sim::io::gantt::check_chart_path(c)?;
    }
    let reduction = LossReduction::from(a.loss_reduction);
    let step_size =
        resolve::step_size(a.seqs_per_step, a.tokens_per_step, plan.as_ref(), &workload)?;
    check_step_memory(a, &workload, step_size)?;
    let source = schedule_source(a, plan.as_ref())?;
    let flags = resolve::RunFlags {
        pp: a.pp,
        vpp: a.vpp,
        dp: a.dp,
        microbatches: a.microbatches,
        token_budget: a.token_budget,
        chunk_tokens: a.chunk_tokens,
        forward_only: a.fo.fo_microbatches.map(|_| fo),
        context_parallel: a.cp.map(|cp| a.cp_opts.group(cp, true)).transpose()?,
        ..Default::default()
    };
    let config = resolve::run_config(
        &flags,
        plan.as_ref(),
        source,
        None,
        Capacity::Dynamic,
        num_layers,
    )?;
    if let Some(m) = config.params.microbatches {
        warn_underfilled(&config.source.name(), m, config.pp, config.v);
    }
    let (pp, dp) = (config.pp, config.dp);
    let backend = backend_config(
        a.backend.resolve_for_stages()?,
        a.precision,
        a.gpus,
        a.init_on_device,
    )?;
    if a.verify && a.precision == GemmPrecision::Bf16 {
        bail!(
            "--verify checks against the fp32 CPU reference at fp32 tolerances (loss 1e-5, tensors 1e-4), which bf16 GEMM math does not meet: verify with --precision fp32"
        );
    }
    let cores = cores();
    if backend.backend == executor::Backend::Cpu && (dp * pp) as usize > cores {
        tracing::warn!(
            "{} ranks on {cores} cores: ranks will share cores, so measured times include the OS scheduler's time slicing",
            dp * pp
        );
    }
    let loaded_profile = profile.clone();
    let (ep, profile) = expert_parallel(a, plan.as_ref(), &config, profile)?;
    let balance = flatpipe_simulator::run::config::balance_cost(&profile);
    let setup = Setup {
        model: model.clone(),
        config,
        workload: workload.clone(),
        step_size,
        seed: a
            .seed
            .or(plan.as_ref().map(|p| p.inputs.seed))
            .unwrap_or(workload.seed),
        init_seed: a.init_seed,
        ep,
        reduction,
        adamw: AdamW {
            lr: a.lr,
            ..AdamW::default()
        },
        max_grad_norm: (a.max_grad_norm > 0.0).then_some(a.max_grad_norm),
        balance: Arc::new(balance),
        profile: Some(Arc::new(profile.clone())),
    };
    Ok(ResolvedRun {
        profile_arg,
        profile,
        loaded_profile,
        model,
        workload,
        gantt,
        setup,
        backend,
    })
}

/// The expert-parallel degree (--ep, else the plan's, else 1) and the profile the steps are
/// planned and predicted on: an expert-parallel rank's (`E / ep` experts, the all-to-alls).
/// Warns when the step's microbatch count is left to the token budget (an expert-parallel
/// group's replicas need the same count).
///
/// # Errors
/// The profile's refusal of `ep` (no mixture-of-experts layer, experts it does not divide).
fn expert_parallel(
    a: &ExecuteArgs,
    plan: Option<&Plan>,
    config: &flatpipe_simulator::run::config::RunConfig,
    profile: Profile,
) -> Result<(u32, Profile)> {
    let ep = a.ep.or(plan.map(|p| p.ep)).unwrap_or(1);
    if ep <= 1 {
        return Ok((1, profile));
    }
    if config.params.microbatches.is_none() {
        tracing::warn!(
            "ep = {ep} without --microbatches: the replicas of an expert-parallel group pair their microbatches one to one, so a step whose token budget cuts them into different counts is refused; give --microbatches to fix the count"
        );
    }
    Ok((ep, profile.expert_parallel(ep, 1, false)?))
}

/// Refuses a step too large for this host before it is sampled (a step's data is drawn before
/// anything else): its lengths (4 bytes each, sampled and cut), and per token an id, a label
/// and a loss weight (12 bytes), twice with --verify's reference.
///
/// # Errors
/// The bytes needed against the memory available.
fn check_step_memory(a: &ExecuteArgs, workload: &Workload, step_size: StepSize) -> Result<()> {
    let (seqs, mean, _) = montecarlo::estimated_step(workload, 0, step_size);
    let need = seqs * 8.0 + seqs * mean * 12.0 * if a.verify { 2.0 } else { 1.0 };
    super::check_memory(
        "the step",
        need,
        &format!(
            "{step_size} of {} (mean {mean:.0} tokens) hold about {} of lengths and token data",
            workload.name,
            fmt_bytes(need)
        ),
        "use fewer sequences or tokens per step",
    )?;
    Ok(())
}

/// The schedule to run: a PyTorch CSV (--schedule-csv), the plan's (`None`), or the named kind
/// (default 1F1B), whose stages per rank --vpp may not change.
///
/// # Errors
/// An unreadable CSV, an unknown schedule, a --vpp the schedule does not run.
fn schedule_source(a: &ExecuteArgs, plan: Option<&Plan>) -> Result<Option<ScheduleSource>> {
    Ok(match (&a.schedule_csv, plan) {
        (Some(path), _) => Some(ScheduleSource::Given(
            sim::ir::pytorch_csv::read_pytorch_csv(
                &profiles::read_to_string(path)?,
                &path.display().to_string(),
            )?,
        )),
        (None, Some(_)) => None,
        (None, None) => {
            let kind: ScheduleKind = match &a.schedule {
                Some(name) => name.parse()?,
                None => resolve::DEFAULT_SCHEDULE,
            };
            // One schedule is named: a vpp it does not run is refused, not replaced.
            let v = kind.stages_per_rank(a.vpp)?;
            if let Some(asked) = a.vpp
                && asked != v
            {
                bail!(
                    "--vpp = {asked} is invalid for {kind}: it runs {v} stage(s) per rank (interleaved-1f1b and looped-bfs take any --vpp, zb-auto 1 or 2)"
                );
            }
            Some(ScheduleSource::Kind(kind))
        }
    })
}
