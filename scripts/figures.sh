#!/usr/bin/env bash
# Writes docs/performance.md: one table of the figures the README and the guides in docs/ quote.
#
#   scripts/figures.sh [--bench] [--out FILE]
#
# - Predictions: runs the CLI commands whose figures the docs quote (`--format json`) with the
#   release binary ($FLATPIPE_BIN, else target/release/flatpipe, built if missing). They are
#   deterministic: the same binary gives the same figures on any machine.
# - Benchmarks: reads criterion's estimates from $CARGO_TARGET_DIR/criterion (else
#   target/criterion), `*/new/estimates.json`, where present. It does not run `cargo bench`
#   unless `--bench` asks for it (the simulator, planner and executor benches; about half an
#   hour on 2 cores).
# - Carried over: measurements that need a run this script does not make (calibration, the
#   PyTorch runtime, whole-process timings, benchmarks not re-run), each with its date and
#   machine, listed in CARRIED below; each row says so.
# The table is written to a temporary file and renamed over the output, so a failed run
# leaves the old page in place.
set -euo pipefail
cd "$(dirname "$0")/.."

bench=0
out=docs/performance.md
while [[ $# -gt 0 ]]; do
    case $1 in
        --bench) bench=1 ;;
        --out) out=$2; shift ;;
        -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
        *) echo "unknown argument: $1 (scripts/figures.sh [--bench] [--out FILE])" >&2; exit 2 ;;
    esac
    shift
done

target=${CARGO_TARGET_DIR:-target}
bin=${FLATPIPE_BIN:-$target/release/flatpipe}
if [[ ! -x $bin ]]; then
    cargo build --release --bin flatpipe
fi
if [[ $bench == 1 ]]; then
    cargo bench --bench simulator
    cargo bench --bench planner
    cargo bench --bench executor
fi

work=$(mktemp -d)
tmp=$(mktemp "$(dirname "$out")/.performance.XXXXXX")
trap 'rm -rf "$work" "$tmp"' EXIT

FIGURES_BIN=$bin FIGURES_WORK=$work FIGURES_CRITERION=$target/criterion \
FIGURES_COMMIT=$(git rev-parse --short HEAD 2>/dev/null || echo unknown) \
python3 - > "$tmp" <<'PY'
import datetime, glob, json, os, platform, subprocess

BIN = os.path.abspath(os.environ["FIGURES_BIN"])
WORK = os.environ["FIGURES_WORK"]
CRITERION = os.environ["FIGURES_CRITERION"]
COMMIT = os.environ["FIGURES_COMMIT"]


def run(args):
    """`flatpipe ARGS --format json` in the scratch directory, parsed."""
    args = [os.path.abspath(a) if a.startswith("examples/") else a for a in args]
    p = subprocess.run([BIN, *args, "--format", "json"], cwd=WORK, capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"flatpipe {' '.join(args)} exited {p.returncode}:\n{p.stderr}")
    return json.loads(p.stdout)


def row(rows, schedule, **match):
    """The result row of `schedule` (and policy, capacity) in a simulate result list."""
    for r in rows:
        if r["schedule"] == schedule and all(r.get(k) == v for k, v in match.items()):
            return r
    raise SystemExit(f"no row {schedule} {match}")


def s(x):
    return f"{x:.3f} s"


def cpu_model():
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


today = datetime.date.today().isoformat()
machine = f"{cpu_model()}, {os.cpu_count()} cores"
rows = []  # (what, figure, how, when and where, source)


def predicted(what, figure, cmd):
    rows.append((what, figure, f"`flatpipe {cmd}`", "deterministic", "prediction, this run"))


# ---- Predictions the README and guides quote ----
plan = run(["plan", "--gantt", "none"])
c, base = plan["chosen"], plan["fsdp_baseline"]
layout = f"tp={c.get('tp', 1)} dp={c.get('dp', 1)} pp={c['pp']} {c.get('sharding', 'ddp')}, budget {c['token_budget']:,}"
predicted("the main job: chosen plan, mean (p90) step",
          f"{s(c['predicted']['step_time_mean_s'])} ({s(c['predicted']['step_time_p90_s'])}), {layout}", "plan")
predicted("the main job: no-pipeline FSDP baseline, mean step",
          f"{s(base['mean_s'])} ({base['candidate']}); chosen {base['chosen_vs_baseline']:+.1%}", "plan")

sim = run(["simulate", "--gantt", "none"])
best = min(sim, key=lambda r: r["makespan_s"])
one = row(sim, "1f1b")
predicted("default step (pp = 4): fastest schedule; 1F1B",
          f"{best['schedule']} {s(best['makespan_s'])} (bubble {best['bubble_ratio']:.1%}); 1f1b {s(one['makespan_s'])}",
          "simulate")
hand = run(["simulate", "--plan", "examples/plan.yaml", "--gantt", "none"])[0]
predicted("`examples/plan.yaml` (layers moved off the head's stage), 1F1B step",
          f"{s(hand['makespan_s'])} against the even split's {s(one['makespan_s'])}",
          "simulate --plan examples/plan.yaml")

zb = run(["simulate", "--costs", "f=1,b=1.5,w=0.8,comm=0.05", "--pp", "8", "--microbatches", "24",
          "--schedule", "1f1b,zb-h1,zb-h2,zb-auto", "--max-activation-units", "12"])
za, h2, h1 = row(zb, "zb-auto"), row(zb, "zb-h2"), row(zb, "zb-h1")
predicted("zb-auto between the handcrafted memory points (12 units)",
          f"zb-auto {za['makespan_s']:.2f} s, bound {za['lower_bound_s']:.2f} s ({za['gap_to_lower_bound']:+.1%}); "
          f"zb-h2 {h2['makespan_s']:.2f} s (15 units), zb-h1 {h1['makespan_s']:.2f} s",
          "simulate --costs f=1,b=1.5,w=0.8,comm=0.05 --pp 8 --microbatches 24 --schedule 1f1b,zb-h1,zb-h2,zb-auto --max-activation-units 12")
cert = run(["simulate", "--costs", "f=1,b=3,w=1,comm=0", "--pp", "8", "--microbatches", "8",
            "--schedule", "1f1b,zb-h1,zb-h2,zb-auto", "--max-activation-units", "8"])
za, ob = row(cert, "zb-auto"), row(cert, "1f1b")
predicted("the lower bound certifies zero-bubble schedules",
          f"zb-auto {za['makespan_s']:.0f} s against {za['lower_bound_s']:.0f} s; 1f1b {ob['makespan_s']:.0f} s against {ob['lower_bound_s']:.0f} s",
          "simulate --costs f=1,b=3,w=1,comm=0 --pp 8 --microbatches 8 --schedule 1f1b,zb-h1,zb-h2,zb-auto --max-activation-units 8")
cons = run(["simulate", "--costs", "f=1,b=1,w=1", "--pp", "4", "--microbatches", "8", "--schedule", "zb-auto",
            "--max-activation-units", "8", "--consecutive-steps", "10", "--zb-objective", "post-validation",
            "--gantt", "none"])[0]["consecutive_steps"]
predicted("zb-auto ranked by its steady state under optimizer post-validation",
          f"{cons['post_validation_step_s']:.3f} s per step (synchronised: {cons['global_sync_step_s']:.3f} s)",
          "simulate --costs f=1,b=1,w=1 --pp 4 --microbatches 8 --schedule zb-auto --max-activation-units 8 --consecutive-steps 10 --zb-objective post-validation")

hol = "--costs f=1,b=2,w=0,comm=0.1 --pp 8 --vpp 2 --microbatches 16 --schedule interleaved-1f1b"
edge = run(["simulate", *hol.split(), "--gantt", "none"])[0]
shared = run(["simulate", *hol.split(), "--p2p-streams", "shared", "--gantt", "none"])[0]
predicted("receives posted ahead on one shared stream (PyTorch issue #188833's case)",
          f"{s(shared['makespan_s'])} (bubble {shared['bubble_ratio']:.1%}) against {s(edge['makespan_s'])} "
          f"({edge['bubble_ratio']:.1%}) on per-edge streams",
          f"simulate {hol} [--p2p-streams shared]")

with open(os.path.join(WORK, "long.csv"), "w") as f:
    f.write("tokens\n131072\n")
whole = run(["simulate", "--workload", "long.csv", "--seqs-per-step", "1", "--pp", "4", "--gantt", "none"])
chunked = run(["simulate", "--workload", "long.csv", "--seqs-per-step", "1", "--pp", "4", "--chunk-tokens", "16384",
               "--gantt", "none"])
bw, bc = min(whole, key=lambda r: r["makespan_s"]), min(chunked, key=lambda r: r["makespan_s"])
predicted("one 131,072-token sequence at pp = 4: whole, and in 8 chunks of 16,384",
          f"{bw['schedule']} {s(bw['makespan_s'])}; chunked {bc['schedule']} {s(bc['makespan_s'])}",
          "simulate --workload long.csv --seqs-per-step 1 --pp 4 [--chunk-tokens 16384]")

mc = run(["simulate", "--schedule", "1f1b", "--policy", "padded,packed,flat-ffd,flat-balanced", "--steps", "1000",
          "--capacity", "dynamic,12", "--gantt", "none"])
fig = ", ".join(f"{p} {row(mc, '1f1b', policy=p, capacity='dynamic')['step_time_s']['mean']:.2f} s"
                for p in ["flat-ffd", "flat-balanced", "packed", "padded"])
predicted("1,000 ShareGPT steps, 1F1B, pp = 4: mean step per policy", fig,
          "simulate --schedule 1f1b --policy padded,packed,flat-ffd,flat-balanced --steps 1000 --capacity dynamic,12")
merged = ["simulate", "--workload", "sharegpt-v3-merged", "--schedule", "zb-h1", "--steps", "200", "--gantt", "none"]
mw, mcn = row(run(merged), "zb-h1"), row(run(merged + ["--chunk-tokens", "16384"]), "zb-h1")
predicted("long-tailed workload, ZB-H1: mean (p99) step, whole and in chunks of 16,384",
          f"{s(mw['step_time_s']['mean'])} ({mw['step_time_s']['p99']:.1f} s) -> "
          f"{s(mcn['step_time_s']['mean'])} ({mcn['step_time_s']['p99']:.1f} s)",
          "simulate --workload sharegpt-v3-merged --schedule zb-h1 --steps 200 [--chunk-tokens 16384]")

# ---- Criterion estimates, where a benchmark run left them ----
for path in sorted(glob.glob(os.path.join(CRITERION, "**", "new", "estimates.json"), recursive=True)):
    name = os.path.relpath(os.path.dirname(os.path.dirname(path)), CRITERION)
    est = json.load(open(path))["mean"]
    lo, hi = est["confidence_interval"]["lower_bound"], est["confidence_interval"]["upper_bound"]

    def t(ns):
        for unit, scale in (("s", 1e9), ("ms", 1e6), ("µs", 1e3)):
            if ns >= scale:
                return f"{ns / scale:.3g} {unit}"
        return f"{ns:.3g} ns"

    when = datetime.date.fromtimestamp(os.path.getmtime(path)).isoformat()
    rows.append((f"criterion `{name}`", f"{t(est['point_estimate'])} mean ({t(lo)} to {t(hi)})",
                 "`cargo bench`", f"{when}, {machine}", "benchmark, read from target/criterion"))

# ---- Carried over: measured by hand, not re-run by this script ----
DEV = "the 2-core x86-64 development machine"
CARRIED = [
    ("whole `flatpipe plan --model deepseek-v3 --hardware h800 --ranks 2048 --workload examples/deepseek-v3-4k.yaml --steps 1 --pp 8,16,32 --gantt none` process (expert parallelism searched)",
     "10.0 s median (9.8-10.1 s), 402 MiB peak", "3 runs", f"2026-12-07, {DEV}"),
    ("whole `flatpipe simulate --costs f=1,b=2,w=1,comm=0.1 --pp 64 --microbatches 4096 --schedule 1f1b --gantt none` process",
     "51 ms median (40-123 ms), 36 MiB peak", "10 runs", f"2026-12-04, {DEV}"),
    ("the same process under other lowerings, against the default in the same call: deferred receives on per-peer streams; ahead receives on peer-pair streams; on one shared stream",
     "0.025 s (x1.16, 36 MiB); 0.091 s (x4.1, 92 MiB); 0.106 s (x4.6, 94 MiB), against 0.021-0.023 s and 36 MiB", "whole-process timer, 10 pairs each", f"2026-12-07, {DEV}"),
    ("replay without timeline, 1F1B p = 64, m = 4,096 (1.04 M DAG nodes)", "57.6 M ops/s (18.1 ms)",
     "criterion mean, `cargo bench --bench simulator`", f"2026-12-04, {DEV}"),
    ("replay with the timeline, same step; generate + validate + replay", "37.9 M ops/s (27.5 ms); 31.6 M ops/s (32.9 ms)",
     "criterion mean", f"2026-12-04, {DEV}"),
    ("zb-auto built for p = 16, m = 64: uniform costs at 16 / 32 units, a Llama-3.1-8B step",
     "0.37 / 0.76 / 0.95 ms", "criterion mean, the slowest of three runs", f"2026-12-04, {DEV}"),
    ("generate, validate and simulate one schedule at p = 32, v = 2, m = 256",
     "GPipe 0.66 ms, 1F1B 0.78, ZB-H1 1.06, ZB-H2 1.04, looped BFS 1.39, DualPipeV 1.47, interleaved 1F1B 2.22, ZB-V 2.33 ms",
     "criterion", f"date not recorded, {DEV}"),
    ("cut one step of 1,024 ShareGPT sequences into microbatches",
     "flat-ffd 0.047 ms, flat-balanced 0.105, packed 0.025, padded 0.026; verl-kk 3.8-4.4 ms",
     "criterion `pack_1024_sequences`", f"2026-12-03, {DEV}"),
    ("flat-planned on one step of 1,024 sequences, p = 8, budget 16,384 with chunks", "3.6 ms (1F1B), 6.9 ms (ZB-V)",
     "criterion `flat_planned`", f"2026-12-03, {DEV}"),
    ("1,000 sampled steps at p = 8, every handcrafted schedule; 1F1B alone", "120 ms; 12.2 ms",
     "criterion `monte_carlo_1000_steps_p8`", f"2026-12-01, {DEV}"),
    ("layer partition, 128 layers into 16 stages under binding memory limits (the DP, proven optimal)", "2.91 ms",
     "criterion, `cargo bench --bench planner --features highs`", f"2026-12-01, {DEV}"),
    ("exact split of 34 layers into 8 ranks x 4 stages, memory-limited: branch and bound; HiGHS", "85 µs; 8.43 s",
     "criterion", f"2026-12-01, {DEV}"),
    ("plan search, Llama-3.1-405B on 1,024 H100 (4 sampled steps of 512 sequences)", "9.99 s (9.56 to 10.56 s)",
     "criterion `search/llama3.1-405b_1024_h100_4_steps`, 10 runs", f"2026-12-02, {DEV}"),
    ("whole `plan` commands, branch and bound; HiGHS", "`examples/plan.yaml`'s: 0.58 s; 40.27 s. `examples/cpu-tiny`'s: 0.04 s; 0.03 s. "
     "`examples/gpu` 8-layer model on 4 ranks: 0.44 s; 1.72 s. Llama-3.1-70B on 16 ranks: 4.9 s (bnb)",
     "`scripts/solver-parity.sh`, one run each; the same plan chosen by both", f"date not recorded, {DEV}"),
    ("a `tiny` decoder layer on 1,024 tokens, each phase against its GEMMs alone",
     "F 16.7 vs 12.7 ms, I 20.4 vs 14.6 ms, W 13.6 vs 11.0 ms; the head within 1.8x", "criterion, `cargo bench --bench executor`",
     f"2026-11-30, {DEV}"),
    ("the executor's interpreter on a backend whose kernels do nothing", "10-15 µs per action (1F1B, ZB-H1, interleaved 1F1B; p = 2, m = 64)",
     "criterion `interpreter_null_backend`", f"2026-11-30, {DEV}"),
    ("`flatpipe calibrate --quick` (`tiny`, pp = 2, nine schedules): median |error| over the schedules",
     "3.2%, 2.9%, 2.4% in three runs on a quiet host; typically 2-8%", "predicted against measured makespan",
     f"2026-12-03, {DEV}"),
    ("full `flatpipe calibrate` (five measured steps per schedule): median |error|", "5.7% (3.8% in an earlier run)",
     "predicted against measured makespan", f"2026-12-03, {DEV}"),
    ("whole `plan --workload` of one 16,777,216-token sequence (`--seqs-per-step 1 --steps 1`, 600 candidates)",
     "3.3 s (63 s before chunk ordering became one pass per rank)", "one run each", f"2026-12-07, {DEV}"),
    ("A Hugging Face Llama (hidden 256, 6 decoders) profiled by `flatpipe.torch.profile`, planned and run (`python/bench/own_model.py`): median |error| over every step",
     "4.6%, 3.0%, 4.3% in three runs (the planned looped BFS alone: 7.7%, 4.3%, 5.4%)", "2 gloo processes, 6 measured steps per schedule after 2 warm-up", f"2026-12-07, {DEV}"),
    ("PyTorch closed loop (`python/bench/closed_loop.py`, fitted on ZB-V): median |error| over six other schedules",
     "1.6-4.8% in five runs of six, 9.6% in the sixth", "12 measured steps after 2 warm-up, gloo", f"2026-12-02, {DEV}"),
    ("MoE closed loop on the CPU executor (`scripts/moe-closed-loop.sh`: tiny-moe, pp 2 x dp 2 x ep 2, fitted on ZB-H1 by `execute --fit-profile`): median |error| over 1F1B, interleaved 1F1B, DualPipeV and combined 1F1B",
     "5.4%, 3.8%, 4.9% in three runs (single schedules 1.2-17.4%)", "3 measured steps per schedule after 1 warm-up, four rank threads", f"2026-12-07, {DEV}"),
    ("flatpipe's PyTorch runtime against PyTorch's `Schedule1F1B` on tiny-chat steps (2 gloo processes)",
     "224-243 ms against 289-327 ms per step (1.19-1.40x)", "`python/bench/vs_torch.py`, three runs", f"2026-12-02, {DEV}"),
    ("the PyTorch runtime's overhead: `plan_step` in Rust; one action's span", "4 µs; 454-751 µs (50-103 µs of it bookkeeping)",
     "`python/bench/overhead.py`, three runs", f"2026-12-02, {DEV}"),
    ("GPU figures (cuBLAS, one decoder layer, predicted against measured steps on one H200)", "see [the CUDA guide](gpu.md#gpu-measurements)",
     "`scripts/gpu-check.sh`", "2026-12-04, one NVIDIA H200"),
]
for what, figure, how, when in CARRIED:
    rows.append((what, figure, how, when, "carried over, not re-measured"))

cell = lambda x: str(x).replace("|", "\\|")
print("# Performance")
print()
print("The figures the README and the guides quote, in one table written by `scripts/figures.sh`")
print(f"on {today} (run at commit {COMMIT}, {machine}). Predictions are deterministic: the")
print("command reproduces them. Benchmarks come from criterion's estimates where a run left them")
print("(`scripts/figures.sh --bench` runs the benches first). Rows marked *carried over* were")
print("measured by hand and are not re-run by the script: their date and machine say when and")
print("where; the development machine is a shared virtual machine whose timings move by about 10%")
print("from one run to the next. Earlier figures are in git's history and [CHANGELOG.md](../CHANGELOG.md).")
print()
print("| what | figure | how | when, where | source |")
print("|---|---|---|---|---|")
for r in rows:
    print("| " + " | ".join(cell(x) for x in r) + " |")
PY
chmod 644 "$tmp"
mv "$tmp" "$out"
echo "wrote $out ($(wc -l < "$out") lines)"
