#!/usr/bin/env bash
# The simulated tables of runs that drift (`flatpipe drift`), three seeds each, as Markdown:
#   stragglers  Llama 3.1 70B on 1,024 H100s (tp 8 x pp 8 x dp 16, ZeRO-1, zb-auto,
#               flat-planned, 4M tokens of sharegpt-v3 per step, 100 steps) with the cited
#               straggler model: the plan made once, re-planned from the measured speeds
#               (forgetting 0.5), and the oracle;
#   grow        lengths that double linearly over 100 steps (an RL run whose responses
#               lengthen): every token budget held for the run against the budget re-chosen
#               per step (lengths capped at 32,768 tokens, a maximum response length), on Llama 3.1 8B (pp 4 on H200; pp 8 on H100), with zb-auto and
#               flat-planned, and with 1F1B and flat-ffd (no per-step cut planning).
# Usage: scripts/drift.sh [OUT_DIR]   (OUT_DIR keeps the JSON)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-}
cargo build --release --quiet --bin flatpipe
bin=target/release/flatpipe
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for seed in 1 2 3; do
    "$bin" drift --profile llama3.1-70b@h100 --tp 8 --pp 8 --dp 16 --sharding zero1 \
        --tokens-per-step 4000000 --steps 100 --stragglers --seed "$seed" --format json \
        >"$tmp/stragglers-$seed.json" 2>/dev/null
    "$bin" drift --profile llama3.1-8b@h200 --pp 4 --steps 100 --grow 2 --max-len 32768 --seed "$seed" \
        --format json >"$tmp/grow-h200-$seed.json" 2>/dev/null
    "$bin" drift --profile llama3.1-8b@h100 --pp 8 --steps 100 --grow 2 --max-len 32768 --seed "$seed" \
        --format json >"$tmp/grow-h100-$seed.json" 2>/dev/null
    "$bin" drift --profile llama3.1-8b@h200 --pp 4 --steps 100 --grow 2 --max-len 32768 --seed "$seed" \
        --schedule 1f1b --policy flat-ffd --format json >"$tmp/grow-1f1b-$seed.json" 2>/dev/null
done
[ -n "$out" ] && mkdir -p "$out" && cp "$tmp"/*.json "$out"/
python3 - "$tmp" <<'PY'
import json, math, statistics as st, sys
d = sys.argv[1]
mean = lambda v: sum(v) / len(v)
pct = lambda x, of: f"{100 * (x / of - 1):+.1f}%"
print("| seed | ideal | planned once | re-planned | oracle | re-planned vs once | vs oracle | planning per step |")
print("|---|---|---|---|---|---|---|---|")
rows = []
for seed in (1, 2, 3):
    j = json.load(open(f"{d}/stragglers-{seed}.json"))
    i, f, r, o = (mean(j[k]) for k in ("ideal_s", "fixed_s", "replanned_s", "oracle_s"))
    p = mean(j["planning_s"])
    rows.append((i, f, r, o, p))
    print(f"| {seed} | {i:.3f} s | {f:.3f} s ({pct(f, i)}) | {r:.3f} s | {o:.3f} s | {pct(r, f)} | {pct(r, o)} | {1e3 * p:.1f} ms ({100 * p / r:.2f}%) |")
m = [st.median(x) for x in zip(*rows)]
print(f"| median | {m[0]:.3f} s | {m[1]:.3f} s ({pct(m[1], m[0])}) | {m[2]:.3f} s | {m[3]:.3f} s | {pct(m[2], m[1])} | {pct(m[2], m[3])} | {1e3 * m[4]:.1f} ms ({100 * m[4] / m[2]:.2f}%) |")
print()
for name, label in (("h200", "8B, pp 4, H200, zb-auto + flat-planned"),
                    ("h100", "8B, pp 8, H100, zb-auto + flat-planned"),
                    ("1f1b", "8B, pp 4, H200, 1F1B + flat-ffd")):
    runs = [json.load(open(f"{d}/grow-{name}-{seed}.json")) for seed in (1, 2, 3)]
    budgets = [b["budget"] for b in runs[0]["budgets"]]
    print(f"{label}: mean step per budget held for the run, against the budget re-chosen per step (median of three seeds)")
    print()
    print("| budget | " + " | ".join(str(b) for b in budgets) + " | re-planned | first step's best, held | planning per step |")
    print("|---|" + "---|" * (len(budgets) + 3))
    cells, rep, first, plan = [], [], [], []
    for j in runs:
        r = mean([x for x in j["replanned_s"] if x is not None and math.isfinite(x)])
        rep.append(r)
        row = []
        for b in j["budgets"]:
            fits = all(b["fits"])
            row.append(mean(b["step_s"]) if fits else None)
        cells.append(row)
        b0 = j["replanned_budget"][0]
        arm = next(b for b in j["budgets"] if b["budget"] == b0)
        first.append(mean(arm["step_s"]) if all(arm["fits"]) else float("nan"))
        plan.append(mean(j["planning_s"]))
    r = st.median(rep)
    out = []
    for k in range(len(budgets)):
        col = [c[k] for c in cells]
        out.append("over memory" if any(x is None for x in col) else f"{st.median(col):.3f} s ({pct(st.median(col), r)})")
    fm = st.median(first)
    pm = st.median(plan)
    print(f"| mean step | " + " | ".join(out) + f" | {r:.3f} s | {fm:.3f} s ({pct(fm, r)}) | {1e3 * pm:.1f} ms ({100 * pm / r:.2f}%) |")
    print()
PY
