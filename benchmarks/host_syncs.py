"""Host syncs per training step of the real training loop, at 2 and 8 blocks and 1 and 4
micro-batches (issue 13): on the single-process path the trainer's count must not grow with
depth, MoE layers or micro-batches. Counted on the CPU by growtrain.runtime.host_syncs (the calls that
would sync on a GPU). The reference expert backends' one offsets read per MoE call is reported
apart: it grows with MoE layers by construction, and the Triton path does not make it.

    python benchmarks/host_syncs.py [--json] [--steps N]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from growtrain.runtime.host_syncs import per_step_syncs  # noqa: E402


def recipe(blocks: int, accum: int) -> dict:
    """Every block an MoE layer (4 experts, top-2): per-layer syncs would show at once."""
    return {
        "name": f"syncs-b{blocks}-a{accum}",
        "seed": 0,
        "model": {"d_model": 32, "n_layers": blocks, "n_heads": 2, "n_kv_heads": 1, "ffn_hidden": 64,
                  "moe": {"num_experts": 4, "top_k": 2, "expert_hidden": 32}, "moe_layers": list(range(blocks))},
        "data": {"source": "builtin:pydoc_topics", "max_bytes": 60_000, "eval_fraction": 0.1},
        "train": {"log_every": 1000, "eval_every": 0, "eval_batches": 1},
        "stages": [{"name": "s", "steps": 2, "seq_len": 16, "batch_size": 2, "grad_accum": accum}],
        "checkpoint": {"every_steps": 0, "keep_last": 1},
        "invariance": {"probe_batch_size": 1, "probe_seq_len": 16},
        "tracking": {"wandb": {"mode": "disabled"}, "progress_bar": False},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="print one JSON line")
    ap.add_argument("--steps", type=int, default=3, help="steps of the shorter of the two runs (default 3)")
    args = ap.parse_args()
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for blocks in (2, 8):
            for accum in (1, 4):
                rows[f"blocks{blocks}_accum{accum}"] = per_step_syncs(recipe(blocks, accum), args.steps, Path(tmp) / f"{blocks}-{accum}")
    if args.json:
        print(json.dumps({"syncs_per_step": {k: v["trainer"] for k, v in rows.items()},
                          "expert_backend_syncs_per_step": {k: v["expert_backend"] for k, v in rows.items()}}))
        return
    print("host syncs per training step (single process, CPU, counted as they would sync on a GPU)")
    print(f"{'case':<16}{'trainer':>9}{'reference expert backend':>26}  trainer's sites")
    for k, v in rows.items():
        sites = ", ".join(f"{s} x{n:g}" for s, n in sorted(v["by_site"].items()))
        print(f"{k:<16}{v['trainer']:>9g}{v['expert_backend']:>26g}  {sites}")


if __name__ == "__main__":
    main()
