"""Loads flatpipe's torchtitan exports with torchtitan's own configuration parser.

Usage: python torchtitan_check.py DIR...   (each DIR holds plan.yaml and its exports)

For every `*.torchtitan.toml` in the directories: torchtitan 0.2.x's `ConfigManager` parses it
the way `run_train.sh --job.config_file` does (unknown fields and bad values are refused there),
and the parsed values are checked against the plan file next to it: the pipeline degree, the
schedule (a name torch's `get_schedule_class` knows, or a CSV whose every action torch's
`_Action.from_str` parses, with one row per rank), one model part per stage, one packed row of
the token budget per microbatch, the model flavor (a flat Llama-3.1-8B plan's is torchtitan's
varlen one, whose block_causal mask keeps a row's documents apart), the activation
checkpointing mode, the context-parallel degree and rotate method (with torchtitan's own check of
the model flavor against cp and its sequence-length divisor), the tensor- and expert-parallel degrees (torchtitan's `ParallelDims` checks
the expert-parallel one against the data-parallel shards)
and the data-parallel degrees: torchtitan's `ParallelDims` accepts them for tp x dp x pp GPUs,
they are what the plan's sharding maps to (FSDP shard degree dp; HSDP replicate x shard; DDP replicate dp), and never
DDP with a pipeline (torchtitan's `apply_ddp` refuses more than one mesh dimension). Exits 1 on
the first mismatch. Written for flatpipe's .ci/run (scripts/interop-check.sh).
"""

import csv
import os
import sys

import yaml
from torch.distributed.pipelining.schedules import _Action, get_schedule_class
from torchtitan.config import ConfigManager
from torchtitan.distributed import ParallelDims


def check(toml_path: str) -> None:
    base = toml_path[: -len(".torchtitan.toml")]
    with open(base + ".yaml") as f:
        plan = yaml.safe_load(f)
    cfg = ConfigManager().parse_args(["--job.config_file", toml_path])
    par = cfg.parallelism
    assert par.pipeline_parallel_degree == plan["pp"], (par.pipeline_parallel_degree, plan["pp"])
    assert len(par.module_fqns_per_model_part) == len(plan["stages"])
    assert par.pipeline_parallel_microbatch_size == 1
    assert cfg.training.seq_len == plan["token_budget"]
    if par.pipeline_parallel_schedule_csv:
        path = os.path.join(os.path.dirname(toml_path), par.pipeline_parallel_schedule_csv)
        with open(path, newline="") as f:
            rows = [r for r in csv.reader(f) if r]
        assert len(rows) == plan["pp"], (len(rows), plan["pp"])
        for row in rows:
            for cell in row:
                if cell.strip():
                    _Action.from_str(cell.strip())
        schedule = f"CSV {os.path.basename(path)}"
    else:
        get_schedule_class(par.pipeline_parallel_schedule)
        schedule = par.pipeline_parallel_schedule
    # The model: a flavor torchtitan defines; a flat plan on Llama-3.1-8B runs varlen attention
    # (FlexAttention with context parallelism, which varlen does not run) with the documents of
    # a row kept apart (block_causal), as the plan predicted.
    cp_plan = plan.get("context_parallel") or {"cp": 1}
    cp = cp_plan["cp"]
    from torchtitan.models.llama3 import llama3_args

    if cfg.model.name == "llama3" and plan.get("model") == "llama3.1-8b":
        args = llama3_args[cfg.model.flavor]
        if plan.get("policy", "flat-ffd") not in ("padded", "packed"):
            attn = "flex" if cp > 1 else "varlen"
            assert (args.attn_type, args.attn_mask_type) == (attn, "block_causal"), (
                cfg.model.flavor,
                args.attn_type,
                args.attn_mask_type,
            )
    dp = plan.get("dp") or 1
    sharding = plan.get("sharding", "ddp")
    tp = plan.get("tp") or 1
    ep = plan.get("ep") or 1
    assert par.context_parallel_degree == cp, (par.context_parallel_degree, cp)
    if cp > 1:
        # Ring attention: the plan's p2p ring rotates by all-to-all, its allgather all-gathers.
        rotate = {"p2p": "alltoall", "allgather": "allgather"}[cp_plan["comm"]]
        assert par.context_parallel_rotate_method == rotate, (par.context_parallel_rotate_method, rotate)
        # torchtitan's own check of the model against cp (varlen attention raises).
        if cfg.model.name == "llama3":
            import copy

            from torchtitan.models.llama3 import llama3_args

            copy.deepcopy(llama3_args[cfg.model.flavor]).update_from_config(cfg)
    assert par.tensor_parallel_degree == tp, (par.tensor_parallel_degree, tp)
    assert par.expert_parallel_degree == ep, (par.expert_parallel_degree, ep)
    etp = par.expert_tensor_parallel_degree if ep > 1 else 1
    assert ep == 1 or etp == tp, (etp, tp)
    dims = ParallelDims(
        dp_replicate=par.data_parallel_replicate_degree,
        dp_shard=par.data_parallel_shard_degree,
        cp=cp,
        tp=tp,
        pp=plan["pp"],
        ep=ep,
        etp=etp,
        world_size=dp * plan["pp"] * tp * cp,
    )
    # torchtitan's parallelize functions assert seq_len % (tp x 2 cp) == 0.
    assert cfg.training.seq_len % dims.seq_len_divisor == 0, (cfg.training.seq_len, dims.seq_len_divisor)
    assert dims.dp_replicate * dims.dp_shard == dp, (dims.dp_replicate, dims.dp_shard, dp)
    if plan["pp"] > 1:
        assert not (dims.dp_replicate > 1 and dims.dp_shard == 1), "DDP with PP"
    if dp > 1 and sharding in ("fsdp", "fsdp-mb", "zero1", "zero2"):
        assert (dims.dp_replicate, dims.dp_shard) == (1, dp), (sharding, dims)
    if sharding == "hsdp" and dp > 1:
        assert dims.dp_shard > 1, (sharding, dims)
    if sharding == "fsdp-mb":
        assert par.fsdp_reshard_after_forward == "always"
    modes = set(plan.get("recompute") or ["none"])
    expected = "full" if "full" in modes else "selective" if "selective" in modes else "none"
    assert cfg.activation_checkpoint.mode == expected, (cfg.activation_checkpoint.mode, expected)
    print(
        f"ok: {toml_path}: pp {par.pipeline_parallel_degree}, {schedule}, "
        f"{len(par.module_fqns_per_model_part)} parts, {cfg.training.local_batch_size} microbatches "
        f"of {cfg.training.seq_len} tokens, activation checkpoint {cfg.activation_checkpoint.mode}, "
        f"tp {tp}, cp {cp}, ep {ep}, dp {dp} {sharding}: replicate {dims.dp_replicate} x shard {dims.dp_shard}"
    )


def main() -> int:
    found = 0
    for d in sys.argv[1:]:
        for name in sorted(os.listdir(d)):
            if name.endswith(".torchtitan.toml"):
                check(os.path.join(d, name))
                found += 1
    if found == 0:
        print("no torchtitan exports found", file=sys.stderr)
        return 1
    print(f"{found} torchtitan configurations parsed by torchtitan")
    return 0


if __name__ == "__main__":
    sys.exit(main())
