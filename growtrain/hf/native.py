"""`growtrain export-hf` for residual models: transformers' own classes, no remote code, the
layouts inference engines (vLLM, SGLang) load natively (DESIGN.md §16, interop).

    dense                                                    LlamaForCausalLM
    dense with q/k/v biases (model.qkv_bias)                 Qwen2ForCausalLM
    every block MoE, no shared expert (softmax)              MixtralForCausalLM
    MoE in some blocks, a shared expert or q/k/v biases      Qwen2MoeForCausalLM
    sigmoid router (balance bias), MoE blocks after dense    Glm4MoeForCausalLM

Each mapping is exact: the same RMSNorm, rotate-half RoPE, GQA and SwiGLU; Mixtral's and
Qwen2-MoE's routers take softmax over all experts, top-k, and renormalize the chosen weights
(`norm_topk_prob`), which is growtrain's softmax routing. Qwen2-MoE's shared expert is gated by
sigmoid(shared_expert_gate · x): a zero gate gives exactly 1/2, so its down-projection is written
doubled (exact in binary floating point); without a shared expert it gets one zero neuron. Its
q/k/v biases (always present in transformers 4) are the model's, or zeros without model.qkv_bias. Experts are written one
tensor per expert and matrix (the layout transformers 4 defines and transformers 5 converts on load).

GLM-4-MoE routes as growtrain's sigmoid router does: sigmoid scores, top-k over scores plus a
selection-only bias (its e_score_correction_bias: our balance bias), the chosen scores
renormalized (one group, scaling factor 1); its shared experts are added ungated, padded here with
zero neurons to a whole number of expert widths; full RoPE (partial_rotary_factor 1). DeepSeek-V3's
class would route alike, but its attention (latent KV with a norm inside) does not compute GQA.

What does not map (a nonzero balance bias with softmax routing, a sigmoid router with MoE blocks
before dense ones) returns a reason, and `export-hf` writes the remote-code export instead, saying why.

Legend: E experts, F expert hidden, D d_model.
"""

from __future__ import annotations

import torch

from growtrain.hf.common import OutTensor, shape_config
from growtrain.model.config import ModelConfig


def native_class(cfg: ModelConfig, balance_bias_nonzero: bool) -> tuple[str | None, str]:
    """(transformers architecture, why) for a residual model; (None, why not) where none maps exactly."""
    if cfg.block != "residual":
        return None, "coupling blocks have no counterpart in transformers"
    if not cfg.moe_layers:
        if cfg.qkv_bias:
            return "Qwen2ForCausalLM", "dense residual blocks with q/k/v biases are Qwen2's"
        return "LlamaForCausalLM", "dense residual blocks are Llama's"
    moe = cfg.moe
    if moe.score_func == "sigmoid":
        k = cfg.n_layers - len(cfg.moe_layers)
        if sorted(cfg.moe_layers) != list(range(k, cfg.n_layers)):
            return None, f"a sigmoid router maps onto GLM-4-MoE, whose MoE blocks follow its dense ones; MoE blocks {list(cfg.moe_layers)} do not"
        if moe.num_experts < 2:
            return None, "GLM-4-MoE's grouped top-k needs 2+ experts"
        return "Glm4MoeForCausalLM", "sigmoid routing with a selection bias (GLM-4-MoE's e_score_correction_bias), MoE blocks after the dense ones"
    if balance_bias_nonzero:
        return None, "a nonzero balance bias with softmax routing: Mixtral and Qwen2-MoE have no selection bias"
    if len(cfg.moe_layers) == cfg.n_layers and not moe.shared_expert_hidden and not cfg.qkv_bias:
        return "MixtralForCausalLM", "every block MoE, softmax routing, no shared expert"
    return "Qwen2MoeForCausalLM", "softmax routing with dense blocks, a shared expert or q/k/v biases"


def _rope(cfg: ModelConfig) -> dict:
    # Both spellings: transformers 5 reads rope_parameters, 4 reads rope_theta.
    return {"rope_theta": cfg.rope_theta, "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta}}


def native_config(arch: str, cfg: ModelConfig, dtype: str, max_positions: int, eos_id: int) -> dict:
    common = {
        "architectures": [arch],
        **shape_config(cfg, max_positions, eos_id),
        "hidden_act": "silu",
        "attention_dropout": 0.0,
        "dtype": dtype,
        "torch_dtype": dtype,
        **_rope(cfg),
    }
    if arch == "LlamaForCausalLM":
        return {"model_type": "llama", **common, "intermediate_size": cfg.ffn_hidden, "attention_bias": False, "mlp_bias": False}
    if arch == "Qwen2ForCausalLM":
        return {"model_type": "qwen2", **common, "intermediate_size": cfg.ffn_hidden, "use_sliding_window": False, "sliding_window": None,
                "max_window_layers": cfg.n_layers}
    moe = cfg.moe
    if arch == "MixtralForCausalLM":
        return {
            "model_type": "mixtral", **common, "intermediate_size": moe.expert_hidden, "num_local_experts": moe.num_experts,
            "num_experts_per_tok": moe.top_k, "sliding_window": None, "router_jitter_noise": 0.0, "output_router_logits": False,
            "router_aux_loss_coef": moe.aux_loss_coef,
        }
    if arch == "Glm4MoeForCausalLM":
        rope = {**common["rope_parameters"], "partial_rotary_factor": 1.0}
        return {
            "model_type": "glm4_moe", **common, "rope_parameters": rope, "partial_rotary_factor": 1.0, "intermediate_size": cfg.ffn_hidden,
            "moe_intermediate_size": moe.expert_hidden, "n_routed_experts": moe.num_experts, "num_experts_per_tok": moe.top_k,
            "n_shared_experts": glm_shared_experts(cfg), "first_k_dense_replace": cfg.n_layers - len(cfg.moe_layers), "n_group": 1,
            "topk_group": 1, "norm_topk_prob": True, "routed_scaling_factor": 1.0, "attention_bias": cfg.qkv_bias, "use_qk_norm": False,
            "num_nextn_predict_layers": 0,
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
    """The export's tensors (hf_common.OutTensor, named as growtrain's base model) renamed, split
    per expert, and completed (zero biases, zero shared-expert gate) for `arch`."""
    out: list[OutTensor] = []
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
                else:  # attn.wq.weight, attn.wq.bias
                    _, matrix, kind = rest.split(".")
                    proj = _ATTN[matrix]
                    out.append(_renamed(t, f"{layer}.self_attn.{proj}.{kind}"))
                    if arch == "Qwen2MoeForCausalLM" and proj != "o_proj" and kind == "weight" and not cfg.qkv_bias:
                        out.append(_zeros(f"{layer}.self_attn.{proj}.bias", (t.shape[0],), t.dtype))
            elif rest == "norm.weight":
                out.append(_renamed(t, f"{layer}.post_attention_layernorm.weight"))
            else:
                out.extend(_ffn_tensors(arch, cfg, layer, rest, t))
    if arch in ("Qwen2MoeForCausalLM", "Glm4MoeForCausalLM"):
        out.extend(_absent_shared_experts(arch, cfg, out))
    return out


def glm_shared_experts(cfg: ModelConfig) -> int:
    """GLM-4-MoE's shared experts are n_shared_experts x moe_intermediate_size neurons wide: growtrain's
    shared expert padded with zero neurons (silu(0) * 0 = 0: exact) to the next multiple, at least one."""
    return max(1, -(-cfg.moe.shared_expert_hidden // cfg.moe.expert_hidden))


def _ffn_tensors(arch: str, cfg: ModelConfig, layer: str, rest: str, t) -> list:
    """g.ffn.* of one block: a dense SwiGLU, the router, the stacked experts, the shared expert."""
    part = rest.split(".")[1:]  # after "ffn"
    moe = "block_sparse_moe" if arch == "MixtralForCausalLM" else "mlp"
    if part[0] in _FFN:  # dense SwiGLU: w_gate.weight
        return [_renamed(t, f"{layer}.mlp.{_FFN[part[0]]}.weight")]
    if part[0] == "router":
        if arch == "Glm4MoeForCausalLM" and part[1] == "balance_bias":
            return [_renamed(t, f"{layer}.mlp.gate.e_score_correction_bias")]
        if part[1] == "balance_bias":
            return []  # all zero (native_class checked): selects as no bias does
        return [_renamed(t, f"{layer}.{moe}.gate.weight")]
    if part[0] == "experts":
        m = part[1]
        names = _MIXTRAL_EXPERT if arch == "MixtralForCausalLM" else _FFN
        return [_expert(t, e, f"{layer}.{moe}.experts.{e}.{names[m]}.weight") for e in range(t.shape[0])]
    if part[0] == "shared" and arch == "Glm4MoeForCausalLM":  # added as it is, padded with zero neurons
        m, width = part[1], glm_shared_experts(cfg) * cfg.moe.expert_hidden
        return [_padded(t, f"{layer}.mlp.shared_experts.{_FFN[m]}.weight", width, along=1 if m == "w_down" else 0)]
    if part[0] == "shared":  # Qwen2-MoE: sigmoid(0) = 1/2 of a doubled down-projection
        m = part[1]
        out = [_renamed(t, f"{layer}.mlp.shared_expert.{_FFN[m]}.weight", scale=2.0 if m == "w_down" else 1.0)]
        if m == "w_gate":
            out.append(_zeros(f"{layer}.mlp.shared_expert_gate.weight", (1, t.shape[1]), t.dtype))
        return out
    raise ValueError(f"no {arch} counterpart for {rest}")


def _absent_shared_experts(arch: str, cfg: ModelConfig, written: list) -> list:
    """Qwen2-MoE and GLM-4-MoE always have a shared expert: a zero one where growtrain has none
    (one neuron for Qwen2-MoE, with its gate; one expert's width for GLM-4-MoE)."""
    if cfg.moe.shared_expert_hidden:
        return []
    dtype = next(t.dtype for t in written if t.name.endswith("q_proj.weight"))
    width, name = (1, "shared_expert") if arch == "Qwen2MoeForCausalLM" else (cfg.moe.expert_hidden, "shared_experts")
    D, out = cfg.d_model, []
    for i in cfg.moe_layers:
        p = f"model.layers.{i}.mlp"
        out += [_zeros(f"{p}.{name}.gate_proj.weight", (width, D), dtype), _zeros(f"{p}.{name}.up_proj.weight", (width, D), dtype),
                _zeros(f"{p}.{name}.down_proj.weight", (D, width), dtype)]
        if arch == "Qwen2MoeForCausalLM":
            out.append(_zeros(f"{p}.shared_expert_gate.weight", (1, D), dtype))
    return out


def _padded(t, name: str, width: int, along: int):
    """`t` ([F, D], or [D, F] with along=1) with zero neurons appended up to `width`."""
    shape = list(t.shape)
    missing = width - shape[along]
    shape[along] = width
    if along == 0:  # rows are neurons: the (small) shared expert whole, padded, then the rows asked for
        rows = lambda lo, hi, rows=t.rows, n=t.shape[0]: torch.cat([rows(0, n).float(), torch.zeros(missing, shape[1])])[lo:hi]  # noqa: E731
    else:
        rows = lambda lo, hi, rows=t.rows: torch.cat([rows(lo, hi).float(), torch.zeros(hi - lo, missing)], dim=1)  # noqa: E731
    return OutTensor(name, tuple(shape), t.dtype, rows)


def _renamed(t, name: str, scale: float = 1.0):
    rows = t.rows if scale == 1.0 else (lambda lo, hi, rows=t.rows: rows(lo, hi).float() * scale)
    return OutTensor(name, t.shape, t.dtype, rows)


def _expert(t, e: int, name: str):
    """Expert e's matrix of a stacked [E, ...] tensor, as a tensor of its own."""
    return OutTensor(name, t.shape[1:], t.dtype, lambda lo, hi, rows=t.rows: rows(e, e + 1)[0][lo:hi])


def _zeros(name: str, shape: tuple, dtype: torch.dtype):
    return OutTensor(name, tuple(shape), dtype, lambda lo, hi: torch.zeros((hi - lo, *shape[1:])))
