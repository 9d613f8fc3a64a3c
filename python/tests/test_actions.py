"""Structured actions (``StepPlan.actions_of``): the same entries as the action strings, and
the transfer rule (which stage each action sends to and receives from) against tables written
by hand; ``parse_action`` through the core's parser."""

from __future__ import annotations

import re

import pytest

import flatpipe

# Enough microbatches for every schedule's steady state (DualPipeV's overlapped pairs).
LENS = [60, 7] + [55] * 10 + [40, 21]


def plans():
    """Step plans of several schedule kinds on 2 and 4 ranks, one with forward-only work."""
    out = []
    for kind in ("1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zb-v", "dualpipev",
                 "combined-1f1b", "gpipe"):
        for pp in (2, 4):
            pipe = flatpipe.Pipeline(kind, pp=pp, num_layers=16, token_budget=64)
            out.append((f"{kind} pp={pp}", pipe.plan_step(LENS)))
    fo = flatpipe.Pipeline("zb-v", pp=2, num_layers=8, token_budget=64, forward_only=3)
    out.append(("zb-v forward_only=3", fo.plan_step(LENS[:5])))
    return out


PLANS = plans()


@pytest.mark.parametrize("name, plan", PLANS, ids=[n for n, _ in PLANS])
def test_structured_actions_agree_with_the_strings(name, plan):
    for rank in range(plan.num_ranks):
        texts = plan.actions(rank)
        structured = plan.actions_of(rank)
        assert [a.text for a in structured] == texts, f"{name} rank {rank}"
        for a in structured:
            assert str(a) == a.text
            halves = [str(p) for p in a.parts]
            if a.is_overlap:
                # A forward and a backward, forward first.
                assert a.text == f"({halves[0]};{halves[1]})OVERLAP_F_B"
                assert a.parts[0].kind == "F" and a.parts[1].kind in ("I", "B"), a.text
            else:
                assert [a.text] == halves
            assert [(p.stage, p.kind, p.microbatch) for p in a.parts] == flatpipe.parse_action(
                a.text
            )
            # Every part runs a stage this rank holds.
            assert all(plan.stage_ranks[p.stage] == rank for p in a.parts), a.text


def test_the_plans_cover_overlapped_pairs_and_forward_only_work():
    kinds = {n: {p.kind for r in range(pl.num_ranks) for a in pl.actions_of(r) for p in a.parts}
             for n, pl in PLANS}
    overlaps = {n for n, pl in PLANS for r in range(pl.num_ranks) for a in pl.actions_of(r)
                if a.is_overlap}
    assert "dualpipev pp=2" in overlaps and "dualpipev pp=4" in overlaps, overlaps
    assert "combined-1f1b pp=2" in overlaps and "combined-1f1b pp=4" in overlaps, overlaps
    assert "Fo" in kinds["zb-v forward_only=3"]
    assert kinds["zb-v pp=2"] == {"F", "I", "W"}


# Four stages in a V on 2 ranks (stage s and 3 - s on one rank), written out by hand: forwards
# (F, Fo) take stage s - 1's activations and send to s + 1, input backwards (I, B) take stage
# s + 1's gradient and send to s - 1; W moves nothing; the ends of the pipeline have no peer.
V4 = {
    # (stage, kind): (sends_to, receives_from)
    (0, "F"): (1, None),
    (1, "F"): (2, 0),
    (2, "F"): (3, 1),
    (3, "F"): (None, 2),
    (0, "Fo"): (1, None),
    (1, "Fo"): (2, 0),
    (2, "Fo"): (3, 1),
    (3, "Fo"): (None, 2),
    (0, "I"): (None, 1),
    (1, "I"): (0, 2),
    (2, "I"): (1, 3),
    (3, "I"): (2, None),
    (0, "B"): (None, 1),
    (1, "B"): (0, 2),
    (2, "B"): (1, 3),
    (3, "B"): (2, None),
    **{(s, "W"): (None, None) for s in range(4)},
}


@pytest.mark.parametrize(
    "schedule, extra",
    [("zb-v", {}), ("zb-v", {"forward_only": 2}), ("dualpipev", {})],
)
def test_transfers_of_a_four_stage_v_match_a_table(schedule, extra):
    pipe = flatpipe.Pipeline(schedule, pp=2, num_layers=8, token_budget=64, **extra)
    plan = pipe.plan_step(LENS)
    assert plan.stage_ranks == [0, 1, 1, 0]
    seen = set()
    for rank in range(2):
        for a in plan.actions_of(rank):
            for p in a.parts:
                assert (p.sends_to, p.receives_from) == V4[(p.stage, p.kind)], str(p)
                seen.add((p.stage, p.kind))
    # Every stage ran a forward and a backward; the table was exercised, not skipped.
    assert {s for s, _ in seen} == {0, 1, 2, 3}
    assert {k for _, k in seen} >= {"F", "W"} | ({"Fo"} if extra else set())


def test_each_compute_action_is_listed_once():
    """Compute actions compare and hash by value: a training step's parts over all ranks are
    every (stage, microbatch) once per kind."""
    plan = flatpipe.Pipeline("zb-h1", pp=4, num_layers=8, token_budget=64).plan_step(LENS)
    parts = [p for r in range(4) for a in plan.actions_of(r) for p in a.parts]
    assert len(set(parts)) == len(parts) == 4 * len(plan.microbatches()) * 3
    again = [p for r in range(4) for a in plan.actions_of(r) for p in a.parts]
    assert again == parts and {hash(p) for p in again} == {hash(p) for p in parts}


@pytest.mark.parametrize(
    "text, want",
    [
        ("0F3", [(0, "F", 3)]),
        ("12Fo7", [(12, "Fo", 7)]),
        ("3I0", [(3, "I", 0)]),
        ("3W0", [(3, "W", 0)]),
        ("2B11", [(2, "B", 11)]),
        (" 3W1 ", [(3, "W", 1)]),
        ("(0F3;1B2)OVERLAP_F_B", [(0, "F", 3), (1, "B", 2)]),
        ("(3F0;0I1)OVERLAP_F_B", [(3, "F", 0), (0, "I", 1)]),
    ],
)
def test_parse_action_parses(text, want):
    from flatpipe.torch import parse_action

    assert parse_action(text) == want


@pytest.mark.parametrize(
    "text",
    ["", "F3", "0X3", "0f3", "0F", "0F3x", "0F-3", "(0F3;1B2)", "(0F3)OVERLAP_F_B",
     "(0F3;1Q2)OVERLAP_F_B", "0F3;1B2"],
)
def test_parse_action_rejects(text):
    from flatpipe.torch import parse_action

    with pytest.raises(ValueError, match=re.escape(text) if text else None):
        parse_action(text)


def test_parse_action_is_public():
    import flatpipe.torch

    assert "parse_action" in flatpipe.torch.__all__
    assert flatpipe.torch.parse_action is flatpipe.parse_action


@pytest.mark.parametrize("name, plan", PLANS, ids=[n for n, _ in PLANS])
def test_lowered_programs_hold_the_compute_and_match_each_pairs_order(name, plan):
    """``lowered_actions_of``: the compute entries are ``actions_of``'s, and on every ordered
    rank pair the sender's sends and the receiver's receives name the same transfers in the
    same order (how gloo and NCCL match them), each send waited for once after it is posted."""
    sends, recvs = {}, {}
    for rank in range(plan.num_ranks):
        program = plan.lowered_actions_of(rank)
        assert [a.text for a in program if isinstance(a, flatpipe.Action)] == plan.actions(rank)
        posted = set()
        for a in program:
            if not isinstance(a, flatpipe.CommAction):
                continue
            t = (a.carries, a.sending_stage, a.microbatch)
            assert plan.stage_ranks[a.sending_stage if a.kind != "RECV" else a.receiving_stage] == rank
            if a.kind == "SEND":
                sends.setdefault((rank, a.peer), []).append(t)
                posted.add(t)
            elif a.kind == "RECV":
                recvs.setdefault((a.peer, rank), []).append(t)
            else:
                assert t in posted, f"{name} rank {rank}: {a} before its send"
                posted.remove(t)
        assert not posted, f"{name} rank {rank}: sends never waited for: {posted}"
    assert sends == recvs, name


def test_a_deferred_order_that_pairs_would_mismatch_is_refused():
    """ZB-V on 2 ranks under PyTorch's deferred receives: rank 1 posts the receives of rank
    0's activations and gradients in its consumption order, not rank 0's send order."""
    plan = flatpipe.Pipeline("zb-v", pp=2, num_layers=8, token_budget=64).plan_step(LENS)
    with pytest.raises(flatpipe.FlatpipeError, match="posting order"):
        plan.lowered_actions_of(0, posting="deferred")
    with pytest.raises(ValueError, match="posting"):
        plan.lowered_actions_of(0, posting="late")
    ok = flatpipe.Pipeline("1f1b", pp=2, num_layers=8, token_budget=64).plan_step(LENS)
    assert any(str(a) == "0RECV_B0" for a in ok.lowered_actions_of(0, posting="deferred"))
