"""Context parallelism in the PyTorch runtime: each process of a group holds its zigzag share of
every microbatch and its attention gathers the group's keys and values, against the
single-process run of the whole model."""

from __future__ import annotations

import pytest
import torch

from flatpipe.models import CpShard, ModelConfig, Stage, cp_pieces
from flatpipe.torch import cp_share


def test_the_zigzag_split_is_the_cores():
    """The split by hand (the Rust core's test): 8 tokens over cp = 2 are chunks [0,2) [2,4)
    [4,6) [6,8), process 0 taking the first and last; a 3-token document gives process 0 only
    [2,3)."""
    assert cp_pieces([8, 3], 0, 2) == [(0, 0, 2), (0, 6, 2), (1, 2, 1)]
    assert cp_pieces([8, 3], 1, 2) == [(0, 2, 2), (0, 4, 2), (1, 0, 1), (1, 1, 1)]
    x = torch.arange(11)
    assert cp_share(x, [0, 8, 11], 1, 2).tolist() == [2, 3, 4, 5, 8, 9]


def test_a_group_of_one_is_the_plain_stage():
    """cp = 1: the share is the microbatch, and the stage's output is the plain one."""
    cfg = ModelConfig(num_decoders=2, seed=1)
    stage = Stage(cfg, 0, cfg.num_layers)
    x, cu = torch.randint(cfg.vocab, (12,)), torch.tensor([0, 7, 12])
    shard = CpShard(None, 0, 1, [7, 5])
    assert torch.allclose(stage(x, cu, cp=shard), stage(x, cu), atol=1e-6)
    with pytest.raises(ValueError, match="holds 12 tokens"):
        stage(x[:5], cu, cp=shard)


#: One step of one long sequence and several short ones (one shorter than 2 cp chunks).
STEPS = [[150, 9, 5, 3, 12], [70, 40, 6]]


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_cp_2_inside_pp_2_equals_one_process(tmp_path, schedule):
    """pp 2 x cp 2 on 4 gloo processes: the two pipelines each run their shares of every
    microbatch, the group's attention gathers keys and values; the loss summed over the group
    and every gradient after the group's all-reduce equal the single-process run's."""
    from _cp_workers import run
    from _workers import spawn_reports

    spec = {"cp": 2, "schedule": schedule, "decoders": 2, "budget": 256, "steps": STEPS}
    world = 4
    reports = spawn_reports(run, world, spec, tmp_path)
    for rank, steps in enumerate(reports):
        for i, s in enumerate(steps):
            where = f"{schedule} rank {rank} step {i}"
            assert not s["missing"], f"{where}: no gradient for {s['missing']}"
            assert s["grad_excess"] <= 1e-6, f"{where}: {s['grad_excess']}"
            # Each pipeline's loss is its shares'; the group's add up to the step's.
            prank = rank // 2
            loss = sum(reports[prank * 2 + i2][i]["loss"] for i2 in range(2))
            assert abs(loss - s["want_loss"]) <= 1e-5 * abs(s["want_loss"]), where
    # The per-sequence loss is refused with a group (a sequence's mean spans its shares).
    assert "loss_reduction = 'sequence' with a cp_group" in reports[0][0]["refused"]
    # The shares split every microbatch.
    for i in range(len(STEPS)):
        assert [a + b for a, b in zip(reports[0][i]["tokens"], reports[1][i]["tokens"])] == reports[0][i]["microbatches"]
