"""Resume equivalence with NF4 experts (DESIGN.md §9): the micro recipe plus a fourth stage that
quantizes the experts (quantize_experts) and trains their LoRA; killed mid-stage after the
quantization and resumed, the run repeats the uninterrupted run's losses and final weights (NF4
codes and quantization state included) bit for bit."""

from __future__ import annotations

import copy

import pytest

from conftest import MICRO, assert_same_run, kill_and_resume, train_recipe


pytestmark = pytest.mark.slow

STEPS = 26


def nf4_recipe() -> dict:
    raw = copy.deepcopy(MICRO)
    raw["name"] = "micro-nf4"
    raw["stages"].append(
        {
            "name": "nf4",
            "steps": 6,  # steps 21..26; checkpoints at 24 and 26
            "seq_len": 32,
            "batch_size": 4,
            "grow": [{"op": "quantize_experts", "r": 4, "lora_alpha": 8.0}],
            "schedule": {"warmup_steps": 1},
        }
    )
    return raw


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory):
    recipe, out, done = train_recipe(nf4_recipe(), tmp_path_factory.mktemp("nf4-reference"), "micro-nf4")
    assert "quantize_experts (approximate)" in done.stdout and "passed" in done.stdout
    return recipe, out


# The last step of the NF4 stage: the resume loads the step-24 checkpoint (NF4 codes, quantization
# state, LoRA moments). Killing right after quantize_experts (regrowing from step 20) takes the
# same growth path as the uninterrupted run; test_resume.py covers that kind of kill.
@pytest.mark.parametrize("fault", ["step_mid:26"])
def test_a_killed_nf4_stage_resumes_to_the_uninterrupted_losses_and_weights(reference_run, tmp_path, fault):
    recipe, reference = reference_run
    out = tmp_path / "run"
    kill_and_resume(recipe, out, fault)

    final = assert_same_run(out, reference, STEPS)
    assert any(k.endswith("experts.w_gate_codes") for k in final) and any(k.endswith("experts.w_down_nested_absmax") for k in final)


def test_resume_generate_and_export_build_on_meta_and_never_quantize(reference_run, tmp_path, monkeypatch):
    """At 120B, quantizing random experts at start-up before loading the checkpoint would take
    hours: resume, generate and export-adapters load the NF4 codes as saved (zero quantize calls)."""
    import signal

    import bitsandbytes.functional as bnbf

    from conftest import cli_env, run_cli
    from growtrain.hf.adapters import export_adapters
    from growtrain.generate import generate_from_checkpoint
    from growtrain.recipe import load_recipe
    from growtrain.train import run

    recipe, reference = reference_run
    out = tmp_path / "run"
    killed = run_cli("run", recipe, "--out", out, env=cli_env(GROWTRAIN_FAULT="step_mid:26"))
    assert killed.returncode == -signal.SIGKILL
    calls = []
    original = bnbf.quantize_4bit
    monkeypatch.setattr(bnbf, "quantize_4bit", lambda *a, **k: calls.append(1) or original(*a, **k))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    result = run(load_recipe(recipe), out, "auto", log=lambda *_: None)
    assert result.global_step == STEPS
    assert calls == [], f"the resume quantized {len(calls)} matrices"
    generate_from_checkpoint(out, "The ", 5, 0.0, 1, 0)
    export_adapters(out, tmp_path / "adapters", with_base=True)
    assert calls == [], f"generate / export-adapters quantized {len(calls)} matrices"
    assert_same_run(out, reference, STEPS)
