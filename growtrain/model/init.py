"""Parameter initialisation drawn from the CPU generator whatever device the tensor is on, so that
a recipe's seed gives the same initial model on a GPU as on the CPU (CUDA's generator draws other
numbers: before this, a GPU run and its CPU reference started from different models). A tensor on
another device gets its draws through a host copy of that one tensor; a meta tensor draws nothing.
On the CPU these are exactly torch.nn.init's draws."""

from __future__ import annotations

import torch


@torch.no_grad()
def normal_(t: torch.Tensor, mean: float = 0.0, std: float = 1.0) -> torch.Tensor:
    if t.device.type == "meta":
        return t
    if t.device.type == "cpu":
        return t.normal_(mean, std)
    return t.copy_(torch.empty(t.shape, dtype=t.dtype).normal_(mean, std))


@torch.no_grad()
def uniform_(t: torch.Tensor, a: float = 0.0, b: float = 1.0) -> torch.Tensor:
    if t.device.type == "meta":
        return t
    if t.device.type == "cpu":
        return t.uniform_(a, b)
    return t.copy_(torch.empty(t.shape, dtype=t.dtype).uniform_(a, b))
