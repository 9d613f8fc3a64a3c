#!/usr/bin/env bash
# Predicts every published run of examples/published/runs/ (one TOML file per run: its source,
# what the source states, what flatpipe assumes where it is silent, and the reported result)
# and rewrites docs/fidelity.md, the table of predicted against reported
# (scripts/published_runs.py; --check only checks that the page is current). Needs python3 >= 3.11 (or tomli).
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --quiet --bin flatpipe
python3 scripts/published_runs.py "$@"
