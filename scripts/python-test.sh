#!/usr/bin/env bash
# Builds the flatpipe Python package (python/, PyO3 + maturin, an abi3 wheel), installs it into
# the test environment (scripts/python-env.sh) and runs its tests with pytest: the native
# module's, and the torch.distributed runtime's in 2 and 4 gloo processes on the CPU (they run
# here, they do not skip). The tests that compare with the flatpipe binary use the one cargo
# built (release, else debug).
set -euo pipefail
cd "$(dirname "$0")/.."
py=$(scripts/python-env.sh)
rm -rf target/wheels
"$py" -m maturin build --release --quiet -m python/Cargo.toml -o target/wheels
"$py" -m pip install -q --force-reinstall --no-deps target/wheels/flatpipe-*.whl
if [[ ! -x target/release/flatpipe && ! -x target/debug/flatpipe ]]; then
    cargo build --quiet --bin flatpipe
fi
# From the repository's root, so that python/flatpipe (the sources, without the native module)
# does not shadow the installed package.
"$py" -m pytest -q python/tests "$@"
