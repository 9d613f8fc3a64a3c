"""Process bodies for re-planning in the PyTorch runtime (spawned: importable by name), and the
run that scripts/replan_torch.py measures."""

from __future__ import annotations

import json
import os
import time

import torch
import torch.distributed as dist

import flatpipe
from _workers import step_data
from flatpipe.models import ModelConfig, Stage
from flatpipe.replan import gather_timings, slow_rank_for_testing
from flatpipe.torch import PipelineRuntime


def model_config(spec: dict) -> ModelConfig:
    """The spec's model: the built-in ``tiny`` (hidden 256, 8 decoders) unless it says less."""
    return ModelConfig(
        vocab=spec.get("vocab", 4096), hidden=spec.get("hidden", 256), heads=4, kv_heads=2,
        ffn=spec.get("ffn", 688), num_decoders=spec.get("decoders", 8), seed=1,
    )


def run(rank: int, world: int, init: str, spec: dict, out_dir: str) -> None:
    """One pipeline rank of ``world``: ``spec["steps"]`` steps of ``spec["lengths"]`` (one
    list per step), ``spec["mode"]`` ``static`` (every step planned on the profile),
    ``replan`` (every step from the estimate after the last) or ``oracle`` (every step on the
    profile ``spec["oracle"]``, a YAML file); rank ``spec["slow"] = [rank, factor, from]`` is
    slowed by the test hook. Writes per step the wall time (barrier to barrier), the planning
    time, each rank's busy time (its actions' compute), the rank factors and the rank's
    actions; the replan
    run also writes its last planning profile to ``out_dir/planning.yaml`` (rank 0)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    try:
        cfg = model_config(spec)
        base = flatpipe.Profile.load(spec["profile"])
        kw = dict(pp=world, microbatches=spec["microbatches"], policy=spec.get("policy", "flat-ffd"))
        pipe = flatpipe.Pipeline(spec["schedule"], profile=base, **kw)
        if spec["mode"] == "oracle":
            planner = flatpipe.Pipeline(spec["schedule"], profile=flatpipe.Profile.load(spec["oracle"]), **kw)
        else:
            planner = pipe
        stages = {
            s: Stage(cfg, *pipe.stages[s])
            for s in range(len(pipe.stages))
            if pipe.stage_ranks[s] == rank
        }
        rt = PipelineRuntime(stages, rank=rank, hidden_size=cfg.hidden)
        slow_rank, factor, start = spec.get("slow", [-1, 1.0, 0])
        if rank == slow_rank:
            slow_rank_for_testing(rt, factor, start)
        estimate = flatpipe.SpeedEstimate(pipe, forgetting=spec.get("forgetting", 0.7))
        opt = torch.optim.SGD([p for m in stages.values() for p in m.parameters()], lr=1e-3)
        report = []
        for step, lengths in enumerate(spec["lengths"]):
            t0 = time.perf_counter()
            plan = planner.plan_step(lengths, step)
            planning_s = time.perf_counter() - t0
            inputs, targets = step_data(cfg, plan.microbatches(0), step)
            opt.zero_grad(set_to_none=True)
            dist.barrier()
            t1 = time.perf_counter()
            result = rt.step(plan, inputs, targets)
            opt.step()
            dist.barrier()
            wall = time.perf_counter() - t1
            timings = gather_timings(result, rank)
            estimate.observe(plan, timings)
            busy = [0.0] * world
            for r, _, secs in timings:
                busy[r] += secs
            if spec["mode"] == "replan":
                planner = estimate.planning_pipeline()
            report.append(
                {
                    "wall_s": wall,
                    "planning_s": planning_s,
                    "busy_s": busy,
                    "factors": estimate.rank_factors(),
                    "actions": plan.actions(rank),
                    "loss": result.loss,
                }
            )
        if spec["mode"] == "replan" and rank == 0:
            with open(os.path.join(out_dir, "planning.yaml"), "w") as f:
                f.write(estimate.planning_pipeline().profile.to_yaml())
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(report, f)
    finally:
        dist.destroy_process_group()
