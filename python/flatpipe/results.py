"""The typed results of the core's searches, simulations and trace imports.

The Rust core builds these (``flatpipe.plan``, ``Pipeline.simulate``, ``flatpipe.import_trace``);
they are frozen dataclasses, so a field is read by name (``c.step_time_mean_s``), a mistyped
name is an ``AttributeError`` rather than a silent ``KeyError`` at the end of a run, and
``dataclasses.asdict`` gives the plain dict to log or serialize. Times are seconds, memory is
bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple


@dataclass(frozen=True)
class PlanCandidate:
    """One configuration of the planner's search (``flatpipe plan``'s table row)."""

    tp: int
    """Tensor-parallel degree (GPUs per rank)."""
    ep: int
    """Expert-parallel degree: data-parallel replicas that split each mixture-of-experts layer's
    routed experts (1 for a dense model)."""
    dp: int
    """Data-parallel replicas."""
    pp: int
    """Pipeline ranks."""
    vpp: int
    """Virtual stages per rank."""
    schedule: str
    """The schedule's name (``Schedule`` values)."""
    token_budget: int
    """Tokens per microbatch at most."""
    sharding: str
    """Data-parallel sharding: ``ddp``, ``zero1``, ``fsdp`` or ``hsdp``."""
    stages: list[tuple[int, int]]
    """Per stage, its layers as a half-open range ``(start, end)``."""
    recompute: list[str]
    """Per stage, its activation recomputation: ``none``, ``selective`` or ``full``."""
    step_time_mean_s: float
    """Predicted mean step time over the sampled steps."""
    step_time_p90_s: float
    """Predicted 90th-percentile step time."""
    lower_bound_s: float
    """A lower bound on the mean step time of any schedule for this layout."""
    peak_memory_bytes: list[float]
    """Predicted peak memory per pipeline rank (parameters, gradients, optimizer state and
    activations)."""


@dataclass(frozen=True)
class SimulationSummary:
    """A pipeline's predicted behaviour over sampled steps (``flatpipe simulate``'s row)."""

    steps: int
    """Steps simulated."""
    step_time_mean_s: float
    step_time_p50_s: float
    step_time_p90_s: float
    step_time_p99_s: float
    bubble_ratio_mean: float
    """Mean over steps of ``1 - busy / (ranks * step time)``."""
    tokens_per_s: float
    """True (unpadded) tokens per second: tokens over step time, summed over the steps."""
    mfu: float
    """Model FLOPs utilization: model FLOPs per second over the GPUs' peak, in [0, 1]."""
    peak_memory_bytes: float
    """The highest peak memory of any rank in any step."""
    microbatches_mean: float
    """Mean microbatches per step and replica."""


class Span(NamedTuple):
    """An action's span on a rank's lane of an imported trace (unpacks as a 3-tuple)."""

    action: str
    """The action, in PyTorch's notation (``0F3``, ``1SEND_F2``, ``0UNSHARD``)."""
    start_s: float
    end_s: float


class Nested(NamedTuple):
    """What the profiler recorded inside a compute action's span."""

    events: int
    """Events nested in the span."""
    comm_s: float
    """Seconds in ``c10d::`` calls (posting sends and receives) inside it."""


@dataclass(frozen=True)
class ImportedTrace:
    """One step of PyTorch profiler traces of a pipelined run, one file per rank, as
    ``flatpipe import-trace`` reads it."""

    actions: list[list[Span]]
    """Per rank, the step's compute actions, busy time from each one's first nested operator."""
    nested: list[list[Nested]]
    """Per rank, per compute action (in ``actions``' order), what its span holds."""
    comm: list[list[Span]]
    """Per rank, its comm lane: each send, receive, wait and FSDP action of the step."""
    steps: int
    """Steps the traces hold."""
    step: int
    """The step imported (0-based)."""
    leading_wait_s: list[float]
    """Per rank, the time between its actions' starts and their first nested operators (the
    waits for inputs torch records inside an action's span: not busy time)."""
    other_events: dict[str, int]
    """``PP:`` events that are not compute actions (sends, receives, waits, FSDP's unshard and
    gradient reduction), by label without stage and microbatch, with their counts over all
    steps."""
    warnings: list[str]
    """What the import noticed and worked around."""

    def __post_init__(self) -> None:
        # The core hands plain tuples over; give them their field names.
        for name, kind in (("actions", Span), ("nested", Nested), ("comm", Span)):
            lanes = [[kind(*x) for x in lane] for lane in getattr(self, name)]
            object.__setattr__(self, name, lanes)
