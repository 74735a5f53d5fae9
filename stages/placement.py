"""Where a run's growth computes, and on what: the run's side of a stage transition.

Placement (train.grow_on): on the training device, or on the host when asked or when growth's planned
peak per rank is over the GPU's budget (auto); the model and its optimizer state move there and back,
and the growth's collectives go to a gloo group meanwhile (NCCL's take CUDA tensors only).

On what: under expert parallelism, on the expert shards where every operator of the transition can
(stages/sharding.py; the optimizer state stays this rank's share: its experts and the dense entries
it owns), else on the gathered model, grown identically on every rank and re-sharded. An AF layout
grows on its shards as an expert-parallel group whose attention ranks hold no expert
(Dist.growth_ep); its expert ranks hold a copy of the dense part meanwhile.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Callable

import torch

from growtrain.model.config import ModelConfig
from growtrain.model.expert_parallel import use_group
from growtrain.optim.adamw import AdamW
from growtrain.parallel import collective_guard
from growtrain.parallel.distributed import Dist
from growtrain.planning import HEADROOM_TARGET, growth_peak_bytes_per_rank
from growtrain.recipe import Recipe, StageConfig
from growtrain.runtime.memory import host_available_bytes
from growtrain.stages import sharding
from growtrain.stages.registry import get_operator
from growtrain.stages.transition import GrowthCheckFailed, GrowthOutcome, apply_growth


def growth_budget_bytes(device: torch.device) -> float | None:
    """What growth may hold per rank on `device` (train.grow_on: auto): a GPU's memory less the
    planner's headroom target; None on the CPU, where the host is the device."""
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_properties(device).total_memory * (1 - HEADROOM_TARGET)


def _size(n: float) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def grows_on_host(recipe: Recipe, stage: StageConfig, before: ModelConfig, dist: Dist, device: torch.device, plan_counts: dict,
                  can: bool, log: Callable[[str], None]) -> bool:
    """train.grow_on for this stage's growth: host, device, or auto (the host when growth's
    planned peak per rank is over the GPU's budget). The same answer on every rank. `can`:
    whether the transition grows without a gather (on shards, or in one process)."""
    setting = recipe.train.grow_on
    budget = growth_budget_bytes(device) if setting == "auto" else None
    if setting == "device" or (setting == "auto" and budget is None):
        return False
    invariance = recipe.invariance
    # An AF layout's expert ranks hold its experts (E / F each) and, while growth runs, the dense
    # part: the planner's peak for F ranks over-counts only their share of the dense state.
    ranks = dist.af.expert_ranks if dist.af is not None else dist.size
    peak = growth_peak_bytes_per_rank(
        before, stage.grow, recipe.optimizer, plan_counts, ranks, (invariance.probe_batch_size, invariance.probe_seq_len), invariance.stream,
    )
    if setting == "auto":
        if not dist.any_rank(peak > budget):
            log(f"growth [{stage.name}]: on {device} (planned peak {_size(peak)} per rank, {_size(budget)} usable)")
            return False
        why = f"planned peak {_size(peak)} per rank is over the {_size(budget)} usable on {device}"
    else:
        why = f"train.grow_on: host; planned peak {_size(peak)} per rank"
    if not can:
        log(f"growth [{stage.name}]: stays on {device} ({why}, but it gathers the whole model, which growth on the host does not do)")
        return False
    available = host_available_bytes()
    ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if available is not None and peak * ranks_here > available:
        log(f"warning: growth [{stage.name}] on the host may run out of memory: {ranks_here} process(es) here x {_size(peak)} "
            f"planned, {_size(available)} available")
    log(f"growth [{stage.name}]: on the host ({why})")
    return True


def grow_stage(model, optimizer: AdamW, dist: Dist, recipe: Recipe, stage_index: int, before: ModelConfig, planned: ModelConfig, probe,
               device: torch.device, plan_counts: dict, run_dir: Path, log: Callable[[str], None]) -> tuple[object, GrowthOutcome]:
    """Stage `stage_index`'s growth of `model` (this rank's part of it) and of `optimizer`'s state,
    placed as the module docstring says. Returns the grown model (this rank's part, back on
    `device`, with the recipe's expert backend) and the outcome; `optimizer` is rebound to the grown
    parameters. A failed check writes its report to RUN_DIR/growth-failure.json and raises."""
    stage = recipe.stages[stage_index]
    if not recipe.invariance.dynamics:
        log("warning: invariance.dynamics is false: no one-step dynamics or trainability check of this growth")
    if not recipe.invariance.values:
        log("warning: invariance.values is false: no check of the grown values against their provenance")
    on_shards = dist.active and all(get_operator(s.op).runs_sharded(s.args) for s in stage.grow)
    af_shards = on_shards and dist.af is not None
    if af_shards:
        log(f"growth [{stage.name}]: on the AF layout's shards (the experts on the {dist.af.expert_ranks} expert ranks, "
            "the dense parameters copied to them while it runs)")
        dist.af_to_growth(model)
    on_host = grows_on_host(recipe, stage, before, dist, device, plan_counts, on_shards or not dist.active, log)
    ep = dist.growth_ep()
    if on_host:
        ep = dist.host_ep() if dist.active else None
        host = torch.device("cpu")
        model.to(host)
        optimizer.to(host)
        if ep is not None:
            use_group(model, ep)
        model.set_expert_backend("auto")  # the reference, on the host
        probe = tuple(t.to(host) for t in probe)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if on_shards:
        grown_from, state = model, optimizer.state
        if af_shards:  # an attention rank holds empty slices of the expert entries meanwhile
            state = dist.af_growth_state(dict(state), torch.device("cpu") if on_host else device)
            # The copy holds every entry: the optimizer lets go of them, so that an entry the growth
            # drops (release_folded) is freed; it is rebound to the outcome's state below.
            optimizer.state = {}
    else:
        if dist.active:
            unsharded = [s.op for s in stage.grow if not get_operator(s.op).runs_sharded(s.args)]
            log(f"growth [{stage.name}]: gathering the whole model on every rank ({', '.join(unsharded)} cannot grow expert shards yet)")
        grown_from, state = dist.gather_full(model, optimizer.state)
    try:
        with sharding.sharded(ep if on_shards else None), collective_guard.only_in(ep.group) if on_host and ep is not None else contextlib.nullcontext():
            outcome = apply_growth(
                grown_from, state, stage.grow, seed=recipe.seed, stage_index=stage_index, stage_name=stage.name, planned=planned,
                probe=probe, invariance_cfg=recipe.invariance, optimizer_cfg=recipe.optimizer, lr=recipe.lr(stage_index, 0), log=log,
                fresh=stage.fresh, release_folded=True,  # the optimizer is rebound to the outcome's state below
            )
    except GrowthCheckFailed as exc:
        # Nothing of the failed growth is checkpointed; its report is kept for the post-mortem.
        report = run_dir / "growth-failure.json"
        if dist.is_main:
            report.write_text(json.dumps(exc.record, indent=2, default=str) + "\n")
        log(f"growth check failed; full report in {report}")
        raise
    model = outcome.model if on_shards else dist.shard(outcome.model)
    if on_host:
        model.to(device)
    if af_shards:
        dist.af_from_growth(model)
    elif on_host and ep is not None:
        use_group(model, dist.ep)
    named = dict(model.named_parameters())
    optimizer.rebind(dist.owned(named), dist.shard_state(outcome.optimizer_state, named, experts_sharded=on_shards))
    if on_host:
        optimizer.to(device)
    model.set_expert_backend(recipe.train.expert_backend)
    return model, outcome


def record_line(stage_name: str, r: dict) -> str:
    """One growth record as the console line a run prints for it."""
    m = r["metrics"]
    return (
        f"growth [{stage_name}] {r['operator']} ({'exact' if r['exact'] else 'approximate'}): "
        f"params {r['params_before']:,} -> {r['params_after']:,}, max|Δlogit| {m['max_abs_dlogits']:.2e}, "
        f"rel L2 {m['rel_l2']:.2e}, cosine {m['cosine']:.6f}, Δloss {m['loss_after'] - m['loss_before']:+.2e}"
        + (f", router KL ≤ {m['max_router_kl']:.1e}" if "max_router_kl" in m else "")
        + (f", one-step Δ rel {m['dynamics']['rel_l2']:.1e} ({m['dynamics']['seconds'] + m.get('trainability', {}).get('seconds', 0.0):.2f}s)" if "dynamics" in m else "")
        + (f", values checked ({m['values']['elements']:,} copied elements, {m['values']['seconds']:.2f}s)" if "values" in m else "")
        + " — passed"
    )
