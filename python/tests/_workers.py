"""Process bodies for the multi-process runtime tests (spawned: importable by name)."""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

import flatpipe
from flatpipe.models import ModelConfig, Stage
from flatpipe.torch import PipelineRuntime

#: Tolerances of a pipelined fp32 run against the single-process run of the same model: the
#: same operations per microbatch, so only the order of the gradient accumulation differs.
RTOL, ATOL = 1e-4, 1e-6


def step_data(cfg: ModelConfig, mbs, step: int):
    """Token ids and targets per microbatch, the same on every rank (seeded by the step)."""
    g = torch.Generator().manual_seed(1000 + step)
    inputs = [torch.randint(cfg.vocab, (mb.tokens,), generator=g) for mb in mbs]
    targets = [torch.randint(cfg.vocab, (mb.tokens,), generator=g) for mb in mbs]
    return inputs, targets


def reference(cfg: ModelConfig, mbs, inputs, targets, reduction: str):
    """The whole model in one process: the loss with the same explicit reduction, and every
    parameter's gradient by its whole-model name."""
    model = Stage(cfg, 0, cfg.num_layers)
    total = 0.0
    if reduction == "token":
        denom = sum(t.numel() for t in targets)
    else:
        denom = sum(len(mb.seq_lens) for mb in mbs)
    loss = 0.0
    for mb, x, y in zip(mbs, inputs, targets):
        cu = torch.as_tensor(mb.cu_seqlens, dtype=torch.int64)
        per_token = F.cross_entropy(model(x, cu), y, reduction="none")
        if reduction == "token":
            loss = loss + per_token.sum() / denom
        else:
            for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
                loss = loss + per_token[a:b].mean() / denom
    loss.backward()
    total = float(loss.detach())
    return total, {k: p.grad.clone() for k, p in model.layer_parameters().items()}


def run(rank: int, world: int, init: str, spec: dict, out_dir: str) -> None:
    """One pipeline rank: runs every step of ``spec`` and writes, per step, the loss and the
    largest gradient error against the single-process reference."""
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    try:
        cfg = ModelConfig(num_decoders=spec["decoders"], seed=spec.get("seed", 0))
        pipe = flatpipe.Pipeline(
            spec["schedule"],
            pp=world,
            num_layers=cfg.num_layers,
            token_budget=spec["budget"],
        )
        stages = {s: Stage(cfg, *pipe.stages[s]) for s in range(len(pipe.stages)) if pipe.stage_ranks[s] == rank}
        reduction = spec.get("reduction", "token")
        rt = PipelineRuntime(stages, rank=rank, hidden_size=cfg.hidden, loss_reduction=reduction)
        report = []
        for step, seq_lens in enumerate(spec["steps"]):
            plan = pipe.plan_step(seq_lens, step)
            mbs = plan.microbatches()
            inputs, targets = step_data(cfg, mbs, step)
            for m in stages.values():
                m.zero_grad(set_to_none=True)
            result = rt.step(plan, inputs, targets, _skip=frozenset(spec.get("skip", {}).get(str(rank), [])))
            want_loss, want = reference(cfg, mbs, inputs, targets, reduction)
            worst, missing = 0.0, []
            for m in stages.values():
                for name, p in m.layer_parameters().items():
                    if p.grad is None:
                        missing.append(name)
                        continue
                    err = ((p.grad - want[name]).abs() - RTOL * want[name].abs()).max().item()
                    worst = max(worst, err)
            report.append(
                {
                    "step": step,
                    "microbatches": [mb.tokens for mb in mbs],
                    "actions": plan.actions(rank),
                    "loss": result.loss,
                    "want_loss": want_loss,
                    "grad_excess": worst,
                    "missing": missing,
                    "wall_s": result.wall_s,
                }
            )
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(report, f)
    finally:
        dist.destroy_process_group()
