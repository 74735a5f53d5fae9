"""Bytes per stored parameter for weights, gradients and optimizer state (DESIGN.md §1, §6), for
(a) full AdamW, (b) NF4 experts + LoRA r=16 with AdamW on the adapters and the dense parts, and
(c) as (b) with 8-bit AdamW moments on the dense parts.

    python benchmarks/optimizer_memory.py              # table
    python benchmarks/optimizer_memory.py --json       # one JSON line

The models are growtrain's own GrowLM and optimizers, built on the meta device (exact shapes, no
memory), and every number is counted from the tensors they hold: parameters and buffers for
weights (NF4 codes, absmax, nested absmax, offsets and code books included), trainable parameters
for gradients (fp32, like the parameters), and every tensor in the optimizer's state_dict.

Shape: the last stage of the 120B recipe (recipes/120b.yaml, planned by its growth operators):
d_model 4096, 32 query heads of 128 with 4 key/value heads, 36 blocks each an MoE layer of 256
experts (top-8) of width 1024, a 131,072 vocabulary, LoRA r = 16 on the experts: 118.4B stored
parameters and 2.26B adapter parameters (LightningLM, arXiv 2606.07404, reports 2.26B for 118.7B).
Scaled down by default by --scale 4 in depth and vocabulary (9 blocks, 32,768 tokens), which keeps
every ratio (experts : attention : routers : embeddings : adapters) and so every byte-per-parameter
figure; --scale 1 builds the full shape (still on the meta device).

"Per stored parameter" divides by the parameter count of the full-precision model (the base the
NF4 model stores, adapters not included), the same denominator for all three rows. "Expert
weight" is the routed experts' matrices alone (the NF4 bases in (b) and (c), adapters excluded).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

import torch

from growtrain.model import GrowLM, ModelConfig
from growtrain.optim.registry import build_optimizer
from growtrain.optim.adamw8bit import state_bytes
from growtrain.recipe import OptimizerConfig, load_recipe

REPO = Path(__file__).resolve().parents[1]
TARGETS = {  # the targets at the 120B proportions
    "expert_weight_bytes_per_param": 0.55,
    "nf4_lora.optimizer_bytes_per_param": 0.35,
    "nf4_lora_adam8bit.optimizer_bytes_per_param": 0.25,
}


def recipe_shape(path: Path, scale: int) -> ModelConfig:
    """The recipe's last-stage model (NF4 experts + LoRA), depth and vocabulary divided by `scale`."""
    from growtrain.stages import plan_stage_models

    recipe = load_recipe(path)
    cfg = plan_stage_models(recipe.model, [s.grow for s in recipe.stages])[-1]
    if cfg.moe is None or cfg.moe.expert_format != "nf4":
        raise SystemExit(f"{path}: the last stage has no NF4 experts")
    if cfg.n_layers % scale or cfg.vocab_size % scale:
        raise SystemExit(f"--scale {scale} must divide n_layers {cfg.n_layers} and vocab_size {cfg.vocab_size}")
    layers = tuple(i // scale for i in cfg.moe_layers if i % scale == 0)
    return cfg.with_changes(n_layers=cfg.n_layers // scale, vocab_size=cfg.vocab_size // scale, moe_layers=layers)


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def measure(cfg: ModelConfig, state_bits: int, stored_params: int) -> dict:
    with torch.device("meta"):
        model = GrowLM(cfg)
        opt = build_optimizer(dict(model.named_parameters()), OptimizerConfig(dense_state_bits=state_bits))
    trainable = [p for p in model.parameters() if p.requires_grad]
    expert_tensors = [t for n, t in list(model.named_parameters()) + list(model.named_buffers()) if ".ffn.experts." in n and "_lora_" not in n]
    expert_weights = sum(cfg.moe.num_experts * 3 * cfg.d_model * cfg.moe.expert_hidden for _ in cfg.moe_layers)
    weight_bytes = _bytes(list(model.parameters()) + list(model.buffers()))
    grad_bytes = _bytes(trainable)
    opt_bytes = state_bytes(opt)
    adapters = sum(p.numel() for n, p in model.named_parameters() if "_lora_" in n)
    return {
        "weight_bytes_per_param": weight_bytes / stored_params,
        "grad_bytes_per_param": grad_bytes / stored_params,
        "optimizer_bytes_per_param": opt_bytes / stored_params,
        "total_bytes_per_param": (weight_bytes + grad_bytes + opt_bytes) / stored_params,
        "expert_weight_bytes_per_param": _bytes(expert_tensors) / expert_weights,
        "stored_params": stored_params,
        "trainable_params": sum(p.numel() for p in trainable),
        "adapter_params": adapters,
        "weight_bytes": weight_bytes,
        "grad_bytes": grad_bytes,
        "optimizer_bytes": opt_bytes,
    }


def run(args) -> dict:
    nf4 = recipe_shape(args.recipe, args.scale)
    if args.rank:
        nf4 = nf4.with_changes(moe=replace(nf4.moe, lora=replace(nf4.moe.lora, r=args.rank, lora_alpha=float(args.rank))))
    full = nf4.with_changes(moe=replace(nf4.moe, expert_format="full"))
    with torch.device("meta"):
        stored = GrowLM(full).num_parameters()
    return {
        "full_adamw": measure(full, 32, stored),
        "nf4_lora": measure(nf4, 32, stored),
        "nf4_lora_adam8bit": measure(nf4, 8, stored),
    }


def check_targets(results: dict) -> list[str]:
    misses = []
    for key, limit in TARGETS.items():
        rows = [k for k in results if k != "full_adamw"] if "." not in key else [key.split(".")[0]]
        field = key.split(".")[-1]
        for row in rows:
            if results[row][field] > limit:
                misses.append(f"{row}.{field} = {results[row][field]:.4f} > {limit}")
    return misses


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true", help="print one JSON line")
    p.add_argument("--recipe", type=Path, default=REPO / "recipes" / "120b.yaml", help="recipe whose last stage gives the shape")
    p.add_argument("--scale", type=int, default=4, help="divide depth and vocabulary by this (1: the full shape)")
    p.add_argument("--rank", type=int, default=0, help="LoRA rank of the experts (0: the recipe's; alpha = rank otherwise)")
    args = p.parse_args(argv)
    results = run(args)
    if args.json:
        print(json.dumps(results))
        return 0
    a, cfg = results["full_adamw"], recipe_shape(args.recipe, args.scale)
    print(
        f"shape: {args.recipe.name} last stage / {args.scale}: {cfg.n_layers} blocks, d_model {cfg.d_model}, {cfg.moe.num_experts} experts "
        f"(top-{cfg.moe.top_k}) of width {cfg.moe.expert_hidden}, vocab {cfg.vocab_size}: {a['stored_params']:,} stored parameters; "
        f"LoRA r={args.rank or cfg.moe.lora.r}: {results['nf4_lora']['adapter_params']:,} adapter parameters"
    )
    print(f"{'bytes per stored parameter':<22} {'weights':>8} {'grads':>8} {'optimizer':>10} {'total':>8} {'experts':>8}")
    for name, r in results.items():
        print(
            f"{name:<22} {r['weight_bytes_per_param']:>8.4f} {r['grad_bytes_per_param']:>8.4f} {r['optimizer_bytes_per_param']:>10.4f} "
            f"{r['total_bytes_per_param']:>8.4f} {r['expert_weight_bytes_per_param']:>8.4f}"
        )
    misses = check_targets(results)
    print("targets (experts <= 0.55, optimizer <= 0.35 for nf4_lora and <= 0.25 with 8-bit dense state): " + ("met" if not misses else "MISSED: " + "; ".join(misses)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
