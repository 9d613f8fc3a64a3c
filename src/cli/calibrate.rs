//! `flatpipe calibrate`: the closed loop on this machine. Profile the executor's kernels, plan
//! each schedule with that profile, execute the plan, and compare the predicted makespan and
//! bubbles with the measured ones.

use super::*;
use backend::backend_config;
use executor::calibrate::{measure_setups, median};
use executor::{AdamW, runner::Setup};
use std::sync::Arc;

/// Options of `flatpipe calibrate`.
#[derive(Debug, Args)]
pub(super) struct CalibrateArgs {
    /// Backend.
    #[arg(long, value_enum, default_value_t = Backend::Cpu)]
    backend: Backend,
    /// GEMM arithmetic on --backend cuda (profile and runs alike).
    #[arg(long, value_enum, default_value_t = GemmPrecision::Fp32)]
    precision: GemmPrecision,
    /// On --backend cuda, spread the ranks over this many GPUs (see execute --gpus); the
    /// profile then measures the peer link. Default 1.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    gpus: u32,
    /// Model (default tiny).
    #[arg(long, default_value = "tiny")]
    model: String,
    /// Workload (default tiny-chat).
    #[arg(long, default_value = "tiny-chat")]
    workload: String,
    /// Use this measured profile instead of profiling first.
    #[arg(long)]
    profile: Option<PathBuf>,
    /// Coarse profiling grid and 3 measured steps per schedule.
    #[arg(long)]
    quick: bool,
    /// Pipeline ranks (default: the machine's cores, at most 4). On the CPU backend keep it at
    /// most the number of cores, so the measurement is not the OS scheduler's.
    #[arg(long)]
    pp: Option<u32>,
    /// Schedules to compare (default: all).
    #[arg(long, value_delimiter = ',')]
    schedule: Vec<String>,
    /// Measured steps per schedule (each run once unmeasured first, to warm the memory it
    /// needs). Default 5 (3 with --quick).
    #[arg(long)]
    steps: Option<u32>,
    /// Token budgets the planner may choose from (default 256,512,1024).
    #[arg(long, value_delimiter = ',')]
    token_budgets: Vec<u64>,
    /// Also write the measured profile here.
    #[arg(long)]
    save_profile: Option<PathBuf>,
    /// The order the schedules' steps run in: `interleaved` (every schedule's step i before
    /// any schedule's step i + 1, all executors side by side: a drift of the host's speed hits
    /// every schedule alike) or `sequential` (one schedule's steps after another's, one
    /// executor at a time).
    #[arg(long, value_enum, default_value_t = Order::Sequential)]
    order: Order,
    /// Output format.
    #[arg(long, value_enum, default_value_t = Format::Table)]
    format: Format,
}

/// The order `calibrate` runs the schedules' steps in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Order {
    Interleaved,
    Sequential,
}

#[derive(Debug, Serialize)]
struct Row {
    schedule: String,
    pp: u32,
    vpp: u32,
    token_budget: u64,
    layers_per_stage: Vec<usize>,
    predicted_makespan_s: f64,
    measured_makespan_s: f64,
    rel_error: f64,
    predicted_bubble_per_rank: Vec<f64>,
    measured_bubble_per_rank: Vec<f64>,
    /// Busy seconds per phase over the ranks (medians), predicted and measured.
    phases: Vec<executor::calibrate::PhaseTime>,
}

#[derive(Debug, Serialize)]
struct Report {
    model: String,
    workload: String,
    device: String,
    profile: String,
    steps: u32,
    schedules: Vec<Row>,
    median_abs_rel_error: f64,
}

/// `flatpipe calibrate`: resolve (backend, model, workload, pp, steps, budgets), refuse what
/// this host cannot hold ([`check_host`]), take the profile ([`profile_for`]), plan every
/// schedule on it ([`plan_schedules`]), run and measure their steps, then render ([`render`]).
pub(super) fn calibrate(a: CalibrateArgs) -> Result<ExitCode> {
    let resolved = a.backend.resolve_for_stages()?;
    // Timing only: on a GPU the weights are drawn on the device.
    let backend = backend_config(
        resolved,
        a.precision,
        a.gpus,
        resolved == executor::Backend::Cuda,
    )?;
    if let Some(p) = &a.save_profile {
        profiles::check_writable(p)?;
    }
    let model = builtins::model(&a.model)?;
    let workload = builtins::workload(&a.workload)?;
    let cores = cores() as u32;
    let pp = a.pp.unwrap_or(cores.clamp(1, 4));
    if pp == 0 {
        bail!("--pp = 0 is invalid: >= 1 rank");
    }
    if pp > cores && resolved == executor::Backend::Cpu {
        tracing::warn!(
            "--pp {pp} on {cores} cores: ranks share cores, so the OS scheduler's time slicing enters the measurement"
        );
    }
    // The executor runs dense models only: no all-to-all for combined 1F1B to hide.
    let kinds = parse_kinds(&a.schedule, false)?;
    let steps = a.steps.unwrap_or(if a.quick { 3 } else { 5 });
    if steps == 0 {
        bail!("--steps = 0 is invalid: >= 1 step");
    }
    let budgets = if a.token_budgets.is_empty() {
        vec![256, 512, 1024]
    } else {
        dedup(a.token_budgets.clone())
    };
    check_host(&a, resolved, &model, &kinds, &budgets)?;
    let (profile, origin) = profile_for(&a, resolved, &backend, &model, pp)?;
    let size = workload.default_step_size();
    let profile = Arc::new(profile);
    let runs = plan_schedules(&kinds, &profile, &model, &workload, pp, &budgets, size)?;
    let bar = Progress::new(2 * u64::from(steps) * runs.len() as u64);
    // The measured steps run once unmeasured first: their memory is then touched, as in
    // training after its first steps (see executor::calibrate::measure_steps).
    let order = match a.order {
        Order::Sequential => executor::calibrate::Order::Sequential,
        Order::Interleaved => executor::calibrate::Order::Interleaved,
    };
    let setups: Vec<&Setup> = runs.iter().map(|(_, _, setup)| setup).collect();
    let comparisons = measure_setups(
        &backend,
        &setups,
        &profile,
        u64::from(steps),
        order,
        &|| bar.inc(),
    )?;
    bar.finish();
    let mut rows = Vec::new();
    for ((kind, token_budget, setup), c) in runs.into_iter().zip(comparisons) {
        rows.push(Row {
            schedule: kind.name().to_string(),
            pp,
            vpp: setup.config.v,
            token_budget,
            layers_per_stage: setup.config.stages.iter().map(|r| r.len()).collect(),
            predicted_makespan_s: c.predicted_makespan_s(),
            measured_makespan_s: c.measured_makespan_s(),
            rel_error: c.rel_error(),
            predicted_bubble_per_rank: c.predicted_bubbles(),
            measured_bubble_per_rank: c.measured_bubbles(),
            phases: c.phases(),
        });
    }
    if rows.is_empty() {
        bail!("no schedule could be planned on this profile");
    }
    render(&a, rows, &model, &workload, &profile, origin, pp, steps)
}

/// Refuses, before allocating, a CPU calibration this host cannot hold: the schedules'
/// executors are built side by side with `--order interleaved`.
///
/// # Errors
/// The memory needed and the memory available, with what to change.
fn check_host(
    a: &CalibrateArgs,
    resolved: executor::Backend,
    model: &flatpipe_profiles::ModelSpec,
    kinds: &[ScheduleKind],
    budgets: &[u64],
) -> Result<()> {
    // The schedules' executors are built side by side (see below): refuse, before allocating,
    // what this host cannot hold.
    if resolved == executor::Backend::Cpu {
        let largest = budgets.iter().copied().max().unwrap_or(0);
        let floor = flatpipe_executor::cpu::MemoryFloor::of(model, largest);
        let n = if a.order == Order::Interleaved {
            kinds.len() as f64
        } else {
            1.0
        };
        check_memory(
            &format!("calibrate of {} over {} schedules", model.name, kinds.len()),
            floor.state * n + floor.activations,
            &format!(
                "{n} executor(s) at once, each with {} of fp32 weights, gradients and AdamW state ({} parameters x 16 bytes), and a microbatch of {largest} tokens keeps {} of activations",
                fmt_bytes(floor.state),
                model.param_count(),
                fmt_bytes(floor.activations)
            ),
            "calibrate a smaller model (--model tiny), or with --order interleaved fewer schedules (--schedule)",
        )?;
    }
    Ok(())
}

/// The profile to predict with and where it came from: `--profile` (refused unless measured on
/// this backend; its conditions warned of), else measured now with `pp` threads busy (saved
/// with `--save-profile`).
///
/// # Errors
/// A profile that does not load or was measured elsewhere; a measurement that fails.
fn profile_for(
    a: &CalibrateArgs,
    resolved: executor::Backend,
    backend: &executor::BackendConfig,
    model: &flatpipe_profiles::ModelSpec,
    pp: u32,
) -> Result<(Profile, String)> {
    let (profile, origin) = match &a.profile {
        Some(path) => {
            let p = Profile::from_yaml(
                &profiles::read_to_string(path)?,
                &path.display().to_string(),
            )?;
            if !resolved.measured(&p) {
                bail!(
                    "{}: the profile was not measured on the {} backend (source {:?}, device {}); run without --profile to measure one",
                    path.display(),
                    resolved.name(),
                    p.provenance.source,
                    p.provenance.device
                );
            }
            // Each schedule runs pp ranks at once on this machine (spread over the GPUs).
            let busy = match resolved {
                executor::Backend::Cpu => pp as usize,
                executor::Backend::Cuda => (pp as usize).div_ceil(backend.gpus),
            };
            for w in executor::backend::condition_warnings(&p, backend, busy) {
                tracing::warn!("{}: {w}", path.display());
            }
            (p, path.display().to_string())
        }
        None => {
            let mut cfg = resolved.profile_config(a.quick);
            // Profile as the plan runs: pp ranks busy at once.
            cfg.concurrency = pp as usize;
            let p = backend::measure(backend, model, None, &cfg)?;
            if let Some(path) = &a.save_profile {
                profiles::write_atomic(path, p.to_yaml()?.as_bytes())?;
            }
            (p, "measured now".to_string())
        }
    };
    if profile.layers.len() != model.layers().len() {
        bail!(
            "the profile has {} layers, model {} has {}",
            profile.layers.len(),
            model.name,
            model.layers().len()
        );
    }
    Ok((profile, origin))
}

/// Every schedule planned on the profile (its layer split and token budget), as
/// `(schedule, token budget, setup)`; a schedule with no feasible plan is warned of and left
/// out.
///
/// # Errors
/// The planner's errors other than no feasible plan.
fn plan_schedules(
    kinds: &[ScheduleKind],
    profile: &Arc<Profile>,
    model: &flatpipe_profiles::ModelSpec,
    workload: &Workload,
    pp: u32,
    budgets: &[u64],
    size: StepSize,
) -> Result<Vec<(ScheduleKind, u64, Setup)>> {
    // Plan every schedule first (see --order for how their steps then run).
    let mut runs = Vec::new();
    for kind in kinds.iter().copied() {
        tracing::info!("calibrate: {}: plan on the measured profile", kind.name());
        // Plan this schedule on the measured profile: the layer split and token budget.
        let (best, config) =
            match planner::search::plan_schedule(profile, workload, kind, pp, budgets, size) {
                Ok(plan) => plan,
                Err(planner::Error::NoFeasiblePlan(why)) => {
                    tracing::warn!("{}: no plan ({why})", kind.name());
                    continue;
                }
                Err(e) => return Err(e.into()),
            };
        let setup = Setup {
            model: model.clone(),
            config,
            workload: workload.clone(),
            step_size: size,
            seed: workload.seed,
            init_seed: 0,
            ep: 1,
            reduction: executor::LossReduction::PerToken,
            adamw: AdamW::default(),
            max_grad_norm: Some(1.0),
            balance: Arc::new(flatpipe_simulator::run::config::balance_cost(profile)),
            profile: Some(Arc::clone(profile)),
        };
        runs.push((kind, best.token_budget(), setup));
    }
    Ok(runs)
}

/// The closed loop's table: per schedule the predicted and measured makespan and bubbles.
///
/// # Errors
/// No schedule could be planned; stdout closed.
#[allow(clippy::too_many_arguments)]
fn render(
    a: &CalibrateArgs,
    rows: Vec<Row>,
    model: &flatpipe_profiles::ModelSpec,
    workload: &Workload,
    profile: &Profile,
    origin: String,
    pp: u32,
    steps: u32,
) -> Result<ExitCode> {
    let median_abs_rel_error = median(rows.iter().map(|r| r.rel_error.abs()).collect());
    let report = Report {
        model: model.name.clone(),
        workload: workload.name.clone(),
        device: profile.provenance.device.clone(),
        profile: origin,
        steps,
        schedules: rows,
        median_abs_rel_error,
    };
    let header = format!(
        "closed loop on {}: {} on {}, pp={pp}, profile {}, {steps} measured steps per schedule (medians)",
        report.device, report.model, report.workload, report.profile
    );
    let mut t = new_table(&[
        "schedule",
        "v",
        "budget",
        "layers per stage",
        "predicted",
        "measured",
        "error",
        "bubble per rank: predicted",
        "measured",
        "busy measured / predicted",
    ]);
    let list = |v: &[f64]| v.iter().map(|x| pct(*x)).collect::<Vec<_>>().join(" ");
    for r in &report.schedules {
        t.add_row([
            r.schedule.clone(),
            r.vpp.to_string(),
            r.token_budget.to_string(),
            slash_list(&r.layers_per_stage),
            fmt_s(r.predicted_makespan_s),
            fmt_s(r.measured_makespan_s),
            format!("{:+.1}%", 100.0 * r.rel_error),
            list(&r.predicted_bubble_per_rank),
            list(&r.measured_bubble_per_rank),
            r.phases
                .iter()
                .map(|p| format!("{} {:.2}", p.phase, p.measured_s / p.predicted_s))
                .collect::<Vec<_>>()
                .join(" "),
        ]);
    }
    let notes = vec![format!(
        "median |relative error| over schedules: {:.1}%",
        100.0 * report.median_abs_rel_error
    )];
    emit(a.format, &report, &header, &t, &notes)
}
