"""Process bodies for the tests of stages cut from other libraries' models: Hugging Face
(flatpipe.hf) and torchtitan (flatpipe.titan). Spawned: importable by name."""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

import flatpipe
from flatpipe import hf, titan
from flatpipe.torch import PipelineRuntime

from _workers import ATOL, gradient_excess  # noqa: F401 (ATOL: the tests import it from here)

#: The tolerances are _workers' (RTOL, ATOL): an fp32 pipelined run against the unsplit model run
#: one sequence at a time differs only in summation orders.


def tiny(kind: str, decoders: int):
    """A tiny random-weight model of ``kind``, fp32, the same weights on every rank (seeded):
    ``llama`` or ``qwen3`` (a Hugging Face ``*ForCausalLM``, SDPA attention, untied head) or
    ``titan`` (torchtitan's Llama 3 ``Transformer`` with FlexAttention's document mask)."""
    torch.manual_seed(1234)
    if kind == "titan":
        from torchtitan.models.llama3 import Transformer, TransformerModelArgs

        args = TransformerModelArgs(
            dim=32, n_layers=decoders, n_heads=4, n_kv_heads=2, vocab_size=96, max_seq_len=256,
            attn_type="flex", attn_mask_type="block_causal",
        )
        model = Transformer(args)
        with torch.no_grad():
            model.init_weights()
        return model
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    config, model = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen3": (Qwen3Config, Qwen3ForCausalLM)}[kind]
    cfg = config(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=decoders,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    return model(cfg)


def cut(kind: str, model, layer_ranges, stage_ranks, rank: int):
    """Rank ``rank``'s stages of ``model``."""
    return (titan if kind == "titan" else hf).stages(model, layer_ranges, stage_ranks, rank)


def hidden_size(kind: str, model) -> int:
    return model.model_args.dim if kind == "titan" else model.config.hidden_size


def reference(kind: str, decoders: int, seqs, targets):
    """The unsplit model, one sequence at a time (no packing, so a packing bug cannot cancel
    out): the token-weighted loss and every parameter's gradient by name. torchtitan's model
    runs as one stage over all its layers (its FlexAttention has no backward on the CPU)."""
    model = tiny(kind, decoders)
    if kind == "titan":
        whole = titan.TitanStage(model, 0, decoders + 2)
        logits = [whole(x, torch.tensor([0, x.numel()])) for x in seqs]
    else:
        logits = [model(x.unsqueeze(0)).logits[0] for x in seqs]
    denom = sum(t.numel() for t in targets)
    loss = sum(F.cross_entropy(z, y, reduction="sum") / denom for z, y in zip(logits, targets))
    loss.backward()
    return float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters()}


def run(rank: int, world: int, init: str, spec: dict, out_dir: str) -> None:
    """One pipeline rank: runs every step of ``spec`` on the model's stages and writes, per
    step, the loss and the largest gradient error against :func:`reference`."""
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    try:
        kind, decoders = spec["model"], spec["decoders"]
        model = tiny(kind, decoders)
        pipe = flatpipe.Pipeline(spec["schedule"], pp=world, num_layers=decoders + 2, token_budget=spec["budget"])
        mine = cut(kind, model, pipe.stages, pipe.stage_ranks, rank)
        rt = PipelineRuntime(mine, rank=rank, hidden_size=hidden_size(kind, model))
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
            worst, missing = gradient_excess(mine.values(), want)
            report.append({
                "step": step, "microbatches": [mb.tokens for mb in mbs], "loss": result.loss,
                "want_loss": want_loss, "grad_excess": worst, "missing": missing,
                "params": sum(len(s.layer_parameters()) for s in mine.values()),
            })
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(report, f)
    finally:
        dist.destroy_process_group()
