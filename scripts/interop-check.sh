#!/usr/bin/env bash
# Exports plans to torchtitan and loads them with torchtitan's own configuration parser, and
# lowers every schedule kind to communication actions as torch does (torchtitan 0.2.2, torch
# 2.15 from PyPI, in the virtual environment scripts/python-env.sh creates or reuses). Run by .ci/run; needs python3 with venv.
set -euo pipefail
cd "$(dirname "$0")/.."
py=$(scripts/python-env.sh)
# The test profile's binary (cargo test has built it already in CI).
cargo build --quiet
bin=target/debug/flatpipe
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
# The default plan, a CSV schedule (zb-h1), a V schedule (zb-v) and interleaved 1F1B with full
# recomputation only.
"$bin" plan -o "$out/default.yaml" --export torchtitan --gantt "$out/g.png" >/dev/null
# (--pp 2: with a pipeline, which the main job's answer, no pipeline, does not exercise.)
"$bin" plan -o "$out/zbh1.yaml" --export torchtitan --schedule zb-h1 --pp 2 --gantt "$out/g.png" >/dev/null
"$bin" plan -o "$out/zbv.yaml" --export torchtitan --schedule zb-v --pp 2 --gantt "$out/g.png" >/dev/null
"$bin" plan -o "$out/interleaved.yaml" --export torchtitan --schedule interleaved-1f1b --pp 2 \
    --recompute full --gantt "$out/g.png" >/dev/null
# Four nodes, pp = 2 x dp = 16 sharded as HSDP (FSDP over a node's 8 replicas, 2 replicas of
# each shard across nodes), and FSDP resharded per microbatch.
"$bin" plan -o "$out/hsdp.yaml" --export torchtitan --ranks 32 --tp 1 --pp 2 --sharding hsdp --steps 8 \
    --gantt "$out/g.png" >/dev/null
"$bin" plan -o "$out/fsdpmb.yaml" --export torchtitan --pp 2 --sharding fsdp-mb --steps 8 \
    --gantt "$out/g.png" >/dev/null
# Llama-3.1-70B on 2 nodes with tensor parallelism inside each (tp = 8, pp = 2).
"$bin" plan -o "$out/tp.yaml" --export torchtitan --model llama3.1-70b --ranks 16 --tp 8 --pp 2 \
    --steps 8 --gantt "$out/g.png" >/dev/null
# Qwen3-30B-A3B's experts over the 8 data-parallel replicas (ep = 8, pp = 2).
"$bin" plan -o "$out/moe.yaml" --export torchtitan --model qwen3-30b-a3b --hardware h100 --ranks 16 \
    --tp 1 --pp 2 --ep 8 --steps 4 --gantt "$out/g.png" >/dev/null
# Context parallelism: Llama-3.1-8B (its flex flavor) with a ring of 2 GPUs per rank, and
# Llama-3.1-70B with all-gathered keys and values, on a long-context workload.
"$bin" plan -o "$out/cp8b.yaml" --export torchtitan --model llama3.1-8b --ranks 8 --tp 2 --cp 2 --pp 2 \
    --workload examples/long-context-128k.yaml --token-budgets 32768 --steps 4 --gantt "$out/g.png" >/dev/null
"$bin" plan -o "$out/cp70b.yaml" --export torchtitan --model llama3.1-70b --ranks 64 --tp 8 --cp 2 --pp 4 \
    --cp-comm allgather --workload examples/long-context-128k.yaml --token-budgets 32768 --steps 4 \
    --gantt "$out/g.png" >/dev/null
(cd "$out" && "$py" "$OLDPWD/scripts/interop/torchtitan_check.py" .)
# Every schedule kind lowered to sends, receives and send waits, receives ahead and deferred:
# equal to torch's own lowering (_add_send_recv, _add_wait_send, _defer_recv_ops), and loadable
# as a compute_comms CSV; with FSDP's actions, equal to what torch's compute-only loader runs.
comms="$out/comms"
mkdir "$comms"
for kind in gpipe 1f1b interleaved-1f1b looped-bfs zb-h1 zb-h2 zb-v dualpipev combined-1f1b zb-auto; do
    for size in "4 8" "3 7" "8 16"; do
        set -- $size
        base="$comms/$kind-p$1-m$2"
        "$bin" schedule --schedule "$kind" --pp "$1" --microbatches "$2" -o "$base.csv" >/dev/null 2>&1 || continue
        for posting in ahead deferred; do
            "$bin" schedule --schedule "$kind" --pp "$1" --microbatches "$2" --comms "$posting" \
                -o "$base.$posting.csv" >/dev/null 2>&1
        done
        "$bin" schedule --schedule "$kind" --pp "$1" --microbatches "$2" --comms ahead --fsdp \
            -o "$base.fsdp.csv" >/dev/null 2>&1
        "$bin" schedule --schedule "$kind" --pp "$1" --microbatches "$2" --comms ahead --fsdp \
            --fsdp-defer-wait -o "$base.fsdp-defer.csv" >/dev/null 2>&1
    done
done
# Four and five stages per rank: more than the 3 FSDP keeps gathered, so stages are resharded
# and gathered again.
for kind in interleaved-1f1b looped-bfs; do
    for size in "2 4 4" "3 5 6"; do
        set -- $size
        base="$comms/$kind-p$1-v$2-m$3"
        "$bin" schedule --schedule "$kind" --pp "$1" --vpp "$2" --microbatches "$3" -o "$base.csv" >/dev/null
        for posting in ahead deferred; do
            "$bin" schedule --schedule "$kind" --pp "$1" --vpp "$2" --microbatches "$3" \
                --comms "$posting" -o "$base.$posting.csv" >/dev/null 2>&1
        done
        "$bin" schedule --schedule "$kind" --pp "$1" --vpp "$2" --microbatches "$3" \
            --comms ahead --fsdp -o "$base.fsdp.csv" >/dev/null 2>&1
        "$bin" schedule --schedule "$kind" --pp "$1" --vpp "$2" --microbatches "$3" \
            --comms ahead --fsdp --fsdp-defer-wait -o "$base.fsdp-defer.csv" >/dev/null 2>&1
    done
done
"$py" scripts/interop/comms_check.py "$comms"
