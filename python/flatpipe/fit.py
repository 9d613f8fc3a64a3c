"""Cost profiles from the runtime's own timings or a profiler trace: the closed loop on a real
framework.

flatpipe's cost model prices one layer kind's phase on a microbatch as
``t = c0 + c_tok * tokens + c_attn * attn_pairs`` seconds (``profiles/src/profile.rs``).
:func:`fit_costs` fits one such model by non-negative least squares on relative residuals
(every subset of the three coefficients solved exactly, as the Rust profiler's ``nnls_fit``
does). :func:`profile_from_steps` fits a whole runtime from the action timings of steps that
:class:`flatpipe.torch.PipelineRuntime` ran (:func:`fit_actions`: every kind and phase, a
fixed cost per action, the fused backward's ratio to I + W, the posting cost per message) into
a :class:`flatpipe.Profile`; :func:`profile_from_trace` does the same from PyTorch profiler
traces. Predicting other schedules with that profile and running them closes the loop
(``python/bench/closed_loop.py``).
"""

from __future__ import annotations

import itertools
from typing import Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

from . import Profile, StepPlan, import_trace
from .torch import ActionTiming, parse_action

__all__ = [
    "cross_rank_messages",
    "fit_actions",
    "fit_costs",
    "nnls",
    "profile_from_steps",
    "profile_from_trace",
    "profiler_overhead_s",
]

Sample = Tuple[float, float, float]  # (tokens, attn_pairs, seconds)


def fit_costs(samples: Sequence[Sample]) -> Tuple[float, float, float, float]:
    """``(c0_s, c_tok_s, c_attn_s, r2)`` of ``t = c0 + c_tok * tokens + c_attn * pairs`` over
    ``samples`` of ``(tokens, pairs, seconds)``, all coefficients >= 0, minimising the sum of
    squared relative residuals. Raises ``ValueError`` for no samples or a time <= 0."""
    if not samples:
        raise ValueError("no timings to fit")
    a = np.array([[1.0, s[0], s[1]] for s in samples], dtype=np.float64)
    t = np.array([s[2] for s in samples], dtype=np.float64)
    if (t <= 0).any():
        raise ValueError(f"a timing of {t.min()} s: times must be > 0")
    w = 1.0 / t  # relative residuals
    best = None
    for k in range(1, 4):
        for cols in itertools.combinations(range(3), k):
            sub = a[:, cols] * w[:, None]
            scale = np.abs(sub).max(axis=0)
            scale[scale == 0] = 1.0
            coef, *_ = np.linalg.lstsq(sub / scale, t * w, rcond=None)
            coef = coef / scale
            if (coef < 0).any():
                continue
            full = np.zeros(3)
            full[list(cols)] = coef
            err = float(((a @ full - t) * w) ** 2 @ np.ones(len(t)))
            if best is None or err < best[0]:
                best = (err, full)
    full = best[1]
    pred = a @ full
    ss_res = float(((pred - t) ** 2).sum())
    ss_tot = float(((t - t.mean()) ** 2).sum())
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0
    return float(full[0]), float(full[1]), float(full[2]), r2


def nnls(a: np.ndarray, b: np.ndarray, max_iter: int = 0) -> np.ndarray:
    """``argmin ||a x - b||`` over ``x >= 0``: Lawson and Hanson's active-set method ("Solving
    Least Squares Problems", 1974, ch. 23), on columns scaled to unit norm. ``a`` is
    ``[n, k]``, ``b`` ``[n]``; returns ``[k]``. All-zero columns get 0."""
    n, k = a.shape
    norms = np.linalg.norm(a, axis=0)
    live = norms > 0
    scale = np.where(live, norms, 1.0)
    a = a / scale
    x = np.zeros(k)
    passive = np.zeros(k, dtype=bool)
    tol = 1e-12 * max(1.0, float(np.abs(b).max()) if n else 1.0)
    for _ in range(max_iter or 3 * k + 10):
        grad = a.T @ (b - a @ x)
        grad[passive | ~live] = -np.inf
        j = int(np.argmax(grad))
        if grad[j] <= tol:
            break
        passive[j] = True
        while True:
            z = np.zeros(k)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if (z[passive] > 0).all():
                x = z
                break
            neg = passive & (z <= 0)
            alpha = np.min(x[neg] / (x[neg] - z[neg]))
            x = x + alpha * (z - x)
            passive &= x > 1e-15
            x[~passive] = 0.0
    return x / scale


Part = Tuple[Sequence[str], str, float, float]  # (the stage's layer kinds, phase, tokens, pairs)


def fit_actions(
    samples: Sequence[Tuple[Sequence[Part], float]], overhead: bool
) -> Tuple[Dict[Tuple[str, str], Tuple[float, float, float, float]], Dict[str, float]]:
    """One fit of every layer kind's phase costs (and, with ``overhead``, a fixed cost per
    action and phase) over actions that may hold several layers and, for an overlapped pair,
    two halves: an action's time is the sum over its halves of
    ``o_phase + sum over the stage's layers of (c0 + c_tok T + c_attn pairs)``. Non-negative
    least squares on absolute residuals (:func:`nnls`): a step's time is a sum of actions'
    times, so the fit aims at their mean (relative residuals discount the actions a busy host
    slowed down, and the sums came out 10-17% short on this machine). ``o_phase`` and a kind's ``c0`` can be
    told apart only when that phase runs on stages of different layer counts: pass
    ``overhead=False`` otherwise.

    Returns ``{(kind, phase): (c0_s, c_tok_s, c_attn_s, r2)}`` (R² over the actions of one
    part whose stage holds only that kind) and ``{phase: o_s}``."""
    cols: Dict[Tuple[str, str, int], int] = {}
    phases = sorted({p for parts, _ in samples for _, p, _, _ in parts})

    def col(key):
        return cols.setdefault(key, len(cols))

    for parts, _ in samples:
        for kinds, phase, _, _ in parts:
            if overhead:
                col(("", phase, 0))
            for k in kinds:
                for c in range(3):
                    col((k, phase, c))
    a = np.zeros((len(samples), len(cols)))
    t = np.array([s for _, s in samples], dtype=np.float64)
    if (t <= 0).any():
        raise ValueError(f"a timing of {t.min()} s: times must be > 0")
    for row, (parts, _) in enumerate(samples):
        for kinds, phase, tokens, pairs in parts:
            if overhead:
                a[row, cols[("", phase, 0)]] += 1.0
            for k in kinds:
                for c, v in enumerate((1.0, tokens, pairs)):
                    a[row, cols[(k, phase, c)]] += v
    x = nnls(a, t)
    pred = a @ x
    fits = {}
    for k, phase in sorted({(k, p) for (k, p, _) in cols if k}):
        coef = tuple(float(x[cols[(k, phase, c)]]) for c in range(3))
        rows = [
            i
            for i, (parts, _) in enumerate(samples)
            if len(parts) == 1 and parts[0][1] == phase and set(parts[0][0]) == {k}
        ]
        r2 = float("nan")
        if len(rows) > 1:
            tt, pp = t[rows], pred[rows]
            ss_tot = float(((tt - tt.mean()) ** 2).sum())
            r2 = 1.0 - float(((pp - tt) ** 2).sum()) / ss_tot if ss_tot > 0 else 1.0
        fits[(k, phase)] = coef + (r2,)
    over = {p: float(x[cols[("", p, 0)]]) if overhead else 0.0 for p in phases}
    return fits, over


def profile_from_steps(
    base: Profile,
    layer_kinds: Sequence[Union[str, Sequence[str]]],
    steps: Sequence[Tuple[StepPlan, Sequence[Sequence[ActionTiming]]]],
    note: str = "fitted from flatpipe.torch action timings",
    posting_s: float = 0.0,
) -> Tuple[Profile, Dict[Tuple[str, str], Tuple[float, float, float, float]]]:
    """A profile whose every layer kind and phase is fitted from runtime timings.

    Args:
        base: the model's profile to take the structure from (layers, bytes, links).
        layer_kinds: per stage, its layers' kinds (``"embedding"``, ``"decoder"``,
            ``"head"``), or one kind for a stage of one layer.
        steps: per step, its plan and every rank's :class:`ActionTiming` list.

    Every action is a sample of :func:`fit_actions` (an overlapped pair of DualPipeV's is one
    sample of both halves: the runtime runs them in sequence, or interleaved on one compute
    stream when their experts split over different groups, never at once). The I, W and F actions fit
    each kind's phases and, when stages hold different numbers of layers, a fixed cost per
    action and phase. The first stage's I is a no-op in the runtime (its input, token ids,
    needs no gradient) and its W runs the whole backward, as in PyTorch's runtime: that W is
    a fused-backward (B) sample, that I none, and the profile prices the first stage so
    (``Profile.with_overhead(..., first_stage_backward_in_w=True)``). B samples give the
    ratio alpha of a fused backward to I + W (the same GEMMs in one autograd pass), and every
    kind's B is alpha x (I + W); a kind seen only alone on the first stage (the embedding) gets
    its B fitted directly. The forward-only phase Fo is given F's fit (it runs the same
    forward without keeping activations).

    Posting a message (``isend`` / ``irecv``) is not compute: each action's ``post_s`` is taken
    out of its busy time, and the link's per-message ``post_s`` (what its sender and its
    receiver each spend) is the steps' posting time over twice their cross-rank messages, so
    a schedule with more cross-rank transfers (interleaved 1F1B) pays for them (from a trace:
    the time in its ``c10d::`` calls, and ``posting_s``, the seconds of the steps' posting
    actions outside the compute spans).

    Returns the profile and each ``(kind, phase)``'s ``(c0, c_tok, c_attn, r2)``, with
    ``("overhead", phase)`` holding ``(o_s, 0, 0, nan)``, ``("ratio", "B")``
    ``(alpha, samples, 0, nan)`` and ``("link", "post")`` ``(post_s, messages, 0, nan)``.
    Raises ``ValueError`` for a kind with no F timing, or no I or W timing off the first
    stage (time a schedule that splits I and W on every stage, such as ZB-V).
    """
    stage_kinds = [[k] if isinstance(k, str) else list(k) for k in layer_kinds]
    samples: List[Tuple[List[Part], float]] = []
    # Posting done outside the actions' spans (a runtime that posts each send and receive as
    # its own action: ``posting_s``) counts with the time inside them.
    post_total, messages = posting_s, 0
    for plan, ranks in steps:
        mbs = plan.microbatches()
        messages += cross_rank_messages(plan)
        for timings in ranks:
            for t in timings:
                post_total += t.post_s
                busy = t.end_s - t.start_s - t.wait_s - t.post_s
                parts: List[Part] = []
                for stage, kind, mb in parse_action(t.action):
                    if kind == "Fo":
                        break
                    if stage == 0 and kind == "I":
                        continue  # a no-op: the first stage's W runs its whole backward
                    if stage == 0 and kind == "W":
                        kind = "B"
                    m = mbs[mb]
                    parts.append((stage_kinds[stage], kind, float(m.tokens), float(m.attn_pairs)))
                else:
                    if parts and busy > 0:
                        samples.append((parts, busy))
    counts = {len(k) for k in stage_kinds}
    split = [x for x in samples if all(ph != "B" for _, ph, _, _ in x[0])]
    fused = [x for x in samples if any(ph == "B" for _, ph, _, _ in x[0])]
    fits, over = fit_actions(split, overhead=len(counts) > 1)
    kinds_all = sorted({k for ks in stage_kinds for k in ks})
    # A kind with no I or W of its own is the embedding on the first stage, whose backward runs
    # in its W as a fused B: no input gradient. On a stage of its own, its B is fitted directly
    # (and is its W); sharing the first stage with decoders, its weight gradient is too small
    # to tell apart and the ratio below prices the stage's B.
    no_split = {lk for lk in kinds_all if (lk, "I") not in fits and (lk, "W") not in fits}
    is_alone = [all(ph == "B" and set(kinds) <= no_split for kinds, ph, _, _ in x[0]) for x in fused]
    alone = [x for x, a in zip(fused, is_alone) if a]
    if alone:
        direct, _ = fit_actions(alone, overhead=False)
        for (lk, _), v in direct.items():
            fits[(lk, "B")] = v
            fits[(lk, "W")] = v
        fused = [x for x, a in zip(fused, is_alone) if not a]
    first_only = {k for k in kinds_all if all(k not in ks for ks in stage_kinds[1:])}
    for lk in kinds_all:
        for phase in ("I", "W"):
            if (lk, phase) in fits:
                continue
            if lk not in first_only:
                raise ValueError(
                    f"no {phase} timing of a {lk} layer: time a schedule that splits I and W "
                    "on every stage, such as ZB-V"
                )
            fits[(lk, phase)] = (0.0, 0.0, 0.0, float("nan"))

    def part_s(kinds: Sequence[str], phase: str, tokens: float, pairs: float) -> float:
        got = over.get(phase, 0.0)
        for k in kinds:
            c0, ct, ca, _ = fits[(k, phase)]
            got += c0 + ct * tokens + ca * pairs
        return got

    alpha = 1.0
    if fused:
        # A fused backward computes what I and W compute (the same GEMMs), in one autograd
        # pass instead of two: priced as alpha x (I + W), alpha the ratio of the B samples'
        # measured time to their I + W prediction (a sum over samples, as steps sum actions).
        num = den = 0.0
        for parts, busy in fused:
            for kinds, ph, tok, pairs in parts:
                if ph == "B":
                    den += part_s(kinds, "I", tok, pairs) + part_s(kinds, "W", tok, pairs)
                else:
                    busy -= part_s(kinds, ph, tok, pairs)
            num += busy
        alpha = num / den if den > 0 and num > 0 else 1.0
        for lk in kinds_all:
            if (lk, "B") in fits:
                continue
            i, w = fits[(lk, "I")], fits[(lk, "W")]
            fits[(lk, "B")] = tuple(alpha * (a + b) for a, b in zip(i[:3], w[:3])) + (float("nan"),)
        over["B"] = alpha * (over.get("I", 0.0) + over.get("W", 0.0))
        fits[("ratio", "B")] = (alpha, float(len(fused)), 0.0, float("nan"))
    profile = base
    for lk in kinds_all:
        for phase in ("F", "I", "W", "B"):
            got = fits.get((lk, phase))
            if got is None:
                if phase == "B":
                    continue
                raise ValueError(f"no {phase} timing of a {lk} layer: time a schedule that splits I and W")
            c0, ct, ca, _ = got
            profile = profile.with_costs(lk, phase, c0, ct, ca, note)
            if phase == "F":
                profile = profile.with_costs(lk, "Fo", c0, ct, ca, note)
    nan = float("nan")
    for phase, o in over.items():
        fits[("overhead", phase)] = (o, 0.0, 0.0, nan)
    # The runtime's: per action, and the first stage's backward in its W.
    profile = profile.with_overhead(
        over.get("F", 0.0), over.get("I", 0.0), over.get("W", 0.0), over.get("B", 0.0), True
    )
    post = post_total / (2 * messages) if messages else 0.0
    fits[("link", "post")] = (post, float(messages), 0.0, nan)
    if post > 0:
        profile = profile.with_post(post)
    return profile, fits


def cross_rank_messages(plan: StepPlan) -> int:
    """Transfers of one step between stages on different ranks: each F of a stage whose
    next stage is elsewhere sends an activation, each I or B of a stage whose previous stage
    is elsewhere sends a gradient (forward-only work included)."""
    ranks = plan.stage_ranks
    n = len(ranks)
    count = 0
    for rank in range(plan.num_ranks):
        for text in plan.actions(rank):
            for stage, kind, _ in parse_action(text):
                if kind in ("F", "Fo") and stage + 1 < n and ranks[stage + 1] != ranks[stage]:
                    count += 1
                elif kind in ("I", "B") and stage > 0 and ranks[stage - 1] != ranks[stage]:
                    count += 1
    return count



def profiler_overhead_s(ops: int = 2000, repeats: int = 3) -> float:
    """Seconds the PyTorch profiler (CPU activity) adds per event it records, on this host:
    the same small forward (a linear layer, a ReLU and a sum on ``[64, 64]``, several events
    each) timed ``repeats`` times without and inside ``torch.profiler.profile``, the median
    difference over the events recorded. A trace's spans include this cost for every event
    nested in them (``import_trace``'s ``nested``); a run without the profiler does not pay it.
    """
    import statistics
    import time

    import torch
    from torch.profiler import ProfilerActivity, profile

    x = torch.randn(64, 64)
    lin = torch.nn.Linear(64, 64)

    def work() -> float:
        t0 = time.perf_counter()
        with torch.no_grad():
            for _ in range(ops):
                lin(x).relu().sum()
        return time.perf_counter() - t0

    work()
    diffs = []
    for _ in range(repeats):
        plain = work()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            traced = work()
        events = sum(e.count for e in prof.key_averages())
        diffs.append(max(traced - plain, 0.0) / max(events, 1))
    return statistics.median(diffs)


def profile_from_trace(
    base: Profile,
    layer_kinds: Sequence[Union[str, Sequence[str]]],
    plans: Sequence[StepPlan],
    paths: Sequence[str],
    steps: Optional[Sequence[int]] = None,
    overhead_per_event_s: float = 0.0,
) -> Tuple[Profile, Dict[Tuple[str, str], Tuple[float, float, float, float]]]:
    """:func:`profile_from_steps` from PyTorch profiler traces instead of the runtime's
    in-memory timings: ``paths`` are the rank files of a run whose actions are labelled
    ``PP:<action>`` (flatpipe's runtime, or PyTorch's multi-stage schedules), ``plans[i]`` the
    plan of the trace's step ``steps[i]`` (default: every step, in order). Each action's busy
    time is what the trace import gives it (from its first nested operator to its end), less
    its ``c10d::`` calls (posting its sends and receives, the link's ``post_s``, with the
    posting actions of the comm lanes: ``PP:..SEND_..`` / ``PP:..RECV_..``) and, with
    ``overhead_per_event_s`` (:func:`profiler_overhead_s`), the profiler's own cost of the
    events recorded in it."""
    first = import_trace(list(paths))
    chosen = list(range(first.steps)) if steps is None else list(steps)
    if len(chosen) != len(plans):
        raise ValueError(f"{len(plans)} plans for {len(chosen)} traced steps {chosen}")
    timed = []
    posting = 0.0
    for plan, step in zip(plans, chosen):
        t = import_trace(list(paths), step)
        # The posting of a send or receive recorded as its own action (``PP:0SEND_F1``,
        # ``PP:1RECV_F1``; not the waits) on the comm lanes.
        posting += sum(
            e - s
            for lane in t.comm
            for a, s, e in lane
            if ("SEND_" in a or "RECV_" in a) and "WAIT_" not in a
        )
        ranks = []
        for acts, nested in zip(t.actions, t.nested):
            row = []
            for (a, s, e), (events, comm) in zip(acts, nested):
                # The profiler's own cost is no busy time of the run being predicted: it is
                # taken out with the waits.
                profiler = min(events * overhead_per_event_s, max(e - s - comm, 0.0))
                row.append(ActionTiming(a, s, e, profiler, post_s=comm))
            ranks.append(row)
        timed.append((plan, ranks))
    return profile_from_steps(
        base, layer_kinds, timed, note="fitted from PyTorch profiler traces", posting_s=posting
    )
