"""The expert backends: for each expert format (full precision, NF4 + LoRA), the functions that
run a layer's experts over its sorted tokens, by name ("reference": PyTorch; "triton": the kernels),
and what `train.expert_backend` accepts. Its own module because both expert types use it
(model/moe.py's full-precision `Experts`, model/nf4.py's `NF4Experts`).

Shape legend: N sorted token rows, D model width, F expert hidden, E experts.
"""

from __future__ import annotations

import difflib
from typing import Callable

import torch

from growtrain.kernels.backend import triton_expert_backend, triton_nf4_expert_backend, triton_unavailable_reason
from growtrain.kernels.nf4_reference import NF4LoRAExperts, grouped_swiglu_nf4_lora_reference
from growtrain.kernels.reference import grouped_swiglu_reference

ExpertBackend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
NF4ExpertBackend = Callable[[torch.Tensor, torch.Tensor, NF4LoRAExperts], torch.Tensor]

# Signature: (x_sorted_ND, offsets_E1 int64, w_gate_EFD, w_up_EFD, w_down_EDF) -> y_sorted_ND.
# "triton" imports Triton on first use; where it cannot run (not installed, CPU without
# TRITON_INTERPRET=1) it logs why on the `growtrain.kernels` logger and runs the reference.
EXPERT_BACKENDS: dict[str, ExpertBackend] = {
    "reference": grouped_swiglu_reference,
    "triton": triton_expert_backend,
}

# Signature: (x_sorted_ND, offsets_E1 int64, NF4LoRAExperts) -> y_sorted_ND.
NF4_EXPERT_BACKENDS: dict[str, NF4ExpertBackend] = {
    "reference": grouped_swiglu_nf4_lora_reference,
    "triton": triton_nf4_expert_backend,
}


def expert_backends(expert_format: str = "full") -> dict:
    """The backend registry of an expert format ('full' or 'nf4')."""
    if expert_format not in ("full", "nf4"):
        raise ValueError(f"unknown expert format {expert_format!r}; valid: full, nf4")
    return NF4_EXPERT_BACKENDS if expert_format == "nf4" else EXPERT_BACKENDS


def get_expert_backend(name: str, expert_format: str = "full"):
    registry = expert_backends(expert_format)
    try:
        return registry[name]
    except KeyError:
        valid = ", ".join(sorted(registry))
        what = "" if expert_format == "full" else f"{expert_format} "
        raise ValueError(f"unknown {what}expert backend {name!r}; valid names: {valid}") from None


def expert_backend_settings() -> list[str]:
    """What train.expert_backend accepts: 'auto', or a backend that every expert format has (one
    setting serves the whole run, whose experts may turn NF4 at a stage boundary)."""
    return ["auto"] + [name for name in EXPERT_BACKENDS if name in NF4_EXPERT_BACKENDS]


def expert_backend_setting_problem(setting) -> str | None:
    """None for a valid train.expert_backend; otherwise what is wrong, with the valid names."""
    valid = expert_backend_settings()
    if setting in valid:
        return None
    near = difflib.get_close_matches(str(setting), valid, n=1)
    hint = f"; did you mean '{near[0]}'?" if near else ""
    return f"unknown expert backend '{setting}'{hint} (valid: {', '.join(valid)})"


def resolve_expert_backend(setting: str, device: torch.device | str) -> str:
    """The backend name that train.expert_backend means for experts on `device`. auto: the Triton
    kernels (full precision, and NF4 + LoRA fused) on a CUDA device where Triton can run, the
    PyTorch reference elsewhere. An explicit name is kept as it is: 'triton' on the CPU runs the
    reference and logs why at its first call (growtrain/kernels/backend.py), as before."""
    problem = expert_backend_setting_problem(setting)
    if problem is not None:
        raise ValueError(f"train.expert_backend: {problem}")
    if setting != "auto":
        return setting
    device = torch.device(device)
    return "triton" if device.type == "cuda" and triton_unavailable_reason(device) is None else "reference"
