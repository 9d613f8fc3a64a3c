"""A cost profile measured on the user's own stage modules with PyTorch's own kernels.

:func:`profile` times, for one stage of each layer kind of the user's model (the embedding, a
decoder layer, the head with its loss), the forward (F), the input gradient (I) and the weight
gradient (W) as :class:`flatpipe.torch.PipelineRuntime` runs them (PyTorch's
``stage_backward_input`` / ``stage_backward_weight``), and the whole backward in one pass (B),
over a grid of microbatch sizes and sequence mixes; fits each kind and phase to flatpipe's
``t = c0 + c_tok * tokens + c_attn * pairs`` (:func:`flatpipe.fit.fit_costs`); and, where a
process group of two ranks or more is up, the point-to-point link between ranks 0 and 1
(``alpha + bytes / beta`` from a ping-pong of ``[T, H]`` tensors). The optimizer's step is timed
over the decoder stage's parameters when an optimizer factory is given. The result is a
:class:`flatpipe.Profile` that ``Pipeline(profile=...)``, ``flatpipe plan --profile`` and
``flatpipe simulate --profile`` take (``Profile.to_yaml``).

What it does not measure: the runtime's own cost per action (Python dispatch, a few tens of
microseconds on the CPU), which the closed loop (``flatpipe.fit.profile_from_steps``) fits from
whole steps instead.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable, Dict, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

from . import Profile
from .fit import fit_costs

__all__ = ["profile", "measure_link"]

Fit = Tuple[float, float, float, float]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _cu(lengths: Sequence[int], device) -> torch.Tensor:
    return torch.tensor([0, *np.cumsum(lengths).tolist()], dtype=torch.int64, device=device)


def _mixes(tokens: Sequence[int], seq_lens: Sequence[Optional[int]]) -> list:
    """Per microbatch size T and sequence length s (None: one sequence of T), the lengths."""
    out = []
    for t in tokens:
        for s in seq_lens:
            if s is None or s >= t:
                out.append([t])
            else:
                out.append([s] * (t // s) + ([t % s] if t % s else []))
    return out


def _time_phases(
    stage: nn.Module,
    kind: str,
    lengths: Sequence[int],
    hidden: int,
    vocab: int,
    dtype: torch.dtype,
    device: torch.device,
) -> Dict[str, float]:
    """One measurement of ``stage`` (of layer kind ``kind``) on one microbatch: seconds of F, I,
    W (split, as the runtime runs them) and B (one backward pass)."""
    t = sum(lengths)
    cu = _cu(lengths, device)
    g = torch.Generator().manual_seed(t)
    params = list(stage.parameters())
    times: Dict[str, float] = {}
    for split in (True, False):
        stage.zero_grad(set_to_none=True)
        if kind == "embedding":
            x = torch.randint(vocab, (t,), generator=g).to(device)
        else:
            x = torch.randn(t, hidden, generator=g, dtype=torch.float32).to(device=device, dtype=dtype)
            x.requires_grad_(True)
        _sync(device)
        c = time.perf_counter()
        out = stage(x, cu)
        if kind == "head":
            targets = torch.randint(vocab, (t,), generator=g).to(device)
            out = F.cross_entropy(out.float(), targets, reduction="sum") / t
        _sync(device)
        times["F"] = time.perf_counter() - c
        grad = None if kind == "head" else torch.ones_like(out) / out.numel()
        c = time.perf_counter()
        if split and kind != "embedding":
            _, groups = stage_backward_input([out], [grad] if grad is not None else None, [x], iter(params))
            _sync(device)
            times["I"] = time.perf_counter() - c
            c = time.perf_counter()
            stage_backward_weight(iter(params), groups)
            _sync(device)
            times["W"] = time.perf_counter() - c
        elif not split:
            torch.autograd.backward([out], [grad] if grad is not None else None)
            _sync(device)
            times["B"] = time.perf_counter() - c
    return times


def measure_link(hidden: int, dtype: torch.dtype, device, group=None, sizes=(256, 1024, 4096, 16384), repeats: int = 5):
    """``(alpha_s, beta_bytes_per_s)`` of the link between ranks 0 and 1 of ``group`` (default
    the world), from half the round trip of ``[T, hidden]`` tensors of each size, the median of
    ``repeats``, fitted by least squares; every rank of the group must call it and gets rank 0's
    fit. ``None`` without a process group of two ranks or more."""
    if not dist.is_initialized() or dist.get_world_size(group) < 2:
        return None
    me = dist.get_rank(group)
    # send / recv take global ranks.
    peer = dist.get_global_rank(group, 1 - me) if group is not None and me < 2 else 1 - me
    pts = []
    for t in sizes:
        buf = torch.zeros(t, hidden, dtype=dtype, device=device)
        one_way = []
        for _ in range(repeats + 1):
            dist.barrier(group)
            c = time.perf_counter()
            if me == 0:
                dist.send(buf, peer, group=group)
                dist.recv(buf, peer, group=group)
            elif me == 1:
                dist.recv(buf, peer, group=group)
                dist.send(buf, peer, group=group)
            one_way.append((time.perf_counter() - c) / 2)
        pts.append((buf.numel() * buf.element_size(), statistics.median(one_way[1:])))
    pts_a = np.array(pts)
    inv_beta, alpha = np.polyfit(pts_a[:, 0], pts_a[:, 1], 1)
    # Rank 0's fit on every rank (the others' timings are of barriers only).
    fit = torch.tensor([max(float(alpha), 0.0), 1.0 / max(float(inv_beta), 1e-15)], dtype=torch.float64, device=device)
    src = dist.get_global_rank(group, 0) if group is not None else 0
    dist.broadcast(fit, src=src, group=group)
    return float(fit[0]), float(fit[1])


def profile(
    make_stage: Callable[[int, int], nn.Module],
    num_layers: int,
    base: Profile,
    *,
    hidden_size: int,
    vocab_size: int,
    dtype: torch.dtype = torch.float32,
    device="cpu",
    tokens: Sequence[int] = (512, 1024, 2048),
    seq_lens: Sequence[Optional[int]] = (None, 128),
    repeats: int = 3,
    optimizer: Optional[Callable[[Sequence[nn.Parameter]], torch.optim.Optimizer]] = None,
    group=None,
    note: str = "measured by flatpipe.torch.profile on the user's stage modules",
) -> Tuple[Profile, Dict[Tuple[str, str], Fit]]:
    """A profile of the user's model measured with its own modules.

    Args:
        make_stage: ``make_stage(start, end)`` builds the stage of layers ``[start, end)`` by
            flatpipe's numbering (``lambda a, b: flatpipe.hf.HFStage(model, a, b)``).
        num_layers: the model's layers, embedding and head included.
        base: the model's profile to take the structure from (layers, parameter and activation
            bytes, hardware): ``Profile.analytic(model_yaml, hardware)``.
        hidden_size, vocab_size: ``H`` of the boundary tensors and the vocabulary.
        tokens, seq_lens: the grid: each microbatch size ``T`` as one sequence (``None``) and as
            sequences of each length (the attention's share tells ``c_attn`` from ``c_tok``).
        repeats: measurements per point after one warm-up; the median is fitted.
        optimizer: builds an optimizer over a parameter list; its ``step()`` over the decoder
            stage's parameters gives the optimizer's seconds per parameter.
        group: the process group whose ranks 0 and 1 time the link (every rank must call
            :func:`profile`); without one, the base profile's link is kept.

    Returns the profile and each ``(kind, phase)``'s ``(c0_s, c_tok_s, c_attn_s, r2)``, with
    ``("link", "p2p")`` ``(alpha_s, 1 / beta, 0, nan)`` when the link was measured and
    ``("optimizer", "step")`` ``(seconds per parameter, 0, 0, nan)``. Raises ``ValueError`` for
    a model of fewer than 3 layers, a grid with no point or a size outside 1 to 2^24 tokens,
    and an optimizer without a process group to measure the link on (the two are set
    together).
    """
    if num_layers < 3:
        raise ValueError(f"num_layers = {num_layers} is invalid: >= 3 (embedding, decoders, head)")
    device = torch.device(device)
    for name, values in (("tokens", tokens), ("seq_lens", [s for s in seq_lens if s is not None])):
        bad = [v for v in values if not (isinstance(v, int) and 1 <= v <= 1 << 24)]
        if bad:
            raise ValueError(f"{name} = {bad[0]!r} is invalid: an integer from 1 to 16,777,216")
    points = _mixes(tokens, seq_lens)
    if not points:
        raise ValueError("tokens is empty: give at least one microbatch size")
    kinds = {"embedding": (0, 1), "decoder": (1, 2), "head": (num_layers - 1, num_layers)}
    fits: Dict[Tuple[str, str], Fit] = {}
    out = base
    for kind, (a, b) in kinds.items():
        stage = make_stage(a, b)
        samples: Dict[str, list] = {}
        for lengths in points:
            pairs = float(sum(s * (s + 1) // 2 for s in lengths))
            runs = [
                _time_phases(stage, kind, lengths, hidden_size, vocab_size, dtype, device)
                for _ in range(repeats + 1)
            ][1:]
            for phase in runs[0]:
                samples.setdefault(phase, []).append(
                    (float(sum(lengths)), pairs, statistics.median(r[phase] for r in runs))
                )
        for phase, pts in samples.items():
            fits[(kind, phase)] = fit_costs(pts)
        if kind == "embedding":
            # The first stage's input needs no gradient: its W is the whole backward.
            fits[("embedding", "I")] = (0.0, 0.0, 0.0, float("nan"))
            fits[("embedding", "W")] = fits[("embedding", "B")]
        for phase in ("F", "I", "W", "B"):
            c0, ct, ca, _ = fits[(kind, phase)]
            out = out.with_costs(kind, phase, c0, ct, ca, note)
        c0, ct, ca, _ = fits[(kind, "F")]
        out = out.with_costs(kind, "Fo", c0, ct, ca, note)
    # flatpipe.torch skips the first stage's input gradient and runs its backward in W.
    out = out.with_overhead(0.0, 0.0, 0.0, 0.0, True)
    per_param = 0.0
    if optimizer is not None:
        per_param = _optimizer_s_per_param(make_stage(1, 2), optimizer, repeats)
        fits[("optimizer", "step")] = (per_param, 0.0, 0.0, float("nan"))
    link = measure_link(hidden_size, dtype, device, group)
    if link is not None:
        alpha, beta = link
        fits[("link", "p2p")] = (alpha, 1.0 / beta, 0.0, float("nan"))
        out = out.with_link(alpha, beta, per_param)
    elif optimizer is not None:
        raise ValueError(
            "the optimizer's cost is set with the link's (Profile.with_link): measure it with a "
            "process group of two ranks or more, or leave optimizer out"
        )
    return out, fits


def _optimizer_s_per_param(stage: nn.Module, optimizer, repeats: int) -> float:
    """Seconds per parameter of ``optimizer``'s step over ``stage``'s parameters (the median of
    ``repeats`` steps after one warm-up)."""
    params = [p for p in stage.parameters() if p.requires_grad]
    # A copy: the step must not change the user's weights.
    copies = [nn.Parameter(p.detach().clone()) for p in params]
    for p in copies:
        p.grad = torch.zeros_like(p)
    opt = optimizer(copies)
    times = []
    for _ in range(repeats + 1):
        c = time.perf_counter()
        opt.step()
        _sync(copies[0].device)
        times.append(time.perf_counter() - c)
    n = sum(p.numel() for p in copies)
    return statistics.median(times[1:]) / max(n, 1)
