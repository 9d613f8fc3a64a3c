"""PyTorch's own pipelining runtime on the same model and data, with the padding it needs
(spawned by test_vs_torch.py and python/bench/vs_torch.py).

PyTorch's ``PipelineStage`` fixes its receive buffers' shapes from the first microbatch it
sees and its schedule fixes the microbatch count, so every microbatch of a step is padded to the
step's largest (``[1, T_max]``, the padding a sequence of its own whose targets are ignored, its
``cu_seqlens`` padded with empty sequences), and the stage and schedule are rebuilt for every
step whose ``T_max`` or microbatch count differs (what NeMo-RL does under pipeline
parallelism). Gradients are not scaled by the schedule (``scale_grads=False``): the loss is the
same explicit token-weighted sum as flatpipe's.
"""

from __future__ import annotations

import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

import flatpipe
from flatpipe.models import ModelConfig, Stage
from flatpipe.torch import PipelineRuntime

from _workers import RTOL, reference, step_data


class Padded(nn.Module):
    """A flatpipe stage behind PyTorch's batch dimension: ``[1, T_max]`` in, ``[1, T_max, *]`` out."""

    def __init__(self, stage: Stage) -> None:
        super().__init__()
        self.stage = stage

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        return self.stage(x[0], cu_seqlens[0]).unsqueeze(0)


def padded_batch(mbs, inputs, targets):
    """``[m, T_max]`` ids and targets (padding: id 0, target -100) and ``[m, n_max + 2]``
    cu_seqlens (the padding a sequence of its own, then empty sequences)."""
    m = len(mbs)
    t_max = max(mb.tokens for mb in mbs)
    n_max = max(len(mb.seq_lens) for mb in mbs)
    x = torch.zeros(m, t_max, dtype=torch.int64)
    y = torch.full((m, t_max), -100, dtype=torch.int64)
    cu = torch.full((m, n_max + 2), t_max, dtype=torch.int64)
    for k, mb in enumerate(mbs):
        x[k, : mb.tokens] = inputs[k]
        y[k, : mb.tokens] = targets[k]
        cu[k, : len(mb.cu_seqlens)] = torch.as_tensor(mb.cu_seqlens)
    return x, y, cu, t_max


def run(rank: int, world: int, init: str, spec: dict, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        cfg = ModelConfig(**spec.get("model", {"num_decoders": spec.get("decoders", 4)}))
        pipe = flatpipe.Pipeline("1f1b", pp=world, num_layers=cfg.num_layers, token_budget=spec["budget"])
        stage = Stage(cfg, *pipe.stages[rank])
        ours = PipelineRuntime({rank: stage}, rank=rank, hidden_size=cfg.hidden)
        first, last = rank == 0, rank == world - 1
        report = []
        for step, seq_lens in enumerate(spec["steps"]):
            plan = pipe.plan_step(seq_lens, step)
            mbs = plan.microbatches()
            inputs, targets = step_data(cfg, mbs, step)
            denom = sum(t.numel() for t in targets)
            want_loss, want = reference(cfg, mbs, inputs, targets, "token")

            def errors():
                worst = 0.0
                for name, p in stage.layer_parameters().items():
                    worst = max(worst, ((p.grad - want[name]).abs() - RTOL * want[name].abs()).max().item())
                return worst

            times = {}
            for runtime in spec.get("order", ["flatpipe", "torch"]):
                stage.zero_grad(set_to_none=True)
                dist.barrier()
                t0 = time.perf_counter()
                if runtime == "flatpipe":
                    loss = ours.step(plan, inputs, targets).loss
                else:
                    x, y, cu, t_max = padded_batch(mbs, inputs, targets)

                    def loss_fn(out, target):
                        return F.cross_entropy(
                            out[0].float(), target[0], reduction="sum", ignore_index=-100
                        ) / denom

                    pstage = PipelineStage(Padded(stage), rank, world, torch.device("cpu"))
                    sched = Schedule1F1B(pstage, n_microbatches=len(mbs), loss_fn=loss_fn, scale_grads=False)
                    losses = []
                    if first:
                        sched.step(x, cu_seqlens=cu)
                    elif last:
                        sched.step(cu_seqlens=cu, target=y, losses=losses)
                    else:
                        sched.step(cu_seqlens=cu)
                    t = torch.tensor([float(sum(l.item() for l in losses))], dtype=torch.float64)
                    dist.all_reduce(t)
                    loss = float(t)
                dist.barrier()
                times[runtime] = time.perf_counter() - t0
                report.append(
                    {
                        "step": step,
                        "runtime": runtime,
                        "microbatches": [mb.tokens for mb in mbs],
                        "loss": loss,
                        "want_loss": want_loss,
                        "grad_excess": errors(),
                        "wall_s": times[runtime],
                    }
                )
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(report, f)
    finally:
        dist.destroy_process_group()
