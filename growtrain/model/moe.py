"""Routed-expert FFN (DESIGN.md §4): fp32 router, top-k selection with a selection-only balance bias,
renormalized gates, dropless sort-based dispatch to a pluggable expert backend, weighted combine,
optional shared expert. Aux losses and routing statistics are returned, never stored.

Experts come in two formats (MoEConfig.expert_format): `Experts` (full precision, trainable) and
`NF4Experts` (growtrain/model/nf4.py: frozen NF4 bases plus per-expert LoRA). The MoE layer calls
its experts module on the expert-sorted rows; the module calls the backend of its format from the
registry: full-precision backends take the three stacked matrices, NF4 backends one
`NF4LoRAExperts` weights object (a fused NF4 kernel plugs in there under a new name).

Legend: T tokens (batch and sequence flattened), D d_model, E experts, K top-k, S = T*K token-slots,
F expert hidden width, E1 = E + 1 offsets.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch
from torch import nn

from growtrain.model.config import ModelConfig, MoEConfig
from growtrain.model.expert_backends import get_expert_backend
from growtrain.model.expert_parallel import EPGroup, expert_parallel_ffn
from growtrain.model.af import AFGroup, af_expert_ffn
from growtrain.model.layers import SwiGLU, compute_dtype, normal_init_, out_proj_std
from growtrain.model.nf4 import NF4Experts

def _autocast_off(device_type: str):
    # torch.autocast rejects device types without an autocast dtype (e.g. "meta").
    if device_type in ("cpu", "cuda"):
        return torch.autocast(device_type=device_type, enabled=False)
    return nullcontext()


class _PermuteRows(torch.autograd.Function):
    """x's rows in the order `perm`; the backward takes the gradient's rows in the inverse order.
    Autograd through x[perm] would scatter into a zero tensor of the whole input instead (a fill
    and an accumulating index_put of S x D per call, ~10% of a layer's CPU time at 256 experts).
    The values are the same: with a permutation every row gets exactly one gradient row."""

    @staticmethod
    def forward(ctx, x_SD: torch.Tensor, perm_S: torch.Tensor, inverse_S: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(inverse_S)
        return x_SD.index_select(0, perm_S)

    @staticmethod
    def backward(ctx, grad_SD: torch.Tensor):
        (inverse_S,) = ctx.saved_tensors
        return grad_SD.index_select(0, inverse_S), None, None


def permute_rows(x_SD: torch.Tensor, perm_S: torch.Tensor, inverse_S: torch.Tensor) -> torch.Tensor:
    """x_SD[perm_S], given inverse_S (inverse_S[perm_S[i]] = i) for a gather-only backward."""
    return _PermuteRows.apply(x_SD, perm_S, inverse_S)


@dataclass
class MoEStats:
    """What one MoE layer reports per forward."""

    aux_loss: torch.Tensor  # scalar: aux_loss_coef * load-balance + z_loss_coef * z-loss
    load: torch.Tensor  # [E] float, token-slots per expert, detached
    top_k_indices: torch.Tensor  # [T, K] int64, chosen experts, detached


class Router(nn.Module):
    def __init__(self, d_model: int, num_experts: int, init_std: float = 0.02):
        super().__init__()
        self.init_std = init_std
        self.weight = nn.Parameter(torch.empty(num_experts, d_model))
        # Persistent: loss-free balancing state must survive a resume.
        self.register_buffer("balance_bias", torch.zeros(num_experts), persistent=True)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        normal_init_(self.weight, self.init_std)
        with torch.no_grad():
            self.balance_bias.zero_()

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        """Router logits [T, E] in at least fp32, even under autocast: bf16 logits flip top-k ties."""
        dt = compute_dtype(x_TD.dtype)
        with _autocast_off(x_TD.device.type):
            return x_TD.to(dt) @ self.weight.to(dt).T


class Experts(nn.Module):
    """E SwiGLU experts with stacked weights."""

    def __init__(self, num_experts: int, d_model: int, hidden: int, init_std: float = 0.02, out_std: float | None = None):
        super().__init__()
        self.init_std = init_std
        self.out_std = init_std if out_std is None else out_std
        self.w_gate = nn.Parameter(torch.empty(num_experts, hidden, d_model))
        self.w_up = nn.Parameter(torch.empty(num_experts, hidden, d_model))
        self.w_down = nn.Parameter(torch.empty(num_experts, d_model, hidden))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        normal_init_(self.w_gate, self.init_std)
        normal_init_(self.w_up, self.init_std)
        normal_init_(self.w_down, self.out_std)

    def forward(self, x_sorted_ND: torch.Tensor, offsets_E1: torch.Tensor, backend: str = "reference") -> torch.Tensor:
        # Reading the parameters here (not in the MoE layer) lets wrappers that re-parametrize them
        # (peft's target_parameters LoRA) take effect.
        return get_expert_backend(backend, "full")(x_sorted_ND, offsets_E1, self.w_gate, self.w_up, self.w_down)


class MoE(nn.Module):
    is_moe = True  # read by FFNBranch to decide whether the FFN returns stats

    def __init__(self, config: ModelConfig):
        super().__init__()
        moe = config.moe
        if moe is None:
            raise ValueError("MoE layer needs config.moe")
        if not 1 <= moe.top_k <= moe.num_experts:
            raise ValueError(f"moe.top_k must be in 1..num_experts={moe.num_experts}, got {moe.top_k}")
        if moe.score_func not in ("softmax", "sigmoid"):
            raise ValueError(f"moe.score_func must be 'softmax' or 'sigmoid', got {moe.score_func!r}")
        self.config: MoEConfig = moe
        self.ep: EPGroup | None = None  # set by expert_parallel.shard_experts: this rank holds a slice
        self.af: AFGroup | None = None  # set by af.shard_af: the routed experts live on the AF layout's expert ranks
        self.af_layer = -1  # this layer's index among the model's MoE layers (the AF calls name it)
        # Runtime state, not shape (train.expert_backend): the trainer sets it after building,
        # restoring and growing the model (GrowLM.set_expert_backend).
        self.expert_backend = "reference"
        out_std = out_proj_std(config)
        self.router = Router(config.d_model, moe.num_experts, moe.router_init_std)
        if moe.expert_format == "nf4":
            self.experts: nn.Module = NF4Experts(
                moe.num_experts, config.d_model, moe.expert_hidden, moe.lora, moe.double_quant, config.init_std, out_std
            )
        else:
            self.experts = Experts(moe.num_experts, config.d_model, moe.expert_hidden, config.init_std, out_std)
        self.shared = (
            SwiGLU(config.d_model, moe.shared_expert_hidden, config.init_std, out_std)
            if moe.shared_expert_hidden > 0
            else None
        )

    def set_expert_backend(self, name: str) -> None:
        """Run the experts on backend `name` of this layer's expert format from now on."""
        get_expert_backend(name, self.config.expert_format)  # fail here, not at the first step
        self.expert_backend = name

    @property
    def num_experts(self) -> int:
        return self.config.num_experts

    def scores(self, logits_TE: torch.Tensor) -> torch.Tensor:
        if self.config.score_func == "softmax":
            return torch.softmax(logits_TE, dim=-1)
        return torch.sigmoid(logits_TE)

    def forward(self, x: torch.Tensor, routing: torch.Tensor | None = None) -> tuple[torch.Tensor, MoEStats]:
        """x: [..., D]. routing: optional [T, K] expert indices to reuse instead of top-k
        (gates are still computed from the current scores at those indices)."""
        cfg = self.config
        E, K = cfg.num_experts, cfg.top_k
        lead_shape, D = x.shape[:-1], x.shape[-1]
        x_TD = x.reshape(-1, D)
        T = x_TD.shape[0]

        logits_TE = self.router(x_TD)
        scores_TE = self.scores(logits_TE)
        if routing is None:
            with torch.no_grad():
                bias_E = self.router.balance_bias.to(scores_TE.dtype)
                idx_TK = torch.topk(scores_TE + bias_E, K, dim=-1).indices
        else:
            if routing.shape != (T, K):
                raise ValueError(f"routing must have shape [T, K] = [{T}, {K}], got {list(routing.shape)}")
            idx_TK = routing.to(device=x.device, dtype=torch.long)
        picked_TK = scores_TE.gather(1, idx_TK)
        gates_TK = picked_TK / picked_TK.sum(-1, keepdim=True).clamp_min(torch.finfo(picked_TK.dtype).tiny)

        # Dropless dispatch: a stable sort makes the row order, and so the result, deterministic.
        expert_S = idx_TK.reshape(-1)
        order_S = torch.argsort(expert_S, stable=True)
        # Offsets by binary search in the sorted ids, not bincount: CUDA's bincount reads the ids'
        # range on the host (an H200 counted 33 syncs per step with it, 1 without: 4 MoE layers,
        # 2 micro-batches, forward and reversible recompute).
        offsets_E1 = torch.searchsorted(expert_S[order_S], torch.arange(E + 1, device=x.device, dtype=expert_S.dtype))
        counts_E = offsets_E1[1:] - offsets_E1[:-1]
        # Expand-then-gather (not x_TD[order // K]): its backward is a plain sum over K plus a
        # permutation, with no accumulating scatter, so gradients are bitwise reproducible.
        x_SD = x_TD.unsqueeze(1).expand(T, K, D).reshape(T * K, D)
        inverse_S = torch.empty_like(order_S)
        inverse_S[order_S] = torch.arange(order_S.numel(), device=x.device)
        x_sorted_SD = permute_rows(x_SD, order_S, inverse_S)
        if self.af is not None:  # attention rank of an AF layout: the experts run elsewhere (growtrain/model/af.py)
            y_sorted_SD, load_E = af_expert_ffn(x_sorted_SD, counts_E, self.af, self.af_layer)
        elif self.ep is None:
            y_sorted_SD = self.experts(x_sorted_SD, offsets_E1, self.expert_backend)
            load_E = counts_E
        else:  # experts sharded over ranks: dispatch, compute, combine (growtrain/model/expert_parallel.py)
            y_sorted_SD, load_E = expert_parallel_ffn(self.experts, self.expert_backend, x_sorted_SD, counts_E, self.ep)
        y_TKD = permute_rows(y_sorted_SD, inverse_S, order_S).view(T, K, -1)
        # Combine in the wider of the two dtypes so bf16 expert outputs keep fp32 gate precision.
        dt = torch.promote_types(y_TKD.dtype, gates_TK.dtype)
        y_TD = (y_TKD.to(dt) * gates_TK.unsqueeze(-1).to(dt)).sum(dim=1)
        if self.shared is not None:
            y_TD = y_TD + self.shared(x_TD)

        stats = MoEStats(
            aux_loss=self._aux_loss(logits_TE, scores_TE, load_E),
            load=load_E.detach().to(torch.float32),
            top_k_indices=idx_TK.detach(),
        )
        return y_TD.reshape(*lead_shape, -1).to(x.dtype), stats

    def _aux_loss(self, logits_TE: torch.Tensor, scores_TE: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
        """counts_E: the load over the whole batch (all ranks under expert parallelism). With each
        rank's P_e from its own tokens, the mean over ranks of E·Σ f_e P_e is the whole batch's
        balance loss, and so is its gradient (equal tokens per rank)."""
        cfg = self.config
        zero = logits_TE.new_zeros(())
        if logits_TE.shape[0] == 0:
            return zero
        aux = zero
        if cfg.aux_loss_coef:
            # Switch-style balance loss: E * sum_e f_e * P_e, minimal (1) at uniform routing.
            frac_E = counts_E.to(scores_TE.dtype) / counts_E.sum()
            probs_TE = scores_TE / scores_TE.sum(-1, keepdim=True) if cfg.score_func == "sigmoid" else scores_TE
            aux = aux + cfg.aux_loss_coef * cfg.num_experts * (frac_E * probs_TE.mean(0)).sum()
        if cfg.z_loss_coef:
            aux = aux + cfg.z_loss_coef * torch.logsumexp(logits_TE, dim=-1).pow(2).mean()
        return aux


@torch.no_grad()
def update_balance_bias(moe_layer: MoE, load: torch.Tensor) -> None:
    """Loss-free balancing step: raise the selection bias of under-loaded experts, lower it for
    over-loaded ones, by a fixed rate times the sign of the load error."""
    rate = moe_layer.config.balance_bias_rate
    if rate == 0:
        return
    bias_E = moe_layer.router.balance_bias
    load_E = load.detach().to(device=bias_E.device, dtype=torch.float32)
    bias_E.add_((rate * torch.sign(load_E.mean() - load_E)).to(bias_E.dtype))
