"""Which tensors are sharded over the expert-parallel ranks, and how a rank's slice is cut from a
full tensor or assembled from another layout's slices (DESIGN.md §12).

Routed experts are sharded contiguously: with E experts in a layer and EP size W, rank r holds
experts [r·E/W, (r+1)·E/W) of every expert tensor (full-precision weights, NF4 codes and quant
state, LoRA pairs) and of their optimizer state. Everything else (router, attention, norms, the
NF4 code books) is replicated. A checkpoint written at EP = W keeps one file per rank with its
slices; loading it at EP = M cuts each new rank's range out of the old ranks' pieces, so a run saved
at one EP size resumes at any other that divides the expert counts (EP = 1 included).

Legend: E experts of a layer, W ranks.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

# Per-layer tables shared by all experts: replicated, never sliced.
_SHARED_EXPERT_BUFFERS = ("quant_map", "nested_quant_map")


def is_expert_tensor(name: str) -> bool:
    """True for a tensor whose dim 0 runs over the routed experts of an MoE layer."""
    parts = name.split(".")
    return "experts" in parts[:-1] and parts[-1] not in _SHARED_EXPERT_BUFFERS


def expert_range(num_experts: int, rank: int, size: int) -> tuple[int, int]:
    if num_experts % size:
        raise ValueError(f"{num_experts} experts cannot be split evenly over {size} expert-parallel ranks")
    n = num_experts // size
    return rank * n, (rank + 1) * n


def slice_tensor(t: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    lo, hi = expert_range(t.shape[0], rank, size)
    return t[lo:hi]


def slice_entry(entry, rank: int, size: int):
    """An optimizer entry (a dict of fields) or a tensor, cut to `rank`'s experts. Tensor fields of
    an expert parameter's state are shaped like the parameter; floats and int steps are shared."""
    if isinstance(entry, torch.Tensor):
        return slice_tensor(entry, rank, size) if entry.ndim else entry
    if isinstance(entry, dict):
        return {k: slice_entry(v, rank, size) for k, v in entry.items()}
    return entry


def slice_state(state: dict, rank: int, size: int) -> dict:
    """A name-keyed dict (model tensors or optimizer entries) with every expert entry cut to
    `rank`'s range; other entries unchanged."""
    if size == 1:
        return dict(state)
    return {n: slice_entry(v, rank, size) if is_expert_tensor(n) else v for n, v in state.items()}


def cat_entries(pieces: list):
    """The inverse of slice_entry over consecutive ranges: tensors concatenated along dim 0."""
    first = pieces[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(pieces) if first.ndim else first
    if isinstance(first, dict):
        return {k: cat_entries([p[k] for p in pieces]) for k in first}
    if any(p != first for p in pieces):
        raise ValueError(f"expert shards disagree on a shared value: {pieces}")
    return first


def assemble(shards: Iterable[tuple[int, int, dict]], rank: int, size: int) -> dict:
    """`rank`'s slices at EP size `size`, from `shards`: (old_rank, old_size, name-keyed dict of
    expert entries) for every old rank. Each tensor is read only over the overlap of the two
    ranges (the shard dicts may be memory-mapped)."""
    shards = sorted(shards, key=lambda s: s[0])
    names = list(shards[0][2]) if shards else []
    out = {}
    for name in names:
        pieces = []
        for old_rank, old_size, entries in shards:
            entry = entries[name]
            local_e = _leading(entry)
            total = local_e * old_size
            lo, hi = expert_range(total, rank, size)
            s_lo, s_hi = old_rank * local_e, (old_rank + 1) * local_e
            a, b = max(lo, s_lo), min(hi, s_hi)
            if a < b:
                pieces.append(_cut(entry, a - s_lo, b - s_lo))
        out[name] = cat_entries(pieces)
    return out


def _leading(entry) -> int:
    if isinstance(entry, torch.Tensor):
        return entry.shape[0]
    for v in entry.values():
        if isinstance(v, torch.Tensor) and v.ndim:
            return v.shape[0]
    raise ValueError("an expert shard entry holds no per-expert tensor")


def _cut(entry, a: int, b: int):
    if isinstance(entry, torch.Tensor):
        return entry[a:b].clone() if entry.ndim else entry
    if isinstance(entry, dict):
        return {k: _cut(v, a, b) for k, v in entry.items()}
    return entry
