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
mod checks;
mod cp;
mod drift;
mod errors;
mod execute;
mod import_trace;
mod plan;
mod profile;
mod render;
mod resolve;
mod schedule;
mod simulate;
mod sources;

use backend::{Backend, GemmPrecision};
use builtins_cmd::{BuiltinsArgs, list_builtins};
use calibrate::{CalibrateArgs, calibrate};
use checks::*;
use drift::{DriftArgs, drift_cmd};
use errors::*;
pub use errors::{StdoutClosed, render_error};
use execute::{ExecuteArgs, execute};
use import_trace::{ImportTraceArgs, import_trace};
use plan::{PlanArgs, plan_cmd};
use profile::{ProfileArgs, profile_cmd};
use render::*;
use resolve::memory_limit;
use schedule::{ScheduleArgs, schedule_cmd};
use simulate::{SimulateArgs, simulate};
use sources::*;

use anyhow::{Result, bail};
use clap::{Args, Parser, Subcommand, ValueEnum};
use comfy_table::{Table, presets::NOTHING};
use flatpipe_executor as executor;
use flatpipe_planner as planner;
use flatpipe_profiles::{self as profiles, AnalyticOptions, Profile, StepSize, Workload, builtins};
use flatpipe_simulator::{
    self as sim, Plan, ScheduleKind, Simulation, UniformCostSpec, UniformCosts,
    batching::policy::Policy,
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
    /// Simulate a run that drifts, step by step: GPUs that slow down (--stragglers) or lengths
    /// that grow (--grow), planned once against planned before every step from what the last
    /// steps measured.
    Drift(Box<DriftArgs>),
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
        Command::Drift(a) => drift_cmd(*a),
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
