"""Process bodies for the expert-parallel tests (spawned: importable by name)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from flatpipe.models import ModelConfig, Stage

#: The model: two mixture-of-experts decoders, 8 experts, top 2.
CFG = ModelConfig(experts=8, top_k=2, expert_ffn=16, num_decoders=2, seed=3)

#: The overlapped-pair run (``_workers.run``'s spec): DualPipeV at pp 2 x ep 2 (4 processes),
#: one expert-parallel group per stage, 6 MoE decoders (every stage holds one), 4 microbatches
#: per replica of a step of variable-length sequences.
OVERLAP_SPEC = {
    "schedule": "dualpipev",
    "decoders": 6,
    "budget": 64,
    "microbatches": 4,
    "dp": 2,
    "ep": "per-stage",
    "moe": {"experts": 4, "top_k": 2, "expert_ffn": 16},
    "steps": [[40, 7, 19, 33, 12, 5, 28, 50, 9, 17, 61, 22]],
}


def tokens(rank: int):
    """Rank ``rank``'s hidden states, two sequences, and the projection its loss takes. Rank 1's
    microbatch is mostly identical rows (padding-like): its router sends them all to the same
    two experts, so the ranks exchange very uneven counts."""
    g = torch.Generator().manual_seed(100 + rank)
    t = [13, 22][rank]
    x = torch.randn(t, CFG.hidden, generator=g)
    if rank == 1:
        x[4:] = x[4]
    cu = torch.tensor([0, 5, t])
    r = torch.randn(t, CFG.hidden, generator=g)
    return x, cu, r


def run_ep(rank: int, world: int, init: str, out: str) -> None:
    """Decoders 1..2 with their experts split over the ``world`` processes: each process runs
    its own tokens, and saves its output, its input's gradient and its parameters' gradients
    (by their whole-model names)."""
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    try:
        stage = Stage(CFG, 1, 3, ep_group=dist.group.WORLD)
        x, cu, r = tokens(rank)
        x.requires_grad_(True)
        y = stage(x, cu)
        (y * r).sum().backward()
        grads = {k: p.grad.clone() for k, p in stage.layer_parameters().items()}
        torch.save({"y": y.detach(), "dx": x.grad, "grads": grads}, f"{out}/ep{rank}.pt")
    finally:
        dist.destroy_process_group()
