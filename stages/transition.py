"""The stage-transition driver: plan every stage's shape, and apply a stage's growth operators
with the optimizer state, checking each application before the next stage may train."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from growtrain.model import GrowLM
from growtrain.model.config import ModelConfig
from growtrain.optim import ParamState, decays
from growtrain.stages.invariance import function_metrics, function_problems, probe_logits, structure_problems
from growtrain.stages.registry import GrowthPlanError, Provenance, get_operator


class GrowthCheckFailed(Exception):
    """An invariance check failed: the run stops before the new stage trains."""

    def __init__(self, record: dict):
        self.record = record
        super().__init__(
            f"growth check failed at stage '{record['stage']}', operator {record['operator']} "
            f"(step {record['index']} of the stage's growth):\n  - " + "\n  - ".join(record["problems"])
        )


def plan_stage_models(seed: ModelConfig, grows) -> list[ModelConfig]:
    """The model shape each stage trains, derived from the seed by the operators' `plan`s alone."""
    from growtrain.recipe import model_problems

    shapes, cfg = [], seed
    for i, steps in enumerate(grows):
        for j, step in enumerate(steps):
            op = get_operator(step.op)
            try:
                cfg = op.plan(cfg, step.args)
            except GrowthPlanError as exc:
                raise GrowthPlanError(exc.message, i, j) from None
            problems = model_problems(cfg)
            if problems:
                raise GrowthPlanError(f"{step.op} would give an invalid model: " + "; ".join(m for _, m in problems), i, j)
        shapes.append(cfg)
    return shapes


def map_optimizer_state(old: dict[str, ParamState], model, provenance: dict[str, Provenance]) -> dict[str, ParamState]:
    """DESIGN.md §7: carried state stays; a β-scaled copy among S copies gets m/S, v/S², LR ×β,
    weight decay ×1/β, epsilon ×1/S and the same step count; new parameters start fresh."""
    new: dict[str, ParamState] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        prov = provenance[name]
        if prov.kind == "carried":
            new[name] = old[prov.source]
        elif prov.kind == "copy":
            s, t = old[prov.source], prov.transform
            new[name] = ParamState(
                s.step,
                t(s.exp_avg) / prov.copies,
                t(s.exp_avg_sq) / prov.copies**2,
                _scaled(s.lr_mult, t, prov.beta),
                _scaled(s.wd_mult, t, 1 / prov.beta),
                _scaled(s.eps_mult, t, 1 / prov.copies),
            )
        else:
            new[name] = ParamState.fresh(p, decays(name, p))
    return new


def _scaled(mult, transform, factor):
    """A multiplier (float, or tensor shaped like its parameter) carried through `transform` and scaled."""
    return transform(mult) * factor if isinstance(mult, torch.Tensor) else mult * factor


def growth_seed(seed: int, stage_index: int, step_index: int) -> int:
    """The seed of one operator application: a function of where it is, never of the RNG stream,
    so a resumed run regrows bit for bit."""
    digest = hashlib.blake2b(f"{seed}/{stage_index}/{step_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


@dataclass
class GrowthOutcome:
    model: GrowLM
    optimizer_state: dict[str, ParamState]
    records: list[dict]


def apply_growth(model, optimizer_state, steps, *, seed, stage_index, stage_name, planned: ModelConfig, probe, invariance_cfg) -> GrowthOutcome:
    """Apply `steps` in order; each is checked, and the first failure raises GrowthCheckFailed."""
    inputs_BT, targets_BT = probe
    records = []
    for j, step in enumerate(steps):
        op = get_operator(step.op)
        before = probe_logits(model, inputs_BT)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(growth_seed(seed, stage_index, j))
            growth = op.apply(model, step.args)
        new_model = growth.model
        after = probe_logits(new_model, inputs_BT)
        metrics = function_metrics(before, after, targets_BT)
        planned_here = op.plan(model.config, step.args)
        with torch.device("meta"):
            planned_params = GrowLM(planned_here).num_parameters()
        problems = structure_problems(model, new_model, growth.provenance, planned_params)
        problems += function_problems(metrics, op.exact, invariance_cfg)
        record = {
            "stage": stage_name,
            "stage_index": stage_index,
            "index": j,
            "operator": op.name,
            "args": step.to_plain(),
            "exact": op.exact,
            "passed": not problems,
            "metrics": metrics,
            "params_before": model.num_parameters(),
            "params_after": new_model.num_parameters(),
            "planned_params": planned_params,
            "provenance": _provenance_summary(growth.provenance),
            "problems": problems,
        }
        records.append(record)
        if problems:
            raise GrowthCheckFailed(record)
        optimizer_state = map_optimizer_state(optimizer_state, new_model, growth.provenance)
        model = new_model
    if model.config != planned:  # the recipe's plan and the operators' results disagree: a bug, never train on
        raise RuntimeError(f"stage {stage_name}: grown shape {model.config} differs from the planned {planned}")
    return GrowthOutcome(model, optimizer_state, records)


def _provenance_summary(provenance: dict[str, Provenance]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for p in provenance.values():
        counts[p.kind] = counts.get(p.kind, 0) + 1
    return counts
