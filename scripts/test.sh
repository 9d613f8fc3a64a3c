#!/usr/bin/env bash
# The README's test command: every Rust test, then the Python package's (scripts/python-test.sh,
# which creates or reuses the virtual environment with torch). Needs a Rust toolchain, a C
# compiler and python3; nothing from apt.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo test --workspace
scripts/python-test.sh
