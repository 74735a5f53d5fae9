"""Layer-streamed growth (issue 14, DESIGN.md §15): a run of expert operators (split_experts,
clone_experts) and the quantize_experts after it, applied one MoE layer at a time, so that their
full-precision results exist for one layer only.

At the 120B recipe's `experts` stage, split_experts ×8 then clone_experts ×4 make 256 fp32
experts per layer. Applied whole, the cloned fp32 model and its mapped optimizer state (~204 GB
per rank over 8) are alive next to the old model, and quantize_experts then throws that state
away (its adapters start fresh). Streamed, layer b is split, cloned, quantized and checked before
layer b + 1 grows: the peak holds one layer's intermediate fp32 shards, and the experts' mapped
state of the intermediate models is never built (the final experts are NF4 bases with fresh
adapters: 'reset' parameters of the old experts). The router rows' provenance is composed through
the operators (`compose`), and the optimizer state mapped once, old model to final.

The result is bitwise the whole-model path's, model and optimizer state (each layer's draws are
keyed by its block index: experts.clone_layer, quantize.quantize_layer). What is checked, and where:
- per layer, on that layer alone: the value checks of every operator (each copied element
  β · source bitwise, the copy counts, the redrawn fractions; NF4 bases against bitsandbytes'
  dequantization, the quantization error against bitsandbytes' own round trip), and the layer's
  function on the old model's probe input to that layer, after each operator: the output's and
  the router distribution's change (KL with children summed onto parents), an exact operator's
  held to exact_rel_tol, the others' router KL to max_router_kl (a split whose top-k can cut a
  group of tied siblings in that layer counts as approximate there: Streamed.inexact says so);
- on the whole model: the composed provenance's values (the state is mapped by it), and, by the
  driver (stages/transition.py), old model vs final: the probe function (the approximate
  operators' thresholds, so clone and quantization errors are judged together), the structure,
  the one-step dynamics and the trainability of every new adapter.
What is not checked: the intermediate models as a whole (they never exist) and the optimizer
state mapping of their experts (never built).

Legend: T probe tokens, D d_model.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import torch
from torch import nn

from growtrain.model.expert_parallel import shard_moe
from growtrain.model.moe import MoE
from growtrain.model.nf4 import MATRICES
from growtrain.stages import sharding
from growtrain.stages.common import carry, materialize
from growtrain.stages.invariance import Probe, router_kl, router_problems
from growtrain.stages.operators.experts import clone_layer, ffn_block, moe_blocks, selection_tie_problems, split_layer
from growtrain.stages.operators.quantize import plan_quantize, quantize_layer
from growtrain.stages.registry import Growth, Provenance, get_operator
from growtrain.stages.values import value_check

# Expert operators that grow one MoE layer at a time (name -> the layer's growth), when
# quantize_experts follows them.
LAYERWISE = {"split_experts": split_layer, "clone_experts": clone_layer}


def stream_length(steps, j: int, enabled: bool) -> int:
    """How many steps from step j are applied together, one MoE layer at a time: a run of
    LAYERWISE operators with the quantize_experts after it; 1 where there is none."""
    k = j
    while enabled and k < len(steps) and steps[k].op in LAYERWISE:
        k += 1
    return k - j + 1 if k > j and k < len(steps) and steps[k].op == "quantize_experts" else 1


@dataclass
class Streamed:
    growth: Growth  # the final model, provenance relative to the old model
    layers: dict[str, dict]  # block -> that layer's metrics
    values: dict  # every operator's value checks summed over the layers
    problems: list[str]
    inexact: list[str]  # exact operators these weights kept from being exact, per layer, and why


def apply_streamed(model, unit, keys: list[int], inputs_BT: torch.Tensor, cfg, values: bool, log=None) -> Streamed:
    """The recipe steps `unit` (LAYERWISE operators, then quantize_experts) on `model`, one MoE
    layer at a time. keys: each operator's draw key (stages/sharding.draw_key under its growth
    seed). cfg: the InvarianceConfig. log: told each layer as it is done (or None)."""
    expert_steps, quantize_step = unit[:-1], unit[-1]
    shapes = [model.config]
    for s in expert_steps:
        shapes.append(get_operator(s.op).plan(shapes[-1], s.args))
    final_cfg = plan_quantize(shapes[-1], quantize_step.args)
    exact = [get_operator(s.op).is_exact(s.args) for s in expert_steps]
    # Parent of each expert in the previous model, per operator; and in the old model.
    parents = [torch.arange(after.moe.num_experts) % before.moe.num_experts for before, after in zip(shapes, shapes[1:])]
    origin = parents[0]
    for p in parents[1:]:
        origin = origin[p]
    blocks = moe_blocks(model.config)
    x_in = _moe_inputs(model, inputs_BT, blocks)
    params = {n for n, _ in model.named_parameters()}
    new, provenance = {}, {}
    for name, w in model.state_dict().items():
        if ffn_block(name, model.config) is None:
            carry(name, w, params, new, provenance)
    layers, problems, notes = {}, [], []
    totals = {"elements": 0, "perturbed": 0, "max_abs_diff": 0.0, "seconds": 0.0}
    matrices = {f"experts.{m}" for m in MATRICES}
    steps_here = [*expert_steps, quantize_step]
    for n, b in enumerate(blocks):
        t0 = time.perf_counter()
        old_moe = model.blocks[b].g.ffn
        prefix = f"blocks.{b}.g.ffn."
        chain = [_Holder(shapes[0], b, old_moe)]
        provs: list[dict] = []
        tensors: dict = {}
        for i, s in enumerate(expert_steps):
            tensors, prov = LAYERWISE[s.op](chain[-1], s.args, b, keys[i])
            chain.append(_Holder(shapes[i + 1], b, _layer_module(shapes[i + 1], old_moe, tensors, prefix)))
            provs.append(prov)
        quantized, quantized_prov = quantize_layer({m: tensors[prefix + "experts." + m] for m in MATRICES}, b, final_cfg, keys[-1])
        final = {k: v for k, v in tensors.items() if k[len(prefix) :] not in matrices} | quantized
        chain.append(_Holder(final_cfg, b, _layer_module(final_cfg, old_moe, final, prefix)))
        # A split whose top-k can cut a group of tied siblings in this layer is not exact on its
        # weights (torch.topk's tie-break decides): judged by the approximate bar here, and said.
        ties = [selection_tie_problems(chain[i], [b]) if e and s.op == "split_experts" else [] for i, (e, s) in enumerate(zip(exact, expert_steps))]
        layer_exact = [e and not t for e, t in zip(exact, ties)]
        for s, t in zip(expert_steps, ties):
            for p in t:
                notes.append(f"split_experts ×{s.args.factor}: {p}")
                if log is not None:
                    log(f"not exact on these weights, checked as approximate: {notes[-1]}")
        metrics, found = _layer_function(b, [h.moe for h in chain], steps_here, layer_exact, parents, origin, x_in.pop(b), cfg)
        if values:
            for i, s in enumerate(steps_here):
                prov = provs[i] if i < len(provs) else quantized_prov
                v, more = value_check(s.op, s.args, chain[i], Growth(chain[i + 1], prov))
                found += [p.replace("values: ", f"values: {s.op}, block {b}: ", 1) for p in more]
                _add_values(totals, v)
        layers[str(b)] = metrics
        problems += found
        if log is not None:
            changes = ", ".join(f"{s.op} {metrics[f'{s.op}_rel_l2']:.2e}" for s in steps_here)
            log(f"layer {n + 1}/{len(blocks)} (block {b}) grown and checked in {time.perf_counter() - t0:.1f}s; output rel L2 {changes}; "
                f"router KL {metrics['router_kl']:.2e}" + (f"; {len(found)} problem(s)" if found else ""))
        new.update(final)
        for name in final:
            if name in quantized_prov:  # the adapters, reset in place of the experts (one name in every model of the chain)
                provenance[name] = quantized_prov[name]
            elif name in provs[-1]:
                composed = provs[0][name]
                for later in provs[1:]:
                    composed = compose(composed, later[name])
                provenance[name] = composed
        del tensors, chain, provs, quantized  # the layer's fp32 experts go before the next layer grows
    out = materialize(final_cfg, new)
    growth = Growth(out, provenance, routers={b: origin for b in blocks})
    if values and len(expert_steps) > 1:
        # The composed provenance (router rows through every operator), recomputed on the whole
        # model: the optimizer state is mapped by it, and the dynamics check holds the router rows.
        copies = {n: p for n, p in provenance.items() if p.kind == "copy"}
        v, more = value_check("+".join(s.op for s in unit), None, model, Growth(out, copies), nf4=False)
        problems += [p.replace("values: ", "values: composed provenance: ", 1) for p in more]
        _add_values(totals, v)
    return Streamed(growth, layers, totals, sharding.union_ranks(problems), notes)


def _add_values(totals: dict, v: dict) -> None:
    for k in ("elements", "perturbed", "seconds"):
        totals[k] += v[k]
    totals["max_abs_diff"] = max(totals["max_abs_diff"], v["max_abs_diff"])


def compose(first: Provenance, then: Provenance) -> Provenance:
    """`then` (a parameter of the model `first`'s operator made) seen from the model before: what
    one operator applying both would declare. Copies compose where their β and S are floats
    (router rows: S1 copies, each copied S2 times at uniform β, give S1·S2); per-element fields of
    expert copies are never composed (the quantize_experts that ends a stream resets them)."""
    if then.kind == "carried":
        return first
    if then.kind == "new":
        return then
    if then.kind == "reset" or first.kind == "carried":
        return replace(then, source=first.source)
    if first.kind != "copy":
        raise ValueError(f"compose: {then.source} is a copy of a '{first.kind}' parameter")
    if any(isinstance(x, torch.Tensor) for x in (first.copies, first.beta, then.copies, then.beta)) or first.fresh is not None:
        raise ValueError(f"compose: {then.source} has per-element copy counts or fresh elements from two operators")
    t1, t2 = first.transform, then.transform
    perturbed, bound = then.perturbed, then.perturb_bound
    if first.perturbed is not None:
        earlier = True if first.perturbed is True else t2(first.perturbed.float()) > 0
        if perturbed is None or earlier is True or perturbed is True:
            perturbed = True if True in (earlier is True, perturbed is True) else earlier
        else:
            perturbed = earlier | perturbed
        bound = bound + abs(then.beta) * first.perturb_bound
    return Provenance(
        "copy",
        first.source,
        lambda x: t2(t1(x)),
        copies=first.copies * then.copies,
        beta=first.beta * then.beta,
        fresh=then.fresh,
        perturbed=perturbed,
        perturb_bound=bound,
    )


@torch.no_grad()
def _moe_inputs(model, inputs_BT: torch.Tensor, blocks: list[int]) -> dict[int, torch.Tensor]:
    """Each MoE layer's input rows [T, D] in the old model's probe forward (eval mode)."""
    store, handles = {}, []
    for b in blocks:
        hook = lambda module, args, b=b: store.__setitem__(b, args[0].detach().reshape(-1, args[0].shape[-1]).clone())  # noqa: E731
        handles.append(model.blocks[b].g.ffn.register_forward_pre_hook(hook))
    was_training = model.training
    model.eval()
    try:
        model(inputs_BT)
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    return store


def _layer_module(cfg, like: MoE, tensors: dict[str, torch.Tensor], prefix: str) -> MoE:
    """An MoE layer of shape `cfg` holding `tensors` (names under `prefix`), on `like`'s expert
    shards and backend."""
    with torch.device("meta"):
        moe = MoE(cfg)
    if like.ep is not None:
        shard_moe(moe, like.ep)
    moe.load_state_dict({k[len(prefix) :]: v for k, v in tensors.items()}, strict=True, assign=True)
    try:
        moe.set_expert_backend(like.expert_backend)
    except ValueError:  # a backend of the full-precision format only: the reference then
        moe.set_expert_backend("reference")
    return moe


@torch.no_grad()
def _layer_function(b: int, modules: list[MoE], steps, exact: list[bool], parents: list[torch.Tensor], origin: torch.Tensor, x_TD: torch.Tensor, cfg) -> tuple[dict, list[str]]:
    """Layer b on the old model's probe input to it, through the chain old -> after each
    operator: each operator's change of the output (relative L2) and of the router distribution
    (KL, children summed onto parents), held to the exact bar for an exact operator and to
    max_router_kl for the others; and old -> final."""
    t0 = time.perf_counter()
    outs, routes = [], []
    for moe in modules:
        was = moe.training
        moe.eval()
        y_TD, _ = moe(x_TD)
        moe.train(was)
        outs.append(y_TD.double())
        scores = moe.scores(moe.router(x_TD).double())
        routes.append(scores / scores.sum(-1, keepdim=True).clamp_min(1e-300))

    rel = sharding.rel_l2  # over every rank's probe rows

    def kl(i: int, j: int, parent: torch.Tensor) -> float:
        return router_kl(Probe(torch.empty(0), routes_TE={b: routes[i]}), Probe(torch.empty(0), routes_TE={b: routes[j]}), {b: (b, parent)})[0][str(b)]

    metrics, problems = {}, []
    for i, s in enumerate(steps):
        is_exact = i < len(exact) and exact[i]
        change = rel(outs[i], outs[i + 1])
        metrics[f"{s.op}_rel_l2"] = change
        where = f"streamed layer check: block {b}, {s.op}"
        if i < len(parents):  # quantize_experts keeps the router: nothing to compare
            metrics[f"{s.op}_router_kl"] = router = kl(i, i + 1, parents[i])
            problems += [f"{where}: {p}" for p in router_problems({str(b): router}, is_exact, cfg)]
        if is_exact and not change <= cfg.exact_rel_tol:
            problems.append(f"{where}: the layer's output moved by relative L2 {change:.3g} > {cfg.exact_rel_tol:g} for an exact operator")
    metrics.update(rel_l2=rel(outs[0], outs[-1]), router_kl=kl(0, len(outs) - 1, origin), seconds=time.perf_counter() - t0)
    if sharding.any_ranks(not bool(torch.isfinite(outs[-1]).all())):
        problems.append(f"streamed layer check: block {b}: non-finite output of the grown layer on the probe")
    return metrics, problems


class _Holder(nn.Module):
    """One MoE layer under its model's name (blocks.{b}.g.ffn) with the model's config: what the
    value checks read of a whole model, for that layer alone."""

    def __init__(self, config, block: int, moe: MoE):
        super().__init__()
        self.config = config
        g = nn.Module()
        g.ffn = moe
        holder = nn.Module()
        holder.g = g
        self.blocks = _Blocks({str(block): holder})

    @property
    def moe(self) -> MoE:
        return next(iter(self.blocks.values())).g.ffn


class _Blocks(nn.ModuleDict):
    """Indexed by block number, as a model's ModuleList is."""

    def __getitem__(self, key):
        return super().__getitem__(str(key))

