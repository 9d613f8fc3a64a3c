"""The training loop of docs/pytorch.md and examples/python/train.py: the same code for pp = 1
and pp > 1 (no pipeline forks)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
TRAIN = os.path.join(ROOT, "examples", "python", "train.py")


def train(nproc: int, schedule: str) -> list[dict]:
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone",
         f"--nproc-per-node={nproc}", TRAIN, "--schedule", schedule, "--steps", "4"],
        check=True, capture_output=True, text=True, timeout=300,
    ).stdout
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


@pytest.mark.parametrize("schedule", ["zb-h1", "interleaved-1f1b"])
def test_pp1_and_pp2_train_the_same(schedule):
    one, two = train(1, schedule), train(2, schedule)
    assert len(one) == len(two) == 4
    for a, b in zip(one, two):
        # The same microbatches, losses and gradient norms through 4 AdamW steps.
        assert a["microbatches"] == b["microbatches"]
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)
    # Steps vary in their microbatch counts.
    assert len({len(s["microbatches"]) for s in one}) >= 2
