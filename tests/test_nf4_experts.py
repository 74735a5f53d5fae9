"""NF4 experts + per-expert LoRA (DESIGN.md §6): the format against bitsandbytes, the expert
backend against autograd through the dequantized weights, forward and backward, and the frozen
base (no gradient, no optimizer state, lossless checkpoints). CPU, tiny and odd sizes.

Tolerances: in fp64 (inputs and adapters fp64, the dequantized bases exact in fp64) the NF4
backend and the dense reference on merged weights W + s·B@A differ only by reassociation:
1e-10 relative. In fp32: 1e-5 relative.

Legend: N sorted rows, D d_model, E experts, F expert hidden width, R LoRA rank.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from growtrain.kernels.nf4_reference import (
    LoRAStack,
    NF4LoRAExperts,
    dequantize_experts_bitsandbytes,
    dequantize_experts_torch,
    dequantize_nf4_bitsandbytes,
    dequantize_nf4_torch,
    grouped_swiglu_nf4_lora_reference,
    nf4_buffer_shapes,
    quant_state,
)
from growtrain.kernels.reference import grouped_swiglu_reference
from growtrain.model import GrowLM, ModelConfig, MoEConfig
from growtrain.model.config import ExpertLoRAConfig
from growtrain.model.nf4 import MATRICES, NF4Experts, dequantize_stack, quantize_stack
from growtrain.optim.registry import build_optimizer
from growtrain.recipe import OptimizerConfig


bnbf = pytest.importorskip("bitsandbytes.functional")


def report(name: str, got: torch.Tensor, want: torch.Tensor) -> str:
    diff = (got.double() - want.double()).abs()
    where = tuple(int(i) for i in torch.nonzero(diff == diff.max())[0]) if diff.numel() else ()
    return f"{name}: max |diff| {diff.max().item() if diff.numel() else 0:.3g} at {where}, max |want| {want.abs().max().item() if want.numel() else 0:.3g}"


def assert_close(name, got, want, rtol):
    scale = max(want.abs().max().item(), 1e-30) if want.numel() else 1.0
    assert (got.double() - want.double()).abs().max().item() <= rtol * scale if got.numel() else got.shape == want.shape, report(name, got, want)


# ---------------------------------------------------------------- the format


@pytest.mark.parametrize("double_quant", [True, False], ids=["double_quant", "plain"])
@pytest.mark.parametrize("shape", [(3, 64, 32), (2, 7, 96), (2, 5, 100), (1, 300, 64)], ids=str)
def test_pure_pytorch_dequantization_is_bit_identical_to_bitsandbytes(shape, double_quant):
    w = torch.randn(shape) * 0.05
    stack = quantize_stack(w, double_quant)
    for e in range(shape[0]):
        got, want = dequantize_nf4_torch(stack, e), dequantize_nf4_bitsandbytes(stack, e)
        assert torch.equal(got, want), report(f"expert {e}", got, want)
        # ... and both are bitsandbytes' own dequantization of its own quantization of that matrix
        packed, qs = bnbf.quantize_4bit(w[e].reshape(-1).contiguous(), blocksize=64, quant_type="nf4", compress_statistics=double_quant)
        assert torch.equal(want.reshape(-1), bnbf.dequantize_4bit(packed, qs).reshape(-1))


@pytest.mark.parametrize("double_quant", [True, False], ids=["double_quant", "plain"])
@pytest.mark.parametrize("shape", [(5, 64, 32), (4, 7, 96), (3, 5, 100)], ids=str)
def test_dequantizing_a_group_of_experts_in_one_call_is_bit_identical_to_one_call_each(shape, double_quant):
    stack = quantize_stack(torch.randn(shape) * 0.05, double_quant)
    group = [3, 0, 1] if shape[0] > 3 else [2, 0]
    want = torch.stack([dequantize_nf4_bitsandbytes(stack, e) for e in group])
    assert torch.equal(dequantize_experts_bitsandbytes(stack, group), want)
    assert torch.equal(dequantize_experts_torch(stack, group), want)


def test_quant_state_is_rebuilt_losslessly_from_the_stored_tensors():
    w = torch.randn(2, 48, 64)
    stack = quantize_stack(w, True)
    packed, qs = bnbf.quantize_4bit(w[1].reshape(-1).contiguous(), blocksize=64, quant_type="nf4", compress_statistics=True)
    rebuilt = quant_state(stack, 1)
    assert torch.equal(stack.codes_EP[1], packed.reshape(-1))
    assert torch.equal(rebuilt.absmax, qs.absmax) and torch.equal(rebuilt.state2.absmax, qs.state2.absmax)
    assert torch.equal(rebuilt.offset, qs.offset) and torch.equal(rebuilt.code, qs.code) and torch.equal(rebuilt.state2.code, qs.state2.code)
    assert (rebuilt.blocksize, rebuilt.state2.blocksize, rebuilt.quant_type) == (qs.blocksize, qs.state2.blocksize, "nf4")


def test_buffer_shapes_and_bytes_per_weight_match_the_format():
    shapes = nf4_buffer_shapes(1024, 4096, True)
    assert shapes == {"codes": (2097152,), "absmax": (65536,), "nested_absmax": (256,), "offset": ()}
    assert nf4_buffer_shapes(3, 32, False) == {"codes": (48,), "absmax": (2,)}


# ---------------------------------------------------------------- the backend


def random_experts(E, D, F, R, dtype=torch.float64, double_quant=True, scale=0.7, seed=0):
    """NF4 bases, and LoRA pairs with nonzero B so every term is exercised."""
    g = torch.Generator().manual_seed(seed)
    stacks = [quantize_stack(torch.randn(E, F, D, generator=g) * 0.3, double_quant) for _ in MATRICES]
    dims = {"w_gate": (D, F), "w_up": (D, F), "w_down": (F, D)}
    loras = []
    for m in MATRICES:
        d_in, d_out = dims[m]
        A = (torch.randn(E, R, d_in, generator=g) * 0.3).to(dtype).requires_grad_(True)
        B = (torch.randn(E, d_out, R, generator=g) * 0.3).to(dtype).requires_grad_(True)
        loras.append(LoRAStack(A, B, scale))
    return NF4LoRAExperts(*stacks, *loras)


def dense_reference(x, offsets, experts: NF4LoRAExperts):
    """grouped_swiglu_reference on W + s·B@A, W the dequantized bases (constants): autograd through
    the merged weights reaches x and the LoRA pairs."""
    dt = x.dtype
    w = {}
    for m, stack, lora in zip(MATRICES, (experts.gate, experts.up, experts.down), (experts.gate_lora, experts.up_lora, experts.down_lora)):
        base = dequantize_stack(stack).to(dt)
        if m == "w_down":
            base = base.transpose(1, 2)
        w[m] = base + lora.scale * (lora.B_EOR @ lora.A_ERI)
    return grouped_swiglu_reference(x, offsets, w["w_gate"], w["w_up"], w["w_down"])


def offsets_of(counts):
    return torch.tensor([0] + list(torch.tensor(counts).cumsum(0)), dtype=torch.long)


CASES = {
    "odd sizes, an empty expert": (5, 24, 40, 3, [3, 0, 7, 1, 2]),
    "all rows on one expert": (4, 32, 64, 4, [0, 0, 11, 0]),
    "one row": (3, 16, 20, 2, [0, 1, 0]),
    "no rows": (3, 16, 20, 2, [0, 0, 0]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_nf4_backend_forward_and_gradients_equal_autograd_through_the_dequantized_weights_in_fp64(case):
    E, D, F, R, counts = CASES[case]
    experts = random_experts(E, D, F, R)
    offsets = offsets_of(counts)
    x = torch.randn(sum(counts), D, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(sum(counts), D, dtype=torch.float64)
    leaves = [x] + [t for l in (experts.gate_lora, experts.up_lora, experts.down_lora) for t in (l.A_ERI, l.B_EOR)]

    y = grouped_swiglu_nf4_lora_reference(x, offsets, experts)
    got = torch.autograd.grad(y, leaves, dy, allow_unused=True)
    y_ref = dense_reference(x, offsets, experts)
    want = torch.autograd.grad(y_ref, leaves, dy, allow_unused=True)

    assert_close("y", y, y_ref, 1e-10)
    names = ["x"] + [f"{m}_lora_{ab}" for m in MATRICES for ab in "AB"]
    for name, g, w in zip(names, got, want):
        g = torch.zeros_like(leaves[names.index(name)]) if g is None else g
        w = torch.zeros_like(g) if w is None else w
        assert_close(f"d{name}", g, w, 1e-10)


def test_nf4_backend_in_fp32_matches_the_fp64_reference_within_1e_5():
    E, D, F, R, counts = CASES["odd sizes, an empty expert"]
    experts64 = random_experts(E, D, F, R)
    f32 = lambda l: LoRAStack(l.A_ERI.detach().float(), l.B_EOR.detach().float(), l.scale)
    experts32 = NF4LoRAExperts(experts64.gate, experts64.up, experts64.down, *(f32(l) for l in (experts64.gate_lora, experts64.up_lora, experts64.down_lora)))
    x = torch.randn(sum(counts), D, dtype=torch.float64)
    y32 = grouped_swiglu_nf4_lora_reference(x.float(), offsets_of(counts), experts32)
    y64 = dense_reference(x, offsets_of(counts), experts64)
    assert y32.dtype == torch.float32
    assert_close("y fp32", y32, y64, 1e-5)


def test_the_pure_pytorch_dequantizer_can_stand_in_for_bitsandbytes_in_the_backend():
    E, D, F, R, counts = CASES["odd sizes, an empty expert"]
    experts = random_experts(E, D, F, R, dtype=torch.float32)
    x = torch.randn(sum(counts), D)
    a = grouped_swiglu_nf4_lora_reference(x, offsets_of(counts), experts)
    b = grouped_swiglu_nf4_lora_reference(x, offsets_of(counts), experts, dequantize=dequantize_experts_torch)
    assert torch.equal(a, b)


def test_nf4_forward_is_close_to_the_full_precision_experts_it_was_quantized_from():
    """NF4's error on Gaussian weights: a few percent per matrix, stated here so regressions show."""
    g = torch.Generator().manual_seed(1)
    E, D, F = 4, 64, 128
    w = {m: torch.randn(E, F, D, generator=g) * 0.05 for m in MATRICES}
    stacks = [quantize_stack(w[m], True) for m in MATRICES]
    zeros = [LoRAStack(torch.zeros(E, 2, D if m != "w_down" else F), torch.zeros(E, F if m != "w_down" else D, 2), 1.0) for m in MATRICES]
    x = torch.randn(40, D)
    offsets = offsets_of([10, 10, 10, 10])
    y = grouped_swiglu_nf4_lora_reference(x, offsets, NF4LoRAExperts(*stacks, *zeros))
    y_full = grouped_swiglu_reference(x, offsets, w["w_gate"], w["w_up"], w["w_down"].transpose(1, 2))
    rel = ((y - y_full).norm() / y_full.norm()).item()
    assert 0 < rel < 0.2, rel


# ---------------------------------------------------------------- in the model


def nf4_model(seed=0, double_quant=True, dtype=torch.float32, reversible=True):
    moe = MoEConfig(num_experts=4, top_k=2, expert_hidden=48, router_init_std=0.5, expert_format="nf4", double_quant=double_quant, lora=ExpertLoRAConfig(r=4, lora_alpha=8.0))
    cfg = ModelConfig(vocab_size=41, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=48, moe=moe, moe_layers=(0, 1), reversible=reversible)
    torch.manual_seed(seed)
    model = GrowLM(cfg).to(dtype)
    with torch.no_grad():  # nonzero B, so the adapters change the function and get every gradient
        for n, p in model.named_parameters():
            if "_lora_B" in n:
                p.normal_(0.0, 0.05)
    return model


def test_the_frozen_base_is_buffers_gets_no_gradient_and_holds_no_optimizer_state():
    model = nf4_model()
    experts = model.blocks[0].g.ffn.experts
    assert isinstance(experts, NF4Experts)
    params = dict(model.named_parameters())
    expert_params = sorted(n.split("experts.")[1] for n in params if n.startswith("blocks.0.g.ffn.experts."))
    assert expert_params == sorted(f"{m}_lora_{ab}" for m in MATRICES for ab in "AB")
    before = {n: b.clone() for n, b in model.named_buffers()}
    tokens = torch.randint(0, 41, (2, 12))
    out = model(tokens)
    (out.logits.square().mean() + out.aux_loss).backward()
    opt = build_optimizer(params, OptimizerConfig())
    opt.step(1e-2)
    for n, b in model.named_buffers():
        assert b.grad is None and not b.requires_grad, n
        assert torch.equal(b, before[n]), f"the frozen base {n} changed"
    for n, p in params.items():
        if "_lora_" in n:
            assert p.grad is not None and p.grad.abs().sum() > 0, f"{n} got no gradient"
    assert not any("_codes" in n or "absmax" in n or "offset" in n or "quant_map" in n for n in opt.state_dict())
    assert set(opt.state_dict()) == set(params)


def test_reversible_backward_gives_the_gradients_of_plain_autograd_with_nf4_experts():
    tokens = torch.randint(0, 41, (2, 10))
    grads = []
    for reversible in (True, False):
        model = nf4_model(seed=3, dtype=torch.float64, reversible=reversible)
        out = model(tokens)
        (out.logits.square().mean() + out.aux_loss).backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for n in grads[0]:
        assert_close(n, grads[0][n], grads[1][n], 1e-10)


def test_bf16_autocast_runs_forward_and_backward():
    model = nf4_model()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(torch.randint(0, 41, (2, 8)))
    out.logits.float().mean().backward()
    assert torch.isfinite(model.blocks[1].g.ffn.experts.w_up_lora_A.grad).all()


@pytest.mark.parametrize("double_quant", [True, False], ids=["double_quant", "plain"])
def test_state_dict_round_trips_through_safetensors_bit_for_bit_and_loads_strictly(tmp_path, double_quant):
    model = nf4_model(double_quant=double_quant)
    path = tmp_path / "model.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    loaded = load_file(str(path))
    fresh = nf4_model(seed=99, double_quant=double_quant)
    fresh.load_state_dict(loaded, strict=True)
    for k, v in model.state_dict().items():
        assert v.dtype == fresh.state_dict()[k].dtype and torch.equal(v, fresh.state_dict()[k]), k
    tokens = torch.randint(0, 41, (2, 9))
    model.eval(), fresh.eval()
    assert torch.equal(model(tokens).logits, fresh(tokens).logits)


def test_an_nf4_model_built_on_the_meta_device_has_the_planned_buffers_and_parameters():
    with torch.device("meta"):
        model = nf4_model()
    real = nf4_model()
    assert {n: (b.shape, b.dtype) for n, b in model.named_buffers()} == {n: (b.shape, b.dtype) for n, b in real.named_buffers()}
    assert model.num_parameters() == real.num_parameters()
