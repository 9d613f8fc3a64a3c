//! `flatpipe execute`: run a plan (or inline options) for real on the CPU or CUDA backend, record
//! the measured timeline, compare with the single-rank reference (`--verify`) and, given a profile
//! measured on this backend, with the simulator's prediction.

mod inputs;
mod replan;
mod report;
use super::*;
use backend::backend_config;
use executor::{AnyExecutor, BackendConfig};
use flatpipe_executor::runner::{PreparedStep, Reference, Setup};
use flatpipe_executor::steps::{StepDone, WarmUp, run_steps};
use flatpipe_executor::{AdamW, LossReduction};
use flatpipe_simulator::run::estimate::SpeedEstimate;
#[allow(unused_imports)]
use inputs::*;
use profiles::ProfileSource;
#[allow(unused_imports)]
use report::*;
use std::sync::Arc;

// --verify's tolerances are the library's (the oracle tests use the same).
use flatpipe_executor::verify::{LOSS_RTOL as VERIFY_LOSS_RTOL, TENSOR_RTOL as VERIFY_RTOL};

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
    /// Pipeline-parallel degree (inline; default 4). Keep pp x dp <= the machine's cores.
    #[arg(long)]
    pp: Option<u32>,
    /// Stages per rank (inline; default: the schedule's).
    #[arg(long)]
    vpp: Option<u32>,
    /// Data-parallel replicas (inline; default 1).
    #[arg(long)]
    dp: Option<u32>,
    /// Expert-parallel degree (inline, or the plan's; default 1): groups of this many
    /// data-parallel replicas split each mixture-of-experts layer's routed experts and exchange
    /// their tokens by all-to-all. Must divide --dp and the experts.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    ep: Option<u32>,
    /// Context-parallel degree (inline, or the plan's; default 1): every rank a group of this
    /// many worker ranks, each holding its zigzag share of every microbatch and gathering the
    /// keys and values of the group (CPU backend; --cp-comm p2p or allgather).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    cp: Option<u32>,
    #[command(flatten)]
    cp_opts: super::cp::CpArgs,
    /// Exactly this many microbatches per replica and step, balanced by predicted cost (inline;
    /// without it, the token budget cuts the step).
    #[arg(long, conflicts_with = "token_budget")]
    microbatches: Option<u32>,
    /// The fewest microbatches of at most this many tokens (inline; first-fit decreasing, as
    /// `simulate`). Default 16384.
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
    #[command(flatten)]
    est: replan::EstimateArgs,
    /// Output format.
    #[arg(long, value_enum, default_value_t = Format::Table)]
    format: Format,
}

/// `flatpipe execute`: resolve the run ([`resolve_run`]), build the executor ([`build`]), run
/// the steps ([`run_reported_steps`]), then render ([`render`]).
pub(super) fn execute(a: ExecuteArgs) -> Result<ExitCode> {
    let run = resolve_run(&a)?;
    let built = build(&a, &run)?;
    let ran = run_reported_steps(&a, &run, built)?;
    let failed = ran.failed;
    let code = render(&a, &run, ran)?;
    if failed {
        eprintln!(
            "--verify: the pipelined run differs from the single-rank reference beyond the tolerance"
        );
        return Ok(ExitCode::from(1));
    }
    Ok(code)
}

/// The executor built for a resolved run, its first step drawn, and what is known before the
/// steps run.
struct Built {
    exec: AnyExecutor,
    reference: Option<Reference>,
    first: PreparedStep,
    /// Whether the profile was measured on this backend (so each step gets a prediction).
    predict: bool,
    /// Conditions under which the profile's figures may not hold, said before the steps run.
    profile_warnings: Vec<String>,
}

/// Draws the first step, refuses a CPU run this host cannot hold before allocating anything,
/// then builds the stages (and `--verify`'s single-rank reference).
///
/// # Errors
/// A step the run cannot be cut into, a host too small, a backend that cannot start.
fn build(a: &ExecuteArgs, r: &ResolvedRun) -> Result<Built> {
    let (setup, backend) = (&r.setup, &r.backend);
    let (pp, dp) = (setup.config.pp, setup.config.dp);
    let predict = backend.backend.measured(&r.profile);
    a.est
        .check(predict, &r.profile.model, backend.backend.name())?;
    let first = setup.prepare(0)?;
    if backend.backend == executor::Backend::Cpu {
        let largest = first
            .all_microbatches()
            .map(|m| m.tokens() as u64)
            .max()
            .unwrap_or(0);
        check_host_memory(&r.model, largest, a.verify, available_memory_bytes())?;
    }
    tracing::info!(
        "execute: building {} stage(s) of {} on {} rank(s) ({} backend)",
        setup.config.stages.len(),
        r.model.name,
        dp * pp,
        backend.backend.name()
    );
    let mut exec = AnyExecutor::new(backend, setup)?;
    if let Some(arg) = &a.est.slow_rank {
        exec.set_slowdown(Some(replan::slowdown(arg, setup.replicas() * pp as usize)?));
    }
    let reference = if a.verify {
        Some(Reference::new(setup)?)
    } else {
        None
    };
    let profile_warnings = if predict {
        let busy = match backend.backend {
            executor::Backend::Cpu => ((dp * pp) as usize).min(cores()),
            executor::Backend::Cuda => ((dp * pp) as usize).div_ceil(backend.gpus),
        };
        executor::backend::condition_warnings(&r.profile, backend, busy)
    } else {
        Vec::new()
    };
    for w in &profile_warnings {
        tracing::warn!("{w}");
    }
    Ok(Built {
        exec,
        reference,
        first,
        predict,
        profile_warnings,
    })
}

/// What the reported steps gave.
struct Ran {
    rows: Vec<StepRow>,
    /// The last step and its run (for the charts).
    last: Option<(PreparedStep, flatpipe_executor::interpreter::StepRun)>,
    /// A step beyond `--verify`'s tolerance.
    failed: bool,
    /// Sequences longer than the token budget, and the longest of them (tokens).
    over_budget: usize,
    longest: u64,
    predict: bool,
    profile_warnings: Vec<String>,
    /// Measured over predicted busy time per phase, over the measured steps (`--fit-profile`).
    estimate: SpeedEstimate,
    /// The links' alpha and beta from the timed transfers (none on the CPU backend's host clock).
    links: sim::run::link_estimate::LinkEstimate,
    /// Per layer kind and phase, measured over predicted time (`--estimate-log`).
    kinds: sim::run::kind_estimate::KindEstimate,
    /// `--estimate-log`'s lines, one per measured step.
    estimate_log: Vec<String>,
    /// `--estimate-chart`'s points, one per measured step.
    estimate_points: Vec<sim::io::estimate_chart::EstimatePoint>,
}

/// Runs `--warmup-steps` then `--steps` steps ([`run_steps`]): each checked for a finite loss,
/// predicted when the profile was measured here, verified against the reference with
/// `--verify`, and made a row.
///
/// # Errors
/// A diverged step (a loss or gradient norm that is not finite), the executor's errors.
fn run_reported_steps(a: &ExecuteArgs, r: &ResolvedRun, built: Built) -> Result<Ran> {
    let Built {
        mut exec,
        mut reference,
        first,
        predict,
        profile_warnings,
    } = built;
    let setup = &r.setup;
    // Warm-up steps count on the bar: a long warm-up is work the user waits for.
    let bar = Progress::new(u64::from(a.steps) + u64::from(a.warmup_steps));
    let mut ran = Ran {
        rows: Vec::with_capacity(a.steps as usize),
        last: None,
        failed: false,
        over_budget: 0,
        longest: 0,
        predict,
        profile_warnings,
        estimate: SpeedEstimate::new(a.est.forgetting)
            .map_err(|e| anyhow::anyhow!("--forgetting {}: {e}", a.est.forgetting))?,
        links: sim::run::link_estimate::LinkEstimate::new(a.est.forgetting)?,
        kinds: sim::run::kind_estimate::KindEstimate::new(a.est.forgetting)?,
        estimate_log: Vec::new(),
        estimate_points: Vec::new(),
    };
    // Sequences longer than the token budget (each gets a microbatch of its own).
    let budget = setup
        .config
        .params
        .microbatches
        .is_none()
        .then_some(setup.config.params.token_budget);
    // Warm-up steps draw their data after the reported ones' (step ids steps.., so the reported
    // steps are the same with or without them).
    let warmup = WarmUp::Following(u64::from(a.warmup_steps));
    run_steps(
        &mut exec,
        setup,
        reference.as_mut(),
        warmup,
        u64::from(a.steps),
        Some(first),
        &|| bar.inc(),
        |done: StepDone<'_>| -> Result<Option<Arc<Profile>>> {
            let StepDone {
                step,
                prepared,
                run,
                exec,
                reference,
                setup: planned_with,
                prepare_s,
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
                    ran.over_budget += 1;
                    ran.longest = ran.longest.max(len);
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
                // The step's own prediction (on the profile it was planned with), and, for the
                // estimate, the same schedules replayed on the run's profile.
                let base = setup.profile.as_deref().unwrap_or(&r.profile);
                let own = planned_with.profile.as_deref().unwrap_or(base);
                let p = prepared.predict(planned_with, own)?;
                let on_base = prepared.predict(planned_with, base)?;
                if let Some(t) = &on_base.timeline {
                    // Replica 0's ranks: the predicted timeline's.
                    ran.estimate
                        .observe(t, &run.timeline, setup.config.pp as usize);
                    replan::observe_links(&mut ran.links, &run, &prepared, base, &setup.config);
                    let mbs = &prepared.replicas[0].lengths;
                    let pp = setup.config.pp as usize;
                    ran.kinds
                        .observe(base, &setup.config, mbs, &run.timeline, pp);
                    if a.est.estimate_log.is_some() {
                        let est = (&ran.estimate, ran.links.pooled(), ran.kinds.factors());
                        ran.estimate_log
                            .push(estimate_line(step, (&p, &run), est, prepare_s)?);
                    }
                    ran.estimate_points
                        .push(replan::point(step, &p, &run, &ran.estimate));
                }
                Some(p)
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
                        setup,
                        &prepared,
                    )?;
                    ran.failed |= !v.within_tolerance;
                    Some(verify_row(v))
                }
                None => None,
            };
            let row = step_row(step, &prepared, &run, predicted.as_ref(), verify);
            tracing::info!(
                "execute: step {step}: {} tokens, loss {:.4}, measured makespan {:.4} s",
                row.tokens,
                row.loss,
                row.measured_makespan_s
            );
            ran.rows.push(row);
            ran.last = Some((prepared, run));
            Ok(match (a.est.replan, predict) {
                (true, true) => Some(Arc::new(ran.links.apply(&ran.estimate.planning_profile(
                    setup.profile.as_deref().unwrap_or(&r.profile),
                    &setup.config,
                )?))),
                _ => None,
            })
        },
    )?;
    bar.finish();
    Ok(ran)
}

/// The report: the charts of the last step, the notes, the table or JSON.
///
/// # Errors
/// A chart or trace that cannot be written; stdout closed.
fn render(a: &ExecuteArgs, r: &ResolvedRun, ran: Ran) -> Result<ExitCode> {
    let config = &r.setup.config;
    let (pp, v, dp) = (config.pp, config.v, config.dp);
    let (model, backend) = (&r.model, &r.backend);
    let mut notes = Vec::new();
    if ran.over_budget > 0 {
        notes.push(format!(
            "{} sequence(s) longer than the token budget of {} tokens (the longest {}) ran as microbatches of their own",
            ran.over_budget, config.params.token_budget, ran.longest
        ));
    }
    if let Some((prepared, run)) = &ran.last {
        let title = format!(
            "{} measured on {}: {} {}dp={dp} pp={pp} v={v} m={}, step {}",
            model.name,
            backend.backend.name(),
            config.source.name(),
            cp_label(config),
            slash_list(prepared.replicas.iter().map(|r| r.microbatches.len())),
            prepared.step
        );
        notes.extend(write_step_charts(
            &title,
            run,
            r.gantt.as_deref(),
            a.trace.as_deref(),
        )?);
    }
    let errors: Vec<f64> = ran
        .rows
        .iter()
        .filter_map(|r| r.rel_error.map(f64::abs))
        .collect();
    let median_abs_rel_error = (!errors.is_empty()).then(|| montecarlo::Quantiles::of(&errors).p50);
    let prediction = prediction_note(
        ran.predict,
        r.profile_arg.as_deref(),
        &r.profile,
        backend.backend,
    );
    notes.push(prediction.clone());
    notes.extend(ran.profile_warnings.iter().map(|w| format!("warning: {w}")));
    if let Some(path) = &a.est.estimate_log {
        notes.push(write_estimate_log(
            path,
            &ran.estimate_log,
            a.est.forgetting,
        )?);
    }
    notes.extend(replan::estimate_chart(a, r, &ran.estimate_points)?);
    if let (true, Some((last, _))) = (a.est.replan && ran.predict, &ran.last) {
        notes.extend(replan::proposal_note(a, r, &ran.estimate, last)?);
    }
    let fitted_scale = replan::fit_profile(a, r, &ran.estimate, &mut notes)?;
    let report = ExecuteReport {
        model: model.name.clone(),
        workload: r.workload.name.clone(),
        schedule: config.source.name(),
        dp,
        pp,
        vpp: v,
        backend: backend.describe(),
        steps: ran.rows,
        median_abs_rel_error,
        prediction,
        profile_warnings: ran.profile_warnings,
        fitted_scale,
    };
    let header = format!(
        "{} on the {} backend: {} {}dp={dp} pp={pp} v={v}, workload {} ({} step(s); {} stages, layers {})",
        model.name,
        report.backend,
        report.schedule,
        cp_label(config),
        r.workload.name,
        a.steps,
        config.stages.len(),
        config
            .stages
            .iter()
            .map(|r| format!("{}..{}", r.start, r.end))
            .collect::<Vec<_>>()
            .join(" ")
    );
    let with_fo = config.forward_only.is_some();
    let t = execute_table(&report.steps, with_fo, ran.predict, a.verify);
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
    emit(a.format, &report, &header, &t, &notes)
}
