"""Dense building blocks of a coupling block: RMSNorm, RoPE, GQA attention, SwiGLU, and the two
branches F (norm + attention) and G (norm + FFN) of DESIGN.md §4.

Attention takes an optional `AttentionCache` (incremental decoding, growtrain/generate.py): new
positions continue from the cache's length, their keys and values are appended to it. Without a
cache it runs exactly the training computation.

Legend: B batch, T sequence (or tokens), S cached plus new positions, D d_model, H query heads,
K key/value heads, Hd head size, F FFN hidden width.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from growtrain.model.config import ModelConfig


def normal_init_(w: torch.Tensor, std: float) -> None:
    """nn.init.normal_(w, 0, std), skipped on the meta device: a meta tensor holds no values, and
    torch's meta normal_ imports torch._dynamo (~2 s), which the commands that only build meta
    models (plan, inspect, validate) would otherwise pay at every start. No random draw is
    skipped: meta tensors take none from the generator."""
    if not w.is_meta:
        nn.init.normal_(w, mean=0.0, std=std)


def out_proj_std(config: ModelConfig) -> float:
    """Std of projections that write into a residual stream: two per block add into the streams,
    so scaling by 1/sqrt(2 * n_layers) keeps the stream variance at init independent of depth."""
    return config.init_std / math.sqrt(2 * config.n_layers)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """At least fp32 (fp64 stays fp64, so that fp64 reference tests are exact)."""
    return torch.promote_types(dtype, torch.float32)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The mean of squares in bf16 loses ~3 significant digits; do it in fp32 and cast back.
        x_f = x.to(compute_dtype(x.dtype))
        x_f = x_f * torch.rsqrt(x_f.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x_f * self.weight.to(x_f.dtype)).to(x.dtype)


def rope_cos_sin(
    seq_len: int, head_dim: int, theta: float, device: torch.device | str | None = None, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin tables of shape [T, Hd/2] for the half-split ("rotate half") RoPE convention.

    Computed on the fly, not cached in buffers, so that meta construction and strict
    `load_state_dict` see only real state."""
    if head_dim % 2:
        raise ValueError(f"RoPE needs an even head size, got {head_dim}")
    work = compute_dtype(dtype)
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, device=device, dtype=work) / head_dim)
    pos = torch.arange(seq_len, device=device, dtype=work)
    angles_TH = torch.outer(pos, inv_freq)
    return angles_TH.cos().to(dtype), angles_TH.sin().to(dtype)


def apply_rope(x_BHTd: torch.Tensor, cos_TH: torch.Tensor, sin_TH: torch.Tensor) -> torch.Tensor:
    half = x_BHTd.shape[-1] // 2
    a, b = x_BHTd[..., :half], x_BHTd[..., half:]
    return torch.cat((a * cos_TH - b * sin_TH, a * sin_TH + b * cos_TH), dim=-1)


class Attention(nn.Module):
    """Causal GQA self-attention; query head h reads key/value head h // (H // K)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = config.n_heads, config.kv_heads, config.head_size
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})")
        self.rope_theta = config.rope_theta
        self.init_std, self.out_std = config.init_std, out_proj_std(config)
        d, hd = config.d_model, self.head_dim
        self.wq = nn.Linear(d, self.n_heads * hd, bias=config.qkv_bias)
        self.wk = nn.Linear(d, self.n_kv_heads * hd, bias=config.qkv_bias)
        self.wv = nn.Linear(d, self.n_kv_heads * hd, bias=config.qkv_bias)
        self.wo = nn.Linear(self.n_heads * hd, d, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for lin in (self.wq, self.wk, self.wv):
            normal_init_(lin.weight, self.init_std)
            if lin.bias is not None:
                nn.init.zeros_(lin.bias)
        normal_init_(self.wo.weight, self.out_std)

    def forward(self, x_BTD: torch.Tensor, cache: AttentionCache | None = None) -> torch.Tensor:
        """Causal attention over x; with `cache`, x holds the positions after the cached ones."""
        B, T, _ = x_BTD.shape
        start = 0 if cache is None else cache.length
        q_BHTd = self.wq(x_BTD).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        k_BKTd = self.wk(x_BTD).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v_BKTd = self.wv(x_BTD).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        cos_TH, sin_TH = rope_cos_sin(start + T, self.head_dim, self.rope_theta, x_BTD.device, q_BHTd.dtype)
        if start:  # RoPE positions continue after the cached ones
            cos_TH, sin_TH = cos_TH[start:], sin_TH[start:]
        q_BHTd = apply_rope(q_BHTd, cos_TH, sin_TH)
        k_BKTd = apply_rope(k_BKTd, cos_TH, sin_TH)
        if cache is not None:
            k_BKSd, v_BKSd = cache.append(k_BKTd, v_BKTd)
            if start:  # an empty cache (prefill) attends over the fresh tensors: the training path's exact operands
                k_BKTd, v_BKTd = k_BKSd, v_BKSd
        group = self.n_heads // self.n_kv_heads
        if group > 1:
            # Explicit repeat instead of SDPA's enable_gqa: that flag needs torch >= 2.5.
            k_BKTd = k_BKTd.repeat_interleave(group, dim=1)
            v_BKTd = v_BKTd.repeat_interleave(group, dim=1)
        if start == 0:
            o_BHTd = F.scaled_dot_product_attention(q_BHTd, k_BKTd, v_BKTd, is_causal=True)
        elif T == 1:  # one new position sees every cached one: no mask
            o_BHTd = F.scaled_dot_product_attention(q_BHTd, k_BKTd, v_BKTd)
        else:  # new position i (absolute start + i) sees keys 0..start + i
            S = start + T
            mask_TS = torch.ones(T, S, dtype=torch.bool, device=x_BTD.device).tril(diagonal=start)
            o_BHTd = F.scaled_dot_product_attention(q_BHTd, k_BKTd, v_BKTd, attn_mask=mask_TS)
        return self.wo(o_BHTd.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))


class AttentionCache:
    """One attention layer's keys and values (after RoPE) for incremental decoding: buffers
    [B, K, capacity, Hd] whose first `length` positions are filled. K/V heads are stored, not the
    repeated query heads (GQA: H / K times less memory). The buffers are allocated at the first
    append, in the keys' dtype and device (fp32, or bf16 under autocast), and grow by doubling when
    an append passes the capacity, so a capacity guess never limits the length."""

    def __init__(self, capacity: int = 0):
        self.capacity = capacity
        self.length = 0
        self.k_BKSd: torch.Tensor | None = None
        self.v_BKSd: torch.Tensor | None = None

    def append(self, k_BKTd: torch.Tensor, v_BKTd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store T new positions; return the keys and values of all `length` positions (views)."""
        end = self.length + k_BKTd.shape[2]
        if self.k_BKSd is None or end > self.k_BKSd.shape[2]:
            B, Kh, _, Hd = k_BKTd.shape
            size = max(end, self.capacity, 2 * (0 if self.k_BKSd is None else self.k_BKSd.shape[2]))
            k_new, v_new = (k_BKTd.new_empty(B, Kh, size, Hd) for _ in range(2))
            if self.k_BKSd is not None:
                k_new[:, :, : self.length] = self.k_BKSd[:, :, : self.length]
                v_new[:, :, : self.length] = self.v_BKSd[:, :, : self.length]
            self.k_BKSd, self.v_BKSd = k_new, v_new
        self.k_BKSd[:, :, self.length : end] = k_BKTd
        self.v_BKSd[:, :, self.length : end] = v_BKTd
        self.length = end
        return self.k_BKSd[:, :, :end], self.v_BKSd[:, :, :end]


class SwiGLU(nn.Module):
    def __init__(self, d_model: int, hidden: int, init_std: float = 0.02, out_std: float | None = None):
        super().__init__()
        self.init_std = init_std
        self.out_std = init_std if out_std is None else out_std
        self.w_gate = nn.Linear(d_model, hidden, bias=False)
        self.w_up = nn.Linear(d_model, hidden, bias=False)
        self.w_down = nn.Linear(hidden, d_model, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        normal_init_(self.w_gate.weight, self.init_std)
        normal_init_(self.w_up.weight, self.init_std)
        normal_init_(self.w_down.weight, self.out_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))


class AttentionBranch(nn.Module):
    """F of a coupling block: attention(RMSNorm(x))."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.norm = RMSNorm(config.d_model, config.norm_eps)
        self.attn = Attention(config)

    def forward(self, x_BTD: torch.Tensor, cache: AttentionCache | None = None) -> torch.Tensor:
        return self.attn(self.norm(x_BTD), cache)


class FFNBranch(nn.Module):
    """G of a coupling block: ffn(RMSNorm(x)), where ffn is a dense SwiGLU or an MoE layer.

    Returns (y, stats): stats is the MoE layer's MoEStats, or None for a dense FFN."""

    def __init__(self, config: ModelConfig, ffn: nn.Module):
        super().__init__()
        self.norm = RMSNorm(config.d_model, config.norm_eps)
        self.ffn = ffn

    @property
    def is_moe(self) -> bool:
        return bool(getattr(self.ffn, "is_moe", False))

    def forward(self, x_BTD: torch.Tensor, routing: torch.Tensor | None = None):
        h = self.norm(x_BTD)
        if self.is_moe:
            return self.ffn(h, routing=routing)
        if routing is not None:
            raise ValueError("routing= was given to a dense FFN branch")
        return self.ffn(h), None
