"""Train the reference model with flatpipe's per-step plans: the same code for pp = 1 and pp > 1.

    torchrun --standalone --nproc-per-node 1 examples/python/train.py      # no pipeline
    torchrun --standalone --nproc-per-node 2 examples/python/train.py      # pp = 2

Each step draws new sequence lengths (a long-tailed mix, one sequence sometimes longer than
the token budget), so every step has its own microbatch count and token counts: the Rust core
plans the step, the runtime runs it with no padding and no shape exchange, and AdamW steps
every rank's stages. Prints one JSON line per step on rank 0: the loss (the same on every
rank), the microbatches' token counts, the wall time and the gradient norm.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.distributed as dist

import flatpipe
from flatpipe.models import ModelConfig, Stage
from flatpipe.torch import PipelineRuntime, clip_grad_norm_


def seq_lens(step: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(step)
    lens = (torch.randn(n, generator=g) * 0.8 + 3.0).exp().clamp(2, 400)
    return [int(x) for x in lens]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--schedule", default="1f1b")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--budget", type=int, default=128)
    ap.add_argument("--sequences", type=int, default=12)
    a = ap.parse_args()

    dist.init_process_group("gloo")
    rank, pp = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    cfg = ModelConfig(num_decoders=4)
    pipe = flatpipe.Pipeline(a.schedule, pp=pp, num_layers=cfg.num_layers, token_budget=a.budget)
    stages = {s: Stage(cfg, *pipe.stages[s]) for s, r in enumerate(pipe.stage_ranks) if r == rank}
    params = [p for m in stages.values() for p in m.parameters()]
    opt = torch.optim.AdamW(params, lr=1e-2)
    runtime = PipelineRuntime(stages, rank=rank, hidden_size=cfg.hidden)

    for step in range(a.steps):
        plan = pipe.plan_step(seq_lens(step, a.sequences), step)
        g = torch.Generator().manual_seed(10_000 + step)
        mbs = plan.microbatches()
        inputs = [torch.randint(cfg.vocab, (mb.tokens,), generator=g) for mb in mbs]
        targets = [torch.randint(cfg.vocab, (mb.tokens,), generator=g) for mb in mbs]
        opt.zero_grad(set_to_none=True)
        result = runtime.step(plan, inputs, targets)
        norm = clip_grad_norm_(params, 1.0)
        opt.step()
        if rank == 0:
            print(
                json.dumps(
                    {
                        "step": step,
                        "loss": result.loss,
                        "microbatches": [mb.tokens for mb in mbs],
                        "grad_norm": norm,
                        "wall_s": result.wall_s,
                    }
                ),
                flush=True,
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
