"""flatpipe's runtime and PyTorch's own pipelining runtime side by side (CPU, gloo, 2 ranks).

The same model, the same steps and the same microbatches (flatpipe's cut at a 512-token budget
of tiny-chat's sampled steps), 1F1B in both. PyTorch's ``Schedule1F1B`` runs every microbatch
padded to the step's largest and its stage and schedule rebuilt per step (its buffers are shaped
by the first microbatch; ``python/tests/_torch_pp.py``); flatpipe's runs the microbatches as
they are. Both runtimes' gradients equal the single-process run (checked here and in
``python/tests/test_vs_torch.py``). Prints the median step time of each over the steps after two
warm-up steps, and the padding PyTorch computes on.

    python python/bench/vs_torch.py [--steps 10] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

import flatpipe  # noqa: E402
from _torch_pp import run  # noqa: E402
from _workers import ATOL  # noqa: E402

MODEL = {"vocab": 256, "hidden": 128, "heads": 4, "kv_heads": 2, "ffn": 256, "num_decoders": 4}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--budget", type=int, default=512)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    w = flatpipe.Workload.load("tiny-chat")
    steps = [[int(x) for x in w.sample_step(s)] for s in range(a.steps)]
    spec = {"model": MODEL, "budget": a.budget, "steps": steps}
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(run, args=(2, os.path.join(d, "init"), spec, d), nprocs=2, join=True)
        rows = json.load(open(os.path.join(d, "rank0.json")))
        rows1 = json.load(open(os.path.join(d, "rank1.json")))
    bad = [r for r in rows + rows1 if r["grad_excess"] > ATOL]
    if bad:
        sys.exit(f"gradients differ from the single-process run: {bad[0]}")
    out = {}
    for runtime in ("flatpipe", "torch"):
        mine = [r for r in rows if r["runtime"] == runtime][2:]
        out[runtime] = statistics.median(r["wall_s"] for r in mine)
    true = sum(sum(r["microbatches"]) for r in rows if r["runtime"] == "torch")
    padded = sum(len(r["microbatches"]) * max(r["microbatches"]) for r in rows if r["runtime"] == "torch")
    res = {
        "steps": a.steps,
        "budget": a.budget,
        "model": MODEL,
        "flatpipe_step_s": out["flatpipe"],
        "torch_padded_step_s": out["torch"],
        "torch_padding_fraction": 1 - true / padded,
    }
    if a.json:
        print(json.dumps(res, indent=2))
    else:
        print(
            f"1F1B, 2 gloo ranks, tiny-chat steps at a {a.budget}-token budget, median over "
            f"{a.steps - 2} steps: flatpipe {out['flatpipe'] * 1e3:.1f} ms, PyTorch Schedule1F1B "
            f"(padded, rebuilt per step) {out['torch'] * 1e3:.1f} ms; PyTorch computes on "
            f"{res['torch_padding_fraction'] * 100:.1f}% padding; gradients of both equal the "
            f"single-process run"
        )


if __name__ == "__main__":
    main()
