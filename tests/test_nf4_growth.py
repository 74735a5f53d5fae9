"""split_experts, clone_experts and deepen on NF4 experts (stages/operators/experts.py, deepen.py):
the operators work on the 4-bit codes and quantization state without requantizing, so

- split: every child's base codes are its parent's row slice, byte for byte, its dequantized
  matrices the parent's rows (down-projection x2) bit for bit, its LoRA product the parent's
  restricted to its neurons; the logits stay within fp32 rounding; optimizer state is mapped by
  DESIGN.md §7 (one AdamW step after the split moves the logits as before it, with the factors the
  children share frozen); sizes that would need requantizing are refused at plan time, saying
  which size is needed;
- clone: children hold their parent's codes and adapters, siblings share its moments; the
  drop-upcycling redraw is refused on frozen bases;
- deepen: inserted MoE blocks get an exactly zero NF4 down-projection and zero LoRA B: identity.

And a whole micro run through the CLI that quantizes the experts and clones, splits and deepens
them in a later stage. CPU, tiny shapes, fp32 (the NF4 path computes in fp32).

Legend: E experts, F expert hidden width, D d_model, B batch, T sequence.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from growtrain.model import GrowLM, ModelConfig, MoEConfig
from growtrain.model.config import ExpertLoRAConfig
from growtrain.model.nf4 import MATRICES, NF4Experts, dequantize_stack
from growtrain.optim.adamw import AdamW
from growtrain.optim.registry import build_optimizer
from growtrain.recipe import GrowthStep, InvarianceConfig, OptimizerConfig, recipe_from_dict
from growtrain.stages import GrowthCheckFailed, GrowthPlanError, apply_growth, get_operator
from growtrain.stages.operators.experts import CloneExpertsArgs, SplitExpertsArgs
from growtrain.stages.transition import map_optimizer_state

pytest.importorskip("bitsandbytes")

V = 29
split, clone, deepen = get_operator("split_experts"), get_operator("clone_experts"), get_operator("deepen")
# Shapes whose halves are sliceable: F/2 x D a multiple of 64 (plain) or of 16384 (double quantization).
SHAPES = {False: dict(d_model=32, expert_hidden=64), True: dict(d_model=128, expert_hidden=256)}


def nf4_config(double_quant=False, E=4, k=2, score="softmax", layers=(0, 1), z_loss=0.001, d_model=None, expert_hidden=None) -> ModelConfig:
    shape = SHAPES[double_quant]
    D, F_ = d_model or shape["d_model"], expert_hidden or shape["expert_hidden"]
    moe = MoEConfig(
        num_experts=E, top_k=k, expert_hidden=F_, score_func=score, router_init_std=0.5, balance_bias_rate=0.05, z_loss_coef=z_loss,
        expert_format="nf4", double_quant=double_quant, lora=ExpertLoRAConfig(r=4, lora_alpha=8.0),
    )  # fmt: skip
    return ModelConfig(vocab_size=V, d_model=D, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=48, init_std=0.1, moe=moe, moe_layers=layers)


def tokens(seed=0, B=2, T=10) -> torch.Tensor:
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


def train_step(model, opt, batch_BT, lr=1e-2) -> float:
    opt.zero_grad()
    out = model(batch_BT[:, :-1])
    (F.cross_entropy(out.logits.flatten(0, 1), batch_BT[:, 1:].flatten()) + out.aux_loss).backward()
    norm = opt.clip_grad_norm(opt.cfg.grad_clip)
    opt.step(lr)
    model.update_balance_biases([s.load for s in out.moe_stats])
    return norm


def trained(cfg, steps=3, clip=1.0, freeze=()) -> tuple[GrowLM, AdamW]:
    """An NF4 model a few steps into training: nonzero adapters (B too), moments, step counts, biases."""
    torch.manual_seed(4)
    model = GrowLM(cfg)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "_lora_B" in n:
                p.normal_(0.0, 0.05)
    for n, p in model.named_parameters():
        p.requires_grad_(not n.endswith(freeze) if freeze else True)
    opt = build_optimizer(dict(model.named_parameters()), OptimizerConfig(grad_clip=clip))
    for k in range(steps):
        train_step(model, opt, tokens(seed=100 + k))
    return model, opt


def logits_of(model, x_BT) -> torch.Tensor:
    with torch.no_grad():
        return model(x_BT).logits


def rel(a, b) -> float:
    return ((b - a).norm() / a.norm()).item()


def grow(model, state, op, args, cfg=None):
    probe = (tokens(seed=99, B=4, T=12), tokens(seed=98, B=4, T=12))
    return apply_growth(
        model, state, [GrowthStep(op.name, args)], seed=0, stage_index=1, stage_name="grown",
        planned=op.plan(model.config, args), probe=probe, invariance_cfg=cfg or InvarianceConfig(exact_rel_tol=1e-5),
    )  # fmt: skip


# ---------------------------------------------------------------- split_experts


@pytest.mark.parametrize("double_quant", [False, True], ids=["plain", "double_quant"])
def test_split_of_nf4_experts_cuts_the_codes_without_requantizing_and_keeps_the_logits(double_quant):
    model, opt = trained(nf4_config(double_quant))
    E, F_ = 4, model.config.moe.expert_hidden
    half = F_ // 2
    outcome = grow(model, opt.state, split, SplitExpertsArgs())
    (record,) = outcome.records
    assert record["passed"] and record["exact"], record["problems"]
    assert record["metrics"]["rel_l2"] < 2e-6, record["metrics"]  # fp32 rounding of the recombined gates
    new = outcome.model
    moe = new.config.moe
    assert (moe.num_experts, moe.top_k, moe.expert_hidden, moe.expert_format, moe.double_quant) == (8, 4, half, "nf4", double_quant)
    D = new.config.d_model
    for b in (0, 1):
        old_x, new_x = model.blocks[b].g.ffn.experts, new.blocks[b].g.ffn.experts
        assert isinstance(new_x, NF4Experts)
        for m in MATRICES:
            old_codes, new_codes = getattr(old_x, f"{m}_codes"), getattr(new_x, f"{m}_codes")
            old_w, new_w = dequantize_stack(old_x.stack(m)), dequantize_stack(new_x.stack(m))
            scale = 2.0 if m == "w_down" else 1.0
            for j in range(2):
                for e in range(E):
                    c = j * E + e  # child j of parent e
                    assert torch.equal(new_codes[c], old_codes[e, j * half * D // 2 : (j + 1) * half * D // 2]), (b, m, c)
                    assert torch.equal(new_w[c], old_w[e, j * half : (j + 1) * half] * scale), (b, m, c)
            # Each child's adapter product is its parent's, restricted to its neurons (x2 on down).
            old_d, new_d = _lora_products(old_x, m), _lora_products(new_x, m)
            for j in range(2):
                neurons = slice(j * half, (j + 1) * half)
                want = old_d[:, :, neurons] * 2 if m == "w_down" else old_d[:, neurons]
                torch.testing.assert_close(new_d[j * E : (j + 1) * E], want, rtol=1e-6, atol=1e-7)


def _lora_products(experts, m) -> torch.Tensor:
    """[E, out, in] scale * B @ A of matrix m, in the math orientation (w_down as [E, D, F])."""
    A, B = getattr(experts, f"{m}_lora_A").detach(), getattr(experts, f"{m}_lora_B").detach()
    return experts.scale * (B @ A)


def test_split_of_nf4_experts_maps_the_adapters_optimizer_state_by_the_copy_rule():
    model, opt = trained(nf4_config())
    E, half = 4, 32
    outcome = grow(model, opt.state, split, SplitExpertsArgs())
    old, new = opt.state, outcome.optimizer_state
    prefix = "blocks.1.g.ffn.experts."
    assert set(new) == {n for n, p in outcome.model.named_parameters() if p.requires_grad}
    assert not any(k.endswith(("_codes", "_absmax")) for k in new), "the frozen base has no optimizer state"
    # gate/up B: the neurons' rows, β = 1, S = 1: the old moments, sliced
    s, o = new[prefix + "w_up_lora_B"], old[prefix + "w_up_lora_B"]
    assert torch.equal(s.exp_avg[E:], o.exp_avg[:, half:]) and torch.equal(s.exp_avg_sq[:E], o.exp_avg_sq[:, :half])
    # down A: the neurons' columns x2, β = 2, S = 2: m/2, v/4, LR x2, weight decay /2
    s, o = new[prefix + "w_down_lora_A"], old[prefix + "w_down_lora_A"]
    assert torch.equal(s.exp_avg[E:], o.exp_avg[:, :, half:] / 2) and torch.equal(s.exp_avg_sq[:E], o.exp_avg_sq[:, :, :half] / 4)
    assert (s.lr_mult, s.wd_mult, s.norm_mult) == (2.0, 0.5, 4.0)
    # shared factors (gate/up A, down B): β = 1, S = 2 like the router rows: siblings split the moments
    for name in ("w_gate_lora_A", "w_down_lora_B"):
        s, o = new[prefix + name], old[prefix + name]
        assert torch.equal(s.exp_avg[:E], o.exp_avg / 2) and torch.equal(s.exp_avg_sq[E:], o.exp_avg_sq / 4), name
        assert s.step == o.step == 3


# The router rows and the factors the children share (gate/up A, down B) get unequal shares of
# their parent's gradient, so only with them frozen is the step exact (as for the full-precision
# split's router); the z-loss changes by log 2 and is off.
SHARED = ("router.weight", "w_gate_lora_A", "w_up_lora_A", "w_down_lora_B")


def test_one_adamw_step_after_an_nf4_split_moves_the_logits_as_before_it():
    model, opt = trained(nf4_config(z_loss=0.0), clip=0.5, freeze=SHARED)
    growth = split.apply(copy.deepcopy(model), SplitExpertsArgs())
    grown = growth.model
    for n, p in grown.named_parameters():
        p.requires_grad_(not n.endswith(SHARED))
    ref, ref_opt = copy.deepcopy(model), build_optimizer(dict(model.named_parameters()), opt.cfg)
    ref_opt.rebind(dict(ref.named_parameters()), copy.deepcopy(opt.state))
    grown_opt = build_optimizer(dict(grown.named_parameters()), opt.cfg)
    grown_opt.rebind(dict(grown.named_parameters()), map_optimizer_state(copy.deepcopy(opt.state), grown, growth.provenance))
    x_BT, batch = tokens(seed=21, B=3, T=10), tokens(seed=8, T=9)
    ref_before, grown_before = logits_of(ref, x_BT), logits_of(grown, x_BT)
    ref_norm, grown_norm = train_step(ref, ref_opt, batch), train_step(grown, grown_opt, batch)
    assert ref_norm > 0.5, "the clip must be engaged for this test to cover it"
    assert grown_norm == pytest.approx(ref_norm, rel=1e-5), "the clip norm is measured in the old parametrization"
    ref_delta, grown_delta = logits_of(ref, x_BT) - ref_before, logits_of(grown, x_BT) - grown_before
    assert rel(ref_delta, grown_delta) < 1e-4, f"the step moved the logits differently: {rel(ref_delta, grown_delta):.3g}"


@pytest.mark.parametrize(
    "double_quant, d_model, hidden, factor, needed, how, bound",
    [
        # halves of 64 x 128 = 8192 elements: half a nested block; the codes are kept, the block scales re-nested
        (True, 128, 128, 2, "multiple of 16384", "double-quantizing their block scales again", 1e-2),
        (True, 32, 64, 2, "double_quant: false", "double-quantizing their block scales again", 1e-2),
        # 5 x 24 = 120 elements: the children start inside a block, so the bases are requantized
        (False, 24, 10, 2, "multiple of 64", "dequantized, cut and quantized again", 0.2),
        (False, 32, 96, 3, "powers of two", "dequantized, cut and quantized again", 0.2),  # the down-projection's x3
    ],
)
def test_an_nf4_split_the_codes_cannot_carry_requantizes_what_it_must_and_is_judged_approximate_saying_why(
    double_quant, d_model, hidden, factor, needed, how, bound
):
    model, opt = trained(nf4_config(double_quant, d_model=d_model, expert_hidden=hidden))
    args = SplitExpertsArgs(factor=factor)
    growth = split.apply(copy.deepcopy(model), args)
    # Every matrix of both layers; at x3 the down-projections only (gate and up cut exactly: 32 x 32 children).
    assert len(growth.notes) == (2 if factor == 3 else 6), growth.notes
    assert growth.notes and all(how in n and needed in n and "split before quantize_experts" in n for n in growth.notes), growth.notes
    # The children's bases against the parent's rows (x factor for the down-projection): within
    # the measured move, which the note states, and that move is what requantizing costs.
    rows = hidden // factor
    for b in (0, 1):
        old_x, new_x = model.blocks[b].g.ffn.experts, growth.model.blocks[b].g.ffn.experts
        for m in MATRICES:
            parent = dequantize_stack(old_x.stack(m))
            want = torch.cat([parent[:, j * rows : (j + 1) * rows] for j in range(factor)]) * (factor if m == "w_down" else 1)
            moved = float((dequantize_stack(new_x.stack(m)) - want).abs().max() / want.abs().max())
            assert moved < bound, (b, m, moved)
            said = [n for n in growth.notes if f"blocks.{b}.g.ffn.experts.{m}:" in n]
            if said:
                assert f"{moved:.1e}" in said[0], (said[0], moved)
            else:
                assert moved == 0.0, (b, m, moved)
    # Judged by the approximate thresholds, the reason recorded, and the run goes on.
    (record,) = grow(model, opt.state, split, args, cfg=InvarianceConfig()).records
    assert record["passed"] and not record["exact"] and record["inexact_on_these_weights"] == growth.notes, record
    # A split whose children would hold an odd number of weights cannot be packed at all.
    with pytest.raises(GrowthPlanError, match="odd number of elements"):
        split.plan(nf4_config(False, d_model=3, expert_hidden=6), SplitExpertsArgs())


def test_a_recipe_that_splits_nf4_experts_off_their_blocks_validates():
    raw = {
        "model": {"d_model": 32, "n_layers": 1, "n_heads": 2, "ffn_hidden": 64},
        "stages": [
            {"name": "moe", "steps": 1, "grow": [{"op": "upcycle_moe", "num_experts": 2, "top_k": 1}]},
            {"name": "nf4", "steps": 1, "grow": [{"op": "quantize_experts", "r": 2}, {"op": "split_experts"}]},
        ],
    }
    # 32 x 32 children inside nested blocks: re-nested, judged as approximate at run time (refused before).
    assert [s.name for s in recipe_from_dict(raw).stages] == ["moe", "nf4"]


def tie_router_rows(model, block, groups) -> None:
    """Experts of each group in `groups` get the first one's router row and balance bias: siblings of
    an earlier split that training has not separated yet."""
    router = model.blocks[block].g.ffn.router
    with torch.no_grad():
        for group in groups:
            for e in group[1:]:
                router.weight[e] = router.weight[group[0]]
                router.balance_bias[e] = router.balance_bias[group[0]]


def test_an_nf4_split_of_a_router_whose_top_k_can_cut_a_tied_group_is_judged_approximate_saying_why():
    # Experts 1 and 2 tie exactly, 0 and 3 do not; top-2 then takes one of the pair for every token
    # whose pair score falls between the others', chosen by torch.topk's tie-break. The codes split
    # exactly (the children reproduce the parent under its own routing); the children's top-4 picks
    # 2 of the 4 tied children by its own tie-break, which is not "both children of the parent's pick".
    model, opt = trained(nf4_config())
    tie_router_rows(model, 0, [(1, 2)])
    growth = split.apply(copy.deepcopy(model), SplitExpertsArgs())
    E = model.config.moe.num_experts
    old_moe, new_moe = model.blocks[0].g.ffn, growth.model.blocks[0].g.ffn
    x_TD = torch.randn(64, model.config.d_model, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        y_old, stats = old_moe(x_TD)
        y_forced, _ = new_moe(x_TD, routing=torch.cat([stats.top_k_indices, stats.top_k_indices + E], dim=1))
        y_new, _ = new_moe(x_TD)
    assert rel(y_old, y_forced) < 1e-5, "under the parent's routing the NF4 children must reproduce it"
    assert rel(y_old, y_new) > 1e-3, "the tie-break must differ for some token, or this test covers nothing"
    (note,) = growth.notes  # block 1's router has no ties
    assert "block 0" in note and "torch.topk" in note and "Train longer" in note, note
    # Issue 42: not exact on these weights, so judged by the approximate thresholds, the reason
    # recorded, and the run goes on where the change is within them ...
    said = []
    (record,) = apply_growth(
        model, opt.state, [GrowthStep("split_experts", SplitExpertsArgs())], seed=0, stage_index=1, stage_name="grown",
        planned=split.plan(model.config, SplitExpertsArgs()), probe=(tokens(seed=99, B=4, T=12), tokens(seed=98, B=4, T=12)),
        invariance_cfg=InvarianceConfig(), log=said.append,
    ).records  # fmt: skip
    assert record["passed"] and not record["exact"] and record["inexact_on_these_weights"] == [note], record
    assert record["metrics"]["dynamics"]["bar"] == InvarianceConfig().dynamics_max_rel
    assert any("not exact on these weights, checked as approximate" in line and "torch.topk" in line for line in said), said
    # ... and where it is not, the failure says why.
    with pytest.raises(GrowthCheckFailed) as err:
        grow(model, opt.state, split, SplitExpertsArgs(), cfg=InvarianceConfig(max_rel_dloss=1e-9))
    assert not err.value.record["exact"]
    assert any("torch.topk" in p and "block 0" in p for p in err.value.record["problems"]), err.value.record["problems"]


def test_an_nf4_split_stays_exact_when_every_tied_group_is_taken_whole():
    # Pairs {0, 1} and {2, 3} tie, top_k 2: every token takes one whole pair (two splits back to
    # back, before training); no ties at all in block 1.
    model, opt = trained(nf4_config())
    assert split.apply(copy.deepcopy(model), SplitExpertsArgs()).notes == []
    tie_router_rows(model, 0, [(0, 1), (2, 3)])
    assert split.apply(copy.deepcopy(model), SplitExpertsArgs()).notes == []
    (record,) = grow(model, opt.state, split, SplitExpertsArgs()).records
    assert record["passed"] and record["metrics"]["rel_l2"] < 2e-6, record["metrics"]


# ---------------------------------------------------------------- clone_experts


@pytest.mark.parametrize("double_quant", [False, True], ids=["plain", "double_quant"])
def test_clone_of_nf4_experts_copies_codes_and_adapters_and_siblings_share_the_moments(double_quant):
    # With top_k = 1 a token picks one child of its old expert, an exact copy: the function is kept.
    model, opt = trained(nf4_config(double_quant, k=1))
    outcome = grow(model, opt.state, clone, CloneExpertsArgs(factor=3, reinit_fraction=0.0, router_noise=0.0))
    (record,) = outcome.records
    assert record["passed"] and not record["exact"] and record["metrics"]["rel_l2"] < 1e-6, record["metrics"]
    new, E = outcome.model, 4
    assert new.config.moe.num_experts == 12 and new.config.moe.top_k == 1
    for m in MATRICES:
        old_x, new_x = model.blocks[0].g.ffn.experts, new.blocks[0].g.ffn.experts
        for part in ("codes", "absmax", "lora_A", "lora_B") + (("nested_absmax", "offset") if double_quant else ()):
            assert torch.equal(getattr(new_x, f"{m}_{part}"), getattr(old_x, f"{m}_{part}").repeat(3, *[1] * (getattr(old_x, f"{m}_{part}").ndim - 1))), (m, part)
    s, o = outcome.optimizer_state["blocks.0.g.ffn.experts.w_up_lora_B"], opt.state["blocks.0.g.ffn.experts.w_up_lora_B"]
    assert torch.equal(s.exp_avg[2 * E :], o.exp_avg / 3) and torch.equal(s.exp_avg_sq[:E], o.exp_avg_sq / 9) and s.step == o.step


def test_clone_of_nf4_experts_with_router_noise_reports_the_change_honestly():
    model, opt = trained(nf4_config(k=2))
    # With top_k fixed at 2 a token may now pick two copies of one parent: the function changes.
    lenient = InvarianceConfig(max_rel_dloss=1e9, min_cosine=-1.0, max_router_kl=1e9)
    outcome = grow(model, opt.state, clone, CloneExpertsArgs(factor=2, reinit_fraction=0.0, router_noise=0.01), cfg=lenient)
    m = outcome.records[0]["metrics"]
    assert outcome.records[0]["passed"] and 1e-3 < m["rel_l2"] < 1 and 0 < m["cosine"] < 1
    assert 0 < m["router_kl"]["1"] < 0.02, "aggregated onto parents, the router moves by the noise only"


def test_drop_upcycling_clones_of_frozen_nf4_bases_are_refused_at_plan_time_naming_the_fix():
    with pytest.raises(GrowthPlanError, match="reinit_fraction: 0") as err:
        clone.plan(nf4_config(), CloneExpertsArgs(factor=2))  # the default redraws a quarter of the neurons
    assert "clone before quantize_experts" in err.value.message
    assert clone.plan(nf4_config(), CloneExpertsArgs(factor=2, reinit_fraction=0.0)).moe.num_experts == 8


# ---------------------------------------------------------------- upcycle_moe


@pytest.mark.parametrize("double_quant", [False, True], ids=["plain", "double_quant"])
def test_upcycling_a_dense_block_into_an_nf4_model_quantizes_the_copies_and_is_judged_approximate_saying_why(double_quant):
    from growtrain.model.nf4 import quantize_stack, stored_layout
    from growtrain.stages.operators.upcycle import UpcycleArgs

    cfg = nf4_config(double_quant, layers=(1,))
    moe = cfg.moe
    model, opt = trained(cfg.with_changes(ffn_hidden=moe.expert_hidden))  # block 0 dense, as wide as the experts
    upcycle = get_operator("upcycle_moe")
    args = UpcycleArgs(num_experts=moe.num_experts, top_k=moe.top_k, layers=(0,), balance_bias_rate=moe.balance_bias_rate,
                       router_init_std=moe.router_init_std, z_loss_coef=moe.z_loss_coef)  # fmt: skip
    assert upcycle.plan(model.config, args).moe == moe  # the new layer takes the NF4 format of the others
    growth = upcycle.apply(copy.deepcopy(model), args)
    assert [n.split(": ")[1] for n in growth.notes] == [f"blocks.0.g.ffn.experts.{m}" for m in MATRICES], growth.notes
    assert all("upcycle before quantize_experts" in n for n in growth.notes)
    new_x = growth.model.blocks[0].g.ffn.experts
    for m in MATRICES:
        dense = getattr(model.blocks[0].g.ffn, m).weight.detach()
        want = dequantize_stack(quantize_stack(stored_layout(m, dense.unsqueeze(0)), double_quant))  # bitsandbytes' round trip of one copy
        assert torch.equal(dequantize_stack(new_x.stack(m)), want.expand(moe.num_experts, -1, -1)), m
        assert not getattr(new_x, f"{m}_lora_B").any()
        assert growth.provenance[f"blocks.0.g.ffn.experts.{m}_lora_A"].kind == "reset"
    # Judged by the approximate thresholds, the reason recorded; the dense matrices' state goes
    # with them, the adapters start fresh.
    # (NF4 of these random weights, std 0.1, moves the probe logits to a cosine of ~0.994, as
    # quantize_experts of the same copies would: the bar is the recipe's, and a failure says why.)
    outcome = grow(model, opt.state, upcycle, args, cfg=InvarianceConfig(min_cosine=0.99))
    (record,) = outcome.records
    assert record["passed"] and not record["exact"] and record["inexact_on_these_weights"] == growth.notes, record
    with pytest.raises(GrowthCheckFailed) as err:
        grow(model, opt.state, upcycle, args, cfg=InvarianceConfig(min_cosine=0.9999))
    assert "logit cosine" in str(err.value) and "upcycle before quantize_experts" in str(err.value)
    assert "blocks.0.g.ffn.w_gate.weight" in opt.state and "blocks.0.g.ffn.w_gate.weight" not in outcome.optimizer_state
    # Other settings, or redrawing neurons of frozen bases, are refused with the fix.
    with pytest.raises(GrowthPlanError, match="top_k 2"):
        upcycle.plan(model.config, UpcycleArgs(num_experts=moe.num_experts, top_k=1, layers=(0,)))
    with pytest.raises(GrowthPlanError, match="drop_ratio"):
        upcycle.plan(model.config, UpcycleArgs(**{**args.__dict__, "drop_ratio": 0.25}))


# ---------------------------------------------------------------- deepen


@pytest.mark.parametrize("init", ["copy", "fresh"])
@pytest.mark.parametrize("double_quant", [False, True], ids=["plain", "double_quant"])
def test_deepen_inserts_nf4_moe_blocks_with_an_exactly_zero_down_projection(init, double_quant):
    model, opt = trained(nf4_config(double_quant, layers=(1,)))
    args = deepen.args_type(after=(0, 1), init=init)
    outcome = grow(model, opt.state, deepen, args, cfg=InvarianceConfig(exact_rel_tol=1e-12))
    (record,) = outcome.records
    assert record["passed"] and record["exact"]
    assert record["metrics"]["max_abs_dlogits"] == 0.0, "identity blocks add exact zeros"
    new = outcome.model
    assert new.config.moe_layers == (2, 3)  # block 1 moved to 2; the block inserted after it is MoE too
    inserted, carried = new.blocks[3].g.ffn.experts, new.blocks[2].g.ffn.experts
    assert torch.equal(inserted.dequantized("w_down"), torch.zeros_like(inserted.dequantized("w_down")))
    assert not inserted.w_down_lora_B.any() and inserted.w_down_lora_A.any()
    if init == "copy":  # the codes are the neighbour's, only the scales are zero; gate/up copied whole
        assert torch.equal(inserted.w_down_codes, carried.w_down_codes) and torch.equal(inserted.w_up_codes, carried.w_up_codes)
        assert torch.equal(inserted.w_gate_lora_B, carried.w_gate_lora_B)
    for name, s in outcome.optimizer_state.items():
        if name.startswith(("blocks.1.", "blocks.3.")):
            assert s.step == 0 and not s.exp_avg.any(), f"{name}: a new block's parameters start fresh"
    # The new block trains through its adapters: after a step its down-projection adapter moves.
    opt.rebind(dict(new.named_parameters()), outcome.optimizer_state)
    train_step(new, opt, tokens(seed=5))
    assert inserted.w_down_lora_B.any()


# ---------------------------------------------------------------- whole run


@pytest.mark.slow
def test_a_micro_run_quantizes_the_experts_then_clones_splits_and_deepens_them_in_a_later_stage(micro_recipe, tmp_path):
    from conftest import growth_report, losses, run_cli

    stages = [
        {"name": "dense", "steps": 3, "seq_len": 32, "batch_size": 4},
        {"name": "moe", "steps": 3, "seq_len": 32, "batch_size": 4, "grow": [{"op": "upcycle_moe", "num_experts": 2, "top_k": 1}]},
        # d_model 32, expert_hidden 64: halves of 32 x 32 = 1024 elements are whole 64-blocks, not
        # whole nested blocks: plain NF4 (no double quantization) splits exactly.
        {"name": "nf4", "steps": 3, "seq_len": 32, "batch_size": 4, "grow": [{"op": "quantize_experts", "r": 2, "lora_alpha": 4.0, "double_quant": False}]},
        {
            "name": "grown-nf4",
            "steps": 3,
            "seq_len": 32,
            "batch_size": 4,
            # clone first, at top_k 1: a token picks one of its parent's exact copies
            "grow": [{"op": "clone_experts", "reinit_fraction": 0.0, "router_noise": 0.01}, {"op": "split_experts"}, {"op": "deepen", "after": [0]}],
        },
    ]
    recipe = micro_recipe({"stages": stages})
    out = tmp_path / "run"
    done = run_cli("run", recipe, "--out", out)
    assert done.returncode == 0, done.stderr[-2000:]
    report, ops = growth_report(out)
    assert ops == [
        ("upcycle_moe", True, True),
        ("quantize_experts", False, True),
        ("clone_experts", False, True),
        ("split_experts", True, True),
        ("deepen", True, True),
        ("transition", False, True),
    ]
    assert report["transitions"][3]["rel_l2"] < 1e-5 and report["transitions"][4]["rel_l2"] == 0.0
    assert report["model"]["num_experts"] == 8
    rows = losses(out)
    assert len(rows) == 12 and all(torch.isfinite(torch.tensor(loss)) for _, loss, _ in rows)
    from safetensors.torch import load_file

    final = load_file(out / "checkpoints" / "step-00000012" / "model.safetensors")
    assert final["blocks.0.g.ffn.experts.w_gate_codes"].shape == (8, 32 * 32 // 2)
