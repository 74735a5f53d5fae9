"""How far sibling experts have moved apart (DESIGN.md §16, clones). Experts that growth made from
one parent (upcycle_moe's copies of the dense FFN, split_experts' and clone_experts' children)
start tied; if they stay so, 256 experts behave as 32. This is measured, not assumed, at the end
of every stage, per MoE layer, over every pair of siblings:

- router_cos_mean / router_cos_max: cosine of the siblings' router rows (a split's children share
  their parent's row, cosine 1, until training moves them apart);
- weight_cos_mean / weight_cos_max: cosine of the siblings' whole expert weights (gate, up and
  down; NF4 experts: the dequantized base plus the LoRA update). A clone or an upcycled copy
  starts at 1; a split's children hold different neurons of their parent, so theirs is near 0
  from the start and only the router's numbers say whether they still act as one;
- tied_pairs: pairs whose router rows and selection biases are bitwise equal: such siblings get
  the same score for every token, so they are selected together or not at all (identical for
  routing whatever their weights);
- topk_two_siblings: the fraction of the stage's last micro-batch's tokens (this process's rows)
  whose top-k holds two siblings (1.0 right after a split, which selects every child of a chosen
  parent; left out where all experts share one parent, as upcycled copies do).

Siblings are the experts of one parent at the layer's last growth of the expert count: children
are laid out round-robin (stages/operators/experts.py: child j of parent e is expert j·P + e), so
expert i's parent is i mod P, P the experts before that stage (1 where the model was dense: every
upcycled expert is a copy of the one FFN). Under expert parallelism or the AF layout a process
holds a slice of the experts, so the weight cosines are left out there (None); the router's
numbers are whole on every process. The weight cosines go sibling group by sibling group, in
float64 chunks of the flattened weights: the pass never holds a float64 copy of a layer's experts
(NF4: one group's dequantized weights at a time).

Legend: E experts, P parents, D d_model, T tokens, K top-k.
"""

from __future__ import annotations

import torch

from growtrain.model.config import ModelConfig


def sibling_parents(before: list[ModelConfig], stage: int) -> int | None:
    """P for stage `stage`'s model: the expert count before the last stage up to it that changed
    the count (1 where that stage made the model's first experts); None if no growth made experts.
    `before[i]` is the model before stage i's growth, `before[i + 1]` after it."""
    for j in range(stage, -1, -1):
        old, new = before[j], before[j + 1]
        n_old = old.moe.num_experts if old.moe is not None and old.moe_layers else 0
        n_new = new.moe.num_experts if new.moe is not None and new.moe_layers else 0
        if n_new != n_old:
            return (n_old or 1) if n_new else None
    return None


def _pairs(E: int, P: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    a, b = torch.triu_indices(E, E, offset=1, device=device)
    same = (a % P) == (b % P)
    return a[same], b[same]


def _cosines(gram_EE: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    norm_E = gram_EE.diagonal().clamp_min(0).sqrt()
    return gram_EE[a, b] / (norm_E[a] * norm_E[b]).clamp_min(torch.finfo(gram_EE.dtype).tiny)


# Elements of one float64 chunk of the flattened experts in the Gram products: the pass holds
# a few such chunks at a time, never a float64 copy of a layer's experts.
CHUNK_ELEMENTS = 1 << 24


def _group_gram(experts, members: range) -> torch.Tensor:
    """Σ over the experts' matrices of W_i · W_j (flattened), float64, for i, j in `members` (a
    range with a step). Full-precision experts are read through a view; NF4 experts are
    dequantized (base plus LoRA update) for these experts only."""
    nf4 = hasattr(experts, "merged")
    device = experts.w_gate_lora_A.device if nf4 else experts.w_gate.device
    G, pick = len(members), slice(members.start, members.stop, members.step)
    gram = torch.zeros(G, G, dtype=torch.float64, device=device)
    for m in ("w_gate", "w_up", "w_down"):
        if nf4:  # [G, rows, cols] in the stored layout, base + scale · B @ A
            from growtrain.model.nf4 import dequantize_stack

            A, B = getattr(experts, f"{m}_lora_A")[pick].float(), getattr(experts, f"{m}_lora_B")[pick].float()
            delta = experts.scale * (B @ A)
            w = dequantize_stack(experts.stack(m), list(members)) + (delta.transpose(1, 2) if m == "w_down" else delta)
        else:
            w = getattr(experts, m).detach()[pick]
        w_GN = w.reshape(G, -1)
        step = max(1, CHUNK_ELEMENTS // G)
        for lo in range(0, w_GN.shape[1], step):
            c_GN = w_GN[:, lo : lo + step].double()
            gram += c_GN @ c_GN.T
    return gram


@torch.no_grad()
def layer_divergence(layer, parents: int, top_k_indices_TK: torch.Tensor | None, with_weights: bool) -> dict | None:
    """One MoE layer's sibling numbers (module doc); None if it has no sibling pairs."""
    E = layer.num_experts
    router_ED = layer.router.weight.detach()
    a, b = _pairs(E, parents, router_ED.device)
    if a.numel() == 0:
        return None
    r_ED = router_ED.double()
    router_cos = _cosines(r_ED @ r_ED.T, a, b)
    bias_E = layer.router.balance_bias
    tied = (router_ED[a] == router_ED[b]).all(-1) & (bias_E[a] == bias_E[b])
    out = {
        "experts": E,
        "parents": parents,
        "pairs": int(a.numel()),
        "router_cos_mean": float(router_cos.mean()),
        "router_cos_max": float(router_cos.max()),
        "tied_pairs": int(tied.sum()),
        "weight_cos_mean": None,
        "weight_cos_max": None,
        "topk_two_siblings": None,
    }
    if with_weights:  # sibling group by sibling group: the pass holds one group's weights at a time
        cos = []
        for parent in range(parents):
            members = range(parent, E, parents)
            if len(members) < 2:
                continue
            ga, gb = torch.triu_indices(len(members), len(members), offset=1)
            gram = _group_gram(layer.experts, members)
            cos.append(_cosines(gram, ga.to(gram.device), gb.to(gram.device)))
        weight_cos = torch.cat(cos)
        out["weight_cos_mean"], out["weight_cos_max"] = float(weight_cos.mean()), float(weight_cos.max())
    if top_k_indices_TK is not None and top_k_indices_TK.numel() and parents > 1:  # of one parent, any two picks are siblings
        parent_TK = (top_k_indices_TK % parents).sort(dim=-1).values
        two = (parent_TK[:, 1:] == parent_TK[:, :-1]).any(-1) if parent_TK.shape[1] > 1 else torch.zeros(parent_TK.shape[0], dtype=torch.bool)
        out["topk_two_siblings"] = float(two.float().mean())
    return out


def sibling_divergence(model, parents: int | None, top_k_indices: list[torch.Tensor] | None = None) -> dict[int, dict]:
    """Every MoE layer's sibling numbers, keyed by its index among the model's MoE layers."""
    if parents is None:
        return {}
    out = {}
    for i, layer in enumerate(model.moe_layers):
        whole = layer.ep is None and layer.af is None  # this process holds every expert
        idx = top_k_indices[i] if top_k_indices is not None and i < len(top_k_indices) else None
        numbers = layer_divergence(layer, parents, idx, whole)
        if numbers is not None:
            out[i] = numbers
    return out


def flat_metrics(divergence: dict[int, dict]) -> dict[str, float]:
    """The numbers as metrics.jsonl / W&B keys (`siblings/layer{i}/{name}`), Nones left out."""
    return {
        f"siblings/layer{i}/{k}": float(v)
        for i, numbers in divergence.items()
        for k, v in numbers.items()
        if v is not None and k not in ("experts", "parents")
    }


def format_line(i: int, n: dict) -> str:
    weights = "" if n["weight_cos_max"] is None else f", weights cos mean {n['weight_cos_mean']:.3f} max {n['weight_cos_max']:.3f}"
    topk = "" if n["topk_two_siblings"] is None else f", {n['topk_two_siblings']:.0%} of tokens pick two siblings"
    return (
        f"MoE layer {i}: {n['experts']} experts from {n['parents']} parent(s), {n['pairs']} sibling pairs: router cos mean "
        f"{n['router_cos_mean']:.3f} max {n['router_cos_max']:.3f}{weights}, tied {n['tied_pairs']}/{n['pairs']}{topk}"
    )


def report_lines(stage_name: str, numbers: dict[int, dict]) -> list[str]:
    """The console lines of a stage end's sibling numbers, with a warning per layer whose siblings
    are still tied."""
    lines = []
    for i, n in numbers.items():
        lines.append(f"siblings [{stage_name}]: {format_line(i, n)}")
        if n["tied_pairs"]:
            lines.append(
                f"warning: siblings [{stage_name}]: MoE layer {i} ends the stage with {n['tied_pairs']} of {n['pairs']} sibling "
                "pairs still tied (same router row and bias: they act as one expert); train longer after the growth (a split's "
                "children separate as their router rows train), or clone with router_noise"
            )
    return lines
