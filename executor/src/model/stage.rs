//! One pipeline stage over an op set: [`Stage`], the [`StageWorker`] that runs a layer range's
//! F, I and W, keeps per microbatch what they save, recomputes per the plan, and holds the
//! parameters and the optimizer state.

use super::experts::{AllToAllSpan, Exchange, ExpertLink, moe_wgrad, swiglu_wgrad};
use super::layers::{
    ChunkDgrad, Layer, Mlp, decoder_dgrad, decoder_forward, head_dgrad, head_forward,
};
use super::ops::OpSet;
use super::params::Param;
use super::saved::{DecoderSelective, FCtx, MlpW, WCtx};
use crate::worker::{
    AdamW, ComputeStream, CopyStamps, DeviceClock, LossSums, Misuse, StageInput, StageOutput,
    StageWorker,
};
use crate::{Error, MicrobatchData, Result};
use flatpipe_simulator::costs::Recompute;
use std::collections::HashMap;

/// Data flowing through a stage's layers.
enum Flow<O: OpSet> {
    Tokens,
    Hidden(O::Hidden),
    Loss(O::Loss),
}

/// One pipeline stage: layers `[start, end)` of a model on one rank, over the op set `O`.
#[derive(Debug)]
pub struct Stage<O: OpSet> {
    pub(crate) ops: O,
    pub(crate) layers: Vec<(usize, Layer<O::Tensor>)>,
    hidden: usize,
    recompute: Recompute,
    fctx: HashMap<u32, (O::Data, Vec<FCtx<O>>)>,
    wctx: HashMap<u32, (O::Data, Vec<WCtx<O>>)>,
    pending: Vec<(u32, bool, u64, O::Loss)>,
    /// Microbatch data moved to the device before the step, by (microbatch, forward-only).
    staged: HashMap<(u32, bool), O::Data>,
    peak_saved: usize,
    /// Chunked sequences on this stage: sequence -> its chunks' `(index, offset, tokens,
    /// microbatch)` as their forwards ran.
    chains: HashMap<u32, Vec<(u32, usize, usize, u32)>>,
    /// Per (chunk microbatch, layer position): the gradients of its rotated keys and values
    /// that its later chunks' dgrads produced, summed, `[tokens, kv]` each.
    later_kv: HashMap<(u32, usize), (O::Tensor, O::Tensor)>,
    /// The stage's end of its expert-parallel group (none: every expert is here).
    link: Option<ExpertLink>,
}

impl<O: OpSet> Stage<O> {
    /// A stage of `layers` on `ops`, recomputing per `recompute`.
    pub(crate) fn from_layers(
        ops: O,
        layers: Vec<(usize, Layer<O::Tensor>)>,
        hidden: usize,
        recompute: Recompute,
    ) -> Self {
        Stage {
            ops,
            layers,
            hidden,
            recompute,
            fctx: HashMap::new(),
            wctx: HashMap::new(),
            pending: Vec::new(),
            staged: HashMap::new(),
            peak_saved: 0,
            chains: HashMap::new(),
            later_kv: HashMap::new(),
            link: None,
        }
    }

    /// Exchanges the routed experts' tokens through `link` (the stage holds the experts of
    /// `link`'s index, [`super::experts::ExpertShard`]).
    pub fn with_link(mut self, link: ExpertLink) -> Self {
        self.link = Some(link);
        self
    }

    /// Calls `f(name, gradient)` on every parameter's gradient, routed experts included.
    ///
    /// # Errors
    /// A backend failure reading or writing a gradient.
    pub fn visit_named_grads(&mut self, f: &mut dyn FnMut(&str, &mut [f32])) -> Result<()> {
        for (_, l) in &mut self.layers {
            for p in l.params_mut() {
                let name = p.name.as_str();
                self.ops.visit(&mut p.grad, &mut |g| f(name, g))?;
            }
        }
        self.ops.synchronize()
    }

    /// Whether a layer of this stage is a mixture of experts.
    pub fn has_moe(&self) -> bool {
        self.layers
            .iter()
            .any(|(_, l)| matches!(l, Layer::Decoder(d) if matches!(d.mlp, Mlp::Moe(_))))
    }

    /// Bytes of activations and gradients this stage holds for microbatches between F and W
    /// (what F keeps until I plus what I keeps until W), from the real tensors.
    pub fn saved_bytes(&self) -> usize {
        let f: usize = self
            .fctx
            .values()
            .flat_map(|(_, c)| c)
            .map(FCtx::bytes)
            .sum();
        let w: usize = self
            .wctx
            .values()
            .flat_map(|(_, c)| c)
            .map(WCtx::bytes)
            .sum();
        let kv: usize = self
            .later_kv
            .values()
            .map(|(k, v)| O::bytes(k) + O::bytes(v))
            .sum();
        f + w + kv
    }

    /// The most [`Stage::saved_bytes`] seen after any action (this stage's share of its rank's
    /// peak activation memory).
    pub fn peak_saved_bytes(&self) -> usize {
        self.peak_saved
    }

    /// Parameters of this stage.
    pub fn param_count(&self) -> u64 {
        self.layers
            .iter()
            .flat_map(|(_, l)| l.params())
            .map(|p| (p.shape.0 * p.shape.1) as u64)
            .sum()
    }

    /// Global layer indices held by this stage.
    pub fn layer_indices(&self) -> Vec<usize> {
        self.layers.iter().map(|(i, _)| *i).collect()
    }

    /// The stage's op set.
    pub fn ops(&self) -> &O {
        &self.ops
    }

    fn note_peak(&mut self) {
        self.peak_saved = self.peak_saved.max(self.saved_bytes());
    }

    /// The earlier chunks' rotated keys and values of every layer (`None` for a layer that is
    /// not a decoder), from their saved forwards, for chunk `c` (microbatch `mb`); `None` when
    /// `c` is the first chunk. Their forwards ran and their dgrads have not (the schedule runs a
    /// sequence's forwards in chunk order and its backwards in reverse).
    #[allow(clippy::type_complexity)]
    fn chunk_prefix(
        &self,
        mb: u32,
        c: flatpipe_simulator::batching::microbatch::Chunk,
    ) -> Result<Option<Vec<Option<(O::Tensor, O::Tensor)>>>> {
        if c.index == 0 {
            return Ok(None);
        }
        let misuse = |why| Misuse::ChunkOrder {
            mb,
            sequence: c.sequence,
            index: c.index,
            why,
        };
        let mut earlier: Vec<(u32, u32)> = self
            .chains
            .get(&c.sequence)
            .map(|v| {
                v.iter()
                    .filter(|x| x.0 < c.index)
                    .map(|x| (x.0, x.3))
                    .collect()
            })
            .unwrap_or_default();
        earlier.sort_unstable();
        if earlier.len() != c.index as usize {
            return Err(misuse("an earlier chunk's forward has not run on this stage").into());
        }
        let mut ctxs = Vec::with_capacity(earlier.len());
        for (_, m) in &earlier {
            let (_, c) = self.fctx.get(m).ok_or(misuse(
                "an earlier chunk's backward ran before this chunk's",
            ))?;
            ctxs.push(c);
        }
        let mut out = Vec::with_capacity(self.layers.len());
        for (l, (_, layer)) in self.layers.iter().enumerate() {
            let Layer::Decoder(d) = layer else {
                out.push(None);
                continue;
            };
            let mut ks = Vec::with_capacity(ctxs.len());
            let mut vs = Vec::with_capacity(ctxs.len());
            for c in &ctxs {
                match c.get(l) {
                    Some(FCtx::Decoder(f)) => {
                        ks.push(&f.k);
                        vs.push(&f.v);
                    }
                    _ => return Err(Misuse::ActivationsOfAnotherKind.into()),
                }
            }
            out.push(Some((
                self.ops.concat_rows(&ks, d.kv())?,
                self.ops.concat_rows(&vs, d.kv())?,
            )));
        }
        Ok(Some(out))
    }

    #[allow(clippy::too_many_arguments)]
    fn run_layer(
        ops: &O,
        layer: &Layer<O::Tensor>,
        flow: Flow<O>,
        data: &O::Data,
        keep: bool,
        recompute: Recompute,
        prefix: Option<(&O::Tensor, &O::Tensor)>,
        ex: &mut Exchange<'_>,
    ) -> Result<(Flow<O>, Option<FCtx<O>>)> {
        let t = O::tokens(data);
        Ok(match (layer, flow) {
            (Layer::Embedding { table, hidden }, Flow::Tokens) => (
                Flow::Hidden(ops.hidden(ops.embedding(&table.value, data, *hidden)?, t * hidden)),
                keep.then_some(FCtx::Embedding),
            ),
            (Layer::Decoder(d), Flow::Hidden(x)) => {
                let (y, c) = decoder_forward(ops, d, O::tensor(&x), data, prefix, ex)?;
                let ctx = match (keep, recompute) {
                    (false, _) => None,
                    (true, Recompute::Full) => Some(FCtx::Input(x)),
                    (true, Recompute::Selective) => {
                        Some(FCtx::Selective(Box::new(DecoderSelective::keep(c)?)))
                    }
                    (true, Recompute::None) => Some(FCtx::Decoder(Box::new(c))),
                };
                (Flow::Hidden(ops.hidden(y, t * d.hidden)), ctx)
            }
            (
                Layer::Head {
                    norm,
                    out,
                    hidden,
                    vocab,
                },
                Flow::Hidden(x),
            ) => {
                let (loss, c) =
                    head_forward(ops, (norm, out), (*hidden, *vocab), O::tensor(&x), data)?;
                // The head keeps everything under selective recomputation (the simulator's cost
                // model has it so).
                let ctx = match (keep, recompute) {
                    (false, _) => None,
                    (true, Recompute::Full) => Some(FCtx::Input(x)),
                    (true, _) => Some(FCtx::Head(Box::new(c))),
                };
                (Flow::Loss(loss), ctx)
            }
            (Layer::Embedding { .. }, _) => {
                return Err(Misuse::EmbeddingWantsTokens.into());
            }
            (_, Flow::Tokens) => {
                return Err(Misuse::TokensOnlyIntoEmbedding.into());
            }
            (_, Flow::Loss(_)) => {
                return Err(Misuse::NothingAfterHead.into());
            }
        })
    }

    /// `(name, values)` of `pick(parameter)` for every parameter, on the host.
    fn named(&self, pick: impl Fn(&Param<O::Tensor>) -> &O::Tensor) -> Vec<(String, Vec<f32>)> {
        self.layers
            .iter()
            .flat_map(|(_, l)| l.params())
            .map(|p| (p.name.clone(), self.ops.to_host(pick(p))))
            .collect()
    }
}

impl<O: OpSet> StageWorker for Stage<O> {
    type Hidden = O::Hidden;

    fn hidden_size(&self) -> usize {
        self.hidden
    }

    fn hidden_len(h: &O::Hidden) -> usize {
        O::hidden_len(h)
    }

    fn forward(
        &mut self,
        mb: u32,
        data: &MicrobatchData,
        input: StageInput<O::Hidden>,
        keep: bool,
    ) -> Result<StageOutput<O::Hidden>> {
        let dev = match self.staged.remove(&(mb, !keep)) {
            Some(d) => d,
            None => self.ops.upload_data(data)?,
        };
        let mut flow = match input {
            StageInput::Tokens => Flow::Tokens,
            StageInput::Hidden(h) => Flow::Hidden(h),
        };
        let prefix = match data.chunk {
            Some(c) => {
                if !keep || self.recompute != Recompute::None {
                    return Err(Error::Unsupported(format!(
                        "chunk {} of {} (microbatch {mb}): chunked sequences run only as training microbatches without recomputation (their later chunks read this chunk's saved keys and values)",
                        c.index, c.of
                    )));
                }
                let prefix = self.chunk_prefix(mb, c)?;
                self.chains.entry(c.sequence).or_default().push((
                    c.index,
                    c.offset as usize,
                    data.tokens(),
                    mb,
                ));
                prefix
            }
            None => None,
        };
        let mut ctxs = Vec::with_capacity(self.layers.len());
        for (l, (index, layer)) in self.layers.iter().enumerate() {
            let p = prefix
                .as_ref()
                .and_then(|p| p[l].as_ref())
                .map(|(k, v)| (k, v));
            let mut ex = Exchange {
                link: self.link.as_mut(),
                layer: *index,
                microbatch: mb,
                forward_only: !keep,
            };
            let (next, ctx) = Self::run_layer(
                &self.ops,
                layer,
                flow,
                &dev,
                keep,
                self.recompute,
                p,
                &mut ex,
            )?;
            flow = next;
            ctxs.extend(ctx);
        }
        let tokens = O::tokens(&dev) as u64;
        if keep {
            if self.fctx.contains_key(&mb) {
                return Err(Misuse::ForwardTwice(mb).into());
            }
            self.fctx.insert(mb, (dev, ctxs));
            self.note_peak();
        }
        match flow {
            Flow::Hidden(h) => Ok(StageOutput::Hidden(self.ops.ready(h)?)),
            Flow::Loss(loss) if O::DEFERRED_LOSS => {
                self.pending.push((mb, !keep, tokens, loss));
                Ok(StageOutput::LossPending)
            }
            Flow::Loss(loss) => Ok(StageOutput::Loss(self.ops.read_loss(&loss, tokens)?)),
            Flow::Tokens => Err(Misuse::NoLayers.into()),
        }
    }

    fn backward_input(
        &mut self,
        mb: u32,
        data: &MicrobatchData,
        grad: Option<O::Hidden>,
    ) -> Result<Option<O::Hidden>> {
        // A chunk: every later chunk's dgrad ran (they produced this chunk's key/value
        // gradients); the earlier chunks' keys and values are still saved.
        let (chunk, prefix) = match data.chunk {
            Some(c) => {
                let chain = self.chains.get(&c.sequence).cloned().unwrap_or_default();
                let later_pending = chain
                    .iter()
                    .any(|x| x.0 > c.index && self.fctx.contains_key(&x.3));
                if later_pending || chain.len() != c.of as usize {
                    return Err(Misuse::ChunkOrder {
                        mb,
                        sequence: c.sequence,
                        index: c.index,
                        why: "a later chunk's backward has not run on this stage (a sequence's backwards run in reverse chunk order)",
                    }
                    .into());
                }
                (Some((c, chain)), self.chunk_prefix(mb, c)?)
            }
            None => (None, None),
        };
        let (dev, ctxs) = self
            .fctx
            .remove(&mb)
            .ok_or(Misuse::DgradBeforeForward(mb))?;
        let ops = &self.ops;
        let t = O::tokens(&dev);
        let mut dy = grad;
        let mut wctxs = Vec::with_capacity(ctxs.len());
        for (pos, ((index, layer), ctx)) in self.layers.iter().zip(ctxs).enumerate().rev() {
            let mut ex = Exchange {
                link: self.link.as_mut(),
                layer: *index,
                microbatch: mb,
                forward_only: false,
            };
            let ctx = match (ctx, layer) {
                // Full recomputation: rerun this layer's forward from its saved input.
                (FCtx::Input(x), Layer::Decoder(d)) => FCtx::Decoder(Box::new(
                    decoder_forward(ops, d, O::tensor(&x), &dev, None, &mut ex)?.1,
                )),
                (
                    FCtx::Input(x),
                    Layer::Head {
                        norm,
                        out,
                        hidden,
                        vocab,
                    },
                ) => FCtx::Head(Box::new(
                    head_forward(ops, (norm, out), (*hidden, *vocab), O::tensor(&x), &dev)?.1,
                )),
                (FCtx::Input(_), Layer::Embedding { .. }) => FCtx::Embedding,
                // Selective: the attention core and the elementwise work again.
                (FCtx::Selective(c), Layer::Decoder(d)) => {
                    FCtx::Decoder(Box::new(c.restore(ops, d, &dev)?))
                }
                (FCtx::Selective(_), _) => return Err(Misuse::ActivationsOfAnotherKind.into()),
                (c, _) => c,
            };
            let (dx, w) = match (layer, ctx) {
                (
                    Layer::Head {
                        norm,
                        out,
                        hidden,
                        vocab,
                    },
                    FCtx::Head(c),
                ) => {
                    let (dx, w) = head_dgrad(ops, (norm, out), (*hidden, *vocab), *c, &dev)?;
                    (Some(ops.hidden(dx, t * hidden)), w)
                }
                (Layer::Decoder(d), FCtx::Decoder(c)) => {
                    let dy = dy.take().ok_or(Misuse::NoOutputGradient(mb))?;
                    let cg = chunk.as_ref().map(|(ch, _)| ChunkDgrad {
                        offset: ch.offset as usize,
                        prefix: prefix
                            .as_ref()
                            .and_then(|p| p[pos].as_ref())
                            .map(|(k, v)| (k, v)),
                        later: self.later_kv.remove(&(mb, pos)),
                    });
                    let (dx, w, earlier) = decoder_dgrad(ops, d, *c, dy, &dev, cg, &mut ex)?;
                    // Hand each earlier chunk its rows of the key/value gradients.
                    if let (Some((dkp, dvp)), Some((ch, chain))) = (earlier, &chunk) {
                        let kv = d.kv();
                        for &(_, off, len, m) in chain.iter().filter(|x| x.0 < ch.index) {
                            let gk = ops.slice_rows(&dkp, off..off + len, kv)?;
                            let gv = ops.slice_rows(&dvp, off..off + len, kv)?;
                            match self.later_kv.get_mut(&(m, pos)) {
                                Some((k, v)) => {
                                    ops.add_inplace(k, &gk, len * kv)?;
                                    ops.add_inplace(v, &gv, len * kv)?;
                                }
                                None => {
                                    self.later_kv.insert((m, pos), (gk, gv));
                                }
                            }
                        }
                    }
                    (Some(ops.hidden(dx, t * d.hidden)), w)
                }
                (Layer::Embedding { .. }, FCtx::Embedding) => {
                    let dy = dy.take().ok_or(Misuse::NoOutputGradient(mb))?;
                    (None, WCtx::Embedding { dy })
                }
                _ => {
                    return Err(Misuse::ActivationsOfAnotherKind.into());
                }
            };
            dy = dx;
            wctxs.push(w);
        }
        wctxs.reverse();
        if let Some((c, _)) = chunk
            && c.index == 0
        {
            // The sequence's last backward on this stage.
            self.chains.remove(&c.sequence);
        }
        self.wctx.insert(mb, (dev, wctxs));
        self.note_peak();
        dy.map(|h| self.ops.ready(h)).transpose()
    }

    fn backward_weight(&mut self, mb: u32, _data: &MicrobatchData) -> Result<()> {
        let (dev, wctxs) = self.wctx.remove(&mb).ok_or(Misuse::WgradBeforeDgrad(mb))?;
        let ops = &self.ops;
        let t = O::tokens(&dev);
        for ((_, layer), w) in self.layers.iter_mut().zip(wctxs) {
            match (layer, w) {
                (Layer::Embedding { table, hidden }, WCtx::Embedding { dy }) => {
                    ops.embedding_backward(&mut table.grad, O::tensor(&dy), &dev, *hidden)?;
                }
                (
                    Layer::Head {
                        norm,
                        out,
                        hidden,
                        vocab,
                    },
                    WCtx::Head {
                        h,
                        xhat,
                        dlogits,
                        dh,
                    },
                ) => {
                    ops.linear_dw(&mut out.grad, &h, &dlogits, t, *hidden, *vocab)?;
                    ops.rmsnorm_dg(&mut norm.grad, &dh, &xhat, t, *hidden)?;
                }
                (Layer::Decoder(d), WCtx::Decoder(w)) => {
                    let d = &mut **d;
                    let w = *w;
                    let (h, kv) = (d.hidden, d.kv());
                    ops.linear_dw(&mut d.wq.grad, &w.h1, &w.dq, t, h, h)?;
                    ops.linear_dw(&mut d.wk.grad, &w.h1, &w.dk, t, h, kv)?;
                    ops.linear_dw(&mut d.wv.grad, &w.h1, &w.dv, t, h, kv)?;
                    ops.linear_dw(&mut d.wo.grad, &w.o, &w.da, t, h, h)?;
                    let dm = O::tensor(&w.dm);
                    match (&mut d.mlp, w.mlp) {
                        (Mlp::Dense(s), MlpW::Dense(sw)) => {
                            swiglu_wgrad(ops, s, &w.h2, dm, &sw, t, h)?;
                        }
                        (Mlp::Moe(m), MlpW::Moe(mw)) => {
                            moe_wgrad(ops, m, *mw, &w.h2, dm, (t, h))?;
                        }
                        _ => return Err(Misuse::GradientsOfAnotherKind.into()),
                    }
                    ops.rmsnorm_dg(&mut d.attn_norm.grad, &w.dh1, &w.xhat1, t, h)?;
                    ops.rmsnorm_dg(&mut d.ffn_norm.grad, &w.dh2, &w.xhat2, t, h)?;
                }
                _ => {
                    return Err(Misuse::GradientsOfAnotherKind.into());
                }
            }
        }
        Ok(())
    }

    fn zero_grads(&mut self) -> Result<()> {
        for (_, l) in &mut self.layers {
            for p in l.params_mut() {
                self.ops.fill_zero(&mut p.grad)?;
            }
        }
        if let Some(link) = &mut self.link {
            link.reset();
        }
        Ok(())
    }

    fn visit_grads(&mut self, f: &mut dyn FnMut(&mut [f32])) -> Result<()> {
        for (_, l) in &mut self.layers {
            for p in l.replicated_mut() {
                self.ops.visit(&mut p.grad, f)?;
            }
        }
        self.ops.synchronize()
    }

    fn visit_expert_grads(&mut self, f: &mut dyn FnMut(&mut [f32])) -> Result<()> {
        for (_, l) in &mut self.layers {
            for p in l.routed_mut() {
                self.ops.visit(&mut p.grad, f)?;
            }
        }
        self.ops.synchronize()
    }

    fn grad_sq_norm(&self) -> Result<f64> {
        let mut sum = 0.0;
        for p in self.layers.iter().flat_map(|(_, l)| l.replicated()) {
            sum += self.ops.sum_squares(&p.grad)?;
        }
        Ok(sum)
    }

    fn expert_grad_sq_norm(&self) -> Result<f64> {
        let mut sum = 0.0;
        for p in self.layers.iter().flat_map(|(_, l)| l.routed()) {
            sum += self.ops.sum_squares(&p.grad)?;
        }
        Ok(sum)
    }

    fn abort_step(&self) {
        if let Some(link) = &self.link {
            link.abort();
        }
    }

    fn exchanges_tokens(&self) -> bool {
        self.link.is_some()
    }

    fn set_compute_stream(&mut self, stream: Option<std::sync::Arc<ComputeStream>>) {
        if let Some(link) = &mut self.link {
            link.set_compute_stream(stream);
        }
    }

    fn take_all_to_alls(&mut self) -> Vec<AllToAllSpan> {
        self.link
            .as_mut()
            .map(ExpertLink::take_spans)
            .unwrap_or_default()
    }

    fn optimizer_step(&mut self, opt: &AdamW, t: u64, grad_scale: f32) -> Result<()> {
        for (_, l) in &mut self.layers {
            for p in l.params_mut() {
                if p.moments.is_none() {
                    let (r, c) = p.shape;
                    p.moments = Some((self.ops.zeros(r, c)?, self.ops.zeros(r, c)?));
                }
                let Param {
                    value,
                    grad,
                    moments: Some((m, v)),
                    ..
                } = p
                else {
                    continue;
                };
                self.ops.adamw((value, grad, m, v), opt, t, grad_scale)?;
            }
        }
        // Done when this returns: the step's optimizer time is the device's.
        self.ops.synchronize()
    }

    fn named_params(&self) -> Vec<(String, Vec<f32>)> {
        self.named(|p| &p.value)
    }

    fn named_grads(&self) -> Vec<(String, Vec<f32>)> {
        self.named(|p| &p.grad)
    }

    fn held_microbatches(&self) -> usize {
        self.fctx.len() + self.wctx.len()
    }

    fn prepare_step(
        &mut self,
        train: &[MicrobatchData],
        forward_only: &[MicrobatchData],
    ) -> Result<()> {
        // What a failed step may have left behind.
        self.fctx.clear();
        self.wctx.clear();
        self.pending.clear();
        self.staged.clear();
        for (fo, list) in [(false, train), (true, forward_only)] {
            for (i, d) in list.iter().enumerate() {
                self.staged.insert((i as u32, fo), self.ops.upload_data(d)?);
            }
        }
        Ok(())
    }

    fn import(&mut self, h: O::Hidden) -> Result<(O::Hidden, CopyStamps)> {
        self.ops.import(h)
    }

    fn take_losses(&mut self) -> Result<Vec<(u32, bool, LossSums)>> {
        let pending = std::mem::take(&mut self.pending);
        pending
            .into_iter()
            .map(|(mb, fo, tokens, loss)| Ok((mb, fo, self.ops.read_loss(&loss, tokens)?)))
            .collect()
    }

    fn device_clock(&mut self) -> Option<&mut dyn DeviceClock> {
        self.ops.clock()
    }
}
