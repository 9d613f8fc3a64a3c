#!/usr/bin/env bash
# Second device call: the profile with timestamped progress, the 4-rank runs, verify vs lr.
set -o pipefail
b=.gpu/flatpipe; m=examples/gpu/llama3.1-8b-8layers.yaml; o=/tmp/gc2; mkdir -p $o
for d in /usr/local/cuda/lib64 $(python3 -c 'import glob, os, nvidia; print(" ".join(d for p in nvidia.__path__ for d in glob.glob(os.path.join(p, "*", "lib"))))' 2>/dev/null); do LD_LIBRARY_PATH="$d:${LD_LIBRARY_PATH:-}"; done; export LD_LIBRARY_PATH
ts() { while IFS= read -r l; do printf '%s %s\n' "$(date +%T)" "$l"; done; }
echo "== profile $(date +%T)"
(nvidia-smi dmon -s u -d 5 > $o/dmon.txt 2>&1 &)
timeout 320 $b profile -v --backend cuda --precision bf16 --model $m --concurrency 4 -o $o/h200-llama3.1-8b-profile.yaml 2>&1 | ts | tee $o/profile.txt
echo "profile rc=$? $(date +%T)"
prof=(); [ -f $o/h200-llama3.1-8b-profile.yaml ] && prof=(--profile $o/h200-llama3.1-8b-profile.yaml)
for s in 1f1b zb-h1; do
  echo "== execute $s $(date +%T)"
  timeout 70 $b execute --backend cuda --precision bf16 --init-on-device --model $m --workload sharegpt-v3 "${prof[@]}" \
    --pp 4 --schedule $s --token-budget 4096 --tokens-per-step 32768 --warmup-steps 1 --steps 3 \
    --gantt $o/gantt-$s.png --trace $o/trace-$s.json 2>&1 | tee $o/execute-$s.txt
done
for lr in 1e-3 1e-6; do
  echo "== verify lr $lr $(date +%T)"
  timeout 30 $b execute --backend cuda --plan examples/cpu-tiny/plan.yaml --steps 2 --seqs-per-step 8 --verify --lr $lr 2>&1 | tee $o/verify-lr$lr.txt
done
pkill -f "nvidia-smi dmon"; echo "done $(date +%T)"
