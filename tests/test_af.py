"""Attention/expert disaggregation (issue 18), its first part: the MoE layers' exchange between
attention ranks and expert ranks (growtrain/model/af.py), on CPU processes (gloo) with NCCL's
rules checked: layers against the whole layers, and a whole reversible model's evaluation and
training passes against one process. The trainer in an AF layout: tests/test_af_training.py."""

from __future__ import annotations

import json

import pytest

from growtrain.model.af import AFGroup
from test_expert_parallel import torchrun

# Measured: ≤ 3.5e-7 relative (2 + 2 and 3 + 1: each attention rank's chunk through the experts
# apart, so other summation blocks than the whole batch's); 0 with one attention rank.
FP32_RTOL = 2e-6


@pytest.mark.parametrize("world,attention,fmt", [(4, 2, "full"), (4, 3, "nf4"), (3, 1, "nf4")])
def test_moe_layers_split_over_attention_and_expert_ranks_match_the_whole_layers(tmp_path, world, attention, fmt):
    report = tmp_path / "af.json"
    r = torchrun(world, "tests/af_layer_worker.py", report, attention, fmt, timeout=240)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    got = json.loads(report.read_text())
    assert got["collective_checks"]
    assert got["flags"] == {
        "no_experts_here": True, "load_is_global": True, "router_untouched": True, "three_calls_served": True,
        "serial_combine_same_bits": True, "serial_combine_same_grads": True, "float16_autocast_followed": True,
    }
    # forward (with and without gradients), the inputs' gradients, both routers', every expert matrix's
    expected = {"y", "y_no_grad", "x_grad", "layer0.router.weight", "layer1.router.weight"}
    assert expected <= set(got["rel_err"]) and sum(".experts." in k for k in got["rel_err"]) == (6 if fmt == "full" else 12)
    worst = {k: v for k, v in got["rel_err"].items() if v > FP32_RTOL}
    assert not worst, worst
    if attention == 1:  # one source chunk: the same rows through the same calls as the whole layer
        assert max(got["rel_err"].values()) == 0.0


def test_attention_ranks_that_drift_apart_stop_with_a_message_naming_both_calls(tmp_path):
    r = torchrun(4, "tests/af_layer_worker.py", tmp_path / "unused.json", 2, "full", "drift", timeout=120)
    assert r.returncode != 0
    assert "AF layout: attention rank 1 is at forward of call 0 (MoE layer 1), attention rank 0 at forward of call 0 (MoE layer 0)" in r.stderr


# bf16 autocast: the reference's matmuls take all rows at once, the AF ranks each attention
# rank's; measured ≤ 1.2e-7 on the losses and ≤ 7.3e-3 on a gradient (a norm weight).
BF16_GRAD_RTOL, BF16_LOSS_RTOL = 3e-2, 1e-5


@pytest.mark.parametrize(
    "world,attention,fmt,precision,schedule",
    [(4, 2, "full", "fp32", "sequential"), (3, 1, "nf4", "fp32", "sequential"), (4, 3, "full", "bf16", "sequential"),
     (3, 1, "nf4", "fp32", "interleaved"), (4, 2, "nf4", "bf16", "interleaved")],
)
def test_a_reversible_model_in_an_af_layout_trains_as_one_process(tmp_path, world, attention, fmt, precision, schedule):
    """The expert ranks follow the attention ranks' headers only: an evaluation pass, then two
    micro-batches of training whose reversible backward recomputes each MoE block's call, one
    after the other or both in flight (af_interleaved: every MoE call hands over to the other)."""
    report = tmp_path / "af_model.json"
    r = torchrun(world, "tests/af_model_worker.py", report, attention, fmt, precision, schedule, timeout=240)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    got = json.loads(report.read_text())
    flags = {"eval_calls": True, "train_calls": True} | ({"handed_over": True, "eval_handed_over": True} if schedule == "interleaved" else {})
    assert got["collective_checks"] and got["flags"] == flags
    errors = got["rel_err"]
    assert sum(".experts." in k for k in errors) == got["expert_tensors"] > 0  # every expert tensor compared
    assert len(errors) > 20  # and every dense one
    grad_bar, loss_bar = (FP32_RTOL, FP32_RTOL) if precision == "fp32" else (BF16_GRAD_RTOL, BF16_LOSS_RTOL)
    assert errors["losses"] <= loss_bar and errors["eval_loss"] <= loss_bar, errors
    worst = {k: v for k, v in errors.items() if v > grad_bar}
    assert not worst, worst
    if attention == 1 and precision == "fp32" and schedule == "sequential":
        # (interleaved: G's backward in two parts, the norm's backward once per part: ≤ 2.2e-7 measured)
        assert max(errors.values()) == 0.0


def test_an_af_layout_needs_ranks_on_both_sides_and_names_them():
    with pytest.raises(ValueError, match="needs 1..3 attention ranks, got 4"):
        AFGroup(0, 4, 4)
    with pytest.raises(ValueError, match="needs 1..3 attention ranks, got 0"):
        AFGroup(0, 4, 0)
    af = AFGroup(3, 4, 2)
    assert not af.is_attention and af.expert_ranks == 2 and af.experts(8) == (4, 8) and af.experts_of(0, 8) == (0, 4)
    with pytest.raises(ValueError, match="rank 1 is an attention rank"):
        AFGroup(1, 4, 2).experts(8)
