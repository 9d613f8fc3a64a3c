"""The torch.distributed runtime against a single-process run of the same model (gloo, CPU,
2 and 4 processes): the loss and every gradient, on variable-length steps."""

from __future__ import annotations

import json
import os
import re
import time

import pytest
import torch.multiprocessing as mp

from _workers import ATOL, run, run_bad_plan, run_link, run_traced

# Variable-length steps at a 64-token budget: different T per microbatch, a different number of
# microbatches per step, a step with fewer microbatches than ranks (m < p), and a sequence 10x
# longer than the others (longer than the budget: a microbatch of its own).
STEPS = [
    [40, 7, 19, 33, 12, 5, 28, 50, 9, 17],
    [300, 30, 25, 35, 28],
    [20, 11],
    [23],
]


def launch(tmp_path, world: int, spec: dict):
    init = tmp_path / "init"
    mp.spawn(run, args=(world, str(init), spec, str(tmp_path)), nprocs=world, join=True)
    return [json.load(open(tmp_path / f"rank{r}.json")) for r in range(world)]


def check(reports, dp: int = 1):
    for rank, steps in enumerate(reports):
        for i, s in enumerate(steps):
            where = f"rank {rank} step {s['step']} microbatches {s['microbatches']}"
            assert not s["missing"], f"{where}: no gradient for {s['missing']}"
            # Each replica's pipeline returns its share of the step's loss.
            loss = sum(reports[(rank // dp) * dp + d][i]["loss"] for d in range(dp))
            assert abs(loss - s["want_loss"]) <= 1e-5 * abs(s["want_loss"]), where
            assert s["grad_excess"] <= ATOL, f"{where}: gradient off by {s['grad_excess']}"


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("schedule", ["1f1b", "interleaved-1f1b", "zb-h1", "zb-v"])
def test_gradients_equal_single_process(tmp_path, world, schedule):
    """Part 1's schedules on 2 and 4 processes."""
    spec = {"schedule": schedule, "decoders": 2 * world, "budget": 64, "steps": STEPS}
    reports = launch(tmp_path, world, spec)
    check(reports)
    # The steps really vary: several microbatch counts, one below the rank count.
    counts = {len(s["microbatches"]) for s in reports[0]}
    assert len(counts) >= 3 and min(counts) < world, counts


# Enough microbatches for every schedule's steady state (DualPipeV's overlapped pairs).
MANY = [[60, 7] + [55] * 10 + [40, 21]]


@pytest.mark.parametrize("schedule", ["gpipe", "looped-bfs", "zb-h2", "dualpipev", "zb-auto"])
def test_every_other_schedule_kind(tmp_path, schedule):
    """The remaining schedule kinds on 2 processes (DualPipeV's overlapped pairs run their two
    halves in sequence; zb-auto is built from unit costs without a profile)."""
    spec = {"schedule": schedule, "decoders": 4, "budget": 64, "steps": STEPS[:2] + MANY}
    reports = launch(tmp_path, 2, spec)
    check(reports)
    if schedule == "dualpipev":
        assert any("OVERLAP_F_B" in a for r in reports for a in r[-1]["actions"])


def test_forward_only_work_fused_into_the_schedule(tmp_path):
    """K forward-only microbatches per step fused into ZB-V's bubbles: the last stage's outputs
    equal the whole model's forward, and the training gradients are unchanged."""
    spec = {"schedule": "zb-v", "decoders": 4, "budget": 64, "steps": STEPS[:2], "forward_only": 3}
    reports = launch(tmp_path, 2, spec)
    check(reports)
    fused = [a for r in reports for s in r for a in s["actions"] if "Fo" in a]
    assert fused, "no Fo action in the plan"
    # The last stage (stage 3 of the V: rank 0) returns every forward-only microbatch.
    for s in reports[0]:
        planned, returned, error = s["forward_only"]
        assert planned == returned == 3 and error <= 1e-5, s["forward_only"]


def test_evaluation_step_then_training_step(tmp_path):
    """An evaluation (forward-only) step, then a training step, on the same stages (PyTorch
    #162822): the evaluation loss is the single-process loss and the training gradients still
    equal."""
    spec = {"schedule": "interleaved-1f1b", "decoders": 4, "budget": 64, "steps": STEPS, "eval_first": True}
    reports = launch(tmp_path, 2, spec)
    check(reports)
    for r in reports:
        for s in r:
            assert abs(s["eval_loss"] - s["want_loss"]) <= 1e-5 * s["want_loss"], s


def test_sequence_weighted_loss(tmp_path):
    spec = {
        "schedule": "zb-v",
        "decoders": 4,
        "budget": 64,
        "steps": STEPS[:2],
        "reduction": "sequence",
    }
    check(launch(tmp_path, 2, spec))


def test_data_parallel_sums_gradients_on_each_stages_last_backward(tmp_path):
    """pp = 2 x dp = 2: each replica runs its share of the step; the stages' gradients are
    all-reduced on their last backward and equal the single-process run over both shares."""
    spec = {"schedule": "zb-h1", "decoders": 4, "budget": 64, "steps": STEPS[:2], "dp": 2}
    reports = launch(tmp_path, 4, spec)
    check(reports, dp=2)
    # The two replicas ran different microbatches.
    assert reports[0][0]["microbatches"] != reports[1][0]["microbatches"]


def test_dropping_one_w_is_caught(tmp_path):
    """The comparison can fail: leaving out one weight-gradient pass must show."""
    spec = {"schedule": "zb-h1", "decoders": 4, "budget": 64, "steps": STEPS[:1]}
    full = launch(tmp_path, 2, spec)
    w = next(a for a in full[1][0]["actions"] if "W" in a)
    spec["skip"] = {"1": [w]}
    dropped = launch(tmp_path, 2, spec)
    with pytest.raises(AssertionError, match="gradient off by"):
        check(dropped)


@pytest.mark.parametrize(
    "case, says",
    [
        ("lengths", "different step plans"),
        ("schedule", "different step plans"),
        ("world", "the plan has 4 pipeline ranks"),
        ("hidden", "different boundary tensors"),
        ("module", "torch.bfloat16 tensor for stage 1, but the plan's boundary tensor is"),
    ],
)
def test_plans_that_cannot_run_together_raise_on_every_rank(tmp_path, case, says):
    """Ranks planning other sequence lengths (gloo would abort the process on the size
    mismatch), other schedules with the same lengths (a hang), a pp = 4 plan in a world of 2
    (a hang), or another hidden size on one rank (gloo would fill a narrower tensor's share of
    the buffer and leave the rest): a ValueError on every rank within the timeout. A stage
    module whose output is not the boundary tensor the runtime was told (bfloat16 for float32:
    gloo would accept the half-size message) is refused before the send, and the receiving
    rank's wait fails instead of hanging."""
    ctx = mp.start_processes(
        run_bad_plan,
        args=(2, str(tmp_path / "init"), str(tmp_path), case),
        nprocs=2,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + 120
    while not ctx.join(timeout=5):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"{case}: the ranks hung")
    errors = [json.load(open(tmp_path / f"rank{r}.json"))["error"] for r in range(2)]
    if case == "module":
        # The sender refuses its module's output; the receiver's wait fails when it stops.
        assert errors[0] and errors[0].startswith("ValueError") and says in errors[0], errors
        assert errors[1] and "the sending rank stopped first" in errors[1], errors
        return
    for e in errors:
        assert e and e.startswith("ValueError") and says in e, e


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1", "zb-v"])
def test_chunked_sequences_equal_the_unsplit_single_process_run(tmp_path, schedule):
    """Issue 24: a 300-token sequence with a 64-token budget and chunk_tokens = 64 runs as 5
    chunks of 60 whose forwards attend to the earlier chunks' keys and values and whose
    backwards hand back their gradients (a split backward, I then W, in ZB-H1 and ZB-V); the
    loss and every gradient equal the single-process run of the whole sequence unsplit."""
    spec = {
        "schedule": schedule,
        "decoders": 4,
        "budget": 64,
        "chunk_tokens": 64,
        "steps": [[300, 30, 25, 35, 28], [150, 200]],
    }
    reports = launch(tmp_path, 2, spec)
    check(reports)
    first = reports[0][0]
    assert first["microbatches"][:5] == [60] * 5, first["microbatches"]
    assert [c[1] for c in first["chunks"][:5]] == [0, 1, 2, 3, 4], first["chunks"]
    assert all(c is None for c in first["chunks"][5:])


def test_the_runtime_posts_the_cores_lowered_program_and_records_it(tmp_path):
    """ZB-V on 2 ranks (stages 0 and 3 on rank 0, 1 and 2 on rank 1): the profiler shows one
    ``PP:`` event per entry of the core's lowered program, in its order (the runtime derives
    no order of its own). Checked by hand on that program: its compute entries are the plan's
    actions; each cross-rank result's ``SEND`` follows its compute entry at once; each input
    from the other rank has its ``RECV`` posted before the entry that reads it; the hand-off
    between stages 1 and 2 (both on rank 1) has no send or receive."""
    mp.spawn(run_traced, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        got = json.load(open(tmp_path / f"rank{rank}.json"))
        lowered = got["lowered"]
        assert got["events"] == [f"PP:{a}" for a in lowered], f"rank {rank}"
        compute = [a for a in lowered if re.fullmatch(r"\d+[FIWB]\d+", a)]
        assert compute == got["actions"]
        crossing = {0: {"0F": "0SEND_F", "3I": "3SEND_B"}, 1: {"1I": "1SEND_B", "2F": "2SEND_F"}}
        needs = {0: {"3F": "3RECV_F", "0I": "0RECV_B"}, 1: {"1F": "1RECV_F", "2I": "2RECV_B"}}
        for i, a in enumerate(lowered):
            m = re.fullmatch(r"(\d+)([FIW])(\d+)", a)
            if not m:
                continue
            head, mb = m[1] + m[2], m[3]
            if head in crossing[rank]:
                assert lowered[i + 1] == f"{crossing[rank][head]}{mb}", (rank, a, lowered[i + 1])
            if head in needs[rank]:
                assert f"{needs[rank][head]}{mb}" in lowered[:i], (rank, a)
        local = ("1SEND_F", "2RECV_F", "2SEND_B", "1RECV_B")
        assert not any(a.startswith(local) for a in lowered), lowered


def test_deferred_receives_give_the_same_gradients(tmp_path):
    """The runtime under the core's deferred-receive order (PyTorch's ``_defer_recv_ops``)
    computes the same loss and gradients as the single-process run (ZB-H1: one stage per
    rank, so each rank pair carries one kind of transfer and keeps one order; the core refuses
    the deferred programs that would not, see test_actions)."""
    spec = {
        "schedule": "zb-h1",
        "decoders": 4,
        "budget": 64,
        "steps": STEPS[:2],
        "posting": "deferred",
    }
    check(launch(tmp_path, 2, spec))


def test_the_link_is_measured_once_for_every_rank(tmp_path):
    """flatpipe.torch.profile's link on 3 processes: ranks 0 and 1 ping-pong, and every rank
    gets rank 0's fit, a latency >= 0 and a finite bandwidth > 0."""
    mp.spawn(run_link, args=(3, str(tmp_path / "init"), str(tmp_path)), nprocs=3, join=True)
    got = [json.load(open(tmp_path / f"link{r}.json")) for r in range(3)]
    assert got[0] == got[1] == got[2], got
    alpha, beta = got[0]
    assert alpha >= 0 and 0 < beta < float("inf"), got
