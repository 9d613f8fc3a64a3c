//! A profile rescaled by how fast a run measured each phase against it ([`Profile::scaled`]):
//! what the closed loop predicts other schedules from once one schedule has run, and what an
//! online re-planner plans the next step from.

use crate::error::{Error, Result};
use crate::profile::{CostCoeffs, Profile};

/// Measured time over predicted time per phase (1.0: the profile held; 1.2: that phase ran 20%
/// slower than the profile says). Each factor is finite and > 0.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct PhaseScale {
    /// Forward (and forward-only) passes.
    pub f: f64,
    /// Input-gradient passes (dgrad).
    pub i: f64,
    /// Weight-gradient passes (wgrad).
    pub w: f64,
    /// Fused backward passes, where the profile has a measured fused cost
    /// ([`crate::LayerProfile::b`]); otherwise a `B` costs the scaled `I + W`.
    pub b: f64,
    /// The optimizer step.
    pub optimizer: f64,
}

impl Default for PhaseScale {
    fn default() -> Self {
        PhaseScale {
            f: 1.0,
            i: 1.0,
            w: 1.0,
            b: 1.0,
            optimizer: 1.0,
        }
    }
}

impl PhaseScale {
    /// Checks every factor is finite and > 0.
    ///
    /// # Errors
    /// [`Error::Invalid`] naming the factor and its value.
    pub fn validate(&self) -> Result<()> {
        for (name, v) in [
            ("f", self.f),
            ("i", self.i),
            ("w", self.w),
            ("b", self.b),
            ("optimizer", self.optimizer),
        ] {
            if !(v.is_finite() && v > 0.0) {
                return Err(Error::invalid(
                    "the phase scale",
                    name,
                    v,
                    "a finite factor > 0",
                ));
            }
        }
        Ok(())
    }
}

fn times(c: &CostCoeffs, k: f64) -> CostCoeffs {
    CostCoeffs {
        c0_s: c.c0_s * k,
        c_tok_s: c.c_tok_s * k,
        c_attn_s: c.c_attn_s * k,
    }
}

/// Every cost of `l` multiplied by its phase's factor ([`Profile::scaled`]).
fn scale_layer(l: &mut crate::LayerProfile, scale: &PhaseScale) {
    l.f = times(&l.f, scale.f);
    l.fo = times(&l.fo, scale.f);
    l.i = times(&l.i, scale.i);
    l.w = times(&l.w, scale.w);
    l.b = l.b.map(|b| times(&b, scale.b));
    if let Some(r) = &mut l.routed {
        r.f = times(&r.f, scale.f);
        r.i = times(&r.i, scale.i);
        r.w = times(&r.w, scale.w);
        // The all-to-alls run inside F and I: priced with the forward's factor, as the
        // measured forward holds them.
        r.all_to_all = times(&r.all_to_all, scale.f);
    }
}

impl Profile {
    /// This profile with the layers of each range scaled by its own [`PhaseScale`] (each
    /// layer's costs as [`Profile::scaled`] scales them; layers in no range unchanged), and the
    /// optimizer's time per parameter by `optimizer`: the profile of a run whose pipeline ranks
    /// go at different speeds, each rank's stages (their layer ranges) scaled by what was
    /// measured on it (a straggler's layers cost more). Links, overheads, memory and the
    /// model's shape are kept.
    ///
    /// # Errors
    /// [`Error::Invalid`] for a factor that is not finite and > 0, or a range that leaves the
    /// layer list.
    pub fn scaled_by_layers(
        &self,
        ranges: &[(std::ops::Range<usize>, PhaseScale)],
        optimizer: f64,
    ) -> Result<Profile> {
        let mut p = self.clone();
        for (range, scale) in ranges {
            scale.validate()?;
            let n = p.layers.len();
            let layers = p.layers.get_mut(range.clone()).ok_or_else(|| {
                Error::invalid(
                    "profile scaling",
                    "layer range",
                    format!("{}..{}", range.start, range.end),
                    format!("within the profile's {n} layers"),
                )
            })?;
            for l in layers {
                scale_layer(l, scale);
            }
        }
        PhaseScale {
            optimizer,
            ..PhaseScale::default()
        }
        .validate()?;
        p.optimizer_s_per_param *= optimizer;
        Ok(p)
    }

    /// This profile with every cost of a phase multiplied by its factor: each layer's `f` and
    /// `fo` by `scale.f`, `i` by `scale.i`, `w` by `scale.w`, a measured fused `b` by `scale.b`
    /// (the routed part of a mixture-of-experts layer, its all-to-alls included, with its
    /// phase), the runtime's fixed cost per action likewise, and the optimizer's time per
    /// parameter by `scale.optimizer`. Links, memory and the model's shape are kept. The
    /// provenance's notes say what was applied.
    ///
    /// # Errors
    /// [`Error::Invalid`] for a factor that is not finite and > 0.
    pub fn scaled(&self, scale: &PhaseScale) -> Result<Profile> {
        scale.validate()?;
        let mut p = self.clone();
        for l in &mut p.layers {
            scale_layer(l, scale);
        }
        let o = &mut p.action_overhead;
        o.f_s *= scale.f;
        o.i_s *= scale.i;
        o.w_s *= scale.w;
        o.b_s *= scale.b;
        p.optimizer_s_per_param *= scale.optimizer;
        let note = format!(
            "scaled by a run's measured / predicted time per phase: F x{:.3}, I x{:.3}, W x{:.3}, B x{:.3}, optimizer x{:.3}",
            scale.f, scale.i, scale.w, scale.b, scale.optimizer
        );
        p.provenance.notes = if p.provenance.notes.is_empty() {
            note
        } else {
            format!("{}; {note}", p.provenance.notes)
        };
        Ok(p)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Phase, builtins};

    fn tiny() -> Profile {
        let m = builtins::model("tiny-moe").unwrap();
        let hw = builtins::hardware("h100").unwrap();
        crate::analytic_profile(&m, &hw, &crate::AnalyticOptions::default()).unwrap()
    }

    #[test]
    fn each_phase_scales_by_its_own_factor_and_nothing_else_moves() {
        let p = tiny();
        let s = PhaseScale {
            f: 1.5,
            i: 0.5,
            w: 2.0,
            b: 3.0,
            optimizer: 0.25,
        };
        let q = p.scaled(&s).unwrap();
        // Scaling every layer's range alike is the same (overheads aside).
        let mut r = p
            .scaled_by_layers(&[(0..p.layers.len(), s)], s.optimizer)
            .unwrap();
        r.action_overhead = q.action_overhead;
        r.provenance = q.provenance.clone();
        assert_eq!(r, q);
        let (t, pairs) = (300.0, 20_000.0);
        for (a, b) in p.layers.iter().zip(&q.layers) {
            for (phase, k) in [
                (Phase::F, 1.5),
                (Phase::Fo, 1.5),
                (Phase::I, 0.5),
                (Phase::W, 2.0),
            ] {
                let (x, y) = (
                    a.coeffs(phase).time_s(t, pairs),
                    b.coeffs(phase).time_s(t, pairs),
                );
                assert!(
                    (y - k * x).abs() <= 1e-12 * x.max(1e-30),
                    "{} {phase:?}",
                    a.name
                );
            }
            // No measured fused cost: a B is the scaled I + W.
            let want = 0.5 * a.i.time_s(t, pairs) + 2.0 * a.w.time_s(t, pairs);
            let got = b.fused_backward_s(t, pairs);
            assert!((got - want).abs() <= 1e-12 * want.max(1e-30), "{}", a.name);
            assert_eq!(a.param_bytes, b.param_bytes);
            assert_eq!(a.act_bytes_per_token_i, b.act_bytes_per_token_i);
        }
        assert!(p.layers.iter().any(|l| l.routed.is_some()));
        assert_eq!(q.optimizer_s_per_param, 0.25 * p.optimizer_s_per_param);
        assert_eq!(q.hardware, p.hardware);
        assert!(
            q.provenance.notes.contains("F x1.500"),
            "{}",
            q.provenance.notes
        );
    }

    #[test]
    fn a_factor_that_is_not_positive_and_finite_is_refused_by_name() {
        for bad in [0.0, -1.0, f64::NAN, f64::INFINITY] {
            let s = PhaseScale {
                w: bad,
                ..PhaseScale::default()
            };
            let e = tiny().scaled(&s).unwrap_err().to_string();
            assert!(e.contains('w') && e.contains("finite factor > 0"), "{e}");
        }
    }
}
