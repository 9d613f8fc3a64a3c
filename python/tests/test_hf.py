"""Other libraries' models as pipeline stages: Hugging Face (flatpipe.hf: a tiny Llama and
Qwen3) and torchtitan (flatpipe.titan: its Llama 3), random weights, cut by flatpipe's plans and
run on gloo, against the unsplit model run one sequence at a time."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.multiprocessing as mp

pytest.importorskip("transformers")

from _hf_workers import ATOL, run, tiny  # noqa: E402
from flatpipe import titan  # noqa: E402
from flatpipe.hf import HFStage, positions, stages  # noqa: E402

# Steps whose microbatch counts and lengths differ (a 64-token budget): ten sequences, five with
# one longer than the budget, two.
STEPS = [[40, 7, 19, 33, 12, 5, 28, 50, 9, 17], [90, 30, 25, 35, 28], [20, 11]]


def launch(tmp_path, world, spec):
    mp.spawn(run, args=(world, str(tmp_path / "init"), spec, str(tmp_path)), nprocs=world, join=True)
    return [json.load(open(tmp_path / f"rank{r}.json")) for r in range(world)]


@pytest.mark.parametrize(
    "model, world, schedule",
    [
        ("llama", 2, "1f1b"),
        ("llama", 2, "interleaved-1f1b"),
        ("llama", 2, "zb-v"),
        ("llama", 2, "zb-auto"),
        ("qwen3", 2, "zb-v"),
        ("qwen3", 4, "1f1b"),
        ("llama", 4, "interleaved-1f1b"),
        ("titan", 2, "zb-v"),
        ("titan", 2, "interleaved-1f1b"),
        ("titan", 4, "zb-auto"),
    ],
)
def test_loss_and_gradients_equal_the_unsplit_model(tmp_path, model, world, schedule):
    spec = {"model": model, "decoders": 6, "schedule": schedule, "budget": 64, "steps": STEPS}
    reports = launch(tmp_path, world, spec)
    for rank, steps in enumerate(reports):
        for s in steps:
            where = f"{model} {schedule} rank {rank} step {s['step']} microbatches {s['microbatches']}"
            assert not s["missing"], f"{where}: no gradient for {s['missing']}"
            assert abs(s["loss"] - s["want_loss"]) <= 1e-5 * abs(s["want_loss"]), where
            assert s["grad_excess"] <= ATOL, f"{where}: gradient off by {s['grad_excess']}"
    # Every parameter of the model is on exactly one rank.
    total = sum(1 for _ in tiny(model, 6).parameters())
    assert sum(r[0]["params"] for r in reports) == total
    # The steps really vary in microbatch count.
    assert len({len(s["microbatches"]) for s in reports[0]}) == len(STEPS)


def test_positions_restart_at_every_boundary():
    cu = torch.tensor([0, 3, 4, 8])
    assert positions(cu).tolist() == [0, 1, 2, 0, 0, 1, 2, 3]


def test_a_packed_microbatch_equals_its_sequences_one_at_a_time():
    """The whole model as one stage on a packed microbatch against each sequence alone; and
    the same tokens as one sequence differ (the check can fail)."""
    model = tiny("qwen3", 2).eval()
    lens = [5, 9, 1, 7]
    cu = torch.tensor([0, 5, 14, 15, 22])
    x = torch.randint(96, (22,), generator=torch.Generator().manual_seed(3))
    whole = HFStage(model, 0, 4)
    with torch.no_grad():
        packed = whole(x, cu)
        alone = torch.cat([model(x[a:b].unsqueeze(0)).logits[0] for a, b in zip(cu[:-1], cu[1:])])
        one = whole(x, torch.tensor([0, 22]))
    assert packed.shape == (sum(lens), 96)
    assert (packed - alone).abs().max() < 1e-5
    assert (one - alone).abs().max() > 1e-3


def test_bad_cuts_are_refused_with_the_reason():
    model = tiny("llama", 2)
    with pytest.raises(ValueError, match=r"do not cover the model's 4 layers"):
        stages(model, [(0, 2), (2, 3)], [0, 1], 0)
    with pytest.raises(ValueError, match=r"0 <= start < end <= 4"):
        HFStage(model, 2, 5)
    model.config.tie_word_embeddings = True
    with pytest.raises(ValueError, match="ties its embedding and head"):
        stages(model, [(0, 2), (2, 4)], [0, 1], 0)
    with pytest.raises(ValueError, match="is not a decoder-only"):
        stages(torch.nn.Linear(2, 2), [(0, 1)], [0], 0)
    with pytest.raises(ValueError, match="does not run sequence chunks"):
        HFStage(tiny("llama", 2), 0, 4)(torch.tensor([1, 2]), torch.tensor([0, 2]), kv=object())


def test_a_titan_stage_runs_the_models_own_attention():
    """torchtitan's model on a packed microbatch with its own compiled FlexAttention (forward
    only: it has no CPU backward) against the same weights cut into two stages, whose blocks run
    SDPA under the same document mask on the CPU."""
    from torch.nn.attention.flex_attention import create_block_mask

    own = tiny("titan", 2)
    cut = tiny("titan", 2)
    first, last = titan.TitanStage(cut, 0, 2), titan.TitanStage(cut, 2, 4)
    cu = torch.tensor([0, 6, 7, 20])
    doc = torch.repeat_interleave(torch.arange(3), cu[1:] - cu[:-1])
    mask = create_block_mask(lambda b, h, q, k: (q >= k) & (doc[q] == doc[k]), None, None, 20, 20, device="cpu")
    x = torch.randint(96, (20,), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = own(x.unsqueeze(0), attention_masks=mask, positions=titan.positions(cu).unsqueeze(0))[0]
        got = last(first(x, cu), cu)
    assert (got - want).abs().max() < 1e-5
    with pytest.raises(ValueError, match="attn_type is 'sdpa'"):
        own.model_args.attn_type = "sdpa"
        titan.stages(own, [(0, 4)], [0], 0)


def test_a_measured_profile_is_what_plan_and_simulate_take(tmp_path):
    """flatpipe.torch.profile on a tiny Hugging Face model's own stages: every kind and phase
    fitted, and the profile's YAML accepted by `flatpipe simulate --profile` and `flatpipe plan
    --profile` (the binary the tests built)."""
    import subprocess

    import flatpipe
    from conftest import flatpipe_bin
    from flatpipe import hf

    model = tiny("llama", 2)
    hf.use_varlen(model)
    path = tmp_path / "model.yaml"
    path.write_text(hf.model_yaml(model, "tiny-hf"))
    base = flatpipe.Profile.analytic(str(path), "cpu")
    prof, fits = flatpipe.torch.profile(
        lambda a, b: HFStage(model, a, b), 4, base, hidden_size=32, vocab_size=96,
        tokens=(64, 128), seq_lens=(None, 16), repeats=1,
    )
    for kind in ("embedding", "decoder", "head"):
        for phase in ("F", "I", "W", "B"):
            assert (kind, phase) in fits, (kind, phase)
    assert fits[("decoder", "F")][1] > 0 or fits[("decoder", "F")][0] > 0
    text = prof.to_yaml()
    assert "measured by flatpipe.torch.profile" in text
    (tmp_path / "p.yaml").write_text(text)
    common = ["--profile", str(tmp_path / "p.yaml"), "--workload", "tiny-chat", "--gantt", "none"]
    sim = subprocess.run(
        [flatpipe_bin(), "simulate", *common, "--pp", "2", "--schedule", "1f1b",
         "--token-budget", "128", "--steps", "2", "--format", "json"],
        capture_output=True, text=True,
    )
    assert sim.returncode == 0, sim.stderr
    assert json.loads(sim.stdout)[0]["step_time_s"]["mean"] > 0
    plan = subprocess.run(
        [flatpipe_bin(), "plan", *common, "--ranks", "2", "--tp", "1", "--steps", "2", "-o",
         str(tmp_path / "plan.yaml")],
        capture_output=True, text=True,
    )
    assert plan.returncode == 0, plan.stderr
    assert flatpipe.Pipeline.from_plan(str(tmp_path / "plan.yaml")).num_layers == 4
    with pytest.raises(ValueError, match="num_layers = 2 is invalid"):
        flatpipe.torch.profile(lambda a, b: None, 2, base, hidden_size=32, vocab_size=96)


def test_the_gpu_profile_script_runs_dry_on_the_cpu(tmp_path):
    """python/bench/torch_profile_gpu.py (step 5 of scripts/gpu-check.sh) with --small on the
    CPU: a profile YAML and the comparison written."""
    import subprocess
    import sys

    script = os.path.join(os.path.dirname(__file__), "..", "bench", "torch_profile_gpu.py")
    out = subprocess.run(
        [sys.executable, script, str(tmp_path), "--device", "cpu", "--small"],
        capture_output=True, text=True,
    )
    assert out.returncode == 0, out.stderr
    assert "decoder layer at T = 128" in out.stdout
    import flatpipe

    measured = flatpipe.Profile.load(str(tmp_path / "torch-profile.yaml"))
    assert measured.num_layers == 4 and "flatpipe.torch.profile" in measured.to_yaml()
