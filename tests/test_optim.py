"""The name-keyed AdamW (growtrain/optim/adamw.py) against its pre-issue-16 self (tests/optim_reference.py):
the fused path (float multipliers, int step) within fp32 rounding, since torch's fused kernel orders
the same formula's roundings differently; the exact path (per-element multipliers and step counts,
other dtypes) and the clip norm bitwise on CPU, their arithmetic being unchanged; the factory and
the state-dict layout. CPU, small odd shapes."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from torch import nn

from optim_reference import reference_clip_grad_norm, reference_step, roundings

from growtrain import recipe
from growtrain.optim import adamw as optim
from growtrain.optim.adamw import AdamW, OptimizerConfig, ParamState, clip_grad_norm
from growtrain.optim.registry import OPTIMIZERS, build_optimizer

SHAPES = {"w": (64, 48), "bias": (33,), "cube": (7, 5, 3), "head": (300, 32), "one": (1,)}


def make_params(seed=0, dtype=torch.float32) -> dict[str, nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return {n: nn.Parameter(torch.randn(s, generator=g).to(dtype)) for n, s in SHAPES.items()}


def set_grads(params: dict, gen: torch.Generator) -> None:
    for p in params.values():
        p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)


def twin(params: dict) -> dict:
    return {n: nn.Parameter(p.detach().clone()) for n, p in params.items()}


def copy_grads(src: dict, dst: dict) -> None:
    for n, p in src.items():
        dst[n].grad = None if p.grad is None else p.grad.clone()


@pytest.fixture
def fused_calls(monkeypatch):
    """The parameter lists handed to torch's fused AdamW kernel, one list per call."""
    calls, real = [], torch._fused_adamw_

    def spy(params, *args, **kwargs):
        calls.append(list(params))
        return real(params, *args, **kwargs)

    monkeypatch.setattr(torch, "_fused_adamw_", spy)
    return calls


LRS = (1e-2, 3e-3, 2e-2, 5e-3, 1e-2, 4e-3)
LR_SUM = sum(LRS)


def run_both(params, opt, states, steps, seed=1, lrs=LRS):
    """`steps` steps of `opt` and of the reference on a twin of `params` with the same gradients."""
    ref_params = twin(params)
    gen = torch.Generator().manual_seed(seed)
    for i in range(steps):
        set_grads(params, gen)
        copy_grads(params, ref_params)
        opt.step(lrs[i % len(lrs)])
        reference_step(ref_params, states, lrs[i % len(lrs)], opt.cfg)
    return ref_params


def test_float_multipliers_take_the_fused_kernel_and_match_the_old_update_within_fp32_rounding(fused_calls):
    params = make_params()
    opt = build_optimizer(params, OptimizerConfig())
    opt.state["w"].lr_mult = 0.5
    opt.state["head"].eps_mult = 0.25
    opt.state["cube"].wd_mult = 2.0
    states = copy.deepcopy(opt.state)
    steps = 6
    ref = run_both(params, opt, states, steps)
    assert fused_calls and {id(p) for call in fused_calls for p in call} == {id(p) for p in params.values()}
    assert len(fused_calls) == steps * 4, "one kernel call per distinct (lr, wd, eps) multiplier triple and step"
    for n, p in params.items():
        s, r = opt.state[n], states[n]
        assert s.step == r.step == steps and isinstance(s.step, int)
        # Measured: at most 1.6 fp32 epsilons of |p| + the LRs summed, 1.2 of the moments' largest element.
        assert roundings(p, ref[n], LR_SUM) <= 4, n
        assert roundings(s.exp_avg, r.exp_avg, r.exp_avg.abs().max()) <= 4, n
        assert roundings(s.exp_avg_sq, r.exp_avg_sq, r.exp_avg_sq.abs().max()) <= 4, n


def test_per_element_multipliers_and_step_counts_are_bitwise_the_old_update(fused_calls):
    params = make_params()
    params["double"] = nn.Parameter(torch.randn(5, 9, dtype=torch.float64))
    params["half"] = nn.Parameter(torch.randn(40, 3).to(torch.bfloat16))
    opt = build_optimizer(params, OptimizerConfig())
    gen = torch.Generator().manual_seed(7)
    st = opt.state
    st["w"].lr_mult = torch.rand(SHAPES["w"], generator=gen) + 0.5
    st["bias"].wd_mult = torch.rand(SHAPES["bias"], generator=gen)
    st["cube"].eps_mult = torch.rand(SHAPES["cube"], generator=gen) * 4
    st["head"].step = torch.randint(0, 4, SHAPES["head"], generator=gen)  # fresh rows count from 0
    states = copy.deepcopy(opt.state)
    ref = run_both(params, opt, states, 5)
    fused = {id(p) for call in fused_calls for p in call}
    assert fused == {id(params["one"])}, "only the tensor with float multipliers, fp32 and an int step is fused"
    for n, p in params.items():
        s, r = opt.state[n], states[n]
        assert p.dtype == ref[n].dtype
        if n == "one":
            assert roundings(p, ref[n], LR_SUM) <= 4
            continue
        assert torch.equal(p, ref[n]), n
        assert torch.equal(s.exp_avg, r.exp_avg) and torch.equal(s.exp_avg_sq, r.exp_avg_sq), n
        assert torch.equal(torch.as_tensor(s.step), torch.as_tensor(r.step)), n


def test_a_parameter_without_a_gradient_is_not_stepped():
    params = make_params()
    opt = build_optimizer(params, OptimizerConfig())
    before = params["bias"].detach().clone()
    set_grads(params, torch.Generator().manual_seed(0))
    params["bias"].grad = None
    opt.step(1e-2)
    assert opt.state["bias"].step == 0 and torch.equal(params["bias"], before)
    assert opt.state["w"].step == 1


@pytest.mark.parametrize("sum_squares", [None, lambda sq: sq], ids=["one-process", "sharded"])
def test_the_weighted_clip_norm_and_the_clipped_gradients_are_bitwise_the_old_ones(sum_squares):
    params = make_params()
    gen = torch.Generator().manual_seed(3)
    set_grads(params, gen)
    params["one"].grad = None
    weights = [1.0, 4.0, torch.rand(SHAPES["cube"], generator=gen) + 0.5, 0.25, 1.0]
    ref = twin(params)
    copy_grads(params, ref)
    got = clip_grad_norm(list(params.values()), 1.0, weights, sum_squares)
    want = reference_clip_grad_norm(list(ref.values()), 1.0, weights, sum_squares)
    assert got == want and got > 1.0, "the gradients must be large enough to be clipped"
    for n, p in params.items():
        assert (p.grad is None and ref[n].grad is None) or torch.equal(p.grad, ref[n].grad), n


def test_the_state_dict_keeps_its_layout_and_an_old_one_loads_and_continues():
    """An entry per name with the seven ParamState fields: a checkpoint written before issue 16
    (same layout: ints stay ints, float multipliers floats) loads and steps as the old code would."""
    params = make_params()
    opt = build_optimizer(params, OptimizerConfig())
    set_grads(params, torch.Generator().manual_seed(2))
    opt.step(1e-2)
    sd = opt.state_dict()
    fields = {"step", "exp_avg", "exp_avg_sq", "lr_mult", "wd_mult", "eps_mult", "norm_mult"}
    assert set(sd) == set(SHAPES) and all(set(e) == fields for e in sd.values())
    assert all(isinstance(e["step"], int) and isinstance(e["lr_mult"], float) for e in sd.values())
    assert sd["bias"]["wd_mult"] == 0.0 and sd["w"]["wd_mult"] == 1.0

    old = {n: dict(e, exp_avg=e["exp_avg"].clone(), exp_avg_sq=e["exp_avg_sq"].clone()) for n, e in sd.items()}
    old["w"]["lr_mult"] = torch.full(SHAPES["w"], 0.5)  # as growth leaves it: a tensor multiplier
    resumed_params = twin(params)
    resumed = build_optimizer(resumed_params, OptimizerConfig())
    resumed.load_state_dict(old)
    states = {n: ParamState(**copy.deepcopy(e)) for n, e in old.items()}
    ref = run_both(resumed_params, resumed, states, 2, seed=9)
    assert torch.equal(resumed_params["w"], ref["w"])  # the exact path: bitwise
    for n in SHAPES:
        assert roundings(resumed_params[n], ref[n], LR_SUM) <= 4, n
        assert resumed.state[n].step == 3


def test_the_factory_builds_the_class_of_the_configured_state_bits():
    params = make_params()
    from growtrain.optim.adamw8bit import AdamW8bit

    assert type(build_optimizer(params, OptimizerConfig())) is AdamW
    assert type(build_optimizer(params, OptimizerConfig(dense_state_bits=8))) is AdamW8bit
    assert set(OPTIMIZERS) == {("adamw", 32), ("adamw", 8)}


def test_a_class_built_for_the_wrong_state_bits_points_to_the_factory():
    with pytest.raises(ValueError, match="build_optimizer"):
        AdamW(make_params(), OptimizerConfig(dense_state_bits=8))


def test_an_unknown_optimizer_name_lists_the_registered_ones():
    cfg = dataclasses.replace(OptimizerConfig(), name="lion")
    with pytest.raises(ValueError, match=r"name: lion.*registered: name: adamw, dense_state_bits: 32"):
        build_optimizer(make_params(), cfg)


def test_the_recipe_uses_the_optimizer_modules_config():
    assert recipe.OptimizerConfig is optim.OptimizerConfig
    assert recipe.Recipe().optimizer == OptimizerConfig()
