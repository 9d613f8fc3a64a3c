#!/usr/bin/env python3
"""Prints docs/long-sequences.md's table of long-sequence strategies: chunks, fixed and dynamic
context parallelism, for Llama-3.1-70B on 64 H100 (tp 8 in a node), on the long-tailed
sharegpt-v3-merged workload and on examples/long-context-128k.yaml. Every row holds 16,384
tokens per GPU of a rank's group per microbatch (the cp rows a budget of 2 x 16,384). Each row is `flatpipe
simulate` over 20 sampled steps, the best of 1F1B, ZB-H1 and interleaved 1F1B by mean step time
among those that fit the 80 GB memory (all of them, marked, when none fits).

Usage: python3 scripts/cp_table.py [FLATPIPE_BINARY]   (default target/release/flatpipe)
"""
import json
import subprocess
import sys

BIN = sys.argv[1] if len(sys.argv) > 1 else "target/release/flatpipe"
WORKLOADS = ["sharegpt-v3-merged", "examples/long-context-128k.yaml"]
ROWS = [
    ("chunks of 16,384: tp 8 x pp 8", ["--pp", "8", "--token-budget", "16384", "--chunk-tokens", "16384"]),
    ("fixed cp 2, ring, zigzag: tp 8 x cp 2 x pp 4", ["--pp", "4", "--cp", "2", "--token-budget", "32768"]),
    ("fixed cp 2, Ulysses: tp 8 x cp 2 x pp 4", ["--pp", "4", "--cp", "2", "--cp-comm", "a2a", "--token-budget", "32768"]),
    ("fixed cp 2, all-gather: tp 8 x cp 2 x pp 4", ["--pp", "4", "--cp", "2", "--cp-comm", "allgather", "--token-budget", "32768"]),
    ("dynamic cp <= 2 at 16,384 tokens per GPU: tp 8 x cp 2 x pp 4", ["--pp", "4", "--cp", "2", "--dynamic-cp", "16384", "--token-budget", "32768"]),
]


def best(rows):
    fits = [r for r in rows if r["fits"]]
    pool = fits or rows
    r = min(pool, key=lambda r: r["step_time_s"]["mean"])
    return r, bool(fits)


def main():
    print("| workload | strategy | best schedule | mean step | p99 step | MFU | peak memory |")
    print("|---|---|---|---|---|---|---|")
    for w in WORKLOADS:
        for name, args in ROWS:
            cmd = [BIN, "simulate", "--model", "llama3.1-70b", "--hardware", "h100", "--workload", w,
                   "--tp", "8", "--schedule", "1f1b,zb-h1,interleaved-1f1b", "--steps", "20",
                   "--gantt", "none", "--format", "json"] + args
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            rows, _ = json.JSONDecoder().raw_decode(out[out.index("["):])
            r, fits = best(rows)
            s = r["step_time_s"]
            mem = r["peak_memory_bytes"] / 2**30
            print(f"| {w.split('/')[-1]} | {name} | {r['schedule']} | {s['mean']:.2f} s | {s['p99']:.2f} s "
                  f"| {100 * r['mfu']:.1f}% | {mem:.1f} GiB{'' if fits else ' (does not fit)'} |")


if __name__ == "__main__":
    main()
