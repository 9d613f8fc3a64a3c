#!/usr/bin/env bash
# Reproduces docs/planning.md's table of published large-scale runs against flatpipe's predictions
# (release binary; each command prints the configuration's predicted step, MFU and memory).
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --quiet
f=target/release/flatpipe
llama=(--model llama3.1-405b --hardware h100 --workload examples/published/llama3-405b-8k-16m.yaml)
# Llama 3 405B at 8K (Dubey et al. 2024, Table 4): tp 8 x pp 16 x dp 64 and x dp 128, FSDP,
# the interleaved schedule (one layer per virtual stage: 128 = 126 decoders, the embedding and
# the head, each alone), one sequence per microbatch.
for dp in 64 128; do
    $f simulate "${llama[@]}" --tp 8 --pp 16 --dp $dp --sharding fsdp --schedule interleaved-1f1b \
        --vpp 8 --token-budget 8192 --gantt none
done
# What flatpipe plans for the same 8,192 GPUs and batch.
$f plan "${llama[@]}" --ranks 8192 --pp 8,16,32,64 --steps 2 --keep 3 --gantt none
# GPT-3 175B on 1,536 A100s (Narayanan et al. 2021, Table 2): tp 8 x pp 12 x dp 16.
$f simulate --plan examples/published/gpt3-175b-1536.yaml --gantt none
