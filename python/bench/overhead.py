"""The Python runtime's overhead per step and per action (CPU, gloo).

Per step: ``Pipeline.plan_step`` (the Rust core cuts the step and builds every rank's
schedule). Per action: 2 gloo processes run 1F1B steps of m microbatches of T tokens through
stages that are one tiny ``nn.Linear`` (H = 32), and the runtime's own timings split each
action's span into the wait for its input, the compute (module and autograd calls), the time
torch.distributed takes to post its ``isend``/``irecv``, and the rest: the runtime's own
bookkeeping. gloo's posting cost is also timed alone (the two ranks in lockstep). The wait is reported apart: on
loopback TCP it is gloo's latency and the other rank's work.

    python python/bench/overhead.py            # prints a table; --json for machine output
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import flatpipe
from flatpipe.torch import PipelineRuntime

H, T = 32, 16


class Tiny(nn.Module):
    def __init__(self, first: bool, last: bool) -> None:
        super().__init__()
        self.first, self.last = first, last
        self.emb = nn.Embedding(64, H) if first else None
        self.lin = nn.Linear(H, 64 if last else H)

    def forward(self, x, cu_seqlens):
        if self.emb is not None:
            x = self.emb(x)
        return self.lin(x)


def plan_step_time(m: int, reps: int = 200) -> float:
    pipe = flatpipe.Pipeline("1f1b", pp=4, num_layers=8, token_budget=T)
    seqs = [T] * m
    pipe.plan_step(seqs)
    t0 = time.perf_counter()
    for i in range(reps):
        pipe.plan_step(seqs, i)
    return (time.perf_counter() - t0) / reps


def compute_alone(reps: int = 2000) -> float:
    """Seconds of one F + one B of the tiny layer, outside the runtime."""
    lin = nn.Linear(H, H)
    x = torch.randn(T, H, requires_grad=True)
    t0 = time.perf_counter()
    for _ in range(reps):
        y = lin(x)
        y.backward(torch.ones_like(y))
    return (time.perf_counter() - t0) / reps


def worker(rank: int, world: int, init: str, m: int, steps: int, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    pipe = flatpipe.Pipeline("1f1b", pp=world, num_layers=world, token_budget=T)
    stage = Tiny(rank == 0, rank == world - 1)
    rt = PipelineRuntime({rank: stage}, rank=rank, hidden_size=H)
    # gloo's own cost of posting one point-to-point operation of [T, H], outside the runtime.
    peer, buf, posts = 1 - rank, torch.zeros(T, H), []
    for i in range(300):
        t0 = time.perf_counter()
        work = dist.isend(buf, dst=peer) if (i + rank) % 2 == 0 else dist.irecv(buf, src=peer)
        posts.append(time.perf_counter() - t0)
        work.wait()
    walls, actions, parts = [], 0, []
    for s in range(steps):
        plan = pipe.plan_step([T] * m, s)
        ids = [torch.randint(64, (T,)) for _ in range(m)]
        r = rt.step(plan, ids, ids)
        if s >= 2:  # warm-up steps excluded
            walls.append(r.wall_s)
            actions = len(r.actions)
            spans = [x.end_s - x.start_s for x in r.actions]
            parts.append(
                [
                    sum(spans) / actions,
                    sum(x.wait_s for x in r.actions) / actions,
                    sum(x.compute_s for x in r.actions) / actions,
                    sum(x.post_s for x in r.actions) / actions,
                ]
            )
    with open(os.path.join(out, f"{rank}.json"), "w") as f:
        json.dump(
            {
                "wall_s": statistics.median(walls),
                "actions": actions,
                "span_s": statistics.median(p[0] for p in parts),
                "wait_s": statistics.median(p[1] for p in parts),
                "compute_s": statistics.median(p[2] for p in parts),
                "post_s": statistics.median(p[3] for p in parts),
                "post_alone_s": statistics.median(posts[50:]),
            },
            f,
        )
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--microbatches", type=int, default=32)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(1)
    plan_s = plan_step_time(a.microbatches)
    alone = compute_alone()
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(
            worker,
            args=(2, os.path.join(d, "init"), a.microbatches, a.steps, d),
            nprocs=2,
            join=True,
        )
        ranks = [json.load(open(os.path.join(d, f"{r}.json"))) for r in range(2)]
    wall = max(r["wall_s"] for r in ranks)
    n = ranks[0]["actions"]
    mean = lambda k: statistics.mean(r[k] for r in ranks)  # noqa: E731
    span, wait, compute, post = mean("span_s"), mean("wait_s"), mean("compute_s"), mean("post_s")
    own = span - wait - compute - post
    res = {
        "microbatches": a.microbatches,
        "tokens_per_microbatch": T,
        "plan_step_s": plan_s,
        "step_wall_s": wall,
        "actions_per_rank": n,
        "compute_f_plus_b_alone_s": alone,
        "action_span_s": span,
        "action_wait_s": wait,
        "action_compute_s": compute,
        "action_post_s": post,
        "gloo_post_alone_s": mean("post_alone_s"),
        "overhead_per_action_s": own,
        "torch": torch.__version__,
        "python": sys.version.split()[0],
    }
    if a.json:
        print(json.dumps(res, indent=2))
    else:
        print(f"plan_step (Rust, 1F1B p=4, m={a.microbatches}): {plan_s * 1e6:.0f} us per step")
        print(
            f"runtime, 2 gloo ranks, 1F1B m={a.microbatches}, T={T}, H={H}: step {wall * 1e3:.2f} ms, "
            f"{n} actions per rank; per action {span * 1e6:.0f} us = {wait * 1e6:.0f} waiting for "
            f"its input + {compute * 1e6:.0f} compute + {post * 1e6:.0f} posting sends and receives "
            f"(gloo alone, in lockstep: {res['gloo_post_alone_s'] * 1e6:.0f}) + "
            f"{own * 1e6:.0f} the runtime's own"
        )

if __name__ == "__main__":
    main()
