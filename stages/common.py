"""Helpers shared by the operators: building the grown model strictly from a full state dict."""

from __future__ import annotations

import torch

from growtrain.model import GrowLM
from growtrain.model.config import ModelConfig


def materialize(cfg: ModelConfig, state: dict[str, torch.Tensor]) -> GrowLM:
    """The model of shape `cfg` holding exactly `state`: built on the meta device and loaded with
    strict=True, so a missing, renamed or stray key fails here instead of leaving a parameter at
    its random init (a pitfall of real growth runs)."""
    with torch.device("meta"):
        model = GrowLM(cfg)
    model.load_state_dict(state, strict=True, assign=True)
    return model


def fresh_state(cfg: ModelConfig, like: GrowLM) -> dict[str, torch.Tensor]:
    """A freshly initialized state dict of shape `cfg`, drawn from the current (seeded) RNG on the
    CPU (same draws whatever the device), then put on `like`'s device and dtype."""
    ref = next(like.parameters())
    return {k: v.to(device=ref.device, dtype=ref.dtype if v.is_floating_point() else v.dtype) for k, v in GrowLM(cfg).state_dict().items()}
