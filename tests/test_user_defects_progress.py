"""Issue 12, defects 8 and 9: resume refusals that say what changed and let console-only settings
change, `inspect` that reports damaged checkpoints and counts NF4 bases, an ETA weighted by each
stage's cost, a line at least every 30 s, a truthful Ctrl-C message, and a warning for text files
that are not UTF-8. One shared run (a dense stage, then experts upcycled and quantized to NF4)
serves the checkpoint tests; each test that changes it works on a copy."""

from __future__ import annotations

import copy
import json
import math
import random
import shutil

import pytest
import yaml
from safetensors.torch import load_file

import growtrain.runtime.progress as progress_mod
import growtrain.runtime.passes as passes_mod
from conftest import MICRO
from growtrain.cli import main
from growtrain.data.corpus import DataConfig, load_corpus
from growtrain.runtime.progress import Progress, stage_step_costs
from growtrain.recipe import RecipeError, load_recipe
from growtrain.stages import plan_stage_models
from growtrain.train import run


def quiet(*_):
    pass


def two_stage_recipe() -> dict:
    raw = copy.deepcopy(MICRO)
    raw["name"] = "defects"
    raw["stages"] = [
        {"name": "dense", "steps": 2, "seq_len": 16, "batch_size": 2},
        {
            "name": "nf4",
            "steps": 2,
            "seq_len": 16,
            "batch_size": 2,
            "grow": [{"op": "upcycle_moe", "num_experts": 4, "top_k": 2}, {"op": "quantize_experts", "r": 4, "lora_alpha": 8.0}],
        },
    ]
    raw["checkpoint"] = {"every_steps": 1, "keep_last": 10}
    return raw


def write_recipe(raw: dict, path):
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("defects")
    recipe = write_recipe(two_stage_recipe(), root / "defects.yaml")
    run(load_recipe(recipe), root / "run", log=quiet)
    return recipe, root / "run"


@pytest.fixture
def run_copy(finished_run, tmp_path):
    _, out = finished_run
    shutil.copytree(out, tmp_path / "run")
    return tmp_path / "run"


def flip_a_byte(path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


# ---------------------------------------------------------------------------------------------
# Defect 8: resume refusals and inspect


def test_a_changed_stage_length_is_refused_with_one_short_line_naming_it(run_copy, tmp_path):
    raw = two_stage_recipe()
    raw["stages"][1]["steps"] = 5
    with pytest.raises(RecipeError) as refused:
        run(load_recipe(write_recipe(raw, tmp_path / "longer.yaml")), run_copy, log=quiet)
    changes = refused.value.problems[:-1]  # the last line is the advice
    assert changes == ["stages.1.steps: checkpoint 2 -> recipe 5"]
    assert len(str(refused.value)) < 600, "the refusal must not print whole stage lists"


def test_a_resume_may_change_the_console_settings_but_not_the_training(run_copy, tmp_path):
    raw = two_stage_recipe()
    raw["train"]["log_every"] = 7
    raw["tracking"]["progress_bar"] = True
    raw["name"] = "renamed"
    lines: list[str] = []
    result = run(load_recipe(write_recipe(raw, tmp_path / "chatty.yaml")), run_copy, log=lines.append)
    assert result.global_step == 4
    assert any(line.startswith("resumed from step-00000004") for line in lines)

    raw["train"]["eval_batches"] = 2  # changes the eval losses the run records: still refused
    with pytest.raises(RecipeError, match=r"train\.eval_batches: checkpoint 1 -> recipe 2"):
        run(load_recipe(write_recipe(raw, tmp_path / "other-eval.yaml")), run_copy, log=quiet)


def test_inspect_of_a_run_whose_newest_checkpoint_is_damaged_says_which_and_why(run_copy, capsys):
    flip_a_byte(run_copy / "checkpoints/step-00000004/model.safetensors")
    assert main(["inspect", str(run_copy)]) == 0
    out = capsys.readouterr().out
    assert "step-00000004, skipped: model.safetensors: sha256 mismatch" in out
    assert "step-00000003 (the newest intact one)" in out
    assert main(["inspect", str(run_copy), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["step"] == 3
    assert [(s["checkpoint"].rsplit("/", 1)[-1], s["problems"]) for s in report["skipped"]] == [
        ("step-00000004", ["model.safetensors: sha256 mismatch"])
    ]


def test_inspect_pointed_at_a_damaged_checkpoint_shows_it_marked_damaged(run_copy, capsys):
    ckpt = run_copy / "checkpoints/step-00000004"
    assert main(["inspect", str(ckpt), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["problems"] == []
    flip_a_byte(ckpt / "trainer.pt")
    assert main(["inspect", str(ckpt)]) == 0
    out = capsys.readouterr().out
    assert "DAMAGED     trainer.pt: sha256 mismatch" in out and "step        4" in out
    flip_a_byte(ckpt / "meta.json")
    assert main(["inspect", str(ckpt)]) == 2
    assert "meta data cannot be trusted" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# Defect 9: inspect's NF4 counts, ETA, heartbeat, Ctrl-C, undecodable text


def test_inspect_counts_the_nf4_bases_so_quantizing_does_not_read_as_a_shrink(finished_run, capsys):
    _, out = finished_run
    assert main(["inspect", str(out), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    quantize = next(t for t in report["transitions"] if t["operator"] == "quantize_experts")
    # Independent of the planner: the checkpoint's own tensors. Quantizing keeps every expert
    # weight (now 4-bit codes) and adds the LoRA pairs.
    tensors = load_file(out / "checkpoints/step-00000004/model.safetensors")
    adapters = sum(t.numel() for n, t in tensors.items() if "_lora_" in n)
    codes = sum(t.numel() for n, t in tensors.items() if n.endswith("_codes"))
    assert adapters > 0 and codes > 0
    assert quantize["weights_before"] == quantize["params_before"]
    assert quantize["weights_after"] == quantize["params_before"] + adapters
    assert report["weights_total"] == report["params_total"] + 2 * codes  # two 4-bit weights a byte
    assert main(["inspect", str(out)]) == 0
    text = capsys.readouterr().out
    assert f"{quantize['params_before']:,} -> {quantize['weights_after']:,}" in text
    assert f"{2 * codes:,} in NF4 expert bases" in text


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_the_eta_weighs_the_remaining_steps_by_their_stages_cost():
    clock = FakeClock()
    # Stage 1: 4 steps of cost 1; stage 2: 10 steps that cost 4 times as much.
    progress = Progress([1.0, 4.0], [4, 10], clock=clock)
    assert math.isnan(progress.eta_seconds(0, 0)), "no estimate before a step is timed"
    progress.start_stage()
    for _ in range(4):
        clock.now += 2.0  # 2 s a step
        progress.step_done(0)
    # 10 steps left, each 4x a 2-s step: 80 s, not the 20 s of "every step costs the same".
    assert progress.eta_seconds(0, 4) == pytest.approx(80.0)
    clock.now += 600.0  # growth, evals and checkpoints between stages are not step time
    progress.start_stage()
    clock.now += 8.0
    progress.step_done(1)
    assert progress.eta_seconds(1, 1) == pytest.approx(9 * 8.0)


def test_the_trainers_step_costs_come_from_the_planners_flops_of_each_stage(micro_recipe):
    recipe = load_recipe(micro_recipe())
    shapes = plan_stage_models(recipe.model.with_changes(vocab_size=257), [s.grow for s in recipe.stages])
    costs = stage_step_costs(shapes, recipe.stages)
    per_token = [c / (s.batch_size * s.seq_len * s.grad_accum) for c, s in zip(costs, recipe.stages)]
    # upcycle_moe top-2 runs two copies of the dense FFN per token; deepen doubles the blocks.
    assert per_token[0] < per_token[1] < per_token[2]
    assert per_token[2] > 1.5 * per_token[0]


def test_the_heartbeat_is_due_every_interval_and_reset_by_each_line():
    clock = FakeClock()
    progress = Progress([1.0], [100], every_s=30.0, clock=clock)
    clock.now += 29.0
    assert not progress.line_due()
    clock.now += 1.0
    assert progress.line_due()
    progress.line_written()
    assert not progress.line_due()


def test_a_stage_prints_lines_between_log_every_steps_when_the_heartbeat_is_due(micro_recipe, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(progress_mod, "HEARTBEAT_S", 0.0)  # every step is "30 s after the last line"
    recipe = load_recipe(micro_recipe({"train": {"log_every": 1000}, "stages": [{"name": "only", "steps": 3, "seq_len": 16, "batch_size": 2}]}))
    run(recipe, tmp_path / "run", log=quiet)
    steps = [line.split()[2] for line in capsys.readouterr().out.splitlines() if line.startswith("[only] step ")]
    assert steps == ["1/3", "2/3", "3/3"]


def interrupt_at(monkeypatch, call: int) -> None:
    real = passes_mod.forward_loss
    calls = {"n": 0}

    def forward(*args):
        calls["n"] += 1
        if calls["n"] == call:
            raise KeyboardInterrupt
        return real(*args)

    monkeypatch.setattr(passes_mod, "forward_loss", forward)


ONE_STAGE = {"stages": [{"name": "only", "steps": 4, "seq_len": 16, "batch_size": 2}], "checkpoint": {"every_steps": 2}}


def test_ctrl_c_before_any_checkpoint_says_that_the_run_starts_over(micro_recipe, tmp_path, monkeypatch):
    interrupt_at(monkeypatch, 2)
    with pytest.raises(KeyboardInterrupt) as stopped:
        run(load_recipe(micro_recipe(ONE_STAGE)), tmp_path / "run", log=quiet)
    assert "no checkpoint was written yet" in str(stopped.value) and "intact" not in str(stopped.value)


def test_ctrl_c_after_a_checkpoint_names_the_one_a_rerun_resumes_from(micro_recipe, tmp_path, monkeypatch):
    interrupt_at(monkeypatch, 4)  # during step 4: step 2 is checkpointed
    with pytest.raises(KeyboardInterrupt) as stopped:
        run(load_recipe(micro_recipe(ONE_STAGE)), tmp_path / "run", log=quiet)
    assert "step-00000002" in str(stopped.value) and "resume" in str(stopped.value)


def test_the_cli_prints_the_truthful_ctrl_c_message(micro_recipe, tmp_path, monkeypatch, capsys):
    # Needs growtrain/cli.py to print the interrupt's message (a two-line change, see issue 12).
    interrupt_at(monkeypatch, 1)
    assert main(["run", str(micro_recipe(ONE_STAGE)), "--out", str(tmp_path / "run")]) == 130
    err = capsys.readouterr().err
    assert "no checkpoint was written yet" in err and "intact" not in err


def test_a_text_file_of_undecodable_bytes_gets_a_warning_naming_it(tmp_path):
    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "good.txt").write_text("plain English prose, nothing odd about it. " * 50, encoding="utf-8")
    (folder / "latin1.txt").write_bytes("un café, déjà. ".encode("latin-1") + b"mostly ascii text here. " * 40)
    (folder / "binary.txt").write_bytes(random.Random(0).randbytes(4000))
    corpus = load_corpus(DataConfig(source=str(folder), max_bytes=0, eval_fraction=0.3), seed=0)
    assert len(corpus.warnings) == 1
    (warning,) = corpus.warnings
    assert "binary.txt" in warning and "not UTF-8" in warning
    assert "good.txt" not in warning and "latin1.txt" not in warning, "a few stray bytes are no reason to warn"
    clean = load_corpus(DataConfig(source=str(folder / "good.txt"), max_bytes=0), seed=0)
    assert clean.warnings == ()
