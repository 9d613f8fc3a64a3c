//! The sampled steps cut as a layout's run cuts them, summarized for the bound and the split:
//! the cut is the simulator's own ([`cut_step`], with [`balance_cost`]), so the microbatches
//! the planner sizes a split for are those the Monte Carlo then runs.

use crate::Result;
use flatpipe_profiles::Profile;
use flatpipe_simulator::ScheduleKind;
use flatpipe_simulator::batching::policy::{Policy, PolicyParams};
use flatpipe_simulator::run::config::{Capacity, RunConfig, ScheduleSource, balance_cost};
use flatpipe_simulator::run::step::cut_step;

/// Microbatch statistics of the sampled steps under one cut ([`RunConfig::cut_key`]: dp,
/// policy, token budget and chunk size, verl-kk's divisor).
pub(super) struct BatchStats {
    /// Mean computed tokens per microbatch, over every replica's microbatches of every step.
    pub mean_tokens: f64,
    /// Mean computed causal attention pairs per microbatch, likewise.
    pub mean_pairs: f64,
    /// The most microbatches any replica gets in a sampled step (at least 1).
    pub max_count: u32,
    /// The most tokens any sampled microbatch computes.
    pub max_tokens: f64,
    /// Per step: the largest replica's total F + I + W time over all layers, with its
    /// forward-only work (`Fo`), seconds.
    pub replica_work_s: Vec<f64>,
    /// Per step: the largest replica's work less its expert-parallel all-to-alls (those of
    /// its forwards and input-gradient passes), seconds: what no schedule that overlaps a
    /// forward with a backward (DualPipe's pairs, which may hide every all-to-all) can beat.
    pub replica_compute_s: Vec<f64>,
}

/// The run configuration a layout's steps are cut with: `kind` on `pp` ranks of `v` stages,
/// `dp` replicas, `policy` under `budget` with long sequences cut into `chunk_tokens`. Its
/// stages are empty: [`cut_step`] reads only what [`RunConfig::cut_key`] names.
pub(super) fn cut_config(
    (kind, dp, pp, v): (ScheduleKind, u32, u32, u32),
    policy: Policy,
    (budget, chunk_tokens): (u64, Option<u64>),
) -> RunConfig {
    let mut run = RunConfig::new(
        ScheduleSource::Kind(kind),
        pp,
        v,
        Vec::new(),
        policy,
        Capacity::Dynamic,
    );
    run.dp = dp;
    run.params = PolicyParams {
        token_budget: budget,
        chunk_tokens,
        ..Default::default()
    };
    run
}

/// The statistics of `steps` (sequence lengths, tokens) cut by [`cut_step`] under `cut`
/// ([`cut_config`]), with `profile`'s costs: the balance cost ([`balance_cost`]) splits the
/// data-parallel shares and balances the microbatches, and a replica's work is its
/// microbatches' fixed plus per-token plus per-pair F + I + W time, and with forward-only work
/// `fo` (`Some(Some(k))`: k forward-only microbatches, the training ones cycled, as the run
/// builds them; `Some(None)`: one per training microbatch) their `Fo` time.
///
/// # Errors
/// [`cut_step`]'s (a replica without sequences, the policy's).
pub(super) fn batch_stats(
    profile: &Profile,
    steps: &[Vec<u32>],
    cut: &RunConfig,
    fo: Option<Option<u32>>,
) -> Result<BatchStats> {
    // Per microbatch: fixed, per computed token and per computed causal pair, seconds, of the
    // training phases and of the forward-only one.
    let sum = |phase: &dyn Fn(&flatpipe_profiles::LayerProfile) -> f64| -> f64 {
        profile.layers.iter().map(phase).sum()
    };
    let c0 = sum(&|l| l.f.c0_s + l.i.c0_s + l.w.c0_s);
    let tok = sum(&|l| l.f.c_tok_s + l.i.c_tok_s + l.w.c_tok_s);
    let pair = sum(&|l| l.f.c_attn_s + l.i.c_attn_s + l.w.c_attn_s);
    // The all-to-alls an F and an I each pay (the routed layers'), fixed and per token.
    let a2a = |c: fn(&flatpipe_profiles::CostCoeffs) -> f64| -> f64 {
        profile
            .layers
            .iter()
            .filter_map(|l| l.routed.map(|r| 2.0 * c(&r.all_to_all)))
            .sum()
    };
    let (a2a_c0, a2a_tok) = (a2a(|c| c.c0_s), a2a(|c| c.c_tok_s));
    let (fo_c0, fo_tok, fo_pair) = (
        sum(&|l| l.fo.c0_s),
        sum(&|l| l.fo.c_tok_s),
        sum(&|l| l.fo.c_attn_s),
    );
    let cost = balance_cost(profile);
    let (mut n, mut t_sum, mut a_sum, mut max_count) = (0usize, 0.0, 0.0, 0u32);
    let mut max_tokens = 0.0f64;
    let mut replica_work_s = Vec::with_capacity(steps.len());
    let mut replica_compute_s = Vec::with_capacity(steps.len());
    for seqs in steps {
        let (mut worst, mut worst_compute) = (0.0f64, 0.0f64);
        for b in cut_step(cut, seqs, &cost)? {
            max_count = max_count.max(b.microbatches.len() as u32);
            let (mut work, mut hideable) = (0.0, 0.0);
            for mb in &b.microbatches {
                let (t, a) = (mb.computed_tokens() as f64, mb.computed_attn_pairs() as f64);
                n += 1;
                max_tokens = max_tokens.max(t);
                t_sum += t;
                a_sum += a;
                work += c0 + tok * t + pair * a;
                hideable += a2a_c0 + a2a_tok * t;
            }
            if let (Some(k), m @ 1..) = (fo, b.microbatches.len()) {
                for j in 0..k.map_or(m, |k| k as usize) {
                    let mb = &b.microbatches[j % m];
                    let (t, a) = (mb.computed_tokens() as f64, mb.computed_attn_pairs() as f64);
                    work += fo_c0 + fo_tok * t + fo_pair * a;
                }
            }
            worst = worst.max(work);
            worst_compute = worst_compute.max(work - hideable);
        }
        replica_work_s.push(worst);
        replica_compute_s.push(worst_compute);
    }
    Ok(BatchStats {
        mean_tokens: t_sum / n.max(1) as f64,
        mean_pairs: a_sum / n.max(1) as f64,
        max_count: max_count.max(1),
        max_tokens,
        replica_work_s,
        replica_compute_s,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use flatpipe_profiles::{AnalyticOptions, analytic_profile, builtins};

    /// One step of 300, 200, 100 and 50 tokens on 2 replicas, flat-ffd under a budget of 1,000
    /// tokens. The balance cost grows with the tokens and the causal pairs t (t + 1) / 2, so
    /// the shares (longest first to the least loaded) are [300] and [200, 100, 50]: 50 joins
    /// replica 1, whose 300 tokens and 20,100 + 5,050 pairs weigh less than replica 0's 300
    /// tokens and 45,150 pairs. Each share fits one microbatch: 300 tokens and 45,150 pairs,
    /// 350 tokens and 26,425 pairs.
    #[test]
    fn a_step_cut_on_two_replicas_by_hand() {
        let m = builtins::model("tiny").unwrap();
        let h = builtins::hardware("cpu").unwrap();
        let p = analytic_profile(&m, &h, &AnalyticOptions::default()).unwrap();
        let cut = cut_config(
            (ScheduleKind::OneFOneB, 2, 2, 1),
            Policy::FlatFfd,
            (1000, None),
        );
        let s = batch_stats(&p, &[vec![300, 200, 100, 50]], &cut, None).unwrap();
        assert_eq!(s.mean_tokens, (300.0 + 350.0) / 2.0);
        assert_eq!(s.mean_pairs, (45_150.0 + 26_425.0) / 2.0);
        assert_eq!((s.max_count, s.max_tokens), (1, 350.0));
        // A replica's work: its microbatch's fixed + per-token + per-pair F + I + W.
        let sum = |f: &dyn Fn(&flatpipe_profiles::LayerProfile) -> f64| -> f64 {
            p.layers.iter().map(f).sum()
        };
        let c0 = sum(&|l| l.f.c0_s + l.i.c0_s + l.w.c0_s);
        let tok = sum(&|l| l.f.c_tok_s + l.i.c_tok_s + l.w.c_tok_s);
        let pair = sum(&|l| l.f.c_attn_s + l.i.c_attn_s + l.w.c_attn_s);
        let work = |t: f64, a: f64| c0 + tok * t + pair * a;
        let want = work(300.0, 45_150.0).max(work(350.0, 26_425.0));
        assert_eq!(s.replica_work_s.len(), 1);
        assert!(
            (s.replica_work_s[0] - want).abs() <= 1e-12 * want,
            "{} vs {want}",
            s.replica_work_s[0]
        );
        // With forward-only work each replica also runs Fo over its microbatches: one per
        // training microbatch, or 3 of them cycled (the one microbatch three times).
        let fo = |t: f64, a: f64| {
            sum(&|l| l.fo.c0_s) + sum(&|l| l.fo.c_tok_s) * t + sum(&|l| l.fo.c_attn_s) * a
        };
        for (spec, times) in [(None, 1.0), (Some(3), 3.0)] {
            let s = batch_stats(&p, &[vec![300, 200, 100, 50]], &cut, Some(spec)).unwrap();
            let want = (work(300.0, 45_150.0) + times * fo(300.0, 45_150.0))
                .max(work(350.0, 26_425.0) + times * fo(350.0, 26_425.0));
            assert!(
                (s.replica_work_s[0] - want).abs() <= 1e-12 * want,
                "{spec:?}: {} vs {want}",
                s.replica_work_s[0]
            );
        }
    }
}
