"""Helpers shared by the operators: building the grown model strictly from a full state dict,
gathering slices with new (-1) entries, and redrawing expert neurons (drop-upcycling).

Legend: E experts, F expert hidden width, D d_model."""

from __future__ import annotations

import torch

from growtrain.model import GrowLM
from growtrain.model.config import ModelConfig


def materialize(cfg: ModelConfig, state: dict[str, torch.Tensor]) -> GrowLM:
    """The model of shape `cfg` holding exactly `state`: built on the meta device and loaded with
    strict=True, so a missing, renamed or stray key fails here instead of leaving a parameter at
    its random init (a pitfall of real growth runs)."""
    from growtrain.stages import sharding

    with torch.device("meta"):
        model = GrowLM(cfg)
    ep = sharding.current()
    if ep is not None:  # sharded growth: the operator built this rank's experts only
        from growtrain.model.expert_parallel import shard_experts

        shard_experts(model, ep)
    model.load_state_dict(state, strict=True, assign=True)
    return model


def fresh_tensors(cfg: ModelConfig, names, like: GrowLM) -> dict[str, torch.Tensor]:
    """Freshly initialized values of the tensors `names` of a model of shape `cfg`, and of no others
    (never a whole random model: at scale that is the model's size again). The module that
    initializes each one (its nearest enclosing attention, norm, FFN, router or experts module) is
    built alone and reset by its own `reset_parameters`, seeded by one draw of the current (seeded)
    RNG and the module's name. Routed experts are reset one expert at a time, seeded by their global
    index, and on expert shards only this rank's are drawn (stages/sharding.py), so a grown model is
    the same at any EP size. Drawn on the CPU (the same numbers whatever the device), then put on
    `like`'s device and float dtype."""
    from growtrain.model.expert_shards import is_expert_tensor
    from growtrain.stages import sharding

    ref = next(like.parameters())
    with torch.device("meta"):
        skeleton = GrowLM(cfg)
    key = sharding.draw_key()
    owners: dict[str, list[str]] = {}
    for name in names:
        owners.setdefault(_initializer(skeleton, name), []).append(name)
    out = {}
    for path, wanted in owners.items():
        module = skeleton.get_submodule(path)
        if any(is_expert_tensor(n) for n in wanted):
            values = _fresh_experts(module, sharding.sub_key(key, path))
        else:
            values = _reset_seeded(module.to_empty(device="cpu"), sharding.sub_key(key, path)).state_dict()
        for name in wanted:
            v = values[name[len(path) + 1 :]]
            out[name] = v.to(device=ref.device, dtype=ref.dtype if v.is_floating_point() else v.dtype)
    return out


def _initializer(model: GrowLM, name: str) -> str:
    """The path of the module whose reset_parameters initializes tensor `name` (GrowLM.init_weights:
    a Linear inside an attention or FFN module is initialized by that module)."""
    from torch import nn

    parts = name.split(".")[:-1]
    while parts:
        module = model.get_submodule(".".join(parts))
        if hasattr(module, "reset_parameters") and not isinstance(module, (nn.Embedding, nn.Linear)):
            return ".".join(parts)
        parts.pop()
    raise ValueError(f"fresh_tensors: no module of the model initializes {name} on its own")


def _fresh_experts(module, key: int) -> dict[str, torch.Tensor]:
    """The experts module's state with this rank's experts freshly reset, each by a one-expert copy
    of the module seeded by (key, its global index)."""
    import copy

    from growtrain.model.expert_shards import is_expert_tensor
    from growtrain.model.expert_parallel import cut_experts
    from growtrain.stages import sharding

    E = next(module.parameters()).shape[0]
    lo, hi = sharding.local_range(E)
    one = cut_experts(copy.deepcopy(module), 0, 1).to_empty(device="cpu")
    rows: dict[str, list[torch.Tensor]] = {}
    shared: dict[str, torch.Tensor] = {}
    if lo == hi:  # no expert here (an AF layout's attention rank): empty rows, the shared tables
        values = _reset_seeded(one, sharding.sub_key(key, "none")).state_dict()
        return {k: v[:0].clone() if is_expert_tensor(f"experts.{k}") else v.detach().clone() for k, v in values.items()}
    for e in range(lo, hi):
        for k, v in _reset_seeded(one, sharding.sub_key(key, e)).state_dict().items():
            if is_expert_tensor(f"experts.{k}"):
                rows.setdefault(k, []).append(v.detach().clone())
            else:
                shared[k] = v.detach().clone()
    return {**shared, **{k: torch.cat(v) for k, v in rows.items()}}


def _reset_seeded(module, seed: int):
    """`module` (on the CPU) re-initialized by its own reset_parameters from the CPU generator seeded
    with `seed`; the caller's RNG stream is left where it was."""
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(seed)
        module.reset_parameters()
    return module


def take(x: torch.Tensor, dim: int, index: torch.Tensor) -> torch.Tensor:
    """The slices of `x` along `dim` at `index`; an index of -1 gives a slice of zeros (a new
    element). Used for weights and, through Provenance.transform, for every optimizer tensor."""
    index = index.to(x.device)
    out = x.index_select(dim, index.clamp_min(0))
    new = index < 0
    if bool(new.any()):
        out = out.masked_fill(_along(new, dim, x.ndim), 0)
    return out


def new_elements(shape: torch.Size, dim: int, index: torch.Tensor) -> torch.Tensor:
    """Bool mask shaped `shape`: True where `take(..., dim, index)` put a new (-1) slice."""
    return _along(index < 0, dim, len(shape)).expand(shape).clone()


def _along(mask_N: torch.Tensor, dim: int, ndim: int) -> torch.Tensor:
    shape = [1] * ndim
    shape[dim] = -1
    return mask_N.view(shape)


def redraw_neurons(w_EFD: torch.Tensor, redraw_EF: torch.Tensor, hidden_dim: int, experts_E: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Drop-upcycling: the neurons marked in `redraw_EF` redrawn from N(mean, std) of each expert's
    own matrix. Each expert's draws come from a generator of its own, keyed by its global index
    (`experts_E`, default 0..E-1) and one draw of the seeded RNG, on the CPU: the same numbers
    whatever the device and whichever rank holds the expert (stages/sharding.py).
    Returns the weight and the mask of redrawn elements, [E, F, 1] or [E, 1, F]: it broadcasts to
    the weight (a neuron is redrawn whole), so the bookkeeping costs a neuron, not an element."""
    from growtrain.stages import sharding

    stats = w_EFD.double().flatten(1)
    mean, std = stats.mean(1), stats.std(1)
    shape = [-1] + [1] * (w_EFD.ndim - 1)
    experts_E = torch.arange(w_EFD.shape[0]) if experts_E is None else experts_E
    unit = sharding.expert_normal(tuple(w_EFD.shape[1:]), experts_E, sharding.draw_key())
    draw = unit * std.cpu().view(shape) + mean.cpu().view(shape)
    mask = along_hidden(redraw_EF, hidden_dim).to(w_EFD.device)
    return torch.where(mask, draw.to(device=w_EFD.device, dtype=w_EFD.dtype), w_EFD), mask


def pick_neurons(n_experts: int, hidden: int, fraction: float, skip: torch.Tensor | None = None) -> torch.Tensor:
    """[E, F] bool: round(fraction·F) random neurons per expert (none for experts marked in `skip`)."""
    count = round(fraction * hidden)
    mask = torch.zeros(n_experts, hidden, dtype=torch.bool)
    for e in range(n_experts):
        if count and (skip is None or not skip[e]):
            mask[e, torch.randperm(hidden)[:count]] = True
    return mask


def sibling_copies(kept_EF: torch.Tensor, parent_E: torch.Tensor, n_parents: int) -> torch.Tensor:
    """S per (expert, neuron): how many experts with the same parent kept that parent's neuron."""
    totals = torch.zeros(n_parents, kept_EF.shape[1], dtype=torch.float32).index_add_(0, parent_E, kept_EF.float())
    return totals[parent_E].clamp_min(1.0)  # a neuron every sibling redrew is fresh everywhere: S unused


def along_hidden(v_EF: torch.Tensor, hidden_dim: int) -> torch.Tensor:
    """A per-neuron [E, F] field shaped to broadcast over an expert weight whose hidden dim is
    `hidden_dim` (w_gate / w_up [E, F, D]: 1; w_down [E, D, F]: 2)."""
    return v_EF.unsqueeze(2 if hidden_dim == 1 else 1)


def requantized_note(op: str, where: str, moved: float, how: str, exact_when: str) -> list[str]:
    """The note (Growth.notes: judged as approximate) for an NF4 base requantized by an exact
    operator, if that moved a weight it keeps: `moved` relative to the largest, taken over every
    rank's experts so that every rank reaches the same verdict (a collective on expert shards)."""
    from growtrain.stages import sharding

    moved = sharding.max_ranks(moved)[0]
    if not moved:
        return []
    return [f"{op}: {where}: the NF4 base was requantized {how}, moving its kept weights by up to {moved:.1e} of their largest (exact {exact_when})"]


def carry(name: str, w: torch.Tensor, params: set[str], new: dict, provenance: dict) -> None:
    """Keep `name` as it is in the grown model: same tensor, and for a parameter the same optimizer
    state ('carried')."""
    from growtrain.stages.registry import Provenance

    new[name] = w
    if name in params:
        provenance[name] = Provenance("carried", name)
