"""Growth checks must not stop good runs (issue 42). The false-failure search (benchmarks/
false_failures.py) at a size that fits the suite: random short recipes, each through a real
`growtrain run`, one process and experts over two; and the cases the issue reported, each as a
recipe run the way a user runs it."""

from __future__ import annotations

import copy
import json
import sys

import pytest

from conftest import MICRO, REPO, growth_report, train_recipe

sys.path.insert(0, str(REPO / "benchmarks"))

import false_failures as ff  # noqa: E402  (benchmarks/false_failures.py)


def assert_clean(tally: ff.Tally) -> None:
    report = json.dumps(tally.as_json(), indent=1)[:4000]
    assert not tally.false_failures and not tally.approximate_failures and not tally.other_errors, report
    assert tally.exact_checks > 0, "no exact operator was checked: the search covered nothing"


@pytest.mark.slow
def test_random_short_runs_in_one_process_pass_every_exact_check(tmp_path):
    tally = ff.search(runs=5, seed=1, ep_share=0.0, work=tmp_path, say=lambda *_: None)
    assert_clean(tally)
    assert tally.runs == 5 and tally.processes == {"1": 5}
    assert tally.worst_step < 1 and tally.worst_clip < 1


@pytest.mark.slow
def test_random_short_runs_with_experts_over_two_processes_pass_every_exact_check(tmp_path):
    tally = ff.search(runs=1, seed=4, ep_share=1.0, work=tmp_path, say=lambda *_: None)
    assert_clean(tally)
    assert tally.processes == {"2": 1}


@pytest.mark.slow
def test_a_random_short_run_in_the_af_layout_passes_every_exact_check(tmp_path):
    """1 attention rank + 1 expert rank: widen_hidden, upcycle_moe and split_experts, grown on the
    AF layout's shards (seed 21's first draw)."""
    tally = ff.search(runs=1, seed=21, ep_share=1.0, work=tmp_path, say=lambda *_: None, af_share=1.0)
    assert_clean(tally)
    assert tally.processes == {"2 (af)": 1}
    report, transitions = growth_report(tmp_path / "ff21-0" / "run")
    assert report["layout"]["name"] == "af" and [op for op, *_ in transitions] == ["widen_hidden", "upcycle_moe", "split_experts"]


def test_the_drawn_recipes_cover_what_the_issue_asks_for():
    # Over the first 40 draws of the default seed: each option and operator appears.
    import random

    rng = random.Random(0)
    recipes = [ff.draw_recipe(rng, f"r{i}") for i in range(40)]
    ops = {g["op"] for r in recipes for s in r["stages"] for g in s.get("grow", [])}
    assert ops >= {"widen_hidden", "add_heads", "widen_ffn", "upcycle_moe", "deepen", "split_experts", "clone_experts", "quantize_experts"}, ops
    assert {r["train"]["precision"] for r in recipes} == {"fp32", "bf16"}
    assert {r["optimizer"]["dense_state_bits"] for r in recipes} == {32, 8}
    after_nf4 = {g["op"] for r in recipes for s in r["stages"] if s["name"] == "nf4grow" for g in s["grow"]}
    assert after_nf4 == {"split_experts", "clone_experts", "deepen"}, after_nf4


# ---------------------------------------------------------------- the issue's cases, as users run them

TIED = {
    "name": "tied",
    "seed": 3,
    "model": {"d_model": 32, "n_layers": 2, "n_heads": 2, "n_kv_heads": 1, "ffn_hidden": 64},
    "data": {"source": "builtin:pydoc_topics", "max_bytes": 120_000, "eval_fraction": 0.1},
    "optimizer": {"lr": 0.003},
    "train": {"log_every": 1, "eval_every": 0, "eval_batches": 1, "threads": 1},
    "stages": [
        {"name": "dense", "steps": 6, "seq_len": 32, "batch_size": 4, "schedule": {"warmup_steps": 2}},
        {"name": "wide", "steps": 2, "seq_len": 32, "batch_size": 4, "grow": [
            {"op": "widen_hidden", "factor": 2}, {"op": "add_heads", "add": 2, "kv": "grow"},
            {"op": "widen_ffn", "ffn_hidden": 96, "init": "zero"}, {"op": "widen_ffn", "ffn_hidden": 128, "init": "split", "noise": 0.01}]},
        {"name": "moe", "steps": 2, "seq_len": 32, "batch_size": 4, "grow": [{"op": "upcycle_moe", "num_experts": 4, "top_k": 2, "layers": [1], "balance_bias_rate": 0.01}]},
        {"name": "deep", "steps": 2, "seq_len": 32, "batch_size": 4, "grow": [
            {"op": "deepen", "after": [0, 1]}, {"op": "split_experts", "factor": 2}, {"op": "widen_ffn", "expert_hidden": 96, "init": "zero"},
            {"op": "widen_ffn", "expert_hidden": 128, "init": "split"}, {"op": "clone_experts", "factor": 2, "reinit_fraction": 0.25}]},
        {"name": "nf4", "steps": 3, "seq_len": 32, "batch_size": 4, "grow": [{"op": "quantize_experts", "r": 4, "lora_alpha": 8, "double_quant": False}]},
        {"name": "nf4split", "steps": 2, "seq_len": 32, "batch_size": 4, "grow": [{"op": "split_experts"}]},
    ],
    "checkpoint": {"every_steps": 0, "keep_last": 1},
    "invariance": {"probe_batch_size": 2, "probe_seq_len": 32},
    "tracking": {"wandb": {"mode": "disabled"}, "progress_bar": False},
}  # fmt: skip


def test_a_split_whose_top_k_can_cut_tied_siblings_is_judged_approximate_and_the_run_goes_on(tmp_path):
    # The issue's second case: block 3 (a deepened block) keeps two split siblings tied through 5
    # steps; the last split's top-4 cuts that pair for a probe token, which torch.topk's tie-break
    # decides. It stopped the run (one-step 2.6e-4 > 1.1e-4) at main before issue 42.
    _, out, done = train_recipe(TIED, tmp_path)
    last = ff.growth_history(out)[-1]
    assert last["operator"] == "split_experts" and not last["exact"] and last["passed"], last
    (reason,) = last["inexact_on_these_weights"]
    assert "block 3" in reason and "tie exactly" in reason, reason
    assert "not exact on these weights, checked as approximate" in done.stdout
    exact = [r for r in ff.growth_history(out)[:-1] if r["metrics"]["dynamics"]["exact"]]  # the step judged exact too
    assert len(exact) >= 6 and all(r["passed"] and r["metrics"]["dynamics"]["twin_rel_l2"] is not None for r in exact)


def test_eight_bit_moments_regrouped_by_widen_hidden_pass_the_exact_check(tmp_path):
    # Found by the false-failure search at main before issue 42: widen_hidden regroups lm_head's
    # 8-bit moments into other blocks, and its one step moved 3.7e-3 off (bar 1.1e-4). The twin
    # regroups the ungrown side's moments likewise and measures that resolution.
    raw = copy.deepcopy(MICRO)
    raw.update(seed=320448, optimizer={"lr": 0.001, "dense_state_bits": 8}, checkpoint={"every_steps": 0, "keep_last": 1})
    raw["model"] = {"d_model": 64, "n_layers": 1, "n_heads": 2, "n_kv_heads": 2, "ffn_hidden": 64}
    raw["stages"] = [
        {"name": "dense", "steps": 6, "seq_len": 32, "batch_size": 4, "schedule": {"warmup_steps": 1}},
        {"name": "wide", "steps": 1, "seq_len": 32, "batch_size": 4, "schedule": {"warmup_steps": 1},
         "grow": [{"op": "widen_hidden", "factor": 2}, {"op": "widen_ffn", "ffn_hidden": 96, "init": "zero"}]},
    ]  # fmt: skip
    _, out, _ = train_recipe(raw, tmp_path)
    widen = next(r for r in ff.growth_history(out) if r["operator"] == "widen_hidden")
    dyn = widen["metrics"]["dynamics"]
    assert widen["exact"] and widen["passed"] and dyn["rel_l2"] > 1e-4, dyn  # past the old fixed bar
    assert dyn["twin_rel_l2"] > dyn["resolution"], "the twin must see the 8-bit regrouping"
    fresh = next(r for r in ff.growth_history(out) if r["operator"] == "widen_ffn")["metrics"]["trainability"]["fresh_first_step"]
    assert fresh and all(v["elements"] > 0 and v["max_dev_lr"] < 1e-3 for v in fresh.values()), fresh
