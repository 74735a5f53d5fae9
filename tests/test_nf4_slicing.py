"""The NF4 helpers split and clone use (growtrain/model/nf4.py): selecting experts, cutting rows,
and scaling by powers of two work on the codes and quantization state alone, and dequantize to
bit-identical values, where the format allows; where it does not, they refuse and say why."""

from __future__ import annotations

import pytest
import torch

from growtrain.model.nf4 import (
    NF4SliceError,
    dequantize_stack,
    nf4_cat_experts,
    nf4_renest_rows,
    nf4_row_slice_problem,
    nf4_scale,
    nf4_slice_rows,
    nf4_take_experts,
    nf4_zeros_like,
    quantize_stack,
    row_slice_problem,
)

pytest.importorskip("bitsandbytes")


def stack_of(E, rows, cols, double_quant, seed=0):
    g = torch.Generator().manual_seed(seed)
    return quantize_stack(torch.randn(E, rows, cols, generator=g) * 0.1, double_quant)


@pytest.mark.parametrize("double_quant", [True, False], ids=["double_quant", "plain"])
def test_taking_and_repeating_experts_is_bit_exact(double_quant):
    stack = stack_of(4, 96, 40, double_quant)  # 3840 elements: 60 blocks, not aligned to anything
    full = dequantize_stack(stack)
    index = [2, 0, 2, 3, 3, 1]
    taken = nf4_take_experts(stack, index)
    assert torch.equal(dequantize_stack(taken), full[index])


@pytest.mark.parametrize(
    "rows, cols, start, stop",
    [
        (256, 128, 128, 256),  # the second half: starts on nested block 1 (16384 elements)
        (256, 128, 0, 128),  # the first half
        (512, 64, 256, 384),  # a middle slice on a nested boundary, a partial end
        (300, 64, 0, 123),  # any prefix
    ],
)
def test_row_slices_on_nested_blocks_are_bit_exact_with_double_quantization(rows, cols, start, stop):
    stack = stack_of(3, rows, cols, True)
    assert nf4_row_slice_problem(stack, start, stop) is None
    sliced = nf4_slice_rows(stack, start, stop)
    assert torch.equal(dequantize_stack(sliced), dequantize_stack(stack)[:, start:stop])


@pytest.mark.parametrize("rows, cols, start, stop", [(96, 64, 48, 96), (384, 128, 192, 384), (40, 96, 2, 37), (10, 32, 2, 10)])
def test_row_slices_on_64_element_blocks_are_bit_exact_without_double_quantization(rows, cols, start, stop):
    stack = stack_of(2, rows, cols, False)
    sliced = nf4_slice_rows(stack, start, stop)
    assert torch.equal(dequantize_stack(sliced), dequantize_stack(stack)[:, start:stop])


def test_row_slices_that_would_need_requantizing_are_refused_with_the_reason():
    plain = stack_of(2, 12, 40, False)
    with pytest.raises(NF4SliceError, match="not on a 64-element quantization block"):
        nf4_slice_rows(plain, 1, 12)  # starts at element 40
    nested = stack_of(2, 384, 128, True)
    with pytest.raises(NF4SliceError, match="nested absmax block of 256 blocks"):
        nf4_slice_rows(nested, 192, 384)  # halves of F=384 at d_model 128: element 24576 = 1.5 nested blocks


def test_the_shape_only_check_tells_a_plan_which_splits_stay_exact():
    # halves of F at d_model 128 with double quantization: F = 512 and 256 yes, 128 no
    assert row_slice_problem(512, 128, 256, 512, True) is None
    assert row_slice_problem(256, 128, 128, 256, True) is None
    assert "nested absmax" in row_slice_problem(128, 128, 64, 128, True)
    assert row_slice_problem(128, 128, 64, 128, False) is None


def test_renesting_keeps_the_codes_and_moves_each_block_scale_by_at_most_one_8bit_step():
    stack = stack_of(2, 384, 128, True)
    renested = nf4_renest_rows(stack, 192, 384)
    assert torch.equal(renested.codes_EP, stack.codes_EP[:, 192 * 64 :])
    got, want = dequantize_stack(renested), dequantize_stack(stack)[:, 192:]
    rel = ((got - want).norm() / want.norm()).item()
    assert 0 < rel < 0.01, rel


@pytest.mark.parametrize("double_quant", [True, False], ids=["double_quant", "plain"])
@pytest.mark.parametrize("factor", [2.0, 0.5, 4.0])
def test_scaling_by_a_power_of_two_is_bit_exact(double_quant, factor):
    stack = stack_of(3, 64, 96, double_quant)
    assert torch.equal(dequantize_stack(nf4_scale(stack, factor)), dequantize_stack(stack) * factor)


@pytest.mark.parametrize("double_quant", [True, False], ids=["double_quant", "plain"])
def test_a_zeroed_stack_dequantizes_to_exact_zeros(double_quant):
    zero = nf4_zeros_like(stack_of(2, 40, 96, double_quant))
    assert torch.equal(dequantize_stack(zero), torch.zeros(2, 40, 96))


def test_scaling_by_other_factors_is_refused():
    with pytest.raises(ValueError, match="powers of two"):
        nf4_scale(stack_of(1, 8, 64, True), 3.0)


def test_a_split_built_from_the_helpers_is_bit_exact():
    """What split_experts needs for NF4: child j of expert e = rows [j·F/2, (j+1)·F/2) of e's gate,
    up and (transposed) down matrices, the down-projection x2, children laid out j·E + e."""
    E, F, D = 3, 256, 128
    stack = stack_of(E, F, D, True)
    halves = [nf4_slice_rows(stack, j * F // 2, (j + 1) * F // 2) for j in range(2)]
    children = nf4_scale(nf4_cat_experts(halves), 2.0)
    full = dequantize_stack(stack)
    want = torch.cat([full[:, : F // 2], full[:, F // 2 :]]) * 2
    assert torch.equal(dequantize_stack(children), want)
