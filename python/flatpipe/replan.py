"""Re-planning each step from what the run measured, in PyTorch.

Every rank plans the same step from the same estimate: after each step the ranks exchange
what each action's compute took (:func:`gather_timings`, one small ``all_gather_object`` over
the pipeline), each rank adds it to its :class:`flatpipe.SpeedEstimate` (the same numbers in
the same order, so the same estimate everywhere), and the next step is planned with
:meth:`flatpipe.SpeedEstimate.planning_pipeline`: the pipeline's profile with each rank's
stages scaled by what that rank measured against the prediction, so that zb-auto's schedule,
the cost-balanced cuts and the prediction follow a rank that slows down::

    estimate = flatpipe.SpeedEstimate(pipe, forgetting=0.7)
    planner = pipe
    for step, lengths in enumerate(steps):
        plan = planner.plan_step(lengths, step)
        result = runtime.step(plan, inputs, targets)
        estimate.observe(plan, gather_timings(result, rank, group))
        planner = estimate.planning_pipeline()

A layer split is not changed mid-run (moving layers moves weights and optimizer state):
``flatpipe execute --replan --propose-plan`` proposes one for the next launch.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch.distributed as dist

from .torch import PipelineRuntime, StepResult

__all__ = ["gather_timings", "slow_rank_for_testing"]


def gather_timings(
    result: StepResult, rank: int, group: Optional[dist.ProcessGroup] = None
) -> List[Tuple[int, str, float]]:
    """Every pipeline rank's ``(rank, action, compute_s)`` of one step, in rank order and
    each rank's program order, the same list on every rank of ``group`` (the pipeline's;
    default the world): what :meth:`flatpipe.SpeedEstimate.observe` takes. ``rank`` is this
    process's pipeline rank. ``compute_s`` is the action's own work (the stage module's
    forward and the autograd calls), without its wait for inputs or its sends."""
    mine = [(rank, a.action, a.compute_s) for a in result.actions]
    world = dist.get_world_size(group)
    out: List[Optional[list]] = [None] * world
    dist.all_gather_object(out, mine, group=group)
    gathered = [t for part in out if part for t in part]
    return sorted(gathered, key=lambda t: t[0])


def slow_rank_for_testing(runtime: PipelineRuntime, factor: float, from_step: int) -> None:
    """Test hook: from plan step ``from_step`` on, every compute action of ``runtime``'s rank
    takes ``factor`` times as long (the runtime sleeps ``factor - 1`` times the action's
    compute after it, counted in its ``compute_s``), as a straggler would. Outside
    :meth:`PipelineRuntime.step`'s signature on purpose: it is for measuring re-planning, not
    for training. Raises ``ValueError`` for a factor below 1 or a negative step."""
    if not factor >= 1.0 or factor != factor or factor == float("inf"):
        raise ValueError(f"factor = {factor!r} is invalid: a finite number >= 1")
    if from_step < 0:
        raise ValueError(f"from_step = {from_step} is invalid: >= 0")
    runtime._test_slowdown = (float(factor), int(from_step))
