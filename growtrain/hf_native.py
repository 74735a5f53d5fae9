"""`growtrain export-hf` for residual models: transformers' own classes, no remote code, the
layouts inference engines (vLLM, SGLang) load natively (DESIGN.md §16, interop).

    dense                                                    LlamaForCausalLM
    every block MoE, no shared expert                        MixtralForCausalLM
    MoE in some blocks, or a shared expert                   Qwen2MoeForCausalLM

Each mapping is exact: the same RMSNorm, rotate-half RoPE, GQA and SwiGLU; Mixtral's and
Qwen2-MoE's routers take softmax over all experts, top-k, and renormalize the chosen weights
(`norm_topk_prob`), which is growtrain's softmax routing. Qwen2-MoE's shared expert is gated by
sigmoid(shared_expert_gate · x): a zero gate gives exactly 1/2, so its down-projection is written
doubled (exact in binary floating point); without a shared expert it gets one zero neuron. Its
q/k/v biases (always present in transformers 4) are written as zeros. Experts are written one
tensor per expert and matrix (the layout transformers 4 defines and transformers 5 converts on load).

What does not map (sigmoid scores, a nonzero balance bias that changes the selection) returns a
reason, and `export-hf` writes the remote-code export instead, saying why.

Legend: E experts, F expert hidden, D d_model.
"""

from __future__ import annotations

import torch

from growtrain.model.config import ModelConfig


def native_class(cfg: ModelConfig, balance_bias_nonzero: bool) -> tuple[str | None, str]:
    """(transformers architecture, why) for a residual model; (None, why not) where none maps exactly."""
    if cfg.block != "residual":
        return None, "coupling blocks have no counterpart in transformers"
    if cfg.dense_lora is not None:
        pass  # merged on export like everything else
    if not cfg.moe_layers:
        return "LlamaForCausalLM", "dense residual blocks are Llama's"
    moe = cfg.moe
    if moe.score_func != "softmax":
        return None, f"router score function {moe.score_func}: Mixtral and Qwen2-MoE route by softmax"
    if balance_bias_nonzero:
        return None, "a nonzero balance bias changes which experts are chosen; Mixtral and Qwen2-MoE have none"
    if len(cfg.moe_layers) == cfg.n_layers and not moe.shared_expert_hidden:
        return "MixtralForCausalLM", "every block MoE, softmax routing, no shared expert"
    return "Qwen2MoeForCausalLM", "softmax routing with dense blocks or a shared expert"


def _rope(cfg: ModelConfig) -> dict:
    # Both spellings: transformers 5 reads rope_parameters, 4 reads rope_theta.
    return {"rope_theta": cfg.rope_theta, "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta}}


def native_config(arch: str, cfg: ModelConfig, dtype: str, max_positions: int, eos_id: int) -> dict:
    common = {
        "architectures": [arch],
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_size,
        "hidden_act": "silu",
        "max_position_embeddings": max_positions,
        "rms_norm_eps": cfg.norm_eps,
        "initializer_range": cfg.init_std,
        "tie_word_embeddings": False,
        "use_cache": True,
        "eos_token_id": eos_id,
        "attention_dropout": 0.0,
        "dtype": dtype,
        "torch_dtype": dtype,
        **_rope(cfg),
    }
    if arch == "LlamaForCausalLM":
        return {"model_type": "llama", **common, "intermediate_size": cfg.ffn_hidden, "attention_bias": False, "mlp_bias": False}
    moe = cfg.moe
    if arch == "MixtralForCausalLM":
        return {
            "model_type": "mixtral", **common, "intermediate_size": moe.expert_hidden, "num_local_experts": moe.num_experts,
            "num_experts_per_tok": moe.top_k, "sliding_window": None, "router_jitter_noise": 0.0, "output_router_logits": False,
            "router_aux_loss_coef": moe.aux_loss_coef,
        }
    return {
        "model_type": "qwen2_moe", **common, "intermediate_size": cfg.ffn_hidden, "moe_intermediate_size": moe.expert_hidden,
        "shared_expert_intermediate_size": max(moe.shared_expert_hidden, 1), "num_experts": moe.num_experts,
        "num_experts_per_tok": moe.top_k, "norm_topk_prob": True, "decoder_sparse_step": 1,
        "mlp_only_layers": [i for i in range(cfg.n_layers) if i not in cfg.moe_layers], "qkv_bias": True,
        "use_sliding_window": False, "sliding_window": None, "output_router_logits": False, "router_aux_loss_coef": moe.aux_loss_coef,
    }


_ATTN = {"wq": "q_proj", "wk": "k_proj", "wv": "v_proj", "wo": "o_proj"}
_FFN = {"w_gate": "gate_proj", "w_up": "up_proj", "w_down": "down_proj"}
_MIXTRAL_EXPERT = {"w_gate": "w1", "w_up": "w3", "w_down": "w2"}


def native_tensors(arch: str, cfg: ModelConfig, tensors: list) -> list:
    """The export's tensors (hf_export.OutTensor, named as growtrain's base model) renamed, split
    per expert, and completed (zero biases, zero shared-expert gate) for `arch`."""
    from growtrain.hf_export import OutTensor

    out: list[OutTensor] = []
    by_name = {t.name: t for t in tensors}
    for t in tensors:
        name = t.name
        if name == "embed.weight":
            out.append(_renamed(t, "model.embed_tokens.weight"))
        elif name == "final_norm.weight":
            out.append(_renamed(t, "model.norm.weight"))
        elif name == "lm_head.weight":
            out.append(t)
        else:
            _, i, branch, rest = name.split(".", 3)
            layer = f"model.layers.{i}"
            if branch == "f":
                if rest == "norm.weight":
                    out.append(_renamed(t, f"{layer}.input_layernorm.weight"))
                else:  # attn.wq.weight
                    proj = _ATTN[rest.split(".")[1]]
                    out.append(_renamed(t, f"{layer}.self_attn.{proj}.weight"))
                    if arch == "Qwen2MoeForCausalLM" and proj != "o_proj":
                        out.append(_zeros(f"{layer}.self_attn.{proj}.bias", (t.shape[0],), t.dtype))
            elif rest == "norm.weight":
                out.append(_renamed(t, f"{layer}.post_attention_layernorm.weight"))
            else:
                out.extend(_ffn_tensors(arch, layer, rest, t, by_name))
    if arch == "Qwen2MoeForCausalLM":
        out.extend(_absent_shared_experts(cfg, out))
    return out


def _ffn_tensors(arch: str, layer: str, rest: str, t, by_name: dict) -> list:
    """g.ffn.* of one block: a dense SwiGLU, the router, the stacked experts, the shared expert."""
    part = rest.split(".")[1:]  # after "ffn"
    moe = "block_sparse_moe" if arch == "MixtralForCausalLM" else "mlp"
    if part[0] in _FFN:  # dense SwiGLU: w_gate.weight
        return [_renamed(t, f"{layer}.mlp.{_FFN[part[0]]}.weight")]
    if part[0] == "router":
        if part[1] == "balance_bias":
            return []  # all zero (native_class checked): selects as no bias does
        return [_renamed(t, f"{layer}.{moe}.gate.weight")]
    if part[0] == "experts":
        m = part[1]
        names = _MIXTRAL_EXPERT if arch == "MixtralForCausalLM" else _FFN
        return [_expert(t, e, f"{layer}.{moe}.experts.{e}.{names[m]}.weight") for e in range(t.shape[0])]
    if part[0] == "shared":  # Qwen2-MoE: sigmoid(0) = 1/2 of a doubled down-projection
        m = part[1]
        out = [_renamed(t, f"{layer}.mlp.shared_expert.{_FFN[m]}.weight", scale=2.0 if m == "w_down" else 1.0)]
        if m == "w_gate":
            out.append(_zeros(f"{layer}.mlp.shared_expert_gate.weight", (1, t.shape[1]), t.dtype))
        return out
    raise ValueError(f"no {arch} counterpart for {rest}")


def _absent_shared_experts(cfg: ModelConfig, written: list) -> list:
    """Qwen2-MoE always has a shared expert: a zero one of one neuron where growtrain has none."""
    if cfg.moe.shared_expert_hidden:
        return []
    dtype = next(t.dtype for t in written if t.name.endswith("q_proj.weight"))
    out = []
    for i in cfg.moe_layers:
        p = f"model.layers.{i}.mlp"
        out += [_zeros(f"{p}.shared_expert.gate_proj.weight", (1, cfg.d_model), dtype), _zeros(f"{p}.shared_expert.up_proj.weight", (1, cfg.d_model), dtype),
                _zeros(f"{p}.shared_expert.down_proj.weight", (cfg.d_model, 1), dtype), _zeros(f"{p}.shared_expert_gate.weight", (1, cfg.d_model), dtype)]
    return out


def _renamed(t, name: str, scale: float = 1.0):
    from growtrain.hf_export import OutTensor

    rows = t.rows if scale == 1.0 else (lambda lo, hi, rows=t.rows: rows(lo, hi).float() * scale)
    return OutTensor(name, t.shape, t.dtype, rows)


def _expert(t, e: int, name: str):
    """Expert e's matrix of a stacked [E, ...] tensor, as a tensor of its own."""
    from growtrain.hf_export import OutTensor

    return OutTensor(name, t.shape[1:], t.dtype, lambda lo, hi, rows=t.rows: rows(e, e + 1)[0][lo:hi])


def _zeros(name: str, shape: tuple, dtype: torch.dtype):
    from growtrain.hf_export import OutTensor

    return OutTensor(name, tuple(shape), dtype, lambda lo, hi: torch.zeros((hi - lo, *shape[1:])))
