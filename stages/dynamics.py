"""The growth checks that look past the logits (DESIGN.md §7, §15): a wrong optimizer-state mapping
(moments not divided by S / S², step counts reset, LR multipliers dropped, renamed parameters
starting fresh) leaves the logits at growth time unchanged and only shows in the next steps; a new
element that can never train (zero rows next to zero columns, LoRA with both factors zero) shows in
no logit at all.

- Dynamics: one optimizer step, with the run's optimizer class, config (clipping included) and the
  new stage's first LR, taken from (old model, old state) and from (new model, new state), each on
  its own copy of the state and with the weights restored afterwards; the two changes of the probe
  logits are compared. Where an operator's step is exact only on a subset, the rest is held out on
  both sides (a tensor held whole is taken out of autograd; a held part's gradient is zeroed before
  the clip norm and its values are restored after the step):
  elements growth introduced fresh (new, reset, or marked fresh in a copy: they step where the old
  model had nothing), the sources of reset parameters (their values now sit in frozen buffers), and
  the operator's declared holds (HELD: split siblings' router rows get unequal shares of their
  parent's gradient). The loss is the cross-entropy alone: the router z-loss changes by log m
  under a split by design, and the balance-bias update is not optimizer state. An exact operator's
  bar adds what this model resolves, measured (issue 42): the distance of the old side's twin
  (twin_step: weights one ulp off, 8-bit moments of copied tensors regrouped) from its own step,
  and likewise for the clip norm.
- Trainability: every trainable element growth introduced has a non-zero gradient on the probe,
  or gets one within TRAINABILITY_STEPS steps of the others (a zero-initialised factor next to a
  non-zero one: the pair's product has a gradient; the loss is the training loss, aux included).
  Each of those steps is the run's optimizer step from the carried state at the weights the
  earlier ones moved (the state is not advanced: no copy of it is held). Experts no probe token
  reached are not judged (counted).
- Fresh state: every element growth introduced fresh takes the run's optimizer step from the
  grown state on its probe gradient, which from fresh state is exactly lr · m · g / (|g| + eps)
  besides the weight decay, m the recipe's `fresh.lr_mult` (fresh_first_steps): a copied step
  count, kept moments or multipliers of new elements inside copied tensors, or a dropped `fresh.lr_mult`,
  show there and nowhere else (they are held out of the dynamics).

Cost on the probe batch, per operator: the old model 1 forward+backward and 1 forward (2 of each
for an exact operator: its twin); the new one 1 forward+backward and 1 forward (dynamics), and 1
forward+backward for trainability, plus TRAINABILITY_STEPS more when some new element has no
gradient at first (zero-initialised factors); the fresh-state check steps one tensor at a time.
Memory: each side's gradients, then its saved weights growing as step_each drops them (one copy of
the stepped weights in all), and one tensor's optimizer state at a time; no side's updates are
kept unless the comparison fails (then `locate` steps both again to name the parameter). The
transition's check adds one old and one new step. On expert shards each rank runs its rows of the
probe (sharding.probe_share): the loss is scaled and the gradients averaged so that they are the
whole probe's, and every figure is reduced over the ranks.

Legend: B batch, T sequence, V vocabulary.
"""

from __future__ import annotations

import copy
import dataclasses
import re
import time
import zlib
from collections.abc import Mapping
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from growtrain.optim.adamw8bit import BLOCKSIZE, Moment8bit, uses_8bit_state
from growtrain.optim.registry import build_optimizer
from growtrain.stages import sharding

# Operator -> patterns (re.search) of the grown parameters held out of the one-step comparison
# (with their sources on the old side), and why.
HELD: dict[str, tuple[tuple[str, ...], str]] = {
    # NF4 experts: the LoRA factor a split copies to both children rather than slicing (down's B,
    # gate's and up's A) is shared by the two halves of the parent's neurons in the same way.
    "split_experts": (
        (r"\.router\.weight$", r"\.experts\.w_down_lora_B$", r"\.experts\.w_(gate|up)_lora_A$"),
        "router rows (and the LoRA factors copied whole: down's B, gate's and up's A) of split siblings receive unequal "
        "shares of their parent's gradient",
    ),
    "clone_experts": ((r"\.router\.weight$",), "router rows of clones receive unequal shares of their parent's gradient"),
    # The rest is exact: the experts are equal, so the renormalized gates (summing to 1) pass the
    # dense FFN's gradient to the streams unchanged.
    "upcycle_moe": (
        (r"\.router\.weight$", r"\.g\.ffn\.experts\."),
        "experts held (each copy receives its gate's share of the dense gradient, not 1/E of it: exact only for uniform gates)",
    ),
}

# Exact operators whose one step is not exact on any useful subset (always, or with some
# arguments), and why: judged by the approximate bar (dynamics_max_rel).
APPROXIMATE_STEP: dict[str, object] = {
    "widen_hidden": lambda args: "the null-space noise makes the copies' gradients differ" if getattr(args, "noise", 0.0) else None,
    "widen_ffn": lambda args: "the noise makes the duplicated neurons' gradients differ" if getattr(args, "noise", 0.0) else None,
}


def approximate_step(op_name: str, args) -> str | None:
    """Why one step after this (exact) operator is not exact, or None."""
    rule = APPROXIMATE_STEP.get(op_name)
    return rule(args) if rule is not None else None

RESOLUTION_MULT = 10.0

# The floor of the clip-norm bar for exact operators: 0 to ~1e-7 measured on the micro recipe, 7e-6
# to 1e-5 on the tiny recipe's deep transition (seed 2, two machines: a fixed bar of 1e-5 stopped
# it on one); the measured twin distance (below) raises the bar where a model resolves its norm no
# finer. A dropped clip-norm weight on the expert tensors of a split moved it by 1.4e-4 (micro).
CLIP_NORM_RTOL = 1e-5

# Exact operators: how far past the measured twin noise (twin_step) a grown model's step may be. The
# grown model computes the same function in another order, so its step sits at the twin's distance;
# measured grown/twin ratios over the false-failure search (tests/test_false_failures.py) stay far
# below it, while a wrong state mapping moves the step by 1e-3 to 1 relative.
NOISE_MULT = 10.0

_EXPERT = re.compile(r"^blocks\.(\d+)\.g\.ffn\.experts\.")


@dataclass
class Side:
    """One side of the comparison: a model, its optimizer state, and the elements held out
    (name -> bool mask shaped like the parameter; None: the whole tensor)."""

    model: object
    state: dict
    held: dict[str, torch.Tensor | None]


def fresh_masks(model, provenance) -> dict[str, torch.Tensor]:
    """Trainable elements an operator introduced: whole 'new' / 'reset' parameters and the fresh
    elements of copies (bool masks shaped like the parameters)."""
    out = {}
    for name, p in model.named_parameters():
        prov = provenance.get(name)
        if not p.requires_grad or prov is None:
            continue
        if prov.kind in ("new", "reset"):
            out[name] = torch.ones((), dtype=torch.bool, device=p.device).expand(p.shape)  # a view: no byte per element
        elif prov.kind == "copy" and prov.fresh is not None and sharding.any_elements(prov.fresh):
            out[name] = prov.fresh.to(p.device).bool().expand(p.shape)  # a per-neuron mask broadcast (a view)
    return out


def carry_masks(masks: dict[str, torch.Tensor], model, provenance) -> dict[str, torch.Tensor]:
    """Masks over an old model carried onto the grown one through the provenance (a transition of
    several operators: fresh elements of an earlier operator are still fresh after the later ones)."""
    out = {}
    for name, p in model.named_parameters():
        prov = provenance.get(name)
        if prov is None or prov.source not in masks:
            continue
        m = masks[prov.source]
        if prov.kind == "carried":
            out[name] = m
        elif prov.kind == "copy":
            out[name] = prov.transform(m.float()).to(p.device) > 0
    return out


def source_names(names, provenance) -> set[str]:
    """The old parameters the given new ones were built from (none for 'new')."""
    return {provenance[n].source for n in names if n in provenance and provenance[n].kind != "new" and provenance[n].source}


def held_patterns(op_names) -> tuple[tuple[str, ...], list[str]]:
    patterns, why = [], []
    for op in op_names:
        if op in HELD:
            patterns += [s for s in HELD[op][0] if s not in patterns]
            why += [w for w in [f"{op}: {HELD[op][1]}"] if w not in why]
    return tuple(patterns), why


def with_patterns(model, held: dict, patterns: tuple[str, ...]) -> dict:
    """`held` plus every trainable parameter matching one of `patterns`, whole."""
    held = dict(held)
    for name, p in model.named_parameters():
        if p.requires_grad and any(re.search(pat, name) for pat in patterns):
            held[name] = None
    return held


# ---------------------------------------------------------------- one step


def _loss(model, inputs_BT, targets_BT, with_aux: bool = False):
    """The probe loss of this rank's share (sharding.probe_share), scaled so that probe_grads
    gives the whole probe's mean-loss gradients; in one process the mean."""
    out = model(inputs_BT)
    ce = F.cross_entropy(out.logits.float().flatten(0, 1), targets_BT.flatten(), reduction="sum")
    loss = ce / sharding.probe_tokens(targets_BT.numel())
    return out, (loss + out.aux_loss if with_aux else loss)


def _backward(model, inputs_BT, targets_BT) -> dict:
    """The training loss's gradients (cross-entropy + aux: a top-1 router trains only through the
    balance loss), left in the parameters' .grad, and the expert loads on the probe."""
    named = {n: p for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)
    with torch.enable_grad():
        out, loss = _loss(model, inputs_BT, targets_BT, with_aux=True)
        loss.backward()
    sharding.probe_grads(named)
    return _expert_loads(model, out)


def _expert_loads(model, out) -> dict[int, torch.Tensor]:
    moe_blocks = [i for i, b in enumerate(model.blocks) if b.is_moe]
    return {b: s.load.detach() for b, s in zip(moe_blocks, out.moe_stats)}


def _optimizer(named, state, opt_cfg):
    """The run's optimizer over `named`, holding `state` itself: a caller that steps it passes a
    copy. Built empty, so no fresh state of the whole model is allocated only to be replaced."""
    opt = build_optimizer({}, opt_cfg)
    opt.rebind(named, state)
    return opt


def step_each(named: dict, state: dict, opt_cfg, lr: float, saved: dict | None = None, holders: dict | None = None) -> None:
    """One optimizer step of every parameter with a gradient (already clipped), one tensor at a time,
    each on a copy of its own state, its gradient dropped once it has stepped: what the run's
    optimizer computes when it steps them all (its update is elementwise, per tensor), holding one
    tensor's state copy instead of the whole model's (at the 120B recipe's clone step, per rank:
    ~1 GB, one layer's expert matrix, instead of ~120 GB). saved: a parameter's value is copied
    into it just before its first step, so the saved weights grow as the gradients are dropped
    (together one copy of the trainable weights, not two). holders (sharding.dense_holders, on
    expert shards): a dense parameter steps on the rank that holds its state, which then
    broadcasts the new value."""
    for n, p in named.items():
        if p.grad is None:
            continue
        if saved is not None and n not in saved:
            saved[n] = p.detach().clone()
        if n in state:
            _optimizer({n: p}, {n: copy.deepcopy(state[n])}, opt_cfg).step(lr)
        elif holders is None or n not in holders:
            raise KeyError(f"no optimizer state for {n}")
        if holders is not None and n in holders:
            sharding.broadcast_(p, holders[n][0])
        p.grad = None


@contextmanager
def _scratch_steps(model):
    """The trainable parameters, by name, and a dict for their saved values (filled by step_each as
    each first steps): steps taken inside move them, and on the way out the weights are restored,
    the gradients cleared and the train/eval mode reset."""
    named = {n: p for n, p in model.named_parameters() if p.requires_grad}
    saved: dict[str, torch.Tensor] = {}
    was_training = model.training
    model.train()
    try:
        yield named, saved
    finally:
        with torch.no_grad():
            for n, t in saved.items():
                named[n].copy_(t)
        model.zero_grad(set_to_none=True)
        model.train(was_training)


@contextmanager
def _frozen(model, names):
    """The named parameters out of autograd for the block: a parameter held whole on a side steps
    not at all, so its gradient, saved value and update are never made (at the quantize step, the
    old side's fp32 experts: three copies of the largest tensors)."""
    params = dict(model.named_parameters())
    off = [params[n] for n in names if n in params and params[n].requires_grad]
    for p in off:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p in off:
            p.requires_grad_(True)


def one_step(side: Side, opt_cfg, lr: float, inputs_BT, targets_BT, on_update=None) -> dict:
    """One clipped optimizer step of `side` on the probe, on copies: returns the change of the probe
    logits (this rank's rows), the squared norm of the logits before and the clip norm; the model's
    weights are restored and its gradients cleared. on_update(name, update): told each trainable
    parameter's update in turn (zeros where it did not step), one tensor alive at a time."""
    model = side.model
    whole = [n for n, mask in side.held.items() if mask is None]
    with _frozen(model, whole), _scratch_steps(model) as (named, saved):
        parts = {n: mask for n, mask in side.held.items() if mask is not None and n in named}  # held in part
        with torch.enable_grad():
            model.zero_grad(set_to_none=True)
            out, loss = _loss(model, inputs_BT, targets_BT)
            before_BTV = out.logits.detach().double()
            loss.backward()
        sharding.probe_grads(named)
        for name, mask in parts.items():
            if named[name].grad is not None:
                named[name].grad.masked_fill_(mask, 0.0)
        norm = _scratch_step(named, side.state, opt_cfg, lr, saved)
        with torch.no_grad():
            for name, mask in parts.items():
                if name in saved:
                    named[name].copy_(torch.where(mask, saved[name], named[name]))
            if on_update is not None:
                for n, p in named.items():
                    on_update(n, p.detach() - saved[n] if n in saved else torch.zeros_like(p))
            after_BTV = model(inputs_BT).logits.double()
        return {"delta_BTV": after_BTV - before_BTV, "norm": norm, "logits_sq": float(before_BTV.pow(2).sum())}


# ---------------------------------------------------------------- the twin: the measured resolution


@contextmanager
def jittered(model):
    """The model's floating-point parameters, each element with probability 1/2 moved one unit in
    the last place away from zero (zeros stay zero: a zero-initialised factor keeps its role), and
    moved back exactly on the way out (nextafter is invertible on every finite non-zero value, so
    no copy of the weights is kept). Which elements move is drawn from the parameter's name alone:
    replicated parameters move alike on every rank. The jittered model computes the same function
    up to fp32 rounding, as a grown model does in another order."""
    moved = []
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.is_floating_point():
                mask = _jitter_mask(name, p)
                chosen = p[mask]  # transients of half the tensor, one tensor at a time
                p[mask] = torch.nextafter(chosen, _scalar(float("inf"), p).copysign(chosen))
                moved.append((name, p))
    try:
        yield
    finally:
        with torch.no_grad():
            for name, p in moved:
                mask = _jitter_mask(name, p)
                p[mask] = torch.nextafter(p[mask], _scalar(0.0, p))


def _jitter_mask(name: str, p: torch.Tensor) -> torch.Tensor:
    g = torch.Generator(device=p.device).manual_seed(zlib.crc32(name.encode()))
    return torch.randint(0, 2, p.shape, generator=g, device=p.device, dtype=torch.uint8).bool() & (p != 0)


def _scalar(value: float, like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(value, dtype=like.dtype, device=like.device)


class Reblocked(Mapping):
    """An optimizer state (name -> ParamState) whose 8-bit moments (optimizer.dense_state_bits: 8)
    of the entries in `regrouped` are requantized with their blocks shifted by half a block, entry
    by entry on access: the same moments up to 8-bit resolution, as a grown tensor's moments are
    after growth regroups their elements into other blocks (a split's columns, a tiled row). Other
    entries pass through, as a carried parameter keeps its codes."""

    def __init__(self, state: dict, params: dict, opt_cfg, regrouped):
        self.state, self.params, self.regrouped = state, params, regrouped
        self.on = getattr(opt_cfg, "dense_state_bits", 32) == 8

    def __getitem__(self, name: str):
        s = self.state[name]
        p = self.params.get(name)
        if not self.on or name not in self.regrouped or p is None or not uses_8bit_state(name, p):
            return s
        return dataclasses.replace(s, exp_avg=_shifted_blocks(s.exp_avg, True), exp_avg_sq=_shifted_blocks(s.exp_avg_sq, False))

    def __iter__(self):
        return iter(self.state)

    def __len__(self) -> int:
        return len(self.state)


def _shifted_blocks(x: torch.Tensor, signed: bool) -> torch.Tensor:
    shift = BLOCKSIZE // 2
    flat = torch.roll(x.reshape(-1), shift)
    return torch.roll(Moment8bit.quantize(flat, signed).dequantize().reshape(-1), -shift).reshape(x.shape)


def twin_step(side: Side, opt_cfg, lr: float, inputs_BT, targets_BT, regrouped=frozenset()) -> dict:
    """one_step of `side`'s twin: its weights jittered by one unit in the last place and the 8-bit
    moments of `regrouped` (the sources of the grown model's copies) requantized in shifted
    blocks. Its distance from the side's own step is the resolution of the one-step comparison on
    this model, state and probe, measured: fp32 rounding carried through the reversible backward,
    Adam's near-sign steps of elements whose gradient sits at the rounding floor, top-k near ties,
    8-bit regrouping. A grown model by an exact operator differs from the ungrown one by the same
    kinds of rounding."""
    named = dict(side.model.named_parameters())
    with jittered(side.model):
        return one_step(Side(side.model, Reblocked(side.state, named, opt_cfg, regrouped), side.held), opt_cfg, lr, inputs_BT, targets_BT)


# A zero factor can sit behind several others (deepen's NF4 block: down's B, then gate's B, then
# gate's A receive gradient one step after another), so the trainability pass steps up to this often.
TRAINABILITY_STEPS = 3


def _scratch_step(named: dict, state: dict, opt_cfg, lr: float, saved: dict) -> float:
    """One clipped step of every parameter from `state` (left as it is), with the gradients in
    .grad; returns the clip norm. A trainability pass steps again from the same state at the moved weights rather than
    from the state its earlier steps would leave, so it holds one tensor's state copy at a time
    (step_each), not a copy of the whole state. On expert shards `state` is this rank's share
    (its experts, the dense entries it owns): the norm is summed over the ranks, and each dense
    parameter steps where its state is."""
    mine = {n: p for n, p in named.items() if n in state}
    holders = sharding.dense_holders(state, mine)
    # The clip norm reads each entry's norm multiplier only: one entry at a time, never a copy of
    # the whole state (8-bit state dequantizes on access).
    norm = sharding.clip_grad_norm(list(mine.values()), opt_cfg.grad_clip, [state[n].norm_mult for n in mine])
    step_each(named, state, opt_cfg, lr, saved, holders)
    return norm


# ---------------------------------------------------------------- the checks


def update_mismatch(name: str, du: torch.Tensor, old_updates: dict, provenance, held: dict) -> float | None:
    """How far a grown parameter's update `du` is from its source's update mapped by the provenance
    (a β-scaled copy moves β times its source's move), relative, over the elements not held; None
    where it has no such source. A copy's transform is a collective on expert shards (split and
    clone move children to their owners): every rank calls this for the same names, in order."""
    prov = provenance.get(name)
    if prov is None or prov.kind not in ("carried", "copy") or prov.source not in old_updates or held.get(name, 0) is None:
        return None
    ref = old_updates[prov.source]
    if prov.kind == "copy":
        beta = prov.beta.to(ref.device) if isinstance(prov.beta, torch.Tensor) else prov.beta
        ref = prov.transform(ref) * beta
    keep = ~held[name] if name in held else torch.ones(du.shape, dtype=torch.bool, device=du.device)
    if not bool(keep.any()) or ref.shape != du.shape:
        return None
    return ((du - ref)[keep].double().norm() / ref[keep].double().norm().clamp_min(1e-30)).item()


def locate(old: Side, new: Side, opt_cfg, lr: float, probe, provenance) -> tuple[str, float] | None:
    """Where a failed step comparison went wrong: both steps taken again, the old side's updates
    kept and the new side's compared with them one tensor at a time as it steps (update_mismatch);
    the grown parameter furthest off its source's mapped update, over every rank's parameters (rank
    order breaks ties). Only on failure: a passing check holds no copy of either side's updates."""
    old_updates: dict[str, torch.Tensor] = {}
    worst = None

    def compare(name: str, du: torch.Tensor) -> None:
        nonlocal worst
        r = update_mismatch(name, du, old_updates, provenance, new.held)
        if r is not None and (worst is None or r > worst[1]):
            worst = (name, r)

    one_step(old, opt_cfg, lr, *probe, on_update=old_updates.__setitem__)
    one_step(new, opt_cfg, lr, *probe, on_update=compare)
    candidates = [w for w in sharding.gather_objects(worst) if w is not None]
    return max(candidates, key=lambda w: w[1]) if candidates else None


def dynamics_check(old: Side, new: Side, opt_cfg, lr: float, probe, exact: bool, cfg, subset: list[str], provenance=None, regrouped=frozenset()) -> tuple[dict, list[str]]:
    """Compare one step from `old` and from `new`: (metrics, problems). regrouped: the old
    parameters whose state growth copied into other shapes (twin_step)."""
    inputs_BT, targets_BT = probe
    t0 = time.perf_counter()
    a = one_step(old, opt_cfg, lr, inputs_BT, targets_BT)
    # Exact operators are judged against the resolution measured on the ungrown side's twin.
    t = twin_step(old, opt_cfg, lr, inputs_BT, targets_BT, regrouped) if exact else None
    b = one_step(new, opt_cfg, lr, inputs_BT, targets_BT)
    # Every figure over every rank's share of the probe (sharding.probe_share).
    twin_sq = float((t["delta_BTV"] - a["delta_BTV"]).pow(2).sum()) if t is not None else 0.0
    diff_sq, step_sq, logits_sq, twin_sq = sharding.sum_ranks(
        float((b["delta_BTV"] - a["delta_BTV"]).pow(2).sum()), float(a["delta_BTV"].pow(2).sum()), a["logits_sq"], twin_sq
    )
    rel = diff_sq**0.5 / max(step_sq**0.5, 1e-30)
    step_norm = step_sq**0.5
    metrics = {
        "rel_l2": rel,
        "max_abs_diff": sharding.max_abs(b["delta_BTV"] - a["delta_BTV"]),
        "step_norm": step_norm,  # the size of the ungrown model's step on the probe logits
        # fp32 rounding of the logits relative to that step: the finest difference the comparison resolves.
        "resolution": torch.finfo(torch.float32).eps * logits_sq**0.5 / max(step_norm, 1e-30),
        "lr": lr,
        "clip_norm_before": a["norm"],
        "clip_norm_after": b["norm"],
        # The ungrown side's twin (twin_step): how far an equivalent computation's step and clip
        # norm sit from the ungrown side's own, relative; None for approximate operators.
        "twin_rel_l2": twin_sq**0.5 / max(step_norm, 1e-30) if t is not None else None,
        "twin_clip_norm_rel": abs(t["norm"] - a["norm"]) / max(abs(a["norm"]), 1e-30) if t is not None else None,
        "held": sorted(n for n in new.held),
        "subset": subset,
        "exact": exact,
        "bar": cfg.dynamics_exact_tol if exact else cfg.dynamics_max_rel,
    }
    problems = []
    if exact:
        # The difference of two fp32 forwards cannot resolve less than their rounding; at a warmup's
        # small first LR that floor nears the bar (the tiny recipe's upcycle: 8.9e-5 at LR 1e-4 with
        # a resolution of 8.2e-5, against ~2e-7 at the micro recipe's 3e-3). Measured unbroken
        # operators sit at 1-2x the resolution (tiny and micro recipes): RESOLUTION_MULT leaves room.
        # Rounding that the step amplifies (Adam's near-sign steps of gradients at the rounding
        # floor, 8-bit moments regrouped) shows in the twin: NOISE_MULT times its distance.
        metrics["bar"] = cfg.dynamics_exact_tol + RESOLUTION_MULT * metrics["resolution"] + NOISE_MULT * metrics["twin_rel_l2"]
    limit = metrics["bar"]
    norm_rel = abs(b["norm"] - a["norm"]) / max(abs(a["norm"]), 1e-30)
    metrics["clip_norm_rel"] = norm_rel
    if exact:
        # Clipping scales the whole step by 1/norm: a norm off by less than what the twin measures
        # for the step is within the step's own noise. The twin's norm alone measured up to 15x
        # below the splits' on the tiny recipe (seeds 0-9: 6e-7 against up to 9.6e-6), whose step
        # distances it does bound (1e-5 to 2e-5).
        metrics["clip_norm_bar"] = CLIP_NORM_RTOL + NOISE_MULT * max(metrics["twin_clip_norm_rel"], metrics["twin_rel_l2"])
    if exact and opt_cfg.grad_clip > 0 and not (norm_rel <= metrics["clip_norm_bar"]):
        # A mapped state weighs each copy's squared gradient by S·β (growtrain/optim/adamw.py): the grown model's
        # clip norm is the ungrown one's, or clipping scales the two steps differently.
        problems.append(
            f"dynamics: the clip norm of the grown model's gradient is {b['norm']:.6g}, the ungrown model's {a['norm']:.6g} "
            f"(relative {norm_rel:.3g} > {metrics['clip_norm_bar']:.3g} for an exact operator: {CLIP_NORM_RTOL:g} + {NOISE_MULT:g}x the "
            f"ungrown model's twin, its norm {metrics['twin_clip_norm_rel']:.2g} or step {metrics['twin_rel_l2']:.2g} off): the clip-norm "
            "weights (norm_mult) are wrong"
        )
    if not (rel <= limit):
        worst = locate(old, new, opt_cfg, lr, probe, provenance) if provenance is not None else None
        if worst is not None:
            metrics["worst_parameter"], metrics["worst_parameter_rel"] = worst
        where = ""
        if worst is not None:
            block = re.match(r"^blocks\.(\d+)\.", worst[0])
            where = f"; parameter {worst[0]}" + (f" (block {block.group(1)})" if block else "") + f" moved {worst[1]:.3g} (relative) off its source's mapped update"
        what = (
            f"exact operator (dynamics_exact_tol + {RESOLUTION_MULT:g}x the logits' fp32 resolution {metrics['resolution']:.2g} + "
            f"{NOISE_MULT:g}x the ungrown model's twin at {metrics['twin_rel_l2']:.2g})"
            if exact
            else "approximate operator (dynamics_max_rel)"
        )
        problems.append(
            f"dynamics: one optimizer step (lr {lr:.3g}, clip norm {a['norm']:.4g} before vs {b['norm']:.4g} after growth) moved the "
            f"probe logits by relative L2 {rel:.3g} off the ungrown model's step, > {limit:g} for an {what}{where}"
        )
    metrics["seconds"] = time.perf_counter() - t0
    return metrics, problems


def trainability_check(model, state, masks: dict[str, torch.Tensor], opt_cfg, lr: float, probe, fresh_lr_mult: float = 1.0) -> tuple[dict, list[str]]:
    """Dead new elements per parameter: zero gradient on the probe now and after each of
    TRAINABILITY_STEPS steps of the others (each from the carried state, see _scratch_step). Holds
    the gradients once, and the weights once more while it steps."""
    inputs_BT, targets_BT = probe
    t0 = time.perf_counter()
    if not masks:
        return {"per_parameter": {}, "dead": 0, "unreached_experts": {}, "seconds": 0.0}, []
    was_training = model.training
    model.train()
    try:
        params = dict(model.named_parameters())
        alive = {n: torch.zeros(params[n].shape, dtype=torch.bool, device=params[n].device) for n in masks}

        def see_gradients() -> dict:
            loads = _backward(model, inputs_BT, targets_BT)
            for n, a in alive.items():
                if params[n].grad is not None:
                    a.logical_or_(params[n].grad != 0)
            return loads

        loads = see_gradients()
        first = fresh_first_steps(params, state, masks, opt_cfg, lr, fresh_lr_mult)
        idle = {b: load == 0 for b, load in loads.items()}  # [E] over all experts (every rank's, on shards)
        stepped = 0
        # The later steps are collectives on expert shards: one verdict for every rank.
        if not sharding.all_ranks(all(bool(alive[n][m].all()) for n, m in masks.items())):
            with _scratch_steps(model) as (named, saved):  # the weights restored after
                for _ in range(TRAINABILITY_STEPS):
                    _scratch_step(named, state, opt_cfg, lr, saved)
                    loads = see_gradients()
                    idle = {b: idle[b] | (loads[b] == 0) for b in idle}
            stepped = TRAINABILITY_STEPS
    finally:
        model.zero_grad(set_to_none=True)
        model.train(was_training)
    report, unreached = {}, {}
    for name, mask in masks.items():
        mask = mask.clone()
        m = _EXPERT.match(name)
        if m is not None and int(m.group(1)) in idle:
            # An expert some pass sent no probe token to cannot be judged (its partner may have had
            # no gradient to step with): counted, not failed.
            idle_E = idle[int(m.group(1))]
            lo, hi = sharding.local_range(idle_E.numel())
            idle_E = idle_E[lo:hi]  # the experts held here
            if bool(idle_E.any()):
                unreached[name] = int(idle_E.sum())
                mask[idle_E.to(mask.device)] = False
        if not bool(mask.any()):
            continue
        alive_n = alive[name]
        dead = mask & ~alive_n
        n_dead = int(dead.sum())
        rows = dead.flatten(0, 1) if dead.ndim >= 3 else dead
        dead_rows = int((rows.reshape(rows.shape[0], -1).any(1) if rows.ndim > 1 else rows).sum())
        report[name] = {"new": int(mask.sum()), "dead": n_dead, "dead_rows": dead_rows}
    report, unreached = _over_ranks(report, unreached)
    problems = []
    for name, r in report.items():
        if r["dead"]:
            block = re.match(r"^blocks\.(\d+)\.", name)
            problems.append(
                f"trainability: {r['dead']} of {r['new']} new element(s) of {name}"
                + (f" (block {block.group(1)})" if block else "")
                + f" ({r['dead_rows']} row(s)) get no gradient on the probe, neither now nor after {stepped} step(s) of the others: they cannot train"
            )
    first_report, first_problems = _first_steps_over_ranks(first, lr * fresh_lr_mult)
    metrics = {"per_parameter": report, "dead": sum(r["dead"] for r in report.values()), "unreached_experts": unreached, "steps": stepped}
    metrics["fresh_first_step"] = first_report
    metrics["seconds"] = time.perf_counter() - t0
    return metrics, problems + first_problems


# How far (in units of the LR) an element's first step from fresh state may be from Adam's
# g / (|g| + eps), past its weight's own fp32 rounding: a wrong step count moves it by a factor
# (~0.45 under a copied count at beta2 0.95, ~3.2 at 0.999), a kept moment or multiplier likewise.
FRESH_STEP_TOL = 1e-2


def fresh_first_steps(params: dict, state: dict, masks: dict[str, torch.Tensor], opt_cfg, lr: float, lr_mult: float = 1.0) -> dict[str, tuple[int, float]]:
    """The first update of every element growth introduced fresh (`masks`), taken by the run's
    optimizer from the grown state on the gradients in .grad, against what fresh state gives: step
    1 of Adam makes m̂ = g and v̂ = g², so the element moves by lr · lr_mult · g / (|g| + eps)
    besides its weight decay, whatever its gradient's scale (clipping included); lr_mult is the
    multiplier fresh elements get (the recipe's `fresh.lr_mult`). name -> (elements judged, worst
    deviation in units of that LR less the weight's rounding). Elements with no gradient
    are not judged; one tensor's state copy and weights at a time. On expert shards each rank judges
    the entries it holds state for."""
    out = {}
    for name, mask in masks.items():
        p = params[name]
        if p.grad is None or name not in state:
            continue
        judged = mask & (p.grad.abs() > 10 * opt_cfg.eps)
        if not bool(judged.any()):
            continue
        s = copy.deepcopy(state[name])
        decay = lr * lr_mult * opt_cfg.weight_decay * (s.wd_mult.to(p.device) if isinstance(s.wd_mult, torch.Tensor) else s.wd_mult)
        before = p.detach().clone()
        try:
            _optimizer({name: p}, {name: s}, opt_cfg).step(lr)
            off = (before * (1 - decay) - p.detach()).float().div_(lr * lr_mult)  # the step's Adam part, in the fresh LRs
        finally:
            with torch.no_grad():
                p.copy_(before)
        del s
        g = p.grad.float()
        adam = g.abs().add_(opt_cfg.eps)
        off.sub_(torch.div(g, adam, out=adam)).abs_()
        del adam
        ulp = torch.nextafter(before, _scalar(float("inf"), before)).sub_(before).abs_().float()
        off.sub_(ulp.mul_(4 / (lr * lr_mult))).clamp_min_(0)  # less 4 ulps of the weight
        out[name] = (int(judged.sum()), float(off[judged].max()))
    return out


def _first_steps_over_ranks(first: dict, lr: float) -> tuple[dict, list[str]]:
    """lr: the fresh elements' LR (the step's LR × the fresh LR multiplier)."""
    merged: dict[str, tuple[int, float]] = {}
    for part in sharding.gather_objects(first):
        for name, (n, worst) in part.items():
            m = merged.get(name, (0, 0.0))
            merged[name] = (m[0] + n, max(m[1], worst))
    problems = [
        f"fresh state: the first step of {n} element(s) growth introduced fresh in {name} is off Adam's first step "
        f"lr · g/(|g| + eps) by up to {worst:.3g} x lr (> {FRESH_STEP_TOL:g}, lr {lr:.3g} with fresh.lr_mult): their optimizer state is not fresh "
        "(a copied step count, kept moments or multipliers)"
        for name, (n, worst) in sorted(merged.items())
        if worst > FRESH_STEP_TOL
    ]
    return {name: {"elements": n, "max_dev_lr": worst} for name, (n, worst) in merged.items()}, problems


def _over_ranks(report: dict, unreached: dict) -> tuple[dict, dict]:
    """The trainability counts of every rank merged (expert shards: an expert tensor's counts
    summed over the ranks that hold its experts; a replicated parameter's are the same everywhere)."""
    every = sharding.gather_objects((report, unreached))
    if len(every) == 1:
        return report, unreached
    from growtrain.model.expert_shards import is_expert_tensor

    merged, idle = {}, {}
    for rep, unr in every:
        for name, r in rep.items():
            if name not in merged:
                merged[name] = dict(r)
            elif is_expert_tensor(name):
                merged[name] = {k: merged[name][k] + v for k, v in r.items()}
        for name, n in unr.items():
            idle[name] = idle.get(name, 0) + n if is_expert_tensor(name) else n
    return merged, idle
