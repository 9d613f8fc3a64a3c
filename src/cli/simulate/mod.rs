//! `flatpipe simulate`: uniform costs (`uniform`) or a profile and workload (`compare`
//! resolves the compared runs, then `profile` simulates and renders them), one or many steps.

mod compare;
mod profile;
mod rows;
mod uniform;

use super::*;
use profile::simulate_profile;
use sim::costs::given::CostSpec;
pub(super) use uniform::simulate_uniform;

/// Options of `flatpipe simulate`.
#[derive(Debug, Args)]
pub(super) struct SimulateArgs {
    #[command(flatten)]
    inputs: Inputs,
    /// Run a plan file (sets pp, vpp, schedule, stages and microbatching); with --schedule,
    /// compare those schedules on the plan's split, recomputation and sharding.
    #[arg(long, conflicts_with_all = ["pp", "vpp", "microbatches", "token_budget", "schedule_csv"])]
    plan: Option<PathBuf>,
    /// Simulate a schedule from PyTorch's compute-only pipeline-order CSV (one row per rank;
    /// its rows set pp, its stages the placement, its microbatch indices m).
    #[arg(long, conflicts_with_all = ["schedule", "pp", "vpp", "microbatches", "token_budget"])]
    schedule_csv: Option<PathBuf>,
    /// Schedules to compare, comma-separated (gpipe, 1f1b, interleaved-1f1b, looped-bfs, zb-h1,
    /// zb-h2, zb-v, dualpipev, combined-1f1b, zb-auto) or `all` (the default; combined-1f1b
    /// only with --ep > 1).
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
    /// Context-parallel degree: GPUs per rank that split each microbatch's sequences along
    /// their length (default 1). GPUs = tp x cp x dp x pp.
    #[arg(long, conflicts_with_all = ["plan", "costs"], value_parser = clap::value_parser!(u32).range(1..))]
    cp: Option<u32>,
    #[command(flatten)]
    cp_opts: super::cp::CpArgs,
    /// Tensor parallelism without sequence parallelism.
    #[arg(long, conflicts_with_all = ["plan", "costs"])]
    no_sequence_parallel: bool,
    /// Expert-parallel degree (default 1): data-parallel replicas that split each
    /// mixture-of-experts layer's routed experts; must divide --dp and the experts.
    #[arg(long, conflicts_with_all = ["plan", "costs"], value_parser = clap::value_parser!(u32).range(1..))]
    ep: Option<u32>,
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
    /// microbatch in seconds, e.g. f=1,b=1,w=1,comm=0 (keys f, b, w, comm, fb, fo, and with
    /// --fsdp FSDP's ag and rs: one rank's all-gather and reduce-scatter, and interference:
    /// how much longer compute runs beside them, a fraction). Per-rank
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
    /// Where each rank posts its pipeline receives: `ahead` (PyTorch's `_add_send_recv`: as
    /// soon as the sender's progress allows) or `deferred` (just before the compute that
    /// consumes it, the lower rank of a pair first: the runtime's `defer_pp_recv=True`).
    /// Default: the plan file's `lowering.posting`, else `ahead`.
    #[arg(long, value_enum)]
    p2p_posting: Option<P2pPosting>,
    /// Each rank's streams for pipeline sends and receives: `per-peer` (one per directed rank
    /// edge, PyTorch's `pipeline_per_edge_p2p`: no transfer queues behind another link's; the
    /// default, and the model of every other output), `peer-pair` (one per peer for both
    /// directions: NCCL's lazy two-rank communicators) or `shared` (one for all: an eagerly
    /// initialised NCCL group). On a shared stream a receive posted early holds every send
    /// behind it; a send completes only with its receive, as NCCL's do for payloads larger than
    /// its buffer.
    /// Default: the plan file's `lowering.streams`, else `per-peer`.
    #[arg(long, value_enum)]
    p2p_streams: Option<P2pStreams>,
    /// Run FSDP's per-stage actions as PyTorch 2.15's runtime lowers them for a sharded model
    /// (`UNSHARD` before a stage's compute, `REDUCE_GRAD` and its wait after its last
    /// backward, `RESHARD`), on a collective stream per rank, with at most this many stages
    /// gathered at once (its `max_active_stages`; 3 when the flag has no value). Under
    /// `--costs` their times are the keys `ag` (all-gather of one rank's parameters) and `rs`
    /// (reduce-scatter of its gradients), spread over its stages; on a profile (with
    /// `--sharding fsdp`, `hsdp`, `ddp` or `zero1` and `--dp` >= 2) each stage's FSDP
    /// all-gather and gradient reduction over its data-parallel group, in place of the step's
    /// collective tail.
    /// Default: the plan file's `lowering.fsdp`, else none.
    #[arg(long, value_name = "MAX_ACTIVE_STAGES", num_args = 0..=1, default_missing_value = "3")]
    fsdp: Option<u32>,
    /// With --fsdp: defer each `WAIT_REDUCE_GRAD` to the rank's next reduction or the end of
    /// the step (PyTorch's `defer_reduce_grad_wait`), so a stage's reduction no longer holds
    /// the rank's other stages. Default: the plan file's `lowering.fsdp_defer_wait`, else off.
    #[arg(long, requires = "fsdp")]
    fsdp_defer_wait: bool,
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

/// `--p2p-posting`: [`sim::ir::lowering::RecvPosting`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(super) enum P2pPosting {
    /// As soon as the sender's progress allows.
    Ahead,
    /// Just before the consuming compute.
    Deferred,
}

impl From<P2pPosting> for sim::ir::lowering::RecvPosting {
    fn from(p: P2pPosting) -> Self {
        match p {
            P2pPosting::Ahead => Self::Ahead,
            P2pPosting::Deferred => Self::Deferred,
        }
    }
}

/// `--p2p-streams`: [`sim::ir::comm::StreamLayout`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(super) enum P2pStreams {
    /// One stream per peer and direction.
    #[value(alias = "per-edge")]
    PerPeer,
    /// One stream per peer, both directions.
    PeerPair,
    /// One stream for every send and receive.
    Shared,
}

impl SimulateArgs {
    /// The lowering `--p2p-posting` and `--p2p-streams` ask for, each default filled in.
    pub(super) fn lowering(&self) -> sim::ir::lowering::Lowering {
        self.lowering_flags()
            .over(sim::ir::lowering::Lowering::default())
    }

    /// `--p2p-posting` and `--p2p-streams` as given (`None`: not given).
    pub(super) fn lowering_flags(&self) -> resolve::LoweringFlags {
        use sim::ir::comm::StreamLayout;
        resolve::LoweringFlags {
            posting: self.p2p_posting.map(Into::into),
            streams: self.p2p_streams.map(|s| match s {
                P2pStreams::PerPeer => StreamLayout::PerPeer,
                P2pStreams::PeerPair => StreamLayout::PeerPair,
                P2pStreams::Shared => StreamLayout::Shared,
            }),
            fsdp: self.fsdp.map(Some),
            fsdp_defer_wait: self.fsdp_defer_wait.then_some(true),
        }
    }
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
        None => Schedules::Kinds(parse_kinds(&a.schedule, a.ep.is_some_and(|ep| ep > 1))?),
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
        Some(spec) => simulate_uniform(&a, &spec.parse::<CostSpec>()?, schedules),
        None => simulate_profile(&a, schedules),
    }
}

/// Writes the Gantt chart(s) and trace a `simulate` call asked for: the notes to print, and
/// the first output that could not be written (the caller prints the finished run's table
/// before returning it, so a full disk loses a chart, not the results).
pub(super) fn write_charts(
    a: &SimulateArgs,
    runs: &[(String, String, &Simulation)],
) -> (Vec<String>, Option<anyhow::Error>) {
    let mut notes = Vec::new();
    let failed = try_write_charts(a, runs, &mut notes).err();
    (notes, failed)
}

/// [`write_charts`]' work, adding a note per file written to `notes`.
///
/// # Errors
/// The first chart, trace or memory file that cannot be written.
fn try_write_charts(
    a: &SimulateArgs,
    runs: &[(String, String, &Simulation)],
    notes: &mut Vec<String>,
) -> Result<()> {
    let Some((best_name, best_title, best_sim)) = runs.first() else {
        return Ok(());
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
    Ok(())
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
