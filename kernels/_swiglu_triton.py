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
def _forward_kernel(g_ptr, u_ptr, h_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(h_ptr + offs, silu_mul(g, u).to(h_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _backward_kernel(dh_ptr, g_ptr, u_ptr, dg_ptr, du_ptr, h_ptr, n, NEED_H: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    dh = tl.load(dh_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    dg, du, h = silu_mul_backward(dh, g, u)
    dt = dg_ptr.dtype.element_ty
    tl.store(dg_ptr + offs, dg.to(dt), mask=mask)
    tl.store(du_ptr + offs, du.to(dt), mask=mask)
    if NEED_H:
        tl.store(h_ptr + offs, h.to(dt), mask=mask)


def launch_forward(g: torch.Tensor, u: torch.Tensor, block: int) -> torch.Tensor:
    h = torch.empty_like(g)
    if g.numel():
        _forward_kernel[(triton.cdiv(g.numel(), block),)](g, u, h, g.numel(), BLOCK=block)
    return h


def launch_backward(dh: torch.Tensor, g: torch.Tensor, u: torch.Tensor, need_h: bool, block: int):
    dg, du = torch.empty_like(g), torch.empty_like(g)
    h = torch.empty_like(g) if need_h else None
    if g.numel():
        _backward_kernel[(triton.cdiv(g.numel(), block),)](dh, g, u, dg, du, h, g.numel(), NEED_H=need_h, BLOCK=block)
    return dg, du, h
