"""split_experts and clone_experts: more routed experts per MoE layer.

Children are laid out round-robin: child j of parent e is expert j·E + e, so the siblings of one
parent land in different contiguous slices of the expert dimension (different expert-parallel
ranks when experts are sharded in contiguous blocks), spreading a parent's load.

split_experts (E → fE, top_k → f·top_k, expert_hidden → expert_hidden / f): child j of expert e
holds neurons [j·F/f, (j+1)·F/f) of e, with its down-projection ×f; its router row is e's row and
its balance bias e's bias (÷f under softmax, where its score is p/f; the bias rate likewise, so the
bias keeps evolving as e's would have). The f children of a selected parent all tie with it, so top-(f·k)
selects exactly the children of the old top-k parents (unless the k-th and (k+1)-th old logits
tie); with renormalized gates each child receives gate/f: softmax, each child's score is p/f of a
total that sums over f copies; sigmoid, each child's score is the parent's and the renormalizing
sum counts it f times. So Σ_children (g/f)·f·W_down,j h_j = g·W_down h: exact. The Switch balance
loss is unchanged too (E·Σ f_e P_e: f-fold more experts with loads and probabilities divided by f);
the z-loss is not (the logsumexp grows by log f). Optimizer state: gate/up slices are the old
elements (β = 1, S = 1), down-projection slices β = f, S = f, router rows β = 1, S = f. Experts'
steps are then exactly the old steps; the router rows' are not: siblings get unequal shares of
their parent's gradient (the shares sum to it), so once they are trained they drift apart.

Until then siblings tie exactly: bitwise-identical router rows and selection biases, so the same
selection score for every token. Siblings that no token of a batch selects get identical
gradients (from the aux losses alone) and identical balance-bias steps, so a model trained only a
step or two after a split keeps some sibling groups tied and others separated. A later split of
such a model is exact only where every token's top-k takes each tied group whole: that holds when
all groups have one size g dividing top_k (e.g. two splits back to back, before any training),
and fails once sizes mix, where a top-k can take part of a group. Which part is torch.topk's
unspecified tie-break, which the children, f times as many ties laid out round-robin, cannot
reproduce. `selection_tie_problems` finds such layers from the weights; apply_split attaches what
it finds to the Growth as notes, which a failed invariance check reports. With `router_noise` > 0
the tie is broken at once: every child but the first gets noise on its router row (as a clone
does), so siblings compete for tokens from the first step, and the split is approximate, checked
by the recipe's bars (the noise's bound declared to the value check).

clone_experts (E → mE, top_k fixed; approximate): every child starts as its parent's copy; all
children but the first redraw a fraction of their neurons (drop-upcycling: gate/up rows and down
columns drawn with the parent matrix's mean and std), and their router rows get small noise, so
that clones specialise instead of staying identical. Softmax needs no −log m logit shift: a
parent's probability is already shared by its m children (each gets p/m) and renormalized gates
do not see the total; sigmoid scores renormalized over the selection and over the experts (the
router KL and the balance loss read them so) are kept without a shift, and a −log m shift would
change the gate ratios between different parents. With top_k fixed a token's k picks may now be
siblings of fewer parents: the function changes, and the checks measure by how much. Optimizer
state: experts and router rows β = 1, S = m (the siblings share the parent's moments); redrawn
neurons start fresh with their own step count.

NF4 experts (quantize_experts; growtrain/model/nf4.py) are cut and copied on their 4-bit codes and
quantization state wherever the shapes allow, so the bases of the children dequantize bit for bit
to the parent's rows (split ×f):
- split: child j takes rows [j·F/f, (j+1)·F/f) of every stored matrix (w_down is stored
  transposed, [F, D], so its neuron slice is a row slice too), and the down-projection's ×f scales
  only the absmax (nf4_scale: exact for powers of two). A slice is exact only where it starts on a
  quantization block: each child's matrix, F/f × D elements, must be a multiple of 64, and with
  double quantization of 64 · 256 = 16384 (the nested absmax blocks). Elsewhere the children are
  made with as little requantizing as the shapes allow (`_nf4_children`: block scales
  double-quantized again with the codes kept, or the whole base requantized), and the move is
  measured and noted, so the transition judges the split as approximate with the reason and
  the size that would make it exact (never a silent requantization). The LoRA pairs
  split so that each child's product is its parent's restricted to its neurons: gate/up B
  [E, F, r] is sliced by rows (β = 1, S = 1, like the base rows) and A [E, r, D] shared by the f
  children; down A [E, r, F] is sliced by columns and ×f (β = f, S = f, like the full-precision
  down-projection) and B [E, D, r] shared. A shared factor gets β = 1, S = f, as the router rows:
  its children's gradients are shares that sum to the parent's.
- clone: children copy their parent's codes and quantization state (nf4_take_experts) and its
  LoRA pair (β = 1, S = m). Drop-upcycling is refused (reinit_fraction must be 0): a redrawn
  neuron of a frozen base would stay random for good, only its rank-r adapter training, and it
  would need requantizing; clones diverge through router_noise and their own adapters.

Legend: E experts, F expert hidden width, D d_model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch

from growtrain.kernels.nf4_reference import NESTED_BLOCKSIZE, NF4_BLOCKSIZE, NF4Stack
from growtrain.model.config import ModelConfig
from growtrain.model.nf4 import (
    MATRICES,
    dequantize_stack,
    nf4_cat_experts,
    nf4_per_expert,
    nf4_renest_rows,
    nf4_requantized,
    nf4_row_slice_problem,
    nf4_scale,
    nf4_slice_rows,
    nf4_take_experts,
    quantize_stack,
    row_slice_problem,
    stack_state,
)
from growtrain.stages.common import carry, along_hidden, materialize, pick_neurons, redraw_neurons, requantized_note, sibling_copies
from growtrain.stages.sharding import children_to_owners, draw_key, local_range, sub_key
from growtrain.stages.registry import Growth, GrowthPlanError, Operator, Provenance, register


@dataclass(frozen=True)
class SplitExpertsArgs:
    factor: int = field(default=2, metadata={"doc": "f: every expert's neurons are cut into f children; num_experts and top_k grow f-fold.", "ge": 2})
    router_noise: float = field(
        default=0.0,
        metadata={
            "doc": "Std of noise on the router rows of every child but the first, relative to the router weights' RMS: "
            "siblings then differ in routing from the first step instead of being selected together until training "
            "separates them. 0 (default): exact; > 0: approximate, checked against the recipe's thresholds.",
            "ge": 0.0,
        },
    )


@dataclass(frozen=True)
class CloneExpertsArgs:
    factor: int = field(default=2, metadata={"doc": "m: every expert gets m − 1 clones; top_k stays.", "ge": 2})
    reinit_fraction: float = field(
        default=0.25,
        metadata={"doc": "Fraction of each clone's neurons redrawn (drop-upcycling); the first child stays an exact copy.", "ge": 0.0, "le": 1.0},
    )
    router_noise: float = field(
        default=0.01, metadata={"doc": "Std of the noise on the clones' router rows, relative to the router weights' RMS.", "ge": 0.0}
    )


# ---------------------------------------------------------------- shared helpers


def moe_blocks(cfg: ModelConfig) -> list[int]:
    return sorted(cfg.moe_layers) if cfg.moe is not None else []


def is_nf4(cfg: ModelConfig) -> bool:
    return cfg.moe is not None and cfg.moe.expert_format == "nf4"


def expert_param(name: str, cfg: ModelConfig) -> tuple[int, str] | None:
    """(block, what) for a routed-expert weight, router weight or balance bias; None otherwise."""
    parts = name.split(".")
    if parts[0] != "blocks" or not cfg.is_moe_layer(int(parts[1])) or parts[2:4] != ["g", "ffn"]:
        return None
    if parts[4] == "experts":
        return int(parts[1]), parts[5]
    if parts[4] == "router":
        return int(parts[1]), "router." + parts[5]
    return None


# ---------------------------------------------------------------- split_experts


def plan_split(cfg: ModelConfig, args: SplitExpertsArgs) -> ModelConfig:
    if cfg.moe is None or not cfg.moe_layers:
        raise GrowthPlanError("split_experts: the model has no MoE layer to split (upcycle_moe first)")
    f, moe = args.factor, cfg.moe
    if moe.expert_hidden % f:
        raise GrowthPlanError(f"split_experts: expert_hidden {moe.expert_hidden} is not divisible by the factor {f}")
    if is_nf4(cfg) and (moe.expert_hidden // f * cfg.d_model) % 2:
        raise GrowthPlanError(
            f"split_experts: NF4 packs two weights per byte, and each child's matrix, expert_hidden / factor x d_model = "
            f"{moe.expert_hidden // f} x {cfg.d_model}, has an odd number of elements; choose another factor, or split before quantize_experts"
        )
    return cfg.with_changes(
        moe=replace(
            moe,
            num_experts=moe.num_experts * f,
            top_k=moe.top_k * f,
            expert_hidden=moe.expert_hidden // f,
            balance_bias_rate=_bias_scale(moe, f) * moe.balance_bias_rate,
        )
    )


def nf4_split_problem(d_model: int, hidden: int, f: int, double_quant: bool) -> str | None:
    """Why NF4 experts of hidden width `hidden` cannot be split f-fold on their codes, bit-exactly
    (None: they can); such a split re-quantizes what it must (`_nf4_children`) and is judged as
    approximate, with this as the note's way to make it exact."""
    if f & (f - 1):
        return (
            f"factor {f} on NF4 experts: the down-projection's ×{f} is exact on the codes only for powers of two "
            "(it scales the absmax); use factor 2 or 4, or split before quantize_experts"
        )
    rows = hidden // f
    for j in range(f):
        problem = row_slice_problem(hidden, d_model, j * rows, (j + 1) * rows, double_quant)
        if problem:
            need = NF4_BLOCKSIZE * NESTED_BLOCKSIZE if double_quant else NF4_BLOCKSIZE
            why = f"{NESTED_BLOCKSIZE} nested absmax blocks of {NF4_BLOCKSIZE}" if double_quant else "the quantization block"
            alternatives = "split before quantize_experts, quantize with double_quant: false (then multiples of 64 suffice), or " if double_quant else "split before quantize_experts, or "
            return (
                f"the NF4 experts' {hidden} x {d_model} matrices cannot be cut into {f} children on their codes "
                f"(child {j}: {problem}). Each child's matrix, expert_hidden / factor x d_model = {rows} x {d_model} = {rows * d_model} "
                f"elements, must be a multiple of {need} ({why}); {alternatives}choose expert_hidden and d_model so that it is"
            )
    return None


def _bias_scale(moe, children: int) -> float:
    """Softmax children score p/children, so the selection bias (and its rate) shrinks with them to
    keep every comparison, and the bias's evolution, as before; sigmoid children keep the score."""
    return 1.0 / children if moe.score_func == "softmax" else 1.0


def _split_transform(what: str, f: int, E: int):
    """How a split builds each tensor from its parent: expert tensors in local child order, then
    moved to the ranks that hold the children (stages/sharding.py); router rows (replicated) tiled."""
    if what in ("w_gate", "w_up"):  # [E, F, D] -> [f·E, F/f, D], child j·E + e = slice j of e
        return lambda t: children_to_owners(t.unflatten(1, (f, -1)).transpose(0, 1).flatten(0, 1), f, E)
    if what == "w_down":  # [E, D, F] -> [f·E, D, F/f]
        return lambda t: children_to_owners(t.unflatten(2, (f, -1)).permute(2, 0, 1, 3).flatten(0, 1), f, E)
    return lambda t: t.repeat((f,) + (1,) * (t.ndim - 1))  # router rows, balance bias


def ffn_block(name: str, cfg: ModelConfig) -> int | None:
    """The block of an MoE layer's FFN tensor (router, experts, shared expert); None otherwise."""
    parts = name.split(".")
    if parts[0] == "blocks" and parts[2:4] == ["g", "ffn"] and cfg.is_moe_layer(int(parts[1])):
        return int(parts[1])
    return None


def _grow_by_layer(model, args, layer_fn, new_cfg: ModelConfig, key: int | None) -> tuple[dict, dict]:
    """Every tensor outside the MoE layers' FFNs carried; each MoE layer grown by `layer_fn`."""
    params = {n for n, _ in model.named_parameters()}
    new, provenance = {}, {}
    for name, w in model.state_dict().items():
        if ffn_block(name, model.config) is None:
            carry(name, w, params, new, provenance)
    for b in moe_blocks(model.config):
        tensors, prov = layer_fn(model, args, b, key)
        new.update(tensors)
        provenance.update(prov)
    return new, provenance


def _layer_tensors(model, block: int, new: dict, provenance: dict):
    """(module, name prefix, its parameter names, [(name, what, tensor)] of its router and expert
    tensors) of MoE layer `block`; everything else in the layer (a shared expert) carried into
    `new` / `provenance`."""
    moe = model.blocks[block].g.ffn
    prefix = f"blocks.{block}.g.ffn."
    params = {n for n, _ in moe.named_parameters(prefix=prefix[:-1])}
    grown = []
    for name, w in moe.state_dict(prefix=prefix).items():
        where = expert_param(name, model.config)
        if where is None:
            carry(name, w, params, new, provenance)
        else:
            grown.append((name, where[1], w))
    return moe, prefix, params, grown


def apply_split(model, args: SplitExpertsArgs) -> Growth:
    old_cfg, f = model.config, args.factor
    new_cfg = plan_split(old_cfg, args)
    key = draw_key() if args.router_noise > 0 else None  # first, as stages/streaming.py draws it
    requantized: list[str] = []  # NF4 bases the codes could not be cut from (`_nf4_children`)
    new, provenance = _grow_by_layer(model, args, lambda *a: split_layer(*a, notes=requantized), new_cfg, key)
    parent = torch.arange(f * old_cfg.moe.num_experts) % old_cfg.moe.num_experts
    notes = [f"split_experts ×{f}: {p}" for p in selection_tie_problems(model)] + requantized
    return Growth(materialize(new_cfg, new), provenance, routers={b: parent for b in moe_blocks(new_cfg)}, notes=notes)


def split_layer(
    model, args: SplitExpertsArgs, block: int, key: int | None = None, notes: list[str] | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, Provenance]]:
    """One MoE layer's children (router rows, experts; a shared expert carried) and their
    provenance. With router_noise, the noise on the children's router rows comes from a generator
    seeded by (key, block), as clone_layer's draws do; else nothing is drawn. NF4 bases that had to
    be requantized add their note (judged as approximate) to `notes`."""
    old_cfg, f = model.config, args.factor
    E = old_cfg.moe.num_experts
    new, provenance = {}, {}
    moe, prefix, params, grown = _layer_tensors(model, block, new, provenance)
    for name, what, w in grown:
        if is_nf4(old_cfg) and not what.startswith("router."):
            continue  # _split_nf4 below
        transform = _split_transform(what, f, E)
        beta = float(f) if what == "w_down" else 1.0
        new[name] = transform(w) * beta if beta != 1.0 else transform(w)
        noisy, bound = None, 0.0
        if what == "router.weight" and args.router_noise > 0:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(sub_key(key, block))
                new[name], noisy, bound = _noisy_rows(w, new[name], E, args.router_noise)
        if what == "router.balance_bias":
            new[name] = new[name] * _bias_scale(old_cfg.moe, f)
        if name in params:
            copies = 1.0 if what in ("w_gate", "w_up") else float(f)
            provenance[name] = Provenance("copy", name, transform, copies=copies, beta=beta, perturbed=noisy, perturb_bound=bound)
    if is_nf4(old_cfg):
        found = _split_nf4(moe.experts, prefix + "experts.", f, E, new, provenance)
        if notes is not None:
            notes.extend(found)
    return new, provenance


def selection_tie_problems(model, blocks: list[int] | None = None) -> list[str]:
    """One line per MoE layer whose top-k can take part of a group of exactly tied experts (bitwise
    identical router rows and selection biases, so equal selection scores for every token), saying
    why a split cannot then be exact and what to do; [] when every group is taken whole (all groups
    one size g with g | top_k, including no ties at all, g = 1). From the weights alone: whether a
    given token does cut a group depends on the other experts' scores."""
    cfg = model.config
    k = cfg.moe.top_k if cfg.moe is not None else 0
    problems = []
    for b in moe_blocks(cfg) if blocks is None else blocks:
        router = model.blocks[b].g.ffn.router
        # [E, D + 1] keys: two experts tie for every token exactly when their keys are equal.
        keys_EK = torch.cat([router.weight.detach().float(), router.balance_bias.detach().float().unsqueeze(1)], dim=1)
        _, counts_G = torch.unique(keys_EK, dim=0, return_counts=True)
        sizes = sorted(set(counts_G.tolist()))
        if len(sizes) == 1 and k % sizes[0] == 0:
            continue
        tied = counts_G[counts_G > 1]
        size_list = ", ".join(f"{int((counts_G == s).sum())} of {s}" for s in sizes)
        problems.append(
            f"block {b}: {int(tied.sum())} of {keys_EK.shape[0]} experts tie exactly in {tied.numel()} groups (bitwise-identical "
            f"router rows and selection bias; groups by size: {size_list}; top_k {k}), siblings of an earlier split or clone "
            f"that training has not separated yet. A token's top-{k} can take part of a tied group, and which part is "
            f"torch.topk's unspecified tie-break, which the children cannot reproduce, so the split is not exact for such "
            f"tokens. Train longer between the two splits, so that the siblings separate, or do both splits back to back "
            f"before training (tied groups of one size dividing top_k are always taken whole)"
        )
    return problems


def _tile(f: int):
    return lambda t: t.repeat((f,) + (1,) * (t.ndim - 1))  # child j·E + e = e


def _split_nf4(experts, prefix: str, f: int, E: int, new: dict, provenance: dict) -> list[str]:
    """An NF4Experts module's children (see the module docstring), written into `new` under
    `prefix`; returns a note per base that could not be cut on its codes (`_nf4_children`)."""
    notes = []
    exact_when = nf4_split_problem(experts.d_model, experts.hidden, f, experts.double_quant)
    for m in MATRICES:
        children, moved, how = _nf4_children(experts.stack(m), f, float(f) if m == "w_down" else 1.0)
        if how:
            notes += requantized_note("split_experts", prefix + m, moved, how, f"where the codes can be cut: {exact_when}")
        new.update({prefix + k: v for k, v in stack_state(m, _to_owners(children, f, E)).items()})
        # The factor indexed by the neurons is sliced (gate/up B's rows, down A's columns: the
        # transforms of the full-precision w_gate and w_down); the other is shared by the children.
        for part, neurons in (("A", m == "w_down"), ("B", m != "w_down")):
            name = prefix + f"{m}_lora_{part}"
            w = getattr(experts, f"{m}_lora_{part}").detach()
            if neurons:
                transform = _split_transform("w_down" if m == "w_down" else "w_gate", f, E)
                beta = float(f) if m == "w_down" else 1.0
                new[name] = transform(w) * beta if beta != 1.0 else transform(w)
                provenance[name] = Provenance("copy", name, transform, copies=beta, beta=beta)
            else:
                new[name] = _children(f, E)(w)
                provenance[name] = Provenance("copy", name, _children(f, E), copies=float(f), beta=1.0)
    return notes


def _nf4_children(stack: NF4Stack, f: int, scale: float) -> tuple[NF4Stack, float, str]:
    """Every expert's f children (child-major: child j of expert e at j·E + e), each its parent's
    rows [j·R/f, (j+1)·R/f) times `scale`; with how far they move from those values (relative to
    the largest of them) and how they were made ("": cut from the codes, exact, 0.0). Chosen from
    the shapes alone, so every rank of a sharded model takes the same way:
    - codes and quantization state cut (nf4_slice_rows, nf4_scale) where every child starts on a
      (nested) quantization block and the scale is a power of two: bit for bit the parent's rows;
    - with double quantization, where children start on a quantization block but not on a nested
      one: the 4-bit codes kept and each child's block scales double-quantized again
      (nf4_renest_rows), every scale moving by at most one 8-bit step;
    - elsewhere (children starting inside a block, a scale that is not a power of two) the
      parent dequantized, cut, scaled and quantized again (nf4_requantized)."""
    rows = stack.rows // f
    cuts = [(j * rows, (j + 1) * rows) for j in range(f)]
    pow2 = math.frexp(scale)[0] == 0.5
    if pow2 and not any(nf4_row_slice_problem(stack, a, b) for a, b in cuts):
        return nf4_scale(nf4_cat_experts([nf4_slice_rows(stack, a, b) for a, b in cuts]), scale), 0.0, ""
    target = dequantize_stack(stack).unflatten(1, (f, rows)).transpose(0, 1).flatten(0, 1) * scale
    blocks_align = not any(row_slice_problem(stack.rows, stack.cols, a, b, False) for a, b in cuts)
    if not (pow2 and stack.double_quant and blocks_align):
        grown, moved = nf4_requantized(stack, target)
        return grown, moved, "for the children (dequantized, cut and quantized again)"
    renested = "for the children by double-quantizing their block scales again (the 4-bit codes kept)"
    if not stack.num_experts:  # no expert here (an AF layout's attention rank): the format alone
        return quantize_stack(target, stack.double_quant), 0.0, renested
    sliced = [nf4_slice_rows(stack, a, b) if not nf4_row_slice_problem(stack, a, b) else nf4_renest_rows(stack, a, b) for a, b in cuts]
    children = nf4_scale(nf4_cat_experts(sliced), scale)
    got = dequantize_stack(children).to(target.device)
    largest = float(target.abs().max())
    moved = float((got - target).abs().max()) / largest if largest else float((got - target).abs().max())
    return children, moved, renested


# ---------------------------------------------------------------- clone_experts


def plan_clone(cfg: ModelConfig, args: CloneExpertsArgs) -> ModelConfig:
    if cfg.moe is None or not cfg.moe_layers:
        raise GrowthPlanError("clone_experts: the model has no MoE layer to clone (upcycle_moe first)")
    moe = cfg.moe
    if is_nf4(cfg) and args.reinit_fraction > 0:
        raise GrowthPlanError(
            f"clone_experts: reinit_fraction {args.reinit_fraction:g} would redraw neurons of frozen NF4 bases, which would stay random "
            "for good (only their rank-r adapters train) and need requantizing; set reinit_fraction: 0 on NF4 experts (the clones "
            "still diverge through router_noise and their own adapters), or clone before quantize_experts"
        )
    return cfg.with_changes(
        moe=replace(moe, num_experts=moe.num_experts * args.factor, balance_bias_rate=_bias_scale(moe, args.factor) * moe.balance_bias_rate)
    )


def apply_clone(model, args: CloneExpertsArgs) -> Growth:
    old_cfg = model.config
    new_cfg = plan_clone(old_cfg, args)
    key = draw_key()  # first, as stages/streaming.py draws it
    new, provenance = _grow_by_layer(model, args, clone_layer, new_cfg, key)
    parent = torch.arange(args.factor * old_cfg.moe.num_experts) % old_cfg.moe.num_experts
    return Growth(materialize(new_cfg, new), provenance, routers={b: parent for b in moe_blocks(new_cfg)})


def clone_layer(model, args: CloneExpertsArgs, block: int, key: int) -> tuple[dict[str, torch.Tensor], dict[str, Provenance]]:
    """One MoE layer's grown tensors (router, experts, shared expert carried) and their provenance.
    Its random draws come from a generator seeded by (key, block): a layer grows the same whether
    the model grows whole or one layer at a time (stages/streaming.py)."""
    old_cfg, m = model.config, args.factor
    E, F = old_cfg.moe.num_experts, old_cfg.moe.expert_hidden
    parent = torch.arange(m * E) % E
    first = torch.arange(m * E) < E
    lo, hi = local_range(m * E)  # the grown experts this rank holds (all of them in one process)
    tile = _tile(m)
    children = _children(m, E)
    nf4 = is_nf4(old_cfg)
    new, provenance = {}, {}
    moe, prefix, params, grown_here = _layer_tensors(model, block, new, provenance)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(sub_key(key, block))
        # Drawn for every expert on every rank (an [mE, F] mask), so the same whatever the EP size.
        redraw = None if nf4 else pick_neurons(m * E, F, args.reinit_fraction, skip=first)
        for name, what, w in grown_here:
            if what.startswith("router."):  # replicated: every rank grows all of its rows
                grown = tile(w)
                noisy, bound = None, 0.0
                if what == "router.weight" and args.router_noise > 0:
                    grown, noisy, bound = _noisy_rows(w, grown, E, args.router_noise)
                if what == "router.balance_bias":
                    grown = grown * _bias_scale(old_cfg.moe, m)
                new[name] = grown
                if name in params:
                    provenance[name] = Provenance("copy", name, tile, copies=float(m), beta=1.0, perturbed=noisy, perturb_bound=bound)
                continue
            if nf4:
                continue  # _clone_nf4 below
            hidden_dim = 1 if what in ("w_gate", "w_up") else 2
            grown, fresh = redraw_neurons(children(w), redraw[lo:hi], hidden_dim, torch.arange(lo, hi))
            new[name] = grown
            copies = along_hidden(sibling_copies(~redraw, parent, E)[lo:hi], hidden_dim)
            provenance[name] = Provenance("copy", name, children, copies=copies, beta=1.0, fresh=fresh)
    if nf4:
        _clone_nf4(moe.experts, prefix + "experts.", m, E, new, provenance)
    return new, provenance


def _noisy_rows(w: torch.Tensor, grown: torch.Tensor, E: int, std: float):
    """`grown` (a router's tiled rows, parent e's children at e, E + e, ...) with noise of `std`
    × the RMS of the parent rows `w` on every row but the first child's, which keeps its parent's
    logits exactly; with the mask of the noisy elements and the bound the value check holds them
    to. Draws from the torch generator (the caller seeds it)."""
    rms = w.double().pow(2).mean().sqrt().item()
    noise = torch.randn(grown.shape, dtype=torch.float64) * (std * rms)
    noise[:E] = 0
    grown = grown + noise.to(device=w.device, dtype=w.dtype)
    first = torch.arange(grown.shape[0]) < E
    noisy = (~first).view(-1, *([1] * (grown.ndim - 1))).expand(grown.shape).to(grown.device)
    # N(0, std²) draws beyond 12 std: probability ~1e-32 (plus the sum's fp32 rounding).
    return grown, noisy, 12.0 * std * rms + 1e-6 * float(grown.abs().max())


def _children(m: int, E: int):
    """An expert tensor's m-fold copies in the round-robin layout (child j·E + e of parent e), on
    the ranks that hold them: tiled locally, then moved (stages/sharding.py)."""
    return lambda t: children_to_owners(_tile(m)(t), m, E)


def _clone_nf4(experts, prefix: str, m: int, E: int, new: dict, provenance: dict) -> None:
    """An NF4Experts module's m-fold clones: codes, quantization state and adapters copied."""
    L = experts.num_experts  # held here: E, or E / W on expert shards
    local_parent = torch.arange(m * L) % L
    for mtx in MATRICES:
        stack = _to_owners(nf4_take_experts(experts.stack(mtx), local_parent), m, E)
        new.update({prefix + k: v for k, v in stack_state(mtx, stack).items()})
        for part in ("A", "B"):
            name = prefix + f"{mtx}_lora_{part}"
            new[name] = _children(m, E)(getattr(experts, f"{mtx}_lora_{part}").detach())
            provenance[name] = Provenance("copy", name, _children(m, E), copies=float(m), beta=1.0)


def _to_owners(stack, m: int, E: int):
    """An NF4 stack of children in local order, moved to the ranks that hold them."""
    return replace(stack, **nf4_per_expert(stack, lambda t: children_to_owners(t, m, E)))


register(
    Operator(
        "split_experts",
        True,
        "E → f·E experts and top_k → f·top_k: each expert's neurons cut into f children, router rows duplicated, "
        "down-projections ×f (each child gets gate/f); exact unless the k-th and (k+1)-th router logits tie (as siblings of an earlier split do until trained apart: named in a failed check). Expert parameters "
        "unchanged (the router gains rows). NF4 experts: codes cut without requantizing where the factor is a power of two and each "
        "child's matrix a multiple of 64 elements (16384 with double quantization), LoRA pairs split with them; elsewhere the "
        "children's bases are requantized, the move measured and judged as approximate. With router_noise > 0 every child but "
        "the first gets noise on its router row (approximate), so that siblings are not selected together.",
        SplitExpertsArgs,
        plan_split,
        apply_split,
        exact_if=lambda args: args.router_noise == 0,
        shards=True,
    )
)
register(
    Operator(
        "clone_experts",
        False,
        "E → m·E experts, top_k fixed: copies with partially redrawn neurons (drop-upcycling), router rows tiled with small noise, "
        "siblings spread round-robin; approximate, checked against the recipe's thresholds. Parameters ×m in the experts. NF4 experts: codes and adapters copied, "
        "reinit_fraction must be 0.",
        CloneExpertsArgs,
        plan_clone,
        apply_clone,
        shards=True,
    )
)
