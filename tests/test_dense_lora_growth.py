"""peft LoRA on the dense layers as a recipe option: `model.dense_lora` (the model is wrapped when it
is built, so checkpoints load strictly) and the add_dense_lora operator that turns it on in a
stage. What it proves: the operator is exact (B = 0), the wrapped bases get no gradient and no
optimizer state, the adapters start fresh and train; any growth after it is refused at plan time;
and a micro run whose last stage adds dense LoRA on top of NF4 experts resumes bit for bit and
exports adapters that peft loads. CPU, tiny shapes."""

from __future__ import annotations


import pytest
import torch

from conftest import MICRO, assert_same_run, kill_and_resume, run_cli, train_recipe
from growtrain.model import GrowLM, ModelConfig, MoEConfig
from growtrain.model.config import DenseLoRAConfig
from growtrain.model.dense_lora import is_peft_wrapped
from growtrain.optim.registry import build_optimizer
from growtrain.recipe import GrowthStep, InvarianceConfig, OptimizerConfig, RecipeError, recipe_from_dict, to_plain
from growtrain.stages import GrowthPlanError, apply_growth, get_operator
from growtrain.stages.operators.dense_lora import AddDenseLoRAArgs

pytest.importorskip("bitsandbytes")

V = 31
add_dense_lora = get_operator("add_dense_lora")
ATTENTION = ("wq", "wk", "wv", "wo")


def model_config(**changes) -> ModelConfig:
    moe = MoEConfig(num_experts=4, top_k=2, expert_hidden=32, router_init_std=0.5)
    return ModelConfig(vocab_size=V, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=48, moe=moe, moe_layers=(1,), **changes)


def trained(cfg: ModelConfig, steps=2):
    torch.manual_seed(1)
    model = GrowLM(cfg)
    opt = build_optimizer(dict(model.named_parameters()), OptimizerConfig())
    for k in range(steps):
        batch = torch.randint(0, V, (2, 9), generator=torch.Generator().manual_seed(k))
        out = model(batch[:, :-1])
        (torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), batch[:, 1:].flatten()) + out.aux_loss).backward()
        opt.step(1e-2)
        opt.zero_grad()
    return model, opt


def test_add_dense_lora_keeps_the_logits_exactly_freezes_the_bases_and_starts_the_adapters_fresh():
    model, opt = trained(model_config())
    args = AddDenseLoRAArgs(r=4, lora_alpha=8.0, target_modules=("wq", "wv", "wo", "w_down"))
    g = torch.Generator().manual_seed(3)
    probe = (torch.randint(0, V, (2, 12), generator=g), torch.randint(0, V, (2, 12), generator=g))
    outcome = apply_growth(
        model, opt.state, [GrowthStep("add_dense_lora", args)], seed=0, stage_index=1, stage_name="lora",
        planned=add_dense_lora.plan(model.config, args), probe=probe, invariance_cfg=InvarianceConfig(exact_rel_tol=1e-12),
    )  # fmt: skip
    (record,) = outcome.records
    assert record["passed"] and record["exact"] and record["metrics"]["max_abs_dlogits"] == 0.0
    new = outcome.model
    assert is_peft_wrapped(new) and new.config.dense_lora == DenseLoRAConfig(r=4, lora_alpha=8.0, target_modules=("wq", "wv", "wo", "w_down"))
    frozen = {n for n, p in new.named_parameters() if not p.requires_grad}
    # block 0 is dense (its FFN's w_down wrapped too); block 1's MoE has no dense w_down
    assert frozen == {f"blocks.{i}.f.attn.{w}.base_layer.weight" for i in range(2) for w in ("wq", "wv", "wo")} | {"blocks.0.g.ffn.w_down.base_layer.weight"}
    state = outcome.optimizer_state
    assert not any("base_layer" in n for n in state), "frozen bases hold no optimizer state"
    for name, s in state.items():
        if ".lora_" in name:
            assert s.step == 0 and not s.exp_avg.any(), name
        else:
            assert s is opt.state[name], f"{name}: carried state must be the same object"
    for name, p in new.named_parameters():
        if ".lora_B." in name:
            assert not p.any()
        if ".lora_A." in name:  # peft's kaiming-uniform: U(-1/sqrt(in), 1/sqrt(in))
            assert 0 < p.abs().max() <= 1 / p.shape[1] ** 0.5


def test_growth_after_dense_lora_is_refused_at_plan_time_naming_the_fix():
    raw = {
        "model": {"d_model": 32, "n_layers": 1, "n_heads": 2, "ffn_hidden": 64},
        "stages": [
            {"name": "a", "steps": 1},
            {"name": "b", "steps": 1, "grow": [{"op": "add_dense_lora", "r": 2}]},
            {"name": "c", "steps": 1, "grow": [{"op": "deepen"}]},
        ],
    }
    with pytest.raises(RecipeError) as err:
        recipe_from_dict(raw)
    assert "stages.2.grow.0" in str(err.value) and "move add_dense_lora after the last growth step" in str(err.value)
    raw["stages"][1]["grow"] = [{"op": "add_dense_lora", "r": 2}, {"op": "upcycle_moe", "num_experts": 2}]
    with pytest.raises(RecipeError, match=r"stages\.1\.grow\.1"):
        recipe_from_dict(raw)
    raw["stages"][1]["grow"].reverse()  # grow first, add the adapters last: fine
    raw["stages"].pop()
    recipe = recipe_from_dict(raw)
    assert [s.op for s in recipe.stages[1].grow] == ["upcycle_moe", "add_dense_lora"]


def test_add_dense_lora_refuses_layers_the_model_does_not_have():
    moe_only = model_config().with_changes(moe_layers=(0, 1))
    with pytest.raises(GrowthPlanError, match="no dense Linear layer named w_up"):
        add_dense_lora.plan(moe_only, AddDenseLoRAArgs(target_modules=("wq", "w_up")))
    with pytest.raises(GrowthPlanError, match="already holds peft LoRA"):
        add_dense_lora.plan(model_config(dense_lora=DenseLoRAConfig()), AddDenseLoRAArgs())


def test_a_recipe_naming_an_unknown_layer_for_dense_lora_fails_validation_listing_the_valid_ones():
    raw = {"model": {"d_model": 32, "n_layers": 1, "n_heads": 2, "dense_lora": {"target_modules": ["wq", "router"]}}, "stages": [{"name": "a", "steps": 1}]}
    with pytest.raises(RecipeError) as err:
        recipe_from_dict(raw)
    assert "model.dense_lora" in str(err.value) and "wq, wk, wv, wo, w_gate, w_up, w_down, lm_head" in str(err.value)
    raw["model"]["dense_lora"]["target_modules"] = ["wq", "lm_head"]
    assert recipe_from_dict(raw).model.dense_lora.target_modules == ("wq", "lm_head")


def test_a_dense_lora_config_survives_a_checkpoints_plain_dict_and_the_model_loads_strictly():
    cfg = model_config(dense_lora=DenseLoRAConfig(r=2, lora_alpha=4.0, target_modules=("wk", "wo")))
    plain = to_plain(cfg)
    assert plain["dense_lora"]["target_modules"] == ["wk", "wo"]
    back = ModelConfig.from_dict(plain)
    assert back == cfg and hash(back) == hash(cfg)
    torch.manual_seed(0)
    model = GrowLM(cfg)
    assert "blocks.1.f.attn.wk.lora_A.default.weight" in model.state_dict()
    GrowLM(back).load_state_dict(model.state_dict(), strict=True)
    with torch.device("meta"):  # init_weights re-draws the adapters after to_empty too
        meta_model = GrowLM(cfg)
    meta_model.to_empty(device="cpu")
    meta_model.init_weights()
    A, B = meta_model.blocks[0].f.attn.wo.lora_A["default"].weight, meta_model.blocks[0].f.attn.wo.lora_B["default"].weight
    assert A.abs().max() <= 1 / A.shape[1] ** 0.5 and A.abs().max() > 0 and not B.any()


# ---------------------------------------------------------------- whole run: resume and export

STEPS = 26


def lora_recipe() -> dict:
    import copy

    raw = copy.deepcopy(MICRO)
    raw["name"] = "micro-dense-lora"
    raw["stages"].append(
        {
            "name": "adapters",
            "steps": 6,  # steps 21..26; checkpoints at 24 and 26 (and 20, the previous stage's end)
            "seq_len": 32,
            "batch_size": 4,
            "grow": [{"op": "quantize_experts", "r": 2, "lora_alpha": 4.0, "double_quant": False}, {"op": "add_dense_lora", "r": 4, "lora_alpha": 8.0}],
            "schedule": {"warmup_steps": 1},
        }
    )
    return raw


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory):
    recipe, out, done = train_recipe(lora_recipe(), tmp_path_factory.mktemp("dense-lora-reference"), "micro-dense-lora")
    assert "add_dense_lora (exact)" in done.stdout
    return recipe, out


@pytest.mark.slow
def test_a_run_whose_last_stage_adds_dense_lora_trains_only_the_adapters_of_attention(reference_run):
    from growtrain.checkpoint.store import resolve

    from conftest import losses

    _, out = reference_run
    rows = losses(out)
    assert len(rows) == STEPS and all(torch.isfinite(torch.tensor(loss)) for _, loss, _ in rows[-6:])
    before, after = resolve(out / "checkpoints" / "step-00000020", log=lambda s: None), resolve(out, log=lambda s: None)
    assert after.step == STEPS
    weights, state = after.model_state, after.trainer_state["optimizer"]
    for i in range(2):  # the micro run deepened to 2 blocks
        for w in ATTENTION:
            name = f"blocks.{i}.f.attn.{w}"
            assert torch.equal(weights[f"{name}.base_layer.weight"], before.model_state[f"{name}.weight"]), "frozen bases stay"
            assert f"{name}.base_layer.weight" not in state and f"{name}.weight" not in state
            assert weights[f"{name}.lora_B.default.weight"].any(), "the adapters train"
            assert state[f"{name}.lora_A.default.weight"]["step"] == 6
    assert not any(k.startswith("blocks.0.f.attn.wq.") and "lora" not in k for k in state)


@pytest.mark.slow
def test_a_killed_dense_lora_stage_resumes_to_the_uninterrupted_losses_and_weights(reference_run, tmp_path):
    recipe, reference = reference_run
    out = tmp_path / "run"
    # Killed in the last step: the resume loads the wrapped model's step-24 checkpoint strictly.
    kill_and_resume(recipe, out, "step_mid:26")
    final = assert_same_run(out, reference, STEPS)
    assert "blocks.1.f.attn.wv.lora_A.default.weight" in final and "blocks.1.g.ffn.experts.w_up_codes" in final


@pytest.mark.slow
def test_export_adapters_of_the_dense_lora_run_load_into_peft_and_compute_the_runs_logits(reference_run, tmp_path):
    import json

    from growtrain.checkpoint.store import resolve
    from growtrain.hf.adapters import ADAPTER_CONFIG, load_base_model
    import peft

    _, run = reference_run
    out = tmp_path / "adapters"
    done = run_cli("export-adapters", run, out, "--base")
    assert done.returncode == 0, done.stderr[-2000:]
    config = json.loads((out / ADAPTER_CONFIG).read_text())
    assert sorted(config["target_modules"]) == sorted(ATTENTION) and config["target_parameters"]
    loaded = resolve(run, log=lambda s: None)
    model = GrowLM(ModelConfig.from_dict(loaded.meta["model_config"]))
    model.load_state_dict(loaded.model_state, strict=True)
    model.eval()
    tokens = torch.randint(0, model.config.vocab_size, (2, 12))
    peft_model = peft.PeftModel.from_pretrained(load_base_model(out), str(out))
    peft_model.eval()
    with torch.no_grad():
        want, got = model(tokens).logits, peft_model(tokens).logits
    assert (got - want).abs().max().item() < 1e-5 * want.abs().max().item()
