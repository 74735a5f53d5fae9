"""Attention/expert disaggregation (DisagMoE): every split of the GPUs into attention and expert
ranks, each side `T = max(FLOPs / (gpus × peak), bytes / bandwidth)`, micro-batches pipelined
between them, against the co-located expert-parallel step."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from growtrain.planning.counting import ModelCount
from growtrain.planning.hardware import Hardware
from growtrain.planning.memory import HEADROOM_TARGET, RUNTIME_RESERVE_BYTES, Activations, workspace_bytes
from growtrain.planning.roofline import allreduce_time, link_time, micro_batch_work, phase_time


@dataclass(frozen=True)
class AfSplit:
    """`attention_gpus` attention ranks and `expert_gpus` expert ranks: their times and bytes."""

    attention_gpus: int
    expert_gpus: int
    attention_s: float
    experts_s: float
    transfer_s: float
    step_time_s: float  # the slowest of the three
    attention_bytes_per_gpu: int
    expert_bytes_per_gpu: int
    fits: bool  # both sides within capacity minus the headroom target

    def to_dict(self) -> dict:
        return {
            "attention_gpus": self.attention_gpus,
            "expert_gpus": self.expert_gpus,
            "attention_s": self.attention_s,
            "experts_s": self.experts_s,
            "transfer_s": self.transfer_s,
            "step_time_s": self.step_time_s,
            "attention_bytes_per_gpu": self.attention_bytes_per_gpu,
            "expert_bytes_per_gpu": self.expert_bytes_per_gpu,
            "fits": self.fits,
        }


@dataclass(frozen=True)
class AfSearch:
    """Every split of one stage's GPUs, and the fastest that fits (the fastest of all if none do)."""

    stage: str
    gpus: int
    nodes: int
    tokens_per_step: int
    splits: tuple[AfSplit, ...]
    best: AfSplit
    colocated_step_time_s: float
    speedup_vs_colocated: float

    applicable: ClassVar[bool] = True

    @property
    def best_fits(self) -> bool:
        return self.best.fits

    def to_dict(self) -> dict:
        return {
            "applicable": True,
            "stage": self.stage,
            "gpus": self.gpus,
            "nodes": self.nodes,
            "tokens_per_step": self.tokens_per_step,
            "splits": [s.to_dict() for s in self.splits],
            "best": self.best.to_dict(),
            "best_fits": self.best_fits,
            "colocated_step_time_s": self.colocated_step_time_s,
            "speedup_vs_colocated": self.speedup_vs_colocated,
        }


@dataclass(frozen=True)
class AfNotApplicable:
    """No split to search: a dense stage, one GPU (`reason`), or a recipe without stages (None)."""

    reason: str | None = None

    applicable: ClassVar[bool] = False

    def to_dict(self) -> dict:
        if self.reason is None:
            return {"applicable": False}
        return {"applicable": False, "reason": self.reason, "splits": []}


def af_search(cfg, count: ModelCount, acts: Activations, stage, hw: Hardware, precision: str, colocated_step: float) -> AfSearch | AfNotApplicable:
    """Every split of the G GPUs into `a` attention ranks (the dense part: attention, norms,
    router, shared expert, embeddings, head; data parallel among themselves, ZeRO-1) and G - a
    expert ranks (the routed experts, sharded over them). Micro-batches are pipelined between the
    groups (two in flight; the pipeline's fill and drain are ignored), so a step takes the slowest
    of: the attention side, the expert side and the transfers between them (the trainer's
    `distributed.af_schedule: interleaved`, model/af_interleaved.py). Each side is T = max(FLOPs / (gpus x peak), bytes / HBM
    bandwidth) with bytes per GPU. Same tokens per step as the co-located layout."""
    G = hw.gpus
    if cfg.moe is None or not cfg.moe_layers or G < 2:
        return AfNotApplicable("needs an MoE stage and at least 2 GPUs")
    B, T = stage.batch_size, stage.seq_len
    tokens = G * B * T * stage.grad_accum
    micro = tokens / (B * T)  # micro-batches per step, over all attention ranks
    E = cfg.moe.num_experts
    w = micro_batch_work(cfg, count, acts, B, T, precision)
    d, e = w.dense, w.experts
    capacity = hw.capacity_bytes * (1 - HEADROOM_TARGET)
    # Activations held: the attention side's share of the saved peak, the expert side's block(s).
    # An expert rank keeps a call's activations until that call's backward: one block's at a time
    # under the reversible backward (its recompute's call); every block's under plain autograd and
    # under checkpointed residual blocks, whose forward calls carry the gradients (af.replaying).
    one_at_a_time = cfg.reversible and getattr(cfg, "block", "coupling") != "residual"
    expert_held = max(acts.block_experts) if one_at_a_time else sum(acts.block_experts)
    attn_held = max(acts.saved_forward_end, acts.saved_backward_peak - max(acts.block_experts)) if cfg.reversible else acts.saved_peak - expert_held
    splits = []
    for a in range(1, G):
        x = G - a
        rounds = micro / a  # micro-batches each attention rank runs; each a round for the experts
        frac = math.ceil(E / x) / E  # of every expert tensor on one expert rank
        b_attn = rounds * d.hbm_bytes + (3 * d.trainable_bytes + 2 * d.optimizer_bytes) / a
        t_attn = phase_time(d.flops * micro, b_attn, a, hw) + allreduce_time(d.trainable_bytes, a, hw)
        # Per round an expert rank reads its experts once per pass and takes a / x micro-batches of slots.
        b_exp = rounds * ((e.weight_bytes + e.grad_bytes) * frac + e.act_bytes * a / x) + (3 * e.trainable_bytes + 2 * e.optimizer_bytes) * frac
        t_exp = phase_time(e.flops * micro, b_exp, x, hw)
        # Every slot crosses: the attention ranks send (and get back) all of it, the expert ranks receive it.
        moved = w.dispatch_bytes * micro
        t_xfer = max(link_time(moved / a, G, hw), link_time(moved / x, G, hw))
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
            AfSplit(
                attention_gpus=a,
                expert_gpus=x,
                attention_s=t_attn,
                experts_s=t_exp,
                transfer_s=t_xfer,
                step_time_s=step,
                attention_bytes_per_gpu=int(mem_attn),
                expert_bytes_per_gpu=int(mem_exp),
                fits=max(mem_attn, mem_exp) <= capacity,
            )
        )
    candidates = [s for s in splits if s.fits] or splits
    best = min(candidates, key=lambda s: s.step_time_s)
    return AfSearch(
        stage=stage.name,
        gpus=G,
        nodes=hw.nodes,
        tokens_per_step=tokens,
        splits=tuple(splits),
        best=best,
        colocated_step_time_s=colocated_step,
        speedup_vs_colocated=colocated_step / best.step_time_s,
    )
