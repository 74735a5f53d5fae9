"""The optimizer's update and clip norm as growtrain computed them before the fused paths (issue 16):
one tensor at a time, in Python. The tests hold the new paths against these: bitwise where the
arithmetic is meant to be unchanged, within fp32 rounding where a fused kernel orders it
differently. Frozen copies: do not "fix" them along with growtrain/optim/adamw.py."""

from __future__ import annotations

import math

import torch


@torch.no_grad()
def reference_step(params: dict, states: dict, lr: float, cfg) -> None:
    """AdamW.step of growtrain/optim/adamw.py before issue 16, over name -> parameter / ParamState."""
    b1, b2 = cfg.beta1, cfg.beta2
    for name, p in params.items():
        if p.grad is None:
            continue
        s = states[name]
        s.step += 1
        g = p.grad.float()
        s.exp_avg.mul_(b1).add_(g, alpha=1 - b1)
        s.exp_avg_sq.mul_(b2).addcmul_(g, g, value=1 - b2)
        bc1 = 1 - b1**s.step
        bc2 = 1 - b2**s.step
        lr_p = lr * s.lr_mult
        decay = lr_p * cfg.weight_decay * s.wd_mult
        denom = (s.exp_avg_sq / bc2).sqrt_().add_(cfg.eps * s.eps_mult)
        update = (s.exp_avg / bc1) / denom
        p32 = p.float()
        p32.mul_(1 - decay)
        p32.sub_(update * lr_p)
        p.copy_(p32)


def reference_clip_grad_norm(params: list, max_norm: float, weights: list | None = None, sum_squares=None) -> float:
    """growtrain.optim.adamw.clip_grad_norm before issue 16."""
    weights = weights if weights is not None else [1.0] * len(params)
    pairs = [(p.grad, w) for p, w in zip(params, weights) if p.grad is not None]
    if sum_squares is not None:
        local = torch.stack([_weighted_norm(g.float(), w) for g, w in pairs]).double().pow(2).sum() if pairs else torch.zeros((), dtype=torch.float64)
        total = sum_squares(local).sqrt().item()
        _clip([g for g, _ in pairs], max_norm, total)
        return total
    if not pairs:
        return 0.0
    grads = [g for g, _ in pairs]
    total = torch.linalg.vector_norm(torch.stack([_weighted_norm(g.float(), w) for g, w in pairs])).item()
    _clip(grads, max_norm, total)
    return total


def _clip(grads, max_norm, total):
    if max_norm > 0 and math.isfinite(total) and total > max_norm:
        scale = max_norm / (total + 1e-6)
        for g in grads:
            g.mul_(scale)


def _weighted_norm(g, weight):
    if isinstance(weight, torch.Tensor):
        return (weight.to(g.dtype) * g * g).sum().sqrt()
    norm = torch.linalg.vector_norm(g)
    return norm if weight == 1.0 else norm * math.sqrt(weight)


def roundings(got: torch.Tensor, want: torch.Tensor, scale: float | torch.Tensor = 0.0) -> float:
    """Largest |got - want| in fp32 epsilons of |want| + scale (0 when bitwise equal). `scale`: the
    size of what was added to the tensor (for a parameter, the sum of the LRs it stepped with: an
    Adam update is O(lr) per element), so that rounding the update counts as rounding too."""
    got, want = got.double(), want.double()
    return ((got - want).abs() / (torch.finfo(torch.float32).eps * (want.abs() + scale))).max().item()
