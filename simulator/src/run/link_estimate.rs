//! How fast the run's links go, estimated from the transfers its steps measured: per ordered
//! pair of ranks, the alpha-beta model `t = alpha + bytes / beta` (Hockney 1994) fitted by
//! least squares over the step's transfers, each step weighing `γ^k` after `k` more
//! ([`LinkEstimate`], exponential forgetting as [`crate::run::estimate::SpeedEstimate`]'s, so a
//! link that gets busier is followed within about `1 / (1 - γ)` steps).
//!
//! Only timed transfers count: a transfer the executor measured as taking no time (the CPU
//! backend's hand-off between rank threads, stamped on the host clock at the send) says nothing
//! of a link and is skipped. The CUDA backend times each device copy; an imported trace gives
//! its sends and receives.

use crate::replay::timeline::TimedTransfer;
use flatpipe_profiles::{Link, Profile};
use std::collections::BTreeMap;

/// A fitted link: `t = alpha_s + bytes / beta_bytes_per_s`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FittedLink {
    /// Latency per message, seconds (>= 0).
    pub alpha_s: f64,
    /// Bandwidth, bytes per second (> 0).
    pub beta_bytes_per_s: f64,
    /// The weight of the messages fitted (messages, discounted by the forgetting factor).
    pub messages: f64,
}

/// Weighted sums of one link's messages: `[Σw, Σw x, Σw y, Σw x², Σw x y]`, x in bytes and y
/// in seconds.
type Sums = [f64; 5];

/// The least-squares line of `sums`: `None` with fewer than two distinct sizes (bandwidth and
/// latency cannot be told apart) or a slope that is not positive (time not growing with size).
/// A negative intercept is clamped to 0.
fn fit(s: &Sums) -> Option<FittedLink> {
    let [w, sx, sy, sxx, sxy] = *s;
    let var = w * sxx - sx * sx;
    if w <= 0.0 || var <= 1e-9 * w * sxx {
        return None;
    }
    let slope = (w * sxy - sx * sy) / var;
    if !(slope > 0.0 && slope.is_finite()) {
        return None;
    }
    let alpha = ((sy - slope * sx) / w).max(0.0);
    Some(FittedLink {
        alpha_s: alpha,
        beta_bytes_per_s: 1.0 / slope,
        messages: w,
    })
}

/// Per ordered pair of ranks, the exponentially weighted least-squares sums of its timed
/// transfers (module doc).
#[derive(Debug, Clone, PartialEq)]
pub struct LinkEstimate {
    forgetting: f64,
    steps: u64,
    pairs: BTreeMap<(u32, u32), Sums>,
}

impl LinkEstimate {
    /// An estimate with nothing observed, forgetting with `forgetting` in (0, 1].
    ///
    /// # Errors
    /// A forgetting factor outside (0, 1].
    pub fn new(forgetting: f64) -> crate::Result<Self> {
        crate::run::estimate::check_forgetting(forgetting)?;
        Ok(LinkEstimate {
            forgetting,
            steps: 0,
            pairs: BTreeMap::new(),
        })
    }

    /// Steps observed.
    pub fn steps(&self) -> u64 {
        self.steps
    }

    /// Adds one step's transfers, `bytes(t)` the size of each, after weighting every earlier
    /// step by the forgetting factor. Transfers of no measured time, or of no size, are
    /// skipped.
    pub fn observe(&mut self, transfers: &[TimedTransfer], bytes: &dyn Fn(&TimedTransfer) -> f64) {
        for s in self.pairs.values_mut() {
            s.iter_mut().for_each(|x| *x *= self.forgetting);
        }
        for t in transfers {
            let (x, y) = (bytes(t), t.end_ns.saturating_sub(t.start_ns) as f64 * 1e-9);
            if !(x > 0.0 && y > 0.0 && x.is_finite()) {
                continue;
            }
            let s = self.pairs.entry((t.from.0, t.to.0)).or_default();
            for (acc, v) in s.iter_mut().zip([1.0, x, y, x * x, x * y]) {
                *acc += v;
            }
        }
        self.steps += 1;
    }

    /// The link from rank `from` to rank `to`, fitted; `None` without two message sizes.
    pub fn link(&self, from: u32, to: u32) -> Option<FittedLink> {
        self.pairs.get(&(from, to)).and_then(fit)
    }

    /// Every pair's messages fitted together: the run's link.
    pub fn pooled(&self) -> Option<FittedLink> {
        let mut all = Sums::default();
        for s in self.pairs.values() {
            for (a, v) in all.iter_mut().zip(s) {
                *a += v;
            }
        }
        fit(&all)
    }

    /// Every pair fitted, `(from, to, link)`, in rank order.
    pub fn links(&self) -> Vec<(u32, u32, FittedLink)> {
        self.pairs
            .iter()
            .filter_map(|(&(a, b), s)| fit(s).map(|l| (a, b, l)))
            .collect()
    }

    /// `profile` with its links (intra- and inter-node) at the slowest fitted pair's alpha
    /// and beta (a pipeline waits for its slowest link), each link's posting cost kept;
    /// `profile` unchanged when no pair has been fitted.
    pub fn apply(&self, profile: &Profile) -> Profile {
        let mut p = profile.clone();
        let slowest = self.links().into_iter().map(|x| x.2).max_by(|a, b| {
            // The slower link is the one a 1 MiB message takes longer on.
            let t = |l: &FittedLink| l.alpha_s + (1u64 << 20) as f64 / l.beta_bytes_per_s;
            t(a).total_cmp(&t(b))
        });
        if let Some(l) = slowest {
            for link in [&mut p.hardware.intra_node, &mut p.hardware.inter_node] {
                *link = Link {
                    name: format!("{} (as measured)", link.name),
                    alpha_s: l.alpha_s,
                    beta_bytes_per_s: l.beta_bytes_per_s,
                    post_s: link.post_s,
                };
            }
        }
        p
    }
}

/// The size of transfer `t` when its microbatch holds `tokens` tokens, bytes, as the cost
/// model sizes it ([`crate::costs::TableCosts`]): a forward sends the output of the sending
/// stage's last layer, a backward the gradient of the sending stage's input (the output of the
/// layer before its first). `stages` is the run's layer range per stage.
pub fn message_bytes(
    profile: &Profile,
    stages: &[std::ops::Range<usize>],
    t: &TimedTransfer,
    tokens: u64,
) -> f64 {
    use crate::ir::ActionKind;
    let Some(range) = stages.get(t.stage.idx()) else {
        return 0.0;
    };
    let layer = match t.kind {
        ActionKind::F | ActionKind::Fo => range.end.checked_sub(1),
        _ => range.start.checked_sub(1),
    };
    layer
        .and_then(|l| profile.layers.get(l))
        .map_or(0.0, |l| l.output_bytes_per_token * tokens as f64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::{ActionKind, MicrobatchId, Rank, StageId};

    /// Transfers of sizes 1, 2, 4 and 8 MiB from rank 0 to 1 on a link of `alpha` and `beta`.
    fn step(alpha: f64, beta: f64) -> Vec<TimedTransfer> {
        (0..4u32)
            .map(|k| {
                let bytes = f64::from(1u32 << (20 + k));
                TimedTransfer {
                    from: Rank(0),
                    to: Rank(1),
                    stage: StageId(0),
                    microbatch: MicrobatchId(k),
                    kind: ActionKind::F,
                    start_ns: 1000,
                    end_ns: 1000 + ((alpha + bytes / beta) * 1e9).round() as u64,
                }
            })
            .collect()
    }

    fn size(t: &TimedTransfer) -> f64 {
        f64::from(1u32 << (20 + t.microbatch.0))
    }

    #[test]
    fn one_link_is_recovered_exactly() {
        let mut e = LinkEstimate::new(1.0).unwrap();
        e.observe(&step(20e-6, 50e9), &size);
        let l = e.link(0, 1).unwrap();
        // Nanosecond rounding of the times: within 1e-4 relative.
        assert!((l.alpha_s - 20e-6).abs() < 2e-9, "{l:?}");
        assert!((l.beta_bytes_per_s / 50e9 - 1.0).abs() < 1e-4, "{l:?}");
        assert_eq!(e.link(1, 0), None);
        assert_eq!(e.pooled().map(|p| p.messages), Some(4.0));
    }

    /// The bandwidth halves from step 5 (a link shared with another job). With forgetting g
    /// the fit is the least-squares line of the two regimes weighted (1 - g^5) g^k against
    /// (1 - g^k): the slope is the weighted mean of the two slopes (the same sizes in every
    /// step, so the two regimes' lines are fitted on the same x), 1/beta = (a/50e9 + b/25e9) /
    /// (a + b) with a = g^k (1 - g^5) and b = 1 - g^k.
    #[test]
    fn a_busier_link_is_followed_as_the_weights_say() {
        let g: f64 = 0.5;
        let mut e = LinkEstimate::new(g).unwrap();
        for _ in 0..5 {
            e.observe(&step(20e-6, 50e9), &size);
        }
        for k in 1..=8 {
            e.observe(&step(20e-6, 25e9), &size);
            let (a, b) = (g.powi(k) * (1.0 - g.powi(5)), 1.0 - g.powi(k));
            let want = (a / 50e9 + b / 25e9) / (a + b);
            let got = 1.0 / e.link(0, 1).unwrap().beta_bytes_per_s;
            assert!((got / want - 1.0).abs() < 1e-4, "k = {k}: {got} vs {want}");
        }
    }

    #[test]
    fn untimed_transfers_and_single_sizes_fit_nothing() {
        let mut e = LinkEstimate::new(1.0).unwrap();
        let mut host = step(20e-6, 50e9);
        for t in &mut host {
            t.end_ns = t.start_ns;
        }
        e.observe(&host, &size);
        assert_eq!(e.pooled(), None);
        e.observe(&step(20e-6, 50e9)[..1], &size);
        assert_eq!(
            e.pooled(),
            None,
            "one size: latency and bandwidth not separable"
        );
        assert!(LinkEstimate::new(0.0).is_err());
    }

    #[test]
    fn the_profile_takes_the_slowest_fitted_link() {
        let model = flatpipe_profiles::builtins::model("tiny").unwrap();
        let hw = flatpipe_profiles::builtins::hardware("cpu").unwrap();
        let p = flatpipe_profiles::analytic_profile(&model, &hw, &Default::default()).unwrap();
        let mut e = LinkEstimate::new(1.0).unwrap();
        assert_eq!(e.apply(&p), p);
        let mut both = step(20e-6, 50e9);
        for mut t in step(40e-6, 10e9) {
            t.from = Rank(1);
            t.to = Rank(2);
            both.push(t);
        }
        e.observe(&both, &size);
        let q = e.apply(&p);
        assert!((q.hardware.intra_node.beta_bytes_per_s / 10e9 - 1.0).abs() < 1e-3);
        assert!((q.hardware.inter_node.alpha_s - 40e-6).abs() < 1e-8);
    }
}
