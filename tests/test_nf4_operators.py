"""quantize_experts and merge_adapters through the growth driver: the quantization and merge
errors are measured and reported like any approximate operator's, the adapters start fresh, the
consumed full-precision experts leave no optimizer state behind, and impossible plans (and
peft-wrapped models) are refused with a message. CPU, tiny shapes."""

from __future__ import annotations

import pytest
import torch

from growtrain.model import GrowLM, ModelConfig, MoEConfig
from growtrain.model.dense_lora import DenseLoRAConfig, apply_dense_lora
from growtrain.model.nf4 import MATRICES, NF4Experts
from growtrain.optim.registry import build_optimizer
from growtrain.recipe import GrowthStep, InvarianceConfig, OptimizerConfig, RecipeError, recipe_from_dict
from growtrain.stages import GrowthPlanError, apply_growth, get_operator
from growtrain.stages.operators.quantize import MergeAdaptersArgs, QuantizeExpertsArgs


pytest.importorskip("bitsandbytes")

quantize = get_operator("quantize_experts")
merge = get_operator("merge_adapters")
V = 37


def moe_model(seed=0) -> GrowLM:
    moe = MoEConfig(num_experts=4, top_k=2, expert_hidden=64, router_init_std=0.5)
    cfg = ModelConfig(vocab_size=V, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64, init_std=0.05, moe=moe, moe_layers=(0, 1))
    torch.manual_seed(seed)
    return GrowLM(cfg)


def trained_state(model, steps=2) -> dict:
    """Optimizer state with nonzero moments and step counts, as after some training."""
    opt = build_optimizer(dict(model.named_parameters()), OptimizerConfig())
    for _ in range(steps):
        out = model(torch.randint(0, V, (2, 8)))
        (out.logits.square().mean() + out.aux_loss).backward()
        opt.step(1e-3)
        opt.zero_grad()
    return opt.state


def grow(model, state, op, args):
    g = torch.Generator().manual_seed(7)
    probe = (torch.randint(0, V, (2, 16), generator=g), torch.randint(0, V, (2, 16), generator=g))
    return apply_growth(
        model, state, [GrowthStep(op.name, args)], seed=0, stage_index=1, stage_name="nf4",
        planned=op.plan(model.config, args), probe=probe, invariance_cfg=InvarianceConfig(),
    )


def test_quantize_experts_reports_its_error_and_gives_fresh_adapters_and_no_state_for_the_consumed_experts():
    model = moe_model()
    old_state = trained_state(model)
    outcome = grow(model, old_state, quantize, QuantizeExpertsArgs(r=4, lora_alpha=8.0))
    (record,) = outcome.records
    assert record["passed"] and not record["exact"] and record["operator"] == "quantize_experts"
    m = record["metrics"]
    assert 0 < m["max_abs_dlogits"] and 0 < m["rel_l2"] < 0.05 and m["cosine"] > 0.999, m
    assert "rel_dloss" in m and "max_router_kl" in m
    assert record["provenance"]["reset"] == 2 * 2 * len(MATRICES)

    new = outcome.model
    assert new.config.moe.expert_format == "nf4" and new.config.moe.lora.r == 4
    experts = new.blocks[0].g.ffn.experts
    assert isinstance(experts, NF4Experts)
    for m_ in MATRICES:
        assert torch.count_nonzero(getattr(experts, f"{m_}_lora_B")) == 0, "B must start at zero"
        assert torch.count_nonzero(getattr(experts, f"{m_}_lora_A")) > 0
    state = outcome.optimizer_state
    assert set(state) == {n for n, p in new.named_parameters() if p.requires_grad}
    assert not any(k.endswith(("experts.w_gate", "experts.w_up", "experts.w_down")) for k in state)
    for name, s in state.items():
        if "_lora_" in name:
            assert s.step == 0 and not s.exp_avg.any() and not s.exp_avg_sq.any(), name
        else:
            assert s is old_state[name], f"{name}: carried state must be the same object"
    # the base dequantizes to the old experts up to NF4's error
    old_w = model.blocks[0].g.ffn.experts.w_down.detach()
    rel = ((experts.dequantized("w_down") - old_w).norm() / old_w.norm()).item()
    assert 0 < rel < 0.15, rel


def test_merge_adapters_folds_the_update_into_the_base_reports_the_error_and_restarts_the_adapters():
    quantized = grow(moe_model(), trained_state(moe_model()), quantize, QuantizeExpertsArgs(r=4, lora_alpha=8.0))
    model = quantized.model
    with torch.no_grad():  # adapters as if trained
        for n, p in model.named_parameters():
            if "_lora_B" in n:
                p.normal_(0.0, 0.02)
    state = trained_state(model)
    experts = model.blocks[1].g.ffn.experts
    want = experts.merged("w_up")
    outcome = grow(model, state, merge, MergeAdaptersArgs())
    (record,) = outcome.records
    assert record["passed"] and not record["exact"] and record["operator"] == "merge_adapters"
    assert 0 < record["metrics"]["rel_l2"] < 0.05
    merged = outcome.model.blocks[1].g.ffn.experts
    got = merged.dequantized("w_up")
    rel = ((got - want).norm() / want.norm()).item()
    assert 0 < rel < 0.15, f"requantized base vs base + s·B@A: relative error {rel}"
    for m_ in MATRICES:
        assert torch.count_nonzero(getattr(merged, f"{m_}_lora_B")) == 0
    for name, s in outcome.optimizer_state.items():
        if "_lora_" in name:
            assert s.step == 0 and not s.exp_avg.any(), f"{name}: adapters restart with fresh state"


def test_impossible_plans_are_refused_with_a_message():
    dense = ModelConfig(vocab_size=V, d_model=32, n_layers=2, n_heads=4)
    with pytest.raises(GrowthPlanError, match="upcycle_moe first"):
        quantize.plan(dense, QuantizeExpertsArgs())
    cfg = moe_model().config
    nf4 = quantize.plan(cfg, QuantizeExpertsArgs())
    with pytest.raises(GrowthPlanError, match="already NF4"):
        quantize.plan(nf4, QuantizeExpertsArgs())
    with pytest.raises(GrowthPlanError, match="quantize_experts first"):
        merge.plan(cfg, MergeAdaptersArgs())
    assert merge.plan(nf4, MergeAdaptersArgs()) == nf4


def test_a_recipe_that_quantizes_a_dense_model_fails_validation_naming_the_stage():
    raw = {
        "model": {"d_model": 32, "n_layers": 1, "n_heads": 2},
        "stages": [{"name": "a", "steps": 1}, {"name": "b", "steps": 1, "grow": [{"op": "quantize_experts", "r": 4}]}],
    }
    with pytest.raises(RecipeError) as err:
        recipe_from_dict(raw)
    assert "stages.1.grow.0" in str(err.value) and "upcycle_moe first" in str(err.value)


def test_growth_operators_refuse_a_model_wrapped_by_peft():
    model = apply_dense_lora(moe_model(), DenseLoRAConfig(r=2))
    with pytest.raises(ValueError, match="peft"):
        quantize.apply(model, QuantizeExpertsArgs())
