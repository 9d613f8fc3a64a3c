"""Process bodies for the context-parallel runtime tests (spawned: importable by name)."""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist

import flatpipe
from _workers import gradient_excess, reference, step_data
from flatpipe.models import ModelConfig, Stage
from flatpipe.torch import PipelineRuntime, cp_share


def run(rank: int, world: int, init: str, spec: dict, out_dir: str) -> None:
    """One process of pp x cp (Megatron's order, cp inner): pipeline rank ``rank // cp``, index
    ``rank % cp`` of its context-parallel group. Every pipeline runs the whole step's plan on its
    shares of each microbatch; writes per step the loss and the largest gradient error against
    the single-process run of the whole microbatches."""
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    try:
        cp = spec["cp"]
        pp = world // cp
        prank, index = rank // cp, rank % cp
        pipe_groups = [dist.new_group([r * cp + i for r in range(pp)]) for i in range(cp)]
        cp_groups = [dist.new_group([r * cp + i for i in range(cp)]) for r in range(pp)]
        cfg = ModelConfig(num_decoders=spec["decoders"], seed=1)
        pipe = flatpipe.Pipeline(
            spec["schedule"], pp=pp, num_layers=cfg.num_layers, token_budget=spec["budget"]
        )
        stages = {
            s: Stage(cfg, *pipe.stages[s])
            for s in range(len(pipe.stages))
            if pipe.stage_ranks[s] == prank
        }
        rt = PipelineRuntime(
            stages,
            rank=prank,
            hidden_size=cfg.hidden,
            group=pipe_groups[index],
            pipeline_ranks=[r * cp + index for r in range(pp)],
            cp_group=cp_groups[prank],
        )
        try:
            PipelineRuntime(stages, rank=prank, hidden_size=cfg.hidden, cp_group=cp_groups[prank], loss_reduction="sequence")
            refused = ""
        except ValueError as e:
            refused = str(e)
        report = []
        for step, seq_lens in enumerate(spec["steps"]):
            plan = pipe.plan_step(seq_lens, step)
            mbs = plan.microbatches(0)
            inputs, targets = step_data(cfg, mbs, step)
            mine_in = [cp_share(x, mb.cu_seqlens, index, cp) for x, mb in zip(inputs, mbs)]
            mine_tg = [cp_share(y, mb.cu_seqlens, index, cp) for y, mb in zip(targets, mbs)]
            for m in stages.values():
                m.zero_grad(set_to_none=True)
            denominator = sum(t.numel() for t in targets)
            result = rt.step(plan, mine_in, mine_tg, loss_denominator=denominator)
            want_loss, want = reference(cfg, mbs, inputs, targets, "token")
            worst, missing = gradient_excess(stages.values(), want)
            report.append(
                {
                    "loss": result.loss,
                    "want_loss": want_loss,
                    "grad_excess": worst,
                    "missing": missing,
                    "tokens": [int(x.numel()) for x in mine_in],
                    "microbatches": [mb.tokens for mb in mbs],
                    "refused": refused,
                }
            )
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(report, f)
    finally:
        dist.destroy_process_group()
