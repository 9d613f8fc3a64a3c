//! `flatpipe drift`: a run that drifts, simulated step by step, planned once against planned
//! before every step ([`sim::run::drift`]): GPUs that slow down (`--stragglers`) or sequence
//! lengths that grow (`--grow`).

use super::*;
use sim::run::config::RunConfig;
use sim::run::drift::{self, Stragglers};

/// Options of `flatpipe drift`: one drift, `--grow` or `--stragglers`.
#[derive(Debug, Args)]
#[command(group = clap::ArgGroup::new("drift").args(["grow", "stragglers"]).required(true))]
pub(super) struct DriftArgs {
    #[command(flatten)]
    inputs: Inputs,
    /// Tensor-parallel degree: GPUs per pipeline rank (default 1).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    tp: u32,
    /// Pipeline-parallel degree (ranks per pipeline).
    #[arg(long, default_value_t = resolve::DEFAULT_PP, value_parser = clap::value_parser!(u32).range(1..))]
    pp: u32,
    /// Data-parallel replicas of the pipeline. GPUs = tp x pp x dp. The replicas share each
    /// step's sequences: give --tokens-per-step to grow the step with them.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    dp: u32,
    /// Schedule (one kind; zb-auto is searched per step under the memory limit).
    #[arg(long, default_value = "zb-auto")]
    schedule: String,
    /// Microbatching policy (flat-planned plans each step's cut for its schedule).
    #[arg(long, default_value = "flat-planned")]
    policy: String,
    /// Token budget per microbatch (with --stragglers; --grow compares --budgets).
    #[arg(long, default_value_t = sim::batching::policy::DEFAULT_TOKEN_BUDGET, conflicts_with = "grow")]
    token_budget: u64,
    /// Cut a sequence longer than the token budget into chunks of at most this many tokens
    /// (with --grow, at most each budget compared).
    #[arg(long)]
    chunk_tokens: Option<u64>,
    /// How the replicas shard their state: ddp (default), zero1, zero2, fsdp, fsdp-mb, hsdp.
    #[arg(long, default_value = "ddp")]
    sharding: String,
    /// Per-rank memory limit (bytes or a size such as 75GiB; default: the hardware's memory
    /// less a reserve).
    #[arg(long, allow_negative_numbers = true)]
    memory_limit: Option<String>,
    /// Steps to simulate, >= 2.
    #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u32).range(2..))]
    steps: u32,
    /// Sequences per step (default: the workload's).
    #[arg(long, conflicts_with = "tokens_per_step")]
    seqs_per_step: Option<u32>,
    /// Tokens per step: sequences are drawn until the step holds this many.
    #[arg(long)]
    tokens_per_step: Option<u64>,
    /// Seed of the lengths and the stragglers.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Lengths that grow: every length times a factor rising linearly from 1 at the first step
    /// to this at the last (an RL run whose responses lengthen). Compares every budget of
    /// --budgets held for the whole run with the budget re-chosen per step.
    #[arg(long, allow_negative_numbers = true)]
    grow: Option<f64>,
    /// Truncate every length (grown, with --grow) to at most this many tokens (an RL run's
    /// maximum response length).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    max_len: Option<u32>,
    /// Token budgets to compare with --grow.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "4096,8192,16384,32768,65536",
        requires = "grow"
    )]
    budgets: Vec<u64>,
    /// GPUs that slow down, drawn per GPU and step: a steady spread of --straggler-spread and
    /// fail-slows (Sinha et al., SC '22, arXiv 2208.11035; Wu et al., arXiv 2410.12588).
    /// Compares the plan made once, re-planning from the measured speeds, and the plan made
    /// knowing the true speeds (the same planner: not a bound).
    #[arg(long)]
    stragglers: bool,
    /// Each GPU's steady time is 1 + U(0, this) times the profile's.
    #[arg(long, default_value_t = 0.08, requires = "stragglers")]
    straggler_spread: f64,
    /// Per GPU and step, the probability that a fail-slow starts.
    #[arg(long, default_value_t = 1e-4, requires = "stragglers")]
    straggler_onset: f64,
    /// Mean length of a fail-slow, steps.
    #[arg(long, default_value_t = 30.0, requires = "stragglers")]
    straggler_steps: f64,
    /// A fail-slow multiplies a GPU's time by U(LO, HI): `LO:HI`.
    #[arg(long, default_value = "1.1:1.5", requires = "stragglers")]
    straggler_factor: String,
    /// The estimate's forgetting factor in (0, 1] (re-planning with --stragglers).
    #[arg(
        long,
        default_value_t = 0.5,
        allow_negative_numbers = true,
        requires = "stragglers"
    )]
    forgetting: f64,
    /// Output format.
    #[arg(long, value_enum, default_value_t = Format::Table)]
    format: Format,
}

/// The run, its profile (split over --tp) and the workload.
fn resolve_run(a: &DriftArgs) -> Result<(RunConfig, Profile, Workload)> {
    let i = &a.inputs;
    let base = resolve_profile(
        i.profile.as_deref(),
        i.model.as_deref(),
        i.hardware.as_deref(),
    )?;
    let profile = base.tensor_parallel(a.tp, true)?;
    let workload = builtins::workload(i.workload.as_deref().unwrap_or(builtins::DEFAULT_WORKLOAD))?;
    let kind: ScheduleKind = a
        .schedule
        .parse()
        .map_err(|e| anyhow::anyhow!("--schedule: {e}"))?;
    let policy: Policy = a
        .policy
        .parse()
        .map_err(|e| anyhow::anyhow!("--policy: {e}"))?;
    let v = kind.stages_per_rank(None)?;
    let stages = even_split(profile.layers.len(), (a.pp * v) as usize)?;
    let mut run = RunConfig::new(
        ScheduleSource::Kind(kind),
        a.pp,
        v,
        stages,
        policy,
        Capacity::Dynamic,
    );
    run.dp = a.dp;
    run.params.token_budget = a.token_budget;
    run.params.chunk_tokens = a.chunk_tokens;
    run.sharding = a
        .sharding
        .parse()
        .map_err(|e| anyhow::anyhow!("--sharding: {e}"))?;
    run.memory_limit_bytes = Some(memory_limit(a.memory_limit.as_deref(), &profile)?);
    run.validate(profile.layers.len())?;
    Ok((run, profile, workload))
}

/// `flatpipe drift`.
pub(super) fn drift_cmd(a: DriftArgs) -> Result<ExitCode> {
    let (run, profile, workload) = resolve_run(&a)?;
    if !(a.forgetting > 0.0 && a.forgetting <= 1.0) {
        bail!(
            "--forgetting {} is invalid: the weight of a step one step older, in (0, 1]",
            a.forgetting
        );
    }
    let size = resolve::step_size(a.seqs_per_step, a.tokens_per_step, None, &workload)?;
    let n = a.steps as usize;
    let cap = a.max_len.unwrap_or(u32::MAX);
    let capped = |mut seqs: Vec<u32>| {
        seqs.iter_mut().for_each(|s| *s = (*s).min(cap));
        seqs
    };
    let sample = |t: usize| capped(workload.sample_step(a.seed, t as u64, size));
    let progress = Progress::new(n as u64);
    let tick = || progress.inc();
    let gpus = u64::from(a.tp) * u64::from(a.pp) * u64::from(a.dp);
    profile.hardware.check_gpus(gpus)?;
    check_drift_memory(&a, &run, &workload, size)?;
    let what = format!(
        "{} on {} GPUs (tp {} x pp {} x dp {}), {}, {}, {} steps of {}",
        profile.model,
        gpus,
        a.tp,
        a.pp,
        a.dp,
        run.source.name(),
        run.policy.name(),
        n,
        workload.name
    );
    let (doc, table, notes) = match a.grow {
        Some(g) => {
            if !(g > 0.0 && g.is_finite()) {
                bail!("--grow {g} is invalid: a factor > 0 (2: lengths double over the run)");
            }
            let steps: Vec<Vec<u32>> = (0..n)
                .map(|t| {
                    let factor = 1.0 + (g - 1.0) * t as f64 / (n - 1) as f64;
                    capped(drift::grown(
                        &workload.sample_step(a.seed, t as u64, size),
                        factor,
                    ))
                })
                .collect();
            let longest = steps.iter().flatten().copied().max().unwrap_or(0);
            let out = drift::budget_run(&run, &profile, &steps, &a.budgets, &tick)
                .map_err(|e| too_long(e, longest))?;
            grow_report(out, g)
        }
        None => {
            let s = stragglers(&a)?;
            let factors = s.draw((a.pp * a.dp) as usize, n, a.seed)?;
            let steps: Vec<(Vec<u32>, Vec<f64>)> = factors
                .into_iter()
                .enumerate()
                .map(|(t, f)| (sample(t), f))
                .collect();
            let longest = steps.iter().flat_map(|x| &x.0).copied().max().unwrap_or(0);
            let arms = drift::straggler_run(&run, &profile, &steps, a.forgetting, &tick)
                .map_err(|e| too_long(e, longest))?;
            straggler_report(&arms, &s)
        }
    };
    progress.finish();
    let mut doc = doc;
    doc["run"] = serde_json::json!({
        "model": profile.model, "gpus": gpus, "tp": a.tp, "pp": a.pp, "dp": a.dp,
        "schedule": run.source.name(), "policy": run.policy.name(), "steps": n,
        "seed": a.seed, "workload": workload.name, "grow": a.grow, "max_len": a.max_len,
    });
    emit(a.format, &doc, &what, &table, &notes)
}

/// `e`, with the run's longest sequence and what to do about it when a step's activations
/// did not fit the memory limit (the limit is then the activations' share of it).
fn too_long(e: sim::Error, longest: u32) -> anyhow::Error {
    match e {
        sim::Error::MemoryLimit { ref limit, .. } if limit.ends_with("of activations") => {
            anyhow::anyhow!(
                "{e}; the run's longest sequence has {longest} tokens: cap the lengths with --max-len, cut them into chunks with --chunk-tokens, or give a smaller --token-budget, more ranks or memory"
            )
        }
        e => e.into(),
    }
}

/// Refuses, before anything is allocated, a run whose sampled steps, step plans (one step's
/// at a time, every budget's with --grow) or straggler draw would not fit in memory.
fn check_drift_memory(a: &DriftArgs, run: &RunConfig, w: &Workload, size: StepSize) -> Result<()> {
    let configs: Vec<RunConfig> = match a.grow {
        Some(_) => a
            .budgets
            .iter()
            .map(|&b| {
                let mut c = run.clone();
                c.params.token_budget = b.max(1);
                c
            })
            .collect(),
        None => vec![run.clone()],
    };
    check_monte_carlo_memory("drift", w, a.seed, size, 1, a.steps, &configs)?;
    let gpus = f64::from(a.tp) * f64::from(a.pp) * f64::from(a.dp);
    let draw = f64::from(a.steps) * f64::from(a.pp) * f64::from(a.dp) * 8.0 + gpus * 24.0;
    check_memory(
        "drift's straggler draw",
        if a.stragglers { draw } else { 0.0 },
        &format!("{} steps of {gpus} GPUs hold {}", a.steps, fmt_bytes(draw)),
        "use fewer steps or GPUs",
    )
}

/// The straggler model of the flags.
fn stragglers(a: &DriftArgs) -> Result<Stragglers> {
    let bad = || {
        anyhow::anyhow!(
            "--straggler-factor {} is invalid: LO:HI with 1 <= LO <= HI",
            a.straggler_factor
        )
    };
    let (lo, hi) = a.straggler_factor.split_once(':').ok_or_else(bad)?;
    let s = Stragglers {
        gpus_per_rank: a.tp,
        spread: a.straggler_spread,
        onset: a.straggler_onset,
        mean_steps: a.straggler_steps,
        factor: (
            lo.trim().parse().map_err(|_| bad())?,
            hi.trim().parse().map_err(|_| bad())?,
        ),
    };
    s.validate().map_err(|e| {
        anyhow::anyhow!("the straggler model (--straggler-spread, --straggler-onset, --straggler-steps, --straggler-factor) is invalid: {e}")
    })?;
    Ok(s)
}

fn mean(v: &[f64]) -> f64 {
    v.iter().sum::<f64>() / v.len().max(1) as f64
}

fn pct(x: f64, of: f64) -> String {
    format!("{:+.1}%", 100.0 * (x / of - 1.0))
}

type Report = (serde_json::Value, PlainTable, Vec<String>);

/// The --stragglers table: each arm's mean step time against the ideal and the re-planned.
fn straggler_report(arms: &drift::StragglerArms, s: &Stragglers) -> Report {
    let rows = [
        ("ideal (nobody slow)", &arms.ideal),
        ("planned once", &arms.fixed),
        ("re-planned each step", &arms.replanned),
        ("oracle (true speeds)", &arms.oracle),
    ];
    let ideal = mean(&arms.ideal);
    let mut table = new_table(&["plan", "mean step (s)", "vs ideal"]);
    for (name, v) in rows {
        table.add_row(vec![
            name.to_string(),
            format!("{:.3}", mean(v)),
            pct(mean(v), ideal),
        ]);
    }
    let (f, r, o) = (mean(&arms.fixed), mean(&arms.replanned), mean(&arms.oracle));
    let plan_s = mean(&arms.planning_s);
    let notes = vec![
        format!(
            "re-planning: {} against the plan made once; {} from the oracle",
            pct(r, f),
            pct(r, o)
        ),
        format!(
            "planning each step took {:.1} ms on this machine, {:.3}% of the mean step",
            plan_s * 1e3,
            100.0 * plan_s / r
        ),
        format!(
            "stragglers: steady spread {:.0}%, fail-slows x{}-{} for {} steps on average, onset {} per GPU and step, {} GPU(s) per rank",
            100.0 * s.spread,
            s.factor.0,
            s.factor.1,
            s.mean_steps,
            s.onset,
            s.gpus_per_rank
        ),
    ];
    let doc = serde_json::json!({
        "ideal_s": arms.ideal, "fixed_s": arms.fixed, "replanned_s": arms.replanned,
        "oracle_s": arms.oracle, "planning_s": arms.planning_s,
        "mean_s": {"ideal": ideal, "fixed": f, "replanned": r, "oracle": o},
        "stragglers": {"gpus_per_rank": s.gpus_per_rank, "spread": s.spread, "onset": s.onset,
            "mean_steps": s.mean_steps, "factor": [s.factor.0, s.factor.1]},
    });
    (doc, table, notes)
}

/// The --grow table: every budget held for the run against the budget re-chosen per step.
fn grow_report(run: drift::BudgetRun, g: f64) -> Report {
    let drift::BudgetRun {
        arms,
        chosen,
        planning_s: planning,
    } = run;
    let n = chosen.len();
    let replanned: Vec<f64> = (0..n)
        .map(|t| {
            chosen[t]
                .and_then(|b| arms.iter().find(|a| a.budget == b))
                .map_or(f64::NAN, |a| a.steps[t].0)
        })
        .collect();
    let ran: Vec<f64> = replanned
        .iter()
        .copied()
        .filter(|x| x.is_finite())
        .collect();
    let r = mean(&ran);
    let mut table = new_table(&[
        "token budget",
        "mean step (s)",
        "vs re-planned",
        "steps over memory",
    ]);
    for a in &arms {
        // A budget over the memory limit on some step did not run the whole run.
        let (mean_s, vs) = if a.over_memory() == 0 {
            (format!("{:.3}", a.mean_s()), pct(a.mean_s(), r))
        } else {
            ("-".to_string(), "-".to_string())
        };
        table.add_row(vec![
            a.budget.to_string(),
            mean_s,
            vs,
            a.over_memory().to_string(),
        ]);
    }
    let mut counts: Vec<(u64, usize)> = Vec::new();
    for b in chosen.iter().flatten() {
        match counts.iter_mut().find(|c| c.0 == *b) {
            Some(c) => c.1 += 1,
            None => counts.push((*b, 1)),
        }
    }
    counts.sort();
    let picks: Vec<String> = counts.iter().map(|(b, k)| format!("{b} x{k}")).collect();
    let unfit = n - ran.len();
    table.add_row(vec![
        "re-planned".to_string(),
        if unfit == 0 {
            format!("{r:.3}")
        } else {
            format!("{r:.3} ({} step(s))", ran.len())
        },
        "+0.0%".to_string(),
        unfit.to_string(),
    ]);
    let best = arms
        .iter()
        .filter(|a| a.over_memory() == 0)
        .min_by(|a, b| a.mean_s().total_cmp(&b.mean_s()));
    let mut notes = vec![format!(
        "lengths grow linearly to {g}x; the re-planned budget per step: {}",
        picks.join(", ")
    )];
    notes.push(match best {
        Some(b) => format!(
            "best fixed budget that fits every step: {} ({} against re-planning)",
            b.budget,
            pct(b.mean_s(), r)
        ),
        None if unfit == 0 => {
            "no budget fits every step: only re-planning runs the whole run".to_string()
        }
        None => format!(
            "{unfit} steps fit no budget (a sequence too long for the memory at any budget): cap the lengths with --max-len, or give more memory or ranks"
        ),
    });
    if let Some(first) = chosen
        .first()
        .copied()
        .flatten()
        .and_then(|b| arms.iter().find(|a| a.budget == b))
        .filter(|a| a.over_memory() == 0)
    {
        notes.push(format!(
            "the budget best at the first step, held for the run: {} ({} against re-planning)",
            first.budget,
            pct(first.mean_s(), r)
        ));
    }
    let plan_s = mean(&planning);
    notes.push(format!(
        "choosing a step's budget (planning it under every budget) took {:.1} ms on this machine, {:.3}% of the mean step",
        plan_s * 1e3,
        100.0 * plan_s / r
    ));
    let doc = serde_json::json!({
        "budgets": arms.iter().map(|a| serde_json::json!({
            "budget": a.budget,
            "step_s": a.steps.iter().map(|s| s.0).collect::<Vec<_>>(),
            "fits": a.steps.iter().map(|s| s.1).collect::<Vec<_>>(),
        })).collect::<Vec<_>>(),
        "replanned_budget": chosen, "replanned_s": replanned, "planning_s": planning,
    });
    (doc, table, notes)
}
