"""One MoE layer's forward + backward on the CPU: growtrain's layer against Hugging Face transformers'
`MixtralSparseMoeBlock` at the same shapes (issue 16), plus growtrain's NF4 + LoRA experts.

    python benchmarks/moe_layer.py                 # a table
    python benchmarks/moe_layer.py --json          # {"rows": [{"E":..., "K":..., "F":..., "growtrain_s":..., "hf_s":...}]}
    python benchmarks/moe_layer.py --reps 3 --tokens 512   # quicker

Per shape (d_model 128, 2,048 tokens, fp32, one thread by default; E experts, top-K, expert hidden F):
  growtrain_s       growtrain's MoE layer (router, top-k, sort dispatch, reference expert backend,
                    combine) forward + backward into x and every parameter
  hf_s              transformers' MixtralSparseMoeBlock built from a MixtralConfig of the same
                    shape, standalone (its experts run their eager per-expert loop), same work
  hf_grouped_mm_s   the same block with experts_implementation="grouped_mm" (what a full HF model
                    picks by default where torch's grouped_mm dispatches); null where it cannot run
  loop_s            growtrain's layer with the per-expert autograd loop the fast path replaced
                    (`grouped_swiglu_reference_loop`): the before
  nf4_s             growtrain's layer with NF4 bases + LoRA (r 16) experts: backward into x and the
                    adapters; nf4_loop_s the same with the old per-expert loop
Target: growtrain_s <= hf_s / 2 at the three shapes of the issue.
Times: the median of --reps runs of each variant, the variants alternating run by run (A B C A B C ...)
after a warm-up of each, so a busy machine slows all of them alike; ratios are the honest figure,
absolute times depend on what else shares the cores.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import statistics
import sys
import time

import torch

SHAPES = ((32, 2, 512), (128, 8, 128), (256, 16, 64))  # (E, K, F) of the issue
TARGET_SPEEDUP_VS_HF = 2.0


@contextlib.contextmanager
def loop_backends():
    """growtrain's registries pointed at the old per-expert loops, for the `loop` columns."""
    from growtrain.kernels.nf4_reference import grouped_swiglu_nf4_lora_reference_loop
    from growtrain.kernels.reference import grouped_swiglu_reference_loop
    from growtrain.model import moe as moe_module

    saved = moe_module.EXPERT_BACKENDS["reference"], moe_module.NF4_EXPERT_BACKENDS["reference"]
    moe_module.EXPERT_BACKENDS["reference"] = grouped_swiglu_reference_loop
    moe_module.NF4_EXPERT_BACKENDS["reference"] = grouped_swiglu_nf4_lora_reference_loop
    try:
        yield
    finally:
        moe_module.EXPERT_BACKENDS["reference"], moe_module.NF4_EXPERT_BACKENDS["reference"] = saved


def growtrain_layer(E: int, K: int, F: int, D: int, expert_format: str = "full"):
    from growtrain.model.config import ExpertLoRAConfig, ModelConfig, MoEConfig
    from growtrain.model.moe import MoE

    moe = MoEConfig(num_experts=E, top_k=K, expert_hidden=F, router_init_std=0.5, expert_format=expert_format, lora=ExpertLoRAConfig(r=16, lora_alpha=16.0))
    torch.manual_seed(0)
    return MoE(ModelConfig(d_model=D, n_heads=4, ffn_hidden=F, moe=moe, moe_layers=(0,)))


def hf_block(E: int, K: int, F: int, D: int, experts_implementation: str):
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    cfg = MixtralConfig(hidden_size=D, intermediate_size=F, num_local_experts=E, num_experts_per_tok=K, router_jitter_noise=0.0)
    cfg._experts_implementation = experts_implementation
    torch.manual_seed(0)
    block = MixtralSparseMoeBlock(cfg)
    with torch.no_grad():  # transformers leaves these torch.empty until a model's init runs
        for p in block.parameters():
            p.normal_(0.0, 0.02)
        block.gate.weight.normal_(0.0, 0.5)
    return block


def fwd_bwd(module, x_BTD: torch.Tensor, dy_BTD: torch.Tensor, growtrain: bool):
    """One forward + backward; returns a closure that runs it."""
    x = x_BTD.clone().requires_grad_(True)

    def run():
        module.zero_grad(set_to_none=True)
        x.grad = None
        y = module(x)
        if growtrain:
            y, stats = y
            loss = (y * dy_BTD).sum() + stats.aux_loss
        else:
            loss = (y * dy_BTD).sum()
        loss.backward()

    return run


def runnable(fn) -> bool:
    try:
        fn()
        return True
    except Exception as err:  # an HF implementation that cannot dispatch on this machine
        logging.getLogger(__name__).warning("skipping a variant: %s", err)
        return False


def time_alternating(fns: dict, reps: int, warmup: int) -> dict[str, float]:
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def measure(E: int, K: int, F: int, D: int, tokens: int, reps: int, warmup: int, with_loop: bool, with_nf4: bool) -> dict:
    g = torch.Generator().manual_seed(E * 1000 + K)
    x = torch.randn(1, tokens, D, generator=g)
    dy = torch.randn(1, tokens, D, generator=g)
    fns = {
        "growtrain_s": fwd_bwd(growtrain_layer(E, K, F, D), x, dy, True),
        "hf_s": fwd_bwd(hf_block(E, K, F, D, "eager"), x, dy, False),
    }
    grouped = fwd_bwd(hf_block(E, K, F, D, "grouped_mm"), x, dy, False)
    if runnable(grouped):
        fns["hf_grouped_mm_s"] = grouped
    if with_nf4:
        fns["nf4_s"] = fwd_bwd(growtrain_layer(E, K, F, D, "nf4"), x, dy, True)
    if with_loop:
        loop_full = fwd_bwd(growtrain_layer(E, K, F, D), x, dy, True)
        loop_nf4 = fwd_bwd(growtrain_layer(E, K, F, D, "nf4"), x, dy, True) if with_nf4 else None

        def under_loop(fn):
            def run():
                with loop_backends():
                    fn()

            return run

        fns["loop_s"] = under_loop(loop_full)
        if loop_nf4 is not None:
            fns["nf4_loop_s"] = under_loop(loop_nf4)
    med = time_alternating(fns, reps, warmup)
    row = {"E": E, "K": K, "F": F, **{k: round(v, 5) for k, v in med.items()}}
    row.setdefault("hf_grouped_mm_s", None)
    return row


def table(rows: list[dict], threads: int, tokens: int, D: int) -> str:
    lines = [f"MoE layer forward + backward, d_model {D}, {tokens} tokens, fp32, {threads} thread(s); median seconds"]
    cols = [c for c in ("growtrain_s", "hf_s", "hf_grouped_mm_s", "loop_s", "nf4_s", "nf4_loop_s") if any(r.get(c) is not None for r in rows)]
    lines.append(f"{'E':>4} {'K':>3} {'F':>4} " + " ".join(f"{c[:-2]:>14}" for c in cols) + f" {'hf / growtrain':>15}")
    for r in rows:
        cells = " ".join(f"{r[c]:>14.4f}" if r.get(c) is not None else f"{'-':>14}" for c in cols)
        lines.append(f"{r['E']:>4} {r['K']:>3} {r['F']:>4} {cells} {r['hf_s'] / r['growtrain_s']:>14.2f}x")
    lines.append(f"target: hf / growtrain >= {TARGET_SPEEDUP_VS_HF:g}x at every shape")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (the issue measured 1)")
    parser.add_argument("--shapes", default="", help="E:K:F,... instead of the issue's three shapes")
    parser.add_argument("--no-loop", action="store_true", help="skip the old per-expert loop columns")
    parser.add_argument("--no-nf4", action="store_true", help="skip the NF4 + LoRA columns")
    parser.add_argument("--json", action="store_true", help="print only one JSON line on stdout")
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    shapes = [tuple(int(v) for v in s.split(":")) for s in args.shapes.split(",")] if args.shapes else SHAPES
    rows = [
        measure(E, K, F, args.d_model, args.tokens, args.reps, args.warmup, not args.no_loop, not args.no_nf4)
        for E, K, F in shapes
    ]
    if args.json:
        print(json.dumps({"rows": rows}))
    else:
        print(table(rows, args.threads, args.tokens, args.d_model))
    return 0


if __name__ == "__main__":
    sys.exit(main())
