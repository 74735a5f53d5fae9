"""Step time: each micro-batch's FLOPs and HBM bytes per phase (dense part, routed experts), a
roofline per phase, `max(FLOPs / peak, bytes / HBM)`, plus the exposed expert-parallel all-to-all
and the data-parallel gradient sync; and the largest micro-batch that fits."""

from __future__ import annotations

import math
from dataclasses import dataclass

from growtrain.planning.counting import ModelCount, TensorInfo, count_model
from growtrain.planning.hardware import GB, Hardware
from growtrain.planning.memory import HEADROOM_TARGET, Activations, expert_share, memory_per_gpu, stage_activations


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
    reversible recompute): the weight the trainer's ETA gives each stage's steps (runtime/progress.py)."""
    dense, expert, _ = _flops_per_token(cfg, count_model(cfg), seq, cfg.reversible)
    return dense + expert


def model_flops_per_token(cfg, seq: int) -> float:
    """Counted FLOPs of one trained token on `cfg`: forward + backward of every matmul and of causal
    attention, without the reversible recompute (a frozen NF4 base's backward counts its input
    gradient only). The x-axis of FLOPs-to-loss comparisons (metrics.jsonl's `flops`,
    benchmarks/growth.py, `growtrain plot`), and the numerator of MFU."""
    return _flops_per_token(cfg, count_model(cfg), seq, cfg.reversible)[2]


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


def phase_time(flops: float, nbytes: float, gpus: int, hw: Hardware) -> float:
    """The issue's roofline: T = max(FLOPs / (gpus x peak), bytes / bandwidth), `nbytes` per GPU."""
    return max(flops / (gpus * hw.peak_flops), nbytes / (hw.hbm_gbps * GB))


def link_time(nbytes: float, gpus: int, hw: Hardware) -> float:
    """Time for one GPU to send `nbytes` spread evenly over the other GPUs: the part bound for its
    own node over NVLink, the rest over its NIC, both at once."""
    if nbytes <= 0 or gpus <= 1:
        return 0.0
    g = min(hw.gpus_per_node, gpus)
    intra = nbytes * (g - 1) / (gpus - 1)
    inter = nbytes - intra
    return max(intra / (hw.nvlink_gbps * GB), inter / (hw.nic_gbps * GB))


def allreduce_time(nbytes: float, gpus: int, hw: Hardware) -> float:
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


@dataclass(frozen=True)
class StepTime:
    """One stage's co-located step on every GPU (its fields are spliced into the stage's row)."""

    step_time_s: float
    micro_batch_time_s: float
    dense_phase_s: float  # per micro-batch
    expert_phase_s: float
    all_to_all_s: float
    optimizer_s: float
    grad_sync_s: float  # reduce-scatter + all-gather
    dense_bound: str  # "memory" or "compute"
    experts_bound: str
    tokens_per_step: int  # over all GPUs
    tokens_per_s: float
    mfu: float
    model_flops_per_token: float

    def to_dict(self) -> dict:
        return {
            "step_time_s": self.step_time_s,
            "micro_batch_time_s": self.micro_batch_time_s,
            "dense_phase_s": self.dense_phase_s,
            "expert_phase_s": self.expert_phase_s,
            "all_to_all_s": self.all_to_all_s,
            "optimizer_s": self.optimizer_s,
            "grad_sync_s": self.grad_sync_s,
            "bound": {"dense": self.dense_bound, "experts": self.experts_bound},
            "tokens_per_step": self.tokens_per_step,
            "tokens_per_s": self.tokens_per_s,
            "mfu": self.mfu,
            "model_flops_per_token": self.model_flops_per_token,
        }


def roofline(cfg, count: ModelCount, acts: Activations, stage, hw: Hardware, precision: str) -> StepTime:
    """Co-located expert parallelism: every GPU runs the dense phase on its micro-batch, then the
    routed-expert phase on the slots its local experts receive, the dispatch and combine between
    them exposed (each waits for the previous phase). The gradient reduce-scatter overlaps the last
    micro-batch's backward; the parameter all-gather after the optimizer step does not."""
    G = hw.gpus
    w = micro_batch_work(cfg, count, acts, stage.batch_size, stage.seq_len, precision)
    share = expert_share(cfg, G)
    t_dense = phase_time(w.dense.flops, w.dense.hbm_bytes, 1, hw)
    t_expert = phase_time(w.experts.flops, w.experts.hbm_bytes_with(share), 1, hw)
    remote = (G - 1) / G
    t_a2a = link_time(w.dispatch_bytes * remote, G, hw)
    t_micro = t_dense + t_expert + t_a2a
    # Optimizer step on this GPU's shard: read weight and gradient, read and write the state,
    # write the weight.
    shard = w.dense.trainable_bytes / G + w.experts.trainable_bytes * share
    state = w.dense.optimizer_bytes / G + w.experts.optimizer_bytes * share
    t_opt = (3 * shard + 2 * state) / (hw.hbm_gbps * GB)
    t_rs = allreduce_time(w.dense.trainable_bytes, G, hw) / 2
    step = stage.grad_accum * t_micro + t_opt + max(0.0, t_rs - (2 / 3) * t_micro) + t_rs
    tokens = G * stage.batch_size * stage.seq_len * stage.grad_accum
    dense_memory_bound = w.dense.flops / hw.peak_flops < w.dense.hbm_bytes / (hw.hbm_gbps * GB)
    experts_memory_bound = w.experts.flops / hw.peak_flops < w.experts.hbm_bytes_with(share) / (hw.hbm_gbps * GB)
    return StepTime(
        step_time_s=step,
        micro_batch_time_s=t_micro,
        dense_phase_s=t_dense,
        expert_phase_s=t_expert,
        all_to_all_s=t_a2a,
        optimizer_s=t_opt,
        grad_sync_s=2 * t_rs,
        dense_bound="memory" if dense_memory_bound else "compute",
        experts_bound="memory" if experts_memory_bound else "compute",
        tokens_per_step=tokens,
        tokens_per_s=tokens / step,
        mfu=w.model_flops * stage.grad_accum * G / (step * G * hw.peak_flops),
        model_flops_per_token=w.model_flops / (stage.batch_size * stage.seq_len),
    )


def max_micro_batch(cfg, count, stage, hw: Hardware, precision: str, limit: int = 256) -> int:
    """The largest micro-batch (sequences per GPU) whose total stays within capacity minus the
    headroom target; 0 if even one sequence does not fit."""
    budget = hw.capacity_bytes * (1 - HEADROOM_TARGET)

    def total(b: int) -> int:
        acts = stage_activations(cfg, b, stage.seq_len, precision, hw.gpus)
        return memory_per_gpu(cfg, count, acts, hw.gpus, precision).total_bytes

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
