#!/usr/bin/env python3
"""Predicts every published run of examples/published/runs/ with flatpipe and writes
docs/fidelity.md: the table of predicted against reported, in the metric each source reports.

    scripts/published_runs.py [--bin target/release/flatpipe] [--out docs/fidelity.md] [--check]

A run file (TOML) has four tables: `source` (citation and where in it), `stated` (what the
source states, nothing else), `reported` (the metric, its value and its definition) and
`assumed` (each field the source leaves unstated: `{value, why}`). A field may not be both stated
and assumed. For each run this script writes, into a scratch directory, the model (a GPT of the
stated shape as flatpipe's decoder, or a built-in name), the workload (the global batch of
fixed-length sequences), the hardware (the built-in GPU, with the stated inter-node bandwidth
where the source states one) and a plan file (the stated parallelism and layer split), runs
`flatpipe simulate --plan` on it and turns the predicted step time into the reported metric.
`--check` exits 1 when the written table would differ from the file (a stale page).

Needs python3 >= 3.11 (tomllib; or tomli from PyPI) and the flatpipe binary.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

try:
    import tomllib
except ImportError:  # python < 3.11: the same parser from PyPI (the test environment has it)
    try:
        import tomli as tomllib
    except ImportError:
        sys.exit("scripts/published_runs.py needs python 3.11 or newer (tomllib), or tomli")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNS = os.path.join(ROOT, "examples", "published", "runs")
FIELDS = {
    "gpu", "gpus", "model", "seq_len", "global_batch", "tp", "pp", "microbatch_sequences",
    "schedule", "vpp", "recompute", "sharding", "sequence_parallel", "inter_node_gbps_per_node",
    "split", "attention",
}
GPUS_PER_NODE = 8


class RunError(Exception):
    """A run file that cannot be predicted: the file, the field and why."""


def load(path: str) -> dict:
    """The run file at `path` with `config`: its stated and assumed fields merged."""
    with open(path, "rb") as f:
        run = tomllib.load(f)
    name = os.path.basename(path)
    for table in ("source", "stated", "reported"):
        if table not in run:
            raise RunError(f"{name}: no [{table}] table")
    config = dict(run["stated"])
    for field, entry in run.get("assumed", {}).items():
        if field in config:
            raise RunError(f"{name}: `{field}` is both stated and assumed")
        if not isinstance(entry, dict) or set(entry) != {"value", "why"}:
            raise RunError(f"{name}: assumed `{field}` must be {{value, why}}")
        config[field] = entry["value"]
    unknown = set(config) - FIELDS
    if unknown:
        raise RunError(f"{name}: unknown field(s) {sorted(unknown)}; known: {sorted(FIELDS)}")
    for field in ("gpu", "gpus", "model", "seq_len", "global_batch", "tp", "pp", "schedule"):
        if field not in config:
            raise RunError(f"{name}: `{field}` is neither stated nor assumed")
    run["name"] = name.removesuffix(".toml")
    run["config"] = config
    return run


def gpt_model(m: dict, attention: str) -> str:
    """A GPT of the stated shape as flatpipe's model YAML: multi-head attention (`attention`:
    fused or unfused), and the GeLU MLP of width 4h (two GEMMs) as the SwiGLU decoder's three
    GEMMs of width 8h/3 rounded, the same parameters and FLOPs per token to within the
    rounding."""
    h, heads = m["hidden"], m["heads"]
    ffn = round(8 * h / 3)
    return (
        f"name: gpt-{m['parameters_b']}b\ndtype: bf16\nattention: {attention}\nlayers:\n"
        f"  - {{kind: embedding, vocab: {m['vocab']}, hidden: {h}}}\n"
        f"  - {{kind: decoder, count: {m['layers']}, hidden: {h}, ffn: {ffn}, heads: {heads}, kv_heads: {heads}}}\n"
        f"  - {{kind: head, vocab: {m['vocab']}, hidden: {h}}}\n"
    )


def stages(decoders: int, count: int, split: str) -> list[tuple[int, int]]:
    """Layer ranges [start, end) of `count` stages over the embedding (layer 0), `decoders`
    decoder layers and the head, as even as the division allows (the larger stages first).
    `split` "decoders" splits the decoders and adds the embedding to the first stage and the
    head to the last (Megatron-LM's default); "layers" splits all the layers, the embedding
    and the head counted as one each (DeepSpeed's `type:transformer|embedding`, or one layer
    per virtual stage)."""
    if split not in ("decoders", "layers"):
        raise RunError(f"split `{split}` is not `decoders` or `layers`")
    total = decoders + 2
    units = decoders if split == "decoders" else total
    base, extra = divmod(units, count)
    if base == 0:
        raise RunError(f"{units} layers cannot fill {count} stages")
    sizes = [base + (1 if s < extra else 0) for s in range(count)]
    if split == "decoders":
        sizes[0] += 1
        sizes[-1] += 1
    ends = [sum(sizes[: s + 1]) for s in range(count)]
    return list(zip([0] + ends[:-1], ends))


def plan_yaml(run: dict, work: str) -> str:
    """Writes the run's model, workload, hardware and plan files into `work`; the plan's path."""
    c, name = run["config"], run["name"]
    tp, pp = c["tp"], c["pp"]
    if c["gpus"] % (tp * pp):
        raise RunError(f"{name}: {c['gpus']} GPUs are not a multiple of tp x pp = {tp * pp}")
    dp = c["gpus"] // (tp * pp)
    if isinstance(c["model"], dict):
        model = os.path.join(work, f"{name}.model.yaml")
        with open(model, "w") as f:
            f.write(gpt_model(c["model"], c.get("attention", "fused")))
        decoders = c["model"]["layers"]
    else:
        if c.get("attention", "fused") != "fused":
            raise RunError(f"{name}: attention `{c['attention']}` needs a model of a stated shape, "
                           f"not the built-in `{c['model']}` (its attention is fused)")
        model = c["model"]
        decoders = builtin_decoders(model, name)
    workload = os.path.join(work, f"{name}.workload.yaml")
    with open(workload, "w") as f:
        f.write(f"name: {name}\nlengths: {{kind: fixed, tokens: {c['seq_len']}}}\n"
                f"seqs_per_step: {c['global_batch']}\n")
    hardware = c["gpu"]
    if "inter_node_gbps_per_node" in c:
        hardware = os.path.join(work, f"{name}.hardware.yaml")
        with open(hardware, "w") as f:
            f.write(hardware_yaml(c["gpu"], c["inter_node_gbps_per_node"]))
    vpp = c.get("vpp", 1)
    recompute = c.get("recompute", "none")
    try:
        split = stages(decoders, pp * vpp, c.get("split", "decoders"))
    except RunError as e:
        raise RunError(f"{name}: {e}") from None
    lines = [
        f"model: {model}", f"hardware: {hardware}", f"workload: {workload}",
        f"dp: {dp}", f"tp: {tp}", f"sequence_parallel: {str(c.get('sequence_parallel', True)).lower()}",
        f"pp: {pp}", f"vpp: {vpp}", "placement: loop", f"schedule: {c['schedule']}",
        f"sharding: {c.get('sharding', 'ddp')}",
        f"token_budget: {c.get('microbatch_sequences', 1) * c['seq_len']}",
        "stages:", *[f"- {{start: {a}, end: {b}}}" for a, b in split],
        f"recompute: [{', '.join([recompute] * len(split))}]",
    ]
    path = os.path.join(work, f"{name}.plan.yaml")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return path


def builtin_decoders(model: str, name: str) -> int:
    """The decoder layers of the built-in `model` (`flatpipe builtins`' description)."""
    out = subprocess.run([BIN, "builtins", "--format", "json"], capture_output=True, text=True)
    for b in json.loads(out.stdout):
        if b["kind"] == "model" and b["name"] == model:
            return int(b["description"].split()[0])
    raise RunError(f"{name}: model `{model}` is not a built-in model (flatpipe builtins)")


def hardware_yaml(gpu: str, gbps_per_node: float) -> str:
    """The built-in `gpu`'s file (profiles/data/hardware/) with the stated inter-node bandwidth:
    `gbps_per_node` Gb/s per node shared by its 8 GPUs, as bytes per second per GPU (the link's
    latency stays the file's: no source states one)."""
    with open(os.path.join(ROOT, "profiles", "data", "hardware", f"{gpu}.yaml")) as f:
        lines = f.read().splitlines()
    beta = gbps_per_node * 1e9 / 8 / GPUS_PER_NODE

    def restated(line: str) -> str:
        line = re.sub(r"name: [^,]*", f"name: {gbps_per_node:g} Gb/s per node", line, count=1)
        return re.sub(r"beta_bytes_per_s: [^,}]*", f"beta_bytes_per_s: {beta:.6e}", line, count=1)

    return "\n".join(restated(l) if l.startswith("inter_node:") else l for l in lines) + "\n"


def simulate(run: dict, plan: str) -> dict:
    """`flatpipe simulate --plan` on one step: its JSON result row."""
    out = subprocess.run([BIN, "simulate", "--plan", plan, "--steps", "1", "--gantt", "none",
                          "--format", "json"], capture_output=True, text=True)
    if out.returncode != 0:
        raise RunError(f"{run['name']}: flatpipe simulate exited {out.returncode}: {out.stderr.strip()}")
    return json.loads(out.stdout)[0]


def predict(run: dict, work: str) -> dict:
    """The run's prediction: step time, MFU, memory per GPU and whether it fits, and the
    reported metric's predicted value; for an FSDP run that does not fit, also its memory with
    the gradients reduced after every backward (`zero2`)."""
    plan = plan_yaml(run, work)
    row = simulate(run, plan)
    step_s = row["step_time_s"]["mean"]
    value = metric_value(run, row)
    extra = {}
    if not row["fits"] and run["config"].get("sharding") == "fsdp":
        with open(plan) as f:
            text = f.read().replace("sharding: fsdp", "sharding: zero2")
        with open(plan, "w") as f:
            f.write(text)
        extra["zero2_gib"] = simulate(run, plan)["peak_memory_bytes"] / 2**30
    return {**extra, "step_s": step_s, "mfu": row["mfu"], "value": value, "bubble": row["bubble_ratio_mean"],
            "gib": row["peak_memory_bytes"] / 2**30, "limit_gib": row["memory_limit_bytes"] / 2**30,
            "act_gib": row["peak_activation_bytes"] / 2**30, "static_gib": row["static_bytes"] / 2**30,
            "fits": row["fits"]}


def gemm_curve(gpu: str) -> str:
    """The built-in `gpu`'s GEMM curve as its hardware file names it: `table` or `roofline`."""
    with open(os.path.join(ROOT, "profiles", "data", "hardware", f"{gpu}.yaml")) as f:
        for line in f:
            if line.startswith("gemm:"):
                return "table" if "table:" in line else "roofline"
    return "flat"


def reason(run: dict) -> str:
    """One line on why the prediction differs, from what the model knows of the run: the GEMM
    curve its GPU has, its attention kernel, and its memory."""
    c, p = run["config"], run["prediction"]
    gemm = {
        "table": f"{c['gpu'].upper()} GEMMs from a measured table by shape",
        "roofline": f"{c['gpu'].upper()} GEMMs on the roofline of a 2025 measurement of its best matmul rate (no table by shape); the run's own kernels are not measured",
        "flat": f"{c['gpu'].upper()} GEMMs at a flat efficiency",
    }[gemm_curve(c["gpu"])]
    attention = "unfused attention" if c.get("attention") == "unfused" else "fused attention"
    line = f"{gemm}; {attention}"
    if not p["fits"]:
        line += (f"; over memory: {p['act_gib']:.1f} GiB of activations in flight on the fullest rank"
                 f" and {p['static_gib']:.1f} GiB of weights, gradients and optimizer state")
    return line


def peak_flops(gpu: str) -> float:
    """The built-in `gpu`'s datasheet peak (`peak_flops` of profiles/data/hardware/), FLOP/s."""
    with open(os.path.join(ROOT, "profiles", "data", "hardware", f"{gpu}.yaml")) as f:
        for line in f:
            if line.startswith("peak_flops:"):
                return float(line.split(":", 1)[1])
    raise RunError(f"hardware {gpu}: no peak_flops")


def metric_value(run: dict, row: dict) -> float:
    """The reported metric's predicted value from `flatpipe simulate`'s result row."""
    step_s = row["step_time_s"]["mean"]
    c, metric = run["config"], run["reported"]["metric"]
    if metric == "step_time_s":
        return step_s
    if metric == "tflops_per_gpu_model":
        return row["mfu"] * peak_flops(c["gpu"]) / 1e12
    if metric == "tflops_per_gpu_with_recompute":
        # Narayanan et al. 2021, Eq. 3: FLOPs per iteration with full recomputation.
        m = c["model"]
        b, s, l, h, v = c["global_batch"], c["seq_len"], m["layers"], m["hidden"], m["vocab"]
        flops = 96 * b * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))
        return flops / (step_s * c["gpus"]) / 1e12
    raise RunError(f"{run['name']}: reported.metric `{metric}` is not step_time_s, "
                   "tflops_per_gpu_model or tflops_per_gpu_with_recompute")


def table(runs: list[dict]) -> str:
    """docs/fidelity.md's text."""
    rows, errors = [], []
    for r in runs:
        p, rep, c = r["prediction"], r["reported"], r["config"]
        err = (p["value"] - rep["value"]) / rep["value"]
        errors.append(abs(err))
        layout = f"{c['tp']} x {c['pp']} x {c['gpus'] // (c['tp'] * c['pp'])}"
        fits = "fits" if p["fits"] else f"**over** the {p['limit_gib']:.1f} GiB limit"
        rows.append(f"| {r['name']} | {c['gpus']:,} {c['gpu'].upper()} | {layout} | "
                    f"{rep['metric']} | {rep['value']:g} | {p['value']:.4g} | {err:+.1%} | "
                    f"{p['step_s']:.3f} s, bubble {p['bubble']:.0%}, MFU {p['mfu']:.1%} | "
                    f"{p['gib']:.1f} GiB, {fits} | {reason(r)} |")
    med = statistics.median(errors)
    over = [f"{r['name']} ({r['prediction']['gib']:.1f} GiB against {r['prediction']['limit_gib']:.1f})"
            for r in runs if not r["prediction"]["fits"]]
    memory = ("Over flatpipe's memory limit, though the source ran it: " + ", ".join(over)
              + ". " + MEMORY.format(zero2=", ".join(
                  f"{r['name']} {r['prediction']['zero2_gib']:.1f} GiB" for r in runs
                  if "zero2_gib" in r["prediction"]))) if over else "Every run fits flatpipe's memory model."
    head = [
        "# Fidelity: published runs against flatpipe's predictions",
        "",
        "Written by `scripts/published-runs.sh` from the run files of `examples/published/runs/`",
        "(each one cites its source, and says what the source leaves unstated and what flatpipe",
        "assumes for it). Every prediction is `flatpipe simulate --plan` on the analytic profile",
        "of the stated model on the built-in GPU; the error is in the metric the source reports.",
        "",
        f"Median |error| {med:.1%}, largest {max(errors):.1%}, over {len(runs)} runs; "
        f"{sum(1 for r in runs if r['prediction']['fits'])} of {len(runs)} fit flatpipe's memory model.",
        "",
        WHY,
        "",
        memory,
        "",
        "| run | GPUs | tp x pp x dp | metric | reported | predicted | error | predicted step | memory per GPU | why it differs |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    return "\n".join(head + rows) + "\n"


def main() -> int:
    global BIN
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bin", default=os.path.join(ROOT, "target", "release", "flatpipe"))
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "fidelity.md"))
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args()
    BIN = args.bin
    runs = [load(os.path.join(RUNS, f)) for f in sorted(os.listdir(RUNS)) if f.endswith(".toml")]
    with tempfile.TemporaryDirectory() as work:
        for r in runs:
            r["prediction"] = predict(r, work)
            p = r["prediction"]
            print(f"{r['name']}: reported {r['reported']['value']:g} {r['reported']['metric']}, "
                  f"predicted {p['value']:.4g} ({(p['value'] / r['reported']['value'] - 1):+.1%})")
    text = table(runs)
    if args.check:
        same = os.path.exists(args.out) and open(args.out).read() == text
        print("docs/fidelity.md is current" if same else "docs/fidelity.md is stale")
        return 0 if same else 1
    tmp = args.out + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, args.out)
    return 0


# Why the predictions miss, in one place: the causes are the model's, not the runs'.
WHY = """\
What the prediction is made of: each layer's GEMMs priced one by one at its GPU's GEMM curve
(`profiles/data/hardware/`: the H100's is OpenXLA's measured table by shape; no table by shape
exists here for the A100, whose curve is the roofline of its maximum achievable matmul rate,
271.2 TFLOP/s, measured in 2025 with torch 2.6 and CUDA 12.6), attention by the kernel the run
used (the batched GEMMs and softmax of Megatron-LM before FlashAttention; cuDNN's measured
rates on the H100), tensor-parallel collectives on the datasheet NVLink rate, and the schedule
replayed step by step. No constant is fitted to these rows.

Why they miss: every A100 row is predicted faster than it ran. The GEMMs dominate those steps,
and the A100's curve is today's cuBLAS at its best shape, as one GPU alone reaches it; what
Megatron-LM's 2021 and 2022 kernels reached at these shapes, and what NCCL reached on the
NVSwitch, no source at hand measures (a measured A100 table by shape is what would settle it).
The Llama 3 rows are predicted faster than Meta reports; the paper does not state its
attention kernel, its overlap of the tensor-parallel collectives or its GPUs' sustained clocks.
BLOOM's run also set `CUDA_LAUNCH_BLOCKING=1` and crossed nodes at 6.25 GB/s per GPU, both in
its run file."""

# Why the Llama 3 rows do not fit, in one place.
MEMORY = """\
Without activation recomputation every schedule of the 1F1B family holds, on its first rank,
the activations of about all 126 decoders for one microbatch (65 KB per token per decoder with
tp 8 and sequence parallelism, 8,192 tokens: 67 GB for 1F1B, 1.125x that for interleaving with
8 virtual stages), before any weight; and FSDP as torchtitan runs it under PP keeps the stage's
gradients unsharded in fp32 for the whole step (12.7 GB here). Reducing the gradients after
every backward instead (flatpipe's `zero2`) needs {zero2}; which of the two Meta ran,
and whether anything was recomputed or offloaded, is what the run file's transcription of
section 3.3.2 must settle."""

BIN = ""
if __name__ == "__main__":
    try:
        sys.exit(main())
    except RunError as e:
        sys.exit(f"error: {e}")
