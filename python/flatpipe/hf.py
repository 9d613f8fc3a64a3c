"""Pipeline stages from a Hugging Face decoder-only model, for ``flatpipe.torch``.

:func:`stages` cuts a ``*ForCausalLM`` of Hugging Face ``transformers`` (Llama, Qwen2, Qwen3,
Mistral: the models whose ``.model`` holds ``embed_tokens``, ``layers``, ``norm`` and
``rotary_emb`` and whose ``lm_head`` is the head) into the stages a pipeline rank runs, by
flatpipe's layer numbering: layer 0 is the embedding, layers ``1..L`` the decoder layers,
``L + 1`` the final norm with the head. Each stage takes its layers' modules from the unsplit
model (its parameters are the model's own, not copies), so a user splits a model they already
have; the other layers are simply never run on that rank.

A stage honours :class:`flatpipe.torch.StageModule`: ``forward(x, cu_seqlens)`` with token ids
``[T]`` on the first stage and hidden states ``[T, H]`` after it, logits ``[T, V]`` from the
last. The flat microbatch is run as one row of ``T`` tokens: positions restart at every
sequence boundary of ``cu_seqlens``, and attention never crosses a boundary. Which attention
runs (:func:`stages`' ``attention``):

- ``"varlen"`` (the default unless the model runs FlashAttention): flatpipe's
  ``flatpipe_varlen`` attention function, registered with transformers' ``AttentionInterface``
  and set as the model's ``attn_implementation``: PyTorch's SDPA, causal, once per sequence
  (the boundaries are where the positions restart), so its cost follows the sequences' query-key
  pairs ``sum s (s + 1) / 2``, as flatpipe's cost model prices attention, on any device.
- ``"model"``: the model's own ``attn_implementation`` with transformers' packed-sequence mask
  (``transformers.masking_utils.create_causal_mask`` recognises the packed sequences from the
  positions): with ``sdpa`` or ``eager`` a block-diagonal causal ``T x T`` mask, whose cost grows
  with ``T^2`` whatever the sequences; with ``flash_attention_2`` on CUDA no mask, and
  FlashAttention's variable-length kernel over the sequences (transformers' packed path; not
  exercised by flatpipe's tests, which run on the CPU).

Not supported: sequences cut into chunks (``Pipeline(chunk_tokens=...)``: a stage refuses the
earlier chunks' keys and values), and a tied embedding and head on stages of different ranks
(:func:`stages` refuses it: the two copies' gradients would need an all-reduce).
"""

from __future__ import annotations

from typing import Dict, Optional, Sequence, Tuple

import torch
from torch import nn

from .models import positions  # each token's position in its sequence, [T] int64

__all__ = ["CutStage", "HFStage", "stages", "positions", "model_yaml", "use_varlen", "varlen_attention"]

#: The name flatpipe's per-sequence attention is registered under in transformers.
VARLEN = "flatpipe_varlen"


def check_cover(layer_ranges: Sequence[Tuple[int, int]], stage_ranks: Sequence[int], total: int, what: str) -> None:
    """``ValueError`` unless ``layer_ranges`` (one per entry of ``stage_ranks``) cover layers
    ``0..total`` in order; ``what`` describes the model's layers for the message."""
    ends = [0] + [b for _, b in layer_ranges]
    if len(layer_ranges) != len(stage_ranks) or [a for a, _ in layer_ranges] != ends[:-1] or ends[-1] != total:
        raise ValueError(
            f"the stages' layer ranges {list(layer_ranges)} (on ranks {list(stage_ranks)}) do not "
            f"cover the model's {total} layers ({what}) in order: plan with num_layers = {total}"
        )


def own_names(stage: nn.Module, model: nn.Module) -> Dict[str, nn.Parameter]:
    """``stage``'s parameters by their names in ``model``."""
    mine = {id(p) for p in stage.parameters()}
    return {n: p for n, p in model.named_parameters() if id(p) in mine}


def refuse_chunks(kv: Optional[object], library: str) -> None:
    """``ValueError`` when a stage of ``library``'s model is given a chunk's keys and values."""
    if kv is not None:
        raise ValueError(
            f"a {library} stage does not run sequence chunks (Pipeline(chunk_tokens=...)): plan "
            "without chunk_tokens, or with a token budget of at least the longest sequence"
        )


def varlen_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """transformers' attention-function interface (``query [1, H, T, D]``, ``key, value
    [1, H_kv, T, D]``; returns ``([1, T, H, D], None)``): causal SDPA once per sequence, the
    sequences being where ``kwargs["position_ids"]`` restarts at 0. Grouped-query attention
    through SDPA's ``enable_gqa``."""
    pos = kwargs.get("position_ids")
    if pos is None or query.shape[0] != 1:
        raise ValueError("flatpipe_varlen attention needs position_ids and one row of tokens")
    t = query.shape[2]
    starts = torch.nonzero(pos[0] == 0).flatten().tolist() + [t]
    gqa = query.shape[1] != key.shape[1]
    outs = [
        torch.nn.functional.scaled_dot_product_attention(
            query[:, :, a:b], key[:, :, a:b], value[:, :, a:b],
            is_causal=True, scale=scaling, dropout_p=dropout, enable_gqa=gqa,
        )
        for a, b in zip(starts[:-1], starts[1:])
    ]
    return torch.cat(outs, dim=2).transpose(1, 2).contiguous(), None


def use_varlen(model: nn.Module) -> None:
    """Sets ``model``'s ``attn_implementation`` to flatpipe's per-sequence SDPA
    (:func:`varlen_attention`, registered with transformers' ``AttentionInterface``); what
    :func:`stages` does by default. Call it before measuring the model's stages
    (:func:`flatpipe.torch.profile`) so that the profile times the attention the run uses."""
    if model.config._attn_implementation != VARLEN:
        from transformers import AttentionInterface

        AttentionInterface.register(VARLEN, varlen_attention)
        model.set_attn_implementation(VARLEN)


def _parts(model: nn.Module) -> Tuple[nn.Module, int]:
    """The model's decoder stack (``model.model``) and its decoder count, or a ``ValueError``
    naming what is missing."""
    inner = getattr(model, "model", None)
    missing = [
        n
        for n in ("embed_tokens", "layers", "norm", "rotary_emb")
        if inner is None or not hasattr(inner, n)
    ]
    if missing or not hasattr(model, "lm_head"):
        raise ValueError(
            f"{type(model).__name__} is not a decoder-only *ForCausalLM flatpipe can cut: it "
            f"lacks {', '.join(['model.' + m for m in missing] or ['lm_head'])} (supported: "
            "Llama, Qwen2, Qwen3, Mistral)"
        )
    return inner, len(inner.layers)


class CutStage(nn.Module):
    """What a stage cut from another library's model does around its layers (the subclass
    sets ``embed``, ``layers``, ``norm``, ``head`` and ``library``, and runs its layers in
    :meth:`run_layers`): a :class:`flatpipe.torch.StageModule`."""

    library = ""

    def forward(
        self, x: torch.Tensor, cu_seqlens: torch.Tensor, kv: Optional[object] = None
    ) -> torch.Tensor:
        """``x``: token ids ``[T]`` (first stage) or hidden states ``[T, H]``; ``cu_seqlens``
        ``[n + 1]`` int64. Returns ``[T, H]``, or logits ``[T, V]`` on the last stage."""
        refuse_chunks(kv, self.library)
        h = (self.embed(x) if self.embed is not None else x).unsqueeze(0)
        if len(self.layers):
            h = self.run_layers(h, cu_seqlens.to(h.device))
        if self.head is not None:
            return self.head(self.norm(h)).squeeze(0)
        # A copy, not the view `squeeze` gives: PyTorch's split backward
        # (`stage_backward_input`) detaches a stage's output in place, which a view refuses.
        return h.squeeze(0).clone()

    def run_layers(self, h: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        """The stage's layers on ``h`` ``[1, T, H]``."""
        raise NotImplementedError

    def layer_parameters(self) -> Dict[str, nn.Parameter]:
        """The stage's parameters by their name in the whole model: for checkpoints and for
        comparing a pipelined run with the unsplit model."""
        return dict(self._names)


class HFStage(CutStage):
    """Layers ``[start, end)`` of a Hugging Face ``*ForCausalLM`` by flatpipe's numbering (0 the
    embedding, ``1..L`` the decoders, ``L + 1`` the final norm and head), as a
    :class:`flatpipe.torch.StageModule`."""

    def __init__(self, model: nn.Module, start: int, end: int) -> None:
        """Takes the model's modules of layers ``[start, end)``; the attention is the model's
        ``attn_implementation`` at each forward (``flatpipe_varlen`` after :func:`stages`
        with ``attention="varlen"``)."""
        super().__init__()
        inner, decoders = _parts(model)
        total = decoders + 2
        if not 0 <= start < end <= total:
            raise ValueError(
                f"layers [{start}, {end}) are invalid for {type(model).__name__} with {total} "
                f"layers (embedding, {decoders} decoders, head): 0 <= start < end <= {total}"
            )
        self.config = model.config
        self.start, self.end = start, end
        self.embed = inner.embed_tokens if start == 0 else None
        first, last = max(start, 1) - 1, min(end, decoders + 1) - 1
        self.layers = nn.ModuleList(inner.layers[first:last]) if last > first else nn.ModuleList()
        self.norm = inner.norm if end == total else None
        self.head = model.lm_head if end == total else None
        self.rotary = inner.rotary_emb
        self._names = own_names(self, model)

    library = "Hugging Face"

    def run_layers(self, h: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        """The decoder layers on ``h`` ``[1, T, H]``: positions from ``cu_seqlens``, the mask
        (none under ``flatpipe_varlen``) and the rotary embedding computed once for the stage."""
        from transformers.masking_utils import create_causal_mask

        pos = positions(cu_seqlens).unsqueeze(0)
        mask = None
        if self.config._attn_implementation != VARLEN:
            mask = create_causal_mask(
                config=self.config,
                inputs_embeds=h,
                attention_mask=None,
                cache=None,
                position_ids=pos,
            )
        rope = self.rotary(h, position_ids=pos)
        for layer in self.layers:
            h = layer(h, attention_mask=mask, position_ids=pos, position_embeddings=rope)
        return h


def stages(
    model: nn.Module,
    layer_ranges: Sequence[Tuple[int, int]],
    stage_ranks: Sequence[int],
    rank: int,
    attention: Optional[str] = None,
) -> Dict[int, HFStage]:
    """Rank ``rank``'s stages of ``model`` by global stage index, from a pipeline's layer ranges
    and stage-to-rank map (``Pipeline.stages`` and ``Pipeline.stage_ranks``, or a plan's).

    ``attention`` (module docstring): ``"varlen"`` sets the model's ``attn_implementation`` to
    flatpipe's per-sequence SDPA; ``"model"`` keeps the model's own; default ``"model"`` when the
    model runs FlashAttention (``flash_attention_2`` / ``_3``), else ``"varlen"``.

    Raises ``ValueError`` when the ranges do not cover the model's layers in order, for another
    ``attention``, or when the model ties its embedding and head (``tie_word_embeddings``) and the
    first and last stages are on different ranks."""
    _, decoders = _parts(model)
    own = model.config._attn_implementation
    if attention is None:
        attention = "model" if own and own.startswith("flash_attention") else "varlen"
    if attention not in ("varlen", "model"):
        raise ValueError(f"attention = {attention!r} is invalid: 'varlen' or 'model'")
    if attention == "varlen":
        use_varlen(model)
    check_cover(layer_ranges, stage_ranks, decoders + 2, f"embedding, {decoders} decoders, head")
    if getattr(model.config, "tie_word_embeddings", False) and stage_ranks[0] != stage_ranks[-1]:
        raise ValueError(
            f"{type(model).__name__} ties its embedding and head (tie_word_embeddings), but "
            f"the first stage runs on rank {stage_ranks[0]} and the last on rank "
            f"{stage_ranks[-1]}: their gradients would need an all-reduce flatpipe does not run; "
            "untie them, or use a V placement (both on rank 0)"
        )
    return {
        s: HFStage(model, a, b)
        for s, ((a, b), r) in enumerate(zip(layer_ranges, stage_ranks))
        if r == rank
    }


def model_yaml(model: nn.Module, name: Optional[str] = None) -> str:
    """flatpipe's model file (``docs/reference.md``) for a Hugging Face Llama-style
    ``*ForCausalLM``: its embedding, decoders (hidden size, SwiGLU size, query and key-value
    heads) and head, in the model's dtype (``bf16`` or ``fp32``): what ``Profile.analytic``
    takes as the base of :func:`flatpipe.torch.profile`."""
    _parts(model)
    c = model.config
    dtype = {torch.bfloat16: "bf16", torch.float32: "fp32"}.get(model.dtype)
    if dtype is None:
        raise ValueError(f"the model's dtype {model.dtype} is not bf16 or fp32")
    kv = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    return (
        f"name: {name or c.model_type}\ndtype: {dtype}\nlayers:\n"
        f"  - {{kind: embedding, vocab: {c.vocab_size}, hidden: {c.hidden_size}}}\n"
        f"  - {{kind: decoder, count: {c.num_hidden_layers}, hidden: {c.hidden_size}, "
        f"ffn: {c.intermediate_size}, heads: {c.num_attention_heads}, kv_heads: {kv}}}\n"
        f"  - {{kind: head, vocab: {c.vocab_size}, hidden: {c.hidden_size}}}\n"
    )
