//! Step 3, screen: before every replica of a candidate runs, the heaviest replica of each
//! sampled step alone ([`montecarlo::screen_base`]), a lower bound on the step time and on the
//! memory. Its memory over the limit rejects exactly; its score no better than the keep-th
//! best's prunes exactly; only the rest are evaluated in full.

use super::enumerate::Pending;
use super::{Context, RankBy};
use crate::Result;
use crate::partition::Partition;
use flatpipe_profiles::Profile;
use flatpipe_simulator::ScheduleKind;
use flatpipe_simulator::costs::Recompute;
use flatpipe_simulator::costs::sharding::Sharding;
use flatpipe_simulator::run::config::RunConfig;
use flatpipe_simulator::run::montecarlo;
use std::collections::HashMap;
use std::ops::Range;

/// A screen's timeline inputs: (profile index, pp, v, kind, (budget, chunk), stages,
/// recomputation).
type ScreenKey = (
    usize,
    u32,
    u32,
    ScheduleKind,
    (u64, Option<u64>),
    Vec<Range<usize>>,
    Vec<Recompute>,
);

/// Screens already run, per layout and split: sharding modes without per-microbatch
/// collectives leave the replica's timeline as it is, so one screen serves them all.
pub(super) type Screens = HashMap<ScreenKey, Vec<montecarlo::ScreenBase>>;

/// What a candidate's screen came to.
pub(super) enum Screen {
    /// Within the limit and possibly better than the keep-th best: evaluate it in full.
    Passed,
    /// Rank `.0`'s simulated peak, `.1` bytes, is over the memory limit.
    OverLimit(usize, f64),
    /// No better than the keep-th best (`bar`): pruned.
    Pruned,
    /// The simulator could not run it (zb-auto under the limit, chunks a schedule cannot
    /// order): rejected with the reason.
    Failed(String),
}

/// Screens candidate `c` split as `partition`, run as `run`, on `profile` (its tensor-parallel
/// profile), against `bar`, the keep-th best's score (`None`: fewer ranked).
///
/// # Errors
/// The simulator's, but for zb-auto's and chunk ordering's, which are a [`Screen::Failed`].
pub(super) fn screen(
    ctx: &Context<'_>,
    (c, profile): (&Pending, &Profile),
    partition: &Partition,
    run: &RunConfig,
    bar: Option<f64>,
    screens: &mut Screens,
) -> Result<Screen> {
    let config = &ctx.config;
    let shareable = c.kind != ScheduleKind::ZbAuto
        && c.sharding != Sharding::Zero2
        && !c.sharding.per_microbatch(c.pp);
    let key = (
        c.tpi,
        c.pp,
        c.v,
        c.kind,
        (c.budget, c.chunk),
        partition.stages.clone(),
        partition.recompute.clone(),
    );
    let base = match screens.get(&key).filter(|_| shareable) {
        Some(b) => Ok(b.clone()),
        None => montecarlo::screen_base(
            profile,
            ctx.workload,
            config.seed,
            config.size,
            config.steps,
            run,
        ),
    };
    let screened = match base.and_then(|b| {
        let s = b
            .iter()
            .map(|x| x.finish(run, profile))
            .collect::<flatpipe_simulator::Result<Vec<_>>>()?;
        if shareable {
            screens.insert(key, b);
        }
        Ok(s)
    }) {
        Ok(s) => s,
        // A schedule that cannot order a step's chunks: a rejected candidate too.
        Err(e) if c.kind == ScheduleKind::ZbAuto || c.chunk.is_some() => {
            return Ok(Screen::Failed(e.to_string()));
        }
        Err(e) => return Err(e.into()),
    };
    let peak = peak_memory(screened.iter().map(|s| &s.rank_memory_bytes), c.pp);
    if let Some((r, m)) = first_over(&peak, config.memory_limit_bytes) {
        return Ok(Screen::OverLimit(r, m));
    }
    let times: Vec<f64> = screened.iter().map(|s| s.step_time_s).collect();
    let q = montecarlo::Quantiles::of(&times);
    let score = match config.rank_by {
        RankBy::Mean => q.mean,
        RankBy::P90 => q.p90,
    };
    if bar.is_some_and(|k| score >= k) {
        return Ok(Screen::Pruned);
    }
    Ok(Screen::Passed)
}

/// Per pipeline rank: the largest of the steps' memory (`[pp]` bytes each), bytes.
pub(super) fn peak_memory<'a>(steps: impl Iterator<Item = &'a Vec<f64>>, pp: u32) -> Vec<f64> {
    let mut peak = vec![0.0f64; pp as usize];
    for s in steps {
        for (r, m) in s.iter().enumerate() {
            peak[r] = peak[r].max(*m);
        }
    }
    peak
}

/// The first rank whose peak is over `limit` bytes, with its peak.
pub(super) fn first_over(peak: &[f64], limit: f64) -> Option<(usize, f64)> {
    peak.iter()
        .enumerate()
        .find(|(_, m)| **m > limit)
        .map(|(r, m)| (r, *m))
}

/// The rejection of a candidate whose simulated peak on rank `r`, `bytes`, is over `limit`.
pub(super) fn over_limit_reason(r: usize, bytes: f64, limit: f64) -> String {
    let gib = |b: f64| b / (1u64 << 30) as f64;
    format!(
        "simulated peak on rank {r} is {:.1} GiB, over the limit {:.1} GiB",
        gib(bytes),
        gib(limit)
    )
}
