"""Pure-PyTorch references of the expert kernels: the ground truth the Triton kernels are tested
against, and the CPU backend. No Triton here.

The grouped SwiGLU runs as one autograd Function (`_GroupedSwiGLU`) that loops over the experts
with rows inside its forward and its backward. Autograd through a plain per-expert loop (kept as
`grouped_swiglu_reference_loop` / `grouped_swiglu_lora_reference_loop`, the old implementation the
tests compare against) pays, in the backward, one zero tensor of the whole stacked weight per
`w[e]` and one of the whole input per `x[start:end]`, then adds into it: O(E) full-size fills per
layer, 60-80% of a layer's time at 128-256 experts (issue 16). Here each weight gradient is one
buffer written expert by expert, and the input gradient is written in place, row block by row
block. The arithmetic is the same ops on the same operands in the same order as autograd through
the loop (mm's backward rules, silu_backward, the summation order of the input gradient), so the
results are bitwise those of the loop (tests/test_moe_fast_path.py).

Legend: N rows (token-slots, sorted by expert), D d_model, E experts, F expert hidden width,
E1 = E + 1 offsets, R ranks, r LoRA rank, I/O a matrix's input/output width, n one expert's rows.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from .weights import LoRA, NF4Weight


def expert_bounds(offsets_E1: torch.Tensor, num_experts: int, num_rows: int) -> list[int]:
    """offsets as a Python list, checked: E + 1 entries, 0 .. N, non-decreasing. The one host sync of
    a grouped call: it lets empty experts be skipped and rows be sliced without further syncs."""
    if offsets_E1.numel() != num_experts + 1:
        raise ValueError(f"offsets must have E + 1 = {num_experts + 1} entries, got {offsets_E1.numel()}")
    bounds = offsets_E1.tolist()
    if bounds[0] != 0 or bounds[-1] != num_rows:
        raise ValueError(f"offsets must run from 0 to N = {num_rows}, got {bounds[0]}..{bounds[-1]}")
    for e in range(num_experts):
        if bounds[e + 1] < bounds[e]:
            raise ValueError(f"offsets must be non-decreasing, got {bounds[e]} > {bounds[e + 1]} at expert {e}")
    return bounds


# ---------------------------------------------------------------------------------------------
# The fast path: one autograd Function over all experts


def _autocast_dtype(x: torch.Tensor) -> torch.dtype | None:
    """The dtype autocast would run this device's matmuls in, None when it is off. Autocast casts
    only fp16/bf16/fp32 operands (never fp64), so the Function does the same by hand."""
    dev = x.device.type
    if dev not in ("cpu", "cuda") or not torch.is_autocast_enabled(dev):
        return None
    return torch.get_autocast_dtype(dev)


def _cast(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    if dtype is None or t.dtype in (dtype, torch.float64) or not t.is_floating_point():
        return t
    return t.to(dtype)


def _no_autocast(device_type: str):
    # The Function casts by hand (as autocast would) and then computes with autocast off, so that
    # the backward sees the same dtypes whatever autocast state it is called under.
    if device_type in ("cpu", "cuda"):
        return torch.autocast(device_type=device_type, enabled=False)
    return nullcontext()


def _mm_grad_mat2(grad_nO: torch.Tensor, mat1_nI: torch.Tensor, mat2_IO: torch.Tensor) -> torch.Tensor:
    """d(mat1 @ mat2)/d mat2 as autograd's mm backward computes it (mm_mat2_backward): for a
    column-major mat2 (a W.T view of a row-major W) the gradient comes out column-major,
    (grad^T @ mat1)^T; otherwise mat1^T @ grad. Returned as [O, I], the W layout."""
    I, O = mat2_IO.shape
    if mat2_IO.stride(0) == 1 and mat2_IO.stride(1) == I:
        return grad_nO.t().mm(mat1_nI)
    return mat1_nI.t().mm(grad_nO).t()


def _mm_grad_mat1(grad_nO: torch.Tensor, mat1_nI: torch.Tensor, mat2_IO: torch.Tensor) -> torch.Tensor:
    """d(mat1 @ mat2)/d mat1 as autograd's mm backward computes it (mm_mat1_backward)."""
    n, I = mat1_nI.shape
    if mat1_nI.stride(0) == 1 and mat1_nI.stride(1) == n:
        return mat2_IO.mm(grad_nO.t()).t()
    return grad_nO.mm(mat2_IO.t())


@dataclass
class _Plan:
    """What the Function needs besides the differentiable tensors.

    bounds: offsets as a list. active: experts with rows. groups: `active` cut into the groups whose
    constant bases are made together. bases(group) -> per expert of the group a (gate, up, down)
    triple of mm right operands [I, O] (constants, e.g. dequantized NF4), or None when the bases are
    the trainable stacked inputs W [E, O, I] (then the operand is W[e].T). scales: per matrix, the
    LoRA scale (None: no LoRA on that matrix). dtype: the compute dtype (autocast's or x's).
    keep_bases: keep constant bases for the backward (False under no_grad: freed group by group)."""

    bounds: list[int]
    active: list[int]
    groups: list[list[int]]
    bases: Callable[[list[int]], Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] | None
    scales: tuple[float | None, float | None, float | None]
    dtype: torch.dtype
    cast: torch.dtype | None  # autocast's dtype, None when autocast is off
    keep_bases: bool = True


def _project_forward(x_nI, mat2_IO, A_RI, B_OR, scale, out_nO):
    """out = x @ mat2 (+ scale * (x @ A^T) @ B^T); returns t = x @ A^T (or None) for the backward."""
    torch.mm(x_nI, mat2_IO, out=out_nO)
    if A_RI is None:
        return None
    t_nR = x_nI.mm(A_RI.t())
    out_nO.add_(t_nR.mm(B_OR.t()).mul_(scale))
    return t_nR


class _GroupedSwiGLU(torch.autograd.Function):
    """y[rows of e] = swiglu_e(x[rows of e]) for every expert e with rows; see the module docstring."""

    @staticmethod
    def forward(ctx, plan: _Plan, x_ND, w_gate, w_up, w_down, a_gate, b_gate, a_up, b_up, a_down, b_down):
        dt, cast, bounds = plan.dtype, plan.cast, plan.bounds
        loras = ((a_gate, b_gate), (a_up, b_up), (a_down, b_down))
        with _no_autocast(x_ND.device.type):
            kept = []
            y_ND = g_NF = u_NF = None
            t_NR = [None, None, None]
            for group in plan.groups:
                mats = plan.bases(group) if plan.bases is not None else [
                    (_cast(w_gate[e], cast).t(), _cast(w_up[e], cast).t(), _cast(w_down[e], cast).t()) for e in group
                ]
                if plan.bases is not None and plan.keep_bases:
                    kept.extend(mats)
                for e, (mg, mu, md) in zip(group, mats):
                    s, t = bounds[e], bounds[e + 1]
                    if y_ND is None:  # first expert: the widths are known now
                        N, F_ = x_ND.shape[0], mg.shape[1]
                        g_NF = x_ND.new_empty((N, F_), dtype=dt)
                        u_NF = x_ND.new_empty((N, F_), dtype=dt)
                        y_ND = x_ND.new_empty((N, md.shape[1]), dtype=dt)
                        for m, (A, _) in enumerate(loras):
                            if A is not None:
                                t_NR[m] = x_ND.new_empty((N, A.shape[1]), dtype=dt)
                    x_nD = _cast(x_ND[s:t], cast)
                    lo = [(None, None) if A is None else (_cast(A[e], cast), _cast(B[e], cast)) for A, B in loras]
                    for m, (mat, out) in enumerate(((mg, g_NF), (mu, u_NF))):
                        tt = _project_forward(x_nD, mat, lo[m][0], lo[m][1], plan.scales[m], out[s:t])
                        if tt is not None:
                            t_NR[m][s:t] = tt
                    h_nF = F.silu(g_NF[s:t]) * u_NF[s:t]
                    tt = _project_forward(h_nF, md, lo[2][0], lo[2][1], plan.scales[2], y_ND[s:t])
                    if tt is not None:
                        t_NR[2][s:t] = tt
        ctx.plan = plan
        # The kept bases go through save_for_backward too: saved-tensor hooks (the memory meter,
        # offloading, checkpointing) must see every byte held for the backward.
        ctx.save_for_backward(
            x_ND, w_gate, w_up, w_down, a_gate, b_gate, a_up, b_up, a_down, b_down, g_NF, u_NF, *t_NR, *(w for mats in kept for w in mats)
        )
        return y_ND

    @staticmethod
    @once_differentiable  # no double backward through the experts (the loop allowed it; nothing uses it)
    def backward(ctx, grad_y_ND):
        plan = ctx.plan
        dt, cast, bounds = plan.dtype, plan.cast, plan.bounds
        (x_ND, w_gate, w_up, w_down, a_gate, b_gate, a_up, b_up, a_down, b_down, g_NF, u_NF, *rest) = ctx.saved_tensors
        t_NR, kept_flat = rest[:3], rest[3:]
        needs = ctx.needs_input_grad  # (plan, x, w_gate, w_up, w_down, a_gate, b_gate, a_up, b_up, a_down, b_down)
        weights = (w_gate, w_up, w_down)
        loras = ((a_gate, b_gate), (a_up, b_up), (a_down, b_down))
        need_w = [needs[2 + m] for m in range(3)]
        need_ab = [(needs[5 + 2 * m], needs[6 + 2 * m]) for m in range(3)]
        # One buffer per weight gradient, filled expert by expert (experts without rows keep zeros).
        grads_w = [torch.zeros_like(w) if need_w[m] else None for m, w in enumerate(weights)]
        grads_ab = [
            tuple(torch.zeros_like(t) if need else None for t, need in zip(loras[m], need_ab[m])) for m in range(3)
        ]
        grad_x_ND = torch.empty_like(x_ND) if needs[1] else None
        grad_y_ND = grad_y_ND.to(dt)
        with _no_autocast(x_ND.device.type):
            kept = iter([tuple(kept_flat[i : i + 3]) for i in range(0, len(kept_flat), 3)])
            for group in plan.groups:
                if plan.bases is None:
                    mats = [(_cast(w_gate[e], cast).t(), _cast(w_up[e], cast).t(), _cast(w_down[e], cast).t()) for e in group]
                else:
                    mats = [next(kept) for _ in group] if plan.keep_bases else plan.bases(group)
                for e, (mg, mu, md) in zip(group, mats):
                    s, t = bounds[e], bounds[e + 1]
                    x_nD = _cast(x_ND[s:t], cast)
                    lo = [(None, None) if A is None else (_cast(A[e], cast), _cast(B[e], cast)) for A, B in loras]
                    g_nF, u_nF = g_NF[s:t], u_NF[s:t]
                    a_nF = F.silu(g_nF)
                    h_nF = a_nF * u_nF
                    gh_terms = _project_backward(grad_y_ND[s:t], h_nF, md, lo[2], plan.scales[2], t_NR[2], s, t, e, 2, grads_w, grads_ab, True)
                    gh_nF = gh_terms[0] if len(gh_terms) == 1 else gh_terms[0] + gh_terms[1]
                    gu_nF = gh_nF * a_nF
                    gg_nF = torch.ops.aten.silu_backward(gh_nF * u_nF, g_nF)
                    # Autograd through the loop runs the up projection's backward first (its nodes are
                    # newer), LoRA term before base term, then the gate's: the input gradient is summed
                    # in that order, each term first cast back to x's dtype (one cast per use under autocast).
                    terms = _project_backward(gu_nF, x_nD, mu, lo[1], plan.scales[1], t_NR[1], s, t, e, 1, grads_w, grads_ab, needs[1])
                    terms += _project_backward(gg_nF, x_nD, mg, lo[0], plan.scales[0], t_NR[0], s, t, e, 0, grads_w, grads_ab, needs[1])
                    if needs[1]:
                        acc = terms[0].to(x_ND.dtype)
                        for term in terms[1:]:
                            acc = acc + term.to(x_ND.dtype)
                        grad_x_ND[s:t] = acc
        return (None, grad_x_ND, *grads_w, *(g for pair in grads_ab for g in pair))


def _project_backward(grad_nO, x_nI, mat2_IO, lora, scale, t_NR, s, t, e, m, grads_w, grads_ab, need_x):
    """Backward of `_project_forward` for expert e, matrix m: writes the weight and LoRA gradients
    into their buffers; returns the input-gradient terms in autograd's order (LoRA term, base term)."""
    terms = []
    A_RI, B_OR = lora
    if grads_w[m] is not None:
        grads_w[m][e] = _mm_grad_mat2(grad_nO, x_nI, mat2_IO)
    if A_RI is not None:
        gz_nO = grad_nO * scale
        t_nR = t_NR[s:t]
        gA, gB = grads_ab[m]
        if gB is not None:
            gB[e] = _mm_grad_mat2(gz_nO, t_nR, B_OR.t())
        gt_nR = _mm_grad_mat1(gz_nO, t_nR, B_OR.t())
        if gA is not None:
            gA[e] = _mm_grad_mat2(gt_nR, x_nI, A_RI.t())
        if need_x:
            terms.append(_mm_grad_mat1(gt_nR, x_nI, A_RI.t()))
    if need_x:
        terms.append(_mm_grad_mat1(grad_nO, x_nI, mat2_IO))
    return terms


# ---------------------------------------------------------------------------------------------
# Entry points


def _compute_dtypes(x: torch.Tensor) -> tuple[torch.dtype, torch.dtype | None]:
    """(the dtype the experts compute in, autocast's dtype or None)."""
    cast = _autocast_dtype(x)
    if cast is None or x.dtype == torch.float64:
        return x.dtype, None
    return cast, cast


def grouped_swiglu_reference(
    x_sorted_ND: torch.Tensor,
    offsets_E1: torch.Tensor,
    w_gate_EFD: torch.Tensor,
    w_up_EFD: torch.Tensor,
    w_down_EDF: torch.Tensor,
) -> torch.Tensor:
    """Rows offsets[e]:offsets[e+1] of x go through expert e:
    (silu(x @ w_gate[e].T) * (x @ w_up[e].T)) @ w_down[e].T. Returns y_sorted_ND."""
    bounds = expert_bounds(offsets_E1, w_gate_EFD.shape[0], x_sorted_ND.shape[0])
    active = [e for e in range(w_gate_EFD.shape[0]) if bounds[e + 1] > bounds[e]]
    if not active:
        return x_sorted_ND.new_zeros((0, w_down_EDF.shape[1])) + 0 * x_sorted_ND.sum()
    dt, cast = _compute_dtypes(x_sorted_ND)
    plan = _Plan(bounds, active, [active], None, (None, None, None), dt, cast)
    return _GroupedSwiGLU.apply(plan, x_sorted_ND, w_gate_EFD, w_up_EFD, w_down_EDF, *([None] * 6))


def grouped_swiglu_lora_reference(
    x_sorted_ND: torch.Tensor,
    offsets_E1: torch.Tensor,
    weights,
    lora=None,
) -> torch.Tensor:
    """Like grouped_swiglu_reference, with each of weights = (gate [E,F,D], up [E,F,D], down [E,D,F])
    dense or NF4Weight, and lora = (gate, up, down) LoRA pairs (each optional) added as
    x @ W.T + scale * (x @ A.T) @ B.T. Computes in x's dtype."""
    l_gate, l_up, l_down = lora if lora is not None else (None, None, None)
    dt = x_sorted_ND.dtype
    w_EOI = [_dense(w, dt) for w in weights]
    E = w_EOI[0].shape[0]
    bounds = expert_bounds(offsets_E1, E, x_sorted_ND.shape[0])
    active = [e for e in range(E) if bounds[e + 1] > bounds[e]]
    if not active:
        return x_sorted_ND.new_zeros((0, w_EOI[2].shape[1])) + 0 * x_sorted_ND.sum()
    ab = [t for lo in (l_gate, l_up, l_down) for t in ((None, None) if lo is None else (lo.A_ERI.to(dt), lo.B_EOR.to(dt)))]
    scales = tuple(None if lo is None else lo.scale for lo in (l_gate, l_up, l_down))
    cdt, cast = _compute_dtypes(x_sorted_ND)
    plan = _Plan(bounds, active, [active], None, scales, cdt, cast)
    return _GroupedSwiGLU.apply(plan, x_sorted_ND, *w_EOI, *ab)


# ---------------------------------------------------------------------------------------------
# The per-expert loops the fast path replaced: autograd through plain ops (the tests' baseline)


def grouped_swiglu_reference_loop(
    x_sorted_ND: torch.Tensor,
    offsets_E1: torch.Tensor,
    w_gate_EFD: torch.Tensor,
    w_up_EFD: torch.Tensor,
    w_down_EDF: torch.Tensor,
) -> torch.Tensor:
    """The per-expert loop that `grouped_swiglu_reference` replaced, autograd through plain ops:
    kept as the baseline the fast path is tested against (slow backward: see the module docstring)."""
    E = w_gate_EFD.shape[0]
    if offsets_E1.numel() != E + 1:
        raise ValueError(f"offsets must have E + 1 = {E + 1} entries, got {offsets_E1.numel()}")
    # One host sync per call: acceptable for a reference, and it lets empty experts be skipped.
    bounds = offsets_E1.tolist()
    if bounds[0] != 0 or bounds[-1] != x_sorted_ND.shape[0]:
        raise ValueError(f"offsets must run from 0 to N = {x_sorted_ND.shape[0]}, got {bounds[0]}..{bounds[-1]}")
    chunks = []
    for e in range(E):
        start, end = bounds[e], bounds[e + 1]
        if end < start:
            raise ValueError(f"offsets must be non-decreasing, got {start} > {end} at expert {e}")
        if end == start:
            continue
        x_nD = x_sorted_ND[start:end]
        h_nF = F.silu(x_nD @ w_gate_EFD[e].T) * (x_nD @ w_up_EFD[e].T)
        chunks.append(h_nF @ w_down_EDF[e].T)
    if not chunks:
        # Keep the result attached to the graph so callers can backpropagate through zero rows.
        return x_sorted_ND.new_zeros((0, w_down_EDF.shape[1])) + 0 * x_sorted_ND.sum()
    return torch.cat(chunks, dim=0)


def grouped_swiglu_lora_reference_loop(
    x_sorted_ND: torch.Tensor,
    offsets_E1: torch.Tensor,
    weights,
    lora=None,
) -> torch.Tensor:
    """The per-expert loop that `grouped_swiglu_lora_reference` replaced (the tests' baseline)."""
    w_gate, w_up, w_down = weights
    l_gate, l_up, l_down = lora if lora is not None else (None, None, None)
    dt = x_sorted_ND.dtype
    wg_EFD, wu_EFD, wd_EDF = (_dense(w, dt) for w in (w_gate, w_up, w_down))
    E = wg_EFD.shape[0]
    if offsets_E1.numel() != E + 1:
        raise ValueError(f"offsets must have E + 1 = {E + 1} entries, got {offsets_E1.numel()}")
    bounds = offsets_E1.tolist()
    chunks = []
    for e in range(E):
        start, end = bounds[e], bounds[e + 1]
        if end == start:
            continue
        x_nD = x_sorted_ND[start:end]
        h_nF = F.silu(_project(x_nD, wg_EFD[e], l_gate, e)) * _project(x_nD, wu_EFD[e], l_up, e)
        chunks.append(_project(h_nF, wd_EDF[e], l_down, e))
    if not chunks:
        return x_sorted_ND.new_zeros((0, wd_EDF.shape[1])) + 0 * x_sorted_ND.sum()
    return torch.cat(chunks, dim=0)


def dequantize_nf4_reference(w: NF4Weight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[E, rows, cols] (the stored layout) in `dtype`: code book value times block scale in fp32, then one rounding to
    `dtype` (what bitsandbytes' dequantize_4bit does)."""
    E, numel = w.num_experts, w.numel_per_expert
    hi_EB = (w.codes_EB >> 4).long()
    lo_EB = (w.codes_EB & 15).long()
    nib_EM = torch.stack([hi_EB, lo_EB], dim=-1).reshape(E, -1)[:, :numel]
    if w.nested:
        # fp32 multiply, then fp32 add: two roundings, as bitsandbytes does (no fused multiply-add).
        scale_EK = w.nested_code_256[w.absmax_EK.long()] * w.nested_absmax_EJ.repeat_interleave(w.nested_blocksize, dim=1)[:, : w.absmax_EK.shape[1]]
        scale_EK = scale_EK + w.offset_E[:, None]
    else:
        scale_EK = w.absmax_EK
    values_EM = w.code_16[nib_EM] * scale_EK.repeat_interleave(w.blocksize, dim=1)[:, :numel]
    return values_EM.to(dtype).reshape(E, *w.shape)


def _dense(w: torch.Tensor | NF4Weight, dtype: torch.dtype) -> torch.Tensor:
    """[E, out, in] in dtype."""
    if isinstance(w, NF4Weight):
        w_E = dequantize_nf4_reference(w, dtype)
        return w_E.transpose(1, 2) if w.transposed else w_E
    return w.to(dtype)


def _project(x_nI: torch.Tensor, w_OI: torch.Tensor, lora: LoRA | None, e: int) -> torch.Tensor:
    out_nO = x_nI @ w_OI.T
    if lora is not None:
        dt = x_nI.dtype
        out_nO = out_nO + lora.scale * ((x_nI @ lora.A_ERI[e].to(dt).T) @ lora.B_EOR[e].to(dt).T)
    return out_nO


def combine_reference(y_SD: torch.Tensor, dest_S: torch.Tensor, dest_row_S: torch.Tensor, buffers: list[torch.Tensor]) -> list[torch.Tensor]:
    """Compute-then-copy combine: row s of y goes to row dest_row_S[s] of buffers[dest_S[s]]
    (one buffer per rank). Writes in place and returns the buffers."""
    for r, buf in enumerate(buffers):
        sel = (dest_S == r).nonzero().flatten()
        if sel.numel():
            buf[dest_row_S[sel].to(buf.device)] = y_SD[sel].to(buf.device, buf.dtype)
    return buffers
