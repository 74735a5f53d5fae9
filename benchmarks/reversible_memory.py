"""Activation memory and step time of the reversible backward against plain autograd and per-block
`torch.utils.checkpoint`, for several depths at fixed width and sequence length; plus the error of
rebuilding the input streams by inverting every block (fp32 streams; fp32 and bf16 compute).

    python benchmarks/reversible_memory.py                  # tables
    python benchmarks/reversible_memory.py --json           # one JSON line

Methods (one model per depth, the same weights and batch for all three):
  reversible  growtrain.model.reversible.reversible_blocks (the default training path)
  plain       the blocks in a plain loop, autograd keeps every block's activations
  checkpoint  torch.utils.checkpoint around each block (reentrant, so its saves and its backward
              recompute pass through the same saved-tensor hooks as the other two)

How memory is measured (works on CPU, where there are no allocator statistics):
  saved       peak bytes held for backward over forward+backward: saved-tensor hooks count each
              saved storage once while autograd holds it (parameters excluded). This includes the
              logits the loss keeps and, during backward, the one block being recomputed.
  step peak   peak bytes of tensors created during forward+backward and alive at the same time
              (a dispatch mode sees every op's output and a weakref marks its free); on CUDA the
              allocator's max_memory_allocated above the pre-step baseline. Includes the gradient
              buffers, which grow with depth for every method.
Time: median over --repeats of one forward+backward each, the three methods interleaved
(a, b, c, a, b, c, ...) so machine noise hits all alike; ratios are against plain autograd.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from growtrain.runtime.memory import LiveTensorMeter, SavedTensorMeter
from growtrain.model import GrowLM, ModelConfig, MoEConfig
from growtrain.model.reversible import invert_blocks, plain_blocks, reversible_blocks

METHODS = ("reversible", "plain", "checkpoint")


def build(depth: int, args) -> GrowLM:
    moe_layers = tuple(range(1, depth, args.moe_every)) if args.moe_every else ()
    cfg = ModelConfig(
        vocab_size=args.vocab,
        d_model=args.d_model,
        n_layers=depth,
        n_heads=args.heads,
        n_kv_heads=max(1, args.heads // 2),
        ffn_hidden=2 * args.d_model,
        moe=MoEConfig(num_experts=4, top_k=2, expert_hidden=args.d_model) if moe_layers else None,
        moe_layers=moe_layers,
    )
    torch.manual_seed(depth)
    return GrowLM(cfg).to(args.device)


def _checkpointed_blocks(blocks, x1, x2):
    stats = []
    for block in blocks:

        def run(a, b, block=block):
            y1, y2, s = block(a, b)
            return (y1, y2) if s is None else (y1, y2, s.aux_loss, s.load, s.top_k_indices)

        out = checkpoint(run, x1, x2, use_reentrant=True)
        x1, x2 = out[0], out[1]
        if len(out) > 2:
            from growtrain.model import MoEStats

            stats.append(MoEStats(aux_loss=out[2], load=out[3], top_k_indices=out[4]))
    return x1, x2, stats


RUNNERS = {"reversible": reversible_blocks, "plain": plain_blocks, "checkpoint": _checkpointed_blocks}


def step(model: GrowLM, tokens: torch.Tensor, method: str) -> None:
    model.zero_grad(set_to_none=True)
    x1, x2 = model.embed_streams(tokens[:, :-1])
    out = model.head(*RUNNERS[method](model.blocks, x1, x2))
    loss = F.cross_entropy(out.logits.flatten(0, 1), tokens[:, 1:].flatten()) + out.aux_loss
    loss.backward()


def measure_memory(model: GrowLM, tokens: torch.Tensor, method: str) -> tuple[int, int]:
    """(peak bytes saved for backward, peak bytes of the step), after one warm-up step."""
    step(model, tokens, method)
    model.zero_grad(set_to_none=True)
    saved = SavedTensorMeter(exclude=list(model.parameters()))
    if tokens.device.type == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        with saved:
            step(model, tokens, method)
        torch.cuda.synchronize()
        return saved.peak, torch.cuda.max_memory_allocated() - base
    with saved, LiveTensorMeter() as live:
        step(model, tokens, method)
    return saved.peak, live.peak


def measure_time(model: GrowLM, tokens: torch.Tensor, repeats: int) -> dict[str, float]:
    times: dict[str, list[float]] = {m: [] for m in METHODS}
    for m in METHODS:  # warm-up
        step(model, tokens, m)
    for _ in range(repeats):
        for m in METHODS:
            if tokens.device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            step(model, tokens, m)
            if tokens.device.type == "cuda":
                torch.cuda.synchronize()
            times[m].append(time.perf_counter() - t0)
    return {m: statistics.median(v) for m, v in times.items()}


@torch.no_grad()
def reconstruction_error(model: GrowLM, tokens: torch.Tensor, autocast_dtype: torch.dtype | None) -> tuple[float, float]:
    """(max |x_rebuilt - x_true| over both input streams after inverting every block, max |x_true|)."""
    dev = tokens.device.type
    with torch.autocast(dev, dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None):
        x1, x2 = model.embed_streams(tokens)
        y1, y2, stats = plain_blocks(model.blocks, x1, x2)
        r1, r2 = invert_blocks(model.blocks, y1, y2, [s.top_k_indices for s in stats])
    err = max((r1 - x1).abs().max().item(), (r2 - x2).abs().max().item())
    return err, x1.abs().max().item()


def mib(n: int) -> str:
    return f"{n / 2**20:8.2f}"


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--depths", type=int, nargs="+", default=[4, 8, 16, 32])
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--moe-every", type=int, default=2, help="every N-th block (from block 1) is MoE (4 experts, top-2); 0: dense")
    p.add_argument("--repeats", type=int, default=5, help="timed steps per method and depth")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument(
        "--threads", type=int, default=1,
        help="CPU threads (0: torch's default). 1 by default: on a shared machine an OpenMP barrier "
        "waiting for a descheduled thread made steps ~40x slower and the ratios meaningless",
    )
    p.add_argument("--json", action="store_true", help="print only the one-line JSON summary")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq_len + 1), generator=gen).to(args.device)
    rows, recon = [], []
    for depth in args.depths:
        model = build(depth, args)
        mem = {m: measure_memory(model, tokens, m) for m in METHODS}
        t = measure_time(model, tokens, args.repeats)
        rows.append({"depth": depth, "mem": mem, "time": t})
        recon.append((depth, reconstruction_error(model, tokens[:, :-1], None), reconstruction_error(model, tokens[:, :-1], torch.bfloat16)))

    deepest = rows[-1]["time"]
    result = {
        "depths": args.depths,
        "reversible_peak_bytes": [r["mem"]["reversible"][0] for r in rows],
        "plain_peak_bytes": [r["mem"]["plain"][0] for r in rows],
        "checkpoint_peak_bytes": [r["mem"]["checkpoint"][0] for r in rows],
        "reversible_time_ratio": round(deepest["reversible"] / deepest["plain"], 3),
        "checkpoint_time_ratio": round(deepest["checkpoint"] / deepest["plain"], 3),
        # Beyond the keys: the whole step's peak (activations + gradients + temporaries).
        "reversible_step_peak_bytes": [r["mem"]["reversible"][1] for r in rows],
        "plain_step_peak_bytes": [r["mem"]["plain"][1] for r in rows],
        "checkpoint_step_peak_bytes": [r["mem"]["checkpoint"][1] for r in rows],
    }
    if args.json:
        print(json.dumps(result))
        return result

    moe = f"MoE every {args.moe_every} blocks (4 experts, top-2)" if args.moe_every else "dense"
    print(
        f"d_model {args.d_model}, seq {args.seq_len}, batch {args.batch}, vocab {args.vocab}, {moe}; "
        f"device {args.device}, {torch.get_num_threads()} threads, median of {args.repeats}\n"
    )
    print("peak bytes saved for backward (MiB)            peak bytes of the fwd+bwd step (MiB)")
    print("depth  reversible    plain  checkpoint          reversible    plain  checkpoint")
    for r in rows:
        m = r["mem"]
        print(
            f"{r['depth']:5d}    {mib(m['reversible'][0])} {mib(m['plain'][0])}   {mib(m['checkpoint'][0])}"
            f"            {mib(m['reversible'][1])} {mib(m['plain'][1])}   {mib(m['checkpoint'][1])}"
        )
    first, last = rows[0]["mem"], rows[-1]["mem"]
    print(
        f"growth depth {args.depths[0]} -> {args.depths[-1]} (saved): reversible {last['reversible'][0] / first['reversible'][0]:.2f}x, "
        f"plain {last['plain'][0] / first['plain'][0]:.2f}x, checkpoint {last['checkpoint'][0] / first['checkpoint'][0]:.2f}x\n"
    )
    print("step time (ms, median)                          relative to plain")
    print("depth  reversible    plain  checkpoint          reversible  checkpoint")
    for r in rows:
        t = r["time"]
        print(
            f"{r['depth']:5d}    {t['reversible'] * 1e3:8.1f} {t['plain'] * 1e3:8.1f}   {t['checkpoint'] * 1e3:8.1f}"
            f"            {t['reversible'] / t['plain']:8.2f}    {t['checkpoint'] / t['plain']:8.2f}"
        )
    print()
    print("reconstruction of the input streams after inverting every block (fp32 streams)")
    print("depth  max|x|     max|err| fp32 compute  max|err| bf16 autocast")
    for depth, (e32, scale), (e16, _) in recon:
        print(f"{depth:5d}  {scale:8.3f}   {e32:20.2e}  {e16:20.2e}")
    print()
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
