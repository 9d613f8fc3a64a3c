"""Fitting the cost model from runtime timings, and profiles built from the fit."""

from __future__ import annotations

import itertools
import os

import numpy as np
import pytest

import flatpipe
from flatpipe.fit import cross_rank_messages, fit_costs, nnls, profile_from_steps, profile_from_trace
from flatpipe.torch import ActionTiming, parse_action

# A synthetic runtime with known costs: per layer kind and phase, seconds (c0, c_tok, c_attn).
# The embedding has no input gradient and a weight gradient too small to tell apart (0 here),
# as in flatpipe.torch, where the first stage's I is a no-op and its W the whole backward.
TRUE = {
    ("embedding", "F"): (2e-4, 1e-7, 0.0),
    ("decoder", "F"): (5e-4, 2e-6, 3e-9),
    ("decoder", "I"): (6e-4, 3e-6, 6e-9),
    ("decoder", "W"): (4e-4, 2.5e-6, 0.0),
    ("head", "F"): (3e-4, 4e-6, 0.0),
    ("head", "I"): (2e-4, 3e-6, 0.0),
    ("head", "W"): (2e-4, 3e-6, 0.0),
}
# Per action and phase, whatever the stage holds.
OVERHEAD = {"F": 1e-4, "I": 2.5e-4, "W": 1.5e-4}
# A fused backward costs ALPHA x what I and W cost, their per-action overheads included.
ALPHA = 0.8
# Posting one message, at each end.
POST = 3e-5
# The closed loop's layout: embedding + 2 decoders, a decoder, 2 decoders, the head.
KINDS = ["embedding"] + ["decoder"] * 5 + ["head"]
STAGES = [(0, 3), (3, 4), (4, 6), (6, 7)]


def cost(kind, phase, tokens, pairs):
    c0, ct, ca = TRUE.get((kind, phase), (0.0, 0.0, 0.0))
    return c0 + ct * tokens + ca * pairs


def action_s(stage, phase, tokens, pairs):
    layers = KINDS[STAGES[stage][0] : STAGES[stage][1]]
    run = lambda ph: OVERHEAD[ph] + sum(cost(k, ph, tokens, pairs) for k in layers)  # noqa: E731
    if phase == "B" or (stage == 0 and phase == "W"):
        return ALPHA * (run("I") + run("W"))
    if stage == 0 and phase == "I":
        return 0.0
    return run(phase)


def test_fit_recovers_exact_coefficients():
    samples = [(t, p, cost("decoder", "F", t, p)) for t, p in [(64, 2080), (128, 3000), (256, 33000), (512, 9000), (32, 528)]]
    c0, ct, ca, r2 = fit_costs(samples)
    assert (c0, ct, ca) == pytest.approx(TRUE[("decoder", "F")], rel=1e-6)
    assert r2 == pytest.approx(1.0)
    # A negative unconstrained fit is not returned: every coefficient >= 0.
    c0, ct, ca, _ = fit_costs([(10, 0, 1.0), (20, 0, 1.5), (30, 0, 1.9)])
    assert min(c0, ct, ca) >= 0
    with pytest.raises(ValueError):
        fit_costs([])


def test_nnls_matches_the_exact_solution_over_every_support():
    rng = np.random.default_rng(7)
    for _ in range(20):
        a = rng.normal(size=(12, 4))
        b = rng.normal(size=12)
        best = None
        for k in range(0, 5):
            for cols in itertools.combinations(range(4), k):
                x = np.zeros(4)
                if cols:
                    x[list(cols)] = np.linalg.lstsq(a[:, cols], b, rcond=None)[0]
                if (x < 0).any():
                    continue
                err = float(((a @ x - b) ** 2).sum())
                if best is None or err < best[0]:
                    best = (err, x)
        got = nnls(a, b)
        assert (got >= 0).all()
        assert float(((a @ got - b) ** 2).sum()) == pytest.approx(best[0], rel=1e-9, abs=1e-12)


def synthetic_zb_v_steps():
    pipe = flatpipe.Pipeline("zb-v", pp=2, num_layers=len(KINDS), stages=STAGES, token_budget=64)
    ranks_of = pipe.stage_ranks
    steps = []
    for i, lens in enumerate([[40, 7, 19, 33, 12], [60, 3, 30], [64, 10, 20, 33], [5, 50, 9, 61, 2]]):
        plan = pipe.plan_step(lens, i)
        mbs = plan.microbatches()
        ranks = []
        for r in range(2):
            timings, now = [], 0.0
            for a in plan.actions(r):
                [(stage, phase, mb)] = parse_action(a)
                d = action_s(stage, phase, mbs[mb].tokens, mbs[mb].attn_pairs)
                # Each cross-rank message is posted at both ends: both counted on its sender.
                sends = (phase == "F" and stage + 1 < 4 and ranks_of[stage + 1] != r) or (
                    phase in ("I", "B") and stage > 0 and ranks_of[stage - 1] != r
                )
                post = 2 * POST if sends else 0.0
                wait = 1e-5
                timings.append(ActionTiming(a, now, now + wait + d + post, wait, d, post))
                now += wait + d + post
            ranks.append(timings)
        steps.append((plan, ranks))
    return steps


def test_profile_from_zb_v_timings_recovers_the_runtime_and_predicts_by_hand():
    steps = synthetic_zb_v_steps()
    # The fitted kinds and phases go into any model's profile (here Llama-3.1-8B's layers).
    base = flatpipe.Profile.analytic("llama3.1-8b", "cpu")
    with pytest.raises(flatpipe.FlatpipeError):
        base.with_costs("decoder", "X", 0, 0)
    profile, fits = profile_from_steps(base, [KINDS[s:e] for s, e in STAGES], steps)
    for key, want in TRUE.items():
        assert fits[key][:3] == pytest.approx(want, rel=1e-5, abs=1e-12), key
    for phase, want in OVERHEAD.items():
        assert fits[("overhead", phase)][0] == pytest.approx(want, rel=1e-5), phase
    assert fits[("ratio", "B")][0] == pytest.approx(ALPHA, rel=1e-5)
    assert fits[("overhead", "B")][0] == pytest.approx(ALPHA * (OVERHEAD["I"] + OVERHEAD["W"]), rel=1e-5)
    assert fits[("link", "post")][0] == pytest.approx(POST, rel=1e-9)
    # One rank, one stage, one microbatch of one sequence: F, then one fused B, over every
    # layer (1 embedding, 32 decoders, 1 head), and no optimizer, transfer or other cost.
    one = flatpipe.Pipeline("1f1b", pp=1, profile=profile.with_link(1e-6, 1e9, 0.0), token_budget=100)
    t, p = 100, 100 * 101 // 2
    counts = (("embedding", 1), ("decoder", 32), ("head", 1))
    run = lambda ph: OVERHEAD[ph] + sum(n * cost(k, ph, t, p) for k, n in counts)  # noqa: E731
    want = run("F") + ALPHA * (run("I") + run("W"))
    got = one.plan_step([100]).predicted_step_time_s()
    assert got == pytest.approx(want, rel=1e-6)
    # ZB-H1 on 2 ranks splits I and W on its first stage too: there I costs nothing and W is
    # the fused backward; an unfitted profile prices that stage's I and W as two passes.
    split = flatpipe.Pipeline("zb-h1", pp=1, profile=profile.with_link(1e-6, 1e9, 0.0), token_budget=100)
    assert split.plan_step([100]).predicted_step_time_s() == pytest.approx(want, rel=1e-6)


def test_posting_costs_each_cross_rank_message_at_both_ends():
    base = flatpipe.Profile.analytic("tiny", "cpu").with_link(1e-5, 1e9, 0.0)
    # Interleaved 1F1B on 2 ranks: every stage boundary crosses ranks (3 per microbatch and
    # direction); ZB-V keeps the middle one on rank 1.
    lens = [64, 64, 64, 64]
    for kind, crossing in (("interleaved-1f1b", 3), ("zb-v", 2)):
        plain = flatpipe.Pipeline(kind, pp=2, profile=base, token_budget=64).plan_step(lens)
        posted = flatpipe.Pipeline(kind, pp=2, profile=base.with_post(1e-3), token_budget=64).plan_step(lens)
        assert cross_rank_messages(plain) == 2 * crossing * len(lens)
        busy = lambda plan: sum(e - s for _, _, s, e in plan.timeline())  # noqa: E731
        # Each message costs its sender and its receiver 1 ms of compute time.
        assert busy(posted) - busy(plain) == pytest.approx(2 * 1e-3 * cross_rank_messages(plain), rel=1e-6)


TRACES = os.path.join(os.path.dirname(__file__), "..", "..", "tests", "data", "traces")


def test_a_profile_fitted_from_real_traces():
    """The committed traces of flatpipe's runtime (scripts/traces/make_traces.py: ZB-V on 2
    ranks over a 4-layer model, one layer per stage) fit every kind and phase."""
    paths = [os.path.join(TRACES, f"flatpipe-zb-v.rank{r}.json.gz") for r in range(2)]
    t = flatpipe.import_trace(paths)
    assert t.steps == 2 and t.step == 1 and "RECV_F" in t.other_events
    # The traced steps, planned again exactly as the script planned them.
    pipe = flatpipe.Pipeline("zb-v", pp=2, num_layers=4, token_budget=64)
    plans = [pipe.plan_step(lens, i) for i, lens in enumerate([[40, 7, 19, 33, 12, 5, 28, 50], [30, 25, 35, 28, 60]])]
    for i, plan in enumerate(plans):
        got = flatpipe.import_trace(paths, i).actions
        assert [[a for a, _, _ in rank] for rank in got] == [plan.actions(r) for r in range(2)]
    base = flatpipe.Profile.analytic("llama3.1-8b", "cpu")
    kinds = ["embedding", "decoder", "decoder", "head"]
    profile, fits = profile_from_trace(base, kinds, plans, paths, overhead_per_event_s=1e-7)
    costs = {(k, p) for k in ("decoder", "head") for p in ("F", "I", "W")} | {("embedding", "F")}
    assert costs <= set(fits)
    assert all(min(fits[c][:3]) >= 0 and sum(fits[c][:3]) > 0 for c in costs)
    # The embedding alone on the first stage: no input gradient, its W the whole backward,
    # fitted directly; one layer per stage leaves no per-action cost to tell apart.
    assert fits[("embedding", "I")][:3] == (0.0, 0.0, 0.0)
    assert fits[("embedding", "W")] == fits[("embedding", "B")] and sum(fits[("embedding", "B")][:3]) > 0
    assert all(fits[("overhead", p)][0] == 0.0 for p in ("F", "I", "W"))
    # The runtime posts its sends and receives as their own PP: actions (the comm lanes): a
    # posting cost.
    assert fits[("link", "post")][0] > 0
    assert profile.to_yaml().count("fitted from PyTorch profiler traces") == 1


def test_nested_events_of_a_real_trace_match_a_count_of_the_raw_events():
    """``import_trace``'s ``nested`` against the trace's own events, counted here: per compute
    action of the last step on rank 0, the events on its thread that start inside its span,
    and the time in ``c10d::`` calls."""
    import gzip
    import json

    paths = [os.path.join(TRACES, f"flatpipe-zb-v.rank{r}.json.gz") for r in range(2)]
    t = flatpipe.import_trace(paths)
    with gzip.open(paths[0], "rt") as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    spans = [e for e in events if e["name"].startswith("PP:") and e["name"][3:] in set(a for a, _, _ in t.actions[0])]
    spans.sort(key=lambda e: e["ts"])
    last = spans[-len(t.actions[0]) :]
    assert [e["name"][3:] for e in last] == [a for a, _, _ in t.actions[0]]
    want = []
    for span in last:
        inside = [
            e
            for e in events
            if not e["name"].startswith("PP:")
            and (e["pid"], e["tid"]) == (span["pid"], span["tid"])
            and span["ts"] <= e["ts"] <= span["ts"] + span["dur"]
        ]
        comm = sum(e["dur"] for e in inside if e["name"].startswith("c10d::")) * 1e-6
        want.append((len(inside), comm))
    got = t.nested[0]
    assert [n for n, _ in got] == [n for n, _ in want]
    assert [c for _, c in got] == pytest.approx([c for _, c in want], abs=1e-9)
    assert sum(n for n, _ in got) > 0
    # The runtime posts its sends and receives in their own PP: events, between the compute
    # spans: their c10d:: calls are there, not inside the spans.
    assert sum(c for _, c in got) == pytest.approx(0.0, abs=1e-9)
    posts = [e for e in events if e["name"].startswith("PP:") and "SEND_" in e["name"]]
    assert posts and any(
        e["name"].startswith("c10d::")
        and any(p["ts"] <= e["ts"] <= p["ts"] + p["dur"] for p in posts)
        for e in events
    )


def test_a_schedule_without_split_backwards_cannot_fit_i_and_w():
    # Interleaved 1F1B runs F and fused B only: the decoders' I and W are unknown.
    pipe = flatpipe.Pipeline("interleaved-1f1b", pp=2, num_layers=len(KINDS), stages=STAGES, token_budget=64)
    plan = pipe.plan_step([40, 7, 19, 33], 0)
    ranks = [
        [ActionTiming(a, 2e-3 * k, 2e-3 * k + 1e-3, 0.0) for k, a in enumerate(plan.actions(r))]
        for r in range(2)
    ]
    base = flatpipe.Profile.analytic("llama3.1-8b", "cpu")
    with pytest.raises(ValueError, match="no I timing of a decoder layer.*ZB-V"):
        profile_from_steps(base, [KINDS[s:e] for s, e in STAGES], [(plan, ranks)])
