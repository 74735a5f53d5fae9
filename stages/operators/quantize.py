"""quantize_experts and merge_adapters: routed experts to and within the NF4 + LoRA format
(DESIGN.md §6, growtrain/model/nf4.py).

quantize_experts (approximate): every MoE layer's full-precision expert matrices become frozen
bitsandbytes NF4 bases (blocksize 64, each expert's matrix on its own, double quantization by
default) plus a LoRA pair per expert and matrix with B = 0, so the only change of function is the
quantization error, which the invariance checks measure like any other approximate operator's.
The full-precision expert parameters are consumed into buffers: the new adapters are 'reset'
parameters in their place (fresh optimizer state), and the old experts' moments are dropped
with them: the frozen base has nothing to train.

merge_adapters (approximate): W' = dequantize(base) + scale * B @ A, requantized; the adapters
restart (A redrawn, B = 0) with fresh optimizer state. The function changes by the requantization
error of W'.

Both refuse a model wrapped by peft (dense LoRA): its renamed parameters would be lost.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch

from growtrain.model import GrowLM
from growtrain.model.config import ExpertLoRAConfig, ModelConfig
from growtrain.model.dense_lora import refuse_peft_wrapped
from growtrain.model.nf4 import MATRICES, lora_dims, quantize_stack, stack_state, stored_layout
from growtrain.stages.common import carry, materialize
from growtrain.stages.registry import Growth, GrowthPlanError, Operator, Provenance, register
from growtrain.stages.sharding import draw_key, expert_uniform, local_range, sub_key


@dataclass(frozen=True)
class QuantizeExpertsArgs:
    r: int = field(default=16, metadata={"doc": "LoRA rank per expert and matrix.", "ge": 1})
    lora_alpha: float = field(default=16.0, metadata={"doc": "LoRA alpha (update scale lora_alpha / r).", "gt": 0.0})
    use_rslora: bool = field(default=False, metadata={"doc": "rsLoRA scale lora_alpha / sqrt(r)."})
    double_quant: bool = field(default=True, metadata={"doc": "Quantize the absmax too (8-bit, nested blocks of 256)."})


@dataclass(frozen=True)
class MergeAdaptersArgs:
    pass


def plan_quantize(cfg: ModelConfig, args: QuantizeExpertsArgs) -> ModelConfig:
    if cfg.moe is None or not cfg.moe_layers:
        raise GrowthPlanError("quantize_experts: the model has no MoE layer at this point (upcycle_moe first)")
    if cfg.moe.expert_format == "nf4":
        raise GrowthPlanError("quantize_experts: the experts are already NF4 (merge_adapters folds the adapters into them)")
    if (cfg.d_model * cfg.moe.expert_hidden) % 2:
        raise GrowthPlanError(f"quantize_experts: NF4 packs two weights per byte; d_model x expert_hidden = {cfg.d_model} x {cfg.moe.expert_hidden} is odd")
    lora = ExpertLoRAConfig(r=args.r, lora_alpha=args.lora_alpha, use_rslora=args.use_rslora)
    return cfg.with_changes(moe=replace(cfg.moe, expert_format="nf4", double_quant=args.double_quant, lora=lora))


def plan_merge(cfg: ModelConfig, args: MergeAdaptersArgs) -> ModelConfig:
    if cfg.moe is None or not cfg.moe_layers or cfg.moe.expert_format != "nf4":
        raise GrowthPlanError("merge_adapters: the model has no NF4 experts at this point (quantize_experts first)")
    return cfg


def _new_state(model, new_cfg: ModelConfig) -> tuple[dict[str, torch.Tensor], dict[str, Provenance], list[str]]:
    """Everything outside the MoE layers' experts carried; the expert prefixes to fill in."""
    with torch.device("meta"):
        keys = list(GrowLM(new_cfg).state_dict())
    old = model.state_dict()
    params = {n for n, _ in model.named_parameters()}
    prefixes = [f"blocks.{i}.g.ffn.experts." for i in new_cfg.moe_layers]
    new, provenance = {}, {}
    for name in keys:
        if not name.startswith(tuple(prefixes)):
            carry(name, old[name], params, new, provenance)
    return new, provenance, prefixes


def _fill_experts(new, provenance, prefix, bases: dict[str, torch.Tensor], sources: dict[str, tuple[str, str]], cfg: ModelConfig, like: torch.Tensor) -> None:
    moe = cfg.moe
    for m in MATRICES:
        stack = quantize_stack(stored_layout(m, bases[m]).to(like.device), moe.double_quant)
        new.update({prefix + k: v for k, v in stack_state(m, stack).items()})
        A, B = fresh_adapters(m, torch.arange(*local_range(moe.num_experts)), cfg.d_model, moe.expert_hidden, moe.lora.r, like)
        new[prefix + f"{m}_lora_A"], new[prefix + f"{m}_lora_B"] = A, B
        src_a, src_b = sources[m]
        provenance[prefix + f"{m}_lora_A"] = Provenance("reset", src_a)
        provenance[prefix + f"{m}_lora_B"] = Provenance("reset", src_b)


def quantize_layer(
    bases: dict[str, torch.Tensor], block: int, new_cfg: ModelConfig, key: int, sources: dict[str, str] | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, Provenance]]:
    """One MoE layer's NF4 bases and fresh adapters from its full-precision expert matrices
    `bases` (w_gate, w_up, w_down; this rank's experts), with their provenance. The adapters'
    draws come from a generator seeded by (key, block): the same whether the model is quantized
    whole or one layer at a time (stages/streaming.py). sources: the parameter each matrix's
    values come from (default: the layer's full-precision expert matrix; upcycle_moe: the dense FFN's)."""
    prefix = f"blocks.{block}.g.ffn.experts."
    new, provenance = {}, {}
    # Both adapters replace the full-precision matrix, whose values now live in the NF4 base.
    sources = {m: ((sources or {}).get(m, prefix + m),) * 2 for m in MATRICES}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(sub_key(key, block))
        _fill_experts(new, provenance, prefix, bases, sources, new_cfg, bases[MATRICES[0]])
    return new, provenance


def apply_quantize(model, args: QuantizeExpertsArgs) -> Growth:
    refuse_peft_wrapped(model, "quantize_experts")
    new_cfg = plan_quantize(model.config, args)
    key = draw_key()  # first, as stages/streaming.py draws it
    new, provenance, prefixes = _new_state(model, new_cfg)
    old = model.state_dict()
    for block, prefix in zip(new_cfg.moe_layers, prefixes):
        tensors, prov = quantize_layer({m: old[prefix + m] for m in MATRICES}, block, new_cfg, key)
        new.update(tensors)
        provenance.update(prov)
    return Growth(materialize(new_cfg, new), provenance)


def apply_merge(model, args: MergeAdaptersArgs) -> Growth:
    refuse_peft_wrapped(model, "merge_adapters")
    cfg = plan_merge(model.config, args)
    new, provenance, prefixes = _new_state(model, cfg)
    like = next(model.parameters())
    for i, prefix in zip(cfg.moe_layers, prefixes):
        experts = model.blocks[i].g.ffn.experts
        bases = {m: experts.merged(m) for m in MATRICES}
        sources = {m: (prefix + f"{m}_lora_A", prefix + f"{m}_lora_B") for m in MATRICES}
        _fill_experts(new, provenance, prefix, bases, sources, cfg, like)
    return Growth(materialize(cfg, new), provenance)


register(
    Operator(
        "quantize_experts",
        False,
        "Routed experts → frozen bitsandbytes NF4 bases (blocksize 64) + a zero-init LoRA pair per expert and matrix; "
        "the quantization error is measured.",
        QuantizeExpertsArgs,
        plan_quantize,
        apply_quantize,
        shards=True,  # each expert is quantized on its own and draws its own adapter
    )
)
register(
    Operator(
        "merge_adapters",
        False,
        "Fold the experts' LoRA into their NF4 bases (dequantize, add scale·B@A, requantize) and restart the adapters; "
        "the requantization error is measured.",
        MergeAdaptersArgs,
        plan_merge,
        apply_merge,
        shards=True,
    )
)


def fresh_adapters(matrix: str, experts_E: torch.Tensor, d_model: int, hidden: int, r: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(A, B) for the experts of global indices `experts_E`, A ~ U(±1/sqrt(d_in)) as
    `NF4Experts.reset_adapters` draws it, B = 0. Each expert's A comes from a generator of its own
    keyed by its index (and one draw of the seeded RNG), on the CPU: the same numbers whatever the
    device and whichever expert-parallel rank draws them (stages/sharding.py). Put on `like`'s
    device and dtype."""
    d_in, d_out = lora_dims(matrix, d_model, hidden)
    bound = 1.0 / math.sqrt(d_in)
    A = (expert_uniform((r, d_in), experts_E, draw_key()) * 2 - 1) * bound
    B = torch.zeros(len(experts_E), d_out, r)
    return A.to(device=like.device, dtype=like.dtype), B.to(device=like.device, dtype=like.dtype)
