"""Invariance checks around a growth operator (DESIGN.md §8): the function on a fixed held-out
probe batch, and the structure (every parameter produced exactly once, every old one used, the
planned parameter count, optimizer state for every trainable parameter)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from growtrain.stages.registry import Provenance


@torch.no_grad()
def probe_logits(model, inputs_BT: torch.Tensor) -> torch.Tensor:
    was_training = model.training
    model.eval()
    logits = model(inputs_BT).logits.double()
    model.train(was_training)
    return logits


def function_metrics(before_BTV: torch.Tensor, after_BTV: torch.Tensor, targets_BT: torch.Tensor) -> dict:
    diff = after_BTV - before_BTV
    loss_before = F.cross_entropy(before_BTV.flatten(0, 1), targets_BT.flatten()).item()
    loss_after = F.cross_entropy(after_BTV.flatten(0, 1), targets_BT.flatten()).item()
    a, b = before_BTV.flatten(), after_BTV.flatten()
    return {
        "max_abs_dlogits": diff.abs().max().item(),
        "rel_l2": (diff.norm() / a.norm().clamp_min(1e-30)).item(),
        "cosine": F.cosine_similarity(a, b, dim=0).item(),
        "loss_before": loss_before,
        "loss_after": loss_after,
        "rel_dloss": abs(loss_after - loss_before) / max(abs(loss_before), 1e-12),
    }


def function_problems(metrics: dict, exact: bool, cfg) -> list[str]:
    """cfg: an InvarianceConfig. Exact operators meet a tight relative bar; approximate ones the recipe's thresholds."""
    if not all(math.isfinite(v) for v in metrics.values()):
        return [f"non-finite probe metrics: {metrics}"]
    if exact:
        if metrics["rel_l2"] > cfg.exact_rel_tol:
            return [f"logits moved by relative L2 {metrics['rel_l2']:.3g} > {cfg.exact_rel_tol:g} for an exact operator (max |Δlogit| {metrics['max_abs_dlogits']:.3g})"]
        return []
    problems = []
    if metrics["rel_dloss"] > cfg.max_rel_dloss:
        problems.append(f"relative Δloss {metrics['rel_dloss']:.3g} > {cfg.max_rel_dloss:g}")
    if metrics["cosine"] < cfg.min_cosine:
        problems.append(f"logit cosine {metrics['cosine']:.5f} < {cfg.min_cosine:g}")
    return problems


def structure_problems(old_model, new_model, provenance: dict[str, Provenance], planned_params: int) -> list[str]:
    problems = []
    new_names = [n for n, _ in new_model.named_parameters()]
    old_names = {n for n, _ in old_model.named_parameters()}
    unaccounted = [n for n in new_names if n not in provenance]
    if unaccounted:
        problems.append(f"{len(unaccounted)} parameter(s) of the grown model were produced by no rule: {unaccounted[:4]}")
    stray = sorted(set(provenance) - set(new_names))
    if stray:
        problems.append(f"the operator describes parameters the grown model does not have: {stray[:4]}")
    sources = {p.source for p in provenance.values() if p.kind in ("carried", "copy")}
    missing_sources = sorted(s for s in sources if s not in old_names)
    if missing_sources:
        problems.append(f"carried from parameters that do not exist: {missing_sources[:4]}")
    dropped = sorted(old_names - sources)
    if dropped:
        problems.append(f"{len(dropped)} parameter(s) of the old model were dropped: {dropped[:4]}")
    carried = [p.source for p in provenance.values() if p.kind == "carried"]
    twice = sorted({s for s in carried if carried.count(s) > 1})
    if twice:
        problems.append(f"parameters carried into two places (use 'copy' with S): {twice[:4]}")
    actual = new_model.num_parameters()
    if actual != planned_params:
        problems.append(f"parameter count {actual:,} differs from the planned {planned_params:,}")
    return problems
