#!/usr/bin/env bash
# Regenerates the images in docs/ (the README's and the guides') with the release binary, from
# the commands the docs show next to each image. The measured chart (execute on the CPU)
# differs from run to run.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release
f=target/release/flatpipe
$f plan --gantt docs/gantt-plan.png > /dev/null
$f simulate --schedule zb-v --gantt docs/gantt-default.png > /dev/null
$f simulate --schedule dualpipev --gantt docs/gantt-dualpipev.png > /dev/null
$f simulate --costs f=1,b=1,w=1 --schedule 1f1b --pp 4 --microbatches 8 \
    --gantt docs/gantt-uniform-1f1b.png > /dev/null
for streams in per-peer shared; do
    name=$([ "$streams" = per-peer ] && echo per-edge || echo shared)
    $f simulate --costs f=1,b=2,w=0,comm=0.1 --pp 8 --vpp 2 --microbatches 16 \
        --schedule interleaved-1f1b --p2p-streams "$streams" --gantt "docs/gantt-p2p-$name.png" > /dev/null
done
$f simulate --costs f=1,b=2,w=0,comm=0.1,ag=6,rs=6 --pp 4 --microbatches 8 \
    --schedule interleaved-1f1b --fsdp --gantt docs/gantt-fsdp-interleaved.png > /dev/null
$f simulate --schedule 1f1b --policy padded,packed,flat-ffd,flat-balanced --steps 1000 \
    --capacity dynamic,12 --gantt none --histogram docs/histogram-sharegpt-v3.png > /dev/null
$f execute --plan examples/cpu-tiny/plan.yaml --gantt docs/gantt-execute-zb-h2.png > /dev/null
$f execute --model tiny-moe --pp 2 --dp 2 --ep 2 --schedule dualpipev --microbatches 4 --steps 1 \
    --gantt docs/gantt-execute-moe-dualpipev.png > /dev/null
echo "regenerated: $(ls docs/*.png | tr '\n' ' ')"
