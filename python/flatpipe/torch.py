"""Run a flatpipe step plan on torch.distributed: variable-length microbatches, no padding,
no shape exchange.

A :class:`flatpipe.StepPlan` says, before the step starts, every microbatch's token count ``T_k``
and every rank's actions in PyTorch's notation (``0F3``, ``1I2``, ``1W2``, ``0B1``), also as
structured actions (:meth:`flatpipe.StepPlan.actions_of`) whose parts name the stage each one
sends to and receives from (the core's one transfer rule). So every transfer's size is known in
advance: the boundary tensor of microbatch ``k`` is ``[T_k, H]``.
:class:`PipelineRuntime` runs the local rank's actions with point-to-point operations:

* The rank runs its program from the core (:meth:`flatpipe.StepPlan.lowered_actions_of`):
  its compute actions with the sends (``isend`` of the stage's output for F, of the input
  gradient for I and B), the receives (``irecv`` into a tensor of exactly ``[T_k, H]``) and the
  waits for sends between them, in the order the core's lowering posts them, which is PyTorch
  2.15's own (``_add_send_recv`` + ``_add_wait_send``, receives ahead; ``posting="deferred"``
  adds ``_defer_recv_ops``). The same order the simulator replays and ``flatpipe schedule
  --comms`` exports; nothing here derives an order of its own. On every ordered pair of ranks
  the lowering posts the sends and the receives in the same order, which is how NCCL (and
  gloo, on one tag) match point-to-point operations, also where a rank's previous and next
  peer are the same rank (p = 2, v = 2). Every receive has its own exact size.
* Nothing is padded and nothing about shapes is exchanged; each step may have a different
  number of microbatches and different ``T_k`` with the same runtime object.
* F runs the stage module; I computes the gradient of the stage's input only and keeps what
  the weight gradient needs; W computes the weight gradient from it; B does both. I and W use
  PyTorch's own ``stage_backward_input`` / ``stage_backward_weight``
  (``torch/distributed/pipelining/_backward.py``), as ``PipelineStage`` does, and like it the
  first stage (whose input, token ids, has no gradient) does nothing in I and the whole
  backward in W.
* The loss is explicit and token-weighted: the last stage's per-token cross-entropy is summed
  and divided by the step's token count (``loss_reduction="token"``) or each sequence's mean is
  summed and divided by the step's sequence count (``"sequence"``), known before the step from
  the plan, so the microbatches' losses add up to the step's loss whatever the cut. The loss is
  all-reduced over the pipeline so every rank returns it.

The stage contract (:class:`StageModule`): one forward signature for every stage,
``forward(x, cu_seqlens) -> Tensor``, where ``x`` is ``[T]`` int64 token ids on the first stage
and ``[T, H]`` hidden states on the others, and ``cu_seqlens`` is ``[n + 1]`` int64; the last
stage returns logits ``[T, V]``, the others ``[T, H]``.

Chunked sequences (a plan with ``chunk_tokens``: ``Microbatch.chunk`` is set): a chunk's
forward is ``forward(x, cu_seqlens, kv=ChunkKV(offset, prefix))``
(:class:`flatpipe.models.ChunkKV`): the module attends to the earlier chunks' keys and values
in ``prefix`` and records its own layer by layer. The runtime feeds ``prefix`` as fresh leaf
tensors, so a chunk's input-gradient pass yields the earlier chunks' key/value gradients
without touching their graphs; each earlier chunk's backward then adds them as the gradients of
its own keys and values (extra outputs of its backward). The plan runs a sequence's backwards
in reverse chunk order on every stage, so they are complete by then. On the first stage (whose
I does nothing for whole microbatches) a chunk's whole backward runs in I, since the earlier
chunks need its key/value gradients before theirs.
"""

from __future__ import annotations

import contextlib
import hashlib
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Mapping, Optional, Protocol, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining._backward import (
    stage_backward_input,
    stage_backward_weight,
)

from . import Action, CommAction, ComputeAction, StepPlan, parse_action
from .models import ChunkKV, ComputeStream, CpShard, cp_pieces

__all__ = [
    "profile",
    "StageModule",
    "PipelineRuntime",
    "StepResult",
    "ActionTiming",
    "parse_action",
    "token_loss_scale",
    "clip_grad_norm_",
    "cp_share",
]


class StageModule(Protocol):
    """What a stage is: a module built from a layer range with one forward signature.

    ``forward(x, cu_seqlens)``: ``x`` is ``[T]`` int64 token ids on the first stage and
    ``[T, H]`` hidden states on the others; ``cu_seqlens`` is ``[n + 1]`` int64 with the
    sequence boundaries ``[0, s_0, s_0 + s_1, ..., T]`` (attention never crosses them). Returns
    ``[T, H]``, or logits ``[T, V]`` on the last stage.
    """

    def __call__(self, x: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor: ...
    # With chunked sequences also ``__call__(x, cu_seqlens, kv=ChunkKV)`` (module docstring);
    # with a ``cp_group``, ``__call__(x, cu_seqlens, cp=CpShard)``.

    def parameters(self, recurse: bool = True): ...


def cp_share(x: torch.Tensor, cu_seqlens: Sequence[int], index: int, cp: int) -> torch.Tensor:
    """Process ``index``'s rows of a whole microbatch's ``x [T, ...]`` (token ids, targets) in a
    context-parallel group of ``cp``: the zigzag pieces of every document
    (:func:`flatpipe.models.cp_pieces`), in row order. What each process of the group gives
    :meth:`PipelineRuntime.step` as its inputs and targets."""
    cu = [int(c) for c in cu_seqlens]
    lens = [b - a for a, b in zip(cu[:-1], cu[1:])]
    rows = [torch.arange(cu[d] + o, cu[d] + o + n) for d, o, n in cp_pieces(lens, index, cp)]
    if not rows:
        return x[:0]
    return x[torch.cat(rows)]


def token_loss_scale(targets: Sequence[torch.Tensor], ignore_index: int = -100) -> int:
    """The step's loss-bearing tokens: targets not equal to ``ignore_index``, over all
    microbatches (the denominator of the token-weighted loss)."""
    return int(sum(int((t != ignore_index).sum()) for t in targets))


@dataclass
class ActionTiming:
    """One action as it ran on this rank: wall-clock seconds from the step's start."""

    action: str
    start_s: float
    end_s: float
    #: Seconds of the span spent waiting for the action's input to arrive.
    wait_s: float
    #: Seconds in the stage module's forward and the autograd calls (the action's own work).
    compute_s: float = 0.0
    #: Seconds in torch.distributed posting the action's sends and receives (``isend``,
    #: ``irecv``). The rest of the span (less wait and compute) is the runtime's own overhead.
    post_s: float = 0.0


@dataclass
class StepResult:
    """What one step returned on this rank."""

    #: The step's loss (token- or sequence-weighted mean), the same on every rank.
    loss: float
    #: Wall-clock seconds of the step on this rank, from the first action to the last send's
    #: completion.
    wall_s: float
    #: This rank's actions with their times.
    actions: List[ActionTiming] = field(default_factory=list)
    #: Forward-only outputs of the last stage, by forward-only microbatch id (last stage only).
    forward_only: Dict[int, torch.Tensor] = field(default_factory=dict)
    #: The overlapped pairs this rank ran with their halves interleaved (their stages' experts
    #: split over different process groups): per pair its action text and the events of its
    #: :class:`flatpipe.models.ComputeStream`, ``(half, what, start_s, end_s)`` with times from
    #: the step's start (half 0 the pair's first action).
    overlapped: List[Tuple[str, List[Tuple[int, str, float, float]]]] = field(
        default_factory=list
    )


class PipelineRuntime:
    """Runs this rank's actions of flatpipe step plans (see the module docstring).

    Args:
        stages: this rank's stage modules by global stage index (``plan.stages_of(rank)``).
        rank: this rank's pipeline rank (0..pp-1).
        hidden_size: ``H`` of the ``[T, H]`` boundary tensors.
        dtype: the boundary tensors' dtype (what the stage modules output).
        device: where the boundary tensors live (``"cpu"`` with gloo, a CUDA device with NCCL).
        group: the pipeline's process group (default: the world).
        pipeline_ranks: the global rank of each pipeline rank (default ``0..pp-1``).
        loss_reduction: ``"token"`` (sum of per-token losses over the step's loss-bearing tokens)
            or ``"sequence"`` (each sequence's mean, averaged over the step's sequences).
        dp_group: when given, each stage's gradients are all-reduced (summed) over this group
            right after the stage's last backward (I/B/W) of the step, as PyTorch's
            ``PipelineStage`` synchronises DDP/FSDP on a stage's last backward only; the
            reduction overlaps with the rest of the step and is waited for at its end. The sum
            is the step's gradient because every replica divides its loss by the whole step's
            denominator (``loss_denominator`` in :meth:`step`, required with a ``dp_group``).
        on_stage_backward_done: called with a stage index after that stage's last backward of
            the step (for a user's own data-parallel synchronisation).
        ignore_index: targets to leave out of the loss.
        annotate: wrap each entry of the program in
            ``torch.profiler.record_function(f"PP:{action}")``, as PyTorch's runtime does: the
            compute actions (``PP:0F1``; the wait for a received input is inside the span, before
            its first operator) and the posting of each send, receive and send wait
            (``PP:0SEND_F1``, ``PP:1RECV_F1``, ``PP:0WAIT_SEND_F1``). ``flatpipe import-trace``
            reads such traces, with the communication on each rank's comm lane.
        posting: where receives are posted in the core's lowering: ``"ahead"`` (PyTorch's
            ``_add_send_recv``, the default) or ``"deferred"`` (``_defer_recv_ops``: just
            before the compute that reads them).
        ep_group: the expert-parallel group of this rank's stages (the ``ep_group`` their
            mixture-of-experts layers split their experts over: ranks of the same pipeline
            rank in other replicas). Its members run each MoE layer's all-to-alls together, so
            they must run the same actions in the same order: before each step one small
            all-reduce over it checks that they have the same number of microbatches (plan with
            a fixed ``microbatches`` count per replica), a ``ValueError`` otherwise.
        expert_dp_group: where the experts' gradients are all-reduced instead of ``dp_group``
            (the parameters a stage marks with ``flatpipe_expert = True``: the ranks holding
            the same experts, ``dp / ep`` of them); ``None``: not reduced (``ep = dp``).
        cp_group: the context-parallel group of this rank (the same pipeline rank of the other
            pipelines that share every microbatch): each process gives :meth:`step` its share of
            every microbatch's inputs and targets (:func:`cp_share`), its stages are called
            with ``cp=CpShard(...)`` (their attention gathers the group's keys and values), and
            each stage's gradients are all-reduced (summed) over this group after its last
            backward, before ``dp_group``'s. Needs ``loss_reduction = "token"`` and the
            ``loss_denominator`` of the whole step; no chunks, no forward-only microbatches.
        check_plan: before each step, check with one small all-reduce over ``group`` that every
            rank was given the same plan (the step, its microbatches' token counts), so that a
            mismatch raises a ``ValueError`` naming it instead of failing inside the transport.
    """

    def __init__(
        self,
        stages: Mapping[int, nn.Module],
        *,
        rank: int,
        hidden_size: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        group: Optional[dist.ProcessGroup] = None,
        pipeline_ranks: Optional[Sequence[int]] = None,
        loss_reduction: str = "token",
        dp_group: Optional[dist.ProcessGroup] = None,
        on_stage_backward_done: Optional[Callable[[int], None]] = None,
        ignore_index: int = -100,
        annotate: bool = True,
        check_plan: bool = True,
        posting: str = "ahead",
        ep_group: Optional[dist.ProcessGroup] = None,
        expert_dp_group: Optional[dist.ProcessGroup] = None,
        cp_group: Optional[dist.ProcessGroup] = None,
    ) -> None:
        if posting not in ("ahead", "deferred"):
            raise ValueError(f"posting = {posting!r} is invalid: 'ahead' or 'deferred'")
        if loss_reduction not in ("token", "sequence"):
            raise ValueError(
                f"loss_reduction = {loss_reduction!r} is invalid: 'token' or 'sequence'"
            )
        if hidden_size <= 0:
            raise ValueError(f"hidden_size = {hidden_size} is invalid: >= 1")
        self.stages = dict(stages)
        self.rank = rank
        self.hidden_size = hidden_size
        self.dtype = dtype
        self.device = torch.device(device)
        self.group = group
        self.pipeline_ranks = list(pipeline_ranks) if pipeline_ranks is not None else None
        self.loss_reduction = loss_reduction
        self.dp_group = dp_group
        self.on_stage_backward_done = on_stage_backward_done
        self.ignore_index = ignore_index
        self.annotate = annotate
        self.check_plan = check_plan
        self.posting = posting
        self.ep_group = ep_group
        self.expert_dp_group = expert_dp_group
        self.cp_group = cp_group
        self.cp = dist.get_world_size(cp_group) if cp_group is not None else 1
        #: Test hook (:func:`flatpipe.replan.slow_rank_for_testing`): ``(factor, from_step)``
        #: makes this rank's compute ``factor`` times longer from plan step ``from_step`` on.
        self._test_slowdown: Optional[Tuple[float, int]] = None
        if self.cp > 1 and loss_reduction != "token":
            raise ValueError(
                "loss_reduction = 'sequence' with a cp_group is not supported (a sequence's mean "
                "spans the group's shares): use 'token'"
            )

    # ---- the step -------------------------------------------------------------------------

    def step(
        self,
        plan: StepPlan,
        inputs: Sequence[torch.Tensor],
        targets: Sequence[torch.Tensor],
        *,
        replica: int = 0,
        loss_denominator: Optional[float] = None,
        forward_only_inputs: Optional[Sequence[torch.Tensor]] = None,
    ) -> StepResult:
        """Runs this rank's actions of ``plan`` (replica ``replica``) and returns the loss.

        Args:
            plan: the step's plan; every rank must pass the same one.
            inputs: token ids ``[T_k]`` int64 per microbatch (read on the first stage's rank).
            targets: target ids ``[T_k]`` int64 per microbatch (read on the last stage's rank;
                ``ignore_index`` leaves a token out of the loss).
            loss_denominator: the loss's denominator when it spans more than this pipeline's
                microbatches (data parallelism: the loss-bearing tokens, or sequences, of every
                replica); default this replica's.
            forward_only_inputs: token ids per forward-only microbatch, when the plan has
                forward-only (``Fo``) work.

        Parameter gradients accumulate into ``.grad`` (zero them between steps). Raises
        ``ValueError`` for inputs that do not match the plan (naming the microbatch, the
        expected and the given token counts).
        """
        return self._run(
            plan,
            inputs,
            targets,
            replica=replica,
            loss_denominator=loss_denominator,
            forward_only_inputs=forward_only_inputs,
            train=True,
        )

    def eval_step(
        self,
        plan: StepPlan,
        inputs: Sequence[torch.Tensor],
        targets: Sequence[torch.Tensor],
        *,
        replica: int = 0,
        loss_denominator: Optional[float] = None,
    ) -> StepResult:
        """An evaluation step on the same stages: the forward passes of ``plan``'s
        microbatches only (each rank's F actions in the plan's order), under ``torch.no_grad``,
        keeping no activations and touching no gradient. Returns the loss, reduced as
        :meth:`step` reduces it. A training step may follow on the same runtime (the case of
        PyTorch #162822)."""
        return self._run(
            plan,
            inputs,
            targets,
            replica=replica,
            loss_denominator=loss_denominator,
            forward_only_inputs=None,
            train=False,
        )

    def _run(
        self,
        plan: StepPlan,
        inputs: Sequence[torch.Tensor],
        targets: Sequence[torch.Tensor],
        *,
        replica: int,
        loss_denominator: Optional[float],
        forward_only_inputs: Optional[Sequence[torch.Tensor]],
        train: bool,
        skip: frozenset = frozenset(),
    ) -> StepResult:
        """The step (``train``) or evaluation step; ``skip``: program entries not to run, by
        their text (the tests' way to make a rank leave out an action)."""
        state = _StepState(self, plan, replica, train)
        state.take_inputs(inputs, targets, forward_only_inputs, loss_denominator)
        if self.check_plan and dist.is_initialized():
            self._check_same_plan(plan, replica, state.tokens)
        if self.ep_group is not None:
            self._check_expert_partners(len(state.tokens))
        state.lower(plan, replica)
        state.run_program(skip)
        return state.finish()

    # ---- helpers ----------------------------------------------------------------------------

    def _check_expert_partners(self, microbatches: int) -> None:
        """The expert-parallel group's members must run as many microbatches (their MoE layers'
        all-to-alls pair up action by action): one all-reduce of ``(m, -m)`` with max."""
        t = torch.tensor([microbatches, -microbatches], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.ep_group)
        if int(t[0]) != microbatches or int(-t[1]) != microbatches:
            raise ValueError(
                f"expert-parallel partners run {int(-t[1])} to {int(t[0])} microbatches this "
                f"step (this rank {microbatches}): their all-to-alls pair up action by action, "
                "so plan every replica with the same count (Pipeline(..., microbatches=N))"
            )

    def _check_same_plan(self, plan: StepPlan, replica: int, tokens: List[int]) -> None:
        """Every rank of the pipeline must run the same step plan, on a group of the plan's
        size: one all-reduce of a digest of the plan (the step, its microbatches' token
        counts, the ranks, the stages and every rank's actions; max of ``h`` and of ``-h``)
        before any transfer, so that a mismatch is a ``ValueError`` on every rank instead of a
        hang or a size error inside the transport; in the same all-reduce, a digest of the
        boundary tensors' width and dtype (``hidden_size``, ``dtype``): gloo accepts a message
        narrower than the receive buffer and leaves its tail unwritten, so a rank given another
        width would read a silently wrong tensor; then the group's size against the plan's
        ranks (the same on every rank once the plans agree)."""
        actions = [plan.actions(r, replica) for r in range(plan.num_ranks)]
        text = repr((plan.step, replica, tokens, plan.num_ranks, plan.num_stages, actions))

        def digest(text: str) -> int:
            return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=7).digest(), "little")

        h = digest(text)
        io = digest(repr((self.hidden_size, str(self.dtype))))
        t = torch.tensor([h, -h, io, -io], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        if int(t[2]) != io or -int(t[3]) != io:
            raise ValueError(
                f"rank {self.rank}: the pipeline's ranks were given different boundary tensors "
                f"(this rank's: hidden_size = {self.hidden_size}, dtype = {self.dtype}); every "
                "rank must send and receive [T, hidden_size] tensors of one width and dtype"
            )
        if int(t[0]) != h or -int(t[1]) != h:
            raise ValueError(
                f"rank {self.rank}: the pipeline's ranks were given different step plans (this "
                f"rank's: step {plan.step}, schedule {plan.schedule_name(replica)}, "
                f"{plan.num_ranks} ranks, microbatches of {tokens} tokens); every rank must plan "
                "the same sequence lengths for the same step with the same pipeline"
            )
        ranks = (
            len(self.pipeline_ranks)
            if self.pipeline_ranks is not None
            else dist.get_world_size(self.group)
        )
        if ranks != plan.num_ranks:
            where = "pipeline_ranks" if self.pipeline_ranks is not None else "the process group"
            raise ValueError(
                f"rank {self.rank}: the plan has {plan.num_ranks} pipeline ranks but {where} "
                f"has {ranks}: plan with pp = {ranks}, or run on a group of {plan.num_ranks}"
            )

    def _annotate(self, name: str):
        return torch.profiler.record_function(name) if self.annotate else contextlib.nullcontext()

    def _global(self, pipeline_rank: int) -> int:
        if self.pipeline_ranks is None:
            return pipeline_rank
        return self.pipeline_ranks[pipeline_rank]

    @staticmethod
    def _last_backward(
        entries: Sequence[Tuple[str, Sequence[ComputeAction]]],
    ) -> Dict[int, Tuple[str, int]]:
        """Per stage, its last backward (I, B or W) in this rank's ``(text, parts)`` entries,
        as ``(kind, microbatch)``."""
        last: Dict[int, Tuple[str, int]] = {}
        for _, parts in entries:
            for p in parts:
                if p.kind in ("I", "B", "W"):
                    last[p.stage] = (p.kind, p.microbatch)
        return last

    def _stage_done(self, stage: int) -> List[object]:
        if self.on_stage_backward_done is not None:
            self.on_stage_backward_done(stage)
        works = []
        for p in self.stages[stage].parameters():
            if p.grad is not None and self.cp > 1:
                # The group's shares of every microbatch: their gradients add up.
                dist.all_reduce(p.grad, group=self.cp_group)
            group = (
                self.expert_dp_group if getattr(p, "flatpipe_expert", False) else self.dp_group
            )
            if p.grad is not None and group is not None:
                works.append(dist.all_reduce(p.grad, group=group, async_op=True))
        return works

    def _check(self, what: str, tensors: Sequence[torch.Tensor], tokens: List[int]) -> None:
        if len(tensors) != len(tokens):
            raise ValueError(
                f"{what}: {len(tensors)} microbatches given, the plan has {len(tokens)}"
            )
        for k, (t, n) in enumerate(zip(tensors, tokens)):
            if t.dim() != 1 or t.shape[0] != n:
                raise ValueError(
                    f"{what}[{k}]: shape {tuple(t.shape)}, the plan's microbatch {k} has [{n}] tokens"
                )

    def _denominator(self, mbs, targets: Sequence[torch.Tensor]) -> float:
        if self.loss_reduction == "token":
            return float(token_loss_scale(targets, self.ignore_index))
        return float(sum(len(mb.seq_lens) for mb in mbs))

    def _loss(self, logits: torch.Tensor, target: torch.Tensor, cu: torch.Tensor) -> torch.Tensor:
        per_token = F.cross_entropy(
            logits.float(), target, reduction="none", ignore_index=self.ignore_index
        )
        if self.loss_reduction == "token":
            return per_token.sum()
        # Each sequence's mean over its loss-bearing tokens.
        seq = torch.repeat_interleave(
            torch.arange(len(cu) - 1, device=cu.device), cu[1:] - cu[:-1]
        )
        valid = (target != self.ignore_index).to(per_token.dtype)
        sums = torch.zeros(len(cu) - 1, dtype=per_token.dtype, device=per_token.device)
        counts = torch.zeros_like(sums)
        sums.index_add_(0, seq, per_token * valid)
        counts.index_add_(0, seq, valid)
        return (sums / counts.clamp(min=1)).sum()


#: A transfer's key: what it carries (``"F"`` activations, ``"Fo"`` forward-only activations,
#: ``"B"`` an input gradient), the receiving stage, the microbatch.
_Key = Tuple[str, int, int]


def _carried(kind: str) -> str:
    """What the transfer of an action of ``kind`` carries (I and B both send an input
    gradient, ``"B"``)."""
    return "B" if kind in ("I", "B") else kind


class _ChunkChains:
    """Chunked sequences on this rank: per (stage, sequence) its chunks' :class:`ChunkKV` by
    chunk index (their own keys and values, with their graphs, until the chunk's backward), the
    microbatch of each chunk, and per (stage, microbatch) the key/value gradients (``[t, ...]``
    per layer, keys then values) its later chunks handed back."""

    def __init__(self, chunks: Sequence[Optional[Tuple[int, int, int, int]]], rank: int) -> None:
        self.chunks = chunks
        self.rank = rank
        self.kv: Dict[Tuple[int, int], Dict[int, ChunkKV]] = {}
        self.mb_of: Dict[Tuple[int, int, int], int] = {}
        self.later: Dict[Tuple[int, int], List[Optional[torch.Tensor]]] = {}
        self.backward_done: set = set()

    def forward_kv(self, stage: int, mb: int, grad: bool) -> ChunkKV:
        """The :class:`ChunkKV` of chunk ``mb``'s forward on ``stage``: the earlier chunks' keys
        and values concatenated along tokens as fresh leaves (``requires_grad`` = ``grad``).
        Raises ``RuntimeError`` when an earlier chunk has not run F on the stage."""
        seq, idx, _, off = self.chunks[mb]
        earlier = self.kv.setdefault((stage, seq), {})
        prefix = None
        if idx > 0:
            missing = [j for j in range(idx) if j not in earlier]
            if missing:
                raise RuntimeError(
                    f"rank {self.rank}: {stage}F{mb} is chunk {idx} of sequence {seq}, but "
                    f"chunk(s) {missing} have not run F on stage {stage} (an invalid schedule)"
                )
            prefix = []
            for layer in range(len(earlier[0].own)):
                pair = []
                for which in (0, 1):
                    t = torch.cat([earlier[j].own[layer][which].detach() for j in range(idx)])
                    pair.append(t.requires_grad_(grad))
                prefix.append((pair[0], pair[1]))
        kv = ChunkKV(off, prefix)
        earlier[idx] = kv
        self.mb_of[(stage, seq, idx)] = mb
        return kv

    def backward(self, stage, kind, mb, x, out, grad, params, first: bool):
        """A chunk's I or B: its output and its own keys and values (with the gradients its
        later chunks handed back) backward; the earlier chunks' key/value gradients handed on.
        On the first stage (``first``) the whole backward runs here. Returns ``(dx, param
        groups for W or None)``. Raises ``RuntimeError`` when a later chunk's backward has not
        run on the stage."""
        seq, idx, of, _ = self.chunks[mb]
        pending_later = [j for j in range(idx + 1, of) if (stage, seq, j) not in self.backward_done]
        if pending_later:
            raise RuntimeError(
                f"rank {self.rank}: {stage}{kind}{mb} is chunk {idx} of sequence {seq}, but the "
                f"backward of chunk(s) {pending_later} has not run on stage {stage} (a "
                "sequence's backwards run in reverse chunk order)"
            )
        chain = self.kv[(stage, seq)]
        kv = chain[idx]
        own = [t for pair in kv.own for t in pair]
        handed = self.later.pop((stage, mb), None)
        own_grads = [
            handed[i] if handed is not None and handed[i] is not None else torch.zeros_like(t)
            for i, t in enumerate(own)
        ]
        leaves = [t for pair in (kv.prefix or []) for t in pair]
        outs = [out] + own
        grads = [torch.ones_like(out) if grad is None else grad] + own_grads
        groups = None
        if kind == "B" or first:
            torch.autograd.backward(outs, grad_tensors=grads)
            dx = x.grad if not first else None
            dleaves = [t.grad for t in leaves]
        else:
            dxs, groups = stage_backward_input(outs, grads, [x] + leaves, iter(params))
            dx, dleaves = dxs[0], list(dxs[1:])
        self._hand_back(stage, seq, idx, chain, dleaves, 2 * len(kv.own))
        self.backward_done.add((stage, seq, idx))
        # The chain's own tensors go once its first chunk's backward has run.
        kv.own = []
        if idx == 0:
            del self.kv[(stage, seq)]
        return dx, groups

    def _hand_back(self, stage, seq, idx, chain, dleaves, slots: int) -> None:
        """Hands each earlier chunk of ``chain`` its rows of the key/value gradients
        ``dleaves`` (per layer keys then values, the earlier chunks' rows in chunk order)."""
        for layer in range(len(dleaves) // 2):
            start = 0
            for j in range(idx):
                n = chain[j].own[layer][0].shape[0]
                slot = self.later.setdefault((stage, self.mb_of[(stage, seq, j)]), [None] * slots)
                for which in (0, 1):
                    d = dleaves[2 * layer + which]
                    if d is None:
                        continue
                    part = d[start : start + n]
                    i = 2 * layer + which
                    slot[i] = part if slot[i] is None else slot[i] + part
                start += n


class _StepState:
    """One step of :class:`PipelineRuntime` on its rank: the plan's sizes (``T_k`` per
    microbatch), every rank's actions, the receives this rank posts in each sender's order, and
    what the rank's actions hand each other: per (stage, microbatch) the stage's input and
    output (or loss) that F saves for I and B, I's parameter groups for W, the tensors handed
    between two stages of this rank, the chunks' keys and values, the loss, the timings.

    Which stage an action receives from and sends to is the core's rule
    (:attr:`flatpipe.ComputeAction.receives_from` / ``sends_to``); nothing here re-derives it.
    """

    def __init__(self, rt: PipelineRuntime, plan: StepPlan, replica: int, train: bool) -> None:
        me = rt.rank
        if me >= plan.num_ranks:
            raise ValueError(f"rank = {me} is out of range: the plan has {plan.num_ranks} ranks")
        mine = set(plan.stages_of(me))
        if set(rt.stages) != mine:
            raise ValueError(
                f"rank {me} holds stages {sorted(rt.stages)}, the plan puts stages {sorted(mine)} on it"
            )
        self.rt, self.me, self.mine, self.train = rt, me, mine, train
        self.step_number = plan.step
        self.stage_rank = plan.stage_ranks
        self.first, self.last = 0, plan.num_stages - 1
        self.mbs = plan.microbatches(replica)
        self.tokens = [mb.tokens for mb in self.mbs]
        self.chunks = [mb.chunk for mb in self.mbs]
        if any(c is not None for c in self.chunks) and rt.loss_reduction != "token":
            raise ValueError(
                "loss_reduction = 'sequence' with chunked sequences is not supported yet (a "
                "sequence's mean spans its chunks): use 'token', or plan without chunk_tokens"
            )
        self.cu = [self._cu(mb) for mb in self.mbs]
        # With a cp group: this process's share of every microbatch (its sizes, its pieces as
        # sequences) and what its stages attend with.
        self.shards: List[Optional[CpShard]] = [None] * len(self.mbs)
        if rt.cp > 1:
            self._take_shares()
        fo_mbs = plan.forward_only_microbatches(replica) if train else []
        if fo_mbs and rt.cp > 1:
            raise ValueError(
                "forward-only microbatches with a cp_group are not supported yet: plan without forward_only"
            )
        self.fo_mbs = fo_mbs
        self.fo_tokens = [mb.tokens for mb in fo_mbs]
        self.fo_cu = [self._cu(mb) for mb in fo_mbs]
        self.chains = _ChunkChains(self.chunks, me)
        # Transfers, by key (what, receiving stage, microbatch): receives posted, results
        # waiting for their SEND, sends in flight, hand-offs within the rank.
        self.pending: Dict[_Key, Tuple[object, torch.Tensor]] = {}
        self.outbox: Dict[_Key, torch.Tensor] = {}
        self.sends: Dict[_Key, Tuple[object, torch.Tensor]] = {}
        self.local: Dict[_Key, torch.Tensor] = {}
        # Per (stage, mb): the stage's input and output (or loss), and I's saved state for W.
        self.saved: Dict[Tuple[int, int], Tuple[torch.Tensor, torch.Tensor]] = {}
        self.param_groups: Dict[Tuple[int, int], Optional[list]] = {}
        self.loss_sum = torch.zeros((), dtype=torch.float64)
        self.fo_out: Dict[int, torch.Tensor] = {}
        self.reductions: List[object] = []
        self.timings: List[ActionTiming] = []
        self.overlapped: List[Tuple[str, List[Tuple[int, str, float, float]]]] = []
        # The current action's seconds in compute and in posting transfers.
        self.compute_s = self.post_s = 0.0

    def _cu(self, mb) -> torch.Tensor:
        return torch.as_tensor(mb.cu_seqlens, dtype=torch.int64, device=self.rt.device)

    def _take_shares(self) -> None:
        """Each microbatch as this process's share of it in the cp group: its token count, its
        pieces as ``cu_seqlens`` and its :class:`CpShard`. Raises ``ValueError`` for chunks."""
        rt = self.rt
        if any(c is not None for c in self.chunks):
            raise ValueError(
                "chunked sequences with a cp_group: chunks and context parallelism are two "
                "answers to long sequences; plan without chunk_tokens"
            )
        index = dist.get_rank(rt.cp_group)
        for k, mb in enumerate(self.mbs):
            shard = CpShard(rt.cp_group, index, rt.cp, list(mb.seq_lens))
            lens = [n for _, _, n in shard.pieces()]
            self.shards[k] = shard
            self.tokens[k] = sum(lens)
            cu = [0]
            for n in lens:
                cu.append(cu[-1] + n)
            self.cu[k] = torch.as_tensor(cu, dtype=torch.int64, device=rt.device)

    def take_inputs(self, inputs, targets, forward_only_inputs, loss_denominator) -> None:
        """Checks the step's token ids ``[T_k]`` (first stage), targets ``[T_k]`` (last stage)
        and forward-only token ids against the plan and fixes the loss's denominator. Raises
        ``ValueError`` naming what does not match."""
        rt = self.rt
        if self.first in self.mine:
            rt._check("inputs", inputs, self.tokens)
            if self.fo_mbs:
                if forward_only_inputs is None:
                    raise ValueError(
                        f"the plan has {len(self.fo_mbs)} forward-only microbatches: give forward_only_inputs"
                    )
                rt._check("forward_only_inputs", forward_only_inputs, self.fo_tokens)
        if self.last in self.mine:
            rt._check("targets", targets, self.tokens)
        if rt.dp_group is not None and loss_denominator is None:
            raise ValueError(
                "with dp_group, give loss_denominator: the loss-bearing tokens (or sequences) of "
                "every replica's step, so that the summed gradients are the step's"
            )
        denominator = loss_denominator
        if denominator is None:
            denominator = rt._denominator(self.mbs, targets) if self.last in self.mine else 1.0
        if self.last in self.mine and denominator <= 0:
            raise ValueError(f"loss denominator = {denominator}: the step has no loss-bearing token")
        self.inputs, self.targets = inputs, targets
        self.fo_inputs = forward_only_inputs
        self.denominator = denominator

    def lower(self, plan: StepPlan, replica: int) -> None:
        """This rank's program from the core: compute entries (an evaluation step: their F
        parts only) with the sends, receives and send waits between them."""
        self.program = plan.lowered_actions_of(
            self.me, replica, posting=self.rt.posting, forward_only=not self.train
        )
        computes = [a for a in self.program if isinstance(a, Action)]
        self.last_backward = PipelineRuntime._last_backward([(a.text, a.parts) for a in computes])

    def run_program(self, skip: frozenset) -> None:
        """Runs this rank's program in order (but the compute entries whose text is in
        ``skip``); the step's clock starts here."""
        self.t_start = time.perf_counter()
        for a in self.program:
            if isinstance(a, Action):
                if a.text not in skip:
                    self.run_action(a.text, a.parts)
                continue
            p0 = time.perf_counter()
            with self.rt._annotate(f"PP:{a}"):
                self._post(a)
            self.post_s += time.perf_counter() - p0

    def run_action(self, text: str, parts: Sequence[ComputeAction]) -> None:
        """One compute entry (one or two compute actions) in its ``PP:<text>`` event, which
        begins with the waits for its received inputs, as in PyTorch's runtime."""
        a0 = time.perf_counter()
        self.compute_s = self.post_s = 0.0
        with self.rt._annotate(f"PP:{text}"):
            got, wait = self.receive_inputs(parts)
            if self._interleaves(parts):
                self.run_overlapped(text, parts, got)
            else:
                for p in parts:
                    self.run_part(p, got)
            for p in parts:
                if self.last_backward.get(p.stage) == (p.kind, p.microbatch):
                    self.reductions.extend(self.rt._stage_done(p.stage))
        now = time.perf_counter()
        self.timings.append(
            ActionTiming(
                text, a0 - self.t_start, now - self.t_start, wait, self.compute_s, self.post_s
            )
        )

    def run_part(self, p: ComputeAction, got: Dict[_Key, torch.Tensor]) -> None:
        """One compute action on its received inputs."""
        before = self.compute_s
        if p.kind in ("F", "Fo"):
            self.forward(p, got)
        elif p.kind in ("I", "B"):
            self.input_backward(p, got)
        else:
            self.weight_backward(p)
        slow = self.rt._test_slowdown
        if slow is not None and self.step_number >= slow[1]:
            # The straggler hook: the action's compute, made `factor` times as long.
            extra = (slow[0] - 1.0) * (self.compute_s - before)
            time.sleep(extra)
            self.compute_s += extra

    def _interleaves(self, parts: Sequence[ComputeAction]) -> bool:
        """Whether an overlapped pair runs with its halves interleaved: a training step, two
        stages whose experts split over two different process groups (each half's
        all-to-alls then go through its own group, in the same order on every rank)."""
        if len(parts) != 2 or not self.train:
            return False
        groups = [getattr(self.rt.stages[p.stage], "ep_group", None) for p in parts]
        return groups[0] is not None and groups[1] is not None and groups[0] is not groups[1]

    def run_overlapped(
        self, text: str, parts: Sequence[ComputeAction], got: Dict[_Key, torch.Tensor]
    ) -> None:
        """Runs an overlapped pair's halves on two threads sharing one
        :class:`flatpipe.models.ComputeStream`: a half computes while it holds the stream and
        lets it go while its all-to-all is on the wire, so the other half computes meanwhile.
        Re-raises the first half's error (after both threads end)."""
        stream = ComputeStream()
        errors: List[Optional[BaseException]] = [None, None]

        def half(i: int) -> None:
            try:
                with stream.bound(i):
                    self.run_part(parts[i], got)
            except BaseException as e:  # re-raised on the step's thread
                errors[i] = e

        t0 = stream._t0 - self.t_start
        other = threading.Thread(target=half, args=(1,), name=f"flatpipe {text} half 1")
        other.start()
        half(0)
        other.join()
        for e in errors:
            if e is not None:
                raise e
        self.overlapped.append(
            (text, [(h, what, a + t0, b + t0) for h, what, a, b in stream.events])
        )

    # ---- transfers ------------------------------------------------------------------------

    def receive_inputs(
        self, parts: Sequence[ComputeAction]
    ) -> Tuple[Dict[_Key, torch.Tensor], float]:
        """The inputs of ``parts`` that come from other ranks (``[T, H]`` each), by transfer
        key, and the seconds spent waiting for them. Raises ``RuntimeError`` when the program
        did not post the receive before (a lowering that is not the core's)."""
        got: Dict[_Key, torch.Tensor] = {}
        wait = 0.0
        for p in parts:
            src = p.receives_from
            if src is None or self.stage_rank[src] == self.me:
                continue
            key = (_carried(p.kind), p.stage, p.microbatch)
            if key not in self.pending:
                raise RuntimeError(f"rank {self.me}: {p} runs before its receive {key} was posted")
            work, buf = self.pending.pop(key)
            w0 = time.perf_counter()
            try:
                work.wait()
            except RuntimeError as e:
                raise RuntimeError(
                    f"rank {self.me}: receiving {key} from rank {self.stage_rank[src]} failed "
                    f"({e}); the sending rank stopped first: its error says why"
                ) from e
            wait += time.perf_counter() - w0
            got[key] = buf
        return got, wait

    def _post(self, c: CommAction) -> None:
        """Posts one communication entry of the program: a receive into a tensor of exactly
        ``[T_k, H]``, the send of a result computed before, or the wait for a send (its buffer
        is then free). Raises ``RuntimeError`` for a send whose result was not computed (its
        compute entry skipped) or a wait for a send never posted."""
        rt = self.rt
        key = (c.carries, c.receiving_stage, c.microbatch)
        if c.kind == "RECV":
            rows = self.fo_tokens[c.microbatch] if c.carries == "Fo" else self.tokens[c.microbatch]
            buf = torch.empty(rows, rt.hidden_size, dtype=rt.dtype, device=rt.device)
            self.pending[key] = (dist.irecv(buf, src=rt._global(c.peer), group=rt.group), buf)
        elif c.kind == "SEND":
            if key not in self.outbox:
                raise RuntimeError(f"rank {self.me}: {c} sends a result that was not computed")
            t = self.outbox.pop(key)
            self.sends[key] = (dist.isend(t, dst=rt._global(c.peer), group=rt.group), t)
        else:
            if key not in self.sends:
                raise RuntimeError(f"rank {self.me}: {c} waits for a send never posted")
            self.sends.pop(key)[0].wait()

    def _received(
        self, part: ComputeAction, got: Dict[_Key, torch.Tensor]
    ) -> Optional[torch.Tensor]:
        """What ``part`` receives (activations for F / Fo, the output gradient for I / B),
        handed over within the rank or received; ``None`` when it receives nothing."""
        src = part.receives_from
        if src is None:
            return None
        key = (_carried(part.kind), part.stage, part.microbatch)
        return self.local.pop(key) if self.stage_rank[src] == self.me else got.pop(key)

    def _send(self, part: ComputeAction, tensor: torch.Tensor) -> None:
        """Hands ``part``'s result ``[T, H]`` to stage ``part.sends_to``: directly when this
        rank runs that stage, else to the program's SEND entry that follows. Raises
        ``ValueError`` when the result is not the plan's boundary tensor (the microbatch's
        tokens x ``hidden_size`` in the runtime's ``dtype``): the peer's receive is sized from
        the plan, and gloo fills a narrower message's share of the buffer and leaves the rest,
        so a stage module with another width or dtype would hand on a silently wrong tensor."""
        dst_stage = part.sends_to
        rows = (self.fo_tokens if part.kind == "Fo" else self.tokens)[part.microbatch]
        rt = self.rt
        if tuple(tensor.shape) != (rows, rt.hidden_size) or tensor.dtype != rt.dtype:
            raise ValueError(
                f"rank {self.me}: {part} produced a {list(tensor.shape)} {tensor.dtype} tensor "
                f"for stage {dst_stage}, but the plan's boundary tensor is [{rows}, "
                f"{rt.hidden_size}] {rt.dtype} (the microbatch's tokens x hidden_size, in the "
                "runtime's dtype): the stage module must output [T, hidden_size] in the "
                "PipelineRuntime's dtype"
            )
        key = (_carried(part.kind), dst_stage, part.microbatch)
        if self.stage_rank[dst_stage] == self.me:
            self.local[key] = tensor
        else:
            self.outbox[key] = tensor.contiguous()

    # ---- compute --------------------------------------------------------------------------

    def forward(self, part: ComputeAction, got: Dict[_Key, torch.Tensor]) -> None:
        """F or Fo: the stage module on the input (token ids ``[T]`` on the first stage, else
        ``[T, H]``); the output ``[T, H]`` goes to ``part.sends_to``. On the last stage F's
        logits become the loss (kept with the input for the backward) and Fo's output is kept
        as the forward-only result. Fo and an evaluation step's F keep no graph."""
        stage, mb = part.stage, part.microbatch
        module = self.rt.stages[stage]
        fo = part.kind == "Fo"
        x = self._received(part, got)
        if x is None:
            x = (self.fo_inputs if fo else self.inputs)[mb]
        c = self.fo_cu[mb] if fo else self.cu[mb]
        if fo:
            c0 = time.perf_counter()
            with torch.no_grad():
                out = module(x, c)
            self.compute_s += time.perf_counter() - c0
            if part.sends_to is None:
                self.fo_out[mb] = out
            else:
                self._send(part, out)
            return
        kv = self.chains.forward_kv(stage, mb, self.train) if self.chunks[mb] is not None else None
        shard = self.shards[mb]
        if kv is not None:
            call = lambda x, c: module(x, c, kv=kv)  # noqa: E731
        elif shard is not None:
            call = lambda x, c: module(x, c, cp=shard)  # noqa: E731
        else:
            call = module
        if not self.train:
            c0 = time.perf_counter()
            with torch.no_grad():
                out = call(x, c)
                if stage == self.last:
                    self.loss_sum += (self._loss(out, mb) / self.denominator).to(torch.float64)
            self.compute_s += time.perf_counter() - c0
            if part.sends_to is not None:
                self._send(part, out)
            return
        if stage != self.first:
            x = x.detach().requires_grad_(True)
        c0 = time.perf_counter()
        out = call(x, c)
        if stage == self.last:
            out = self._loss(out, mb) / self.denominator
            self.loss_sum += out.detach().to(torch.float64)
            self.compute_s += time.perf_counter() - c0
        else:
            self.compute_s += time.perf_counter() - c0
            self._send(part, out.detach())
        self.saved[(stage, mb)] = (x, out)

    def _loss(self, logits: torch.Tensor, mb: int) -> torch.Tensor:
        return self.rt._loss(logits, self.targets[mb], self.cu[mb])

    def input_backward(self, part: ComputeAction, got: Dict[_Key, torch.Tensor]) -> None:
        """I (the input gradient, keeping what W needs) or B (the whole backward) from the
        output gradient ``[T, H]`` (none on the last stage, whose output is the loss); the input
        gradient ``[T, H]`` goes to ``part.sends_to``. On the first stage, whose input (token
        ids) has no gradient, I does nothing and leaves the whole backward to W, as PyTorch's
        ``PipelineStage`` does (a chunk's runs whole in I: its earlier chunks need its key/value
        gradients)."""
        stage, kind, mb = part.stage, part.kind, part.microbatch
        module = self.rt.stages[stage]
        x, out = self.saved[(stage, mb)]
        grad = self._received(part, got)
        c0 = time.perf_counter()
        if self.chunks[mb] is not None:
            params = list(module.parameters())
            dx, groups = self.chains.backward(
                stage, kind, mb, x, out, grad, params, first=stage == self.first
            )
            if kind == "B":
                del self.saved[(stage, mb)]
            else:
                # None: the whole backward ran here (first stage), W is empty.
                self.param_groups[(stage, mb)] = groups
        elif kind == "B":
            torch.autograd.backward(out, grad_tensors=grad)
            dx = x.grad if stage != self.first else None
            del self.saved[(stage, mb)]
        elif stage == self.first:
            # As PipelineStage: token ids have no gradient, so the whole backward runs in W
            # (stage_backward_input would not capture the parameters).
            self.param_groups[(stage, mb)] = [grad]
            dx = None
        else:
            params = list(module.parameters())
            dxs, groups = stage_backward_input(
                [out], None if grad is None else [grad], [x], iter(params)
            )
            dx = dxs[0]
            self.param_groups[(stage, mb)] = groups
        self.compute_s += time.perf_counter() - c0
        if part.sends_to is not None:
            if dx is None:
                dx = torch.zeros_like(x)
            self._send(part, dx.detach())

    def weight_backward(self, part: ComputeAction) -> None:
        """W: the weight gradient from I's saved parameter groups (on the first stage the whole
        backward, from the output gradient I kept)."""
        stage, mb = part.stage, part.microbatch
        groups = self.param_groups.pop((stage, mb))
        c0 = time.perf_counter()
        if groups is None:
            # A chunk on the first stage: its backward ran whole in I.
            self.saved.pop((stage, mb), None)
        elif stage == self.first:
            _, out = self.saved.pop((stage, mb))
            torch.autograd.backward(out, grad_tensors=groups[0])
        else:
            stage_backward_weight(iter(list(self.rt.stages[stage].parameters())), groups)
            self.saved.pop((stage, mb), None)
        self.compute_s += time.perf_counter() - c0

    # ---- the end ----------------------------------------------------------------------------

    def finish(self) -> StepResult:
        """Waits for the sends the program did not wait for and the gradient reductions,
        all-reduces the loss over the pipeline and returns the step's result. Raises
        ``RuntimeError`` when a result was never sent or a tensor handed over within the rank
        never used (an invalid schedule)."""
        for work, _ in self.sends.values():
            work.wait()
        if self.outbox:
            raise RuntimeError(f"rank {self.me}: computed but never sent: {sorted(self.outbox)}")
        for work in self.reductions:
            work.wait()
        if self.local:
            raise RuntimeError(f"rank {self.me}: handed over but never used: {sorted(self.local)}")
        total = self.loss_sum.clone()
        dist.all_reduce(total, group=self.rt.group)
        return StepResult(
            loss=float(total),
            wall_s=time.perf_counter() - self.t_start,
            actions=self.timings,
            forward_only=self.fo_out,
            overlapped=self.overlapped,
        )


def clip_grad_norm_(
    parameters, max_norm: float, group: Optional[dist.ProcessGroup] = None
) -> float:
    """Clips the gradients of this rank's ``parameters`` so that the norm over *every*
    pipeline rank's parameters is at most ``max_norm`` (the sum of squares all-reduced over
    ``group``, the pipeline's process group), as ``torch.nn.utils.clip_grad_norm_`` does for one
    process; the same call for pp = 1. Returns the total norm before clipping."""
    grads = [p.grad for p in parameters if p.grad is not None]
    sq = torch.zeros((), dtype=torch.float64)
    for g in grads:
        sq += g.detach().double().pow(2).sum().cpu()
    if dist.is_initialized():
        dist.all_reduce(sq, group=group)
    norm = float(sq.sqrt())
    if norm > max_norm > 0:
        for g in grads:
            g.mul_(max_norm / (norm + 1e-6))
    return norm


def profile(*args, **kwargs):
    """:func:`flatpipe.measure.profile`: a cost profile measured on the user's own stage modules
    (F, I, W and B per layer kind over a grid of microbatches, the link, the optimizer)."""
    from .measure import profile as measured

    return measured(*args, **kwargs)
