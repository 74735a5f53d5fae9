"""AdamW whose state is keyed by parameter *name*, with per-parameter LR, weight-decay and epsilon
multipliers; and its config, `OptimizerConfig` (the recipe's `optimizer` section).

Names, not parameter objects, because growth replaces modules: an operator maps old names to new
ones and transforms each moment by DESIGN.md §7's rule (a scaled copy β·p of p, with S the sum of β
over p's copies, gets m/S, v/S², LR ×β, weight decay ×1/β and epsilon ×1/S), so that one step after
growth moves the function as the same step before it would have. A multiplier is a float or a
tensor that broadcasts to its parameter: its shape, or size 1 along the dims (after the first)
where it does not vary, as growth keeps them (stages/transition.compact_fields: a redrawn
neuron's fields are [E, F, 1], not [E, F, D]). The update broadcasts them, with the same values
element by element as at full size.

Two per-element refinements keep growth's dynamics:
- `step` may be an integer tensor (broadcasting to the parameter, like a multiplier): elements that joined an existing
  tensor fresh (new neurons, new heads) count their own steps, so Adam's bias correction treats
  them as a fresh parameter (zero moments under the tensor's copied step count would make their
  first updates ~0.45x normal at beta2 = 0.95, and several times too large at beta2 = 0.999).
- `norm_mult` weighs each element's squared gradient in the global clipping norm. A copy among
  others carries S·β, so the norm of a grown model's gradient equals the ungrown one's and
  clipping scales the step exactly as it would have before growth.

The update (`adamw_step`) takes one of two paths per tensor, both deterministic on CPU:
- fused: fp32 tensors whose multipliers are floats and whose step is an int go, grouped by their
  multipliers, through torch's fused AdamW kernel (`torch._fused_adamw_`, what
  `torch.optim.AdamW(fused=True)` runs) with lr·lr_mult, weight_decay·wd_mult and eps·eps_mult:
  one pass over memory instead of about twelve. Same formula, other rounding order (it divides
  sqrt(v) by sqrt(1 - beta2^t) and m by 1 - beta1^t in one factor, and updates m by lerp), so it
  matches the element-by-element update within fp32 rounding, not bitwise
  (tests/test_optim.py);
- exact: everything else (tensor multipliers, per-element steps, other dtypes), the
  element-by-element update growtrain always ran, moments through `torch._foreach_*`: per-element
  multipliers and step counts enter exactly as DESIGN.md §7 states them.
"""

from __future__ import annotations

import math
import dataclasses
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import nn

# Devices whose torch build has the fused AdamW kernel that `adamw_step` uses.
FUSED_DEVICES = ("cpu", "cuda")


@dataclass(frozen=True)
class OptimizerConfig:
    """AdamW over all trainable parameters, with per-parameter LR/weight-decay multipliers."""

    name: Literal["adamw"] = field(default="adamw", metadata={"doc": "Optimizer (registry name)."})
    lr: float = field(default=3e-3, metadata={"doc": "Base peak LR (stages may override with schedule.peak_lr).", "gt": 0.0})
    beta1: float = field(default=0.9, metadata={"doc": "Adam beta1.", "ge": 0.0, "lt": 1.0})
    beta2: float = field(default=0.95, metadata={"doc": "Adam beta2.", "ge": 0.0, "lt": 1.0})
    eps: float = field(default=1e-8, metadata={"doc": "Adam epsilon.", "gt": 0.0})
    weight_decay: float = field(
        default=0.1, metadata={"doc": "Decoupled weight decay on matrices (norm weights are not decayed).", "ge": 0.0}
    )
    grad_clip: float = field(default=1.0, metadata={"doc": "Global gradient-norm clip; 0 disables.", "ge": 0.0})
    max_bad_steps: int = field(
        default=3,
        metadata={"doc": "Consecutive non-finite steps skipped before the run stops (no checkpoint of a bad state).", "ge": 0},
    )
    dense_state_bits: Literal[32, 8] = field(
        default=32,
        metadata={
            "doc": "Bits per Adam moment of the dense parts: 8 stores them blockwise-quantized as bitsandbytes' 8-bit "
            "optimizers do (blocks of 256, dynamic map; ~2.03 instead of 8 bytes per parameter) for every trainable "
            "tensor of >= 4096 elements except the experts' LoRA adapters, the routers and the token embeddings (a stacked "
            "expert tensor only where each expert fills whole blocks of 256). Every layout: under expert parallelism and in "
            "the AF layout each ZeRO-1 owner holds the codes of its entries, and growth moves them with the entry."
        },
    )


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

    def has_scalar_schedule(self) -> bool:
        """One int step and float multipliers: the whole tensor steps alike (a fused kernel can take it)."""
        return isinstance(self.step, int) and not any(isinstance(m, torch.Tensor) for m in (self.lr_mult, self.wd_mult, self.eps_mult))


def to_device(obj, device: torch.device):
    """Every tensor in `obj` moved to `device`: a tensor, or nested dicts, lists, tuples and
    dataclasses (ParamState, 8-bit moments) of them (optimizer state from a checkpoint, or moved
    for growth on the host)."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, dict):
        return {k: to_device(v, device) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_device(v, device) for v in obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{f.name: to_device(getattr(obj, f.name), device) for f in dataclasses.fields(obj) if f.init})
    return obj


def decays(name: str, p: torch.Tensor) -> bool:
    """Matrices decay; norm weights, biases and the selection bias do not."""
    return p.ndim >= 2


class AdamW:
    """Name-keyed AdamW with 32-bit moments. Build it (or its 8-bit variant) from the config with
    growtrain.optim.registry.build_optimizer."""

    state_bits = 32  # the cfg.dense_state_bits this class implements

    def __init__(self, named_params: dict[str, nn.Parameter], cfg: OptimizerConfig):
        bits = getattr(cfg, "dense_state_bits", 32)
        if bits != self.state_bits:
            raise ValueError(
                f"{type(self).__name__} keeps {self.state_bits}-bit moments but the config asks for dense_state_bits={bits}: "
                "build the optimizer with growtrain.optim.registry.build_optimizer(named_params, cfg)"
            )
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

    def _stored(self) -> dict[str, ParamState]:
        """The states as held (subclasses may hold them packed); multipliers are read from here."""
        return self.state

    @torch.no_grad()
    def to(self, device: torch.device | str) -> None:
        """Every state tensor moved to `device`, entry by entry (each old copy freed as the next
        moves): growth on the host, and back to the GPU after it."""
        stored = self._stored()
        for name in list(stored):
            stored[name] = to_device(stored[name], torch.device(device))

    def zero_grad(self) -> None:
        for p in self.params.values():
            p.grad = None

    @torch.no_grad()
    def step(self, lr: float) -> None:
        adamw_step([(p, self.state[n]) for n, p in self.params.items() if p.grad is not None], lr, self.cfg)

    @contextmanager
    def ramped(self, since: int, factor: float):
        """Within it, the LR of every element whose step count is at most `since` is × `factor`:
        `since` steps into a stage, those are the elements that took no step before the stage
        (what its growth created fresh, or everything after `fresh.state: fresh`), whose LR the
        recipe's `stages.N.fresh.warmup_steps` ramps. The rule reads the step counts alone, so a
        resumed run ramps the same elements. The multipliers are restored on the way out. No host
        sync: a per-element count gives a per-element multiplier (those tensors already take the
        element-by-element update), an int count a float one."""
        saved = {}
        stored = self._stored()
        for name in self.params:
            s = stored[name]
            if isinstance(s.step, torch.Tensor):
                saved[name] = s.lr_mult
                s.lr_mult = torch.where(s.step <= since, s.lr_mult * factor, s.lr_mult).to(torch.float32)
            elif s.step <= since:
                saved[name] = s.lr_mult
                s.lr_mult = s.lr_mult * factor
        try:
            yield
        finally:
            stored = self._stored()  # a step may have replaced an entry (the 8-bit optimizer's repacking)
            for name, mult in saved.items():
                stored[name].lr_mult = mult

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
        return float(self.clip_grad_norm_(max_norm, sum_squares))

    def clip_grad_norm_(self, max_norm: float, sum_squares=None) -> torch.Tensor:
        """The same without a host sync: the norm as a 0-dim tensor on the parameters' device."""
        names, stored = list(self.params), self._stored()
        return clip_grad_norm_([self.params[n] for n in names], max_norm, [stored[n].norm_mult for n in names], sum_squares)


# ---------------------------------------------------------------------------------------------
# The update


@torch.no_grad()
def adamw_step(items: list[tuple[torch.Tensor, ParamState]], lr: float, cfg: OptimizerConfig) -> None:
    """One AdamW step of every (parameter, state) pair (each parameter has a gradient): the fused
    kernel where the tensor steps alike, the element-by-element update elsewhere (module docstring)."""
    fused, exact = [], []
    for p, s in items:
        (fused if _fusable(p, s) else exact).append((p, s))
    if fused:
        _fused_step(fused, lr, cfg)
    if exact:
        _exact_step(exact, lr, cfg)


def _fusable(p: torch.Tensor, s: ParamState) -> bool:
    g, m, v = p.grad, s.exp_avg, s.exp_avg_sq
    tensors = (p, g, m, v)
    return (
        s.has_scalar_schedule()
        and p.device.type in FUSED_DEVICES
        and all(isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.device == p.device and t.is_contiguous() for t in tensors)
        and g.layout == torch.strided
    )


def _fused_step(items: list[tuple[torch.Tensor, ParamState]], lr: float, cfg: OptimizerConfig) -> None:
    for _, s in items:
        s.step += 1
    # The kernel reads each tensor's step from a float32 tensor on its device: one small copy per
    # device and step (exact: steps stay far below 2^24).
    by_device: dict[torch.device, list[int]] = {}
    for i, (p, _) in enumerate(items):
        by_device.setdefault(p.device, []).append(i)
    step_of: dict[int, torch.Tensor] = {}
    for device, idx in by_device.items():
        steps = torch.tensor([float(items[i][1].step) for i in idx], dtype=torch.float32)
        if device.type != "cpu":
            steps = steps.pin_memory().to(device, non_blocking=True)
        step_of.update(zip(idx, steps.unbind(0)))
    groups: dict[tuple, list[int]] = {}
    for i, (p, s) in enumerate(items):
        groups.setdefault((p.device, float(s.lr_mult), float(s.wd_mult), float(s.eps_mult)), []).append(i)
    for (_, lr_mult, wd_mult, eps_mult), idx in groups.items():
        torch._fused_adamw_(
            [items[i][0] for i in idx],
            [items[i][0].grad for i in idx],
            [items[i][1].exp_avg for i in idx],
            [items[i][1].exp_avg_sq for i in idx],
            [],
            [step_of[i] for i in idx],
            lr=lr * lr_mult,
            beta1=cfg.beta1,
            beta2=cfg.beta2,
            weight_decay=cfg.weight_decay * wd_mult,
            eps=cfg.eps * eps_mult,
            amsgrad=False,
            maximize=False,
        )


def _exact_step(items: list[tuple[torch.Tensor, ParamState]], lr: float, cfg: OptimizerConfig) -> None:
    """The element-by-element update, unchanged in its arithmetic: on CPU bitwise what the
    one-tensor-at-a-time loop computed (CPU `_foreach_*` runs the same kernel per tensor)."""
    b1, b2 = cfg.beta1, cfg.beta2
    grads = [p.grad.float() for p, _ in items]
    exp_avgs = [s.exp_avg for _, s in items]
    exp_avg_sqs = [s.exp_avg_sq for _, s in items]
    torch._foreach_mul_(exp_avgs, b1)
    torch._foreach_add_(exp_avgs, grads, alpha=1 - b1)
    torch._foreach_mul_(exp_avg_sqs, b2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - b2)
    for p, s in items:
        s.step += 1  # an int, or an integer tensor of per-element counts
        bc1 = 1 - b1**s.step
        bc2 = 1 - b2**s.step
        lr_p = lr * s.lr_mult  # float or tensor
        decay = lr_p * cfg.weight_decay * s.wd_mult
        denom = (s.exp_avg_sq / bc2).sqrt_().add_(cfg.eps * s.eps_mult)
        update = (s.exp_avg / bc1) / denom
        p32 = p.float()  # p itself when p is fp32
        p32.mul_(1 - decay)
        p32.sub_(update * lr_p)
        if p32 is not p:
            p.copy_(p32)


# ---------------------------------------------------------------------------------------------
# Gradient clipping


def clip_grad_norm(params: list[torch.Tensor], max_norm: float, weights: list | None = None, sum_squares=None) -> float:
    """Global L2 norm of the gradients (returned before clipping); clips in place when max_norm > 0.

    weights: per parameter, a float or a tensor shaped like it, multiplying its squared gradient
    (1 everywhere: the plain norm, computed exactly as without weights).
    sum_squares: when these parameters are one rank's share, a function turning the local squared
    norm into the global one (distributed.Dist.sum_squares); every rank then clips by the same factor."""
    return float(clip_grad_norm_(params, max_norm, weights, sum_squares))


def clip_grad_norm_(params: list[torch.Tensor], max_norm: float, weights: list | None = None, sum_squares=None) -> torch.Tensor:
    """clip_grad_norm without a host sync: the norm stays a 0-dim tensor on the gradients' device
    and the clip factor is applied there (the training loop reads the norm with its other numbers,
    once per step). Bitwise what the float version computed: the factor max_norm / (norm + 1e-6)
    in float64, rounded once to the gradients' float32, and 1 where no clipping applies."""
    weights = weights if weights is not None else [1.0] * len(params)
    pairs = [(p.grad, w) for p, w in zip(params, weights) if p.grad is not None]
    grads = [g for g, _ in pairs]
    if sum_squares is not None:
        local = torch.stack(_weighted_norms(pairs)).double().pow(2).sum() if pairs else _zero_norm(params)
        total = sum_squares(local).sqrt()
    elif not pairs:
        return _zero_norm(params)
    else:
        total = torch.linalg.vector_norm(torch.stack(_weighted_norms(pairs)))
    if grads and max_norm > 0:
        t64 = total.double()
        clip = torch.isfinite(t64) & (t64 > max_norm)
        factor = torch.where(clip, max_norm / (t64 + 1e-6), torch.ones_like(t64))
        for dtype in {g.dtype for g in grads}:
            same = [g for g in grads if g.dtype == dtype]
            torch._foreach_mul_(same, factor.to(dtype))
    return total


def _zero_norm(params: list[torch.Tensor]) -> torch.Tensor:
    device = params[0].device if params else torch.device("cpu")
    return torch.zeros((), dtype=torch.float64, device=device)


def _weighted_norms(pairs: list[tuple[torch.Tensor, float | torch.Tensor]]) -> list[torch.Tensor]:
    """Each gradient's L2 norm with its squared elements weighted. Float weights: one
    `_foreach_norm` over all of them (on CPU the same per-tensor kernel as `vector_norm`; on GPU a
    multi-tensor reduction, equal within fp32 rounding), scaled by sqrt(weight) where not 1."""
    out: list[torch.Tensor | None] = [None] * len(pairs)
    plain = [i for i, (_, w) in enumerate(pairs) if not isinstance(w, torch.Tensor)]
    if plain:
        for i, norm in zip(plain, torch._foreach_norm([pairs[i][0].float() for i in plain])):
            w = pairs[i][1]
            out[i] = norm if w == 1.0 else norm * math.sqrt(w)
    for i, (g, w) in enumerate(pairs):
        if isinstance(w, torch.Tensor):
            g = g.float()
            out[i] = (w.to(g.dtype) * g * g).sum().sqrt()
    return out
