#!/usr/bin/env bash
# The closed loop on a mixture-of-experts model under expert parallelism, on the CPU, fitted on
# one schedule and predicting the others: profile tiny-moe on this machine (`flatpipe profile
# --quick`, as many threads busy as the run's ranks: pp 2 x dp 2 = 4), run three tiny-chat steps
# of ZB-H1 at pp 2 x dp 2 x ep 2 with 8 microbatches per replica (after one unmeasured step) and
# refit the profile on them (`execute --fit-profile`: each phase's costs times its measured over
# predicted busy time; ZB-H1 runs F, I and W as separate actions, so each phase gets its own
# factor), then run three steps of each other schedule and predict them on the refitted profile
# (never fitted on a run it predicts). Prints per schedule the median |error|
# of the predicted makespan over its steps and, for DualPipeV, the predicted and measured
# all-to-all times. Repeats the whole loop RUNS times (default 3), each with its own profile
# and fit. Usage: scripts/moe-closed-loop.sh [RUNS]
set -euo pipefail
cd "$(dirname "$0")/.."
runs=${1:-3}
cargo build --release --quiet --bin flatpipe
bin=target/release/flatpipe
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fit_on=zb-h1
schedules="1f1b interleaved-1f1b dualpipev combined-1f1b"
run_steps() { # schedule, profile, extra arguments
    local s=$1 p=$2
    shift 2
    "$bin" execute --model tiny-moe --profile "$p" --pp 2 --dp 2 --ep 2 \
        --microbatches 8 --schedule "$s" --steps 3 --warmup-steps 1 --format json "$@" \
        >"$tmp/$s.json" 2>/dev/null
}
for run in $(seq 1 "$runs"); do
    "$bin" profile --model tiny-moe --quick --concurrency 4 --output "$tmp/p.yaml" >/dev/null 2>&1
    run_steps "$fit_on" "$tmp/p.yaml" --fit-profile "$tmp/fitted.yaml"
    for s in $schedules; do
        run_steps "$s" "$tmp/fitted.yaml"
    done
    python3 - "$tmp" "$run" "$fit_on" $schedules <<'PY'
import json, statistics, sys
tmp, run, fit_on, schedules = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
f = json.load(open(f"{tmp}/{fit_on}.json"))
k = f["fitted_scale"]
print(f"run {run}  fitted on {fit_on}: F x{k['f']:.3f}  I x{k['i']:.3f}  W x{k['w']:.3f}  optimizer x{k['optimizer']:.3f}"
      f"  (its own steps on the profile: {100 * f['median_abs_rel_error']:.1f}%)")
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
print(f"run {run}  median over the predicted schedules: {100 * statistics.median(errors):.1f}%")
PY
done
