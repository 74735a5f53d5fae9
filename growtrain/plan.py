"""`growtrain plan`: what every stage of a recipe needs per GPU, and how fast it can run (DESIGN.md §13).

Nothing here trains or allocates weights. Each stage's shape comes from the growth operators'
`plan`s (`plan_stage_models`); its model is the real `GrowLM` built on the meta device, and its
optimizer the real `AdamW`, also on meta. So parameter counts and the bytes of weights, NF4 codes,
gradients and optimizer state are read off the tensors those classes create, never from a separate
formula. What cannot be read off a meta model — activations, time — is modelled:

- Activations: `activation_bytes` lists, op by op, the tensors autograd saves for backward in
  GrowLM's forward (norms, attention, SwiGLU, router, dispatch, the expert backends, the head and
  cross-entropy), counting a storage once as `growtrain.memory.SavedTensorMeter` does. Plain
  autograd holds every block's; the reversible backward holds the two fp32 streams, the routing
  ids and one block's recompute at a time. tests/test_plan.py checks the model against the meter
  on small CPU models (fp32 and bf16, dense, MoE, NF4 + LoRA). Non-saved transients (the logits'
  gradient, the streams rebuilt in the reversible backward, bf16 weight copies autocast caches
  during the forward) are a rougher allowance, `workspace`.
- Sharding (DESIGN.md §12): routed experts contiguously over an expert-parallel group of every
  GPU (weights, gradients and optimizer state of the local experts); everything else data
  parallel with the weights and gradients replicated and the optimizer state sharded (ZeRO-1).
  `batch_size` means what it means to the trainer: sequences per micro-batch over all GPUs (each of
  G GPUs trains batch_size / G of them), so a step is batch × seq × accum tokens whatever G is.
- Time: a roofline per phase (dense part, routed experts), each `max(FLOPs / peak, bytes / HBM)`,
  plus the expert-parallel all-to-all (the dispatch waits for the router, so it is not hidden) and
  the data-parallel gradient sync. Attention/expert disaggregation (DisagMoE) searches every split
  of the GPUs into attention and expert ranks with `T = max(FLOPs / (gpus × peak), bytes / bandwidth)`
  per side and micro-batches pipelined between them.

Legend: B micro-batch (sequences), T sequence length, N = B·T tokens, D d_model, H query heads,
Kv key/value heads, Hd head size, F dense FFN width, E routed experts, K top-k, Fe expert width,
Fs shared-expert width, S = N·K token-slots, V vocabulary, r LoRA rank, G GPUs.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import asdict, dataclass, replace

GB = 1e9
GIB = 2**30
# PyTorch DDP's default gradient bucket (bucket_cap_mb=25); two in flight while one reduces.
GRAD_BUCKET_BYTES = 25 * 2**20
# CUDA context, cuBLAS workspaces and NCCL's own buffers: a rough allowance (the CUDA context alone
# is ~0.5 GiB on a Hopper GPU), not a measurement.
RUNTIME_RESERVE_BYTES = int(1.5 * GIB)
HEADROOM_TARGET = 0.10


class PlanError(Exception):
    """A planning request that cannot be answered (unknown preset, missing vocabulary size)."""


# ---------------------------------------------------------------------------------------------
# Hardware presets


@dataclass(frozen=True)
class Hardware:
    """One GPU model and the node it sits in. Bandwidths are per GPU and per direction."""

    name: str
    peak_tflops: float  # dense BF16 tensor-core peak (no 2:4 sparsity)
    hbm_gbps: float
    nvlink_gbps: float  # per direction (datasheets quote both directions added)
    nic_gbps: float  # GB/s per GPU to other nodes, per direction (one NIC per GPU)
    capacity_gb: float
    gpus_per_node: int = 8
    nodes: int = 1
    source: str = ""

    @property
    def gpus(self) -> int:
        return self.gpus_per_node * self.nodes

    @property
    def peak_flops(self) -> float:
        return self.peak_tflops * 1e12

    @property
    def capacity_bytes(self) -> int:
        return int(self.capacity_gb * GB)


# Vendor datasheet figures (NVIDIA A100, H100, H200 and HGX/DGX B200 datasheets): dense BF16
# tensor-core TFLOP/s (half the "with sparsity" figure), HBM bandwidth, NVLink (900 GB/s
# bidirectional on Hopper = 450 GB/s each way; 600 -> 300 on A100; 1.8 TB/s -> 900 on Blackwell),
# the DGX systems' one ConnectX NIC per GPU (A100: 200 Gb/s HDR = 25 GB/s; H100/H200/B200:
# 400 Gb/s NDR = 50 GB/s), and memory as sold (GB = 1e9 bytes; B200: 1,440 GB per DGX B200 / 8).
PRESETS: dict[str, Hardware] = {
    "a100-80gb": Hardware("a100-80gb", 312.0, 2039.0, 300.0, 25.0, 80.0, source="NVIDIA A100 80GB SXM datasheet"),
    "h100-80gb": Hardware("h100-80gb", 989.0, 3350.0, 450.0, 50.0, 80.0, source="NVIDIA H100 SXM5 datasheet"),
    "h200-141gb": Hardware("h200-141gb", 989.0, 4800.0, 450.0, 50.0, 141.0, source="NVIDIA H200 SXM datasheet"),
    "b200": Hardware("b200", 2250.0, 8000.0, 900.0, 50.0, 180.0, source="NVIDIA HGX/DGX B200 datasheet"),
}


def get_hardware(name: str, **overrides) -> Hardware:
    """A preset by name, with any of its figures overridden (None: keep the preset's)."""
    if name not in PRESETS:
        raise PlanError(f"unknown hardware preset '{name}'; valid: {', '.join(PRESETS)}")
    hw = PRESETS[name]
    changes = {k: v for k, v in overrides.items() if v is not None}
    for key, value in changes.items():
        if value <= 0:
            raise PlanError(f"--{key.replace('_', '-')} must be positive, got {value}")
    if changes:
        hw = replace(hw, **changes, source=hw.source + " (overridden: " + ", ".join(sorted(changes)) + ")")
    return hw


# ---------------------------------------------------------------------------------------------
# Counting on the meta device

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

    from growtrain.optim_registry import build_optimizer

    with torch.device("meta"):
        opt = build_optimizer(dict(model.named_parameters()), optimizer_cfg)
    out = {}
    for name, entry in opt.state_dict().items():
        out[name] = sum(v.numel() * v.element_size() for v in entry.values() if isinstance(v, torch.Tensor))
    return out


# ---------------------------------------------------------------------------------------------
# Activations: the tensors autograd saves, op by op


class _Saved:
    """Storages held for backward, by a key naming each tensor: one storage is counted once, as
    SavedTensorMeter counts it. `phase` tags bytes as the dense part's or the routed experts'."""

    def __init__(self):
        self.items: dict[str, tuple[int, str]] = {}

    def add(self, key: str, numel: float, width: int, phase: str = "dense") -> None:
        if numel > 0 and key not in self.items:
            self.items[key] = (math.ceil(numel * width), phase)

    def total(self, phase: str | None = None) -> int:
        return sum(b for b, ph in self.items.values() if phase is None or ph == phase)


def _norm(s: _Saved, p: str, x_key: str, N: int, D: int) -> str:
    """RMSNorm: its input, the reciprocal RMS, and the normalized input (for the weight's grad).
    Returns the key of its fp32 output."""
    s.add(x_key, N * D, 4)
    s.add(p + "rstd", N, 4)
    s.add(p + "xn", N * D, 4)
    return p + "h"


def _linear(s: _Saved, p: str, x_key: str, x_width: int, rows: int, d_in: int, d_out: int, w_key: str, a: int, phase: str = "dense") -> None:
    """nn.Linear / matmul with a trainable weight: saves its input. Under bf16 autocast the input is
    cast (a new copy per call, unless already bf16) and so is the weight (a leaf: cached once per
    autocast region, saved by every use)."""
    if a == 4 or x_width == a:
        s.add(x_key, rows * d_in, x_width, phase)
    else:
        s.add(p + x_key + "@bf16", rows * d_in, a, phase)
    if a != 4:
        s.add(w_key + "@bf16", d_in * d_out, a, phase)


def _swiglu(s: _Saved, p: str, h_key: str, N: int, D: int, F: int, a: int) -> None:
    """SwiGLU on a dense nn.Linear trio: gate and up read h; silu saves its input g, the product
    saves silu(g) and u; the down projection saves the product."""
    _linear(s, p + "gate.", h_key, 4, N, D, F, p + "w_gate", a)
    _linear(s, p + "up.", h_key, 4, N, D, F, p + "w_up", a)
    for t in ("g", "s", "u", "prod"):
        s.add(p + t, N * F, a)
    _linear(s, p + "down.", p + "prod", a, N, F, D, p + "w_down", a)


def _attention(s: _Saved, p: str, x_key: str, cfg, B: int, T: int, a: int) -> None:
    N, D, H, Kv, Hd = B * T, cfg.d_model, cfg.n_heads, cfg.kv_heads, cfg.head_size
    h = _norm(s, p + "norm.", x_key, N, D)
    for w, out in (("wq", H * Hd), ("wk", Kv * Hd), ("wv", Kv * Hd)):
        _linear(s, p + w + ".", h, 4, N, D, out, p + w, a)
    s.add(p + "cos", T * Hd // 2, a)  # RoPE tables, computed per call in q's dtype
    s.add(p + "sin", T * Hd // 2, a)
    # SDPA saves q, k, v (GQA repeats k and v to H heads first), its output and log-sum-exp.
    s.add(p + "q", B * H * T * Hd, a)
    s.add(p + "k", B * H * T * Hd, a)
    s.add(p + "v", B * H * T * Hd, a)
    s.add(p + "o", B * H * T * Hd, a)
    s.add(p + "lse", B * H * T, 4)  # flash/efficient attention's log-sum-exp, fp32
    s.add(p + "o_flat", N * H * Hd, a)  # transpose + reshape copy read by wo
    _linear(s, p + "wo.", p + "o_flat", a, N, H * Hd, D, p + "wo", a)


def _expected_active(experts: int, routed_tokens: int, top_k: int, num_experts: int) -> float:
    """Experts (of `experts` here) that receive at least one of the routed tokens' slots, if
    routing were uniform: each token picks top_k distinct of num_experts."""
    return experts * (1.0 - (1.0 - top_k / num_experts) ** routed_tokens)


def _moe(s: _Saved, p: str, x_key: str, cfg, N: int, a: int, local_experts: int, routed_tokens: int) -> None:
    """The MoE layer (growtrain/model/moe.py) and its expert backend (the reference backends of
    growtrain.kernels). `local_experts` of E live here; `routed_tokens` tokens (over every rank)
    choose among all E experts."""
    moe, D = cfg.moe, cfg.d_model
    E, K, Fe = moe.num_experts, moe.top_k, moe.expert_hidden
    S = N * K
    h = _norm(s, p + "norm.", x_key, N, D)
    s.add(h, N * D, 4)  # the router runs in fp32 with autocast off and saves its fp32 input
    s.add(p + "scores", N * E, 4)  # softmax / sigmoid output
    s.add(p + "idx", N * K, 8)  # gather's int64 index
    s.add(p + "denom", N, 4)
    s.add(p + "denom_clamped", N, 4)
    s.add(p + "picked", N * K, 4)
    s.add(p + "order", S, 8, "experts")
    # Experts that receive at least one slot (each token picks K distinct of E).
    active = _expected_active(local_experts, routed_tokens, K, E)
    ex = p + "experts."
    # The grouped SwiGLU Function (growtrain.kernels reference backends) saves the sorted rows once
    # in their own dtype (fp32: the router's input), the gate and up pre-activations, and, with
    # LoRA, x @ A^T of each matrix; autocast's casts of x and of the weights are redone in the backward.
    s.add(ex + "x_sorted", S * D, 4, "experts")
    s.add(ex + "g", S * Fe, a, "experts")
    s.add(ex + "u", S * Fe, a, "experts")
    if moe.expert_format == "nf4":
        # The dequantized bases of the experts with rows (frozen, kept for the input's gradient).
        s.add(ex + "bases", active * 3 * Fe * D, a, "experts")
        s.add(ex + "xa", 3 * S * moe.lora.r, a, "experts")
    s.add(p + "inverse", S, 8, "experts")
    s.add(p + "gates", N * K, 4)
    s.add(p + "y_tkd", S * D, 4, "experts")  # combine runs in fp32: the gathered expert outputs
    if moe.aux_loss_coef:
        s.add(p + "frac", E, 4)
        if moe.score_func == "sigmoid":
            s.add(p + "score_sum", N, 4)
    if moe.z_loss_coef:
        s.add(p + "logits", N * E, 4)
        s.add(p + "lse", N, 4)
    if moe.shared_expert_hidden:
        _swiglu(s, p + "shared.", h, N, D, moe.shared_expert_hidden, a)


def _ffn_branch(s: _Saved, p: str, x_key: str, cfg, index: int, B: int, T: int, a: int, local_experts: int, routed_tokens: int) -> None:
    N = B * T
    if cfg.is_moe_layer(index):
        _moe(s, p, x_key, cfg, N, a, local_experts, routed_tokens)
    else:
        h = _norm(s, p + "norm.", x_key, N, cfg.d_model)
        _swiglu(s, p, h, N, cfg.d_model, cfg.ffn_hidden, a)


def _head(s: _Saved, cfg, B: int, T: int, a: int) -> None:
    N, D, V = B * T, cfg.d_model, cfg.vocab_size
    h = _norm(s, "head.norm.", "head.in", N, D)
    _linear(s, "head.lm.", h, 4, N, D, V, "lm_head", a)
    s.add("head.log_softmax", N * V, 4)  # cross-entropy on fp32 logits saves log_softmax's output
    s.add("head.targets", N, 8)
    s.add("head.total_weight", 1, 4)


@dataclass
class Activations:
    """Bytes for one micro-batch on one GPU."""

    saved_peak: int  # peak bytes held for backward (the quantity tests check against the meter)
    saved_forward_end: int
    saved_backward_peak: int
    per_block: list[int]  # saved bytes of each block's F + G (plain autograd keeps them all)
    block_dense: list[int]  # of which the dense part
    block_experts: list[int]  # of which the routed experts' dispatch and compute
    head: int
    streams: int
    workspace: int  # non-saved transients of the backward (approximate)
    forward_logits: int  # logits and their fp32 copy alive at the end of the forward
    tokens: int  # N = batch x seq of the micro-batch


def activation_bytes(cfg, batch: int, seq: int, precision: str = "fp32", reversible: bool | None = None, *, local_experts: int | None = None, routed_tokens: int | None = None) -> Activations:
    """Saved-for-backward bytes of one forward+backward of `GrowLM(cfg)` on [batch, seq] tokens,
    with the training loop's loss (growtrain.train.forward_loss: cross-entropy on fp32 logits plus
    the aux loss). `local_experts` (default E) and `routed_tokens` (default batch·seq) describe an
    expert-parallel rank."""
    reversible = cfg.reversible if reversible is None else reversible
    a = 2 if precision == "bf16" else 4
    B, T, N, D = batch, seq, batch * seq, cfg.d_model
    E = cfg.moe.num_experts if cfg.moe is not None else 0
    local = E if local_experts is None else local_experts
    routed = N if routed_tokens is None else routed_tokens

    base = _Saved()
    base.add("tokens", B * (T + 1), 8)  # the embedding saves its int64 indices (a [B, T+1] batch)
    blocks_f, blocks_g = [], []
    for i in range(cfg.n_layers):
        f, g = _Saved(), _Saved()
        _attention(f, "f.", "x_in", cfg, B, T, a)
        _ffn_branch(g, "g.", "y_in", cfg, i, B, T, a, local, routed)
        blocks_f.append(f)
        blocks_g.append(g)
    head = _Saved()
    _head(head, cfg, B, T, a)
    per_block = [f.total() + g.total() for f, g in zip(blocks_f, blocks_g)]
    block_experts = [g.total("experts") for g in blocks_g]
    block_dense = [pb - be for pb, be in zip(per_block, block_experts)]
    stream = N * D * 4
    routing_width = 1 if E <= 256 else 2 if E <= 32768 else 4  # reversible.py keeps the narrowest int
    routing = sum(N * cfg.moe.top_k * routing_width for i in range(cfg.n_layers) if cfg.is_moe_layer(i)) if E else 0

    if reversible:
        fixed = base.total() + 2 * stream + routing
        forward_end = fixed + head.total()
        # Backward: one block's G, then its F, is rebuilt with grad on at a time. The last block's
        # G reads the saved y1 itself (same storage); every other block's input is a new tensor.
        worst = 0
        for i, (f, g) in enumerate(zip(blocks_f, blocks_g)):
            g_bytes = g.total() - (stream if i == cfg.n_layers - 1 else 0)
            worst = max(worst, g_bytes, f.total())
        backward_peak = fixed + worst
        streams = 2 * stream
    else:
        forward_end = base.total() + sum(per_block) + head.total()
        backward_peak = forward_end
        streams = 0

    # Not saved, but alive (approximate): the head's backward holds the gradient of log_softmax's
    # output and of the logits ([N, V] fp32 each); a block's backward the four streams (rebuilt
    # x1, x2 and their gradients) and the gradient of its widest activation.
    widest = 8 * N * max(D, cfg.ffn_hidden, D * cfg.moe.top_k if cfg.moe is not None and cfg.moe_layers else 0)
    workspace = max(N * cfg.vocab_size * 8, 4 * stream + widest)
    return Activations(
        saved_peak=max(forward_end, backward_peak),
        saved_forward_end=forward_end,
        saved_backward_peak=backward_peak,
        per_block=per_block,
        block_dense=block_dense,
        block_experts=block_experts,
        head=head.total(),
        streams=streams,
        workspace=workspace,
        forward_logits=N * cfg.vocab_size * (a + (4 if a != 4 else 0)),
        tokens=N,
    )


def autocast_weight_cache(cfg, count: ModelCount, precision: str) -> int:
    """bf16 autocast caches one bf16 copy of every leaf weight it casts (attention, dense and
    shared FFNs, LM head; not the router, not expert slices) until the forward's autocast exits.
    Plain autograd saves those copies anyway (they are in the saved bytes); the reversible forward
    saves nothing, so they come on top."""
    if precision != "bf16" or not cfg.reversible:
        return 0
    r = count.params_by_role
    return 2 * (r["attention"] + r["dense_ffn"] + r["shared_expert"] + count.lm_head_params)


def workspace_bytes(cfg, count: ModelCount, acts: Activations, precision: str) -> int:
    """Non-saved memory at the worse of the forward's end (autocast's weight cache, the logits)
    and the backward (the logits' gradients, a block's rebuilt streams and gradients)."""
    return max(acts.workspace, autocast_weight_cache(cfg, count, precision) + acts.forward_logits)


# ---------------------------------------------------------------------------------------------
# Memory per GPU


def _expert_share(cfg, gpus: int) -> float:
    """Fraction of each expert tensor on the most loaded GPU (experts sharded contiguously)."""
    if cfg.moe is None or not cfg.moe_layers:
        return 1.0
    E = cfg.moe.num_experts
    return math.ceil(E / gpus) / E


def memory_per_gpu(cfg, count: ModelCount, acts: Activations, gpus: int, precision: str) -> dict:
    share = _expert_share(cfg, gpus)
    weights: dict[str, float] = defaultdict(float)
    grads = opt = 0.0
    for t in count.tensors:
        frac = share if t.expert_sharded else 1.0
        weights[t.storage] += t.bytes * frac
        if t.trainable:
            grads += t.bytes * frac  # gradients in the parameter's dtype
            # ZeRO-1: the dense parameters' state is sharded over all GPUs; the experts' state
            # lives with them.
            opt += t.optimizer_bytes * (frac if t.expert_sharded else 1.0 / gpus)
    comm = 0
    if gpus > 1:
        a = 2 if precision == "bf16" else 4
        comm = 2 * GRAD_BUCKET_BYTES
        if cfg.moe is not None and cfg.moe_layers:
            # Dispatch and combine, each a send and a receive buffer of the micro-batch's token-slots.
            comm += 4 * acts.tokens * cfg.moe.top_k * cfg.d_model * a
    w = {k: int(v) for k, v in sorted(weights.items())}
    workspace = workspace_bytes(cfg, count, acts, precision)
    total = sum(w.values()) + int(grads) + int(opt) + acts.saved_peak + workspace + comm + RUNTIME_RESERVE_BYTES
    return {
        "weights": w,
        "weights_total": sum(w.values()),
        "gradients": int(grads),
        "optimizer": int(opt),
        "activations": acts.saved_peak,
        "workspace": workspace,
        "communication": comm,
        "runtime_reserve": RUNTIME_RESERVE_BYTES,
        "total": total,
    }


# ---------------------------------------------------------------------------------------------
# Roofline


@dataclass
class Side:
    """FLOPs and HBM bytes of one micro-batch of one phase (the dense part, or the routed experts)
    as if one GPU ran it all: weights read per pass, gradient traffic, activation traffic."""

    flops: float
    weight_bytes: float  # weights read by all passes
    grad_bytes: float  # read + write of the fp32 gradients
    act_bytes: float  # saved activations written and read
    trainable_bytes: float  # for the optimizer step
    optimizer_bytes: float

    @property
    def hbm_bytes(self) -> float:
        return self.weight_bytes + self.grad_bytes + self.act_bytes

    def hbm_bytes_with(self, share: float) -> float:
        """With `share` of the weights (and their gradients) on this GPU."""
        return (self.weight_bytes + self.grad_bytes) * share + self.act_bytes


@dataclass
class Work:
    dense: Side
    experts: Side  # all E experts' weights; one micro-batch's slots (what one GPU receives when balanced)
    model_flops: float  # forward + backward without the reversible recompute (MFU numerator)
    dispatch_bytes: float  # bytes of every token-slot row crossing dispatch + combine, all passes


def _flops_per_token(cfg, count: ModelCount, seq: int, reversible: bool) -> tuple[float, float, float]:
    """(dense, expert, model) FLOPs per token for forward + backward (+ reversible recompute)."""
    roles = count.params_by_role
    matmul_dense = roles["attention"] + roles["dense_ffn"] + roles["shared_expert"] + roles["router"]
    dense_adapters = roles["adapters"] - count.expert_adapter_params
    share = cfg.moe.top_k / cfg.moe.num_experts if cfg.moe is not None and cfg.moe_layers else 0.0
    routed = share * count.routed_params
    expert_adapters = share * count.expert_adapter_params
    frozen_routed = cfg.moe is not None and cfg.moe.expert_format == "nf4"
    # Causal attention scores and values: 2·2·Hd·t per head at position t, averaged over t.
    attn_core = cfg.n_layers * 2 * cfg.n_heads * cfg.head_size * (seq + 1)
    block_fwd_dense = 2 * (matmul_dense + dense_adapters) + attn_core
    head_fwd = 2 * count.lm_head_params
    expert_fwd = 2 * (routed + expert_adapters)
    # Backward: input and weight gradients (2x forward); frozen NF4 bases only the input's (1x).
    expert_bwd = 2 * routed * (1 if frozen_routed else 2) + 2 * 2 * expert_adapters
    dense_model = 3 * (block_fwd_dense + head_fwd)
    expert_model = expert_fwd + expert_bwd
    recompute = 1 if reversible else 0
    return dense_model + recompute * block_fwd_dense, expert_model + recompute * expert_fwd, dense_model + expert_model


def train_flops_per_token(cfg, seq: int) -> float:
    """FLOPs one trained token costs on `cfg` (dense + routed experts, forward + backward and the
    reversible recompute): the weight the trainer's ETA gives each stage's steps (progress.py)."""
    dense, expert, _ = _flops_per_token(cfg, count_model(cfg), seq, cfg.reversible)
    return dense + expert


def _passes(reversible: bool) -> int:
    return 3 if reversible else 2  # forward, backward (and the reversible recompute)


def micro_batch_work(cfg, count: ModelCount, acts: Activations, batch: int, seq: int, precision: str) -> Work:
    """One micro-batch's work. Weights are read once per pass at their stored width (NF4 bases as
    codes + absmax: a fused dequantizing kernel); under bf16 autocast an fp32 weight is also
    cast (read 4, write 2, read 2 bytes). The embedding reads only its N rows. Each micro-batch
    reads and writes every fp32 gradient once. Saved activations are written once and read once
    by each pass after the first."""
    N = batch * seq
    rev = cfg.reversible
    dense_f, expert_f, model_f = _flops_per_token(cfg, count, seq, rev)
    passes = _passes(rev)
    cast = 2 if precision == "bf16" else 1

    def weight_read(t: TensorInfo) -> float:
        if t.name.startswith("embed."):
            return N * cfg.d_model * 4
        return t.bytes * (cast if t.storage == "fp32" and t.params else 1)

    def side(expert: bool, flops: float, act: float) -> Side:
        ts = [t for t in count.tensors if t.expert_sharded == expert]
        return Side(
            flops=flops * N,
            weight_bytes=passes * sum(weight_read(t) for t in ts),
            grad_bytes=2 * sum(t.bytes for t in ts if t.trainable),
            act_bytes=2 * act * (passes - 1),
            trainable_bytes=sum(t.bytes for t in ts if t.trainable),
            optimizer_bytes=sum(t.optimizer_bytes for t in ts),
        )

    a = 2 if precision == "bf16" else 4
    n_moe = len(cfg.moe_layers) if cfg.moe is not None else 0
    K = cfg.moe.top_k if cfg.moe is not None else 0
    return Work(
        dense=side(False, dense_f, sum(acts.block_dense) + acts.head),
        experts=side(True, expert_f, sum(acts.block_experts)),
        model_flops=model_f * N,
        # Per MoE layer and pass: dispatch and combine move N·K rows of D.
        dispatch_bytes=n_moe * passes * 2 * N * K * cfg.d_model * a,
    )


def _phase_time(flops: float, nbytes: float, gpus: int, hw: Hardware) -> float:
    """The issue's roofline: T = max(FLOPs / (gpus x peak), bytes / bandwidth), `nbytes` per GPU."""
    return max(flops / (gpus * hw.peak_flops), nbytes / (hw.hbm_gbps * GB))


def _link_time(nbytes: float, gpus: int, hw: Hardware) -> float:
    """Time for one GPU to send `nbytes` spread evenly over the other GPUs: the part bound for its
    own node over NVLink, the rest over its NIC, both at once."""
    if nbytes <= 0 or gpus <= 1:
        return 0.0
    g = min(hw.gpus_per_node, gpus)
    intra = nbytes * (g - 1) / (gpus - 1)
    inter = nbytes - intra
    return max(intra / (hw.nvlink_gbps * GB), inter / (hw.nic_gbps * GB))


def _allreduce_time(nbytes: float, gpus: int, hw: Hardware) -> float:
    """Reduce-scatter + all-gather of `nbytes` over `gpus`: ring inside a node, then across nodes
    on each GPU's 1/g shard (hierarchical)."""
    if gpus <= 1 or nbytes <= 0:
        return 0.0
    g = min(hw.gpus_per_node, gpus)
    nodes = math.ceil(gpus / g)
    t = 2 * nbytes * (g - 1) / g / (hw.nvlink_gbps * GB)
    if nodes > 1:
        t += 2 * (nbytes / g) * (nodes - 1) / nodes / (hw.nic_gbps * GB)
    return t


def roofline(cfg, count: ModelCount, acts: Activations, stage, hw: Hardware, precision: str) -> dict:
    """Co-located expert parallelism: every GPU runs the dense phase on its micro-batch, then the
    routed-expert phase on the slots its local experts receive, the dispatch and combine between
    them exposed (each waits for the previous phase). The gradient reduce-scatter overlaps the last
    micro-batch's backward; the parameter all-gather after the optimizer step does not."""
    G = hw.gpus
    w = micro_batch_work(cfg, count, acts, stage.batch_size, stage.seq_len, precision)
    share = _expert_share(cfg, G)
    t_dense = _phase_time(w.dense.flops, w.dense.hbm_bytes, 1, hw)
    t_expert = _phase_time(w.experts.flops, w.experts.hbm_bytes_with(share), 1, hw)
    remote = (G - 1) / G
    t_a2a = _link_time(w.dispatch_bytes * remote, G, hw)
    t_micro = t_dense + t_expert + t_a2a
    # Optimizer step on this GPU's shard: read weight and gradient, read and write the state,
    # write the weight.
    shard = w.dense.trainable_bytes / G + w.experts.trainable_bytes * share
    state = w.dense.optimizer_bytes / G + w.experts.optimizer_bytes * share
    t_opt = (3 * shard + 2 * state) / (hw.hbm_gbps * GB)
    t_rs = _allreduce_time(w.dense.trainable_bytes, G, hw) / 2
    step = stage.grad_accum * t_micro + t_opt + max(0.0, t_rs - (2 / 3) * t_micro) + t_rs
    tokens = G * stage.batch_size * stage.seq_len * stage.grad_accum
    mem_bound = {
        "dense": w.dense.flops / hw.peak_flops < w.dense.hbm_bytes / (hw.hbm_gbps * GB),
        "experts": w.experts.flops / hw.peak_flops < w.experts.hbm_bytes_with(share) / (hw.hbm_gbps * GB),
    }
    return {
        "step_time_s": step,
        "micro_batch_time_s": t_micro,
        "dense_phase_s": t_dense,
        "expert_phase_s": t_expert,
        "all_to_all_s": t_a2a,
        "optimizer_s": t_opt,
        "grad_sync_s": 2 * t_rs,
        "bound": {k: ("memory" if v else "compute") for k, v in mem_bound.items()},
        "tokens_per_step": tokens,
        "tokens_per_s": tokens / step,
        "mfu": w.model_flops * stage.grad_accum * G / (step * G * hw.peak_flops),
        "model_flops_per_token": w.model_flops / (stage.batch_size * stage.seq_len),
    }


# ---------------------------------------------------------------------------------------------
# Attention/expert disaggregation


def af_search(cfg, count: ModelCount, acts: Activations, stage, hw: Hardware, precision: str, colocated_step: float) -> dict:
    """Every split of the G GPUs into `a` attention ranks (the dense part: attention, norms,
    router, shared expert, embeddings, head; data parallel among themselves, ZeRO-1) and G - a
    expert ranks (the routed experts, sharded over them). Micro-batches are pipelined between the
    groups (two in flight; the pipeline's fill and drain are ignored), so a step takes the slowest
    of: the attention side, the expert side and the transfers between them. Each side is T = max(FLOPs / (gpus x peak), bytes / HBM
    bandwidth) with bytes per GPU. Same tokens per step as the co-located layout."""
    G = hw.gpus
    if cfg.moe is None or not cfg.moe_layers or G < 2:
        return {"applicable": False, "reason": "needs an MoE stage and at least 2 GPUs", "splits": []}
    B, T = stage.batch_size, stage.seq_len
    tokens = G * B * T * stage.grad_accum
    micro = tokens / (B * T)  # micro-batches per step, over all attention ranks
    E = cfg.moe.num_experts
    w = micro_batch_work(cfg, count, acts, B, T, precision)
    d, e = w.dense, w.experts
    capacity = hw.capacity_bytes * (1 - HEADROOM_TARGET)
    # Activations held: the attention side's share of the saved peak, the expert side's block(s).
    expert_held = max(acts.block_experts) if cfg.reversible else sum(acts.block_experts)
    attn_held = max(acts.saved_forward_end, acts.saved_backward_peak - expert_held) if cfg.reversible else acts.saved_peak - expert_held
    splits = []
    for a in range(1, G):
        x = G - a
        rounds = micro / a  # micro-batches each attention rank runs; each a round for the experts
        frac = math.ceil(E / x) / E  # of every expert tensor on one expert rank
        b_attn = rounds * d.hbm_bytes + (3 * d.trainable_bytes + 2 * d.optimizer_bytes) / a
        t_attn = _phase_time(d.flops * micro, b_attn, a, hw) + _allreduce_time(d.trainable_bytes, a, hw)
        # Per round an expert rank reads its experts once per pass and takes a / x micro-batches of slots.
        b_exp = rounds * ((e.weight_bytes + e.grad_bytes) * frac + e.act_bytes * a / x) + (3 * e.trainable_bytes + 2 * e.optimizer_bytes) * frac
        t_exp = _phase_time(e.flops * micro, b_exp, x, hw)
        # Every slot crosses: the attention ranks send (and get back) all of it, the expert ranks receive it.
        moved = w.dispatch_bytes * micro
        t_xfer = max(_link_time(moved / a, G, hw), _link_time(moved / x, G, hw))
        step = max(t_attn, t_exp, t_xfer)
        mem_attn = (
            sum(t.bytes for t in count.tensors if not t.expert_sharded)
            + d.trainable_bytes
            + d.optimizer_bytes / a
            + 2 * attn_held
            + workspace_bytes(cfg, count, acts, precision)
            + RUNTIME_RESERVE_BYTES
        )
        mem_exp = (
            (sum(t.bytes for t in count.tensors if t.expert_sharded) + e.trainable_bytes + e.optimizer_bytes) * frac
            + 2 * expert_held * a / x
            + RUNTIME_RESERVE_BYTES
        )
        splits.append(
            {
                "attention_gpus": a,
                "expert_gpus": x,
                "attention_s": t_attn,
                "experts_s": t_exp,
                "transfer_s": t_xfer,
                "step_time_s": step,
                "attention_bytes_per_gpu": int(mem_attn),
                "expert_bytes_per_gpu": int(mem_exp),
                "fits": max(mem_attn, mem_exp) <= capacity,
            }
        )
    candidates = [s for s in splits if s["fits"]] or splits
    best = min(candidates, key=lambda s: s["step_time_s"])
    return {
        "applicable": True,
        "stage": stage.name,
        "gpus": G,
        "nodes": hw.nodes,
        "tokens_per_step": tokens,
        "splits": splits,
        "best": best,
        "best_fits": best["fits"],
        "colocated_step_time_s": colocated_step,
        "speedup_vs_colocated": colocated_step / best["step_time_s"],
    }


# ---------------------------------------------------------------------------------------------
# The whole recipe


def resolve_vocab(recipe) -> int:
    """The vocabulary the trainer would use: model.vocab_size, or the tokenizer's size."""
    if recipe.model.vocab_size:
        return recipe.model.vocab_size
    if recipe.data.tokenizer == "byte":
        from growtrain.tokenizer import ByteTokenizer

        return ByteTokenizer.vocab_size
    from growtrain.data import DataError
    from growtrain.tokenizer import HFTokenizerFile

    try:
        return HFTokenizerFile(recipe.data.tokenizer).vocab_size
    except DataError as exc:
        raise PlanError(f"model.vocab_size is 0 and the tokenizer cannot be read ({exc}); set model.vocab_size") from None


def max_micro_batch(cfg, count, stage, hw: Hardware, precision: str, limit: int = 256) -> int:
    """The largest micro-batch (sequences per GPU) whose total stays within capacity minus the
    headroom target; 0 if even one sequence does not fit."""
    budget = hw.capacity_bytes * (1 - HEADROOM_TARGET)

    def total(b: int) -> int:
        acts = _stage_acts(cfg, b, stage.seq_len, precision, hw.gpus)
        return memory_per_gpu(cfg, count, acts, hw.gpus, precision)["total"]

    if total(1) > budget:
        return 0
    lo, hi = 1, 2
    while hi <= limit and total(hi) <= budget:
        lo, hi = hi, hi * 2
    hi = min(hi, limit + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if total(mid) <= budget else (lo, mid)
    return lo


def _stage_acts(cfg, batch: int, seq: int, precision: str, gpus: int) -> Activations:
    E = cfg.moe.num_experts if cfg.moe is not None and cfg.moe_layers else 0
    local = math.ceil(E / gpus) if E else None
    return activation_bytes(cfg, batch, seq, precision, local_experts=local, routed_tokens=batch * seq * gpus)


def _held_bytes(count: ModelCount) -> int:
    """Weights, buffers and optimizer state of a whole (unsharded) model."""
    return sum(t.bytes + t.optimizer_bytes for t in count.tensors)


def growth_peak_bytes(cfg_before, steps, optimizer_cfg, counts: dict) -> int:
    """Peak bytes a stage's growth holds in its one process today (stages/transition.py): while
    an operator runs, the old model and its optimizer state and the new model and its mapped
    state are alive together. 0 for a stage without growth."""
    from growtrain.stages import get_operator

    peak, cfg = 0, cfg_before
    for step in steps:
        new_cfg = get_operator(step.op).plan(cfg, step.args)
        old, new = (counts.get(c) or counts.setdefault(c, count_model(c, optimizer_cfg)) for c in (cfg, new_cfg))
        peak = max(peak, _held_bytes(old) + _held_bytes(new))
        cfg = new_cfg
    return peak


def plan_recipe(recipe, hw: Hardware) -> dict:
    """The plan as one JSON-ready dict: {"hardware", "stages": [...], "af": {...}}."""
    from growtrain.stages import plan_stage_models

    vocab = resolve_vocab(recipe)
    seed = recipe.model.with_changes(vocab_size=vocab)
    shapes = plan_stage_models(seed, [s.grow for s in recipe.stages])
    precision = recipe.train.precision
    stages, last = [], None
    tokens_before = 0
    counts: dict = {}
    previous = seed
    uneven = [f"stages '{s.name}': batch_size {s.batch_size} does not divide over {hw.gpus} GPUs (batch_size counts the "
              f"sequences of a micro-batch over all GPUs; use a multiple of {hw.gpus})" for s in recipe.stages if s.batch_size % hw.gpus]
    if uneven:
        raise PlanError("; ".join(uneven))
    for global_stage, cfg in zip(recipe.stages, shapes):
        # Everything below works on one GPU's share of the micro-batch.
        stage = replace(global_stage, batch_size=global_stage.batch_size // hw.gpus)
        count = counts.get(cfg) or counts.setdefault(cfg, count_model(cfg, recipe.optimizer))
        grow_peak = growth_peak_bytes(previous, stage.grow, recipe.optimizer, counts)
        previous = cfg
        acts = _stage_acts(cfg, stage.batch_size, stage.seq_len, precision, hw.gpus)
        mem = memory_per_gpu(cfg, count, acts, hw.gpus, precision)
        roof = roofline(cfg, count, acts, stage, hw, precision)
        moe = cfg.moe if cfg.moe is not None and cfg.moe_layers else None
        stage_tokens = roof["tokens_per_step"] * stage.steps
        row = {
            "name": stage.name,
            "params_total": count.params_total,
            "params_active": count.params_active,
            "params_by_role": count.params_by_role,
            "params_trainable": count.trainable_params,
            "experts": moe.num_experts if moe else 0,
            "top_k": moe.top_k if moe else 0,
            "expert_format": moe.expert_format if moe else None,
            "moe_layers": len(cfg.moe_layers) if moe else 0,
            "n_layers": cfg.n_layers,
            "d_model": cfg.d_model,
            "reversible": cfg.reversible,
            "precision": precision,
            "batch_size": global_stage.batch_size,
            "micro_batch": stage.batch_size,  # per GPU
            "seq_len": stage.seq_len,
            "grad_accum": stage.grad_accum,
            "steps": stage.steps,
            "tokens": stage_tokens,
            "tokens_cumulative": tokens_before + stage_tokens,
            "memory": mem,
            "per_gpu_bytes": mem["total"],
            "capacity_bytes": hw.capacity_bytes,
            "headroom": 1 - mem["total"] / hw.capacity_bytes,
            "fits": mem["total"] <= hw.capacity_bytes * (1 - HEADROOM_TARGET),
            "max_micro_batch": max_micro_batch(cfg, count, stage, hw, precision),
            "activations_detail": {
                "saved_forward_end": acts.saved_forward_end,
                "saved_backward_peak": acts.saved_backward_peak,
                "head": acts.head,
                "streams": acts.streams,
                "largest_block": max(acts.per_block) if acts.per_block else 0,
                "autocast_weight_cache": autocast_weight_cache(cfg, count, precision),
            },
            **roof,
            "stage_time_s": roof["step_time_s"] * stage.steps,
            "growth_peak_bytes": grow_peak,
        }
        tokens_before += stage_tokens
        stages.append(row)
        last = (cfg, count, acts, stage, roof["step_time_s"])
    af = af_search(last[0], last[1], last[2], last[3], hw, precision, last[4]) if last else {"applicable": False}
    return {
        "recipe": recipe.name,
        "hardware": {**asdict(hw), "gpus": hw.gpus},
        "layout": (
            f"{hw.gpus} GPUs: routed experts sharded over all (expert parallel), dense parts data parallel "
            "with ZeRO-1 optimizer state; each GPU trains batch_size / GPUs sequences of every micro-batch"
        ),
        "headroom_target": HEADROOM_TARGET,
        "stages": stages,
        "af": af,
    }


# ---------------------------------------------------------------------------------------------
# Console


def _b(n: float) -> str:
    return f"{n / GB:.1f}"


def _p(n: float) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.1f}M"


def _t(s: float) -> str:
    if s >= 86400:
        return f"{s / 86400:.1f} d"
    if s >= 3600:
        return f"{s / 3600:.1f} h"
    if s >= 60:
        return f"{s / 60:.1f} min"
    if s >= 1:
        return f"{s:.2f} s"
    return f"{s * 1e3:.1f} ms" if s >= 1e-3 else f"{s * 1e6:.0f} us"


def format_plan(plan: dict) -> str:
    hw = plan["hardware"]
    out = [
        (
            f"{plan['recipe']}: {len(plan['stages'])} stage(s) on {hw['nodes']} node(s) x {hw['gpus_per_node']} {hw['name']} "
            f"({hw['peak_tflops']:.0f} TFLOP/s bf16, HBM {hw['hbm_gbps']:.0f} GB/s, NVLink {hw['nvlink_gbps']:.0f} GB/s/dir, "
            f"NIC {hw['nic_gbps']:.0f} GB/s, {hw['capacity_gb']:.0f} GB; {hw['source']})"
        ),
        f"layout: {plan['layout']}",
        "",
        "parameters (exact, from the meta-device models)",
        f"{'stage':<12}{'stored':>9}{'active':>9}{'attention':>10}{'router':>9}{'shared':>9}{'experts':>9}{'dense ffn':>10}{'embed':>8}{'adapters':>9}{'E':>5}{'k':>4}{'format':>7}",
    ]
    for s in plan["stages"]:
        r = s["params_by_role"]
        out.append(
            f"{s['name']:<12}{_p(s['params_total']):>9}{_p(s['params_active']):>9}{_p(r['attention']):>10}{_p(r['router']):>9}"
            f"{_p(r['shared_expert']):>9}{_p(r['routed_experts']):>9}{_p(r['dense_ffn']):>10}{_p(r['embeddings']):>8}"
            f"{_p(r['adapters']):>9}{s['experts']:>5}{s['top_k']:>4}{s['expert_format'] or '-':>7}"
        )
    out += [
        "",
        "memory per GPU (GB; activations at the stage's micro-batch)",
        f"{'stage':<12}{'mb x seq':>10}{'weights':>9}{'(nf4)':>7}{'grads':>7}{'optim':>7}{'activ':>7}{'work':>6}{'comm':>6}{'rsv':>5}{'total':>8}{'cap':>6}{'headroom':>9}{'max mb':>7}",
    ]
    for s in plan["stages"]:
        m = s["memory"]
        flag = "" if s["fits"] else "  OVER"
        out.append(
            f"{s['name']:<12}{str(s['micro_batch']) + ' x ' + str(s['seq_len']):>10}{_b(m['weights_total']):>9}{_b(m['weights'].get('nf4', 0)):>7}"
            f"{_b(m['gradients']):>7}{_b(m['optimizer']):>7}{_b(m['activations']):>7}{_b(m['workspace']):>6}{_b(m['communication']):>6}"
            f"{_b(m['runtime_reserve']):>5}{_b(m['total']):>8}{_b(s['capacity_bytes']):>6}{s['headroom']:>8.1%}{s['max_micro_batch']:>7}{flag}"
        )
    out += [
        "",
        (
            "roofline (step = grad_accum x micro-batch + optimizer + gradient sync; the phase columns are per micro-batch, "
            "each max(FLOPs/peak, bytes/HBM); a2a: expert-parallel dispatch + combine, not overlapped)"
        ),
        f"{'stage':<12}{'tokens/step':>12}{'step':>9}{'dense':>9}{'experts':>9}{'a2a':>9}{'MFU':>7}{'tok/s':>10}{'steps':>8}{'tokens':>9}{'time':>8}",
    ]
    for s in plan["stages"]:
        out.append(
            f"{s['name']:<12}{s['tokens_per_step']:>12,}{_t(s['step_time_s']):>9}{_t(s['dense_phase_s']):>9}{_t(s['expert_phase_s']) if s['experts'] else '-':>9}"
            f"{_t(s['all_to_all_s']) if s['experts'] else '-':>9}{s['mfu']:>7.1%}{s['tokens_per_s']:>10,.0f}{s['steps']:>8,}{s['tokens'] / 1e9:>8.1f}B{_t(s['stage_time_s']):>8}"
        )
    grown = [s for s in plan["stages"] if s["growth_peak_bytes"]]
    if grown:
        out.append("")
        out.append(
            "growth at a stage start runs in one process today: old and new model with their optimizer state, peak "
            + ", ".join(f"{s['name']} {_b(s['growth_peak_bytes'])} GB" for s in grown)
        )
    af = plan["af"]
    out.append("")
    if not af.get("applicable"):
        out.append(f"attention/expert disaggregation: not applicable ({af.get('reason', 'no stages')})")
    else:
        out.append(
            f"attention/expert disaggregation, stage '{af['stage']}' ({af['gpus']} GPUs, {af['tokens_per_step']:,} tokens/step; "
            "each side max(FLOPs/(gpus x peak), bytes/HBM), micro-batches pipelined)"
        )
        out.append(f"{'attn':>5}{'expert':>7}{'attention':>11}{'experts':>10}{'transfer':>10}{'step':>10}{'attn GB':>9}{'exp GB':>8}  fits")
        for sp in af["splits"]:
            mark = "  <- best" if sp is af["best"] or sp == af["best"] else ""
            out.append(
                f"{sp['attention_gpus']:>5}{sp['expert_gpus']:>7}{_t(sp['attention_s']):>11}{_t(sp['experts_s']):>10}{_t(sp['transfer_s']):>10}"
                f"{_t(sp['step_time_s']):>10}{_b(sp['attention_bytes_per_gpu']):>9}{_b(sp['expert_bytes_per_gpu']):>8}  {'yes' if sp['fits'] else 'no '}{mark}"
            )
        best = af["best"]
        out.append(
            f"best: {best['attention_gpus']} attention + {best['expert_gpus']} expert GPUs, {_t(best['step_time_s'])} per step vs "
            f"{_t(af['colocated_step_time_s'])} co-located expert-parallel ({af['speedup_vs_colocated']:.2f}x)"
        )
    out.append("")
    out.append(
        "exact: parameter counts, weight/gradient/optimizer bytes (real classes on the meta device). modelled: saved activations "
        "(checked against the saved-tensor meter on CPU models); approximate: workspace, communication buffers, runtime reserve, "
        "every time figure (a roofline, no kernel efficiencies)."
    )
    return "\n".join(out)
