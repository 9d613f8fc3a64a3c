"""Your own model, planned from its own kernels: a Hugging Face Llama (random weights, hidden
256, 6 decoders, fp32, flatpipe's per-sequence attention) cut by flatpipe.hf, profiled with
flatpipe.torch.profile on each of two gloo processes at once (one thread each; the link between
them measured too), then run by flatpipe's PyTorch runtime for several schedules;
each step's predicted time (the core's prediction from that profile) against the measured one
(the slowest rank's wall time between barriers). First the plan `flatpipe plan --profile`
chooses on the measured profile for these steps' lengths (schedule, layer split, token budget),
then four schedules at a fixed budget.

    python python/bench/own_model.py [--steps 8] [--budget 2048] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import flatpipe
from flatpipe import hf
from flatpipe.torch import PipelineRuntime

SCHEDULES = ["1f1b", "zb-h1", "zb-v", "interleaved-1f1b"]
CONFIG = dict(vocab_size=2048, hidden_size=256, intermediate_size=768, num_hidden_layers=6,
              num_attention_heads=8, num_key_value_heads=4, head_dim=32, tie_word_embeddings=False)
WARMUP = 2


def model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**CONFIG, attn_implementation="sdpa"))


def steps(n: int, seed: int = 7):
    """Variable-length steps: 6 to 14 sequences of 64 to 1,500 tokens."""
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(64, 1500, (int(torch.randint(6, 15, (1,), generator=g)),), generator=g).tolist()
        for _ in range(n)
    ]


def flatpipe_bin() -> str:
    root = os.path.join(os.path.dirname(__file__), "..", "..", "target")
    for profile in ("release", "debug"):
        path = os.path.abspath(os.path.join(root, profile, "flatpipe"))
        if os.access(path, os.X_OK):
            return path
    raise SystemExit("build the flatpipe binary first: cargo build --release")


def plan_file(profile_yaml: str, spec: dict, d: str) -> str:
    """`flatpipe plan --profile` on the measured profile, for a workload of the bench's own
    sequence lengths on 2 pipeline ranks (no tensor parallelism, no chunks: the runtime's Hugging
    Face stages run neither): the chosen plan's path."""
    prof = os.path.join(d, "profile.yaml")
    with open(prof, "w") as f:
        f.write(profile_yaml)
    lens = [n for step in spec["steps"] for n in step]
    csv = os.path.join(d, "lengths.csv")
    with open(csv, "w") as f:
        f.write("tokens\n" + "\n".join(map(str, lens)) + "\n")
    workload = os.path.join(d, "workload.yaml")
    with open(workload, "w") as f:
        f.write(f"name: bench\nlengths: {{kind: empirical, csv: lengths.csv}}\n"
                f"seqs_per_step: {round(len(lens) / len(spec['steps']))}\n")
    out = os.path.join(d, "plan.yaml")
    subprocess.run(
        [flatpipe_bin(), "plan", "--profile", prof, "--workload", workload, "--ranks", "2",
         "--pp", "2", "--tp", "1", "--sharding", "ddp", "--no-chunk", "--token-budgets",
         "1024,2048,4096", "--steps", "8", "-o", out, "--gantt", "none"],
        check=True, capture_output=True, text=True,
    )
    return out


def run_steps(m, rank: int, pipe, spec: dict):
    """(predicted, measured) seconds of each step after the warm-up, measured as the slowest
    rank's wall time between barriers."""
    stages = hf.stages(m, pipe.stages, pipe.stage_ranks, rank)
    rt = PipelineRuntime(stages, rank=rank, hidden_size=CONFIG["hidden_size"])
    rows = []
    for i, lens in enumerate(spec["steps"]):
        plan = pipe.plan_step(lens, i)
        g = torch.Generator().manual_seed(i)
        inputs = [torch.randint(CONFIG["vocab_size"], (mb.tokens,), generator=g) for mb in plan.microbatches()]
        targets = [torch.randint(CONFIG["vocab_size"], (mb.tokens,), generator=g) for mb in plan.microbatches()]
        m.zero_grad(set_to_none=True)
        dist.barrier()
        c = time.perf_counter()
        rt.step(plan, inputs, targets)
        wall = torch.tensor([time.perf_counter() - c])
        dist.all_reduce(wall, op=dist.ReduceOp.MAX)
        if i >= WARMUP:
            rows.append((plan.predicted_step_time_s(), float(wall)))
    return rows


def worker(rank: int, world: int, init: str, spec: dict, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    try:
        m = model()
        hf.use_varlen(m)  # profile the attention the run uses (hf.stages sets it too)
        layers = CONFIG["num_hidden_layers"] + 2
        path = os.path.join(out, f"model{rank}.yaml")
        with open(path, "w") as f:
            f.write(hf.model_yaml(m, "own-llama"))
        base = flatpipe.Profile.analytic(path, "cpu")
        c = time.perf_counter()
        prof, fits = flatpipe.torch.profile(
            lambda a, b: hf.HFStage(m, a, b), layers, base, hidden_size=CONFIG["hidden_size"],
            vocab_size=CONFIG["vocab_size"], tokens=(512, 1024, 2048), seq_lens=(None, 128),
        )
        report = {"profile_s": time.perf_counter() - c, "fits": {f"{k}/{p}": v for (k, p), v in fits.items()}, "runs": {}}
        # The plan: rank 0 plans on its profile; every rank runs the chosen plan.
        if rank == 0:
            plan_file(prof.to_yaml(), spec, out)
        dist.barrier()
        chosen = flatpipe.Pipeline.from_plan(os.path.join(out, "plan.yaml"))
        report["plan"] = {"schedule": chosen.schedule, "stages": chosen.stages}
        report["runs"]["planned: " + chosen.schedule] = run_steps(m, rank, chosen, spec)
        for schedule in SCHEDULES:
            pipe = flatpipe.Pipeline(schedule, pp=world, num_layers=layers, token_budget=spec["budget"], profile=prof)
            report["runs"][schedule] = run_steps(m, rank, pipe, spec)
        with open(os.path.join(out, f"{rank}.json"), "w") as f:
            json.dump(report, f)
    finally:
        dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--budget", type=int, default=2048)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    spec = {"budget": a.budget, "steps": steps(a.steps + WARMUP)}
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(worker, args=(2, os.path.join(d, "init"), spec, d), nprocs=2, join=True)
        report = json.load(open(os.path.join(d, "0.json")))
    errors = {s: [p / w - 1 for p, w in rows] for s, rows in report["runs"].items()}
    every = [abs(e) for es in errors.values() for e in es]
    summary = {
        "profile_s": report["profile_s"],
        "median_abs_error": statistics.median(every),
        "per_schedule": {s: statistics.median(abs(e) for e in es) for s, es in errors.items()},
        "mean_measured_s": {s: statistics.mean(w for _, w in rows) for s, rows in report["runs"].items()},
        "mean_predicted_s": {s: statistics.mean(p for p, _ in rows) for s, rows in report["runs"].items()},
    }
    if a.json:
        print(json.dumps(summary))
        return
    print(f"profiled in {summary['profile_s']:.1f} s; median |error| over every step: {summary['median_abs_error']:.1%}")
    print(f"flatpipe plan chose {report['plan']['schedule']}, stages {report['plan']['stages']}")
    for s in report["runs"]:
        print(f"  {s:18} predicted {summary['mean_predicted_s'][s]:.3f} s, measured "
              f"{summary['mean_measured_s'][s]:.3f} s, median |error| {summary['per_schedule'][s]:.1%}")


if __name__ == "__main__":
    main()
