"""flatpipe's runtime and PyTorch's own (Schedule1F1B with padded microbatches) on the same
model and data: both give the single-process gradients."""

from __future__ import annotations

import json

import torch.multiprocessing as mp

from _torch_pp import run
from _workers import ATOL

# Steps with at least as many microbatches as ranks (PyTorch's Schedule1F1B refuses fewer).
STEPS = [[40, 7, 19, 33, 12, 5, 28, 50, 9, 17], [30, 25, 35, 28, 60, 3]]


def test_pytorch_runtime_with_padding_gives_the_same_gradients(tmp_path):
    spec = {"decoders": 4, "budget": 64, "steps": STEPS}
    mp.spawn(run, args=(2, str(tmp_path / "init"), spec, str(tmp_path)), nprocs=2, join=True)
    for r in range(2):
        rows = json.load(open(tmp_path / f"rank{r}.json"))
        assert {row["runtime"] for row in rows} == {"flatpipe", "torch"}
        for row in rows:
            where = f"rank {r} {row['runtime']} step {row['step']}"
            assert abs(row["loss"] - row["want_loss"]) <= 1e-5 * row["want_loss"], where
            assert row["grad_excess"] <= ATOL, f"{where}: gradient off by {row['grad_excess']}"
        # The steps differ in microbatch count and size: PyTorch's stage is rebuilt for each.
        assert len({len(row["microbatches"]) for row in rows}) == 2
