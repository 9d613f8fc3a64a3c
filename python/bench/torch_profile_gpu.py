"""A profile of Llama-3.1-8B measured with PyTorch's own kernels, for a lent GPU.

Two of Llama-3.1-8B's decoder layers (hidden 4,096, SwiGLU 14,336, 32 heads, 8 key-value heads,
vocabulary 128,256; random weights) in bf16, cut into stages and measured by
``flatpipe.torch.profile`` over microbatches of 1,024 to 16,384 tokens, as one sequence and as
sequences of 512; the per-kind costs replace those of the analytic profile of the whole
32-layer model on the GPU's hardware file, and the result is written as a profile YAML that
``flatpipe plan --profile`` takes (the README's main job re-planned from it is the next command
of the device script). The stages are a Hugging Face ``LlamaForCausalLM`` with flatpipe's
per-sequence attention when ``transformers`` is importable, else flatpipe's reference model
(``flatpipe.models.Stage``: the same layer, its attention under a document mask). It prints the
decoder's F, I and W at T = 4,096 (8 sequences of 512) beside the analytic profile's and, with
``--compare``, a measured profile of flatpipe's CUDA backend (``flatpipe profile --backend
cuda``).

    python python/bench/torch_profile_gpu.py OUT_DIR [--hardware h200] [--compare P.yaml]
        [--device cuda] [--small]

``--small`` shrinks the model and the grid (a dry run on the CPU: the tests run it).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

import flatpipe

LLAMA_8B = dict(vocab=128256, hidden=4096, ffn=14336, heads=32, kv_heads=8)
SMALL = dict(vocab=256, hidden=64, ffn=128, heads=4, kv_heads=2)


def model_yaml(shape: dict, decoders: int, dtype: str) -> str:
    return (
        f"name: torch-profiled\ndtype: {dtype}\nlayers:\n"
        f"  - {{kind: embedding, vocab: {shape['vocab']}, hidden: {shape['hidden']}}}\n"
        f"  - {{kind: decoder, count: {decoders}, hidden: {shape['hidden']}, ffn: {shape['ffn']}, "
        f"heads: {shape['heads']}, kv_heads: {shape['kv_heads']}}}\n"
        f"  - {{kind: head, vocab: {shape['vocab']}, hidden: {shape['hidden']}}}\n"
    )


def make_stages(shape: dict, dtype, device):
    """``(make_stage, which)``: stages of a 2-decoder model of ``shape``."""
    try:
        from transformers import LlamaConfig, LlamaForCausalLM

        from flatpipe import hf
    except ImportError:
        from flatpipe.models import ModelConfig, Stage

        cfg = ModelConfig(vocab=shape["vocab"], hidden=shape["hidden"], heads=shape["heads"],
                          kv_heads=shape["kv_heads"], ffn=shape["ffn"], num_decoders=2)
        return (lambda a, b: Stage(cfg, a, b).to(device=device, dtype=dtype)), "flatpipe.models.Stage"
    config = LlamaConfig(vocab_size=shape["vocab"], hidden_size=shape["hidden"],
                         intermediate_size=shape["ffn"], num_hidden_layers=2,
                         num_attention_heads=shape["heads"], num_key_value_heads=shape["kv_heads"],
                         tie_word_embeddings=False)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype)
    hf.use_varlen(model)
    return (lambda a, b: hf.HFStage(model, a, b)), "transformers LlamaForCausalLM (flatpipe_varlen)"


def decoder_costs(profile_yaml: str, tokens: int, pairs: int) -> dict:
    """The first decoder layer's F, I, W seconds at ``tokens`` and ``pairs`` from a profile's
    YAML (``profiles/src/profile.rs``: ``layers[i].{f,i,w}`` as ``{c0_s, c_tok_s, c_attn_s}``)."""
    import yaml

    p = yaml.safe_load(profile_yaml)
    layer = next(l for l in p["layers"] if l["kind"] == "decoder")
    return {
        ph.upper(): layer[ph]["c0_s"] + layer[ph]["c_tok_s"] * tokens + layer[ph].get("c_attn_s", 0.0) * pairs
        for ph in ("f", "i", "w")
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--hardware", default="h200")
    ap.add_argument("--compare", help="a profile of flatpipe's CUDA backend to compare with")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--small", action="store_true")
    a = ap.parse_args()
    if a.device == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device: run on a GPU, or --device cpu --small for a dry run")
    os.makedirs(a.out, exist_ok=True)
    shape = SMALL if a.small else LLAMA_8B
    dtype = torch.float32 if a.small else torch.bfloat16
    tokens = (64, 128) if a.small else (1024, 4096, 16384)
    seq_lens = (None, 32) if a.small else (None, 512)
    make_stage, which = make_stages(shape, dtype, a.device)
    path = os.path.join(a.out, "model.yaml")
    with open(path, "w") as f:
        f.write(model_yaml(shape, 2 if a.small else 32, "fp32" if a.small else "bf16"))
    analytic = flatpipe.Profile.analytic(path, "cpu" if a.small else a.hardware)
    measured, fits = flatpipe.torch.profile(
        make_stage, 4, analytic, hidden_size=shape["hidden"], vocab_size=shape["vocab"],
        dtype=dtype, device=a.device, tokens=tokens, seq_lens=seq_lens,
        note=f"measured by flatpipe.torch.profile ({which}, {torch.__version__})",
    )
    text = measured.to_yaml()
    with open(os.path.join(a.out, "torch-profile.yaml"), "w") as f:
        f.write(text)
    t, s = (128, 32) if a.small else (4096, 512)
    pairs = (t // s) * s * (s + 1) // 2
    rows = {"torch (this run)": decoder_costs(text, t, pairs), "analytic": decoder_costs(analytic.to_yaml(), t, pairs)}
    if a.compare:
        rows["flatpipe CUDA backend"] = decoder_costs(open(a.compare).read(), t, pairs)
    lines = [f"stages: {which}; decoder layer at T = {t} ({t // s} sequences of {s}), milliseconds:"]
    for name, c in rows.items():
        lines.append(f"  {name:24} F {c['F'] * 1e3:8.3f}  I {c['I'] * 1e3:8.3f}  W {c['W'] * 1e3:8.3f}")
    lines.append("fits (c0 s, c_tok s, c_attn s, r2): " + "; ".join(
        f"{k}/{p} {v[0]:.3g} {v[1]:.3g} {v[2]:.3g} {v[3]:.3f}" for (k, p), v in fits.items()))
    report = "\n".join(lines)
    print(report)
    with open(os.path.join(a.out, "torch-profile-comparison.txt"), "w") as f:
        f.write(report + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
