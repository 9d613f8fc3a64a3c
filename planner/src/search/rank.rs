//! Step 5, rank: the evaluated candidates best first ([`Ranking`]), the bar a candidate's
//! bound or screen must beat, and, when nothing fits, why ([`nothing_fits`]).

use super::candidate::{Candidate, SplitReport};
use super::enumerate::{Pending, shardings_for};
use super::evaluate::Fitted;
use super::{Context, RankBy, state_bytes};
use crate::Error;
use flatpipe_profiles::context_parallel::ContextParallel;
use flatpipe_simulator::costs::sharding::Sharding;
use flatpipe_simulator::run::montecarlo;

/// The best `keep` evaluated, feasible candidates, best first by `by`.
pub(super) struct Ranking {
    /// Best first, at most `keep` (at most 1 for `keep` = 0).
    pub ranked: Vec<Candidate>,
    /// The best candidate of each answer to long sequences evaluated
    /// ([`Candidate::long_sequences`]), best first.
    pub strategies: Vec<Candidate>,
    keep: usize,
    by: RankBy,
}

impl Ranking {
    /// An empty ranking keeping the best `keep` by `by`.
    pub fn new(keep: usize, by: RankBy) -> Self {
        Ranking {
            ranked: Vec::new(),
            strategies: Vec::new(),
            keep,
            by,
        }
    }

    /// The score to beat, seconds: the keep-th best's once `keep` are ranked (`None` before).
    /// A bound or screen no better than it prunes a candidate exactly.
    pub fn bar(&self) -> Option<f64> {
        (self.ranked.len() >= self.keep).then(|| self.ranked[self.keep - 1].score(self.by))
    }

    /// Whether a candidate whose step time is at least `bound_s` cannot enter the ranking.
    pub fn prunes(&self, bound_s: f64) -> bool {
        self.bar().is_some_and(|k| bound_s >= k)
    }

    /// Inserts `cand` in order and drops the candidates past `keep`. Ties go to the larger
    /// token budget (it cuts fewer sequences into microbatches of their own, and an export
    /// then trains on the rows that were predicted), then to the earlier ranked.
    pub fn insert(&mut self, cand: Candidate) {
        let by = self.by;
        let key = cand.long_sequences();
        match self
            .strategies
            .iter()
            .position(|c| c.long_sequences() == key)
        {
            Some(i) if self.strategies[i].score(by) <= cand.score(by) => {}
            Some(i) => self.strategies[i] = cand.clone(),
            None => self.strategies.push(cand.clone()),
        }
        self.strategies
            .sort_by(|a, b| a.score(by).total_cmp(&b.score(by)));
        let pos = self.ranked.partition_point(|x| {
            let (a, b) = (x.score(by), cand.score(by));
            a < b || (a == b && x.token_budget() >= cand.token_budget())
        });
        self.ranked.insert(pos, cand);
        self.ranked.truncate(self.keep.max(1));
    }

    /// Whether a ranked candidate has the layout ((tp, ep, cp), (dp, pp, token budget,
    /// sharding)): a deferred candidate of that layout is a finalist. Where a cp candidate of
    /// the same tp and ep is ranked, every layout's chunks of long sequences (no cp) are
    /// finalists too: the two answers to long sequences compete on the same GPUs.
    pub fn holds_layout(
        &self,
        (tp, ep, cp): (u32, u32, Option<ContextParallel>),
        (dp, pp, budget, sharding): (u32, u32, u64, Sharding),
    ) -> bool {
        self.ranked.iter().any(|r| {
            let as_cp = cp.is_none() && r.run.context_parallel.is_some();
            (r.tp, r.ep) == (tp, ep)
                && (as_cp
                    || (r.run.context_parallel == cp
                        && (r.run.dp, r.run.pp, r.token_budget(), r.run.sharding)
                            == (dp, pp, budget, sharding)))
        })
    }
}

/// The candidate `c` evaluated as `fitted` (its run, split, simulated steps and each rank's
/// peak memory), on its tensor-parallel profile.
pub(super) fn candidate(ctx: &Context<'_>, c: &Pending, fitted: Fitted) -> Candidate {
    let Fitted {
        run,
        split,
        outcomes,
        peak,
    } = fitted;
    let (tp, profile) = (ctx.profiles[c.tpi].0, &ctx.profiles[c.tpi].1);
    Candidate {
        run,
        tp,
        sequence_parallel: ctx.space.sequence_parallel && tp > 1,
        ep: profile.expert_parallel,
        split: SplitReport::of(split),
        lower_bound_s: c.lower_bound_s,
        summary: {
            // Bubbles are per rank's timeline; a cp group's GPUs all count for the MFU.
            let mut s = montecarlo::summarize(&outcomes, c.dp * c.pp, profile.hardware.peak_flops);
            s.mfu /= f64::from(c.cp_gpus());
            s
        },
        peak_memory_bytes: peak,
    }
}

/// Why no candidate fits: the first rejection of each of the first six kinds of reason (and
/// how many are like it); led, when the static
/// state alone cannot fit even split over the most pipeline ranks searched, by that.
pub(super) fn nothing_fits(ctx: &Context<'_>, rejected: &[(String, String)]) -> Error {
    let config = &ctx.config;
    let mut reasons = distinct_reasons(rejected, 6);
    if let Some(least) = least_static(ctx)
        && least.bytes > config.memory_limit_bytes
    {
        let gib = |b: f64| b / (1u64 << 30) as f64;
        let LeastStatic {
            bytes,
            pp,
            dp,
            sharding: m,
            per_param,
            tp,
            total_params,
        } = least;
        reasons.insert(
            0,
            format!(
                "parameters, gradients and optimizer state alone need at least {:.1} GiB per GPU in every layout searched (the least: {}pp = {pp}, dp = {dp}, {m}: {:.2} bytes per parameter over {pp} rank(s), {:.2e} parameters per GPU of a rank), above the {:.1} GiB limit: more ranks, more sharding or a larger memory limit",
                gib(bytes),
                if tp > 1 { format!("tp = {tp}, ") } else { String::new() },
                per_param,
                total_params,
                gib(config.memory_limit_bytes)
            ),
        );
    }
    Error::NoFeasiblePlan(reasons.join("; "))
}

/// The first rejection of each kind of reason (the reason with its numbers left out), the
/// first `most` kinds, each with how many more rejections read like it, so that one kind
/// that hit many layouts (every replica empty) does not hide the others (activations over
/// the limit).
fn distinct_reasons(rejected: &[(String, String)], most: usize) -> Vec<String> {
    let kind = |r: &str| -> String { r.chars().filter(|c| !c.is_ascii_digit()).collect() };
    let mut kinds: Vec<(String, String, usize)> = Vec::new();
    for (what, reason) in rejected {
        let k = kind(reason);
        match kinds.iter_mut().find(|(seen, _, _)| *seen == k) {
            Some(entry) => entry.2 += 1,
            None => kinds.push((k, format!("{what}: {reason}"), 0)),
        }
    }
    let shown = kinds.len().min(most);
    let mut out: Vec<String> = kinds[..shown]
        .iter()
        .map(|(_, first, like)| match like {
            0 => first.clone(),
            n => format!("{first} (and {n} more like it)"),
        })
        .collect();
    let hidden: usize = kinds[shown..].iter().map(|(_, _, n)| n + 1).sum();
    if hidden > 0 {
        out.push(format!("... and {hidden} more of other kinds"));
    }
    out
}

/// The layout searched whose static state per rank is least.
struct LeastStatic {
    /// Its parameters, gradients and optimizer state per rank, bytes.
    bytes: f64,
    pp: u32,
    dp: u32,
    sharding: Sharding,
    /// Its state bytes per parameter.
    per_param: f64,
    tp: u32,
    /// Parameters of one GPU of a rank (the tensor-parallel profile's).
    total_params: f64,
}

/// The least any layout searched holds per rank: its state bytes per parameter over its pp
/// ranks (`None` for no layout).
fn least_static(ctx: &Context<'_>) -> Option<LeastStatic> {
    let (space, config) = (ctx.space, &ctx.config);
    let mut least: Option<LeastStatic> = None;
    for (tp, profile) in &ctx.profiles {
        let ranks = space.ranks / tp;
        let total_params: f64 = profile.layers.iter().map(|l| l.param_count as f64).sum();
        for &pp in space.pp.iter().filter(|&&pp| ranks % pp == 0) {
            let dp = ranks / pp;
            for m in shardings_for(profile, space, pp, dp) {
                let per_param = state_bytes(profile, config, m, pp, dp).total();
                let bytes = total_params * per_param / f64::from(pp);
                if least.as_ref().is_none_or(|l| bytes < l.bytes) {
                    least = Some(LeastStatic {
                        bytes,
                        pp,
                        dp,
                        sharding: m,
                        per_param,
                        tp: *tp,
                        total_params,
                    });
                }
            }
        }
    }
    least
}

#[cfg(test)]
mod tests {
    use super::distinct_reasons;

    fn rejected(list: &[(&str, &str)]) -> Vec<(String, String)> {
        list.iter()
            .map(|(w, r)| (w.to_string(), r.to_string()))
            .collect()
    }

    #[test]
    fn one_kind_of_reason_does_not_hide_the_others() {
        // Five layouts with empty replicas, then two over the memory limit, then one more kind:
        // the first of each kind is shown, with the count of those like it.
        let list = rejected(&[
            ("dp=8", "8 replicas, 1 sequence"),
            ("dp=4", "4 replicas, 1 sequence"),
            ("dp=2", "2 replicas, 1 sequence"),
            ("tp=2 dp=4", "4 replicas, 1 sequence"),
            ("tp=2 dp=2", "2 replicas, 1 sequence"),
            ("pp=8", "peak 278.7 GiB over 136.4 GiB"),
            ("tp=8", "peak 512.0 GiB over 136.4 GiB"),
            ("pp=4", "no schedule"),
        ]);
        assert_eq!(
            distinct_reasons(&list, 6),
            [
                "dp=8: 8 replicas, 1 sequence (and 4 more like it)",
                "pp=8: peak 278.7 GiB over 136.4 GiB (and 1 more like it)",
                "pp=4: no schedule",
            ]
        );
        // At most two kinds shown: the third kind's one rejection is counted, not shown.
        assert_eq!(
            distinct_reasons(&list, 2).last().unwrap(),
            "... and 1 more of other kinds"
        );
    }
}
