"""SwiGLU's elementwise steps in one pass each, for the torch._grouped_mm route (grouped_torch.py),
whose products come back as whole tensors: forward h = silu(g) u; backward dg = dh u silu'(g),
du = dh silu(g), and h again for the down projection's gradients. Math in fp32, one rounding per
output, as the Triton GEMM epilogues do. Written with torch ops these were 4-6 passes each over
[N, F] (upcasts, products, casts): 40% of an NF4 + LoRA step's GPU time at the 120B expert shapes
on an H200. Reference: `swiglu_forward_reference` / `swiglu_backward_reference` (also what runs
where Triton cannot).

Legend: N rows, F expert hidden.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_BLOCK = 1024


def swiglu_forward_reference(g_NF: torch.Tensor, u_NF: torch.Tensor) -> torch.Tensor:
    return (F.silu(g_NF.float()) * u_NF.float()).to(g_NF.dtype)


def swiglu_backward_reference(dh_NF, g_NF, u_NF, need_h: bool, out=None):
    gf, uf, dh = g_NF.float(), u_NF.float(), dh_NF.float()
    sig = torch.sigmoid(gf)
    silu = gf * sig
    dg = (dh * uf * (sig * (1.0 + gf * (1.0 - sig)))).to(g_NF.dtype)
    du = (dh * silu).to(g_NF.dtype)
    if out is not None:
        dg, du = out[0].copy_(dg), out[1].copy_(du)
    return dg, du, ((silu * uf).to(g_NF.dtype) if need_h else None)


def _use_triton(t: torch.Tensor) -> bool:
    # Reached from grouped.py's torch._grouped_mm route, which runs where Triton is installed: on a
    # GPU compiled; on the CPU the reference (the interpreter would only be slower).
    return t.device.type == "cuda"


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t itself where its rows are contiguous (a column slice of a wider tensor is), else a copy."""
    return t if t.shape[1] <= 1 or t.stride(1) == 1 else t.contiguous()


def swiglu_forward(g_NF: torch.Tensor, u_NF: torch.Tensor) -> torch.Tensor:
    """h = silu(g) u, contiguous. g and u may be column slices of one wider tensor (the folded
    route's [g | u | x Ag^T | x Au^T], grouped_torch.forward_folded), read in place."""
    if not _use_triton(g_NF):
        return swiglu_forward_reference(g_NF, u_NF)
    from ._swiglu_triton import launch_forward

    g, u = _rows(g_NF), _rows(u_NF)
    if g.stride(0) != u.stride(0):
        g, u = g.contiguous(), u.contiguous()
    return launch_forward(g, u, _BLOCK)


def swiglu_backward(dh_NF: torch.Tensor, g_NF: torch.Tensor, u_NF: torch.Tensor, need_h: bool, out=None):
    """(dg, du, h or None) in g's dtype; dg and du written into `out` (two [N, F] views with
    contiguous rows and one row stride, e.g. column slices of the input gradient's stacked
    operand) where given."""
    if not _use_triton(g_NF):
        return swiglu_backward_reference(dh_NF, g_NF, u_NF, need_h, out)
    from ._swiglu_triton import launch_backward

    g, u = _rows(g_NF), _rows(u_NF)
    if g.stride(0) != u.stride(0):
        g, u = g.contiguous(), u.contiguous()
    return launch_backward(dh_NF.contiguous(), g, u, need_h, _BLOCK, out)
