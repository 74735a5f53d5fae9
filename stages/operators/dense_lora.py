"""add_dense_lora: wrap dense Linear layers (attention by default) with peft LoRA, so that a stage
trains them through adapters (growtrain/model/dense_lora.py).

Exact: peft adds scale · B A x with B = 0, so every logit is unchanged. The wrapped base weights are
carried unchanged under peft's names (`wq.weight` -> `wq.base_layer.weight`) and frozen: no
gradient, and their optimizer state is dropped. The adapters are new parameters with fresh state:
A drawn as peft draws it (kaiming-uniform, bound 1/sqrt(in), on the CPU: the same draws whatever
the device), B zero.

A peft-wrapped model is the model's last form: growth operators map parameters by growtrain's
names, so a later growth step is refused at plan time (stages/transition.py, plan_stage_models).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from growtrain.model import GrowLM
from growtrain.model.config import DenseLoRAConfig, ModelConfig
from growtrain.model.dense_lora import refuse_peft_wrapped
from growtrain.stages.common import materialize
from growtrain.stages.registry import Growth, GrowthPlanError, Operator, Provenance, register

ATTENTION = ("wq", "wk", "wv", "wo")
FFN = ("w_gate", "w_up", "w_down")


@dataclass(frozen=True)
class AddDenseLoRAArgs:
    r: int = field(default=16, metadata={"doc": "LoRA rank.", "ge": 1})
    lora_alpha: float = field(default=16.0, metadata={"doc": "LoRA alpha (scale lora_alpha / r).", "gt": 0.0})
    use_rslora: bool = field(default=False, metadata={"doc": "rsLoRA: scale lora_alpha / sqrt(r)."})
    target_modules: tuple[str, ...] = field(
        default=ATTENTION,
        metadata={"doc": "nn.Linear modules to adapt: wq, wk, wv, wo; w_gate, w_up, w_down (dense FFNs and the shared expert); lm_head."},
    )


def linear_names(cfg: ModelConfig) -> tuple[str, ...]:
    """The dense nn.Linear names (peft's suffix match) a model of shape `cfg` has."""
    has_ffn = cfg.n_layers > len(cfg.moe_layers) or bool(cfg.moe is not None and cfg.moe_layers and cfg.moe.shared_expert_hidden > 0)
    return ATTENTION + (FFN if has_ffn else ()) + ("lm_head",)


def plan(cfg: ModelConfig, args: AddDenseLoRAArgs) -> ModelConfig:
    if cfg.dense_lora is not None:
        raise GrowthPlanError("add_dense_lora: the model already holds peft LoRA on its dense layers")
    if not args.target_modules:
        raise GrowthPlanError("add_dense_lora: target_modules is empty")
    valid = linear_names(cfg)
    missing = [t for t in args.target_modules if t not in valid]
    if missing:
        raise GrowthPlanError(f"add_dense_lora: the model has no dense Linear layer named {', '.join(missing)} at this point (it has {', '.join(valid)})")
    lora = DenseLoRAConfig(r=args.r, lora_alpha=args.lora_alpha, use_rslora=args.use_rslora, target_modules=tuple(args.target_modules))
    return cfg.with_changes(dense_lora=lora)


def apply(model, args: AddDenseLoRAArgs) -> Growth:
    refuse_peft_wrapped(model, "add_dense_lora")
    new_cfg = plan(model.config, args)
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in GrowLM(new_cfg).state_dict().items()}
    old = model.state_dict()
    params = {n for n, _ in model.named_parameters()}
    ref = next(model.parameters())
    new, provenance = {}, {}
    for name, shape in shapes.items():
        if ".lora_A." in name:  # peft's init: kaiming_uniform_(a=sqrt(5)) = U(-1/sqrt(in), 1/sqrt(in))
            bound = 1.0 / math.sqrt(shape[1])
            new[name] = ((torch.rand(shape) * 2 - 1) * bound).to(device=ref.device, dtype=ref.dtype)
            provenance[name] = Provenance("new")
        elif ".lora_B." in name:
            new[name] = torch.zeros(shape, device=ref.device, dtype=ref.dtype)
            provenance[name] = Provenance("new")
        else:
            source = name.replace(".base_layer.", ".")
            new[name] = old[source]
            if source in params:
                provenance[name] = Provenance("carried", source)  # frozen now: its state is dropped
    return Growth(materialize(new_cfg, new), provenance)


register(
    Operator(
        "add_dense_lora",
        True,
        "Wrap dense Linear layers (attention by default) with peft LoRA (B = 0: exact); their bases freeze and drop their "
        "optimizer state, the adapters start fresh. The model's last form: no growth step may follow.",
        AddDenseLoRAArgs,
        plan,
        apply,
        shards=True,  # the experts are carried as each rank holds them; the adapters are dense, drawn alike on every rank
    )
)
