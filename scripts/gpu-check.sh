#!/usr/bin/env bash
# GPU check: one command, run on a host with an NVIDIA GPU and binaries built elsewhere (the GPU
# host may have no Rust toolchain and no internet). Build them on a Linux x86-64 machine first:
#
#   cargo build --release                                    # target/release/flatpipe
#   cargo test --release -p flatpipe-executor --features cuda --test gpu --no-run
#                                                            # target/release/deps/gpu-<hash>
#
# then copy the working tree with those two files and run, from the repository root:
#
#   scripts/gpu-check.sh [OUT_DIR]
#
# It needs the NVIDIA driver (libcuda.so) and NVRTC and cuBLAS (libnvrtc.so, libcublas.so: the
# CUDA toolkit, or PyTorch's nvidia-* wheels on LD_LIBRARY_PATH). Steps, each writing to OUT_DIR
# (default gpu-check-out):
#   1. the GPU tests with FLATPIPE_REQUIRE_GPU=1 (a missing device or NVRTC fails them): NVRTC
#      compiles the kernels, a CUDA stage equals the CPU stage in F / I / W, and pipelined CUDA
#      steps (1F1B, ZB-H1, GPipe, ZB-V) equal the single-rank CPU reference;
#   2. the profile of Llama-3.1-8B's layers (examples/gpu/llama3.1-8b-8layers.yaml, bf16 GEMM
#      math) with 4 streams busy, as the 4-rank runs will be, cuBLAS GEMM TFLOP/s, and the GEMMs
#      split 2, 4 and 8 ways (tensor parallelism) against whole (the profile's gemm_split);
#   3. 4-rank 1F1B and ZB-H1 runs of that model on ShareGPT lengths, predicted against measured,
#      with Gantt charts and Chrome traces of the measured timelines;
#   4. a small run checked against the CPU reference (--verify) on the GPU;
#   5. with FLATPIPE_PY set to a python with CUDA torch and the flatpipe wheel built here
#      (`scripts/python-test.sh` leaves it in target/wheels; installed with --no-deps if
#      missing): two of Llama-3.1-8B's layers profiled in bf16 with PyTorch's own kernels
#      (python/bench/torch_profile_gpu.py), compared with step 2's profile and the analytic one,
#      and the README's main job planned from it.
# On an H200 (2026-12-04, one pass) the steps took 6 s, 185 s, 35 s per run and 2 s: 267 s in all
# (docs/gpu/h200-2026-12-04/).
# FLATPIPE_STEP_TIMEOUT=SECONDS stops any one command that runs longer (a hung kernel or a slow
# step then costs that much, and the steps after it still run); unset or 0, no limit.
set -euo pipefail

out=${1:-gpu-check-out}
bin=${FLATPIPE_BIN:-target/release/flatpipe}
model=examples/gpu/llama3.1-8b-8layers.yaml
mkdir -p "$out"
limit=${FLATPIPE_STEP_TIMEOUT:-0}

if [ ! -x "$bin" ]; then
    echo "no flatpipe binary at $bin: build it with cargo build --release (or set FLATPIPE_BIN)" >&2
    exit 2
fi
# The newest build of the GPU tests (older builds keep their own hashes).
gpu_test=$(find target/release/deps -maxdepth 1 -type f -name 'gpu-*' ! -name '*.d' -perm -u+x -printf '%T@ %p\n' \
    | sort -rn | head -n 1 | cut -d' ' -f2-)
if [ -z "$gpu_test" ]; then
    echo "no GPU test binary in target/release/deps: cargo test --release -p flatpipe-executor --features cuda --test gpu --no-run" >&2
    exit 2
fi

# NVRTC and cuBLAS: the CUDA toolkit's libraries, or the nvidia-* wheels of a Python install
# (PyTorch's), when they are not on the loader's path already.
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib \
    $(python3 -c 'import glob, os, nvidia; print(" ".join(d for p in nvidia.__path__ for d in glob.glob(os.path.join(p, "*", "lib"))))' 2>/dev/null); do
    if [ -d "$d" ]; then
        LD_LIBRARY_PATH="$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    fi
done
export LD_LIBRARY_PATH
{
    echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "flatpipe: $("$bin" --version 2>&1)"
    echo "commit: $(git rev-parse HEAD 2>/dev/null || echo unknown)"
    echo "LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}"
} > "$out/environment.txt"
(nvidia-smi || true) > "$out/nvidia-smi.txt" 2>&1
status=0

echo "== 1. GPU tests ($gpu_test)"
FLATPIPE_REQUIRE_GPU=1 timeout "$limit" "$gpu_test" --nocapture --test-threads 1 2>&1 | tee "$out/gpu-tests.txt" || status=1

echo "== 2. profile of Llama-3.1-8B layers (bf16 GEMM math, 4 streams busy)"
timeout "$limit" "$bin" profile --backend cuda --precision bf16 --model "$model" --concurrency 4 \
    -o "$out/h200-llama3.1-8b-profile.yaml" 2>&1 | tee "$out/profile.txt" || status=1

echo "== 3. 4-rank 1F1B and ZB-H1 on ShareGPT lengths, predicted vs measured"
if [ -f "$out/h200-llama3.1-8b-profile.yaml" ]; then
    for s in 1f1b zb-h1; do
        timeout "$limit" "$bin" execute --backend cuda --precision bf16 --init-on-device \
            --model "$model" --workload sharegpt-v3 --profile "$out/h200-llama3.1-8b-profile.yaml" \
            --pp 4 --schedule "$s" --token-budget 4096 --tokens-per-step 32768 --warmup-steps 1 --steps 3 \
            --gantt "$out/gantt-$s.png" --trace "$out/trace-$s.json" 2>&1 | tee "$out/execute-$s.txt" || status=1
    done
else
    echo "skipped: step 2 wrote no profile (see $out/profile.txt)" | tee "$out/execute-skipped.txt"
    status=1
fi

echo "== 4. the CPU example on the GPU, checked against the CPU reference"
timeout "$limit" "$bin" execute --backend cuda --plan examples/cpu-tiny/plan.yaml --steps 2 --seqs-per-step 8 --verify \
    --gantt "$out/cpu-tiny-on-gpu.png" 2>&1 | tee "$out/verify.txt" || status=1

if [ -n "${FLATPIPE_PY:-}" ]; then
    echo "== 5. Llama-3.1-8B layers profiled with PyTorch's kernels, and the main job planned from it"
    if ! "$FLATPIPE_PY" -c "import flatpipe" 2>/dev/null; then
        "$FLATPIPE_PY" -m pip install -q --no-deps target/wheels/flatpipe-*.whl || status=1
    fi
    compare=()
    [ -f "$out/h200-llama3.1-8b-profile.yaml" ] && compare=(--compare "$out/h200-llama3.1-8b-profile.yaml")
    timeout "$limit" "$FLATPIPE_PY" python/bench/torch_profile_gpu.py "$out/torch-profile" "${compare[@]}" \
        2>&1 | tee "$out/torch-profile.txt" || status=1
    if [ -f "$out/torch-profile/torch-profile.yaml" ]; then
        timeout "$limit" "$bin" plan --profile "$out/torch-profile/torch-profile.yaml" --gantt "$out/plan-torch-profile.png" \
            2>&1 | tee "$out/plan-torch-profile.txt" || status=1
    fi
fi

echo "results in $out/ (exit $status)"
exit $status
