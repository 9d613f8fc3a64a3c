//! CPU kernels of a Llama-style decoder over flat `[T]` tokens with `cu_seqlens`, fp32.
//!
//! Every tensor is row-major `[T, X]` (`T` tokens of the microbatch, no padding). Matrix
//! multiplies go through [`ndarray::linalg::general_mat_mul`], which runs `matrixmultiply`'s
//! single-threaded packed GEMM (no hand-written matmul). Each forward has a backward that
//! returns the gradient with respect to its inputs; gradients with respect to weights are
//! separate functions so that dgrad (I) and wgrad (W) can run at different times. All
//! backwards are checked against central finite differences in this module's tests.
//!
//! Conventions follow Llama 3 (Dubey et al. 2024) as implemented in torchtitan: RMSNorm with
//! `eps = 1e-5`, rotary embeddings with `theta = 500000` on the rotate-half layout, positions
//! restarting at 0 in every sequence, grouped-query attention (query head `h` reads key/value
//! head `h / (heads / kv_heads)`), SwiGLU MLP `W2 (silu(x W1) * (x W3))`.

use ndarray::linalg::general_mat_mul;
use ndarray::{Array1, Array2, ArrayView1, ArrayView2, ArrayViewMut2, Axis, Slice};
use std::ops::Range;

/// The block `rows x cols` of `x` (ndarray's `s![]` macro expands to unsafe code, which this
/// workspace forbids).
fn block(x: ArrayView2<'_, f32>, rows: Range<usize>, cols: Range<usize>) -> ArrayView2<'_, f32> {
    let mut v = x;
    v.slice_axis_inplace(Axis(0), Slice::from(rows));
    v.slice_axis_inplace(Axis(1), Slice::from(cols));
    v
}

/// The mutable block `rows x cols` of `x`.
fn block_mut(
    x: &mut Array2<f32>,
    rows: Range<usize>,
    cols: Range<usize>,
) -> ArrayViewMut2<'_, f32> {
    let mut v = x.view_mut();
    v.slice_axis_inplace(Axis(0), Slice::from(rows));
    v.slice_axis_inplace(Axis(1), Slice::from(cols));
    v
}

/// RMSNorm epsilon (Llama 3).
pub const RMS_EPS: f32 = 1e-5;
/// Rotary base (Llama 3).
pub const ROPE_THETA: f32 = 500_000.0;

/// `a [m, k] @ b [k, n]` -> `[m, n]`.
pub fn matmul(a: ArrayView2<f32>, b: ArrayView2<f32>) -> Array2<f32> {
    let mut c = Array2::zeros((a.nrows(), b.ncols()));
    general_mat_mul(1.0, &a, &b, 0.0, &mut c);
    c
}

/// `c += a @ b` (shapes `[m, k] @ [k, n]` into `[m, n]`).
pub fn matmul_acc(c: &mut ArrayViewMut2<f32>, a: ArrayView2<f32>, b: ArrayView2<f32>) {
    general_mat_mul(1.0, &a, &b, 1.0, c);
}

/// RMSNorm forward: `y = x * rstd * g`, `rstd = 1 / sqrt(mean(x²) + eps)` per row.
/// `x [T, H]`, `g [H]`. Returns `(y [T, H], xhat = x * rstd [T, H], rstd [T])`.
pub fn rmsnorm(x: ArrayView2<f32>, g: ArrayView1<f32>) -> (Array2<f32>, Array2<f32>, Array1<f32>) {
    let h = x.ncols() as f32;
    let mut xhat = x.to_owned();
    let mut rstd = Array1::zeros(x.nrows());
    for (mut row, r) in xhat.rows_mut().into_iter().zip(rstd.iter_mut()) {
        let ms = row.iter().map(|v| v * v).sum::<f32>() / h;
        *r = 1.0 / (ms + RMS_EPS).sqrt();
        row.mapv_inplace(|v| v * *r);
    }
    let y = &xhat * &g;
    (y, xhat, rstd)
}

/// RMSNorm dgrad: `dx = rstd * (dy*g - xhat * mean(dy*g*xhat))` per row.
pub fn rmsnorm_dx(
    dy: ArrayView2<f32>,
    xhat: ArrayView2<f32>,
    rstd: ArrayView1<f32>,
    g: ArrayView1<f32>,
) -> Array2<f32> {
    let h = dy.ncols() as f32;
    let mut dx = &dy * &g;
    for ((mut row, xh), r) in dx.rows_mut().into_iter().zip(xhat.rows()).zip(rstd.iter()) {
        let dot = row.iter().zip(xh.iter()).map(|(a, b)| a * b).sum::<f32>() / h;
        row.zip_mut_with(&xh, |d, &xv| *d = r * (*d - xv * dot));
    }
    dx
}

/// RMSNorm wgrad: `dg += Σ_t dy * xhat`.
pub fn rmsnorm_dg(dg: &mut Array1<f32>, dy: ArrayView2<f32>, xhat: ArrayView2<f32>) {
    for (d, x) in dy.rows().into_iter().zip(xhat.rows()) {
        for ((acc, &dv), &xv) in dg.iter_mut().zip(d.iter()).zip(x.iter()) {
            *acc += dv * xv;
        }
    }
}

/// Rotary embedding in place on `x [T, heads * d]`, rotate-half layout: for each head and
/// `i < d/2`, `(x_i, x_{i+d/2})` is rotated by `pos * theta^(-2i/d)`, where `pos` restarts at 0 in
/// every sequence of `cu_seqlens`. `inverse` rotates back (the backward of a rotation is its
/// transpose).
///
/// `offset` shifts every position (a chunk of a longer sequence starts at its offset in the
/// sequence, [`flatpipe_simulator::batching::microbatch::Chunk`]); 0 otherwise.
pub fn rope(
    x: &mut ArrayViewMut2<f32>,
    cu_seqlens: &[usize],
    head_dim: usize,
    inverse: bool,
    offset: usize,
) {
    let half = head_dim / 2;
    let heads = x.ncols() / head_dim;
    let freqs: Vec<f32> = (0..half)
        .map(|i| ROPE_THETA.powf(-2.0 * i as f32 / head_dim as f32))
        .collect();
    let sign = if inverse { -1.0 } else { 1.0 };
    for w in cu_seqlens.windows(2) {
        for (pos, t) in (w[0]..w[1]).enumerate() {
            let pos = pos + offset;
            let mut row = x.row_mut(t);
            for (i, f) in freqs.iter().enumerate() {
                let (sin, cos) = (pos as f32 * f).sin_cos();
                let sin = sign * sin;
                for h in 0..heads {
                    let a = h * head_dim + i;
                    let b = a + half;
                    let (x1, x2) = (row[a], row[b]);
                    row[a] = x1 * cos - x2 * sin;
                    row[b] = x1 * sin + x2 * cos;
                }
            }
        }
    }
}

/// Sizes of grouped-query attention.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttnDims {
    /// Query heads.
    pub heads: usize,
    /// Key/value heads (divides `heads`).
    pub kv_heads: usize,
    /// Head dimension `d`.
    pub head_dim: usize,
}

impl AttnDims {
    fn kv_of(&self, h: usize) -> usize {
        h / (self.heads / self.kv_heads)
    }
    fn scale(&self) -> f32 {
        1.0 / (self.head_dim as f32).sqrt()
    }
}

/// Query rows per attention block: each block of a sequence attends only to the keys up to its
/// last row, so the work follows the causal pairs `Σ s(s+1)/2` (plus half a block per row)
/// rather than `s²`, and a block's scores `[64, keys]` stay in cache.
pub const ATTN_BLOCK: usize = 64;

/// Causal softmax probabilities of one query block `q [rows, d]` whose first row is position
/// `row0` of its sequence, against keys `k [row0 + rows, d]`: `P = softmax(Q K^T * scale)` with
/// `P[i, j] = 0` for `j > row0 + i`. Uses the rows' log-sum-exps when `lse` is given (the
/// backward), else computes and returns them.
fn probs(
    q: ArrayView2<f32>,
    k: ArrayView2<f32>,
    row0: usize,
    scale: f32,
    lse: Option<&[f32]>,
) -> (Array2<f32>, Vec<f32>) {
    let mut p = matmul(q, k.t());
    let mut out_lse = Vec::with_capacity(p.nrows());
    for (i, mut row) in p.rows_mut().into_iter().enumerate() {
        let last = row0 + i;
        let l = match lse {
            Some(l) => l[i],
            None => {
                let m = row
                    .iter()
                    .take(last + 1)
                    .fold(f32::NEG_INFINITY, |a, &b| a.max(b * scale));
                let sum: f32 = row
                    .iter()
                    .take(last + 1)
                    .map(|&v| (v * scale - m).exp())
                    .sum();
                m + sum.ln()
            }
        };
        out_lse.push(l);
        for (j, v) in row.iter_mut().enumerate() {
            *v = if j <= last {
                (*v * scale - l).exp()
            } else {
                0.0
            };
        }
    }
    (p, out_lse)
}

/// The query blocks of a sequence `[a, b)`: `(first token, end token, position of the first)`.
fn blocks(a: usize, b: usize) -> impl Iterator<Item = (usize, usize, usize)> {
    (a..b)
        .step_by(ATTN_BLOCK)
        .map(move |q0| (q0, (q0 + ATTN_BLOCK).min(b), q0 - a))
}

/// Varlen causal attention forward (FlashAttention's interface, computed per sequence, head and
/// query block with GEMMs): `q [T, heads*d]`, `k, v [T, kv_heads*d]` ->
/// `(o [T, heads*d], lse [T, heads])`. No query attends across a `cu_seqlens` boundary or to a
/// later position.
///
/// With `prefix > 0` the microbatch is one chunk of a longer sequence (`cu_seqlens = [0, T]`):
/// `k, v` are `[prefix + T, kv_heads*d]`, the earlier chunks' keys and values then the chunk's
/// own, and query row `i` (position `prefix + i`) attends to key rows `0..=prefix + i`: the
/// `T (T + 1) / 2 + T prefix` pairs of [`flatpipe_simulator::Microbatch::attn_pairs`].
pub fn attention(
    q: ArrayView2<f32>,
    k: ArrayView2<f32>,
    v: ArrayView2<f32>,
    cu_seqlens: &[usize],
    dims: AttnDims,
    prefix: usize,
) -> (Array2<f32>, Array2<f32>) {
    debug_assert!(prefix == 0 || cu_seqlens.len() == 2);
    debug_assert_eq!(k.nrows(), q.nrows() + prefix);
    let d = dims.head_dim;
    let mut o = Array2::zeros(q.raw_dim());
    let mut lse = Array2::zeros((q.nrows(), dims.heads));
    for w in cu_seqlens.windows(2) {
        let (a, b) = (w[0], w[1]);
        for h in 0..dims.heads {
            let g = dims.kv_of(h);
            for (q0, q1, row0) in blocks(a, b) {
                let qh = block(q, q0..q1, h * d..(h + 1) * d);
                let kh = block(k, a..q1 + prefix, g * d..(g + 1) * d);
                let vh = block(v, a..q1 + prefix, g * d..(g + 1) * d);
                let (p, l) = probs(qh, kh, row0 + prefix, dims.scale(), None);
                let mut oh = block_mut(&mut o, q0..q1, h * d..(h + 1) * d);
                general_mat_mul(1.0, &p, &vh, 0.0, &mut oh);
                for (i, x) in l.into_iter().enumerate() {
                    lse[[q0 + i, h]] = x;
                }
            }
        }
    }
    (o, lse)
}

/// Varlen causal attention backward: from `do [T, heads*d]` and the forward's `q, k, v, o, lse`,
/// returns `(dq [T, heads*d], dk [T, kv_heads*d], dv [T, kv_heads*d])` (FlashAttention-2's
/// backward, Dao 2023: `dS = P ∘ (dP - rowsum(dO ∘ O))`), per query block like the forward.
#[allow(clippy::too_many_arguments)]
pub fn attention_backward(
    dout: ArrayView2<f32>,
    q: ArrayView2<f32>,
    k: ArrayView2<f32>,
    v: ArrayView2<f32>,
    o: ArrayView2<f32>,
    lse: ArrayView2<f32>,
    cu_seqlens: &[usize],
    dims: AttnDims,
    prefix: usize,
) -> (Array2<f32>, Array2<f32>, Array2<f32>) {
    let d = dims.head_dim;
    let scale = dims.scale();
    let mut dq = Array2::zeros(q.raw_dim());
    let mut dk = Array2::zeros(k.raw_dim());
    let mut dv = Array2::zeros(v.raw_dim());
    for w in cu_seqlens.windows(2) {
        let (a, b) = (w[0], w[1]);
        for h in 0..dims.heads {
            let g = dims.kv_of(h);
            let (cols, kv_cols) = (h * d..(h + 1) * d, g * d..(g + 1) * d);
            for (q0, q1, row0) in blocks(a, b) {
                let row0 = row0 + prefix;
                let keys = a..q1 + prefix;
                let qh = block(q, q0..q1, cols.clone());
                let kh = block(k, keys.clone(), kv_cols.clone());
                let vh = block(v, keys.clone(), kv_cols.clone());
                let doh = block(dout, q0..q1, cols.clone());
                let oh = block(o, q0..q1, cols.clone());
                let l: Vec<f32> = (q0..q1).map(|t| lse[[t, h]]).collect();
                let (p, _) = probs(qh, kh, row0, scale, Some(&l));
                // dV += P^T dO
                matmul_acc(
                    &mut block_mut(&mut dv, keys.clone(), kv_cols.clone()),
                    p.t(),
                    doh,
                );
                // dP = dO V^T; dS = P ∘ (dP - D), D_i = Σ_j dO_ij O_ij
                let mut ds = matmul(doh, vh.t());
                for (i, mut row) in ds.rows_mut().into_iter().enumerate() {
                    let di: f32 = doh.row(i).iter().zip(oh.row(i)).map(|(x, y)| x * y).sum();
                    for (j, x) in row.iter_mut().enumerate() {
                        *x = p[[i, j]] * (*x - di) * scale;
                    }
                }
                // dQ = dS K, dK += dS^T Q (scale folded into dS)
                matmul_acc(&mut block_mut(&mut dq, q0..q1, cols.clone()), ds.view(), kh);
                matmul_acc(&mut block_mut(&mut dk, keys, kv_cols.clone()), ds.t(), qh);
            }
        }
    }
    (dq, dk, dv)
}

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// SwiGLU activation: `silu(gate) * up` elementwise, `[T, F]`.
pub fn swiglu(gate: ArrayView2<f32>, up: ArrayView2<f32>) -> Array2<f32> {
    let mut out = gate.to_owned();
    out.zip_mut_with(&up, |g, &u| *g = *g * sigmoid(*g) * u);
    out
}

/// SwiGLU backward: from `d [T, F]` returns `(dgate, dup)`;
/// `dgate = d * up * σ(g)(1 + g(1 - σ(g)))`, `dup = d * silu(g)`.
pub fn swiglu_backward(
    d: ArrayView2<f32>,
    gate: ArrayView2<f32>,
    up: ArrayView2<f32>,
) -> (Array2<f32>, Array2<f32>) {
    let mut dg = d.to_owned();
    let mut du = d.to_owned();
    ndarray::Zip::from(&mut dg)
        .and(&mut du)
        .and(gate)
        .and(up)
        .for_each(|dg, du, &g, &u| {
            let sg = sigmoid(g);
            *du *= g * sg;
            *dg *= u * sg * (1.0 + g * (1.0 - sg));
        });
    (dg, du)
}

/// Cross-entropy of `logits [T, V]` against `labels [T]`, weighted per token: returns
/// `(Σ_t w_t loss_t, Σ_t loss_t, lse [T])` with `loss_t = lse_t - logits[t, label_t]`, summed in f64.
pub fn cross_entropy(
    logits: ArrayView2<f32>,
    labels: &[u32],
    weights: &[f32],
) -> (f64, f64, Array1<f32>) {
    let mut lse = Array1::zeros(logits.nrows());
    let (mut weighted, mut plain) = (0.0f64, 0.0f64);
    for (t, row) in logits.rows().into_iter().enumerate() {
        let m = row.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
        let l = m + row.iter().map(|&x| (x - m).exp()).sum::<f32>().ln();
        lse[t] = l;
        let loss = (l - row[labels[t] as usize]) as f64;
        plain += loss;
        weighted += weights[t] as f64 * loss;
    }
    (weighted, plain, lse)
}

/// Cross-entropy dgrad with respect to the logits: `w_t (softmax_t - onehot(label_t))`, in place
/// on a copy of the logits.
pub fn cross_entropy_backward(
    logits: ArrayView2<f32>,
    lse: ArrayView1<f32>,
    labels: &[u32],
    weights: &[f32],
) -> Array2<f32> {
    let mut d = logits.to_owned();
    for (t, mut row) in d.rows_mut().into_iter().enumerate() {
        let (l, w) = (lse[t], weights[t]);
        row.mapv_inplace(|x| w * (x - l).exp());
        row[labels[t] as usize] -= w;
    }
    d
}

/// Embedding lookup: rows `ids` of `table [V, H]` -> `[T, H]`.
pub fn embedding(table: ArrayView2<f32>, ids: &[u32]) -> Array2<f32> {
    table.select(
        Axis(0),
        &ids.iter().map(|&i| i as usize).collect::<Vec<_>>(),
    )
}

/// Embedding wgrad: `dtable[ids[t]] += dy[t]`.
pub fn embedding_backward(dtable: &mut Array2<f32>, dy: ArrayView2<f32>, ids: &[u32]) {
    for (t, &id) in ids.iter().enumerate() {
        let mut row = dtable.row_mut(id as usize);
        row += &dy.row(t);
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use rand::{RngExt, SeedableRng, rngs::ChaCha8Rng};

    pub(crate) fn randn(rng: &mut ChaCha8Rng, shape: (usize, usize), scale: f32) -> Array2<f32> {
        Array2::from_shape_fn(shape, |_| (rng.random::<f32>() * 2.0 - 1.0) * scale)
    }

    /// Checks `<grad, u> ≈ (L(x + eps u) - L(x - eps u)) / 2 eps` for a random direction u,
    /// with `L(x) = <r, f(x)>` for a fixed random projection r. Returns the relative error.
    pub(crate) fn directional(
        x: &Array2<f32>,
        grad: &Array2<f32>,
        loss: &dyn Fn(&Array2<f32>) -> f64,
        seed: u64,
    ) -> f64 {
        directional_eps(x, grad, loss, seed, 1e-2)
    }

    /// [`directional`] with step `eps` (larger for parameters whose effect is small next to
    /// the output's magnitude, where f32 rounding of the output dominates a small step).
    pub(crate) fn directional_eps(
        x: &Array2<f32>,
        grad: &Array2<f32>,
        loss: &dyn Fn(&Array2<f32>) -> f64,
        seed: u64,
        eps: f32,
    ) -> f64 {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let u = randn(&mut rng, x.dim(), 1.0);
        let lp = loss(&(x + &(&u * eps)));
        let lm = loss(&(x - &(&u * eps)));
        let fd = (lp - lm) / (2.0 * eps as f64);
        let an: f64 = grad
            .iter()
            .zip(u.iter())
            .map(|(g, u)| (*g * *u) as f64)
            .sum();
        (fd - an).abs() / fd.abs().max(an.abs()).max(1e-3)
    }

    fn proj(y: &Array2<f32>, r: &Array2<f32>) -> f64 {
        y.iter()
            .zip(r.iter())
            .map(|(a, b)| (*a as f64) * (*b as f64))
            .sum()
    }

    const TOL: f64 = 2e-3;

    #[test]
    fn rmsnorm_gradients_match_finite_differences() {
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        let x = randn(&mut rng, (5, 16), 1.0);
        let g = randn(&mut rng, (1, 16), 1.0).row(0).to_owned();
        let r = randn(&mut rng, (5, 16), 1.0);
        let (_, xhat, rstd) = rmsnorm(x.view(), g.view());
        let dx = rmsnorm_dx(r.view(), xhat.view(), rstd.view(), g.view());
        let e = directional(&x, &dx, &|x| proj(&rmsnorm(x.view(), g.view()).0, &r), 2);
        assert!(e < TOL, "dx rel err {e}");
        let mut dg = Array1::zeros(16);
        rmsnorm_dg(&mut dg, r.view(), xhat.view());
        let g2 = g.clone().insert_axis(Axis(0));
        let dg2 = dg.insert_axis(Axis(0));
        let e = directional(&g2, &dg2, &|g| proj(&rmsnorm(x.view(), g.row(0)).0, &r), 3);
        assert!(e < TOL, "dg rel err {e}");
    }

    #[test]
    fn rope_is_a_rotation_restarting_per_sequence() {
        let mut rng = ChaCha8Rng::seed_from_u64(4);
        let x = randn(&mut rng, (7, 16), 1.0);
        let cu = [0, 3, 7];
        let mut y = x.clone();
        rope(&mut y.view_mut(), &cu, 8, false, 0);
        // Position 0 of each sequence is unrotated; norms are preserved.
        assert_eq!(y.row(0), x.row(0));
        assert_eq!(y.row(3), x.row(3));
        for (a, b) in x.rows().into_iter().zip(y.rows()) {
            let (na, nb) = (a.dot(&a), b.dot(&b));
            assert!((na - nb).abs() < 1e-4 * na, "{na} {nb}");
        }
        // Same relative position, same rotation: row 1 and row 4 rotate by pos 1.
        let mut one = block(x.view(), 1..2, 0..16).to_owned();
        rope(&mut one.view_mut(), &[0, 1], 8, false, 0);
        assert_ne!(
            one.row(0),
            y.row(1),
            "pos 0 of a one-token sequence is unrotated"
        );
        // The inverse undoes it (the backward of the rotation).
        rope(&mut y.view_mut(), &cu, 8, true, 0);
        for (a, b) in x.iter().zip(y.iter()) {
            assert!((a - b).abs() < 1e-5);
        }
    }

    #[test]
    fn attention_gradients_match_finite_differences() {
        let mut rng = ChaCha8Rng::seed_from_u64(5);
        let dims = AttnDims {
            heads: 4,
            kv_heads: 2,
            head_dim: 4,
        };
        let cu = [0usize, 3, 8, 9];
        let q = randn(&mut rng, (9, 16), 1.0);
        let k = randn(&mut rng, (9, 8), 1.0);
        let v = randn(&mut rng, (9, 8), 1.0);
        check_attention_gradients(&q, &k, &v, &cu, dims, 6);
    }

    /// dq, dk and dv of `attention_backward` against finite differences of `<r, attention>` for
    /// a random projection r.
    fn check_attention_gradients(
        q: &Array2<f32>,
        k: &Array2<f32>,
        v: &Array2<f32>,
        cu: &[usize],
        dims: AttnDims,
        seed: u64,
    ) {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let r = randn(&mut rng, q.dim(), 1.0);
        let (o, lse) = attention(q.view(), k.view(), v.view(), cu, dims, 0);
        let (dq, dk, dv) = attention_backward(
            r.view(),
            q.view(),
            k.view(),
            v.view(),
            o.view(),
            lse.view(),
            cu,
            dims,
            0,
        );
        let f = |q: &Array2<f32>, k: &Array2<f32>, v: &Array2<f32>| {
            proj(&attention(q.view(), k.view(), v.view(), cu, dims, 0).0, &r)
        };
        assert!(directional(q, &dq, &|x| f(x, k, v), seed + 1) < TOL, "dq");
        assert!(directional(k, &dk, &|x| f(q, x, v), seed + 2) < TOL, "dk");
        assert!(directional(v, &dv, &|x| f(q, k, x), seed + 3) < TOL, "dv");
    }

    /// Causal attention computed directly in f64 from its definition.
    fn naive_attention(
        q: &Array2<f32>,
        k: &Array2<f32>,
        v: &Array2<f32>,
        cu: &[usize],
        dims: AttnDims,
    ) -> Array2<f64> {
        let d = dims.head_dim;
        let mut o = Array2::<f64>::zeros(q.raw_dim());
        for w in cu.windows(2) {
            for h in 0..dims.heads {
                let g = dims.kv_of(h);
                for i in w[0]..w[1] {
                    let scores: Vec<f64> = (w[0]..=i)
                        .map(|j| {
                            (0..d)
                                .map(|c| q[[i, h * d + c]] as f64 * k[[j, g * d + c]] as f64)
                                .sum::<f64>()
                                / (d as f64).sqrt()
                        })
                        .collect();
                    let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let z: f64 = scores.iter().map(|x| (x - m).exp()).sum();
                    for (jj, sc) in scores.iter().enumerate() {
                        let p = (sc - m).exp() / z;
                        for c in 0..d {
                            o[[i, h * d + c]] += p * v[[w[0] + jj, g * d + c]] as f64;
                        }
                    }
                }
            }
        }
        o
    }

    /// A chunk (queries at positions 70..150 of one 150-token sequence, keys and values of all
    /// 150) computes exactly the unsplit attention's rows 70..150, forward and backward (with an
    /// output gradient on those rows only, the unsplit backward's dq rows and its whole dk, dv).
    #[test]
    fn chunked_attention_is_the_unsplit_attention_restricted_to_its_rows() {
        let mut rng = ChaCha8Rng::seed_from_u64(31);
        let dims = AttnDims {
            heads: 2,
            kv_heads: 1,
            head_dim: 4,
        };
        let (t, o0) = (150usize, 70usize);
        let q = randn(&mut rng, (t, 8), 1.0);
        let k = randn(&mut rng, (t, 4), 1.0);
        let v = randn(&mut rng, (t, 4), 1.0);
        let (o, lse) = attention(q.view(), k.view(), v.view(), &[0, t], dims, 0);
        let qc = q.slice(ndarray::s![o0.., ..]).to_owned();
        let (oc, lsec) = attention(qc.view(), k.view(), v.view(), &[0, t - o0], dims, o0);
        let close = |a: ArrayView2<f32>, b: ArrayView2<f32>| {
            a.iter().zip(b.iter()).all(|(x, y)| (x - y).abs() <= 1e-5)
        };
        assert!(close(oc.view(), o.slice(ndarray::s![o0.., ..])));
        assert!(close(lsec.view(), lse.slice(ndarray::s![o0.., ..])));
        let mut dout = randn(&mut rng, (t, 8), 1.0);
        dout.slice_mut(ndarray::s![..o0, ..]).fill(0.0);
        let (dq, dk, dv) = attention_backward(
            dout.view(),
            q.view(),
            k.view(),
            v.view(),
            o.view(),
            lse.view(),
            &[0, t],
            dims,
            0,
        );
        let doc = dout.slice(ndarray::s![o0.., ..]).to_owned();
        let (dqc, dkc, dvc) = attention_backward(
            doc.view(),
            qc.view(),
            k.view(),
            v.view(),
            oc.view(),
            lsec.view(),
            &[0, t - o0],
            dims,
            o0,
        );
        assert!(close(dqc.view(), dq.slice(ndarray::s![o0.., ..])));
        assert!(close(dkc.view(), dk.view()));
        assert!(close(dvc.view(), dv.view()));
        // Rotary at an offset is the unsplit rotary's rows.
        let mut whole = q.clone();
        rope(&mut whole.view_mut(), &[0, t], 4, false, 0);
        let mut part = qc.clone();
        rope(&mut part.view_mut(), &[0, t - o0], 4, false, o0);
        assert!(close(part.view(), whole.slice(ndarray::s![o0.., ..])));
    }

    #[test]
    fn blocked_attention_equals_the_definition_across_blocks() {
        let mut rng = ChaCha8Rng::seed_from_u64(21);
        let dims = AttnDims {
            heads: 2,
            kv_heads: 1,
            head_dim: 4,
        };
        // Sequences longer than a block (64), one exactly a block, one short.
        let cu = [0usize, 150, 214, 217];
        let q = randn(&mut rng, (217, 8), 1.0);
        let k = randn(&mut rng, (217, 4), 1.0);
        let v = randn(&mut rng, (217, 4), 1.0);
        let (o, _) = attention(q.view(), k.view(), v.view(), &cu, dims, 0);
        let want = naive_attention(&q, &k, &v, &cu, dims);
        for (a, b) in o.iter().zip(want.iter()) {
            assert!((*a as f64 - b).abs() < 1e-5, "{a} vs {b}");
        }
        // And its gradients across blocks.
        check_attention_gradients(&q, &k, &v, &cu, dims, 22);
    }

    #[test]
    fn attention_is_causal_and_stays_inside_its_sequence() {
        let mut rng = ChaCha8Rng::seed_from_u64(9);
        let dims = AttnDims {
            heads: 2,
            kv_heads: 1,
            head_dim: 4,
        };
        let q = randn(&mut rng, (6, 8), 1.0);
        let k = randn(&mut rng, (6, 4), 1.0);
        let mut v = randn(&mut rng, (6, 4), 1.0);
        let (o1, _) = attention(q.view(), k.view(), v.view(), &[0, 2, 6], dims, 0);
        // Changing token 3's value changes nothing before it nor the first sequence.
        v.row_mut(3).fill(7.0);
        let (o2, _) = attention(q.view(), k.view(), v.view(), &[0, 2, 6], dims, 0);
        for t in [0, 1, 2] {
            assert_eq!(o1.row(t), o2.row(t), "token {t}");
        }
        assert_ne!(o1.row(3), o2.row(3));
        // Token 0 of a sequence attends only to itself: its output is its value.
        let (o, _) = attention(q.view(), k.view(), v.view(), &[0, 2, 6], dims, 0);
        for c in 0..4 {
            assert!((o[[2, c]] - v[[2, c]]).abs() < 1e-6);
        }
    }

    #[test]
    fn swiglu_gradients_match_finite_differences() {
        let mut rng = ChaCha8Rng::seed_from_u64(10);
        let g = randn(&mut rng, (4, 6), 2.0);
        let u = randn(&mut rng, (4, 6), 2.0);
        let r = randn(&mut rng, (4, 6), 1.0);
        let (dg, du) = swiglu_backward(r.view(), g.view(), u.view());
        assert!(directional(&g, &dg, &|x| proj(&swiglu(x.view(), u.view()), &r), 11) < TOL);
        assert!(directional(&u, &du, &|x| proj(&swiglu(g.view(), x.view()), &r), 12) < TOL);
    }

    #[test]
    fn cross_entropy_gradient_and_value() {
        let mut rng = ChaCha8Rng::seed_from_u64(13);
        let logits = randn(&mut rng, (5, 11), 3.0);
        let labels = [0u32, 3, 10, 5, 5];
        let w = [0.1f32, 0.2, 0.3, 0.4, 0.5];
        let (_, plain, lse) = cross_entropy(logits.view(), &labels, &[1.0; 5]);
        // Reference: -log softmax computed directly in f64.
        let direct: f64 = (0..5)
            .map(|t| {
                let row = logits.row(t);
                let z: f64 = row.iter().map(|&x| (x as f64).exp()).sum();
                -((row[labels[t] as usize] as f64).exp() / z).ln()
            })
            .sum();
        assert!((plain - direct).abs() < 1e-4 * direct, "{plain} {direct}");
        let d = cross_entropy_backward(logits.view(), lse.view(), &labels, &w);
        let e = directional(&logits, &d, &|x| cross_entropy(x.view(), &labels, &w).0, 14);
        assert!(e < TOL, "{e}");
    }

    #[test]
    fn embedding_backward_scatters() {
        let table = Array2::from_shape_fn((4, 2), |(i, j)| (i * 2 + j) as f32);
        let y = embedding(table.view(), &[3, 0, 3]);
        assert_eq!(y.row(0).to_vec(), vec![6.0, 7.0]);
        let mut d = Array2::zeros((4, 2));
        embedding_backward(&mut d, Array2::ones((3, 2)).view(), &[3, 0, 3]);
        assert_eq!(d.row(3).to_vec(), vec![2.0, 2.0]);
        assert_eq!(d.row(0).to_vec(), vec![1.0, 1.0]);
        assert_eq!(d.row(1).to_vec(), vec![0.0, 0.0]);
    }
}
