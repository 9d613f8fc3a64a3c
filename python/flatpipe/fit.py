"""Cost profiles from the runtime's own timings: the closed loop on a real framework.

flatpipe's cost model prices one layer kind's phase on a microbatch as
``t = c0 + c_tok * tokens + c_attn * attn_pairs`` seconds (``profiles/src/profile.rs``).
:func:`fit_costs` fits it by non-negative least squares on relative residuals (every subset of
the three coefficients is solved exactly and the best non-negative one kept, as the Rust
profiler's ``nnls_fit`` does). :func:`profile_from_steps` turns the action timings of steps
that :class:`flatpipe.torch.PipelineRuntime` ran, on a pipeline whose stages hold one layer
each, into a :class:`flatpipe.Profile`: each action's busy time (its span less the wait for its
input: compute, posting its sends and receives, and the runtime's own bookkeeping) is a sample
of its stage's layer kind and phase. Predicting other schedules with that profile and running
them closes the loop (``python/bench/closed_loop.py``).
"""

from __future__ import annotations

import itertools
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from . import Profile, StepPlan, import_trace
from .torch import ActionTiming, parse_action

__all__ = ["fit_costs", "profile_from_steps", "profile_from_trace"]

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


def profile_from_steps(
    base: Profile,
    layer_kinds: Sequence[str],
    steps: Sequence[Tuple[StepPlan, Sequence[Sequence[ActionTiming]]]],
    note: str = "fitted from flatpipe.torch action timings",
) -> Tuple[Profile, Dict[Tuple[str, str], Tuple[float, float, float, float]]]:
    """A profile whose every layer kind and phase is fitted from runtime timings.

    Args:
        base: the model's profile to take the structure from (layers, bytes, links).
        layer_kinds: the layer kind of each stage (``"embedding"``, ``"decoder"``, ``"head"``):
            the timed pipeline must hold one layer per stage.
        steps: per step, its plan and every rank's :class:`ActionTiming` list.

    F, I and W samples come from F, I and W actions (a B, fused I and W, is not used). The
    forward-only phase Fo is given F's fit (it runs the same forward without keeping
    activations). Returns the profile and each ``(kind, phase)``'s ``(c0, c_tok, c_attn, r2)``.
    Raises ``ValueError`` for a kind and phase with no timing (time a schedule that splits I
    and W, such as ZB-V).
    """
    samples: Dict[Tuple[str, str], List[Sample]] = {}
    for plan, ranks in steps:
        mbs = plan.microbatches()
        for timings in ranks:
            for t in timings:
                parts = parse_action(t.action)
                if len(parts) != 1:
                    continue
                stage, kind, mb = parts[0]
                if kind not in ("F", "I", "W"):
                    continue
                busy = t.end_s - t.start_s - t.wait_s
                if busy <= 0:
                    continue
                m = mbs[mb]
                samples.setdefault((layer_kinds[stage], kind), []).append(
                    (float(m.tokens), float(m.attn_pairs), busy)
                )
    fits = {}
    profile = base
    for lk in sorted(set(layer_kinds)):
        for phase in ("F", "I", "W"):
            got = samples.get((lk, phase))
            if not got:
                raise ValueError(f"no {phase} timing of a {lk} layer: time a schedule that splits I and W")
            fits[(lk, phase)] = fit_costs(got)
            c0, ct, ca, _ = fits[(lk, phase)]
            profile = profile.with_costs(lk, phase, c0, ct, ca, note)
            if phase == "F":
                profile = profile.with_costs(lk, "Fo", c0, ct, ca, note)
    return profile, fits


def profile_from_trace(
    base: Profile,
    layer_kinds: Sequence[str],
    plans: Sequence[StepPlan],
    paths: Sequence[str],
    steps: Optional[Sequence[int]] = None,
) -> Tuple[Profile, Dict[Tuple[str, str], Tuple[float, float, float, float]]]:
    """:func:`profile_from_steps` from PyTorch profiler traces instead of the runtime's
    in-memory timings: ``paths`` are the rank files of a run whose actions are labelled
    ``PP:<action>`` (flatpipe's runtime, or PyTorch's multi-stage schedules), ``plans[i]`` the
    plan of the trace's step ``steps[i]`` (default: every step, in order). Each action's busy
    time is what the trace import gives it: from its first nested operator to its end."""
    first = import_trace(list(paths))
    chosen = list(range(first["steps"])) if steps is None else list(steps)
    if len(chosen) != len(plans):
        raise ValueError(f"{len(plans)} plans for {len(chosen)} traced steps {chosen}")
    timed = []
    for plan, step in zip(plans, chosen):
        t = import_trace(list(paths), step)
        ranks = [[ActionTiming(a, s, e, 0.0) for a, s, e in rank] for rank in t["actions"]]
        timed.append((plan, ranks))
    return profile_from_steps(base, layer_kinds, timed, note="fitted from PyTorch profiler traces")
