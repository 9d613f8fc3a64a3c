//! What a backend provides to the interpreter: one [`StageWorker`] per pipeline stage.
//!
//! A stage is built from its layer range alone. Its input and output say what they are: token
//! ids into the first stage ([`StageInput::Tokens`], read from the microbatch's data), hidden
//! states `[T, H]` between stages ([`StageInput::Hidden`] / [`StageOutput::Hidden`]), and loss
//! sums out of the last ([`StageOutput::Loss`]).

use crate::data::MicrobatchData;
use crate::{Error, Result};

/// A stage worker used out of order or with the wrong input: one wording for every backend,
/// reported as [`Error::Invalid`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub(crate) enum Misuse {
    #[error("the embedding takes token ids")]
    EmbeddingWantsTokens,
    #[error("token ids go only into the stage holding the embedding (layer 0)")]
    TokensOnlyIntoEmbedding,
    #[error("nothing follows the head (the last layer)")]
    NothingAfterHead,
    #[error("microbatch {0} ran F twice on the same stage before its backward")]
    ForwardTwice(u32),
    #[error("I of microbatch {0} before its F")]
    DgradBeforeForward(u32),
    #[error("I of microbatch {0}: no output gradient")]
    NoOutputGradient(u32),
    #[error("W of microbatch {0} before its I")]
    WgradBeforeDgrad(u32),
    #[error("saved activations of another layer kind")]
    ActivationsOfAnotherKind,
    #[error("saved gradients of another layer kind")]
    GradientsOfAnotherKind,
    #[error("a stage has no layers")]
    NoLayers,
    #[error("chunk {index} of sequence {sequence} (microbatch {mb}): {why}")]
    ChunkOrder {
        mb: u32,
        sequence: u32,
        index: u32,
        why: &'static str,
    },
}

impl From<Misuse> for Error {
    fn from(m: Misuse) -> Self {
        Error::Invalid(m.to_string())
    }
}

/// What a stage's forward takes.
#[derive(Debug)]
pub enum StageInput<H> {
    /// The first stage reads the microbatch's token ids `[T]`.
    Tokens,
    /// Hidden states `[T, H]` from the previous stage.
    Hidden(H),
}

/// What a stage's forward produces.
#[derive(Debug)]
pub enum StageOutput<H> {
    /// Hidden states `[T, H]` for the next stage.
    Hidden(H),
    /// The last stage's loss sums over the microbatch.
    Loss(LossSums),
    /// The last stage's loss, still on the device: [`StageWorker::take_losses`] reads it after
    /// the step (reading it now would make the host wait for the GPU inside the step).
    LossPending,
}

/// The `(start, end)` [`DeviceClock`] stamps of a copy between ranks, when the backend timed it.
pub type CopyStamps = Option<(usize, usize)>;

/// A clock on the device for backends whose kernels run asynchronously (CUDA): the host's time
/// when an action is enqueued says nothing of when it runs, so actions are timed with events
/// recorded on the rank's stream.
pub trait DeviceClock {
    /// Waits for the rank's stream to be idle and starts the step's clock.
    ///
    /// # Errors
    /// A backend failure.
    fn start(&mut self) -> Result<()>;
    /// Records a timestamp on the rank's stream, after the work enqueued so far; returns its
    /// index.
    ///
    /// # Errors
    /// A backend failure.
    fn stamp(&mut self) -> Result<usize>;
    /// Waits for the rank's stream and returns every stamp's time in nanoseconds after `t0`
    /// (the interpreter's step start, host clock), in stamp order.
    ///
    /// # Errors
    /// A backend failure.
    fn finish(&mut self, t0: std::time::Instant) -> Result<Vec<u64>>;
}

/// Loss sums of one microbatch (f64 accumulations of fp32 token losses).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct LossSums {
    /// `Σ_t weight_t * loss_t`: this microbatch's share of the step's loss.
    pub weighted: f64,
    /// `Σ_t loss_t` (nats).
    pub sum: f64,
    /// Tokens `T`.
    pub tokens: u64,
}

/// AdamW hyper-parameters (decoupled weight decay, Loshchilov and Hutter 2019).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamW {
    /// Learning rate.
    pub lr: f32,
    /// First-moment decay.
    pub beta1: f32,
    /// Second-moment decay.
    pub beta2: f32,
    /// Denominator epsilon.
    pub eps: f32,
    /// Decoupled weight decay.
    pub weight_decay: f32,
}

impl Default for AdamW {
    fn default() -> Self {
        AdamW {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
        }
    }
}

impl AdamW {
    /// One AdamW update of `param` with gradient `grad * grad_scale` and moments `m`, `v` at
    /// step `t >= 1`: `m = b1 m + (1-b1) g`, `v = b2 v + (1-b2) g²`,
    /// `p -= lr (m / (1-b1^t) / (sqrt(v / (1-b2^t)) + eps) + wd p)`.
    pub fn update(
        &self,
        param: &mut [f32],
        grad: &[f32],
        m: &mut [f32],
        v: &mut [f32],
        t: u64,
        grad_scale: f32,
    ) {
        let bc1 = 1.0 - self.beta1.powi(t as i32);
        let bc2 = 1.0 - self.beta2.powi(t as i32);
        for (((p, &g), m), v) in param
            .iter_mut()
            .zip(grad)
            .zip(m.iter_mut())
            .zip(v.iter_mut())
        {
            let g = g * grad_scale;
            *m = self.beta1 * *m + (1.0 - self.beta1) * g;
            *v = self.beta2 * *v + (1.0 - self.beta2) * g * g;
            let update = (*m / bc1) / ((*v / bc2).sqrt() + self.eps);
            *p -= self.lr * (update + self.weight_decay * *p);
        }
    }
}

/// One pipeline stage on one rank: its layers' parameters, gradients, optimizer state and the
/// activations it keeps between F, I and W of each microbatch.
///
/// The interpreter calls F, then I, then W (or B = I + W) for every microbatch, in the order the
/// schedule says; `Fo` is a forward that keeps nothing.
pub trait StageWorker: Send {
    /// The hidden-state tensor passed between stages (`[T, H]`).
    type Hidden: Send;

    /// Hidden size H.
    fn hidden_size(&self) -> usize;

    /// Number of elements of a hidden tensor (`T * H`), to check a transfer against the plan.
    fn hidden_len(h: &Self::Hidden) -> usize;

    /// Forward of microbatch `mb` (`keep`: save what the backward needs; false for `Fo`).
    ///
    /// # Errors
    /// A wrong input kind for this stage, or a backend failure.
    fn forward(
        &mut self,
        mb: u32,
        data: &MicrobatchData,
        input: StageInput<Self::Hidden>,
        keep: bool,
    ) -> Result<StageOutput<Self::Hidden>>;

    /// dgrad (I) of microbatch `mb`: from the output gradient (`None` on the last stage, whose
    /// gradient starts at its loss) to the input gradient (`None` on the first stage, whose input
    /// is token ids). Keeps what W needs.
    ///
    /// # Errors
    /// No saved forward for `mb`, or a backend failure.
    fn backward_input(
        &mut self,
        mb: u32,
        data: &MicrobatchData,
        grad: Option<Self::Hidden>,
    ) -> Result<Option<Self::Hidden>>;

    /// wgrad (W) of microbatch `mb`: accumulates the weight gradients and frees what I kept.
    ///
    /// # Errors
    /// No saved dgrad for `mb`, or a backend failure.
    fn backward_weight(&mut self, mb: u32, data: &MicrobatchData) -> Result<()>;

    /// Sets every gradient to zero (start of a step).
    ///
    /// # Errors
    /// A backend failure (the gradients would otherwise carry the last step's).
    fn zero_grads(&mut self) -> Result<()>;

    /// Calls `f` on every gradient buffer but the routed experts', in a fixed order (for the
    /// data-parallel all-reduce).
    ///
    /// # Errors
    /// A backend failure reading or writing a gradient.
    fn visit_grads(&mut self, f: &mut dyn FnMut(&mut [f32])) -> Result<()>;

    /// `Σ g²` over this stage's gradients but the routed experts', in f64.
    ///
    /// # Errors
    /// A backend failure.
    fn grad_sq_norm(&self) -> Result<f64>;

    /// Calls `f` on every routed expert's gradient buffer this stage holds, in a fixed order
    /// (they are split over the expert-parallel group and reduced over the
    /// expert-data-parallel group; [`StageWorker::visit_grads`] visits every other gradient).
    /// Default: none.
    ///
    /// # Errors
    /// A backend failure reading or writing a gradient.
    fn visit_expert_grads(&mut self, f: &mut dyn FnMut(&mut [f32])) -> Result<()> {
        let _ = f;
        Ok(())
    }

    /// `Σ g²` over the routed experts' gradients this stage holds. Default: 0.
    ///
    /// # Errors
    /// A backend failure.
    fn expert_grad_sq_norm(&self) -> Result<f64> {
        Ok(0.0)
    }

    /// Another rank of the step failed: stop waiting on the expert-parallel group. Default:
    /// nothing to stop.
    fn abort_step(&self) {}

    /// Whether this stage exchanges tokens with an expert-parallel group (an overlapped pair
    /// with such a stage runs its halves around each other's all-to-alls). Default: no.
    fn exchanges_tokens(&self) -> bool {
        false
    }

    /// The compute stream this stage's all-to-alls let go while they wait (`None`: they hold
    /// the rank's only thread anyway). Default: ignored.
    fn set_compute_stream(&mut self, stream: Option<std::sync::Arc<ComputeStream>>) {
        let _ = stream;
    }

    /// The expert-parallel all-to-alls this stage ran since the last call. Default: none.
    fn take_all_to_alls(&mut self) -> Vec<AllToAllSpan> {
        Vec::new()
    }

    /// One optimizer step at step number `t >= 1` with gradients scaled by `grad_scale`
    /// (clipping); done when it returns (a GPU waits for it).
    ///
    /// # Errors
    /// A backend failure.
    fn optimizer_step(&mut self, opt: &AdamW, t: u64, grad_scale: f32) -> Result<()>;

    /// `(name, values)` of every parameter, names as torchtitan's (`layers.3.attention.wq.weight`).
    fn named_params(&self) -> Vec<(String, Vec<f32>)>;

    /// `(name, values)` of every gradient, named like [`StageWorker::named_params`].
    fn named_grads(&self) -> Vec<(String, Vec<f32>)>;

    /// Microbatches whose activations are still held (F done, W not yet), for checks.
    fn held_microbatches(&self) -> usize;

    /// Called once per step before the rank's first action, with the step's training and
    /// forward-only microbatches: a GPU uploads their token ids, labels and weights here, so no
    /// host-to-device copy runs inside the step.
    ///
    /// # Errors
    /// A backend failure.
    fn prepare_step(
        &mut self,
        _train: &[MicrobatchData],
        _forward_only: &[MicrobatchData],
    ) -> Result<()> {
        Ok(())
    }

    /// Takes a tensor another rank sent, before the action that reads it starts. The CPU
    /// backend uses the sender's buffer itself (threads share memory); CUDA copies it device to
    /// device on this rank's copy stream, makes the compute stream wait for the copy, and
    /// returns the copy's start and end [`DeviceClock`] stamps.
    ///
    /// # Errors
    /// A backend failure.
    fn import(&mut self, h: Self::Hidden) -> Result<(Self::Hidden, CopyStamps)> {
        Ok((h, None))
    }

    /// The losses this stage returned as [`StageOutput::LossPending`] since the last call, as
    /// `(microbatch, forward-only, sums)`.
    ///
    /// # Errors
    /// A backend failure.
    fn take_losses(&mut self) -> Result<Vec<(u32, bool, LossSums)>> {
        Ok(Vec::new())
    }

    /// The device clock of this stage's rank, for backends that run asynchronously; `None`: the
    /// host clock times actions exactly.
    fn device_clock(&mut self) -> Option<&mut dyn DeviceClock> {
        None
    }
}

/// Which exchange of a layer a message belongs to: an MoE layer's token all-to-alls, or a
/// context-parallel group's keys and values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Phase {
    /// F: token rows to the experts' ranks.
    Dispatch,
    /// F: expert outputs back to the tokens' ranks.
    Combine,
    /// I: output gradients to the experts' ranks.
    GradDispatch,
    /// I: input gradients back to the tokens' ranks.
    GradCombine,
    /// F: a context-parallel group's keys and values, gathered.
    KeysValues,
    /// I: the same keys and values gathered again (not kept from F).
    KeysValuesAgain,
    /// I: key and value gradients to the GPUs whose rows they are.
    KeyValueGrads,
}

/// One all-to-all as this rank saw it: from its first send to its last receive.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AllToAllSpan {
    /// Global layer index.
    pub layer: usize,
    /// Microbatch.
    pub microbatch: u32,
    /// A forward-only microbatch's.
    pub forward_only: bool,
    /// Which exchange.
    pub phase: Phase,
    /// Values sent to other ranks (rows x H, f32).
    pub values_sent: usize,
    /// First send.
    pub start: std::time::Instant,
    /// When the last member of the group entered it: from `start` to here this rank waited
    /// for a slower partner, from here to `end` the exchange itself ran.
    pub ready: std::time::Instant,
    /// Last receive.
    pub end: std::time::Instant,
}

/// A rank's compute stream, shared by the two halves of an overlapped pair that run on two
/// threads: a half holds it while it computes and lets it go while it waits on an all-to-all,
/// as one GPU stream runs one half's kernels while the other half's tokens are on the wire
/// (DualPipe; Megatron-LM's combined 1F1B). The rank never computes two things at once, so the
/// overlap hides communication and adds no compute.
#[derive(Debug, Default)]
pub struct ComputeStream {
    busy: std::sync::Mutex<bool>,
    free: std::sync::Condvar,
}

impl ComputeStream {
    /// Waits until the stream is free and takes it.
    pub fn acquire(&self) {
        let mut busy = self
            .busy
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        while *busy {
            busy = self
                .free
                .wait(busy)
                .unwrap_or_else(std::sync::PoisonError::into_inner);
        }
        *busy = true;
    }

    /// Lets the stream go.
    pub fn release(&self) {
        *self
            .busy
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = false;
        self.free.notify_one();
    }
}
