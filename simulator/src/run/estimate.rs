//! How fast a run goes against its profile, estimated from its measured steps: per rank and
//! phase, the measured busy time over the time the replay predicted for the same actions,
//! exponentially weighted over the steps ([`SpeedEstimate`]). The phase factors rescale the
//! profile ([`flatpipe_profiles::Profile::scaled`]) so that the next prediction (another
//! schedule, or the next step's plan) starts from what the run has just measured.
//!
//! The estimator is the ratio estimator `s = Σ γ^k m_k / Σ γ^k p_k` (the least-squares slope of
//! measured on predicted time through the origin when a phase's variance grows with its
//! time), with forgetting factor `γ` in (0, 1]: step `k` steps ago weighs `γ^k`, so a change
//! of speed is followed with a memory of about `1 / (1 - γ)` steps (recursive least squares
//! with exponential forgetting, Ljung and Söderström 1983, §2.6). With `γ = 1` every step weighs
//! the same: the fit of a whole run.

use crate::ir::{Action, ActionKind};
use crate::replay::timeline::Timeline;
use crate::run::config::RunConfig;
use flatpipe_profiles::{PhaseScale, Profile};

/// The phases estimated, in slot order: F, I, W, B, Fo, optimizer. Overlapped pairs (`F&B`)
/// are left out: their predicted time holds the overlap model, so their ratio says as much
/// about that model as about the run's speed.
const SLOTS: usize = 6;
const OPTIMIZER: usize = 5;

fn slot(kind: ActionKind) -> usize {
    match kind {
        ActionKind::F => 0,
        ActionKind::I => 1,
        ActionKind::W => 2,
        ActionKind::B => 3,
        ActionKind::Fo => 4,
    }
}

/// Exponentially weighted sums of measured and predicted busy nanoseconds, per rank and phase.
#[derive(Debug, Clone, PartialEq)]
pub struct SpeedEstimate {
    forgetting: f64,
    steps: u64,
    /// `sums[r][slot] = (Σ γ^k measured_ns, Σ γ^k predicted_ns)`.
    sums: Vec<[(f64, f64); SLOTS]>,
}

/// Per phase slot, the busy nanoseconds of rank `r` (overlapped pairs left out).
fn busy(t: &Timeline, r: usize) -> [f64; SLOTS] {
    let mut out = [0.0; SLOTS];
    for op in &t.compute[r] {
        if let Action::Compute(c) = op.action {
            out[slot(c.kind)] += op.end_ns.saturating_sub(op.start_ns) as f64;
        }
    }
    if let Some(Some((a, b))) = t.optimizer.get(r) {
        out[OPTIMIZER] += b.saturating_sub(*a) as f64;
    }
    out
}

/// Refuses a forgetting factor outside (0, 1] (every estimate here takes one).
///
/// # Errors
/// [`crate::Error::InvalidArgument`] naming the factor.
pub(crate) fn check_forgetting(forgetting: f64) -> crate::Result<()> {
    if forgetting > 0.0 && forgetting <= 1.0 {
        return Ok(());
    }
    Err(crate::Error::invalid(
        "forgetting factor",
        forgetting,
        "the weight of a step one step older, in (0, 1] (1: no forgetting)",
    ))
}

impl SpeedEstimate {
    /// An estimate with no step observed yet (every factor 1) and forgetting factor
    /// `forgetting` in (0, 1] (1: every step weighs the same).
    ///
    /// # Errors
    /// A forgetting factor outside (0, 1].
    pub fn new(forgetting: f64) -> crate::Result<Self> {
        check_forgetting(forgetting)?;
        Ok(SpeedEstimate {
            forgetting,
            steps: 0,
            sums: Vec::new(),
        })
    }

    /// Steps observed.
    pub fn steps(&self) -> u64 {
        self.steps
    }

    /// Adds one step: ranks `0..ranks` of the predicted and the measured timeline (the same
    /// ranks running the same actions; a rank either timeline lacks is skipped), after
    /// weighting every earlier step by the forgetting factor.
    pub fn observe(&mut self, predicted: &Timeline, measured: &Timeline, ranks: usize) {
        let n = ranks.min(predicted.num_ranks()).min(measured.num_ranks());
        if self.sums.len() < n {
            self.sums.resize(n, [(0.0, 0.0); SLOTS]);
        }
        for rank in self.sums.iter_mut() {
            for s in rank.iter_mut() {
                s.0 *= self.forgetting;
                s.1 *= self.forgetting;
            }
        }
        for r in 0..n {
            let (p, m) = (busy(predicted, r), busy(measured, r));
            for k in 0..SLOTS {
                // A phase only counts where both ran it.
                if p[k] > 0.0 && m[k] > 0.0 {
                    self.sums[r][k].0 += m[k];
                    self.sums[r][k].1 += p[k];
                }
            }
        }
        self.steps += 1;
    }

    /// Summed over the ranks `ranks` (all: `None`), `(measured, predicted)` of the slots
    /// `slots`.
    fn over_ranks(&self, ranks: Option<usize>, slots: &[usize]) -> (f64, f64) {
        let mut out = (0.0, 0.0);
        for (r, rank) in self.sums.iter().enumerate() {
            if ranks.is_some_and(|x| x != r) {
                continue;
            }
            for &k in slots {
                out.0 += rank[k].0;
                out.1 += rank[k].1;
            }
        }
        out
    }

    /// The phase factors of rank `rank` (all ranks: `None`), with [`SpeedEstimate::phase_scale`]'s
    /// fallbacks.
    fn scale_of(&self, rank: Option<usize>) -> PhaseScale {
        let factor = |slots: &[usize]| {
            let (m, p) = self.over_ranks(rank, slots);
            (p > 0.0).then(|| m / p)
        };
        let (f, i, w, b, fo, opt) = (0, 1, 2, 3, 4, OPTIMIZER);
        let one = |x: Option<f64>| x.unwrap_or(1.0);
        let bwd = factor(&[b]).or_else(|| factor(&[i, w]));
        PhaseScale {
            f: one(factor(&[f]).or_else(|| factor(&[fo]))),
            i: one(factor(&[i]).or(bwd)),
            w: one(factor(&[w]).or(bwd)),
            b: one(bwd),
            optimizer: one(factor(&[opt])),
        }
    }

    /// The phase factors over all ranks, each the measured over the predicted busy time of its
    /// phase. A phase the run did not show falls back on the nearest one it did: `I` and `W`
    /// on `B` (a fused backward is their sum) and `B` on `I` and `W` together, `F` on `Fo`;
    /// with nothing to go on a factor stays 1.
    pub fn phase_scale(&self) -> PhaseScale {
        self.scale_of(None)
    }

    /// The phase factors of pipeline rank `rank` alone (as [`SpeedEstimate::phase_scale`];
    /// every factor 1 for a rank not observed): what re-planning scales that rank's stages by.
    pub fn rank_phase_scale(&self, rank: usize) -> PhaseScale {
        if rank >= self.sums.len() {
            return PhaseScale::default();
        }
        self.scale_of(Some(rank))
    }

    /// Per rank, its measured over predicted busy time over all phases (1 for a rank with
    /// nothing observed): a rank that runs slower than the others stands out here.
    pub fn rank_factors(&self) -> Vec<f64> {
        self.sums
            .iter()
            .map(|rank| {
                let (m, p) = rank.iter().fold((0.0, 0.0), |a, s| (a.0 + s.0, a.1 + s.1));
                if p > 0.0 { m / p } else { 1.0 }
            })
            .collect()
    }
}

impl SpeedEstimate {
    /// The profile the next step is planned with: `base` with each pipeline rank's stages
    /// scaled by that rank's phase factors ([`SpeedEstimate::rank_phase_scale`]) and the
    /// optimizer by the run's ([`profile_for_ranks`]).
    ///
    /// # Errors
    /// [`profile_for_ranks`]'s.
    pub fn planning_profile(&self, base: &Profile, config: &RunConfig) -> crate::Result<Profile> {
        let scales: Vec<PhaseScale> = (0..config.pp as usize)
            .map(|r| self.rank_phase_scale(r))
            .collect();
        profile_for_ranks(base, config, &scales, self.phase_scale().optimizer)
    }
}

/// `base` as one replica of `config` sees it when pipeline rank `r` goes at `scales[r]`
/// against the profile: every stage's layers scaled by its rank's factors
/// ([`Profile::scaled_by_layers`]), the optimizer's time by `optimizer`.
///
/// # Errors
/// [`crate::Error::InvalidArgument`] for fewer scales than ranks; the placement's; a factor
/// that is not finite and > 0.
pub fn profile_for_ranks(
    base: &Profile,
    config: &RunConfig,
    scales: &[PhaseScale],
    optimizer: f64,
) -> crate::Result<Profile> {
    if scales.len() < config.pp as usize {
        return Err(crate::Error::invalid(
            "rank speeds",
            scales.len(),
            format!("one per pipeline rank ({})", config.pp),
        ));
    }
    let placement = config.placement()?;
    let ranges: Vec<_> = config
        .stages
        .iter()
        .enumerate()
        .map(|(s, layers)| (layers.clone(), scales[placement.rank_of[s].idx()]))
        .collect();
    Ok(base.scaled_by_layers(&ranges, optimizer)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::replay::timeline::TimedOp;

    /// Two ranks; each runs F, B (and rank 0 a W) of `ns` nanoseconds, then the optimizer.
    fn timeline(f_ns: u64, b_ns: u64, w_ns: u64, opt_ns: u64) -> Timeline {
        let op = |kind, start_ns, len: u64| TimedOp {
            action: Action::new(0, kind, 0),
            start_ns,
            end_ns: start_ns + len,
        };
        let rank = |w: bool| {
            let mut v = vec![op(ActionKind::F, 0, f_ns), op(ActionKind::B, f_ns, b_ns)];
            if w {
                v.push(op(ActionKind::W, f_ns + b_ns, w_ns));
            }
            v
        };
        let end = f_ns + b_ns + w_ns;
        Timeline {
            compute: vec![rank(true), rank(false)],
            transfers: Vec::new(),
            optimizer: vec![Some((end, end + opt_ns)); 2],
            comm: Vec::new(),
        }
    }

    #[test]
    fn each_phase_factor_is_measured_over_predicted() {
        let mut e = SpeedEstimate::new(1.0).unwrap();
        let predicted = timeline(100, 200, 50, 40);
        let measured = timeline(130, 160, 100, 10);
        e.observe(&predicted, &measured, 2);
        let s = e.phase_scale();
        assert_eq!(s.f, 1.3);
        assert_eq!(s.b, 0.8);
        // No I observed: it falls back on B; W was observed on rank 0.
        assert_eq!(s.i, 0.8);
        assert_eq!(s.w, 2.0);
        assert_eq!(s.optimizer, 0.25);
        // Rank 0: (130 + 160 + 100 + 10) / (100 + 200 + 50 + 40); rank 1 without W.
        let r = e.rank_factors();
        assert!((r[0] - 400.0 / 390.0).abs() < 1e-12, "{r:?}");
        assert!((r[1] - 300.0 / 340.0).abs() < 1e-12, "{r:?}");
        // Per rank: rank 1 has no W, which falls back on its B.
        let r1 = e.rank_phase_scale(1);
        assert_eq!((r1.f, r1.b, r1.w), (1.3, 0.8, 0.8));
        assert_eq!(e.rank_phase_scale(0).w, 2.0);
        assert_eq!(e.rank_phase_scale(7), PhaseScale::default());
    }

    /// A straggler: from its sixth step rank 1 computes 1.5x slower; rank 0 stays at the
    /// profile's speed. Rank 1's factors follow the change as the geometric sums say, rank 0's
    /// stay 1, and the phase factors over both ranks sit between.
    #[test]
    fn a_slowed_rank_stands_out_in_its_own_factors() {
        let g: f64 = 0.7;
        let mut e = SpeedEstimate::new(g).unwrap();
        let p = timeline(1000, 1000, 1000, 1000);
        let mut slow = timeline(1000, 1000, 1000, 1000);
        for op in &mut slow.compute[1] {
            op.end_ns = op.start_ns + (op.end_ns - op.start_ns) * 3 / 2;
        }
        for _ in 0..5 {
            e.observe(&p, &p, 2);
        }
        for k in 1..=10 {
            e.observe(&p, &slow, 2);
            let want = 1.5 - 0.5 * g.powi(k) * (1.0 - g.powi(5)) / (1.0 - g.powi(5 + k));
            assert!((e.rank_phase_scale(1).f - want).abs() < 1e-12, "k = {k}");
            assert_eq!(e.rank_phase_scale(0).f, 1.0);
            let f = e.phase_scale().f;
            assert!(f > 1.0 && f < want, "k = {k}: {f}");
        }
    }

    #[test]
    fn without_forgetting_every_step_weighs_alike() {
        let mut e = SpeedEstimate::new(1.0).unwrap();
        let p = timeline(100, 100, 100, 100);
        e.observe(&p, &timeline(100, 100, 100, 100), 2);
        e.observe(&p, &timeline(200, 100, 100, 100), 2);
        assert_eq!(e.phase_scale().f, 1.5);
        assert_eq!(e.steps(), 2);
    }

    #[test]
    fn with_forgetting_a_change_of_speed_is_followed_geometrically() {
        // Ten steps at the profile's speed, then F runs 1.5x slower. With forgetting g the
        // estimate k steps after the change is 1.5 - 0.5 g^k (1 - g^10) / (1 - g^(10 + k))
        // (a ratio of geometric sums); at g = 0.5 within 5% of 1.5 after four steps.
        let g: f64 = 0.5;
        let mut e = SpeedEstimate::new(g).unwrap();
        let p = timeline(1000, 1000, 1000, 1000);
        for _ in 0..10 {
            e.observe(&p, &p, 2);
        }
        for k in 1..=8 {
            e.observe(&p, &timeline(1500, 1000, 1000, 1000), 2);
            let want = 1.5 - 0.5 * g.powi(k) * (1.0 - g.powi(10)) / (1.0 - g.powi(10 + k));
            let got = e.phase_scale().f;
            assert!((got - want).abs() < 1e-12, "k = {k}: {got} vs {want}");
            assert_eq!(e.phase_scale().b, 1.0);
            if k >= 4 {
                assert!((got - 1.5).abs() / 1.5 < 0.05, "k = {k}: {got}");
            }
        }
    }

    #[test]
    fn nothing_observed_leaves_every_factor_at_one_and_bad_forgetting_is_refused() {
        let e = SpeedEstimate::new(0.9).unwrap();
        assert_eq!(e.phase_scale(), PhaseScale::default());
        assert!(e.rank_factors().is_empty());
        for bad in [0.0, -0.5, 1.5, f64::NAN] {
            let msg = SpeedEstimate::new(bad).unwrap_err().to_string();
            assert!(msg.contains("(0, 1]"), "{msg}");
        }
    }
}
