#!/usr/bin/env python3
"""Online re-planning in the PyTorch runtime with a straggler, measured: 4 gloo processes on
the CPU, the built-in tiny model (flatpipe.models, 8 decoders, hidden 256) at pp 4, zb-auto
with 8 microbatches of tiny-chat per step, 40 steps, rank 1 computing 1.5x slower from step 10
(flatpipe.replan.slow_rank_for_testing). The profile is measured first on this machine with
flatpipe.torch.profile on the same stage modules. Three ways:

  static   every step planned on the measured profile;
  replan   every step planned from the estimate after the last (forgetting 0.7), every rank
           fed the same gathered timings (flatpipe.replan.gather_timings);
  oracle   every step planned from the start on the profile the re-planned run ended with.

Prints per run and way the mean step (barrier to barrier) over steps 15-39, the busiest rank's
mean busy time over them (no plan on this layer split is faster), and the median planning time
per step; then the medians over RUNS runs. Run with the test environment's Python
(scripts/python-env.sh prints it): python scripts/replan_torch.py [RUNS]
"""

from __future__ import annotations

import json
import os
import statistics as st
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python", "tests"))

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

import flatpipe  # noqa: E402
from _replan_workers import model_config, run  # noqa: E402
from flatpipe.models import Stage  # noqa: E402

STEPS, SLOW_FROM, WINDOW = 40, 10, (15, 40)


def measure_profile(path: str) -> None:
    torch.set_num_threads(1)
    cfg = model_config({})
    base = flatpipe.Profile.analytic("tiny", "cpu")
    prof, _ = flatpipe.torch.profile(
        lambda a, b: Stage(cfg, a, b), cfg.num_layers, base, hidden_size=cfg.hidden,
        vocab_size=cfg.vocab, tokens=(256, 512, 1024), seq_lens=(None, 64), repeats=3,
    )
    with open(path, "w") as f:
        f.write(prof.to_yaml())


def one(mode: str, spec: dict, out: str) -> list:
    os.makedirs(out, exist_ok=True)
    spec = dict(spec, mode=mode)
    mp.spawn(run, args=(4, os.path.join(out, "init"), spec, out), nprocs=4, join=True)
    return [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(4)]


def summary(reports: list) -> tuple:
    a, b = WINDOW
    steps = reports[0][a:b]
    wall = st.mean(s["wall_s"] for s in steps)
    busiest = st.mean(max(s["busy_s"]) for s in steps)
    planning = st.median(s["planning_s"] for s in reports[0])
    return wall, busiest, planning


def main() -> None:
    runs = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    workload = flatpipe.Workload.load("tiny-chat")
    lengths = [[int(x) for x in workload.sample_step(s)] for s in range(STEPS)]
    rows = []
    for k in range(runs):
        with tempfile.TemporaryDirectory() as tmp:
            prof = os.path.join(tmp, "profile.yaml")
            measure_profile(prof)
            spec = {
                "profile": prof, "schedule": "zb-auto", "microbatches": 8,
                "lengths": lengths, "slow": [1, 1.5, SLOW_FROM], "forgetting": 0.7,
            }
            static = summary(one("static", spec, os.path.join(tmp, "static")))
            rep = one("replan", spec, os.path.join(tmp, "replan"))
            replan = summary(rep)
            spec["oracle"] = os.path.join(tmp, "replan", "planning.yaml")
            oracle = summary(one("oracle", spec, os.path.join(tmp, "oracle")))
            factors = rep[0][-1]["factors"]
        rows.append((static, replan, oracle, factors))
        print(
            f"run {k + 1}: static {static[0]:.3f} s (busiest rank {static[1]:.3f} s), "
            f"replan {replan[0]:.3f} s (busiest {replan[1]:.3f} s), oracle {oracle[0]:.3f} s "
            f"(busiest {oracle[1]:.3f} s), "
            f"replan vs oracle {100 * (replan[0] / oracle[0] - 1):+.1f}%, "
            f"planning {1e3 * replan[2]:.2f} ms ({100 * replan[2] / replan[0]:.3f}%), "
            f"factors {[round(f, 2) for f in factors]}",
            flush=True,
        )
    med = lambda i, j: st.median(r[i][j] for r in rows)
    print(
        f"median: static {med(0, 0):.3f} s (busiest rank {med(0, 1):.3f} s), replan "
        f"{med(1, 0):.3f} s (busiest {med(1, 1):.3f} s), oracle {med(2, 0):.3f} s (busiest "
        f"{med(2, 1):.3f} s), replan vs static "
        f"{100 * st.median(r[1][0] / r[0][0] - 1 for r in rows):+.1f}%, replan vs oracle "
        f"{100 * st.median(r[1][0] / r[2][0] - 1 for r in rows):+.1f}%, planning "
        f"{1e3 * med(1, 2):.2f} ms ({100 * st.median(r[1][2] / r[1][0] for r in rows):.3f}%)"
    )


if __name__ == "__main__":
    main()
