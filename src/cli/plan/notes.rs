//! What `plan` says about its choice: sequences over the budget, the no-pipeline FSDP baseline, the
//! sizing of the chosen plan.

use super::*;

/// Of the search's sampled sequences: how many are longer than `budget` tokens, and how many
/// there are.
pub(super) fn longer_than_budget(
    a: &PlanArgs,
    workload: &Workload,
    seed: u64,
    size: StepSize,
    budget: u64,
) -> (usize, usize) {
    (0..u64::from(a.steps))
        .map(|step| workload.sample_step(seed, step, size))
        .fold((0, 0), |(longer, total), seqs| {
            (
                longer + seqs.iter().filter(|&&x| u64::from(x) > budget).count(),
                total + seqs.len(),
            )
        })
}

/// The no-pipeline FSDP configuration a torchtitan user runs first, against the chosen plan.
pub(super) struct Baseline {
    /// One line for the notes.
    pub(super) note: String,
    /// The baseline's candidate (`null` when it does not fit), for `--format json`.
    pub(super) json: serde_json::Value,
}

/// Searches the no-pipeline FSDP configuration (pp = 1, dp = every rank, torchtitan's default
/// FSDP2: resharded per microbatch without a pipeline) over the same budgets, recomputation and
/// memory limit, and says how much `best` gains or loses against it. Already the chosen plan,
/// it says how the best pipelined plan (among `ranked`, else searched) compares; impossible, it
/// says why.
pub(super) fn fsdp_baseline(
    profile: &Profile,
    workload: &Workload,
    space: &planner::search::SearchSpace,
    config: &planner::search::SearchConfig,
    best: &planner::search::Candidate,
    ranked: &[planner::search::Candidate],
) -> Baseline {
    use sim::costs::sharding::Sharding;
    let what = format!("no pipeline, FSDP over dp={}", space.ranks);
    if best.run.pp == 1 && best.tp == 1 && best.run.sharding == Sharding::Fsdp {
        // The best pipelined plan, against it: among the runners-up, else searched.
        let piped = ranked.iter().find(|c| c.run.pp > 1).cloned().or_else(|| {
            let mut s = space.clone();
            s.pp.retain(|p| *p > 1);
            let mut c = config.clone();
            c.keep = 1;
            planner::search::search(profile, workload, &s, &c, &|_, _| {})
                .ok()
                .and_then(|r| r.ranked.into_iter().next())
        });
        let t = best.summary.step_time_s.mean;
        let versus = match &piped {
            Some(p) => {
                let tp = p.summary.step_time_s.mean;
                format!(
                    "; the best pipelined plan ({}: mean step {}) is {:.1}% {}",
                    p.describe(),
                    fmt_s(tp),
                    100.0 * (tp / t - 1.0).abs(),
                    if tp >= t { "slower" } else { "faster" }
                )
            }
            None => "; no pipelined plan fits".into(),
        };
        return Baseline {
            note: format!(
                "The chosen plan is the no-pipeline FSDP configuration a torchtitan user runs first ({what}){versus}."
            ),
            json: serde_json::json!({"candidate": best.describe(), "mean_s": t, "chosen_vs_baseline": 0.0,
                "best_pipelined": piped.as_ref().map(|p| serde_json::json!({"candidate": p.describe(), "mean_s": p.summary.step_time_s.mean}))}),
        };
    }
    let mut s = space.clone();
    s.pp = vec![1];
    s.tp = vec![1];
    s.sharding = vec![Sharding::Fsdp];
    s.context_parallel = Vec::new();
    let mut c = config.clone();
    c.keep = 1;
    match planner::search::search(profile, workload, &s, &c, &|_, _| {}) {
        Ok(r) if !r.ranked.is_empty() => {
            let b = &r.ranked[0];
            let (t_best, t_base) = (best.summary.step_time_s.mean, b.summary.step_time_s.mean);
            let change = t_best / t_base - 1.0;
            Baseline {
                note: format!(
                    "Against the no-pipeline FSDP configuration a torchtitan user runs first ({}: mean step {}): the chosen plan is {:.1}% {} ({}).",
                    b.describe(),
                    fmt_s(t_base),
                    100.0 * change.abs(),
                    if change <= 0.0 { "faster" } else { "slower" },
                    fmt_s(t_best)
                ),
                json: serde_json::json!({
                    "fits": true,
                    "candidate": b.describe(),
                    "mean_s": t_base,
                    "p90_s": b.summary.step_time_s.p90,
                    "peak_memory_bytes": b.peak_memory_bytes.iter().copied().fold(0.0, f64::max),
                    "recompute": b.run.recompute,
                    "chosen_vs_baseline": change,
                }),
            }
        }
        Ok(_) => Baseline {
            note: format!("The no-pipeline FSDP configuration ({what}) has no feasible plan."),
            json: serde_json::json!({"fits": false, "reason": "no feasible plan"}),
        },
        Err(e) => Baseline {
            note: format!("The no-pipeline FSDP configuration ({what}) does not fit: {e}"),
            json: serde_json::json!({"fits": false, "reason": e.to_string()}),
        },
    }
}

/// The notes on the chosen plan's sizing: sequences longer than its token budget (each a
/// microbatch of its own) over `a.steps` sampled steps, and a busiest rank within
/// [`MARGIN_NOTE_FRACTION`] of the memory `limit` (bytes).
pub(super) fn sizing_notes(
    a: &PlanArgs,
    workload: &Workload,
    seed: u64,
    size: StepSize,
    best: &planner::search::Candidate,
    limit: f64,
) -> Vec<String> {
    let mut notes = Vec::new();
    // Sequences longer than the chosen token budget get a microbatch of their own.
    let (longer, total) = longer_than_budget(a, workload, seed, size, best.token_budget());
    if longer > 0 {
        notes.push(format!(
            "{longer} of the {total} sampled sequences are longer than the chosen token budget of {} tokens: {}",
            best.token_budget(),
            match best.chunk_tokens() {
                Some(c) => format!("each is cut into chunks of at most {c} tokens"),
                None => "each gets a microbatch of its own".into(),
            }
        ));
    }
    if let Some(w) = headroom_warning(best, limit) {
        notes.push(format!("{w} (on the {} sampled steps)", a.steps));
    }
    notes
}

/// When the chosen plan's busiest rank needs more than [`MARGIN_NOTE_FRACTION`] of the memory
/// `limit` (bytes): what that means and the re-plan that keeps a margin. The sampled steps'
/// peak is not every step's.
pub(super) fn headroom_warning(best: &planner::search::Candidate, limit: f64) -> Option<String> {
    let peak = best.peak_memory_bytes.iter().copied().fold(0.0, f64::max);
    (peak > MARGIN_NOTE_FRACTION * limit).then(|| {
        format!(
            "the plan's busiest rank needs {} of the {} memory limit ({:.1}%, less than {:.0}% headroom); a rarer, longer step may need more: re-plan with --memory-margin {:.2} to keep that much free",
            fmt_bytes(peak),
            fmt_bytes(limit),
            100.0 * peak / limit,
            100.0 * (1.0 - MARGIN_NOTE_FRACTION),
            1.0 - MARGIN_NOTE_FRACTION
        )
    })
}

/// Which answer to long sequences the chosen plan takes and what the best of each other one
/// evaluated costs (mean step time against the chosen), when the search weighed more than one
/// (chunks, whole sequences, context-parallel groups).
pub(super) fn long_sequence_note(
    best: &planner::search::Candidate,
    strategies: &[planner::search::Candidate],
) -> Option<String> {
    if strategies.len() < 2 {
        return None;
    }
    let t = best.summary.step_time_s.mean;
    let others: Vec<String> = strategies
        .iter()
        .filter(|c| c.long_sequences() != best.long_sequences())
        .map(|c| {
            format!(
                "{} {} ({:+.1}%, {})",
                c.long_sequences(),
                fmt_s(c.summary.step_time_s.mean),
                100.0 * (c.summary.step_time_s.mean / t - 1.0),
                c.describe()
            )
        })
        .collect();
    Some(format!(
        "Long sequences: the chosen plan runs {}; the best of each other answer evaluated: {}",
        best.long_sequences(),
        others.join("; ")
    ))
}
