"""`growtrain export-adapters`: a checkpoint's adapters in the layout peft saves and loads
(`adapter_config.json` + `adapter_model.safetensors`, as written by `PeftModel.save_pretrained`).

The adapters apply to the *base model*: the same GrowLM with full-precision experts holding the
dequantized NF4 bases (`base_model`, optionally written next to the adapters with `--base`).
- Expert LoRA pairs become peft `target_parameters` LoRA on `experts.w_gate / w_up / w_down` (one
  [E, out, in] parameter each): peft's lora_A.weight [E*r, in] is our A [E, r, in] flattened, its
  lora_B.weight [out, r*E] our B [E, out, r] with columns ordered (rank, expert). peft nests one
  wrapper per parameter on the same module; the key names are taken from a peft model built on
  the meta device, so they are exactly the ones peft expects.
- peft LoRA on dense layers (growtrain/model/dense_lora.py) is copied as is, in the same adapter
  (its own rank and alpha through rank_pattern / alpha_pattern when they differ).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from growtrain.model import GrowLM
from growtrain.model.config import ModelConfig
from growtrain.model.nf4 import MATRICES
from growtrain.data.tokenizer import CHECKPOINT_TOKENIZER

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
BASE_WEIGHTS = "base_model.safetensors"
BASE_CONFIG = "base_model_config.json"
PEFT_PREFIX = "base_model.model."


class ExportError(Exception):
    """Nothing to export, or adapters peft cannot express together."""


def _has_nf4_experts(model: GrowLM) -> bool:
    return any(getattr(layer.experts, "is_nf4", False) for layer in model.moe_layers)


def base_config(cfg: ModelConfig) -> ModelConfig:
    """The model config the adapters apply to: experts in full precision, no peft wrappers."""
    from dataclasses import replace

    cfg = cfg.with_changes(dense_lora=None)
    if cfg.moe is None or cfg.moe.expert_format == "full":
        return cfg
    return cfg.with_changes(moe=replace(cfg.moe, expert_format="full"))


def _dense_peft_layers(model: GrowLM) -> dict[str, torch.nn.Module]:
    from growtrain.model.dense_lora import _is_peft_layer

    return {n: m for n, m in model.named_modules() if _is_peft_layer(m) and not hasattr(m, "parameter_name")}


@torch.no_grad()
def base_model(model: GrowLM) -> GrowLM:
    """A plain GrowLM (full-precision experts, no peft wrappers) computing `model` without its
    adapters: NF4 bases dequantized, peft-wrapped dense layers' base weights."""
    cfg = base_config(model.config)
    state = {}
    for name, t in model.state_dict().items():
        if ".lora_" in name or "_lora_" in name:
            continue
        state[name.replace(".base_layer.", ".")] = t
    for i, layer in zip(model.config.moe_layers, model.moe_layers):
        if getattr(layer.experts, "is_nf4", False):
            prefix = f"blocks.{i}.g.ffn.experts."
            for key in [k for k in state if k.startswith(prefix)]:
                del state[key]
            for m in MATRICES:
                state[prefix + m] = layer.experts.dequantized(m)
    with torch.device("meta"):
        out = GrowLM(cfg)
    out.load_state_dict(state, strict=True, assign=True)
    out.set_expert_backend(model.expert_backend)  # runtime state: computes like `model`
    return out


def _lora_settings(model: GrowLM) -> tuple[dict | None, dict | None]:
    experts = dense = None
    if _has_nf4_experts(model):
        lora = model.config.moe.lora
        experts = {"r": lora.r, "lora_alpha": lora.lora_alpha, "use_rslora": lora.use_rslora}
    layers = _dense_peft_layers(model)
    if layers:
        settings = {(m.r["default"], m.lora_alpha["default"], m.use_rslora.get("default", False)) for m in layers.values()}
        if len(settings) > 1:
            raise ExportError(f"the dense peft layers use different LoRA settings {sorted(settings)}; export supports one")
        (r, alpha, rslora), = settings
        dense = {"r": r, "lora_alpha": alpha, "use_rslora": rslora, "modules": sorted({n.rsplit(".", 1)[-1] for n in layers})}
    return experts, dense


def peft_config_for(model: GrowLM):
    """The peft LoraConfig under which `model`'s adapters load onto `base_model(model)`."""
    experts, dense = _lora_settings(model)
    if experts is None and dense is None:
        raise ExportError("the model has no adapters: neither NF4 experts with LoRA (quantize_experts) nor peft LoRA on dense layers")
    from peft import LoraConfig

    main = experts or dense
    kwargs = {"r": main["r"], "lora_alpha": main["lora_alpha"], "use_rslora": main["use_rslora"], "lora_dropout": 0.0, "bias": "none"}
    kwargs["target_parameters"] = [f"experts.{m}" for m in MATRICES] if experts else None
    kwargs["target_modules"] = dense["modules"] if dense else []
    if experts and dense:
        if experts["use_rslora"] != dense["use_rslora"]:
            raise ExportError("the experts' and the dense layers' LoRA disagree on use_rslora; peft keeps one per adapter")
        if (dense["r"], dense["lora_alpha"]) != (experts["r"], experts["lora_alpha"]):
            kwargs["rank_pattern"] = {m: dense["r"] for m in dense["modules"]}
            kwargs["alpha_pattern"] = {m: dense["lora_alpha"] for m in dense["modules"]}
    return LoraConfig(**kwargs)


@torch.no_grad()
def adapter_state_dict(model: GrowLM, lora_config) -> dict[str, torch.Tensor]:
    """Our adapters under the keys `PeftModel.save_pretrained` writes for `lora_config`."""
    from peft import get_peft_model

    with torch.device("meta"):
        skeleton = GrowLM(base_config(model.config))
    skeleton = get_peft_model(skeleton, lora_config)
    modules = dict(model.named_modules())
    out: dict[str, torch.Tensor] = {}
    for path, wrapper in skeleton.named_modules():
        if not hasattr(wrapper, "lora_A") or "default" not in getattr(wrapper, "lora_A", {}):
            continue
        if not path.startswith(PEFT_PREFIX):
            raise ExportError(f"unexpected peft module path {path}")
        inner = path[len(PEFT_PREFIX) :]
        if hasattr(wrapper, "parameter_name"):  # expert LoRA on one stacked [E, out, in] parameter
            experts_path = inner.split(".base_layer")[0]
            m = wrapper.parameter_name
            A = getattr(modules[experts_path], f"{m}_lora_A").detach()
            B = getattr(modules[experts_path], f"{m}_lora_B").detach()
            E, r, d_in = A.shape
            lora_a, lora_b = A.reshape(E * r, d_in), B.permute(1, 2, 0).reshape(B.shape[1], r * E)
        else:  # a dense Linear wrapped by peft: already in peft's layout
            layer = modules[inner]
            lora_a, lora_b = layer.lora_A["default"].weight.detach(), layer.lora_B["default"].weight.detach()
        for key, value, want in ((f"{path}.lora_A.weight", lora_a, wrapper.lora_A["default"].weight), (f"{path}.lora_B.weight", lora_b, wrapper.lora_B["default"].weight)):
            if tuple(value.shape) != tuple(want.shape):
                raise ExportError(f"{key}: our adapter has shape {tuple(value.shape)}, peft expects {tuple(want.shape)}")
            out[key] = value.float().cpu().contiguous()
    return out


def export_model_adapters(model: GrowLM, out_dir: Path, with_base: bool = False) -> dict:
    """Write `model`'s adapters (and with `with_base` the base model) to `out_dir`."""
    lora_config = peft_config_for(model)
    state = adapter_state_dict(model, lora_config)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    lora_config.save_pretrained(str(out_dir))
    save_file(state, str(out_dir / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    summary = {"adapter_tensors": len(state), "adapter_parameters": sum(t.numel() for t in state.values()), "out_dir": str(out_dir)}
    if with_base:
        from growtrain.recipe import to_plain

        base = base_model(model)
        save_file({k: v.contiguous() for k, v in base.state_dict().items()}, str(out_dir / BASE_WEIGHTS), metadata={"format": "pt"})
        (out_dir / BASE_CONFIG).write_text(json.dumps(to_plain(base.config), indent=2) + "\n")
        summary["base_parameters"] = base.num_parameters()
    return summary


def load_base_model(out_dir: Path) -> GrowLM:
    """The base model written by `export-adapters --base`."""
    from safetensors.torch import load_file

    out_dir = Path(out_dir)
    cfg = ModelConfig.from_dict(json.loads((out_dir / BASE_CONFIG).read_text()))
    with torch.device("meta"):
        model = GrowLM(cfg)
    model.load_state_dict(load_file(str(out_dir / BASE_WEIGHTS)), strict=True, assign=True)
    return model


def export_adapters(checkpoint: Path, out_dir: Path, with_base: bool = False, log=print) -> dict:
    """`growtrain export-adapters CHECKPOINT OUT_DIR`: a run directory (its newest complete
    checkpoint) or a checkpoint directory."""
    from growtrain.checkpoint.store import resolve

    loaded = resolve(Path(checkpoint), log)
    cfg = ModelConfig.from_dict(loaded.meta["model_config"])
    # Built on meta and given the checkpoint's tensors: no random init, no quantizing of random
    # experts only to overwrite them (hours at 120B).
    with torch.device("meta"):
        model = GrowLM(cfg)
    model.load_state_dict(loaded.model_state, strict=True, assign=True)
    summary = export_model_adapters(model, out_dir, with_base)
    summary["checkpoint"] = str(loaded.path)
    own_tokenizer = loaded.path / CHECKPOINT_TOKENIZER
    if own_tokenizer.is_file():  # the adapters come with the tokenizer they were trained with
        shutil.copyfile(own_tokenizer, Path(out_dir) / CHECKPOINT_TOKENIZER)
        summary["tokenizer"] = CHECKPOINT_TOKENIZER
    return summary
