//! Command-line parsing and the subcommands (one module each).

/// `println!` for command output: a closed stdout (`| head`) ends the command quietly through
/// [`StdoutClosed`] instead of panicking; other write errors are errors.
macro_rules! outln {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        writeln!(std::io::stdout().lock(), $($arg)*).map_err($crate::cli::stdout_error)?
    }};
}

/// `print!` for command output (see [`outln!`]).
macro_rules! out {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        write!(std::io::stdout().lock(), $($arg)*).map_err($crate::cli::stdout_error)?
    }};
}

mod backend;
mod builtins_cmd;
mod calibrate;
mod execute;
mod import_trace;
mod plan;
mod profile;
mod resolve;
mod schedule;
mod simulate;

use backend::{Backend, GemmPrecision};
use builtins_cmd::{BuiltinsArgs, list_builtins};
use calibrate::{CalibrateArgs, calibrate};
use execute::{ExecuteArgs, execute};
use import_trace::{ImportTraceArgs, import_trace};
use plan::{PlanArgs, plan_cmd};
use profile::{ProfileArgs, profile_cmd};
use resolve::memory_limit;
use schedule::{ScheduleArgs, schedule_cmd};
use simulate::{SimulateArgs, simulate};

use anyhow::{Result, bail};
use clap::{Args, Parser, Subcommand, ValueEnum};
use comfy_table::{Table, presets::NOTHING};
use flatpipe_executor as executor;
use flatpipe_planner as planner;
use flatpipe_profiles::{self as profiles, AnalyticOptions, Profile, StepSize, Workload, builtins};
use flatpipe_simulator::{
    self as sim, Plan, ScheduleKind, Simulation, UniformCostSpec, UniformCosts,
    batching::policy::{Policy, PolicyParams},
    run::plan::even_split,
    run::{
        config::{Capacity, ScheduleSource},
        montecarlo,
    },
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
    /// Run a plan for real (CPU or CUDA backend): a real transformer's F / I / W on the workload's
    /// sequences, the measured timeline, and with --verify a check against a single-rank run.
    Execute(Box<ExecuteArgs>),
    /// Measure the executor's kernels (F, I, W, Fo per layer kind over a token grid), links and
    /// optimizer on this machine, fit the cost model and write a measured profile.
    Profile(Box<ProfileArgs>),
    /// The closed loop: profile this machine, plan each schedule on the measured profile,
    /// execute it, and compare predicted with measured makespan and bubbles.
    Calibrate(Box<CalibrateArgs>),
    /// Read a PyTorch profiler trace (actions labelled PP:<action>) into a measured timeline:
    /// Gantt chart, bubble per rank, and the comparison with flatpipe's prediction.
    ImportTrace(Box<ImportTraceArgs>),
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
    #[arg(long, conflicts_with = "hardware")]
    profile: Option<String>,
    /// Model (YAML file or built-in name); its analytic profile on --hardware is used. With
    /// --profile it names the profile's model (its architecture, for execute, when the model is
    /// not a built-in) and must be the model the profile was made for.
    #[arg(long)]
    model: Option<String>,
    /// Hardware (YAML file or built-in name).
    #[arg(long)]
    hardware: Option<String>,
    /// Workload: a YAML file, a CSV file with a `tokens` column, or a built-in name.
    #[arg(long)]
    workload: Option<String>,
}

/// Parses the command line and runs the subcommand.
/// The reader of stdout went away (a pipe into `head`): not an error of the command.
#[derive(Debug, thiserror::Error)]
#[error("stdout was closed by its reader")]
pub struct StdoutClosed;

/// The command-line flag of a library field: the libraries name what they check in their own
/// words (a plan file's keys, `token_budget`, `forward_only.mode`), the command line maps them
/// to the flags a user typed. `None` for a field with no flag (e.g. `stages[2]`).
fn flag_of(field: &str) -> Option<String> {
    // `costs f`: a key of --costs.
    let (head, rest) = field.split_once(' ').unwrap_or((field, ""));
    let flag = match head {
        "forward_only.microbatches" => "--fo-microbatches",
        "forward_only.mode" => "--fo-mode",
        "forward_only.loss_dependency" => "--fo-loss-dependency",
        "token_budget" => "--token-budget",
        "microbatches" => "--microbatches",
        "pack_len" => "--pack-len",
        "max_seq_len" => "--max-seq-len",
        "pp" => "--pp",
        "vpp" => "--vpp",
        "dp" => "--dp",
        "schedule" => "--schedule",
        "capacity" => "--capacity",
        "policy" => "--policy",
        "costs" => "--costs",
        "ranks" => "--ranks",
        "steps" => "--steps",
        "gpus" => "--gpus",
        "precision" => "--precision",
        "init_on_device" => "--init-on-device",
        "tp" => "--tp",
        "sharding" => "--sharding",
        _ => return None,
    };
    Some(if rest.is_empty() {
        flag.to_string()
    } else {
        format!("{flag} {rest}")
    })
}

/// The message of one error of a chain, a library's out-of-range field named by its flag.
fn render_one(e: &(dyn std::error::Error + 'static)) -> String {
    let invalid = |field: &str, value: &str, allowed: &str| {
        flag_of(field).map(|flag| format!("{flag} = {value} is invalid: {allowed}"))
    };
    let sim_invalid = |e: &sim::Error| match e {
        sim::Error::InvalidArgument {
            field,
            value,
            allowed,
        } => invalid(field, value, allowed),
        _ => None,
    };
    let mapped = if let Some(e) = e.downcast_ref::<sim::Error>() {
        sim_invalid(e)
    } else if let Some(e) = e.downcast_ref::<planner::Error>() {
        match e {
            planner::Error::InvalidArgument {
                field,
                value,
                allowed,
            } => invalid(field, value, allowed),
            planner::Error::Simulator(e) => sim_invalid(e),
            _ => None,
        }
    } else if let Some(profiles::Error::Invalid {
        path,
        field,
        value,
        allowed,
    }) = e.downcast_ref::<profiles::Error>()
    {
        invalid(field, value, allowed).map(|m| format!("{path}: {m}"))
    } else if let Some(e) = e.downcast_ref::<executor::Error>() {
        match e {
            executor::Error::InvalidArgument {
                field,
                value,
                allowed,
            } => invalid(field, value, allowed),
            executor::Error::Simulator(e) => sim_invalid(e),
            _ => None,
        }
    } else {
        None
    };
    mapped.unwrap_or_else(|| e.to_string())
}

/// Renders an error and its causes as `{:#}` does (`outer: inner: root`), with the libraries'
/// field names mapped to the command line's flags ([`flag_of`]).
pub fn render_error(e: &anyhow::Error) -> String {
    e.chain().map(render_one).collect::<Vec<_>>().join(": ")
}

/// Maps a stdout write error: a broken pipe becomes [`StdoutClosed`].
pub(crate) fn stdout_error(e: std::io::Error) -> anyhow::Error {
    if e.kind() == std::io::ErrorKind::BrokenPipe {
        anyhow::Error::new(StdoutClosed)
    } else {
        anyhow::Error::new(e).context("writing to stdout")
    }
}

/// Cores this process may run on (1 when unknown).
fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// Memory this machine has available now (`MemAvailable` of /proc/meminfo), bytes; `None` where
/// it cannot be read.
fn available_memory_bytes() -> Option<f64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024.0)
}

/// Refuses, before anything is allocated, a request whose schedules would not fit in the
/// memory available: `pairs` (stage, microbatch) pairs over all the schedules built, each
/// [`montecarlo::BYTES_PER_STAGE_MICROBATCH`]. `what` names the request (e.g. `--microbatches
/// 10000000 with --pp 4`).
fn check_schedule_memory(what: &str, pairs: f64) -> Result<()> {
    let need = pairs * montecarlo::BYTES_PER_STAGE_MICROBATCH;
    check_memory(
        what,
        need,
        &format!(
            "its schedules hold {pairs:.0} (stage, microbatch) pairs, about {} at ~{:.0} bytes each",
            fmt_bytes(need),
            montecarlo::BYTES_PER_STAGE_MICROBATCH
        ),
        "use fewer microbatches, ranks or schedules",
    )
}

/// Refuses, before anything is allocated, a request estimated to need `need` bytes when this
/// machine has less available; `why` says how the estimate was made and `help` what reduces
/// it.
fn check_memory(what: &str, need: f64, why: &str, help: &str) -> Result<()> {
    if let Some(have) = available_memory_bytes()
        && need > have
    {
        bail!(
            "{what} is too large: {why}, more than the {} of memory available; {help}",
            fmt_bytes(have)
        );
    }
    Ok(())
}

/// Refuses, before anything is allocated, a Monte Carlo run estimated
/// ([`montecarlo::estimated_memory_bytes`]) not to fit in the memory available, with
/// `kept_steps` sampled steps held besides (the planner samples every step up front).
#[allow(clippy::too_many_arguments)]
fn check_monte_carlo_memory(
    what: &str,
    workload: &Workload,
    seed: u64,
    size: StepSize,
    steps: u32,
    kept_steps: u32,
    configs: &[flatpipe_simulator::run::config::RunConfig],
) -> Result<()> {
    let (seqs, _, _) = montecarlo::estimated_step(workload, seed, size);
    let kept = f64::from(kept_steps) * (seqs * 4.0 + 24.0);
    let need = kept + montecarlo::estimated_memory_bytes(workload, seed, size, steps, configs);
    tracing::info!("{what}: estimated to hold {}", fmt_bytes(need));
    check_memory(
        what,
        need,
        &format!(
            "{steps} step(s) of {size} for {} configuration(s) of up to pp = {} are estimated to hold {}",
            configs.len(),
            configs.iter().map(|c| c.pp).max().unwrap_or(1),
            fmt_bytes(need)
        ),
        "use fewer steps, sequences per step, ranks or schedules, or a larger token budget",
    )
}

/// The default microbatch count of a schedule with `p` ranks and `v` stages per rank: `p·v`,
/// one microbatch per stage, the fewest that fill the pipeline (torchtitan's
/// `pipeline_parallel_microbatch_size` warns below the stage count, pytorch/torchtitan PR #781).
/// Used by `simulate --costs` and inline `execute`.
fn default_microbatches(p: u32, v: u32) -> u32 {
    p.saturating_mul(v).max(1)
}

/// Warns when `m` microbatches leave a `p`-rank, `v`-stages-per-rank pipeline under-filled:
/// `m < p` (some ranks never have two microbatches in flight; the bubble ratio of 1F1B is at
/// least `(p - 1) / (m + p - 1)`), or `m < p·v` (an interleaved schedule runs no better than
/// its looped form). `what` names the schedule. Returns the warning (for tests and notes).
fn warn_underfilled(what: &str, m: u32, p: u32, v: u32) -> Option<String> {
    let stages = p.saturating_mul(v);
    let msg = if m < p && p > 1 {
        Some(format!(
            "{what}: m = {m} microbatches < pp = {p} ranks: the pipeline never fills, and the bubble ratio is at least (p - 1)/(m + p - 1) = {:.0}%; use m >= {stages} (p·v)",
            100.0 * f64::from(p - 1) / f64::from(m + p - 1)
        ))
    } else if m < stages && v > 1 {
        Some(format!(
            "{what}: m = {m} microbatches < p·v = {stages} stages: the pipeline is under-filled and the interleaving gains little; use m >= {stages}"
        ))
    } else {
        None
    };
    if let Some(w) = &msg {
        tracing::warn!("{w}");
    }
    msg
}

/// The chart path of `--gantt`: the given path, `default` without one, `None` for `none`
/// (the chart switched off).
fn chart_path(arg: &Option<PathBuf>, default: &str) -> Option<PathBuf> {
    match arg {
        Some(p) if p.as_os_str() == "none" => None,
        Some(p) => Some(p.clone()),
        None => Some(PathBuf::from(default)),
    }
}

/// Checks, before any work, that every output path can be written (its directory exists and
/// it is not a directory), so that a bad path does not lose the results at the end.
fn check_outputs<'a>(paths: impl IntoIterator<Item = &'a PathBuf>) -> Result<()> {
    for p in paths {
        profiles::check_writable(p)?;
    }
    Ok(())
}

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
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .without_time()
        .init();
    match cli.command {
        Command::Simulate(a) => simulate(*a),
        Command::Plan(a) => plan_cmd(*a),
        Command::Execute(a) => execute(*a),
        Command::Profile(a) => profile_cmd(*a),
        Command::Calibrate(a) => calibrate(*a),
        Command::ImportTrace(a) => import_trace(*a),
        Command::Schedule(a) => schedule_cmd(a),
        Command::Builtins(a) => list_builtins(a),
    }
}

/// Built-in profile names: `<model>@<hardware>` for every built-in pair.
/// `--fo-microbatches`: a count, or `same` (one per training microbatch).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum FoCount {
    Same,
    Count(u32),
}

impl std::str::FromStr for FoCount {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim() {
            "same" => Ok(FoCount::Same),
            x => x
                .parse::<u32>()
                .map(FoCount::Count)
                .map_err(|_| format!("`{x}` is not a number of microbatches >= 0 or `same`")),
        }
    }
}

/// Forward-only work in a step (shared by simulate, plan, execute and schedule).
#[derive(Debug, Args)]
struct FoArgs {
    /// Forward-only microbatches per step: a frozen reference or teacher model's forward (`Fo`
    /// actions, no activations kept, no backward) over the step's microbatches, cycled. A number
    /// K, or `same` (one per training microbatch). Under --costs their cost is the key fo=
    /// (default f). Default: none.
    #[arg(long)]
    fo_microbatches: Option<FoCount>,
    /// `fused` into the training schedule's bubbles (default) or a `separate` pass first.
    #[arg(long, default_value = "fused")]
    fo_mode: sim::schedules::forward_only::FoMode,
    /// Training microbatch i's loss needs forward-only microbatch i (reference log-probs in the
    /// loss: PPO / GRPO with a KL term, DPO, distillation); needs as many Fo microbatches as m.
    #[arg(long)]
    fo_loss_dependency: bool,
}

impl FoArgs {
    /// The forward-only work asked for; `None` without any (`--fo-microbatches 0` or absent).
    fn spec(&self) -> Result<Option<flatpipe_simulator::run::config::ForwardOnlySpec>> {
        let microbatches = match self.fo_microbatches {
            None | Some(FoCount::Count(0)) => {
                if self.fo_loss_dependency {
                    bail!(
                        "--fo-loss-dependency needs forward-only work: give --fo-microbatches K (>= the step's microbatches) or `same`"
                    );
                }
                return Ok(None);
            }
            Some(FoCount::Same) => None,
            Some(FoCount::Count(k)) => Some(k),
        };
        Ok(Some(flatpipe_simulator::run::config::ForwardOnlySpec {
            microbatches,
            mode: self.fo_mode,
            loss_dependency: self.fo_loss_dependency,
        }))
    }
}

/// Reads a plan file, if one was given.
fn read_plan(path: Option<&Path>) -> Result<Option<Plan>> {
    path.map(|p| {
        Ok(Plan::from_yaml(
            &profiles::read_to_string(p)?,
            &p.display().to_string(),
        )?)
    })
    .transpose()
}

/// `1/2/3`: a list joined with slashes (microbatches per replica, layers per stage).
fn slash_list<T: ToString>(xs: impl IntoIterator<Item = T>) -> String {
    xs.into_iter()
        .map(|x| x.to_string())
        .collect::<Vec<_>>()
        .join("/")
}

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
        let prof = if path.is_file() {
            Profile::from_yaml(&profiles::read_to_string(path)?, p)?
        } else if let Some((m, h)) = p.split_once('@') {
            analytic(m, h)?
        } else {
            bail!(
                "unknown profile `{p}`: no such file and no such built-in (built-ins: {})",
                builtin_profile_names().join(", ")
            );
        };
        if let Some(m) = model {
            let spec = builtins::model(m)?;
            if spec.name != prof.model || spec.layers().len() != prof.layers.len() {
                bail!(
                    "--model {m} is model {} with {} layers; the profile {p} is of model {} with {} layers: give the model the profile was made for, or leave out --model",
                    spec.name,
                    spec.layers().len(),
                    prof.model,
                    prof.layers.len()
                );
            }
        }
        return Ok(prof);
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
        // These commands also take `all`.
        let k: ScheduleKind = n.parse().map_err(|e| match e {
            sim::Error::InvalidArgument { value, allowed, .. } => {
                anyhow::anyhow!("--schedule = {value} is invalid: {allowed}, or all")
            }
            e => e.into(),
        })?;
        if !kinds.contains(&k) {
            kinds.push(k);
        }
    }
    Ok(kinds)
}

fn emit<T: Serialize>(
    format: Format,
    reports: &T,
    header: &str,
    table: &PlainTable,
    notes: &[String],
) -> Result<ExitCode> {
    match format {
        Format::Json => {
            outln!("{}", serde_json::to_string_pretty(reports)?);
            eprintln!("{header}");
            for n in notes {
                eprintln!("{n}");
            }
        }
        Format::Table => {
            outln!("{header}");
            outln!("{table}");
            for n in notes {
                outln!("{n}");
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// A results table: plain columns three spaces apart, no borders and no trailing spaces
/// (copied into a document or a spreadsheet as it is, and what the README shows).
struct PlainTable(Table);

impl std::ops::Deref for PlainTable {
    type Target = Table;
    fn deref(&self) -> &Table {
        &self.0
    }
}

impl std::ops::DerefMut for PlainTable {
    fn deref_mut(&mut self) -> &mut Table {
        &mut self.0
    }
}

impl std::fmt::Display for PlainTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let text = self.0.to_string();
        let lines: Vec<&str> = text.lines().map(str::trim_end).collect();
        f.write_str(&lines.join("\n"))
    }
}

fn new_table(header: &[&str]) -> PlainTable {
    let mut t = Table::new();
    t.load_preset(NOTHING);
    t.set_header(header.to_vec());
    for c in t.column_iter_mut() {
        c.set_padding((0, 3));
    }
    PlainTable(t)
}

fn pct(x: f64) -> String {
    format!("{:.1}%", 100.0 * x)
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
        self.inc_by(1);
    }

    fn inc_by(&self, n: u64) {
        use std::sync::atomic::Ordering;
        if !self.shown.load(Ordering::Relaxed)
            && self.start.elapsed() > std::time::Duration::from_secs(1)
            && !self.shown.swap(true, Ordering::Relaxed)
        {
            self.bar
                .set_draw_target(indicatif::ProgressDrawTarget::stderr());
        }
        self.bar.inc(n);
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

fn gantt_title(name: &str, schedule: &sim::Schedule, v: u32, m: &sim::Metrics) -> String {
    format!(
        "{name}  p={} v={v} m={}  makespan {}  bubble {:.1}%",
        schedule.placement.num_ranks,
        schedule.num_microbatches,
        fmt_s(m.makespan_s),
        100.0 * m.bubble_ratio
    )
}
