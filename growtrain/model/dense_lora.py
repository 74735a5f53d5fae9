"""peft LoRA on the dense Linear layers (attention projections by default), through peft itself
(`peft.inject_adapter_in_model`): the base weights are frozen, and the adapters train. A model
whose config sets `dense_lora` (DenseLoRAConfig, in growtrain/model/config.py) is wrapped when it is
built, so a checkpoint of it loads strictly into a freshly built one; the add_dense_lora growth
operator (stages/operators/dense_lora.py) sets it mid-recipe.

peft renames what it wraps (`f.attn.wq.weight` becomes `f.attn.wq.base_layer.weight`, next to
`f.attn.wq.lora_A.default.weight` and `...lora_B.default.weight`), so a wrapped model is the last
form of a model: growth operators refuse it (`refuse_peft_wrapped`), and the experts' own LoRA
(growtrain/model/nf4.py) is separate from it. Export: growtrain/hf/adapters.py.
"""

from __future__ import annotations

from torch import nn

from growtrain.kernels.nf4_reference import _silence_bitsandbytes_start_up
from growtrain.model.config import DenseLoRAConfig

__all__ = ["DenseLoRAConfig", "apply_dense_lora", "is_peft_wrapped", "refuse_peft_wrapped"]


def apply_dense_lora(model: nn.Module, cfg: DenseLoRAConfig, adapter_name: str = "default") -> nn.Module:
    """Wrap `model`'s target Linear layers with peft LoRA in place and freeze their base weights
    (only the wrapped layers: everything else keeps training). Returns the model."""
    if is_peft_wrapped(model):
        raise ValueError("the model already holds peft adapters")
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    import peft  # seconds to import: only when a model gets adapters

    _silence_bitsandbytes_start_up()
    wrapped = peft.inject_adapter_in_model(cfg.peft_config(), model, adapter_name=adapter_name)
    # peft marks only adapters trainable; here only the wrapped layers' bases freeze, and the other
    # dense parts (embeddings, norms, routers, LM head) and the experts keep training as before.
    frozen = {id(p) for m in wrapped.modules() if _is_peft_layer(m) for p in m.get_base_layer().parameters()}
    for name, p in wrapped.named_parameters():
        is_adapter = ".lora_A." in name or ".lora_B." in name
        p.requires_grad_(is_adapter or (id(p) in trainable and id(p) not in frozen))
    return wrapped


def _is_peft_layer(module: nn.Module) -> bool:
    return type(module).__module__.startswith("peft.") and hasattr(module, "get_base_layer")


def is_peft_wrapped(model: nn.Module) -> bool:
    return any(_is_peft_layer(m) for m in model.modules())


def refuse_peft_wrapped(model: nn.Module, operator: str) -> None:
    """Growth operators map parameters by growtrain's names; peft's renamed ones would be lost."""
    if is_peft_wrapped(model):
        raise ValueError(
            f"{operator}: the model holds peft adapters on its dense layers (parameters renamed to base_layer / "
            "lora_A.default ...); growth operators do not apply to a peft-wrapped model: grow first, add peft LoRA last"
        )
