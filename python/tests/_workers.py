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


def spawn_reports(run, world: int, spec: dict, tmp_path) -> list:
    """Runs ``run(rank, world, init, spec, out_dir)`` in ``world`` gloo processes and returns
    each rank's report (``rank<r>.json`` in ``tmp_path``), in rank order."""
    import torch.multiprocessing as mp

    mp.spawn(run, args=(world, str(tmp_path / "init"), spec, str(tmp_path)), nprocs=world, join=True)
    return [json.load(open(tmp_path / f"rank{r}.json")) for r in range(world)]


def gradient_excess(stages, want):
    """``(worst, missing)``: the largest ``|grad - want| - RTOL |want|`` over the stages'
    parameters (by their whole-model names, ``layer_parameters()``), and the names of those with
    no gradient."""
    worst, missing = 0.0, []
    for m in stages:
        for name, p in m.layer_parameters().items():
            if p.grad is None:
                missing.append(name)
                continue
            worst = max(worst, ((p.grad - want[name]).abs() - RTOL * want[name].abs()).max().item())
    return worst, missing


def step_data(cfg: ModelConfig, mbs, step: int):
    """Token ids and targets per microbatch, the same on every rank (seeded by the step)."""
    g = torch.Generator().manual_seed(1000 + step)
    inputs = [torch.randint(cfg.vocab, (mb.tokens,), generator=g) for mb in mbs]
    targets = [torch.randint(cfg.vocab, (mb.tokens,), generator=g) for mb in mbs]
    return inputs, targets


def join_chunks(mbs, inputs, targets):
    """Chunked sequences joined back into one microbatch each (in the place of their first
    chunk): ``(cu_seqlens, inputs, targets)`` per microbatch of the unsplit step."""
    out, at = [], {}
    for mb, x, y in zip(mbs, inputs, targets):
        c = mb.chunk
        if c is None:
            out.append([torch.as_tensor(mb.cu_seqlens, dtype=torch.int64), x, y])
        elif c[0] in at:
            whole = out[at[c[0]]]
            whole[1] = torch.cat([whole[1], x])
            whole[2] = torch.cat([whole[2], y])
            whole[0] = torch.tensor([0, whole[1].numel()], dtype=torch.int64)
        else:
            at[c[0]] = len(out)
            out.append([torch.tensor([0, x.numel()], dtype=torch.int64), x, y])
    return out


def reference(cfg: ModelConfig, mbs, inputs, targets, reduction: str):
    """The whole model in one process: the loss with the same explicit reduction, and every
    parameter's gradient by its whole-model name. A chunked sequence runs whole (its chunks
    joined back, in chunk order: the plan lists a sequence's chunks in order)."""
    model = Stage(cfg, 0, cfg.num_layers)
    total = 0.0
    if reduction == "token":
        denom = sum(t.numel() for t in targets)
    else:
        denom = sum(len(mb.seq_lens) for mb in mbs)
    loss = 0.0
    for cu, x, y in join_chunks(mbs, inputs, targets):
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
    """One process: pipeline rank ``rank // dp`` of replica ``rank % dp`` (Megatron's order:
    replicas adjacent). Runs every step of ``spec`` and writes, per step, the loss and the
    largest gradient error against the single-process reference over all replicas' data."""
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    try:
        dp = spec.get("dp", 1)
        pp = world // dp
        prank, replica = rank // dp, rank % dp
        # Every process creates every group, in the same order.
        pipe_groups = [dist.new_group([r * dp + d for r in range(pp)]) for d in range(dp)]
        dp_groups = [dist.new_group([r * dp + d for d in range(dp)]) for r in range(pp)]
        cfg = ModelConfig(num_decoders=spec["decoders"], seed=spec.get("seed", 0), **spec.get("moe", {}))
        # Expert parallelism over the replicas of each pipeline rank (ep = dp).
        ep_group = dp_groups[prank] if spec.get("ep") else None
        pipe = flatpipe.Pipeline(
            spec["schedule"],
            pp=pp,
            num_layers=cfg.num_layers,
            token_budget=spec["budget"],
            dp=dp,
            forward_only=spec.get("forward_only"),
            chunk_tokens=spec.get("chunk_tokens"),
            microbatches=spec.get("microbatches"),
        )
        stage_groups = {}
        if spec.get("ep") == "per-stage":
            # One expert-parallel group per stage (every process creates every group, in stage
            # order), so an overlapped pair's halves exchange through different groups.
            for s in range(len(pipe.stages)):
                r = pipe.stage_ranks[s]
                stage_groups[s] = dist.new_group([r * dp + d for d in range(dp)])
        stages = {
            s: Stage(cfg, *pipe.stages[s], ep_group=stage_groups.get(s, ep_group))
            for s in range(len(pipe.stages))
            if pipe.stage_ranks[s] == prank
        }
        if stage_groups:
            ep_group = stage_groups[min(stages)]
        reduction = spec.get("reduction", "token")
        rt = PipelineRuntime(
            stages,
            rank=prank,
            hidden_size=cfg.hidden,
            loss_reduction=reduction,
            group=pipe_groups[replica],
            pipeline_ranks=[r * dp + replica for r in range(pp)],
            dp_group=dp_groups[prank] if dp > 1 else None,
            posting=spec.get("posting", "ahead"),
            ep_group=ep_group,
        )
        skip = frozenset(spec.get("skip", {}).get(str(rank), []))
        report = []
        for step, seq_lens in enumerate(spec["steps"]):
            plan = pipe.plan_step(seq_lens, step)
            every = [mb for d in range(plan.num_replicas) for mb in plan.microbatches(d)]
            inputs, targets = step_data(cfg, every, step)
            offset = sum(len(plan.microbatches(d)) for d in range(replica))
            mine = slice(offset, offset + len(plan.microbatches(replica)))
            denominator = None
            if dp > 1:
                denominator = (
                    sum(t.numel() for t in targets)
                    if reduction == "token"
                    else sum(len(mb.seq_lens) for mb in every)
                )
            eval_loss = None
            if spec.get("eval_first"):
                eval_loss = rt.eval_step(
                    plan, inputs[mine], targets[mine], replica=replica, loss_denominator=denominator
                ).loss
            fo_mbs = plan.forward_only_microbatches(replica)
            gf = torch.Generator().manual_seed(5000 + step)
            fo_inputs = [torch.randint(cfg.vocab, (mb.tokens,), generator=gf) for mb in fo_mbs]
            for m in stages.values():
                m.zero_grad(set_to_none=True)
            # The runtime's internal entry: the same as step(), with the test's skipped actions.
            result = rt._run(
                plan,
                inputs[mine],
                targets[mine],
                replica=replica,
                loss_denominator=denominator,
                forward_only_inputs=fo_inputs or None,
                train=True,
                skip=skip,
            )
            fo_error = 0.0
            if result.forward_only:
                whole = Stage(cfg, 0, cfg.num_layers)
                with torch.no_grad():
                    for k, out in result.forward_only.items():
                        cu = torch.as_tensor(fo_mbs[k].cu_seqlens, dtype=torch.int64)
                        fo_error = max(fo_error, (out - whole(fo_inputs[k], cu)).abs().max().item())
            want_loss, want = reference(cfg, every, inputs, targets, reduction)
            worst, missing = gradient_excess(stages.values(), want)
            report.append(
                {
                    "step": step,
                    "microbatches": [mb.tokens for mb in plan.microbatches(replica)],
                    "chunks": [mb.chunk for mb in plan.microbatches(replica)],
                    "actions": plan.actions(prank, replica),
                    # With dp > 1 each pipeline returns its replica's share of the step's loss.
                    "loss": result.loss,
                    "want_loss": want_loss,
                    "grad_excess": worst,
                    "eval_loss": eval_loss,
                    "forward_only": [len(fo_mbs), len(result.forward_only), fo_error],
                    "missing": missing,
                    "wall_s": result.wall_s,
                    "overlapped": result.overlapped,
                }
            )
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(report, f)
    finally:
        dist.destroy_process_group()


def run_bad_plan(rank: int, world: int, init: str, out_dir: str, case: str) -> None:
    """Plans that cannot run together: ``"lengths"``, rank 1 plans other sequence lengths;
    ``"schedule"``, rank 1 plans GPipe where rank 0 plans 1F1B (same lengths); ``"world"``,
    both plan pp = 4 in a world of 2; ``"hidden"``, rank 1's runtime is told half the hidden
    size (its receives would take a narrower tensor); ``"module"``, rank 0's stage module
    outputs bfloat16 where the runtime was told float32 (a message half the buffer's size).
    Each rank writes the error it got (or None), with its type."""
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    try:
        cfg = ModelConfig(num_decoders=4)
        kind = "gpipe" if case == "schedule" and rank == 1 else "1f1b"
        pp = 4 if case == "world" else world
        pipe = flatpipe.Pipeline(kind, pp=pp, num_layers=cfg.num_layers, token_budget=64)
        stages = {rank: Stage(cfg, *pipe.stages[rank])}
        if case == "module" and rank == 0:
            stages[0] = _Cast(stages[0], torch.bfloat16)
        hidden = cfg.hidden // 2 if case == "hidden" and rank == 1 else cfg.hidden
        rt = PipelineRuntime(stages, rank=rank, hidden_size=hidden)
        lengths = [30, 20, 50, 10, 40, 25]
        if case == "lengths" and rank == 1:
            lengths[0] += 1
        plan = pipe.plan_step(lengths)
        inputs, targets = step_data(cfg, plan.microbatches(), 0)
        try:
            rt.step(plan, inputs, targets)
            msg = None
        except (ValueError, RuntimeError) as e:
            msg = f"{type(e).__name__}: {e}"
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump({"error": msg}, f)
    finally:
        dist.destroy_process_group()


class _Cast(torch.nn.Module):
    """A stage module whose output is cast to ``dtype`` (a module that does not output what the
    runtime was told)."""

    def __init__(self, inner: torch.nn.Module, dtype: torch.dtype) -> None:
        super().__init__()
        self.inner, self.dtype = inner, dtype

    def forward(self, x, cu_seqlens, **kw):
        return self.inner(x, cu_seqlens, **kw).to(self.dtype)


def run_traced(rank: int, world: int, init: str, out_dir: str) -> None:
    """One ZB-V step (2 ranks) under the PyTorch profiler: writes the rank's actions and the
    names of its ``PP:`` events in start order."""
    from torch.profiler import ProfilerActivity, profile

    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    try:
        cfg = ModelConfig(num_decoders=2)
        pipe = flatpipe.Pipeline("zb-v", pp=world, num_layers=cfg.num_layers, token_budget=64)
        stages = {
            s: Stage(cfg, *pipe.stages[s])
            for s in range(len(pipe.stages))
            if pipe.stage_ranks[s] == rank
        }
        rt = PipelineRuntime(stages, rank=rank, hidden_size=cfg.hidden)
        plan = pipe.plan_step([30, 20, 50, 10, 44])
        inputs, targets = step_data(cfg, plan.microbatches(), 0)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            rt.step(plan, inputs, targets)
        events = sorted(
            (e for e in prof.events() if e.name.startswith("PP:")),
            key=lambda e: e.time_range.start,
        )
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(
                {
                    "actions": plan.actions(rank),
                    "lowered": [str(a) for a in plan.lowered_actions_of(rank)],
                    "events": [e.name for e in events],
                },
                f,
            )
    finally:
        dist.destroy_process_group()


def run_link(rank: int, world: int, init: str, out_dir: str) -> None:
    """flatpipe.measure.measure_link on every rank: writes the (alpha, beta) each rank got."""
    from flatpipe.measure import measure_link

    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    try:
        got = measure_link(16, torch.float32, "cpu", sizes=(64, 512, 4096), repeats=3)
        with open(os.path.join(out_dir, f"link{rank}.json"), "w") as f:
            json.dump(got, f)
    finally:
        dist.destroy_process_group()
