"""Layer-streamed growth (stages/streaming.py): split_experts / clone_experts runs and the
quantize_experts after them, applied one MoE layer at a time, grow the whole-model path's model
and optimizer state bit for bit, with one record for the streamed steps and per-layer metrics.
(The mutation suite, tests/test_growth_mutations.py, breaks the streamed layers; the sharded
runs, tests/test_sharded_growth.py, stream on expert shards.)"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from test_growth_operators import LENIENT, PROBE, moe_config, trained
from growtrain.model import GrowLM
from growtrain.optim.adamw import ParamState
from growtrain.recipe import GrowthStep
from growtrain.stages import apply_growth, plan_stage_models
from growtrain.stages.operators.deepen import DeepenArgs
from growtrain.stages.operators.experts import CloneExpertsArgs, SplitExpertsArgs
from growtrain.stages.operators.quantize import QuantizeExpertsArgs
from growtrain.stages.registry import Provenance
from growtrain.stages.streaming import compose, stream_length

FP32 = dataclasses.replace(LENIENT, exact_rel_tol=1e-4)  # fp32 runs: the default exact bar
SPLIT, CLONE = GrowthStep("split_experts", SplitExpertsArgs()), GrowthStep("clone_experts", CloneExpertsArgs(factor=2, reinit_fraction=0.25))
QUANTIZE = GrowthStep("quantize_experts", QuantizeExpertsArgs(r=4, double_quant=False))


def ops(*names):
    return [SimpleNamespace(op=n) for n in names]


def test_a_run_of_split_and_clone_streams_only_into_a_quantize_right_after_it():
    steps = ops("deepen", "split_experts", "clone_experts", "quantize_experts", "split_experts")
    assert [stream_length(steps, j, True) for j in range(5)] == [1, 3, 2, 1, 1]
    assert stream_length(steps, 1, False) == 1
    assert stream_length(ops("split_experts", "deepen", "quantize_experts"), 0, True) == 1
    assert stream_length(ops("clone_experts"), 0, True) == 1


def grow_both(steps, cfg=None):
    cfg = cfg or moe_config(layers=(0, 2), E=4, k=2)
    model, opt = trained(cfg)
    planned = plan_stage_models(cfg, [steps])[0]
    return [
        apply_growth(model, dict(opt.state), steps, seed=0, stage_index=1, stage_name="g", planned=planned, probe=PROBE, invariance_cfg=dataclasses.replace(FP32, stream=stream))
        for stream in (True, False)
    ]


def same_state(a: ParamState, b: ParamState) -> bool:
    def eq(x, y):
        return torch.equal(x, y) if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) else (not isinstance(x, torch.Tensor) and not isinstance(y, torch.Tensor) and x == y)

    return all(eq(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(ParamState))


NOISY_SPLIT = GrowthStep("split_experts", SplitExpertsArgs(router_noise=0.02))


@pytest.mark.parametrize(
    "steps",
    [[CLONE, QUANTIZE], [GrowthStep("deepen", DeepenArgs()), SPLIT, CLONE, QUANTIZE], [GrowthStep("deepen", DeepenArgs()), NOISY_SPLIT, SPLIT, QUANTIZE]],
    ids=["clone_quantize", "deepen_split_clone_quantize", "deepen_noisy_split_split_quantize"],
)
def test_streamed_growth_gives_the_whole_model_paths_model_and_state_bit_for_bit(steps):
    streamed, whole = grow_both(steps)
    a, b = streamed.model.state_dict(), whole.model.state_dict()
    assert a.keys() == b.keys()
    assert [k for k in a if not torch.equal(a[k], b[k])] == []  # NF4 codes and quant state included
    assert streamed.optimizer_state.keys() == whole.optimizer_state.keys()
    assert [n for n in whole.optimizer_state if not same_state(streamed.optimizer_state[n], whole.optimizer_state[n])] == []
    pair = streamed.records[-2] if len(steps) > 2 else streamed.records[-1]
    assert pair["operator"] == "+".join(s.op for s in steps[-3 if len(steps) > 2 else 0 :]) and pair["streamed"] and pair["passed"]
    assert sorted(pair["metrics"]["layers"]) == [str(b) for b in streamed.model.config.moe_layers]
    # old vs final: the whole path's transition check measures the same models
    assert pair["metrics"]["rel_l2"] == pytest.approx(whole.records[-1]["metrics"]["rel_l2"], rel=1e-12)


def test_compose_keeps_the_first_source_and_multiplies_float_copy_counts():
    tile = lambda m: (lambda t: t.repeat(m, 1))  # noqa: E731
    split = Provenance("copy", "r", tile(2), copies=2.0, beta=1.0)
    clone = Provenance("copy", "r", tile(3), copies=3.0, beta=1.0, perturbed=torch.ones(6, 1, dtype=torch.bool), perturb_bound=0.5)
    both = compose(split, clone)
    x = torch.arange(4.0).view(2, 2)
    assert torch.equal(both.transform(x), x.repeat(6, 1)) and both.copies == 6.0 and both.beta == 1.0 and both.perturb_bound == 0.5
    assert compose(Provenance("carried", "old"), clone).source == "old"
    assert compose(split, Provenance("carried", "r")) is split
    assert compose(split, Provenance("reset", "r")).kind == "reset"
    noisy_split = dataclasses.replace(split, perturbed=torch.tensor([True, False, True, False]).view(4, 1), perturb_bound=0.25)
    last = torch.tensor([False] * 11 + [True]).view(12, 1)
    mixed = compose(noisy_split, dataclasses.replace(clone, perturbed=last))  # two masks: their union, the bounds added
    assert mixed.perturbed.view(-1).tolist() == [True, False] * 5 + [True, True] and mixed.perturb_bound == 0.75
    one = compose(noisy_split, dataclasses.replace(clone, perturbed=None))
    assert one.perturbed.view(-1).tolist() == [True, False] * 6
    with pytest.raises(ValueError, match="per-element"):
        compose(dataclasses.replace(split, copies=torch.ones(4, 1)), clone)


def test_a_streamed_split_of_a_layer_with_tied_siblings_is_judged_approximate_there_and_says_so():
    # Experts 1 and 2 of block 0 tie exactly (router rows and balance bias), 0 and 3 do not: a
    # top-2 can take one of the pair, which torch.topk's tie-break decides (issue 42).
    cfg = moe_config(layers=(0, 2), E=4, k=2)
    model, opt = trained(cfg)
    router = model.blocks[0].g.ffn.router
    with torch.no_grad():
        router.weight[2] = router.weight[1]
        router.balance_bias[2] = router.balance_bias[1]
    steps = [SPLIT, QUANTIZE]
    said = []
    outcome = apply_growth(
        model, dict(opt.state), steps, seed=0, stage_index=1, stage_name="g", planned=plan_stage_models(cfg, [steps])[0],
        probe=PROBE, invariance_cfg=FP32, log=said.append,
    )  # fmt: skip
    (record,) = outcome.records
    assert record["streamed"] and record["passed"], record["problems"]
    (note,) = record["inexact_on_these_weights"]  # block 2 has no ties
    assert "block 0" in note and "torch.topk" in note, note
    assert any("not exact on these weights, checked as approximate" in line and "block 0" in line for line in said), said


DEEPEN = GrowthStep("deepen", DeepenArgs())


@pytest.mark.parametrize("bits", [32, 8])
@pytest.mark.parametrize("steps", [[SPLIT, CLONE, QUANTIZE, DEEPEN], [DEEPEN, SPLIT, QUANTIZE]], ids=["stream_then_deepen", "deepen_then_stream"])
def test_releasing_the_folded_experts_state_changes_no_result_and_empties_the_trainers_entries(steps, bits):
    """release_folded (the trainer hands its state over): the fp32 experts' entries a quantization
    folds leave the trainer's optimizer (its 8-bit view too), and the grown model, its state and
    every check's figures are what they are without the release."""
    from test_growth_operators import train_step, tokens

    from growtrain.optim.registry import build_optimizer
    from growtrain.recipe import OptimizerConfig

    cfg = moe_config(layers=(0, 2), E=4, k=2)
    planned = plan_stage_models(cfg, [steps])[0]
    folded = {f"blocks.{b}.g.ffn.experts.{m}" for b in (0, 2) for m in ("w_gate", "w_up", "w_down")}
    runs = []
    for release in (False, True):
        torch.manual_seed(4)
        model = GrowLM(cfg)
        opt = build_optimizer(dict(model.named_parameters()), OptimizerConfig(grad_clip=1.0, dense_state_bits=bits))
        for k in range(3):
            train_step(model, opt, tokens(seed=100 + k, vocab=cfg.vocab_size))
        before = set(opt.state)
        assert folded <= before
        outcome = apply_growth(model, opt.state, steps, seed=0, stage_index=1, stage_name="g", planned=planned, probe=PROBE, invariance_cfg=FP32,
                               release_folded=release)  # fmt: skip
        assert set(opt.state) == (before - folded if release else before)
        runs.append(outcome)
    kept, released = runs
    a, b = kept.model.state_dict(), released.model.state_dict()
    assert a.keys() == b.keys() and [k for k in a if not torch.equal(a[k], b[k])] == []
    assert kept.optimizer_state.keys() == released.optimizer_state.keys()
    assert [n for n in kept.optimizer_state if not same_state(kept.optimizer_state[n], released.optimizer_state[n])] == []
    assert [(r["operator"], r["passed"], r["metrics"]["rel_l2"], r["metrics"].get("dynamics", {}).get("rel_l2")) for r in kept.records] == [
        (r["operator"], r["passed"], r["metrics"]["rel_l2"], r["metrics"].get("dynamics", {}).get("rel_l2")) for r in released.records
    ]
