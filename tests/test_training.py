"""The training loop in-process: learning happens, the NaN guard skips and stops, precision and
tracking modes behave."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

import growtrain.runtime.passes as passes_mod
from conftest import REPO, cli_env, losses, run_cli
from growtrain.recipe import load_recipe
from growtrain.train import TrainingDiverged, run


def quiet(*_):
    pass


def test_micro_run_learns_and_grows_through_all_stages(micro_recipe, tmp_path):
    result = run(load_recipe(micro_recipe()), tmp_path / "run", log=quiet)
    rows = losses(tmp_path / "run")
    assert [r[0] for r in rows] == list(range(1, 21))
    assert rows[0][1] > math.log(257) - 0.1, "an untrained byte model starts near ln(vocab)"
    assert result.final_eval_loss < rows[0][1] - 0.5
    ops = [(h["stage"], h["operator"], h["passed"]) for h in result.growth_history]
    assert ops == [("moe", "upcycle_moe", True), ("deep", "deepen", True)]


def test_non_finite_steps_are_skipped_then_the_run_stops_without_saving_them(micro_recipe, tmp_path, monkeypatch):
    real = passes_mod.forward_loss
    calls = {"n": 0}

    def poisoned(model, x, y, precision):
        calls["n"] += 1
        ce, aux, stats = real(model, x, y, precision)
        if calls["n"] == 3 or calls["n"] >= 6:
            ce = ce * float("nan")
        return ce, aux, stats

    monkeypatch.setattr(passes_mod, "forward_loss", poisoned)
    recipe = load_recipe(micro_recipe({"optimizer": {"max_bad_steps": 2}, "checkpoint": {"every_steps": 1}}))
    lines = []
    with pytest.raises(TrainingDiverged, match="3 consecutive non-finite steps at step 8"):
        run(recipe, tmp_path / "run", log=lines.append)
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["skipped"] for r in rows] == [False, False, True, False, False, True, True]
    saved = sorted(p.name for p in (tmp_path / "run" / "checkpoints").glob("step-*"))
    assert saved[-1] == "step-00000007", "the step that diverged must not be checkpointed"


def test_a_skipped_step_leaves_the_weights_untouched(micro_recipe, tmp_path, monkeypatch):
    real = passes_mod.forward_loss
    snapshots = []

    def poisoned(model, x, y, precision):
        snapshots.append({n: p.detach().clone() for n, p in model.named_parameters()})
        ce, aux, stats = real(model, x, y, precision)
        return (ce * float("nan") if len(snapshots) == 2 else ce), aux, stats

    monkeypatch.setattr(passes_mod, "forward_loss", poisoned)
    recipe = load_recipe(micro_recipe({"stages": [{"name": "only", "steps": 3, "seq_len": 16, "batch_size": 2}]}))
    run(recipe, tmp_path / "run", log=quiet)
    for name in snapshots[1]:
        assert torch.equal(snapshots[1][name], snapshots[2][name]), name


def test_bf16_autocast_trains(micro_recipe, tmp_path):
    recipe = load_recipe(micro_recipe({"train": {"precision": "bf16"}}))
    result = run(recipe, tmp_path / "run", log=quiet)
    assert math.isfinite(result.final_eval_loss) and result.final_eval_loss < math.log(257)


def test_disabled_wandb_never_imports_wandb(micro_recipe, tmp_path):
    recipe = micro_recipe()
    code = (
        "import sys; from growtrain.recipe import load_recipe; from growtrain.train import run; "
        f"run(load_recipe({str(recipe)!r}), {str(tmp_path / 'run')!r}, log=lambda m: None); "
        "assert 'wandb' not in sys.modules, 'wandb was imported'"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=cli_env(), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert not (tmp_path / "run" / "wandb").exists()


@pytest.mark.slow
def test_offline_wandb_writes_a_run_and_reuses_its_id_after_resume(micro_recipe, tmp_path):
    recipe = micro_recipe({"tracking": {"wandb": {"mode": "offline"}}})
    out = tmp_path / "run"
    env = cli_env()
    killed = run_cli("run", recipe, "--out", out, env={**env, "GROWTRAIN_FAULT": "after_transition:2"})
    assert killed.returncode == -9
    assert run_cli("run", recipe, "--out", out, env=env).returncode == 0
    runs = sorted((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 2, "a resumed offline run starts a new local run directory"
    ids = {p.name.rsplit("-", 1)[1] for p in runs}
    meta = json.loads(sorted((out / "checkpoints").glob("step-*"))[-1].joinpath("meta.json").read_text())
    assert ids == {meta["wandb_id"]}, "the resumed run must reuse the run id kept in the checkpoint"
    (log,) = runs[-1].glob("run-*.wandb")
    # The resumed local run holds all 20 steps (the killed one may have lost its unflushed tail):
    # W&B stores each history record's keys as plain strings.
    assert log.read_bytes().count(b"grad_norm") >= 20


def test_a_failed_growth_check_stops_the_run_before_the_new_stage_trains(micro_recipe, tmp_path):
    # A bar no fp32 upcycling can meet (its logits move by ~1e-8 relative): the check must fire.
    recipe = micro_recipe({"invariance": {"exact_rel_tol": 1e-30}})
    out = tmp_path / "run"
    done = run_cli("run", recipe, "--out", out)
    assert done.returncode == 3, done.stderr
    assert "upcycle_moe" in done.stderr and "relative L2" in done.stderr and "Traceback" not in done.stderr
    assert [r[0] for r in losses(out)] == list(range(1, 9)), "no step of the MoE stage may run"
    report = json.loads((out / "growth-failure.json").read_text())
    assert report["operator"] == "upcycle_moe" and report["passed"] is False
    assert sorted(p.name for p in (out / "checkpoints").glob("step-*"))[-1] == "step-00000008"


def test_resuming_on_changed_training_text_warns_that_losses_will_not_repeat(micro_recipe, tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(4):
        (corpus / f"doc{i}.txt").write_text(f"document {i}: " + "the quick brown fox jumps over the lazy dog. " * 40)
    recipe = load_recipe(micro_recipe({"data": {"source": str(corpus), "max_bytes": 0, "eval_fraction": 0.25},
                                       "stages": [{"name": "only", "steps": 2, "seq_len": 16, "batch_size": 2}]}))
    lines: list[str] = []
    run(recipe, tmp_path / "run", log=lines.append)
    assert not [x for x in lines if "differs" in x]
    (corpus / "doc0.txt").write_text("an edited document " * 50)
    run(recipe, tmp_path / "run", log=lines.append)
    assert [x for x in lines if "training data differs" in x]
