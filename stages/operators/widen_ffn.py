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
from growtrain.model.nf4 import MATRICES, dequantize_stack, nf4_append_rows, nf4_requantized, stack_state, state_stack
from growtrain.stages.common import carry, fresh_tensors, materialize, new_elements, requantized_note, take
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
    nf4 = old_cfg.moe is not None and old_cfg.moe.expert_format == "nf4" and widths[True][0] != widths[True][1]
    nf4_prefixes = tuple(f"blocks.{i}.g.ffn.experts." for i in old_cfg.moe_layers) if nf4 else ()
    widened = {}  # name -> (matrix, is_expert) of every FFN weight that grows
    for name in old:
        matrix = _ffn_matrix(name.split("."), old_cfg)
        if matrix is not None and widths[matrix[1]][0] != widths[matrix[1]][1] and not name.startswith(nf4_prefixes):
            widened[name] = matrix
    # New gate/up rows drawn fresh (init zero); their down columns stay zero. NF4 experts' new base
    # rows are drawn as full-precision experts' would be, then quantized.
    drawn = [n for n, (kind, _) in widened.items() if kind != "w_down"] + [p + m for p in nf4_prefixes for m in ("w_gate", "w_up")]
    full_cfg = replace(new_cfg, moe=replace(new_cfg.moe, expert_format="full")) if nf4 else new_cfg
    fresh = fresh_tensors(full_cfg, drawn, model) if args.init == "zero" else {}
    new, provenance = {}, {}
    notes = [note for prefix in nf4_prefixes for note in _widen_nf4_experts(old, prefix, old_cfg, new_cfg, args, fresh, new, provenance)]
    # One ε per (expert, new neuron), shared by the neuron's down column: drawn up front, in a fixed order.
    eps = {}
    for name, w in old.items():
        parts = name.split(".")
        if name.startswith(nf4_prefixes):
            continue
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
    return Growth(materialize(new_cfg, new), provenance, notes=notes)


def _widen_nf4_experts(old: dict, prefix: str, old_cfg: ModelConfig, new_cfg: ModelConfig, args: WidenFFNArgs, fresh: dict, new: dict, provenance: dict) -> list[str]:
    """One MoE layer's NF4 + LoRA experts widened F -> F' (this rank's experts). The bases are
    stored [F, D] per expert for every matrix (w_down transposed), so new neurons are new rows.

    init zero: new gate/up rows drawn as full-precision experts' would be, new down rows exactly 0
    (the NF4 code of 0.0), appended on quantization blocks of their own where the old rows end on
    one (and, with double quantization, on a nested absmax block): old codes untouched, exact.
    Elsewhere the matrix is requantized, and how far that moves the old rows is measured and
    returned as a note (the transition then judges the operator as approximate). The adapters:
    gate/up B [E, F, r] gain zero rows, down A [E, r, F] zero columns (so B·A adds nothing through
    a new neuron), both with fresh state; gate/up A and down B are carried.

    init split: neuron j copies neuron index[j]; the bases are dequantized, their rows taken (down's
    scaled by its share (1 + ε)/c) and requantized, measured as above; gate/up B rows copied (S = c),
    down A columns copied and scaled by the share (β = share, S = 1). Returns the notes."""
    D, (f_old, f_new) = old_cfg.d_model, (old_cfg.moe.expert_hidden, new_cfg.moe.expert_hidden)
    index = _index(f_old, f_new, args.init)
    local = {k[len(prefix) :]: v for k, v in old.items() if k.startswith(prefix)}
    E = local["w_gate_lora_A"].shape[0]
    counts = torch.bincount(index.clamp_min(0), minlength=f_old)[index.clamp_min(0)].to(torch.float64)
    share = ((1 + _zero_sum_noise(_noise((E,), f_new, old_cfg, True, args.noise), index, f_old)) / counts) if args.init == "split" else None
    notes = []
    for name in ("quant_map", "nested_quant_map"):
        if name in local:
            new[prefix + name] = local[name]
    for m in MATRICES:
        stack = state_stack(m, local, f_old, D)
        like = local[f"{m}_lora_A"]
        if args.init == "zero":
            rows = fresh[prefix + m][:, f_old:, :] if m != "w_down" else torch.zeros(E, f_new - f_old, D)
            rows = rows.to(device=like.device, dtype=torch.float32)
            grown = nf4_append_rows(stack, rows)
            moved = 0.0
            if grown is None:
                target = torch.cat([dequantize_stack(stack).to(rows.device), rows], 1)
                grown, moved = nf4_requantized(stack, target, torch.arange(f_new) < f_old)
        else:
            target = dequantize_stack(stack).to(like.device).index_select(1, index.to(like.device))
            if m == "w_down":
                target = target * share.to(device=like.device, dtype=torch.float32).unsqueeze(-1)
            grown, moved = nf4_requantized(stack, target)
        notes += requantized_note("widen_ffn", prefix + m, moved, f"at width {f_new}", "init: zero where the old rows end on a quantization block "
                                  "(with double quantization on a nested block of 16384 elements), or init: split without noise or double quantization")
        new.update({prefix + k: v for k, v in stack_state(m, grown).items() if k not in ("quant_map", "nested_quant_map")})
        # The factor with a slot per neuron grows (down: A [E, r, F] columns; gate/up: B [E, F, r]
        # rows), the other is carried.
        grows, keeps, dim = ("A", "B", 2) if m == "w_down" else ("B", "A", 1)
        kept, name = prefix + f"{m}_lora_{keeps}", prefix + f"{m}_lora_{grows}"
        new[kept], provenance[kept] = local[f"{m}_lora_{keeps}"], Provenance("carried", kept)
        transform = lambda t, index=index, dim=dim: take(t, dim, index)  # noqa: E731
        grown_t = transform(local[f"{m}_lora_{grows}"])
        if args.init == "zero":
            new[name], provenance[name] = grown_t, Provenance("copy", name, transform, fresh=new_elements(grown_t.shape, dim, index).to(grown_t.device))
        elif m == "w_down":  # the neuron's share of the down projection: β = (1 + ε)/c, S = 1
            beta = _broadcast(share, grown_t.shape, dim).to(device=grown_t.device, dtype=grown_t.dtype)
            new[name], provenance[name] = grown_t * beta, Provenance("copy", name, transform, copies=1.0, beta=beta.float())
        else:  # gate/up rows copied c times: S = c
            new[name], provenance[name] = grown_t, Provenance("copy", name, transform, copies=_broadcast(counts, grown_t.shape, dim).float(), beta=1.0)
    return notes


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
        "step count), or Net2Wider duplicates sharing the down column (moments m/S, v/S²). NF4 experts: new neurons on "
        "quantization blocks of their own, old codes untouched, where F·D ends on a block (with double quantization on a "
        "nested block of 16384 elements); else the base is requantized, its move measured and judged as approximate.",
        WidenFFNArgs,
        plan,
        apply,
        shards=True,  # experts widen expert by expert (their draws keyed by global index); the dense FFNs alike on every rank
    )
)
