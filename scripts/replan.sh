#!/usr/bin/env bash
# Online re-planning on the CPU executor with a straggler. Profiles tiny on this machine
# (`flatpipe profile --quick`, 2 threads busy as the run's 2 ranks), then runs 40 steps of
# zb-auto at pp 2 (8 microbatches of tiny-chat per step) with rank 1 computing 1.5x slower from
# step 10 on (the `--slow-rank` test hook), three ways:
#   static   every step planned on the profile as measured;
#   replan   every step planned from the current estimate (`--replan`, forgetting 0.7): each
#            rank's stages scaled by what that rank measured against the prediction;
#   oracle   every step planned from the start on the costs the re-planned run ended with
#            (its last estimate written with `--fit-profile`), the slowed rank's included;
#   split    the layer split the re-planned run proposed for the speeds it measured
#            (`--propose-plan`), run as a plan with the same straggler.
# Prints per way the mean measured step time over steps 15-39, the mean busy time of the
# busiest rank over those steps (no plan on this layer split can be faster), and the median
# planning time per step against the step. Repeats the whole thing RUNS times (default 3).
# Usage: scripts/replan.sh [RUNS] [OUT_DIR]   (OUT_DIR keeps the JSON and estimate logs)
set -euo pipefail
cd "$(dirname "$0")/.."
runs=${1:-3}
out=${2:-}
cargo build --release --quiet --bin flatpipe
bin=target/release/flatpipe
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
common=(--model tiny --workload tiny-chat --pp 2 --schedule zb-auto --microbatches 8 --steps 40
    --gantt none --format json --slow-rank 1:1.5:10)
for run in $(seq 1 "$runs"); do
    "$bin" profile --model tiny --quick --concurrency 2 --output "$tmp/p.yaml" >/dev/null 2>&1
    "$bin" execute "${common[@]}" --profile "$tmp/p.yaml" >"$tmp/static-$run.json" 2>/dev/null
    "$bin" execute "${common[@]}" --profile "$tmp/p.yaml" --replan --forgetting 0.7 \
        --fit-profile "$tmp/slowed-$run.yaml" --estimate-log "$tmp/estimate-$run.jsonl" \
        --propose-plan "$tmp/proposed-$run.yaml" >"$tmp/replan-$run.json" 2>/dev/null
    "$bin" execute "${common[@]}" --profile "$tmp/slowed-$run.yaml" >"$tmp/oracle-$run.json" 2>/dev/null
    "$bin" execute --plan "$tmp/proposed-$run.yaml" --steps 40 --gantt none --format json \
        --slow-rank 1:1.5:10 >"$tmp/split-$run.json" 2>/dev/null
    python3 - "$tmp" "$run" <<'PY'
import json, statistics, sys
tmp, run = sys.argv[1], sys.argv[2]
row = {}
for way in ("static", "replan", "oracle", "split"):
    steps = json.load(open(f"{tmp}/{way}-{run}.json"))["steps"][15:40]
    mean = statistics.mean(s["measured_makespan_s"] for s in steps)
    bound = statistics.mean(max(s["rank_busy_s"]) for s in steps)
    row[way] = (mean, bound)
plan = [json.loads(l) for l in open(f"{tmp}/estimate-{run}.jsonl")]
planning = statistics.median(l["planning_s"] for l in plan if l["planning_s"] is not None)
step = statistics.median(l["measured_makespan_s"] for l in plan)
factors = plan[-1]["rank_factors"]
s, r, o, x = row["static"][0], row["replan"][0], row["oracle"][0], row["split"][0]
print(
    f"run {run}  steps 15-39 mean: static {s:.3f} s (busiest rank {row['static'][1]:.3f} s)  "
    f"replan {r:.3f} s ({100 * (r / s - 1):+.1f}% vs static, {100 * (r / o - 1):+.1f}% vs oracle; busiest {row['replan'][1]:.3f} s)  "
    f"oracle {o:.3f} s  proposed split {x:.3f} s ({100 * (x / s - 1):+.1f}% vs static)  |  planning {1e3 * planning:.2f} ms per step = {100 * planning / step:.3f}% of a {step:.3f} s step  "
    f"|  rank factors at the end {factors[0]:.2f}, {factors[1]:.2f}"
)
PY
done
if [[ -n $out ]]; then
    mkdir -p "$out"
    cp "$tmp"/*.json "$tmp"/*.jsonl "$out"/
fi
