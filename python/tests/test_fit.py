"""Fitting the cost model from runtime timings, and profiles built from the fit."""

from __future__ import annotations

import os

import pytest

import flatpipe
from flatpipe.fit import fit_costs, profile_from_steps, profile_from_trace
from flatpipe.torch import ActionTiming, parse_action

TRUE = {
    ("embedding", "F"): (2e-4, 1e-7, 0.0),
    ("embedding", "I"): (1e-4, 0.0, 0.0),
    ("embedding", "W"): (3e-4, 2e-7, 0.0),
    ("decoder", "F"): (5e-4, 2e-6, 3e-9),
    ("decoder", "I"): (6e-4, 3e-6, 6e-9),
    ("decoder", "W"): (4e-4, 2.5e-6, 0.0),
    ("head", "F"): (3e-4, 4e-6, 0.0),
    ("head", "I"): (2e-4, 3e-6, 0.0),
    ("head", "W"): (2e-4, 3e-6, 0.0),
}


def cost(kind, phase, tokens, pairs):
    c0, ct, ca = TRUE[(kind, phase)]
    return c0 + ct * tokens + ca * pairs


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


def test_profile_from_zb_v_timings_predicts_by_hand():
    # ZB-V on 2 ranks over a 4-layer model: 4 stages of one layer each.
    pipe = flatpipe.Pipeline("zb-v", pp=2, num_layers=4, token_budget=64)
    kinds = ["embedding", "decoder", "decoder", "head"]
    steps = []
    for i, lens in enumerate([[40, 7, 19, 33, 12], [60, 3, 30], [64, 10, 20, 33]]):
        plan = pipe.plan_step(lens, i)
        mbs = plan.microbatches()
        ranks = []
        for r in range(2):
            timings, now = [], 0.0
            for a in plan.actions(r):
                [(stage, phase, mb)] = parse_action(a)
                d = cost(kinds[stage], phase, mbs[mb].tokens, mbs[mb].attn_pairs)
                timings.append(ActionTiming(a, now, now + d + 1e-5, 1e-5))
                now += d + 1e-5
            ranks.append(timings)
        steps.append((plan, ranks))
    # The fitted kinds and phases go into any model's profile (here Llama-3.1-8B's layers).
    base = flatpipe.Profile.analytic("llama3.1-8b", "cpu")
    with pytest.raises(flatpipe.FlatpipeError):
        base.with_costs("decoder", "X", 0, 0)
    profile, fits = profile_from_steps(base, kinds, steps)
    for key, want in TRUE.items():
        assert fits[key][:3] == pytest.approx(want, rel=1e-5, abs=1e-12), key
    # One rank, one stage, one microbatch of one sequence: F, then B = I + W, over every layer
    # (1 embedding, 32 decoders, 1 head), and no optimizer, transfer or other cost.
    one = flatpipe.Pipeline("1f1b", pp=1, profile=profile.with_link(1e-6, 1e9, 0.0), token_budget=100)
    t, p = 100, 100 * 101 // 2
    want = sum(
        n * sum(cost(k, ph, t, p) for ph in ("F", "I", "W"))
        for k, n in (("embedding", 1), ("decoder", 32), ("head", 1))
    )
    got = one.plan_step([100]).predicted_step_time_s()
    assert got == pytest.approx(want, rel=1e-6)


TRACES = os.path.join(os.path.dirname(__file__), "..", "..", "tests", "data", "traces")


def test_a_profile_fitted_from_real_traces():
    """The committed traces of flatpipe's runtime (scripts/traces/make_traces.py: ZB-V on 2
    ranks over a 4-layer model, one layer per stage) fit every kind and phase."""
    paths = [os.path.join(TRACES, f"flatpipe-zb-v.rank{r}.json.gz") for r in range(2)]
    t = flatpipe.import_trace(paths)
    assert t["steps"] == 2 and t["step"] == 1 and "RECV_F" in t["other_events"]
    # The traced steps, planned again exactly as the script planned them.
    pipe = flatpipe.Pipeline("zb-v", pp=2, num_layers=4, token_budget=64)
    plans = [pipe.plan_step(lens, i) for i, lens in enumerate([[40, 7, 19, 33, 12, 5, 28, 50], [30, 25, 35, 28, 60]])]
    for i, plan in enumerate(plans):
        got = flatpipe.import_trace(paths, i)["actions"]
        assert [[a for a, _, _ in rank] for rank in got] == [plan.actions(r) for r in range(2)]
    base = flatpipe.Profile.analytic("llama3.1-8b", "cpu")
    kinds = ["embedding", "decoder", "decoder", "head"]
    profile, fits = profile_from_trace(base, kinds, plans, paths)
    assert set(fits) == {(k, p) for k in ("embedding", "decoder", "head") for p in ("F", "I", "W")}
    assert all(min(v[:3]) >= 0 and sum(v[:3]) > 0 for v in fits.values())
    assert profile.to_yaml().count("fitted from PyTorch profiler traces") == 1
