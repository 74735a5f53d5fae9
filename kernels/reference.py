"""Pure-PyTorch references of the expert kernels: the ground truth the Triton kernels are tested
against, and the CPU backend. Autograd flows through ordinary ops. No Triton here.

Legend: N rows (token-slots, sorted by expert), D d_model, E experts, F expert hidden width,
E1 = E + 1 offsets, R ranks, r LoRA rank.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .weights import LoRA, NF4Weight


def grouped_swiglu_reference(
    x_sorted_ND: torch.Tensor,
    offsets_E1: torch.Tensor,
    w_gate_EFD: torch.Tensor,
    w_up_EFD: torch.Tensor,
    w_down_EDF: torch.Tensor,
) -> torch.Tensor:
    """Rows offsets[e]:offsets[e+1] of x go through expert e:
    (silu(x @ w_gate[e].T) * (x @ w_up[e].T)) @ w_down[e].T. Returns y_sorted_ND."""
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


def grouped_swiglu_lora_reference(
    x_sorted_ND: torch.Tensor,
    offsets_E1: torch.Tensor,
    weights,
    lora=None,
) -> torch.Tensor:
    """Like grouped_swiglu_reference, with each of weights = (gate [E,F,D], up [E,F,D], down [E,D,F])
    dense or NF4Weight, and lora = (gate, up, down) LoRA pairs (each optional) added as
    x @ W.T + scale * (x @ A.T) @ B.T. Computes in x's dtype."""
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


def combine_reference(y_SD: torch.Tensor, dest_S: torch.Tensor, dest_row_S: torch.Tensor, buffers: list[torch.Tensor]) -> list[torch.Tensor]:
    """Compute-then-copy combine: row s of y goes to row dest_row_S[s] of buffers[dest_S[s]]
    (one buffer per rank). Writes in place and returns the buffers."""
    for r, buf in enumerate(buffers):
        sel = (dest_S == r).nonzero().flatten()
        if sel.numel():
            buf[dest_row_S[sel].to(buf.device)] = y_SD[sel].to(buf.device, buf.dtype)
    return buffers
