"""Growth operators beyond upcycle/deepen: widen_hidden, widen_ffn, add_heads, upcycle_moe's
drop-upcycling, split_experts, clone_experts. What they prove:

- every exact operator keeps the logits (fp64, ~1e-15) and every router's parent-aggregated
  distribution, builds exactly the planned model, and accounts for every parameter; random chains
  of all operators (hypothesis) keep that, and approximate ones report finite, honest numbers;
- the checks fail when an operator is broken (a split without its ×2 down-projection, a dropped
  parameter, a non-strict load under a renamed key, router drift, optimizer state of the wrong
  shape), naming the operator, the block and the number;
- DESIGN.md §7's optimizer rule: one AdamW step after widen_hidden, widen_ffn (Net2Wider) or
  split_experts moves the logits exactly as the same step before growth (gradient clipping
  engaged: the clip norm is measured in the old parametrization), while plainly copied moments do
  not; after zero-init growth (new neurons, new heads) the old elements' updates are unchanged and
  the new elements step like a fresh Adam, by their own per-element step count.

Legend: B batch, T sequence, V vocabulary, D d_model, E experts, F hidden width.
"""

from __future__ import annotations

import copy
import io
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

from conftest import EXPLORE_FACTOR, default_dtype
from growtrain.model import GrowLM, ModelConfig
from growtrain.optim.adamw import AdamW, ParamState, clip_grad_norm
from growtrain.optim.registry import build_optimizer
from growtrain.recipe import GrowthStep, InvarianceConfig, OptimizerConfig, load_recipe
from growtrain.stages import OPERATORS, GrowthCheckFailed, GrowthPlanError, Operator, Provenance, apply_growth, get_operator, plan_stage_models, register
from growtrain.stages.common import materialize
from growtrain.stages.invariance import Probe, router_kl
from growtrain.stages.operators.experts import CloneExpertsArgs, SplitExpertsArgs, selection_tie_problems
from growtrain.stages.operators.heads import AddHeadsArgs
from growtrain.stages.operators.upcycle import UpcycleArgs
from growtrain.stages.operators.widen import WidenHiddenArgs
from growtrain.stages.operators.widen_ffn import WidenFFNArgs
from growtrain.stages.registry import Growth
from growtrain.stages.transition import map_optimizer_state

V, D, H, KV, F_DENSE = 29, 16, 4, 2, 24
REPO = Path(__file__).resolve().parents[1]
upcycle = get_operator("upcycle_moe")


# ---------------------------------------------------------------- helpers


def dense_config(n_layers: int = 3, **changes) -> ModelConfig:
    # init_std 0.2: blocks must move the logits visibly, or a broken exact operator could hide.
    base = dict(vocab_size=V, d_model=D, n_layers=n_layers, n_heads=H, n_kv_heads=KV, ffn_hidden=F_DENSE, init_std=0.2)
    return ModelConfig(**{**base, **changes})


def moe_config(score: str = "softmax", layers=(1,), E: int = 4, k: int = 2, shared: int = 0, z_loss: float = 0.001, **changes) -> ModelConfig:
    args = UpcycleArgs(num_experts=E, top_k=k, layers=tuple(layers), score_func=score, router_init_std=0.5, balance_bias_rate=0.05, z_loss_coef=z_loss)
    cfg = upcycle.plan(dense_config(**changes), args)
    return cfg.with_changes(moe=replace(cfg.moe, shared_expert_hidden=shared)) if shared else cfg


def tokens(seed: int = 0, B: int = 2, T: int = 8, vocab: int = V) -> torch.Tensor:
    return torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(seed))


def loss_of(model: GrowLM, batch_BT: torch.Tensor, with_aux: bool = True) -> torch.Tensor:
    out = model(batch_BT[:, :-1])
    loss = F.cross_entropy(out.logits.flatten(0, 1).float(), batch_BT[:, 1:].flatten())
    return loss + out.aux_loss if with_aux else loss


def train_step(model: GrowLM, opt: AdamW, batch_BT: torch.Tensor, lr: float = 1e-2, with_aux: bool = True) -> float:
    """One step as the trainer takes it: backward, weighted clip norm, AdamW, balance-bias update."""
    opt.zero_grad()
    out = model(batch_BT[:, :-1])
    loss = F.cross_entropy(out.logits.flatten(0, 1).float(), batch_BT[:, 1:].flatten())
    (loss + out.aux_loss if with_aux else loss).backward()
    norm = opt.clip_grad_norm(opt.cfg.grad_clip)
    opt.step(lr)
    if out.moe_stats:
        model.update_balance_biases([s.load for s in out.moe_stats])
    return norm


def trained(cfg: ModelConfig, steps: int = 3, seed: int = 4, clip: float = 1.0, freeze=()) -> tuple[GrowLM, AdamW]:
    """A model a few steps into training: moments, step counts and balance biases are non-trivial."""
    torch.manual_seed(seed)
    model = GrowLM(cfg)
    for name, p in model.named_parameters():
        p.requires_grad_(not name.endswith(freeze) if freeze else True)
    opt = build_optimizer(dict(model.named_parameters()), OptimizerConfig(grad_clip=clip))
    for k in range(steps):
        train_step(model, opt, tokens(seed=100 + k, vocab=cfg.vocab_size))
    return model, opt


def logits_of(model: GrowLM, tokens_BT: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(tokens_BT).logits


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((b - a).norm() / a.norm()).item()


PROBE = (tokens(seed=99, B=4, T=12), tokens(seed=98, B=4, T=12))
STRICT = InvarianceConfig(exact_rel_tol=1e-10)  # fp64 runs: far tighter than the fp32 default
LENIENT = InvarianceConfig(exact_rel_tol=1e-10, max_rel_dloss=1e9, min_cosine=-1.0, max_router_kl=1e9, dynamics_max_rel=1e9)


def grow(model, state, op_name: str, args, cfg: InvarianceConfig = STRICT, probe=PROBE, fresh=None):
    op = get_operator(op_name)
    return apply_growth(
        model,
        state,
        [GrowthStep(op_name, args)],
        seed=0,
        stage_index=1,
        stage_name="grown",
        planned=op.plan(model.config, args),
        probe=probe,
        invariance_cfg=cfg,
        fresh=fresh,
    )


def planned_param_count(cfg: ModelConfig) -> int:
    with torch.device("meta"):
        return GrowLM(cfg).num_parameters()


# ---------------------------------------------------------------- every exact operator keeps the function


EXACT_CASES = {
    "widen_hidden_k2_moe_shared": (lambda: moe_config(layers=(0, 1, 2), shared=8), "widen_hidden", WidenHiddenArgs(factor=2)),
    "widen_hidden_k3_noise_sigmoid_mha": (lambda: moe_config("sigmoid", n_kv_heads=0), "widen_hidden", WidenHiddenArgs(factor=3, noise=0.5)),
    "widen_ffn_zero_dense_and_experts": (lambda: moe_config(), "widen_ffn", WidenFFNArgs(ffn_hidden=40, expert_hidden=30)),
    "widen_ffn_split_noise_sigmoid": (lambda: moe_config("sigmoid", shared=8), "widen_ffn", WidenFFNArgs(ffn_hidden=56, expert_hidden=60, init="split", noise=0.5)),
    "add_heads_grow_gqa": (lambda: moe_config(), "add_heads", AddHeadsArgs(add=2, kv="grow")),
    "add_heads_share_gqa": (lambda: moe_config("sigmoid"), "add_heads", AddHeadsArgs(add=2, kv="share")),
    "add_heads_grow_mha": (lambda: dense_config(n_kv_heads=0), "add_heads", AddHeadsArgs(add=1)),
    "split_by_2_softmax": (lambda: moe_config(layers=(0, 2)), "split_experts", SplitExpertsArgs()),
    "split_by_2_sigmoid_k1": (lambda: moe_config("sigmoid", k=1), "split_experts", SplitExpertsArgs()),
    "split_by_3_shared": (lambda: moe_config(E=3, shared=8), "split_experts", SplitExpertsArgs(factor=3)),
}


@pytest.mark.parametrize("case", EXACT_CASES)
def test_exact_operator_keeps_logits_routers_and_structure(case, fp64):
    make, op_name, args = EXACT_CASES[case]
    model, opt = trained(make())
    op = get_operator(op_name)
    assert op.is_exact(args)
    outcome = grow(model, opt.state, op_name, args)
    (record,) = outcome.records
    m = record["metrics"]
    assert record["passed"] and record["exact"], record["problems"]
    assert m["rel_l2"] < 1e-12 and m["max_abs_dlogits"] < 1e-11, m
    assert all(v < 1e-12 for v in m["block_rel_l2"].values()), m["block_rel_l2"]
    if model.config.moe is not None:
        assert len(m["router_kl"]) == len(model.config.moe_layers) and max(m["router_kl"].values()) < 1e-12
    grown = outcome.model
    assert grown.config == op.plan(model.config, args)
    assert record["params_after"] == grown.num_parameters() == planned_param_count(grown.config)
    trainable = {n for n, p in grown.named_parameters() if p.requires_grad}
    assert set(outcome.optimizer_state) == trainable
    for name, s in outcome.optimizer_state.items():
        assert s.exp_avg.shape == dict(grown.named_parameters())[name].shape
    # The grown model trains on with the mapped state.
    opt.rebind(dict(grown.named_parameters()), outcome.optimizer_state)
    assert torch.isfinite(torch.tensor(train_step(grown, opt, tokens(seed=7))))


def test_widen_hidden_duplicates_coordinates_and_heads_with_head_dim_fixed(fp64):
    cfg = moe_config()
    model, _ = trained(cfg)
    growth = get_operator("widen_hidden").apply(model, WidenHiddenArgs(factor=2))
    new, k = growth.model, 2
    assert (new.config.d_model, new.config.n_heads, new.config.kv_heads, new.config.head_size) == (2 * D, 2 * H, 2 * KV, cfg.head_size)
    old_sd, new_sd = model.state_dict(), new.state_dict()
    assert torch.equal(new_sd["embed.weight"], old_sd["embed.weight"].repeat(1, k))
    assert torch.equal(new_sd["blocks.0.f.norm.weight"], old_sd["blocks.0.f.norm.weight"].repeat(k))
    assert torch.equal(new_sd["blocks.0.f.attn.wq.weight"], old_sd["blocks.0.f.attn.wq.weight"].repeat(k, k) / k)
    assert torch.equal(new_sd["blocks.1.g.ffn.experts.w_down"], old_sd["blocks.1.g.ffn.experts.w_down"].repeat(1, k, 1))
    assert torch.equal(new_sd["lm_head.weight"], old_sd["lm_head.weight"].repeat(1, k) / k)
    prov = growth.provenance
    # DESIGN.md §7: tiled outputs β = 1, S = k; input-side halves β = 1/k, S = 1; q/k/v/o S = k.
    assert (prov["embed.weight"].beta, prov["embed.weight"].copies) == (1.0, 2.0)
    assert (prov["blocks.0.g.ffn.w_gate.weight"].beta, prov["blocks.0.g.ffn.w_gate.weight"].copies) == (0.5, 1.0)
    assert (prov["blocks.0.f.attn.wo.weight"].beta, prov["blocks.0.f.attn.wo.weight"].copies) == (0.5, 2.0)


def test_split_experts_builds_round_robin_children_with_half_the_neurons_and_doubled_down_projections(fp64):
    cfg = moe_config("softmax", E=4, k=2)
    model, _ = trained(cfg)
    growth = get_operator("split_experts").apply(model, SplitExpertsArgs())
    moe = growth.model.config.moe
    assert (moe.num_experts, moe.top_k, moe.expert_hidden) == (8, 4, F_DENSE // 2)
    assert moe.balance_bias_rate == cfg.moe.balance_bias_rate / 2  # softmax children score p/2
    old, new = model.state_dict(), growth.model.state_dict()
    half = F_DENSE // 2
    for j in range(2):
        for e in range(4):
            c = j * 4 + e  # child j of parent e
            assert torch.equal(new["blocks.1.g.ffn.experts.w_up"][c], old["blocks.1.g.ffn.experts.w_up"][e, j * half : (j + 1) * half])
            assert torch.equal(new["blocks.1.g.ffn.experts.w_down"][c], 2 * old["blocks.1.g.ffn.experts.w_down"][e, :, j * half : (j + 1) * half])
            assert torch.equal(new["blocks.1.g.ffn.router.weight"][c], old["blocks.1.g.ffn.router.weight"][e])
            assert new["blocks.1.g.ffn.router.balance_bias"][c] == old["blocks.1.g.ffn.router.balance_bias"][e] / 2
    assert torch.count_nonzero(old["blocks.1.g.ffn.router.balance_bias"]) > 0
    assert torch.equal(growth.routers[1], torch.arange(8) % 4)


def test_split_router_noise_moves_every_child_but_the_first_within_its_bound_and_is_judged_approximate():
    """Issue 43: siblings of a split tie in routing until trained apart; router_noise breaks the
    tie at once, declared approximate (its bound given to the value check), and passes the default bars."""
    model, opt = trained(moe_config("softmax", E=4, k=2))
    old = model.blocks[1].g.ffn.router.weight.detach().clone()
    args = SplitExpertsArgs(router_noise=0.05)
    assert not get_operator("split_experts").is_exact(args) and get_operator("split_experts").is_exact(SplitExpertsArgs())
    outcome = grow(copy.deepcopy(model), opt.state, "split_experts", args, cfg=InvarianceConfig())
    (record,) = outcome.records
    assert record["passed"] and not record["exact"], record["problems"]
    assert record["metrics"]["values"]["perturbed"] == 4 * old.shape[1]  # the second children's rows
    new = outcome.model.blocks[1].g.ffn.router.weight.detach()
    assert torch.equal(new[:4], old)  # the first children keep their parents' logits exactly
    moved = (new[4:] - old).abs()
    rms = float(old.double().pow(2).mean().sqrt())
    assert 0 < float(moved.max()) <= 12 * 0.05 * rms + 1e-6 * float(new.abs().max())
    assert float((new[4:] - old).std()) == pytest.approx(0.05 * rms, rel=0.3)  # 64 draws of N(0, (0.05 rms)²)
    # Seeded by the growth's position: the same split again draws the same noise.
    again = grow(copy.deepcopy(model), opt.state, "split_experts", args, cfg=InvarianceConfig())
    assert torch.equal(again.model.blocks[1].g.ffn.router.weight, outcome.model.blocks[1].g.ffn.router.weight)


def test_split_is_not_exact_when_the_kth_and_next_router_logits_tie(fp64):
    # Experts 1 and 2 share a router row: a token that ranks them k-th and (k+1)-th picks one of
    # them before the split, but two children of each after: the documented exception.
    torch.manual_seed(0)
    model = GrowLM(moe_config("softmax", E=4, k=1))
    with torch.no_grad():
        router = model.blocks[1].g.ffn.router
        router.weight[2] = router.weight[1]
        router.weight[1] *= 1e3  # expert 1 (and 2) top for many tokens
        router.weight[2] *= 1e3
        router.balance_bias.zero_()
        experts = model.blocks[1].g.ffn.experts
        experts.w_down[2] = -experts.w_down[1]  # the two tied experts compute different functions
    x_BT = tokens(seed=3, B=4, T=12)
    growth = get_operator("split_experts").apply(model, SplitExpertsArgs())
    assert rel(logits_of(model, x_BT), logits_of(growth.model, x_BT)) > 1e-3


# ---------------------------------------------------------------- approximate operators report honestly


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_clone_experts_reports_honest_numbers_and_aggregates_children_onto_parents(score, fp64):
    model, opt = trained(moe_config(score, E=4, k=2))
    args = CloneExpertsArgs(factor=4, reinit_fraction=0.25, router_noise=0.01)
    op = get_operator("clone_experts")
    assert not op.is_exact(args)
    outcome = grow(model, opt.state, "clone_experts", args, cfg=LENIENT)
    (record,) = outcome.records
    m = record["metrics"]
    assert record["exact"] is False and record["passed"]
    assert 0 < m["rel_l2"] < 1 and 0 < m["cosine"] < 1 and m["rel_dloss"] >= 0
    # Siblings share their parent's mass: aggregated onto parents, the router barely moves.
    assert 0 <= m["router_kl"]["1"] < 1e-3 and m["router_kl"]["1"] <= m["router_kl_per_token"]["1"] + 1e-15
    moe = outcome.model.config.moe
    assert (moe.num_experts, moe.top_k) == (16, 2)
    new = outcome.model.state_dict()
    old = model.state_dict()
    assert torch.equal(new["blocks.1.g.ffn.experts.w_gate"][:4], old["blocks.1.g.ffn.experts.w_gate"])  # first children exact
    redrawn = (new["blocks.1.g.ffn.experts.w_gate"][4:] != old["blocks.1.g.ffn.experts.w_gate"].repeat(3, 1, 1)).any(-1)
    assert (redrawn.sum(-1) == round(0.25 * F_DENSE)).all()
    state = outcome.optimizer_state["blocks.1.g.ffn.experts.w_gate"]
    assert isinstance(state.step, torch.Tensor) and set(state.step[4:][redrawn].unique().tolist()) == {0}


def test_clone_without_redraw_or_noise_keeps_the_function_when_top_k_is_one(fp64):
    # With k = 1 a token picks one child of its old expert, which is an exact copy: a sanity check
    # of the construction (layout, router tiling, bias scaling) independent of the approximation.
    model, opt = trained(moe_config("softmax", E=4, k=1))
    outcome = grow(model, opt.state, "clone_experts", CloneExpertsArgs(factor=3, reinit_fraction=0.0, router_noise=0.0), cfg=LENIENT)
    assert outcome.records[0]["metrics"]["rel_l2"] < 1e-12


def test_drop_upcycling_is_approximate_with_fresh_state_on_the_redrawn_neurons(fp64):
    model, opt = trained(dense_config(2))
    args = UpcycleArgs(num_experts=4, top_k=2, drop_ratio=0.5, router_init_std=0.5)
    assert upcycle.is_exact(UpcycleArgs()) and not upcycle.is_exact(args)
    outcome = grow(model, opt.state, "upcycle_moe", args, cfg=LENIENT)
    (record,) = outcome.records
    assert record["exact"] is False and record["metrics"]["rel_l2"] > 1e-3
    s = outcome.optimizer_state["blocks.0.g.ffn.experts.w_up"]
    dense = opt.state["blocks.0.g.ffn.w_up.weight"]
    assert tuple(s.step.shape) == (4, F_DENSE, 1)  # per neuron (tests/test_compact_state.py)
    steps = s.step.expand(s.exp_avg.shape)
    redrawn = steps == 0
    assert redrawn.any() and (~redrawn).any()
    assert torch.count_nonzero(s.exp_avg[redrawn]) == 0 and (steps[~redrawn] == dense.step).all()
    # A kept element's S is the number of experts that kept its neuron.
    kept_E_F = ~redrawn[:, :, 0]
    S_F = kept_E_F.sum(0).float()
    e, j = torch.nonzero(kept_E_F)[0].tolist()
    torch.testing.assert_close(s.exp_avg[e, j], dense.exp_avg[j] / S_F[j])


def test_router_kl_sums_children_onto_parents():
    p_TE = torch.tensor([[0.5, 0.3, 0.2]], dtype=torch.float64)
    children_TE = torch.tensor([[0.25, 0.15, 0.1, 0.25, 0.15, 0.1]], dtype=torch.float64)
    kl, per_token = router_kl(Probe(torch.empty(0), routes_TE={1: p_TE}), Probe(torch.empty(0), routes_TE={1: children_TE}), {1: (1, torch.arange(6) % 3)})
    assert kl == {"1": 0.0} and per_token == {"1": 0.0}
    shifted = torch.tensor([[0.4, 0.4, 0.2]], dtype=torch.float64)
    kl, _ = router_kl(Probe(torch.empty(0), routes_TE={3: p_TE}), Probe(torch.empty(0), routes_TE={5: shifted}), {5: (3, None)})
    expected = (p_TE * (p_TE / shifted).log()).sum().item()
    assert kl["5"] == pytest.approx(expected, rel=1e-12)


# ---------------------------------------------------------------- random chains (hypothesis)


@st.composite
def seed_shapes(draw) -> ModelConfig:
    kv = draw(st.sampled_from([1, 2]))
    n_heads = kv * draw(st.sampled_from([1, 2]))
    head = draw(st.sampled_from([2, 4]))
    cfg = ModelConfig(
        vocab_size=draw(st.integers(3, 17)),
        d_model=n_heads * head,
        n_layers=draw(st.integers(1, 3)),
        n_heads=n_heads,
        n_kv_heads=draw(st.sampled_from([0, kv])) if n_heads == kv else kv,
        ffn_hidden=draw(st.sampled_from([4, 6, 8])),
        init_std=0.2,
    )
    if draw(st.booleans()):
        layers = draw(st.lists(st.integers(0, cfg.n_layers - 1), min_size=1, max_size=cfg.n_layers, unique=True))
        E = draw(st.integers(1, 3))
        args = UpcycleArgs(
            num_experts=E,
            top_k=draw(st.integers(1, E)),
            layers=tuple(layers),
            score_func=draw(st.sampled_from(["softmax", "sigmoid"])),
            router_init_std=1.0,
            balance_bias_rate=0.05,
        )
        cfg = upcycle.plan(cfg, args)
    return cfg


def draw_step(data, cfg: ModelConfig) -> tuple[str, object]:
    # Expert operators first where they apply: hypothesis favours the first choices.
    ops = (["split_experts", "clone_experts"] if cfg.moe else []) + ["widen_hidden", "widen_ffn", "add_heads", "upcycle_moe", "deepen"]
    name = data.draw(st.sampled_from(ops), label="operator")
    if name == "deepen":
        return name, get_operator(name).args_type(after=tuple(data.draw(st.lists(st.integers(0, cfg.n_layers - 1), max_size=2), label="after")))
    if name == "widen_hidden":
        return name, WidenHiddenArgs(factor=data.draw(st.sampled_from([2, 3])), noise=data.draw(st.sampled_from([0.0, 0.3])))
    if name == "widen_ffn":
        grow_dense = data.draw(st.integers(0, 5), label="dense +")
        grow_expert = data.draw(st.integers(0, 5), label="expert +") if cfg.moe else 0
        return name, WidenFFNArgs(
            ffn_hidden=cfg.ffn_hidden + grow_dense if grow_dense else 0,
            expert_hidden=cfg.moe.expert_hidden + grow_expert if grow_expert else 0,
            init=data.draw(st.sampled_from(["zero", "split"])),
            noise=data.draw(st.sampled_from([0.0, 0.4])),
        )
    if name == "add_heads":
        return name, AddHeadsArgs(add=data.draw(st.integers(1, 2)), kv=data.draw(st.sampled_from(["grow", "share"])))
    if name == "upcycle_moe":
        moe = cfg.moe
        base = UpcycleArgs(num_experts=2, top_k=1, router_init_std=1.0, balance_bias_rate=0.05) if moe is None else UpcycleArgs(
            num_experts=moe.num_experts, top_k=moe.top_k, score_func=moe.score_func, router_init_std=moe.router_init_std,
            balance_bias_rate=moe.balance_bias_rate, aux_loss_coef=moe.aux_loss_coef, z_loss_coef=moe.z_loss_coef,
        )  # fmt: skip
        return name, replace(base, drop_ratio=data.draw(st.sampled_from([0.0, 0.0, 0.5]), label="drop"))
    if name == "split_experts":
        return name, SplitExpertsArgs(factor=data.draw(st.sampled_from([2, 3])))
    return name, CloneExpertsArgs(factor=2, reinit_fraction=data.draw(st.sampled_from([0.0, 0.5])), router_noise=0.05)


@settings(max_examples=50 * EXPLORE_FACTOR, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(cfg=seed_shapes(), data=st.data())
def test_random_operator_chains_keep_exact_logits_and_account_for_every_parameter(cfg, data):
    with default_dtype(torch.float64):
        model, opt = trained(cfg, steps=2, seed=data.draw(st.integers(0, 2**16), label="torch seed"))
        state = opt.state
        probe = (torch.randint(0, cfg.vocab_size, (2, 6)), torch.randint(0, cfg.vocab_size, (2, 6)))
        reference = logits_of(model, probe[0])
        for _ in range(data.draw(st.integers(1, 3), label="chain length")):
            name, args = draw_step(data, model.config)
            event(name)
            op = get_operator(name)
            try:
                planned = op.plan(model.config, args)
            except GrowthPlanError:
                assume(False)
            if planned.d_model > 48 or planned.n_layers > 6 or (planned.moe and planned.moe.num_experts > 24):
                break  # keeps an example to a fraction of a second
            # A split of siblings that still tie bitwise (children of an earlier split in this
            # chain: no training between its operators) in groups top_k can cut is inexact by
            # design; the check names it (test_split_is_not_exact_when_the_kth_and_next_router_logits_tie).
            assume(name != "split_experts" or not selection_tie_problems(model))
            outcome = grow(model, state, name, args, cfg=LENIENT, probe=probe)  # raises on any structure or coverage problem
            (record,) = outcome.records
            m = record["metrics"]
            assert record["exact"] == op.is_exact(args)
            assert all(isinstance(v, float) and v == v for v in (m["rel_l2"], m["cosine"], m["rel_dloss"]))
            if record["exact"]:
                assert m["rel_l2"] < 1e-10 and all(v < 1e-10 for v in m["router_kl"].values()), (name, args, m)
                assert rel(reference, logits_of(outcome.model, probe[0])) < 1e-10
            reference = logits_of(outcome.model, probe[0])
            model, state = outcome.model, outcome.optimizer_state
            assert set(state) == {n for n, p in model.named_parameters() if p.requires_grad}
            assert record["params_after"] == planned_param_count(planned) == model.num_parameters()
        opt.rebind(dict(model.named_parameters()), state)
        assert torch.isfinite(torch.tensor(train_step(model, opt, tokens(seed=5, vocab=cfg.vocab_size))))


# ---------------------------------------------------------------- a stage's growth as a whole


def grow_stage(model, state, steps, cfg: InvarianceConfig):
    grow_steps = [GrowthStep(name, args) for name, args in steps]
    planned = plan_stage_models(model.config, [grow_steps])[0]
    return apply_growth(model, state, grow_steps, seed=0, stage_index=1, stage_name="grown", planned=planned, probe=PROBE, invariance_cfg=cfg)


def test_a_stage_of_several_operators_is_also_checked_first_model_against_last(fp64):
    model, opt = trained(moe_config(layers=(0, 2)))
    steps = [("deepen", get_operator("deepen").args_type(after=(0,))), ("split_experts", SplitExpertsArgs()), ("widen_hidden", WidenHiddenArgs())]
    outcome = grow_stage(model, opt.state, steps, STRICT)
    *per_op, whole = outcome.records
    assert [r["operator"] for r in per_op] == ["deepen", "split_experts", "widen_hidden"]
    assert whole["operator"] == "transition" and whole["exact"] and whole["passed"] and whole["index"] == 3
    m = whole["metrics"]
    assert m["rel_l2"] < 1e-12
    # Composed maps: old block 0 is new block 0 (its copy, block 1, is new), old block 2 is block 3;
    # experts are compared through the split's parents and the widened streams through the view.
    assert set(m["router_kl"]) == {"0", "3"} and max(m["router_kl"].values()) < 1e-12
    assert set(m["block_rel_l2"]) == {"0", "2", "3"} and max(m["block_rel_l2"].values()) < 1e-12
    assert whole["params_before"] == model.num_parameters() and whole["params_after"] == outcome.model.num_parameters()


def test_approximations_that_pass_one_by_one_but_add_up_fail_the_whole_transition():
    model, opt = trained(moe_config("softmax", E=4, k=2))
    clone = CloneExpertsArgs(factor=2, reinit_fraction=0.3, router_noise=0.01)
    steps = [("clone_experts", clone), ("clone_experts", clone)]
    lenient = grow_stage(model, opt.state, steps, LENIENT).records
    per_op = min(r["metrics"]["cosine"] for r in lenient[:2])
    whole = lenient[2]["metrics"]["cosine"]
    assert whole < per_op, "two approximations compound"
    bar = (whole + per_op) / 2
    with pytest.raises(GrowthCheckFailed) as err:
        grow_stage(model, opt.state, steps, replace(LENIENT, min_cosine=bar))
    record = err.value.record
    assert record["operator"] == "transition" and record["index"] == 2
    assert f"logit cosine {whole:.5f} < {bar:g}" in str(err.value)


# ---------------------------------------------------------------- the checks can fail


@pytest.fixture
def broken_operator():
    """Register test-only operators; remove them afterwards so the registry is left as it was."""
    before = dict(OPERATORS)
    added: list[str] = []

    def add(name: str, base: str, apply, exact: bool = True) -> Operator:
        added.append(name)
        op = get_operator(base)
        return register(Operator(name, exact, "test-only broken operator", op.args_type, op.plan, apply))

    yield add
    for name in added:
        OPERATORS.pop(name, None)
    assert OPERATORS == before


def test_a_split_that_skips_the_down_projection_scaling_fails_naming_the_operator_and_block(broken_operator):
    def apply(model, args):
        growth = get_operator("split_experts").apply(model, args)
        with torch.no_grad():
            for block in growth.model.blocks:
                if block.is_moe:
                    block.g.ffn.experts.w_down /= args.factor  # "forget" the ×f
        return growth

    op = broken_operator("split_experts_unscaled", "split_experts", apply)
    model, opt = trained(moe_config(layers=(1, 2)))
    with pytest.raises(GrowthCheckFailed) as err:
        grow(model, opt.state, op.name, SplitExpertsArgs(), cfg=InvarianceConfig())
    record, msg = err.value.record, str(err.value)
    assert record["passed"] is False and record["operator"] == "split_experts_unscaled"
    rel_l2 = record["metrics"]["rel_l2"]
    assert rel_l2 > 1e-2
    assert "split_experts_unscaled" in msg and f"relative L2 {rel_l2:.3g}" in msg
    assert "first block whose output moved: block 1" in msg


def test_an_operator_that_drops_a_parameter_from_its_provenance_fails(broken_operator):
    def apply(model, args):
        growth = get_operator("widen_hidden").apply(model, args)
        del growth.provenance["blocks.0.g.ffn.router.weight"]
        return growth

    op = broken_operator("widen_forgets_the_router", "widen_hidden", apply)
    model, opt = trained(moe_config(layers=(0,)))
    with pytest.raises(GrowthCheckFailed, match=r"widen_forgets_the_router(.|\n)*produced by no rule(.|\n)*blocks\.0\.g\.ffn\.router\.weight"):
        grow(model, opt.state, op.name, WidenHiddenArgs(), cfg=InvarianceConfig())


def test_a_non_strict_load_under_a_renamed_key_is_caught(broken_operator):
    def apply(model, args):
        # add_heads done wrong: a key renamed on the way, loaded with strict=False into a freshly
        # initialized model, so the real parameter silently keeps its random init.
        right = get_operator("add_heads").apply(model, args)
        state = right.model.state_dict()
        state["blocks.0.g.ffn.w_gate.renamed"] = state.pop("blocks.0.g.ffn.w_gate.weight")
        wrong = GrowLM(right.model.config)
        wrong.load_state_dict(state, strict=False)
        return Growth(wrong, right.provenance)

    op = broken_operator("add_heads_loaded_non_strictly", "add_heads", apply)
    model, opt = trained(dense_config(2))
    with pytest.raises(GrowthCheckFailed) as err:
        grow(model, opt.state, op.name, AddHeadsArgs(add=2), cfg=InvarianceConfig())
    msg = str(err.value)
    assert "add_heads_loaded_non_strictly" in msg
    assert "do not hold their source's values: ['blocks.0.g.ffn.w_gate.weight']" in msg
    assert "first block whose output moved: block 0" in msg
    # The right way refuses the renamed key outright.
    state = get_operator("add_heads").apply(model, AddHeadsArgs(add=2)).model.state_dict()
    state["blocks.0.g.ffn.w_gate.renamed"] = state.pop("blocks.0.g.ffn.w_gate.weight")
    with pytest.raises(RuntimeError, match="Missing key"):
        materialize(get_operator("add_heads").plan(model.config, AddHeadsArgs(add=2)), state)


def test_router_drift_beyond_the_threshold_fails_naming_the_operator_block_and_number():
    model, opt = trained(moe_config("softmax", layers=(0, 2)))
    loose_function = InvarianceConfig(max_rel_dloss=1e9, min_cosine=-1.0, max_router_kl=1e-4)
    with pytest.raises(GrowthCheckFailed) as err:
        grow(model, opt.state, "clone_experts", CloneExpertsArgs(factor=2, reinit_fraction=0.0, router_noise=5.0), cfg=loose_function)
    record, msg = err.value.record, str(err.value)
    kl = record["metrics"]["router_kl"]
    worst = max(kl, key=kl.get)
    assert kl[worst] > 1e-4 and "clone_experts" in msg
    assert f"router KL {kl[worst]:.3g} > 0.0001 at the MoE layer of block {worst}" in msg


def test_optimizer_state_of_the_wrong_shape_or_an_unknown_provenance_fails(broken_operator):
    def misshaped(model, args):
        growth = get_operator("widen_ffn").apply(model, args)
        prov = growth.provenance["blocks.0.g.ffn.w_up.weight"]
        growth.provenance["blocks.0.g.ffn.w_up.weight"] = replace(prov, transform=lambda t: t, fresh=None)  # old shape
        return growth

    def unknown(model, args):
        growth = get_operator("widen_ffn").apply(model, args)
        growth.provenance["blocks.0.g.ffn.w_up.weight"] = Provenance("moved", "blocks.0.g.ffn.w_up.weight")
        return growth

    model, opt = trained(dense_config(1))
    args = WidenFFNArgs(ffn_hidden=32)
    op = broken_operator("widen_ffn_misshaped_state", "widen_ffn", misshaped)
    with pytest.raises(GrowthCheckFailed, match=r"optimizer state shaped unlike its parameter: \['blocks\.0\.g\.ffn\.w_up\.weight'\]"):
        grow(model, opt.state, op.name, args, cfg=InvarianceConfig())
    op = broken_operator("widen_ffn_unknown_kind", "widen_ffn", unknown)
    with pytest.raises(GrowthCheckFailed, match="unknown kind"):
        grow(model, opt.state, op.name, args, cfg=InvarianceConfig())


# ---------------------------------------------------------------- dynamics (DESIGN.md §7)


def step_both(model, opt, growth, batch, lr=1e-2, naive=False):
    """One AdamW step on a copy of the ungrown model and on the grown one (mapped state, or plainly
    copied moments with `naive`); returns both logit changes on a held-out batch and both clip norms."""
    ref_model, ref_opt = copy.deepcopy(model), build_optimizer(dict(model.named_parameters()), opt.cfg)
    ref_opt.rebind(dict(ref_model.named_parameters()), copy.deepcopy(opt.state))
    grown = growth.model
    state = map_optimizer_state(copy.deepcopy(opt.state), grown, growth.provenance)
    if naive:  # moments copied as they are, no multipliers: what DESIGN.md §7 warns against
        state = {
            n: ParamState(s.step, p.transform(opt.state[p.source].exp_avg).clone(), p.transform(opt.state[p.source].exp_avg_sq).clone())
            if (p := growth.provenance[n]).kind == "copy"
            else s
            for n, s in state.items()
        }
    grown_opt = build_optimizer(dict(grown.named_parameters()), opt.cfg)
    grown_opt.rebind(dict(grown.named_parameters()), state)
    x_BT = tokens(seed=21, B=3, T=10)
    ref_before, grown_before = logits_of(ref_model, x_BT), logits_of(grown, x_BT)
    norms = (train_step(ref_model, ref_opt, batch, lr), train_step(grown, grown_opt, batch, lr))
    return logits_of(ref_model, x_BT) - ref_before, logits_of(grown, x_BT) - grown_before, norms, (ref_model, grown)


DYNAMICS_CASES = {
    "widen_hidden_k2": (lambda: moe_config(shared=8), "widen_hidden", WidenHiddenArgs(factor=2), ()),
    "widen_hidden_k3_sigmoid": (lambda: moe_config("sigmoid"), "widen_hidden", WidenHiddenArgs(factor=3), ()),
    "widen_ffn_net2wider": (lambda: moe_config(), "widen_ffn", WidenFFNArgs(ffn_hidden=40, expert_hidden=60, init="split"), ()),
    # The router rows of split siblings get unequal shares of their parent's gradient (next test),
    # so only with the router frozen is the step exact; the z-loss changes by log 2 and is off.
    "split_router_frozen": (lambda: moe_config(layers=(0, 1), z_loss=0.0), "split_experts", SplitExpertsArgs(), ("router.weight",)),
    "split_router_frozen_sigmoid": (lambda: moe_config("sigmoid", z_loss=0.0), "split_experts", SplitExpertsArgs(), ("router.weight",)),
}


@pytest.mark.parametrize("case", DYNAMICS_CASES)
def test_one_adamw_step_after_duplicating_growth_moves_the_logits_as_before_growth(case):
    make, op_name, args, freeze = DYNAMICS_CASES[case]
    model, opt = trained(make(), clip=0.5, freeze=freeze)
    growth = get_operator(op_name).apply(copy.deepcopy(model), args)
    for name, p in growth.model.named_parameters():
        p.requires_grad_(not name.endswith(freeze) if freeze else True)
    batch = tokens(seed=8, T=9)
    ref_delta, grown_delta, (ref_norm, grown_norm), _ = step_both(model, opt, growth, batch)
    assert ref_norm > 0.5, "the clip must be engaged for this test to cover it"
    assert grown_norm == pytest.approx(ref_norm, rel=1e-5), "the clip norm is measured in the old parametrization"
    assert rel(ref_delta, grown_delta) < 1e-4, f"step moved the logits differently: {rel(ref_delta, grown_delta):.3g}"
    if op_name == "widen_hidden":
        naive_delta = step_both(model, opt, get_operator(op_name).apply(copy.deepcopy(model), args), batch, naive=True)[1]
        assert rel(ref_delta, naive_delta) > 1e-2


def test_split_siblings_share_their_parents_router_gradient():
    model, _ = trained(moe_config("softmax", z_loss=0.0))
    growth = get_operator("split_experts").apply(copy.deepcopy(model), SplitExpertsArgs())
    batch = tokens(seed=9, B=4, T=12)
    for m in (model, growth.model):
        m.zero_grad(set_to_none=True)
        loss_of(m, batch).backward()
    parent = model.blocks[1].g.ffn.router.weight.grad
    children = growth.model.blocks[1].g.ffn.router.weight.grad
    torch.testing.assert_close(children[:4] + children[4:], parent, rtol=1e-4, atol=1e-6)
    assert rel(children[:4], children[4:]) > 1e-3, "siblings hold different neurons, so their shares differ"


ZERO_INIT_CASES = {
    "widen_ffn_zero": (lambda: moe_config(), "widen_ffn", WidenFFNArgs(ffn_hidden=40, expert_hidden=36)),
    "add_heads_grow": (lambda: dense_config(2), "add_heads", AddHeadsArgs(add=2)),
}


@pytest.mark.parametrize("case", ZERO_INIT_CASES)
def test_after_zero_init_growth_old_elements_step_as_before_and_new_ones_as_a_fresh_adam(case):
    # grad_clip = 0: the new elements' gradients join the global norm (they are new parameters, not
    # copies), so an engaged clip would rescale every update; without it the old updates must match.
    make, op_name, args = ZERO_INIT_CASES[case]
    model, opt = trained(make(), clip=0.0)
    growth = get_operator(op_name).apply(copy.deepcopy(model), args)
    start = {n: p.detach().clone() for n, p in growth.model.named_parameters()}
    lr = 1e-2
    _, _, _, (ref_model, grown) = step_both(model, opt, growth, tokens(seed=8, T=9), lr=lr)
    old_params, ref_params = dict(model.named_parameters()), dict(ref_model.named_parameters())
    fresh_checked = 0
    for name, p in grown.named_parameters():
        prov = growth.provenance[name]
        moved = p.detach() - start[name]
        ref_update = (ref_params[prov.source] - old_params[prov.source]).detach()
        if prov.kind == "carried":
            torch.testing.assert_close(moved, ref_update, rtol=0, atol=1e-6)
            continue
        assert prov.kind == "copy" and prov.fresh is not None and bool(prov.fresh.any()), name
        old = ~prov.fresh
        torch.testing.assert_close(moved[old], prov.transform(ref_update)[old], rtol=0, atol=1e-6)
        # New elements that start at zero (down-projection / out-projection columns): a fresh
        # Adam's first step, -lr·g/(|g| + eps), whatever step count the tensor's old elements had.
        zero_start = prov.fresh & (start[name] == 0) & (p.grad.abs() > 1e-6)
        g = p.grad[zero_start]
        torch.testing.assert_close(p.detach()[zero_start], -lr * g / (g.abs() + opt.cfg.eps), rtol=1e-5, atol=1e-9)
        fresh_checked += int(zero_start.sum())
        assert opt.state[prov.source].step == 3 and (grown_state_step(growth, name, model, opt)[prov.fresh] == 0).all()
    assert fresh_checked > 0


def grown_state_step(growth, name, model, opt):
    """The mapped per-element step counts of `name`, at the parameter's shape (they are stored
    compact: size 1 along the dims where they do not vary)."""
    step = map_optimizer_state(copy.deepcopy(opt.state), growth.model, growth.provenance)[name].step
    return step.expand(growth.model.get_parameter(name).shape)


# ---------------------------------------------------------------- optimizer state: per-element counts, clip weights


def test_per_element_step_counts_and_multipliers_survive_a_checkpoint_round_trip_bit_for_bit():
    model, opt = trained(moe_config(), steps=2)
    growth = get_operator("widen_ffn").apply(model, WidenFFNArgs(ffn_hidden=40, expert_hidden=36))
    grown = growth.model
    opt.rebind(dict(grown.named_parameters()), map_optimizer_state(opt.state, grown, growth.provenance))
    train_step(grown, opt, tokens(seed=11))
    step = opt.state["blocks.0.g.ffn.w_up.weight"].step
    assert isinstance(step, torch.Tensor) and set(step.unique().tolist()) == {1, 3}  # new rows: 1 step, old: 3
    buffer = io.BytesIO()
    torch.save({"model": grown.state_dict(), "optimizer": opt.state_dict()}, buffer)
    twin = copy.deepcopy(grown)
    saved = torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
    twin.load_state_dict(saved["model"], strict=True)
    twin_opt = build_optimizer(dict(twin.named_parameters()), opt.cfg)
    twin_opt.load_state_dict(saved["optimizer"])
    for m, o in ((grown, opt), (twin, twin_opt)):
        train_step(m, o, tokens(seed=12))
    for (name, a), (_, b) in zip(grown.named_parameters(), twin.named_parameters()):
        assert torch.equal(a, b), name


def test_clip_norm_with_unit_weights_is_the_plain_norm_bit_for_bit():
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(7))]
    for p in params:
        p.grad = torch.randn_like(p)
    plain = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in params])).item()
    assert clip_grad_norm(params, 0.0) == plain
    assert clip_grad_norm(params, 0.0, [1.0, torch.ones(7)]) == pytest.approx(plain, rel=1e-6)
    assert clip_grad_norm(params, 0.0, [4.0, 1.0]) == pytest.approx((4 * params[0].grad.pow(2).sum() + params[1].grad.pow(2).sum()).sqrt().item())


# ---------------------------------------------------------------- the tiny recipe's plan


def test_the_tiny_recipe_grows_dense_to_moe_to_deeper_to_256_nf4_experts_with_one_approximate_step():
    recipe = load_recipe(REPO / "recipes" / "tiny.yaml")
    seed = recipe.model.with_changes(vocab_size=256)
    shapes = plan_stage_models(seed, [s.grow for s in recipe.stages])
    assert shapes[0].moe is None
    assert shapes[1].moe is not None and shapes[1].n_layers == shapes[0].n_layers
    assert shapes[-1].n_layers > shapes[1].n_layers
    last = shapes[-1]
    assert last.moe.num_experts >= 256 and last.moe.expert_hidden % 64 == 0
    assert [s.moe.expert_format for s in shapes[1:]] == ["full", "full", "nf4"], "the last stage trains NF4 experts + LoRA"
    ops = [(step.op, step.args) for s in recipe.stages for step in s.grow]
    approximate = [name for name, args in ops if not get_operator(name).is_exact(args)]
    assert approximate == ["quantize_experts"], ops
    # The split after quantize_experts cuts the 4-bit codes without requantizing (plan-time checked).
    assert [name for name, _ in ops][-2:] == ["quantize_experts", "split_experts"]
    # Full-precision splits keep the experts' parameters while the expert count grows (the routers gain rows).
    cfg, counts = shapes[1], []
    for name, args in ops[1:]:
        cfg = get_operator(name).plan(cfg, args)
        if name == "split_experts" and cfg.moe.expert_format == "full":
            counts.append(planned_param_count(cfg) - cfg.moe.num_experts * cfg.d_model * len(cfg.moe_layers))
    assert len(counts) == 2 and len(set(counts)) == 1 and cfg == last


# ---------------------------------------------------------------- end to end


@pytest.mark.slow
def test_a_micro_run_through_every_new_operator_reports_each_transition_in_inspect(micro_recipe, tmp_path):

    from conftest import growth_report, run_cli

    stages = [
        {"name": "dense", "steps": 4, "seq_len": 32, "batch_size": 4},
        {"name": "moe", "steps": 3, "seq_len": 32, "batch_size": 4, "grow": [{"op": "upcycle_moe", "num_experts": 2, "top_k": 1}]},
        {
            "name": "wide",
            "steps": 3,
            "seq_len": 32,
            "batch_size": 4,
            "grow": [
                {"op": "clone_experts", "factor": 2, "reinit_fraction": 0.0, "router_noise": 0.01},
                {"op": "widen_hidden", "factor": 2, "noise": 0.01},
                {"op": "split_experts"},
                {"op": "add_heads", "add": 2},
                {"op": "widen_ffn", "ffn_hidden": 96, "expert_hidden": 64},
            ],
        },
    ]
    recipe = micro_recipe({"stages": stages})
    out = tmp_path / "run"
    done = run_cli("run", recipe, "--out", out)
    assert done.returncode == 0, done.stderr[-2000:]
    report, ops = growth_report(out)
    assert ops == [
        ("upcycle_moe", True, True),
        ("clone_experts", False, True),
        ("widen_hidden", True, True),
        ("split_experts", True, True),
        ("add_heads", True, True),
        ("widen_ffn", True, True),
        ("transition", False, True),  # the whole stage's growth, first model vs last
    ]
    assert report["transitions"][-1]["args"] == {"ops": ["clone_experts", "widen_hidden", "split_experts", "add_heads", "widen_ffn"]}
    split = report["transitions"][3]
    assert split["rel_l2"] < 1e-4 and set(split["router_kl"]) == {"0"} and split["router_kl"]["0"] < 1e-4
    assert report["model"]["num_experts"] == 8 and report["model"]["d_model"] == 64
