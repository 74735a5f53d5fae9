"""Activation memory per depth of residual blocks (issue 45): checkpointed (model.block: residual,
model.reversible: true, the memory-saving mode) against plain autograd, with coupling blocks'
reversible backward beside them, and what the planner predicts.

    python benchmarks/residual_memory.py [--json] [--depths 4 8 16 32]

Each model runs one forward + backward through GrowLM.forward, as the trainer runs it, under two
meters (growtrain/runtime/memory.py):
  kept   peak bytes that autograd holds for backward (saved-tensor hooks, parameters excluded).
         torch.utils.checkpoint's non-reentrant recompute keeps its tensors under hooks of its
         own, so for the checkpointed arm this is what the forward keeps: the blocks' inputs.
  step   peak bytes of every tensor the step creates, alive at once (activations, the one block
         being recomputed, temporaries and the parameters' gradients, which grow with depth for
         every arm alike).
Planner: growtrain.planning.memory.activation_bytes(...).saved_peak of the same shape.
Expected: checkpointed residual blocks keep one [batch, seq, d_model] fp32 boundary per block;
plain autograd the whole block's activations; couplings stay flat.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from growtrain.runtime.memory import LiveTensorMeter, SavedTensorMeter
from growtrain.model import GrowLM, ModelConfig, MoEConfig
from growtrain.planning.memory import activation_bytes

ARMS = {"residual checkpointed": ("residual", True), "residual plain": ("residual", False), "coupling reversible": ("coupling", True)}


def measure(cfg: ModelConfig, tokens: torch.Tensor) -> tuple[int, int]:
    """(kept, step) peak bytes of one forward + backward."""
    torch.manual_seed(0)
    model = GrowLM(cfg)
    kept = SavedTensorMeter(exclude=list(model.parameters()))
    with kept, LiveTensorMeter() as live:
        out = model(tokens[:, :-1])
        loss = F.cross_entropy(out.logits.flatten(0, 1), tokens[:, 1:].flatten()) + out.aux_loss
        loss.backward()
    return kept.peak, live.peak


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--depths", type=int, nargs="+", default=[4, 8, 16, 32])
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    vocab = 512
    tokens = torch.randint(0, vocab, (args.batch, args.seq_len + 1), generator=torch.Generator().manual_seed(0))
    rows = []
    for depth in args.depths:
        row = {"depth": depth}
        for arm, (block, reversible) in ARMS.items():
            cfg = ModelConfig(vocab_size=vocab, d_model=args.d_model, n_layers=depth, n_heads=4, n_kv_heads=2, ffn_hidden=2 * args.d_model,
                              moe=MoEConfig(num_experts=4, top_k=2, expert_hidden=args.d_model), moe_layers=tuple(range(1, depth, 2)),
                              block=block, reversible=reversible)
            kept, step = measure(cfg, tokens)
            row[arm] = {"kept": kept, "step": step, "planned": activation_bytes(cfg, args.batch, args.seq_len).saved_peak}
        rows.append(row)
    boundary = args.batch * args.seq_len * args.d_model * 4
    mib = 2**20
    print(f"d_model {args.d_model}, seq {args.seq_len}, batch {args.batch}, MoE every 2nd block (4 experts, top-2); one fp32 boundary = {boundary / mib:.2f} MiB")
    print(f"{'depth':>5} " + " ".join(f"{arm + ': kept / step / planned (MiB)':>46}" for arm in ARMS))
    for r in rows:
        print(f"{r['depth']:>5} " + " ".join(f"{r[a]['kept'] / mib:>22.2f}{r[a]['step'] / mib:>12.2f}{r[a]['planned'] / mib:>12.2f}" for a in ARMS))
    first, last = rows[0], rows[-1]
    span = last["depth"] - first["depth"]
    slope = {a: {k: (last[a][k] - first[a][k]) / span for k in ("kept", "step")} for a in ARMS}
    print("added per block: " + "; ".join(f"{a}: kept {v['kept'] / boundary:.2f} boundaries, step {v['step'] / mib:.2f} MiB" for a, v in slope.items()))
    if args.json:
        print(json.dumps({"benchmark": "residual_memory", "boundary_bytes": boundary, "rows": rows, "per_block_bytes": slope}))


if __name__ == "__main__":
    main()
