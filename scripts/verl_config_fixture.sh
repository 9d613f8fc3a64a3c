#!/usr/bin/env bash
# Writes tests/data/verl/ppo_megatron_trainer.v0.7.0.yaml: verl's own flattened Megatron trainer
# configuration (verl/trainer/config/_generated_ppo_megatron_trainer.yaml, which verl generates
# from ppo_megatron_trainer.yaml) at tag v0.7.0, commit f9c855f7cf04d603c9546bc01776c74806a879c1.
# The verl export's test checks every override it writes against it: read from verl's source,
# not by installing verl. Needs git and the network; run from the repository's root.
set -euo pipefail
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
git clone --quiet --filter=blob:none --no-checkout https://github.com/volcengine/verl "$tmp/verl"
git -C "$tmp/verl" show v0.7.0:verl/trainer/config/_generated_ppo_megatron_trainer.yaml \
    > tests/data/verl/ppo_megatron_trainer.v0.7.0.yaml
