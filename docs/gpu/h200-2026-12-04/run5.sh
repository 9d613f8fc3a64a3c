#!/usr/bin/env bash
# 2026-12-04 evening, one device call: the whole scripts/gpu-check.sh with the fixes, in one pass.
# Outputs copied to this folder as run5-* (gpu-check.log holds every step's output with times), the
# profile as h200-llama3.1-8b-8layers-bf16-concurrency4-run5.yaml.
set -o pipefail
mkdir -p target/release/deps && cp .gpu/gpu-* target/release/deps/
o=/tmp/gc5; start=$(date +%s)
FLATPIPE_BIN=.gpu/flatpipe FLATPIPE_STEP_TIMEOUT=300 scripts/gpu-check.sh $o 2>&1 \
  | while IFS= read -r l; do printf '%s %s\n' "$(date +%T)" "$l"; done | tee $o.log
echo "gpu-check rc=${PIPESTATUS[0]} wall=$(( $(date +%s) - start )) s" | tee -a $o.log
cp $o.log $o/gpu-check.log
tar czf "$OUT/gc5.tgz" -C /tmp gc5
