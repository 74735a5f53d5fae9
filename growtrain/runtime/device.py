"""Where a run computes and what it ran with: the training device (train.device), deterministic
kernels (train.deterministic), the GPU's peak for the utilisation figure, and the environment a run
logs at its start (STYLE.md item 12)."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

import torch

from growtrain.kernels.backend import triton_route
from growtrain.parallel.distributed import Dist
from growtrain.recipe import Recipe, RecipeError


def resolve_device(setting: str, dist: Dist) -> torch.device:
    """train.device: auto is cuda:LOCAL_RANK where CUDA is available (under NCCL, the process
    group's device), else the CPU."""
    if setting == "cpu":
        if dist.active and dist.device.type != "cpu":
            raise RecipeError([f"train.device: cpu, but the process group runs on {dist.device} (NCCL); use auto or cuda"])
        return torch.device("cpu")
    if setting == "cuda" and not torch.cuda.is_available():
        raise RecipeError(["train.device: cuda, but no CUDA device is available here; use auto or cpu"])
    if setting == "cuda" or (setting == "auto" and torch.cuda.is_available()):
        if dist.active and dist.device.type == "cuda":
            return dist.device
        index = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def use_deterministic_kernels() -> None:
    """train.deterministic: the same bits from the same state on a GPU. cuBLAS needs a fixed
    workspace for that (read when its first handle is made, so set before the first matmul). Not
    warn_only: with it, memory-efficient attention keeps its non-deterministic backward (it only
    warns, seen on an H200); strict, it takes its deterministic one, and an op with no
    deterministic version fails naming itself."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)


def gpu_peak_tflops(device: torch.device) -> float | None:
    """Dense bf16 peak of a GPU the planner has a preset for (by name), else None."""
    if device.type != "cuda":
        return None
    from growtrain.planning import PRESETS

    name = torch.cuda.get_device_name(device).lower()
    for key, hw in PRESETS.items():
        if key.split("-")[0] in name:
            return hw.peak_tflops
    return None


def environment(device: torch.device | None = None) -> dict:
    """What ran: code version, package versions, device (STYLE.md item 12)."""
    try:
        commit = subprocess.run(
            ["git", "describe", "--always", "--dirty"], cwd=Path(__file__).parent, capture_output=True, text=True, timeout=5
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    device = device or torch.device("cpu")
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        device = f"{device} ({props.name}, {props.total_memory / 2**30:.0f} GiB; {torch.cuda.device_count()} GPU(s) visible)"
    else:
        device = f"cpu ({torch.get_num_threads()} threads)"
    return {"code": commit or "unknown", "python": platform.python_version(), "torch": torch.__version__, "device": device}


def model_lines(recipe: Recipe, backend: str, device: torch.device) -> list[str]:
    """What a run logs about how its model computes: the expert backend, residual blocks' backward,
    and the Triton route."""
    lines = [f"expert backend: {backend} (train.expert_backend: {recipe.train.expert_backend})"]
    if recipe.model.block == "residual":
        lines.append("model: residual blocks, " + (
            "each checkpointed (model.reversible: residual blocks are not invertible; each block's input is kept and the "
            "block recomputed in backward with the forward's routing)" if recipe.model.reversible else "plain autograd (model.reversible: false)"))
    if backend == "triton":
        lines.append(f"  {triton_route(device, torch.bfloat16 if recipe.train.precision == 'bf16' else torch.float32)}")
    return lines
