"""Re-planning from what the run measured: the estimate on synthetic timings with a known
change point, and the PyTorch runtime re-planning every step in 4 gloo processes with a rank
slowed by the test hook."""

from __future__ import annotations

import pytest

import flatpipe


def _pipe(**kw):
    profile = flatpipe.Profile.analytic("llama3.1-8b", "h100")
    return flatpipe.Pipeline("zb-auto", pp=4, profile=profile, token_budget=8192, **kw)


def _timings(plan, slow=None):
    """The plan's own predicted compute time per action, rank ``slow[0]``'s times ``slow[1]``:
    what a run at the profile's speed (and one slowed rank) would measure."""
    out = []
    for rank, action, start, end in plan.timeline():
        f = slow[1] if slow and rank == slow[0] else 1.0
        out.append((rank, action, (end - start) * f))
    return out


LENGTHS = [300 + (i * 53) % 900 for i in range(48)]


def test_timings_at_the_profiles_speed_leave_every_factor_at_one():
    pipe = _pipe()
    est = flatpipe.SpeedEstimate(pipe)
    plan = pipe.plan_step(LENGTHS, 0)
    est.observe(plan, _timings(plan))
    assert est.steps == 1
    assert est.rank_factors() == pytest.approx([1.0] * 4, rel=1e-6)


def test_a_change_point_is_followed_as_the_geometric_sums_say():
    """Five steps at the profile's speed, then rank 1 at 1.5x: with forgetting g, after k slow
    steps rank 1's factor is (5-step sums weighted g^k..) 1.5 - 0.5 g^k (1 - g^5) / (1 - g^(5+k))
    (a ratio of exponentially weighted sums with equal predicted time per step); the others stay
    at 1."""
    g = 0.6
    pipe = _pipe()
    est = flatpipe.SpeedEstimate(pipe, forgetting=g)
    plan = pipe.plan_step(LENGTHS, 0)
    for _ in range(5):
        est.observe(plan, _timings(plan))
    for k in range(1, 8):
        est.observe(plan, _timings(plan, slow=(1, 1.5)))
        want = 1.5 - 0.5 * g**k * (1 - g**5) / (1 - g ** (5 + k))
        f = est.rank_factors()
        assert f[1] == pytest.approx(want, rel=1e-6), k
        assert f[0] == pytest.approx(1.0, rel=1e-6)
        assert est.phase_factors(1)["f"] == pytest.approx(want, rel=1e-6)


def test_the_planning_pipeline_predicts_the_slowed_rank():
    """Planned from the estimate, the step's prediction grows with rank 1's measured 1.5x, and
    is what the same pipeline predicts on timings from its own plan (factors 1 again)."""
    pipe = _pipe()
    est = flatpipe.SpeedEstimate(pipe)
    plan = pipe.plan_step(LENGTHS, 0)
    est.observe(plan, _timings(plan, slow=(1, 1.5)))
    planner = est.planning_pipeline()
    assert planner.pp == pipe.pp and planner.stages == pipe.stages
    slowed = planner.plan_step(LENGTHS, 1)
    assert slowed.predicted_step_time_s() > plan.predicted_step_time_s() * 1.1
    # Rank 1's stages now cost 1.5x: its busy time in the new plan's timeline.
    busy = lambda p, r: sum(e - s for rr, _, s, e in p.timeline() if rr == r)
    assert busy(slowed, 1) == pytest.approx(1.5 * busy(plan, 1), rel=0.02)


def test_a_rank_that_stays_slow_gets_a_split_proposed():
    """Rank 1 measured 1.5x: the proposed split gives it fewer layers than the even split's
    (32 decoders + embedding + head over 4 ranks), the others more; at equal speeds nothing is
    proposed."""
    pipe = _pipe()
    plan = pipe.plan_step(LENGTHS, 0)
    even = flatpipe.SpeedEstimate(pipe)
    even.observe(plan, _timings(plan))
    assert even.propose_split(4096, 4096 * 300) is None
    est = flatpipe.SpeedEstimate(pipe)
    est.observe(plan, _timings(plan, slow=(1, 1.5)))
    stages = est.propose_split(4096, 4096 * 300)
    assert stages is not None and len(stages) == 4
    assert stages[0][0] == 0 and stages[-1][1] == pipe.num_layers
    layers = [b - a for a, b in stages]
    was = [b - a for a, b in pipe.stages]
    assert layers[1] < was[1], (layers, was)
    with pytest.raises(flatpipe.FlatpipeError, match="tokens"):
        est.propose_split(0)


def test_bad_timings_are_refused_with_the_field():
    pipe = _pipe()
    est = flatpipe.SpeedEstimate(pipe)
    plan = pipe.plan_step(LENGTHS, 0)
    with pytest.raises(flatpipe.FlatpipeError, match="rank"):
        est.observe(plan, [(7, "0F0", 0.1)])
    with pytest.raises(flatpipe.FlatpipeError, match="compute_s"):
        est.observe(plan, [(0, "0F0", -1.0)])
    good = _timings(plan)
    with pytest.raises(flatpipe.FlatpipeError, match="an action the plan puts on rank 0"):
        est.observe(plan, [(0, "0F99", 0.1)])
    with pytest.raises(flatpipe.FlatpipeError, match="once"):
        est.observe(plan, good + good[:1])
    with pytest.raises(flatpipe.FlatpipeError, match="timings is empty"):
        est.observe(plan, [])
    with pytest.raises(flatpipe.FlatpipeError, match="rank"):
        est.phase_factors(4)
    assert est.steps == 0, "nothing refused was counted"
    with pytest.raises(flatpipe.FlatpipeError, match="needs a pipeline with a profile"):
        flatpipe.SpeedEstimate(flatpipe.Pipeline("1f1b", pp=2, num_layers=4))
    with pytest.raises(flatpipe.FlatpipeError, match="forgetting"):
        flatpipe.SpeedEstimate(pipe, forgetting=0.0)


def test_the_runtime_replans_every_step_from_what_it_measured(tmp_path):
    """4 gloo processes, the tiny model at pp 4, zb-auto with 8 microbatches; rank 2 slowed 2x from
    step 2 by the test hook. Every rank plans each step from its own estimate, fed the same
    gathered timings, so every rank runs the same plan (the runtime's check_plan all-reduce
    raises otherwise); the estimate finds rank 2 the slowest."""
    import torch.multiprocessing as mp

    from _replan_workers import run
    from _workers import spawn_reports

    prof = tmp_path / "p.yaml"
    prof.write_text(flatpipe.Profile.analytic("tiny", "cpu").to_yaml())
    spec = {
        "profile": str(prof), "schedule": "zb-auto", "microbatches": 8, "mode": "replan",
        "lengths": [[40 + (i * 17 + s) % 60 for i in range(16)] for s in range(6)],
        "slow": [2, 2.0, 2], "forgetting": 0.5,
    }
    reports = spawn_reports(run, 4, spec, tmp_path)
    last = reports[0][-1]["factors"]
    for r in range(4):
        assert reports[r][-1]["factors"] == last, "every rank holds the same estimate"
    assert last[2] == max(last), last
    assert (tmp_path / "planning.yaml").exists()
