//! `flatpipe execute`: run a plan (or inline options) for real on the CPU or CUDA backend, record the
//! measured timeline, compare with the single-rank reference (`--verify`) and, given a profile
//! measured on this backend, with the simulator's prediction.

use super::*;
use backend::backend_config;
use executor::{AnyExecutor, BackendConfig};
use flatpipe_executor::runner::{PreparedStep, Reference, Setup};
use flatpipe_executor::steps::{StepDone, WarmUp, run_steps};
use flatpipe_executor::{AdamW, LossReduction};
use profiles::ProfileSource;
use std::sync::Arc;

// --verify's tolerances are the library's (the oracle tests use the same).
use flatpipe_executor::verify::{LOSS_RTOL as VERIFY_LOSS_RTOL, TENSOR_RTOL as VERIFY_RTOL};

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

/// Options of `flatpipe execute`.
#[derive(Debug, Args)]
pub(super) struct ExecuteArgs {
    #[command(flatten)]
    inputs: Inputs,
    /// Run this plan file (sets model, workload, dp, pp, vpp, schedule, stages, microbatching).
    #[arg(long, conflicts_with_all = ["schedule", "pp", "vpp", "dp", "microbatches", "token_budget"])]
    plan: Option<PathBuf>,
    /// Schedule (inline; default 1f1b): gpipe, 1f1b, interleaved-1f1b, looped-bfs, zb-h1, zb-h2,
    /// zb-v, dualpipev, zb-auto (for unit costs under 1F1B memory).
    #[arg(long)]
    schedule: Option<String>,
    /// Run a schedule from PyTorch's pipeline-order CSV instead (its rows set pp, its microbatch
    /// count m: every step is cut into exactly m microbatches).
    #[arg(long, conflicts_with_all = ["plan", "schedule", "pp", "vpp", "microbatches", "token_budget"])]
    schedule_csv: Option<PathBuf>,
    /// Pipeline-parallel degree (inline; default 2). Keep pp x dp <= the machine's cores.
    #[arg(long)]
    pp: Option<u32>,
    /// Stages per rank (inline; default: the schedule's).
    #[arg(long)]
    vpp: Option<u32>,
    /// Data-parallel replicas (inline; default 1).
    #[arg(long)]
    dp: Option<u32>,
    /// Exactly this many microbatches per replica and step (inline; default pp x vpp, one per stage,
    /// unless --token-budget is given).
    #[arg(long, conflicts_with = "token_budget")]
    microbatches: Option<u32>,
    /// The fewest microbatches of at most this many tokens (inline).
    #[arg(long)]
    token_budget: Option<u64>,
    /// Cut a sequence longer than the token budget into chunks of at most this many tokens
    /// (inline; needs --token-budget; the CPU backend, no recomputation): chunk k attends to the
    /// keys and values of chunks < k, its backward hands back their gradients.
    #[arg(long, requires = "token_budget")]
    chunk_tokens: Option<u64>,
    /// Sequences per step (default: the workload's).
    #[arg(long, conflicts_with = "tokens_per_step")]
    seqs_per_step: Option<u32>,
    /// Tokens per step.
    #[arg(long)]
    tokens_per_step: Option<u64>,
    /// Training steps to run. Default 3.
    #[arg(long, default_value_t = 3)]
    steps: u32,
    /// Untimed training steps before them (first-touch memory, a GPU's library warm-up), run
    /// and verified like the others but not reported. Default 0.
    #[arg(long, default_value_t = 0)]
    warmup_steps: u32,
    /// Seed of the step sampler and the token ids (default: the plan's or workload's).
    #[arg(long)]
    seed: Option<u64>,
    /// Seed of the initial weights.
    #[arg(long, default_value_t = 0)]
    init_seed: u64,
    /// Backend.
    #[arg(long, value_enum, default_value_t = Backend::Cpu)]
    backend: Backend,
    /// GEMM arithmetic on --backend cuda.
    #[arg(long, value_enum, default_value_t = GemmPrecision::Fp32)]
    precision: GemmPrecision,
    /// On --backend cuda, draw the weights on the GPU (uniform, the same standard deviations)
    /// instead of uploading the CPU backend's: seconds instead of minutes for billions of
    /// parameters, but not the CPU reference's weights, so --verify refuses it.
    #[arg(long, conflicts_with = "verify")]
    init_on_device: bool,
    /// On --backend cuda, spread the ranks over this many GPUs (rank g on GPU g mod N; one per
    /// rank: every transfer a peer copy). Default 1: every rank a stream of GPU 0.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    gpus: u32,
    /// Loss reduction: per-token (Σ token losses / step tokens) or per-sequence.
    #[arg(long, value_enum, default_value_t = LossReductionArg::PerToken)]
    loss_reduction: LossReductionArg,
    /// AdamW learning rate.
    #[arg(long, default_value_t = 1e-3)]
    lr: f32,
    /// Clip the global gradient norm to this value (0: no clipping).
    #[arg(long, default_value_t = 1.0)]
    max_grad_norm: f64,
    #[command(flatten)]
    fo: FoArgs,
    /// Also run the single-rank reference on the same steps; print the largest differences of
    /// loss, gradients and parameters, and exit 1 when they exceed the tolerance (loss 1e-5
    /// relative, tensors 1e-4 normwise relative). The parameters are checked against the
    /// reference's AdamW on the pipelined run's gradients (AdamW turns rounding-level gradient
    /// differences near zero into `2 lr` moves).
    #[arg(long)]
    verify: bool,
    /// Write the Gantt chart of the last step's measured timeline here (.svg or .png; `none`, as
    /// without the option: no chart).
    #[arg(long)]
    gantt: Option<PathBuf>,
    /// Write a Chrome trace (Perfetto) of the last step's measured timeline here.
    #[arg(long)]
    trace: Option<PathBuf>,
    /// Output format.
    #[arg(long, value_enum, default_value_t = Format::Table)]
    format: Format,
}

/// One step's row of `execute`'s output.
#[derive(Debug, Serialize)]
struct StepRow {
    step: u64,
    microbatches: Vec<usize>,
    tokens: u64,
    loss: f64,
    grad_norm: f64,
    measured_makespan_s: f64,
    tokens_per_s: f64,
    bubble_ratio: f64,
    /// Forward-only microbatches of the step (all replicas).
    fo_microbatches: usize,
    /// Time the ranks spent on forward-only actions, summed over ranks, seconds.
    fo_busy_s: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    predicted_makespan_s: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    rel_error: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    verify: Option<VerifyRow>,
}

/// Differences against the single-rank reference on one step.
#[derive(Debug, Serialize, Clone)]
struct VerifyRow {
    reference_loss: f64,
    loss_rel_diff: f64,
    grad_max_abs_diff: f64,
    grad_max_rel_diff: f64,
    grad_worst: String,
    param_max_abs_diff: f64,
    param_max_rel_diff: f64,
    grad_norm_rel_diff: f64,
    fo_loss_rel_diff: f64,
    within_tolerance: bool,
}

#[derive(Debug, Serialize)]
struct ExecuteReport {
    model: String,
    workload: String,
    schedule: String,
    dp: u32,
    pp: u32,
    vpp: u32,
    backend: String,
    steps: Vec<StepRow>,
    #[serde(skip_serializing_if = "Option::is_none")]
    median_abs_rel_error: Option<f64>,
    prediction: String,
    /// Why the profile may not predict this run ([`executor::backend::condition_warnings`]).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    profile_warnings: Vec<String>,
}

/// One `--verify` row from the library's comparison.
fn verify_row(v: flatpipe_executor::verify::Verification) -> VerifyRow {
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
fn step_row(
    step: u64,
    prepared: &PreparedStep,
    run: &flatpipe_executor::interpreter::StepRun,
    predicted: Option<f64>,
    verify: Option<VerifyRow>,
) -> StepRow {
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
        fo_microbatches: prepared
            .replicas
            .iter()
            .map(|r| r.fo_microbatches.len())
            .sum(),
        fo_busy_s: fo_s,
        predicted_makespan_s: predicted,
        rel_error: predicted.map(|p| (p - makespan_s) / makespan_s),
        verify,
    }
}

/// `execute`'s table: one row per reported step, with the forward-only, prediction and
/// `--verify` columns when they apply.
fn execute_table(steps: &[StepRow], with_fo: bool, predict: bool, verify: bool) -> PlainTable {
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
    if predict {
        cols.extend(["predicted", "error"]);
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
        if let (Some(p), Some(e)) = (r.predicted_makespan_s, r.rel_error) {
            row.extend([fmt_s(p), format!("{:+.1}%", 100.0 * e)]);
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

/// Refuses, before anything is allocated, a CPU run whose floor
/// ([`flatpipe_executor::cpu::MemoryFloor`]: fp32 weights, gradients and AdamW state, plus one
/// microbatch of `microbatch_tokens` tokens in every layer; twice the state with `--verify`'s
/// single-rank reference) exceeds `available` bytes (the host's available memory; `None`: not
/// known, no check).
fn check_host_memory(
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
struct ResolvedRun {
    /// The profile as the user named it (a file or built-in), when one was given.
    profile_arg: Option<String>,
    profile: Profile,
    model: flatpipe_profiles::ModelSpec,
    workload: Workload,
    /// The Gantt chart's path (`--gantt`, none for `none`).
    gantt: Option<std::path::PathBuf>,
    setup: Setup,
    backend: BackendConfig,
}

/// Resolves `execute`'s flags and plan file into a [`ResolvedRun`], refusing what cannot run
/// before anything is allocated.
fn resolve_run(a: &ExecuteArgs) -> Result<ResolvedRun> {
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
    let profile_arg = plan
        .as_ref()
        .and_then(|p| p.profile.clone())
        .or_else(|| a.inputs.profile.clone());
    let hardware = plan
        .as_ref()
        .and_then(|p| p.hardware.clone())
        .or_else(|| a.inputs.hardware.clone())
        .unwrap_or_else(|| "cpu".into());
    let model_arg = plan
        .as_ref()
        .and_then(|p| p.model.clone())
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
        .or_else(|| plan.as_ref().map(|p| p.workload.clone()))
        .unwrap_or_else(|| "tiny-chat".into());
    let workload = builtins::workload(&workload_name)?;
    let num_layers = model.layers().len();
    if let (Some(p), Some(path)) = (&plan, &a.plan) {
        p.validate(&path.display().to_string(), num_layers)?;
    }
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
    let fo = a.fo.spec()?;
    // No chart unless asked for; `--gantt none` as in the other commands.
    let gantt = a
        .gantt
        .clone()
        .and_then(|p| super::chart_path(&Some(p), ""));
    for p in gantt.iter().chain(&a.trace) {
        profiles::check_writable(p)?;
    }
    if let Some(c) = &gantt {
        sim::io::gantt::check_chart_path(c)?;
    }
    let reduction = LossReduction::from(a.loss_reduction);
    let step_size =
        resolve::step_size(a.seqs_per_step, a.tokens_per_step, plan.as_ref(), &workload)?;
    // A step's data is drawn before anything else: refuse a step too large for this host
    // before sampling it. Its lengths (4 bytes each, sampled and cut), and per token an id, a
    // label and a loss weight (12 bytes), twice with --verify's reference.
    {
        let (seqs, mean, _) = montecarlo::estimated_step(&workload, 0, step_size);
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
    }
    let (source, pp, v, dp, stages, recompute, policy, params) = match &plan {
        Some(pl) => {
            let c = pl.run_config()?;
            (
                c.source,
                c.pp,
                c.v,
                c.dp,
                c.stages,
                c.recompute,
                c.policy,
                c.params,
            )
        }
        None => {
            let (source, pp, v) = match &a.schedule_csv {
                Some(path) => {
                    let s = sim::ir::pytorch_csv::read_pytorch_csv(
                        &profiles::read_to_string(path)?,
                        &path.display().to_string(),
                    )?;
                    let (p, v) = (
                        s.placement.num_ranks,
                        s.num_stages() / s.placement.num_ranks,
                    );
                    (ScheduleSource::Given(s), p, v)
                }
                None => {
                    let kind: ScheduleKind = a.schedule.as_deref().unwrap_or("1f1b").parse()?;
                    let pp = a.pp.unwrap_or(2);
                    if pp == 0 {
                        bail!("--pp = 0 is invalid: >= 1 rank");
                    }
                    let v = kind.stages_per_rank(a.vpp)?;
                    if let Some(asked) = a.vpp
                        && asked != v
                    {
                        bail!(
                            "--vpp = {asked} is invalid for {kind}: it runs {v} stage(s) per rank (interleaved-1f1b and looped-bfs take any --vpp, zb-auto 1 or 2)"
                        );
                    }
                    (ScheduleSource::Kind(kind), pp, v)
                }
            };
            let microbatches = match (&source, a.microbatches, a.token_budget) {
                (ScheduleSource::Given(s), _, _) => Some(s.num_microbatches),
                (_, Some(m), _) => Some(m),
                (_, None, Some(_)) => None,
                (_, None, None) => Some(default_microbatches(pp, v)),
            };
            let stages = even_split(num_layers, (pp * v) as usize)?;
            (
                source,
                pp,
                v,
                a.dp.unwrap_or(1),
                stages,
                Vec::new(),
                Policy::FlatBalanced,
                PolicyParams {
                    token_budget: a
                        .token_budget
                        .unwrap_or(sim::batching::policy::DEFAULT_TOKEN_BUDGET),
                    microbatches,
                    chunk_tokens: a.chunk_tokens,
                    ..PolicyParams::default()
                },
            )
        }
    };
    if dp == 0 {
        bail!("--dp = 0 is invalid: >= 1 replica");
    }
    if let Some(m) = params.microbatches {
        warn_underfilled(&source.name(), m, pp, v);
    }
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
    let balance = flatpipe_simulator::run::config::balance_cost(&profile);
    // zb-auto plans were searched under the plan's memory limit: build their steps under it too.
    let zb_limit = plan
        .as_ref()
        .and_then(|p| p.predicted.as_ref())
        .map(|p| p.memory_limit_bytes);
    let mut config = flatpipe_simulator::run::config::RunConfig::new(
        source.clone(),
        pp,
        v,
        stages.clone(),
        policy,
        Capacity::Dynamic,
    );
    config.dp = dp;
    config.recompute = recompute.clone();
    config.params = params;
    config.sharding = plan.as_ref().map(|p| p.sharding).unwrap_or_default();
    // The options' forward-only work, else the plan's (an explicit 0 drops it).
    config.forward_only = match a.fo.fo_microbatches {
        Some(_) => fo,
        None => plan.as_ref().and_then(|p| p.forward_only),
    };
    config.memory_limit_bytes = zb_limit;
    let setup = Setup {
        model: model.clone(),
        config,
        workload: workload.clone(),
        step_size,
        seed: a
            .seed
            .or(plan.as_ref().map(|p| p.seed))
            .unwrap_or(workload.seed),
        init_seed: a.init_seed,
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
        model,
        workload,
        gantt,
        setup,
        backend,
    })
}

pub(super) fn execute(a: ExecuteArgs) -> Result<ExitCode> {
    let ResolvedRun {
        profile_arg,
        profile,
        model,
        workload,
        gantt,
        setup,
        backend,
    } = resolve_run(&a)?;
    let (pp, v, dp) = (setup.config.pp, setup.config.v, setup.config.dp);
    let (source, stages) = (setup.config.source.clone(), setup.config.stages.clone());
    // The microbatch count the user did not give: say where it came from when a step cannot
    // be cut into it.
    let defaulted_m = a.plan.is_none()
        && a.microbatches.is_none()
        && a.token_budget.is_none()
        && !matches!(source, ScheduleSource::Given(_));
    let with_default = |e: anyhow::Error| {
        // Only the refusal of the microbatch count itself comes from the default.
        let about_m = matches!(
            e.downcast_ref::<flatpipe_executor::Error>(),
            Some(flatpipe_executor::Error::Simulator(sim::Error::InvalidArgument { field, .. }))
                if field == "microbatches"
        );
        if defaulted_m && about_m {
            e.context(format!(
                "the default of pp x vpp = {} microbatches per replica and step does not fit this workload; give --microbatches or --token-budget",
                default_microbatches(pp, v)
            ))
        } else {
            e
        }
    };
    let first = setup.prepare(0).map_err(|e| with_default(e.into()))?;
    // Refuse, before allocating the stages, a run this host cannot hold.
    if backend.backend == executor::Backend::Cpu {
        let largest = first
            .all_microbatches()
            .map(|m| m.tokens() as u64)
            .max()
            .unwrap_or(0);
        check_host_memory(&model, largest, a.verify, available_memory_bytes())?;
    }
    tracing::info!(
        "execute: building {} stage(s) of {} on {} rank(s) ({} backend)",
        stages.len(),
        model.name,
        dp * pp,
        backend.backend.name()
    );
    let mut exec = AnyExecutor::new(&backend, &setup)?;
    let mut reference = if a.verify {
        Some(Reference::new(&setup)?)
    } else {
        None
    };
    let predict = backend.backend.measured(&profile);
    // Said before the steps run, as a user wants to know before trusting a prediction.
    let profile_warnings = if predict {
        let busy = match backend.backend {
            executor::Backend::Cpu => ((dp * pp) as usize).min(cores()),
            executor::Backend::Cuda => ((dp * pp) as usize).div_ceil(backend.gpus),
        };
        executor::backend::condition_warnings(&profile, &backend, busy)
    } else {
        Vec::new()
    };
    for w in &profile_warnings {
        tracing::warn!("{w}");
    }
    // Warm-up steps count on the bar: a long warm-up is work the user waits for.
    let bar = Progress::new(u64::from(a.steps) + u64::from(a.warmup_steps));
    let mut rows = Vec::with_capacity(a.steps as usize);
    let mut last = None;
    let mut failed = false;
    // Sequences longer than the token budget (each gets a microbatch of its own).
    let budget = setup
        .config
        .params
        .microbatches
        .is_none()
        .then_some(setup.config.params.token_budget);
    let (mut over_budget, mut longest) = (0usize, 0u64);
    // Warm-up steps draw their data after the reported ones' (step ids steps.., so the reported
    // steps are the same with or without them).
    let warmup = WarmUp::Following(u64::from(a.warmup_steps));
    run_steps(
        &mut exec,
        &setup,
        reference.as_mut(),
        warmup,
        u64::from(a.steps),
        Some(first),
        &|| bar.inc(),
        |done: StepDone<'_>| -> Result<()> {
            let StepDone {
                step,
                prepared,
                run,
                exec,
                reference,
            } = done;
            if let Some(b) = budget {
                for len in prepared
                    .replicas
                    .iter()
                    .flat_map(|r| &r.lengths)
                    .flat_map(|m| &m.seq_lens)
                    .map(|&l| u64::from(l))
                    .filter(|&l| l > b)
                {
                    over_budget += 1;
                    longest = longest.max(len);
                }
            }
            if !run.loss.is_finite() || !run.grad_norm.is_finite() {
                bail!(
                    "step {step}: the loss ({}) or gradient norm ({}) is not finite: training diverged (--lr {} too large?)",
                    run.loss,
                    run.grad_norm,
                    a.lr
                );
            }
            let predicted = if predict {
                // The setup's profile is this profile (an Arc of it): the step carries its
                // prediction, the replay of the schedules that ran.
                let on = setup.profile.as_deref().unwrap_or(&profile);
                Some(prepared.predict(&setup, on)?.makespan_s)
            } else {
                None
            };
            let verify = match reference {
                Some(re) => {
                    let v = flatpipe_executor::verify::verify_step(
                        &run,
                        &exec.named_grads(),
                        Some(&exec.named_params()),
                        re,
                        &setup,
                        &prepared,
                    )?;
                    failed |= !v.within_tolerance;
                    Some(verify_row(v))
                }
                None => None,
            };
            let row = step_row(step, &prepared, &run, predicted, verify);
            tracing::info!(
                "execute: step {step}: {} tokens, loss {:.4}, measured makespan {:.4} s",
                row.tokens,
                row.loss,
                row.measured_makespan_s
            );
            rows.push(row);
            last = Some((prepared, run));
            Ok(())
        },
    )
    .map_err(with_default)?;
    bar.finish();
    let mut notes = Vec::new();
    if over_budget > 0 {
        notes.push(format!(
            "{over_budget} sequence(s) longer than the token budget of {} tokens (the longest {longest}) ran as microbatches of their own",
            setup.config.params.token_budget
        ));
    }
    if let Some((prepared, run)) = &last {
        let title = format!(
            "{} measured on {}: {} dp={dp} pp={pp} v={v} m={}, step {}",
            model.name,
            backend.backend.name(),
            source.name(),
            slash_list(prepared.replicas.iter().map(|r| r.microbatches.len())),
            prepared.step
        );
        notes.extend(write_step_charts(
            &title,
            &run.timeline,
            gantt.as_deref(),
            a.trace.as_deref(),
        )?);
    }
    let errors: Vec<f64> = rows
        .iter()
        .filter_map(|r| r.rel_error.map(f64::abs))
        .collect();
    let median_abs_rel_error = (!errors.is_empty()).then(|| montecarlo::Quantiles::of(&errors).p50);
    let prediction = prediction_note(predict, profile_arg.as_deref(), &profile, backend.backend);
    notes.push(prediction.clone());
    notes.extend(profile_warnings.iter().map(|w| format!("warning: {w}")));
    let report = ExecuteReport {
        model: model.name.clone(),
        workload: workload.name.clone(),
        schedule: source.name(),
        dp,
        pp,
        vpp: v,
        backend: backend.describe(),
        steps: rows,
        median_abs_rel_error,
        prediction,
        profile_warnings,
    };
    let header = format!(
        "{} on the {} backend: {} dp={dp} pp={pp} v={v}, workload {} ({} step(s); {} stages, layers {})",
        model.name,
        report.backend,
        report.schedule,
        workload.name,
        a.steps,
        stages.len(),
        stages
            .iter()
            .map(|r| format!("{}..{}", r.start, r.end))
            .collect::<Vec<_>>()
            .join(" ")
    );
    let with_fo = setup.config.forward_only.is_some();
    let t = execute_table(&report.steps, with_fo, predict, a.verify);
    if let Some(e) = report.median_abs_rel_error {
        notes.push(format!(
            "median |relative error| of the prediction: {:.1}%",
            100.0 * e
        ));
    }
    if a.verify {
        notes.push(format!(
            "--verify: the single-rank reference ran the same steps; tolerance: loss {VERIFY_LOSS_RTOL:.0e} relative, gradients and parameters {VERIFY_RTOL:.0e} normwise relative (max|a - b| / max|b| per tensor; parameters against the reference's AdamW on the pipelined gradients)"
        ));
    }
    let code = emit(a.format, &report, &header, &t, &notes)?;
    if failed {
        eprintln!(
            "--verify: the pipelined run differs from the single-rank reference beyond the tolerance"
        );
        return Ok(ExitCode::from(1));
    }
    Ok(code)
}

/// Writes the last step's measured timeline as a Gantt chart and a Chrome trace where asked, and
/// says where.
fn write_step_charts(
    title: &str,
    timeline: &sim::Timeline,
    gantt: Option<&Path>,
    trace: Option<&Path>,
) -> Result<Vec<String>> {
    let mut notes = Vec::new();
    if let Some(path) = gantt {
        sim::io::gantt::write_gantt(path, title, timeline)?;
        notes.push(format!("Gantt chart of the last step: {}", path.display()));
    }
    if let Some(path) = trace {
        let doc = sim::io::trace::chrome_trace(timeline);
        profiles::write_atomic(path, serde_json::to_string(&doc)?.as_bytes())?;
        notes.push(format!("Chrome trace of the last step: {}", path.display()));
    }
    Ok(notes)
}

/// What the prediction column stands on: the profile (`profile_arg` as the user named it) and
/// where it was measured when it was measured on `backend` (`predict`), else why there is no
/// prediction and what to give.
fn prediction_note(
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
