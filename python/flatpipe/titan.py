"""Pipeline stages from torchtitan's Llama 3 model, for ``flatpipe.torch``.

:func:`stages` cuts a ``torchtitan.models.llama3.Transformer`` (torchtitan 0.2) into the stages a
pipeline rank runs, by flatpipe's layer numbering: 0 the token embedding, ``1..L`` the
transformer blocks, ``L + 1`` the final norm with the output projection. Each stage takes its
modules from the unsplit model.

A stage runs a flat microbatch as one row of ``T`` tokens, with positions restarting at each
``cu_seqlens`` boundary (torchtitan's ``positions`` index its RoPE cache) and a document mask
(causal within a sequence, never across one) as FlexAttention's ``BlockMask``: the model must be
built with ``attn_type="flex"`` (``"sdpa"`` has no document mask; ``"varlen"`` is not wired
yet). On CUDA the blocks run torchtitan's compiled FlexAttention. FlexAttention has no backward
on the CPU, so on the CPU a stage runs PyTorch's SDPA under the same mask, materialised as a
``T x T`` boolean matrix: :func:`stages` gives every block of the stage an attention kernel
(:class:`DocumentAttention`) that picks by device; it holds no parameters, so the model's state
dict is unchanged.
"""

from __future__ import annotations

from typing import Dict, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from .hf import CutStage, check_cover, own_names
from .models import positions

__all__ = ["TitanStage", "DocumentAttention", "stages"]


class DocumentAttention(nn.Module):
    """FlexAttention on CUDA (torchtitan's compiled wrapper), SDPA under the block mask's own
    ``mask_mod`` materialised as ``[T, T]`` on the CPU, where FlexAttention has no backward.
    Takes ``q [B, H, T, D]``, ``k, v [B, H_kv, T, D]``."""

    def forward(self, q, k, v, *, block_mask, enable_gqa: bool = False, **kw) -> torch.Tensor:
        if q.device.type != "cpu":
            from torchtitan.models.attention import FlexAttentionWrapper

            return FlexAttentionWrapper()(q, k, v, block_mask=block_mask, enable_gqa=enable_gqa, **kw)
        idx = torch.arange(q.shape[2], device=q.device)
        dense = block_mask.mask_mod(0, 0, idx[:, None], idx[None, :])
        return F.scaled_dot_product_attention(q, k, v, attn_mask=dense, enable_gqa=enable_gqa)


def _check(model: nn.Module) -> int:
    """The model's block count, or a ``ValueError`` naming what is missing or unsupported."""
    missing = [n for n in ("tok_embeddings", "layers", "norm", "output", "freqs_cis") if not hasattr(model, n)]
    if missing:
        raise ValueError(
            f"{type(model).__name__} is not torchtitan's Llama 3 Transformer: it lacks "
            f"{', '.join(missing)}"
        )
    attn = getattr(getattr(model, "model_args", None), "attn_type", None)
    if attn != "flex":
        raise ValueError(
            f"the model's attn_type is {attn!r}: a flat microbatch needs a document mask, which "
            "torchtitan gives with attn_type='flex' (build the model with it)"
        )
    return len(model.layers)


class TitanStage(CutStage):
    """Layers ``[start, end)`` of torchtitan's Llama 3 ``Transformer`` by flatpipe's numbering,
    as a :class:`flatpipe.torch.StageModule`."""

    def __init__(self, model: nn.Module, start: int, end: int) -> None:
        super().__init__()
        blocks = _check(model)
        total = blocks + 2
        if not 0 <= start < end <= total:
            raise ValueError(
                f"layers [{start}, {end}) are invalid for a {blocks}-block model ({total} layers "
                f"with the embedding and the output): 0 <= start < end <= {total}"
            )
        self.embed = model.tok_embeddings if start == 0 else None
        keys = list(model.layers.keys())[max(start, 1) - 1 : min(end, blocks + 1) - 1]
        self.layers = nn.ModuleList(model.layers[k] for k in keys)
        for block in self.layers:
            block.attention.inner_attention = DocumentAttention()
        self.norm = model.norm if end == total else None
        self.head = model.output if end == total else None
        self._model = [model]  # the RoPE cache (a buffer of the model), not a submodule here
        self._names = own_names(self, model)

    library = "torchtitan"

    def run_layers(self, h: torch.Tensor, cu: torch.Tensor) -> torch.Tensor:
        """The blocks on ``h`` ``[1, T, H]``: positions from ``cu_seqlens`` (``cu``), which index
        the RoPE cache, and the document mask as a ``BlockMask``."""
        from torch.nn.attention.flex_attention import create_block_mask

        pos = positions(cu)
        freqs = self._model[0].freqs_cis
        if int(pos.max()) >= freqs.shape[0]:
            raise ValueError(
                f"a sequence of {int(pos.max()) + 1} tokens is longer than the model's "
                f"max_seq_len {freqs.shape[0]}"
            )
        doc = torch.repeat_interleave(torch.arange(len(cu) - 1, device=h.device), cu[1:] - cu[:-1])

        def document(b, head, q, k):
            return (q >= k) & (doc[q] == doc[k])

        t = h.shape[1]
        mask = create_block_mask(document, None, None, t, t, device=h.device.type)
        for block in self.layers:
            h = block(h, freqs.to(h.device), attention_masks=mask, positions=pos.unsqueeze(0))
        return h


def stages(
    model: nn.Module,
    layer_ranges: Sequence[Tuple[int, int]],
    stage_ranks: Sequence[int],
    rank: int,
) -> Dict[int, TitanStage]:
    """Rank ``rank``'s stages of ``model`` by global stage index, from a pipeline's layer ranges
    and stage-to-rank map (``Pipeline.stages`` and ``Pipeline.stage_ranks``). Raises
    ``ValueError`` when the ranges do not cover the model's layers in order."""
    blocks = _check(model)
    check_cover(layer_ranges, stage_ranks, blocks + 2, f"embedding, {blocks} blocks, output")
    return {
        s: TitanStage(model, a, b)
        for s, ((a, b), r) in enumerate(zip(layer_ranges, stage_ranks))
        if r == rank
    }
