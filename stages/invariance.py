"""Invariance checks around a growth operator (DESIGN.md §8): the function on a fixed held-out
probe batch (logits, each block's output streams, each MoE layer's router distribution), and the
structure (every parameter produced exactly once, every old one used, the planned parameter
count, optimizer state for every trainable parameter).

Legend: B batch, T sequence (or tokens, flattened), D d_model, V vocabulary, E experts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.nn.functional as F

from growtrain.stages import sharding
from growtrain.stages.registry import Growth, Provenance

PROVENANCE_KINDS = ("carried", "copy", "new", "reset")


# ---------------------------------------------------------------- probing


@dataclass
class Probe:
    """What one model computes on the probe batch, in float64."""

    logits_BTV: torch.Tensor
    streams: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)  # block -> (y1, y2)
    routes_TE: dict[int, torch.Tensor] = field(default_factory=dict)  # MoE block -> router distribution per token


@torch.no_grad()
def probe(model, inputs_BT: torch.Tensor) -> Probe:
    """Run the model in eval mode, recording each block's output streams and each router's
    per-token distribution over experts (forward hooks: nothing is stored on the model). A model
    whose forward bypasses the modules' __call__ simply yields fewer records."""
    out = Probe(torch.empty(0))
    handles = []
    for i, block in enumerate(model.blocks):
        handles.append(block.register_forward_hook(partial(_keep_streams, out.streams, i)))
        if block.is_moe:
            moe = block.g.ffn
            handles.append(moe.router.register_forward_hook(partial(_keep_route, out.routes_TE, i, moe)))
    was_training = model.training
    model.eval()
    try:
        out.logits_BTV = model(inputs_BT).logits.double()
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    return out


def probe_logits(model, inputs_BT: torch.Tensor) -> torch.Tensor:
    return probe(model, inputs_BT).logits_BTV


def _keep_streams(store, index, module, args, output) -> None:
    store[index] = (output[0].detach().double(), output[1].detach().double())


def _keep_route(store, index, moe, module, args, logits_TE) -> None:
    scores_TE = moe.scores(logits_TE.detach().double())
    # Softmax scores already sum to 1; sigmoid scores are normalized the way the aux loss reads them.
    store[index] = scores_TE / scores_TE.sum(-1, keepdim=True).clamp_min(1e-300)


# ---------------------------------------------------------------- function metrics


def function_metrics(before_BTV: torch.Tensor, after_BTV: torch.Tensor, targets_BT: torch.Tensor) -> dict:
    """Logit and loss changes over the whole probe: on expert shards each rank holds its rows
    (sharding.probe_share), and every figure is reduced over the ranks."""
    diff = after_BTV - before_BTV
    a, b = before_BTV.flatten(), after_BTV.flatten()
    ce_before = F.cross_entropy(before_BTV.flatten(0, 1), targets_BT.flatten(), reduction="sum").item()
    ce_after = F.cross_entropy(after_BTV.flatten(0, 1), targets_BT.flatten(), reduction="sum").item()
    diff_sq, a_sq, b_sq, dot, ce_before, ce_after, tokens = sharding.sum_ranks(
        diff.pow(2).sum().item(), a.pow(2).sum().item(), b.pow(2).sum().item(), a.dot(b).item(), ce_before, ce_after, float(targets_BT.numel())
    )
    loss_before, loss_after = ce_before / tokens, ce_after / tokens
    return {
        "max_abs_dlogits": sharding.max_abs(diff),
        "rel_l2": diff_sq**0.5 / max(a_sq**0.5, 1e-30),
        "cosine": dot / max(a_sq**0.5 * b_sq**0.5, 1e-8),  # torch's cosine_similarity eps
        "loss_before": loss_before,
        "loss_after": loss_after,
        "rel_dloss": abs(loss_after - loss_before) / max(abs(loss_before), 1e-12),
    }


def block_pairs(old_model, new_model, growth: Growth) -> dict[int, int]:
    """New block -> old block computing the same output streams."""
    if growth.blocks is not None:
        return dict(growth.blocks)
    return {i: i for i in range(min(len(old_model.blocks), len(new_model.blocks)))}


def block_drift(before: Probe, after: Probe, pairs: dict[int, int], view=None) -> dict[str, float]:
    """Relative L2 change of each block's output streams (both concatenated), keyed by new block."""
    view = view or (lambda x: x)
    sums = {}
    for new, old in sorted(pairs.items()):
        if new not in after.streams or old not in before.streams:
            continue
        a = torch.cat(before.streams[old], -1)
        b = torch.cat([view(y) for y in after.streams[new]], -1)
        sums[str(new)] = ((b - a).pow(2).sum().item(), a.pow(2).sum().item())
    if not sums:
        return {}
    totals = sharding.sum_ranks(*(x for pair in sums.values() for x in pair))  # every rank's probe rows, one reduction
    return {k: totals[2 * i] ** 0.5 / max(totals[2 * i + 1] ** 0.5, 1e-30) for i, k in enumerate(sums)}


def router_pairs(old_model, new_model, growth: Growth, pairs: dict[int, int]) -> dict[int, tuple[int, torch.Tensor | None]]:
    """New MoE block -> (old MoE block, parent expert of each new expert or None for the same experts)."""
    if growth.routers is not None:
        return {new: (pairs[new], parent) for new, parent in growth.routers.items()}
    out = {}
    for new, old in pairs.items():
        nb, ob = new_model.blocks[new], old_model.blocks[old]
        if nb.is_moe and ob.is_moe and nb.g.ffn.num_experts == ob.g.ffn.num_experts:
            out[new] = (old, None)
    return out


def router_kl(before: Probe, after: Probe, pairs: dict[int, tuple[int, torch.Tensor | None]]) -> tuple[dict[str, float], dict[str, float]]:
    """Per MoE layer (keyed by new block): KL(old || new) of the token-averaged router distribution,
    and the mean per-token KL (an upper bound of the first, by convexity). New experts' scores are
    summed onto their parents first, so a split or clone that only divides a parent's mass among
    its children reads 0."""
    averaged, per_token = {}, {}
    for new, (old, parent) in sorted(pairs.items()):
        if new not in after.routes_TE or old not in before.routes_TE:
            continue
        p_TE = before.routes_TE[old]
        q_TE = after.routes_TE[new]
        if parent is not None:
            q_TE = q_TE.new_zeros(p_TE.shape).index_add_(1, parent.to(q_TE.device), q_TE)
        # Over every rank's probe tokens (sharding.probe_share): the summed distributions, the
        # summed per-token KL and the token count, in one reduction.
        E = p_TE.shape[-1]
        local = torch.cat([p_TE.sum(0), q_TE.sum(0), _kl(p_TE, q_TE).sum().reshape(1), p_TE.new_tensor([p_TE.shape[0]])])
        total = sharding.sum_tensor(local)
        tokens = total[-1].clamp_min(1)
        averaged[str(new)] = max(0.0, _kl(total[:E] / tokens, total[E : 2 * E] / tokens).item())
        per_token[str(new)] = max(0.0, (total[-2] / tokens).item())
    return averaged, per_token


def _kl(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    tiny = 1e-300
    return (p * (p.clamp_min(tiny).log() - q.clamp_min(tiny).log())).sum(-1)


# ---------------------------------------------------------------- problems


def function_problems(metrics: dict, exact: bool, cfg, drift: dict[str, float] | None = None) -> list[str]:
    """cfg: an InvarianceConfig. Exact operators meet a tight relative bar; approximate ones the
    recipe's thresholds. `drift` (block -> relative change) locates where an exact operator broke."""
    scalars = {k: v for k, v in metrics.items() if isinstance(v, float)}
    if not all(math.isfinite(v) for v in scalars.values()):
        return [f"non-finite probe metrics: {scalars}"]
    drift = drift or {}
    if exact:
        if metrics["rel_l2"] > cfg.exact_rel_tol:
            moved = [(int(b), d) for b, d in drift.items() if d > cfg.exact_rel_tol]
            where = (
                f"; first block whose output moved: block {min(moved)[0]} (relative L2 {min(moved)[1]:.3g})"
                if moved
                else ("; every block's output matches: the change is in the final norm or LM head" if drift else "")
            )
            return [
                f"logits moved by relative L2 {metrics['rel_l2']:.3g} > {cfg.exact_rel_tol:g} for an exact operator "
                f"(max |Δlogit| {metrics['max_abs_dlogits']:.3g}){where}"
            ]
        return []
    problems = []
    worst = max(drift.items(), key=lambda kv: kv[1]) if drift else None
    where = f" (largest block drift: block {worst[0]}, relative L2 {worst[1]:.3g})" if worst else ""
    if metrics["rel_dloss"] > cfg.max_rel_dloss:
        problems.append(f"relative Δloss {metrics['rel_dloss']:.3g} > {cfg.max_rel_dloss:g}{where}")
    if metrics["cosine"] < cfg.min_cosine:
        problems.append(f"logit cosine {metrics['cosine']:.5f} < {cfg.min_cosine:g}{where}")
    return problems


def router_problems(kl: dict[str, float], exact: bool, cfg) -> list[str]:
    """Exact operators keep every router's (parent-aggregated) distribution: KL within the exact bar."""
    limit = cfg.exact_rel_tol if exact else cfg.max_router_kl
    what = " for an exact operator" if exact else ""
    return [f"router KL {v:.3g} > {limit:g} at the MoE layer of block {b}{what}" for b, v in kl.items() if not v <= limit]


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
    unknown = sorted(n for n, p in provenance.items() if p.kind not in PROVENANCE_KINDS)
    if unknown:
        problems.append(f"provenance of unknown kind (valid: {', '.join(PROVENANCE_KINDS)}): {unknown[:4]}")
    sources = {p.source for p in provenance.values() if p.kind in ("carried", "copy", "reset")}
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
    params = dict(new_model.named_parameters())
    old_params = dict(old_model.named_parameters())
    # A parameter that claims to be carried must hold its source's values: catches a load that
    # silently skipped it (non-strict, renamed key) and left it at its random init.
    altered = sorted(
        n
        for n, p in provenance.items()
        if p.kind == "carried" and n in params and p.source in old_params and not _same(params[n], old_params[p.source])
    )
    if altered:
        problems.append(f"carried parameters that do not hold their source's values: {altered[:4]}")
    bad_masks = sorted(n for n, p in provenance.items() if p.fresh is not None and n in params and not broadcasts_to(p.fresh, params[n].shape))
    if bad_masks:
        problems.append(f"fresh-element masks that do not broadcast to their parameters: {bad_masks[:4]}")
    actual = sharding.count_parameters(new_model)  # expert shards summed over the ranks
    if actual != planned_params:
        problems.append(f"parameter count {actual:,} differs from the planned {planned_params:,}")
    return problems


def broadcasts_to(t: torch.Tensor, shape) -> bool:
    """A per-element field's layout (Provenance, ParamState): the parameter's shape, or size 1
    along dims after the first where the field does not vary."""
    return t.ndim == len(shape) and t.shape[:1] == tuple(shape)[:1] and all(a in (1, b) for a, b in zip(t.shape, shape))


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.device != b.device:
        return False
    if a.data_ptr() == b.data_ptr() and a.stride() == b.stride() and a.dtype == b.dtype:
        return True  # the same storage (materialize assigns carried tensors): nothing to compare
    return bool(torch.equal(a.detach(), b.detach()))


def optimizer_problems(new_model, state: dict) -> list[str]:
    """Optimizer coverage: every trainable parameter has mapped or declared-fresh state of its own
    shape, finite, and nothing else has state. On expert shards, of this rank's share: its expert
    slices and the dense parameters it owns (ZeRO-1), no other dense entry."""
    trainable = {n: p for n, p in new_model.named_parameters() if p.requires_grad}
    owners = sharding.dense_owners(new_model)  # on expert shards: this rank's share (ZeRO-1)
    here = {n for n in trainable if sharding.holds(n, owners)}
    problems = []
    missing = sorted(here - set(state))
    if missing:
        problems.append(f"{len(missing)} trainable parameter(s) have no optimizer state: {missing[:4]}")
    stray = sorted(set(state) - set(trainable))
    if stray:
        problems.append(f"optimizer state for parameters the grown model does not train: {stray[:4]}")
    elsewhere = sorted(set(state) - here - set(stray))
    if elsewhere:
        problems.append(f"optimizer state on rank {sharding.current().rank} for dense parameters another rank owns: {elsewhere[:4]}")
    misshaped, nonfinite = [], []
    for name, p in trainable.items():
        s = state.get(name)
        if s is None:
            continue
        fields = [x for x in (s.step, s.lr_mult, s.wd_mult, s.eps_mult, s.norm_mult) if isinstance(x, torch.Tensor)]
        tensors = [s.exp_avg, s.exp_avg_sq] + fields
        if tuple(s.exp_avg.shape) != tuple(p.shape) or tuple(s.exp_avg_sq.shape) != tuple(p.shape) or not all(broadcasts_to(t, p.shape) for t in fields):
            misshaped.append(name)
        elif not all(bool(torch.isfinite(t.float()).all()) for t in tensors):
            nonfinite.append(name)
    if misshaped:
        problems.append(
            f"optimizer state shaped unlike its parameter: {misshaped[:4]} (moments take its shape; step counts and multipliers its "
            "shape or size 1 along dims after the first)"
        )
    if nonfinite:
        problems.append(f"non-finite optimizer state: {nonfinite[:4]}")
    return problems
