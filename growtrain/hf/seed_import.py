"""`model.init_from: PATH`: a local Hugging Face checkpoint of the Llama family (Llama, Mistral,
Qwen2) as the seed model
(DESIGN.md §16, interop). Residual blocks compute exactly what these classes compute, weight for
weight:

    transformers (Llama/Mistral/Qwen2ForCausalLM)           growtrain (model.block: residual)
    model.embed_tokens.weight                                  embed.weight
    model.layers.{i}.input_layernorm.weight                    blocks.{i}.f.norm.weight
    model.layers.{i}.self_attn.{q,k,v,o}_proj.weight           blocks.{i}.f.attn.w{q,k,v,o}.weight
    model.layers.{i}.self_attn.{q,k,v}_proj.bias (Qwen2)       blocks.{i}.f.attn.w{q,k,v}.bias (model.qkv_bias)
    model.layers.{i}.post_attention_layernorm.weight           blocks.{i}.g.norm.weight
    model.layers.{i}.mlp.{gate,up,down}_proj.weight            blocks.{i}.g.ffn.w_{gate,up,down}.weight
    model.norm.weight                                          final_norm.weight
    lm_head.weight (or the embedding, when tied)               lm_head.weight

RMSNorm in float32, rotate-half RoPE with the checkpoint's theta, GQA, SwiGLU, attention scaled
by 1/sqrt(head_dim), untied head, Qwen2's q/k/v biases. What does not map is refused with the
reason: a bias on the output projection or the MLP, q/k norms (Qwen3), RoPE scaling (Llama 3.1's and others), activations other
than SiLU, a sliding window shorter than a stage's sequence. The import is checked like a growth
operator by the tests: logits equal transformers' own forward of the checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

SUPPORTED = ("llama", "mistral", "qwen2")
REFUSED = {
    "qwen3": "Qwen3 normalizes queries and keys per head (q_norm / k_norm), which growtrain's attention does not do yet",
    "gemma": "Gemma scales the embedding and its norms by (1 + weight)",
}
_LAYER_MAP = {
    "input_layernorm.weight": "f.norm.weight",
    "self_attn.q_proj.weight": "f.attn.wq.weight",
    "self_attn.k_proj.weight": "f.attn.wk.weight",
    "self_attn.v_proj.weight": "f.attn.wv.weight",
    "self_attn.o_proj.weight": "f.attn.wo.weight",
    "self_attn.q_proj.bias": "f.attn.wq.bias",  # Qwen2
    "self_attn.k_proj.bias": "f.attn.wk.bias",
    "self_attn.v_proj.bias": "f.attn.wv.bias",
    "post_attention_layernorm.weight": "g.norm.weight",
    "mlp.gate_proj.weight": "g.ffn.w_gate.weight",
    "mlp.up_proj.weight": "g.ffn.w_up.weight",
    "mlp.down_proj.weight": "g.ffn.w_down.weight",
}


class ImportRefused(ValueError):
    """A checkpoint that does not map exactly onto growtrain's residual blocks; the message says why."""


def read_config(path: Path) -> dict:
    file = Path(path) / "config.json"
    if not file.is_file():
        raise ImportRefused(f"{path}: no config.json (model.init_from names a local Hugging Face checkpoint folder)")
    try:
        return json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise ImportRefused(f"{file}: unreadable ({e})") from None


def rope_theta(config: dict) -> float:
    params = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling") or {}
    kind = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if kind != "default":
        raise ImportRefused(f"RoPE type {kind!r} (scaled positions) does not map onto growtrain's plain RoPE")
    theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
    return float(theta)


def shape_fields(path: Path) -> dict:
    """The ModelConfig fields a checkpoint folder fixes (block residual included); ImportRefused for
    a family or setting that does not map exactly."""
    c = read_config(path)
    family = c.get("model_type", "?")
    if family in REFUSED:
        raise ImportRefused(f"{path}: model_type {family!r} does not map exactly: {REFUSED[family]}")
    if family not in SUPPORTED:
        raise ImportRefused(f"{path}: model_type {family!r} is not one init_from imports (supported: {', '.join(SUPPORTED)})")
    problems = []
    if c.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act {c.get('hidden_act')!r} (growtrain's FFN is SwiGLU with SiLU)")
    for key in ("attention_bias", "mlp_bias"):
        if c.get(key):
            problems.append(f"{key}: true (growtrain's projections have no bias)")
    try:
        theta = rope_theta(c)
    except ImportRefused as e:
        problems.append(str(e))
        theta = 0.0
    if problems:
        raise ImportRefused(f"{path}: {'; '.join(problems)}")
    heads = int(c["num_attention_heads"])
    return {
        "block": "residual",
        "vocab_size": int(c["vocab_size"]),
        "d_model": int(c["hidden_size"]),
        "n_layers": int(c["num_hidden_layers"]),
        "n_heads": heads,
        "n_kv_heads": int(c.get("num_key_value_heads") or heads),
        "head_dim": int(c.get("head_dim") or c["hidden_size"] // heads),
        "ffn_hidden": int(c["intermediate_size"]),
        "rope_theta": theta,
        "qkv_bias": family == "qwen2",  # Qwen2's q/k/v projections always carry biases
        "norm_eps": float(c.get("rms_norm_eps", 1e-6)),
        "init_std": float(c.get("initializer_range", 0.02)),
    }


def sliding_window(path: Path) -> int | None:
    """The checkpoint's attention window (Mistral), None for full causal attention."""
    c = read_config(path)
    return c.get("sliding_window") if c.get("use_sliding_window", True) else None


def _weight_files(path: Path) -> list[Path]:
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return sorted({path / f for f in json.loads(index.read_text())["weight_map"].values()})
    if (path / "model.safetensors").is_file():
        return [path / "model.safetensors"]
    raise ImportRefused(f"{path}: no model.safetensors (nor an index of shards); save the checkpoint with safe_serialization")


def import_state(path: Path, n_layers: int) -> dict[str, torch.Tensor]:
    """The checkpoint's weights under growtrain's names, float32."""
    from safetensors import safe_open

    out: dict[str, torch.Tensor] = {}
    unknown = []
    for file in _weight_files(path):
        with safe_open(str(file), "pt") as f:
            for key in f.keys():
                name = _our_name(key, n_layers)
                if name is None:
                    unknown.append(key)
                else:
                    out[name] = f.get_tensor(key).float()
    if unknown:
        raise ImportRefused(f"{path}: tensors with no counterpart in growtrain's residual blocks: {', '.join(unknown[:5])}{' ...' if len(unknown) > 5 else ''}")
    if "lm_head.weight" not in out and "embed.weight" in out:  # tied embeddings: the head starts as a copy
        out["lm_head.weight"] = out["embed.weight"].clone()
    return out


def _our_name(key: str, n_layers: int) -> str | None:
    if key == "model.embed_tokens.weight":
        return "embed.weight"
    if key == "model.norm.weight":
        return "final_norm.weight"
    if key == "lm_head.weight":
        return key
    parts = key.split(".", 3)
    if len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[2].isdigit() and int(parts[2]) < n_layers and parts[3] in _LAYER_MAP:
        return f"blocks.{parts[2]}.{_LAYER_MAP[parts[3]]}"
    return None


@torch.no_grad()
def import_check(model, path: Path, vocab: int, seq_len: int) -> dict:
    """The imported model's logits against transformers' own forward of the checkpoint (float32, on
    the CPU) on a fixed batch of token ids: the relative L2 distance, as the exact growth operators
    are checked. Loads the checkpoint a second time (host memory: twice the model in float32)."""
    import transformers

    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    tokens = torch.randint(0, vocab, (2, max(2, min(seq_len, 64))), generator=torch.Generator().manual_seed(0))
    want = theirs(tokens).logits.double()
    device = next(model.parameters()).device
    got = model(tokens.to(device)).logits.double().cpu()
    del theirs
    return {
        "architecture": read_config(path).get("architectures", ["?"])[0],
        "rel_l2": ((got - want).norm() / want.norm()).item(),
        "max_abs_dlogits": (got - want).abs().max().item(),
    }
