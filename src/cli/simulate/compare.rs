//! The runs `simulate` compares on a profile: flags and a plan file resolved into run
//! configurations, one per (schedule, policy, capacity).

use super::*;

/// A comparison on a profile, resolved from the flags and an optional plan file: every default
/// decided here, once.
pub(super) struct Comparison {
    pub(super) plan: Option<Plan>,
    pub(super) profile: Profile,
    pub(super) workload: Workload,
    pub(super) size: StepSize,
    pub(super) seed: u64,
    pub(super) steps: u32,
    /// Exactly this many microbatches per step (else the token budget).
    pub(super) microbatches: Option<u32>,
    pub(super) token_budget: u64,
    pub(super) policies: Vec<Policy>,
    pub(super) capacities: Vec<Capacity>,
    /// Ranks per pipeline.
    pub(super) p: u32,
    /// Tensor-parallel degree and sequence parallelism (`profile` is then one GPU's).
    pub(super) tp: (u32, bool),
    /// The profile before tensor parallelism (what a plan file's hash names).
    pub(super) base_profile: Profile,
    /// Per-rank memory limit, bytes, and where it comes from in the user's words.
    pub(super) limit: f64,
    pub(super) limit_source: String,
    /// One configuration per (schedule, policy, capacity).
    pub(super) configs: Vec<flatpipe_simulator::run::config::RunConfig>,
}

/// The profile before and after tensor parallelism (one GPU's), the tensor-parallel degree
/// with sequence parallelism, and the workload of a comparison: the plan file's inputs, else
/// the flags'. The plan file is checked against the profile's model here.
///
/// # Errors
/// A profile or workload that does not load, `--keep-prob` out of range, a plan that does not
/// fit the model, a tp the model's heads do not divide.
fn resolve_inputs(
    a: &SimulateArgs,
    plan: Option<&Plan>,
) -> Result<(Profile, Profile, (u32, bool), Workload)> {
    fn pick<'a>(from_plan: Option<&'a String>, from_args: &'a Option<String>) -> Option<&'a str> {
        from_plan.or(from_args.as_ref()).map(String::as_str)
    }
    let profile = resolve_profile(
        pick(
            plan.and_then(|p| p.inputs.profile.as_ref()),
            &a.inputs.profile,
        ),
        pick(plan.and_then(|p| p.inputs.model.as_ref()), &a.inputs.model),
        pick(
            plan.and_then(|p| p.inputs.hardware.as_ref()),
            &a.inputs.hardware,
        ),
    )?;
    let workload_name = a
        .inputs
        .workload
        .clone()
        .or_else(|| plan.map(|p| p.inputs.workload.clone()))
        .unwrap_or_else(|| builtins::DEFAULT_WORKLOAD.to_string());
    let mut workload = builtins::workload(&workload_name)?;
    if let Some(q) = a.keep_prob {
        workload.keep_probability = Some(q);
        workload.validate("--keep-prob")?;
    }
    if let (Some(p), Some(path)) = (plan, &a.plan) {
        p.validate(&path.display().to_string(), profile.layers.len())?;
    }
    let tp = match plan {
        Some(p) => p.tensor_parallel(),
        None => (a.tp.unwrap_or(1), !a.no_sequence_parallel),
    };
    let ep = plan.map_or(a.ep.unwrap_or(1), |p| p.ep);
    let base_profile = profile.clone();
    let split = |p: &Profile| {
        p.tensor_parallel(tp.0, tp.1)
            .and_then(|q| q.expert_parallel(ep, tp.0, tp.1))
    };
    let profile = match &a.plan {
        // A plan file's tp and ep: the error names the file, not a flag.
        Some(path) => split(&profile).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?,
        None => split(&profile)?,
    };
    Ok((base_profile, profile, tp, workload))
}

/// Resolves `simulate`'s flags and plan file into a [`Comparison`].
pub(super) fn resolve_comparison(a: &SimulateArgs, schedules: Schedules) -> Result<Comparison> {
    let plan = read_plan(a.plan.as_deref())?;
    let (base_profile, profile, tp, workload) = resolve_inputs(a, plan.as_ref())?;
    let sharding = a
        .sharding
        .as_ref()
        .map(|m| {
            m.trim()
                .parse::<sim::costs::sharding::Sharding>()
                .map_err(|e| anyhow::anyhow!("--sharding: {e}"))
        })
        .transpose()?;
    let size = resolve::step_size(a.seqs_per_step, a.tokens_per_step, plan.as_ref(), &workload)?;
    let seed = a
        .seed
        .or(plan.as_ref().map(|p| p.inputs.seed))
        .unwrap_or(workload.seed);
    let steps = a.steps.unwrap_or(1);
    if steps == 0 {
        bail!("--steps = 0 is invalid: >= 1 step");
    }
    if matches!(schedules, Schedules::Csv(_)) && !a.capacity.is_empty() {
        bail!(
            "--capacity cannot be combined with --schedule-csv: a loaded schedule has the fixed capacity of its microbatch count"
        );
    }
    let (limit, limit_source) = row_limit(a, plan.as_ref(), &profile)?;
    let flags = resolve::RunFlags {
        pp: a.pp,
        vpp: a.vpp,
        dp: a.dp,
        microbatches: a.microbatches,
        token_budget: a.token_budget,
        chunk_tokens: a.chunk_tokens,
        pack_len: a.pack_len,
        max_seq_len: a.max_seq_len,
        lowering: a.lowering_flags(),
        sharding,
        forward_only: a.fo.fo_microbatches.map(|_| a.fo.spec()).transpose()?,
        memory_limit_bytes: Some(limit),
        context_parallel: context_parallel(a)?,
    };
    let (policies, capacities) = policies_and_capacities(a)?;
    let sources = schedule_sources(a, schedules, plan.as_ref())?;
    let mut combos = Vec::new();
    for source in &sources {
        for &policy in &policies {
            for &capacity in &capacities {
                combos.push(resolve::run_config(
                    &flags,
                    plan.as_ref(),
                    source.clone(),
                    policy,
                    capacity,
                    profile.layers.len(),
                )?);
            }
        }
    }
    let first = combos
        .first()
        .ok_or_else(|| anyhow::anyhow!("no schedule to simulate"))?;
    let (p, microbatches, token_budget) = (
        first.pp,
        first.params.microbatches,
        first.params.token_budget,
    );
    let ep = profile.expert_parallel;
    if let Some(c) = combos.iter().find(|c| c.dp.max(1) % ep != 0) {
        bail!(
            "--ep = {ep} is invalid: a divisor of --dp = {} (the expert-parallel group is made of data-parallel replicas)",
            c.dp.max(1)
        );
    }
    let policies: Vec<Policy> = dedup(combos.iter().map(|c| c.policy).collect());
    check_combos(&combos, (&workload, seed, size, steps), &base_profile, tp)?;
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

/// The one per-rank memory limit for building zb-auto and checking every row, bytes, and where
/// it came from: `--memory-limit`, else the plan file's (the one it was searched under), else
/// the hardware's less its reserve.
///
/// # Errors
/// A `--memory-limit` that does not parse.
fn row_limit(a: &SimulateArgs, plan: Option<&Plan>, profile: &Profile) -> Result<(f64, String)> {
    let planned = plan
        .and_then(|p| p.predicted.as_ref())
        .map(|p| p.memory_limit_bytes);
    Ok(match (&a.memory_limit, planned) {
        (Some(text), _) => (
            memory_limit(Some(text), profile)?,
            format!("--memory-limit {text}"),
        ),
        (None, Some(bytes)) => (bytes, "the plan file's memory limit".to_string()),
        (None, None) => (
            memory_limit(None, profile)?,
            format!("{}'s memory less its reserve", profile.hardware.name),
        ),
    })
}

/// `--policy` and `--capacity` as given (deduplicated), or one default each (`None`: the run's
/// own policy; dynamic capacity).
///
/// # Errors
/// A name that does not parse.
fn policies_and_capacities(a: &SimulateArgs) -> Result<(Vec<Option<Policy>>, Vec<Capacity>)> {
    let policies = if a.policy.is_empty() {
        vec![None]
    } else {
        dedup(
            a.policy
                .iter()
                .map(|x| x.parse().map(Some))
                .collect::<Result<Vec<Option<Policy>>, _>>()?,
        )
    };
    let capacities = if a.capacity.is_empty() {
        vec![Capacity::Dynamic]
    } else {
        dedup(
            a.capacity
                .iter()
                .map(|x| x.parse())
                .collect::<Result<Vec<Capacity>, _>>()?,
        )
    };
    Ok((policies, capacities))
}

/// The schedules compared: a plan file runs its own schedule, or with `--schedule` those of
/// its stages per rank ([`plan_schedules`]); `--schedule-csv` its; else each schedule asked
/// for (`None`: the plan's own).
///
/// # Errors
/// As [`plan_schedules`].
fn schedule_sources(
    a: &SimulateArgs,
    schedules: Schedules,
    plan: Option<&Plan>,
) -> Result<Vec<Option<ScheduleSource>>> {
    Ok(match (schedules, plan) {
        (Schedules::Csv(s), _) => vec![Some(ScheduleSource::Given(s))],
        (Schedules::Kinds(kinds), Some(p)) if !a.schedule.is_empty() => plan_schedules(p, kinds)?,
        (_, Some(_)) => vec![None],
        (Schedules::Kinds(kinds), None) => kinds
            .into_iter()
            .map(|k| Some(ScheduleSource::Kind(k)))
            .collect(),
    })
}

/// Refuses, before any work, runs this host or cluster cannot hold: the schedules of a fixed
/// microbatch count (`--microbatches`), the Monte Carlo's steps, and more GPUs (tp x cp x dp x
/// pp) than the hardware's cluster has.
///
/// # Errors
/// Each check's, with the numbers.
fn check_combos(
    combos: &[sim::run::config::RunConfig],
    (workload, seed, size, steps): (&Workload, u64, StepSize, u32),
    base_profile: &Profile,
    tp: (u32, bool),
) -> Result<()> {
    let Some(first) = combos.first() else {
        return Ok(());
    };
    let p = first.pp;
    if let Some(m) = first.params.microbatches {
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
    super::check_monte_carlo_memory("the Monte Carlo", workload, seed, size, steps, 0, combos)?;
    let cp = first.context_parallel.map_or(1, |c| c.cp);
    base_profile
        .hardware
        .check_gpus(u64::from(tp.0) * u64::from(cp) * u64::from(first.dp.max(1)) * u64::from(p))?;
    Ok(())
}

/// `simulate --plan P --schedule ...`: the schedules to compare on the plan's split,
/// recomputation and sharding, those whose stages per rank are the plan's (`v`); the others
/// are left out with a warning (their split would be another).
///
/// # Errors
/// When no schedule asked for runs the plan's stages per rank, naming those that would.
fn plan_schedules(plan: &Plan, kinds: Vec<ScheduleKind>) -> Result<Vec<Option<ScheduleSource>>> {
    let v = plan.run.v;
    let fits = |k: &ScheduleKind| k.stages_per_rank(Some(v)).is_ok_and(|kv| kv == v);
    let (keep, left): (Vec<ScheduleKind>, Vec<ScheduleKind>) = kinds.into_iter().partition(fits);
    let names = |ks: &[ScheduleKind]| {
        ks.iter()
            .map(|k| k.to_string())
            .collect::<Vec<_>>()
            .join(", ")
    };
    let same: Vec<ScheduleKind> = ScheduleKind::ALL.iter().copied().filter(fits).collect();
    if keep.is_empty() {
        bail!(
            "the plan's split has {v} stage(s) per rank ({} stages), which none of {} runs: compare {} on this plan, or plan again with --schedule",
            plan.run.stages.len(),
            names(&left),
            names(&same)
        );
    }
    if !left.is_empty() {
        tracing::warn!(
            "{} left out: the plan's split has {v} stage(s) per rank, which they do not run (schedules that do: {})",
            names(&left),
            names(&same)
        );
    }
    Ok(keep
        .into_iter()
        .map(|k| Some(ScheduleSource::Kind(k)))
        .collect())
}

/// `--cp` with `--cp-comm`, `--cp-balance` and `--dynamic-cp` (ring and zigzag by
/// default); `None` without `--cp`.
///
/// # Errors
/// A communication or balance name that is not one.
fn context_parallel(
    a: &SimulateArgs,
) -> Result<Option<profiles::context_parallel::ContextParallel>> {
    a.cp.map(|cp| a.cp_opts.group(cp, true)).transpose()
}
