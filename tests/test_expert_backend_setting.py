"""train.expert_backend (issue 13): which kernels run the experts is a runtime setting, not part
of the model's shape. auto resolves per device, a resume may switch it, a recipe that still sets it
on upcycle_moe is told where it went, and checkpoints written before the move still load."""

from __future__ import annotations

import copy
import shutil
from types import SimpleNamespace

import pytest
import torch
import yaml

from conftest import MICRO, _merge, losses
from growtrain.generate import load_model
from growtrain.model import GrowLM
from growtrain.model.config import ModelConfig, MoEConfig
from growtrain.model.expert_backends import resolve_expert_backend
from growtrain.recipe import RecipeError, load_recipe, recipe_from_dict, to_plain
from growtrain.checkpoint.resume import comparable as _comparable
from growtrain.train import run


def _moe_config() -> ModelConfig:
    return ModelConfig(vocab_size=37, d_model=16, n_layers=2, n_heads=2, ffn_hidden=24,
                       moe=MoEConfig(num_experts=3, top_k=2, expert_hidden=24), moe_layers=(1,))


def _two_stage_raw(backend: str) -> dict:
    raw = copy.deepcopy(MICRO)
    _merge(raw, {"train": {"expert_backend": backend, "eval_every": 0}, "checkpoint": {"every_steps": 2, "keep_last": 10}})
    raw["stages"] = [
        {"name": "dense", "steps": 4, "seq_len": 16, "batch_size": 2},
        {"name": "moe", "steps": 4, "seq_len": 16, "batch_size": 2,
         "grow": [{"op": "upcycle_moe", "num_experts": 4, "top_k": 2}]},
    ]
    return raw


def test_auto_resolves_to_the_reference_on_the_cpu_and_explicit_names_are_kept():
    assert resolve_expert_backend("auto", "cpu") == "reference"
    assert resolve_expert_backend("auto", "meta") == "reference"
    assert resolve_expert_backend("reference", "cpu") == "reference"
    assert resolve_expert_backend("triton", "cpu") == "triton"  # it logs its fallback when called
    model = GrowLM(_moe_config())
    assert model.set_expert_backend("auto") == "reference"
    assert [layer.expert_backend for layer in model.moe_layers] == ["reference"]
    with pytest.raises(ValueError, match="did you mean 'triton'"):
        model.set_expert_backend("trition")


def test_auto_resolves_to_triton_on_cuda_only_where_triton_can_run(monkeypatch):
    import growtrain.model.expert_backends as moe

    monkeypatch.setattr(moe, "triton_unavailable_reason", lambda device: None)
    assert resolve_expert_backend("auto", "cuda") == "triton"
    assert resolve_expert_backend("auto", "cpu") == "reference"  # the interpreter is for tests, not auto
    monkeypatch.setattr(moe, "triton_unavailable_reason", lambda device: "triton is not installed")
    assert resolve_expert_backend("auto", "cuda") == "reference"


def test_a_recipe_that_sets_the_backend_on_upcycle_moe_is_refused_naming_train_expert_backend(micro_recipe):
    changes = copy.deepcopy(MICRO["stages"])
    changes[1]["grow"][0]["expert_backend"] = "triton"
    with pytest.raises(RecipeError) as err:
        load_recipe(micro_recipe({"stages": changes}))
    (problem,) = [p for p in err.value.problems if "expert_backend" in p]
    assert problem.startswith("stages.1.grow.0.expert_backend (line ")
    assert "train.expert_backend: triton" in problem
    with pytest.raises(RecipeError) as err:
        recipe_from_dict({**MICRO, "model": {**MICRO["model"], "moe": {"num_experts": 4, "expert_backend": "reference"}}})
    assert any(p.startswith("model.moe.expert_backend") and "train.expert_backend" in p for p in err.value.problems)


def test_an_unknown_train_expert_backend_lists_the_valid_settings(micro_recipe):
    with pytest.raises(RecipeError) as err:
        load_recipe(micro_recipe({"train": {"expert_backend": "trito"}}))
    (problem,) = err.value.problems
    assert problem.startswith("train.expert_backend (line ") and "did you mean 'triton'" in problem
    assert "valid: auto, reference, triton" in problem
    assert load_recipe(micro_recipe()).train.expert_backend == "auto"


def test_an_old_checkpoints_model_config_with_expert_backend_still_loads():
    cfg = _moe_config()
    old = to_plain(cfg)
    old["moe"]["expert_backend"] = "triton"  # what meta.json held before the setting moved
    assert ModelConfig.from_dict(old) == cfg
    torch.manual_seed(0)
    state = GrowLM(cfg).state_dict()
    recipe = {"train": {"precision": "fp32"}, "stages": [{"seq_len": 16}]}  # an old recipe: no train.expert_backend
    model = load_model(SimpleNamespace(meta={"model_config": old, "recipe": recipe}, model_state=state))
    assert model.config == cfg and model.expert_backend == "reference"  # auto, on the CPU
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())


def test_an_old_checkpoints_recipe_with_the_backend_on_upcycle_moe_compares_equal_on_resume():
    new = to_plain(recipe_from_dict(_two_stage_raw("reference")))
    old = copy.deepcopy(new)
    del old["train"]["expert_backend"]
    old["stages"][1]["grow"][0]["expert_backend"] = "triton"
    assert _comparable(old) == _comparable(new)
    changed = copy.deepcopy(new)
    changed["stages"][1]["grow"][0]["top_k"] = 1
    assert _comparable(changed) != _comparable(new), "the legacy key is dropped, nothing else"


def test_resume_with_another_expert_backend_is_accepted_and_continues(tmp_path, monkeypatch):
    from growtrain.kernels.backend import triton_unavailable_reason

    reason = triton_unavailable_reason("cpu")
    if reason is not None:
        pytest.skip(f"the Triton kernels cannot run here, so no other backend would run: {reason}")
    import growtrain.kernels.grouped as grouped

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        first = tmp_path / "reference"
        run(recipe_from_dict(_two_stage_raw("reference")), first, log=lambda *a, **k: None)
        resumed = tmp_path / "resumed"
        shutil.copytree(first, resumed)
        for step in (7, 8):  # back to the middle of the MoE stage
            shutil.rmtree(resumed / "checkpoints" / f"step-{step:08d}", ignore_errors=True)
        assert not (resumed / "checkpoints" / "step-00000008").exists()
        launches = []
        real = grouped.launch_grouped_mm
        monkeypatch.setattr(grouped, "launch_grouped_mm", lambda *a, **k: launches.append(1) or real(*a, **k))
        lines = []
        recipe = recipe_from_dict(_two_stage_raw("triton"))
        result = run(recipe, resumed, log=lambda *a, **k: lines.append(" ".join(map(str, a))))
    finally:
        torch.set_num_threads(before)
    assert any(line.startswith("resumed from step-00000006") for line in lines), lines
    assert "expert backend: triton (train.expert_backend: triton)" in lines
    assert launches, "the resumed steps never ran the Triton kernels"
    assert result.global_step == 8
    got, want = losses(resumed), losses(first)
    assert [s for s, *_ in got] == list(range(1, 9))
    assert got[:6] == want[:6]
    # Other kernels, same experts: the continued losses agree within fp32 kernel rounding.
    for (_, a, _), (_, b, _) in zip(got[6:], want[6:]):
        assert a == pytest.approx(b, rel=1e-4)
    assert yaml.safe_load((resumed / "recipe.yaml").read_text())["train"]["expert_backend"] == "triton"
