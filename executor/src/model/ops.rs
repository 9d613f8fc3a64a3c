//! The op set: the kernels a backend provides to the model ([`OpSet`]).

use crate::kernels::AttnDims;
use crate::worker::{AdamW, CopyStamps, DeviceClock, LossSums};
use crate::{Error, MicrobatchData, Result};
use std::fmt::Debug;
use std::ops::Range;

/// The kernels a backend provides to the model. Every tensor is fp32, row-major `[rows, cols]`;
/// shapes are passed explicitly (`t` tokens, `h` hidden, `din` / `dout` of a linear layer) so a
/// backend whose buffers are flat needs no layout of its own. Kernels may run asynchronously
/// (CUDA enqueues on the rank's stream); a result is ready for the next kernel of the same op
/// set.
pub trait OpSet: Send + Debug + 'static {
    /// A tensor on the device.
    type Tensor: Debug + Send;
    /// A `[T, H]` tensor that crosses stages (CUDA: shared with the rank's transfer list).
    type Hidden: Debug + Send;
    /// A microbatch's token ids, labels, loss weights and `cu_seqlens` on the device.
    type Data: Debug + Send;
    /// The head's loss sums as the cross-entropy kernel leaves them.
    type Loss: Debug + Send;
    /// Whether losses stay on the device until the step ends ([`crate::worker::StageOutput::LossPending`]).
    const DEFERRED_LOSS: bool;

    /// Moves a microbatch's data to the device.
    ///
    /// # Errors
    /// A backend failure (out of memory).
    fn upload_data(&self, d: &MicrobatchData) -> Result<Self::Data>;
    /// Tokens `T` of a microbatch.
    fn tokens(d: &Self::Data) -> usize;
    /// The context-parallel share a microbatch is ([`crate::data::MicrobatchData::cp`]);
    /// default none (a backend without context parallelism).
    fn cp_share(d: &Self::Data) -> Option<&crate::data::CpShare> {
        let _ = d;
        None
    }
    /// Wraps a `[T, H]` tensor of `len` values for a transfer.
    fn hidden(&self, t: Self::Tensor, len: usize) -> Self::Hidden;
    /// The tensor of a transferred hidden state.
    fn tensor(h: &Self::Hidden) -> &Self::Tensor;
    /// Values of a hidden state (`T * H`).
    fn hidden_len(h: &Self::Hidden) -> usize;
    /// Bytes of a tensor.
    fn bytes(t: &Self::Tensor) -> usize;
    /// Marks a stage's output ready for another rank to read (CUDA records an event).
    ///
    /// # Errors
    /// A backend failure.
    fn ready(&self, h: Self::Hidden) -> Result<Self::Hidden> {
        Ok(h)
    }
    /// Takes a hidden state another rank sent ([`crate::worker::StageWorker::import`]).
    ///
    /// # Errors
    /// A backend failure.
    fn import(&self, h: Self::Hidden) -> Result<(Self::Hidden, CopyStamps)> {
        Ok((h, None))
    }
    /// Waits for everything enqueued (after the optimizer and the gradient all-reduce).
    ///
    /// # Errors
    /// A backend failure.
    fn synchronize(&self) -> Result<()> {
        Ok(())
    }
    /// The rank's device clock, for a backend that runs asynchronously.
    fn clock(&mut self) -> Option<&mut dyn DeviceClock> {
        None
    }

    /// Zeros `[rows, cols]`.
    ///
    /// # Errors
    /// A backend failure (out of memory).
    fn zeros(&self, rows: usize, cols: usize) -> Result<Self::Tensor>;
    /// Sets `t` to zero.
    ///
    /// # Errors
    /// A backend failure.
    fn fill_zero(&self, t: &mut Self::Tensor) -> Result<()>;
    /// Calls `f` on `t`'s values (through the host where the device's memory is not the host's).
    ///
    /// # Errors
    /// A backend failure.
    fn visit(&self, t: &mut Self::Tensor, f: &mut dyn FnMut(&mut [f32])) -> Result<()>;
    /// `t`'s values on the host; NaN where they cannot be read (the error is logged).
    fn to_host(&self, t: &Self::Tensor) -> Vec<f32>;
    /// A `[rows, cols]` tensor of `values` (row-major) from the host. Default: unsupported
    /// (mixture-of-experts layers need it, [`OpSet::supports_moe`]).
    ///
    /// # Errors
    /// [`Error::Unsupported`] on a backend without it; a backend failure.
    fn upload_host(&self, values: Vec<f32>, rows: usize, cols: usize) -> Result<Self::Tensor> {
        let _ = (values, rows, cols);
        Err(Error::Unsupported(
            "host tensors (mixture-of-experts layers) on this backend".into(),
        ))
    }
    /// Whether the backend runs mixture-of-experts layers (their routing and token exchange
    /// run on the host, [`crate::model::experts`]). Default: no.
    fn supports_moe(&self) -> bool {
        false
    }
    /// `Σ x²` in f64.
    ///
    /// # Errors
    /// A backend failure.
    fn sum_squares(&self, t: &Self::Tensor) -> Result<f64>;
    /// One AdamW update of `value` with `grad * grad_scale` and moments `m`, `v` at step `t`.
    ///
    /// # Errors
    /// A backend failure.
    fn adamw(
        &self,
        state: (
            &mut Self::Tensor,
            &Self::Tensor,
            &mut Self::Tensor,
            &mut Self::Tensor,
        ),
        opt: &AdamW,
        t: u64,
        grad_scale: f32,
    ) -> Result<()>;

    /// `x [t, din] @ w [din, dout]`.
    ///
    /// # Errors
    /// A backend failure.
    fn linear(
        &self,
        x: &Self::Tensor,
        w: &Self::Tensor,
        t: usize,
        din: usize,
        dout: usize,
    ) -> Result<Self::Tensor>;
    /// `dy [t, dout] @ w^T` -> `[t, din]` (dgrad of a linear layer).
    ///
    /// # Errors
    /// A backend failure.
    fn linear_dx(
        &self,
        dy: &Self::Tensor,
        w: &Self::Tensor,
        t: usize,
        din: usize,
        dout: usize,
    ) -> Result<Self::Tensor>;
    /// `dx += dy [t, dout] @ w^T`.
    ///
    /// # Errors
    /// A backend failure.
    #[allow(clippy::too_many_arguments)]
    fn linear_dx_acc(
        &self,
        dx: &mut Self::Tensor,
        dy: &Self::Tensor,
        w: &Self::Tensor,
        t: usize,
        din: usize,
        dout: usize,
    ) -> Result<()>;
    /// `dw [din, dout] += x^T @ dy` (wgrad of a linear layer).
    ///
    /// # Errors
    /// A backend failure.
    #[allow(clippy::too_many_arguments)]
    fn linear_dw(
        &self,
        dw: &mut Self::Tensor,
        x: &Self::Tensor,
        dy: &Self::Tensor,
        t: usize,
        din: usize,
        dout: usize,
    ) -> Result<()>;
    /// `y += x` over `n` values.
    ///
    /// # Errors
    /// A backend failure.
    fn add_inplace(&self, y: &mut Self::Tensor, x: &Self::Tensor, n: usize) -> Result<()>;
    /// RMSNorm of `x [t, h]` with weight `g [h]`: `(y, xhat = x * rstd, rstd [t])`.
    ///
    /// # Errors
    /// A backend failure.
    #[allow(clippy::type_complexity)]
    fn rmsnorm(
        &self,
        x: &Self::Tensor,
        g: &Self::Tensor,
        t: usize,
        h: usize,
    ) -> Result<(Self::Tensor, Self::Tensor, Self::Tensor)>;
    /// RMSNorm dgrad, plus `residual` when given (the residual stream's gradient).
    ///
    /// # Errors
    /// A backend failure.
    #[allow(clippy::too_many_arguments)]
    fn rmsnorm_dx(
        &self,
        dy: &Self::Tensor,
        xhat: &Self::Tensor,
        rstd: &Self::Tensor,
        g: &Self::Tensor,
        residual: Option<&Self::Tensor>,
        t: usize,
        h: usize,
    ) -> Result<Self::Tensor>;
    /// `dg += Σ_t dy * xhat` (RMSNorm wgrad).
    ///
    /// # Errors
    /// A backend failure.
    fn rmsnorm_dg(
        &self,
        dg: &mut Self::Tensor,
        dy: &Self::Tensor,
        xhat: &Self::Tensor,
        t: usize,
        h: usize,
    ) -> Result<()>;
    /// `xhat [t, h] * g [h]` per row (an RMSNorm's output again from its `xhat`).
    ///
    /// # Errors
    /// A backend failure; [`Error::Unsupported`] where the backend lacks the kernel.
    fn scale_rows(
        &self,
        xhat: &Self::Tensor,
        g: &Self::Tensor,
        t: usize,
        h: usize,
    ) -> Result<Self::Tensor>;
    /// Rotary embedding of `x [t, heads * head_dim]` in place (`inverse`: its transpose, for
    /// the backward), positions restarting in every sequence (a chunk's starting at its
    /// offset, [`MicrobatchData::chunk`]).
    ///
    /// # Errors
    /// A backend failure.
    fn rope(
        &self,
        x: &mut Self::Tensor,
        data: &Self::Data,
        heads: usize,
        head_dim: usize,
        inverse: bool,
    ) -> Result<()>;
    /// Varlen causal grouped-query attention: `(o [t, heads * d], lse [t, heads])`. For a chunk
    /// of a longer sequence ([`MicrobatchData::chunk`] at offset `o`), `k` and `v` hold the
    /// `o` earlier rows of its sequence then its own `t`.
    ///
    /// # Errors
    /// A backend failure.
    fn attention(
        &self,
        q: &Self::Tensor,
        k: &Self::Tensor,
        v: &Self::Tensor,
        data: &Self::Data,
        dims: AttnDims,
    ) -> Result<(Self::Tensor, Self::Tensor)>;
    /// Attention dgrad: `(dq, dk, dv)` from `dout` and the forward's `(q, k, v, o, lse)`.
    ///
    /// # Errors
    /// A backend failure.
    #[allow(clippy::type_complexity)]
    fn attention_backward(
        &self,
        dout: &Self::Tensor,
        saved: (
            &Self::Tensor,
            &Self::Tensor,
            &Self::Tensor,
            &Self::Tensor,
            &Self::Tensor,
        ),
        data: &Self::Data,
        dims: AttnDims,
    ) -> Result<(Self::Tensor, Self::Tensor, Self::Tensor)>;
    /// `[rows_0 + rows_1 + .., cols]`: the parts one under the other (a chunk's keys after the
    /// earlier chunks'). Default: unsupported (chunked sequences need it).
    ///
    /// # Errors
    /// [`Error::Unsupported`] on a backend without it; a backend failure.
    fn concat_rows(&self, parts: &[&Self::Tensor], cols: usize) -> Result<Self::Tensor> {
        let _ = (parts, cols);
        Err(Error::Unsupported(
            "chunked sequences (keys of earlier chunks) run on the CPU backend only".into(),
        ))
    }
    /// Rows `rows` of a `[_, cols]` tensor, as a tensor of their own. Default: unsupported.
    ///
    /// # Errors
    /// [`Error::Unsupported`] on a backend without it; a backend failure.
    fn slice_rows(
        &self,
        t: &Self::Tensor,
        rows: Range<usize>,
        cols: usize,
    ) -> Result<Self::Tensor> {
        let _ = (t, rows, cols);
        Err(Error::Unsupported(
            "chunked sequences (keys of earlier chunks) run on the CPU backend only".into(),
        ))
    }
    /// `silu(gate) * up` over `n` values.
    ///
    /// # Errors
    /// A backend failure.
    fn swiglu(&self, gate: &Self::Tensor, up: &Self::Tensor, n: usize) -> Result<Self::Tensor>;
    /// SwiGLU dgrad over `n` values: `(dgate, dup)`.
    ///
    /// # Errors
    /// A backend failure.
    fn swiglu_backward(
        &self,
        d: &Self::Tensor,
        gate: &Self::Tensor,
        up: &Self::Tensor,
        n: usize,
    ) -> Result<(Self::Tensor, Self::Tensor)>;
    /// Rows `ids` of `table [vocab, h]`.
    ///
    /// # Errors
    /// A backend failure.
    fn embedding(&self, table: &Self::Tensor, data: &Self::Data, h: usize) -> Result<Self::Tensor>;
    /// `dtable[ids[t]] += dy[t]`.
    ///
    /// # Errors
    /// A backend failure.
    fn embedding_backward(
        &self,
        dtable: &mut Self::Tensor,
        dy: &Self::Tensor,
        data: &Self::Data,
        h: usize,
    ) -> Result<()>;
    /// Weighted cross-entropy of `logits [t, vocab]` against the labels: the loss sums and the
    /// rows' log-sum-exps.
    ///
    /// # Errors
    /// A backend failure.
    fn cross_entropy(
        &self,
        logits: &Self::Tensor,
        data: &Self::Data,
        vocab: usize,
    ) -> Result<(Self::Loss, Self::Tensor)>;
    /// Cross-entropy dgrad: `dlogits [t, vocab]`.
    ///
    /// # Errors
    /// A backend failure.
    fn cross_entropy_backward(
        &self,
        logits: &Self::Tensor,
        lse: &Self::Tensor,
        data: &Self::Data,
        vocab: usize,
    ) -> Result<Self::Tensor>;
    /// The loss sums on the host.
    ///
    /// # Errors
    /// A backend failure.
    fn read_loss(&self, loss: &Self::Loss, tokens: u64) -> Result<LossSums>;
}
