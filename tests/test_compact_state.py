"""Per-element optimizer fields only where elements differ (issue 14, DESIGN.md §15).

Drop-upcycling (clone_experts with reinit_fraction, upcycle_moe with drop_ratio) redraws whole
neurons, so the step counts and multipliers it leaves vary per neuron, not per element: growth
keeps them [E, F, 1] for w_gate / w_up [E, F, D] and [E, 1, F] for w_down [E, D, F]
(stages/transition.compact_fields), d_model times smaller than the weight. What this shows:

- the fields (and the provenance's S and fresh mask) have the compact shapes, and the growth's
  checks pass;
- compact fields are the full ones without the repeats: the optimizer steps a model with them
  bit for bit as with the same fields expanded to the parameter's shape, checkpoint round trip
  included;
- a later operator transforms compact fields as it would transform the full ones (a split along
  the hidden dim after a clone; widen_hidden along the compact dim itself, after which they are
  compacted again);
- a field that varies along a dim keeps it.

Legend: E experts, F expert hidden width, D d_model.
"""

from __future__ import annotations

import copy
import io

import torch

from growtrain.optim.adamw import ParamState
from growtrain.optim.registry import build_optimizer
from growtrain.stages import get_operator
from growtrain.stages.invariance import broadcasts_to
from growtrain.stages.operators.experts import CloneExpertsArgs, SplitExpertsArgs
from growtrain.stages.operators.widen import WidenHiddenArgs
from growtrain.stages.transition import compact_fields, map_optimizer_state
from test_growth_operators import LENIENT, grow, moe_config, tokens, train_step, trained

FIELDS = ("step", "lr_mult", "wd_mult", "eps_mult", "norm_mult")
EXPERT = "blocks.1.g.ffn.experts."


def expanded(s: ParamState) -> ParamState:
    """The same state with every tensor field at the parameter's full shape."""
    shape = s.exp_avg.shape
    full = {k: getattr(s, k).expand(shape).clone() if isinstance(getattr(s, k), torch.Tensor) else getattr(s, k) for k in FIELDS}
    return ParamState(exp_avg=s.exp_avg.clone(), exp_avg_sq=s.exp_avg_sq.clone(), **full)


def cloned():
    model, opt = trained(moe_config(E=4, k=2))
    outcome = grow(model, opt.state, "clone_experts", CloneExpertsArgs(factor=2, reinit_fraction=0.5, router_noise=0.01), cfg=LENIENT)
    return outcome, opt


def test_drop_upcycled_clones_keep_their_step_counts_and_multipliers_per_neuron():
    outcome, _ = cloned()
    (record,) = outcome.records
    assert record["passed"], record["problems"]
    model = outcome.model
    E, F, D = 8, model.config.moe.expert_hidden, model.config.d_model
    want = {"w_gate": (E, F, 1), "w_up": (E, F, 1), "w_down": (E, 1, F)}
    for m, shape in want.items():
        s = outcome.optimizer_state[EXPERT + m]
        assert tuple(s.exp_avg.shape) == ((E, F, D) if m != "w_down" else (E, D, F))
        for k in ("step", "eps_mult", "norm_mult"):
            assert tuple(getattr(s, k).shape) == shape, (m, k, tuple(getattr(s, k).shape))
        assert s.lr_mult == 1.0 and s.wd_mult == 1.0  # β = 1: they stay floats
        steps = s.step.expand(s.exp_avg.shape)
        assert (steps == 0).any() and (steps == 3).any()  # redrawn neurons fresh, kept ones the parent's 3 steps
        assert torch.count_nonzero(s.exp_avg[steps == 0]) == 0


def test_compact_fields_step_bit_for_bit_as_the_full_ones_and_survive_a_checkpoint():
    outcome, opt = cloned()
    grown = outcome.model
    twin = copy.deepcopy(grown)
    compact_opt = build_optimizer(dict(grown.named_parameters()), opt.cfg)
    compact_opt.rebind(dict(grown.named_parameters()), copy.deepcopy(outcome.optimizer_state))
    full_opt = build_optimizer(dict(twin.named_parameters()), opt.cfg)
    full_opt.rebind(dict(twin.named_parameters()), {n: expanded(s) for n, s in outcome.optimizer_state.items()})
    assert tuple(full_opt.state[EXPERT + "w_up"].step.shape) == tuple(grown.get_parameter(EXPERT + "w_up").shape)
    for k in range(2):
        norms = [train_step(m, o, tokens(seed=30 + k)) for m, o in ((grown, compact_opt), (twin, full_opt))]
        assert norms[0] == norms[1]
    for (name, a), (_, b) in zip(grown.named_parameters(), twin.named_parameters()):
        assert torch.equal(a, b), name
    # The checkpoint keeps the compact layout and resumes bit for bit.
    buffer = io.BytesIO()
    torch.save(compact_opt.state_dict(), buffer)
    saved = torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
    assert tuple(saved[EXPERT + "w_down"]["step"].shape) == (8, 1, grown.config.moe.expert_hidden)
    resumed_model = copy.deepcopy(grown)
    resumed = build_optimizer(dict(resumed_model.named_parameters()), opt.cfg)
    resumed.load_state_dict(saved)
    for m, o in ((grown, compact_opt), (resumed_model, resumed)):
        train_step(m, o, tokens(seed=40))
    for (name, a), (_, b) in zip(grown.named_parameters(), resumed_model.named_parameters()):
        assert torch.equal(a, b), name


def test_later_growth_maps_compact_fields_as_it_maps_the_full_ones():
    outcome, _ = cloned()
    model, compact = outcome.model, outcome.optimizer_state
    full = {n: expanded(s) for n, s in compact.items()}
    for op, args in (("split_experts", SplitExpertsArgs()), ("widen_hidden", WidenHiddenArgs(factor=2))):
        growth = get_operator(op).apply(copy.deepcopy(model), args)
        from_compact = map_optimizer_state(copy.deepcopy(compact), growth.model, growth.provenance)
        from_full = map_optimizer_state(copy.deepcopy(full), growth.model, growth.provenance)
        for name, a in from_compact.items():
            b = from_full[name]
            p = growth.model.get_parameter(name)
            for k in FIELDS + ("exp_avg", "exp_avg_sq"):
                x, y = getattr(a, k), getattr(b, k)
                if isinstance(x, torch.Tensor):
                    assert broadcasts_to(x, p.shape), (op, name, k)
                    # Both come out compacted to the same layout, with the same values.
                    assert tuple(x.shape) == tuple(y.shape) and torch.equal(x, y), (op, name, k)
                else:
                    assert x == y, (op, name, k)
        s = from_compact["blocks.1.g.ffn.experts.w_up"]
        if op == "split_experts":  # still per neuron: [2E, F/2, 1]
            assert tuple(s.step.shape) == (16, model.config.moe.expert_hidden // 2, 1)
        else:  # widen_hidden duplicates d_model coordinates: the fields stay constant along it
            assert tuple(s.step.shape) == (8, model.config.moe.expert_hidden, 1)


def test_a_field_that_varies_along_a_dim_keeps_it_and_one_that_does_not_shrinks():
    shape = (3, 4, 5)
    varies = torch.arange(60, dtype=torch.float32).view(shape)
    per_row = torch.arange(3, dtype=torch.int32).view(3, 1, 1).expand(shape).clone()
    s = compact_fields(ParamState(per_row, torch.zeros(shape), torch.zeros(shape), 1.0, 0.5, varies, varies[:, :, :1]), shape)
    assert tuple(s.step.shape) == (3, 1, 1) and torch.equal(s.step.expand(shape), per_row)  # dim 0 is never shrunk
    assert tuple(s.eps_mult.shape) == shape and torch.equal(s.eps_mult, varies)
    assert tuple(s.norm_mult.shape) == (3, 4, 1)
    assert s.lr_mult == 1.0 and s.wd_mult == 0.5


def test_the_dynamics_check_steps_tensor_by_tensor_bit_for_bit_as_the_whole_optimizer(monkeypatch):
    """stages/dynamics.step_each: one tensor's state copied at a time instead of the whole model's
    (issue 14: the dynamics check's copy of the optimizer state was a third of the 120B clone
    step's per-rank peak). Per-neuron fields, fresh counts, 8-bit dense moments: bitwise the same."""
    from dataclasses import replace

    from growtrain.optim import adamw8bit as optim8bit
    from growtrain.stages.dynamics import _optimizer, step_each

    monkeypatch.setattr(optim8bit, "MIN_8BIT_NUMEL", 256)  # the toy's dense matrices get 8-bit moments too
    outcome, opt = cloned()
    for bits in (32, 8):
        cfg = replace(opt.cfg, dense_state_bits=bits)
        models = [outcome.model, copy.deepcopy(outcome.model)]
        state = build_optimizer(dict(models[0].named_parameters()), cfg)
        state.rebind(dict(models[0].named_parameters()), copy.deepcopy(outcome.optimizer_state))
        assert bits == 32 or any(optim8bit.uses_8bit_state(n, p) for n, p in models[0].named_parameters())
        state = dict(state.state)  # the logical (float32) view, as the growth check receives it
        before = copy.deepcopy(state)
        x = tokens(seed=50)
        norms = []
        for m in models:
            m.zero_grad()
            out = m(x[:, :-1])
            torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), x[:, 1:].flatten()).backward()
        named = [{n: p for n, p in m.named_parameters() if p.requires_grad} for m in models]
        whole = _optimizer(named[0], copy.deepcopy(state), cfg)
        norms.append(float(whole.clip_grad_norm(cfg.grad_clip)))
        whole.step(1e-2)
        norms.append(float(_optimizer(named[1], state, cfg).clip_grad_norm(cfg.grad_clip)))
        step_each(named[1], state, cfg, 1e-2)
        assert norms[0] == norms[1], bits
        for n in named[0]:
            assert torch.equal(named[0][n], named[1][n]), (bits, n)
            assert named[1][n].grad is None, n  # dropped once stepped
            for k in ("exp_avg", "exp_avg_sq", *FIELDS):  # the check's state is left as it was
                a, b = getattr(state[n], k), getattr(before[n], k)
                assert (torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b), (bits, n, k)
