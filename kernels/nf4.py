"""NF4 dequantization in Triton, bit-identical to bitsandbytes' `dequantize_4bit` (quant_type="nf4"),
with and without double quantization. `nf4_values` is the per-element decode the grouped GEMM
also inlines, so a fused tile sees exactly the weights a standalone dequantization gives.
Reference: `reference.dequantize_nf4_reference`.

Legend: E experts, M elements per expert matrix (rows*cols).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .weights import NF4Weight

# 1024 elements per program: 512 bytes of codes and 16 absmax blocks, a few KB of registers.
_DEQUANT_BLOCK = 1024


@triton.jit
def nf4_values(
    codes_ptr,
    absmax_ptr,
    code_ptr,
    nabs_ptr,
    ncode_ptr,
    qoff_ptr,
    e,
    flat,
    mask,
    numel,
    NESTED: tl.constexpr,
    QBLOCK: tl.constexpr,
    NQBLOCK: tl.constexpr,
):
    """fp32 values of elements `flat` (any shape) of expert `e`; 0 where ~mask."""
    e64 = e.to(tl.int64)
    nbytes = (numel + 1) // 2
    nblk = (numel + QBLOCK - 1) // QBLOCK
    byte = tl.load(codes_ptr + e64 * nbytes + flat // 2, mask=mask, other=0).to(tl.int32)
    nib = tl.where(flat % 2 == 0, byte >> 4, byte & 15)
    value = tl.load(code_ptr + nib, mask=mask, other=0.0)
    blk = flat // QBLOCK
    if NESTED:
        nnest = (nblk + NQBLOCK - 1) // NQBLOCK
        q = tl.load(absmax_ptr + e64 * nblk + blk, mask=mask, other=0).to(tl.int32)
        scale = tl.load(ncode_ptr + q, mask=mask, other=0.0) * tl.load(nabs_ptr + e64 * nnest + blk // NQBLOCK, mask=mask, other=0.0)
        scale = scale + tl.load(qoff_ptr + e)
    else:
        scale = tl.load(absmax_ptr + e64 * nblk + blk, mask=mask, other=0.0)
    return value * scale


@triton.jit
def round_to_bf16(v):
    """fp32 -> bf16, round to nearest even, in integer ops: the same bits compiled or interpreted
    (triton 3.9's interpreter truncates fp32 -> bf16 casts). Not for NaN."""
    bits = v.to(tl.uint32, bitcast=True)
    bits = bits + 0x7FFF + ((bits >> 16) & 1)
    return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _dequant_kernel(
    out_ptr,
    codes_ptr,
    absmax_ptr,
    code_ptr,
    nabs_ptr,
    ncode_ptr,
    qoff_ptr,
    numel,
    out_stride_e,
    NESTED: tl.constexpr,
    QBLOCK: tl.constexpr,
    NQBLOCK: tl.constexpr,
    BLOCK: tl.constexpr,
    OUT_BF16: tl.constexpr,
):
    pid = tl.program_id(0)
    e = tl.program_id(1)
    flat = pid * BLOCK + tl.arange(0, BLOCK)
    mask = flat < numel
    v = nf4_values(codes_ptr, absmax_ptr, code_ptr, nabs_ptr, ncode_ptr, qoff_ptr, e, flat, mask, numel, NESTED, QBLOCK, NQBLOCK)
    if OUT_BF16:
        out = round_to_bf16(v)
    else:
        out = v.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + e.to(tl.int64) * out_stride_e + flat, out, mask=mask)


def nf4_kernel_args(w: NF4Weight) -> tuple:
    """(codes, absmax, code, nested absmax, nested code, offset) in the order nf4_values takes them."""
    return (w.codes_EB, w.absmax_EK, w.code_16, w.nested_absmax_EJ, w.nested_code_256, w.offset_E)


def dequantize_nf4_experts(w: NF4Weight, dtype: torch.dtype = torch.float32, out: torch.Tensor | None = None) -> torch.Tensor:
    """[E, rows, cols] (the stored layout) in `dtype` (fp32, bf16 or fp16). `out`: where to write
    it instead of a new tensor, e.g. a slice of a stack of several matrices along rows (each
    expert's rows x cols contiguous, any stride between experts)."""
    E, numel = w.num_experts, w.numel_per_expert
    if out is None:
        out = torch.empty((E, *w.shape), dtype=dtype, device=w.device)
    elif tuple(out.shape) != (E, *w.shape) or out.dtype != dtype or out.stride()[1:] != (w.shape[1], 1):
        raise ValueError(f"dequantize_nf4_experts: out must be {dtype} [{E}, {w.shape[0]}, {w.shape[1]}] with each expert contiguous, got {out.dtype} {list(out.shape)} strides {out.stride()}")
    if out.numel() == 0:
        return out
    grid = (triton.cdiv(numel, _DEQUANT_BLOCK), E)
    _dequant_kernel[grid](
        out,
        *nf4_kernel_args(w),
        numel,
        out.stride(0),
        NESTED=w.nested,
        QBLOCK=w.blocksize,
        NQBLOCK=w.nested_blocksize,
        BLOCK=_DEQUANT_BLOCK,
        OUT_BF16=dtype == torch.bfloat16,
        # bitsandbytes rounds the nested scale's product and sum separately; an FMA would not.
        enable_fp_fusion=False,
    )
    return out


def dequantize_nf4(packed: torch.Tensor, quant_state) -> torch.Tensor:
    """Drop-in for `bitsandbytes.functional.dequantize_4bit(packed, quant_state, quant_type="nf4")`:
    the tensor of `quant_state.shape` in `quant_state.dtype`, with blocks over the flat element index
    (as bitsandbytes' CUDA kernel and its generic path lay them out)."""
    w = NF4Weight.from_bnb([packed], [quant_state])
    return dequantize_nf4_experts(w, quant_state.dtype).reshape(quant_state.shape)
