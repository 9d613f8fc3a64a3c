"""Prints one overlapped DualPipeV pair's trace from the torch runtime: pp 2 x ep 2 on 4 gloo
processes, one expert-parallel group per stage, the model and step of
``python/tests/test_moe.py::test_overlapped_pairs_interleave_around_their_all_to_alls``
(``_moe_workers.OVERLAP_SPEC``). The first pair on rank 0 whose halves both exchange tokens,
its events in ms from the step's start: which half, what (a stretch of compute, or an
all-to-all from posting to completion).

    python python/bench/overlap_trace.py
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from _moe_workers import OVERLAP_SPEC as SPEC  # noqa: E402
from _workers import run  # noqa: E402


def main() -> None:
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(run, args=(4, os.path.join(d, "init"), SPEC, d), nprocs=4, join=True)
        step = json.load(open(os.path.join(d, "rank0.json")))[0]
    for text, events in step["overlapped"]:
        if {h for h, what, _, _ in events if what != "compute"} == {0, 1}:
            print(f"rank 0, {text}")
            for h, what, a, b in sorted(events, key=lambda e: e[2]):
                print(f"  half {h}  {what:<13} {1e3 * a:8.3f} - {1e3 * b:8.3f} ms")
            return
    print("no pair whose halves both exchange tokens")


if __name__ == "__main__":
    main()
