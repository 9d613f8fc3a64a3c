#!/usr/bin/env bash
# Creates (or reuses) the virtual environment the Python tests and the interop checks run in:
# torch 2.15, torchtitan 0.2.2 and transformers 5.25 from PyPI (the Linux wheel is torch's CUDA
# build, about 6 GB with its libraries, 3 minutes the first time; it runs on the CPU), maturin
# (builds the flatpipe wheel), pytest, numpy and mypy (its stubtest checks the native module's
# stub). Needs python3 with venv, nothing from apt. The location is
# $FLATPIPE_VENV, default .venv at the repository's root. Prints the environment's python.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${FLATPIPE_VENV:-.venv}
py=$venv/bin/python
need='import torch, torchtitan, transformers, yaml, numpy, pytest, maturin, mypy'
if [[ ! -x $py ]] || ! "$py" -c "$need" 2>/dev/null; then
    if [[ ! -x $py ]]; then
        python3 -m venv "$venv" >&2
    fi
    "$py" -m pip install -q "torch==2.15.0" "torchtitan==0.2.2" "transformers==5.25.0" tomli tyro pyyaml numpy \
        "pytest>=8" "maturin>=1.9.4,<2" "mypy>=1.18" >&2
fi
echo "$(cd "$(dirname "$py")" && pwd)/python"
