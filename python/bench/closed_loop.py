"""The closed loop on a real framework: fit a profile from one schedule's run in flatpipe's
PyTorch runtime, predict the other schedules' step times for the same steps, run them, and
compare (CPU, gloo, 2 processes).

1. Two ranks time a ping-pong of ``[T, H]`` tensors: the link's ``alpha + bytes / beta``.
2. ZB-V (``--fit dualpipev``: DualPipeV) runs the steps on a 7-layer model (embedding, 5 decoders,
   head) in 4 stages of 3, 1, 2 and 1 layers. ``flatpipe.fit`` fits
   ``t = c0 + c_tok T + c_attn pairs`` per layer kind and phase (F, I, W, and DualPipeV's fused
   B), and a fixed cost per action and phase (told apart from the layers' by the stages of 1
   and 2 decoders), from each action's busy time (its span less the wait for its input and the
   posting of its sends and receives), and the link's per-message posting cost from the
   posting time.
3. Every schedule runs the same steps (after two warm-up steps each; step by step, every
   schedule's step i before any schedule's step i + 1); the Rust core predicts
   each step from the fitted profile (``StepPlan.predicted_step_time_s``); the measured step
   is the slowest rank's wall time after a barrier.

    python python/bench/closed_loop.py [--steps 12] [--fit dualpipev|zb-v] [--from-trace] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import flatpipe
from flatpipe.fit import profile_from_steps, profile_from_trace
from flatpipe.models import ModelConfig, Stage
from flatpipe.torch import ActionTiming, PipelineRuntime

MODEL = {"vocab": 512, "hidden": 128, "heads": 4, "kv_heads": 2, "ffn": 384, "num_decoders": 5}
SCHEDULES = ["dualpipev", "zb-v", "1f1b", "gpipe", "zb-h1", "zb-h2", "interleaved-1f1b"]
WARMUP = 2
# The V schedules' stages (V placement on 2 ranks): embedding + 2 decoders, a decoder,
# 2 decoders, the head. A decoder alone and in pairs tells the per-action cost from the
# per-layer one, and the ranks hold about the same work (rank 0: stages 0 and 3).
FIT_STAGES = [(0, 3), (3, 4), (4, 6), (6, 7)]


def pipeline(schedule: str, budget: int, profile=None) -> flatpipe.Pipeline:
    """The pipeline a schedule runs and is predicted on: the V schedules on ``FIT_STAGES``,
    the others on their even split of the 6 layers."""
    n = 2 + MODEL["num_decoders"]
    stages = FIT_STAGES if schedule in ("dualpipev", "zb-v") else None
    return flatpipe.Pipeline(schedule, pp=2, num_layers=n, stages=stages, token_budget=budget, profile=profile)


def model_yaml(cfg: ModelConfig, path: str) -> None:
    with open(path, "w") as f:
        f.write(
            "name: flatpipe-reference\ndtype: fp32\nlayers:\n"
            f"  - {{kind: embedding, vocab: {cfg.vocab}, hidden: {cfg.hidden}}}\n"
            f"  - {{kind: decoder, count: {cfg.num_decoders}, hidden: {cfg.hidden}, ffn: {cfg.ffn}, "
            f"heads: {cfg.heads}, kv_heads: {cfg.kv_heads}}}\n"
            f"  - {{kind: head, vocab: {cfg.vocab}, hidden: {cfg.hidden}}}\n"
        )


def worker(rank: int, world: int, init: str, spec: dict, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    cfg = ModelConfig(**spec["model"])
    # 1. The link: half a round trip of [T, H] fp32.
    link = []
    for t in (16, 64, 256, 1024):
        buf = torch.zeros(t, cfg.hidden)
        times = []
        for i in range(30):
            dist.barrier()
            t0 = time.perf_counter()
            if rank == 0:
                dist.send(buf, 1)
                dist.recv(buf, 1)
            else:
                dist.recv(buf, 0)
                dist.send(buf, 0)
            times.append((time.perf_counter() - t0) / 2)
        link.append((buf.numel() * 4, statistics.median(times[5:])))
    runs = {}
    spec_overhead = 0.0
    if spec.get("trace"):
        # The fit schedule once more under the profiler: its trace is what the fit reads.
        from torch.profiler import ProfilerActivity, profile

        from flatpipe.fit import profiler_overhead_s

        # The profiler's cost per event, both ranks measuring at once as they trace at once.
        dist.barrier()
        spec_overhead = profiler_overhead_s()

        pipe = pipeline(spec["fit"], spec["budget"])
        stages = {s: Stage(cfg, *pipe.stages[s]) for s, r in enumerate(pipe.stage_ranks) if r == rank}
        rt = PipelineRuntime(stages, rank=rank, hidden_size=cfg.hidden)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for i, lens in enumerate(spec["steps"]):
                plan = pipe.plan_step(lens, i)
                g = torch.Generator().manual_seed(i)
                ids = [torch.randint(cfg.vocab, (mb.tokens,), generator=g) for mb in plan.microbatches()]
                dist.barrier()
                rt.step(plan, ids, ids)
        prof.export_chrome_trace(os.path.join(out, f"trace.rank{rank}.json"))
    # Every schedule runs step i before any runs step i + 1, so a drift of the host's speed
    # (a shared machine's) hits every schedule alike instead of the ones that ran last.
    runners = {}
    for schedule in spec["schedules"]:
        pipe = pipeline(schedule, spec["budget"])
        stages = {s: Stage(cfg, *pipe.stages[s]) for s, r in enumerate(pipe.stage_ranks) if r == rank}
        runners[schedule] = (pipe, stages, PipelineRuntime(stages, rank=rank, hidden_size=cfg.hidden))
        runs[schedule] = []
    for i, lens in enumerate(spec["steps"]):
        for schedule, (pipe, stages, rt) in runners.items():
            plan = pipe.plan_step(lens, i)
            g = torch.Generator().manual_seed(i)
            ids = [torch.randint(cfg.vocab, (mb.tokens,), generator=g) for mb in plan.microbatches()]
            for m in stages.values():
                m.zero_grad(set_to_none=True)
            dist.barrier()
            r = rt.step(plan, ids, ids)
            runs[schedule].append(
                {
                    "wall_s": r.wall_s,
                    "actions": [[a.action, a.start_s, a.end_s, a.wait_s, a.compute_s, a.post_s] for a in r.actions],
                }
            )
    with open(os.path.join(out, f"{rank}.json"), "w") as f:
        json.dump({"link": link, "runs": runs, "profiler_overhead_s": spec_overhead}, f)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--json", action="store_true")
    ap.add_argument(
        "--from-trace",
        action="store_true",
        help="fit from a PyTorch profiler trace of the fit schedule's run (a run of its own, "
        "under the profiler) instead of the runtime's own timings",
    )
    ap.add_argument(
        "--fit",
        default="zb-v",
        choices=["zb-v", "dualpipev"],
        help="the schedule whose run the profile is fitted from (default zb-v: every stage "
        "runs F, I and W, and the first stage's W is a fused backward; DualPipeV runs I and W "
        "only in its cool-down, too few to fit)",
    )
    ap.add_argument("--keep", metavar="DIR", help="keep every rank's timings (and traces) in DIR")
    a = ap.parse_args()
    cfg = ModelConfig(**MODEL)
    w = flatpipe.Workload.load("tiny-chat")
    steps = [[int(x) for x in w.sample_step(s)] for s in range(a.steps + WARMUP)]
    spec = {
        "model": MODEL,
        "budget": a.budget,
        "steps": steps,
        "schedules": SCHEDULES,
        "trace": a.from_trace,
        "fit": a.fit,
    }
    fit_pipe = pipeline(a.fit, a.budget)
    kinds = ["embedding"] + ["decoder"] * cfg.num_decoders + ["head"]
    layer_kinds = [kinds[s:e] for s, e in fit_pipe.stages]
    measured = range(WARMUP, len(steps))
    with tempfile.TemporaryDirectory() as tmp:
        d = a.keep or tmp
        os.makedirs(d, exist_ok=True)
        mp.spawn(worker, args=(2, os.path.join(d, "init"), spec, d), nprocs=2, join=True)
        ranks = [json.load(open(os.path.join(d, f"{r}.json"))) for r in range(2)]
        path = os.path.join(d, "model.yaml")
        model_yaml(cfg, path)
        base = flatpipe.Profile.analytic(path, "cpu")
        # The link: least squares of one-way time on bytes, both ranks' medians.
        pts = np.array([p for r in ranks for p in r["link"]])
        beta_inv, alpha = np.polyfit(pts[:, 0], pts[:, 1], 1)
        alpha, beta = max(float(alpha), 0.0), 1.0 / max(float(beta_inv), 1e-15)
        base = base.with_link(alpha, beta, 0.0)
        plans = [fit_pipe.plan_step(steps[i], i) for i in measured]
        if a.from_trace:
            # The fit schedule's steps after the warm-up, from the profiler's trace files.
            traces = [os.path.join(d, f"trace.rank{r}.json") for r in range(2)]
            per_event = statistics.mean(r["profiler_overhead_s"] for r in ranks)
            profile, fits = profile_from_trace(
                base, layer_kinds, plans, traces, steps=list(measured), overhead_per_event_s=per_event
            )
            fits[("profiler", "event")] = (per_event, 0.0, 0.0, float("nan"))
        else:
            # The fit schedule's steps after the warm-up, from the runtime's own timings.
            fit_steps = []
            for plan, i in zip(plans, measured):
                timings = [
                    [ActionTiming(x[0], x[1], x[2], x[3], x[4], x[5]) for x in r["runs"][a.fit][i]["actions"]]
                    for r in ranks
                ]
                fit_steps.append((plan, timings))
            profile, fits = profile_from_steps(base, layer_kinds, fit_steps)
    if a.keep:
        with open(os.path.join(a.keep, "profile.yaml"), "w") as f:
            f.write(profile.to_yaml())
        with open(os.path.join(a.keep, "steps.json"), "w") as f:
            json.dump({"steps": steps, "budget": a.budget, "num_layers": cfg.num_layers}, f)
    rows = []
    for schedule in SCHEDULES:
        pipe = pipeline(schedule, a.budget, profile)
        pred, meas = [], []
        for i in range(WARMUP, len(steps)):
            pred.append(pipe.plan_step(steps[i], i).predicted_step_time_s())
            meas.append(max(r["runs"][schedule][i]["wall_s"] for r in ranks))
        errs = [(p - m) / m for p, m in zip(pred, meas)]
        rows.append(
            {
                "schedule": schedule,
                "predicted_mean_s": statistics.mean(pred),
                "measured_mean_s": statistics.mean(meas),
                "error_of_means": statistics.mean(pred) / statistics.mean(meas) - 1,
                "median_abs_step_error": statistics.median(abs(e) for e in errs),
                "fitted_on": schedule == a.fit,
            }
        )
    others = [r for r in rows if not r["fitted_on"]]
    res = {
        "model": MODEL,
        "budget": a.budget,
        "steps": a.steps,
        "link_alpha_s": alpha,
        "link_beta_bytes_per_s": beta,
        "fits": {f"{k}.{p}": {"c0_s": v[0], "c_tok_s": v[1], "c_attn_s": v[2], "r2": v[3]} for (k, p), v in fits.items()},
        "schedules": rows,
        "median_abs_error_of_means_other_schedules": statistics.median(abs(r["error_of_means"]) for r in others),
    }
    if a.json:
        print(json.dumps(res, indent=2))
        return
    print(f"link: {alpha * 1e6:.1f} us + bytes / {beta:.3e} B/s; fits (c0 us, c_tok us, c_attn ns, R2):")
    for (k, p), v in sorted(fits.items()):
        print(f"  {k:9} {p}: {v[0] * 1e6:7.1f} {v[1] * 1e6:7.3f} {v[2] * 1e9:7.3f}  {v[3]:.3f}")
    print(f"{'schedule':18} {'predicted':>10} {'measured':>10} {'error':>8} {'median |step error|':>20}")
    for r in rows:
        tag = " (fitted on)" if r["fitted_on"] else ""
        print(
            f"{r['schedule'] + tag:18} {r['predicted_mean_s'] * 1e3:8.1f}ms {r['measured_mean_s'] * 1e3:8.1f}ms "
            f"{r['error_of_means'] * 100:+7.1f}% {r['median_abs_step_error'] * 100:19.1f}%"
        )
    print(f"median |error| over the other schedules: {res['median_abs_error_of_means_other_schedules'] * 100:.1f}%")


if __name__ == "__main__":
    main()
