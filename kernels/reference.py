"""Pure-PyTorch reference of the grouped expert SwiGLU: the ground truth the Triton kernel is tested
against, and the CPU backend. Autograd flows through ordinary ops.

Legend: N rows (token-slots, sorted by expert), D d_model, E experts, F expert hidden width,
E1 = E + 1 offsets.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


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
