//! The resolution layer shared by the subcommands (not a subcommand): what the user's flags and
//! files mean, decided once (the per-rank memory limit, the step size).

use super::*;
use sim::run::config::RunConfig;

/// The per-rank memory limit, bytes: `--memory-limit` (a number of bytes or a size such as
/// `120GiB`), or the hardware's memory less its reserve
/// ([`flatpipe_simulator::run::config::default_memory_limit`]). A limit above the device's memory is warned of once.
///
/// # Errors
/// A limit that does not parse or is not positive, naming the flag.
pub(super) fn memory_limit(arg: Option<&str>, profile: &Profile) -> Result<f64> {
    match arg {
        None => Ok(flatpipe_simulator::run::config::default_memory_limit(
            profile,
        )),
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
            let device = profile.hardware.memory_bytes as f64;
            if bytes > device {
                // Said once per run (several configurations resolve the same limit).
                static WARNED: std::sync::Once = std::sync::Once::new();
                WARNED.call_once(|| {
                    tracing::warn!(
                        "--memory-limit {text} is more than {}'s {} of memory: plans under it may not fit the device",
                        profile.hardware.name,
                        fmt_bytes(device)
                    )
                });
            }
            Ok(bytes)
        }
    }
}

/// The step size: `--seqs-per-step` or `--tokens-per-step` as given, else the plan file's, else
/// the workload's default (one rule for `simulate`, `plan` and `execute`).
///
/// # Errors
/// A zero size, naming the flag.
pub(super) fn step_size(
    seqs: Option<u32>,
    tokens: Option<u64>,
    plan: Option<&Plan>,
    w: &Workload,
) -> Result<StepSize> {
    Ok(match (seqs, tokens) {
        (Some(0), _) => bail!("--seqs-per-step = 0 is invalid: >= 1 sequence"),
        (_, Some(0)) => bail!("--tokens-per-step = 0 is invalid: >= 1 token"),
        (Some(n), _) => StepSize::Seqs(n),
        (None, Some(t)) => StepSize::Tokens(t),
        (None, None) => match plan.map(|p| (p.inputs.seqs_per_step, p.inputs.tokens_per_step)) {
            Some((Some(0), _)) => bail!("the plan's seqs_per_step = 0 is invalid: >= 1 sequence"),
            Some((_, Some(0))) => bail!("the plan's tokens_per_step = 0 is invalid: >= 1 token"),
            Some((Some(n), _)) => StepSize::Seqs(n),
            Some((_, Some(t))) => StepSize::Tokens(t),
            _ => w.default_step_size(),
        },
    })
}

/// Pipeline ranks when neither `--pp` nor a plan file gives them: four, the depth the
/// planner's search and the examples start from (the executor on a machine with fewer cores
/// warns that its ranks share cores).
pub(super) const DEFAULT_PP: u32 = 4;

/// The schedule when neither `--schedule` nor a plan file names one.
pub(super) const DEFAULT_SCHEDULE: ScheduleKind = ScheduleKind::OneFOneB;

/// The microbatching policy when neither `--policy` nor a plan file names one: flat-ffd, the
/// fewest microbatches of at most the token budget ([`sim::batching::policy::DEFAULT_TOKEN_BUDGET`]
/// tokens unless `--token-budget` or `--microbatches` is given). A token budget bounds every
/// microbatch's activation memory whatever the step's size, as verl's dynamic batching
/// (`ppo_max_token_len_per_gpu`) does; a plan file without `policy:` means the same.
pub(super) const DEFAULT_POLICY: Policy = Policy::FlatFfd;

/// The flags that describe one run, as `simulate` and `execute` take them (each `None` when
/// the flag was not given). A plan file's run is the base when there is one; clap refuses the
/// layout flags (`--pp`, `--vpp`, `--schedule`, `--microbatches`, `--token-budget`) alongside
/// `--plan`, and the others vary the plan's run.
#[derive(Default)]
pub(super) struct RunFlags {
    pub(super) pp: Option<u32>,
    pub(super) vpp: Option<u32>,
    pub(super) dp: Option<u32>,
    pub(super) microbatches: Option<u32>,
    pub(super) token_budget: Option<u64>,
    pub(super) chunk_tokens: Option<u64>,
    /// `--pack-len` and `--max-seq-len` (the padded and packed policies').
    pub(super) pack_len: Option<u32>,
    pub(super) max_seq_len: Option<u32>,
    pub(super) sharding: Option<sim::costs::sharding::Sharding>,
    /// `--fo-microbatches` and friends: `None` when `--fo-microbatches` was not given (the
    /// plan's forward-only work stands), else the asked spec (`Some(None)`: none).
    pub(super) forward_only: Option<Option<sim::run::config::ForwardOnlySpec>>,
    /// `--memory-limit`, resolved to bytes.
    pub(super) memory_limit_bytes: Option<f64>,
    /// `--p2p-posting` and `--p2p-streams`.
    pub(super) lowering: LoweringFlags,
    /// `--cp` and its options (`None`, or cp = 1: one GPU per rank).
    pub(super) context_parallel: Option<profiles::context_parallel::ContextParallel>,
}

/// `--p2p-posting`, `--p2p-streams` and `--fsdp` as given (`None`: the plan file's, else the
/// default).
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct LoweringFlags {
    pub(super) posting: Option<sim::ir::lowering::RecvPosting>,
    pub(super) streams: Option<sim::ir::comm::StreamLayout>,
    pub(super) fsdp: Option<Option<u32>>,
    pub(super) fsdp_defer_wait: Option<bool>,
}

impl LoweringFlags {
    /// `base` with the given flags in place of its fields.
    pub(super) fn over(self, base: sim::ir::lowering::Lowering) -> sim::ir::lowering::Lowering {
        sim::ir::lowering::Lowering {
            posting: self.posting.unwrap_or(base.posting),
            streams: self.streams.unwrap_or(base.streams),
            fsdp: self.fsdp.unwrap_or(base.fsdp),
            fsdp_defer_wait: self.fsdp_defer_wait.unwrap_or(base.fsdp_defer_wait),
        }
    }
}

/// The run `flags` and `plan` describe for one schedule `source` (`None`: the plan's, else
/// [`DEFAULT_SCHEDULE`]) and `policy` (`None`: the plan's, else [`DEFAULT_POLICY`]), at
/// `capacity`, on a model of `num_layers` layers: the one place `simulate` and `execute` decide
/// a run's defaults ([`DEFAULT_PP`], the schedule's own stages per rank, a token budget of
/// [`sim::batching::policy::DEFAULT_TOKEN_BUDGET`] tokens, one replica, DDP, no recomputation,
/// stages of an even layer split). A given schedule (`--schedule-csv`) sets pp, the stages per
/// rank and the exact microbatch count.
///
/// # Errors
/// `--pp 0`, a vpp the schedule does not run, more stages than layers, a plan file whose run
/// does not resolve; [`sim::run::config::RunConfig::validate`]'s refusals.
pub(super) fn run_config(
    flags: &RunFlags,
    plan: Option<&Plan>,
    source: Option<ScheduleSource>,
    policy: Option<Policy>,
    capacity: Capacity,
    num_layers: usize,
) -> Result<RunConfig> {
    let mut run = match plan {
        Some(p) => p.run_config()?,
        None => {
            let source = source
                .clone()
                .unwrap_or(ScheduleSource::Kind(DEFAULT_SCHEDULE));
            let (pp, v, given_m) = match &source {
                ScheduleSource::Given(s) => (
                    s.placement.num_ranks,
                    s.num_stages() / s.placement.num_ranks,
                    Some(s.num_microbatches),
                ),
                ScheduleSource::Kind(k) => (
                    flags.pp.unwrap_or(DEFAULT_PP),
                    k.stages_per_rank(flags.vpp)?,
                    None,
                ),
            };
            if pp == 0 {
                bail!("--pp = 0 is invalid: >= 1 rank");
            }
            let stages = even_split(num_layers, (pp * v) as usize)?;
            let mut run = RunConfig::new(source, pp, v, stages, DEFAULT_POLICY, capacity);
            run.params.microbatches = given_m.or(flags.microbatches);
            if let Some(t) = flags.token_budget {
                run.params.token_budget = t;
            }
            run.dp = flags.dp.unwrap_or(1);
            run.sharding = flags.sharding.unwrap_or_default();
            run
        }
    };
    // What varies a plan's run (and fills an inline one).
    if plan.is_some()
        && let Some(s) = source
    {
        run.source = s;
    }
    run.capacity = capacity;
    if let Some(p) = policy {
        run.policy = p;
    }
    if let Some(c) = flags.chunk_tokens {
        run.params.chunk_tokens = Some(c);
    }
    if let Some(l) = flags.pack_len {
        run.params.pack_len = l;
    }
    if flags.max_seq_len.is_some() {
        run.params.max_seq_len = flags.max_seq_len;
    }
    if let Some(fo) = flags.forward_only {
        run.forward_only = fo;
    }
    if let Some(l) = flags.memory_limit_bytes {
        run.memory_limit_bytes = Some(l);
    }
    if let Some(cp) = flags.context_parallel.filter(|c| c.cp > 1) {
        cp.validate()
            .map_err(|e| anyhow::anyhow!("--cp {} with --cp-comm / --dynamic-cp: {e}", cp.cp))?;
        run.context_parallel = Some(cp);
    }
    if run.dp == 0 {
        bail!("--dp = 0 is invalid: >= 1 replica");
    }
    run.lowering = flags.lowering.over(run.lowering);
    if let Some(k) = run.lowering.fsdp {
        let per_stage = sim::costs::sharding::StageCollectives::runs(run.sharding, run.pp);
        if !per_stage || run.dp < 2 || run.pp < 2 {
            bail!(
                "the per-stage actions (--fsdp {k}, or a plan's lowering.fsdp) run the data-parallel \
                 collectives of --sharding fsdp, hsdp, ddp or zero1 across --dp >= 2 replicas \
                 under pp >= 2; this run has --sharding {} with --dp {} at pp {}: give --sharding \
                 fsdp and --dp 2 or more, or drop --fsdp",
                run.sharding,
                run.dp,
                run.pp
            );
        }
    }
    Ok(run)
}
