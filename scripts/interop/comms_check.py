"""Checks flatpipe's compute-and-communication CSVs against PyTorch's own lowering.

Usage: python comms_check.py DIR   (DIR holds NAME.csv, NAME.ahead.csv and NAME.deferred.csv,
written by `flatpipe schedule -o` without and with `--comms ahead|deferred`, and NAME.fsdp.csv,
`--comms ahead --fsdp`, checked against torch's own compute-only loader)

For every NAME: torch's `_add_send_recv` then `_add_wait_send` lowers the compute-only CSV (read
with `_Action.from_str`, stage -> rank from where each stage runs), and must give NAME.ahead.csv
action for action; torch's `_defer_recv_ops` on that must give NAME.deferred.csv. Both files
then load the way `_PipelineScheduleRuntime._load_csv(path, format="compute_comms")` does:
`_validate_schedule` (every stage's F, I, W and B counts) and `_validate_send_waits` (one wait
per send). The runtime instance is built without `__init__` (which needs stages on a process
group); `_prepare_schedule_with_comms` only reads the attributes set here. Exits 1 on the first
mismatch. Written for flatpipe's .ci/run (scripts/interop-check.sh), torch 2.15.
"""

import csv
import os
import sys

from torch.distributed.pipelining.schedules import (
    _Action,
    _add_send_recv,
    _add_wait_send,
    _defer_recv_ops,
    _PipelineScheduleRuntime,
)


def read(path: str) -> dict[int, list[_Action]]:
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    return {r: [_Action.from_str(c) for c in row if c.strip()] for r, row in enumerate(rows)}


def names(actions: dict[int, list[_Action]]) -> dict[int, list[str]]:
    return {r: [str(a) for a in acts] for r, acts in actions.items()}


def stage_ranks(compute: dict[int, list[_Action]]) -> dict[int, int]:
    ranks = {}
    for r, acts in compute.items():
        for a in acts:
            for part in a.sub_actions or (a,):
                ranks[part.stage_index] = r
    return ranks


def runtime(compute: dict[int, list[_Action]]) -> _PipelineScheduleRuntime:
    """A `_PipelineScheduleRuntime` without `__init__` (which needs stages on a process group),
    with the attributes its loader reads, at its defaults."""
    rt = _PipelineScheduleRuntime.__new__(_PipelineScheduleRuntime)
    rt.pp_group_size = len(compute)
    rt._num_stages = len(stage_ranks(compute))
    rt._n_microbatches = 1 + max(
        part.microbatch_index
        for acts in compute.values()
        for a in acts
        for part in (a.sub_actions or (a,))
    )
    rt._stages = []
    rt._unshard_lookahead = "full"
    rt._max_active_stages = 3
    rt._max_outstanding_sends = None
    rt._defer_pp_recv = False
    rt._defer_reduce_grad_wait = False
    rt.pipeline_order = {}
    return rt


def load_compute_comms(path: str, compute: dict[int, list[_Action]]) -> None:
    rt = runtime(compute)
    rt._load_csv(path, format="compute_comms")
    assert rt.stage_index_to_group_rank == stage_ranks(compute), (
        rt.stage_index_to_group_rank,
        stage_ranks(compute),
    )


def same(path: str, ours: dict[int, list[str]], theirs: dict[int, list[str]], what: str) -> None:
    """Exits naming the first rank and action where `ours` (the file at `path`) differs."""
    for r in theirs:
        if ours.get(r) != theirs[r]:
            at = next(
                (i for i, (x, y) in enumerate(zip(ours.get(r, []), theirs[r])) if x != y),
                min(len(ours.get(r, [])), len(theirs[r])),
            )
            raise SystemExit(
                f"{path}: rank {r} differs from {what} at action {at}: "
                f"flatpipe {ours.get(r, [])[at:at + 4]}, torch {theirs[r][at:at + 4]}"
            )


def check_fsdp(base: str, compute: dict[int, list[_Action]]) -> None:
    """NAME.fsdp.csv (`--comms ahead --fsdp`) must be what torch's own runtime makes of the
    compute-only CSV: `_load_csv(format="compute_only")` adds FSDP's UNSHARD / RESHARD /
    REDUCE_GRAD / WAIT_REDUCE_GRAD, then the sends, receives and waits; NAME.fsdp-defer.csv
    (`--fsdp-defer-wait`) what it makes with `defer_reduce_grad_wait`."""
    for suffix, defer in (("fsdp", False), ("fsdp-defer", True)):
        path = f"{base}.{suffix}.csv"
        if not os.path.exists(path):
            continue
        rt = runtime(compute)
        rt._defer_reduce_grad_wait = defer
        rt._load_csv(base + ".csv", format="compute_only")
        theirs = names(rt.pipeline_order_with_comms)
        same(path, names(read(path)), theirs, "torch's runtime")
        print(f"ok: {path}: equal to torch's compute_only loader, FSDP actions included")


def check(base: str) -> None:
    compute = read(base + ".csv")
    ranks = stage_ranks(compute)
    to_rank = ranks.__getitem__
    ahead = _add_wait_send(_add_send_recv({r: list(a) for r, a in compute.items()}, to_rank, len(ranks)))
    deferred = _defer_recv_ops(ahead, to_rank)
    for suffix, torch_order in (("ahead", ahead), ("deferred", deferred)):
        path = f"{base}.{suffix}.csv"
        ours = names(read(path))
        same(path, ours, names(torch_order), "torch's lowering")
        load_compute_comms(path, compute)
        n = sum(len(v) for v in ours.values())
        print(f"ok: {path}: {n} actions, equal to torch's lowering, loads as compute_comms")
    check_fsdp(base, compute)


def main() -> int:
    d = sys.argv[1]
    bases = sorted(
        os.path.join(d, n[: -len(".ahead.csv")]) for n in os.listdir(d) if n.endswith(".ahead.csv")
    )
    if not bases:
        print("no .ahead.csv files found", file=sys.stderr)
        return 1
    for base in bases:
        check(base)
    print(f"{len(bases)} schedules lowered as torch lowers them")
    return 0


if __name__ == "__main__":
    sys.exit(main())
