//! The order of evaluation: the candidates in increasing order of their bound, in chunks whose
//! splits are solved in parallel (independent of the ranking; one that the ranking then prunes
//! was solved for nothing, never wrongly), each then pruned, screened, evaluated and ranked in
//! turn; the deferred candidates (zb-auto, cut long sequences) follow for the finalists'
//! layouts only.

use super::enumerate::Pending;
use super::evaluate::{Evaluation, evaluate, split_inputs};
use super::rank::{Ranking, candidate};
use super::screen::Screens;
use super::split::plan_candidate;
use super::{Context, ZB_AUTO_MAX_FINALISTS};
use crate::Result;
use crate::partition::Partition;
use flatpipe_simulator::ScheduleKind;
use rayon::prelude::*;

/// What the evaluation counted, beside the ranking.
#[derive(Default)]
pub(super) struct Tally {
    /// Candidates rejected, with the reason (the enumeration's first).
    pub rejected: Vec<(String, String)>,
    /// Pruned by their bound or their screen.
    pub pruned: usize,
    /// Splits simulated (screened, then in full where the screen did not prune them).
    pub evaluated: usize,
    /// zb-auto candidates not built: their layout was not a finalist's.
    pub zb_auto_not_finalist: usize,
    /// zb-auto finalists not built: [`ZB_AUTO_MAX_FINALISTS`] were built already.
    pub zb_auto_over_limit: usize,
    /// Chunked candidates not evaluated: their layout was not a finalist's.
    pub chunked_not_finalist: usize,
    /// zb-auto finalists built so far.
    zb_auto_built: usize,
    /// Candidates done (the progress reported).
    done: usize,
}

/// Evaluates `pending` (in bound order), after the enumeration's `rejected`: first every
/// candidate not deferred ([`Pending::deferred`]), then the deferred ones of the layouts
/// (tp, dp, pp, budget, sharding) ranked by then (all of them when none is), in order of their
/// bound, zb-auto until [`ZB_AUTO_MAX_FINALISTS`] were built. `progress(done, total)` after
/// each.
///
/// # Errors
/// [`evaluate`]'s.
pub(super) fn evaluate_in_rounds(
    ctx: &Context<'_>,
    pending: Vec<Pending>,
    rejected: Vec<(String, String)>,
    progress: &(dyn Fn(usize, usize) + Sync),
) -> Result<(Ranking, Tally)> {
    let total = pending.len();
    let mut round = Round {
        ctx,
        ranking: Ranking::new(ctx.config.keep, ctx.config.rank_by),
        tally: Tally {
            rejected,
            ..Tally::default()
        },
        screens: Screens::default(),
        total,
        progress,
    };
    let (deferred, first): (Vec<Pending>, Vec<Pending>) =
        pending.into_iter().partition(Pending::deferred);
    round.run(&first)?;
    let finalists = round.finalists(deferred);
    if !finalists.is_empty() {
        round.run(&finalists)?;
    }
    Ok((round.ranking, round.tally))
}

/// The state the rounds share.
struct Round<'a, 'b> {
    ctx: &'a Context<'b>,
    ranking: Ranking,
    tally: Tally,
    screens: Screens,
    /// Candidates in all (the progress's total).
    total: usize,
    progress: &'a (dyn Fn(usize, usize) + Sync),
}

impl Round<'_, '_> {
    /// Evaluates `items` in order, their splits solved ahead in parallel per chunk of the
    /// thread count.
    fn run(&mut self, items: &[Pending]) -> Result<()> {
        let width = rayon::current_num_threads().max(1);
        for chunk in items.chunks(width) {
            let first = self.first_splits(chunk);
            for (c, first) in chunk.iter().zip(first) {
                self.one(c, first)?;
            }
        }
        Ok(())
    }

    /// The splits of `chunk`'s candidates, solved in parallel; `None` for those the ranking
    /// prunes now and for zb-auto (whose split is solved when it is built).
    fn first_splits(&self, chunk: &[Pending]) -> Vec<Option<Result<Partition>>> {
        let ctx = self.ctx;
        let bar = self.ranking.bar();
        chunk
            .par_iter()
            .map(|c| {
                if bar.is_some_and(|k| c.lower_bound_s >= k) || c.kind == ScheduleKind::ZbAuto {
                    return None;
                }
                let profile = &ctx.profiles[c.tpi].1;
                let (act_tokens, state) = split_inputs(ctx, c);
                Some(plan_candidate(
                    profile,
                    ctx.space,
                    &ctx.config,
                    &ctx.stats[c.stats],
                    (c.pp, c.v, c.kind, act_tokens),
                    state,
                    &ctx.inflight,
                ))
            })
            .collect()
    }

    /// One candidate: pruned by its bound, over the zb-auto limit, or evaluated and ranked.
    fn one(&mut self, c: &Pending, first: Option<Result<Partition>>) -> Result<()> {
        self.tally.done += 1;
        let done = self.tally.done;
        if self.ranking.prunes(c.lower_bound_s) {
            self.tally.pruned += 1;
            (self.progress)(done, self.total);
            return Ok(());
        }
        if c.kind == ScheduleKind::ZbAuto {
            self.tally.zb_auto_built += 1;
            if self.tally.zb_auto_built > ZB_AUTO_MAX_FINALISTS {
                self.tally.zb_auto_over_limit += 1;
                (self.progress)(done, self.total);
                return Ok(());
            }
        }
        let evaluation = evaluate(
            self.ctx,
            c,
            first,
            self.ranking.bar(),
            (&mut self.screens, &mut self.tally.evaluated),
        )?;
        (self.progress)(done, self.total);
        match evaluation {
            Evaluation::Fits(fitted) => {
                let cand = candidate(self.ctx, c, *fitted);
                self.ranking.insert(cand);
            }
            Evaluation::Screened => self.tally.pruned += 1,
            Evaluation::Rejected(reason) => {
                let (tp, profile) = &self.ctx.profiles[c.tpi];
                let what = c.describe(*tp, profile.expert_parallel);
                self.tally.rejected.push((what, reason));
            }
        }
        Ok(())
    }

    /// The deferred candidates of the layouts ranked now (all of them when none is), in
    /// order; the others are counted done.
    fn finalists(&mut self, deferred: Vec<Pending>) -> Vec<Pending> {
        let mut out = Vec::new();
        for c in deferred {
            let (tp, profile) = &self.ctx.profiles[c.tpi];
            if self.ranking.ranked.is_empty()
                || self.ranking.holds_layout(
                    (*tp, profile.expert_parallel, c.cp),
                    (c.dp, c.pp, c.budget, c.sharding),
                )
            {
                out.push(c);
                continue;
            }
            if c.kind != ScheduleKind::ZbAuto {
                self.tally.chunked_not_finalist += 1;
            } else {
                self.tally.zb_auto_not_finalist += 1;
            }
            self.tally.done += 1;
            (self.progress)(self.tally.done, self.total);
        }
        out
    }
}
