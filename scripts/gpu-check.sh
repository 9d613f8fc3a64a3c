#!/usr/bin/env bash
# GPU check: run on a host with an NVIDIA GPU and binaries built elsewhere (the GPU host may have
# no Rust toolchain and no internet). Build them on a Linux x86-64 machine first:
#
#   cargo build --release                                   # target/release/flatpipe
#   cargo test --release -p flatpipe-executor --features cuda --test gpu --no-run   # target/release/deps/gpu-<hash>
#
# then copy the working tree with those two files and run, from the repository root:
#
#   scripts/gpu-check.sh [OUT_DIR]
#
# It runs the GPU tests with FLATPIPE_REQUIRE_GPU=1 (a missing device fails them), times cuBLAS
# GEMMs at Llama-3.1-8B's layer shapes, and runs the CPU example as a sanity check of the binary,
# writing everything to OUT_DIR (default gpu-check-out). Still owed until the CUDA stage worker
# exists: the per-layer Llama-3.1-8B profile and the 4-rank 1F1B / ZB-H1 runs on real input.
set -euo pipefail

out=${1:-gpu-check-out}
bin=${FLATPIPE_BIN:-target/release/flatpipe}
mkdir -p "$out"

if [ ! -x "$bin" ]; then
    echo "no flatpipe binary at $bin: build it with cargo build --release (or set FLATPIPE_BIN)" >&2
    exit 2
fi
gpu_test=$(find target/release/deps -maxdepth 1 -type f -name 'gpu-*' ! -name '*.d' -perm -u+x | head -n 1)
if [ -z "$gpu_test" ]; then
    echo "no GPU test binary in target/release/deps: cargo test --release -p flatpipe-executor --features cuda --test gpu --no-run" >&2
    exit 2
fi

(nvidia-smi || true) > "$out/nvidia-smi.txt" 2>&1
echo "GPU tests ($gpu_test)"
FLATPIPE_REQUIRE_GPU=1 "$gpu_test" --nocapture 2>&1 | tee "$out/gpu-tests.txt"
echo "cuBLAS GEMMs at Llama-3.1-8B layer shapes"
"$bin" profile --backend cuda | tee "$out/gemms.txt"
"$bin" profile --backend cuda --format json > "$out/gemms.json" 2>/dev/null
echo "CPU example (sanity check of the binary)"
"$bin" execute --plan examples/cpu-tiny/plan.yaml --steps 1 --seqs-per-step 8 --verify \
    --gantt "$out/cpu-tiny.png" | tee "$out/cpu-execute.txt"
echo "results in $out/"
