#!/usr/bin/env bash
# The closed loop on a mixture-of-experts model under expert parallelism, on the CPU: profile
# tiny-moe on this machine (`flatpipe profile`, about 4 minutes, as many threads busy as the
# run's ranks: pp 2 x dp 2 = 4; no schedule run enters it), then run three tiny-chat steps of
# each schedule at pp 2 x dp 2 x ep 2 with 8 microbatches per replica (after one unmeasured step)
# and print, per schedule, the median |error| of the predicted makespan over its steps and, for
# DualPipeV, the predicted and measured all-to-all times. Repeats the whole loop RUNS times
# (default 3), each with its own profile. Usage: scripts/moe-closed-loop.sh [RUNS]
set -euo pipefail
cd "$(dirname "$0")/.."
runs=${1:-3}
cargo build --release --quiet --bin flatpipe
bin=target/release/flatpipe
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
schedules="1f1b interleaved-1f1b zb-h1 dualpipev combined-1f1b"
for run in $(seq 1 "$runs"); do
    "$bin" profile --model tiny-moe --concurrency 4 --output "$tmp/p.yaml" >/dev/null 2>&1
    for s in $schedules; do
        "$bin" execute --model tiny-moe --profile "$tmp/p.yaml" --pp 2 --dp 2 --ep 2 \
            --microbatches 8 --schedule "$s" --steps 3 --warmup-steps 1 --format json \
            >"$tmp/$s.json" 2>/dev/null
    done
    python3 - "$tmp" "$run" $schedules <<'PY'
import json, statistics, sys
tmp, run, schedules = sys.argv[1], sys.argv[2], sys.argv[3:]
errors = []
for s in schedules:
    r = json.load(open(f"{tmp}/{s}.json"))
    e = [abs(x["rel_error"]) for x in r["steps"]]
    errors.append(statistics.median(e))
    line = f"run {run}  {s:<17} median |error| {100 * errors[-1]:5.1f}%  (" + ", ".join(
        f"{100 * x['rel_error']:+.1f}%" for x in r["steps"]) + ")"
    if s == "dualpipev":
        x = r["steps"][0]
        p, m = x["predicted_all_to_all"], x["all_to_all"]
        line += (f"  step 0 all-to-all predicted {1e3 * p['exposed_s']:.1f} of {1e3 * p['total_s']:.1f} ms,"
                 f" measured {1e3 * m['exposed_s']:.1f} of {1e3 * m['total_s']:.1f} ms"
                 f" (+ {1e3 * x['all_to_all_wait_s']:.1f} ms waiting for the partner)")
    print(line)
print(f"run {run}  median over the schedules: {100 * statistics.median(errors):.1f}%")
PY
done
