"""scripts/published_runs.py: the published-run files, their predictions and docs/fidelity.md."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

from conftest import flatpipe_bin

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
SCRIPT = os.path.join(ROOT, "scripts", "published_runs.py")


def script():
    spec = importlib.util.spec_from_file_location("published_runs", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_fidelity_page_is_what_the_run_files_predict():
    """docs/fidelity.md is regenerated from every run file by the binary the tests built: a
    model change that moves a prediction must regenerate the page."""
    out = subprocess.run(
        [sys.executable, SCRIPT, "--bin", flatpipe_bin(), "--check"],
        capture_output=True, text=True,
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_layer_splits_by_hand():
    pr = script()
    # BLOOM's `type:transformer|embedding`: 70 decoders + 2 embeddings over 12 stages, 6 each.
    bloom = pr.stages(70, 12, "layers")
    assert [b - a for a, b in bloom] == [6] * 12 and bloom[-1][1] == 72
    # Megatron-LM: 48 decoders over 2 stages, the embedding on the first, the head on the last.
    assert pr.stages(48, 2, "decoders") == [(0, 25), (25, 50)]
    # One layer per virtual stage: Llama 3 405B at pp 16 x vpp 8.
    assert pr.stages(126, 128, "layers") == [(i, i + 1) for i in range(128)]
    with pytest.raises(pr.RunError, match="cannot fill"):
        pr.stages(126, 128, "decoders")


def test_a_field_both_stated_and_assumed_is_refused(tmp_path):
    pr = script()
    path = tmp_path / "r.toml"
    path.write_text(
        '[source]\ncitation = "x"\nwhere = "y"\n'
        '[stated]\ngpu = "a100"\ngpus = 8\nmodel = "llama3.1-8b"\nseq_len = 2048\n'
        'global_batch = 8\ntp = 1\npp = 1\nschedule = "1f1b"\n'
        '[reported]\nmetric = "step_time_s"\nvalue = 1.0\ndefinition = "z"\n'
        '[assumed]\nschedule = { value = "gpipe", why = "w" }\n'
    )
    with pytest.raises(pr.RunError, match="`schedule` is both stated and assumed"):
        pr.load(str(path))


def test_the_recompute_flop_count_is_a_count_of_the_passes():
    """The metric of Narayanan et al. 2021 (Eq. 3) as the script computes it, against a count
    from the passes: per token and layer the forward's GEMMs are 24h^2 (Q/K/V 6h^2, output 2h^2,
    MLP 16h^2) and its attention 4sh (QK^T and PV over the whole sequence); full recomputation
    runs the forward twice and the backward costs two forwards, 4 x in all; the logits' GEMM,
    2hV per token, runs forward and backward, 3 x."""
    pr = script()
    run = {
        "name": "x",
        "config": {"gpu": "a100", "gpus": 4, "global_batch": 8, "seq_len": 2048,
                   "model": {"layers": 24, "hidden": 2304, "vocab": 51200}},
        "reported": {"metric": "tflops_per_gpu_with_recompute"},
    }
    step_s = 2.0
    got = pr.metric_value(run, {"step_time_s": {"mean": step_s}, "mfu": 0.0})
    b, s, l, h, v = 8, 2048, 24, 2304, 51200
    per_token = 4 * l * (24 * h * h + 4 * s * h) + 3 * 2 * h * v
    assert got == pytest.approx(per_token * b * s / (step_s * 4) / 1e12, rel=1e-12)


def test_unfused_attention_needs_a_model_of_a_stated_shape(tmp_path):
    """A GPT of a stated shape carries the run's attention into its model file; a built-in
    model (whose attention is fused) refuses an unfused one by name."""
    pr = script()
    text = pr.gpt_model({"parameters_b": 1, "layers": 2, "hidden": 64, "heads": 4, "vocab": 100},
                        "unfused")
    assert "\nattention: unfused\n" in text
    run = {"name": "r", "config": {"gpu": "a100", "gpus": 8, "model": "llama3.1-8b",
                                   "seq_len": 2048, "global_batch": 8, "tp": 1, "pp": 1,
                                   "schedule": "1f1b", "attention": "unfused"}}
    with pytest.raises(pr.RunError, match="attention `unfused` needs a model of a stated shape"):
        pr.plan_yaml(run, str(tmp_path))
