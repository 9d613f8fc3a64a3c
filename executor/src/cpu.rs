//! The CPU backend: the model ([`crate::model`]) over fp32 `ndarray` tensors, with the kernels
//! of [`crate::kernels`] (GEMMs by `matrixmultiply`), one thread per rank.
//!
//! A [`CpuStage`] is built from its layer range `[start, end)` of the model's expanded layer list
//! (0 = embedding, then decoders, the last = final norm + LM head + cross-entropy); nothing
//! builds the whole model and removes parts. Parameters are initialised from `(seed, layer
//! index)`, so any split of the model holds exactly the same weights as a single-rank run.
//!
//! Linear weights are stored `[in, out]` (`y = x W`); torchtitan stores `[out, in]`. Names follow
//! torchtitan's Llama (`layers.N.attention.wq.weight`, `layers.N.feed_forward.w1.weight`, ...).

use crate::kernels::{self as k, AttnDims};
use crate::model::experts::ExpertShard;
use crate::model::layers::build_layers;
use crate::model::{OpSet, ParamInit, Stage};
use crate::worker::{AdamW, LossSums};
use crate::{Error, MicrobatchData, Result};
use flatpipe_profiles::{LayerKind, ModelSpec};
use flatpipe_simulator::costs::Recompute;
use ndarray::{Array2, Axis};
use rand_distr::{Distribution, Normal};
use std::ops::Range;

/// The CPU op set: `ndarray` tensors `[rows, cols]` in host memory, the kernels of
/// [`crate::kernels`] (single-threaded: a rank is a thread). Per-row vectors (`rstd`, the head's
/// log-sum-exp) are `[T, 1]`.
#[derive(Debug, Clone, Copy, Default)]
pub struct CpuOps;

/// One pipeline stage of the CPU backend: layers `[start, end)` of a model.
pub type CpuStage = Stage<CpuOps>;

impl CpuStage {
    /// Builds layers `range` of `model` with weights from `seed` (normal, std 0.02 for linear
    /// weights, 1 for the embedding table; norm weights 1), recomputing per `recompute`:
    /// selective recomputation applies to decoder layers
    /// ([`crate::model::OpSet::scale_rows`] and the attention again in I); the embedding and the
    /// head keep everything, as the simulator's cost model has it.
    ///
    /// # Errors
    /// [`crate::Error::Invalid`] for an empty or out-of-range layer range;
    /// [`crate::Error::Unsupported`] for a layer shape the kernels cannot run.
    pub fn new(
        model: &ModelSpec,
        range: Range<usize>,
        seed: u64,
        recompute: Recompute,
    ) -> Result<Self> {
        Self::sharded(model, range, seed, recompute, ExpertShard::ALL)
    }

    /// [`CpuStage::new`] holding only `shard`'s routed experts of each mixture-of-experts
    /// layer (its expert-parallel group's exchange is attached with [`Stage::with_link`]).
    ///
    /// # Errors
    /// [`CpuStage::new`]'s; [`crate::Error::Unsupported`] for recomputation of a stage with a
    /// mixture-of-experts layer; [`crate::Error::Invalid`] when `shard.ep` does not divide a
    /// layer's experts.
    pub fn sharded(
        model: &ModelSpec,
        range: Range<usize>,
        seed: u64,
        recompute: Recompute,
        shard: ExpertShard,
    ) -> Result<Self> {
        let ops = CpuOps;
        let layers = build_layers(
            &ops,
            model,
            range.clone(),
            seed,
            shard,
            &mut |_, shape, init, rng| {
                Ok(match init {
                    ParamInit::Ones => Array2::ones(shape),
                    ParamInit::Normal(std) => {
                        let d = Normal::new(0.0f32, std)
                            .map_err(|e| crate::Error::Invalid(format!("normal std {std}: {e}")))?;
                        Array2::from_shape_fn(shape, |_| d.sample(rng))
                    }
                })
            },
        )?;
        let hidden = model.layers()[range.start].hidden as usize;
        let stage = Stage::from_layers(ops, layers, hidden, recompute);
        if stage.has_moe() && recompute != Recompute::None {
            return Err(crate::Error::Unsupported(format!(
                "recomputation {recompute:?} of layers [{}, {}): a mixture-of-experts layer's forward exchanges tokens with its expert-parallel group, and the executor does not rerun that exchange in the backward; run it without recomputation",
                range.start, range.end
            )));
        }
        Ok(stage)
    }
}

/// `[t]` as `[t, 1]` (no copy).
fn column(v: ndarray::Array1<f32>) -> Array2<f32> {
    v.insert_axis(Axis(1))
}

/// The earlier chunks' key rows before a chunk's own (`k` has `prefix + T` rows): its offset
/// in its sequence, 0 for a microbatch that is not a chunk.
fn prefix_rows(q: &Array2<f32>, k: &Array2<f32>, data: &MicrobatchData) -> Result<usize> {
    let prefix = data.chunk.map_or(0, |c| c.offset as usize);
    if k.nrows() != q.nrows() + prefix || (prefix > 0 && data.cu_seqlens.len() != 2) {
        return Err(Error::Invalid(format!(
            "attention of a chunk at offset {prefix}: {} query rows, {} key rows, {} sequences (keys must be the {prefix} earlier rows then the chunk's own, of one sequence)",
            q.nrows(),
            k.nrows(),
            data.cu_seqlens.len().saturating_sub(1)
        )));
    }
    Ok(prefix)
}

impl OpSet for CpuOps {
    type Tensor = Array2<f32>;
    type Hidden = Array2<f32>;
    type Data = MicrobatchData;
    type Loss = LossSums;
    const DEFERRED_LOSS: bool = false;

    fn upload_data(&self, d: &MicrobatchData) -> Result<MicrobatchData> {
        Ok(d.clone())
    }
    fn tokens(d: &MicrobatchData) -> usize {
        d.tokens()
    }
    fn cp_share(d: &MicrobatchData) -> Option<&crate::data::CpShare> {
        d.cp.as_ref()
    }
    fn hidden(&self, t: Array2<f32>, _len: usize) -> Array2<f32> {
        t
    }
    fn tensor(h: &Array2<f32>) -> &Array2<f32> {
        h
    }
    fn hidden_len(h: &Array2<f32>) -> usize {
        h.len()
    }
    fn bytes(t: &Array2<f32>) -> usize {
        t.len() * 4
    }

    fn zeros(&self, rows: usize, cols: usize) -> Result<Array2<f32>> {
        Ok(Array2::zeros((rows, cols)))
    }
    fn fill_zero(&self, t: &mut Array2<f32>) -> Result<()> {
        t.fill(0.0);
        Ok(())
    }
    fn visit(&self, t: &mut Array2<f32>, f: &mut dyn FnMut(&mut [f32])) -> Result<()> {
        f(t.as_slice_mut().expect("standard layout"));
        Ok(())
    }
    fn to_host(&self, t: &Array2<f32>) -> Vec<f32> {
        t.iter().copied().collect()
    }
    fn upload_host(&self, values: Vec<f32>, rows: usize, cols: usize) -> Result<Array2<f32>> {
        Array2::from_shape_vec((rows, cols), values)
            .map_err(|e| Error::Invalid(format!("a [{rows}, {cols}] tensor: {e}")))
    }
    fn supports_moe(&self) -> bool {
        true
    }
    fn sum_squares(&self, t: &Array2<f32>) -> Result<f64> {
        Ok(t.iter().map(|&g| g as f64 * g as f64).sum())
    }
    fn adamw(
        &self,
        (value, grad, m, v): (
            &mut Array2<f32>,
            &Array2<f32>,
            &mut Array2<f32>,
            &mut Array2<f32>,
        ),
        opt: &AdamW,
        t: u64,
        grad_scale: f32,
    ) -> Result<()> {
        opt.update(
            value.as_slice_mut().expect("standard layout"),
            grad.as_slice().expect("standard layout"),
            m.as_slice_mut().expect("standard layout"),
            v.as_slice_mut().expect("standard layout"),
            t,
            grad_scale,
        );
        Ok(())
    }

    fn linear(
        &self,
        x: &Array2<f32>,
        w: &Array2<f32>,
        _t: usize,
        _din: usize,
        _dout: usize,
    ) -> Result<Array2<f32>> {
        Ok(k::matmul(x.view(), w.view()))
    }
    fn linear_dx(
        &self,
        dy: &Array2<f32>,
        w: &Array2<f32>,
        _t: usize,
        _din: usize,
        _dout: usize,
    ) -> Result<Array2<f32>> {
        Ok(k::matmul(dy.view(), w.t()))
    }
    fn linear_dx_acc(
        &self,
        dx: &mut Array2<f32>,
        dy: &Array2<f32>,
        w: &Array2<f32>,
        _t: usize,
        _din: usize,
        _dout: usize,
    ) -> Result<()> {
        k::matmul_acc(&mut dx.view_mut(), dy.view(), w.t());
        Ok(())
    }
    fn linear_dw(
        &self,
        dw: &mut Array2<f32>,
        x: &Array2<f32>,
        dy: &Array2<f32>,
        _t: usize,
        _din: usize,
        _dout: usize,
    ) -> Result<()> {
        k::matmul_acc(&mut dw.view_mut(), x.t(), dy.view());
        Ok(())
    }
    fn add_inplace(&self, y: &mut Array2<f32>, x: &Array2<f32>, _n: usize) -> Result<()> {
        *y += x;
        Ok(())
    }
    fn rmsnorm(
        &self,
        x: &Array2<f32>,
        g: &Array2<f32>,
        _t: usize,
        _h: usize,
    ) -> Result<(Array2<f32>, Array2<f32>, Array2<f32>)> {
        let (y, xhat, rstd) = k::rmsnorm(x.view(), g.row(0));
        Ok((y, xhat, column(rstd)))
    }
    fn rmsnorm_dx(
        &self,
        dy: &Array2<f32>,
        xhat: &Array2<f32>,
        rstd: &Array2<f32>,
        g: &Array2<f32>,
        residual: Option<&Array2<f32>>,
        _t: usize,
        _h: usize,
    ) -> Result<Array2<f32>> {
        let mut dx = k::rmsnorm_dx(dy.view(), xhat.view(), rstd.column(0), g.row(0));
        if let Some(r) = residual {
            dx += r;
        }
        Ok(dx)
    }
    fn rmsnorm_dg(
        &self,
        dg: &mut Array2<f32>,
        dy: &Array2<f32>,
        xhat: &Array2<f32>,
        _t: usize,
        _h: usize,
    ) -> Result<()> {
        let mut g = dg.row(0).to_owned();
        k::rmsnorm_dg(&mut g, dy.view(), xhat.view());
        dg.row_mut(0).assign(&g);
        Ok(())
    }
    fn scale_rows(
        &self,
        xhat: &Array2<f32>,
        g: &Array2<f32>,
        _t: usize,
        _h: usize,
    ) -> Result<Array2<f32>> {
        // The very expression of `kernels::rmsnorm`'s output: bitwise the forward's.
        Ok(xhat * &g.row(0))
    }
    fn rope(
        &self,
        x: &mut Array2<f32>,
        data: &MicrobatchData,
        _heads: usize,
        head_dim: usize,
        inverse: bool,
    ) -> Result<()> {
        if let Some(cp) = &data.cp {
            // Each piece at its position in its document.
            for (w, p) in data.cu_seqlens.windows(2).zip(&cp.pieces) {
                let mut rows = x.slice_mut(ndarray::s![w[0]..w[1], ..]);
                k::rope(&mut rows, &[0, w[1] - w[0]], head_dim, inverse, p.offset);
            }
            return Ok(());
        }
        let offset = data.chunk.map_or(0, |c| c.offset as usize);
        k::rope(
            &mut x.view_mut(),
            &data.cu_seqlens,
            head_dim,
            inverse,
            offset,
        );
        Ok(())
    }
    fn attention(
        &self,
        q: &Array2<f32>,
        k_: &Array2<f32>,
        v: &Array2<f32>,
        data: &MicrobatchData,
        dims: AttnDims,
    ) -> Result<(Array2<f32>, Array2<f32>)> {
        Ok(k::attention(
            q.view(),
            k_.view(),
            v.view(),
            &data.cu_seqlens,
            dims,
            prefix_rows(q, k_, data)?,
        ))
    }
    fn attention_backward(
        &self,
        dout: &Array2<f32>,
        (q, k_, v, o, lse): (
            &Array2<f32>,
            &Array2<f32>,
            &Array2<f32>,
            &Array2<f32>,
            &Array2<f32>,
        ),
        data: &MicrobatchData,
        dims: AttnDims,
    ) -> Result<(Array2<f32>, Array2<f32>, Array2<f32>)> {
        Ok(k::attention_backward(
            dout.view(),
            q.view(),
            k_.view(),
            v.view(),
            o.view(),
            lse.view(),
            &data.cu_seqlens,
            dims,
            prefix_rows(q, k_, data)?,
        ))
    }
    fn concat_rows(&self, parts: &[&Array2<f32>], cols: usize) -> Result<Array2<f32>> {
        if parts.iter().any(|p| p.ncols() != cols) {
            return Err(Error::Invalid(format!(
                "concat_rows: a part is not {cols} columns wide"
            )));
        }
        let views: Vec<_> = parts.iter().map(|p| p.view()).collect();
        ndarray::concatenate(ndarray::Axis(0), &views)
            .map_err(|e| Error::Invalid(format!("concat_rows: {e}")))
    }
    fn slice_rows(
        &self,
        t: &Array2<f32>,
        rows: std::ops::Range<usize>,
        _cols: usize,
    ) -> Result<Array2<f32>> {
        if rows.end > t.nrows() || rows.start > rows.end {
            return Err(Error::Invalid(format!(
                "slice_rows: rows {rows:?} of a {}-row tensor",
                t.nrows()
            )));
        }
        Ok(t.slice(ndarray::s![rows, ..]).to_owned())
    }
    fn swiglu(&self, gate: &Array2<f32>, up: &Array2<f32>, _n: usize) -> Result<Array2<f32>> {
        Ok(k::swiglu(gate.view(), up.view()))
    }
    fn swiglu_backward(
        &self,
        d: &Array2<f32>,
        gate: &Array2<f32>,
        up: &Array2<f32>,
        _n: usize,
    ) -> Result<(Array2<f32>, Array2<f32>)> {
        Ok(k::swiglu_backward(d.view(), gate.view(), up.view()))
    }
    fn embedding(
        &self,
        table: &Array2<f32>,
        data: &MicrobatchData,
        _h: usize,
    ) -> Result<Array2<f32>> {
        Ok(k::embedding(table.view(), &data.ids))
    }
    fn embedding_backward(
        &self,
        dtable: &mut Array2<f32>,
        dy: &Array2<f32>,
        data: &MicrobatchData,
        _h: usize,
    ) -> Result<()> {
        k::embedding_backward(dtable, dy.view(), &data.ids);
        Ok(())
    }
    fn cross_entropy(
        &self,
        logits: &Array2<f32>,
        data: &MicrobatchData,
        _vocab: usize,
    ) -> Result<(LossSums, Array2<f32>)> {
        let (weighted, sum, lse) =
            k::cross_entropy(logits.view(), &data.labels, &data.loss_weights);
        let loss = LossSums {
            weighted,
            sum,
            tokens: data.tokens() as u64,
        };
        Ok((loss, column(lse)))
    }
    fn cross_entropy_backward(
        &self,
        logits: &Array2<f32>,
        lse: &Array2<f32>,
        data: &MicrobatchData,
        _vocab: usize,
    ) -> Result<Array2<f32>> {
        Ok(k::cross_entropy_backward(
            logits.view(),
            lse.column(0),
            &data.labels,
            &data.loss_weights,
        ))
    }
    fn read_loss(&self, loss: &LossSums, _tokens: u64) -> Result<LossSums> {
        Ok(*loss)
    }
}

/// What the CPU backend must hold at the least to train `model`, bytes, counted from the tensors
/// it allocates: [`MemoryFloor::state`] (fp32 weights, gradients and AdamW's two moments: 16 bytes
/// per parameter, [`ModelSpec::param_count`]) and [`MemoryFloor::activations`] (what forward keeps
/// until backward for one microbatch of `microbatch_tokens` tokens in every layer at once, as at
/// the peak of a full pipeline: per decoder token `4H` (both RMSNorms' inputs and outputs) + `2H`
/// (Q, attention output) + `2·kv_dim` (K, V) + `3·FFN` (gate, up, SwiGLU), per head token `2H +
/// V` (norm input, output and logits), fp32; see `model::DecoderF` and `model::HeadF`). A floor, not a
/// peak: schedules that keep several microbatches in flight per stage hold more.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MemoryFloor {
    /// Weights, gradients and optimizer state, bytes.
    pub state: f64,
    /// Saved activations, bytes.
    pub activations: f64,
}

impl MemoryFloor {
    /// The floor of `model` for microbatches of `microbatch_tokens` tokens.
    pub fn of(model: &ModelSpec, microbatch_tokens: u64) -> Self {
        const F32: f64 = 4.0;
        let t = microbatch_tokens as f64;
        let activations: f64 = model
            .layers()
            .iter()
            .map(|l| {
                let (h, ffn) = (l.hidden as f64, l.ffn as f64);
                let per_token = match l.kind {
                    LayerKind::Embedding => 0.0,
                    LayerKind::Head => 2.0 * h + l.vocab as f64,
                    LayerKind::Decoder => {
                        let kv_dim = h / l.heads.max(1) as f64 * l.kv_heads as f64;
                        6.0 * h + 2.0 * kv_dim + 3.0 * ffn
                    }
                };
                per_token * t * F32
            })
            .sum();
        MemoryFloor {
            state: model.param_count() as f64 * 4.0 * F32,
            activations,
        }
    }
}

/// Sum of a stage's parameter counts (for checks against the profile's).
pub fn param_count(stage: &CpuStage) -> u64 {
    stage.param_count()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::{LossReduction, build_step};
    use crate::kernels::tests::{directional, directional_eps};
    use crate::model::experts::Exchange;
    use crate::model::layers::{Layer, decoder_dgrad, decoder_forward};
    use crate::worker::{StageInput, StageOutput, StageWorker};
    use flatpipe_profiles::builtins;
    use rand::{SeedableRng, rngs::ChaCha8Rng};

    fn small_model() -> ModelSpec {
        ModelSpec::from_yaml(
            "name: t\ndtype: fp32\nlayers:\n  - {kind: embedding, vocab: 32, hidden: 16}\n  - {kind: decoder, count: 2, hidden: 16, ffn: 24, heads: 4, kv_heads: 2}\n  - {kind: head, vocab: 32, hidden: 16}\n",
            "test",
        )
        .unwrap()
    }

    /// [`small_model`] with 4 routed experts (2 per token) and a shared expert in place of
    /// the dense MLP.
    fn small_moe_model(gating: &str) -> ModelSpec {
        ModelSpec::from_yaml(
            &format!("name: t\ndtype: fp32\nlayers:\n  - {{kind: embedding, vocab: 32, hidden: 16}}\n  - {{kind: decoder, count: 2, hidden: 16, heads: 4, kv_heads: 2, moe: {{experts: 4, top_k: 2, expert_ffn: 8, shared_experts: 1, gating: {gating}}}}}\n  - {{kind: head, vocab: 32, hidden: 16}}\n"),
            "test",
        )
        .unwrap()
    }

    #[test]
    fn decoder_layer_dgrad_matches_finite_differences() {
        decoder_matches_finite_differences(&small_model(), 1.0, 2e-3);
    }

    /// The MoE decoder (router, shared expert, routed experts; without expert parallelism)
    /// against finite differences, for both gatings. The top-k choice is piecewise constant:
    /// the router's weights are scaled up and the steps kept small so that no token changes
    /// experts, and steps that small in fp32 leave a few percent of rounding, hence the coarse
    /// tolerance (a missing or wrong gradient misses by far more: a router gradient of the
    /// wrong sign or none is off by 100%). The exact check of the MoE arithmetic is
    /// `model::experts`' comparison with the kernels of `crate::moe`.
    #[test]
    fn moe_decoder_layer_dgrad_matches_finite_differences() {
        for gating in ["softmax", "sigmoid"] {
            decoder_matches_finite_differences(&small_moe_model(gating), 0.3, 5e-2);
        }
    }

    /// Decoder 1 of `model`; a router's weights scaled up so that every token's top-k margin is
    /// far wider than a finite-difference step (the choice must not flip under it).
    fn decoder_stage(model: &ModelSpec) -> CpuStage {
        let mut st = CpuStage::new(model, 1..2, 3, Recompute::None).unwrap();
        for p in st.layers[0].1.params_mut() {
            if p.name.contains("router") {
                p.value.mapv_inplace(|v| v * 100.0);
            }
        }
        st
    }

    /// Decoder 1's input and weight gradients against central differences along a random
    /// direction, of step `1e-2 eps_scale` (norm weights `0.1 eps_scale`), within `tol`.
    fn decoder_matches_finite_differences(model: &ModelSpec, eps_scale: f32, tol: f64) {
        let model = model.clone();
        let mut stage = decoder_stage(&model);
        let data = &build_step(&[vec![vec![3, 4]]], 32, 0, 0, LossReduction::PerToken)[0][0];
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        let x = crate::kernels::tests::randn(&mut rng, (7, 16), 1.0);
        let r = crate::kernels::tests::randn(&mut rng, (7, 16), 1.0);
        let dec = match &stage.layers[0].1 {
            Layer::Decoder(d) => d,
            _ => unreachable!(),
        };
        let f = |x: &Array2<f32>| -> f64 {
            let (y, _) =
                decoder_forward(&CpuOps, dec, x, data, None, &mut Exchange::solo()).unwrap();
            y.iter().zip(r.iter()).map(|(a, b)| (*a * *b) as f64).sum()
        };
        let (_, c) = decoder_forward(&CpuOps, dec, &x, data, None, &mut Exchange::solo()).unwrap();
        let (dx, _, _) = decoder_dgrad(
            &CpuOps,
            dec,
            c,
            r.clone(),
            data,
            None,
            &mut Exchange::solo(),
        )
        .unwrap();
        let e = directional(&x, &dx, &f, 2);
        assert!(e < 2e-3, "{e}");
        // The wgrad of every parameter against finite differences of that parameter.
        let _ = stage
            .forward(0, data, StageInput::Hidden(x.clone()), true)
            .unwrap();
        stage.backward_input(0, data, Some(r.clone())).unwrap();
        stage.backward_weight(0, data).unwrap();
        let grads = stage.named_grads();
        for (pi, (name, g)) in grads.iter().enumerate() {
            let shape = stage.layers[0].1.params()[pi].value.raw_dim();
            let g = Array2::from_shape_vec(shape, g.clone()).unwrap();
            let base = stage.layers[0].1.params()[pi].value.clone();
            let loss = |w: &Array2<f32>| -> f64 {
                let mut st = decoder_stage(&model);
                st.layers[0].1.params_mut()[pi].value.assign(w);
                let dec = match &st.layers[0].1 {
                    Layer::Decoder(d) => d,
                    _ => unreachable!(),
                };
                let (y, _) =
                    decoder_forward(&CpuOps, dec, &x, data, None, &mut Exchange::solo()).unwrap();
                y.iter().zip(r.iter()).map(|(a, b)| (*a * *b) as f64).sum()
            };
            // Norm weights act through the small MLP / attention branches next to the residual
            // stream, so their finite difference needs a larger step to rise above f32 rounding.
            let eps = if name.contains("norm") { 0.1 } else { 1e-2 } * eps_scale;
            let e = directional_eps(&base, &g, &loss, 10 + pi as u64, eps);
            assert!(e < tol, "{name}: rel err {e}");
        }
    }

    #[test]
    fn head_and_embedding_gradients_match_finite_differences() {
        let model = small_model();
        let data = &build_step(&[vec![vec![2, 5]]], 32, 0, 0, LossReduction::PerToken)[0][0];
        let mut rng = ChaCha8Rng::seed_from_u64(5);
        let x = crate::kernels::tests::randn(&mut rng, (7, 16), 1.0);
        let mut head = CpuStage::new(&model, 3..4, 3, Recompute::None).unwrap();
        let loss_of = |st: &mut CpuStage, x: &Array2<f32>| match st
            .forward(9, data, StageInput::Hidden(x.clone()), false)
            .unwrap()
        {
            StageOutput::Loss(l) => l.weighted,
            _ => unreachable!(),
        };
        head.forward(0, data, StageInput::Hidden(x.clone()), true)
            .unwrap();
        let dx = head.backward_input(0, data, None).unwrap().unwrap();
        let e = directional(
            &x,
            &dx,
            &|x| {
                loss_of(
                    &mut CpuStage::new(&model, 3..4, 3, Recompute::None).unwrap(),
                    x,
                )
            },
            3,
        );
        assert!(e < 2e-3, "head dx {e}");
        head.backward_weight(0, data).unwrap();
        let out_grad = head.named_grads()[1].1.clone();
        let base = head.layers[0].1.params()[1].value.clone();
        let g = Array2::from_shape_vec(base.raw_dim(), out_grad).unwrap();
        let e = directional(
            &base,
            &g,
            &|w| {
                let mut st = CpuStage::new(&model, 3..4, 3, Recompute::None).unwrap();
                st.layers[0].1.params_mut()[1].value.assign(w);
                loss_of(&mut st, &x)
            },
            4,
        );
        assert!(e < 2e-3, "output.weight {e}");
        // Embedding wgrad: d<r, E[ids]>/dE.
        let mut emb = CpuStage::new(&model, 0..1, 3, Recompute::None).unwrap();
        let r = crate::kernels::tests::randn(&mut rng, (7, 16), 1.0);
        emb.forward(0, data, StageInput::Tokens, true).unwrap();
        assert!(
            emb.backward_input(0, data, Some(r.clone()))
                .unwrap()
                .is_none()
        );
        emb.backward_weight(0, data).unwrap();
        let g = Array2::from_shape_vec((32, 16), emb.named_grads()[0].1.clone()).unwrap();
        let base = emb.layers[0].1.params()[0].value.clone();
        let e = directional(
            &base,
            &g,
            &|w| {
                let y = k::embedding(w.view(), &data.ids);
                y.iter().zip(r.iter()).map(|(a, b)| (*a * *b) as f64).sum()
            },
            5,
        );
        assert!(e < 2e-3, "embedding {e}");
    }

    #[test]
    fn recomputation_gives_the_same_gradients_and_keeps_less() {
        let model = builtins::model("tiny").unwrap();
        let data = &build_step(&[vec![vec![9, 4]]], 4096, 0, 0, LossReduction::PerToken)[0][0];
        let run = |mode| {
            let mut st = CpuStage::new(&model, 0..10, 7, mode).unwrap();
            st.forward(0, data, StageInput::Tokens, true).unwrap();
            let kept = st.saved_bytes();
            st.backward_input(0, data, None).unwrap();
            st.backward_weight(0, data).unwrap();
            (st.named_grads(), kept)
        };
        let (none, kept_none) = run(Recompute::None);
        let (full, kept_full) = run(Recompute::Full);
        let (selective, kept_selective) = run(Recompute::Selective);
        assert_eq!(
            none, full,
            "recomputation reruns the same kernels on the same input"
        );
        assert_eq!(none, selective, "selective reruns the same kernels too");
        // What F keeps, from the tiny model's shapes (hidden 256, ffn 688, 4 heads; 8 decoders;
        // 13 tokens), 4 bytes a float: per decoder token, no recomputation keeps
        // h1 xhat1 q k v o h2 xhat2 gate up act = 5h + 2kv + 3ffn floats and 2 rstd + heads
        // lse; selective drops h1 o h2 act (3h + ffn) and lse (heads). The head keeps the same
        // in both.
        let spec = &model.layers()[1];
        let (h, ffn, heads) = (spec.hidden as usize, spec.ffn as usize, spec.heads as usize);
        let decoders = model
            .layers()
            .iter()
            .filter(|l| l.kind == LayerKind::Decoder)
            .count();
        let dropped = decoders * 13 * 4 * (3 * h + ffn + heads);
        assert_eq!(kept_none - kept_selective, dropped);
        assert!(kept_full < kept_selective);
    }

    /// The floor counts what forward really keeps: one microbatch through every layer of the
    /// tiny model holds, in real tensors, between the floor and 5% more (the per-row norms and
    /// log-sum-exps the floor leaves out).
    #[test]
    fn memory_floor_matches_the_tensors_forward_keeps() {
        let model = builtins::model("tiny").unwrap();
        let n = model.layers().len();
        let data = &build_step(&[vec![vec![40, 24]]], 4096, 0, 0, LossReduction::PerToken)[0][0];
        let mut st = CpuStage::new(&model, 0..n, 7, Recompute::None).unwrap();
        st.forward(0, data, StageInput::Tokens, true).unwrap();
        let floor = MemoryFloor::of(&model, 64);
        let held = st.saved_bytes() as f64;
        assert!(
            held >= floor.activations && held <= 1.05 * floor.activations,
            "held {held} B, floor {} B",
            floor.activations
        );
        assert_eq!(floor.state, 16.0 * model.param_count() as f64);
    }

    #[test]
    fn parameter_counts_match_the_model_spec() {
        let model = builtins::model("tiny").unwrap();
        let st = CpuStage::new(&model, 0..10, 0, Recompute::None).unwrap();
        let expect: u64 = model.layers().iter().map(|l| l.param_count()).sum();
        assert_eq!(param_count(&st), expect);
        // tiny-moe by hand: embedding and head 4096 x 256 (+ the final norm); per decoder
        // attention 2 x 256^2 + 2 x 256 x 128 and two norms, a router 256 x 8, 8 routed and one
        // shared SwiGLU of 3 x 256 x 128.
        let moe = builtins::model("tiny-moe").unwrap();
        let n = moe.layers().len();
        let st = CpuStage::new(&moe, 0..n, 0, Recompute::None).unwrap();
        let decoder = 2 * 256 * 256 + 2 * 256 * 128 + 2 * 256 + 256 * 8 + 9 * 3 * 256 * 128;
        let by_hand = 2 * 4096 * 256 + 256 + 6 * decoder;
        assert_eq!(param_count(&st), by_hand);
        assert_eq!(moe.param_count(), by_hand);
        assert_eq!(by_hand, 8_600_832);
        // Split over an expert-parallel group of 2: each rank holds half the routed experts.
        let half = CpuStage::sharded(
            &moe,
            0..n,
            0,
            Recompute::None,
            crate::model::experts::ExpertShard { index: 1, ep: 2 },
        )
        .unwrap();
        assert_eq!(param_count(&half), by_hand - 6 * 4 * 3 * 256 * 128);
    }
}
