"""Type stubs of flatpipe's native module (python/src/lib.rs)."""

from typing import Optional, Sequence, Tuple, Union, final

import numpy as np
import numpy.typing as npt

from .results import ImportedTrace, PlanCandidate, SimulationSummary

__version__: str
SCHEDULES: list[str]
POLICIES: list[str]

__all__ = [
    "FlatpipeError",
    "__version__",
    "SCHEDULES",
    "POLICIES",
    "Profile",
    "Pipeline",
    "Workload",
    "Microbatch",
    "StepPlan",
    "SpeedEstimate",
    "ComputeAction",
    "Action",
    "CommAction",
    "parse_action",
    "plan",
    "import_trace",
]

class FlatpipeError(ValueError):
    """An error from the Rust core (a ``ValueError``): the message names the file, field, value
    and allowed range; ``field`` and ``value`` hold the two where the error is about one field
    (else ``None``)."""

    field: Optional[str]
    value: Optional[str]

@final
class Profile:
    """A cost profile: per layer and phase (F, I, W, Fo) ``t = c0 + c_tok * tokens + c_attn * pairs``
    (seconds), activation and parameter bytes, the hardware and its links."""

    @staticmethod
    def analytic(model: str, hardware: str) -> Profile:
        """The analytic profile of ``model`` on ``hardware`` (built-in names or YAML files)."""
    @staticmethod
    def load(path: str) -> Profile:
        """A profile file (YAML) as ``flatpipe profile`` writes it."""
    def with_costs(
        self,
        kind: str,
        phase: str,
        c0_s: float,
        c_tok_s: float,
        c_attn_s: float = 0.0,
        note: str = "",
    ) -> Profile:
        """A copy whose ``kind`` layers (embedding, decoder, head) cost
        ``c0_s + c_tok_s * tokens + c_attn_s * pairs`` seconds in ``phase`` (F, I, W, Fo, or B:
        a fused backward, which otherwise costs I + W)."""
    def with_link(
        self,
        alpha_s: float,
        beta_bytes_per_s: float,
        optimizer_s_per_param: float = 0.0,
        post_s: float = 0.0,
    ) -> Profile:
        """A copy with the link ``alpha_s + bytes / beta_bytes_per_s`` between ranks, each
        message costing its sender and its receiver ``post_s`` seconds to post, and the
        optimizer's seconds per parameter."""
    def with_overhead(
        self,
        f_s: float,
        i_s: float,
        w_s: float,
        b_s: float = 0.0,
        first_stage_backward_in_w: bool = False,
    ) -> Profile:
        """A copy with a fixed cost per stage action (F, I, W, fused B), seconds; with
        ``first_stage_backward_in_w`` the first stage's I costs nothing and its W a fused B
        (PyTorch's runtime and ``flatpipe.torch`` skip the first stage's input gradient)."""
    def with_post(self, post_s: float) -> Profile:
        """A copy whose links charge each message's sender and receiver ``post_s`` seconds
        of CPU time to post it."""
    def tensor_parallel(self, tp: int, sequence_parallel: bool = True) -> Profile:
        """The profile of one GPU of a Megatron-style tensor-parallel group of ``tp`` GPUs."""
    @property
    def model(self) -> str: ...
    @property
    def hardware(self) -> str: ...
    @property
    def num_layers(self) -> int:
        """Layers: the embedding, the decoders and the head."""
    def to_yaml(self) -> str: ...

@final
class Workload:
    """A distribution of sequence lengths (tokens) and a step's size."""

    @staticmethod
    def load(name: str) -> Workload:
        """A built-in workload (``sharegpt-v3``, ``sharegpt-v3-merged``, ``tiny-chat``) or a file."""
    @property
    def name(self) -> str: ...
    @property
    def seed(self) -> int: ...
    def sample_step(self, step: int, seed: Optional[int] = None) -> npt.NDArray[np.uint32]:
        """Step ``step``'s sequence lengths: the draw ``flatpipe simulate`` makes for it."""

@final
class Microbatch:
    """One microbatch: flat ``[T]`` tokens of several sequences."""

    @property
    def index(self) -> int:
        """The id in the step's actions (``0F3`` is microbatch 3)."""
    @property
    def tokens(self) -> int:
        """True tokens ``T``."""
    @property
    def seq_lens(self) -> npt.NDArray[np.uint32]:
        """Sequence lengths, ``[n]``."""
    @property
    def cu_seqlens(self) -> npt.NDArray[np.int64]:
        """``[0, s_0, s_0 + s_1, ..., T]``, ``[n + 1]``."""
    @property
    def attn_pairs(self) -> int:
        """Causal attention query-key pairs, ``sum s (s + 1) / 2`` (a chunk at offset ``o``:
        ``T (T + 1) / 2 + T o``)."""
    @property
    def chunk(self) -> Optional[Tuple[int, int, int, int]]:
        """``None``, or ``(sequence, index, of, offset)`` for one chunk of a sequence longer
        than the token budget."""

@final
class ComputeAction:
    """One compute action: ``stage`` runs ``kind`` (``"F"``, ``"I"``, ``"W"``, ``"B"``,
    ``"Fo"``) on ``microbatch``, with the stages it sends its result to and receives its input
    from (the core's transfer rule: F and Fo send activations ``[T, H]`` to stage s + 1, I and B
    the input gradient ``[T, H]`` to stage s - 1). Frozen, hashable; ``str()`` gives PyTorch's
    notation (``2F3``)."""

    @property
    def stage(self) -> int: ...
    @property
    def kind(self) -> str:
        """``"F"``, ``"I"``, ``"W"``, ``"B"`` or ``"Fo"``."""
    @property
    def microbatch(self) -> int:
        """The microbatch (forward-only microbatches have their own id space)."""
    @property
    def sends_to(self) -> Optional[int]:
        """The stage this action's result goes to; ``None`` for W, the last stage's forward and
        stage 0's backward."""
    @property
    def receives_from(self) -> Optional[int]:
        """The stage whose result this action waits on; ``None`` for W, stage 0's forward and
        the last stage's backward."""

@final
class CommAction:
    """One communication entry of a rank's lowered program (``StepPlan.lowered_actions_of``):
    a send, a receive, or the wait for a send, of the transfer carrying ``carries`` (``"F"``,
    ``"B"``, ``"Fo"``; ``[T, H]`` of ``microbatch``) from ``sending_stage`` to ``receiving_stage``;
    ``peer`` is the other rank. Frozen, hashable; ``str()`` gives PyTorch's name
    (``0SEND_F3``, ``1RECV_F3``, ``0WAIT_SEND_F3``)."""

    @property
    def kind(self) -> str:
        """``"SEND"``, ``"RECV"`` or ``"WAIT_SEND"``."""
    @property
    def carries(self) -> str: ...
    @property
    def microbatch(self) -> int: ...
    @property
    def sending_stage(self) -> int: ...
    @property
    def receiving_stage(self) -> int: ...
    @property
    def peer(self) -> int: ...

@final
class Action:
    """One entry of a rank's action list: a compute action or an overlapped pair
    (``(0F3;1B2)OVERLAP_F_B``, forward first). Frozen, hashable; ``str()`` is ``text``."""

    @property
    def text(self) -> str:
        """PyTorch's notation, as ``StepPlan.actions`` gives it."""
    @property
    def parts(self) -> list[ComputeAction]:
        """One compute action, or the pair's forward then backward."""
    @property
    def is_overlap(self) -> bool: ...

def parse_action(text: str) -> list[tuple[int, str, int]]:
    """``"0F3"`` -> ``[(0, "F", 3)]``; ``"(0F3;1B2)OVERLAP_F_B"`` -> both halves, forward first,
    as ``(stage, kind, microbatch)`` (the core's parser). Raises ``ValueError`` naming the
    text."""

@final
class StepPlan:
    """One step, planned: per replica its microbatches and every rank's actions in PyTorch's
    notation, and with a profile the predicted timeline (seconds) and memory (bytes)."""

    @property
    def step(self) -> int: ...
    @property
    def num_replicas(self) -> int: ...
    @property
    def num_ranks(self) -> int: ...
    @property
    def num_stages(self) -> int: ...
    @property
    def stage_ranks(self) -> list[int]:
        """The rank of each stage, in stage order."""
    def stages_of(self, rank: int) -> list[int]: ...
    def microbatches(self, replica: int = 0) -> list[Microbatch]: ...
    def forward_only_microbatches(self, replica: int = 0) -> list[Microbatch]: ...
    def actions(self, rank: int, replica: int = 0) -> list[str]:
        """``rank``'s actions in run order: ``0F3``, ``1I2``, ``1W2``, ``0B1``, ``2Fo0``,
        ``(0F3;1B2)OVERLAP_F_B``."""
    def actions_of(self, rank: int, replica: int = 0) -> list[Action]:
        """``rank``'s actions in run order, structured: the same entries as ``actions``, each
        with its compute actions and the stages they send to and receive from."""
    def lowered_actions_of(
        self,
        rank: int,
        replica: int = 0,
        posting: str = "ahead",
        forward_only: bool = False,
    ) -> list[Union[Action, CommAction]]:
        """``rank``'s program: its entries (``actions_of``) with the sends, receives and send
        waits between them in the core's lowering order (PyTorch 2.15's ``_add_send_recv`` +
        ``_add_wait_send``; ``posting="deferred"`` adds ``_defer_recv_ops``). With
        ``forward_only``, the program of the F parts alone (an evaluation step)."""
    def schedule_name(self, replica: int = 0) -> str: ...
    def predicted_step_time_s(self, replica: int = 0) -> Optional[float]: ...
    def predicted_bubble_ratio(self, replica: int = 0) -> Optional[float]: ...
    def predicted_peak_bytes(self, replica: int = 0) -> Optional[list[float]]: ...
    def timeline(self, replica: int = 0) -> list[tuple[int, str, float, float]]:
        """``(rank, action, start_s, end_s)`` per compute action; empty without a profile."""

@final
class SpeedEstimate:
    """Per pipeline rank and phase, the measured over the predicted busy time of the steps
    seen, exponentially weighted; :meth:`planning_pipeline` plans the next step from it."""

    def __new__(cls, pipeline: Pipeline, forgetting: float = 1.0) -> SpeedEstimate: ...
    def observe(
        self, plan: StepPlan, timings: Sequence[tuple[int, str, float]], replica: int = 0
    ) -> None:
        """Adds one step: ``(rank, action, compute_s)`` per action of every rank
        (``flatpipe.replan.gather_timings``) against ``plan`` replayed on the profile."""
    @property
    def steps(self) -> int: ...
    def rank_factors(self) -> list[float]: ...
    def phase_factors(self, rank: int) -> dict[str, float]:
        """``{"f", "i", "w", "b", "optimizer"}`` of pipeline rank ``rank``."""
    def planning_pipeline(self) -> Pipeline:
        """The pipeline with each rank's stages scaled by that rank's factors."""
    def propose_split(self, tokens: float, pairs: float = 0.0) -> Optional[list[tuple[int, int]]]:
        """A layer split for the measured rank speeds when a rank stays > 10% slower."""

@final
class Pipeline:
    """A pipeline configuration that plans each step's sequence lengths into a StepPlan."""

    def __new__(
        cls,
        schedule: str,
        pp: int,
        num_layers: Optional[int] = None,
        *,
        vpp: Optional[int] = None,
        stages: Optional[Sequence[tuple[int, int]]] = None,
        token_budget: Optional[int] = None,
        microbatches: Optional[int] = None,
        policy: Optional[str] = None,
        dp: int = 1,
        profile: Optional[Profile] = None,
        forward_only: Optional[int] = None,
        forward_only_mode: str = "fused",
        chunk_tokens: Optional[int] = None,
    ) -> Pipeline: ...
    @staticmethod
    def from_plan(path: str) -> Pipeline:
        """The pipeline of a plan file written by ``flatpipe plan -o``, with its profile."""
    def plan_step(self, seq_lens: Sequence[int], step: int = 0) -> StepPlan: ...
    def simulate(
        self, workload: Optional[str] = None, steps: int = 16, seed: Optional[int] = None
    ) -> SimulationSummary:
        """Predicted step time (mean, p50, p90, p99, seconds), bubble ratio, tokens per second,
        MFU, peak memory (bytes) over ``steps`` steps of ``workload``."""
    @property
    def schedule(self) -> str: ...
    @property
    def pp(self) -> int: ...
    @property
    def vpp(self) -> int: ...
    @property
    def dp(self) -> int: ...
    @property
    def num_layers(self) -> int: ...
    @property
    def stages(self) -> list[tuple[int, int]]: ...
    @property
    def stage_ranks(self) -> list[int]: ...
    @property
    def profile(self) -> Optional[Profile]: ...

def plan(
    profile: Profile,
    workload: str,
    ranks: int,
    *,
    steps: int = 8,
    seed: Optional[int] = None,
    keep: int = 5,
) -> list[PlanCandidate]:
    """The planner's search, best first (at most ``keep`` candidates)."""

def import_trace(paths: Sequence[str], step: Optional[int] = None) -> ImportedTrace:
    """PyTorch profiler traces of a pipelined run (one file per rank, ``.gz`` too), as
    ``flatpipe import-trace`` reads them: one step (default the last) of them."""
