//! Command-line parsing and the subcommands.

use anyhow::{Result, bail};
use clap::{Args, Parser, Subcommand, ValueEnum};
use comfy_table::{Table, presets::UTF8_BORDERS_ONLY};
use flatpipe_profiles::{self as profiles, AnalyticOptions, Profile, StepSize, Workload, builtins};
use flatpipe_simulator::{
    self as sim, Microbatching, Plan, ScheduleKind, Simulation, TableCosts, UniformCostSpec,
    UniformCosts, microbatch, plan::even_split,
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

/// Options of `flatpipe simulate`.
#[derive(Debug, Args)]
struct SimulateArgs {
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
    /// Uniform costs instead of a profile and workload: one rank's share of the model per
    /// microbatch in seconds, e.g. f=1,b=1,w=1,comm=0 (keys f, b, w, comm, fb, fo).
    #[arg(long, conflicts_with_all = ["profile", "model", "hardware", "workload", "plan", "token_budget", "seqs_per_step", "tokens_per_step"])]
    costs: Option<String>,
    /// Seed of the step sampler (default: the workload's, 0). Printed.
    #[arg(long)]
    seed: Option<u64>,
    /// Write the Gantt chart of the best schedule here (.svg or .png); with several schedules,
    /// each one's also goes to <stem>-<schedule>.<ext>. Default flatpipe-gantt.png.
    #[arg(long)]
    gantt: Option<PathBuf>,
    /// Write a Chrome trace (Perfetto) JSON of the best schedule here.
    #[arg(long)]
    trace: Option<PathBuf>,
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

/// One row of `simulate`'s output (`--format json` prints a list of these).
#[derive(Debug, Serialize)]
struct Report {
    schedule: String,
    pp: u32,
    vpp: u32,
    microbatches: u32,
    #[serde(flatten)]
    metrics: sim::Metrics,
}

struct Run {
    name: String,
    vpp: u32,
    sim: Simulation,
    schedule: sim::Schedule,
}

/// What the step looks like, for the header line and the Gantt title.
struct StepInfo {
    description: String,
}

/// The schedules a `simulate` call compares: generated kinds, or one loaded from a CSV file.
enum Schedules {
    Kinds(Vec<ScheduleKind>),
    Csv(sim::Schedule),
}

impl Schedules {
    /// `(name, stages per rank, schedule)` for `p` ranks and `m` microbatches.
    fn build(&self, p: u32, vpp: Option<u32>, m: u32) -> Result<Vec<(String, u32, sim::Schedule)>> {
        match self {
            Schedules::Csv(s) => Ok(vec![(
                s.name.clone(),
                s.num_stages() / s.placement.num_ranks,
                s.clone(),
            )]),
            Schedules::Kinds(kinds) => kinds
                .iter()
                .map(|k| {
                    let v = k.stages_per_rank(vpp)?;
                    Ok((k.name().to_string(), v, k.generate(p, v, m)?))
                })
                .collect(),
        }
    }
}

fn simulate(a: SimulateArgs) -> Result<ExitCode> {
    let mut runs = Vec::new();
    let info: StepInfo;
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
    let csv_shape = match &schedules {
        Schedules::Csv(s) => Some((s.placement.num_ranks, s.num_microbatches)),
        Schedules::Kinds(_) => None,
    };
    if let Some(spec) = &a.costs {
        let spec: UniformCostSpec = spec.parse()?;
        let (p, m) = csv_shape.unwrap_or((
            a.pp.unwrap_or(4),
            a.microbatches.unwrap_or(a.pp.unwrap_or(4)),
        ));
        for (name, v, schedule) in schedules.build(p, a.vpp, m)? {
            let costs = UniformCosts::new(&spec, v);
            runs.push(Run {
                name,
                vpp: v,
                sim: sim::simulate(&schedule, &costs)?,
                schedule,
            });
        }
        info = StepInfo {
            description: format!(
                "uniform costs f={} b={} w={} comm={} s (one rank's share per microbatch), {m} microbatches",
                spec.f, spec.b, spec.w, spec.comm
            ),
        };
    } else {
        let plan = match &a.plan {
            Some(path) => {
                let origin = path.display().to_string();
                Some(Plan::from_yaml(&profiles::read_to_string(path)?, &origin)?)
            }
            None => None,
        };
        fn pick<'a>(
            from_plan: Option<&'a String>,
            from_args: &'a Option<String>,
        ) -> Option<&'a str> {
            from_plan.or(from_args.as_ref()).map(String::as_str)
        }
        let profile = resolve_profile(
            pick(plan.as_ref().and_then(|p| p.profile.as_ref()), &a.profile),
            pick(plan.as_ref().and_then(|p| p.model.as_ref()), &a.model),
            pick(plan.as_ref().and_then(|p| p.hardware.as_ref()), &a.hardware),
        )?;
        let workload_name = a
            .workload
            .clone()
            .or_else(|| plan.as_ref().map(|p| p.workload.clone()))
            .unwrap_or_else(|| builtins::DEFAULT_WORKLOAD.to_string());
        let workload = builtins::workload(&workload_name)?;
        if let (Some(p), Some(path)) = (&plan, &a.plan) {
            p.validate(&path.display().to_string(), profile.layers.len())?;
        }
        let size = step_size(&a, plan.as_ref(), &workload)?;
        let seed = a
            .seed
            .or(plan.as_ref().map(|p| p.seed))
            .unwrap_or(workload.seed);
        let seqs = workload.sample_step(seed, 0, size);
        let mbing = match (&plan, csv_shape) {
            (Some(p), _) => p.microbatching()?,
            (None, Some((_, m))) => Microbatching::Microbatches(m),
            (None, None) => match (a.microbatches, a.token_budget) {
                (Some(m), _) => Microbatching::Microbatches(m),
                (None, Some(t)) => Microbatching::TokenBudget(t),
                (None, None) => Microbatching::TokenBudget(16_384),
            },
        };
        let mbs = make_microbatches(&seqs, mbing, &profile)?;
        let tokens: u64 = seqs.iter().map(|&s| s as u64).sum();
        let p = csv_shape
            .map(|c| c.0)
            .or(plan.as_ref().map(|p| p.pp))
            .or(a.pp)
            .unwrap_or(4);
        let schedules = match &plan {
            Some(pl) => Schedules::Kinds(vec![pl.schedule]),
            None => schedules,
        };
        let vpp = plan.as_ref().and_then(|p| p.vpp).or(a.vpp);
        for (name, v, schedule) in schedules.build(p, vpp, mbs.len() as u32)? {
            let stages = match &plan {
                Some(pl) => pl.stage_ranges(),
                None => even_split(profile.layers.len(), schedule.num_stages() as usize)?,
            };
            let costs =
                TableCosts::from_profile(&profile, &stages, &schedule.placement, &mbs, &[])?;
            runs.push(Run {
                name,
                vpp: v,
                sim: sim::simulate(&schedule, &costs)?,
                schedule,
            });
        }
        info = StepInfo {
            description: format!(
                "{} on {} ({} profile), workload {} seed {seed}: {} sequences, {tokens} tokens, {} microbatches ({})",
                profile.model,
                profile.hardware.name,
                format!("{:?}", profile.provenance.source).to_lowercase(),
                workload.name,
                seqs.len(),
                mbs.len(),
                match mbing {
                    Microbatching::Microbatches(m) => format!("{m} balanced by cost"),
                    Microbatching::TokenBudget(t) =>
                        format!("token budget {t}, first-fit decreasing"),
                }
            ),
        };
    }
    // Fastest first; among equally fast schedules, the one with less peak activation memory.
    let peak = |r: &Run| {
        let m = &r.sim.metrics;
        m.ranks
            .iter()
            .map(|x| {
                x.peak_activation_bytes
                    .or(x.peak_activation_units)
                    .unwrap_or(0.0)
            })
            .fold(0.0, f64::max)
    };
    runs.sort_by(|x, y| {
        let (a, b) = (&x.sim.metrics, &y.sim.metrics);
        a.makespan_s
            .total_cmp(&b.makespan_s)
            .then(peak(x).total_cmp(&peak(y)))
            .then(x.name.cmp(&y.name))
    });
    let reports: Vec<Report> = runs
        .iter()
        .map(|r| Report {
            schedule: r.name.clone(),
            pp: r.schedule.placement.num_ranks,
            vpp: r.vpp,
            microbatches: r.schedule.num_microbatches,
            metrics: r.sim.metrics.clone(),
        })
        .collect();
    let mut notes = Vec::new();
    let best = &runs[0];
    let title = |r: &Run| {
        format!(
            "{}  p={} v={} m={}  makespan {}  bubble {:.1}%",
            r.name,
            r.schedule.placement.num_ranks,
            r.vpp,
            r.schedule.num_microbatches,
            fmt_s(r.sim.metrics.makespan_s),
            100.0 * r.sim.metrics.bubble_ratio
        )
    };
    let gantt = a
        .gantt
        .clone()
        .unwrap_or_else(|| PathBuf::from("flatpipe-gantt.png"));
    sim::gantt::write_gantt(&gantt, &title(best), &best.sim.timeline)?;
    notes.push(format!("Gantt chart of {}: {}", best.name, gantt.display()));
    if a.gantt.is_some() && runs.len() > 1 {
        for r in &runs {
            let path = sibling(&gantt, &sanitize(&r.name));
            sim::gantt::write_gantt(&path, &title(r), &r.sim.timeline)?;
            notes.push(format!("Gantt chart of {}: {}", r.name, path.display()));
        }
    }
    if let Some(path) = &a.trace {
        let doc = sim::trace::chrome_trace(&best.sim.timeline);
        profiles::write_atomic(path, serde_json::to_string(&doc)?.as_bytes())?;
        notes.push(format!("Chrome trace of {}: {}", best.name, path.display()));
    }
    match a.format {
        Format::Json => {
            println!("{}", serde_json::to_string_pretty(&reports)?);
            eprintln!("{}", info.description);
            for n in notes {
                eprintln!("{n}");
            }
        }
        Format::Table => {
            println!("{}", info.description);
            println!("{}", table(&reports));
            for n in notes {
                println!("{n}");
            }
        }
    }
    Ok(ExitCode::SUCCESS)
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
fn make_microbatches(
    seqs: &[u32],
    how: Microbatching,
    profile: &Profile,
) -> Result<Vec<sim::Microbatch>> {
    Ok(match how {
        Microbatching::Microbatches(m) => {
            // Predicted F + I + W time of one sequence through the whole model.
            let (tok, pair) = profile.layers.iter().fold((0.0, 0.0), |acc, l| {
                (
                    acc.0 + l.f.c_tok_s + l.i.c_tok_s + l.w.c_tok_s,
                    acc.1 + l.f.c_attn_s + l.i.c_attn_s + l.w.c_attn_s,
                )
            });
            microbatch::split_balanced(seqs, m as usize, |t, a| tok * t as f64 + pair * a as f64)?
        }
        Microbatching::TokenBudget(t) => {
            let (mbs, over) = microbatch::pack_token_budget(seqs, t)?;
            for o in over {
                tracing::warn!(
                    "sequence {} of the step has {} tokens, more than the token budget {t}: it gets a microbatch of its own",
                    o.index,
                    o.tokens
                );
            }
            mbs
        }
    })
}

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

fn table(reports: &[Report]) -> Table {
    let mut t = Table::new();
    t.load_preset(UTF8_BORDERS_ONLY);
    t.set_header([
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
    for r in reports {
        let m = &r.metrics;
        let peak_mem = m
            .ranks
            .iter()
            .map(|x| {
                x.peak_activation_bytes
                    .or(x.peak_activation_units)
                    .unwrap_or(0.0)
            })
            .fold(0.0, f64::max);
        let unit_mode = m.ranks.iter().any(|x| x.peak_activation_units.is_some());
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
            format!("{:.1}%", 100.0 * m.bubble_ratio),
            fmt_s(m.lower_bound_s),
            format!("{:+.1}%", 100.0 * m.gap_to_lower_bound),
            if unit_mode {
                format!("{peak_mem:.2} units")
            } else {
                fmt_bytes(peak_mem)
            },
            inflight.to_string(),
        ]);
    }
    t
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
