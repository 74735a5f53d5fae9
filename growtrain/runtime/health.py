"""Non-finite values: which tensors hold a NaN or an infinity (one host sync for all of them), and
the error that stops a run on them (exit 4)."""

from __future__ import annotations

import torch


class TrainingDiverged(Exception):
    """Too many consecutive non-finite steps; no checkpoint of the bad state was written."""


def finite_flags(tensors: list[torch.Tensor]) -> torch.Tensor:
    """One bool per tensor, on the device: no NaN or infinity in it (no host sync)."""
    return torch.stack([t.isfinite().all() for t in tensors])


def nonfinite_tensors(named) -> list[str]:
    """Names of the floating-point tensors holding a NaN or an infinity (one host sync for all)."""
    named = [(n, t) for n, t in named if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel()]
    if not named:
        return []
    finite = finite_flags([t for _, t in named]).tolist()
    return [n for (n, _), ok in zip(named, finite) if not ok]


def tensors_in(obj, prefix: str):
    """(name, tensor) pairs of a nested dict/list (optimizer state)."""
    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from tensors_in(v, f"{prefix}.{k}")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from tensors_in(v, f"{prefix}.{i}")


def nonfinite_count(model, dist, device: torch.device) -> torch.Tensor:
    """How many parameters hold a NaN or an infinity, over all ranks, as a device tensor (no
    host sync). Finite gradients can still give non-finite weights (an LR or multiplier that
    overflows the update); undoing the update would need a second copy of the weights and
    optimizer state, so such a step stops the run before anything of it is checkpointed."""
    params = [p for p in model.parameters() if p.is_floating_point() and p.numel() and not p.is_meta]
    if not params:  # a rank without any (an AF expert rank in a dense stage) still takes part in the sum
        return dist.sum_tensor(torch.zeros((), dtype=torch.float64, device=dist.device if dist.active else device))
    return dist.sum_tensor(finite_flags(params).logical_not().sum().double())


def bad_update(model, step: int, stage_name: str) -> TrainingDiverged:
    """The error for an update that made parameters non-finite (nonfinite_count > 0 on some rank)."""
    bad = nonfinite_tensors(model.named_parameters())
    where = f" (first: {bad[0]})" if bad else " (on another rank)"
    return TrainingDiverged(
        f"the update of step {step} (stage '{stage_name}') made parameters non-finite{where}, from finite "
        "gradients: the learning rate or a multiplier overflows it. No checkpoint of this state was written: "
        "resume restarts from the last good one. Lower the LR."
    )
