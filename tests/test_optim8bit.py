"""8-bit Adam moments on the dense parts (optimizer.dense_state_bits: 8, growtrain/optim/adamw8bit.py):
which tensors get them, steps close to 32-bit AdamW's, bitsandbytes' blockwise update against the
dequantize / step / requantize update it replaced (tests/optim_reference.py), per-element
multipliers stepped exactly, checkpoints that load with torch.load(weights_only=True) and continue
bit for bit, growth mapping through the float32 view with carried moments keeping their codes, and
whole `growtrain run`s with `--set optimizer.dense_state_bits=8`, killed and resumed. CPU, tiny
shapes."""

from __future__ import annotations

import io
import math
import signal
from dataclasses import replace

import pytest
import torch
import yaml
from torch import nn

from conftest import MICRO, assert_same_run, cli_env, losses, run_cli
from optim_reference import reference_step, roundings

from growtrain.model import GrowLM, ModelConfig, MoEConfig
from growtrain.optim.adamw import ParamState
from growtrain.optim.adamw8bit import AdamW8bit, Moment8bit, state_bytes
from growtrain.optim.registry import build_optimizer
from growtrain.recipe import GrowthStep, InvarianceConfig, OptimizerConfig
from growtrain.stages import apply_growth, get_operator
from growtrain.stages.operators.quantize import QuantizeExpertsArgs


pytest.importorskip("bitsandbytes")

V = 300  # embeddings and LM head of 300 x 32 = 9600 elements: big enough for 8-bit state


def moe_model(seed=0) -> GrowLM:
    moe = MoEConfig(num_experts=4, top_k=2, expert_hidden=64, router_init_std=0.5)
    cfg = ModelConfig(vocab_size=V, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64, moe=moe, moe_layers=(1,))
    torch.manual_seed(seed)
    return GrowLM(cfg)


def backward(model, g: torch.Generator) -> None:
    out = model(torch.randint(0, V, (2, 12), generator=g))
    (torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), torch.randint(0, V, (24,), generator=g)) + out.aux_loss).backward()


def train(model, opt, steps, seed=0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        backward(model, g)
        opt.clip_grad_norm(1.0)
        opt.step(1e-2)
        opt.zero_grad()


def dequantize_step_requantize(opt, lr: float) -> dict[str, tuple[torch.Tensor, ParamState]]:
    """What the 8-bit optimizer computed before issue 16 for each of its 8-bit tensors (gradients
    set): dequantize both moments, take the old element-by-element step on a copy, requantize."""
    out = {}
    for name, p in opt.params.items():
        s = opt._packed[name]
        if not isinstance(s.exp_avg, Moment8bit):
            continue
        ref_p = nn.Parameter(p.detach().clone())
        ref_p.grad = p.grad.clone()
        logical = replace(s, step=s.step.clone() if isinstance(s.step, torch.Tensor) else s.step, exp_avg=s.exp_avg.dequantize(), exp_avg_sq=s.exp_avg_sq.dequantize())
        reference_step({name: ref_p}, {name: logical}, lr, opt.cfg)
        out[name] = ref_p, replace(logical, exp_avg=Moment8bit.quantize(logical.exp_avg, True), exp_avg_sq=Moment8bit.quantize(logical.exp_avg_sq, False))
    return out


def test_the_config_switch_builds_8bit_state_for_large_dense_tensors_only():
    model = moe_model()
    opt = build_optimizer(dict(model.named_parameters()), OptimizerConfig(dense_state_bits=8))
    assert isinstance(opt, AdamW8bit)
    train(model, opt, 1)
    sd = opt.state_dict()
    eight = {n for n, e in sd.items() if "exp_avg_codes" in e}
    assert {"lm_head.weight", "blocks.1.g.ffn.experts.w_gate", "blocks.1.g.ffn.experts.w_down"} <= eight
    assert not {"embed.weight", "blocks.1.g.ffn.router.weight", "blocks.0.f.norm.weight", "blocks.0.g.ffn.w_up.weight"} & eight  # < 4096
    assert all(sd[n]["exp_avg_codes"].dtype == torch.uint8 and sd[n]["exp_avg_codes"].shape == p.shape for n, p in model.named_parameters() if n in eight)
    full = build_optimizer(dict(moe_model().named_parameters()), OptimizerConfig())
    assert state_bytes(opt) < 0.6 * state_bytes(full)


def test_8bit_steps_stay_close_to_32bit_adamw():
    """The first step is 32-bit AdamW's within fp32 rounding (moments are quantized after it;
    bitsandbytes' kernel and torch's fused one order the roundings differently); after four, each
    tensor's total update differs by under 15% relative L2 (measured: 1-9% at lr 1e-2)."""
    m8, m32 = moe_model(), moe_model()
    start = {n: p.detach().clone() for n, p in m32.named_parameters()}
    o8, o32 = build_optimizer(dict(m8.named_parameters()), OptimizerConfig(dense_state_bits=8)), build_optimizer(dict(m32.named_parameters()), OptimizerConfig())
    train(m8, o8, 1)
    train(m32, o32, 1)
    for (n, a), b in zip(m8.named_parameters(), m32.parameters()):
        assert roundings(a, b, 1e-2) <= 4, n  # measured: at most 1 epsilon of |p| + lr
    train(m8, o8, 3, seed=1)
    train(m32, o32, 3, seed=1)
    for (n, p8), p32 in zip(m8.named_parameters(), m32.parameters()):
        d8, d32 = p8 - start[n], p32 - start[n]
        assert ((d8 - d32).norm() / d32.norm()).item() < 0.15, n


def test_a_checkpointed_8bit_state_loads_with_weights_only_and_continues_bit_for_bit():
    model = moe_model()
    opt = build_optimizer(dict(model.named_parameters()), OptimizerConfig(dense_state_bits=8))
    train(model, opt, 2)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)

    resumed = moe_model(seed=1)
    resumed.load_state_dict(saved["model"])
    opt2 = build_optimizer(dict(resumed.named_parameters()), OptimizerConfig(dense_state_bits=8))
    opt2.load_state_dict(saved["optimizer"])
    train(model, opt, 2, seed=5)
    train(resumed, opt2, 2, seed=5)
    for (n, a), b in zip(model.named_parameters(), resumed.parameters()):
        assert torch.equal(a, b), n
    for n, entry in opt.state_dict().items():
        for k, v in entry.items():
            w = opt2.state_dict()[n][k]
            assert torch.equal(v, w) if isinstance(v, torch.Tensor) else v == w, (n, k)


def test_growth_maps_8bit_state_through_the_float32_view_and_carried_moments_keep_their_codes():
    model = moe_model()
    opt = build_optimizer(dict(model.named_parameters()), OptimizerConfig(dense_state_bits=8))
    train(model, opt, 2)
    codes_before = opt._packed["lm_head.weight"].exp_avg.codes
    assert opt.state["lm_head.weight"].exp_avg.dtype == torch.float32  # what growth sees

    op, args = get_operator("quantize_experts"), QuantizeExpertsArgs(r=4)
    g = torch.Generator().manual_seed(3)
    probe = (torch.randint(0, V, (2, 16), generator=g), torch.randint(0, V, (2, 16), generator=g))
    outcome = apply_growth(
        model, opt.state, [GrowthStep(op.name, args)], seed=0, stage_index=1, stage_name="nf4",
        planned=op.plan(model.config, args), probe=probe, invariance_cfg=InvarianceConfig(),
    )
    opt.rebind(dict(outcome.model.named_parameters()), outcome.optimizer_state)
    packed = opt._packed
    assert packed["lm_head.weight"].exp_avg.codes is codes_before, "a carried moment was requantized"
    assert not isinstance(packed["blocks.1.g.ffn.experts.w_gate_lora_A"].exp_avg, Moment8bit), "adapters keep 32-bit state"
    assert "blocks.1.g.ffn.experts.w_gate" not in packed
    train(outcome.model, opt, 1)
    assert opt.state_dict()["blocks.1.g.ffn.experts.w_up_lora_B"]["step"] == 1


def test_the_blockwise_update_matches_dequantize_step_requantize_within_fp32_rounding():
    """bitsandbytes' update (float multipliers) against the old three-pass one, from the same
    trained 8-bit state and gradients: parameters within fp32 rounding; the requantized moments
    land on the same codes except where a value sits on the rounding edge between two."""
    model = moe_model()
    opt = build_optimizer(dict(model.named_parameters()), OptimizerConfig(dense_state_bits=8))
    train(model, opt, 3)
    backward(model, torch.Generator().manual_seed(11))
    want = dequantize_step_requantize(opt, 1e-2)
    assert {"lm_head.weight", "blocks.1.g.ffn.experts.w_up"} <= set(want)
    opt.step(1e-2)
    for name, (ref_p, ref_s) in want.items():
        s = opt._packed[name]
        assert s.step == ref_s.step == 4
        assert roundings(opt.params[name], ref_p, 1e-2) <= 4, name  # measured: at most 1
        for got, ref in ((s.exp_avg, ref_s.exp_avg), (s.exp_avg_sq, ref_s.exp_avg_sq)):
            assert roundings(got.absmax_B, ref.absmax_B) <= 4, name
            moved = (got.codes.int() - ref.codes.int()).abs()
            assert moved.max() <= 1 and (moved > 0).float().mean() < 1e-3, name


def test_8bit_tensors_with_per_element_multipliers_and_steps_are_stepped_exactly():
    """A grown tensor (tensor lr_mult, per-element step counts) skips bitsandbytes' kernel, which
    takes one of each per tensor: its step is the old dequantize / step / requantize, bit for bit."""
    model = moe_model()
    opt = build_optimizer(dict(model.named_parameters()), OptimizerConfig(dense_state_bits=8))
    train(model, opt, 2)
    gen = torch.Generator().manual_seed(5)
    state = dict(opt.state)
    head = state["lm_head.weight"]
    state["lm_head.weight"] = replace(head, lr_mult=torch.rand(head.exp_avg.shape, generator=gen) + 0.5,
                                      step=torch.randint(0, 3, head.exp_avg.shape, generator=gen))
    opt.rebind(dict(model.named_parameters()), state)
    backward(model, gen)
    want = dequantize_step_requantize(opt, 1e-2)
    opt.step(1e-2)
    ref_p, ref_s = want["lm_head.weight"]
    s = opt._packed["lm_head.weight"]
    assert torch.equal(model.lm_head.weight, ref_p) and torch.equal(s.step, ref_s.step)
    assert torch.equal(s.exp_avg.codes, ref_s.exp_avg.codes) and torch.equal(s.exp_avg_sq.codes, ref_s.exp_avg_sq.codes)
    assert torch.equal(s.exp_avg.absmax_B, ref_s.exp_avg.absmax_B) and torch.equal(s.exp_avg_sq.absmax_B, ref_s.exp_avg_sq.absmax_B)


def test_the_8bit_clip_norm_takes_the_sum_squares_argument_the_trainer_passes():
    """growtrain/train.py calls clip_grad_norm(max_norm, sum_squares) on every step; the 8-bit
    optimizer took only max_norm (issue 12: a TypeError at step 1 of every 8-bit run)."""
    m8, m32 = moe_model(), moe_model()
    o8 = build_optimizer(dict(m8.named_parameters()), OptimizerConfig(dense_state_bits=8))
    o32 = build_optimizer(dict(m32.named_parameters()), OptimizerConfig())
    backward(m8, torch.Generator().manual_seed(2))
    backward(m32, torch.Generator().manual_seed(2))
    one_rank = lambda sq: sq  # noqa: E731 (Dist.sum_squares of a single process)
    norm8, norm32 = o8.clip_grad_norm(0.5, one_rank), o32.clip_grad_norm(0.5, one_rank)
    assert norm8 == norm32 > 0.5
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(m8.parameters(), m32.parameters()) if a.grad is not None)


EIGHT_BIT = ("--set", "optimizer.dense_state_bits=8")


@pytest.fixture(scope="module")
def reference_8bit_run(tmp_path_factory):
    """The micro recipe (dense, upcycle to MoE, deepen; 20 steps) trained uninterrupted with 8-bit
    dense state, through the CLI."""
    root = tmp_path_factory.mktemp("run8")
    recipe = root / "micro.yaml"
    recipe.write_text(yaml.safe_dump(MICRO, sort_keys=False))
    out = root / "run"
    done = run_cli("run", recipe, "--out", out, *EIGHT_BIT)
    assert done.returncode == 0, done.stderr[-3000:]
    return recipe, out


@pytest.mark.slow
def test_a_run_with_8bit_dense_state_trains_through_growth_with_8bit_moments(reference_8bit_run):
    recipe, out = reference_8bit_run
    rows = losses(out)
    assert [s for s, *_ in rows] == list(range(1, 21)) and all(math.isfinite(loss) for _, loss, _ in rows)
    saved = torch.load(out / "checkpoints/step-00000020/trainer.pt", weights_only=True)["optimizer"]
    eight = {n for n, e in saved.items() if "exp_avg_codes" in e}
    assert {"lm_head.weight", "blocks.0.g.ffn.experts.w_up"} <= eight, sorted(eight)
    assert not {n for n in eight if n.endswith(("embed.weight", "router.weight"))}


@pytest.mark.slow
def test_an_8bit_run_killed_in_the_moe_stage_resumes_to_the_same_losses_and_weights(reference_8bit_run, tmp_path):
    """Killed mid-step 14: resumed from the step-12 checkpoint (8-bit codes of the MoE stage),
    then through the deepen growth, to the uninterrupted run's losses and final weights bit for bit."""
    recipe, reference = reference_8bit_run
    out = tmp_path / "run"
    killed = run_cli("run", recipe, "--out", out, *EIGHT_BIT, env=cli_env(GROWTRAIN_FAULT="step_mid:14"))
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    resumed = run_cli("run", recipe, "--out", out, *EIGHT_BIT)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout and "step-00000012" in resumed.stdout
    assert_same_run(out, reference, 20)


def test_a_zero_moment_stays_zero_in_a_block_with_nonzero_ones():
    # bitsandbytes' blockwise quantization rounds an exact 0 next to nonzero values to a nonzero
    # code (~2e-5 of the absmax for exp_avg): an element growth adds fresh inside a copied tensor
    # would start with ghost moments, and its first step would be off by up to ~1x the LR.
    from growtrain.kernels.nf4_reference import bitsandbytes_functional
    from growtrain.optim.adamw8bit import BLOCKSIZE, dynamic_map

    bnbf = bitsandbytes_functional()
    x = torch.zeros(3, BLOCKSIZE)
    x[0, ::2] = torch.rand(BLOCKSIZE // 2, generator=torch.Generator().manual_seed(0)) * 1e-3
    x[1, 7] = 1e-6
    for signed in (True, False):
        back = Moment8bit.quantize(x, signed).dequantize()
        assert torch.equal(back[x == 0], torch.zeros(int((x == 0).sum()))), signed
        codes, qs = bnbf.quantize_blockwise(x.contiguous(), code=dynamic_map(signed, x.device), blocksize=BLOCKSIZE)
        plain = bnbf.dequantize_blockwise(codes, absmax=qs.absmax, code=dynamic_map(signed, x.device), blocksize=BLOCKSIZE)
        assert bool((plain[0][x[0] == 0] != 0).any()), "bitsandbytes keeps zeros now: the masking is no longer needed"
        assert torch.equal(back[x != 0], plain[x != 0]), "nonzero moments quantize as bitsandbytes does"


def test_a_moved_entry_keeps_its_codes_and_a_bare_float32_copy_is_requantized():
    """An entry that growth moves to another rank (ZeRO-1 owners change, a gather and re-shard)
    arrives as new float32 tensors: with its codes and absmax sent along (packed_fields, with_packed)
    it keeps them; without, it is requantized, which is not the identity (a block whose largest
    moment is negative comes back with a smaller absmax)."""
    from growtrain.optim.adamw8bit import packed_fields, with_packed

    model = moe_model()
    opt = build_optimizer(dict(model.named_parameters()), OptimizerConfig(dense_state_bits=8))
    train(model, opt, 2)
    name = "lm_head.weight"
    before = opt._packed[name].exp_avg
    view = opt.state[name]
    wire = {k: v.clone() for k, v in packed_fields(view).items()}
    moved = with_packed(replace(view, exp_avg=view.exp_avg.clone(), exp_avg_sq=view.exp_avg_sq.clone()), wire)
    bare = replace(view, exp_avg=view.exp_avg.clone(), exp_avg_sq=view.exp_avg_sq.clone())
    for entry, kept in ((moved, True), (bare, False)):
        opt.rebind(dict(model.named_parameters()), {**dict(opt.state), name: entry})
        after = opt._packed[name].exp_avg
        assert torch.equal(after.dequantize(), before.dequantize()) is kept
        assert torch.equal(after.absmax_B, before.absmax_B) is kept
        opt._packed[name] = replace(opt._packed[name], exp_avg=before)


def test_a_view_handed_out_before_a_step_is_requantized_from_what_it_holds():
    model = moe_model()
    opt = build_optimizer(dict(model.named_parameters()), OptimizerConfig(dense_state_bits=8))
    train(model, opt, 1)
    stale = dict(opt.state)  # float32 views of step 1
    train(model, opt, 1, seed=4)  # the codes change in place
    opt.rebind(dict(model.named_parameters()), stale)
    for n, s in stale.items():
        if isinstance(opt._packed[n].exp_avg, Moment8bit):
            assert torch.equal(opt._packed[n].exp_avg.dequantize(), Moment8bit.quantize(s.exp_avg, True).dequantize()), n


def test_expert_tensors_get_8bit_state_only_where_each_expert_fills_whole_blocks():
    """Blocks that never straddle two experts: an expert-parallel rank's slice of the experts then
    holds exactly the codes and absmax one process holds for them; checkpoints keep an expert
    tensor's absmax as [experts, blocks each], cut along the experts with the codes."""
    from growtrain.model.expert_shards import slice_state

    for hidden, eight in ((64, True), (68, False)):  # 32 x 64 = 8 blocks per expert; 32 x 68 = 8.5
        moe = MoEConfig(num_experts=4, top_k=2, expert_hidden=hidden, router_init_std=0.5)
        torch.manual_seed(0)
        model = GrowLM(ModelConfig(vocab_size=V, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64, moe=moe, moe_layers=(1,)))
        opt = build_optimizer(dict(model.named_parameters()), OptimizerConfig(dense_state_bits=8))
        train(model, opt, 1)
        entry = opt.state_dict()["blocks.1.g.ffn.experts.w_up"]
        assert ("exp_avg_codes" in entry) is eight
    assert entry["exp_avg"].dtype == torch.float32  # the 68-wide experts: 32-bit moments
    moe = MoEConfig(num_experts=4, top_k=2, expert_hidden=64, router_init_std=0.5)
    torch.manual_seed(0)
    model = GrowLM(ModelConfig(vocab_size=V, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64, moe=moe, moe_layers=(1,)))
    opt = build_optimizer(dict(model.named_parameters()), OptimizerConfig(dense_state_bits=8))
    train(model, opt, 1)
    whole = opt.state_dict()
    name = "blocks.1.g.ffn.experts.w_up"
    assert whole[name]["exp_avg_absmax"].shape == (4, 8)
    half = slice_state(whole, 1, 2)[name]  # rank 1 of 2: experts 2 and 3
    codes = Moment8bit(half["exp_avg_codes"], half["exp_avg_absmax"].reshape(-1), True).dequantize()
    assert torch.equal(codes, opt.state[name].exp_avg[2:])
    flat = dict(whole)
    flat[name] = dict(whole[name], exp_avg_absmax=whole[name]["exp_avg_absmax"].reshape(-1)[:5])
    with pytest.raises(ValueError, match="absmax values for"):
        build_optimizer(dict(model.named_parameters()), OptimizerConfig(dense_state_bits=8)).load_state_dict(flat)
