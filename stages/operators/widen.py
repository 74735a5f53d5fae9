"""widen_hidden: d_model → k·d_model by duplicating every stream coordinate (DESIGN.md §7).

The grown streams are k side-by-side copies of the old ones. Every weight is the old one tiled
along each widened dimension; a weight that reads a duplicated input along its last dimension
(attention q/k/v/out, FFN and expert gate/up, router, LM head) is also divided by k, so that the k
copies of an input sum back to the old pre-activation. Heads are duplicated with head_dim fixed
(query head c·H + h is old head h, and reads kv head c·K + h // (H/K), its old kv head's copy);
norms' weights are tiled, and the RMS of a tiled vector equals the old RMS, so every norm, head,
neuron and router logit computes what it did: exact.

Null-space noise (optional): the k copies of an input-side weight get noise that sums to zero over
the copies, so it cancels on the duplicated inputs (still exact) but makes the copies' gradients
differ after the first step (symmetry breaking; then the dynamics are no longer the old model's).

Optimizer state: every element is β·p of one old p, with β = 1/k on input-side weights (1
elsewhere) and S = β·(number of copies): tiled output rows S = k, input-side halves S = 1, q/k/v/o
(tiled both ways, /k) S = k.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from growtrain.model.expert_shards import is_expert_tensor
from growtrain.model.config import ModelConfig
from growtrain.model.expert_parallel import shard_experts
from growtrain.model.nf4 import MATRICES, dequantize_stack, nf4_requantized, stack_state, state_stack
from growtrain.stages import sharding
from growtrain.stages.common import materialize, requantized_note
from growtrain.stages.registry import Growth, GrowthPlanError, Operator, Provenance, register

_LOOKUPS = ("embed.weight",)  # last dim is d_model, but rows are looked up, not read from the stream


@dataclass(frozen=True)
class WidenHiddenArgs:
    factor: int = field(default=2, metadata={"doc": "k: d_model and the number of (query and kv) heads grow k-fold; head_dim stays.", "ge": 2})
    noise: float = field(
        default=0.0,
        metadata={
            "doc": "Std of the null-space noise on input-side weights, relative to each weight's RMS; it cancels on the "
            "duplicated stream (still exact) and breaks the copies' symmetry. 0: pure duplication (exact dynamics too).",
            "ge": 0.0,
        },
    )


def plan(cfg: ModelConfig, args: WidenHiddenArgs) -> ModelConfig:
    k = args.factor
    return cfg.with_changes(
        d_model=cfg.d_model * k,
        n_heads=cfg.n_heads * k,
        n_kv_heads=cfg.n_kv_heads * k,  # 0 (= n_heads) stays 0
        head_dim=cfg.head_dim,  # 0 (= d_model // n_heads) stays 0: the ratio is unchanged
    )


def apply(model, args: WidenHiddenArgs) -> Growth:
    old_cfg, k = model.config, args.factor
    new_cfg = plan(old_cfg, args)
    params = {n for n, _ in model.named_parameters()}
    new, provenance = {}, {}
    with torch.device("meta"):
        grown_model = type(model)(new_cfg)
    ep = sharding.current()
    if ep is not None:  # on expert shards: this rank's experts of every expert tensor
        shard_experts(grown_model, ep)
    shapes = {n: t.shape for n, t in grown_model.state_dict().items()}
    old_state = model.state_dict()
    nf4 = old_cfg.moe is not None and old_cfg.moe.expert_format == "nf4"
    nf4_prefixes = tuple(f"blocks.{i}.g.ffn.experts." for i in old_cfg.moe_layers) if nf4 else ()
    notes = [note for prefix in nf4_prefixes for note in _widen_nf4_bases(old_state, prefix, old_cfg, k, new)]
    for name, w in old_state.items():
        if name.startswith(nf4_prefixes) and not name.endswith(("_lora_A", "_lora_B")):
            continue  # an NF4 base: above. Its adapters are tiled below like any weight (gate/up A reads the stream).
        reps = [n // o if o else 1 for n, o in zip(shapes[name], w.shape)]  # o = 0: no expert here (an AF attention rank)
        if [o * r for o, r in zip(w.shape, reps)] != list(shapes[name]):
            raise GrowthPlanError(f"widen_hidden: cannot tile {name} {tuple(w.shape)} into {tuple(shapes[name])}")
        input_side = w.ndim >= 2 and reps[-1] == k and name not in _LOOKUPS
        beta = 1.0 / k if input_side else 1.0
        tile = lambda t, reps=tuple(reps): t.repeat(reps)  # noqa: E731
        grown = tile(w) * beta if beta != 1.0 else tile(w)
        noisy, bound = None, 0.0
        if input_side and args.noise > 0:
            # An expert tensor's RMS and largest value are over all its experts (every rank's, on shards).
            expert = is_expert_tensor(name)
            sq, count = float(grown.double().pow(2).sum()), float(grown.numel())
            if expert:
                sq, count = sharding.sum_ranks(sq, count)
            std = args.noise * math.sqrt(sq / count)
            # Zero-mean over k copies of N(0, std²) draws: beyond 12 std only with probability ~1e-32.
            grown = grown + _null_space_noise(grown, k, std, torch.arange(*sharding.local_range(new_cfg.moe.num_experts)) if expert else None)
            largest = float(grown.abs().max()) if grown.numel() else 0.0
            largest = sharding.max_ranks(largest)[0] if expert else largest
            noisy, bound = True, 12.0 * std + 1e-6 * largest  # + the sum's fp32 rounding
        new[name] = grown
        if name in params:
            copies = math.prod(reps)
            provenance[name] = Provenance("copy", name, tile, copies=copies * beta, beta=beta, perturbed=noisy, perturb_bound=bound)
    return Growth(materialize(new_cfg, new), provenance, stream_view=lambda x, k=k: x.unflatten(-1, (k, -1)).mean(-2), notes=notes)


def _widen_nf4_bases(old: dict, prefix: str, cfg: ModelConfig, k: int, new: dict) -> list[str]:
    """One MoE layer's NF4 bases at k·d_model (this rank's experts): each matrix, stored [F, D] per
    expert, dequantized, tiled along D (gate/up read the stream: also divided by k; down writes
    it) and requantized. Without double quantization, with d_model a multiple of 64 and k a power
    of two, each new block holds the elements of one old block (halved for gate/up: the absmax
    halves exactly, NF4's code book holding ±1), so the codes come back as they were: exact,
    measured. Otherwise what the requantization moved is measured and returned as a note (the
    transition judges the operator as approximate). The null-space noise goes into the adapters
    (gate/up A, tiled with the stream), never into the frozen bases."""
    local = {n[len(prefix) :]: v for n, v in old.items() if n.startswith(prefix)}
    notes = []
    for name in ("quant_map", "nested_quant_map"):
        if name in local:
            new[prefix + name] = local[name]
    for m in MATRICES:
        stack = state_stack(m, local, cfg.moe.expert_hidden, cfg.d_model)
        like = local[f"{m}_lora_A"]
        target = dequantize_stack(stack).to(like.device).repeat(1, 1, k)
        if m != "w_down":
            target = target / k
        grown, moved = nf4_requantized(stack, target)
        notes += requantized_note("widen_hidden", prefix + m, moved, f"at d_model {k * cfg.d_model}",
                                  "without double quantization, d_model a multiple of 64 and factor a power of two")
        new.update({prefix + n: v for n, v in stack_state(m, grown).items() if n not in ("quant_map", "nested_quant_map")})
    return notes


def _null_space_noise(w: torch.Tensor, k: int, std: float, experts_E: torch.Tensor | None = None) -> torch.Tensor:
    """Noise over the k copies of the last dimension that sums to zero across the copies (drawn on
    the CPU, as fresh_tensors does: the same draws whatever the device). An expert tensor's
    (`experts_E`: the global indices of its rows) draws each expert's noise from a generator of
    its own, so the same whichever rank holds it (stages/sharding.py)."""
    if experts_E is None:
        noise = torch.randn(w.shape, dtype=w.dtype)
    else:
        noise = sharding.expert_normal(tuple(w.shape[1:]), experts_E, sharding.draw_key()).to(w.dtype)
    noise = noise.unflatten(-1, (k, -1)) * std
    return (noise - noise.mean(-2, keepdim=True)).flatten(-2).to(w.device)


register(
    Operator(
        "widen_hidden",
        True,
        "d_model → k·d_model: stream coordinates duplicated, input-side weights [W/k, …] (± null-space noise), heads "
        "duplicated with head_dim fixed; optimizer moments m/S, v/S², LR ×β. NF4 experts: bases tiled and requantized "
        "(the same codes without double quantization at d_model a multiple of 64; else measured and judged as approximate).",
        WidenHiddenArgs,
        plan,
        apply,
        shards=True,  # expert tensors widen along d_model, expert by expert
    )
)
