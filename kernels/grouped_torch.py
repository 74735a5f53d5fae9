"""The grouped SwiGLU's GEMMs through `torch._grouped_mm` (CUTLASS grouped GEMM on Hopper GPUs): the
same math as kernels/grouped.py's launches, written as whole-tensor torch ops. `grouped_swiglu`
takes this route on a GPU when torch can run it (`gemm_unavailable_reason`): on an H200 it ran
the dense SwiGLU forward at 640 TFLOP/s where the Triton grouped kernel reached 300-400 at best
(`benchmarks/kernels.py`). The Triton kernels stay for what this cannot do: NF4 decoding, the
tile-signalled combine (kernels/combine.py), fp32, and the interpreter. NF4 bases reach this path
dequantized (grouped.resolve_nf4_decode).

Per expert e over its rows (LoRA terms where a pair is given):
  g = x Wg^T + sg (x Ag^T) Bg^T,  u = x Wu^T + su (x Au^T) Bu^T,  h = silu(g) u,
  y = h Wd^T + sd (h Ad^T) Bd^T;
  dh = dy Wd + sd (dy Bd) Ad,  dg = dh u silu'(g),  du = dh silu(g),
  dx = dg Wg + sg (dg Bg) Ag + du Wu + su (du Bu) Au; weight and adapter gradients as grouped
  [out, rows] @ [rows, in] products over each expert's rows.
The SwiGLU steps compute in fp32 and round once (kernels/swiglu.py), as the Triton epilogues do,
but from rounded products (dh too); the LoRA term is added to the rounded base product (the
Triton kernel adds it before rounding): results agree with the Triton path to bf16 rounding, not
bit for bit.

Legend: N rows sorted by expert, D d_model, F expert hidden, E experts, r LoRA rank, O/I a
matrix's output/input width.
"""

from __future__ import annotations

import torch

from .swiglu import swiglu_backward, swiglu_forward
from .weights import LoRA


def gemm_unavailable_reason(x: torch.Tensor, widths: list[int], tensors: list[torch.Tensor]) -> str | None:
    """None when torch._grouped_mm can run every product of the layer: a GPU of compute capability
    9.0 or later in bf16 (CUTLASS' grouped kernel), or the CPU (its reference loop, for tests);
    every width (D, F; the LoRA ranks are padded to it, in_dtype) and every operand's row stride a
    multiple of 16 bytes."""
    if getattr(torch, "_grouped_mm", None) is None:
        return "this torch has no torch._grouped_mm"
    if x.device.type == "cuda":
        if torch.cuda.get_device_capability(x.device) < (9, 0):
            return "torch._grouped_mm needs compute capability 9.0 or later"
        if x.dtype != torch.bfloat16:
            return f"torch._grouped_mm runs bf16 on a GPU, not {x.dtype}"
    elif x.device.type != "cpu":
        return f"no torch._grouped_mm on {x.device.type}"
    size = x.element_size()
    if any(w * size % 16 for w in widths):
        return f"widths {widths} are not all multiples of 16 bytes"
    for t in tensors:
        if t.dtype != x.dtype:
            continue  # cast to x's dtype per call (as autocast would): a contiguous copy
        lead = t.stride()[-2:]
        if 1 not in lead or any(s * size % 16 for s in lead if s != 1) or t.data_ptr() % 16:
            return "an operand is not laid out as torch._grouped_mm needs (one unit stride, 16-byte aligned rows)"
    return None


def in_dtype(weights: list, loras: list, dtype: torch.dtype) -> tuple[list, list]:
    """Weights and LoRA pairs in the compute dtype (fp32 master copies cast, as autocast casts a
    Linear's weight; the Triton kernels convert inside instead), each pair's rank zero-padded to a
    multiple of 16 bytes (`padded_rank`)."""
    weights = [w.to(dtype) for w in weights]
    return weights, [None if lo is None else _padded(lo, dtype) for lo in loras]


def padded_rank(r: int, dtype: torch.dtype) -> int:
    """The rank r rounded up to a multiple of 16 bytes in `dtype`, as torch._grouped_mm needs every
    width (rank 4 in bf16, 8 bytes, becomes 8)."""
    per = 16 // torch.empty((), dtype=dtype).element_size()
    return -(-r // per) * per


def _padded(lo: LoRA, dtype: torch.dtype) -> LoRA:
    """A pair in `dtype` with zero rows of A and zero columns of B up to padded_rank: the same
    product (x A'^T has zero columns there, which meet B's zero columns), the same gradients of the
    first r rows and columns (`backward` returns them padded; the caller keeps those)."""
    E, r, I = lo.A_ERI.shape
    rp = padded_rank(r, dtype)
    if rp == r:
        return LoRA(lo.A_ERI.to(dtype), lo.B_EOR.to(dtype), lo.scale)
    A = lo.A_ERI.new_zeros((E, rp, I), dtype=dtype)
    B = lo.B_EOR.new_zeros((E, lo.B_EOR.shape[1], rp), dtype=dtype)
    A[:, :r] = lo.A_ERI
    B[:, :, :r] = lo.B_EOR
    return LoRA(A, B, lo.scale)


def _gm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return torch._grouped_mm(a, b, offs=offs)


def _project(x: torch.Tensor, w: torch.Tensor, transpose: bool, lora: LoRA | None, z: torch.Tensor | None, offs: torch.Tensor) -> torch.Tensor:
    """x @ W' (+ scale z @ L2): W' = W^T when `transpose` (forward) else W (input gradient), with
    z = x @ L1 (`low_rank`) and L2 = B^T or A accordingly."""
    out = _gm(x, w.transpose(1, 2) if transpose else w, offs)
    if lora is not None:
        out.add_(_gm(z, lora.B_EOR.transpose(1, 2) if transpose else lora.A_ERI, offs), alpha=lora.scale)
    return out


def low_rank(x: torch.Tensor, lora: LoRA | None, transpose: bool, offs: torch.Tensor) -> torch.Tensor | None:
    """x @ A^T (forward) or x @ B (input gradient) per expert; None without a pair."""
    if lora is None:
        return None
    return _gm(x, lora.A_ERI.transpose(1, 2) if transpose else lora.B_EOR, offs)


def _wgrad(d_NO: torch.Tensor, q_NI: torch.Tensor, offs: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """[E, O, I] = scale * d[rows_e]^T @ q[rows_e] (zeros for an expert without rows)."""
    out = _gm(d_NO.t(), q_NI, offs)
    return out if scale == 1.0 else out.mul_(scale)


def forward(x: torch.Tensor, offs: torch.Tensor, weights: list, loras: list, save: bool):
    """y [N, D] and what the backward needs: (g, u, zg, zu, zd), or None when not saving."""
    zg, zu = low_rank(x, loras[0], True, offs), low_rank(x, loras[1], True, offs)
    g = _project(x, weights[0], True, loras[0], zg, offs)
    u = _project(x, weights[1], True, loras[1], zu, offs)
    h = swiglu_forward(g, u)
    zd = low_rank(h, loras[2], True, offs)
    y = _project(h, weights[2], True, loras[2], zd, offs)
    return y, ((g, u, zg, zu, zd) if save else None)


def backward(dy, x, offs, g, u, z_fwd, weights, loras, need_dx: bool, need_dW: tuple, need_dA: tuple, need_dB: tuple):
    """(dx or None, [dW], [dA], [dB]) per matrix (gate, up, down), None where not needed; dA and dB
    at the padded rank of `loras` (in_dtype)."""
    zbd = low_rank(dy, loras[2], False, offs)
    dh = _project(dy, weights[2], False, loras[2], zbd, offs)
    dg, du, h = swiglu_backward(dh, g, u, need_dW[2] or need_dA[2])
    del dh
    zbg = low_rank(dg, loras[0], False, offs) if need_dx or need_dA[0] else None
    zbu = low_rank(du, loras[1], False, offs) if need_dx or need_dA[1] else None
    dx = None
    if need_dx:
        dx = _project(dg, weights[0], False, loras[0], zbg, offs)
        dx.add_(_project(du, weights[1], False, loras[1], zbu, offs))
    d_in, x_in = (dg, du, dy), (x, x, h)
    dW = [_wgrad(d_in[i], x_in[i], offs) if need_dW[i] else None for i in range(3)]
    dA, dB = [None] * 3, [None] * 3
    for i, (lo, zf, zb) in enumerate(zip(loras, z_fwd, (zbg, zbu, zbd))):
        if lo is None:
            continue
        if need_dB[i]:
            dB[i] = _wgrad(d_in[i], zf, offs, lo.scale)
        if need_dA[i]:
            dA[i] = _wgrad(zb, x_in[i], offs, lo.scale)
    return dx, dW, dA, dB


# ---------------------------------------------------------------------------------------------
# The folded route: the gate and up projections and their adapters' A factors stacked along the
# output rows, Wx = [Wg; Wu; Ag; Au] [E, 2F + 2r', D] (r' the padded rank; a block absent without
# its pair), so that one grouped product reads x once and writes [g | u | x Ag^T | x Au^T], and one
# product gives the input gradient, dx = [dg | du | sg dg Bg | su du Bu] @ Wx, where the unfolded
# route runs four products and adds three [N, D] terms. The B-terms are still added to g and u in
# place, and the down projection is as in `forward` / `backward`.


def x_side_rows(F: int, loras: list) -> list[tuple[int, int]]:
    """Row ranges of Wx's blocks: gate, up, then each present adapter's A (None where absent)."""
    ranges, at = [(0, F), (F, 2 * F)], 2 * F
    for lo in loras[:2]:
        if lo is None:
            ranges.append(None)
        else:
            ranges.append((at, at + lo.A_ERI.shape[1]))
            at += lo.A_ERI.shape[1]
    return ranges


def forward_folded(x: torch.Tensor, offs: torch.Tensor, wx: torch.Tensor, wd: torch.Tensor, loras: list, save: bool):
    """y [N, D] and what backward_folded needs: (gu, zd) with gu = [g | u | zg | zu] [N, K], or
    None when not saving. wx [E, K, D] (x_side_rows), wd [E, D, F], loras padded (in_dtype)."""
    F = wd.shape[2]
    rows = x_side_rows(F, loras)
    gu = _gm(x, wx.transpose(1, 2), offs)
    g, u = gu[:, : rows[0][1]], gu[:, rows[1][0] : rows[1][1]]
    for part, lo, r in ((g, loras[0], rows[2]), (u, loras[1], rows[3])):
        if lo is not None:
            part.add_(_gm(gu[:, r[0] : r[1]], lo.B_EOR.transpose(1, 2), offs), alpha=lo.scale)
    h = swiglu_forward(g, u)
    zd = low_rank(h, loras[2], True, offs)
    y = _project(h, wd, True, loras[2], zd, offs)
    return y, ((gu, zd) if save else None)


def backward_folded(dy, x, offs, gu, zd, wx, wd, loras, need_dx: bool, need_dW: tuple, need_dA: tuple, need_dB: tuple):
    """As `backward`, for forward_folded's saved tensors."""
    F = wd.shape[2]
    rows = x_side_rows(F, loras)
    g, u = gu[:, : rows[0][1]], gu[:, rows[1][0] : rows[1][1]]
    zbd = low_rank(dy, loras[2], False, offs)
    dh = _project(dy, wd, False, loras[2], zbd, offs)
    stacked = dy.new_empty((dy.shape[0], gu.shape[1]))  # [dg | du | sg dg Bg | su du Bu]
    dg, du = stacked[:, : rows[0][1]], stacked[:, rows[1][0] : rows[1][1]]
    _, _, h = swiglu_backward(dh, g, u, need_dW[2] or need_dA[2], out=(dg, du))
    del dh
    zb = [None, None, zbd]  # (scaled for gate and up: the stacked operand's columns)
    for i, (d, lo, r) in enumerate(((dg, loras[0], rows[2]), (du, loras[1], rows[3]))):
        if lo is not None and (need_dx or need_dA[i]):
            zb[i] = stacked[:, r[0] : r[1]]
            torch.mul(_gm(d, lo.B_EOR, offs), lo.scale, out=zb[i])
    dx = _gm(stacked, wx, offs) if need_dx else None
    d_in, x_in = (dg, du, dy), (x, x, h)
    dW = [_wgrad(d_in[i], x_in[i], offs) if need_dW[i] else None for i in range(3)]
    dA, dB = [None] * 3, [None] * 3
    z_fwd = [gu[:, r[0] : r[1]] if r is not None else None for r in rows[2:]] + [zd]
    for i, lo in enumerate(loras):
        if lo is None:
            continue
        if need_dB[i]:
            dB[i] = _wgrad(d_in[i], z_fwd[i], offs, lo.scale)
        if need_dA[i]:
            dA[i] = _wgrad(zb[i], x_in[i], offs, 1.0 if i < 2 else lo.scale)
    return dx, dW, dA, dB
