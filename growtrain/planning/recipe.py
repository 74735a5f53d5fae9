"""The recipe-level plan: every stage's shape from the growth operators' `plan`s, its counts,
memory per GPU and step time, and the AF search on the last stage, as typed results whose
`to_dict()` is the JSON `growtrain plan --json` prints."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from growtrain.planning.counting import count_model
from growtrain.planning.disaggregation import AfNotApplicable, AfSearch, af_search
from growtrain.planning.errors import PlanError
from growtrain.planning.hardware import Hardware
from growtrain.planning.memory import (
    HEADROOM_TARGET,
    MemoryPerGpu,
    autocast_weight_cache,
    growth_peak_bytes_per_rank,
    memory_per_gpu,
    stage_activations,
)
from growtrain.planning.roofline import StepTime, max_micro_batch, roofline


def resolve_vocab(recipe) -> int:
    """The vocabulary the trainer would use: model.vocab_size, or the tokenizer's size."""
    if recipe.model.vocab_size:
        return recipe.model.vocab_size
    if recipe.data.tokenizer == "byte":
        from growtrain.data.tokenizer import ByteTokenizer

        return ByteTokenizer.vocab_size
    from growtrain.data.corpus import DataError
    from growtrain.data.tokenizer import HFTokenizerFile

    try:
        return HFTokenizerFile(recipe.data.tokenizer).vocab_size
    except DataError as exc:
        raise PlanError(f"model.vocab_size is 0 and the tokenizer cannot be read ({exc}); set model.vocab_size") from None


@dataclass(frozen=True)
class ActivationsDetail:
    """The parts of a stage's activation bytes behind its `memory.activations` figure."""

    saved_forward_end_bytes: int
    saved_backward_peak_bytes: int
    head_bytes: int
    streams_bytes: int  # the reversible backward's two fp32 streams (0 under plain autograd)
    largest_block_bytes: int
    autocast_weight_cache_bytes: int

    def to_dict(self) -> dict:
        return {
            "saved_forward_end": self.saved_forward_end_bytes,
            "saved_backward_peak": self.saved_backward_peak_bytes,
            "head": self.head_bytes,
            "streams": self.streams_bytes,
            "largest_block": self.largest_block_bytes,
            "autocast_weight_cache": self.autocast_weight_cache_bytes,
        }


@dataclass(frozen=True)
class StagePlan:
    """One stage on one GPU: its model's counts, memory against capacity and co-located step time.
    `batch_size` is the trainer's (over all GPUs); `micro_batch` is one GPU's share of it."""

    name: str
    params_total: int
    params_active: int
    params_by_role: dict[str, int]
    params_trainable: int
    experts: int
    top_k: int
    expert_format: str | None
    n_moe_layers: int
    n_layers: int
    d_model: int
    reversible: bool
    precision: str
    batch_size: int
    micro_batch: int  # sequences per GPU
    seq_len: int
    grad_accum: int
    steps: int
    tokens: int  # over the whole stage, all GPUs
    tokens_cumulative: int
    memory: MemoryPerGpu
    capacity_bytes: int
    headroom: float  # fraction of capacity left
    fits: bool  # within capacity minus the headroom target
    max_micro_batch: int
    activations: ActivationsDetail
    roofline: StepTime
    stage_time_s: float
    growth_peak_bytes: int  # growth's peak in one process (the per-rank figure over 1); 0 without growth at the stage's start
    growth_peak_bytes_per_rank: int  # the same per expert-parallel rank over hw.gpus processes
    growth_on: str  # where train.grow_on: auto grows this stage: "gpu", "host" (over the GPU's budget), "" without growth
    growth_fits: bool  # the per-rank peak within the budget where it runs (capacity or host share, less the headroom)

    @property
    def per_gpu_bytes(self) -> int:
        return self.memory.total_bytes

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "params_total": self.params_total,
            "params_active": self.params_active,
            "params_by_role": dict(self.params_by_role),
            "params_trainable": self.params_trainable,
            "experts": self.experts,
            "top_k": self.top_k,
            "expert_format": self.expert_format,
            "moe_layers": self.n_moe_layers,
            "n_layers": self.n_layers,
            "d_model": self.d_model,
            "reversible": self.reversible,
            "precision": self.precision,
            "batch_size": self.batch_size,
            "micro_batch": self.micro_batch,
            "seq_len": self.seq_len,
            "grad_accum": self.grad_accum,
            "steps": self.steps,
            "tokens": self.tokens,
            "tokens_cumulative": self.tokens_cumulative,
            "memory": self.memory.to_dict(),
            "per_gpu_bytes": self.per_gpu_bytes,
            "capacity_bytes": self.capacity_bytes,
            "headroom": self.headroom,
            "fits": self.fits,
            "max_micro_batch": self.max_micro_batch,
            "activations_detail": self.activations.to_dict(),
            **self.roofline.to_dict(),
            "stage_time_s": self.stage_time_s,
            "growth_peak_bytes": self.growth_peak_bytes,
            "growth_peak_bytes_per_rank": self.growth_peak_bytes_per_rank,
            "growth_on": self.growth_on,
            "growth_fits": self.growth_fits,
        }


def growth_budget(hw: Hardware, where: str) -> float:
    """Bytes one rank may hold while growing on the GPU or on the host, less the headroom target."""
    whole = hw.capacity_bytes if where == "gpu" else hw.host_bytes_per_gpu
    return whole * (1 - HEADROOM_TARGET)


def growth_place(peak_per_rank: int, hw: Hardware) -> str:
    """Where train.grow_on: auto grows: on the GPU when the per-rank peak fits its budget, else on the host."""
    return "gpu" if peak_per_rank <= growth_budget(hw, "gpu") else "host"


@dataclass(frozen=True)
class Plan:
    """A whole recipe on one hardware layout: every stage, and the AF search on the last."""

    recipe: str
    hardware: Hardware
    layout: str
    headroom_target: float
    stages: tuple[StagePlan, ...]
    af: AfSearch | AfNotApplicable

    @property
    def fits(self) -> bool:
        return all(s.fits and s.growth_fits for s in self.stages)

    def to_dict(self) -> dict:
        return {
            "recipe": self.recipe,
            "hardware": {**asdict(self.hardware), "gpus": self.hardware.gpus},
            "layout": self.layout,
            "headroom_target": self.headroom_target,
            "stages": [s.to_dict() for s in self.stages],
            "af": self.af.to_dict(),
        }


def plan_recipe(recipe, hw: Hardware) -> Plan:
    """The plan of every stage of `recipe` on `hw` (`.to_dict()`: {"hardware", "stages": [...], "af": {...}})."""
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
        probe = (recipe.invariance.probe_batch_size, recipe.invariance.probe_seq_len)
        grow_peak = growth_peak_bytes_per_rank(previous, stage.grow, recipe.optimizer, counts, 1, probe, recipe.invariance.stream)
        grow_peak_rank = growth_peak_bytes_per_rank(previous, stage.grow, recipe.optimizer, counts, hw.gpus, probe, recipe.invariance.stream)
        # Where train.grow_on: auto grows it: a growth that gathers the whole model (an operator
        # that cannot grow expert shards) stays on the GPU, as the trainer keeps it.
        from growtrain.stages import get_operator  # lazily, as planning.memory does: stages imports the planner

        gathers = hw.gpus > 1 and not all(get_operator(s.op).runs_sharded(s.args) for s in stage.grow)
        grow_on = ("gpu" if gathers else growth_place(grow_peak_rank, hw)) if stage.grow else ""
        previous = cfg
        acts = stage_activations(cfg, stage.batch_size, stage.seq_len, precision, hw.gpus)
        mem = memory_per_gpu(cfg, count, acts, hw.gpus, precision)
        roof = roofline(cfg, count, acts, stage, hw, precision)
        moe = cfg.moe if cfg.moe is not None and cfg.moe_layers else None
        stage_tokens = roof.tokens_per_step * stage.steps
        row = StagePlan(
            name=stage.name,
            params_total=count.params_total,
            params_active=count.params_active,
            params_by_role=count.params_by_role,
            params_trainable=count.trainable_params,
            experts=moe.num_experts if moe else 0,
            top_k=moe.top_k if moe else 0,
            expert_format=moe.expert_format if moe else None,
            n_moe_layers=len(cfg.moe_layers) if moe else 0,
            n_layers=cfg.n_layers,
            d_model=cfg.d_model,
            reversible=cfg.reversible,
            precision=precision,
            batch_size=global_stage.batch_size,
            micro_batch=stage.batch_size,
            seq_len=stage.seq_len,
            grad_accum=stage.grad_accum,
            steps=stage.steps,
            tokens=stage_tokens,
            tokens_cumulative=tokens_before + stage_tokens,
            memory=mem,
            capacity_bytes=hw.capacity_bytes,
            headroom=1 - mem.total_bytes / hw.capacity_bytes,
            fits=mem.total_bytes <= hw.capacity_bytes * (1 - HEADROOM_TARGET),
            max_micro_batch=max_micro_batch(cfg, count, stage, hw, precision),
            activations=ActivationsDetail(
                saved_forward_end_bytes=acts.saved_forward_end,
                saved_backward_peak_bytes=acts.saved_backward_peak,
                head_bytes=acts.head,
                streams_bytes=acts.streams,
                largest_block_bytes=max(acts.per_block) if acts.per_block else 0,
                autocast_weight_cache_bytes=autocast_weight_cache(cfg, count, precision),
            ),
            roofline=roof,
            stage_time_s=roof.step_time_s * stage.steps,
            growth_peak_bytes=grow_peak,
            growth_peak_bytes_per_rank=grow_peak_rank,
            growth_on=grow_on,
            growth_fits=not stage.grow or grow_peak_rank <= growth_budget(hw, grow_on),
        )
        tokens_before += stage_tokens
        stages.append(row)
        last = (cfg, count, acts, stage, roof.step_time_s)
    af = af_search(last[0], last[1], last[2], last[3], hw, precision, last[4]) if last else AfNotApplicable()
    return Plan(
        recipe=recipe.name,
        hardware=hw,
        layout=(
            f"{hw.gpus} GPUs: routed experts sharded over all (expert parallel), dense parts data parallel "
            "with ZeRO-1 optimizer state; each GPU trains batch_size / GPUs sequences of every micro-batch"
        ),
        headroom_target=HEADROOM_TARGET,
        stages=tuple(stages),
        af=af,
    )
