"""The run-wide learning-rate schedule (top-level `schedule:`, issue 43) and the sibling-divergence
numbers every stage end reports (growtrain/runtime/divergence.py): the LR as a pure function of the run's
position, continuous through a growth, repeated by a resume; what `validate` refuses; how far
siblings have moved apart, in metrics.jsonl and `growtrain inspect`."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch

from conftest import MICRO, assert_same_run, kill_and_resume, metrics_rows, run_cli, train_recipe

from growtrain.runtime.divergence import layer_divergence, sibling_divergence, sibling_parents
from growtrain.model import GrowLM
from growtrain.model.config import ModelConfig, MoEConfig
from growtrain.recipe import RecipeError, recipe_from_dict
from growtrain.stages import plan_stage_models


def run_wide(kind: str = "wsd", **schedule) -> dict:
    """MICRO under one run-wide schedule: a 2-step re-warm at the MoE growth, none at the deepen +
    split one (20 steps: dense 8, moe 6, deep 6)."""
    raw = copy.deepcopy(MICRO)
    raw["schedule"] = {"kind": kind, "warmup_steps": 2, "min_lr_ratio": 0.1, **schedule}
    raw["stages"][0].pop("schedule")
    raw["stages"][1]["schedule"] = {"warmup_steps": 2}
    raw["stages"][2]["schedule"] = {}
    raw["stages"][2]["grow"] = [{"op": "deepen", "after": [0]}, {"op": "split_experts"}]
    return raw


def lrs(recipe) -> list[float]:
    return [recipe.lr(i, s) for i, st in enumerate(recipe.stages) for s in range(st.steps)]


# ---------------------------------------------------------------------------------------------
# The schedule as a lookup


def test_wsd_warms_up_once_holds_the_peak_through_every_growth_and_decays_once_at_the_end():
    recipe = recipe_from_dict(run_wide("wsd", decay_fraction=0.25))  # the last 5 of 20 steps decay
    got = lrs(recipe)
    peak = recipe.optimizer.lr
    assert got[:2] == pytest.approx([peak / 2, peak])
    assert got[8:10] == pytest.approx([peak / 2, peak])  # the MoE stage's own 2-step re-warm
    assert got[2:8] == pytest.approx([peak] * 6) and got[10:15] == pytest.approx([peak] * 5)
    assert got[13] == got[14] == peak  # continuous through the deepen + split growth: no re-warm there
    assert got[15:] == pytest.approx([peak - (peak - 0.1 * peak) * k / 5 for k in range(1, 6)])


def test_cosine_decays_once_over_the_runs_total_steps_whatever_the_stages():
    recipe = recipe_from_dict(run_wide("cosine"))
    got, peak = lrs(recipe), recipe.optimizer.lr
    after = got[2:8] + got[10:]  # outside the re-warm
    assert all(a >= b for a, b in zip(after, after[1:]))
    assert got[-1] == pytest.approx(0.1 * peak)
    half = 2 + (20 - 2) // 2 - 1  # halfway through the decay: midway between peak and floor
    assert got[half] == pytest.approx(0.1 * peak + 0.5 * 0.9 * peak * (1 + math.cos(math.pi * 0.5)))


def test_a_rewarm_with_its_own_peak_climbs_to_it_then_hands_over_to_the_run():
    raw = run_wide("wsd")
    raw["stages"][1]["schedule"] = {"warmup_steps": 4, "peak_lr": 1e-3}
    recipe = recipe_from_dict(raw)
    assert [recipe.lr(1, s) for s in range(5)] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3, recipe.optimizer.lr])


def test_per_stage_schedules_are_unchanged_by_default():
    recipe = recipe_from_dict(copy.deepcopy(MICRO))
    assert not recipe.schedule.run_wide
    assert lrs(recipe) == [st.lr(s, recipe.optimizer.lr) for st in recipe.stages for s in range(st.steps)]


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda r: r["stages"][1]["schedule"].update(kind="wsd", min_lr_ratio=0.2), "stages.1.schedule.kind: kind, min_lr_ratio: not read"),
        (lambda r: r["stages"][1]["schedule"].update(min_lr_ratio=0.2), "min_lr_ratio: not read under the run-wide schedule"),
        (lambda r: r["stages"][0].update(schedule={"warmup_steps": 3}), "the first stage starts the run"),
        (lambda r: r["schedule"].update(warmup_steps=21), "21 warmup steps exceed the run's 20 steps"),
        (lambda r: r["schedule"].update(decay_fraction=0.95), "wsd: the final decay (19 of the run's 20 steps) overlaps the 2 warmup steps"),
        (lambda r: r.update(schedule={"kind": "stages", "min_lr_ratio": 0.2}), "read only by a run-wide schedule"),
        (lambda r: r["schedule"].update(kind="linear"), "schedule.kind: "),
    ],
)
def test_every_bad_combination_is_explained(change, message):
    raw = run_wide("wsd")
    change(raw)
    with pytest.raises(RecipeError) as exc:
        recipe_from_dict(raw)
    assert any(message in p for p in exc.value.problems), exc.value.problems


def test_validate_names_a_stage_setting_the_run_wide_schedule_would_ignore(tmp_path):
    import yaml

    raw = run_wide("wsd")
    raw["stages"][2]["schedule"] = {"kind": "cosine", "min_lr_ratio": 0.3}
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    done = run_cli("validate", path)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "stages.2.schedule.min_lr_ratio (line" in done.stderr and "not read under the run-wide schedule (schedule.kind: wsd)" in done.stderr


def test_validate_shows_the_schedule_and_each_stages_first_and_last_lr(tmp_path):
    import yaml

    path = tmp_path / "ok.yaml"
    path.write_text(yaml.safe_dump(run_wide("wsd", decay_fraction=0.25), sort_keys=False))
    out = run_cli("validate", path).stdout
    assert "20 steps, run-wide wsd schedule (warmup 2 steps, floor 0.1 x optimizer.lr)" in out
    assert "moe: 1 blocks, d_model 32, MoE 4 experts top-2 in 1 layer(s); 6 steps, lr 1.50e-03 -> 3.00e-03" in out


# ---------------------------------------------------------------------------------------------
# Through real runs


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    recipe, out, done = train_recipe(run_wide("wsd", decay_fraction=0.25), tmp_path_factory.mktemp("runwide"), "runwide")
    return recipe, out, done


def test_the_run_trains_at_the_lookups_lr_and_a_resume_mid_stage_repeats_it(reference, tmp_path):
    recipe_path, out, _ = reference
    from growtrain.recipe import load_recipe

    recipe = load_recipe(recipe_path)
    rows = metrics_rows(out)
    assert [r["lr"] for r in rows] == pytest.approx(lrs(recipe), rel=1e-12)
    resumed = tmp_path / "run"
    kill_and_resume(recipe_path, resumed, "step_mid:18")  # in the deep stage, after the step-16 checkpoint
    assert_same_run(resumed, out, 20)
    assert [r["lr"] for r in metrics_rows(resumed)] == [r["lr"] for r in rows]


def test_every_stage_end_reports_how_far_siblings_moved_apart(reference):
    _, out, done = reference
    rows = {r["step"]: r for r in metrics_rows(out)}
    moe_end, deep_end = rows[14], rows[20]
    # After the upcycle: 4 copies of the one FFN, 6 pairs; no top-k number (every pick is a sibling).
    assert moe_end["siblings/layer0/pairs"] == 6 and "siblings/layer0/topk_two_siblings" not in moe_end
    assert -1 <= moe_end["siblings/layer0/weight_cos_max"] <= 1
    # After deepen + split x2 (4 -> 8 experts of 4 parents): 4 sibling pairs per MoE layer.
    assert deep_end["siblings/layer0/pairs"] == 4
    assert 0 <= deep_end["siblings/layer0/topk_two_siblings"] <= 1
    assert "siblings [deep]: MoE layer 0: 8 experts from 4 parent(s), 4 sibling pairs" in done.stdout
    report = json.loads(run_cli("inspect", out, "--json").stdout)
    assert set(report["sibling_divergence"]) == {"moe", "deep"}
    assert report["sibling_divergence"]["deep"]["0"]["pairs"] == 4
    assert "sibling experts at each stage's end" in run_cli("inspect", out).stdout


# ---------------------------------------------------------------------------------------------
# The numbers themselves


def test_siblings_are_the_children_of_the_last_growth_of_the_expert_count():
    seed = ModelConfig(vocab_size=64, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, ffn_hidden=32)
    from growtrain.recipe import GrowthStep
    from growtrain.stages import get_operator

    def step(op, **kw):
        return GrowthStep(op, get_operator(op).args_type(**kw))

    grows = [(), (step("upcycle_moe", num_experts=4, top_k=2),), (step("split_experts"),), (step("deepen", after=[0]),)]
    before = [seed] + plan_stage_models(seed, grows)
    assert [sibling_parents(before, i) for i in range(4)] == [None, 1, 4, 4]


def test_tied_pairs_weight_cosines_and_sibling_picks_are_counted_per_pair():
    cfg = ModelConfig(vocab_size=64, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, ffn_hidden=32,
                      moe=MoEConfig(num_experts=4, top_k=2, expert_hidden=8), moe_layers=(0,))
    torch.manual_seed(0)
    model = GrowLM(cfg)
    layer = model.moe_layers[0]
    with torch.no_grad():  # parents = 2: sibling pairs (0, 2) and (1, 3)
        layer.router.weight[2] = layer.router.weight[0]  # tied: same row, same (zero) bias
        layer.router.weight[3] = -layer.router.weight[1]
        for w in (layer.experts.w_gate, layer.experts.w_up, layer.experts.w_down):
            w[3] = 2 * w[1]  # a scaled copy: cosine 1
    n = layer_divergence(layer, 2, torch.tensor([[0, 2], [0, 1], [3, 1], [1, 2]]), True)
    assert n["pairs"] == 2 and n["tied_pairs"] == 1
    assert n["router_cos_max"] == pytest.approx(1.0) and n["router_cos_mean"] == pytest.approx(0.0, abs=1e-12)
    assert n["weight_cos_max"] == pytest.approx(1.0)
    assert n["topk_two_siblings"] == 0.5
    with torch.no_grad():
        layer.router.balance_bias[2] += 1e-3  # a different selection bias: no longer tied
    assert layer_divergence(layer, 2, None, False)["tied_pairs"] == 0
    assert sibling_divergence(model, None) == {} and sibling_divergence(model, 4) == {}  # no siblings


@pytest.mark.parametrize("fmt", ["full", "nf4"])
def test_weight_cosines_by_sibling_group_and_chunk_match_the_whole_layers_merged_weights(fmt, monkeypatch):
    import growtrain.runtime.divergence as divergence
    from growtrain.model.config import ExpertLoRAConfig

    moe = MoEConfig(num_experts=6, top_k=2, expert_hidden=64, expert_format=fmt, double_quant=False, lora=ExpertLoRAConfig(r=4, lora_alpha=8.0))
    cfg = ModelConfig(vocab_size=64, d_model=64, n_layers=1, n_heads=2, n_kv_heads=1, ffn_hidden=64, moe=moe, moe_layers=(0,))
    torch.manual_seed(1)
    experts = GrowLM(cfg).moe_layers[0].experts
    if fmt == "nf4":
        with torch.no_grad():  # nonzero adapters, so the LoRA update (and w_down's layout) counts
            for m in ("w_gate", "w_up", "w_down"):
                getattr(experts, f"{m}_lora_B").normal_(0, 0.05)
        whole = [experts.merged(m) for m in ("w_gate", "w_up", "w_down")]
    else:
        whole = [experts.w_gate.detach(), experts.w_up.detach(), experts.w_down.detach()]
    flat_EN = torch.cat([w.reshape(6, -1).double() for w in whole], dim=1)
    want = flat_EN @ flat_EN.T
    monkeypatch.setattr(divergence, "CHUNK_ELEMENTS", 1000)  # many chunks per matrix
    members = range(1, 6, 2)  # one sibling group of 2 parents
    got = divergence._group_gram(experts, members)
    assert torch.allclose(got, want[list(members)][:, list(members)], rtol=1e-10, atol=0)
