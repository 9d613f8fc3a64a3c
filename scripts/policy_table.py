#!/usr/bin/env python3
"""docs/variable-length.md's microbatching-policy comparison: every policy at its best token
budget, Llama-3.1-8B on 8 H200 (pp = 8), sharegpt-v3 and sharegpt-v3-merged, 1F1B and ZB-V.

For each workload and schedule, runs `flatpipe simulate` once per token budget in BUDGETS
with every policy (sequences longer than the budget cut into chunks of the budget for the
flat policies, verl-kk included), 1,000 steps of 128 sequences, and keeps each policy's
best budget by mean step time among the budgets whose memory fits (the best overall,
marked, when none fits). The bound column is the lowest over the budgets of flat-planned's
mean per-step lower bound (each budget's bound holds for every cut under that budget, so the
lowest holds for every row). Prints Markdown.

    cargo build --release && python3 scripts/policy_table.py [path/to/flatpipe]
"""

import json
import subprocess
import sys

BIN = sys.argv[1] if len(sys.argv) > 1 else "target/release/flatpipe"
BUDGETS = [2048, 4096, 8192, 16384, 32768]
POLICIES = ["padded", "packed", "flat-ffd", "flat-balanced", "verl-kk", "flat-planned"]
STEPS = 1000


def run(workload, schedule, budget):
    cmd = [
        BIN, "simulate", "--model", "llama3.1-8b", "--hardware", "h200", "--pp", "8",
        "--schedule", schedule, "--policy", ",".join(POLICIES), "--steps", str(STEPS),
        "--workload", workload, "--token-budget", str(budget), "--chunk-tokens", str(budget),
        "--gantt", "none", "--format", "json",
    ]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out)


def main():
    for workload in ["sharegpt-v3", "sharegpt-v3-merged"]:
        for schedule in ["1f1b", "zb-v"]:
            rows = {}
            bound = None
            for b in BUDGETS:
                for r in run(workload, schedule, b):
                    r["budget"] = b
                    best = rows.get(r["policy"])
                    better = best is None or (r["fits"], -r["step_time_s"]["mean"]) > (
                        best["fits"], -best["step_time_s"]["mean"])
                    if better:
                        rows[r["policy"]] = r
                    lb = r.get("lower_bound_mean_s")
                    if lb is not None:
                        bound = lb if bound is None else min(bound, lb)
            verl = rows["verl-kk"]["step_time_s"]["mean"]
            print(f"\n{workload}, {schedule}, pp = 8 (mean per-step lower bound {bound:.3f} s: "
                  f"verl-kk is {verl / bound - 1:+.1%} above it)\n")
            print("| policy | best budget | mean | p90 | p99 | vs verl-kk (mean) | above the bound | memory (max rank) |")
            print("|---|---|---|---|---|---|---|---|")
            for p in POLICIES:
                r = rows[p]
                t = r["step_time_s"]
                mem = r["peak_memory_bytes"] / 2**30
                fits = "" if r["fits"] else " (over)"
                print(f"| {p} | {r['budget']:,} | {t['mean']:.3f} s | {t['p90']:.3f} s | {t['p99']:.3f} s "
                      f"| {t['mean'] / verl - 1:+.1%} | {t['mean'] / bound - 1:+.1%} | {mem:.1f} GiB{fits} |")


if __name__ == "__main__":
    main()
