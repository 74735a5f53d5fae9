"""benchmarks/gpu_step.py (issue 47): the one-GPU slice of a recipe's per-rank step. Its --cpu form
runs here, as a user runs it, so the script cannot rot while no GPU is at hand; the slice's shapes
and the block count it picks are checked at the 120B recipe's real sizes on the meta device."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_step  # noqa: E402
from conftest import run_script  # noqa: E402


def test_the_cpu_form_runs_every_part_of_a_stage_and_reports_the_table_and_json():
    out = run_script(ROOT / "benchmarks" / "gpu_step.py", "--cpu", "--json", "--reps", "1", "--stage", "dense", "--stage", "experts")
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout)
    dense, experts = res["stages"]
    assert (dense["stage"], experts["stage"]) == ("dense", "experts")
    assert experts["expert_format"] == "nf4" and experts["reversible"] and experts["blocks"] == 2
    assert experts["local_experts"] == math.ceil(experts["experts"] / 8) and experts["top_k"] == 8
    assert set(experts["share"]) == {"attention", "router", "experts", "dequantize", "adapters", "recompute", "optimizer", "other"}
    assert set(dense["share"]) == {"attention", "recompute", "optimizer", "other"}
    for r in (dense, experts):
        assert r["tokens_per_s"] > 0 and r["model_tflops"] > 0 and r["mfu"] is None  # no preset for a CPU
        assert all(v >= 0 for v in r["share"].values()), r["share"]
        assert r["predicted_bytes"] > 0 and r["peak_bytes"] is None
    bad = run_script(ROOT / "benchmarks" / "gpu_step.py", "--cpu", "--stage", "nope")
    assert bad.returncode == 2 and "no stage nope" in bad.stderr and "Traceback" not in bad.stderr


def _stage_model(name: str):
    from growtrain.planning.recipe import resolve_vocab
    from growtrain.recipe import load_recipe
    from growtrain.stages import plan_stage_models

    recipe = load_recipe(ROOT / "recipes" / "120b.yaml")
    shapes = plan_stage_models(recipe.model.with_changes(vocab_size=resolve_vocab(recipe)), [s.grow for s in recipe.stages])
    i = [s.name for s in recipe.stages].index(name)
    return recipe, recipe.stages[i], shapes[i]


def test_the_slice_holds_one_ranks_experts_and_the_blocks_the_plan_fits():
    from growtrain.planning.counting import count_model

    recipe, stage, cfg = _stage_model("experts")
    s = gpu_step.slice_config(cfg, 8, 3)
    assert s.n_layers == 3 and s.moe.num_experts == cfg.moe.num_experts // 8 and s.moe.top_k == cfg.moe.top_k
    assert s.d_model == cfg.d_model and s.moe.expert_hidden == cfg.moe.expert_hidden and s.moe.expert_format == "nf4"
    # Rows per local expert in the slice equal a rank's in the node under balanced routing:
    # N k / (E / G) for the slice's N tokens, (G N) k / E in the node.
    N, G, E, k = 2 * 4096, 8, cfg.moe.num_experts, cfg.moe.top_k
    assert N * k / s.moe.num_experts == G * N * k / E
    # The slice's expert weights are one rank's share of the stage's, per MoE layer.
    whole, part = count_model(cfg), count_model(s)
    per_layer = lambda c, m: c.params_by_role["routed_experts"] / len(m.moe_layers)  # noqa: E731
    assert per_layer(part, s) * G == per_layer(whole, cfg)
    micro, seq = stage.batch_size // 8, stage.seq_len
    fits = lambda b: gpu_step.predicted_bytes(gpu_step.slice_config(cfg, 8, b), recipe.optimizer, micro, seq, recipe.train.precision)  # noqa: E731
    # On an 80 GB GPU the plan fits all 36 blocks (69 GB with the whole dense optimizer state);
    # on a 50 GB one, fewer.
    assert gpu_step.blocks_that_fit(cfg, 8, recipe.optimizer, micro, seq, recipe.train.precision, 80 * 10**9) == cfg.n_layers
    cap = 50 * 10**9
    n = gpu_step.blocks_that_fit(cfg, 8, recipe.optimizer, micro, seq, recipe.train.precision, cap)
    assert 2 <= n < cfg.n_layers
    assert fits(n) <= gpu_step.HEADROOM * cap < fits(n + 1)
    with pytest.raises(SystemExit, match="fewer than top_k"):
        gpu_step.slice_config(cfg, 64, 2)
