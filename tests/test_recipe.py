"""Recipe loading and validation, in-process: typos, types, ranges, stage consistency, line numbers,
`--set` overrides, the print-config round trip, and each stage's LR schedule."""

from __future__ import annotations

import copy
import math
import re
from collections import Counter
from pathlib import Path

import pytest
import yaml

from growtrain.recipe import Recipe, RecipeError, ScheduleConfig, StageConfig, dump_yaml, load_recipe, recipe_from_dict

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "recipes" / "tiny.yaml"

# A small valid recipe; tests break copies of it.
GOOD = {
    "name": "t",
    "model": {"d_model": 32, "n_layers": 2, "n_heads": 2, "ffn_hidden": 64},
    "stages": [
        {"name": "dense", "steps": 10},
        {"name": "moe", "steps": 10, "grow": [{"op": "upcycle_moe", "num_experts": 4, "top_k": 2}]},
    ],
}


def variant(**sections) -> dict:
    raw = copy.deepcopy(GOOD)
    raw.update(copy.deepcopy(sections))
    return raw


def problems_of(raw: dict) -> list[str]:
    with pytest.raises(RecipeError) as info:
        recipe_from_dict(raw)
    return info.value.problems


def problems_in_file(tmp_path: Path, text: str, overrides: list[str] = ()) -> list[str]:
    path = tmp_path / "r.yaml"
    path.write_text(text)
    with pytest.raises(RecipeError) as info:
        load_recipe(path, overrides)
    return info.value.problems


def one(problems: list[str], pattern: str) -> str:
    """The single problem matching `pattern` (a regex); fails listing them all otherwise."""
    hits = [p for p in problems if re.search(pattern, p)]
    assert len(hits) == 1, f"expected exactly one problem matching {pattern!r}, got {len(hits)}:\n" + "\n".join(problems)
    return hits[0]


def assert_no_duplicates(problems: list[str]) -> None:
    dups = [p for p, n in Counter(problems).items() if n > 1]
    assert not dups, "problems listed more than once:\n" + "\n".join(dups)


# ---------------------------------------------------------------------------------------------
# Loading and validation


def test_tiny_recipe_loads_with_its_four_stages():
    recipe = load_recipe(TINY)
    assert isinstance(recipe, Recipe)
    assert [s.name for s in recipe.stages] == ["dense", "moe", "deep", "nf4"]
    assert [g.op for g in recipe.stages[1].grow] == ["upcycle_moe"]
    assert recipe.stages[2].grow[0].args.after == (0, 1)
    assert [g.op for g in recipe.stages[3].grow] == ["quantize_experts", "split_experts"]


def test_typos_are_reported_with_the_nearest_valid_key():
    raw = variant(model={"d_modle": 32, "n_layers": 2, "n_heads": 2}, stagse=[])
    raw["stages"][0]["bach_size"] = 4
    problems = problems_of(raw)
    assert "did you mean 'd_model'?" in one(problems, r"^model\.d_modle\b")
    assert "did you mean 'stages'?" in one(problems, r"^stagse\b")
    assert "did you mean 'batch_size'?" in one(problems, r"^stages\.0\.bach_size\b")


def test_wrong_types_are_reported():
    raw = variant(model={"d_model": "thirty-two", "n_layers": True, "n_heads": 2, "rope_theta": [1, 2]})
    problems = problems_of(raw)
    assert "expected an integer, got a string" in one(problems, r"^model\.d_model\b")
    assert "expected an integer, got a boolean" in one(problems, r"^model\.n_layers\b")
    assert "expected a number, got a list" in one(problems, r"^model\.rope_theta\b")


def test_out_of_range_values_are_reported():
    raw = variant(data={"eval_fraction": 0.9}, optimizer={"beta2": 1.0})
    raw["stages"][0]["steps"] = 0
    problems = problems_of(raw)
    assert "must be >= 1" in one(problems, r"^stages\.0\.steps\b")
    assert "must be < 0.5" in one(problems, r"^data\.eval_fraction\b")
    assert "must be < 1.0" in one(problems, r"^optimizer\.beta2\b")


def test_exponent_without_a_dot_is_read_as_a_float(tmp_path):
    # YAML 1.1 (PyYAML) reads `3e-4` as the string '3e-4'; a float field must still accept it.
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(variant()) + "optimizer: {lr: 3e-4}\n")
    assert yaml.safe_load("x: 3e-4")["x"] == "3e-4"
    assert load_recipe(path).optimizer.lr == pytest.approx(3e-4)


def test_a_string_that_is_not_a_number_is_still_rejected_for_a_float():
    assert "expected a number" in one(problems_of(variant(optimizer={"lr": "fast"})), r"^optimizer\.lr\b")


def test_deepen_after_a_block_that_does_not_exist_names_the_stage_and_grow_index():
    raw = variant()
    raw["stages"].append({"name": "deep", "grow": [{"op": "deepen", "after": [5]}]})
    problem = one(problems_of(raw), r"deepen")
    assert problem.startswith("stages.2.grow.0")
    assert "block 5 does not exist" in problem and "2 blocks" in problem


def test_upcycling_the_same_layers_twice_is_reported():
    raw = variant()
    raw["stages"].append({"name": "again", "grow": [{"op": "upcycle_moe", "num_experts": 4, "layers": [0]}]})
    problem = one(problems_of(raw), r"upcycle_moe")
    assert problem.startswith("stages.2.grow.0")
    assert "already an MoE layer" in problem


def test_unknown_growth_operator_suggests_the_registered_one():
    raw = variant()
    raw["stages"][1]["grow"][0]["op"] = "upcyle_moe"
    problem = one(problems_of(raw), r"upcyle_moe")
    assert problem.startswith("stages.1.grow.0.op")
    assert "did you mean 'upcycle_moe'?" in problem


def test_growth_operator_arguments_are_checked_like_fields():
    raw = variant()
    raw["stages"][1]["grow"][0].update(num_expertz=4, top_k=0)
    problems = problems_of(raw)
    assert "did you mean 'num_experts'?" in one(problems, r"stages\.1\.grow\.0\.num_expertz")
    assert "must be >= 1" in one(problems, r"stages\.1\.grow\.0\.top_k")


def test_duplicate_stage_names_and_warmup_longer_than_the_stage_are_reported():
    raw = variant()
    raw["stages"][1]["name"] = "dense"
    raw["stages"][0]["schedule"] = {"warmup_steps": 20}
    problems = problems_of(raw)
    assert "already used by stage 0" in one(problems, r"^stages\.1\.name\b")
    assert "exceed the stage's 10 steps" in one(problems, r"^stages\.0\.schedule\.warmup_steps\b")


def test_wsd_decay_overlapping_the_warmup_is_reported():
    raw = variant()
    raw["stages"][0]["schedule"] = {"kind": "wsd", "warmup_steps": 5, "decay_fraction": 0.8}
    assert "overlaps the 5 warmup steps" in one(problems_of(raw), r"^stages\.0\.schedule\.decay_fraction\b")


def test_a_recipe_without_stages_is_reported():
    raw = variant()
    del raw["stages"]
    assert "at least one stage" in one(problems_of(raw), r"^stages\b")


@pytest.mark.parametrize(
    "model, path, message",
    [
        ({"d_model": 30, "n_heads": 4}, "model.n_heads", "not divisible by n_heads 4"),
        ({"d_model": 32, "n_heads": 4, "n_kv_heads": 3}, "model.n_kv_heads", "not a multiple of n_kv_heads 3"),
        ({"d_model": 32, "n_heads": 2, "moe_layers": [0]}, "model.moe_layers", "`moe` is not set"),
    ],
)
def test_model_shape_problems_are_reported(model, path, message):
    assert message in one(problems_of(variant(model=model)), "^" + re.escape(path) + r"\b")


def test_cross_checks_still_run_when_other_fields_are_invalid():
    # One run must list every problem: a type error elsewhere may not hide the stage-order problem.
    raw = variant(optimizer={"lr": "fast"})
    raw["stages"][0]["steps"] = 0
    raw["stages"][1]["name"] = "dense"
    raw["stages"].append({"name": "deep", "grow": [{"op": "deepen", "after": [5]}]})
    problems = problems_of(raw)
    one(problems, r"^optimizer\.lr\b")
    one(problems, r"^stages\.0\.steps\b")
    one(problems, r"^stages\.1\.name\b.*already used")
    one(problems, r"^stages\.2\.grow\.0\b.*block 5 does not exist")


BROKEN_YAML = """\
name: broken
model:
  d_modle: 32
  n_layers: 2
  n_heads: "two"
optimizer:
  beta2: 1.0
stagse: []
stages:
  - name: a
    steps: 0
  - name: a
    steps: 10
    schedule: {warmup_steps: 20}
  - name: c
    grow:
      - {op: upcyle_moe}
"""


def test_every_problem_appears_exactly_once():
    raw = yaml.safe_load(BROKEN_YAML)
    problems = problems_of(raw)
    assert_no_duplicates(problems)
    assert len(problems) == 8, "\n".join(problems)


def test_problems_name_the_yaml_line(tmp_path):
    problems = problems_in_file(tmp_path, BROKEN_YAML)
    assert_no_duplicates(problems)
    expected = {
        r"^model\.d_modle\b": 3,
        r"^model\.n_heads\b": 5,
        r"^optimizer\.beta2\b": 7,
        r"^stagse\b": 8,
        r"^stages\.0\.steps\b": 11,
        r"^stages\.1\.name\b": 12,
        r"^stages\.1\.schedule\.warmup_steps\b": 14,
        r"^stages\.2\.grow\.0\.op\b": 17,
    }
    for pattern, line in expected.items():
        assert f"(line {line})" in one(problems, pattern)
    assert len(problems) == len(expected), "\n".join(problems)


def test_a_key_written_twice_is_reported_with_both_lines(tmp_path):
    text = "name: a\nstages:\n  - name: s\n    steps: 3\n    steps: 4\n"
    assert problems_in_file(tmp_path, text) == ["stages.0.steps (line 5): duplicate key; it is already set on line 4"]


def test_invalid_yaml_is_a_recipe_error_with_its_line(tmp_path):
    problem = one(problems_in_file(tmp_path, "name: x\nstages: [\n"), r"not valid YAML")
    assert "line 3" in problem


def test_a_top_level_list_is_a_recipe_error(tmp_path):
    one(problems_in_file(tmp_path, "- a\n- b\n"), r"top level must be a mapping")


def test_a_missing_file_is_a_recipe_error(tmp_path):
    with pytest.raises(RecipeError, match="no such recipe file"):
        load_recipe(tmp_path / "nope.yaml")


# ---------------------------------------------------------------------------------------------
# --set overrides


def test_overrides_apply_to_nested_keys_and_list_items():
    recipe = load_recipe(TINY, ["stages.0.steps=40", "optimizer.lr=1e-3", "tracking.wandb.mode=disabled", "model.moe_layers=[]"])
    assert recipe.stages[0].steps == 40
    assert recipe.optimizer.lr == pytest.approx(1e-3)
    assert recipe.tracking.wandb.mode == "disabled"
    assert recipe.stages[2].grow[0].args.after == (0, 1)  # untouched


def test_overrides_of_growth_arguments_apply():
    recipe = load_recipe(TINY, ["stages.1.grow.0.num_experts=4"])
    assert recipe.stages[1].grow[0].args.num_experts == 4


def test_bad_override_paths_are_reported():
    with pytest.raises(RecipeError) as info:
        load_recipe(TINY, ["stages.9.steps=5", "name.x=1", "model.d_modle=64", "noequals"])
    problems = info.value.problems
    assert "has no item 9 (it has 4)" in one(problems, r"^--set stages\.9\.steps")
    assert "is not a section" in one(problems, r"^--set name\.x")
    assert "did you mean 'd_model'?" in one(problems, r"^model\.d_modle \(--set\)")
    assert "expected key.path=value" in one(problems, r"noequals")


def test_an_invalid_override_value_is_attributed_to_the_override():
    with pytest.raises(RecipeError) as info:
        load_recipe(TINY, ["stages.0.steps=0"])
    assert info.value.problems == ["stages.0.steps (--set): 0 is out of range: must be >= 1"]


# ---------------------------------------------------------------------------------------------
# print-config round trip


def test_print_config_output_reloads_to_an_equal_recipe(tmp_path):
    recipe = load_recipe(TINY)
    text = dump_yaml(recipe)
    path = tmp_path / "resolved.yaml"
    path.write_text(text)
    assert load_recipe(path) == recipe
    assert recipe_from_dict(yaml.safe_load(text)) == recipe


def test_print_config_fills_in_every_default():
    plain = yaml.safe_load(dump_yaml(load_recipe(TINY)))
    assert plain["optimizer"]["beta2"] == 0.95
    assert plain["stages"][0]["schedule"]["decay_fraction"] == 0.2
    assert plain["stages"][1]["grow"][0]["score_func"] == "softmax"


# ---------------------------------------------------------------------------------------------
# StageConfig.lr: the schedule as a lookup


def stage(kind: str, steps: int = 20, warmup: int = 4, **schedule) -> StageConfig:
    return StageConfig(name="s", steps=steps, schedule=ScheduleConfig(kind=kind, warmup_steps=warmup, **schedule))


@pytest.mark.parametrize("kind", ["cosine", "wsd", "constant"])
def test_warmup_ramps_linearly_from_peak_over_warmup_to_peak(kind):
    s = stage(kind, warmup=4)
    assert [s.lr(i, 1.0) for i in range(4)] == pytest.approx([0.25, 0.5, 0.75, 1.0])


def test_cosine_decays_monotonically_to_the_floor_on_the_last_step():
    s = stage("cosine", steps=20, warmup=4, min_lr_ratio=0.1)
    after = [s.lr(i, 2.0) for i in range(4, 20)]
    assert all(a >= b for a, b in zip(after, after[1:]))
    assert after[0] < 2.0
    assert s.lr(19, 2.0) == pytest.approx(0.2)
    # midpoint of the decay: halfway between peak and floor
    assert s.lr(4 + 8 - 1, 2.0) == pytest.approx(0.2 + 0.5 * (2.0 - 0.2) * (1 + math.cos(math.pi * 0.5)))


def test_wsd_holds_the_peak_then_decays_linearly_to_the_floor():
    s = stage("wsd", steps=20, warmup=4, min_lr_ratio=0.0, decay_fraction=0.25)  # decay over the last 5 steps
    assert [s.lr(i, 1.0) for i in range(4, 15)] == pytest.approx([1.0] * 11)
    assert [s.lr(i, 1.0) for i in range(15, 20)] == pytest.approx([0.8, 0.6, 0.4, 0.2, 0.0])


def test_constant_stays_at_the_peak_after_warmup():
    s = stage("constant", steps=20, warmup=4, min_lr_ratio=0.1)
    assert [s.lr(i, 1.0) for i in range(4, 20)] == pytest.approx([1.0] * 16)


def test_zero_warmup_starts_at_the_peak():
    assert stage("constant", warmup=0).lr(0, 1.0) == 1.0
    assert stage("wsd", warmup=0).lr(0, 1.0) == 1.0


def test_peak_lr_overrides_the_optimizer_lr():
    assert stage("constant", warmup=0, peak_lr=0.5).lr(3, 3e-3) == 0.5


@pytest.mark.parametrize("name", ["tiny"])
def test_the_shipped_recipes_hold_the_lr_through_every_growth_and_decay_once(name):
    recipe = load_recipe(REPO / "recipes" / f"{name}.yaml")
    assert recipe.schedule.kind == "wsd"
    base, total = recipe.optimizer.lr, recipe.total_steps
    starts = [sum(s.steps for s in recipe.stages[:i]) for i in range(1, len(recipe.stages))]
    lr = [recipe.lr(i, k) for i, st in enumerate(recipe.stages) for k in range(st.steps)]
    for start in starts:  # no re-warm: the step after a growth runs at the step before's LR, or one decay step on
        assert lr[start] <= lr[start - 1] and lr[start] == pytest.approx(lr[start - 1], rel=0.1), (name, start)
    assert lr[recipe.schedule.warmup_steps - 1] == base and lr[-1] == pytest.approx(base * recipe.schedule.min_lr_ratio)
    assert sum(1 for a, b in zip(lr, lr[1:]) if b < a) == recipe.schedule.decay_steps(total)


def test_the_120b_rehearsal_keeps_the_120b_recipes_structure_at_a_tiny_width():
    """Everything but widths, steps and batch shapes: block counts, heads, experts, top-k, every
    operator with every argument, NF4 and LoRA settings, per stage."""
    import dataclasses

    from growtrain.stages import plan_stage_models

    big, small = load_recipe(REPO / "recipes" / "120b.yaml"), load_recipe(REPO / "recipes" / "120b-rehearsal.yaml")
    assert [s.name for s in small.stages] == [s.name for s in big.stages]
    assert [[(g.op, g.args) for g in s.grow] for s in small.stages] == [[(g.op, g.args) for g in s.grow] for s in big.stages]
    widths = {"vocab_size", "d_model", "head_dim", "ffn_hidden"}

    def structure(cfg):
        moe = dataclasses.replace(cfg.moe, expert_hidden=0) if cfg.moe is not None else None
        return {k: v for k, v in dataclasses.asdict(dataclasses.replace(cfg, moe=moe)).items() if k not in widths}

    shapes_big = plan_stage_models(big.model, [s.grow for s in big.stages])
    shapes_small = plan_stage_models(small.model, [s.grow for s in small.stages])
    for a, b in zip(shapes_big, shapes_small):
        assert structure(a) == structure(b)
    assert shapes_small[-1].moe.num_experts == 256 and shapes_small[-1].n_layers == 36
