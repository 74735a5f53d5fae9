"""upcycle_moe: turn dense SwiGLU FFNs into MoE layers whose experts are all copies of the FFN.

Exact: with gates renormalized over the selected experts they sum to 1, and every expert computes
the same function, so the layer's output is the dense FFN's whatever the (fresh, small) router
chooses. Each expert weight is a copy (β = 1) of the dense weight, S = E copies: moments m/E, v/E².

drop_ratio > 0 (Drop-Upcycling, Nakamura et al. 2025): every expert redraws that fraction of its
neurons (gate/up rows and down columns from N(mean, std) of the dense matrix), so the experts start
diverse; the operator is then approximate. Redrawn elements start with fresh optimizer state and
their own step count; a kept element's S is the number of experts that kept it.

Into a model whose MoE layers are NF4 + LoRA already (quantize_experts ran), the new layers'
experts take the same format, as quantize_experts would have made them: each copy of the dense
FFN quantized on its own, its adapters fresh with B = 0 ('reset' in place of the dense matrix).
The function then changes by the quantization error, which is measured and noted, so the
transition judges the operator as approximate, saying why (drop_ratio must be 0 there: a redrawn
neuron of a frozen base would stay random).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import ClassVar, Literal

import torch

from growtrain.model.config import ModelConfig, MoEConfig
from growtrain.model import GrowLM
from growtrain.model.moe import Router
from growtrain.model.nf4 import MATRICES, dequantize_stack, state_stack, stored_layout
from growtrain.stages import sharding
from growtrain.stages.common import carry, along_hidden, materialize, pick_neurons, redraw_neurons, sibling_copies
from growtrain.stages.registry import Growth, GrowthPlanError, Operator, Provenance, register
from growtrain.stages.sharding import draw_key, local_range


@dataclass(frozen=True)
class UpcycleArgs:
    # The expert backend is a runtime setting (it changes no weight): a recipe that still sets it
    # here is refused with the new key's name (growtrain/recipe.py).
    MOVED_KEYS: ClassVar[dict[str, str]] = {"expert_backend": "train.expert_backend"}

    num_experts: int = field(default=8, metadata={"doc": "Experts per upcycled layer.", "ge": 1})
    top_k: int = field(default=2, metadata={"doc": "Experts per token.", "ge": 1})
    layers: tuple[int, ...] = field(default=(), metadata={"doc": "Dense blocks to upcycle; empty: every dense block."})
    score_func: Literal["softmax", "sigmoid"] = field(default="softmax", metadata={"doc": "Router score function."})
    aux_loss_coef: float = field(default=0.01, metadata={"doc": "Load-balance loss weight.", "ge": 0.0})
    z_loss_coef: float = field(default=0.001, metadata={"doc": "Router z-loss weight.", "ge": 0.0})
    balance_bias_rate: float = field(default=0.0, metadata={"doc": "Loss-free balancing bias rate; 0: off.", "ge": 0.0})
    router_init_std: float = field(default=0.02, metadata={"doc": "Std of the fresh router.", "gt": 0.0})
    drop_ratio: float = field(
        default=0.0,
        metadata={"doc": "Drop-upcycling: fraction of each expert's neurons redrawn; > 0 makes the operator approximate.", "ge": 0.0, "le": 1.0},
    )


def _targets(cfg: ModelConfig, args: UpcycleArgs) -> list[int]:
    return list(args.layers) or [i for i in range(cfg.n_layers) if not cfg.is_moe_layer(i)]


def plan(cfg: ModelConfig, args: UpcycleArgs) -> ModelConfig:
    if args.top_k > args.num_experts:
        raise GrowthPlanError(f"upcycle_moe: top_k {args.top_k} exceeds num_experts {args.num_experts}")
    targets = _targets(cfg, args)
    if not targets:
        raise GrowthPlanError("upcycle_moe: the model has no dense block left to upcycle")
    for i in targets:
        if not 0 <= i < cfg.n_layers:
            raise GrowthPlanError(f"upcycle_moe: layer {i} does not exist (the model has {cfg.n_layers} blocks at this point)")
        if cfg.is_moe_layer(i):
            raise GrowthPlanError(f"upcycle_moe: layer {i} is already an MoE layer")
    moe = MoEConfig(
        num_experts=args.num_experts,
        top_k=args.top_k,
        expert_hidden=cfg.ffn_hidden,
        score_func=args.score_func,
        aux_loss_coef=args.aux_loss_coef,
        z_loss_coef=args.z_loss_coef,
        balance_bias_rate=args.balance_bias_rate,
        router_init_std=args.router_init_std,
    )
    if cfg.moe is not None and cfg.moe.expert_format == "nf4" and replace(cfg.moe, expert_format="full", double_quant=moe.double_quant, lora=moe.lora) == moe:
        # The new layers join NF4 ones: their expert copies are quantized like the others' (_nf4_experts).
        if args.drop_ratio > 0:
            raise GrowthPlanError(
                f"upcycle_moe: drop_ratio {args.drop_ratio:g} into a model whose experts are NF4 would redraw neurons of frozen "
                "bases, which would stay random for good (only their rank-r adapters train); set drop_ratio: 0 here, or upcycle "
                "before quantize_experts"
            )
        moe = cfg.moe
    if cfg.moe is not None and cfg.moe != moe:
        raise GrowthPlanError(
            "upcycle_moe: the model already has MoE layers with other settings; upcycle with the same settings (num_experts "
            f"{cfg.moe.num_experts}, top_k {cfg.moe.top_k}, expert_hidden {cfg.moe.expert_hidden} = ffn_hidden, score_func, loss "
            "coefficients, balance_bias_rate and router_init_std as they are now)"
        )
    return cfg.with_changes(moe=moe, moe_layers=tuple(sorted(set(cfg.moe_layers) | set(targets))))


def apply(model, args: UpcycleArgs) -> Growth:
    old_cfg = model.config
    new_cfg = plan(old_cfg, args)
    old = model.state_dict()
    targets = sorted(set(_targets(old_cfg, args)))
    # Every tensor is carried or copied below except the new routers, drawn here in block order
    # (the same on every rank and at any EP size; their balance bias starts at zero).
    ref = next(model.parameters())
    routers = {b: Router(new_cfg.d_model, args.num_experts, new_cfg.moe.router_init_std).to(device=ref.device, dtype=ref.dtype) for b in targets}
    with torch.device("meta"):
        new = dict.fromkeys(GrowLM(new_cfg).state_dict())
    provenance: dict[str, Provenance] = {}
    params = {n for n, _ in model.named_parameters()}
    E = args.num_experts
    lo, hi = local_range(E)  # the experts this rank builds (all of them in one process)
    # Drawn for every expert on every rank, then cut to this rank's: the same at any EP size.
    redraw = {b: pick_neurons(E, old_cfg.ffn_hidden, args.drop_ratio) for b in targets} if args.drop_ratio > 0 else {}
    nf4 = new_cfg.moe.expert_format == "nf4"
    for name in list(new):
        parts = name.split(".")
        block = int(parts[1]) if parts[0] == "blocks" else None
        if nf4 and block in routers and parts[2:5] == ["g", "ffn", "experts"]:
            del new[name]  # _nf4_experts below
            continue
        if block in routers and parts[2] == "g" and parts[3] == "ffn" and parts[4] == "router":
            new[name] = routers[block].state_dict()[parts[5]].detach()
            if name.endswith("router.weight"):
                provenance[name] = Provenance("new")  # small random: exactness does not depend on it
            continue
        if block in routers and parts[4:5] == ["experts"]:
            matrix = parts[5]  # w_gate / w_up / w_down
            source = f"blocks.{block}.g.ffn.{matrix}.weight"
            expand = lambda t, n=hi - lo: t.unsqueeze(0).expand(n, *t.shape).clone()  # noqa: E731
            new[name] = expand(old[source])
            if block not in redraw:
                provenance[name] = Provenance("copy", source, expand, copies=E, beta=1.0)
                continue
            hidden_dim = 2 if matrix == "w_down" else 1
            new[name], fresh = redraw_neurons(new[name], redraw[block][lo:hi], hidden_dim, torch.arange(lo, hi))
            copies = sibling_copies(~redraw[block], torch.zeros(E, dtype=torch.long), 1)[lo:hi]
            provenance[name] = Provenance("copy", source, expand, copies=along_hidden(copies, hidden_dim), fresh=fresh)
            continue
        carry(name, old[name], params, new, provenance)
    notes = _nf4_experts(old, targets, new_cfg, hi - lo, new, provenance) if nf4 else []
    return Growth(materialize(new_cfg, new), provenance, notes=notes)


def _nf4_experts(old: dict, targets: list[int], cfg: ModelConfig, local: int, new: dict, provenance: dict) -> list[str]:
    """The new layers' experts in a model whose experts are NF4 + LoRA: `local` copies of each dense
    FFN quantized as quantize_experts does (each expert on its own, adapters drawn per expert with
    B = 0: 'reset' parameters in place of the dense matrix, whose values the bases now hold). The
    quantization changes the function: the move is measured (relative to the largest weight, over
    every rank's experts) and returned as notes, so the transition judges the operator as
    approximate, saying why."""
    # Imported here: at the top it would register quantize_experts before upcycle_moe (the order of `growtrain schema`).
    from growtrain.stages.operators.quantize import quantize_layer

    key = draw_key()
    notes = []
    for b in targets:
        sources = {m: f"blocks.{b}.g.ffn.{m}.weight" for m in MATRICES}
        bases = {m: old[src].unsqueeze(0).expand(local, *old[src].shape).contiguous() for m, src in sources.items()}
        tensors, prov = quantize_layer(bases, b, cfg, key, sources)
        new.update(tensors)
        provenance.update(prov)
        prefix = f"blocks.{b}.g.ffn.experts."
        for m in MATRICES:
            moved = 0.0
            if local:
                w = stored_layout(m, bases[m][:1]).float()
                got = dequantize_stack(state_stack(m, {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}, cfg.moe.expert_hidden, cfg.d_model), [0])
                largest = float(w.abs().max())
                moved = float((got.to(w.device) - w).abs().max()) / (largest or 1.0)
            moved = sharding.max_ranks(moved)[0]
            if moved:
                notes.append(
                    f"upcycle_moe: {prefix}{m}: the experts' copies of the dense FFN were quantized to NF4 like the model's other "
                    f"experts, moving their weights by up to {moved:.1e} of the largest (exact with full-precision experts: upcycle "
                    "before quantize_experts)"
                )
    return notes


register(
    Operator(
        "upcycle_moe",
        True,
        "Dense FFN → MoE whose experts are exact copies (renormalized gates sum to 1); moments m/E, v/E². "
        "With drop_ratio > 0 (drop-upcycling) approximate. Into a model whose experts are NF4: the copies quantized like "
        "theirs with fresh adapters, the quantization error measured and judged as approximate.",
        UpcycleArgs,
        plan,
        apply,
        exact_if=lambda args: args.drop_ratio == 0,
        shards=True,  # the dense FFN is on every rank: each builds its own experts from it
    )
)
