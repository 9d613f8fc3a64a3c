//! Command-line parsing and the subcommands.

use anyhow::{Result, bail};
use clap::{Args, Parser, Subcommand, ValueEnum};
use comfy_table::{Table, presets::UTF8_BORDERS_ONLY};
use flatpipe_planner as planner;
use flatpipe_profiles::{self as profiles, AnalyticOptions, Profile, StepSize, Workload, builtins};
use flatpipe_simulator::{
    self as sim, Microbatching, Plan, ScheduleKind, Simulation, UniformCostSpec, UniformCosts,
    montecarlo::{self, Capacity, ScheduleSource},
    plan::even_split,
    policy::{Policy, PolicyParams},
};
use serde::Serialize;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

/// flatpipe: profile, simulate, plan and execute pipeline-parallel LLM training.
#[derive(Debug, Parser)]
#[command(name = "flatpipe", version, about, long_about = None)]
struct Cli {
    /// Log more (repeat for more detail).
    #[arg(short, long, global = true, action = clap::ArgAction::Count)]
    verbose: u8,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Simulate pipeline schedules on one step of a workload and compare them.
    Simulate(Box<SimulateArgs>),
    /// Choose the fastest plan (dp x pp, v, schedule, token budget, layer split, recomputation)
    /// that fits the memory limit, and export it.
    Plan(Box<PlanArgs>),
    /// Generate a schedule, print its step-by-rank grid and optionally write PyTorch's CSV.
    Schedule(ScheduleArgs),
    /// List the built-in models, hardware, profiles and workloads.
    Builtins(BuiltinsArgs),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Format {
    Table,
    Json,
}

/// What a run is about: the model's costs and the input lengths (shared by simulate and plan).
#[derive(Debug, Args)]
struct Inputs {
    /// Cost profile: a YAML file or a built-in name such as llama3.1-8b@h200.
    #[arg(long, conflicts_with_all = ["model", "hardware"])]
    profile: Option<String>,
    /// Model (YAML file or built-in name); its analytic profile on --hardware is used.
    #[arg(long)]
    model: Option<String>,
    /// Hardware (YAML file or built-in name).
    #[arg(long)]
    hardware: Option<String>,
    /// Workload: a YAML file, a CSV file with a `tokens` column, or a built-in name.
    #[arg(long)]
    workload: Option<String>,
}

/// Options of `flatpipe simulate`.
#[derive(Debug, Args)]
struct SimulateArgs {
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
    /// zb-h2, zb-v, dualpipev) or `all` (the default).
    #[arg(long, value_delimiter = ',')]
    schedule: Vec<String>,
    /// Pipeline-parallel degree (ranks). Default 4.
    #[arg(long)]
    pp: Option<u32>,
    /// Stages per rank for interleaved schedules (default 2; V schedules always use 2).
    #[arg(long)]
    vpp: Option<u32>,
    /// Exactly this many microbatches, balanced by predicted cost.
    #[arg(long, conflicts_with = "token_budget")]
    microbatches: Option<u32>,
    /// The fewest microbatches of at most this many tokens (first-fit decreasing). Default 16384.
    #[arg(long)]
    token_budget: Option<u64>,
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
    /// flat-balanced.
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
    #[arg(long)]
    max_seq_len: Option<u32>,
    /// Keep each sampled sequence with this probability (an RL filter), so the sequence count
    /// per step varies.
    #[arg(long)]
    keep_prob: Option<f64>,
    /// Write a histogram of step times per policy (best schedule) here (.svg or .png).
    #[arg(long)]
    histogram: Option<PathBuf>,
    /// Uniform costs instead of a profile and workload: one rank's share of the model per
    /// microbatch in seconds, e.g. f=1,b=1,w=1,comm=0 (keys f, b, w, comm, fb, fo).
    #[arg(long, conflicts_with_all = ["profile", "model", "hardware", "workload", "plan", "token_budget", "seqs_per_step", "tokens_per_step", "policy", "capacity", "pack_len", "max_seq_len", "keep_prob", "histogram"])]
    costs: Option<String>,
    /// Seed of the step sampler (default: the workload's, 0). Printed.
    #[arg(long)]
    seed: Option<u64>,
    /// Write the Gantt chart of the best schedule here (.svg or .png); with several schedules,
    /// each one's also goes to <stem>-<schedule>.<ext>. Default flatpipe-gantt.png.
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

/// What `plan --export` writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum ExportFormat {
    Torchtitan,
    Megatron,
    PytorchCsv,
}

/// Options of `flatpipe plan`.
#[derive(Debug, Args)]
struct PlanArgs {
    #[command(flatten)]
    inputs: Inputs,
    /// Ranks in all (dp x pp). Default 8 (one 8-GPU node).
    #[arg(long, default_value_t = 8)]
    ranks: u32,
    /// Memory limit per rank, e.g. 120GiB (default: the hardware's memory minus a 4 GiB
    /// reserve for the CUDA context, communication buffers and fragmentation).
    #[arg(long)]
    memory_limit: Option<String>,
    /// Pipeline degrees to try, comma-separated (default: every divisor of --ranks).
    #[arg(long, value_delimiter = ',')]
    pp: Vec<u32>,
    /// Stages per rank to try for interleaved schedules (default 2,4).
    #[arg(long, value_delimiter = ',')]
    vpp: Vec<u32>,
    /// Schedules to try (default: every handcrafted schedule).
    #[arg(long, value_delimiter = ',')]
    schedule: Vec<String>,
    /// Token budgets per microbatch to try (default 4096,8192,16384,32768,65536,131072).
    #[arg(long, value_delimiter = ',')]
    token_budgets: Vec<u64>,
    /// Recomputation modes the split may use per stage (default none,selective,full).
    #[arg(long, value_delimiter = ',')]
    recompute: Vec<String>,
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
    #[arg(long, default_value = "mean", value_parser = ["mean", "p90"])]
    rank_by: String,
    /// Where memory forces a split away from the fastest one, also run the partition MILP
    /// (HiGHS, 0.5 s per candidate) instead of keeping the DP-based split and its certified gap.
    #[arg(long)]
    exact_split: bool,
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
    /// Write the Gantt chart of the chosen plan's first step here (default flatpipe-plan.png).
    #[arg(long)]
    gantt: Option<PathBuf>,
    /// Output format.
    #[arg(long, value_enum, default_value_t = Format::Table)]
    format: Format,
}

/// Options of `flatpipe schedule`.
#[derive(Debug, Args)]
struct ScheduleArgs {
    /// Schedule kind (gpipe, 1f1b, interleaved-1f1b, looped-bfs, zb-h1, zb-h2, zb-v, dualpipev).
    #[arg(long)]
    schedule: String,
    /// Pipeline-parallel degree (ranks).
    #[arg(long)]
    pp: u32,
    /// Stages per rank (interleaved schedules; default 2).
    #[arg(long)]
    vpp: Option<u32>,
    /// Microbatches per step.
    #[arg(long)]
    microbatches: u32,
    /// Write PyTorch's compute-only pipeline-order CSV here (atomically).
    #[arg(short, long)]
    output: Option<PathBuf>,
    /// Output format of the grid.
    #[arg(long, value_enum, default_value_t = Format::Table)]
    format: Format,
}

/// Options of `flatpipe builtins`.
#[derive(Debug, Args)]
struct BuiltinsArgs {
    /// Output format.
    #[arg(long, value_enum, default_value_t = Format::Table)]
    format: Format,
}

/// Parses the command line and runs the subcommand.
pub fn run() -> Result<ExitCode> {
    let cli = Cli::parse();
    let level = match cli.verbose {
        0 => "warn",
        1 => "info",
        _ => "debug",
    };
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| level.into()),
        )
        .with_writer(std::io::stderr)
        .with_target(false)
        .without_time()
        .init();
    match cli.command {
        Command::Simulate(a) => simulate(*a),
        Command::Plan(a) => plan_cmd(*a),
        Command::Schedule(a) => schedule_cmd(a),
        Command::Builtins(a) => list_builtins(a),
    }
}

/// Built-in profile names: `<model>@<hardware>` for every built-in pair.
fn builtin_profile_names() -> Vec<String> {
    builtins::MODELS
        .iter()
        .flat_map(|(m, _)| {
            builtins::HARDWARE
                .iter()
                .map(move |(h, _)| format!("{m}@{h}"))
        })
        .collect()
}

/// Resolves `--profile` (file or `model@hardware`) or `--model` + `--hardware` to a profile.
fn resolve_profile(
    profile: Option<&str>,
    model: Option<&str>,
    hardware: Option<&str>,
) -> Result<Profile> {
    if let Some(p) = profile {
        let path = Path::new(p);
        if path.is_file() {
            return Ok(Profile::from_yaml(&profiles::read_to_string(path)?, p)?);
        }
        if let Some((m, h)) = p.split_once('@') {
            return analytic(m, h);
        }
        bail!(
            "unknown profile `{p}`: no such file and no such built-in (built-ins: {})",
            builtin_profile_names().join(", ")
        );
    }
    analytic(
        model.unwrap_or(builtins::DEFAULT_MODEL),
        hardware.unwrap_or(builtins::DEFAULT_HARDWARE),
    )
}

fn analytic(model: &str, hardware: &str) -> Result<Profile> {
    let m = builtins::model(model)?;
    let h = builtins::hardware(hardware)?;
    Ok(profiles::analytic_profile(
        &m,
        &h,
        &AnalyticOptions::default(),
    )?)
}

fn parse_kinds(names: &[String]) -> Result<Vec<ScheduleKind>> {
    if names.is_empty() || names.iter().any(|n| n.trim() == "all") {
        return Ok(ScheduleKind::ALL.to_vec());
    }
    let mut kinds = Vec::new();
    for n in names {
        let k: ScheduleKind = n.parse()?;
        if !kinds.contains(&k) {
            kinds.push(k);
        }
    }
    Ok(kinds)
}

/// One row of `simulate --costs`'s output (`--format json` prints a list of these).
#[derive(Debug, Serialize)]
struct Report {
    schedule: String,
    pp: u32,
    vpp: u32,
    microbatches: u32,
    #[serde(flatten)]
    metrics: sim::Metrics,
}

/// The single-step fields of a profile-driven row (when one step ran as one round).
#[derive(Debug, Serialize)]
struct SingleStep {
    microbatches: u32,
    #[serde(flatten)]
    metrics: sim::Metrics,
}

/// One row of `simulate`'s output with a profile: one (schedule, policy, capacity).
#[derive(Debug, Serialize)]
struct McReport {
    schedule: String,
    policy: String,
    capacity: String,
    pp: u32,
    vpp: u32,
    #[serde(flatten)]
    summary: montecarlo::Summary,
    #[serde(flatten)]
    single: Option<SingleStep>,
}

/// The schedules a `simulate` call compares: generated kinds, or one loaded from a CSV file.
enum Schedules {
    Kinds(Vec<ScheduleKind>),
    Csv(sim::Schedule),
}

fn simulate(a: SimulateArgs) -> Result<ExitCode> {
    let schedules = match &a.schedule_csv {
        Some(path) => {
            let text = profiles::read_to_string(path)?;
            Schedules::Csv(sim::pytorch_csv::read_pytorch_csv(
                &text,
                &path.display().to_string(),
            )?)
        }
        None => Schedules::Kinds(parse_kinds(&a.schedule)?),
    };
    match &a.costs {
        Some(_) if a.steps.is_some_and(|n| n > 1) => {
            bail!(
                "the argument '--costs' cannot be used with '--steps' > 1: uniform costs describe one step"
            )
        }
        Some(spec) => simulate_uniform(&a, &spec.parse()?, schedules),
        None => simulate_profile(&a, schedules),
    }
}

/// Writes the Gantt chart(s) and trace a `simulate` call asked for; returns notes to print.
fn write_charts(a: &SimulateArgs, runs: &[(String, String, &Simulation)]) -> Result<Vec<String>> {
    let mut notes = Vec::new();
    let Some((best_name, best_title, best_sim)) = runs.first() else {
        return Ok(notes);
    };
    let best = &best_sim.timeline;
    let gantt = a
        .gantt
        .clone()
        .unwrap_or_else(|| PathBuf::from("flatpipe-gantt.png"));
    sim::gantt::write_gantt(&gantt, best_title, best)?;
    notes.push(format!("Gantt chart of {best_name}: {}", gantt.display()));
    if a.gantt.is_some() && runs.len() > 1 {
        for (name, title, s) in runs {
            let path = sibling(&gantt, &sanitize(name));
            sim::gantt::write_gantt(&path, title, &s.timeline)?;
            notes.push(format!("Gantt chart of {name}: {}", path.display()));
        }
    }
    if let Some(path) = &a.trace {
        let doc = sim::trace::chrome_trace(best);
        profiles::write_atomic(path, serde_json::to_string(&doc)?.as_bytes())?;
        notes.push(format!("Chrome trace of {best_name}: {}", path.display()));
        if runs.len() > 1 {
            for (name, _, s) in runs {
                let path = sibling(path, &sanitize(name));
                let doc = sim::trace::chrome_trace(&s.timeline);
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

fn gantt_title(name: &str, schedule: &sim::Schedule, v: u32, m: &sim::Metrics) -> String {
    format!(
        "{name}  p={} v={v} m={}  makespan {}  bubble {:.1}%",
        schedule.placement.num_ranks,
        schedule.num_microbatches,
        fmt_s(m.makespan_s),
        100.0 * m.bubble_ratio
    )
}

fn peak_of(m: &sim::Metrics) -> f64 {
    m.ranks
        .iter()
        .map(|x| {
            x.peak_activation_bytes
                .or(x.peak_activation_units)
                .unwrap_or(0.0)
        })
        .fold(0.0, f64::max)
}

fn simulate_uniform(
    a: &SimulateArgs,
    spec: &UniformCostSpec,
    schedules: Schedules,
) -> Result<ExitCode> {
    let built: Vec<(String, u32, sim::Schedule)> = match schedules {
        Schedules::Csv(s) => vec![(s.name.clone(), s.num_stages() / s.placement.num_ranks, s)],
        Schedules::Kinds(kinds) => {
            let p = a.pp.unwrap_or(4);
            let m = a.microbatches.unwrap_or(p);
            kinds
                .iter()
                .map(|k| {
                    let v = k.stages_per_rank(a.vpp)?;
                    Ok((k.name().to_string(), v, k.generate(p, v, m)?))
                })
                .collect::<Result<_>>()?
        }
    };
    let mut runs = Vec::new();
    for (name, v, schedule) in built {
        let sim = sim::simulate(&schedule, &UniformCosts::new(spec, v))?;
        runs.push((name, v, schedule, sim));
    }
    runs.sort_by(|x, y| {
        let (a, b) = (&x.3.metrics, &y.3.metrics);
        a.makespan_s
            .total_cmp(&b.makespan_s)
            .then(peak_of(a).total_cmp(&peak_of(b)))
            .then(x.0.cmp(&y.0))
    });
    let reports: Vec<Report> = runs
        .iter()
        .map(|(name, v, s, sim)| Report {
            schedule: name.clone(),
            pp: s.placement.num_ranks,
            vpp: *v,
            microbatches: s.num_microbatches,
            metrics: sim.metrics.clone(),
        })
        .collect();
    let charts: Vec<_> = runs
        .iter()
        .map(|(n, v, s, sim)| (n.clone(), gantt_title(n, s, *v, &sim.metrics), sim))
        .collect();
    let notes = write_charts(a, &charts)?;
    let m = runs.first().map_or(0, |r| r.2.num_microbatches);
    let header = format!(
        "uniform costs f={} b={} w={} comm={} s (one rank's share per microbatch), {m} microbatches",
        spec.f, spec.b, spec.w, spec.comm
    );
    let mut t = new_table(&[
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
    ]);
    for r in &reports {
        let m = &r.metrics;
        let inflight = m
            .ranks
            .iter()
            .map(|x| x.peak_inflight_microbatches)
            .max()
            .unwrap_or(0);
        t.add_row([
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
        ]);
    }
    emit(a.format, &reports, &header, &t, &notes)
}

fn emit<T: Serialize>(
    format: Format,
    reports: &T,
    header: &str,
    table: &Table,
    notes: &[String],
) -> Result<ExitCode> {
    match format {
        Format::Json => {
            println!("{}", serde_json::to_string_pretty(reports)?);
            eprintln!("{header}");
            for n in notes {
                eprintln!("{n}");
            }
        }
        Format::Table => {
            println!("{header}");
            println!("{table}");
            for n in notes {
                println!("{n}");
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn new_table(header: &[&str]) -> Table {
    let mut t = Table::new();
    t.load_preset(UTF8_BORDERS_ONLY);
    t.set_header(header.to_vec());
    t
}

fn pct(x: f64) -> String {
    format!("{:.1}%", 100.0 * x)
}

fn simulate_profile(a: &SimulateArgs, schedules: Schedules) -> Result<ExitCode> {
    let plan = match &a.plan {
        Some(path) => Some(Plan::from_yaml(
            &profiles::read_to_string(path)?,
            &path.display().to_string(),
        )?),
        None => None,
    };
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
    let size = step_size(a, plan.as_ref(), &workload)?;
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
    let (microbatches, token_budget) = match &plan {
        Some(pl) => match pl.microbatching()? {
            Microbatching::Microbatches(m) => (Some(m), 16_384),
            Microbatching::TokenBudget(t) => (None, t),
        },
        None => (a.microbatches.or(csv_m), a.token_budget.unwrap_or(16_384)),
    };
    let params = PolicyParams {
        token_budget,
        microbatches,
        pack_len: a.pack_len.unwrap_or(4096),
        max_seq_len: a.max_seq_len,
    };
    let policies: Vec<Policy> = if a.policy.is_empty() {
        match plan.as_ref().and_then(|pl| pl.policy.as_ref()) {
            Some(name) => vec![name.parse()?],
            None => vec![Policy::FlatFfd],
        }
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
    let p = match (&schedules, &plan) {
        (Schedules::Csv(s), _) => s.placement.num_ranks,
        (_, Some(pl)) => pl.pp,
        _ => a.pp.unwrap_or(4),
    };
    if p == 0 {
        bail!("--pp = 0 is invalid: >= 1 rank");
    }
    let sources: Vec<(ScheduleSource, u32)> = match (schedules, &plan) {
        (Schedules::Csv(s), _) => {
            let v = s.num_stages() / s.placement.num_ranks;
            vec![(ScheduleSource::Given(s), v)]
        }
        (_, Some(pl)) => vec![(
            ScheduleSource::Kind(pl.schedule),
            pl.schedule.stages_per_rank(pl.vpp)?,
        )],
        (Schedules::Kinds(kinds), None) => kinds
            .into_iter()
            .map(|k| Ok((ScheduleSource::Kind(k), k.stages_per_rank(a.vpp)?)))
            .collect::<Result<_>>()?,
    };
    let mut combos = Vec::new();
    for (source, v) in sources {
        let stages = match (&plan, &source) {
            (Some(pl), _) => pl.stage_ranges(),
            (None, ScheduleSource::Given(s)) => {
                even_split(profile.layers.len(), s.num_stages() as usize)?
            }
            (None, ScheduleSource::Kind(_)) => even_split(profile.layers.len(), (p * v) as usize)?,
        };
        for &policy in &policies {
            for &capacity in &capacities {
                let mut combo =
                    montecarlo::Combo::new(source.clone(), v, stages.clone(), policy, capacity);
                if let Some(pl) = &plan {
                    combo.dp = pl.dp.unwrap_or(1);
                    combo.recompute = pl.recompute.clone();
                }
                combos.push(combo);
            }
        }
    }
    let bar = Progress::new(steps as u64);
    let mc = montecarlo::run(
        &profile,
        &workload,
        seed,
        size,
        steps,
        p,
        &params,
        &combos,
        &|| bar.inc(),
    )?;
    bar.finish();
    if mc.oversize_sequences > 0 {
        tracing::warn!(
            "{} sequence(s) longer than the token budget {token_budget} got a microbatch of their own",
            mc.oversize_sequences
        );
    }
    if mc.truncated_tokens > 0 {
        tracing::warn!(
            "the padded policy truncated {} tokens at --max-seq-len",
            mc.truncated_tokens
        );
    }
    type Row = (McReport, Option<(sim::Schedule, Simulation)>, u32);
    let mut rows: Vec<Row> = combos
        .iter()
        .zip(mc.outcomes.iter().zip(mc.first))
        .map(|(c, (outcomes, first))| {
            let single = if steps == 1 {
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
            let report = McReport {
                schedule: c.source.name(),
                policy: c.policy.to_string(),
                capacity,
                pp: p,
                vpp: c.v,
                summary: montecarlo::summarize(
                    outcomes,
                    p * c.dp.max(1),
                    profile.hardware.peak_flops,
                ),
                single,
            };
            (report, first, c.v)
        })
        .collect();
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
        .filter_map(|(r, first, v)| {
            first.as_ref().map(|(s, sim)| {
                let name = format!("{}-{}-{}", r.schedule, r.policy, r.capacity);
                let name =
                    if combos.len() == rows.len() && policies.len() == 1 && capacities.len() == 1 {
                        r.schedule.clone()
                    } else {
                        name
                    };
                (name.clone(), gantt_title(&name, s, *v, &sim.metrics), sim)
            })
        })
        .collect();
    let mut notes = write_charts(a, &charts)?;
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
        sim::histogram::write_histogram(path, &title, &series)?;
        notes.push(format!(
            "Histogram of step times of {best}: {}",
            path.display()
        ));
    }
    let n0 = mc.sequences_per_step[0];
    let header = format!(
        "{} on {} ({} profile), workload {} seed {seed}: {steps} step(s), {} sequences per step on average (step 0: {n0}), {}",
        profile.model,
        profile.hardware.name,
        format!("{:?}", profile.provenance.source).to_lowercase(),
        workload.name,
        mc.sequences_per_step.iter().sum::<usize>() as f64 / steps as f64,
        match microbatches {
            Some(m) => format!("{m} microbatches balanced by cost"),
            None => format!("token budget {token_budget}"),
        }
    );
    let reports: Vec<&McReport> = rows.iter().map(|r| &r.0).collect();
    let table = if steps == 1 {
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
            "tokens/s",
            "MFU",
        ]);
        for r in &reports {
            let s = &r.summary;
            let (lb, gap) = match &r.single {
                Some(x) => (
                    fmt_s(x.metrics.lower_bound_s),
                    format!("{:+.1}%", 100.0 * x.metrics.gap_to_lower_bound),
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
                format!("{:.0}", s.tokens_per_s),
                pct(s.mfu),
            ]);
        }
        t
    } else {
        let mut t = new_table(&[
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
            "mean m",
        ]);
        for r in &reports {
            let s = &r.summary;
            t.add_row([
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
                format!("{:.1}", s.microbatches_mean),
            ]);
        }
        t
    };
    emit(a.format, &reports, &header, &table, &notes)
}

fn dedup<T: PartialEq>(v: Vec<T>) -> Vec<T> {
    let mut out: Vec<T> = Vec::with_capacity(v.len());
    for x in v {
        if !out.contains(&x) {
            out.push(x);
        }
    }
    out
}

/// A progress bar on stderr that appears only once the work has run for a second.
struct Progress {
    bar: indicatif::ProgressBar,
    start: std::time::Instant,
    shown: std::sync::atomic::AtomicBool,
}

impl Progress {
    fn new(len: u64) -> Self {
        let bar = indicatif::ProgressBar::with_draw_target(
            Some(len),
            indicatif::ProgressDrawTarget::hidden(),
        );
        if let Ok(style) = indicatif::ProgressStyle::with_template(
            "{bar:40} {pos}/{len} steps  {elapsed} (eta {eta})",
        ) {
            bar.set_style(style);
        }
        Progress {
            bar,
            start: std::time::Instant::now(),
            shown: false.into(),
        }
    }

    fn inc(&self) {
        use std::sync::atomic::Ordering;
        if !self.shown.load(Ordering::Relaxed)
            && self.start.elapsed() > std::time::Duration::from_secs(1)
            && !self.shown.swap(true, Ordering::Relaxed)
        {
            self.bar
                .set_draw_target(indicatif::ProgressDrawTarget::stderr());
        }
        self.bar.inc(1);
    }

    fn finish(&self) {
        self.bar.finish_and_clear();
    }
}

/// A schedule name fit for a file name (a CSV schedule is named after its path).
fn sanitize(name: &str) -> String {
    name.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                c
            } else {
                '_'
            }
        })
        .collect()
}

/// `out.png` + `1f1b` -> `out-1f1b.png`.
fn sibling(path: &Path, tag: &str) -> PathBuf {
    let stem = path
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    let ext = path
        .extension()
        .map(|e| format!(".{}", e.to_string_lossy()))
        .unwrap_or_default();
    path.with_file_name(format!("{stem}-{tag}{ext}"))
}

fn step_size(a: &SimulateArgs, plan: Option<&Plan>, w: &Workload) -> Result<StepSize> {
    let seqs = a.seqs_per_step.or(plan.and_then(|p| p.seqs_per_step));
    let toks = a.tokens_per_step.or(plan.and_then(|p| p.tokens_per_step));
    Ok(match (seqs, toks) {
        (Some(0), _) => bail!("--seqs-per-step = 0 is invalid: >= 1 sequence"),
        (_, Some(0)) => bail!("--tokens-per-step = 0 is invalid: >= 1 token"),
        (Some(n), _) => StepSize::Seqs(n),
        (None, Some(t)) => StepSize::Tokens(t),
        (None, None) => w.default_step_size(),
    })
}

/// Cuts one step into flat microbatches; warns about sequences longer than the token budget.
/// Seconds with a unit that fits.
fn fmt_s(s: f64) -> String {
    if s >= 1.0 {
        format!("{s:.3} s")
    } else if s >= 1e-3 {
        format!("{:.3} ms", s * 1e3)
    } else {
        format!("{:.1} µs", s * 1e6)
    }
}

fn fmt_bytes(b: f64) -> String {
    format!("{:.2} GiB", b / (1u64 << 30) as f64)
}

/// The memory limit: `--memory-limit` parsed (e.g. `120GiB`, `80GB`, `1.5e11`), or the
/// hardware's memory minus a 4 GiB reserve.
fn memory_limit(arg: Option<&str>, profile: &Profile) -> Result<f64> {
    const RESERVE_BYTES: f64 = 4.0 * (1u64 << 30) as f64;
    match arg {
        None => Ok(profile.hardware.memory_bytes as f64 - RESERVE_BYTES),
        Some(text) => {
            let bytes = match text.trim().parse::<f64>() {
                Ok(b) => b,
                Err(_) => text
                    .trim()
                    .parse::<bytesize::ByteSize>()
                    .map_err(|e| anyhow::anyhow!("--memory-limit `{text}` is invalid: {e} (e.g. 120GiB, 80GB or a number of bytes)"))?
                    .as_u64() as f64,
            };
            if !(bytes.is_finite() && bytes > 0.0) {
                bail!("--memory-limit `{text}` is invalid: a positive amount of memory");
            }
            Ok(bytes)
        }
    }
}

fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::Digest;
    sha2::Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn workload_hash(w: &Workload) -> Result<String> {
    let mut bytes = serde_yaml::to_string(w)?.into_bytes();
    if let profiles::LengthDistribution::Empirical { samples, .. } = &w.lengths {
        for s in samples.iter() {
            bytes.extend_from_slice(&s.to_le_bytes());
        }
    }
    Ok(sha256_hex(&bytes))
}

/// One row of `plan`'s output.
#[derive(Debug, Serialize)]
struct PlanRow {
    rank: usize,
    #[serde(flatten)]
    candidate: planner::search::Candidate,
    stages: Vec<[usize; 2]>,
    recompute: Vec<sim::costs::Recompute>,
    gap_to_lower_bound: f64,
}

fn plan_cmd(a: PlanArgs) -> Result<ExitCode> {
    use planner::search::{RankBy, SearchConfig, SearchSpace};
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
    if a.keep == 0 {
        bail!("--keep = 0 is invalid: >= 1 plan");
    }
    let size = match (a.seqs_per_step, a.tokens_per_step) {
        (Some(0), _) => bail!("--seqs-per-step = 0 is invalid: >= 1 sequence"),
        (_, Some(0)) => bail!("--tokens-per-step = 0 is invalid: >= 1 token"),
        (Some(n), _) => StepSize::Seqs(n),
        (None, Some(t)) => StepSize::Tokens(t),
        (None, None) => workload.default_step_size(),
    };
    let seed = a.seed.unwrap_or(workload.seed);
    let config = SearchConfig {
        steps: a.steps,
        seed,
        size,
        memory_limit_bytes: limit,
        static_bytes: Default::default(),
        rank_by: if a.rank_by == "p90" {
            RankBy::P90
        } else {
            RankBy::Mean
        },
        keep: a.keep,
        milp_time_limit_s: a
            .exact_split
            .then_some(planner::partition::MILP_TIME_LIMIT_S),
    };
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
    let result = planner::search::search(&profile, &workload, &space, &config, &progress)?;
    if let Some(pb) = bar.lock().expect("progress lock").take() {
        pb.finish_and_clear();
    }
    let best = &result.ranked[0];
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
    let plan = Plan {
        model: model_ref,
        hardware: hardware_ref,
        profile: a.inputs.profile.clone(),
        workload: workload_name.clone(),
        dp: Some(best.dp),
        pp: best.pp,
        vpp: Some(best.vpp),
        placement: best.schedule.placement(),
        schedule: best.schedule,
        stages: best
            .partition
            .stages
            .iter()
            .map(|r| sim::plan::StageLayers {
                start: r.start,
                end: r.end,
            })
            .collect(),
        microbatches: None,
        token_budget: Some(best.token_budget),
        seqs_per_step: a.seqs_per_step,
        tokens_per_step: a.tokens_per_step,
        policy: Some(space.policy.to_string()),
        recompute: best.partition.recompute.clone(),
        seed,
        predicted: Some(sim::plan::Predicted {
            step_time_mean_s: best.summary.step_time_s.mean,
            step_time_p90_s: best.summary.step_time_s.p90,
            bubble_ratio: best.summary.bubble_ratio_mean,
            lower_bound_s: best.lower_bound_s,
            peak_memory_bytes: best.peak_memory_bytes.clone(),
            memory_limit_bytes: limit,
            steps: a.steps,
        }),
        provenance: Some(sim::plan::PlanProvenance {
            profile_sha256: sha256_hex(profile.to_yaml()?.as_bytes()),
            workload_sha256: workload_hash(&workload)?,
            flatpipe_version: env!("CARGO_PKG_VERSION").to_string(),
        }),
    };
    let mut notes = Vec::new();
    if let Some(path) = &a.output {
        profiles::write_atomic(path, plan.to_yaml()?.as_bytes())?;
        notes.push(format!(
            "Plan written to {} (run it: flatpipe simulate --plan {})",
            path.display(),
            path.display()
        ));
    }
    let m_typical = best.summary.microbatches_mean.round().max(1.0) as u32;
    let export_text = match a.export {
        None => None,
        Some(ExportFormat::Torchtitan) => Some((
            "torchtitan.toml",
            planner::export::torchtitan(&plan, &profile, m_typical, Some("schedule.csv"))?,
        )),
        Some(ExportFormat::Megatron) => {
            Some(("megatron.txt", planner::export::megatron(&plan, &profile)?))
        }
        Some(ExportFormat::PytorchCsv) => {
            let s = best.schedule.generate(best.pp, best.vpp, m_typical)?;
            Some((
                "pytorch.csv",
                sim::pytorch_csv::write_pytorch_csv(&s, false)?,
            ))
        }
    };
    let mut export_inline = None;
    if let Some((ext, text)) = &export_text {
        match &a.output {
            Some(path) => {
                let p = path.with_extension(ext);
                profiles::write_atomic(&p, text.as_bytes())?;
                notes.push(format!("Export written to {}", p.display()));
            }
            None => export_inline = Some(text.clone()),
        }
    }
    // Gantt of the chosen plan's first step (replica 0).
    let mut combo = montecarlo::Combo::new(
        ScheduleSource::Kind(best.schedule),
        best.vpp,
        best.partition.stages.clone(),
        space.policy,
        Capacity::Dynamic,
    );
    combo.dp = best.dp;
    combo.recompute = best.partition.recompute.clone();
    let params = PolicyParams {
        token_budget: best.token_budget,
        ..Default::default()
    };
    let first = montecarlo::run(
        &profile,
        &workload,
        seed,
        size,
        1,
        best.pp,
        &params,
        &[combo],
        &|| {},
    )?;
    if let Some((s, simulation)) = &first.first[0] {
        let gantt = a
            .gantt
            .clone()
            .unwrap_or_else(|| PathBuf::from("flatpipe-plan.png"));
        let title = format!(
            "chosen plan: {} dp={} (step 0, replica 0)",
            gantt_title(best.schedule.name(), s, best.vpp, &simulation.metrics),
            best.dp
        );
        sim::gantt::write_gantt(&gantt, &title, &simulation.timeline)?;
        notes.push(format!(
            "Gantt chart of the chosen plan: {}",
            gantt.display()
        ));
    }
    let header = format!(
        "{} on {} x {} ({} profile), workload {} seed {seed}, {} sampled steps, memory limit {:.1} GiB per rank: {} candidates evaluated, {} pruned by their lower bound, {} rejected",
        profile.model,
        a.ranks,
        profile.hardware.name,
        format!("{:?}", profile.provenance.source).to_lowercase(),
        workload.name,
        a.steps,
        gib(limit),
        result.evaluated,
        result.pruned,
        result.rejected.len()
    );
    match a.format {
        Format::Json => {
            let doc = serde_json::json!({
                "plans": rows,
                "chosen": plan,
                "rejected": result.rejected.iter().map(|(w, r)| serde_json::json!({"candidate": w, "reason": r})).collect::<Vec<_>>(),
                "export": export_inline,
            });
            println!("{}", serde_json::to_string_pretty(&doc)?);
            eprintln!("{header}");
            for n in &notes {
                eprintln!("{n}");
            }
        }
        Format::Table => {
            println!("{header}");
            let mut t = new_table(&[
                "#",
                "schedule",
                "dp",
                "pp",
                "v",
                "budget",
                "mean",
                "p90",
                "bubble",
                "lower bound",
                "gap",
                "peak mem (max rank)",
                "layers per stage",
                "recompute",
            ]);
            for r in &rows {
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
                    c.schedule.to_string(),
                    c.dp.to_string(),
                    c.pp.to_string(),
                    c.vpp.to_string(),
                    c.token_budget.to_string(),
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
            println!("{t}");
            println!(
                "chosen: {} (layers per stage {}), predicted mean step {} (p90 {})",
                best.describe(),
                best.partition
                    .stages
                    .iter()
                    .map(|x| x.len().to_string())
                    .collect::<Vec<_>>()
                    .join("/"),
                fmt_s(best.summary.step_time_s.mean),
                fmt_s(best.summary.step_time_s.p90)
            );
            if let Some(text) = &export_inline {
                println!("{text}");
            }
            for n in &notes {
                println!("{n}");
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// `none x6, full x2` (run-length counts of the per-stage modes, in stage order).
fn recompute_summary(modes: &[sim::costs::Recompute]) -> String {
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

fn schedule_cmd(a: ScheduleArgs) -> Result<ExitCode> {
    let kind: ScheduleKind = a.schedule.parse()?;
    let v = kind.stages_per_rank(a.vpp)?;
    let s = kind.generate(a.pp, v, a.microbatches)?;
    if let Some(path) = &a.output {
        profiles::write_atomic(
            path,
            sim::pytorch_csv::write_pytorch_csv(&s, false)?.as_bytes(),
        )?;
    }
    match a.format {
        Format::Json => {
            let ranks: Vec<Vec<String>> = s
                .ranks
                .iter()
                .map(|r| r.iter().map(ToString::to_string).collect())
                .collect();
            let doc = serde_json::json!({
                "schedule": kind.name(), "pp": a.pp, "vpp": v, "microbatches": a.microbatches,
                "placement": format!("{:?}", s.placement.kind).to_lowercase(), "ranks": ranks,
            });
            println!("{}", serde_json::to_string_pretty(&doc)?);
        }
        Format::Table => {
            println!(
                "{kind}: p={} v={v} m={} ({:?} placement)",
                a.pp, a.microbatches, s.placement.kind
            );
            print!("{}", s.grid());
        }
    }
    if let Some(path) = &a.output {
        eprintln!("wrote {}", path.display());
    }
    Ok(ExitCode::SUCCESS)
}

fn list_builtins(a: BuiltinsArgs) -> Result<ExitCode> {
    #[derive(Serialize)]
    struct Entry {
        kind: &'static str,
        name: String,
        description: String,
    }
    let mut out = Vec::new();
    for (name, _) in builtins::MODELS {
        let m = builtins::model(name)?;
        out.push(Entry {
            kind: "model",
            name: name.to_string(),
            description: format!(
                "{} decoder layers, {:.2}B parameters, {:?}",
                m.num_decoder_layers(),
                m.param_count() as f64 / 1e9,
                m.dtype
            )
            .to_lowercase(),
        });
    }
    for (name, _) in builtins::HARDWARE {
        let h = builtins::hardware(name)?;
        out.push(Entry {
            kind: "hardware",
            name: name.to_string(),
            description: format!(
                "{}, {} MiB, {:.0} TFLOP/s bf16, {} per node",
                h.name,
                h.memory_bytes >> 20,
                h.peak_flops / 1e12,
                h.gpus_per_node
            ),
        });
    }
    for name in builtin_profile_names() {
        out.push(Entry {
            kind: "profile",
            name: name.clone(),
            description: "analytic profile (FLOP counts over datasheet peaks)".into(),
        });
    }
    for (name, _) in builtins::WORKLOADS {
        let w = builtins::workload(name)?;
        let d = match &w.lengths {
            profiles::LengthDistribution::Empirical { samples, .. } => format!(
                "{} real sequence lengths, {:?} per step",
                samples.len(),
                w.default_step_size()
            ),
            other => format!("{other:?}"),
        };
        out.push(Entry {
            kind: "workload",
            name: name.to_string(),
            description: d,
        });
    }
    match a.format {
        Format::Json => println!("{}", serde_json::to_string_pretty(&out)?),
        Format::Table => {
            let mut t = Table::new();
            t.load_preset(UTF8_BORDERS_ONLY);
            t.set_header(["kind", "name", "description"]);
            for e in out {
                t.add_row([e.kind.to_string(), e.name, e.description]);
            }
            println!("{t}");
        }
    }
    Ok(ExitCode::SUCCESS)
}
