"""The growth study (benchmarks/growth.py, issue 19) and what it stands on: metrics.jsonl's counted
FLOPs against a hand count, the FLOPs-to-loss interpolation, and the study end to end on the
micro recipe, two seeds."""

from __future__ import annotations

import json
import math
import sys

import pytest
import yaml

from conftest import MICRO, REPO, metrics_rows, train_recipe

sys.path.insert(0, str(REPO / "benchmarks"))

import growth as study  # noqa: E402  (benchmarks/growth.py)

from growtrain.model.config import ModelConfig, MoEConfig  # noqa: E402
from growtrain.planning import model_flops_per_token  # noqa: E402


def hand_count(cfg: ModelConfig, seq: int) -> float:
    """3 x forward matmul FLOPs per token, written out per layer (the formula benchmarks/growth.py
    used before the planner's count): attention projections, causal scores and values, a SwiGLU
    FFN or a routed MoE layer (router + top-k experts + shared expert), the LM head."""
    D, hd, H, K = cfg.d_model, cfg.head_size, cfg.n_heads, cfg.kv_heads
    forward = 2 * D * cfg.vocab_size
    for i in range(cfg.n_layers):
        forward += 2 * D * (2 * H + 2 * K) * hd + 2 * 2 * H * hd * (seq + 1) / 2
        if cfg.is_moe_layer(i):
            m = cfg.moe
            forward += 2 * D * m.num_experts + m.top_k * 6 * D * m.expert_hidden + 6 * D * m.shared_expert_hidden
        else:
            forward += 6 * D * cfg.ffn_hidden
    return 3 * forward


@pytest.mark.parametrize(
    "cfg",
    [
        ModelConfig(vocab_size=256, d_model=64, n_layers=3, n_heads=4, n_kv_heads=2, ffn_hidden=256),
        ModelConfig(vocab_size=256, d_model=64, n_layers=4, n_heads=4, n_kv_heads=1, ffn_hidden=256,
                    moe=MoEConfig(num_experts=8, top_k=2, expert_hidden=128, shared_expert_hidden=64), moe_layers=(1, 3)),
    ],
    ids=["dense", "moe"],
)
def test_counted_flops_per_token_match_a_hand_count_of_the_matmuls(cfg):
    got, want = model_flops_per_token(cfg, 128), hand_count(cfg, 128)
    assert math.isclose(got, want, rel_tol=1e-12), (got, want)


def test_metrics_count_every_steps_flops_at_its_stages_shape(tmp_path):
    """`flops` is cumulative, and grows per step by the hand count at that stage's shape."""
    from growtrain.stages import plan_stage_models
    from growtrain.recipe import load_recipe

    recipe_path, run_dir, _ = train_recipe(MICRO, tmp_path, "micro")
    recipe = load_recipe(recipe_path)
    vocab = study.final_model_config(run_dir).vocab_size  # the byte tokenizer's, specials included
    shapes = plan_stage_models(recipe.model.with_changes(vocab_size=vocab), [s.grow for s in recipe.stages])
    rows = metrics_rows(run_dir)
    per_stage = {s.name: hand_count(cfg, s.seq_len) * s.batch_size * s.seq_len * s.grad_accum for cfg, s in zip(shapes, recipe.stages)}
    previous = 0.0
    for row in rows:
        assert math.isclose(row["flops"] - previous, per_stage[row["stage"]], rel_tol=1e-9), row
        previous = row["flops"]


def test_flops_to_reach_interpolates_between_evaluations():
    curve = [(10.0, 3.0), (20.0, 2.0), (30.0, 1.5)]
    assert study.flops_to_reach(curve, 2.5) == pytest.approx(15.0)
    assert study.flops_to_reach(curve, 2.0) == 20.0
    assert study.flops_to_reach(curve, 3.5) == 10.0  # already below at the first evaluation
    assert study.flops_to_reach(curve, 1.0) is None  # never reached
    assert study.flops_to_reach([(10.0, 3.0), (20.0, 3.0), (30.0, 2.0)], 3.0) == 10.0


def test_the_study_trains_three_arms_per_seed_at_the_grown_runs_flops(tmp_path, capsys):
    raw = {**MICRO, "stages": MICRO["stages"][:2]}  # dense -> moe: a few seconds a run
    recipe = tmp_path / "micro.yaml"
    recipe.write_text(yaml.safe_dump(raw, sort_keys=False))
    args = ["--recipe", str(recipe), "--seeds", "0,1", "--out", str(tmp_path / "runs"), "--schedules", "wsd", "--grow-at", "0.75", "--json"]
    assert study.main(args) == 0
    result = json.loads(capsys.readouterr().out)
    assert set(result["arms"]) == {"grown", "grown-wsd", "scratch", "dense"}
    # The run-wide arm trains the same steps at the same shapes (one scratch arm serves both), on another LR curve.
    for g, w in zip(result["arms"]["grown"], result["arms"]["grown-wsd"]):
        assert (g["steps"], g["flops"]) == (w["steps"], w["flops"]) and g["final_eval_loss"] != w["final_eval_loss"]
    assert set(result["variants"]) == {"grown", "grown-wsd"}
    # One excursion per growth and seed: the held-out loss at the dense stage's end, the worst after.
    assert [(e["seed"], e["transition"], e["operators"]) for e in result["excursions"]] == [(0, "moe", ["upcycle_moe"]), (1, "moe", ["upcycle_moe"])]
    for e in result["excursions"]:
        assert e["relative"] == pytest.approx((e["worst_after"] - e["before"]) / e["before"])
    # The 4 upcycled experts are copies of one FFN: 6 sibling pairs at the MoE stage's end.
    assert result["sibling_divergence"]["0"]["moe"]["0"]["pairs"] == 6
    (point,) = result["grow_at"]
    assert point["fraction"] == 0.75 and point["seed"] == 0 and point["seed_steps"] > 8
    assert point["flops"] == pytest.approx(result["arms"]["grown"][0]["flops"], rel=0.1)
    for seed in (0, 1):
        grown, scratch, dense = (result["arms"][arm][seed] for arm in ("grown", "scratch", "dense"))
        assert grown["seed"] == scratch["seed"] == dense["seed"] == seed
        assert grown["steps"] == 14
        # Equal budgets: each single-stage arm within one of its own steps of the grown run's FLOPs.
        for arm in (scratch, dense):
            per_step = arm["flops"] / arm["steps"]
            assert grown["flops"] - per_step < arm["flops"] <= grown["flops"], (arm, grown)
        # The dense seed model costs less per token than the grown MoE one: it sees more tokens.
        assert dense["tokens"] > grown["tokens"] > 0
        assert all(math.isfinite(a["final_eval_loss"]) for a in (grown, scratch, dense))
    # Different seeds train different runs.
    assert result["arms"]["grown"][0]["final_eval_loss"] != result["arms"]["grown"][1]["final_eval_loss"]
    assert len(result["flops_ratio_per_seed"]) == 2 and [len(result["grown_minus"][a]) for a in ("scratch", "dense")] == [2, 2]
    ratios = result["flops_ratio_per_seed"]
    if all(r is not None for r in ratios):
        assert result["flops_ratio_to_scratch_loss"] == pytest.approx(sum(ratios) / 2)
    else:
        assert result["flops_ratio_to_scratch_loss"] is None
    assert "seeds 0, 1" in study.format_table(result)
    # Each excursion beside the dense arm's rise over the same steps, read from that arm's own run.
    for e in result["excursions"]:
        dense_evals = [(r["step"], r["eval_loss"]) for r in metrics_rows(tmp_path / "runs" / f"seed{e['seed']}" / "dense") if "eval_loss" in r]
        assert e["control"] == study.control(e, dense_evals) and e["control"] is not None
        assert e["control"]["before"] == [loss for step, loss in dense_evals if step <= e["step"]][-1]
    assert "dense arm, same steps" in study.format_table(result)
    # --reread trains nothing and reads the same results back from the kept runs.
    mtimes = {p: p.stat().st_mtime_ns for p in (tmp_path / "runs").rglob("metrics.jsonl")}
    assert study.main([*args, "--reread"]) == 0
    again = json.loads(capsys.readouterr().out)
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "runs").rglob("metrics.jsonl")} == mtimes
    strip = lambda r: {**r, "arms": {a: [{**x, "seconds": 0.0} for x in xs] for a, xs in r["arms"].items()}, "grow_at": [{**x, "seconds": 0.0} for x in r["grow_at"]]}
    assert strip(again) == strip(result)
    with pytest.raises(SystemExit, match="no finished run"):
        study.main([*args[:4], "--out", str(tmp_path / "elsewhere"), "--reread"])


def test_an_excursions_control_is_the_never_grown_arms_rise_over_the_same_steps():
    entry = {"step": 100, "stop": 200}
    evals = [(50, 2.5), (100, 2.0), (150, 2.4), (200, 2.2), (250, 1.0)]
    assert study.control(entry, evals) == {"before": 2.0, "worst_after": 2.4, "relative": pytest.approx(0.2)}
    assert study.control(entry, evals[:2]) is None  # none in the window
    assert study.control({"step": 10, "stop": 40}, evals) is None  # none before the growth, none inside


def test_the_scratch_arm_is_the_same_whether_the_grown_run_is_scheduled_per_stage_or_run_wide():
    from growtrain.recipe import recipe_from_dict

    recipe = recipe_from_dict(MICRO)
    wide = study.run_wide(recipe, "wsd")
    assert wide.schedule.run_wide and all(s.schedule.warmup_steps == 0 for s in wide.stages)
    shape = recipe.model.with_changes(vocab_size=300)
    a, b = study.one_stage(recipe, "scratch", shape, 1e9), study.one_stage(wide, "scratch", shape, 1e9)
    assert a.stages == b.stages and not a.schedule.run_wide and not b.schedule.run_wide
    assert a.stages[0].schedule.warmup_steps == recipe.stages[0].schedule.warmup_steps


@pytest.mark.parametrize("name", ["tiny"])
def test_the_shipped_recipes_are_their_per_stage_versions_under_one_run_wide_wsd(name):
    """So the study's `grown-wsd` arm of benchmarks/recipes/NAME-per-stage.yaml is the shipped recipe."""
    from growtrain.recipe import load_recipe

    per_stage = load_recipe(REPO / "benchmarks" / "recipes" / f"{name}-per-stage.yaml")
    assert not per_stage.schedule.run_wide
    assert study.run_wide(per_stage, "wsd") == load_recipe(REPO / "recipes" / f"{name}.yaml")


def test_the_half_lr_small_recipe_is_the_per_stage_small_recipe_with_only_its_lr_halved():
    """So the half-LR study (docs/results.md) compares one change: benchmarks/recipes/small-lr1.5e-3.yaml
    against the small recipe it ran beside (benchmarks/recipes/small-per-stage.yaml)."""
    from dataclasses import replace

    from growtrain.recipe import load_recipe

    per_stage, half = load_recipe(REPO / "benchmarks" / "recipes" / "small-per-stage.yaml"), load_recipe(REPO / "benchmarks" / "recipes" / "small-lr1.5e-3.yaml")
    assert half.optimizer.lr == per_stage.optimizer.lr / 2
    assert replace(half, name=per_stage.name, optimizer=per_stage.optimizer) == per_stage


def test_the_split_noise_tiny_recipe_is_the_shipped_tiny_recipe_with_only_router_noise_on_its_splits():
    """So the split-noise study (docs/results.md) compares one change: benchmarks/recipes/tiny-split-noise.yaml."""
    from dataclasses import replace

    from growtrain.recipe import load_recipe

    shipped, noisy = load_recipe(REPO / "recipes" / "tiny.yaml"), load_recipe(REPO / "benchmarks" / "recipes" / "tiny-split-noise.yaml")
    splits = [(i, j) for i, st in enumerate(noisy.stages) for j, g in enumerate(st.grow) if g.op == "split_experts"]
    assert len(splits) == 3 and all(noisy.stages[i].grow[j].args.router_noise == 0.05 for i, j in splits)
    quiet = [
        replace(st, grow=tuple(replace(g, args=replace(g.args, router_noise=0.0)) if g.op == "split_experts" else g for g in st.grow))
        for st in noisy.stages
    ]
    assert replace(noisy, name=shipped.name, stages=tuple(quiet)) == shipped


def test_fresh_sets_every_growing_stage_and_nothing_else_and_refuses_what_validate_refuses():
    from dataclasses import replace

    from growtrain.recipe import FreshConfig, RecipeError, recipe_from_dict

    recipe = recipe_from_dict(MICRO)
    fresh = study.with_fresh(recipe, "warmup_steps=3, lr_mult=0.5")
    assert fresh.name == "micro+fresh"
    assert [s.fresh for s in fresh.stages] == [FreshConfig(), FreshConfig(lr_mult=0.5, warmup_steps=3), FreshConfig(lr_mult=0.5, warmup_steps=3)]
    assert replace(fresh, name=recipe.name, stages=recipe.stages) == recipe
    assert [s.fresh for s in study.run_wide(fresh, "cosine").stages] == [s.fresh for s in fresh.stages]  # every grown arm keeps it
    for bad, message in (("warmup_steps=7", "7 warmup steps exceed the stage's 6 steps"), ("warm=2", "unknown key 'warm'"), ("lr_mult", "not KEY=VALUE")):
        with pytest.raises(RecipeError) as info:
            study.with_fresh(recipe, bad)
        assert message in str(info.value), str(info.value)
