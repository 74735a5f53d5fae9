"""Counting on the meta device: every parameter and buffer of a stage's real GrowLM and the real
optimizer's state, by role, read off the tensors those classes create (never a separate formula)."""

from __future__ import annotations

from dataclasses import dataclass

ROLES = ("attention", "dense_ffn", "router", "shared_expert", "routed_experts", "embeddings", "norms", "adapters")


def role_of(name: str) -> str:
    """The role of a parameter or buffer of GrowLM, from its name."""
    if name.startswith(("embed.", "lm_head.")):
        return "embeddings"
    if ".lora_" in name or "_lora_" in name:
        return "adapters"
    if ".ffn.experts." in name:
        return "routed_experts"
    if ".ffn.router." in name:
        return "router"
    if ".ffn.shared." in name:
        return "shared_expert"
    if ".f.attn." in name:
        return "attention"
    if name.endswith("norm.weight"):
        return "norms"
    if ".g.ffn.w_" in name:
        return "dense_ffn"
    return "other"


def _is_expert_tensor(name: str) -> bool:
    """Tensors that live with their experts under expert parallelism (leading dim E)."""
    return ".ffn.experts." in name and not name.endswith("quant_map")


def _weights_counted(name: str, t, is_param: bool) -> int:
    """Parameters count as stored; of the NF4 buffers only the codes do, two weights a byte
    (absmax, offsets and code books are quantization state, not weights)."""
    if is_param:
        return t.numel()
    return 2 * t.numel() if name.endswith("_codes") else 0


def _storage_kind(name: str, t, nf4: bool) -> str:
    if nf4 and ".ffn.experts." in name and "_lora_" not in name:
        return "nf4"
    return {"torch.float32": "fp32", "torch.bfloat16": "bf16", "torch.float16": "fp16"}.get(str(t.dtype), str(t.dtype).replace("torch.", ""))


@dataclass
class TensorInfo:
    name: str
    role: str
    params: int  # weights this tensor stores (NF4 codes: 2 per byte)
    bytes: int
    storage: str
    trainable: bool
    expert_sharded: bool
    optimizer_bytes: int = 0


@dataclass
class ModelCount:
    """Every parameter and buffer of one stage's model, read off the meta-device GrowLM."""

    tensors: list[TensorInfo]
    params_by_role: dict[str, int]
    params_total: int
    params_active: int
    routed_params: int
    expert_adapter_params: int
    trainable_params: int
    lm_head_params: int
    embed_params: int


def build_meta_model(cfg):
    import torch

    from growtrain.model import GrowLM

    with torch.device("meta"):
        return GrowLM(cfg)


def count_model(cfg, optimizer_cfg=None) -> ModelCount:
    """Parameter counts by role, active parameters per token, and per-tensor bytes (and, given the
    recipe's optimizer config, the bytes of its state for each trainable tensor)."""
    model = build_meta_model(cfg)
    nf4 = cfg.moe is not None and cfg.moe.expert_format == "nf4"
    tensors: list[TensorInfo] = []
    for name, p in model.named_parameters():
        tensors.append(
            TensorInfo(name, role_of(name), p.numel(), p.numel() * p.element_size(), _storage_kind(name, p, nf4), p.requires_grad, _is_expert_tensor(name))
        )
    for name, b in model.named_buffers():
        tensors.append(
            TensorInfo(name, role_of(name), _weights_counted(name, b, False), b.numel() * b.element_size(), _storage_kind(name, b, nf4), False, _is_expert_tensor(name))
        )
    if optimizer_cfg is not None:
        per_name = optimizer_state_bytes(model, optimizer_cfg)
        for t in tensors:
            t.optimizer_bytes = per_name.get(t.name, 0)
    by_role = {r: 0 for r in ROLES}
    for t in tensors:
        by_role[t.role] = by_role.get(t.role, 0) + t.params
    total = sum(by_role.values())
    routed = by_role["routed_experts"]
    expert_adapters = sum(t.params for t in tensors if t.role == "adapters" and ".ffn.experts." in t.name)
    share = cfg.moe.top_k / cfg.moe.num_experts if cfg.moe is not None and cfg.moe_layers else 0.0
    # Active per token: everything but the routed experts (and their adapters), plus top_k / E of
    # those. Embedding rows count in full, as is the convention for "activated parameters".
    active = total - routed - expert_adapters + round(share * (routed + expert_adapters))
    return ModelCount(
        tensors=tensors,
        params_by_role=by_role,
        params_total=total,
        params_active=active,
        routed_params=routed,
        expert_adapter_params=expert_adapters,
        trainable_params=sum(t.params for t in tensors if t.trainable),
        lm_head_params=sum(t.params for t in tensors if t.name.startswith("lm_head.")),
        embed_params=sum(t.params for t in tensors if t.name.startswith("embed.")),
    )


def optimizer_state_bytes(model, optimizer_cfg) -> dict[str, int]:
    """Bytes of the real optimizer's state per parameter name (AdamW, or its 8-bit variant),
    built on the meta device."""
    import torch

    from growtrain.optim.registry import build_optimizer

    with torch.device("meta"):
        opt = build_optimizer(dict(model.named_parameters()), optimizer_cfg)
    out = {}
    for name, entry in opt.state_dict().items():
        out[name] = sum(v.numel() * v.element_size() for v in entry.values() if isinstance(v, torch.Tensor))
    return out
