"""The Triton kernels of kernels/swiglu.py (imported only where Triton runs), and the SwiGLU math
they share with the grouped GEMM's epilogues (kernels/grouped.py): fp32 in, fp32 out."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def silu_mul(g, u):
    """h = silu(g) u."""
    return g * tl.sigmoid(g) * u


@triton.jit
def silu_mul_backward(dh, g, u):
    """(dg, du, h): dg = dh u silu'(g), du = dh silu(g), and h = silu(g) u again."""
    sig = tl.sigmoid(g)
    silu = g * sig
    return dh * u * (sig * (1.0 + g * (1.0 - sig))), dh * silu, silu * u


@triton.jit
def _forward_kernel(g_ptr, u_ptr, h_ptr, n, cols, in_stride, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    at = (offs // cols) * in_stride + offs % cols  # g and u may be column slices of a wider tensor
    g = tl.load(g_ptr + at, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + at, mask=mask, other=0.0).to(tl.float32)
    tl.store(h_ptr + offs, silu_mul(g, u).to(h_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _backward_kernel(dh_ptr, g_ptr, u_ptr, dg_ptr, du_ptr, h_ptr, n, cols, in_stride, out_stride, NEED_H: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    row, col = offs // cols, offs % cols
    dh = tl.load(dh_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + row * in_stride + col, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * in_stride + col, mask=mask, other=0.0).to(tl.float32)
    dg, du, h = silu_mul_backward(dh, g, u)
    dt = dg_ptr.dtype.element_ty
    tl.store(dg_ptr + row * out_stride + col, dg.to(dt), mask=mask)
    tl.store(du_ptr + row * out_stride + col, du.to(dt), mask=mask)
    if NEED_H:
        tl.store(h_ptr + offs, h.to(dt), mask=mask)


def _row_stride(*ts: torch.Tensor) -> int:
    """The common row stride of [N, F] tensors whose rows are contiguous (column slices of one
    wider tensor are)."""
    strides = {t.stride(0) if t.shape[0] > 1 else t.shape[1] for t in ts}
    if len(strides) != 1 or any(t.shape[1] > 1 and t.stride(1) != 1 for t in ts):
        raise ValueError(f"swiglu kernels: rows must be contiguous with one row stride, got strides {[t.stride() for t in ts]}")
    return strides.pop()


def launch_forward(g: torch.Tensor, u: torch.Tensor, block: int) -> torch.Tensor:
    """h = silu(g) u, contiguous; g and u [N, F] with contiguous rows (any common row stride)."""
    h = torch.empty(g.shape, dtype=g.dtype, device=g.device)
    if g.numel():
        _forward_kernel[(triton.cdiv(g.numel(), block),)](g, u, h, g.numel(), g.shape[1], _row_stride(g, u), BLOCK=block)
    return h


def launch_backward(dh: torch.Tensor, g: torch.Tensor, u: torch.Tensor, need_h: bool, block: int, out=None):
    """(dg, du, h or None); dg and du written into `out` (two [N, F] views with contiguous rows)
    where given. dh contiguous; g and u as in launch_forward."""
    dg, du = out if out is not None else (torch.empty(g.shape, dtype=g.dtype, device=g.device) for _ in range(2))
    h = torch.empty(g.shape, dtype=g.dtype, device=g.device) if need_h else None
    if g.numel():
        _backward_kernel[(triton.cdiv(g.numel(), block),)](
            dh, g, u, dg, du, h, g.numel(), g.shape[1], _row_stride(g, u), _row_stride(dg, du), NEED_H=need_h, BLOCK=block,
        )
    return dg, du, h
