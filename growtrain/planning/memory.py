"""Memory per GPU: the saved-activation model, op by op, the workspace allowance, weights,
gradients, optimizer state and buffers under expert + data parallelism, and the growth peak.

Activations: `activation_bytes` lists the tensors autograd saves for backward in GrowLM's forward
(norms, attention, SwiGLU, router, dispatch, the expert backends, the head and cross-entropy),
counting a storage once as `growtrain.runtime.memory.SavedTensorMeter` does; tests/test_plan.py checks it
against the meter on small CPU models. Plain autograd holds every block's; the reversible backward
holds the two final fp32 streams and the stack's input one, the routing ids and one block's recompute at a time. Non-saved
transients are a rougher allowance, `workspace`.
Sharding (DESIGN.md §12): routed experts contiguously over an expert-parallel group of every GPU;
everything else data parallel, weights and gradients replicated, optimizer state sharded (ZeRO-1).

Legend: B micro-batch (sequences), T sequence length, N = B·T tokens, D d_model, H query heads,
Kv key/value heads, Hd head size, F dense FFN width, E routed experts, K top-k, Fe expert width,
Fs shared-expert width, S = N·K token-slots, V vocabulary, r LoRA rank, G GPUs.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, replace

from growtrain.planning.counting import ModelCount, count_model
from growtrain.planning.hardware import GIB

# PyTorch DDP's default gradient bucket (bucket_cap_mb=25); two in flight while one reduces.
GRAD_BUCKET_BYTES = 25 * 2**20
# CUDA context, cuBLAS workspaces and NCCL's own buffers: a rough allowance (the CUDA context alone
# is ~0.5 GiB on a Hopper GPU), not a measurement.
RUNTIME_RESERVE_BYTES = int(1.5 * GIB)
# Of that reserve, the part PyTorch's caching allocator holds, and so the part
# torch.cuda.max_memory_allocated counts: the cuBLAS and cuBLASLt workspaces, 32 MiB each on
# Hopper. The tiny recipe's per-stage peaks on an H200 (benchmarks/gpu_checks.sh part 4) stood
# 56-85 MB above the planned tensors before it was counted among them.
BLAS_WORKSPACE_BYTES = 64 * 2**20
HEADROOM_TARGET = 0.10


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

    if reversible and getattr(cfg, "block", "coupling") == "residual":
        # Checkpointed residual blocks: every block's input (one fp32 stream) and routing are kept;
        # backward recomputes one block at a time with grad on.
        fixed = base.total() + cfg.n_layers * stream + routing
        forward_end = fixed + head.total()
        backward_peak = fixed + max(per_block)
        streams = cfg.n_layers * stream
    elif reversible:
        # The final two streams, and the stack's input (both input streams are the embedding's one
        # tensor; reversible.py keeps it so that the first block is never inverted).
        fixed = base.total() + 3 * stream + routing
        forward_end = fixed + head.total()
        # Backward: one block's G, then its F, is rebuilt with grad on at a time. The last block's
        # G reads the saved y1 itself (same storage); every other block's input is a new tensor.
        worst = 0
        for i, (f, g) in enumerate(zip(blocks_f, blocks_g)):
            g_bytes = g.total() - (stream if i == cfg.n_layers - 1 else 0)
            worst = max(worst, g_bytes, f.total())
        backward_peak = fixed + worst
        streams = 3 * stream
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


def stage_activations(cfg, batch: int, seq: int, precision: str, gpus: int) -> Activations:
    """One GPU's activations for a stage's micro-batch: its share of the experts, and the tokens
    of every GPU routed among all of them."""
    E = cfg.moe.num_experts if cfg.moe is not None and cfg.moe_layers else 0
    local = math.ceil(E / gpus) if E else None
    return activation_bytes(cfg, batch, seq, precision, local_experts=local, routed_tokens=batch * seq * gpus)


# ---------------------------------------------------------------------------------------------
# Memory per GPU


def expert_share(cfg, gpus: int) -> float:
    """Fraction of each expert tensor on the most loaded GPU (experts sharded contiguously)."""
    if cfg.moe is None or not cfg.moe_layers:
        return 1.0
    E = cfg.moe.num_experts
    return math.ceil(E / gpus) / E


@dataclass(frozen=True)
class MemoryPerGpu:
    """Bytes one GPU holds at a stage's peak, by kind (the `memory` entry of a plan's stage)."""

    weights_bytes: dict[str, int]  # by storage: fp32, bf16, nf4, ...
    weights_total_bytes: int
    gradients_bytes: int
    optimizer_bytes: int
    activations_bytes: int  # saved for backward, at its peak
    workspace_bytes: int
    communication_bytes: int
    runtime_reserve_bytes: int
    total_bytes: int

    def to_dict(self) -> dict:
        return {
            "weights": dict(self.weights_bytes),
            "weights_total": self.weights_total_bytes,
            "gradients": self.gradients_bytes,
            "optimizer": self.optimizer_bytes,
            "activations": self.activations_bytes,
            "workspace": self.workspace_bytes,
            "communication": self.communication_bytes,
            "runtime_reserve": self.runtime_reserve_bytes,
            "total": self.total_bytes,
        }


def memory_per_gpu(cfg, count: ModelCount, acts: Activations, gpus: int, precision: str) -> MemoryPerGpu:
    """The most loaded GPU's bytes for one micro-batch of `acts` on `gpus` GPUs."""
    share = expert_share(cfg, gpus)
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
    workspace = workspace_bytes(cfg, count, acts, precision) + BLAS_WORKSPACE_BYTES
    reserve = RUNTIME_RESERVE_BYTES - BLAS_WORKSPACE_BYTES
    total = sum(w.values()) + int(grads) + int(opt) + acts.saved_peak + workspace + comm + reserve
    return MemoryPerGpu(
        weights_bytes=w,
        weights_total_bytes=sum(w.values()),
        gradients_bytes=int(grads),
        optimizer_bytes=int(opt),
        activations_bytes=acts.saved_peak,
        workspace_bytes=workspace,
        communication_bytes=comm,
        runtime_reserve_bytes=reserve,
        total_bytes=total,
    )


# ---------------------------------------------------------------------------------------------
# Growth: old and new model alive together


def _carries_whole(unit) -> bool:
    """An operator step whose grown model holds every old tensor as the same storage (deepen:
    the old blocks carried, under their new indices, with their optimizer state objects)."""
    return len(unit) == 1 and unit[0].op == "deepen"


# Operators that carry every tensor outside the MoE layers' FFNs as the same storage, with the same
# optimizer state object (stages/common.carry; quantize_experts carries the routers as well, not
# counted here).
_CARRY_OUTSIDE_FFN = ("split_experts", "clone_experts", "quantize_experts")


# Operators that carry every tensor they leave unchanged as the same storage, with the same optimizer
# state object (stages/common.carry): upcycling all but the upcycled FFNs and the new routers,
# add_heads all but the attention matrices that gain heads, widen_ffn all but the FFN matrices that
# widen, add_dense_lora every tensor (a wrapped Linear's weight under `base_layer`, frozen: the grown
# model holds no state for it).
_CARRY_UNCHANGED = ("upcycle_moe", "add_heads", "widen_ffn", "add_dense_lora")


def _unchanged(old, new: dict):
    """old tensor name -> the grown model's tensor of the same name (a Linear's weight moved under
    peft's `base_layer` as well) and the same size and storage, or None."""

    def renamed(name: str):
        head, _, leaf = name.rpartition(".")
        t = old.get(name)
        for candidate in (name, f"{head}.base_layer.{leaf}"):
            c = new.get(candidate)
            if t is not None and c is not None and (c.params, c.bytes, c.storage) == (t.params, t.bytes, t.storage):
                return candidate
        return None

    return renamed


def _carried_names(unit, cfg, old: dict | None = None, new: dict | None = None):
    """old tensor name -> its name in the model `unit` grows from `cfg`, for the tensors the grown
    model holds as the same storage (with the same optimizer state object); None for the others.
    old, new: name -> TensorInfo of the two models (needed for _CARRY_UNCHANGED's operators).
    Where an operator is not known to carry a tensor it counts as new: the plan may over-count,
    never under-count."""
    from growtrain.stages.operators.deepen import _index_maps, _positions
    from growtrain.stages.operators.experts import ffn_block

    if len(unit) == 1 and unit[0].op in _CARRY_UNCHANGED and old is not None and new is not None:
        if unit[0].op == "widen_ffn" and cfg.moe is not None and cfg.moe.expert_format == "nf4":
            # NF4 experts that widen are rebuilt whole (their quantization constants too)
            widens = unit[0].args.expert_hidden not in (0, cfg.moe.expert_hidden)
            same = _unchanged(old, new)
            return lambda name: None if widens and ffn_block(name, cfg) is not None and ".experts." in name else same(name)
        return _unchanged(old, new)
    if _carries_whole(unit):
        old_to_new, _ = _index_maps(cfg, _positions(cfg, unit[0].args))

        def renamed(name: str) -> str:
            parts = name.split(".")
            return ".".join([parts[0], str(old_to_new[int(parts[1])]), *parts[2:]]) if parts[0] == "blocks" else name

        return renamed
    if all(s.op in _CARRY_OUTSIDE_FFN for s in unit):
        return lambda name: name if ffn_block(name, cfg) is None else None
    return lambda name: None


# Per-neuron bookkeeping of an operator that marks fresh neurons inside copied expert tensors
# (drop-upcycling: upcycle_moe with drop_ratio > 0, clone_experts with reinit_fraction > 0), per
# grown expert neuron (a row of w_gate / w_up, a column of w_down: d_model elements): the
# provenance's copy count S (fp32) and fresh mask (bool), and, in the mapped optimizer state, a
# step count (int32) and the eps and clip-norm multipliers 1/S and S (fp32; the LR and
# weight-decay multipliers stay scalars at β = 1). They vary per neuron only, so they are kept
# [E, F, 1] / [E, 1, F] (stages/transition.compact_fields), not per element.
_FRESH_PROVENANCE_BYTES = 4 + 1
_FRESH_STATE_BYTES = 4 + 4 + 4


# Operators that start a factor at zero next to a non-zero one (LoRA's B, a new block's output
# projections), so that the trainability pass steps before every new element has a gradient.
_ZERO_FACTORS = ("deepen", "quantize_experts", "add_dense_lora", "add_heads")


def _starts_a_zero_factor(step) -> bool:
    """widen_ffn's `zero` init too: new gate/up rows next to zero down-projection columns."""
    return step.op in _ZERO_FACTORS or (step.op == "widen_ffn" and getattr(step.args, "init", "") == "zero")


def _marks_fresh(step) -> bool:
    args = step.args
    return (step.op == "upcycle_moe" and getattr(args, "drop_ratio", 0) > 0) or (step.op == "clone_experts" and getattr(args, "reinit_fraction", 0) > 0)


def probe_bytes(cfg, batch: int, seq_len: int) -> int:
    """One invariance probe (stages/invariance.Probe), float64: the logits, both output streams of
    every block and the router distribution of every MoE layer, for `batch` rows (on expert shards
    a rank's share of the probe batch, stages/sharding.probe_share)."""
    tokens = batch * seq_len
    moe = len(cfg.moe_layers) * cfg.moe.num_experts if cfg.moe is not None else 0
    return 8 * tokens * (cfg.vocab_size + 2 * cfg.n_layers * cfg.d_model + moe)


def growth_peak_bytes_per_rank(cfg_before, steps, optimizer_cfg, counts: dict, ranks: int, probe: tuple[int, int] = (0, 0), stream: bool = True) -> int:
    """Peak bytes one of `ranks` expert-parallel processes holds while a stage's growth runs
    (stages/transition.py). Where every operator of the stage grows expert shards
    (stages/sharding.py), a rank holds its E/W experts of every model alive at once and the whole
    dense part, with its share of the optimizer state as training keeps it (its experts', and the
    dense entries it owns by ZeRO-1; a dense entry another rank needs travels alone): the stage's first
    model (kept for the transition's own check; what the current model still holds of it as the
    same storage counted once), the current operator's old and new model with
    their state (the tensors it carries unchanged, deepen's and _CARRY_UNCHANGED's, once; less the
    folded experts' state at a later quantize_experts, unless the first model holds it; with 8-bit
    dense state every model growth makes holds float32 state), the new model's per-neuron bookkeeping, the checks' working set (the largest
    of their one-step and trainability passes, see below, and the activations of a forward +
    backward on the probe), and the probes (`probe`: the invariance probe's batch and
    sequence length; each rank runs its share of the rows): the stage's first, the old and the new
    model's, plus four logit tensors of the one-step comparison. A stage of several steps ends with
    the transition's own check: the first and the final model, one step of each. With `stream` (invariance.stream), a run of split_experts /
    clone_experts and the quantize_experts after it are one step, applied one MoE layer at a time
    (stages/streaming.py): the old model and the quantized one are alive whole, each operator's
    fp32 experts for one layer (with their quantized copy and the per-layer checks' copies), the
    old model's probe input to every MoE layer, and no optimizer state of the intermediate experts.
    Where an operator of the stage cannot grow expert shards every rank gathers the whole model and
    grows it as one process does: the figure for `ranks` = 1. 0 for a stage without growth."""
    from growtrain.stages import get_operator, stream_length

    if not steps:
        return 0
    if ranks > 1 and not all(get_operator(s.op).runs_sharded(s.args) for s in steps):
        return growth_peak_bytes_per_rank(cfg_before, steps, optimizer_cfg, counts, 1, probe, stream)

    def count(c):
        return counts.get(c) or counts.setdefault(c, count_model(c, optimizer_cfg))

    # With 8-bit dense state, growth reads the optimizer's entries through its float32 view and maps
    # them into float32 entries (optim/adamw8bit.py): every model growth makes holds its state at 32
    # bits until the trainer packs it again, and no entry is shared with the optimizer's.
    packed = getattr(optimizer_cfg, "dense_state_bits", 32) != 32
    counts32: dict = {}

    def count32(c):
        if not packed:
            return count(c)
        return counts32.get(c) or counts32.setdefault(c, count_model(c, replace(optimizer_cfg, dense_state_bits=32)))

    def share(t) -> float:
        return 1.0 / ranks if t.expert_sharded else 1.0

    def held(c, mapped: bool = False) -> float:  # the optimizer state is sharded whole: experts by expert, dense entries by ZeRO-1 owner
        return sum(t.bytes * share(t) + t.optimizer_bytes / ranks for t in (count32(c) if mapped else count(c)).tensors)

    def expert_weights(c) -> float:
        return sum(t.bytes * share(t) for t in count(c).tensors if t.expert_sharded and t.trainable and t.role == "routed_experts")

    probe = (-(-probe[0] // ranks), probe[1])  # this rank's rows (stages/sharding.probe_share)

    def probe_pass(*cfgs) -> float:
        """The checks' forward + backward on this rank's probe rows (fp32): saved activations and
        the backward's transients, of the larger model."""
        if not probe[0]:
            return 0.0
        acts = [stage_activations(c, probe[0], probe[1], "fp32", ranks) for c in cfgs]
        return max(a.saved_peak + a.workspace for a in acts)

    def largest_terms(*cfgs) -> float:
        """step_each: one tensor's optimizer state copy, its update and saved value."""
        tensors = [t for c in cfgs for t in count(c).tensors]
        return max((t.optimizer_bytes * share(t) for t in tensors), default=0.0) + 2 * max((t.bytes * share(t) for t in tensors if t.trainable), default=0.0)

    def held_tensor(t) -> float:  # what a later model shares of the first one's tensor t (no packed state)
        return t.bytes * share(t) + (0.0 if packed else t.optimizer_bytes / ranks)

    peak, cfg, carried = 0.0, cfg_before, 0.0  # carried: per-neuron state fields of the current model
    start = held(cfg_before)
    # The stage's first model, kept whole for the transition's own check, shares storage (and
    # optimizer state objects) with the current model where every operator so far carried it:
    # current name -> that tensor's count in the first model.
    from_start = {t.name: t for t in count(cfg_before).tensors}
    units = 0
    j = 0
    while j < len(steps):
        unit = steps[j : j + stream_length(steps, j, stream)]
        new_cfg = cfg
        for s in unit:
            new_cfg = get_operator(s.op).plan(new_cfg, s.args)
        new = count(new_cfg)
        fresh = len(unit) == 1 and _marks_fresh(unit[0])
        neurons = expert_weights(new_cfg) / 4 / new_cfg.d_model  # fp32 expert weights, d_model per neuron
        book = neurons * (_FRESH_PROVENANCE_BYTES + _FRESH_STATE_BYTES) if fresh else 0.0
        new_carried = neurons * _FRESH_STATE_BYTES if fresh else (0.0 if new_cfg.moe is not None and new_cfg.moe.expert_format == "nf4" else carried)
        trainable = sum(t.bytes * share(t) for t in new.tensors if t.trainable)
        # quantize_experts folds the fp32 experts into NF4 bases ('reset' sources): the checks hold
        # them whole on the old side (no gradient, saved copy or update), and the trainer hands
        # their state over, which the transition drops before the unit (release_folded), from the
        # first model's state too where it is the same object.
        quantizes = unit[-1].op == "quantize_experts"
        folded = [t for t in count(cfg).tensors if quantizes and t.trainable and t.role == "routed_experts"]
        old_step = sum(t.bytes * share(t) for t in count(cfg).tensors if t.trainable) - sum(t.bytes * share(t) for t in folded)
        freed = sum(t.optimizer_bytes * share(t) for t in folded)
        # The checks' working set (stages/dynamics.py), the largest of: either side's step (the
        # gradients, then the saved weights growing as step_each drops them: one copy of the
        # stepped weights), the trainability pass (gradients and a bool per new element, and, where
        # a zero-initialised factor makes it step, the saved weights next to the next gradients);
        # the optimizer steps one tensor's state copy at a time (step_each), its update and saved
        # copy one more tensor.
        steps_again = any(_starts_a_zero_factor(s) for s in unit)
        work = max(old_step, trainable, (2.25 if steps_again else 1.25) * trainable) + largest_terms(new_cfg) + probe_pass(cfg, new_cfg)
        probes = (probe_bytes(cfg_before, *probe) if j else 0) + probe_bytes(cfg, *probe) + probe_bytes(new_cfg, *probe)
        probes += 4 * 8 * probe[0] * probe[1] * new_cfg.vocab_size
        layer = 0.0
        if len(unit) > 1:
            # One layer's fp32 experts after each expert operator of the stream, its NF4 + adapter
            # copy, and the value check's int32 indices and float64 sums over the largest of those
            # tensors (~ the largest layer once more, stages/values.py); the probe input of every
            # MoE layer (fp32).
            shapes, c = [], cfg
            for s in unit[:-1]:
                c = get_operator(s.op).plan(c, s.args)
                shapes.append(c)
            moe_layers = max(len(new_cfg.moe_layers), 1)
            chain = [expert_weights(c) / moe_layers for c in shapes]
            final_layer = sum(t.bytes * share(t) for t in new.tensors if t.expert_sharded) / moe_layers
            layer = sum(chain) + max(chain) + final_layer
            probes += 4 * probe[0] * probe[1] * cfg.d_model * moe_layers
        # deepen carries every old tensor into the new model as the same storage (and its optimizer
        # state as the same objects): only the inserted blocks are new memory. The _CARRY_UNCHANGED
        # operators carry what they leave unchanged: those tensors count once, and their optimizer
        # state too where the grown model keeps it (with 8-bit dense state the growth works on
        # copies of the packed entries: counted twice).
        into = {t.name: t for t in count32(new_cfg).tensors}
        renamed = _carried_names(unit, cfg, {t.name: t for t in count(cfg).tensors}, into)
        shared = 0.0
        if _carries_whole(unit) or (len(unit) == 1 and unit[0].op in _CARRY_UNCHANGED):
            for t in count32(cfg).tensors if j else count(cfg).tensors:
                if (n := renamed(t.name)) is not None:
                    shared += t.bytes * share(t) + (0.0 if packed and not j else min(t.optimizer_bytes, into[n].optimizer_bytes) / ranks)
        # The first model less what the old one holds of it as the same storage.
        first = start - sum(held_tensor(t) for t in from_start.values()) if j else 0.0
        alive = first + held(cfg, mapped=j > 0) - freed + carried + held(new_cfg, mapped=True) - shared + book + work + probes + layer
        peak = max(peak, alive)
        if getattr(optimizer_cfg, "dense_state_bits", 32) == 32:
            # The first model's entry is the same object as a carried one's, and goes with it (with
            # 8-bit state the optimizer hands out copies of its packed entries: it stays).
            start -= sum(t.optimizer_bytes / ranks for t in folded if t.name in from_start)
        from_start = {renamed(n): t for n, t in from_start.items() if renamed(n) is not None}
        cfg, carried = new_cfg, new_carried
        j += len(unit)
        units += 1
    if units > 1:
        # The transition's own check (stages/transition.check_transition): one step of the first
        # model (its folded experts held whole: no gradient) and one of the final model, with the
        # probes of both and the one-step comparison's logits.
        quantized = cfg.moe is not None and cfg.moe.expert_format == "nf4" and not (cfg_before.moe is not None and cfg_before.moe.expert_format == "nf4")
        first_step = sum(t.bytes * share(t) for t in count(cfg_before).tensors if t.trainable and not (quantized and t.role == "routed_experts"))
        final_step = sum(t.bytes * share(t) for t in count(cfg).tensors if t.trainable)
        work = max(first_step, final_step) + largest_terms(cfg_before, cfg) + probe_pass(cfg_before, cfg)
        probes = probe_bytes(cfg_before, *probe) + probe_bytes(cfg, *probe) + 4 * 8 * probe[0] * probe[1] * cfg.vocab_size
        first = start - sum(held_tensor(t) for t in from_start.values())
        peak = max(peak, first + held(cfg, mapped=True) + carried + work + probes)
    return int(peak)

