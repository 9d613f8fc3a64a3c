"""A small Llama-style transformer over flat ``[T]`` tokens with ``cu_seqlens``, built per layer
range: the reference implementation of :class:`flatpipe.torch.StageModule` that the tests and
examples use.

Layers are numbered as flatpipe numbers them: 0 is the embedding, ``1..=num_decoders`` the
decoders (RMSNorm, grouped-query attention with rotary positions, RMSNorm, SwiGLU MLP), and
``num_decoders + 1`` the head (RMSNorm and the output projection). Every layer draws its weights
from a generator seeded with ``(seed, layer index)``, so a stage built from any layer range holds
exactly the weights the same layers have in the whole model: a pipelined run and a
single-process run of one model start from the same parameters.

Attention is causal inside each sequence and never crosses a ``cu_seqlens`` boundary; rotary
positions restart at 0 at each sequence's first token (as FlashAttention's varlen kernels and
torchtitan's document masking see them). A chunk of a longer sequence (``forward(x, cu_seqlens,
kv=ChunkKV(...))``) holds one sequence's tokens ``offset ..``: its positions start at the
offset and its queries attend to the earlier chunks' keys and values, then its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["ModelConfig", "Stage", "ChunkKV", "causal_document_mask", "positions"]


@dataclass(frozen=True)
class ModelConfig:
    """A model's shape. ``num_layers = num_decoders + 2`` (embedding and head)."""

    vocab: int = 64
    hidden: int = 32
    heads: int = 4
    kv_heads: int = 2
    ffn: int = 64
    num_decoders: int = 4
    seed: int = 0
    rope_theta: float = 10000.0

    @property
    def num_layers(self) -> int:
        return self.num_decoders + 2

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


def _init(shape, gen: torch.Generator, scale: float) -> nn.Parameter:
    return nn.Parameter(torch.randn(*shape, generator=gen) * scale)


def _gen(cfg: ModelConfig, index: int) -> torch.Generator:
    return torch.Generator().manual_seed(cfg.seed * 1_000_003 + index)


def positions(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Each token's position inside its sequence, ``[T]`` int64."""
    lens = cu_seqlens[1:] - cu_seqlens[:-1]
    starts = torch.repeat_interleave(cu_seqlens[:-1], lens)
    return torch.arange(int(cu_seqlens[-1]), device=cu_seqlens.device) - starts


def causal_document_mask(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """``[T, T]`` bool: query i may attend to key j iff both are in the same sequence and
    ``j <= i``."""
    lens = cu_seqlens[1:] - cu_seqlens[:-1]
    seq = torch.repeat_interleave(torch.arange(len(lens), device=cu_seqlens.device), lens)
    t = seq.shape[0]
    idx = torch.arange(t, device=cu_seqlens.device)
    return (seq[:, None] == seq[None, :]) & (idx[None, :] <= idx[:, None])


def _rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    # x: [T, heads, d]
    d = x.shape[-1]
    inv = theta ** (-torch.arange(0, d, 2, dtype=torch.float32, device=x.device) / d)
    ang = pos.to(torch.float32)[:, None] * inv[None, :]
    cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return out.flatten(-2)


@dataclass
class ChunkKV:
    """What one chunk of a longer sequence attends to on one stage, layer by layer.

    ``offset``: the tokens of the sequence before the chunk. ``prefix``: per decoder layer of the
    stage, in order, the earlier chunks' rotated keys and values ``([offset, kv_heads, d],
    [offset, kv_heads, d])`` (``None`` for the first chunk). The forward appends each layer's
    own rotated keys and values ``[T, kv_heads, d]`` to ``own`` (the runtime keeps them for the
    later chunks and feeds their gradients back in this chunk's backward).
    """

    offset: int
    prefix: Optional[List[Tuple[torch.Tensor, torch.Tensor]]] = None
    own: List[Tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)

    def extend(self, k: torch.Tensor, v: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Records this layer's own ``k, v`` and returns the keys and values to attend to: the
        earlier chunks' then these."""
        i = len(self.own)
        # Not views: the runtime passes them as outputs of the chunk's backward, which detaches
        # its outputs in place (torch's stage_backward_input).
        k, v = k.clone(), v.clone()
        self.own.append((k, v))
        if self.prefix is None:
            return k, v
        pk, pv = self.prefix[i]
        return torch.cat([pk, k]), torch.cat([pv, v])


class _RMSNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * self.weight


class _Decoder(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int) -> None:
        super().__init__()
        g, h, d = _gen(cfg, index), cfg.hidden, cfg.head_dim
        s = h**-0.5
        self.cfg = cfg
        self.attn_norm = _RMSNorm(h)
        self.wq = _init((h, cfg.heads * d), g, s)
        self.wk = _init((h, cfg.kv_heads * d), g, s)
        self.wv = _init((h, cfg.kv_heads * d), g, s)
        self.wo = _init((cfg.heads * d, h), g, s)
        self.mlp_norm = _RMSNorm(h)
        self.w_gate = _init((h, cfg.ffn), g, s)
        self.w_up = _init((h, cfg.ffn), g, s)
        self.w_down = _init((cfg.ffn, h), g, cfg.ffn**-0.5)

    def forward(
        self,
        x: torch.Tensor,
        mask: torch.Tensor,
        pos: torch.Tensor,
        kv: Optional[ChunkKV] = None,
    ) -> torch.Tensor:
        cfg, t = self.cfg, x.shape[0]
        a = self.attn_norm(x)
        q = (a @ self.wq).view(t, cfg.heads, cfg.head_dim)
        k = (a @ self.wk).view(t, cfg.kv_heads, cfg.head_dim)
        v = (a @ self.wv).view(t, cfg.kv_heads, cfg.head_dim)
        q, k = _rope(q, pos, cfg.rope_theta), _rope(k, pos, cfg.rope_theta)
        if kv is not None:
            k, v = kv.extend(k, v)
        rep = cfg.heads // cfg.kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask
        )
        x = x + o.transpose(0, 1).reshape(t, -1) @ self.wo
        m = self.mlp_norm(x)
        return x + (F.silu(m @ self.w_gate) * (m @ self.w_up)) @ self.w_down


class Stage(nn.Module):
    """Layers ``[start, end)`` of the model: ``forward(x, cu_seqlens)`` takes token ids ``[T]``
    when the range starts at the embedding, hidden states ``[T, H]`` otherwise, and returns
    ``[T, H]``, or logits ``[T, vocab]`` when the range ends at the head."""

    def __init__(self, cfg: ModelConfig, start: int, end: int) -> None:
        super().__init__()
        if not 0 <= start < end <= cfg.num_layers:
            raise ValueError(
                f"layer range [{start}, {end}) is invalid for a model of {cfg.num_layers} layers"
            )
        self.cfg, self.start, self.end = cfg, start, end
        self.embedding = None
        if start == 0:
            self.embedding = _init((cfg.vocab, cfg.hidden), _gen(cfg, 0), 1.0)
        self.decoders = nn.ModuleList(
            _Decoder(cfg, i) for i in range(max(start, 1), min(end, cfg.num_decoders + 1))
        )
        self.norm = self.output = None
        if end == cfg.num_layers:
            g = _gen(cfg, cfg.num_layers - 1)
            self.norm = _RMSNorm(cfg.hidden)
            self.output = _init((cfg.hidden, cfg.vocab), g, cfg.hidden**-0.5)

    def forward(
        self, x: torch.Tensor, cu_seqlens: torch.Tensor, kv: Optional[ChunkKV] = None
    ) -> torch.Tensor:
        """``kv``: for one chunk of a longer sequence (``cu_seqlens = [0, T]``), the earlier
        chunks' keys and values (:class:`ChunkKV`)."""
        if self.embedding is not None:
            x = self.embedding[x]
        if len(self.decoders):
            if kv is None:
                mask, pos = causal_document_mask(cu_seqlens), positions(cu_seqlens)
            else:
                if cu_seqlens.numel() != 2:
                    raise ValueError(
                        f"a chunk holds one sequence: cu_seqlens has {cu_seqlens.numel() - 1}"
                    )
                t, o = x.shape[0], kv.offset
                idx = torch.arange(t, device=x.device)
                pos = idx + o
                # Query i (position o + i) sees keys 0 ..= o + i of its sequence.
                mask = torch.arange(o + t, device=x.device)[None, :] <= pos[:, None]
            for d in self.decoders:
                x = d(x, mask, pos, kv)
        if self.output is not None:
            x = self.norm(x) @ self.output
        return x

    def layer_parameters(self) -> dict:
        """The stage's parameters by their name in the whole model (``layers.<i>.<name>``, ``i``
        the layer index), the same whatever the stage's range: for checkpoints and for
        comparing a pipelined run with a single-process one."""
        out = {}
        if self.embedding is not None:
            out["layers.0.embedding"] = self.embedding
        first = max(self.start, 1)
        for i, d in enumerate(self.decoders):
            for name, p in d.named_parameters():
                out[f"layers.{first + i}.{name}"] = p
        if self.output is not None:
            head = self.cfg.num_layers - 1
            out[f"layers.{head}.norm.weight"] = self.norm.weight
            out[f"layers.{head}.output"] = self.output
        return out
