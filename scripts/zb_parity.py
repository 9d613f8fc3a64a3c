#!/usr/bin/env python3
"""Runs the Zero Bubble authors' heuristic scheduler on a grid of settings and writes its
results to tests/data/zb_heuristic.json, for `tests/zb_parity.rs` to compare zb-auto with
(issue 26, part 3).

The heuristic is `do_heuristic_search` in `megatron/core/pipeline_parallel/auto_schedule.py`
of sail-sg/zero-bubble-pipeline-parallelism, tag zero-bubble-v0.1.0. It is not copied into
this repository: the script loads that file from a checkout given on the command line, with a
stand-in for `pulp` (the ILP path, which the heuristic does not use). It needs torch.

    git clone https://github.com/sail-sg/zero-bubble-pipeline-parallelism /tmp/zb
    git -C /tmp/zb checkout zero-bubble-v0.1.0
    .venv/bin/python scripts/zb_parity.py \
        /tmp/zb/megatron/core/pipeline_parallel/auto_schedule.py tests/data/zb_heuristic.json

The heuristic's figure (`best_time`, what it minimises over its eight settings) is, over the
stages, the longest span from a stage's first F start to its last W end (F, B, W integer costs
per stage, one transfer cost between stages); the makespan of the schedule it picks is the
latest completion time (`heuristic_makespan`), which is what zb-auto minimises;
memory: an F adds `mem_f`, a B and a W each free half of it (`mem_f = 2`, `mem_b = mem_w = -1`
as the file's own examples), under `max_mem` per stage. The grid: p in {4, 6, 8, 12, 16, 32},
m in {p, 2p, 4p}; uniform costs (f, b, w) = (1, 1, 1) and (5, 6, 4), and per-stage costs drawn
around them (seeded); comm 0 and 1; a limit of p and of 2p microbatches' activations.
Where the heuristic's own assertion fails (some per-stage settings), the setting is recorded
with the error and no figure. The last setting is the authors' own heterogeneous 8-stage
example from the file's `__main__` (with the grid's uniform memory per stage).
"""

import importlib.util
import json
import random
import sys
import types


def load(path):
    sys.modules.setdefault("pulp", types.ModuleType("pulp"))
    pulp = sys.modules["pulp"]
    for name in ["LpMinimize", "LpProblem", "LpStatus", "LpVariable", "lpDot", "lpSum"]:
        setattr(pulp, name, None)
    consts = types.ModuleType("pulp.constants")
    pulp.constants = consts
    sys.modules["pulp.constants"] = consts
    spec = importlib.util.spec_from_file_location("zb_auto_schedule", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main():
    src, out = sys.argv[1], sys.argv[2]
    zb = load(src)
    rng = random.Random(20261203)
    settings = []
    for p in [4, 6, 8, 12, 16, 32]:
        for m in sorted({p, 2 * p, 4 * p}):
            for base in [(1, 1, 1), (5, 6, 4)]:
                for per_stage in [False, True]:
                    if per_stage:
                        f = [max(1, base[0] + rng.randint(-1, 2)) for _ in range(p)]
                        b = [max(1, base[1] + rng.randint(-1, 2)) for _ in range(p)]
                        w = [max(1, base[2] + rng.randint(-1, 2)) for _ in range(p)]
                    else:
                        f, b, w = [base[0]] * p, [base[1]] * p, [base[2]] * p
                    for comm in [0, 1]:
                        for units in [p, 2 * p]:
                            cfg = zb.GraphConfig(
                                cost_f=f, cost_b=b, cost_w=w, cost_comm=comm,
                                mem_f=[2] * p, mem_b=[-1] * p, mem_w=[-1] * p,
                                max_mem=[2 * units] * p,
                            )
                            row = {
                                "p": p, "m": m, "f": f, "b": b, "w": w, "comm": comm,
                                "limit_microbatches": units,
                            }
                            try:
                                best, _, complete = zb.do_heuristic_search(p, m, cfg)
                                row["heuristic_span"] = int(best)
                                row["heuristic_makespan"] = int(max(complete))
                            except AssertionError as e:
                                # The heuristic's own consistency check fails on some per-stage
                                # settings: recorded, not compared.
                                row["heuristic_span"] = None
                                row["heuristic_error"] = f"AssertionError {e}"
                            settings.append(row)
        print(f"p = {p}: {len(settings)} settings", file=sys.stderr)
    # The authors' own heterogeneous 8-stage example (the file's `__main__`: p = 8, m = 32,
    # measured per-stage costs, comm 473, max_mem 16 microbatches of the middle stages), with
    # the grid's uniform memory per stage (flatpipe's StageCosts has one unit per F).
    f = [30715, 29233, 29106, 29078, 28850, 28919, 28924, 41678]
    b = [31308, 29344, 29357, 29455, 29217, 29384, 29354, 38731]
    w = [18746, 18789, 19062, 19367, 19455, 19967, 20096, 32833]
    cfg = zb.GraphConfig(
        cost_f=f, cost_b=b, cost_w=w, cost_comm=473,
        mem_f=[2] * 8, mem_b=[-1] * 8, mem_w=[-1] * 8, max_mem=[2 * 16] * 8,
    )
    best, _, complete = zb.do_heuristic_search(8, 32, cfg)
    settings.append({
        "name": "the authors' 8-stage heterogeneous example",
        "p": 8, "m": 32, "f": f, "b": b, "w": w, "comm": 473, "limit_microbatches": 16,
        "heuristic_span": int(best), "heuristic_makespan": int(max(complete)),
    })
    with open(out, "w") as fh:
        json.dump({
            "source": "sail-sg/zero-bubble-pipeline-parallelism zero-bubble-v0.1.0 megatron/core/pipeline_parallel/auto_schedule.py do_heuristic_search",
            "script": "scripts/zb_parity.py",
            "settings": settings,
        }, fh)
        fh.write("\n")


if __name__ == "__main__":
    main()
