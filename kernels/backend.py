"""The `triton` expert backends, ready to register, and the check that decides whether Triton can
run. Where it cannot, the call logs why (once per reason) and runs the PyTorch reference instead:
never silently. Triton itself is imported only when a backend is first called, so importing this
module stays cheap and works without Triton installed.

Legend: N rows sorted by expert, D d_model, F expert hidden, E experts, E1 = E + 1 offsets.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys

import torch

from . import grouped_torch
from .reference import grouped_swiglu_lora_reference
from .weights import LoRA, NF4Weight

log = logging.getLogger("growtrain.kernels")
_reported: set[str] = set()


def _interpret_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() not in ("", "0", "false", "no", "off")


def triton_unavailable_reason(device: torch.device | str) -> str | None:
    """None when the Triton kernels can run on tensors of `device`; otherwise why not."""
    device = torch.device(device)
    try:
        found = importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):  # ValueError: a module entry without a spec
        found = False
    if not found:
        return "triton is not installed"
    if device.type == "cuda":
        return None
    if device.type != "cpu":
        return f"Triton kernels do not run on {device.type} tensors"
    if not _interpret_enabled():
        return "tensors are on the CPU and TRITON_INTERPRET=1 is not set (compiled Triton needs a CUDA GPU)"
    grouped = sys.modules.get(f"{__package__}.grouped")
    if grouped is not None and type(grouped._grouped_mm_kernel).__name__ != "InterpretedFunction":
        return "the kernels were imported before TRITON_INTERPRET=1 was set (set it before the first import)"
    return None


def triton_route(device: torch.device | str, dtype: torch.dtype) -> str:
    """What the `triton` backend's expert products run on for this device and compute dtype (logged
    at start): torch._grouped_mm where it runs (grouped_torch.gemm_unavailable_reason), NF4 bases
    dequantized first on a GPU (grouped.resolve_nf4_decode); the Triton kernels otherwise."""
    device = torch.device(device)
    if triton_unavailable_reason(device) is not None:
        return "products by the PyTorch reference (Triton cannot run here)"
    probe = torch.empty(0, device=device, dtype=dtype)
    reason = grouped_torch.gemm_unavailable_reason(probe, [], []) if device.type == "cuda" else "not a GPU"
    nf4 = "NF4 bases dequantized first" if device.type == "cuda" else "NF4 decoded inside the kernel"
    if reason is None:
        return f"products by torch._grouped_mm ({str(dtype).replace('torch.', '')}; Triton where D or F is not a multiple of 16 bytes; LoRA ranks padded), {nf4}"
    return f"products by triton kernels ({reason}), {nf4}"


def _fallback(reason: str, name: str) -> None:
    if reason not in _reported:
        _reported.add(reason)
        log.warning("expert backend %r: %s; running the PyTorch reference instead", name, reason)


def triton_expert_backend(x_sorted_ND, offsets_E1, w_gate_EFD, w_up_EFD, w_down_EDF, lora=None):
    """Same signature as `reference.grouped_swiglu_reference` (plus optional (gate, up, down) LoRA);
    weights dense tensors or NF4Weight. Register as EXPERT_BACKENDS["triton"]."""
    weights = (w_gate_EFD, w_up_EFD, w_down_EDF)
    reason = triton_unavailable_reason(x_sorted_ND.device)
    if reason is not None:
        _fallback(reason, "triton")
        return grouped_swiglu_lora_reference(x_sorted_ND, offsets_E1, weights, lora)
    from .grouped import grouped_swiglu

    return grouped_swiglu(x_sorted_ND, offsets_E1, weights, lora)


def nf4_lora_weights(experts) -> tuple[tuple[NF4Weight, NF4Weight, NF4Weight], tuple[LoRA, LoRA, LoRA]]:
    """Kernel containers from growtrain's `NF4LoRAExperts` (kernels/nf4_reference.py), read by field
    name: gate/up/down NF4 stacks (down stored transposed, [F, D]) and gate_lora/up_lora/down_lora
    pairs (A [E, r, in], B [E, out, r], scale). Views, no copies, where already contiguous."""
    weights = (
        NF4Weight.from_stack(experts.gate),
        NF4Weight.from_stack(experts.up),
        NF4Weight.from_stack(experts.down, transposed=True),
    )
    loras = tuple(
        None if lo is None else LoRA(lo.A_ERI, lo.B_EOR, float(lo.scale))
        for lo in (experts.gate_lora, experts.up_lora, experts.down_lora)
    )
    return weights, loras


def triton_nf4_expert_backend(x_sorted_ND, offsets_E1, experts):
    """(x_sorted_ND, offsets_E1, NF4LoRAExperts) -> y_sorted_ND, with NF4 decoded inside the
    kernel. Register as NF4_EXPERT_BACKENDS["triton"]."""
    weights, loras = nf4_lora_weights(experts)
    reason = triton_unavailable_reason(x_sorted_ND.device)
    if reason is not None:
        _fallback(reason, "triton")
        return grouped_swiglu_lora_reference(x_sorted_ND, offsets_E1, weights, loras)
    from .grouped import grouped_swiglu

    return grouped_swiglu(x_sorted_ND, offsets_E1, weights, loras)
