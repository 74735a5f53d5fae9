"""NF4 dequantization kernel (kernels/nf4.py) against bitsandbytes' dequantize_4bit and the
pure-PyTorch reference: bit for bit, with and without double quantization, at odd sizes."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from kernel_testing import assert_equal, needs_cuda, require_triton

require_triton()
bnbf = pytest.importorskip("bitsandbytes.functional", reason="bitsandbytes (the 'test' extra) is the ground truth here")

from growtrain.kernels.nf4 import dequantize_nf4, dequantize_nf4_experts
from growtrain.kernels.reference import dequantize_nf4_reference
from growtrain.kernels.weights import NF4Weight

# (7, 96): rows not a multiple of the 64-block; (3, 37): odd element count (a half-used last byte);
# (2, 16448): 514 blocks, so three nested blocks of 256, the last one partial; (129,): 1-D.
SHAPES = [(7, 96), (5, 100), (3, 37), (2, 64 * 256 + 64), (129,)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _quantize(shape, double_quant: bool, seed: int = 0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(shape, generator=g) * 3).to(device)
    return bnbf.quantize_4bit(w, blocksize=64, compress_statistics=double_quant, quant_type="nf4")


def _bnb_flat(packed, qs, dtype):
    """bitsandbytes' answer with blocks over the flat element index. Its CPU C kernel, given a 2-D
    shape whose last dim is not a multiple of the blocksize, restarts blocks at every row (0.50.2),
    which disagrees with its own quantizer; the CUDA kernel and the generic path are flat."""
    flat = bnbf.QuantState(
        absmax=qs.absmax, shape=torch.Size([qs.shape.numel()]), code=qs.code, blocksize=qs.blocksize,
        quant_type="nf4", dtype=dtype, offset=qs.offset, state2=qs.state2,
    )
    return bnbf.dequantize_4bit(packed, flat, quant_type="nf4").reshape(qs.shape)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("double_quant", [False, True], ids=["plain", "double_quant"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_dequantize_is_bit_identical_to_bitsandbytes(shape, double_quant, dtype):
    packed, qs = _quantize(shape, double_quant)
    qs.dtype = dtype
    want = _bnb_flat(packed, qs, dtype)
    assert_equal("triton vs bitsandbytes", dequantize_nf4(packed, qs), want)
    ref = dequantize_nf4_reference(NF4Weight.from_bnb([packed], [qs]), dtype).reshape(shape)
    assert_equal("reference vs bitsandbytes", ref, want)


@pytest.mark.parametrize("shape", [(5, 100), (3, 37), (129,)], ids=str)
def test_dequantize_equals_bitsandbytes_unflattened_where_its_cpu_path_is_flat(shape):
    packed, qs = _quantize(shape, True, seed=1)
    want = bnbf.dequantize_4bit(packed, qs, quant_type="nf4").reshape(shape)
    assert_equal("triton vs bitsandbytes", dequantize_nf4(packed, qs), want)


@pytest.mark.parametrize("double_quant", [False, True], ids=["plain", "double_quant"])
def test_stacked_experts_dequantize_like_each_expert_alone(double_quant):
    w_ERC = torch.randn(3, 24, 40)
    w = NF4Weight.quantize(w_ERC, compress_statistics=double_quant)
    got = dequantize_nf4_experts(w, torch.float32)
    for e in range(3):
        packed, qs = bnbf.quantize_4bit(w_ERC[e].contiguous(), blocksize=64, compress_statistics=double_quant, quant_type="nf4")
        assert_equal(f"expert {e}", got[e], _bnb_flat(packed, qs, torch.float32))


def test_nf4_weight_reads_growtrain_stack_fields_without_copying():
    w = NF4Weight.quantize(torch.randn(2, 16, 12), compress_statistics=True)
    stack = SimpleNamespace(
        codes_EP=w.codes_EB, absmax_EA=w.absmax_EK, quant_map=w.code_16, rows=16, cols=12,
        nested_absmax_EM=w.nested_absmax_EJ, offset_E=w.offset_E, nested_quant_map=w.nested_code_256,
        blocksize=64, nested_blocksize=256,
    )
    again = NF4Weight.from_stack(stack)
    assert again.codes_EB.data_ptr() == w.codes_EB.data_ptr()
    assert_equal("from_stack", dequantize_nf4_experts(again), dequantize_nf4_experts(w))


def test_nf4_weight_rejects_inconsistent_tensors_with_every_problem_named():
    w = NF4Weight.quantize(torch.randn(2, 16, 12))
    with pytest.raises(ValueError) as err:
        NF4Weight(codes_EB=w.codes_EB[:, :-1].contiguous(), absmax_EK=w.absmax_EK.double(), code_16=w.code_16, shape=(16, 12))
    assert "codes_EB" in str(err.value) and "absmax_EK must be fp32" in str(err.value)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("double_quant", [False, True], ids=["plain", "double_quant"])
@pytest.mark.parametrize("shape", [(7, 96), (64, 4096 + 64), (3, 37)], ids=str)
def test_dequantize_is_bit_identical_to_bitsandbytes_on_cuda(shape, double_quant, dtype):
    packed, qs = _quantize(shape, double_quant, device="cuda")
    qs.dtype = dtype
    want = bnbf.dequantize_4bit(packed, qs, quant_type="nf4")
    assert_equal("triton vs bitsandbytes (cuda)", dequantize_nf4(packed, qs), want.reshape(shape))
