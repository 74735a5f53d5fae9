"""widen_ffn: more hidden neurons in the dense FFNs and/or in every routed expert.

init 'zero': the new neurons' gate/up rows are freshly drawn and their down-projection columns are
zero, so they add nothing: exact. The new elements join the existing tensors with fresh optimizer
state and their own per-element step count (Adam then treats them as a fresh parameter: first
updates at the normal scale), the old elements keep theirs.

init 'split' (Net2Wider): new neuron F + i duplicates old neuron i mod F (round robin); a neuron
with c copies has its down-projection column shared among them, each copy getting (1 + ε)/c of it
with the ε of one neuron's copies summing to zero: exact for any ε. Optimizer state by DESIGN.md §7:
gate/up rows β = 1, S = c; down columns β = (1 + ε)/c, S = 1. With ε = 0 one step moves the
function exactly as before growth, and the copies stay identical (no specialisation); `noise` > 0
makes them diverge from the first step.

Shared experts keep their width. Legend: E experts, F hidden width, D d_model.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal

import torch

from growtrain.model.config import ModelConfig
from growtrain.stages import sharding
from growtrain.stages.common import carry, fresh_tensors, materialize, new_elements, require_full_experts, take
from growtrain.stages.registry import Growth, GrowthPlanError, Operator, Provenance, register


@dataclass(frozen=True)
class WidenFFNArgs:
    ffn_hidden: int = field(default=0, metadata={"doc": "New hidden width of the dense FFNs (and of later upcycles); 0 keeps it.", "ge": 0})
    expert_hidden: int = field(default=0, metadata={"doc": "New hidden width of every routed expert; 0 keeps it.", "ge": 0})
    init: Literal["zero", "split"] = field(
        default="zero",
        metadata={"doc": "zero: new neurons with zero down-projection columns (fresh state); split: Net2Wider duplicates of old neurons."},
    )
    noise: float = field(
        default=0.0, metadata={"doc": "split only: std of ε, how unevenly duplicates share a down-projection column (exact either way).", "ge": 0.0}
    )


# (hidden dim of the dense weight, of the stacked expert weight), by matrix
_HIDDEN_DIM = {"w_gate": (0, 1), "w_up": (0, 1), "w_down": (1, 2)}


def plan(cfg: ModelConfig, args: WidenFFNArgs) -> ModelConfig:
    if not args.ffn_hidden and not args.expert_hidden:
        raise GrowthPlanError("widen_ffn: set ffn_hidden and/or expert_hidden")
    if args.ffn_hidden and args.ffn_hidden < cfg.ffn_hidden:
        raise GrowthPlanError(f"widen_ffn: ffn_hidden {args.ffn_hidden} is below the current {cfg.ffn_hidden}; this operator only widens")
    changes = {"ffn_hidden": args.ffn_hidden or cfg.ffn_hidden}
    if args.expert_hidden:
        if cfg.moe is None:
            raise GrowthPlanError("widen_ffn: expert_hidden is set but the model has no MoE layers yet")
        require_full_experts(cfg, "widen_ffn")
        if args.expert_hidden < cfg.moe.expert_hidden:
            raise GrowthPlanError(
                f"widen_ffn: expert_hidden {args.expert_hidden} is below the current {cfg.moe.expert_hidden}; this operator only widens"
            )
        changes["moe"] = replace(cfg.moe, expert_hidden=args.expert_hidden)
    return cfg.with_changes(**changes)


def _index(old: int, new: int, init: str) -> torch.Tensor:
    """Source neuron of each new neuron; -1 for a freshly drawn one."""
    extra = torch.arange(new - old)
    return torch.cat([torch.arange(old), extra % old if init == "split" else torch.full_like(extra, -1)])


def apply(model, args: WidenFFNArgs) -> Growth:
    old_cfg = model.config
    new_cfg = plan(old_cfg, args)
    old = model.state_dict()
    params = {n for n, _ in model.named_parameters()}
    widths = {False: (old_cfg.ffn_hidden, new_cfg.ffn_hidden)}
    if old_cfg.moe is not None:
        widths[True] = (old_cfg.moe.expert_hidden, new_cfg.moe.expert_hidden)
    widened = {}  # name -> (matrix, is_expert) of every FFN weight that grows
    for name in old:
        matrix = _ffn_matrix(name.split("."), old_cfg)
        if matrix is not None and widths[matrix[1]][0] != widths[matrix[1]][1]:
            widened[name] = matrix
    # New gate/up rows drawn fresh (init zero); their down columns stay zero.
    fresh = fresh_tensors(new_cfg, [n for n, (kind, _) in widened.items() if kind != "w_down"], model) if args.init == "zero" else {}
    new, provenance = {}, {}
    # One ε per (expert, new neuron), shared by the neuron's down column: drawn up front, in a fixed order.
    eps = {}
    for name, w in old.items():
        parts = name.split(".")
        if name not in widened:
            carry(name, w, params, new, provenance)
            continue
        kind, is_expert = widened[name]
        f_old, f_new = widths[is_expert]
        dim = _HIDDEN_DIM[kind][is_expert]
        index = _index(f_old, f_new, args.init)
        transform = lambda t, dim=dim, index=index: take(t, dim, index)  # noqa: E731
        grown = transform(w)
        if args.init == "zero":
            mask = new_elements(grown.shape, dim, index).to(grown.device)
            if kind != "w_down":  # new gate/up rows drawn fresh; new down columns stay zero
                grown = torch.where(mask, fresh[name], grown)
            new[name] = grown
            provenance[name] = Provenance("copy", name, transform, fresh=mask)
            continue
        counts = torch.bincount(index, minlength=f_old)[index].to(torch.float64)  # copies of each new neuron's source
        lead = (w.shape[0],) if is_expert else ()
        if kind == "w_down":
            key = (parts[1], is_expert)
            if key not in eps:
                eps[key] = _zero_sum_noise(_noise(lead, f_new, old_cfg, is_expert, args.noise), index, f_old)
            share = (1 + eps[key]) / counts  # [(E,) F_new]
            beta = _broadcast(share, grown.shape, dim).to(device=w.device, dtype=w.dtype)
            new[name] = grown * beta
            provenance[name] = Provenance("copy", name, transform, copies=1.0, beta=beta.float())
        else:
            new[name] = grown
            provenance[name] = Provenance("copy", name, transform, copies=_broadcast(counts, grown.shape, dim).float(), beta=1.0)
    return Growth(materialize(new_cfg, new), provenance)


def _ffn_matrix(parts: list[str], cfg: ModelConfig) -> tuple[str, bool] | None:
    """(matrix, is_expert) for a dense FFN or routed-expert weight; None for anything else."""
    if parts[0] != "blocks" or parts[2:4] != ["g", "ffn"]:
        return None
    if cfg.is_moe_layer(int(parts[1])):
        return (parts[5], True) if parts[4] == "experts" else None
    return (parts[4], False) if parts[4] in _HIDDEN_DIM else None


def _noise(lead: tuple, f_new: int, cfg: ModelConfig, is_expert: bool, std: float) -> torch.Tensor | None:
    """N(0, std²) per new neuron ([F_new], or [E_local, F_new] for experts, each expert's drawn by a
    generator keyed by its global index: the same at any EP size); None for std 0."""
    if std == 0:
        return None
    if not is_expert:
        return torch.randn(f_new, dtype=torch.float64) * std
    lo, hi = sharding.local_range(cfg.moe.num_experts)
    assert lead == (hi - lo,), (lead, lo, hi)
    return sharding.expert_normal((f_new,), torch.arange(lo, hi), sharding.draw_key()) * std


def _zero_sum_noise(noise: torch.Tensor | None, index: torch.Tensor, f_old: int) -> torch.Tensor:
    """ε per new neuron: `noise` less its mean over the copies of each old neuron, so it sums to zero
    over them (a lone neuron gets 0); zeros for no noise."""
    if noise is None:
        return torch.zeros(index.numel(), dtype=torch.float64)
    counts = torch.bincount(index, minlength=f_old).to(torch.float64)
    mean = noise.new_zeros(noise.shape[:-1] + (f_old,)).index_add_(-1, index, noise) / counts
    return noise - mean.index_select(-1, index)


def _broadcast(vec: torch.Tensor, shape: torch.Size, dim: int) -> torch.Tensor:
    """A per-neuron vector ([F] or per-expert [E, F]) expanded to a weight of `shape` whose hidden dim is `dim`."""
    view = [1] * len(shape)
    view[dim] = shape[dim]
    if vec.ndim == 2:
        view[0] = shape[0]
    return vec.reshape(view).expand(shape).clone()


register(
    Operator(
        "widen_ffn",
        True,
        "More hidden neurons in dense FFNs and/or experts: new neurons with zero down-projection columns (fresh state, own "
        "step count), or Net2Wider duplicates sharing the down column (moments m/S, v/S²).",
        WidenFFNArgs,
        plan,
        apply,
        shards=True,  # experts widen expert by expert (their draws keyed by global index); the dense FFNs alike on every rank
    )
)
