"""Process bodies for the Hugging Face stage tests (spawned: importable by name)."""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

import flatpipe
from flatpipe.hf import stages
from flatpipe.torch import PipelineRuntime

#: fp32 pipelined run against the unsplit model run one sequence at a time: the same operations
#: per token except the packed attention's summation order and the gradient accumulation order.
RTOL, ATOL = 1e-4, 1e-6


def tiny(kind: str, decoders: int):
    """A tiny random-weight ``*ForCausalLM`` of ``kind`` (``llama`` or ``qwen3``), fp32, SDPA
    attention, untied head, the same weights on every rank (seeded)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    config, model = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen3": (Qwen3Config, Qwen3ForCausalLM)}[kind]
    cfg = config(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=decoders,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    torch.manual_seed(1234)
    return model(cfg)


def reference(kind: str, decoders: int, seqs, targets):
    """The unsplit model, one sequence at a time (no packing, so a packing bug cannot cancel
    out): the token-weighted loss and every parameter's gradient by name."""
    model = tiny(kind, decoders)
    denom = sum(t.numel() for t in targets)
    loss = sum(
        F.cross_entropy(model(x.unsqueeze(0)).logits[0], y, reduction="sum") / denom
        for x, y in zip(seqs, targets)
    )
    loss.backward()
    return float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters()}


def run(rank: int, world: int, init: str, spec: dict, out_dir: str) -> None:
    """One pipeline rank: runs every step of ``spec`` on Hugging Face stages and writes, per
    step, the loss and the largest gradient error against :func:`reference`."""
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    try:
        kind, decoders = spec["model"], spec["decoders"]
        model = tiny(kind, decoders)
        pipe = flatpipe.Pipeline(spec["schedule"], pp=world, num_layers=decoders + 2, token_budget=spec["budget"])
        mine = stages(model, pipe.stages, pipe.stage_ranks, rank)
        rt = PipelineRuntime(mine, rank=rank, hidden_size=model.config.hidden_size)
        report = []
        for step, lens in enumerate(spec["steps"]):
            plan = pipe.plan_step(lens, step)
            mbs = plan.microbatches()
            g = torch.Generator().manual_seed(100 + step)
            inputs = [torch.randint(96, (mb.tokens,), generator=g) for mb in mbs]
            targets = [torch.randint(96, (mb.tokens,), generator=g) for mb in mbs]
            model.zero_grad(set_to_none=True)
            result = rt.step(plan, inputs, targets)
            seqs, ys = [], []
            for mb, x, y in zip(mbs, inputs, targets):
                cu = mb.cu_seqlens.tolist()
                seqs += [x[a:b] for a, b in zip(cu[:-1], cu[1:])]
                ys += [y[a:b] for a, b in zip(cu[:-1], cu[1:])]
            want_loss, want = reference(kind, decoders, seqs, ys)
            worst, missing = 0.0, []
            for s in mine.values():
                for name, p in s.layer_parameters().items():
                    if p.grad is None:
                        missing.append(name)
                        continue
                    worst = max(worst, ((p.grad - want[name]).abs() - RTOL * want[name].abs()).max().item())
            report.append({
                "step": step, "microbatches": [mb.tokens for mb in mbs], "loss": result.loss,
                "want_loss": want_loss, "grad_excess": worst, "missing": missing,
                "params": sum(len(s.layer_parameters()) for s in mine.values()),
            })
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(report, f)
    finally:
        dist.destroy_process_group()
