//! `flatpipe simulate`: uniform costs or a profile and workload, one or many steps.

use super::*;

/// Options of `flatpipe simulate`.
#[derive(Debug, Args)]
pub(super) struct SimulateArgs {
    #[command(flatten)]
    inputs: Inputs,
    /// Run a plan file (sets pp, vpp, schedule, stages and microbatching).
    #[arg(long, conflicts_with_all = ["schedule", "pp", "vpp", "microbatches", "token_budget", "schedule_csv"])]
    plan: Option<PathBuf>,
    /// Simulate a schedule from PyTorch's compute-only pipeline-order CSV (one row per rank;
    /// its rows set pp, its stages the placement, its microbatch indices m).
    #[arg(long, conflicts_with_all = ["schedule", "pp", "vpp", "microbatches", "token_budget"])]
    schedule_csv: Option<PathBuf>,
    /// Schedules to compare, comma-separated (gpipe, 1f1b, interleaved-1f1b, looped-bfs, zb-h1,
    /// zb-h2, zb-v, dualpipev, zb-auto) or `all` (the default).
    #[arg(long, value_delimiter = ',')]
    schedule: Vec<String>,
    /// Pipeline-parallel degree (ranks). Default 4.
    #[arg(long)]
    pp: Option<u32>,
    /// Stages per rank for interleaved schedules (default 2; V schedules always use 2).
    #[arg(long)]
    vpp: Option<u32>,
    /// Tensor-parallel degree: GPUs per rank (default 1). GPUs = tp x dp x pp.
    #[arg(long, conflicts_with_all = ["plan", "costs"], value_parser = clap::value_parser!(u32).range(1..))]
    tp: Option<u32>,
    /// Tensor parallelism without sequence parallelism.
    #[arg(long, conflicts_with_all = ["plan", "costs"])]
    no_sequence_parallel: bool,
    /// Data-parallel replicas of the pipeline (default 1), each taking a cost-balanced share of
    /// every step.
    #[arg(long, conflicts_with_all = ["plan", "costs"], value_parser = clap::value_parser!(u32).range(1..))]
    dp: Option<u32>,
    /// How the replicas shard their state: ddp (default), zero1, zero2, fsdp, fsdp-mb, hsdp.
    #[arg(long, conflicts_with_all = ["plan", "costs"])]
    sharding: Option<String>,
    /// Exactly this many microbatches, balanced by predicted cost.
    #[arg(long, conflicts_with = "token_budget")]
    microbatches: Option<u32>,
    /// The fewest microbatches of at most this many tokens (first-fit decreasing). Default 16384.
    #[arg(long)]
    token_budget: Option<u64>,
    /// Cut a sequence longer than the token budget into chunks of at most this many tokens
    /// (<= the budget), pipelined along the token dimension (TeraPipe / Seq1F1B); without it,
    /// such a sequence gets one microbatch of its own.
    #[arg(long, conflicts_with = "microbatches")]
    chunk_tokens: Option<u64>,
    /// Sequences per step (default: the workload's, 128).
    #[arg(long, conflicts_with = "tokens_per_step")]
    seqs_per_step: Option<u32>,
    /// Tokens per step: sequences are drawn until the step holds this many.
    #[arg(long)]
    tokens_per_step: Option<u64>,
    /// Steps to sample and simulate (Monte Carlo over the workload). Default 1.
    #[arg(long)]
    steps: Option<u32>,
    /// Microbatching policies to compare, comma-separated: padded, packed, flat-ffd (default),
    /// flat-balanced, verl-kk (verl's dynamic batch size), flat-planned (count, contents and
    /// order planned per step for the schedule; its rows add the mean per-step lower bound).
    #[arg(long, value_delimiter = ',')]
    policy: Vec<String>,
    /// Schedule capacities to compare, comma-separated: `dynamic` (default: each step's schedule
    /// is built for its microbatch count) or K (built once for K microbatches; overflow runs
    /// extra rounds, missing slots run empty).
    #[arg(long, value_delimiter = ',')]
    capacity: Vec<String>,
    /// Row length of the packed policy, tokens. Default 4096.
    #[arg(long)]
    pack_len: Option<u32>,
    /// Cap on the padded policy's sequence length S (longer sequences are truncated).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    max_seq_len: Option<u32>,
    /// Keep each sampled sequence with this probability (an RL filter), so the sequence count
    /// per step varies.
    #[arg(long)]
    keep_prob: Option<f64>,
    /// Write a histogram of step times per policy (best schedule) here (.svg or .png).
    #[arg(long)]
    histogram: Option<PathBuf>,
    /// Uniform costs instead of a profile and workload: one rank's share of the model per
    /// microbatch in seconds, e.g. f=1,b=1,w=1,comm=0 (keys f, b, w, comm, fb, fo). Per-rank
    /// values separated by `/` give heterogeneous ranks, e.g. f=1/1/1/2,b=2/2/2/3,w=1 (one
    /// value per rank of --pp, or one for all; with v stages per rank each stage costs its
    /// rank's share / v).
    #[arg(long, conflicts_with_all = ["profile", "model", "hardware", "workload", "plan", "token_budget", "chunk_tokens", "seqs_per_step", "tokens_per_step", "policy", "capacity", "pack_len", "max_seq_len", "keep_prob", "histogram", "memory_limit"])]
    costs: Option<String>,
    /// zb-auto under --costs: the most activation memory a rank may hold, in units (one rank's
    /// share of one microbatch's activations; default p, 1F1B's memory; 2p behaves like ZB-2p).
    #[arg(long, requires = "costs")]
    max_activation_units: Option<f64>,
    /// Under --costs, also solve for the optimal schedule (branch and bound over every order of
    /// F, I and W under --max-activation-units; zb-auto's placement: loop, or V with --vpp 2),
    /// for at most this many seconds: prints the optimum, or the best schedule found and a
    /// lower bound when the time runs out. Exact in seconds for p <= 4 and m <= 8.
    #[arg(long, requires = "costs", value_name = "SECONDS")]
    exact: Option<f64>,
    /// Under --costs, also replay K consecutive steps of each schedule and report the
    /// steady-state step time with a global synchronisation before the optimizer
    /// (gradient-norm clipping) and with the Zero Bubble paper's optimizer post-validation
    /// (each rank steps after its own last W and starts the next step).
    #[arg(long, requires = "costs", value_name = "K", value_parser = clap::value_parser!(u32).range(2..=100_000))]
    consecutive_steps: Option<u32>,
    /// Under --costs, what zb-auto minimises: one step's makespan (`step`, with a global
    /// synchronisation before the optimizer), or the steady-state step time under the Zero
    /// Bubble paper's optimizer post-validation (`post-validation`, 4 steps replayed per
    /// candidate; where ZB-H2's shape pays).
    #[arg(long, requires = "costs", value_enum, default_value_t = ZbObjective::Step)]
    zb_objective: ZbObjective,
    /// zb-auto with a profile: the memory limit per rank (e.g. 120GiB); its activations get this
    /// minus parameters, gradients and optimizer state. Default: the hardware's memory minus a
    /// reserve of 4 GiB (at most 1/8).
    #[arg(long)]
    memory_limit: Option<String>,
    #[command(flatten)]
    fo: FoArgs,
    /// Seed of the step sampler (default: the workload's, 0). Printed.
    #[arg(long)]
    seed: Option<u64>,
    /// Write the Gantt chart of the best schedule here (.svg or .png); with several schedules,
    /// each one's also goes to <stem>-<schedule>.<ext>. Default flatpipe-gantt.png; `none`
    /// writes no chart.
    #[arg(long)]
    gantt: Option<PathBuf>,
    /// Write the best schedule's activation memory per rank over the step here (CSV: rank,
    /// time_s, activation in bytes or units).
    #[arg(long)]
    memory: Option<PathBuf>,
    /// Write a Chrome trace (Perfetto) JSON of the best schedule here; with several schedules,
    /// each one's also goes to <stem>-<schedule>.json.
    #[arg(long)]
    trace: Option<PathBuf>,
    /// Output format.
    #[arg(long, value_enum, default_value_t = Format::Table)]
    format: Format,
}

/// One row of `simulate --costs`'s output (`--format json` prints a list of these).
#[derive(Debug, Serialize)]
pub(super) struct Report {
    schedule: String,
    pp: u32,
    vpp: u32,
    microbatches: u32,
    #[serde(flatten)]
    metrics: sim::Metrics,
    #[serde(flatten, skip_serializing_if = "Option::is_none")]
    forward_only: Option<FoReport>,
    #[serde(skip_serializing_if = "Option::is_none")]
    consecutive_steps: Option<ConsecutiveReport>,
}

/// `--consecutive-steps K`: the steady-state step time of K steps under both synchronisations
/// (`simulator::replay::multistep`).
#[derive(Debug, Serialize, Clone)]
pub(super) struct ConsecutiveReport {
    steps: u32,
    /// With a global synchronisation before the optimizer, seconds per step.
    global_sync_step_s: f64,
    /// With optimizer post-validation, seconds per step.
    post_validation_step_s: f64,
}

/// Forward-only work of a `--costs` row (`--fo-microbatches K > 0`).
#[derive(Debug, Serialize, Clone)]
pub(super) struct FoReport {
    fo_microbatches: u32,
    fo_mode: sim::schedules::forward_only::FoMode,
    fo_loss_dependency: bool,
    /// The training schedule alone, seconds.
    train_only_s: f64,
    /// The forward-only pass alone, seconds.
    fo_separate_s: f64,
    /// `(T_train + T_fo_separate - T_combined) / T_fo_separate`.
    fo_hidden_fraction: f64,
}

/// The single-step fields of a profile-driven row (when one step ran as one round).
#[derive(Debug, Serialize)]
pub(super) struct SingleStep {
    microbatches: u32,
    #[serde(flatten)]
    metrics: sim::Metrics,
}

/// One row of `simulate`'s output with a profile: one (schedule, policy, capacity).
#[derive(Debug, Serialize)]
pub(super) struct McReport {
    schedule: String,
    policy: String,
    capacity: String,
    pp: u32,
    vpp: u32,
    #[serde(flatten)]
    summary: montecarlo::Summary,
    #[serde(flatten)]
    single: Option<SingleStep>,
    /// The per-rank memory limit the row is checked against, bytes.
    memory_limit_bytes: f64,
    /// Whether the largest per-rank total (`peak_memory_bytes`) fits the limit.
    fits: bool,
}

/// `--zb-objective`: what zb-auto minimises (`sim::schedules::zb_auto::Objective`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(super) enum ZbObjective {
    /// One step's makespan.
    Step,
    /// The steady-state step time under optimizer post-validation.
    PostValidation,
}

impl From<ZbObjective> for sim::schedules::zb_auto::Objective {
    fn from(o: ZbObjective) -> Self {
        match o {
            ZbObjective::Step => sim::schedules::zb_auto::Objective::Step,
            ZbObjective::PostValidation => sim::schedules::zb_auto::Objective::PostValidation,
        }
    }
}

/// The schedules a `simulate` call compares: generated kinds, or one loaded from a CSV file.
pub(super) enum Schedules {
    Kinds(Vec<ScheduleKind>),
    Csv(sim::Schedule),
}

pub(super) fn simulate(a: SimulateArgs) -> Result<ExitCode> {
    // A bad output path is found before the work, not after it.
    let gantt = super::chart_path(&a.gantt, "flatpipe-gantt.png");
    super::check_outputs(
        gantt
            .iter()
            .chain(&a.trace)
            .chain(&a.memory)
            .chain(&a.histogram),
    )?;
    for c in gantt.iter().chain(&a.histogram) {
        sim::io::gantt::check_chart_path(c)?;
    }
    let schedules = match &a.schedule_csv {
        Some(path) => {
            let text = profiles::read_to_string(path)?;
            Schedules::Csv(sim::ir::pytorch_csv::read_pytorch_csv(
                &text,
                &path.display().to_string(),
            )?)
        }
        None => Schedules::Kinds(parse_kinds(&a.schedule)?),
    };
    // Checks --fo-loss-dependency against the forward-only work up front.
    a.fo.spec()?;
    if (a.max_activation_units.is_some() || a.memory_limit.is_some())
        && matches!(&schedules, Schedules::Kinds(k) if !k.contains(&ScheduleKind::ZbAuto))
    {
        tracing::warn!(
            "--max-activation-units / --memory-limit bound zb-auto only, which is not among the schedules"
        );
    }
    if a.zb_objective != ZbObjective::Step
        && matches!(&schedules, Schedules::Kinds(k) if !k.contains(&ScheduleKind::ZbAuto))
    {
        tracing::warn!("--zb-objective applies to zb-auto only, which is not among the schedules");
    }
    match &a.costs {
        Some(_) if a.steps.is_some_and(|n| n > 1) => {
            bail!(
                "the argument '--costs' cannot be used with '--steps' > 1: uniform costs describe one step"
            )
        }
        Some(spec) => simulate_uniform(&a, &CostsArg::parse(spec)?, schedules),
        None => simulate_profile(&a, schedules),
    }
}

/// Writes the Gantt chart(s) and trace a `simulate` call asked for; returns notes to print.
pub(super) fn write_charts(
    a: &SimulateArgs,
    runs: &[(String, String, &Simulation)],
) -> Result<Vec<String>> {
    let mut notes = Vec::new();
    let Some((best_name, best_title, best_sim)) = runs.first() else {
        return Ok(notes);
    };
    let best = &best_sim.timeline;
    if let Some(gantt) = super::chart_path(&a.gantt, "flatpipe-gantt.png") {
        sim::io::gantt::write_gantt(&gantt, best_title, best)?;
        notes.push(format!("Gantt chart of {best_name}: {}", gantt.display()));
        if a.gantt.is_some() && runs.len() > 1 {
            for (name, title, s) in runs {
                let path = sibling(&gantt, &sanitize(name));
                sim::io::gantt::write_gantt(&path, title, &s.timeline)?;
                notes.push(format!("Gantt chart of {name}: {}", path.display()));
            }
        }
    }
    if let Some(path) = &a.trace {
        let doc = sim::io::trace::chrome_trace(best);
        profiles::write_atomic(path, serde_json::to_string(&doc)?.as_bytes())?;
        notes.push(format!("Chrome trace of {best_name}: {}", path.display()));
        if runs.len() > 1 {
            for (name, _, s) in runs {
                let path = sibling(path, &sanitize(name));
                let doc = sim::io::trace::chrome_trace(&s.timeline);
                profiles::write_atomic(&path, serde_json::to_string(&doc)?.as_bytes())?;
                notes.push(format!("Chrome trace of {name}: {}", path.display()));
            }
        }
    }
    if let Some(path) = &a.memory {
        let unit = if best_sim
            .metrics
            .ranks
            .iter()
            .any(|r| r.peak_activation_units.is_some())
        {
            "units"
        } else {
            "bytes"
        };
        let mut csv = format!("rank,time_s,activation_{unit}\n");
        for (r, levels) in best_sim.memory.iter().enumerate() {
            csv.push_str(&format!("{r},0,0\n"));
            for (t, level) in levels {
                csv.push_str(&format!("{r},{},{level}\n", *t as f64 / 1e9));
            }
        }
        profiles::write_atomic(path, csv.as_bytes())?;
        notes.push(format!(
            "Activation memory over time of {best_name}: {}",
            path.display()
        ));
    }
    Ok(notes)
}

pub(super) fn peak_of(m: &sim::Metrics) -> f64 {
    m.ranks
        .iter()
        .map(|x| {
            x.peak_activation_bytes
                .or(x.peak_activation_units)
                .unwrap_or(0.0)
        })
        .fold(0.0, f64::max)
}

/// `--costs`: one value per key, or per-rank lists.
pub(super) enum CostsArg {
    Uniform(UniformCostSpec),
    PerRank(sim::PerRankCostSpec),
}

impl CostsArg {
    fn parse(s: &str) -> Result<Self> {
        Ok(if s.contains('/') {
            CostsArg::PerRank(s.parse()?)
        } else {
            CostsArg::Uniform(s.parse()?)
        })
    }

    /// The cost model on `placement` (its ranks and stages per rank).
    fn model(&self, placement: &sim::ir::Placement) -> Result<CliCosts> {
        let p = placement.num_ranks;
        Ok(match self {
            CostsArg::Uniform(spec) => {
                CliCosts::Uniform(UniformCosts::new(spec, placement.num_stages() / p.max(1)))
            }
            CostsArg::PerRank(spec) => {
                let [f, b, w] = spec.for_ranks(p)?;
                CliCosts::PerRank(sim::StageCosts::per_rank(&f, &b, &w, spec.comm, placement)?)
            }
        })
    }

    /// The longest a rank's share of one microbatch can take, training (f + b + w + two
    /// transfers) and forward-only, seconds.
    fn serial_s(&self) -> (f64, f64) {
        match self {
            CostsArg::Uniform(s) => (s.f + s.b + s.w + 2.0 * s.comm, s.fo.unwrap_or(s.f)),
            CostsArg::PerRank(s) => {
                let most = |xs: &[f64]| xs.iter().copied().fold(0.0, f64::max);
                (
                    most(&s.f) + most(&s.b) + most(&s.w) + 2.0 * s.comm,
                    most(&s.f),
                )
            }
        }
    }
}

impl std::fmt::Display for CostsArg {
    fn fmt(&self, out: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let list = |xs: &[f64]| {
            xs.iter()
                .map(|x| x.to_string())
                .collect::<Vec<_>>()
                .join("/")
        };
        match self {
            CostsArg::Uniform(s) => write!(
                out,
                "uniform costs f={} b={} w={} comm={} s",
                s.f, s.b, s.w, s.comm
            ),
            CostsArg::PerRank(s) => write!(
                out,
                "per-rank costs f={} b={} w={} comm={} s",
                list(&s.f),
                list(&s.b),
                list(&s.w),
                s.comm
            ),
        }
    }
}

/// The cost model of `--costs`: uniform, or per rank.
#[derive(Debug, Clone)]
pub(super) enum CliCosts {
    Uniform(UniformCosts),
    PerRank(sim::StageCosts),
}

macro_rules! delegate {
    ($self:ident, $c:ident => $e:expr) => {
        match $self {
            CliCosts::Uniform($c) => $e,
            CliCosts::PerRank($c) => $e,
        }
    };
}

impl sim::CostModel for CliCosts {
    fn compute_ns(&self, a: sim::ir::ComputeAction) -> u64 {
        delegate!(self, c => c.compute_ns(a))
    }
    fn overlap_ns(&self, f: sim::ir::ComputeAction, b: sim::ir::ComputeAction) -> u64 {
        delegate!(self, c => c.overlap_ns(f, b))
    }
    fn comm_ns(
        &self,
        s: sim::ir::StageId,
        mb: sim::ir::MicrobatchId,
        kind: sim::ir::ActionKind,
    ) -> u64 {
        delegate!(self, c => c.comm_ns(s, mb, kind))
    }
    fn activation(&self, s: sim::ir::StageId, mb: sim::ir::MicrobatchId) -> (f64, f64) {
        delegate!(self, c => c.activation(s, mb))
    }
    fn optimizer_ns(&self, r: sim::ir::Rank) -> u64 {
        delegate!(self, c => c.optimizer_ns(r))
    }
    fn memory_unit(&self) -> sim::MemoryUnit {
        delegate!(self, c => c.memory_unit())
    }
}

/// One compared schedule under uniform costs: its name, stages per rank, schedule, metrics,
/// and its full simulation (timeline and memory levels) when an output draws it.
struct UniformRun {
    name: String,
    v: u32,
    schedule: sim::Schedule,
    metrics: sim::Metrics,
    simulation: Option<Simulation>,
}

impl UniformRun {
    /// Validates and replays `schedule` under `costs` ([`simulate_run`]).
    ///
    /// # Errors
    /// The schedule's validation error or a deadlock.
    fn simulated<C: sim::CostModel>(
        name: String,
        v: u32,
        schedule: sim::Schedule,
        costs: &C,
        keep_timeline: bool,
    ) -> Result<Self> {
        let (metrics, simulation) = simulate_run(&schedule, costs, keep_timeline)?;
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
fn needs_timeline(a: &SimulateArgs) -> bool {
    super::chart_path(&a.gantt, "flatpipe-gantt.png").is_some()
        || a.trace.is_some()
        || a.memory.is_some()
}

/// Validates and replays `schedule`: the full [`Simulation`] when `keep_timeline`, else the
/// metrics alone.
///
/// # Errors
/// The schedule's validation error or a deadlock.
fn simulate_run<C: sim::CostModel>(
    schedule: &sim::Schedule,
    costs: &C,
    keep_timeline: bool,
) -> Result<(sim::Metrics, Option<Simulation>)> {
    if keep_timeline {
        let simulation = sim::simulate(schedule, costs)?;
        Ok((simulation.metrics.clone(), Some(simulation)))
    } else {
        schedule.validate()?;
        Ok((
            sim::replay::summary::metrics_without_timeline(schedule, costs)?,
            None,
        ))
    }
}

/// One step's makespan in seconds, without a timeline.
fn makespan_s<C: sim::CostModel>(schedule: &sim::Schedule, costs: &C) -> Result<f64> {
    Ok(simulate_run(schedule, costs, false)?.0.makespan_s)
}

pub(super) fn simulate_uniform(
    a: &SimulateArgs,
    spec: &CostsArg,
    schedules: Schedules,
) -> Result<ExitCode> {
    let built: Vec<(String, u32, sim::Schedule)> = match schedules {
        Schedules::Csv(s) => vec![(s.name.clone(), s.num_stages() / s.placement.num_ranks, s)],
        Schedules::Kinds(kinds) => {
            let p = a.pp.unwrap_or(4);
            // One count for the whole comparison: the deepest interleaving's p·v.
            let v_max = kinds
                .iter()
                .map(|k| k.stages_per_rank(a.vpp))
                .collect::<std::result::Result<Vec<_>, _>>()?
                .into_iter()
                .max()
                .unwrap_or(1);
            let m = a.microbatches.unwrap_or(default_microbatches(p, v_max));
            let pairs: f64 = kinds
                .iter()
                .map(|k| Ok(f64::from(p) * f64::from(k.stages_per_rank(a.vpp)?) * f64::from(m)))
                .sum::<Result<f64>>()?;
            super::check_schedule_memory(
                &format!(
                    "--microbatches {m} with --pp {p} and {} schedule(s)",
                    kinds.len()
                ),
                pairs,
            )?;
            kinds
                .iter()
                .map(|k| {
                    let v = k.stages_per_rank(a.vpp)?;
                    warn_underfilled(k.name(), m, p, v);
                    // Every kind through the one building contract; only zb-auto reads the
                    // costs and the activation limit.
                    let units = a.max_activation_units.unwrap_or(p as f64);
                    if a.max_activation_units.is_some() && !(units.is_finite() && units > 0.0) {
                        bail!("--max-activation-units = {units} is invalid: > 0 units (1F1B's rank 0 holds p)");
                    }
                    let costs = spec.model(&k.placement_on(p, v)?)?;
                    let s = k.build_for(p, v, m, &costs, units, a.zb_objective.into())?;
                    Ok((k.name().to_string(), v, s))
                })
                .collect::<Result<_>>()?
        }
    };
    let m = match &built[..] {
        [(_, _, s), ..] => s.num_microbatches,
        [] => 0,
    };
    let k = a.fo.spec()?.map_or(0, |f| f.microbatches.unwrap_or(m));
    // Every action one after the other bounds the makespan; it must stay well inside u64
    // nanoseconds (1.8e10 s): the training work and the forward-only work (Fo costs f unless
    // given).
    if let [(_, _, s), ..] = &built[..] {
        let p = s.placement.num_ranks;
        let (train_s, fo_s) = spec.serial_s();
        let serial_s = f64::from(p) * (f64::from(m) * train_s + f64::from(k) * fo_s);
        if serial_s > 1e10 {
            bail!(
                "--costs with --pp {p}, {m} microbatches and {k} forward-only microbatches: a step could last up to {serial_s:.3e} s, beyond the simulator's range of 1e10 s (time is counted in u64 nanoseconds); use smaller costs or fewer microbatches"
            );
        }
    }
    let keep_timeline = needs_timeline(a);
    let mut runs = Vec::new();
    let mut fo_reports = std::collections::HashMap::new();
    for (name, v, train) in built {
        let costs = spec.model(&train.placement)?;
        let schedule = if k > 0 {
            let t_train = makespan_s(&train, &costs)?;
            let pass = sim::schedules::forward_only::forward_only_pass(&train, k);
            let t_fo = makespan_s(&pass, &costs)?;
            let combined = sim::schedules::forward_only::with_forward_only(
                &train,
                k,
                a.fo.fo_mode,
                a.fo.fo_loss_dependency,
                &costs,
            )?;
            let t = makespan_s(&combined, &costs)?;
            fo_reports.insert(
                name.clone(),
                FoReport {
                    fo_microbatches: k,
                    fo_mode: a.fo.fo_mode,
                    fo_loss_dependency: a.fo.fo_loss_dependency,
                    train_only_s: t_train,
                    fo_separate_s: t_fo,
                    fo_hidden_fraction: (t_train + t_fo - t) / t_fo,
                },
            );
            combined
        } else {
            train
        };
        runs.push(UniformRun::simulated(
            name,
            v,
            schedule,
            &costs,
            keep_timeline,
        )?);
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
            let (name, v, s) = (&run.name, &run.v, &run.schedule);
            let consecutive_steps = match a.consecutive_steps {
                Some(k) => {
                    let costs = spec.model(&s.placement)?;
                    let steady = |sync| -> Result<f64> {
                        Ok(sim::costs::ns_to_s(
                            sim::replay::multistep::consecutive_steps(s, &costs, k, sync)?
                                .steady_state_step_ns,
                        ))
                    };
                    Some(ConsecutiveReport {
                        steps: k,
                        global_sync_step_s: steady(sim::replay::multistep::StepSync::Global)?,
                        post_validation_step_s: steady(
                            sim::replay::multistep::StepSync::PostValidation,
                        )?,
                    })
                }
                None => None,
            };
            Ok(Report {
                schedule: name.clone(),
                pp: s.placement.num_ranks,
                vpp: *v,
                microbatches: s.num_microbatches,
                metrics: run.metrics.clone(),
                forward_only: fo_reports.get(name).cloned(),
                consecutive_steps,
            })
        })
        .collect::<Result<_>>()?;
    let charts: Vec<_> = runs
        .iter()
        .filter_map(|r| {
            let sim = r.simulation.as_ref()?;
            Some((
                r.name.clone(),
                gantt_title(&r.name, &r.schedule, r.v, &r.metrics),
                sim,
            ))
        })
        .collect();
    let mut notes = write_charts(a, &charts)?;
    notes.extend(exact_notes);
    let m = runs.first().map_or(0, |r| r.schedule.num_microbatches);
    let header = format!("{spec} (one rank's share per microbatch), {m} microbatches");
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
    if k > 0 {
        cols.extend(["train only", "fo separate", "fo hidden"]);
    }
    if a.consecutive_steps.is_some() {
        cols.extend(["steady step, sync", "steady step, post-validation"]);
    }
    let mut t = new_table(&cols);
    for r in &reports {
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
    emit(a.format, &reports, &header, &t, &notes)
}

/// `--exact SECONDS`: solves for the optimal schedule on zb-auto's placement (or the CSV
/// schedule's), starting from the fastest compared schedule of that placement within the
/// limit, adds it as a row and returns the notes that say what was proved.
fn exact_row(
    a: &SimulateArgs,
    spec: &CostsArg,
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
    runs.push(UniformRun::simulated(
        name,
        v,
        schedule,
        &costs,
        keep_timeline,
    )?);
    Ok(vec![note])
}

/// A comparison on a profile, resolved from the flags and an optional plan file: every default
/// decided here, once.
struct Comparison {
    plan: Option<Plan>,
    profile: Profile,
    workload: Workload,
    size: StepSize,
    seed: u64,
    steps: u32,
    /// Exactly this many microbatches per step (else the token budget).
    microbatches: Option<u32>,
    token_budget: u64,
    policies: Vec<Policy>,
    capacities: Vec<Capacity>,
    /// Ranks per pipeline.
    p: u32,
    /// Tensor-parallel degree and sequence parallelism (`profile` is then one GPU's).
    tp: (u32, bool),
    /// The profile before tensor parallelism (what a plan file's hash names).
    base_profile: Profile,
    /// Per-rank memory limit, bytes, and where it comes from in the user's words.
    limit: f64,
    limit_source: String,
    /// One configuration per (schedule, policy, capacity).
    configs: Vec<flatpipe_simulator::run::config::RunConfig>,
}

/// Resolves `simulate`'s flags and plan file into a [`Comparison`].
fn resolve_comparison(a: &SimulateArgs, schedules: Schedules) -> Result<Comparison> {
    let plan = read_plan(a.plan.as_deref())?;
    fn pick<'a>(from_plan: Option<&'a String>, from_args: &'a Option<String>) -> Option<&'a str> {
        from_plan.or(from_args.as_ref()).map(String::as_str)
    }
    let profile = resolve_profile(
        pick(
            plan.as_ref().and_then(|p| p.profile.as_ref()),
            &a.inputs.profile,
        ),
        pick(
            plan.as_ref().and_then(|p| p.model.as_ref()),
            &a.inputs.model,
        ),
        pick(
            plan.as_ref().and_then(|p| p.hardware.as_ref()),
            &a.inputs.hardware,
        ),
    )?;
    let workload_name = a
        .inputs
        .workload
        .clone()
        .or_else(|| plan.as_ref().map(|p| p.workload.clone()))
        .unwrap_or_else(|| builtins::DEFAULT_WORKLOAD.to_string());
    let mut workload = builtins::workload(&workload_name)?;
    if let Some(q) = a.keep_prob {
        workload.keep_probability = Some(q);
        workload.validate("--keep-prob")?;
    }
    if let (Some(p), Some(path)) = (&plan, &a.plan) {
        p.validate(&path.display().to_string(), profile.layers.len())?;
    }
    let tp = match &plan {
        Some(p) => p.tensor_parallel(),
        None => (a.tp.unwrap_or(1), !a.no_sequence_parallel),
    };
    let base_profile = profile.clone();
    let profile = match &a.plan {
        // A plan file's tp: its error names the file, not a flag.
        Some(path) => profile
            .tensor_parallel(tp.0, tp.1)
            .map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?,
        None => profile.tensor_parallel(tp.0, tp.1)?,
    };
    let sharding = match &a.sharding {
        Some(m) => m
            .trim()
            .parse::<sim::costs::sharding::Sharding>()
            .map_err(|e| anyhow::anyhow!("--sharding: {e}"))?,
        None => Default::default(),
    };
    let size = resolve::step_size(a.seqs_per_step, a.tokens_per_step, plan.as_ref(), &workload)?;
    let seed = a
        .seed
        .or(plan.as_ref().map(|p| p.seed))
        .unwrap_or(workload.seed);
    let steps = a.steps.unwrap_or(1);
    if steps == 0 {
        bail!("--steps = 0 is invalid: >= 1 step");
    }
    let csv_m = match &schedules {
        Schedules::Csv(s) => Some(s.num_microbatches),
        Schedules::Kinds(_) => None,
    };
    if csv_m.is_some() && !a.capacity.is_empty() {
        bail!(
            "--capacity cannot be combined with --schedule-csv: a loaded schedule has the fixed capacity of its microbatch count"
        );
    }
    // The plan file's run, when there is one: the flags below only vary it.
    let base = plan.as_ref().map(Plan::run_config).transpose()?;
    let (microbatches, token_budget) = match &base {
        Some(c) => (c.params.microbatches, c.params.token_budget),
        None => (
            a.microbatches.or(csv_m),
            a.token_budget
                .unwrap_or(sim::batching::policy::DEFAULT_TOKEN_BUDGET),
        ),
    };
    let params = PolicyParams {
        token_budget,
        microbatches,
        pack_len: a.pack_len.unwrap_or(4096),
        max_seq_len: a.max_seq_len,
        chunk_tokens: a
            .chunk_tokens
            .or(base.as_ref().and_then(|c| c.params.chunk_tokens)),
    };
    let policies: Vec<Policy> = if a.policy.is_empty() {
        vec![base.as_ref().map_or(Policy::FlatFfd, |c| c.policy)]
    } else {
        dedup(
            a.policy
                .iter()
                .map(|x| x.parse())
                .collect::<Result<Vec<Policy>, _>>()?,
        )
    };
    let capacities: Vec<Capacity> = if a.capacity.is_empty() {
        vec![Capacity::Dynamic]
    } else {
        dedup(
            a.capacity
                .iter()
                .map(|x| x.parse())
                .collect::<Result<Vec<Capacity>, _>>()?,
        )
    };
    // One per-rank memory limit for building zb-auto and checking every row: --memory-limit,
    // else the plan file's (the one it was searched under), else the hardware's.
    let (limit, limit_source) = match (
        &a.memory_limit,
        base.as_ref().and_then(|c| c.memory_limit_bytes),
    ) {
        (Some(text), _) => (
            memory_limit(Some(text), &profile)?,
            format!("--memory-limit {text}"),
        ),
        (None, Some(bytes)) => (bytes, "the plan file's memory limit".to_string()),
        (None, None) => (
            memory_limit(None, &profile)?,
            format!("{}'s memory less its reserve", profile.hardware.name),
        ),
    };
    let p = match (&schedules, &base) {
        (Schedules::Csv(s), _) => s.placement.num_ranks,
        (_, Some(c)) => c.pp,
        _ => a.pp.unwrap_or(4),
    };
    if p == 0 {
        bail!("--pp = 0 is invalid: >= 1 rank");
    }
    let sources: Vec<(ScheduleSource, u32)> = match (schedules, &base) {
        (Schedules::Csv(s), _) => {
            let v = s.num_stages() / s.placement.num_ranks;
            vec![(ScheduleSource::Given(s), v)]
        }
        (_, Some(c)) => vec![(c.source.clone(), c.v)],
        (Schedules::Kinds(kinds), None) => kinds
            .into_iter()
            .map(|k| Ok((ScheduleSource::Kind(k), k.stages_per_rank(a.vpp)?)))
            .collect::<Result<_>>()?,
    };
    let mut combos = Vec::new();
    for (source, v) in sources {
        let stages = match (&base, &source) {
            (Some(c), _) => c.stages.clone(),
            (None, ScheduleSource::Given(s)) => {
                even_split(profile.layers.len(), s.num_stages() as usize)?
            }
            (None, ScheduleSource::Kind(_)) => even_split(profile.layers.len(), (p * v) as usize)?,
        };
        for &policy in &policies {
            for &capacity in &capacities {
                let mut combo = flatpipe_simulator::run::config::RunConfig::new(
                    source.clone(),
                    p,
                    v,
                    stages.clone(),
                    policy,
                    capacity,
                );
                combo.params = params;
                combo.dp = a.dp.unwrap_or(1);
                combo.sharding = sharding;
                if let Some(c) = &base {
                    combo.dp = c.dp;
                    combo.recompute = c.recompute.clone();
                    combo.sharding = c.sharding;
                }
                combo.memory_limit_bytes = Some(limit);
                // The options' forward-only work, else the plan's (an explicit 0 drops it).
                combo.forward_only = match a.fo.fo_microbatches {
                    Some(_) => a.fo.spec()?,
                    None => base.as_ref().and_then(|c| c.forward_only),
                };
                combos.push(combo);
            }
        }
    }
    if let Some(m) = microbatches {
        let pairs: f64 = combos
            .iter()
            .map(|c| f64::from(p) * f64::from(c.v) * f64::from(m))
            .sum();
        super::check_schedule_memory(
            &format!(
                "--microbatches {m} with --pp {p} and {} schedule(s)",
                combos.len()
            ),
            pairs,
        )?;
    }
    super::check_monte_carlo_memory("the Monte Carlo", &workload, seed, size, steps, 0, &combos)?;
    if let Some(c) = combos.first() {
        base_profile
            .hardware
            .check_gpus(u64::from(tp.0) * u64::from(c.dp.max(1)) * u64::from(p))?;
    }
    Ok(Comparison {
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
        configs: combos,
    })
}

pub(super) fn simulate_profile(a: &SimulateArgs, schedules: Schedules) -> Result<ExitCode> {
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
type Row = (McReport, Option<(sim::Schedule, Simulation)>, u32, u32);

/// The comparison's rows, in the configurations' order: each configuration's summary over the
/// steps, checked against the per-rank memory `limit` (bytes), with one step's metrics when a
/// single step ran as one round.
fn comparison_rows(
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
fn comparison_table(reports: &[&McReport], steps: u32) -> PlainTable {
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
fn memory_cell(r: &McReport) -> String {
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
fn plan_comparison(
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
