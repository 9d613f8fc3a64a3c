#!/usr/bin/env bash
# Third device call: --verify with the parameter check on the pipelined gradients.
set -o pipefail
b=.gpu/flatpipe; o=/tmp/gc3; mkdir -p $o
for d in /usr/local/cuda/lib64 $(python3 -c 'import glob, os, nvidia; print(" ".join(d for p in nvidia.__path__ for d in glob.glob(os.path.join(p, "*", "lib"))))' 2>/dev/null); do LD_LIBRARY_PATH="$d:${LD_LIBRARY_PATH:-}"; done; export LD_LIBRARY_PATH
FLATPIPE_REQUIRE_GPU=1 timeout 60 .gpu/gpu-* --test-threads 1 2>&1 | tee $o/gpu-tests.txt
i=0
for a in "--plan examples/cpu-tiny/plan.yaml" "--model tiny --schedule zb-v --pp 2" "--model tiny --schedule 1f1b --pp 4" "--model tiny --schedule dualpipev --pp 2" "--model tiny --schedule interleaved-1f1b --pp 2 --vpp 2"; do
  i=$((i+1)); echo "== verify $a $(date +%T)"
  timeout 40 $b execute --backend cuda $a --steps 3 --seqs-per-step 8 --verify 2>&1 | tee $o/verify-$i.txt; echo "rc=$?"
done
echo "done $(date +%T)"
