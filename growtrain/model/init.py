"""Parameter initialisation drawn from the CPU generator whatever device the tensor is on, so that
a recipe's seed gives the same initial model on a GPU as on the CPU (CUDA's generator draws other
numbers: before this, a GPU run and its CPU reference started from different models). A tensor on
another device gets its draws through a host copy of that one tensor; a meta tensor draws nothing.
On the CPU these are exactly torch.nn.init's draws."""

from __future__ import annotations

import torch


@torch.no_grad()
def _drawn(t: torch.Tensor, fill) -> torch.Tensor:
    """`fill` (an in-place draw) applied to t where it lives on the CPU, else to a host tensor of
    t's shape and dtype that is then copied into t."""
    if t.device.type == "meta":
        return t
    if t.device.type == "cpu":
        return fill(t)
    return t.copy_(fill(torch.empty(t.shape, dtype=t.dtype)))


def normal_(t: torch.Tensor, mean: float = 0.0, std: float = 1.0) -> torch.Tensor:
    return _drawn(t, lambda u: u.normal_(mean, std))


def uniform_(t: torch.Tensor, a: float = 0.0, b: float = 1.0) -> torch.Tensor:
    return _drawn(t, lambda u: u.uniform_(a, b))
