#!/usr/bin/env bash
# The default split solver (branch and bound) against HiGHS's MILP on the README's main job and
# on the configurations of every file in examples/: the chosen plan (schedule, dp, pp, v, token
# budget, layer split, recomputation) must be the same, and the whole `plan` command's time is
# printed for both. Needs cmake and libclang (HiGHS is built from source by highs-sys):
#   apt-get install cmake libclang1-14 && scripts/solver-parity.sh
# Exit 0 when every plan matches, 1 otherwise.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --features highs --quiet
bin=target/release/flatpipe
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT

cases=(
    "readme-main-job|"
    "examples/plan.yaml|--model llama3.1-8b --hardware h200 --workload sharegpt-v3 --ranks 4"
    "examples/cpu-tiny/plan.yaml|--model tiny --hardware cpu --workload tiny-chat --ranks 2 --pp 2 --schedule gpipe,1f1b,interleaved-1f1b,looped-bfs,zb-h1,zb-h2,zb-v,dualpipev --recompute none --token-budgets 256,512,1024 --steps 32"
    "examples/gpu/llama3.1-8b-8layers.yaml|--model examples/gpu/llama3.1-8b-8layers.yaml --hardware h200 --workload sharegpt-v3 --ranks 4"
    "llama3.1-70b-16-ranks|--model llama3.1-70b --ranks 16"
)
status=0
printf '%-40s %-10s %-10s %s\n' case bnb_s highs_s "chosen plan (same for both?)"
for c in "${cases[@]}"; do
    name=${c%%|*}
    args=${c#*|}
    for solver in bnb highs; do
        start=$EPOCHREALTIME
        # shellcheck disable=SC2086
        "$bin" plan $args --split-solver "$solver" --format json --gantt "$out/g.png" \
            >"$out/$solver.json" 2>"$out/$solver.err" || { cat "$out/$solver.err"; exit 1; }
        end=$EPOCHREALTIME
        awk -v a="$start" -v b="$end" 'BEGIN { printf "%.2f", b - a }' >"$out/$solver.time"
    done
    verdict=$(python3 - "$out/bnb.json" "$out/highs.json" <<'EOF'
import json, sys
def key(path):
    c = json.load(open(path))["chosen"]
    return (c["schedule"], c["dp"], c["pp"], c["vpp"], c["token_budget"],
            "/".join(str(s["end"] - s["start"]) for s in c["stages"]),
            ",".join(c["recompute"]))
a, b = key(sys.argv[1]), key(sys.argv[2])
print(("same: " if a == b else "DIFFERENT: ") + str(a) + ("" if a == b else " vs " + str(b)))
EOF
)
    printf '%-40s %-10s %-10s %s\n' "$name" "$(cat "$out/bnb.time")" "$(cat "$out/highs.time")" "$verdict"
    [[ $verdict == same* ]] || status=1
done
exit $status
