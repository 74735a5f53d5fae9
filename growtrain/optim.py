"""AdamW whose state is keyed by parameter *name*, with per-parameter LR, weight-decay and epsilon
multipliers.

Names, not parameter objects, because growth replaces modules: an operator maps old names to new
ones and transforms each moment by DESIGN.md §7's rule (a scaled copy β·p of p, with S the sum of β
over p's copies, gets m/S, v/S², LR ×β, weight decay ×1/β and epsilon ×1/S), so that one step after
growth moves the function as the same step before it would have. A multiplier is a float or a
tensor shaped like its parameter. Plain tensor ops only: bitwise deterministic on CPU.

Two per-element refinements keep growth's dynamics:
- `step` may be an integer tensor shaped like the parameter: elements that joined an existing
  tensor fresh (new neurons, new heads) count their own steps, so Adam's bias correction treats
  them as a fresh parameter (zero moments under the tensor's copied step count would make their
  first updates ~0.45x normal at beta2 = 0.95, and several times too large at beta2 = 0.999).
- `norm_mult` weighs each element's squared gradient in the global clipping norm. A copy among
  others carries S·β, so the norm of a grown model's gradient equals the ungrown one's and
  clipping scales the step exactly as it would have before growth.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from growtrain.recipe import OptimizerConfig


@dataclass
class ParamState:
    step: int
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    lr_mult: float | torch.Tensor = 1.0
    wd_mult: float | torch.Tensor = 1.0
    eps_mult: float | torch.Tensor = 1.0
    norm_mult: float | torch.Tensor = 1.0  # weight of this parameter's squared gradient in the clip norm

    @classmethod
    def fresh(cls, p: torch.Tensor, decay: bool) -> "ParamState":
        return cls(0, torch.zeros_like(p, dtype=torch.float32), torch.zeros_like(p, dtype=torch.float32), 1.0, 1.0 if decay else 0.0, 1.0)


def decays(name: str, p: torch.Tensor) -> bool:
    """Matrices decay; norm weights, biases and the selection bias do not."""
    return p.ndim >= 2


class AdamW:
    def __new__(cls, *args, **kwargs):
        # optimizer.dense_state_bits: 8 builds the variant with 8-bit dense moments (growtrain/optim8bit.py).
        cfg = kwargs.get("cfg", args[1] if len(args) > 1 else None)
        if cls is AdamW and getattr(cfg, "dense_state_bits", 32) == 8:
            from growtrain.optim8bit import AdamW8bit

            return super().__new__(AdamW8bit)
        return super().__new__(cls)

    def __init__(self, named_params: dict[str, nn.Parameter], cfg: OptimizerConfig):
        self.cfg = cfg
        self.params: dict[str, nn.Parameter] = {}
        self.state: dict[str, ParamState] = {}
        self.rebind(named_params)

    def rebind(self, named_params: dict[str, nn.Parameter], state: dict[str, ParamState] | None = None) -> None:
        """Point at a (possibly grown) model's parameters. With `state`, it must cover exactly the
        trainable names: a missing or stray entry is an error, never silently fresh state."""
        self.params = {n: p for n, p in named_params.items() if p.requires_grad}
        if state is None:
            state = {n: self.state.get(n) or ParamState.fresh(p, decays(n, p)) for n, p in self.params.items()}
        missing = sorted(set(self.params) - set(state))
        stray = sorted(set(state) - set(self.params))
        if missing or stray:
            raise ValueError(f"optimizer state does not match the model: missing {missing[:5]}, stray {stray[:5]}")
        for n, p in self.params.items():
            if state[n].exp_avg.shape != p.shape:
                raise ValueError(f"optimizer state of {n} has shape {tuple(state[n].exp_avg.shape)}, parameter {tuple(p.shape)}")
        self.state = state

    def zero_grad(self) -> None:
        for p in self.params.values():
            p.grad = None

    @torch.no_grad()
    def step(self, lr: float) -> None:
        b1, b2 = self.cfg.beta1, self.cfg.beta2
        for name, p in self.params.items():
            if p.grad is None:
                continue
            s = self.state[name]
            s.step += 1  # an int, or an integer tensor of per-element counts
            g = p.grad.float()
            s.exp_avg.mul_(b1).add_(g, alpha=1 - b1)
            s.exp_avg_sq.mul_(b2).addcmul_(g, g, value=1 - b2)
            bc1 = 1 - b1**s.step
            bc2 = 1 - b2**s.step
            lr_p = lr * s.lr_mult  # float or tensor
            decay = lr_p * self.cfg.weight_decay * s.wd_mult
            denom = (s.exp_avg_sq / bc2).sqrt_().add_(self.cfg.eps * s.eps_mult)
            update = (s.exp_avg / bc1) / denom
            p32 = p.float()
            p32.mul_(1 - decay)
            p32.sub_(update * lr_p)
            p.copy_(p32)

    def state_dict(self) -> dict:
        return {
            name: {
                "step": s.step,
                "exp_avg": s.exp_avg,
                "exp_avg_sq": s.exp_avg_sq,
                "lr_mult": s.lr_mult,
                "wd_mult": s.wd_mult,
                "eps_mult": s.eps_mult,
                "norm_mult": s.norm_mult,
            }
            for name, s in self.state.items()
        }

    def load_state_dict(self, d: dict) -> None:
        self.rebind(self.params, {n: ParamState(**v) for n, v in d.items()})

    def clip_grad_norm(self, max_norm: float, sum_squares=None) -> float:
        """clip_grad_norm over this optimizer's parameters, each weighted by its `norm_mult`.
        sum_squares: see clip_grad_norm (sharded optimizer state: the other ranks' shares)."""
        names = list(self.params)
        return clip_grad_norm([self.params[n] for n in names], max_norm, [self.state[n].norm_mult for n in names], sum_squares)


def clip_grad_norm(params: list[torch.Tensor], max_norm: float, weights: list | None = None, sum_squares=None) -> float:
    """Global L2 norm of the gradients (returned before clipping); clips in place when max_norm > 0.

    weights: per parameter, a float or a tensor shaped like it, multiplying its squared gradient
    (1 everywhere: the plain norm, computed exactly as without weights).
    sum_squares: when these parameters are one rank's share, a function turning the local squared
    norm into the global one (distributed.Dist.sum_squares); every rank then clips by the same factor."""
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


def _clip(grads: list[torch.Tensor], max_norm: float, total: float) -> None:
    if max_norm > 0 and math.isfinite(total) and total > max_norm:
        scale = max_norm / (total + 1e-6)
        for g in grads:
            g.mul_(scale)


def _weighted_norm(g: torch.Tensor, weight) -> torch.Tensor:
    if isinstance(weight, torch.Tensor):
        return (weight.to(g.dtype) * g * g).sum().sqrt()
    norm = torch.linalg.vector_norm(g)
    return norm if weight == 1.0 else norm * math.sqrt(weight)
