"""A small Llama-style transformer over flat ``[T]`` tokens with ``cu_seqlens``, built per layer
range: the reference implementation of :class:`flatpipe.torch.StageModule` that the tests and
examples use.

Layers are numbered as flatpipe numbers them: 0 is the embedding, ``1..=num_decoders`` the
decoders (RMSNorm, grouped-query attention with rotary positions, RMSNorm, SwiGLU MLP), and
``num_decoders + 1`` the head (RMSNorm and the output projection). Every layer draws its weights
from a generator seeded with ``(seed, layer index)``, so a stage built from any layer range holds
exactly the weights the same layers have in the whole model: a pipelined run and a
single-process run of one model start from the same parameters.

With ``experts > 0`` every decoder's MLP is a mixture of experts instead: a linear router,
softmax gating, each token's ``top_k`` experts with their weights normalised to sum to 1
(Qwen3-MoE's ``norm_topk_prob``), ``experts`` SwiGLU experts of width ``expert_ffn``. Passing
an ``ep_group`` to :class:`Stage` splits the experts over that process group (expert
parallelism): each process holds ``experts / ep`` of them, and every MoE layer sends each
token's routed copies to the processes holding its experts and brings the results back with
two autograd-aware ``all_to_all_single`` calls, after exchanging how many rows go where (the
receiver sizes its buffers from those counts). The experts' weights are drawn per (seed, layer,
expert), so a process holds exactly the weights its experts have in the whole model.

Attention is causal inside each sequence and never crosses a ``cu_seqlens`` boundary; rotary
positions restart at 0 at each sequence's first token (as FlashAttention's varlen kernels and
torchtitan's document masking see them). A chunk of a longer sequence (``forward(x, cu_seqlens,
kv=ChunkKV(...))``) holds one sequence's tokens ``offset ..``: its positions start at the
offset and its queries attend to the earlier chunks' keys and values, then its own.

Context parallelism (``forward(x, cu_seqlens, cp=CpShard(...))``): the process holds its zigzag
share of a microbatch (:func:`cp_pieces`: each document cut into ``2 cp`` chunks, process ``i``
taking chunks ``i`` and ``2 cp - 1 - i``, as Megatron-LM splits), each piece at its positions in
its document. Every decoder gathers the group's rotated keys and values (an autograd-aware
all-gather whose backward sums the key and value gradients over the group and keeps this
process's rows) and attends causally within each document.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

__all__ = [
    "ModelConfig",
    "Stage",
    "ChunkKV",
    "CpShard",
    "ComputeStream",
    "cp_pieces",
    "causal_document_mask",
    "positions",
]


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
    #: Routed experts per decoder (0: a dense SwiGLU MLP of width ``ffn``).
    experts: int = 0
    #: Experts each token is routed to.
    top_k: int = 2
    #: Width of one expert's SwiGLU.
    expert_ffn: int = 32

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


def cp_pieces(doc_lens: List[int], index: int, cp: int) -> List[Tuple[int, int, int]]:
    """Process ``index``'s pieces of a microbatch of documents of ``doc_lens`` tokens in a
    context-parallel group of ``cp``, in row order: ``(document, offset, length)``. A document
    of ``L`` tokens is cut into ``2 cp`` chunks, chunk ``j`` its positions ``[L j / 2cp,
    L (j + 1) / 2cp)``; process ``i`` takes chunks ``i`` and ``2 cp - 1 - i`` (empty chunks
    left out). The same split as the Rust core's ``CpShare::zigzag_pieces``."""
    n, out = 2 * cp, []
    for doc, length in enumerate(doc_lens):
        for j in (index, n - 1 - index):
            a, b = length * j // n, length * (j + 1) // n
            if b > a and (doc, a, b - a) not in out:
                out.append((doc, a, b - a))
    return out


@dataclass
class CpShard:
    """This process's share of one microbatch in a context-parallel group: the ``group``
    (``None``: a group of one, for tests), this process's ``index`` in it, its size ``cp`` and
    the whole microbatch's document lengths."""

    group: Optional[object]
    index: int
    cp: int
    doc_lens: List[int]

    def pieces(self, index: Optional[int] = None) -> List[Tuple[int, int, int]]:
        """Process ``index``'s pieces (default this one's), :func:`cp_pieces`."""
        return cp_pieces(self.doc_lens, self.index if index is None else index, self.cp)

    def layout(self, index: Optional[int] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(document, position)`` of each of process ``index``'s rows, ``[T_i]`` int64 each."""
        docs, pos = [], []
        for d, o, n in self.pieces(index):
            docs.append(torch.full((n,), d, dtype=torch.int64))
            pos.append(torch.arange(o, o + n))
        if not docs:
            return torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64)
        return torch.cat(docs), torch.cat(pos)

    def counts(self) -> List[int]:
        """Rows of every process of the group."""
        return [sum(n for _, _, n in self.pieces(i)) for i in range(self.cp)]

    def mask(self) -> torch.Tensor:
        """``[T_mine, T_all]`` bool: this process's queries against the group's gathered keys
        (every process's rows in process order): same document, key position <= query
        position."""
        qd, qp = self.layout()
        kd, kp = zip(*(self.layout(i) for i in range(self.cp)))
        kd, kp = torch.cat(kd), torch.cat(kp)
        return (qd[:, None] == kd[None, :]) & (kp[None, :] <= qp[:, None])


class _GatherRows(torch.autograd.Function):
    """All-gathers rows ``x [T_i, ...]`` of every process of ``group`` (``counts[i]`` each),
    concatenated in process order; the backward sums the gradient over the group and returns
    this process's rows of it."""

    @staticmethod
    def forward(ctx, x, group, counts: List[int], index: int):  # type: ignore[override]
        ctx.group, ctx.counts, ctx.index = group, counts, index
        most = max(counts)
        pad = torch.zeros((most - x.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype)
        parts = [torch.empty((most,) + tuple(x.shape[1:]), dtype=x.dtype) for _ in counts]
        with _on_the_wire("cp all-gather"):
            dist.all_gather(parts, torch.cat([x.detach(), pad]).contiguous(), group=group)
        return torch.cat([p[:n] for p, n in zip(parts, counts)])

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        grad = grad.contiguous().clone()
        with _on_the_wire("cp reduce"):
            dist.all_reduce(grad, group=ctx.group)
        start = sum(ctx.counts[: ctx.index])
        return grad[start : start + ctx.counts[ctx.index]], None, None, None


class _RMSNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * self.weight


class ComputeStream:
    """One rank's compute, shared by the two halves of an overlapped pair that
    :class:`flatpipe.torch.PipelineRuntime` runs on two threads: a half holds it while it
    computes and lets it go while one of its all-to-alls is on the wire, so the other half
    computes meanwhile (DualPipe; Megatron-LM's combined 1F1B; torchtitan's ``OVERLAP_F_B``),
    and the rank never computes two things at once.

    ``events``: ``(half, what, start_s, end_s)`` from the stream's creation, ``what`` being
    ``"compute"`` (a stretch holding the stream) or the all-to-all's name (``"dispatch"``,
    ``"combine"``, ``"counts"``, and ``"dispatch grad"`` / ``"combine grad"`` in the backward:
    from posting it to its completion)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._t0 = time.perf_counter()
        self._since: Dict[int, float] = {}
        self.events: List[Tuple[int, str, float, float]] = []

    def _now(self) -> float:
        return time.perf_counter() - self._t0

    def _acquire(self, half: int) -> None:
        self._lock.acquire()
        self._since[half] = self._now()

    def _release(self, half: int) -> None:
        self.events.append((half, "compute", self._since.pop(half), self._now()))
        self._lock.release()

    @contextlib.contextmanager
    def bound(self, half: int) -> Iterator[None]:
        """Runs the body as ``half`` (0 or 1) of the pair on this thread, holding the stream
        but while its all-to-alls are on the wire."""
        _BOUND.stream = (self, half)
        self._acquire(half)
        try:
            yield
        finally:
            self._release(half)
            _BOUND.stream = None


#: The stream (and half) the current thread computes on, if it runs half of an overlapped pair.
_BOUND = threading.local()


@contextlib.contextmanager
def _on_the_wire(what: str) -> Iterator[None]:
    """Around a collective: the current thread's half of an overlapped pair lets its compute
    stream go until the collective completes (and records it); nothing otherwise."""
    bound = getattr(_BOUND, "stream", None)
    if bound is None:
        yield
        return
    stream, half = bound
    stream._release(half)
    t0 = stream._now()
    try:
        yield
    finally:
        t1 = stream._now()
        stream._acquire(half)
        stream.events.append((half, what, t0, t1))


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` of rows with the given split sizes; its backward sends the
    gradients back with the splits swapped. ``what`` names it in an overlapped pair's trace."""

    @staticmethod
    def forward(ctx, x, send: List[int], recv: List[int], group, what: str):  # type: ignore[override]
        ctx.send, ctx.recv, ctx.group, ctx.what = send, recv, group, what
        out = x.new_empty((sum(recv),) + tuple(x.shape[1:]))
        with _on_the_wire(what):
            dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        out = grad.new_empty((sum(ctx.send),) + tuple(grad.shape[1:]))
        with _on_the_wire(f"{ctx.what} grad"):
            dist.all_to_all_single(out, grad.contiguous(), ctx.send, ctx.recv, group=ctx.group)
        return out, None, None, None, None


class _Expert(nn.Module):
    def __init__(self, cfg: ModelConfig, g: torch.Generator) -> None:
        super().__init__()
        h, f = cfg.hidden, cfg.expert_ffn
        self.w_gate = _init((h, f), g, h**-0.5)
        self.w_up = _init((h, f), g, h**-0.5)
        self.w_down = _init((f, h), g, f**-0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (F.silu(x @ self.w_gate) * (x @ self.w_up)) @ self.w_down


class _MoE(nn.Module):
    """A mixture-of-experts MLP (see the module documentation); with ``ep_group`` it holds the
    experts ``[r E / ep, (r + 1) E / ep)`` of its rank ``r`` in the group."""

    def __init__(self, cfg: ModelConfig, index: int, ep_group=None) -> None:
        super().__init__()
        h, e, f = cfg.hidden, cfg.experts, cfg.expert_ffn
        if not 1 <= cfg.top_k <= e:
            raise ValueError(f"top_k = {cfg.top_k}: between 1 and experts = {e}")
        self.ep = dist.get_world_size(ep_group) if ep_group is not None else 1
        self.rank = dist.get_rank(ep_group) if ep_group is not None else 0
        if e % self.ep:
            raise ValueError(f"{e} experts do not divide over an expert-parallel group of {self.ep}")
        self.cfg, self.group, self.local = cfg, ep_group, e // self.ep
        self.router = _init((h, e), _gen(cfg, index), h**-0.5)
        first = self.rank * self.local
        self.first = first
        self.experts = nn.ModuleList(
            _Expert(cfg, _gen(cfg, 1_000_000 * (index + 1) + x))
            for x in range(first, first + self.local)
        )
        if ep_group is not None:
            # Split experts: PipelineRuntime reduces their gradients over its expert_dp_group.
            for p in self.experts.parameters():
                p.flatpipe_expert = True  # type: ignore[attr-defined]

    def route(self, m: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Each token's ``top_k`` experts ``[T, k]`` (highest first) and normalised weights."""
        probs = torch.softmax(m @ self.router, dim=-1)
        w, idx = torch.topk(probs, self.cfg.top_k, dim=-1)
        return idx, w / w.sum(-1, keepdim=True)

    def _experts(self, rows: torch.Tensor, counts: List[int]) -> torch.Tensor:
        """The local experts on ``rows``, sorted by local expert with ``counts`` rows each."""
        out, start = [], 0
        for ex, n in zip(self.experts, counts):
            out.append(ex(rows[start : start + n]))
            start += n
        return torch.cat(out) if out else rows

    def forward(self, m: torch.Tensor) -> torch.Tensor:
        t, k, e = m.shape[0], self.cfg.top_k, self.cfg.experts
        idx, w = self.route(m)
        flat = idx.reshape(-1)
        order = torch.argsort(flat, stable=True)
        rows = m.repeat_interleave(k, dim=0)[order]
        per_expert = torch.bincount(flat, minlength=e)
        if self.group is None:
            y = self._experts(rows, per_expert.tolist())
        else:
            # Rows for each destination rank, then the per-expert counts every rank receives.
            per_rank = per_expert.view(self.ep, self.local)
            recv_counts = torch.empty_like(per_rank)
            with _on_the_wire("counts"):
                dist.all_to_all_single(recv_counts, per_rank.contiguous(), group=self.group)
            send = per_rank.sum(1).tolist()
            recv = recv_counts.sum(1).tolist()
            got = _AllToAll.apply(rows, send, recv, self.group, "dispatch")
            # Received blocks are by source rank, each sorted by local expert: regroup by expert.
            src = torch.repeat_interleave(
                torch.arange(self.ep * self.local), recv_counts.reshape(-1)
            )
            expert_of = src % self.local
            by_expert = torch.argsort(expert_of, stable=True)
            out = self._experts(got[by_expert], recv_counts.sum(0).tolist())
            back = torch.empty_like(out)
            back[by_expert] = out
            y = _AllToAll.apply(back, recv, send, self.group, "combine")
        unsorted = torch.empty_like(y)
        unsorted[order] = y
        return (unsorted.view(t, k, -1) * w.unsqueeze(-1)).sum(1)


class _Decoder(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int, ep_group=None) -> None:
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
        self.moe = _MoE(cfg, index, ep_group) if cfg.experts > 0 else None
        if self.moe is None:
            self.w_gate = _init((h, cfg.ffn), g, s)
            self.w_up = _init((h, cfg.ffn), g, s)
            self.w_down = _init((cfg.ffn, h), g, cfg.ffn**-0.5)

    def forward(
        self,
        x: torch.Tensor,
        mask: torch.Tensor,
        pos: torch.Tensor,
        kv: Optional[ChunkKV] = None,
        cp: Optional[CpShard] = None,
    ) -> torch.Tensor:
        cfg, t = self.cfg, x.shape[0]
        a = self.attn_norm(x)
        q = (a @ self.wq).view(t, cfg.heads, cfg.head_dim)
        k = (a @ self.wk).view(t, cfg.kv_heads, cfg.head_dim)
        v = (a @ self.wv).view(t, cfg.kv_heads, cfg.head_dim)
        q, k = _rope(q, pos, cfg.rope_theta), _rope(k, pos, cfg.rope_theta)
        if kv is not None:
            k, v = kv.extend(k, v)
        if cp is not None and cp.cp > 1:
            counts = cp.counts()
            k = _GatherRows.apply(k, cp.group, counts, cp.index)
            v = _GatherRows.apply(v, cp.group, counts, cp.index)
        rep = cfg.heads // cfg.kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask
        )
        x = x + o.transpose(0, 1).reshape(t, -1) @ self.wo
        m = self.mlp_norm(x)
        if self.moe is not None:
            return x + self.moe(m)
        return x + (F.silu(m @ self.w_gate) * (m @ self.w_up)) @ self.w_down


class Stage(nn.Module):
    """Layers ``[start, end)`` of the model: ``forward(x, cu_seqlens)`` takes token ids ``[T]``
    when the range starts at the embedding, hidden states ``[T, H]`` otherwise, and returns
    ``[T, H]``, or logits ``[T, vocab]`` when the range ends at the head. ``ep_group``: the
    process group its mixture-of-experts layers split their experts over (``None``: every
    expert here)."""

    def __init__(self, cfg: ModelConfig, start: int, end: int, ep_group=None) -> None:
        super().__init__()
        if not 0 <= start < end <= cfg.num_layers:
            raise ValueError(
                f"layer range [{start}, {end}) is invalid for a model of {cfg.num_layers} layers"
            )
        self.cfg, self.start, self.end = cfg, start, end
        #: The process group the experts split over (``None``: every expert here).
        self.ep_group = ep_group
        self.embedding = None
        if start == 0:
            self.embedding = _init((cfg.vocab, cfg.hidden), _gen(cfg, 0), 1.0)
        self.decoders = nn.ModuleList(
            _Decoder(cfg, i, ep_group)
            for i in range(max(start, 1), min(end, cfg.num_decoders + 1))
        )
        self.norm = self.output = None
        if end == cfg.num_layers:
            g = _gen(cfg, cfg.num_layers - 1)
            self.norm = _RMSNorm(cfg.hidden)
            self.output = _init((cfg.hidden, cfg.vocab), g, cfg.hidden**-0.5)

    def forward(
        self,
        x: torch.Tensor,
        cu_seqlens: torch.Tensor,
        kv: Optional[ChunkKV] = None,
        cp: Optional[CpShard] = None,
    ) -> torch.Tensor:
        """``kv``: for one chunk of a longer sequence (``cu_seqlens = [0, T]``), the earlier
        chunks' keys and values (:class:`ChunkKV`). ``cp``: this process's share of the
        microbatch in a context-parallel group (:class:`CpShard`; ``x`` holds its rows)."""
        if kv is not None and cp is not None:
            raise ValueError("a chunk of a sequence under context parallelism: give kv or cp, not both")
        if self.embedding is not None:
            x = self.embedding[x]
        if len(self.decoders):
            if cp is not None:
                mask, pos = cp.mask(), cp.layout()[1]
                if pos.numel() != x.shape[0]:
                    raise ValueError(
                        f"context-parallel share {cp.index} of {cp.cp} holds {pos.numel()} tokens, x has {x.shape[0]} rows"
                    )
            elif kv is None:
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
                x = d(x, mask, pos, kv, cp)
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
                if d.moe is not None and name.startswith("moe.experts."):
                    # By the expert's index in the whole model, not in this process.
                    _, _, local, rest = name.split(".", 3)
                    name = f"moe.experts.{d.moe.first + int(local)}.{rest}"
                out[f"layers.{first + i}.{name}"] = p
        if self.output is not None:
            head = self.cfg.num_layers - 1
            out[f"layers.{head}.norm.weight"] = self.norm.weight
            out[f"layers.{head}.output"] = self.output
        return out
