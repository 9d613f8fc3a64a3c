//! `execute`'s estimate of the run's speed and re-planning from it: the refitted profile, the
//! estimate log, each step planned from what the last ones measured, and the straggler test
//! hook.

use super::*;
use flatpipe_executor::interpreter::Slowdown;

/// The estimate's options.
#[derive(Debug, Args)]
pub(super) struct EstimateArgs {
    /// After the steps, write the profile refitted on them here: the profile's costs of each
    /// phase (F, I, W, B, optimizer) times the measured over the predicted busy time of that
    /// phase over the measured steps. Predicting another schedule from it is the closed loop
    /// fitted on this one. Needs a profile measured on this backend.
    #[arg(long)]
    pub(super) fit_profile: Option<PathBuf>,
    /// Write, after the steps, one JSON line per measured step: its predicted and measured
    /// makespan, the time its planning took, and the estimate after it (measured over predicted
    /// busy time per phase and per rank). Needs a profile measured on this backend.
    #[arg(long)]
    pub(super) estimate_log: Option<PathBuf>,
    /// Draw the estimate step by step here (.svg or .png): each step's predicted and measured
    /// makespan, and each rank's speed factor after it. Needs a profile measured on this
    /// backend.
    #[arg(long)]
    pub(super) estimate_chart: Option<PathBuf>,
    /// The estimate's forgetting factor in (0, 1]: a step one step older weighs this much
    /// (memory of about 1 / (1 - factor) steps); 1, the default, weighs every step alike.
    #[arg(long, default_value_t = 1.0, allow_negative_numbers = true)]
    pub(super) forgetting: f64,
    /// Plan each step from the current estimate: the profile with each pipeline rank's stages
    /// scaled by that rank's measured over predicted time per phase, so that zb-auto's schedule,
    /// the cost-balanced cuts and the prediction follow a rank that slows down. Needs a profile
    /// measured on this backend.
    #[arg(long)]
    pub(super) replan: bool,
    /// With --replan: where a pipeline rank stays slower than the others, write the plan with
    /// the layer split proposed for the measured speeds here (YAML; it is not applied
    /// mid-run: run it with `execute --plan`).
    #[arg(long, requires = "replan")]
    pub(super) propose_plan: Option<PathBuf>,
    /// Test hook: `RANK:FACTOR:FROM` makes rank RANK (`d x pp + r`) compute FACTOR times slower
    /// from step FROM on, as a straggler would.
    #[arg(long, hide = true)]
    pub(super) slow_rank: Option<String>,
}

impl EstimateArgs {
    /// Refuses an estimate without a prediction to set it against (a profile not measured on
    /// this backend).
    ///
    /// # Errors
    /// `--fit-profile`, `--estimate-log` or `--replan` without a measured profile.
    pub(super) fn check(&self, predict: bool, model: &str, backend: &str) -> Result<()> {
        let asked = if let Some(p) = &self.fit_profile {
            Some(format!("--fit-profile {}", p.display()))
        } else if let Some(p) = &self.estimate_log {
            Some(format!("--estimate-log {}", p.display()))
        } else if let Some(p) = &self.estimate_chart {
            Some(format!("--estimate-chart {}", p.display()))
        } else if self.replan {
            Some("--replan".to_string())
        } else {
            None
        };
        match asked {
            Some(flag) if !predict => bail!(
                "{flag}: the estimate scales a profile measured on this backend by what the steps measured against its prediction, and the {model} profile was not measured on the {backend} backend (no prediction): measure one with `flatpipe profile` and pass it with --profile"
            ),
            _ => Ok(()),
        }
    }
}

/// `--slow-rank RANK:FACTOR:FROM`.
///
/// # Errors
/// A value that is not three fields, a factor below 1 or not finite, a rank past the run's.
pub(super) fn slowdown(arg: &str, ranks: usize) -> Result<Slowdown> {
    let bad = || {
        anyhow::anyhow!(
            "--slow-rank {arg} is invalid: RANK:FACTOR:FROM, a rank below {ranks}, a factor >= 1, a step"
        )
    };
    let parts: Vec<&str> = arg.split(':').collect();
    let [r, f, from] = parts.as_slice() else {
        return Err(bad());
    };
    let s = Slowdown {
        rank: r.parse().map_err(|_| bad())?,
        factor: f.parse().map_err(|_| bad())?,
        from_step: from.parse().map_err(|_| bad())?,
    };
    if s.rank >= ranks || !(s.factor >= 1.0 && s.factor.is_finite()) {
        return Err(bad());
    }
    Ok(s)
}

/// Adds a step's timed transfers to the link estimate, each sized as the cost model sizes it
/// (`sim::run::link_estimate::message_bytes`, its replica's microbatch tokens; global rank
/// `d * pp + r` is replica d's rank r). The CPU backend's hand-offs take no measured time and
/// add nothing.
pub(super) fn observe_links(
    links: &mut sim::run::link_estimate::LinkEstimate,
    run: &flatpipe_executor::interpreter::StepRun,
    prepared: &PreparedStep,
    profile: &Profile,
    config: &sim::run::config::RunConfig,
) {
    let pp = config.pp.max(1) as usize;
    let bytes = |t: &sim::replay::timeline::TimedTransfer| {
        let tokens = prepared
            .replicas
            .get(t.from.idx() / pp)
            .and_then(|r| r.lengths.get(t.microbatch.idx()))
            .map_or(0, |m| m.tokens());
        sim::run::link_estimate::message_bytes(profile, &config.stages, t, tokens)
    };
    links.observe(&run.timeline.transfers, &bytes);
}

/// A layer split for the speeds the estimate measured (`--replan`, one stage per rank): the
/// planner's [`planner::partition::speeds::propose_split`] on `base` at a microbatch of
/// `tokens` tokens and `pairs` causal pairs; `None` with several stages per rank.
pub(super) fn propose_split(
    base: &Profile,
    config: &sim::run::config::RunConfig,
    estimate: &SpeedEstimate,
    at: (f64, f64),
) -> Option<(Vec<std::ops::Range<usize>>, f64, f64)> {
    let speeds = estimate.rank_factors();
    if config.v != 1 || speeds.len() != config.pp as usize {
        return None;
    }
    planner::partition::speeds::propose_split(base, &config.stages, &speeds, at)
}

/// After a re-planned run: the note on a rank that stayed slow and the layer split proposed
/// for it ([`propose_split`], at the last step's mean microbatch), written as a plan file to
/// `--propose-plan` when given; `None` when nothing is proposed.
///
/// # Errors
/// The plan file cannot be written.
pub(super) fn proposal_note(
    a: &ExecuteArgs,
    r: &ResolvedRun,
    estimate: &SpeedEstimate,
    last: &PreparedStep,
) -> Result<Option<String>> {
    let mbs: Vec<&sim::Microbatch> = last.replicas.iter().flat_map(|x| &x.lengths).collect();
    let n = mbs.len().max(1) as f64;
    let tokens = mbs.iter().map(|m| m.tokens() as f64).sum::<f64>() / n;
    let pairs = mbs
        .iter()
        .flat_map(|m| &m.seq_lens)
        .map(|&s| f64::from(s) * (f64::from(s) + 1.0) / 2.0)
        .sum::<f64>()
        / n;
    let base = r.setup.profile.as_deref().unwrap_or(&r.profile);
    let config = &r.setup.config;
    let Some((stages, now, then)) = propose_split(base, config, estimate, (tokens, pairs)) else {
        return Ok(None);
    };
    let f = estimate.rank_factors();
    let ranges = |s: &[std::ops::Range<usize>]| {
        s.iter()
            .map(|x| format!("{}..{}", x.start, x.end))
            .collect::<Vec<_>>()
            .join(" ")
    };
    let mut note = format!(
        "ranks measured at {} times their profile: layers {} (now {}) would take the slowest stage from {:.2} to {:.2} ms per microbatch ({:+.1}%)",
        f.iter()
            .map(|x| format!("{x:.2}"))
            .collect::<Vec<_>>()
            .join(", "),
        ranges(&stages),
        ranges(&config.stages),
        now * 1e3,
        then * 1e3,
        100.0 * (then / now - 1.0)
    );
    if let Some(path) = &a.est.propose_plan {
        let mut run = config.clone();
        run.stages = stages;
        let plan = sim::Plan {
            inputs: sim::run::plan::PlanInputs {
                model: Some(r.model.name.clone()),
                workload: a
                    .inputs
                    .workload
                    .clone()
                    .unwrap_or_else(|| r.workload.name.clone()),
                profile: a.inputs.profile.clone(),
                seed: r.setup.seed,
                ..Default::default()
            },
            run,
            tp: 1,
            sequence_parallel: true,
            ep: r.setup.ep,
            predicted: None,
            provenance: None,
        };
        profiles::write_atomic(path, plan.to_yaml()?.as_bytes())?;
        note.push_str(&format!(
            "; written to {} (run it with execute --plan)",
            path.display()
        ));
    }
    Ok(Some(note))
}

/// One step of `--estimate-chart`: its predicted and measured makespan and the rank factors
/// after it.
pub(super) fn point(
    step: u64,
    prediction: &flatpipe_executor::runner::Prediction,
    run: &flatpipe_executor::interpreter::StepRun,
    estimate: &SpeedEstimate,
) -> sim::io::estimate_chart::EstimatePoint {
    sim::io::estimate_chart::EstimatePoint {
        step,
        predicted_s: prediction.makespan_s,
        measured_s: run.timeline.makespan_ns() as f64 * 1e-9,
        rank_factors: estimate.rank_factors(),
    }
}

/// Draws `--estimate-chart` (when given) and returns the note saying where.
///
/// # Errors
/// The chart cannot be drawn or written; no measured step had a prediction.
pub(super) fn estimate_chart(
    a: &ExecuteArgs,
    r: &ResolvedRun,
    points: &[sim::io::estimate_chart::EstimatePoint],
) -> Result<Option<String>> {
    let Some(path) = &a.est.estimate_chart else {
        return Ok(None);
    };
    let title = format!(
        "{} on {}: {}{}, predicted and measured step by step",
        r.model.name,
        r.backend.backend.name(),
        r.setup.config.source.name(),
        if a.est.replan { " re-planned" } else { "" }
    );
    sim::io::estimate_chart::write_estimate_chart(path, &title, points)?;
    Ok(Some(format!("Estimate chart: {}", path.display())))
}

/// Writes `--fit-profile` (when given: per rank with `--replan`, [`write_fitted_profile`]),
/// adds its note to `notes` and returns the run's phase factors.
///
/// # Errors
/// As [`write_fitted_profile`].
pub(super) fn fit_profile(
    a: &ExecuteArgs,
    r: &ResolvedRun,
    estimate: &SpeedEstimate,
    notes: &mut Vec<String>,
) -> Result<Option<profiles::PhaseScale>> {
    let Some(path) = &a.est.fit_profile else {
        return Ok(None);
    };
    let per_rank = a.est.replan.then_some(&r.setup.config);
    let (scale, note) = write_fitted_profile(path, &r.loaded_profile, estimate, per_rank)?;
    notes.push(note);
    Ok(Some(scale))
}
