"""The native module: step plans, errors, plan files written by the flatpipe binary,
predictions against the binary's own simulate."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

import flatpipe
from conftest import flatpipe_bin


def test_microbatches_and_cu_seqlens_by_hand():
    pipe = flatpipe.Pipeline("1f1b", pp=2, num_layers=6, token_budget=512)
    step = pipe.plan_step([300, 200, 120, 40], step=3)
    # First-fit decreasing at 512: 300 + 200 = 500; 120 does not fit (620), nor 40 (540).
    mbs = step.microbatches()
    assert [mb.tokens for mb in mbs] == [500, 160]
    np.testing.assert_array_equal(mbs[0].cu_seqlens, [0, 300, 500])
    np.testing.assert_array_equal(mbs[1].cu_seqlens, [0, 120, 160])
    assert mbs[0].cu_seqlens.dtype == np.int64
    np.testing.assert_array_equal(mbs[1].seq_lens, [120, 40])
    assert mbs[0].attn_pairs == 300 * 301 // 2 + 200 * 201 // 2
    assert step.step == 3 and step.num_ranks == 2 and step.num_stages == 2
    # 1F1B with p = 2, m = 2 (Narayanan et al. 2021): rank 0 warms up with p - 1 - 0 = 1 forward.
    assert step.actions(0) == ["0F0", "0F1", "0B0", "0B1"]
    assert step.actions(1) == ["1F0", "1B0", "1F1", "1B1"]
    # Without a profile there is no prediction.
    assert step.predicted_step_time_s() is None and step.timeline() == []


def test_chunked_sequences_by_hand():
    """A 300-token sequence, budget 64, chunk_tokens 64: 5 chunks of 60 at offsets 0..240, whose
    pairs (60 * 61 / 2 + 60 * o each) add up to the unsplit 300 * 301 / 2; the short sequences
    are packed as usual."""
    pipe = flatpipe.Pipeline("1f1b", pp=2, num_layers=6, token_budget=64, chunk_tokens=64)
    plan = pipe.plan_step([300, 30, 25], 0)
    mbs = plan.microbatches()
    assert [mb.chunk for mb in mbs[:5]] == [(0, k, 5, 60 * k) for k in range(5)]
    assert all(mb.chunk is None for mb in mbs[5:])
    assert [mb.attn_pairs for mb in mbs[:2]] == [1830, 1830 + 60 * 60]
    assert sum(mb.attn_pairs for mb in mbs[:5]) == 300 * 301 // 2
    # The last stage runs chunk 1's backward before chunk 0's.
    acts = plan.actions(1)
    assert acts.index("1B1") < acts.index("1B0"), acts
    with pytest.raises(flatpipe.FlatpipeError, match="chunk_tokens = 65"):
        flatpipe.Pipeline("1f1b", pp=2, num_layers=6, token_budget=64, chunk_tokens=65)


def test_v_placement_and_split_backward():
    pipe = flatpipe.Pipeline("zb-v", pp=2, num_layers=6, microbatches=2)
    assert pipe.vpp == 2
    # V placement: rank r holds stages r and 2p - 1 - r.
    assert pipe.stage_ranks == [0, 1, 1, 0]
    assert pipe.stages == [(0, 2), (2, 4), (4, 5), (5, 6)]
    step = pipe.plan_step([10, 20, 30, 40])
    assert step.stages_of(0) == [0, 3] and step.stages_of(1) == [1, 2]
    letters = {a[1:-1] for r in range(2) for a in step.actions(r)}
    assert letters == {"F", "I", "W"}


def test_each_step_has_its_own_microbatch_count():
    pipe = flatpipe.Pipeline("zb-h1", pp=4, num_layers=10, token_budget=100)
    counts = [len(pipe.plan_step(s).microbatches()) for s in ([90] * 9, [50], [100, 100])]
    assert counts == [9, 1, 2]


@pytest.mark.parametrize(
    "call, words",
    [
        (lambda: flatpipe.Pipeline("1f1b", pp=0, num_layers=6), ["pp = 0", ">= 1"]),
        (lambda: flatpipe.Pipeline("2f2b", pp=2, num_layers=6), ["2f2b", "1f1b", "zb-v"]),
        (lambda: flatpipe.Pipeline("1f1b", pp=4, num_layers=3), ["at most", "3 layers"]),
        (lambda: flatpipe.Pipeline("zb-v", pp=4, num_layers=6), ["zb-v", "2 stages per rank", "8 stages"]),
        (
            lambda: flatpipe.Pipeline("1f1b", pp=2, num_layers=6, stages=[(0, 2), (3, 6)]),
            ["stages[1]", "must start at 2"],
        ),
        (lambda: flatpipe.Pipeline("1f1b", pp=2, num_layers=6).plan_step([5, 0]), ["seq_lens[1] = 0"]),
        (lambda: flatpipe.Pipeline("1f1b", pp=2, num_layers=6).plan_step([5]).actions(2), ["rank = 2", "2 ranks"]),
        (lambda: flatpipe.Profile.analytic("llama3.1-8b", "tpu"), ["tpu"]),
        (lambda: flatpipe.Profile.load("/nonexistent/p.yaml"), ["/nonexistent/p.yaml"]),
        (lambda: flatpipe.Profile.analytic("llama3.1-70b", "h200").tensor_parallel(3), ["tp", "GPUs per node"]),
    ],
)
def test_errors_carry_the_rust_message(call, words):
    with pytest.raises(flatpipe.FlatpipeError) as e:
        call()
    for w in words:
        assert w in str(e.value), str(e.value)


def test_errors_are_value_errors_that_name_the_field_and_value(tmp_path):
    # An argument out of range: a ValueError whose field and value are the argument's.
    with pytest.raises(ValueError) as e:
        flatpipe.Pipeline("1f1b", pp=0, num_layers=4)
    assert isinstance(e.value, flatpipe.FlatpipeError)
    assert (e.value.field, e.value.value) == ("pp", "0"), str(e.value)
    # A field of a file: the hardware file's field and its value.
    hw = tmp_path / "h.yaml"
    hw.write_text(
        "name: x\nmemory_bytes: 1\npeak_flops: -5\nhbm_bytes_per_s: 1\ngpus_per_node: 8\n"
        "intra_node: {alpha_s: 0, beta_bytes_per_s: 1}\ninter_node: {alpha_s: 0, beta_bytes_per_s: 1}\n"
    )
    with pytest.raises(flatpipe.FlatpipeError) as e:
        flatpipe.Profile.analytic("llama3.1-8b", str(hw))
    assert (e.value.field, e.value.value) == ("peak_flops", "-5"), str(e.value)
    # An error about no one field (a file that is not there) has neither.
    with pytest.raises(flatpipe.FlatpipeError) as e:
        flatpipe.Profile.load("/nonexistent/p.yaml")
    assert (e.value.field, e.value.value) == (None, None)


def _pipe():
    return flatpipe.Pipeline("1f1b", pp=2, num_layers=4)


@pytest.mark.parametrize(
    "call, field, value",
    [
        (lambda: flatpipe.Pipeline("1f1b", pp=-1, num_layers=4), "pp", "-1"),
        (lambda: flatpipe.Pipeline("1f1b", pp=2**40, num_layers=4), "pp", str(2**40)),
        (lambda: flatpipe.Pipeline("1f1b", pp=2, num_layers=4, token_budget=-5), "token_budget", "-5"),
        (lambda: flatpipe.Pipeline("1f1b", pp=2, stages=[(0, 2), (-2, 4)]), "stages[1][0]", "-2"),
        (lambda: _pipe().plan_step([100, -3]), "seq_lens[1]", "-3"),
        (lambda: _pipe().plan_step([100], step=-1), "step", "-1"),
        (lambda: _pipe().plan_step([100]).actions(-1), "rank", "-1"),
        (lambda: _pipe().plan_step([100]).microbatches(replica=-2), "replica", "-2"),
        (lambda: flatpipe.Workload.load("sharegpt-v3").sample_step(-1), "step", "-1"),
    ],
)
def test_negative_or_oversized_integers_name_the_argument(call, field, value):
    """PyO3 turned these into an OverflowError without the argument's name."""
    with pytest.raises(flatpipe.FlatpipeError) as e:
        call()
    assert (e.value.field, e.value.value) == (field, value), str(e.value)
    assert "an integer from 0 to" in str(e.value)


def test_the_schedule_and_policy_enums_are_the_cores_names():
    assert [s.value for s in flatpipe.Schedule] == flatpipe.SCHEDULES
    assert [p.value for p in flatpipe.Policy] == flatpipe.POLICIES
    # An enum member is a str: it goes wherever a name does.
    pipe = flatpipe.Pipeline(
        flatpipe.Schedule.ZB_V, pp=2, num_layers=8, policy=flatpipe.Policy.FLAT_BALANCED
    )
    assert pipe.schedule == "zb-v" == flatpipe.Schedule.ZB_V
    assert str(flatpipe.Schedule.ONE_F_ONE_B) == "1f1b"
    assert flatpipe.Schedule(pipe.schedule) is flatpipe.Schedule.ZB_V


def test_the_stub_matches_the_native_module(tmp_path):
    """mypy's stubtest checks python/flatpipe/_core.pyi against the built module: every class,
    function, argument and default, as a type checker's user relies on them."""
    r = subprocess.run(
        [sys.executable, "-m", "mypy.stubtest", "flatpipe._core"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stdout + r.stderr


def test_workload_steps_are_seeded_draws():
    w = flatpipe.Workload.load("sharegpt-v3")
    a, b = w.sample_step(0), w.sample_step(1)
    assert a.dtype == np.uint32 and len(a) == 128 and not np.array_equal(a, b)
    np.testing.assert_array_equal(a, w.sample_step(0, seed=w.seed))
    with pytest.raises(flatpipe.FlatpipeError, match="nope"):
        flatpipe.Workload.load("nope")


def test_prediction_with_a_profile():
    profile = flatpipe.Profile.analytic("llama3.1-8b", "h200")
    assert profile.num_layers == 34
    pipe = flatpipe.Pipeline("1f1b", pp=4, profile=profile, token_budget=8192)
    step = pipe.plan_step([4096] * 16)
    t = step.predicted_step_time_s()
    timeline = step.timeline()
    # Every action of every rank is on the timeline, within the step.
    assert len(timeline) == sum(len(step.actions(r)) for r in range(4))
    assert all(0 <= s < e <= t + 1e-12 for _, _, s, e in timeline)
    # The step is at least the busiest rank's compute.
    busy = [sum(e - s for r2, _, s, e in timeline if r2 == r) for r in range(4)]
    assert t >= max(busy)
    assert len(step.predicted_peak_bytes()) == 4


@pytest.mark.skipif(flatpipe_bin() is None, reason="needs the flatpipe binary (cargo build)")
def test_a_plan_file_written_by_flatpipe_plan(tmp_path):
    out = tmp_path / "plan.yaml"
    subprocess.run(
        [flatpipe_bin(), "plan", "--ranks", "4", "--tp", "1", "--pp", "4", "--schedule", "zb-v",
         "--steps", "2", "-o", str(out), "--gantt", str(tmp_path / "g.png")],
        check=True, capture_output=True,
    )
    pipe = flatpipe.Pipeline.from_plan(str(out))
    assert pipe.schedule == "zb-v" and pipe.pp == 4 and pipe.vpp == 2
    assert pipe.profile.model == "llama3.1-8b"
    step = pipe.plan_step([1000, 2000, 3000, 500] * 8)
    assert step.predicted_step_time_s() > 0


@pytest.mark.skipif(flatpipe_bin() is None, reason="needs the flatpipe binary (cargo build)")
def test_simulate_matches_the_binary():
    """The same configuration through the binary's simulate and the Python binding."""
    out = subprocess.run(
        [flatpipe_bin(), "simulate", "--model", "llama3.1-8b", "--hardware", "h200",
         "--workload", "sharegpt-v3", "--schedule", "1f1b", "--pp", "4", "--token-budget",
         "16384", "--steps", "6", "--format", "json", "--gantt", "none"],
        check=True, capture_output=True, text=True,
    ).stdout
    row = json.loads(out)[0]
    pipe = flatpipe.Pipeline(
        "1f1b", pp=4, profile=flatpipe.Profile.analytic("llama3.1-8b", "h200"), token_budget=16384
    )
    got = pipe.simulate("sharegpt-v3", steps=6)
    assert got.step_time_mean_s == pytest.approx(row["step_time_s"]["mean"], rel=1e-9)
    assert got.peak_memory_bytes == pytest.approx(row["peak_memory_bytes"], rel=1e-9)


def test_plan_ranks_candidates_best_first():
    profile = flatpipe.Profile.analytic("llama3.1-8b", "h200")
    ranked = flatpipe.plan(profile, "sharegpt-v3", ranks=8, steps=2, keep=3)
    assert 1 <= len(ranked) <= 3
    assert all(isinstance(c, flatpipe.PlanCandidate) for c in ranked)
    times = [c.step_time_mean_s for c in ranked]
    assert times == sorted(times)
    for c in ranked:
        assert c.tp * c.dp * c.pp == 8
        assert c.stages[0][0] == 0 and c.stages[-1][1] == profile.num_layers
        assert len(c.recompute) == len(c.stages) == c.pp * c.vpp
        assert c.lower_bound_s <= c.step_time_mean_s
        assert c.schedule in flatpipe.SCHEDULES and len(c.peak_memory_bytes) == c.pp
    # The best candidate is the binary's plan on the same search.
    out = subprocess.run(
        [flatpipe_bin(), "plan", "--model", "llama3.1-8b", "--hardware", "h200", "--workload",
         "sharegpt-v3", "--ranks", "8", "--steps", "2", "--keep", "3", "--format", "json",
         "--gantt", "none"],
        check=True, capture_output=True, text=True,
    ).stdout
    best = json.loads(out)["plans"][0]
    assert ranked[0].step_time_mean_s == pytest.approx(best["summary"]["step_time_s"]["mean"], rel=1e-9)
    with pytest.raises(AttributeError):
        ranked[0].step_time_mean_s = 0.0  # frozen


def test_submodules_load_on_first_use():
    import flatpipe as fp

    assert fp.torch.PipelineRuntime and fp.models.Stage and fp.fit.fit_costs
    with pytest.raises(AttributeError):
        fp.nope


def test_verl_kk_and_flat_planned_policies():
    # verl-kk, verl PR #7553's case: lengths [7] * 8 with budget 8 give 8 microbatches of one
    # sequence each (ceil(56 / 8) = 7 parts cannot all fit).
    pipe = flatpipe.Pipeline("1f1b", pp=2, num_layers=6, token_budget=8, policy="verl-kk")
    assert [mb.tokens for mb in pipe.plan_step([7] * 8).microbatches()] == [7] * 8
    # flat-planned with a profile: never slower than flat-ffd's cut of the same step, every
    # sequence kept once, every microbatch within the budget.
    profile = flatpipe.Profile.analytic("llama3.1-8b", "h200")
    seqs = [3000, 2500, 1200, 900, 800, 700, 400, 300, 200, 100, 60, 50]
    ffd = flatpipe.Pipeline("1f1b", pp=4, profile=profile, token_budget=4096).plan_step(seqs)
    planned = flatpipe.Pipeline(
        "1f1b", pp=4, profile=profile, token_budget=4096, policy="flat-planned"
    ).plan_step(seqs)
    assert planned.predicted_step_time_s() <= ffd.predicted_step_time_s()
    assert sorted(int(s) for mb in planned.microbatches() for s in mb.seq_lens) == sorted(seqs)
    assert all(mb.tokens <= 4096 for mb in planned.microbatches())
