//! CPU kernels of a mixture-of-experts MLP over flat `[T]` tokens, fp32: the router's gating
//! and top-k choice, and the routed SwiGLU experts, with the backward split into dgrad (I) and
//! wgrad (W) as the dense layer's is ([`crate::kernels`]). The shared experts are a dense
//! SwiGLU MLP and the router's projection a dense matmul: both run on the dense kernels.
//!
//! For `T` tokens of hidden size `H`, `E` routed experts of width `F` and `k` experts per token:
//! - router: `logits = x Wr` (`[T, E]`, a dense matmul outside this module), scores
//!   `softmax(logits)` (Mixtral, Qwen3-MoE) or `sigmoid(logits)` (DeepSeek-V3), each token's
//!   `k` highest scores (ties to the lower expert index) as its experts, their scores as its
//!   weights, divided by their sum where `normalise` (DeepSeek-V3, arXiv 2412.19437, §2.1.2;
//!   Qwen3's `norm_topk_prob`);
//! - expert `e` on the `n_e` tokens routed to it: `y_e = (silu(x_e Wg_e) * (x_e Wu_e)) Wd_e`,
//!   and each token's output is `Σ_j w_j y_{e_j}`.
//!
//! The top-k choice is piecewise constant: gradients flow to the logits through the chosen
//! experts' weights only. Every backward is checked against central finite differences in this
//! module's tests.

use crate::kernels::{matmul, swiglu, swiglu_backward};
use ndarray::{Array2, ArrayView2};

pub use flatpipe_profiles::Gating;

/// Each token's chosen experts and weights, from [`route`].
#[derive(Debug, Clone, PartialEq)]
pub struct Routing {
    /// `[T, k]`: the chosen experts, highest score first.
    pub experts: Array2<u32>,
    /// `[T, k]`: their weights.
    pub weights: Array2<f32>,
    /// `[T, E]`: every expert's score (what the backward needs).
    pub scores: Array2<f32>,
    /// The gating used.
    pub gating: Gating,
    /// Whether the weights were divided by their sum.
    pub normalise: bool,
}

impl Routing {
    /// Tokens routed to each of `experts` experts (what a receiver sizes its buffers by: the
    /// counts are exchanged before the tokens).
    pub fn counts(&self, experts: usize) -> Vec<usize> {
        let mut out = vec![0; experts];
        for &e in &self.experts {
            out[e as usize] += 1;
        }
        out
    }

    /// Per expert, the `(token, slot)` pairs routed to it, in token order.
    pub fn assignments(&self, experts: usize) -> Vec<Vec<(usize, usize)>> {
        let mut out = vec![Vec::new(); experts];
        for ((t, j), &e) in self.experts.indexed_iter() {
            out[e as usize].push((t, j));
        }
        out
    }
}

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// Routes `logits [T, E]` to `k` experts per token (see the module documentation).
///
/// # Panics
/// If `k` is 0 or more than the experts (the model file's checks refuse both).
pub fn route(logits: ArrayView2<f32>, k: usize, gating: Gating, normalise: bool) -> Routing {
    let (t, e) = logits.dim();
    assert!(k >= 1 && k <= e, "top-k {k} of {e} experts");
    let mut scores = logits.to_owned();
    for mut row in scores.rows_mut() {
        match gating {
            Gating::Softmax => {
                let max = row.fold(f32::NEG_INFINITY, |m, &x| m.max(x));
                row.mapv_inplace(|x| (x - max).exp());
                let sum: f32 = row.sum();
                row.mapv_inplace(|x| x / sum);
            }
            Gating::Sigmoid => row.mapv_inplace(sigmoid),
        }
    }
    let mut experts = Array2::zeros((t, k));
    let mut weights = Array2::zeros((t, k));
    let mut order: Vec<usize> = (0..e).collect();
    for (i, row) in scores.rows().into_iter().enumerate() {
        order.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
        let sum: f32 = order[..k].iter().map(|&x| row[x]).sum();
        for (j, &x) in order[..k].iter().enumerate() {
            experts[[i, j]] = x as u32;
            weights[[i, j]] = if normalise { row[x] / sum } else { row[x] };
        }
    }
    Routing {
        experts,
        weights,
        scores,
        gating,
        normalise,
    }
}

/// The router's backward: from the gradient of the chosen weights `dweights [T, k]`, the
/// gradient of the logits `[T, E]` (zero through the experts not chosen, except as softmax
/// couples them). With normalisation `w_j = s_j / Σ s`: `ds_j = (dw_j - Σ_i dw_i w_i) / Σ s`.
/// Softmax: `dlogits = p (ds - Σ p ds)`; sigmoid: `dlogits = ds s (1 - s)`.
pub fn route_backward(r: &Routing, dweights: ArrayView2<f32>) -> Array2<f32> {
    let mut ds = Array2::<f32>::zeros(r.scores.dim());
    for (i, (dw, w)) in dweights
        .rows()
        .into_iter()
        .zip(r.weights.rows())
        .enumerate()
    {
        let chosen = r.experts.row(i);
        let sum: f32 = chosen.iter().map(|&e| r.scores[[i, e as usize]]).sum();
        let dot: f32 = dw.iter().zip(w.iter()).map(|(a, b)| a * b).sum();
        for (j, &e) in chosen.iter().enumerate() {
            ds[[i, e as usize]] += if r.normalise {
                (dw[j] - dot) / sum
            } else {
                dw[j]
            };
        }
    }
    let mut d = ds;
    for (mut drow, srow) in d.rows_mut().into_iter().zip(r.scores.rows()) {
        match r.gating {
            Gating::Softmax => {
                let dot: f32 = drow.iter().zip(srow.iter()).map(|(a, b)| a * b).sum();
                drow.zip_mut_with(&srow, |g, &p| *g = p * (*g - dot));
            }
            Gating::Sigmoid => drow.zip_mut_with(&srow, |g, &s| *g *= s * (1.0 - s)),
        }
    }
    d
}

/// One routed expert's weights: gate `[H, F]`, up `[H, F]`, down `[F, H]`.
#[derive(Debug, Clone, PartialEq)]
pub struct Expert {
    /// `Wg`, `[H, F]`.
    pub gate: Array2<f32>,
    /// `Wu`, `[H, F]`.
    pub up: Array2<f32>,
    /// `Wd`, `[F, H]`.
    pub down: Array2<f32>,
}

/// What one expert's forward keeps for its backward, on its `n_e` routed tokens.
#[derive(Debug, Clone)]
pub struct ExpertSaved {
    /// The `(token, slot)` pairs it ran, in token order.
    pub rows: Vec<(usize, usize)>,
    /// Its input rows `x_e`, `[n_e, H]`.
    pub x: Array2<f32>,
    /// `x_e Wg`, `[n_e, F]`.
    pub gate: Array2<f32>,
    /// `x_e Wu`, `[n_e, F]`.
    pub up: Array2<f32>,
    /// `silu(x_e Wg) * (x_e Wu)`, `[n_e, F]` (the down projection's input, for its wgrad).
    pub act: Array2<f32>,
    /// `y_e` before weighting, `[n_e, H]` (for the weights' gradient).
    pub out: Array2<f32>,
}

fn gather(x: ArrayView2<f32>, rows: &[(usize, usize)]) -> Array2<f32> {
    let mut out = Array2::zeros((rows.len(), x.ncols()));
    for (r, &(t, _)) in rows.iter().enumerate() {
        out.row_mut(r).assign(&x.row(t));
    }
    out
}

/// The routed experts' forward: `y [T, H] = Σ_j w_j expert_{e_j}(x)` for `x [T, H]`, and what
/// each expert keeps for the backward.
pub fn experts_forward(
    x: ArrayView2<f32>,
    r: &Routing,
    experts: &[Expert],
) -> (Array2<f32>, Vec<ExpertSaved>) {
    let mut y = Array2::<f32>::zeros(x.dim());
    let mut saved = Vec::with_capacity(experts.len());
    for (ex, rows) in experts.iter().zip(r.assignments(experts.len())) {
        let xe = gather(x, &rows);
        let (g, u) = (
            matmul(xe.view(), ex.gate.view()),
            matmul(xe.view(), ex.up.view()),
        );
        let act = swiglu(g.view(), u.view());
        let out = matmul(act.view(), ex.down.view());
        for (i, &(t, j)) in rows.iter().enumerate() {
            y.row_mut(t).scaled_add(r.weights[[t, j]], &out.row(i));
        }
        saved.push(ExpertSaved {
            rows,
            x: xe,
            gate: g,
            up: u,
            act,
            out,
        });
    }
    (y, saved)
}

/// What one expert's dgrad leaves for its wgrad: the gradients at its down projection's output
/// (`[n_e, H]`) and at its gate and up projections' outputs (`[n_e, F]` each).
#[derive(Debug, Clone)]
pub struct ExpertGrads {
    /// `dL/dy_e` scaled by each row's weight.
    pub d_out: Array2<f32>,
    /// `dL/d(x_e Wg)`.
    pub d_gate: Array2<f32>,
    /// `dL/d(x_e Wu)`.
    pub d_up: Array2<f32>,
}

/// The routed experts' input-gradient pass (I): from `dy [T, H]`, the gradient of their input
/// `dx [T, H]`, of the routing weights `[T, k]` (for [`route_backward`]), and what each
/// expert's wgrad needs.
pub fn experts_dgrad(
    dy: ArrayView2<f32>,
    r: &Routing,
    experts: &[Expert],
    saved: &[ExpertSaved],
) -> (Array2<f32>, Array2<f32>, Vec<ExpertGrads>) {
    let mut dx = Array2::<f32>::zeros(dy.dim());
    let mut dw = Array2::<f32>::zeros(r.weights.dim());
    let mut grads = Vec::with_capacity(saved.len());
    for (ex, s) in experts.iter().zip(saved) {
        let mut d_out = gather(dy, &s.rows);
        for (i, &(t, j)) in s.rows.iter().enumerate() {
            dw[[t, j]] = d_out.row(i).dot(&s.out.row(i));
            d_out.row_mut(i).mapv_inplace(|v| v * r.weights[[t, j]]);
        }
        let d_act = matmul(d_out.view(), ex.down.t());
        let (d_gate, d_up) = swiglu_backward(d_act.view(), s.gate.view(), s.up.view());
        let mut dxe = matmul(d_gate.view(), ex.gate.t());
        dxe += &matmul(d_up.view(), ex.up.t());
        for (i, &(t, _)) in s.rows.iter().enumerate() {
            dx.row_mut(t).scaled_add(1.0, &dxe.row(i));
        }
        grads.push(ExpertGrads {
            d_out,
            d_gate,
            d_up,
        });
    }
    (dx, dw, grads)
}

/// The routed experts' weight-gradient pass (W): adds each expert's `dWg = x_eᵀ dG`, `dWu =
/// x_eᵀ dU`, `dWd = (silu(G) * U)ᵀ dY` to `into` (same shapes as the experts).
pub fn experts_wgrad(saved: &[ExpertSaved], grads: &[ExpertGrads], into: &mut [Expert]) {
    for ((s, g), d) in saved.iter().zip(grads).zip(into.iter_mut()) {
        if s.rows.is_empty() {
            continue;
        }
        d.gate += &matmul(s.x.t(), g.d_gate.view());
        d.up += &matmul(s.x.t(), g.d_up.view());
        d.down += &matmul(s.act.t(), g.d_out.view());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::tests::{directional, randn};
    use rand::SeedableRng;
    use rand::rngs::ChaCha8Rng;

    const TOL: f64 = 3e-3;

    fn proj(y: &Array2<f32>, r: &Array2<f32>) -> f64 {
        y.iter()
            .zip(r.iter())
            .map(|(a, b)| (*a as f64) * (*b as f64))
            .sum()
    }

    fn experts(rng: &mut ChaCha8Rng, e: usize, h: usize, f: usize) -> Vec<Expert> {
        (0..e)
            .map(|_| Expert {
                gate: randn(rng, (h, f), 0.5),
                up: randn(rng, (h, f), 0.5),
                down: randn(rng, (f, h), 0.5),
            })
            .collect()
    }

    /// The layer's routed part as a function of its input through the router:
    /// `<r, experts(x, route(x Wr))>`.
    fn layer(
        x: &Array2<f32>,
        wr: &Array2<f32>,
        ex: &[Expert],
        k: usize,
        gating: Gating,
        normalise: bool,
    ) -> (Array2<f32>, Routing) {
        let routing = route(matmul(x.view(), wr.view()).view(), k, gating, normalise);
        (experts_forward(x.view(), &routing, ex).0, routing)
    }

    #[test]
    fn top_k_takes_the_highest_scores_and_normalises() {
        let logits = ndarray::arr2(&[[0.0f32, 2.0, 1.0, 2.0], [3.0, -1.0, 0.5, 0.0]]);
        let r = route(logits.view(), 2, Gating::Softmax, true);
        // Ties go to the lower index: token 0 takes experts 1 and 3 (equal), token 1 0 and 2.
        assert_eq!(r.experts, ndarray::arr2(&[[1u32, 3], [0, 2]]));
        assert!((r.weights[[0, 0]] - 0.5).abs() < 1e-6);
        let p = |row: &[f32], i: usize| {
            let z: f32 = row.iter().map(|x| x.exp()).sum();
            row[i].exp() / z
        };
        let row1 = [3.0f32, -1.0, 0.5, 0.0];
        let (p0, p2) = (p(&row1, 0), p(&row1, 2));
        assert!((r.weights[[1, 0]] - p0 / (p0 + p2)).abs() < 1e-6);
        let s = route(logits.view(), 2, Gating::Sigmoid, false);
        assert!((s.weights[[1, 1]] - 1.0 / (1.0 + (-0.5f32).exp())).abs() < 1e-6);
        assert_eq!(r.counts(4), vec![1, 1, 1, 1]);
    }

    #[test]
    fn gradients_match_finite_differences() {
        let (t, h, f, e, k) = (6, 8, 5, 4, 2);
        for (seed, gating, normalise) in [
            (1u64, Gating::Softmax, false),
            (2, Gating::Softmax, true),
            (3, Gating::Sigmoid, true),
        ] {
            let mut rng = ChaCha8Rng::seed_from_u64(seed);
            let x = randn(&mut rng, (t, h), 1.0);
            // A router of large weights keeps the top-k choice the same under the step.
            let wr = randn(&mut rng, (h, e), 3.0);
            let ex = experts(&mut rng, e, h, f);
            let r = randn(&mut rng, (t, h), 1.0);
            let (_, routing) = layer(&x, &wr, &ex, k, gating, normalise);
            let (_, saved) = experts_forward(x.view(), &routing, &ex);
            let (dx_experts, dw, grads) = experts_dgrad(r.view(), &routing, &ex, &saved);
            let dlogits = route_backward(&routing, dw.view());
            // x feeds both the experts and the router.
            let dx = dx_experts + matmul(dlogits.view(), wr.t());
            let loss_x = |x: &Array2<f32>| {
                let (y, again) = layer(x, &wr, &ex, k, gating, normalise);
                assert_eq!(again.experts, routing.experts, "the step changed the top-k");
                proj(&y, &r)
            };
            let err = directional(&x, &dx, &loss_x, seed + 10);
            assert!(err < TOL, "{gating:?} {normalise}: x {err}");
            let dwr = matmul(x.t(), dlogits.view());
            let loss_wr = |w: &Array2<f32>| proj(&layer(&x, w, &ex, k, gating, normalise).0, &r);
            let err = directional(&wr, &dwr, &loss_wr, seed + 20);
            assert!(err < TOL, "{gating:?} {normalise}: router {err}");
            let mut d: Vec<Expert> = ex
                .iter()
                .map(|x| Expert {
                    gate: Array2::zeros(x.gate.dim()),
                    up: Array2::zeros(x.up.dim()),
                    down: Array2::zeros(x.down.dim()),
                })
                .collect();
            experts_wgrad(&saved, &grads, &mut d);
            for i in 0..e {
                let with = |which: usize, m: &Array2<f32>| {
                    let mut w = ex.clone();
                    match which {
                        0 => w[i].gate = m.clone(),
                        1 => w[i].up = m.clone(),
                        _ => w[i].down = m.clone(),
                    }
                    proj(&experts_forward(x.view(), &routing, &w).0, &r)
                };
                for (which, (m, g)) in [
                    (&ex[i].gate, &d[i].gate),
                    (&ex[i].up, &d[i].up),
                    (&ex[i].down, &d[i].down),
                ]
                .into_iter()
                .enumerate()
                {
                    let err = directional(m, g, &|w| with(which, w), seed + 30 + i as u64);
                    assert!(err < TOL, "{gating:?} expert {i} weight {which}: {err}");
                }
            }
        }
    }

    #[test]
    fn identical_tokens_all_go_to_the_same_experts() {
        // The seed's point: identical (padding) embeddings choose identical top-k experts.
        let mut rng = ChaCha8Rng::seed_from_u64(5);
        let wr = randn(&mut rng, (8, 16), 1.0);
        let mut x = randn(&mut rng, (20, 8), 1.0);
        for t in 4..20 {
            let first = x.row(4).to_owned();
            x.row_mut(t).assign(&first);
        }
        let r = route(matmul(x.view(), wr.view()).view(), 2, Gating::Softmax, true);
        // 16 identical tokens of 20 on 2 of 16 experts: those two hold at least 16 each.
        let counts = r.counts(16);
        let mut sorted = counts.clone();
        sorted.sort_unstable_by(|a, b| b.cmp(a));
        assert!(sorted[0] >= 16 && sorted[1] >= 16, "{counts:?}");
        // The busiest expert over the mean of 40 copies on 16 experts: at least 6.4.
        let mean = r.experts.len() as f64 / 16.0;
        assert!(sorted[0] as f64 / mean >= 16.0 / (40.0 / 16.0));
    }
}
