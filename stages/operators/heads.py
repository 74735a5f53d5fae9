"""add_heads: more attention heads per layer, head_dim fixed, d_model unchanged.

The new query heads (and, with kv='grow', new key/value heads) are freshly drawn and their
out-projection columns are zero, so they add nothing: exact. GQA stays consistent: with kv='grow'
the group size H/K is kept and the new query heads read new kv heads; with kv='share' the kv heads
are kept and each group gains (new H − H)/K query heads, placed inside the group so that every old
head still reads its own kv head. New rows and columns join the existing tensors with fresh
optimizer state and their own per-element step count; old elements keep theirs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

from growtrain.model.config import ModelConfig
from growtrain.stages.common import carry, fresh_tensors, materialize, new_elements, take
from growtrain.stages.registry import Growth, GrowthPlanError, Operator, Provenance, register

# matrix -> (dim holding the heads, query or kv heads)
_ATTN = {"wq": (0, "q"), "wk": (0, "kv"), "wv": (0, "kv"), "wo": (1, "q")}


@dataclass(frozen=True)
class AddHeadsArgs:
    add: int = field(default=2, metadata={"doc": "Query heads added to every attention layer.", "ge": 1})
    kv: Literal["grow", "share"] = field(
        default="grow",
        metadata={"doc": "grow: keep the GQA group size, adding kv heads (add must be a multiple of it); share: keep the kv heads."},
    )


def plan(cfg: ModelConfig, args: AddHeadsArgs) -> ModelConfig:
    H, K = cfg.n_heads, cfg.kv_heads
    group = H // K
    H2 = H + args.add
    if args.kv == "grow":
        if args.add % group:
            raise GrowthPlanError(f"add_heads: kv 'grow' keeps the GQA group size {group}; add ({args.add}) must be a multiple of it")
        K2 = K + args.add // group
    else:
        if H2 % K:
            raise GrowthPlanError(f"add_heads: kv 'share' keeps {K} kv heads; the new head count {H2} must be a multiple of it")
        K2 = K
    return cfg.with_changes(n_heads=H2, n_kv_heads=0 if (cfg.n_kv_heads == 0 and K2 == H2) else K2, head_dim=cfg.head_size)


def head_maps(cfg: ModelConfig, args: AddHeadsArgs) -> dict[str, torch.Tensor]:
    """Old head of each new query / kv head (-1: new)."""
    H, K = cfg.n_heads, cfg.kv_heads
    new = plan(cfg, args)
    H2, K2 = new.n_heads, new.kv_heads
    if args.kv == "grow":
        q = torch.cat([torch.arange(H), torch.full((H2 - H,), -1)])
        kv = torch.cat([torch.arange(K), torch.full((K2 - K,), -1)])
    else:
        g, g2 = H // K, H2 // K
        slot = torch.arange(H2)
        group, r = slot // g2, slot % g2
        q = torch.where(r < g, group * g + r, torch.full_like(slot, -1))
        kv = torch.arange(K)
    return {"q": q, "kv": kv}


def apply(model, args: AddHeadsArgs) -> Growth:
    old_cfg = model.config
    new_cfg = plan(old_cfg, args)
    hd = old_cfg.head_size
    rows = {}
    for which, heads in head_maps(old_cfg, args).items():
        offsets = torch.arange(hd)
        rows[which] = torch.where((heads >= 0).unsqueeze(1), heads.unsqueeze(1) * hd + offsets, torch.full((heads.numel(), hd), -1)).flatten()
    old = model.state_dict()
    params = {n for n, _ in model.named_parameters()}
    grown_rows = {}  # weight name -> (matrix, the source row or column of each new one; -1 for a new head's)
    for name in old:
        parts = name.split(".")
        matrix = parts[4] if parts[0] == "blocks" and parts[2:4] == ["f", "attn"] else None
        index = rows[_ATTN[matrix][1]] if matrix in _ATTN else None
        if index is not None and not bool((index == torch.arange(index.numel())).all()):
            grown_rows[name] = (matrix, index)
    fresh = fresh_tensors(new_cfg, [n for n, (matrix, _) in grown_rows.items() if matrix != "wo"], model)
    new, provenance = {}, {}
    for name, w in old.items():
        if name not in grown_rows:
            carry(name, w, params, new, provenance)
            continue
        matrix, index = grown_rows[name]
        dim = _ATTN[matrix][0]
        transform = lambda t, dim=dim, index=index: take(t, dim, index)  # noqa: E731
        grown = transform(w)
        mask = new_elements(grown.shape, dim, index).to(grown.device)
        if matrix != "wo":  # new heads' q/k/v drawn fresh; their out-projection columns stay zero
            grown = torch.where(mask, fresh[name], grown)
        new[name] = grown
        provenance[name] = Provenance("copy", name, transform, fresh=mask)
    return Growth(materialize(new_cfg, new), provenance)


register(
    Operator(
        "add_heads",
        True,
        "More attention heads (head_dim fixed): new heads with zero out-projection columns; GQA groups kept consistent; "
        "new rows and columns get fresh state with their own step count.",
        AddHeadsArgs,
        plan,
        apply,
        shards=True,  # only attention grows (drawn alike on every rank); the experts are carried as each rank holds them
    )
)
