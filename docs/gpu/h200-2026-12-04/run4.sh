#!/usr/bin/env bash
# Fourth device call: the profile at concurrency 1 with each measurement's medians (-v).
set -o pipefail
b=.gpu/flatpipe; m=examples/gpu/llama3.1-8b-8layers.yaml; o=/tmp/gc4; mkdir -p $o
for d in /usr/local/cuda/lib64 $(python3 -c 'import glob, os, nvidia; print(" ".join(d for p in nvidia.__path__ for d in glob.glob(os.path.join(p, "*", "lib"))))' 2>/dev/null); do LD_LIBRARY_PATH="$d:${LD_LIBRARY_PATH:-}"; done; export LD_LIBRARY_PATH
ts() { while IFS= read -r l; do printf '%s %s\n' "$(date +%T)" "$l"; done; }
timeout 225 $b profile -v --backend cuda --precision bf16 --model $m --concurrency 1 -o $o/h200-llama3.1-8b-profile-c1.yaml 2>&1 | ts | tee $o/profile-c1.txt
echo "profile rc=$? $(date +%T)"
