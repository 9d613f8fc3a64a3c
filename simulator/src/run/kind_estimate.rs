//! How fast each layer kind runs against its profile, per phase, estimated from a run's
//! measured actions ([`KindEstimate`]).
//!
//! A stage's action runs the layers of its stage, so its measured time is, by the profile's
//! cost model, `Σ_k s_k p_k`: `p_k` the profile's time of the stage's layers of kind `k`
//! (embedding, decoder, head) at the action's microbatch, `s_k` the kind's factor for the
//! action's phase. Over every action of every step the factors are the non-negative least
//! squares fit of that model (Lawson and Hanson 1974, here exact: every subset of the three
//! kinds is solved and the best feasible kept), each step weighing `γ^k` after `k` more, as
//! [`crate::run::estimate::SpeedEstimate`] forgets. Where [`SpeedEstimate`]'s rank factors tell
//! *where* a run is slow, these tell *what* is slow, and they carry over to another layer
//! split (`Profile::scaled_by_layers` with each layer's kind's factors). The fit assumes the
//! ranks go at one speed: a straggler's time is put on the kinds its stages hold.
//!
//! [`SpeedEstimate`]: crate::run::estimate::SpeedEstimate

use crate::batching::microbatch::Microbatch;
use crate::ir::{Action, ActionKind};
use crate::replay::timeline::Timeline;
use crate::run::config::RunConfig;
use flatpipe_profiles::{LayerKind, PhaseScale, Profile};

/// The kinds fitted, in column order (`parts` indexes them the same way).
const KINDS: [LayerKind; 3] = [LayerKind::Embedding, LayerKind::Decoder, LayerKind::Head];
/// Phase slots: F (and Fo), I, W, B.
const PHASES: usize = 4;

/// One phase's weighted normal equations: `A = Σ w p pᵀ`, `b = Σ w p m`, `c = Σ w m²`.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct Normal {
    a: [[f64; 3]; 3],
    b: [f64; 3],
    c: f64,
}

impl Normal {
    fn scale(&mut self, g: f64) {
        self.a.iter_mut().flatten().for_each(|x| *x *= g);
        self.b.iter_mut().for_each(|x| *x *= g);
        self.c *= g;
    }

    fn add(&mut self, p: [f64; 3], m: f64) {
        for i in 0..3 {
            for j in 0..3 {
                self.a[i][j] += p[i] * p[j];
            }
            self.b[i] += p[i] * m;
        }
        self.c += m * m;
    }

    /// The non-negative least-squares factors: every non-empty subset of the observed kinds
    /// solved by Gaussian elimination, the feasible one (all > 0) of least residual kept;
    /// `None` per kind outside it or not observed.
    fn solve(&self) -> [Option<f64>; 3] {
        let observed: Vec<usize> = (0..3).filter(|&i| self.a[i][i] > 0.0).collect();
        let mut best: Option<(f64, Vec<(usize, f64)>)> = None;
        for mask in 1u32..(1 << observed.len()) {
            let set: Vec<usize> = (0..observed.len())
                .filter(|k| mask & (1 << k) != 0)
                .map(|k| observed[k])
                .collect();
            let Some(x) = self.solve_subset(&set) else {
                continue;
            };
            if x.iter().any(|v| v.is_nan() || *v <= 0.0) {
                continue;
            }
            // Residual c - 2 xᵀb + xᵀAx over the subset.
            let mut r = self.c;
            for (u, &i) in set.iter().enumerate() {
                r -= 2.0 * x[u] * self.b[i];
                for (v, &j) in set.iter().enumerate() {
                    r += x[u] * x[v] * self.a[i][j];
                }
            }
            if best
                .as_ref()
                .is_none_or(|(br, _)| r < *br - 1e-12 * self.c.abs())
            {
                best = Some((r, set.iter().copied().zip(x).collect()));
            }
        }
        let mut out = [None; 3];
        for (i, v) in best.map(|b| b.1).unwrap_or_default() {
            out[i] = Some(v);
        }
        out
    }

    /// The least-squares solution on the kinds `set`; `None` when singular.
    fn solve_subset(&self, set: &[usize]) -> Option<Vec<f64>> {
        let n = set.len();
        let mut m: Vec<Vec<f64>> = set
            .iter()
            .map(|&i| {
                let mut row: Vec<f64> = set.iter().map(|&j| self.a[i][j]).collect();
                row.push(self.b[i]);
                row
            })
            .collect();
        let scale = m.iter().flatten().fold(0.0f64, |a, x| a.max(x.abs()));
        for col in 0..n {
            let pivot = (col..n).max_by(|&x, &y| m[x][col].abs().total_cmp(&m[y][col].abs()))?;
            if m[pivot][col].abs() <= 1e-12 * scale {
                return None;
            }
            m.swap(col, pivot);
            let p = m[col].clone();
            for (row, r) in m.iter_mut().enumerate() {
                if row != col {
                    let f = r[col] / p[col];
                    for (x, y) in r[col..].iter_mut().zip(&p[col..]) {
                        *x -= f * y;
                    }
                }
            }
        }
        Some((0..n).map(|i| m[i][n] / m[i][i]).collect())
    }
}

/// Per layer kind and phase, the exponentially weighted non-negative least-squares factors of
/// measured over profile time (module doc).
#[derive(Debug, Clone, PartialEq)]
pub struct KindEstimate {
    forgetting: f64,
    steps: u64,
    phases: [Normal; PHASES],
}

/// The phase slot of an action kind.
fn phase(kind: ActionKind) -> usize {
    match kind {
        ActionKind::F | ActionKind::Fo => 0,
        ActionKind::I => 1,
        ActionKind::W => 2,
        ActionKind::B => 3,
    }
}

impl KindEstimate {
    /// An estimate with nothing observed, forgetting with `forgetting` in (0, 1].
    ///
    /// # Errors
    /// A forgetting factor outside (0, 1].
    pub fn new(forgetting: f64) -> crate::Result<Self> {
        crate::run::estimate::check_forgetting(forgetting)?;
        Ok(KindEstimate {
            forgetting,
            steps: 0,
            phases: [Normal::default(); PHASES],
        })
    }

    /// Steps observed.
    pub fn steps(&self) -> u64 {
        self.steps
    }

    /// The profile's time of each kind's layers in stage `stage` for an action of `kind` on
    /// microbatch `mb`, seconds per kind (the first stage's I costs nothing and its W a fused
    /// backward where the profile says its runtime does so).
    fn parts(
        profile: &Profile,
        config: &RunConfig,
        stage: usize,
        kind: ActionKind,
        mb: &Microbatch,
    ) -> [f64; 3] {
        let (t, a) = (mb.computed_tokens() as f64, mb.computed_attn_pairs() as f64);
        let whole = stage == 0 && profile.first_stage_backward_in_w;
        let mut out = [0.0; 3];
        for l in config.stages.get(stage).cloned().unwrap_or(0..0) {
            let Some(layer) = profile.layers.get(l) else {
                continue;
            };
            let k = match layer.kind {
                LayerKind::Embedding => 0,
                LayerKind::Decoder => 1,
                LayerKind::Head => 2,
            };
            out[k] += match kind {
                ActionKind::F | ActionKind::Fo => layer.f.time_s(t, a),
                ActionKind::I if whole => 0.0,
                ActionKind::I => layer.i.time_s(t, a),
                ActionKind::W if whole => layer.fused_backward_s(t, a),
                ActionKind::W => layer.w.time_s(t, a),
                ActionKind::B => layer.fused_backward_s(t, a),
            };
        }
        out
    }

    /// Adds one step: every compute action (overlapped pairs left out) of ranks `0..ranks` of
    /// `measured`, its measured time against `profile`'s time of each kind's layers in its
    /// stage (`config`'s stages) at its microbatch `microbatches[mb]`; actions on a microbatch
    /// past the list are skipped.
    pub fn observe(
        &mut self,
        profile: &Profile,
        config: &RunConfig,
        microbatches: &[Microbatch],
        measured: &Timeline,
        ranks: usize,
    ) {
        for n in self.phases.iter_mut() {
            n.scale(self.forgetting);
        }
        for ops in measured.compute.iter().take(ranks) {
            for op in ops {
                let Action::Compute(c) = op.action else {
                    continue;
                };
                let Some(mb) = microbatches.get(c.microbatch.idx()) else {
                    continue;
                };
                let p = Self::parts(profile, config, c.stage.idx(), c.kind, mb);
                let m = op.end_ns.saturating_sub(op.start_ns) as f64 * 1e-9;
                if p.iter().sum::<f64>() > 0.0 {
                    self.phases[phase(c.kind)].add(p, m);
                }
            }
        }
        self.steps += 1;
    }

    /// Per kind, its factor per phase: the fit's, or where the fit has none for a kind (not
    /// observed in that phase), the fused backward's for I and W and theirs for B, else 1.
    pub fn factors(&self) -> Vec<(LayerKind, PhaseScale)> {
        let fits: Vec<[Option<f64>; 3]> = self.phases.iter().map(Normal::solve).collect();
        KINDS
            .iter()
            .enumerate()
            .map(|(k, &kind)| {
                let at = |ph: usize| fits[ph][k];
                let bwd = at(3).or_else(|| at(1).zip(at(2)).map(|(i, w)| (i + w) / 2.0));
                let s = PhaseScale {
                    f: at(0).unwrap_or(1.0),
                    i: at(1).or(bwd).unwrap_or(1.0),
                    w: at(2).or(bwd).unwrap_or(1.0),
                    b: bwd.unwrap_or(1.0),
                    optimizer: 1.0,
                };
                (kind, s)
            })
            .collect()
    }

    /// `profile` with every layer scaled by its kind's factors ([`KindEstimate::factors`]).
    ///
    /// # Errors
    /// A factor that is not finite and > 0.
    pub fn scaled(&self, profile: &Profile) -> crate::Result<Profile> {
        let f = self.factors();
        let ranges: Vec<_> = profile
            .layers
            .iter()
            .enumerate()
            .map(|(l, layer)| {
                let s = f
                    .iter()
                    .find(|x| x.0 == layer.kind)
                    .map_or(PhaseScale::default(), |x| x.1);
                (l..l + 1, s)
            })
            .collect();
        Ok(profile.scaled_by_layers(&ranges, 1.0)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::batching::policy::Policy;
    use crate::ir::{ComputeAction, MicrobatchId, StageId};
    use crate::replay::timeline::TimedOp;
    use crate::run::config::{Capacity, ScheduleSource};
    use crate::run::plan::even_split;
    use crate::schedules::generators::ScheduleKind;

    fn setup() -> (Profile, RunConfig, Vec<Microbatch>) {
        let model = flatpipe_profiles::builtins::model("tiny").unwrap();
        let hw = flatpipe_profiles::builtins::hardware("cpu").unwrap();
        let p = flatpipe_profiles::analytic_profile(&model, &hw, &Default::default()).unwrap();
        let c = RunConfig::new(
            ScheduleSource::Kind(ScheduleKind::OneFOneB),
            2,
            1,
            even_split(p.layers.len(), 2).unwrap(),
            Policy::FlatFfd,
            Capacity::Dynamic,
        );
        let mbs = vec![
            Microbatch::flat(vec![100, 30]),
            Microbatch::flat(vec![400]),
            Microbatch::flat(vec![60, 60, 60]),
        ];
        (p, c, mbs)
    }

    /// Every F, I, W of both stages on every microbatch, each lasting the profile's time of
    /// its layers with kind k's layers `truth[k]` times slower (F) and `bwd[k]` (I and W).
    fn measured(
        p: &Profile,
        c: &RunConfig,
        mbs: &[Microbatch],
        truth: [f64; 3],
        bwd: [f64; 3],
    ) -> Timeline {
        let mut compute = vec![Vec::new(), Vec::new()];
        for (s, ops) in compute.iter_mut().enumerate() {
            let mut at = 0u64;
            for (m, mb) in mbs.iter().enumerate() {
                for kind in [ActionKind::F, ActionKind::I, ActionKind::W] {
                    let parts = KindEstimate::parts(p, c, s, kind, mb);
                    let f = if kind == ActionKind::F { truth } else { bwd };
                    let secs: f64 = parts.iter().zip(f).map(|(x, y)| x * y).sum();
                    let len = (secs * 1e9).round() as u64;
                    ops.push(TimedOp {
                        action: Action::Compute(ComputeAction {
                            stage: StageId(s as u32),
                            kind,
                            microbatch: MicrobatchId(m as u32),
                        }),
                        start_ns: at,
                        end_ns: at + len,
                    });
                    at += len;
                }
            }
        }
        Timeline {
            compute,
            ..Timeline::default()
        }
    }

    #[test]
    fn each_kinds_factor_is_recovered_from_stage_times() {
        let (p, c, mbs) = setup();
        let mut e = KindEstimate::new(1.0).unwrap();
        e.observe(
            &p,
            &c,
            &mbs,
            &measured(&p, &c, &mbs, [1.0, 1.2, 2.0], [0.9, 1.5, 1.1]),
            2,
        );
        let f = e.factors();
        let near = |a: f64, b: f64| (a - b).abs() < 1e-4 * b;
        assert_eq!(f[0].0, LayerKind::Embedding);
        assert!(
            near(f[0].1.f, 1.0) && near(f[1].1.f, 1.2) && near(f[2].1.f, 2.0),
            "{f:?}"
        );
        assert!(near(f[1].1.i, 1.5) && near(f[2].1.w, 1.1), "{f:?}");
        // The scaled profile prices a decoder's F 1.2x the profile's.
        let q = e.scaled(&p).unwrap();
        let d = p
            .layers
            .iter()
            .position(|l| l.kind == LayerKind::Decoder)
            .unwrap();
        assert!(near(q.layers[d].f.c_tok_s, 1.2 * p.layers[d].f.c_tok_s));
    }

    /// The head's F slows from 1 to 3 at step 4. With forgetting g, after k slow steps the
    /// fit is the blend of the two regimes' exact solutions weighted g^k (1 - g^4) against
    /// 1 - g^k (the same actions every step, so the normal equations are the regimes' sums).
    #[test]
    fn a_kind_that_slows_is_followed_as_the_weights_say() {
        let (p, c, mbs) = setup();
        let g: f64 = 0.5;
        let mut e = KindEstimate::new(g).unwrap();
        for _ in 0..4 {
            e.observe(&p, &c, &mbs, &measured(&p, &c, &mbs, [1.0; 3], [1.0; 3]), 2);
        }
        for k in 1..=6 {
            e.observe(
                &p,
                &c,
                &mbs,
                &measured(&p, &c, &mbs, [1.0, 1.0, 3.0], [1.0; 3]),
                2,
            );
            let (a, b) = (g.powi(k) * (1.0 - g.powi(4)), 1.0 - g.powi(k));
            let want = (a + 3.0 * b) / (a + b);
            let head = e.factors()[2].1.f;
            assert!(
                (head - want).abs() < 1e-4 * want,
                "k = {k}: {head} vs {want}"
            );
            assert!((e.factors()[1].1.f - 1.0).abs() < 1e-4);
        }
        assert!(KindEstimate::new(1.5).is_err());
    }
}
