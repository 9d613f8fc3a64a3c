"""Writes the real PyTorch profiler traces that flatpipe's trace import is tested on
(tests/data/traces/), with torch on the CPU and gloo, 2 processes, 2 training steps each:

- ``torch-interleaved-1f1b.rank{0,1}.json.gz``: PyTorch's own runtime,
  ``ScheduleInterleaved1F1B`` with 2 stages per rank and 4 microbatches of fixed shape (its
  runtime labels every action ``PP:<action>``: compute, sends, receives, waits);
- ``flatpipe-zb-v.rank{0,1}.json.gz``: flatpipe's runtime (``flatpipe.torch``) running ZB-V
  step plans of variable-length steps (it records the core's lowered program: compute, sends,
  receives and send waits, as PyTorch's runtime does);
- ``torch-1f1b.rank0.json.gz``: PyTorch's ``Schedule1F1B`` (rank 0 of 2, one step), whose
  runtime records no ``PP:`` event at all: the import must refuse it and say what to do;
- ``torch-fsdp-interleaved-1f1b.rank{0,1}.json.gz``: PyTorch's runtime again, now on 4
  processes (pp 2 x dp 2) with every stage module under FSDP2 (``fully_shard`` over the
  data-parallel ranks, ``reshard_after_forward=False`` as torchtitan sets it under PP), so its
  ``UNSHARD`` all-gathers and ``REDUCE_GRAD`` reduce-scatters really move parameters and
  gradients; the files are the pipeline ranks of data-parallel replica 0 (global ranks 0 and
  2);
- ``truth.json``: what each rank really ran, per file and step (compute actions in order), from
  the schedule objects, to check the import against.

    .venv/bin/python scripts/traces/make_traces.py tests/data/traces [--only NAME ...]

(``--only torch-fsdp`` rewrites that trace alone and keeps truth.json's other entries; names:
``torch``, ``flatpipe``, ``torch-1f1b``, ``torch-fsdp``.)
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.profiler import ProfilerActivity, profile

import flatpipe
from flatpipe.models import ModelConfig, Stage
from flatpipe.torch import PipelineRuntime

CFG = ModelConfig(num_decoders=2, hidden=32, vocab=64)
STEPS = [[40, 7, 19, 33, 12, 5, 28, 50], [30, 25, 35, 28, 60]]


class Padded(nn.Module):
    def __init__(self, stage: Stage) -> None:
        super().__init__()
        self.stage = stage

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        cu = torch.tensor([0, t], dtype=torch.int64)
        return self.stage(x[0], cu).unsqueeze(0)


def write(prof, path: str) -> None:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        tmp = f.name
    prof.export_chrome_trace(tmp)
    with open(tmp, "rb") as src, open(path, "wb") as raw:
        with gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=9, mtime=0) as dst:
            dst.write(src.read())
    os.unlink(tmp)


def torch_worker(rank: int, world: int, init: str, out: str) -> None:
    from torch.distributed.pipelining import PipelineStage, ScheduleInterleaved1F1B

    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    layers = CFG.num_layers  # 4: one layer per stage, stages r and r + 2 on rank r
    stages = [
        PipelineStage(Padded(Stage(CFG, s, s + 1)), s, 2 * world, torch.device("cpu"))
        for s in (rank, rank + world)
    ]
    assert layers == 2 * world
    m, t = 4, 16
    loss_fn = lambda out, y: F.cross_entropy(out[0], y[0])  # noqa: E731
    sched = ScheduleInterleaved1F1B(stages, n_microbatches=m, loss_fn=loss_fn)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(CFG.vocab, (m, t), generator=g)
    y = torch.randint(CFG.vocab, (m, t), generator=g)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(2):
            if rank == 0:
                sched.step(x)
            elif rank == world - 1:
                sched.step(target=y, losses=[])
            else:
                sched.step()
    write(prof, os.path.join(out, f"torch-interleaved-1f1b.rank{rank}.json.gz"))
    order = [str(a) for a in sched.pipeline_order[rank] if a is not None]
    with open(os.path.join(out, f"truth-torch-{rank}.json"), "w") as f:
        json.dump([order, order], f)
    dist.destroy_process_group()


def torch_1f1b_worker(rank: int, world: int, init: str, out: str) -> None:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    half = CFG.num_layers // world
    stage = PipelineStage(
        Padded(Stage(CFG, rank * half, (rank + 1) * half)), rank, world, torch.device("cpu")
    )
    m, t = 2, 8
    sched = Schedule1F1B(stage, n_microbatches=m, loss_fn=lambda out, y: F.cross_entropy(out[0], y[0]))
    g = torch.Generator().manual_seed(0)
    x = torch.randint(CFG.vocab, (m, t), generator=g)
    y = torch.randint(CFG.vocab, (m, t), generator=g)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        if rank == 0:
            sched.step(x)
        else:
            sched.step(target=y, losses=[])
    if rank == 0:
        write(prof, os.path.join(out, "torch-1f1b.rank0.json.gz"))
    dist.destroy_process_group()


def flatpipe_worker(rank: int, world: int, init: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    pipe = flatpipe.Pipeline("zb-v", pp=world, num_layers=CFG.num_layers, token_budget=64)
    stages = {s: Stage(CFG, *pipe.stages[s]) for s, r in enumerate(pipe.stage_ranks) if r == rank}
    rt = PipelineRuntime(stages, rank=rank, hidden_size=CFG.hidden)
    truth = []
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for step, lens in enumerate(STEPS):
            plan = pipe.plan_step(lens, step)
            g = torch.Generator().manual_seed(step)
            ids = [torch.randint(CFG.vocab, (mb.tokens,), generator=g) for mb in plan.microbatches()]
            rt.step(plan, ids, ids)
            truth.append(plan.actions(rank))
    write(prof, os.path.join(out, f"flatpipe-zb-v.rank{rank}.json.gz"))
    with open(os.path.join(out, f"truth-flatpipe-{rank}.json"), "w") as f:
        json.dump(truth, f)
    dist.destroy_process_group()


def torch_fsdp_worker(rank: int, world: int, init: str, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage, ScheduleInterleaved1F1B

    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    pp, dp = 2, world // 2
    mesh = init_device_mesh("cpu", (pp, dp), mesh_dim_names=("pp", "dp"))
    pr, dr = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    stages = []
    for s in (pr, pr + pp):
        mod = Padded(Stage(CFG, s, s + 1))
        fully_shard(mod, mesh=mesh["dp"], reshard_after_forward=False)
        stages.append(
            PipelineStage(mod, s, 2 * pp, torch.device("cpu"), group=mesh["pp"].get_group())
        )
    m, t = 4, 16
    loss_fn = lambda out, y: F.cross_entropy(out[0], y[0])  # noqa: E731
    sched = ScheduleInterleaved1F1B(stages, n_microbatches=m, loss_fn=loss_fn)
    g = torch.Generator().manual_seed(dr)
    x = torch.randint(CFG.vocab, (m, t), generator=g)
    y = torch.randint(CFG.vocab, (m, t), generator=g)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(2):
            if pr == 0:
                sched.step(x)
            else:
                sched.step(target=y, losses=[])
    if dr == 0:
        write(prof, os.path.join(out, f"torch-fsdp-interleaved-1f1b.rank{pr}.json.gz"))
        order = [str(a) for a in sched.pipeline_order[pr] if a is not None]
        with open(os.path.join(out, f"truth-torch-fsdp-{pr}.json"), "w") as f:
            json.dump([order, order], f)
    dist.destroy_process_group()


# name: (worker, processes, trace prefix with a truth entry or None)
TRACES = {
    "torch": (torch_worker, 2, "torch-interleaved-1f1b"),
    "flatpipe": (flatpipe_worker, 2, "flatpipe-zb-v"),
    "torch-1f1b": (torch_1f1b_worker, 2, None),
    "torch-fsdp": (torch_fsdp_worker, 4, "torch-fsdp-interleaved-1f1b"),
}


def main() -> None:
    parser = argparse.ArgumentParser(description="Writes flatpipe's test traces.")
    parser.add_argument("out", nargs="?", default="tests/data/traces")
    parser.add_argument("--only", action="append", choices=list(TRACES), default=[])
    args = parser.parse_args()
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    only = args.only
    names = only or list(TRACES)
    truth_path = os.path.join(out, "truth.json")
    truth = json.load(open(truth_path)) if only and os.path.exists(truth_path) else {}
    for name in names:
        fn, procs, prefix = TRACES[name]
        with tempfile.TemporaryDirectory() as d:
            mp.spawn(fn, args=(procs, os.path.join(d, "init"), out), nprocs=procs, join=True)
        if prefix is None:
            continue
        for r in range(2):
            path = os.path.join(out, f"truth-{name}-{r}.json")
            truth[f"{prefix}.rank{r}.json.gz"] = json.load(open(path))
            os.unlink(path)
    truth["torch_version"] = torch.__version__
    with open(truth_path, "w") as f:
        json.dump(truth, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
