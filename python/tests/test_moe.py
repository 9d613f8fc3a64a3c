"""The mixture-of-experts reference layer (``flatpipe.models`` with ``experts > 0``): against a
per-token loop of its definition, and split over 2 gloo processes (expert parallelism with
``all_to_all_single``) against one process, outputs and every gradient."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F

from _moe_workers import CFG, run_ep, tokens
from flatpipe.models import ModelConfig, Stage


def per_token(moe, m):
    """The layer's definition, one token at a time: softmax over the router's logits, the
    ``top_k`` largest (ties to the lower index), weights divided by their sum, and the weighted
    sum of those experts' SwiGLU outputs."""
    out = []
    for row in m:
        p = torch.softmax(row @ moe.router, dim=-1)
        order = p.detach()
        chosen = sorted(range(p.numel()), key=lambda e: (-float(order[e]), e))[: moe.cfg.top_k]
        total = sum(p[e] for e in chosen)
        y = 0
        for e in chosen:
            ex = moe.experts[e]
            y = y + p[e] / total * ((F.silu(row @ ex.w_gate) * (row @ ex.w_up)) @ ex.w_down)
        out.append(y)
    return torch.stack(out)


def test_the_layer_is_its_definition():
    cfg = ModelConfig(experts=6, top_k=2, expert_ffn=8, num_decoders=1, seed=1)
    moe = Stage(cfg, 1, 2).decoders[0].moe
    m = torch.randn(17, cfg.hidden, generator=torch.Generator().manual_seed(7))
    r = torch.randn(17, cfg.hidden)
    got = moe(m)
    want = per_token(moe, m)
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
    (got * r).sum().backward()
    have = {n: p.grad.clone() for n, p in moe.named_parameters()}
    moe.zero_grad()
    (want * r).sum().backward()
    for n, p in moe.named_parameters():
        assert torch.allclose(have[n], p.grad, atol=1e-5), n


def test_expert_parallel_equals_one_process(tmp_path):
    world = 2
    mp.spawn(run_ep, args=(world, str(tmp_path / "init"), str(tmp_path)), nprocs=world, join=True)
    got = [torch.load(tmp_path / f"ep{r}.pt") for r in range(world)]
    # One process, every expert, both ranks' tokens: the loss is the sum of the two.
    ref = Stage(CFG, 1, 3)
    want = {}
    for r in range(world):
        x, cu, proj = tokens(r)
        x.requires_grad_(True)
        y = ref(x, cu)
        (y * proj).sum().backward()
        assert torch.allclose(got[r]["y"], y.detach(), atol=1e-5), r
        assert torch.allclose(got[r]["dx"], x.grad, atol=1e-5), r
    want = {k: p.grad for k, p in ref.layer_parameters().items()}
    # Each expert's gradient lives on the process holding it; the rest is summed over both (what
    # the data-parallel reduction does).
    names = set()
    for g in got:
        names |= set(g["grads"])
    assert names == set(want)
    for name, w in want.items():
        if ".moe.experts." in name:
            (have,) = [g["grads"][name] for g in got if name in g["grads"]]
        else:
            have = sum(g["grads"][name] for g in got)
        assert torch.allclose(have, w, atol=1e-5), name
    # The skewed microbatch did send very uneven counts: most rows to two experts.
    moe = ref.decoders[0].moe
    x, _, _ = tokens(1)
    idx, _ = moe.route(ref.decoders[0].mlp_norm(x))
    counts = torch.bincount(idx.reshape(-1), minlength=CFG.experts)
    assert int(counts.max()) >= 18, counts


def test_bad_expert_settings_are_refused():
    with pytest.raises(ValueError, match="top_k"):
        Stage(ModelConfig(experts=2, top_k=3), 1, 2)


# A step of variable-length sequences, cut into 4 microbatches per replica: the expert-parallel
# partners (the two replicas of a pipeline rank) run the same actions, with different T.
EP_STEPS = [[40, 7, 19, 33, 12, 5, 28, 50, 9, 17, 61, 22]]


@pytest.mark.parametrize("schedule", ["1f1b", "zb-v", "dualpipev"])
def test_pipeline_with_expert_parallelism_equals_one_process(tmp_path, schedule):
    """pp 2 x dp 2 on 4 gloo processes, each mixture-of-experts layer's 4 experts split over the
    two replicas of its pipeline rank (ep = dp = 2): the step's loss, and every gradient against
    the single-process run of the whole model on both replicas' data (experts' on the process
    holding them, the rest after the data-parallel all-reduce)."""
    from _workers import run, spawn_reports

    spec = {
        "schedule": schedule,
        "decoders": 4,
        "budget": 64,
        "microbatches": 4,
        "dp": 2,
        "ep": True,
        "moe": {"experts": 4, "top_k": 2, "expert_ffn": 16},
        "steps": EP_STEPS,
    }
    world = 4
    reports = spawn_reports(run, world, spec, tmp_path)
    for rank, steps in enumerate(reports):
        for i, s in enumerate(steps):
            where = f"{schedule} rank {rank} step {i}"
            assert not s["missing"], f"{where}: no gradient for {s['missing']}"
            loss = sum(reports[(rank // 2) * 2 + d][i]["loss"] for d in range(2))
            assert abs(loss - s["want_loss"]) <= 1e-5 * abs(s["want_loss"]), where
            assert s["grad_excess"] <= 1e-6, f"{where}: {s['grad_excess']}"


def test_overlapped_pairs_interleave_around_their_all_to_alls(tmp_path):
    """DualPipeV at pp 2 x ep 2 with one expert-parallel group per stage: each overlapped pair
    runs its halves on two threads sharing the rank's compute stream. The gradients still equal
    one process's, no two compute stretches of a pair overlap, and the trace shows the order:
    in the pairs whose two halves both exchange tokens, an all-to-all of one half is posted
    before a stretch of the other half's compute starts and completes after it starts (the
    other half computed while it was on the wire). A half without a mixture-of-experts layer
    (a stage of only the head) computes in one stretch, and a pair whose other half has
    finished has nothing left to hide under."""
    from _moe_workers import OVERLAP_SPEC
    from _workers import run, spawn_reports

    spec = OVERLAP_SPEC
    world = 4
    reports = spawn_reports(run, world, spec, tmp_path)
    pairs = hidden = 0
    for rank, steps in enumerate(reports):
        s = steps[0]
        loss = sum(reports[(rank // 2) * 2 + d][0]["loss"] for d in range(2))
        assert abs(loss - s["want_loss"]) <= 1e-5 * abs(s["want_loss"]), rank
        assert s["grad_excess"] <= 1e-6, f"rank {rank}: {s['grad_excess']}"
        for text, events in s["overlapped"]:
            compute = sorted((a, b, h) for h, what, a, b in events if what == "compute")
            for (a0, b0, _), (a1, _, _) in zip(compute, compute[1:]):
                assert b0 <= a1, f"rank {rank} {text}: two halves computed at once"
            wires = [(h, what, a, b) for h, what, a, b in events if what != "compute"]
            if {h for h, _, _, _ in wires} == {0, 1}:
                pairs += 1
                hidden += any(
                    a < c0 < b for h, _, a, b in wires for c0, _, ch in compute if ch != h
                )
    assert pairs > 0, "no overlapped pair whose halves both exchange tokens ran interleaved"
    assert hidden > 0, f"none of {pairs} pairs computed one half under the other's all-to-all"


def test_partners_with_different_microbatch_counts_are_refused(tmp_path):
    """Without a fixed count the two replicas cut this step into different numbers of
    microbatches: their all-to-alls would not pair up, so the runtime refuses the step on both
    (one process per replica, pp = 1)."""
    from _workers import run, spawn_reports

    spec = {
        "schedule": "1f1b",
        "decoders": 2,
        "budget": 64,
        "dp": 2,
        "ep": True,
        "moe": {"experts": 4, "top_k": 2, "expert_ffn": 16},
        "steps": [[4, 50, 56, 1, 58]],
    }
    with pytest.raises(Exception, match="expert-parallel partners run 1 to 2 microbatches"):
        mp.spawn(run, args=(2, str(tmp_path / "init"), spec, str(tmp_path)), nprocs=2, join=True)
