//! The MLP of a decoder, written once over the op set: a dense SwiGLU (`Swiglu`) or a
//! mixture of experts (`MoeMlp`: a linear router, optional shared experts, routed SwiGLU
//! experts), with the routed experts' tokens exchanged with the other ranks of an
//! expert-parallel group by an [`ExpertLink`].
//!
//! An MoE layer on `T` tokens of hidden size `H`, `E` routed experts over `ep` ranks (`E / ep`
//! each, in contiguous blocks as Megatron-LM and torchtitan place them), `k` per token:
//! - F: router logits `x Wr [T, E]` and the top-k choice ([`crate::moe::route`], on the host);
//!   the dispatch all-to-all sends each `(token, slot)` pair's row of `x` to the rank holding its
//!   expert, ordered by local expert then token; each rank runs its experts on the rows it
//!   received from every rank; the combine all-to-all returns the outputs in the same order,
//!   and each token sums its `k` outputs times their routing weights. Shared experts (one
//!   SwiGLU of width `shared * expert_ffn`) run on every token locally.
//! - I: the gradient of each pair's output (`w dy`) goes to the expert's rank (a third
//!   all-to-all), which returns its input gradient (a fourth); the routing weights' gradient
//!   `dy . y_e` flows to the logits through [`crate::moe::route_backward`] and on to `x`.
//! - W: the router's, the shared experts' and the local experts' weight gradients; no exchange.
//!
//! Buffers are sized from counts, never negotiated: every message carries the pair count per
//! receiving expert ahead of its rows, so a receiver knows `Σ counts x H` before it reads a row,
//! and a message whose rows do not match its counts is refused ([`Error::Invalid`]). The
//! arithmetic is that of [`crate::moe`]'s kernels (checked against finite differences there;
//! this layer is checked against them in the stage's tests).

use super::ops::OpSet;
use super::params::Param;
use crate::moe::{Routing, route, route_backward};
use crate::worker::ComputeStream;
pub use crate::worker::{AllToAllSpan, Phase};
use crate::{Error, Result};
use flatpipe_profiles::Moe;
use ndarray::{Array2, ArrayView2};
use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender, channel};
use std::time::{Duration, Instant};

/// Which routed experts a rank holds: rank `index` of an expert-parallel group of `ep` holds
/// experts `[index E / ep, (index + 1) E / ep)` of each MoE layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExpertShard {
    /// This rank's index in its group.
    pub index: usize,
    /// Ranks in the group.
    pub ep: usize,
}

impl ExpertShard {
    /// Every expert (no expert parallelism).
    pub const ALL: ExpertShard = ExpertShard { index: 0, ep: 1 };
}

/// A SwiGLU MLP of width `ffn`: `(silu(x W1) * (x W3)) W2`, `W1`, `W3` `[H, ffn]`, `W2` `[ffn, H]`.
#[derive(Debug)]
pub(crate) struct Swiglu<T> {
    pub(crate) ffn: usize,
    pub(crate) w1: Param<T>,
    pub(crate) w3: Param<T>,
    pub(crate) w2: Param<T>,
}

impl<T> Swiglu<T> {
    pub(crate) fn params(&self) -> [&Param<T>; 3] {
        [&self.w1, &self.w3, &self.w2]
    }

    pub(crate) fn params_mut(&mut self) -> [&mut Param<T>; 3] {
        [&mut self.w1, &mut self.w3, &mut self.w2]
    }
}

/// What a SwiGLU's forward keeps: `x W1`, `x W3` and the activation, `[T, ffn]` each.
#[derive(Debug)]
pub(crate) struct SwigluF<T> {
    pub(crate) gate: T,
    pub(crate) up: T,
    pub(crate) act: T,
}

/// What a SwiGLU's dgrad keeps for its wgrad (besides its input and output gradient).
#[derive(Debug)]
pub(crate) struct SwigluW<T> {
    pub(crate) act: T,
    pub(crate) dgate: T,
    pub(crate) dup: T,
}

/// A SwiGLU's forward on `x [t, h]`: `y [t, h]`.
pub(crate) fn swiglu_forward<O: OpSet>(
    ops: &O,
    p: &Swiglu<O::Tensor>,
    x: &O::Tensor,
    t: usize,
    h: usize,
) -> Result<(O::Tensor, SwigluF<O::Tensor>)> {
    let f = p.ffn;
    let gate = ops.linear(x, &p.w1.value, t, h, f)?;
    let up = ops.linear(x, &p.w3.value, t, h, f)?;
    let act = ops.swiglu(&gate, &up, t * f)?;
    let y = ops.linear(&act, &p.w2.value, t, f, h)?;
    Ok((y, SwigluF { gate, up, act }))
}

/// A SwiGLU's dgrad from `dy [t, h]`: `dx [t, h]` and what its wgrad needs.
pub(crate) fn swiglu_dgrad<O: OpSet>(
    ops: &O,
    p: &Swiglu<O::Tensor>,
    c: SwigluF<O::Tensor>,
    dy: &O::Tensor,
    t: usize,
    h: usize,
) -> Result<(O::Tensor, SwigluW<O::Tensor>)> {
    let f = p.ffn;
    let dact = ops.linear_dx(dy, &p.w2.value, t, f, h)?;
    let (dgate, dup) = ops.swiglu_backward(&dact, &c.gate, &c.up, t * f)?;
    let mut dx = ops.linear_dx(&dgate, &p.w1.value, t, h, f)?;
    ops.linear_dx_acc(&mut dx, &dup, &p.w3.value, t, h, f)?;
    Ok((
        dx,
        SwigluW {
            act: c.act,
            dgate,
            dup,
        },
    ))
}

/// A SwiGLU's wgrad: `dW1 += xᵀ dgate`, `dW3 += xᵀ dup`, `dW2 += actᵀ dy`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn swiglu_wgrad<O: OpSet>(
    ops: &O,
    p: &mut Swiglu<O::Tensor>,
    x: &O::Tensor,
    dy: &O::Tensor,
    w: &SwigluW<O::Tensor>,
    t: usize,
    h: usize,
) -> Result<()> {
    let f = p.ffn;
    ops.linear_dw(&mut p.w1.grad, x, &w.dgate, t, h, f)?;
    ops.linear_dw(&mut p.w3.grad, x, &w.dup, t, h, f)?;
    ops.linear_dw(&mut p.w2.grad, &w.act, dy, t, f, h)
}

/// A mixture-of-experts MLP on one rank: the router `[H, E]`, the shared experts as one SwiGLU,
/// and the routed experts this rank holds (its [`ExpertShard`]'s, named by global index).
#[derive(Debug)]
pub(crate) struct MoeMlp<T> {
    pub(crate) spec: Moe,
    pub(crate) router: Param<T>,
    pub(crate) shared: Option<Swiglu<T>>,
    pub(crate) experts: Vec<Swiglu<T>>,
}

impl<T> MoeMlp<T> {
    /// The parameters every rank of the group holds (router, shared experts).
    pub(crate) fn replicated(&self) -> Vec<&Param<T>> {
        let mut v = vec![&self.router];
        v.extend(self.shared.iter().flat_map(Swiglu::params));
        v
    }

    pub(crate) fn replicated_mut(&mut self) -> Vec<&mut Param<T>> {
        let mut v = vec![&mut self.router];
        v.extend(self.shared.iter_mut().flat_map(Swiglu::params_mut));
        v
    }

    /// The routed experts' parameters (this rank's share).
    pub(crate) fn routed(&self) -> impl Iterator<Item = &Param<T>> {
        self.experts.iter().flat_map(Swiglu::params)
    }

    pub(crate) fn routed_mut(&mut self) -> impl Iterator<Item = &mut Param<T>> {
        self.experts.iter_mut().flat_map(Swiglu::params_mut)
    }
}

/// One message of an all-to-all: the pair count per receiving expert, then the rows
/// (`Σ counts x H` values).
#[derive(Debug, Clone, Default)]
pub(crate) struct Payload {
    pub(crate) counts: Vec<u32>,
    pub(crate) rows: Vec<f32>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct Key {
    layer: usize,
    microbatch: u32,
    forward_only: bool,
    phase: Phase,
}

struct Packet {
    key: Key,
    from: usize,
    /// When the sender entered the all-to-all (its threads share this process's clock).
    posted: Instant,
    payload: Payload,
}

/// One stage's end of its expert-parallel group: a channel to the same stage on each of the
/// group's ranks, and the messages that arrived before they were needed.
pub struct ExpertLink {
    index: usize,
    peers: Vec<Sender<Packet>>,
    rx: Receiver<Packet>,
    early: HashMap<(Key, usize), (Instant, Payload)>,
    abort: Arc<AtomicBool>,
    spans: Vec<AllToAllSpan>,
    stream: Option<Arc<ComputeStream>>,
}

impl std::fmt::Debug for ExpertLink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExpertLink")
            .field("index", &self.index)
            .field("ep", &self.peers.len())
            .finish_non_exhaustive()
    }
}

impl ExpertLink {
    /// The `ep` ends of one group (index i for the group's i-th rank); `abort` stops a rank
    /// waiting on a peer that failed (the interpreter sets it, [`ExpertLink::abort`]).
    pub fn group(ep: usize, abort: &Arc<AtomicBool>) -> Vec<ExpertLink> {
        let (txs, rxs): (Vec<_>, Vec<_>) = (0..ep).map(|_| channel::<Packet>()).unzip();
        rxs.into_iter()
            .enumerate()
            .map(|(index, rx)| ExpertLink {
                index,
                peers: txs.clone(),
                rx,
                early: HashMap::new(),
                abort: Arc::clone(abort),
                spans: Vec::new(),
                stream: None,
            })
            .collect()
    }

    /// Lets `stream` go while waiting on the group, and takes it back after.
    pub fn set_compute_stream(&mut self, stream: Option<Arc<ComputeStream>>) {
        self.stream = stream;
    }

    /// This rank's index in its group.
    pub fn index(&self) -> usize {
        self.index
    }

    /// Ranks in the group.
    pub fn ep(&self) -> usize {
        self.peers.len()
    }

    /// Tells every rank waiting on the group to stop (a rank failed).
    pub fn abort(&self) {
        self.abort.store(true, Ordering::SeqCst);
    }

    /// Clears the stop flag and what a failed step left (before a step).
    pub fn reset(&mut self) {
        self.abort.store(false, Ordering::SeqCst);
        self.early.clear();
        while self.rx.try_recv().is_ok() {}
        self.spans.clear();
    }

    /// The all-to-alls since the last call.
    pub fn take_spans(&mut self) -> Vec<AllToAllSpan> {
        std::mem::take(&mut self.spans)
    }

    /// One all-to-all of `values` floats to every other rank of the group, keyed by `round`
    /// (the profiler's measurement of the exchange itself).
    ///
    /// # Errors
    /// [`Error::Aborted`] when a peer stopped.
    pub(crate) fn exchange_for_profile(&mut self, round: usize, values: usize) -> Result<()> {
        let sends = (0..self.ep())
            .map(|_| Payload {
                counts: vec![values as u32],
                rows: vec![1.0; values],
            })
            .collect();
        let key = Key {
            layer: round,
            microbatch: 0,
            forward_only: true,
            phase: Phase::Dispatch,
        };
        self.all_to_all(key, sends)?;
        self.spans.clear();
        Ok(())
    }

    /// Sends `sends[r]` to the group's rank `r` and returns what each rank sent this one.
    fn all_to_all(&mut self, key: Key, sends: Vec<Payload>) -> Result<Vec<Payload>> {
        let ep = self.peers.len();
        let start = Instant::now();
        let mut got: Vec<Option<Payload>> = (0..ep).map(|_| None).collect();
        let mut values_sent = 0;
        for (r, payload) in sends.into_iter().enumerate() {
            if r == self.index {
                got[r] = Some(payload);
                continue;
            }
            values_sent += payload.rows.len();
            let packet = Packet {
                key,
                from: self.index,
                posted: start,
                payload,
            };
            self.peers[r]
                .send(packet)
                .map_err(|_| Error::Aborted(self.index as u32))?;
        }
        if let Some(s) = &self.stream {
            s.release();
        }
        let mut received = Ok(());
        let mut ready = start;
        for (r, slot) in got.iter_mut().enumerate() {
            if slot.is_none() {
                match self.receive(key, r) {
                    Ok((posted, p)) => {
                        ready = ready.max(posted);
                        *slot = Some(p);
                    }
                    Err(e) => {
                        received = Err(e);
                        break;
                    }
                }
            }
        }
        let end = Instant::now();
        if let Some(s) = &self.stream {
            s.acquire();
        }
        received?;
        self.spans.push(AllToAllSpan {
            layer: key.layer,
            microbatch: key.microbatch,
            forward_only: key.forward_only,
            phase: key.phase,
            values_sent,
            start,
            ready: ready.min(end),
            end,
        });
        Ok(got.into_iter().flatten().collect())
    }

    fn receive(&mut self, key: Key, from: usize) -> Result<(Instant, Payload)> {
        loop {
            if let Some(p) = self.early.remove(&(key, from)) {
                return Ok(p);
            }
            match self.rx.recv_timeout(Duration::from_millis(20)) {
                Ok(p) => {
                    self.early.insert((p.key, p.from), (p.posted, p.payload));
                }
                Err(RecvTimeoutError::Timeout) => {
                    if self.abort.load(Ordering::SeqCst) {
                        return Err(Error::Aborted(self.index as u32));
                    }
                }
                Err(RecvTimeoutError::Disconnected) => {
                    return Err(Error::Aborted(self.index as u32));
                }
            }
        }
    }
}

/// An MoE layer's exchanges for one microbatch: through the link, or to itself without one
/// (`ep = 1`).
pub(crate) struct Exchange<'a> {
    pub(crate) link: Option<&'a mut ExpertLink>,
    pub(crate) layer: usize,
    pub(crate) microbatch: u32,
    pub(crate) forward_only: bool,
}

impl Exchange<'_> {
    /// A layer's exchange without expert parallelism (the tests' layer-by-layer calls).
    #[cfg(test)]
    pub(crate) fn solo() -> Exchange<'static> {
        Exchange {
            link: None,
            layer: 1,
            microbatch: 0,
            forward_only: false,
        }
    }

    /// Ranks of the group the exchange reaches (1 without a link).
    pub(crate) fn ep(&self) -> usize {
        self.link.as_ref().map_or(1, |l| l.ep())
    }

    /// Sends `sends[r]` to the group's rank `r` and returns what each rank sent this one (without
    /// a link, `sends` itself).
    pub(crate) fn all_to_all(&mut self, phase: Phase, sends: Vec<Payload>) -> Result<Vec<Payload>> {
        let key = Key {
            layer: self.layer,
            microbatch: self.microbatch,
            forward_only: self.forward_only,
            phase,
        };
        match self.link.as_deref_mut() {
            Some(l) => l.all_to_all(key, sends),
            None => Ok(sends),
        }
    }
}

/// The tokens' side of a dispatch: per destination rank, the `(token, slot)` pairs it is sent,
/// ordered by local expert then token, and the pair count per local expert.
#[derive(Debug)]
pub(crate) struct Dispatch {
    pairs: Vec<Vec<(usize, usize)>>,
    counts: Vec<Vec<u32>>,
}

impl Dispatch {
    fn new(r: &Routing, experts: usize, ep: usize) -> Self {
        let local = experts / ep;
        let by_expert = r.assignments(experts);
        let mut pairs = vec![Vec::new(); ep];
        let mut counts = vec![Vec::with_capacity(local); ep];
        for (e, list) in by_expert.into_iter().enumerate() {
            let d = e / local;
            counts[d].push(list.len() as u32);
            pairs[d].extend(list);
        }
        Dispatch { pairs, counts }
    }

    /// Per destination, the rows of `x [T, H]` of its pairs (with `scale`: times the pair's
    /// routing weight).
    fn gather(&self, x: ArrayView2<f32>, scale: Option<&Array2<f32>>) -> Vec<Payload> {
        self.pairs
            .iter()
            .zip(&self.counts)
            .map(|(pairs, counts)| {
                let mut rows = Vec::with_capacity(pairs.len() * x.ncols());
                for &(t, j) in pairs {
                    let w = scale.map_or(1.0, |s| s[[t, j]]);
                    rows.extend(x.row(t).iter().map(|v| v * w));
                }
                Payload {
                    counts: counts.clone(),
                    rows,
                }
            })
            .collect()
    }
}

/// The experts' side: what each source rank sent per local expert.
#[derive(Debug)]
pub(crate) struct Received {
    counts: Vec<Vec<u32>>,
}

impl Received {
    /// Checks the messages of a dispatch: `local` counts each, rows matching them.
    fn check(got: &[Payload], local: usize, h: usize, layer: usize) -> Result<Self> {
        for (s, p) in got.iter().enumerate() {
            let n: usize = p.counts.iter().map(|&c| c as usize).sum();
            if p.counts.len() != local || p.rows.len() != n * h {
                return Err(Error::Invalid(format!(
                    "layer {layer}: rank {s} of the expert-parallel group sent {} counts and {} values, expected {local} counts (one per local expert) and {} x {h} values",
                    p.counts.len(),
                    p.rows.len(),
                    n
                )));
            }
        }
        Ok(Received {
            counts: got.iter().map(|p| p.counts.clone()).collect(),
        })
    }

    /// Rows of local expert `e`: each source's in source order.
    fn rows_of(&self, got: &[Payload], e: usize, h: usize) -> (usize, Vec<f32>) {
        let mut rows = Vec::new();
        for (p, counts) in got.iter().zip(&self.counts) {
            let off: usize = counts[..e].iter().map(|&c| c as usize).sum();
            rows.extend_from_slice(&p.rows[off * h..(off + counts[e] as usize) * h]);
        }
        (rows.len() / h.max(1), rows)
    }

    /// The experts' outputs `outs[e]` (rows as [`Received::rows_of`] ordered them) split back
    /// per source.
    fn split_back(&self, outs: &[Vec<f32>], h: usize) -> Vec<Payload> {
        let mut start = vec![0usize; outs.len()];
        self.counts
            .iter()
            .map(|counts| {
                let mut rows = Vec::new();
                for (e, &c) in counts.iter().enumerate() {
                    let n = c as usize * h;
                    rows.extend_from_slice(&outs[e][start[e]..start[e] + n]);
                    start[e] += n;
                }
                Payload {
                    counts: counts.clone(),
                    rows,
                }
            })
            .collect()
    }
}

/// What one local expert keeps from F to I (`None`: it received no rows).
type LocalF<T> = Option<(T, SwigluF<T>)>;

/// What an MoE layer's F keeps until its I.
#[derive(Debug)]
pub(crate) struct MoeF<T> {
    routing: Routing,
    dispatch: Dispatch,
    /// Per destination, the expert outputs of its pairs (the combine's rows).
    combined: Vec<Vec<f32>>,
    received: Received,
    local: Vec<LocalF<T>>,
    shared: Option<SwigluF<T>>,
}

/// What one local expert's dgrad keeps for its wgrad: its row count, input rows, output
/// gradient rows and SwiGLU gradients (`None`: it received no rows).
type LocalW<T> = Option<(usize, T, T, SwigluW<T>)>;

/// What an MoE layer's I keeps until its W (besides the layer's input and output gradient).
#[derive(Debug)]
pub(crate) struct MoeW<T> {
    dlogits: T,
    shared: Option<SwigluW<T>>,
    local: Vec<LocalW<T>>,
}

impl<T> MoeF<T> {
    pub(crate) fn tensors(&self) -> Vec<&T> {
        let mut v = Vec::new();
        for (x, f) in self.local.iter().flatten() {
            v.extend([x, &f.gate, &f.up, &f.act]);
        }
        if let Some(f) = &self.shared {
            v.extend([&f.gate, &f.up, &f.act]);
        }
        v
    }

    /// Host bytes kept: routing, and the combine's rows.
    pub(crate) fn host_bytes(&self) -> usize {
        let r = &self.routing;
        4 * (r.experts.len() + r.weights.len() + r.scores.len())
            + 4 * self.combined.iter().map(Vec::len).sum::<usize>()
    }
}

impl<T> MoeW<T> {
    pub(crate) fn tensors(&self) -> Vec<&T> {
        let mut v = vec![&self.dlogits];
        if let Some(w) = &self.shared {
            v.extend([&w.act, &w.dgate, &w.dup]);
        }
        for (_, x, dy, w) in self.local.iter().flatten() {
            v.extend([x, dy, &w.act, &w.dgate, &w.dup]);
        }
        v
    }
}

/// A `[rows, cols]` tensor copied to the host (row-major).
///
/// # Errors
/// [`Error::Invalid`] when the tensor does not hold `rows x cols` values.
pub(super) fn host<O: OpSet>(
    ops: &O,
    t: &O::Tensor,
    rows: usize,
    cols: usize,
) -> Result<Array2<f32>> {
    let v = ops.to_host(t);
    Array2::from_shape_vec((rows, cols), v)
        .map_err(|e| Error::Invalid(format!("a [{rows}, {cols}] tensor: {e}")))
}

/// A host array uploaded as a tensor of its shape.
///
/// # Errors
/// The backend's [`OpSet::upload_host`] (unsupported off the CPU backend).
pub(super) fn device<O: OpSet>(ops: &O, a: Array2<f32>) -> Result<O::Tensor> {
    let (r, c) = a.dim();
    let (v, _) = a.into_raw_vec_and_offset();
    ops.upload_host(v, r, c)
}

/// An MoE MLP's forward on `x [t, h]` (the normed residual): `y [t, h]` and what I needs.
pub(crate) fn moe_forward<O: OpSet>(
    ops: &O,
    p: &MoeMlp<O::Tensor>,
    x: &O::Tensor,
    (t, h): (usize, usize),
    ex: &mut Exchange<'_>,
) -> Result<(O::Tensor, MoeF<O::Tensor>)> {
    let (e, k) = (p.spec.experts as usize, p.spec.top_k as usize);
    let logits = ops.linear(x, &p.router.value, t, h, e)?;
    let routing = route(
        host(ops, &logits, t, e)?.view(),
        k,
        p.spec.gating,
        p.spec.normalise_top_k,
    );
    let xh = host(ops, x, t, h)?;
    let dispatch = Dispatch::new(&routing, e, ex.ep());
    let got = ex.all_to_all(Phase::Dispatch, dispatch.gather(xh.view(), None))?;
    let received = Received::check(&got, p.experts.len(), h, ex.layer)?;
    let mut outs = Vec::with_capacity(p.experts.len());
    let mut local = Vec::with_capacity(p.experts.len());
    for (i, expert) in p.experts.iter().enumerate() {
        let (n, rows) = received.rows_of(&got, i, h);
        if n == 0 {
            outs.push(Vec::new());
            local.push(None);
            continue;
        }
        let xe = ops.upload_host(rows, n, h)?;
        let (ye, f) = swiglu_forward(ops, expert, &xe, n, h)?;
        outs.push(ops.to_host(&ye));
        local.push(Some((xe, f)));
    }
    let combined: Vec<Vec<f32>> = ex
        .all_to_all(Phase::Combine, received.split_back(&outs, h))?
        .into_iter()
        .map(|p| p.rows)
        .collect();
    let mut y = Array2::<f32>::zeros((t, h));
    for (pairs, rows) in dispatch.pairs.iter().zip(&combined) {
        if rows.len() != pairs.len() * h {
            return Err(Error::Invalid(format!(
                "layer {}: the combine returned {} values for {} rows of {h}",
                ex.layer,
                rows.len(),
                pairs.len()
            )));
        }
        for (i, &(tok, j)) in pairs.iter().enumerate() {
            let w = routing.weights[[tok, j]];
            let row = &rows[i * h..(i + 1) * h];
            for (a, b) in y.row_mut(tok).iter_mut().zip(row) {
                *a += w * b;
            }
        }
    }
    let mut y = device(ops, y)?;
    let shared = match &p.shared {
        Some(s) => {
            let (ys, f) = swiglu_forward(ops, s, x, t, h)?;
            ops.add_inplace(&mut y, &ys, t * h)?;
            Some(f)
        }
        None => None,
    };
    Ok((
        y,
        MoeF {
            routing,
            dispatch,
            combined,
            received,
            local,
            shared,
        },
    ))
}

/// An MoE MLP's dgrad from `dy [t, h]`: `dx [t, h]` and what W needs.
pub(crate) fn moe_dgrad<O: OpSet>(
    ops: &O,
    p: &MoeMlp<O::Tensor>,
    c: MoeF<O::Tensor>,
    dy: &O::Tensor,
    (t, h): (usize, usize),
    ex: &mut Exchange<'_>,
) -> Result<(O::Tensor, MoeW<O::Tensor>)> {
    let (e, k) = (p.spec.experts as usize, p.spec.top_k as usize);
    let r = &c.routing;
    let dyh = host(ops, dy, t, h)?;
    // The routing weights' gradient: dy . y_e per pair.
    let mut dweights = Array2::<f32>::zeros((t, k));
    for (pairs, rows) in c.dispatch.pairs.iter().zip(&c.combined) {
        for (i, &(tok, j)) in pairs.iter().enumerate() {
            let row = &rows[i * h..(i + 1) * h];
            dweights[[tok, j]] = dyh.row(tok).iter().zip(row).map(|(a, b)| a * b).sum();
        }
    }
    let got = ex.all_to_all(
        Phase::GradDispatch,
        c.dispatch.gather(dyh.view(), Some(&r.weights)),
    )?;
    let again = Received::check(&got, p.experts.len(), h, ex.layer)?;
    if again.counts != c.received.counts {
        return Err(Error::Invalid(format!(
            "layer {} microbatch {}: the gradients' counts per expert differ from the forward's",
            ex.layer, ex.microbatch
        )));
    }
    let mut outs = Vec::with_capacity(p.experts.len());
    let mut local = Vec::with_capacity(p.experts.len());
    for (i, (expert, saved)) in p.experts.iter().zip(c.local).enumerate() {
        let Some((xe, f)) = saved else {
            outs.push(Vec::new());
            local.push(None);
            continue;
        };
        let (n, rows) = c.received.rows_of(&got, i, h);
        let dye = ops.upload_host(rows, n, h)?;
        let (dxe, w) = swiglu_dgrad(ops, expert, f, &dye, n, h)?;
        outs.push(ops.to_host(&dxe));
        local.push(Some((n, xe, dye, w)));
    }
    let back = ex.all_to_all(Phase::GradCombine, c.received.split_back(&outs, h))?;
    let mut dx = Array2::<f32>::zeros((t, h));
    for (pairs, p) in c.dispatch.pairs.iter().zip(&back) {
        if p.rows.len() != pairs.len() * h {
            return Err(Error::Invalid(format!(
                "layer {}: the gradient combine returned {} values for {} rows of {h}",
                ex.layer,
                p.rows.len(),
                pairs.len()
            )));
        }
        for (i, &(tok, _)) in pairs.iter().enumerate() {
            let row = &p.rows[i * h..(i + 1) * h];
            for (a, b) in dx.row_mut(tok).iter_mut().zip(row) {
                *a += b;
            }
        }
    }
    let dlogits = device(ops, route_backward(r, dweights.view()))?;
    let mut dx = device(ops, dx)?;
    ops.linear_dx_acc(&mut dx, &dlogits, &p.router.value, t, h, e)?;
    let shared = match (&p.shared, c.shared) {
        (Some(s), Some(f)) => {
            let (dxs, w) = swiglu_dgrad(ops, s, f, dy, t, h)?;
            ops.add_inplace(&mut dx, &dxs, t * h)?;
            Some(w)
        }
        _ => None,
    };
    Ok((
        dx,
        MoeW {
            dlogits,
            shared,
            local,
        },
    ))
}

/// An MoE MLP's wgrad: router, shared experts and the local experts; `x` and `dy` are the
/// layer's input and output gradient `[t, h]`.
pub(crate) fn moe_wgrad<O: OpSet>(
    ops: &O,
    p: &mut MoeMlp<O::Tensor>,
    w: MoeW<O::Tensor>,
    x: &O::Tensor,
    dy: &O::Tensor,
    (t, h): (usize, usize),
) -> Result<()> {
    let e = p.spec.experts as usize;
    ops.linear_dw(&mut p.router.grad, x, &w.dlogits, t, h, e)?;
    if let (Some(s), Some(sw)) = (p.shared.as_mut(), w.shared.as_ref()) {
        swiglu_wgrad(ops, s, x, dy, sw, t, h)?;
    }
    for (expert, saved) in p.experts.iter_mut().zip(&w.local) {
        if let Some((n, xe, dye, ew)) = saved {
            swiglu_wgrad(ops, expert, xe, dye, ew, *n, h)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::{CpuOps, CpuStage};
    use crate::kernels::tests::randn;
    use crate::kernels::{matmul, swiglu, swiglu_backward};
    use crate::model::layers::{Layer, Mlp};
    use crate::moe::{Expert, experts_dgrad, experts_forward, experts_wgrad};
    use flatpipe_profiles::ModelSpec;
    use flatpipe_simulator::costs::Recompute;
    use rand::SeedableRng;
    use rand::rngs::ChaCha8Rng;

    fn moe_stage(gating: &str) -> CpuStage {
        let m = ModelSpec::from_yaml(
            &format!("name: t\ndtype: fp32\nlayers:\n  - {{kind: embedding, vocab: 32, hidden: 16}}\n  - {{kind: decoder, count: 1, hidden: 16, heads: 4, kv_heads: 2, moe: {{experts: 4, top_k: 2, expert_ffn: 8, shared_experts: 1, gating: {gating}}}}}\n  - {{kind: head, vocab: 32, hidden: 16}}\n"),
            "test",
        )
        .unwrap();
        CpuStage::new(&m, 1..2, 3, Recompute::None).unwrap()
    }

    fn max_diff(a: &Array2<f32>, b: &Array2<f32>) -> f32 {
        assert_eq!(a.dim(), b.dim());
        a.iter().zip(b).fold(0.0, |m, (x, y)| m.max((x - y).abs()))
    }

    /// The op-set MoE MLP (dispatch, local experts, combine, and their backward through the
    /// exchange) against the host kernels of [`crate::moe`] (checked against finite
    /// differences there) on the same weights: forward, input, router and every weight
    /// gradient agree to fp32 rounding.
    #[test]
    fn the_layer_matches_the_moe_kernels() {
        for gating in ["softmax", "sigmoid"] {
            let mut stage = moe_stage(gating);
            let Layer::Decoder(d) = &mut stage.layers[0].1 else {
                unreachable!()
            };
            let Mlp::Moe(m) = &mut d.mlp else {
                unreachable!()
            };
            let m = &mut **m;
            // Weights of unit scale, so the outputs are far above rounding.
            for p in m.routed_mut() {
                p.value.mapv_inplace(|v| v * 30.0);
            }
            for p in m.replicated_mut() {
                p.value.mapv_inplace(|v| v * 30.0);
            }
            let (t, h) = (9, 16);
            let mut rng = ChaCha8Rng::seed_from_u64(4);
            let x = randn(&mut rng, (t, h), 1.0);
            let dy = randn(&mut rng, (t, h), 1.0);
            let ops = CpuOps;
            let (y, c) = moe_forward(&ops, m, &x, (t, h), &mut Exchange::solo()).unwrap();
            let (dx, w) = moe_dgrad(&ops, m, c, &dy, (t, h), &mut Exchange::solo()).unwrap();
            moe_wgrad(&ops, m, w, &x, &dy, (t, h)).unwrap();

            // The reference: the host kernels, expert by expert.
            let r = route(
                matmul(x.view(), m.router.value.view()).view(),
                2,
                m.spec.gating,
                true,
            );
            let experts: Vec<Expert> = m
                .experts
                .iter()
                .map(|e| Expert {
                    gate: e.w1.value.clone(),
                    up: e.w3.value.clone(),
                    down: e.w2.value.clone(),
                })
                .collect();
            let (mut y_ref, saved) = experts_forward(x.view(), &r, &experts);
            let s = m.shared.as_ref().unwrap();
            let (sg, su) = (
                matmul(x.view(), s.w1.value.view()),
                matmul(x.view(), s.w3.value.view()),
            );
            let sa = swiglu(sg.view(), su.view());
            y_ref += &matmul(sa.view(), s.w2.value.view());
            let scale = y_ref.iter().fold(0.0f32, |a, v| a.max(v.abs()));
            assert!(max_diff(&y, &y_ref) <= 1e-5 * scale, "{gating}: forward");

            let (mut dx_ref, dweights, grads) = experts_dgrad(dy.view(), &r, &experts, &saved);
            let dlogits = route_backward(&r, dweights.view());
            dx_ref += &matmul(dlogits.view(), m.router.value.t());
            let (dsg, dsu) = swiglu_backward(
                matmul(dy.view(), s.w2.value.t()).view(),
                sg.view(),
                su.view(),
            );
            dx_ref += &matmul(dsg.view(), s.w1.value.t());
            dx_ref += &matmul(dsu.view(), s.w3.value.t());
            let scale = dx_ref.iter().fold(0.0f32, |a, v| a.max(v.abs()));
            assert!(max_diff(&dx, &dx_ref) <= 1e-5 * scale, "{gating}: dgrad");

            let mut dexperts: Vec<Expert> = experts
                .iter()
                .map(|e| Expert {
                    gate: Array2::zeros(e.gate.dim()),
                    up: Array2::zeros(e.up.dim()),
                    down: Array2::zeros(e.down.dim()),
                })
                .collect();
            experts_wgrad(&saved, &grads, &mut dexperts);
            let router_ref = matmul(x.t(), dlogits.view());
            let check = |got: &Array2<f32>, want: &Array2<f32>, what: &str| {
                let scale = want.iter().fold(1e-6f32, |a, v| a.max(v.abs()));
                assert!(max_diff(got, want) <= 1e-5 * scale, "{gating}: {what}");
            };
            check(&m.router.grad, &router_ref, "router");
            for (i, (e, de)) in m.experts.iter().zip(&dexperts).enumerate() {
                check(&e.w1.grad, &de.gate, &format!("expert {i} w1"));
                check(&e.w3.grad, &de.up, &format!("expert {i} w3"));
                check(&e.w2.grad, &de.down, &format!("expert {i} w2"));
            }
            check(&s.w2.grad, &matmul(sa.t(), dy.view()), "shared w2");
            check(&s.w1.grad, &matmul(x.t(), dsg.view()), "shared w1");
        }
    }

    /// Two ranks of an expert-parallel group, each with its half of the experts and its own
    /// tokens, give each token the output and gradients of the whole layer on one rank.
    #[test]
    fn two_ranks_of_a_group_match_one_rank() {
        use crate::model::experts::ExpertShard;
        let m = ModelSpec::from_yaml(
            "name: t\ndtype: fp32\nlayers:\n  - {kind: embedding, vocab: 32, hidden: 16}\n  - {kind: decoder, count: 1, hidden: 16, heads: 4, kv_heads: 2, moe: {experts: 4, top_k: 2, expert_ffn: 8}}\n  - {kind: head, vocab: 32, hidden: 16}\n",
            "test",
        )
        .unwrap();
        fn moe_of(st: &CpuStage) -> &MoeMlp<Array2<f32>> {
            let Layer::Decoder(d) = &st.layers[0].1 else {
                unreachable!()
            };
            let Mlp::Moe(m) = &d.mlp else { unreachable!() };
            m
        }
        let whole = CpuStage::new(&m, 1..2, 3, Recompute::None).unwrap();
        let halves: Vec<CpuStage> = (0..2)
            .map(|index| {
                CpuStage::sharded(&m, 1..2, 3, Recompute::None, ExpertShard { index, ep: 2 })
                    .unwrap()
            })
            .collect();
        let mut rng = ChaCha8Rng::seed_from_u64(8);
        let xs = [randn(&mut rng, (5, 16), 1.0), randn(&mut rng, (3, 16), 1.0)];
        let abort = Arc::new(AtomicBool::new(false));
        let links = ExpertLink::group(2, &abort);
        let outs: Vec<Array2<f32>> = std::thread::scope(|scope| {
            let hs: Vec<_> = links
                .into_iter()
                .zip(&halves)
                .zip(&xs)
                .map(|((mut link, st), x)| {
                    let p = moe_of(st);
                    scope.spawn(move || {
                        let mut ex = Exchange {
                            link: Some(&mut link),
                            layer: 1,
                            microbatch: 0,
                            forward_only: true,
                        };
                        moe_forward(&CpuOps, p, x, (x.nrows(), 16), &mut ex)
                            .unwrap()
                            .0
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let p = moe_of(&whole);
        for (x, y) in xs.iter().zip(&outs) {
            let (want, _) =
                moe_forward(&CpuOps, p, x, (x.nrows(), 16), &mut Exchange::solo()).unwrap();
            assert!(max_diff(y, &want) <= 1e-6, "{y} vs {want}");
        }
    }
}
