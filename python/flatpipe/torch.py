"""Run a flatpipe step plan on torch.distributed: variable-length microbatches, no padding,
no shape exchange.

A :class:`flatpipe.StepPlan` says, before the step starts, every microbatch's token count ``T_k``
and every rank's actions in PyTorch's notation (``0F3``, ``1I2``, ``1W2``, ``0B1``). So every
transfer's size is known in advance: the boundary tensor of microbatch ``k`` is ``[T_k, H]``.
:class:`PipelineRuntime` runs the local rank's actions with point-to-point operations:

* Sends are ``isend`` of the stage's output (F) or input gradient (I, B), posted in the
  rank's action order. Receives are ``irecv`` into a tensor of exactly ``[T_k, H]``, posted in
  the *sender's* action order (every rank knows every rank's actions), lazily: when an action
  needs an input, the receives from that peer are posted up to and including it. So on every
  ordered pair of ranks the sends and the receives are posted in the same order, which is how
  NCCL (and gloo, on one tag) match point-to-point operations, also where a rank's previous and
  next peer are the same rank (p = 2, v = 2). A mismatched order would be a size error, never a
  silently wrong tensor: every receive has its own exact size.
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
import re
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

from . import StepPlan
from .models import ChunkKV

__all__ = [
    "StageModule",
    "PipelineRuntime",
    "StepResult",
    "ActionTiming",
    "parse_action",
    "token_loss_scale",
    "clip_grad_norm_",
]

_ACTION = re.compile(r"^(\d+)(Fo|F|I|W|B)(\d+)$")
_OVERLAP = re.compile(r"^\((.+);(.+)\)OVERLAP_F_B$")


class StageModule(Protocol):
    """What a stage is: a module built from a layer range with one forward signature.

    ``forward(x, cu_seqlens)``: ``x`` is ``[T]`` int64 token ids on the first stage and
    ``[T, H]`` hidden states on the others; ``cu_seqlens`` is ``[n + 1]`` int64 with the
    sequence boundaries ``[0, s_0, s_0 + s_1, ..., T]`` (attention never crosses them). Returns
    ``[T, H]``, or logits ``[T, V]`` on the last stage.
    """

    def __call__(self, x: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor: ...
    # With chunked sequences also ``__call__(x, cu_seqlens, kv=ChunkKV)`` (module docstring).

    def parameters(self, recurse: bool = True): ...


def parse_action(text: str) -> List[Tuple[int, str, int]]:
    """``"0F3"`` -> ``[(0, "F", 3)]``; an overlapped pair ``"(0F3;1B2)OVERLAP_F_B"`` -> both
    halves, forward first (they run in sequence). Raises ``ValueError`` naming the text."""
    m = _OVERLAP.match(text)
    parts = [m.group(1), m.group(2)] if m else [text]
    out = []
    for p in parts:
        a = _ACTION.match(p.strip())
        if a is None:
            raise ValueError(
                f"{text!r} is not a compute action (stage, one of F, I, W, B, Fo, microbatch: '0F3')"
            )
        out.append((int(a.group(1)), a.group(2), int(a.group(3))))
    return out


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


@dataclass
class _Transfer:
    kind: str  # "F" (activation), "Fo" (forward-only activation) or "B" (input gradient)
    stage: int  # the receiving stage
    mb: int


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
        annotate: wrap each action in ``torch.profiler.record_function(f"PP:{action}")`` and each
            wait for an input in its own ``PP:<stage>RECV_F<mb>`` / ``PP:<stage>RECV_B<mb>``
            event before the action's, so a profiler trace shows the action's work and its wait
            apart (``flatpipe import-trace`` reads such traces).
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
    ) -> None:
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
        _skip: frozenset = frozenset(),
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
            skip=_skip,
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
            skip=frozenset(),
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
        skip: frozenset,
    ) -> StepResult:
        mbs = plan.microbatches(replica)
        fo_mbs = plan.forward_only_microbatches(replica)
        stage_rank = plan.stage_ranks
        num_stages = plan.num_stages
        me = self.rank
        if me >= plan.num_ranks:
            raise ValueError(f"rank = {me} is out of range: the plan has {plan.num_ranks} ranks")
        mine = set(plan.stages_of(me))
        if set(self.stages) != mine:
            raise ValueError(
                f"rank {me} holds stages {sorted(self.stages)}, the plan puts stages {sorted(mine)} on it"
            )
        first, last = 0, num_stages - 1
        tokens = [mb.tokens for mb in mbs]
        chunks = [mb.chunk for mb in mbs]
        if any(c is not None for c in chunks) and self.loss_reduction != "token":
            raise ValueError(
                "loss_reduction = 'sequence' with chunked sequences is not supported yet (a "
                "sequence's mean spans its chunks): use 'token', or plan without chunk_tokens"
            )
        cu = [torch.as_tensor(mb.cu_seqlens, dtype=torch.int64, device=self.device) for mb in mbs]
        fo_tokens = [mb.tokens for mb in fo_mbs]
        fo_cu = [
            torch.as_tensor(mb.cu_seqlens, dtype=torch.int64, device=self.device) for mb in fo_mbs
        ]
        if not train:
            fo_mbs, fo_tokens, fo_cu = [], [], []
        if first in mine:
            self._check("inputs", inputs, tokens)
            if fo_mbs:
                if forward_only_inputs is None:
                    raise ValueError(
                        f"the plan has {len(fo_mbs)} forward-only microbatches: give forward_only_inputs"
                    )
                self._check("forward_only_inputs", forward_only_inputs, fo_tokens)
        if last in mine:
            self._check("targets", targets, tokens)
        if self.dp_group is not None and loss_denominator is None:
            raise ValueError(
                "with dp_group, give loss_denominator: the loss-bearing tokens (or sequences) of "
                "every replica's step, so that the summed gradients are the step's"
            )
        denominator = loss_denominator
        if denominator is None:
            denominator = self._denominator(mbs, targets) if last in mine else 1.0
        if last in mine and denominator <= 0:
            raise ValueError(f"loss denominator = {denominator}: the step has no loss-bearing token")

        if self.check_plan and dist.is_initialized():
            self._check_same_plan(plan, replica, tokens)

        # Every rank's actions, to order the receives as their senders post them.
        all_actions = [plan.actions(r, replica) for r in range(plan.num_ranks)]
        if not train:
            # An evaluation step: the forwards only, in the plan's order.
            all_actions = [
                [f"{s}F{m}" for text in acts for s, k, m in parse_action(text) if k == "F"]
                for acts in all_actions
            ]
        incoming: Dict[int, List[_Transfer]] = {}
        for src, acts in enumerate(all_actions):
            if src == me:
                continue
            for text in acts:
                for stage, kind, mb in parse_action(text):
                    t = self._transfer_of(stage, kind, mb, num_stages)
                    if t is not None and stage_rank[t.stage] == me:
                        incoming.setdefault(src, []).append(t)
        posted: Dict[int, int] = {src: 0 for src in incoming}
        pending: Dict[Tuple[str, int, int], Tuple[object, torch.Tensor]] = {}
        sends: List[Tuple[object, torch.Tensor]] = []
        local: Dict[Tuple[str, int, int], torch.Tensor] = {}

        def rows(t: _Transfer) -> int:
            return fo_tokens[t.mb] if t.kind == "Fo" else tokens[t.mb]

        acc = {"post": 0.0}

        def receive(src: int, key: Tuple[str, int, int]) -> Tuple[torch.Tensor, float]:
            queue = incoming.get(src, [])
            while key not in pending:
                if posted[src] >= len(queue):
                    raise RuntimeError(
                        f"rank {me}: {key} was never sent by rank {src} in the plan (an invalid schedule)"
                    )
                t = queue[posted[src]]
                posted[src] += 1
                buf = torch.empty(rows(t), self.hidden_size, dtype=self.dtype, device=self.device)
                p0 = time.perf_counter()
                work = dist.irecv(buf, src=self._global(src), group=self.group)
                acc["post"] += time.perf_counter() - p0
                pending[(t.kind, t.stage, t.mb)] = (work, buf)
            work, buf = pending.pop(key)
            w0 = time.perf_counter()
            work.wait()
            return buf, time.perf_counter() - w0

        def send(dst_stage: int, tensor: torch.Tensor, kind: str, mb: int) -> None:
            dst = stage_rank[dst_stage]
            if dst == me:
                local[(kind, dst_stage, mb)] = tensor
                return
            t = tensor.contiguous()
            p0 = time.perf_counter()
            sends.append((dist.isend(t, dst=self._global(dst), group=self.group), t))
            acc["post"] += time.perf_counter() - p0

        # Chunked sequences: per (stage, sequence) its chunks' ChunkKV by chunk index (their own
        # keys and values, with their graphs, until the chunk's backward), the microbatch of each
        # chunk, and per (stage, mb) the key/value gradients its later chunks handed back.
        chain_kv: Dict[Tuple[int, int], Dict[int, ChunkKV]] = {}
        chunk_mb: Dict[Tuple[int, int, int], int] = {}
        later: Dict[Tuple[int, int], List[Optional[torch.Tensor]]] = {}
        chunk_bwd_done: set = set()

        def chunk_kv(stage: int, mb: int, grad: bool) -> ChunkKV:
            seq, idx, _, off = chunks[mb]
            earlier = chain_kv.setdefault((stage, seq), {})
            prefix = None
            if idx > 0:
                missing = [j for j in range(idx) if j not in earlier]
                if missing:
                    raise RuntimeError(
                        f"rank {me}: {stage}F{mb} is chunk {idx} of sequence {seq}, but chunk(s) "
                        f"{missing} have not run F on stage {stage} (an invalid schedule)"
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
            chunk_mb[(stage, seq, idx)] = mb
            return kv

        def chunk_backward(stage, kind, mb, x, out, grad, params):
            """A chunk's I or B: its output and its own keys and values (with the gradients
            its later chunks handed back) backward; the earlier chunks' key/value gradients
            handed on. Returns ``(dx, param groups for W or None)``."""
            seq, idx, of, _ = chunks[mb]
            pending_later = [j for j in range(idx + 1, of) if (stage, seq, j) not in chunk_bwd_done]
            if pending_later:
                raise RuntimeError(
                    f"rank {me}: {stage}{kind}{mb} is chunk {idx} of sequence {seq}, but the "
                    f"backward of chunk(s) {pending_later} has not run on stage {stage} (a "
                    "sequence's backwards run in reverse chunk order)"
                )
            chain = chain_kv[(stage, seq)]
            kv = chain[idx]
            own = [t for pair in kv.own for t in pair]
            handed = later.pop((stage, mb), None)
            own_grads = [
                handed[i] if handed is not None and handed[i] is not None else torch.zeros_like(t)
                for i, t in enumerate(own)
            ]
            leaves = [t for pair in (kv.prefix or []) for t in pair]
            outs = [out] + own
            grads = [torch.ones_like(out) if grad is None else grad] + own_grads
            groups = None
            if kind == "B" or stage == first:
                torch.autograd.backward(outs, grad_tensors=grads)
                dx = x.grad if stage != first else None
                dleaves = [t.grad for t in leaves]
            else:
                dxs, groups = stage_backward_input(outs, grads, [x] + leaves, iter(params))
                dx, dleaves = dxs[0], list(dxs[1:])
            # Hand each earlier chunk its rows of the key/value gradients.
            for layer in range(len(dleaves) // 2):
                start = 0
                for j in range(idx):
                    n = chain[j].own[layer][0].shape[0]
                    slot = later.setdefault(
                        (stage, chunk_mb[(stage, seq, j)]), [None] * (2 * len(kv.own))
                    )
                    for which in (0, 1):
                        d = dleaves[2 * layer + which]
                        if d is None:
                            continue
                        part = d[start : start + n]
                        i = 2 * layer + which
                        slot[i] = part if slot[i] is None else slot[i] + part
                    start += n
            chunk_bwd_done.add((stage, seq, idx))
            # The chain's own tensors go once its first chunk's backward has run.
            kv.own = []
            if idx == 0:
                del chain_kv[(stage, seq)]
            return dx, groups

        # Per (stage, mb): the stage's input and output (or loss), and I's saved state for W.
        saved: Dict[Tuple[int, int], Tuple[torch.Tensor, torch.Tensor]] = {}
        param_groups: Dict[Tuple[int, int], list] = {}
        last_backward = self._last_backward(all_actions[me])
        loss_sum = torch.zeros((), dtype=torch.float64)
        fo_out: Dict[int, torch.Tensor] = {}
        reductions: List[object] = []
        timings: List[ActionTiming] = []
        t_start = time.perf_counter()

        for text in all_actions[me]:
            if text in skip:
                continue
            a0 = time.perf_counter()
            wait = compute = 0.0
            acc["post"] = 0.0
            parts = parse_action(text)
            # The inputs from other ranks first, each wait its own profiler event
            # (PP:<stage>RECV_F<mb> / RECV_B), so the action's span is its work.
            got: Dict[Tuple[str, int, int], torch.Tensor] = {}
            for stage, kind, mb in parts:
                if kind in ("F", "Fo") and stage != first and stage_rank[stage - 1] != me:
                    key, name = (kind, stage, mb), f"PP:{stage}RECV_F{mb}"
                    src = stage_rank[stage - 1]
                elif kind in ("I", "B") and stage != last and stage_rank[stage + 1] != me:
                    key, name = ("B", stage, mb), f"PP:{stage}RECV_B{mb}"
                    src = stage_rank[stage + 1]
                else:
                    continue
                with self._annotate(name):
                    got[key], w = receive(src, key)
                wait += w
            span = self._annotate(f"PP:{text}")
            with span:
                for stage, kind, mb in parts:
                    module = self.stages[stage]
                    if kind in ("F", "Fo"):
                        fo = kind == "Fo"
                        key = ("Fo" if fo else "F", stage, mb)
                        if stage == first:
                            x = (forward_only_inputs if fo else inputs)[mb]
                        elif stage_rank[stage - 1] == me:
                            x = local.pop(key)
                        else:
                            x = got.pop(key)
                        c = fo_cu[mb] if fo else cu[mb]
                        if fo:
                            c0 = time.perf_counter()
                            with torch.no_grad():
                                out = module(x, c)
                            compute += time.perf_counter() - c0
                            if stage == last:
                                fo_out[mb] = out
                            else:
                                send(stage + 1, out, "Fo", mb)
                            continue
                        kv = (
                            chunk_kv(stage, mb, train) if chunks[mb] is not None else None
                        )
                        call = (lambda x, c: module(x, c, kv=kv)) if kv is not None else module
                        if not train:
                            c0 = time.perf_counter()
                            with torch.no_grad():
                                out = call(x, c)
                                if stage == last:
                                    loss_sum += (
                                        self._loss(out, targets[mb], c) / denominator
                                    ).to(torch.float64)
                            compute += time.perf_counter() - c0
                            if stage != last:
                                send(stage + 1, out, "F", mb)
                            continue
                        if stage != first:
                            x = x.detach().requires_grad_(True)
                        c0 = time.perf_counter()
                        out = call(x, c)
                        if stage == last:
                            out = self._loss(out, targets[mb], c) / denominator
                            loss_sum += out.detach().to(torch.float64)
                            compute += time.perf_counter() - c0
                        else:
                            compute += time.perf_counter() - c0
                            send(stage + 1, out.detach(), "F", mb)
                        saved[(stage, mb)] = (x, out)
                    elif kind in ("I", "B"):
                        x, out = saved[(stage, mb)]
                        if stage == last:
                            grad = None
                        elif stage_rank[stage + 1] == me:
                            grad = local.pop(("B", stage, mb))
                        else:
                            grad = got.pop(("B", stage, mb))
                        c0 = time.perf_counter()
                        if chunks[mb] is not None:
                            dx, groups = chunk_backward(
                                stage, kind, mb, x, out, grad, list(module.parameters())
                            )
                            if kind == "B":
                                del saved[(stage, mb)]
                            else:
                                # None: the whole backward ran here (first stage), W is empty.
                                param_groups[(stage, mb)] = groups
                        elif kind == "B":
                            torch.autograd.backward(out, grad_tensors=grad)
                            dx = x.grad if stage != first else None
                            del saved[(stage, mb)]
                        elif stage == first:
                            # As PipelineStage: token ids have no gradient, so the whole backward
                            # runs in W (stage_backward_input would not capture the parameters).
                            saved[(stage, mb)] = (x, out)
                            param_groups[(stage, mb)] = [grad]
                            dx = None
                        else:
                            params = list(module.parameters())
                            dxs, groups = stage_backward_input(
                                [out], None if grad is None else [grad], [x], iter(params)
                            )
                            dx = dxs[0]
                            param_groups[(stage, mb)] = groups
                        compute += time.perf_counter() - c0
                        if stage != first:
                            if dx is None:
                                dx = torch.zeros_like(x)
                            send(stage - 1, dx.detach(), "B", mb)
                    elif kind == "W":
                        groups = param_groups.pop((stage, mb))
                        c0 = time.perf_counter()
                        if groups is None:
                            # A chunk on the first stage: its backward ran whole in I.
                            saved.pop((stage, mb), None)
                        elif stage == first:
                            _, out = saved.pop((stage, mb))
                            torch.autograd.backward(out, grad_tensors=groups[0])
                        else:
                            stage_backward_weight(iter(list(module.parameters())), groups)
                            saved.pop((stage, mb), None)
                        compute += time.perf_counter() - c0
                    if last_backward.get(stage) == (kind, mb):
                        reductions.extend(self._stage_done(stage))
            timings.append(
                ActionTiming(
                    text,
                    a0 - t_start,
                    time.perf_counter() - t_start,
                    wait,
                    compute,
                    acc["post"],
                )
            )

        for work, _ in sends:
            work.wait()
        for work in reductions:
            work.wait()
        if local:
            raise RuntimeError(f"rank {me}: handed over but never used: {sorted(local)}")
        total = loss_sum.clone()
        dist.all_reduce(total, group=self.group)
        return StepResult(
            loss=float(total),
            wall_s=time.perf_counter() - t_start,
            actions=timings,
            forward_only=fo_out,
        )

    # ---- helpers ----------------------------------------------------------------------------

    def _check_same_plan(self, plan: StepPlan, replica: int, tokens: List[int]) -> None:
        """Every rank of the pipeline must run the same step plan: one all-reduce of a hash of
        the step's microbatch token counts (max of ``h`` and of ``-h``) before any transfer,
        so that a mismatch is a ``ValueError`` on every rank instead of a size error inside
        the transport."""
        h = hash((plan.step, replica, tuple(tokens), plan.num_ranks, plan.num_stages)) & (2**62 - 1)
        t = torch.tensor([h, -h], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        if int(t[0]) != h or -int(t[1]) != h:
            raise ValueError(
                f"rank {self.rank}: the pipeline's ranks were given different step plans (this "
                f"rank's: step {plan.step}, microbatches of {tokens} tokens); every rank must plan "
                "the same sequence lengths for the same step"
            )

    def _annotate(self, name: str):
        return torch.profiler.record_function(name) if self.annotate else contextlib.nullcontext()

    def _global(self, pipeline_rank: int) -> int:
        if self.pipeline_ranks is None:
            return pipeline_rank
        return self.pipeline_ranks[pipeline_rank]

    @staticmethod
    def _transfer_of(stage: int, kind: str, mb: int, num_stages: int) -> Optional[_Transfer]:
        """What an action sends, if anything: F/Fo its output to stage + 1, I/B its input
        gradient to stage - 1."""
        if kind in ("F", "Fo") and stage + 1 < num_stages:
            return _Transfer(kind, stage + 1, mb)
        if kind in ("I", "B") and stage > 0:
            return _Transfer("B", stage - 1, mb)
        return None

    @staticmethod
    def _last_backward(actions: Sequence[str]) -> Dict[int, Tuple[str, int]]:
        last: Dict[int, Tuple[str, int]] = {}
        for text in actions:
            for stage, kind, mb in parse_action(text):
                if kind in ("I", "B", "W"):
                    last[stage] = (kind, mb)
        return last

    def _stage_done(self, stage: int) -> List[object]:
        if self.on_stage_backward_done is not None:
            self.on_stage_backward_done(stage)
        if self.dp_group is None:
            return []
        works = []
        for p in self.stages[stage].parameters():
            if p.grad is not None:
                works.append(dist.all_reduce(p.grad, group=self.dp_group, async_op=True))
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
