"""deepen: insert identity coupling blocks.

A block whose attention out-projection and FFN/expert down-projections are zero adds nothing to
either stream (y1 = x1 + 0, y2 = x2 + 0), so the grown model computes the same logits. The other
weights are copied from the block before it ('copy') or drawn fresh ('fresh'); either way the new
block's parameters are new parameters with fresh optimizer state and their own step count.

NF4 experts (growtrain/model/nf4.py): a new MoE block's down-projection is an exactly zero NF4
base (its codes kept, its block scales zeroed: nf4_zeros_like) plus a LoRA pair with B = 0. The
base is frozen, so until merge_adapters folds the adapter into it, that block's experts write to
the stream only through their rank-r down-projection adapters.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

from growtrain.model.config import ModelConfig
from growtrain.model.nf4 import nf4_zeros_like, stack_state, state_stack
from growtrain.stages.common import carry, fresh_tensors, materialize
from growtrain.stages.registry import Growth, GrowthPlanError, Operator, Provenance, register

_OUTPUT_PROJECTIONS = (
    "f.attn.wo.weight",
    "g.ffn.w_down.weight",
    "g.ffn.experts.w_down",
    "g.ffn.experts.w_down_lora_B",  # NF4 experts: their zero base is set below
    "g.ffn.shared.w_down.weight",
)


@dataclass(frozen=True)
class DeepenArgs:
    after: tuple[int, ...] = field(default=(), metadata={"doc": "Insert one new block after each listed (current) block index; empty: after every block."})
    init: Literal["copy", "fresh"] = field(default="copy", metadata={"doc": "New blocks' non-output weights: copied from the block before, or fresh."})


def _positions(cfg: ModelConfig, args: DeepenArgs) -> list[int]:
    return sorted(args.after) if args.after else list(range(cfg.n_layers))


def _index_maps(cfg: ModelConfig, positions: list[int]) -> tuple[dict[int, int], dict[int, int]]:
    """old block -> new index, and new (inserted) block -> the old block it follows."""
    old_to_new, inserted, j = {}, {}, 0
    for i in range(cfg.n_layers):
        old_to_new[i] = j
        j += 1
        for _ in range(positions.count(i)):
            inserted[j] = i
            j += 1
    return old_to_new, inserted


def plan(cfg: ModelConfig, args: DeepenArgs) -> ModelConfig:
    positions = _positions(cfg, args)
    for i in positions:
        if not 0 <= i < cfg.n_layers:
            raise GrowthPlanError(f"deepen: block {i} does not exist (the model has {cfg.n_layers} blocks at this point)")
    old_to_new, inserted = _index_maps(cfg, positions)
    moe_layers = [old_to_new[i] for i in cfg.moe_layers] + [n for n, o in inserted.items() if cfg.is_moe_layer(o)]
    return cfg.with_changes(n_layers=cfg.n_layers + len(positions), moe_layers=tuple(sorted(moe_layers)))


def apply(model, args: DeepenArgs) -> Growth:
    old_cfg = model.config
    new_cfg = plan(old_cfg, args)
    old_to_new, inserted = _index_maps(old_cfg, _positions(old_cfg, args))
    new_to_old = {n: o for o, n in old_to_new.items()}
    old = model.state_dict()
    with torch.device("meta"):
        new = dict.fromkeys(type(model)(new_cfg).state_dict())
    if args.init == "fresh":  # the inserted blocks' tensors drawn (this rank's experts only); the rest is carried below
        new.update(fresh_tensors(new_cfg, [n for n in new if n.startswith("blocks.") and int(n.split(".")[1]) in inserted], model))
    params = {n for n, _ in model.named_parameters()}
    provenance: dict[str, Provenance] = {}
    for name in list(new):
        parts = name.split(".")
        if parts[0] != "blocks":
            carry(name, old[name], params, new, provenance)
            continue
        index, rest = int(parts[1]), ".".join(parts[2:])
        if index in new_to_old:
            source = f"blocks.{new_to_old[index]}.{rest}"
            new[name] = old[source]
            if source in params:
                provenance[name] = Provenance("carried", source)
            continue
        neighbour = f"blocks.{inserted[index]}.{rest}"
        if args.init == "copy":
            new[name] = old[neighbour].clone()
        if rest in _OUTPUT_PROJECTIONS:
            new[name] = torch.zeros_like(new[name])
        if neighbour in params:
            provenance[name] = Provenance("new", neighbour if args.init == "copy" else None)
    if new_cfg.moe is not None and new_cfg.moe.expert_format == "nf4":
        for index in inserted:
            if new_cfg.is_moe_layer(index):
                prefix = f"blocks.{index}.g.ffn.experts."
                local = {k[len(prefix) :]: v for k, v in new.items() if k.startswith(prefix)}
                zero = nf4_zeros_like(state_stack("w_down", local, new_cfg.moe.expert_hidden, new_cfg.d_model))
                new.update({prefix + k: v for k, v in stack_state("w_down", zero).items()})
    # Carried blocks compute what they did; the inserted identity blocks have no counterpart.
    return Growth(materialize(new_cfg, new), provenance, blocks=new_to_old)


register(
    Operator(
        "deepen",
        True,
        "Insert identity blocks (zero output projections) after given blocks.",
        DeepenArgs,
        plan,
        apply,
        shards=True,  # a copied block's experts are the rank's own; fresh ones are drawn expert by expert, this rank's only
    )
)
