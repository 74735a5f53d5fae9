"""Value checks against provenance (issue 15): what an operator says it did, recomputed.

Function and dynamics checks see a parameter only through the logits; a value that is slightly
wrong, or a copy count S that is wrong where the experts are held from the dynamics check, passes
them. These checks read the provenance alone, not the operator's code path:

- **values**: every 'copy' element that is not fresh equals β · transform(source) bitwise in fp32
  (one fp32 ulp for other dtypes: β is stored as fp32); elements the operator declares perturbed
  (null-space or router noise) are within its declared bound.
- **copy counts**: S of every kept element equals the sum of β over all kept elements that come
  from the same source element, found by pushing the source's element indices through the
  transform (DESIGN.md §7's rule, derived instead of declared).
- **redrawn fractions**: drop-upcycling and clone_experts redraw exactly round(fraction · F)
  neurons of each expert they declare (none of a clone's first copy).
- **NF4**: every NF4 base dequantizes, through the path the model uses, to bitsandbytes' own
  dequantization of its stored codes (expert by expert, from its QuantState); after
  quantize_experts / merge_adapters, the weight-space error of the new experts (base + LoRA) is at
  most bitsandbytes' own NF4 round-trip error on the same full-precision weights.

Problems are worded "values: ..." and name the parameter (hence the block) and the number.
Cost: per copied parameter one transform of the source, of an index tensor and of the sums
(peak: one parameter's worth of int32 indices and float64 sums; on expert shards never more than
the rank's own shard of a tensor); for NF4 one dequantization
of every base per operator, plus one bitsandbytes quantize/dequantize round trip of the experts at
quantize_experts and merge_adapters.
"""

from __future__ import annotations

import re
import time

import torch

from growtrain.kernels.nf4_reference import NF4_BLOCKSIZE, bitsandbytes_functional, dequantize_nf4_bitsandbytes
from growtrain.model.expert_shards import is_expert_tensor
from growtrain.model.nf4 import MATRICES, NF4Experts, stored_layout
from growtrain.stages import sharding
from growtrain.stages.registry import Growth, Provenance

_EXPERT = re.compile(r"^blocks\.(\d+)\.g\.ffn\.experts\.(w_gate|w_up|w_down)$")
S_RTOL = 1e-5  # S is a float sum of β (split shares carry zero-sum noise): exact up to rounding
NF4_ERROR_RTOL = 1e-6  # our quantization is bitsandbytes': the errors agree to rounding


def value_check(op_name: str, args, old_model, growth: Growth, nf4: bool = True) -> tuple[dict, list[str]]:
    """Every check above for one operator's `growth` of `old_model` (nf4=False: without the NF4
    dequantization check, for a caller that has run it on the same bases)."""
    t0 = time.perf_counter()
    old = dict(old_model.named_parameters())
    new = dict(growth.model.named_parameters())
    problems: list[str] = []
    counts = {False: [0, 0], True: [0, 0]}  # (checked, perturbed) of replicated tensors / of expert shards
    worst = 0.0
    with torch.no_grad():
        for name, prov in growth.provenance.items():
            if prov.kind != "copy" or name not in new or prov.source not in old:
                continue
            n, p, diff, found = _copy_problems(name, prov, old[prov.source].detach(), new[name].detach())
            mine = counts[is_expert_tensor(name)]
            mine[0], mine[1], worst = mine[0] + n, mine[1] + p, max(worst, diff)
            problems += found
        problems += _redraw_problems(op_name, args, old_model, growth)
        if nf4:
            problems += nf4_problems(growth.model)
        if op_name in ("quantize_experts", "merge_adapters"):
            problems += quantization_error_problems(old_model, growth.model, merged_source=op_name == "merge_adapters")
    # On expert shards: counts summed over the ranks, the worst difference their maximum.
    checked, perturbed = (int(x) + d for x, d in zip(sharding.sum_ranks(*counts[True]), counts[False]))
    worst = sharding.max_ranks(worst)[0]
    metrics = {"elements": checked, "perturbed": perturbed, "max_abs_diff": worst, "seconds": time.perf_counter() - t0}
    return metrics, problems


def _full(x, like: torch.Tensor, dtype=None) -> torch.Tensor:
    """A provenance field (float or tensor) as a tensor shaped like `like`."""
    t = x.to(like.device) if isinstance(x, torch.Tensor) else torch.tensor(float(x), device=like.device)
    return t.to(dtype or like.dtype).expand(like.shape)


def _copy_problems(name: str, prov: Provenance, old: torch.Tensor, new: torch.Tensor) -> tuple[int, int, float, list[str]]:
    grown = prov.transform(old)
    if tuple(grown.shape) != tuple(new.shape):
        return 0, 0, 0.0, [f"values: {name}: its transform gives shape {tuple(grown.shape)}, the parameter is {tuple(new.shape)}"]
    beta = prov.beta
    if isinstance(beta, torch.Tensor):
        expected = grown * beta.to(device=grown.device, dtype=grown.dtype)
    else:
        expected = grown * beta if beta != 1.0 else grown
    copied = (~prov.fresh.to(new.device)).expand(new.shape) if prov.fresh is not None else torch.ones(new.shape, dtype=torch.bool, device=new.device)
    noisy = _full(prov.perturbed, new, torch.bool) & copied if prov.perturbed is not None else None
    keep = copied & ~noisy if noisy is not None else copied
    problems = []
    delta = (new - expected).abs()
    if new.dtype == torch.float32:
        bad = (new != expected) & keep
    else:  # β is stored as fp32: the operator's product may differ by its rounding
        bad = (delta > expected.abs() * 2.0**-23) & keep
    n_bad = int(bad.sum())
    worst = float(delta[keep].max()) if bool(keep.any()) else 0.0
    if n_bad:
        problems.append(
            f"values: {n_bad} of {int(keep.sum())} copied element(s) of {name} differ from β · transform({prov.source}) "
            f"(max |Δ| {float(delta[bad].max()):.3g}; fp32 copies must match bitwise)"
        )
    n_noisy = int(noisy.sum()) if noisy is not None else 0
    if n_noisy:
        over = delta[noisy] > prov.perturb_bound
        if bool(over.any()):
            problems.append(
                f"values: {int(over.sum())} of {n_noisy} perturbed element(s) of {name} move by up to {float(delta[noisy].max()):.3g}, "
                f"beyond the operator's declared bound {prov.perturb_bound:.3g}"
            )
    on_shards = sharding.current() is not None
    problems += _copies_problems(name, prov, old, new, copied, on_shards and is_expert_tensor(prov.source), on_shards and is_expert_tensor(name))
    return int(keep.sum()), n_noisy, worst, problems


def _copies_problems(name: str, prov: Provenance, old: torch.Tensor, new: torch.Tensor, keep: torch.Tensor, source_sharded: bool = False, copies_sharded: bool = False) -> list[str]:
    """S derived from the transform and β against the declared S, on the kept elements.

    The source's elements are numbered (globally on expert shards: the r-th of the W ranks that
    hold experts holds elements [r·n, (r+1)·n) of a sharded source of n local elements) and pushed through the transform; the β
    of the kept copies summed per source element gives its S, which the transform then carries
    back onto every copy. The copies of a sharded source may sit on other ranks: each rank's partial
    sums for the elements rank s holds are reduced onto rank s, one source rank at a time, so no
    rank ever holds more than a vector of its own source's size (float64)."""
    ep = sharding.current()
    # W here: the ranks that hold experts (an AF layout's attention ranks hold none: r is None
    # there, and they add nothing to the holders' sums but take part in their collectives).
    W, r, base = (ep.expert_ranks, ep.holder(), ep.attention) if ep is not None and source_sharded else (1, 0, 0)
    n = old.numel()
    if base:  # a rank without experts numbers none of the source, but its sums take the holders' size
        n = int(sharding.max_ranks(float(n))[0])
    index_dtype = torch.int32 if n * W < 2**31 else torch.int64
    lo = (r or 0) * n
    index = prov.transform(torch.arange(lo, lo + old.numel(), dtype=index_dtype, device=old.device).view(old.shape))
    if isinstance(prov.beta, torch.Tensor):
        beta = prov.beta.to(device=old.device, dtype=torch.float64).expand(new.shape)[keep]
    else:  # one value for every copy: not materialised
        beta = torch.tensor(float(prov.beta), dtype=torch.float64, device=old.device).expand(int(keep.sum()))
    index = index[keep]
    if W > 1 or base:
        sums = None
        for s in range(W):
            held_by_s = (index >= s * n) & (index < (s + 1) * n)
            part = torch.zeros(n, dtype=torch.float64, device=old.device).index_add_(0, index[held_by_s] - s * n, beta[held_by_s])
            part = sharding.reduce_tensor(part, dst=base + s)
            if s == r:
                sums = part
        if r is None:
            sums = torch.zeros(0, dtype=torch.float64, device=old.device)
        del index, beta
        derived = prov.transform(sums.view(old.shape))
    else:
        sums = torch.zeros(n, dtype=torch.float64, device=old.device).index_add_(0, index, beta)
        del index, beta
        if copies_sharded:  # a replicated source (upcycle's dense FFN) copied onto expert shards
            sums = sharding.sum_tensor(sums)
        derived = prov.transform(sums.view(old.shape))
    declared = _full(prov.copies, new, torch.float64)
    off = (derived - declared).abs() > S_RTOL * derived.abs().clamp_min(1.0)
    off &= keep
    if not bool(off.any()):
        return []
    first = off.nonzero()[0].tolist()
    return [
        f"values: {name}: {int(off.sum())} element(s) declare copy count S = {float(declared[tuple(first)]):g} where the "
        f"transform and β give {float(derived[tuple(first)]):g} (element {first}): their optimizer state would be "
        "mapped with the wrong S"
    ]


def _redraw_problems(op_name: str, args, old_model, growth: Growth) -> list[str]:
    """Each expert redraws exactly round(fraction · F) neurons (a clone's first copies none)."""
    if op_name == "upcycle_moe" and getattr(args, "drop_ratio", 0) > 0:
        fraction, skip_first = args.drop_ratio, 0
    elif op_name == "clone_experts" and old_model.config.moe is not None and old_model.config.moe.expert_format == "full":
        fraction, skip_first = args.reinit_fraction, old_model.config.moe.num_experts
    else:
        return []
    problems = []
    params = dict(growth.model.named_parameters())
    for name, prov in growth.provenance.items():
        match = _EXPERT.match(name)
        if match is None or prov.kind != "copy":
            continue
        param = params[name]
        hidden_dim = 2 if match.group(2) == "w_down" else 1
        F = param.shape[hidden_dim]
        want = round(fraction * F)
        fresh = prov.fresh if prov.fresh is not None else torch.zeros(param.shape, dtype=torch.bool)
        per_neuron = fresh.any(dim=3 - hidden_dim)  # [E, F] (this rank's experts, on expert shards)
        counts = per_neuron.sum(1)
        lo, _ = sharding.local_range(growth.model.config.moe.num_experts)
        expected = torch.full_like(counts, want)
        expected[torch.arange(lo, lo + len(counts)) < skip_first] = 0
        wrong = (counts != expected).nonzero().flatten().tolist()
        if wrong:
            e = wrong[0]
            problems.append(
                f"values: {name}: {len(wrong)} expert(s) redraw another number of neurons than declared (expert {lo + e}: "
                f"{int(counts[e])} of {F}, declared {int(expected[e])} = round({fraction:g} x {F})"
                + (", none for a clone's first copy" if skip_first else "") + ")"
            )
    return problems


def _nf4_modules(model) -> list[tuple[str, NF4Experts]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, NF4Experts)]


def nf4_problems(model) -> list[str]:
    """Every NF4 base, dequantized the way the model does, equals bitsandbytes' own dequantization
    of the stored codes (each expert from its QuantState), bitwise."""
    problems = []
    for prefix, experts in _nf4_modules(model):
        for m in MATRICES:
            stack = experts.stack(m)
            if not stack.num_experts:  # a rank without experts (an AF layout's attention rank)
                continue
            ours = experts.dequantized(m)  # the model's path, in the full-precision layout
            theirs = torch.stack([dequantize_nf4_bitsandbytes(stack, e) for e in range(stack.num_experts)])
            theirs = theirs.transpose(1, 2) if m == "w_down" else theirs
            if not torch.equal(ours, theirs):
                n = int((ours != theirs).sum())
                problems.append(
                    f"values: {prefix}.{m}: {n} dequantized NF4 weight(s) differ from bitsandbytes' dequantization of the "
                    f"stored codes (max |Δ| {float((ours - theirs).abs().max()):.3g})"
                )
    return problems


def quantization_error_problems(old_model, new_model, merged_source: bool) -> list[str]:
    """The new experts' weight-space error (base + LoRA, the function they compute) is at most
    bitsandbytes' NF4 round-trip error on the same full-precision weights."""
    bnbf = bitsandbytes_functional()
    old_modules = dict(old_model.named_modules())
    problems = []
    for prefix, experts in _nf4_modules(new_model):
        source = old_modules.get(prefix)
        if source is None:
            continue
        for m in MATRICES:
            full = source.merged(m) if merged_source else getattr(source, m).detach().float()
            stored = stored_layout(m, full)
            double_quant = experts.stack(m).double_quant
            round_trip = torch.stack([
                bnbf.dequantize_4bit(*bnbf.quantize_4bit(w.reshape(-1).contiguous(), blocksize=NF4_BLOCKSIZE,
                                                         quant_type="nf4", compress_statistics=double_quant)).reshape(w.shape)
                for w in stored
            ]) if len(stored) else stored  # none on a rank without experts
            # On expert shards: the norms over every rank's experts.
            reference, got = (v**0.5 for v in sharding.sum_ranks(float((stored - round_trip).double().pow(2).sum()), float((full - experts.merged(m)).double().pow(2).sum())))
            if got > reference * (1 + NF4_ERROR_RTOL) + 1e-12:
                problems.append(
                    f"values: {prefix}.{m}: the quantized experts are {got / max(reference, 1e-30):.3g}x as far from the "
                    f"full-precision weights as bitsandbytes' own NF4 round trip (L2 {got:.4g} vs {reference:.4g})"
                )
    return problems
