"""One GPU runs a recipe's training step as one of its expert-parallel ranks would (issue 47): the
dense parts whole, its share of each MoE layer's experts (NF4 + LoRA where the stage has them), the
stage's sequences per GPU and sequence length, bf16 autocast where the recipe trains in it, the
stage's blocks (reversible or not), the expert backend `auto` picks, and the recipe's optimizer.

    python benchmarks/gpu_step.py                                # every stage of recipes/120b.yaml, on the GPU
    python benchmarks/gpu_step.py --stage experts --stage long   # some stages
    python benchmarks/gpu_step.py --json                         # one JSON line
    python benchmarks/gpu_step.py --cpu                          # toy widths on the CPU (the suite runs this)

The slice. A rank of G holds E/G experts of every MoE layer and receives, with balanced routing,
as many expert rows as its own tokens times top-k. The slice model is the stage's model with
num_experts = ceil(E/G) and the same top_k, so each local expert gets the rows it would get in the
node (N*k/(E/G)), and the all-to-all dispatch and combine are replaced by the local permutation
they feed. Left out: the exchange itself (NVLink time, the a2a column of `plan`), the router's
other (G-1)/G columns (a [N, E] product instead of [N, E/G]: small), the gradient sync and the
ZeRO-1 sharding of the dense optimizer state (this GPU steps all of it: the optimizer part is G
times a rank's), and imbalance between experts. Blocks: as many as the plan says fit in 90% of
this GPU's memory (at least 2, at most the stage's), or --blocks; every figure is per step of
that many blocks.

Per stage it prints tokens/s on this GPU, counted model TFLOP/s (growtrain.planning's
model_flops_per_token of the slice, the MFU numerator the trainer logs) and MFU against the GPU's
bf16 peak (planning's preset for its name), the peak allocated memory against what the plan's
memory model predicts for the slice as one GPU, and the share of step time per part. The parts are
timed on their own at the step's shapes (a forward + backward each, times the blocks that hold
one): attention, router, experts (the expert products: NF4 bases without adapters, less their
dequantization), adapters (the experts with adapters, less without), dequantize (one per
forward + backward: the bases' copy is kept for the input gradient), recompute (the reversible
backward's second forward of every block, without grad: it runs each part's forward, and
dequantizes, once more), and the optimizer. What the parts do
not cover (norms, embedding, head and loss, permutation and combine, launches) is `other`.
Where the step runs bf16 on a GPU without a planner preset, MFU is not computed (said so).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
HEADROOM = 0.9  # the blocks must fit in this fraction of the GPU's memory, by the plan


def slice_config(cfg, gpus: int, blocks: int):
    """The stage's model as one rank of `gpus` runs it: `blocks` of its blocks (its MoE pattern
    kept) and ceil(E/gpus) experts per MoE layer with the same top_k."""
    moe_layers = tuple(i for i in cfg.moe_layers if i < blocks)
    moe = cfg.moe
    if moe is not None and moe_layers:
        local = math.ceil(moe.num_experts / gpus)
        if local < moe.top_k:
            raise SystemExit(f"{gpus} GPUs leave {local} experts per rank, fewer than top_k {moe.top_k}: the slice cannot route")
        moe = replace(moe, num_experts=local)
    return cfg.with_changes(n_layers=blocks, moe_layers=moe_layers, moe=moe if moe_layers else cfg.moe)


def predicted_bytes(cfg, optimizer_cfg, micro_batch: int, seq: int, precision: str) -> int:
    """The plan's memory model (growtrain.planning.memory) for the slice as one GPU: its weights,
    gradients, optimizer state, activations, workspace and reserve."""
    from growtrain.planning.counting import count_model
    from growtrain.planning.memory import memory_per_gpu, stage_activations

    acts = stage_activations(cfg, micro_batch, seq, precision, 1)
    return memory_per_gpu(cfg, count_model(cfg, optimizer_cfg), acts, 1, precision).total_bytes


def blocks_that_fit(cfg, gpus: int, optimizer_cfg, micro_batch: int, seq: int, precision: str, capacity: int) -> int:
    best = 2
    for n in range(2, cfg.n_layers + 1):
        if predicted_bytes(slice_config(cfg, gpus, n), optimizer_cfg, micro_batch, seq, precision) > HEADROOM * capacity:
            break
        best = n
    return min(best, cfg.n_layers)


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def timed(fn, dev: torch.device, reps: int, warmup: int = 1) -> float:
    """Median seconds of `reps` calls after `warmup`."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        sync(dev)
        t0 = time.perf_counter()
        fn()
        sync(dev)
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def _autocast(dev: torch.device, precision: str):
    return torch.autocast(dev.type, dtype=torch.bfloat16, enabled=precision == "bf16")


def _balanced_offsets(rows: int, experts: int, dev: torch.device) -> torch.Tensor:
    counts = torch.full((experts,), rows // experts, dtype=torch.int64)
    counts[: rows % experts] += 1
    return torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)]).to(dev)


def run_stage(recipe, stage_cfg, stage, args, dev: torch.device) -> dict:
    from growtrain.model.lm import GrowLM
    from growtrain.optim.registry import build_optimizer
    from growtrain.planning.roofline import model_flops_per_token
    from growtrain.runtime.device import gpu_peak_tflops
    from growtrain.runtime.passes import forward_loss

    precision = recipe.train.precision if dev.type == "cuda" else "fp32"
    micro = max(stage.batch_size // args.gpus, 1)
    seq = stage.seq_len
    if args.cpu:
        micro, seq = 1, min(seq, 64)
    capacity = torch.cuda.get_device_properties(dev).total_memory if dev.type == "cuda" else 0
    if args.blocks:
        blocks = min(args.blocks, stage_cfg.n_layers)
    elif dev.type == "cuda":
        blocks = blocks_that_fit(stage_cfg, args.gpus, recipe.optimizer, micro, seq, precision, capacity)
    else:
        blocks = 2
    cfg = slice_config(stage_cfg, args.gpus, blocks)
    predicted = predicted_bytes(cfg, recipe.optimizer, micro, seq, precision)
    torch.manual_seed(0)
    with torch.device(dev):
        model = GrowLM(cfg)
    backend = model.set_expert_backend("auto")
    optimizer = build_optimizer(dict(model.named_parameters()), recipe.optimizer)
    tokens = torch.randint(0, cfg.vocab_size, (micro, seq + 1), device=dev)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]

    def step():
        ce, aux, _ = forward_loss(model, inputs, targets, precision)
        (ce + aux).backward()
        optimizer.clip_grad_norm_(recipe.optimizer.grad_clip)
        optimizer.step(1e-5)
        for p in model.parameters():
            p.grad = None

    if dev.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
    step_s = timed(step, dev, args.reps)
    peak = torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else None
    n_tokens = micro * seq
    flops = model_flops_per_token(cfg, seq) * n_tokens
    peak_tflops = gpu_peak_tflops(dev)
    tflops = flops / step_s / 1e12
    parts = time_parts(model, optimizer, cfg, micro, seq, precision, dev, args.reps, recipe)
    share = {k: v / step_s for k, v in parts.items()}
    share["other"] = max(0.0, 1.0 - sum(share.values()))
    moe = cfg.moe if cfg.moe_layers else None
    return {
        "stage": stage.name,
        "blocks": blocks,
        "stage_blocks": stage_cfg.n_layers,
        "moe_layers": len(cfg.moe_layers),
        "local_experts": moe.num_experts if moe else 0,
        "experts": stage_cfg.moe.num_experts if moe else 0,
        "top_k": moe.top_k if moe else 0,
        "expert_format": moe.expert_format if moe else None,
        "d_model": cfg.d_model,
        "micro_batch": micro,
        "seq_len": seq,
        "precision": precision,
        "reversible": cfg.reversible,
        "expert_backend": backend,
        "step_s": step_s,
        "tokens_per_s": n_tokens / step_s,
        "model_tflops": tflops,
        "mfu": tflops / peak_tflops if peak_tflops else None,
        "peak_bytes": peak,
        "predicted_bytes": predicted,
        "peak_vs_plan": peak / predicted if peak else None,
        "parts_s": parts,
        "share": share,
    }


def time_parts(model, optimizer, cfg, micro: int, seq: int, precision: str, dev: torch.device, reps: int, recipe) -> dict:
    """Seconds per step of each part, each timed on its own at the step's shapes (module docstring)."""
    D, N = cfg.d_model, micro * seq
    blocks = list(model.blocks)
    moe_blocks = [b for b in blocks if b.is_moe]
    parts: dict[str, float] = {}

    def fwd_bwd(fn, *xs):
        def run():
            leaves = [x.detach().requires_grad_(True) for x in xs]
            with _autocast(dev, precision):
                out = fn(*leaves)
            out = out[0] if isinstance(out, tuple) else out
            out.float().sum().backward()
        return run

    x_BTD = torch.randn(micro, seq, D, device=dev) * 0.1
    parts["attention"] = timed(fwd_bwd(blocks[0].f, x_BTD), dev, reps) * len(blocks)
    if moe_blocks:
        moe = moe_blocks[0].g.ffn
        parts["router"] = timed(fwd_bwd(moe.router, x_BTD.reshape(N, D)), dev, reps) * len(moe_blocks)
        experts = moe.experts
        k = cfg.moe.top_k
        rows = N * k
        x_sorted = torch.randn(rows, D, device=dev) * 0.1
        offsets = _balanced_offsets(rows, cfg.moe.num_experts, dev)
        with_adapters = timed(fwd_bwd(lambda x: experts(x, offsets, moe.expert_backend), x_sorted), dev, reps)
        if cfg.moe.expert_format == "nf4":
            base = timed(fwd_bwd(lambda x: _nf4_base_only(experts, x, offsets, dev), x_sorted), dev, reps)
            dequantize = timed(lambda: _dequantize_all(experts, dev), dev, reps)
            parts["experts"] = max(base - dequantize, 0.0) * len(moe_blocks)
            parts["dequantize"] = dequantize * len(moe_blocks)
            parts["adapters"] = max(with_adapters - base, 0.0) * len(moe_blocks)
        else:
            parts["experts"] = with_adapters * len(moe_blocks)
    if cfg.reversible:
        x1 = torch.randn(micro, seq, D, device=dev) * 0.1

        def recompute():
            with torch.no_grad(), _autocast(dev, precision):
                a, b = x1, x1
                for blk in blocks:
                    a, b, _ = blk(a, b)

        parts["recompute"] = timed(recompute, dev, reps)
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    parts["optimizer"] = timed(lambda: optimizer.step(1e-5), dev, reps)
    for p in model.parameters():
        p.grad = None
    return parts


def _nf4_base_only(experts, x, offsets, dev):
    """The NF4 experts' forward without their adapters, on the route the backend takes."""
    from growtrain.kernels.backend import nf4_lora_weights, triton_unavailable_reason

    weights, _ = nf4_lora_weights(experts.weights())
    if triton_unavailable_reason(dev) is None:
        from growtrain.kernels.grouped import grouped_swiglu

        return grouped_swiglu(x, offsets, weights, None)
    from growtrain.kernels.reference import grouped_swiglu_lora_reference

    return grouped_swiglu_lora_reference(x, offsets, weights, None)


def _dequantize_all(experts, dev):
    from growtrain.kernels.backend import nf4_lora_weights, triton_unavailable_reason

    weights, _ = nf4_lora_weights(experts.weights())
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    if triton_unavailable_reason(dev) is None:
        from growtrain.kernels.nf4 import dequantize_nf4_experts

        return [dequantize_nf4_experts(w, dtype) for w in weights]
    from growtrain.kernels.reference import dequantize_nf4_reference

    return [dequantize_nf4_reference(w, dtype) for w in weights]


def toy(cfg):
    """--cpu: the stage's structure (blocks, MoE pattern, expert format, LoRA, top_k) at toy widths."""
    moe = cfg.moe
    if moe is not None:
        lora = replace(moe.lora, r=min(moe.lora.r, 4))
        moe = replace(moe, expert_hidden=32, shared_expert_hidden=min(moe.shared_expert_hidden, 32), lora=lora)
    gqa = cfg.kv_heads < cfg.n_heads
    return cfg.with_changes(d_model=64, n_heads=4, n_kv_heads=2 if gqa else 0, head_dim=0, ffn_hidden=128, vocab_size=256, moe=moe)


def table(res: dict) -> str:
    lines = [f"device {res['device']}  torch {res['torch']}  recipe {res['recipe']}  one rank of {res['gpus']}", ""]
    head = f"{'stage':8s} {'blocks':>9s} {'experts':>9s} {'mb x seq':>10s} {'tok/s':>10s} {'TFLOP/s':>8s} {'MFU':>6s} {'peak GB':>8s} {'plan GB':>8s} {'peak/plan':>9s}"
    lines.append(head)
    for r in res["stages"]:
        if "error" in r:
            lines.append(f"{r['stage']:8s} {r['error']}")
            continue
        gb = (lambda b: f"{b / 1e9:8.2f}" if b else f"{'-':>8s}")
        mfu = f"{r['mfu']:.1%}" if r["mfu"] else "-"
        ratio = f"{r['peak_vs_plan']:.2f}" if r["peak_vs_plan"] else "-"
        lines.append(
            f"{r['stage']:8s} {r['blocks']:>4d} of {r['stage_blocks']:<2d} {r['local_experts']:>4d}/{r['experts']:<4d} {r['micro_batch']:>3d} x {r['seq_len']:<5d}"
            f" {r['tokens_per_s']:10,.0f} {r['model_tflops']:8.1f} {mfu:>6s} {gb(r['peak_bytes'])} {gb(r['predicted_bytes'])} {ratio:>9s}"
        )
    lines += ["", "share of step time per part (each timed on its own at the step's shapes; other: what they do not cover)"]
    names, done = [], [r for r in res["stages"] if "error" not in r]
    for r in done:
        names += [k for k in r["share"] if k not in names]
    lines.append(f"{'stage':8s} " + " ".join(f"{n[:12]:>12s}" for n in names))
    for r in done:
        lines.append(f"{r['stage']:8s} " + " ".join(f"{r['share'][n]:12.1%}" if n in r["share"] else f"{'-':>12s}" for n in names))
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", default=str(ROOT / "recipes" / "120b.yaml"))
    p.add_argument("--stage", action="append", default=[], help="a stage name (repeatable; default: every stage)")
    p.add_argument("--gpus", type=int, default=8, help="the node's GPUs this one stands for (default 8)")
    p.add_argument("--blocks", type=int, default=0, help="blocks in the slice (default: as many as the plan says fit, at least 2)")
    p.add_argument("--reps", type=int, default=3, help="timed steps per figure, after one warm-up (median)")
    p.add_argument("--cpu", action="store_true", help="toy widths on the CPU, fp32 (the suite runs this form)")
    p.add_argument("--json", action="store_true", help="print one JSON line instead of the table")
    args = p.parse_args(argv)
    for name, least in (("gpus", 1), ("reps", 1), ("blocks", 0)):
        if getattr(args, name) < least:
            p.error(f"--{name} must be at least {least}")

    from growtrain.planning.recipe import resolve_vocab
    from growtrain.recipe import RecipeError, load_recipe
    from growtrain.stages import plan_stage_models

    try:
        recipe = load_recipe(args.recipe)
    except (RecipeError, FileNotFoundError) as exc:
        print(f"gpu_step: {exc}", file=sys.stderr)
        return 2
    if not args.cpu and not torch.cuda.is_available():
        print("gpu_step: no CUDA GPU here; --cpu runs the toy form", file=sys.stderr)
        return 2
    dev = torch.device("cpu" if args.cpu else "cuda")
    seed = recipe.model.with_changes(vocab_size=resolve_vocab(recipe))
    shapes = plan_stage_models(seed, [s.grow for s in recipe.stages])
    names = [s.name for s in recipe.stages]
    unknown = [n for n in args.stage if n not in names]
    if unknown:
        print(f"gpu_step: no stage {', '.join(unknown)} in {args.recipe} (stages: {', '.join(names)})", file=sys.stderr)
        return 2
    rows = []
    for stage, cfg in zip(recipe.stages, shapes):
        if args.stage and stage.name not in args.stage:
            continue
        if args.cpu:
            cfg = toy(cfg)
        if not args.json:
            print(f"stage {stage.name} ...", file=sys.stderr, flush=True)
        try:
            rows.append(run_stage(recipe, cfg, stage, args, dev))
        except torch.OutOfMemoryError as exc:  # one stage's slice too big: the others still run
            rows.append({"stage": stage.name, "error": f"out of memory: {str(exc).splitlines()[0]}"})
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    res = {
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "recipe": Path(args.recipe).name,
        "gpus": args.gpus,
        "stages": rows,
    }
    print(json.dumps(res) if args.json else table(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
