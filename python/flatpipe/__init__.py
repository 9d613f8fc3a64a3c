"""flatpipe: per-step pipeline-parallel plans for variable-length LLM training.

The Rust core plans each step from its sequence lengths: microbatches as flat ``[T]`` tokens
with ``cu_seqlens`` (no padding), every rank's actions in PyTorch's notation (``0F3``, ``1I2``,
``1W2``, ``0B1``), and with a cost profile the predicted timeline and memory.
``StepPlan.actions_of`` gives the same actions structured (:class:`Action`, its
:class:`ComputeAction` parts with the stages each sends to and receives from).
``flatpipe.torch`` runs a step plan on torch.distributed with every receive sized from the plan:
no padding and no shape exchange.

>>> import flatpipe
>>> pipe = flatpipe.Pipeline("1f1b", pp=2, num_layers=6, token_budget=512)
>>> step = pipe.plan_step([300, 200, 120, 40])
>>> [mb.tokens for mb in step.microbatches()]
[500, 160]
>>> step.actions(0)
['0F0', '0F1', '0B0', '0B1']
"""

import enum

from ._core import (
    POLICIES,
    SCHEDULES,
    Action,
    CommAction,
    ComputeAction,
    FlatpipeError,
    Microbatch,
    Pipeline,
    Profile,
    SpeedEstimate,
    StepPlan,
    Workload,
    __version__,
    import_trace,
    parse_action,
    plan,
)
from .results import ImportedTrace, Nested, PlanCandidate, SimulationSummary, Span


class _Name(str, enum.Enum):
    """A name the core takes, as a ``str`` enum member (``str()`` gives the name)."""

    def __str__(self) -> str:
        return self.value


class Schedule(_Name):
    """The pipeline schedules, by the name ``Pipeline(schedule=...)`` takes (a ``str``: either
    form works)."""

    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED_1F1B = "interleaved-1f1b"
    LOOPED_BFS = "looped-bfs"
    ZB_H1 = "zb-h1"
    ZB_H2 = "zb-h2"
    ZB_V = "zb-v"
    DUALPIPEV = "dualpipev"
    COMBINED_1F1B = "combined-1f1b"
    ZB_AUTO = "zb-auto"


class Policy(_Name):
    """The microbatching policies, by the name ``Pipeline(policy=...)`` takes."""

    PADDED = "padded"
    PACKED = "packed"
    FLAT_FFD = "flat-ffd"
    FLAT_BALANCED = "flat-balanced"
    VERL_KK = "verl-kk"
    FLAT_PLANNED = "flat-planned"


__all__ = [
    "POLICIES",
    "SCHEDULES",
    "Policy",
    "Schedule",
    "Action",
    "CommAction",
    "ComputeAction",
    "FlatpipeError",
    "ImportedTrace",
    "Microbatch",
    "Nested",
    "PlanCandidate",
    "Pipeline",
    "Profile",
    "SimulationSummary",
    "Span",
    "SpeedEstimate",
    "StepPlan",
    "Workload",
    "__version__",
    "import_trace",
    "parse_action",
    "plan",
]

# The submodules that need torch (torch, models, replan; hf and titan, stages from Hugging Face and
# torchtitan models, which also need those libraries) or numpy-only helpers (fit) load on first
# use,
# so `import flatpipe` does not import torch: `flatpipe.torch.PipelineRuntime` works without an
# explicit `import flatpipe.torch`.
_LAZY = ("torch", "models", "fit", "hf", "titan", "replan")


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
