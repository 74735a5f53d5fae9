"""A growtrain model for transformers (`growtrain export-hf`): two-stream additive coupling blocks
(or pre-norm residual blocks, `block_type: residual`, where no transformers class maps exactly)
with GQA attention and dense or routed-expert SwiGLU feed-forwards.

Self-contained (torch and transformers only), so the exported folder runs where growtrain is not
installed. It computes what growtrain's GrowLM computes, in the same order of operations:

    x1 = x2 = embed(tokens)                      (streams kept in float32 whatever the weights' dtype)
    block b:  y1 = x1 + attention(norm(x2))
              y2 = x2 + ffn(norm(y1))            (ffn: dense SwiGLU, or MoE)
    logits = lm_head(norm((y1 + y2) / 2))

MoE: float32 router logits, softmax or sigmoid scores, top-k over scores plus the selection-only
balance bias, gates renormalized over the chosen experts, SwiGLU experts stored stacked
([E, F, D] gate and up, [E, D, F] down), optional always-on shared expert. The router stays in
float32 in every export dtype (`_keep_in_fp32_modules`): bfloat16 logits would flip near-ties of
the top-k and so change which experts run.

Attention keys and values are kept in transformers' `DynamicCache`, built by `forward` when
`use_cache` is on and none is given, so `generate` decodes with a cache. transformers 5.24 renamed
the argument and output field `past_key_values` to `cache`; both names are accepted here.

Legend: B batch, T new positions, S cached plus new positions, D hidden, H query heads, K key/value
heads, Hd head size, E experts, F expert hidden, N token-slots.
"""

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import DynamicCache
from transformers.modeling_outputs import CausalLMOutputWithPast

try:  # transformers 5: initializers that skip weights already loaded from the checkpoint
    from transformers import initialization as init
except ImportError:  # transformers 4
    from torch.nn import init

from .configuration_growlm import GrowLMConfig


def _linear(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """A projection in its weights' dtype (the streams are float32; a bfloat16 export computes in bfloat16)."""
    return module(x.to(module.weight.dtype))


class GrowLMRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_f = x.to(torch.promote_types(x.dtype, torch.float32))
        x_f = x_f * torch.rsqrt(x_f.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x_f * self.weight.to(x_f.dtype)).to(x.dtype)


def rope_cos_sin(position_ids_BT: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [B, 1, T, Hd/2] of the half-split ("rotate half") convention, in float32."""
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, device=position_ids_BT.device, dtype=torch.float32) / head_dim)
    angles_BTH = position_ids_BT.to(torch.float32).unsqueeze(-1) * inv_freq
    return angles_BTH.cos().unsqueeze(1), angles_BTH.sin().unsqueeze(1)


def apply_rope(x_BHTd: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x_BHTd.shape[-1] // 2
    a, b = x_BHTd[..., :half], x_BHTd[..., half:]
    cos, sin = cos.to(x_BHTd.dtype), sin.to(x_BHTd.dtype)
    return torch.cat((a * cos - b * sin, a * sin + b * cos), dim=-1)


class GrowLMAttention(nn.Module):
    """Causal GQA self-attention; query head h reads key/value head h // (H / K)."""

    def __init__(self, config: GrowLMConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.rope_theta = config.rope_theta
        d = config.hidden_size
        bias = getattr(config, "qkv_bias", False)
        self.wq = nn.Linear(d, self.n_heads * self.head_dim, bias=bias)
        self.wk = nn.Linear(d, self.n_kv_heads * self.head_dim, bias=bias)
        self.wv = nn.Linear(d, self.n_kv_heads * self.head_dim, bias=bias)
        self.wo = nn.Linear(self.n_heads * self.head_dim, d, bias=False)

    def forward(self, x_BTD, position_ids_BT, attention_mask_BS, past_key_values):
        B, T, _ = x_BTD.shape
        q = _linear(self.wq, x_BTD).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        k = _linear(self.wk, x_BTD).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = _linear(self.wv, x_BTD).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = rope_cos_sin(position_ids_BT, self.head_dim, self.rope_theta)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if past_key_values is not None:
            k, v = past_key_values.update(k, v, self.layer_idx)
        S = k.shape[2]
        group = self.n_heads // self.n_kv_heads
        if group > 1:
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        if attention_mask_BS is None and S == T:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        elif attention_mask_BS is None and T == 1:  # one new position sees every cached one
            o = F.scaled_dot_product_attention(q, k, v)
        else:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=_mask(B, T, S, attention_mask_BS, q.device))
        return _linear(self.wo, o.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))


def _mask(B: int, T: int, S: int, attention_mask_BS, device) -> torch.Tensor:
    """[B, 1, T, S] bool: new position i (absolute S - T + i) sees keys 0..S - T + i that are not
    padding. A padding query that would see no key at all sees every key instead (its output is
    never read), so no row of the softmax is empty."""
    allowed = torch.ones(T, S, dtype=torch.bool, device=device).tril(diagonal=S - T).expand(B, 1, T, S)
    if attention_mask_BS is not None:
        allowed = allowed & attention_mask_BS[:, None, None, -S:].to(device=device, dtype=torch.bool)
    empty = ~allowed.any(-1, keepdim=True)
    return allowed | empty


class GrowLMSwiGLU(nn.Module):
    def __init__(self, d_model: int, hidden: int):
        super().__init__()
        self.w_gate = nn.Linear(d_model, hidden, bias=False)
        self.w_up = nn.Linear(d_model, hidden, bias=False)
        self.w_down = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _linear(self.w_down, F.silu(_linear(self.w_gate, x)) * _linear(self.w_up, x))


class GrowLMRouter(nn.Module):
    def __init__(self, d_model: int, num_experts: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, d_model))
        # Loss-free balancing's selection bias: it picks the experts, never weights them.
        self.register_buffer("balance_bias", torch.zeros(num_experts), persistent=True)


class GrowLMExperts(nn.Module):
    """E SwiGLU experts with stacked weights."""

    def __init__(self, num_experts: int, d_model: int, hidden: int):
        super().__init__()
        self.w_gate = nn.Parameter(torch.empty(num_experts, hidden, d_model))
        self.w_up = nn.Parameter(torch.empty(num_experts, hidden, d_model))
        self.w_down = nn.Parameter(torch.empty(num_experts, d_model, hidden))

    def forward(self, x_ND: torch.Tensor, expert_N: torch.Tensor) -> torch.Tensor:
        """Row n through expert expert_N[n]: rows grouped by expert, one matmul per expert present."""
        out_ND = x_ND.new_zeros(x_ND.shape[0], self.w_down.shape[1], dtype=self.w_down.dtype)
        order = torch.argsort(expert_N, stable=True)
        counts = torch.bincount(expert_N, minlength=self.w_gate.shape[0]).tolist()
        start = 0
        for e, n in enumerate(counts):
            if n:
                rows = order[start : start + n]
                h = x_ND[rows].to(self.w_gate.dtype)
                out_ND[rows] = (F.silu(h @ self.w_gate[e].T) * (h @ self.w_up[e].T)) @ self.w_down[e].T
                start += n
        return out_ND


class GrowLMMoE(nn.Module):
    def __init__(self, config: GrowLMConfig):
        super().__init__()
        self.top_k, self.score_func = config.num_experts_per_tok, config.router_score_func
        self.router = GrowLMRouter(config.hidden_size, config.num_experts)
        self.experts = GrowLMExperts(config.num_experts, config.hidden_size, config.moe_intermediate_size)
        hidden = config.shared_expert_intermediate_size
        self.shared = GrowLMSwiGLU(config.hidden_size, hidden) if hidden > 0 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead, D = x.shape[:-1], x.shape[-1]
        x_TD = x.reshape(-1, D)
        work = torch.promote_types(x_TD.dtype, torch.float32)
        logits_TE = x_TD.to(work) @ self.router.weight.to(work).T
        scores_TE = torch.softmax(logits_TE, dim=-1) if self.score_func == "softmax" else torch.sigmoid(logits_TE)
        idx_TK = torch.topk(scores_TE + self.router.balance_bias.to(scores_TE.dtype), self.top_k, dim=-1).indices
        picked_TK = scores_TE.gather(1, idx_TK)
        gates_TK = picked_TK / picked_TK.sum(-1, keepdim=True).clamp_min(torch.finfo(picked_TK.dtype).tiny)
        T, K = idx_TK.shape
        x_ND = x_TD.unsqueeze(1).expand(T, K, D).reshape(T * K, D)
        y_TKD = self.experts(x_ND, idx_TK.reshape(-1)).view(T, K, D)
        dt = torch.promote_types(y_TKD.dtype, gates_TK.dtype)
        y_TD = (y_TKD.to(dt) * gates_TK.unsqueeze(-1).to(dt)).sum(dim=1)
        if self.shared is not None:
            y_TD = y_TD + self.shared(x_TD)
        return y_TD.reshape(*lead, D).to(x.dtype)


class GrowLMAttentionBranch(nn.Module):
    def __init__(self, config: GrowLMConfig, layer_idx: int):
        super().__init__()
        self.norm = GrowLMRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn = GrowLMAttention(config, layer_idx)


class GrowLMFFNBranch(nn.Module):
    def __init__(self, config: GrowLMConfig, layer_idx: int):
        super().__init__()
        self.norm = GrowLMRMSNorm(config.hidden_size, config.rms_norm_eps)
        if layer_idx in config.moe_layers:
            self.ffn = GrowLMMoE(config)
        else:
            self.ffn = GrowLMSwiGLU(config.hidden_size, config.intermediate_size)


class GrowLMBlock(nn.Module):
    """Coupling: y1 = x1 + F(x2); y2 = x2 + G(y1). Residual (block_type residual, one stream held in
    both): h = x + F(x); y = h + G(h), returned as both streams. F = attention(norm(.)), G = ffn(norm(.))."""

    def __init__(self, config: GrowLMConfig, layer_idx: int):
        super().__init__()
        self.residual = config.block_type == "residual"
        self.f = GrowLMAttentionBranch(config, layer_idx)
        self.g = GrowLMFFNBranch(config, layer_idx)

    def forward(self, x1, x2, position_ids, attention_mask, past_key_values):
        if self.residual:
            h = x1 + self.f.attn(self.f.norm(x1), position_ids, attention_mask, past_key_values).to(x1.dtype)
            y = h + self.g.ffn(self.g.norm(h)).to(h.dtype)
            return y, y
        y1 = x1 + self.f.attn(self.f.norm(x2), position_ids, attention_mask, past_key_values).to(x1.dtype)
        y2 = x2 + self.g.ffn(self.g.norm(y1)).to(x2.dtype)
        return y1, y2


class GrowLMPreTrainedModel(PreTrainedModel):
    config_class = GrowLMConfig
    base_model_prefix = "model"
    _no_split_modules = ["GrowLMBlock"]
    # float32 under float16 (`_keep_in_fp32_modules`) and bfloat16 too (`_strict`, transformers >= 4.56).
    _keep_in_fp32_modules = ["router"]
    _keep_in_fp32_modules_strict = ["router"]

    def __init__(self, config: GrowLMConfig, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        if not config.moe_layers:  # no router: transformers 4 refuses names of modules that do not exist
            self._keep_in_fp32_modules = self._keep_in_fp32_modules_strict = None

    def _init_weights(self, module):
        std = self.config.initializer_range
        if isinstance(module, (nn.Linear, nn.Embedding)):
            init.normal_(module.weight, mean=0.0, std=std)
            if getattr(module, "bias", None) is not None:
                init.zeros_(module.bias)
        elif isinstance(module, GrowLMRMSNorm):
            init.ones_(module.weight)
        elif isinstance(module, GrowLMRouter):
            init.normal_(module.weight, mean=0.0, std=std)
            init.zeros_(module.balance_bias)
        elif isinstance(module, GrowLMExperts):
            for w in (module.w_gate, module.w_up, module.w_down):
                init.normal_(w, mean=0.0, std=std)


class GrowLMModel(GrowLMPreTrainedModel):
    def __init__(self, config: GrowLMConfig):
        super().__init__(config)
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.blocks = nn.ModuleList(GrowLMBlock(config, i) for i in range(config.num_hidden_layers))
        self.final_norm = GrowLMRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_init()

    def get_input_embeddings(self):
        return self.embed

    def set_input_embeddings(self, value):
        self.embed = value

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, inputs_embeds=None, use_cache=None, **kwargs):
        """The final hidden state, norm((y1 + y2) / 2), in float32, and the cache."""
        past_key_values = cache if cache is not None else kwargs.get("past_key_values")
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("give exactly one of input_ids and inputs_embeds")
        if inputs_embeds is None:
            inputs_embeds = self.embed(input_ids)
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if use_cache and past_key_values is None:
            past_key_values = _new_cache(self.config)
        B, T = inputs_embeds.shape[:2]
        past = past_key_values.get_seq_length() if past_key_values is not None else 0
        if position_ids is None:
            position_ids = torch.arange(past, past + T, device=inputs_embeds.device).unsqueeze(0).expand(B, T)
        if attention_mask is not None and bool(attention_mask.all()):
            attention_mask = None  # no padding: the causal fast paths
        # Streams in float32 (bfloat16 streams drift ~1e-3 per block in growtrain's measurements).
        x1 = x2 = inputs_embeds.to(torch.promote_types(inputs_embeds.dtype, torch.float32))
        for block in self.blocks:
            x1, x2 = block(x1, x2, position_ids, attention_mask, past_key_values if use_cache else None)
        return self.final_norm((x1 + x2) / 2), past_key_values if use_cache else None


# The output field that holds the cache: `cache` from transformers 5.24, `past_key_values` before.
_CACHE_FIELD = "cache" if "cache" in getattr(CausalLMOutputWithPast, "__dataclass_fields__", {}) else "past_key_values"


def _new_cache(config: GrowLMConfig) -> DynamicCache:
    try:
        return DynamicCache(config=config)  # transformers 5
    except TypeError:
        return DynamicCache()  # transformers 4


class GrowLMForCausalLM(GrowLMPreTrainedModel, GenerationMixin):
    def __init__(self, config: GrowLMConfig):
        super().__init__(config)
        self.model = GrowLMModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed

    def set_input_embeddings(self, value):
        self.model.embed = value

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, value):
        self.lm_head = value

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        cache=None,
        inputs_embeds=None,
        labels=None,
        use_cache=None,
        logits_to_keep=0,
        return_dict=None,
        past_key_values=None,
        **kwargs,
    ):
        cache = cache if cache is not None else past_key_values
        h_BTD, cache = self.model(input_ids, attention_mask, position_ids, cache, inputs_embeds, use_cache)
        if logits_to_keep:
            h_BTD = h_BTD[:, -logits_to_keep:]
        logits = _linear(self.lm_head, h_BTD).float()
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1).to(logits.device), ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits, **{_CACHE_FIELD: cache})
