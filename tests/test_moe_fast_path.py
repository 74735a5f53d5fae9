"""The MoE layer's CPU fast path (issue 16): the grouped SwiGLU references run as one autograd
Function over all experts (kernels/reference.py) instead of autograd through a per-expert loop.
The old loops stay as `*_loop` functions; every test here compares the new path against them.

Exactness: bitwise. The Function applies the same ops to the same operands in the same order as
autograd through the loop (mm's backward rules, silu_backward, the order in which the input
gradient's terms are summed, autocast's per-use casts), so no tolerance is needed anywhere,
including under bf16 autocast; `torch.equal` is the check (it treats -0.0 and 0.0 as equal: the
loop's gradients of a stacked weight are sums with zeros, which turn a -0.0 into 0.0).

Legend: N sorted rows, D d_model, E experts, F expert hidden width, r LoRA rank, T tokens.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from growtrain.kernels import nf4_reference
from growtrain.kernels.nf4_reference import (
    LoRAStack,
    NF4LoRAExperts,
    grouped_swiglu_nf4_lora_reference,
    grouped_swiglu_nf4_lora_reference_loop,
)
from growtrain.kernels.reference import (
    grouped_swiglu_lora_reference,
    grouped_swiglu_lora_reference_loop,
    grouped_swiglu_reference,
    grouped_swiglu_reference_loop,
)
from growtrain.kernels.weights import LoRA, NF4Weight
from growtrain.model import expert_backends
from growtrain.model.config import ExpertLoRAConfig, ModelConfig, MoEConfig
from growtrain.model.moe import MoE
from growtrain.model.nf4 import quantize_stack

# Rows per expert; D and F are odd where the case allows it.
CASES = {
    "odd sizes and an empty expert": ([3, 0, 7, 1, 2], 13, 9),
    "all rows on one expert": ([0, 0, 11, 0], 8, 12),
    "one row": ([0, 1, 0], 6, 5),
    "no rows": ([0, 0, 0], 6, 5),
    "many small experts": ([2, 1, 0, 3, 1, 1, 0, 2, 4, 1, 1, 2], 16, 8),
}


def offsets_of(counts: list[int]) -> torch.Tensor:
    off = torch.zeros(len(counts) + 1, dtype=torch.long)
    off[1:] = torch.cumsum(torch.tensor(counts), 0)
    return off


def leaf(*shape, gen, dtype, scale=0.5):
    return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).to(dtype).requires_grad_(True)


def dense_weights(E, D, F, gen, dtype):
    return [leaf(E, F, D, gen=gen, dtype=dtype), leaf(E, F, D, gen=gen, dtype=dtype), leaf(E, D, F, gen=gen, dtype=dtype)]


def lora_pairs(E, D, F, r, gen, dtype, cls=LoRA, scale=0.75):
    return [cls(leaf(E, r, i, gen=gen, dtype=dtype), leaf(E, o, r, gen=gen, dtype=dtype), scale) for i, o in ((D, F), (D, F), (F, D))]


def outputs_and_grads(fn, leaves, dy):
    y = fn()
    if y.requires_grad:
        grads = torch.autograd.grad(y, leaves, dy.to(y.dtype), allow_unused=True)
    else:
        grads = [None] * len(leaves)
    return [y, *grads]


def assert_bitwise(names, got, want):
    for name, g, w in zip(names, got, want):
        if g is None or w is None:
            assert g is None and w is None, f"{name}: one side has no gradient ({g is None}, {w is None})"
            continue
        assert g.dtype == w.dtype and g.shape == w.shape, f"{name}: {g.dtype} {list(g.shape)} vs {w.dtype} {list(w.shape)}"
        if not torch.equal(g, w):
            diff = (g.double() - w.double()).abs()
            raise AssertionError(f"{name}: not bitwise equal, max |diff| {diff.max().item():.3e} at {divmod(diff.argmax().item(), g.shape[-1])}")


def autocast_or_not(bf16: bool):
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("case", list(CASES))
def test_dense_fast_path_gives_the_loops_output_and_gradients_bit_for_bit(case, dtype):
    counts, D, F = CASES[case]
    gen = torch.Generator().manual_seed(len(counts) * 7 + D)
    x = leaf(sum(counts), D, gen=gen, dtype=dtype)
    w = dense_weights(len(counts), D, F, gen, dtype)
    dy = torch.randn(sum(counts), D, generator=gen, dtype=torch.float64).to(dtype)
    off = offsets_of(counts)
    got = outputs_and_grads(lambda: grouped_swiglu_reference(x, off, *w), [x, *w], dy)
    want = outputs_and_grads(lambda: grouped_swiglu_reference_loop(x, off, *w), [x, *w], dy)
    assert_bitwise(["y", "dx", "dw_gate", "dw_up", "dw_down"], got, want)


@pytest.mark.parametrize("bf16_autocast", [False, True])
@pytest.mark.parametrize("case", ["odd sizes and an empty expert", "all rows on one expert", "many small experts"])
def test_lora_fast_path_with_trainable_bases_gives_the_loops_results_bit_for_bit(case, bf16_autocast):
    counts, D, F = CASES[case]
    E = len(counts)
    gen = torch.Generator().manual_seed(E + 100 * bf16_autocast)
    x = leaf(sum(counts), D, gen=gen, dtype=torch.float32)
    w = dense_weights(E, D, F, gen, torch.float32)
    lora = lora_pairs(E, D, F, 3, gen, torch.float32)
    leaves = [x, *w, *(t for lo in lora for t in (lo.A_ERI, lo.B_EOR))]
    dy = torch.randn(sum(counts), D, generator=gen)
    off = offsets_of(counts)
    with autocast_or_not(bf16_autocast):
        got = outputs_and_grads(lambda: grouped_swiglu_lora_reference(x, off, w, lora), leaves, dy)
        want = outputs_and_grads(lambda: grouped_swiglu_lora_reference_loop(x, off, w, lora), leaves, dy)
    assert got[0].dtype == (torch.bfloat16 if bf16_autocast else torch.float32)
    names = ["y", "dx", "dw_gate", "dw_up", "dw_down"] + [f"d{m}_{ab}" for m in ("gate", "up", "down") for ab in "AB"]
    assert_bitwise(names, got, want)


def test_lora_fast_path_with_nf4_bases_and_only_some_adapters_gives_the_loops_results_bit_for_bit():
    counts, D, F = [4, 0, 9, 2], 64, 32
    E = len(counts)
    gen = torch.Generator().manual_seed(3)
    x = leaf(sum(counts), D, gen=gen, dtype=torch.float32)
    weights = (
        NF4Weight.quantize(torch.randn(E, F, D, generator=gen)),
        NF4Weight.quantize(torch.randn(E, F, D, generator=gen), compress_statistics=True),
        NF4Weight.quantize(torch.randn(E, F, D, generator=gen), transposed=True),  # down stored [F, D]
    )
    gate, _, down = lora_pairs(E, D, F, 2, gen, torch.float32)
    lora = (gate, None, down)
    leaves = [x, gate.A_ERI, gate.B_EOR, down.A_ERI, down.B_EOR]
    dy = torch.randn(sum(counts), D, generator=gen)
    off = offsets_of(counts)
    got = outputs_and_grads(lambda: grouped_swiglu_lora_reference(x, off, weights, lora), leaves, dy)
    want = outputs_and_grads(lambda: grouped_swiglu_lora_reference_loop(x, off, weights, lora), leaves, dy)
    assert_bitwise(["y", "dx", "dgate_A", "dgate_B", "ddown_A", "ddown_B"], got, want)


def nf4_experts(E, D, F, r, gen, double_quant, dtype=torch.float32):
    stacks = [quantize_stack(torch.randn(E, F, D, generator=gen) * 0.3, double_quant) for _ in range(3)]
    return NF4LoRAExperts(*stacks, *lora_pairs(E, D, F, r, gen, dtype, cls=LoRAStack, scale=2.0))


@pytest.mark.parametrize("bf16_autocast", [False, True])
@pytest.mark.parametrize("double_quant", [True, False])
@pytest.mark.parametrize("case", ["odd sizes and an empty expert", "all rows on one expert", "one row", "no rows", "many small experts"])
def test_nf4_fast_path_gives_the_loops_output_and_adapter_gradients_bit_for_bit(case, double_quant, bf16_autocast):
    counts, _, _ = CASES[case]
    D, F = 32, 16  # NF4 needs an even number of weights per matrix
    gen = torch.Generator().manual_seed(len(counts) + double_quant)
    experts = nf4_experts(len(counts), D, F, 3, gen, double_quant)
    x = leaf(sum(counts), D, gen=gen, dtype=torch.float32)
    leaves = [x] + [t for lo in (experts.gate_lora, experts.up_lora, experts.down_lora) for t in (lo.A_ERI, lo.B_EOR)]
    dy = torch.randn(sum(counts), D, generator=gen)
    off = offsets_of(counts)
    with autocast_or_not(bf16_autocast):
        got = outputs_and_grads(lambda: grouped_swiglu_nf4_lora_reference(x, off, experts), leaves, dy)
        want = outputs_and_grads(lambda: grouped_swiglu_nf4_lora_reference_loop(x, off, experts), leaves, dy)
    assert_bitwise(["y", "dx"] + [f"d{m}_{ab}" for m in ("gate", "up", "down") for ab in "AB"], got, want)


def test_nf4_fast_path_dequantizing_in_several_groups_gives_the_loops_results_bit_for_bit(monkeypatch):
    counts, D, F = [3, 0, 5, 2, 1, 4, 0, 2], 32, 16
    monkeypatch.setattr(nf4_reference, "DEQUANT_GROUP_NUMEL", 3 * D * F)  # groups of 3 experts
    gen = torch.Generator().manual_seed(11)
    experts = nf4_experts(len(counts), D, F, 2, gen, True)
    x = leaf(sum(counts), D, gen=gen, dtype=torch.float32)
    leaves = [x] + [t for lo in (experts.gate_lora, experts.up_lora, experts.down_lora) for t in (lo.A_ERI, lo.B_EOR)]
    dy = torch.randn(sum(counts), D, generator=gen)
    off = offsets_of(counts)
    got = outputs_and_grads(lambda: grouped_swiglu_nf4_lora_reference(x, off, experts), leaves, dy)
    want = outputs_and_grads(lambda: grouped_swiglu_nf4_lora_reference_loop(x, off, experts), leaves, dy)
    assert_bitwise(["y", "dx"] + [f"d{m}_{ab}" for m in ("gate", "up", "down") for ab in "AB"], got, want)


def test_nf4_fast_path_without_grad_computes_the_same_output():
    counts, D, F = [3, 0, 5, 2], 32, 16
    gen = torch.Generator().manual_seed(5)
    experts = nf4_experts(len(counts), D, F, 2, gen, True)
    x = torch.randn(sum(counts), D, generator=gen)
    off = offsets_of(counts)
    with torch.no_grad():
        y = grouped_swiglu_nf4_lora_reference(x, off, experts)
    assert not y.requires_grad
    assert torch.equal(y, grouped_swiglu_nf4_lora_reference_loop(x, off, experts).detach())


# ---------------------------------------------------------------- the whole layer


def moe_layer(expert_format: str, E=6, K=2, F=16, D=32, seed=0):
    moe = MoEConfig(num_experts=E, top_k=K, expert_hidden=F, router_init_std=0.5, expert_format=expert_format, lora=ExpertLoRAConfig(r=4, lora_alpha=8.0))
    torch.manual_seed(seed)
    layer = MoE(ModelConfig(d_model=D, n_heads=4, ffn_hidden=F, moe=moe, moe_layers=(0,)))
    if expert_format == "nf4":
        with torch.no_grad():  # non-zero B, so the adapters' gradients are not trivially related
            for name, p in layer.experts.named_parameters():
                if name.endswith("lora_B"):
                    p.normal_(0.0, 0.1)
    return layer


def layer_loss_and_grads(layer: MoE, x_BTD: torch.Tensor, dy_BTD: torch.Tensor, bf16: bool = False):
    x = x_BTD.clone().requires_grad_(True)
    params = [p for p in layer.parameters() if p.requires_grad]
    with autocast_or_not(bf16):
        y, stats = layer(x)
        loss = (y.float() * dy_BTD).sum() + stats.aux_loss
    grads = torch.autograd.grad(loss, [x, *params])
    return [loss.detach(), y.detach(), *grads], ["loss", "y", "dx"] + [n for n, p in layer.named_parameters() if p.requires_grad]


def with_loop_backends(monkeypatch):
    monkeypatch.setitem(expert_backends.EXPERT_BACKENDS, "reference", grouped_swiglu_reference_loop)
    monkeypatch.setitem(expert_backends.NF4_EXPERT_BACKENDS, "reference", grouped_swiglu_nf4_lora_reference_loop)


@pytest.mark.parametrize("bf16_autocast", [False, True])
@pytest.mark.parametrize("expert_format", ["full", "nf4"])
def test_moe_layer_on_the_fast_path_trains_exactly_as_on_the_old_loop(monkeypatch, expert_format, bf16_autocast):
    layer = moe_layer(expert_format)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 9, 32, generator=gen)
    dy = torch.randn(2, 9, 32, generator=gen)
    got, names = layer_loss_and_grads(layer, x, dy, bf16_autocast)
    with monkeypatch.context() as m:
        with_loop_backends(m)
        want, _ = layer_loss_and_grads(layer, x, dy, bf16_autocast)
    assert_bitwise(names, got, want)


def test_moe_layer_fast_path_is_bitwise_reproducible_run_to_run():
    layer = moe_layer("full", E=16, K=4)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(3, 17, 32, generator=gen)
    dy = torch.randn(3, 17, 32, generator=gen)
    first, names = layer_loss_and_grads(layer, x, dy)
    second, _ = layer_loss_and_grads(layer, x, dy)
    assert_bitwise(names, first, second)


# ---------------------------------------------------------------- what the fast path avoids


class _RecordOutputs(TorchDispatchMode):
    """numel of every tensor any aten op returns."""

    def __init__(self):
        super().__init__()
        self.numels: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.numels.append(t.numel())
        return out


@pytest.mark.parametrize("fn, most", [(grouped_swiglu_reference, 3), (grouped_swiglu_reference_loop, None)])
def test_backward_makes_one_weight_sized_buffer_per_matrix_instead_of_one_per_expert(fn, most):
    """The loop's backward materialises a zero tensor of the whole stacked weight for every w[e]
    (select's backward); the fast path writes each weight gradient into one buffer. The loop case
    shows this test would catch the old behaviour."""
    E, D, F = 12, 10, 6  # E*F*D is no other tensor's size here
    counts = [3, 1, 2, 0, 4, 1, 2, 1, 3, 2, 1, 2]
    gen = torch.Generator().manual_seed(4)
    x = leaf(sum(counts), D, gen=gen, dtype=torch.float32)
    w = dense_weights(E, D, F, gen, torch.float32)
    y = fn(x, offsets_of(counts), *w)
    rec = _RecordOutputs()
    with rec:
        torch.autograd.grad(y, [x, *w], torch.ones_like(y))
    weight_sized = sum(n == E * F * D for n in rec.numels)
    if most is None:
        assert weight_sized >= 3 * (E - 1), weight_sized  # the loop: one per active expert and matrix
    else:
        assert weight_sized <= most, weight_sized


@pytest.mark.parametrize("fn", [grouped_swiglu_reference, grouped_swiglu_nf4_lora_reference])
def test_a_grouped_call_reads_the_offsets_on_the_host_once_for_forward_and_backward(monkeypatch, fn):
    counts, D, F = [3, 0, 5, 2, 1], 32, 16
    gen = torch.Generator().manual_seed(6)
    x = leaf(sum(counts), D, gen=gen, dtype=torch.float32)
    if fn is grouped_swiglu_reference:
        params = dense_weights(len(counts), D, F, gen, torch.float32)
        call = lambda: fn(x, offsets_of(counts), *params)
    else:
        experts = nf4_experts(len(counts), D, F, 2, gen, False)
        params = [t for lo in (experts.gate_lora, experts.up_lora, experts.down_lora) for t in (lo.A_ERI, lo.B_EOR)]
        call = lambda: fn(x, offsets_of(counts), experts)
    calls = {"tolist": 0, "item": 0}
    real_tolist, real_item = torch.Tensor.tolist, torch.Tensor.item

    def tolist(t):
        calls["tolist"] += 1
        return real_tolist(t)

    def item(t):
        calls["item"] += 1
        return real_item(t)

    monkeypatch.setattr(torch.Tensor, "tolist", tolist)
    monkeypatch.setattr(torch.Tensor, "item", item)
    y = call()
    torch.autograd.grad(y, [x, *params], torch.ones_like(y))
    assert calls == {"tolist": 1, "item": 0}


def test_permuting_rows_gives_indexing_results_and_gradients_bit_for_bit():
    from growtrain.model.moe import permute_rows

    gen = torch.Generator().manual_seed(8)
    x = torch.randn(23, 7, generator=gen).requires_grad_(True)
    perm = torch.randperm(23, generator=gen)
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(23)
    dy = torch.randn(23, 7, generator=gen)
    got = outputs_and_grads(lambda: permute_rows(x, perm, inverse), [x], dy)
    want = outputs_and_grads(lambda: x[perm], [x], dy)
    assert_bitwise(["y", "dx"], got, want)
