#!/usr/bin/env python3
"""Writes tests/data/verl_kk_partitions.json: microbatch partitions made by verl's own
`rearrange_micro_batches`, for `tests/verl_kk.rs` to compare flatpipe's `verl-kk` with.

verl is not a dependency and nothing of it is copied into this repository: the script loads
verl's `verl/utils/seqlen_balancing.py` from a checkout given on the command line, with
stand-ins for the three verl modules it imports that the partitioning does not use
(`verl.protocol`, `verl.utils.tensordict_utils`, `verl.utils.device`). It needs torch.

    git clone https://github.com/verl-project/verl /tmp/verl
    git -C /tmp/verl checkout 1dda039b9c6311889a9c9a26040677e1254814f9
    .venv/bin/python scripts/verl_kk_fixture.py /tmp/verl/verl/utils/seqlen_balancing.py \
        tests/data/verl_kk_partitions.json

The cases are seeded. Only cases whose parts all fit the budget are kept: this verl commit
predates PR #7553 (repartitioning until every part fits), which flatpipe models, so on the
other cases the two differ by design.
"""

import importlib.util
import json
import random
import sys
import types

import torch


def load_verl(path):
    for name in ["verl", "verl.utils"]:
        sys.modules.setdefault(name, types.ModuleType(name))
    protocol = types.ModuleType("verl.protocol")
    protocol.DataProto = object
    tu = types.ModuleType("verl.utils.tensordict_utils")
    tu.index_select_tensor_dict = lambda batch, idx: None
    device = types.ModuleType("verl.utils.device")
    device.get_device_name = lambda: "cpu"
    sys.modules["verl.protocol"] = protocol
    sys.modules["verl.utils.tensordict_utils"] = tu
    sys.modules["verl.utils.device"] = device
    sys.modules["verl.utils"].tensordict_utils = tu
    sys.modules["verl.utils"].device = device
    spec = importlib.util.spec_from_file_location("verl_seqlen_balancing", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main():
    src, out = sys.argv[1], sys.argv[2]
    verl = load_verl(src)
    rng = random.Random(20261203)
    cases = []
    tries = 0
    while len(cases) < 60 and tries < 1000:
        tries += 1
        n = rng.randint(2, 96)
        if tries % 5 == 0:
            # Many equal lengths: the tie-breaking paths.
            lens = [rng.choice([64, 128, 256]) for _ in range(n)]
        else:
            lens = [max(1, int(rng.lognormvariate(6.0, 1.2))) for _ in range(n)]
        longest = max(lens)
        budget = max(longest, sum(lens) // rng.randint(1, 16) + 1)
        mask = torch.zeros(n, longest, dtype=torch.long)
        for i, s in enumerate(lens):
            mask[i, :s] = 1
        batch = {"input_ids": torch.zeros(n, longest, dtype=torch.long), "attention_mask": mask}
        _, parts = verl.rearrange_micro_batches(batch, max_token_len=budget)
        if any(sum(lens[i] for i in p) > budget for p in parts):
            continue
        cases.append({"seq_lens": lens, "token_budget": budget, "microbatches": [list(map(int, p)) for p in parts]})
    with open(out, "w") as f:
        json.dump(
            {
                "source": "verl-project/verl 1dda039b9c6311889a9c9a26040677e1254814f9 verl/utils/seqlen_balancing.py rearrange_micro_batches (defaults: use_dynamic_bsz_balance=True, no dp group, no divisor)",
                "script": "scripts/verl_kk_fixture.py",
                "cases": cases,
            },
            f,
            indent=None,
        )
        f.write("\n")
    print(f"{len(cases)} cases from {tries} tries -> {out}")


if __name__ == "__main__":
    main()
