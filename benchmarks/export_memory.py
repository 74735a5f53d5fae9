"""Peak memory of `growtrain export-hf` against the size of the model it exports (issue 44).

Writes a checkpoint of a model of at least 1 GB (an MoE with stacked experts; with --nf4 its
experts NF4 + LoRA, exported merged), then exports it three ways, each in its own process whose
peak RSS the kernel reports (ru_maxrss):
- `growtrain export-hf` as a user runs it (float32, shards of --max-shard-size);
- the same with bfloat16 weights;
- the baseline a user would otherwise write: load the checkpoint's model.safetensors whole with
  safetensors' load_file and save it with save_file (no merging, no sharding).
Also measures the interpreter alone (python, torch and growtrain.hf.export imported) so the
table shows what the export adds on top of it.

    python benchmarks/export_memory.py [--json] [--gb 1.2] [--nf4] [--max-shard-size 500MB]

Target: export peak RSS - interpreter <= 3 x hf_common.CHUNK_BYTES (a chunk read, merged, cast),
whatever the model size; the baseline grows with the model.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


# Each measured process reports its own VmHWM at exit: the peak resident set of its own address space
# (ru_maxrss of a child would also count the parent's pages at the fork).
_REPORT_PEAK = """
import atexit, sys
def _peak():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            sys.stderr.write("\\nVMHWM_KB " + line.split()[1] + "\\n")
atexit.register(_peak)
"""


def peak_rss_mb(code: str, cwd: Path) -> tuple[float, float]:
    """(peak RSS in MB, seconds) of a fresh interpreter running `code`."""
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", _REPORT_PEAK + code], cwd=cwd, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{code} failed:\n{done.stderr[-3000:]}")
    kb = int(done.stderr.rsplit("VMHWM_KB ", 1)[1].split()[0])
    return kb / 1024, time.perf_counter() - t0


def _cli(*args: str) -> str:
    return f"from growtrain.cli import main; sys.exit(main({list(args)!r}))"


def write_checkpoint(root: Path, gb: float, nf4: bool) -> tuple[Path, int]:
    import torch

    from growtrain.checkpoint.store import CheckpointConfig, CheckpointManager
    from growtrain.model import GrowLM, ModelConfig, MoEConfig
    from growtrain.recipe import to_plain

    d, hidden, layers = 1024, 2048, 4
    per_expert = 3 * d * hidden * 4  # float32 bytes of one expert's three matrices
    experts = max(2, int(gb * 1e9 / (layers * per_expert)) + 1)
    moe = MoEConfig(num_experts=experts, top_k=2, expert_hidden=hidden, expert_format="nf4" if nf4 else "full")
    cfg = ModelConfig(vocab_size=257, d_model=d, n_layers=layers, n_heads=8, ffn_hidden=2048, moe=moe, moe_layers=tuple(range(layers)))
    torch.manual_seed(0)
    model = GrowLM(cfg)
    meta = {
        "model_config": to_plain(cfg), "stage": 0, "stage_name": "bench", "stage_step": 1, "step": 1, "tokens": 0,
        "params_total": model.num_parameters(), "loss": None, "eval_loss": None, "growth_history": [],
        "recipe": {"name": "export-memory", "data": {"tokenizer": "byte", "source": "none"}, "stages": [{"name": "bench", "steps": 1, "seq_len": 256}]},
    }
    CheckpointManager(root / "run", CheckpointConfig(), log=lambda s: None).save(1, model_state=model.state_dict(), trainer_state={"optimizer": {}}, meta=meta)
    del model
    return root / "run", _exported_bytes(cfg)


def _exported_bytes(cfg) -> int:
    """The exported model's size at float32 (NF4 experts merged to full precision)."""
    import torch

    from growtrain.hf.adapters import base_config
    from growtrain.model import GrowLM

    with torch.device("meta"):
        return sum(t.numel() * 4 for t in GrowLM(base_config(cfg)).state_dict().values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="also print one machine-readable line")
    ap.add_argument("--gb", type=float, default=1.2, help="model size in GB at float32 (default 1.2)")
    ap.add_argument("--nf4", action="store_true", help="NF4 + LoRA experts (exported merged)")
    ap.add_argument("--max-shard-size", default="500MB")
    args = ap.parse_args()

    from growtrain.hf import common as hf_common

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        t0 = time.perf_counter()
        run, model_bytes = write_checkpoint(root, args.gb, args.nf4)
        setup_s = time.perf_counter() - t0
        base_rss, _ = peak_rss_mb("import torch, growtrain.cli, growtrain.hf.export, growtrain.inspect, bitsandbytes", root)
        rows = []
        for label, extra in (("export-hf float32", []), ("export-hf bfloat16", ["--dtype", "bfloat16"])):
            out = root / label.replace(" ", "-")
            rss, secs = peak_rss_mb(_cli("export-hf", str(run), "--out", str(out), "--max-shard-size", args.max_shard_size, *extra), root)
            shards = sorted(out.glob("*.safetensors"))
            rows.append({"what": label, "peak_rss_mb": rss, "seconds": secs, "files": len(shards),
                         "largest_file_mb": max(p.stat().st_size for p in shards) / 1e6, "written_mb": sum(p.stat().st_size for p in shards) / 1e6})
        if not args.nf4:
            ckpt = sorted((run / "checkpoints").glob("step-*"))[-1]
            code = f"from safetensors.torch import load_file, save_file; save_file(load_file({str(ckpt / 'model.safetensors')!r}), {str(root / 'whole.safetensors')!r})"
            rss, secs = peak_rss_mb(code, root)
            size = (root / "whole.safetensors").stat().st_size / 1e6
            rows.append({"what": "load_file + save_file (baseline)", "peak_rss_mb": rss, "seconds": secs, "files": 1, "largest_file_mb": size, "written_mb": size})

    print(f"model: {model_bytes / 1e9:.2f} GB at float32 ({'NF4 + LoRA experts, merged on export' if args.nf4 else 'full-precision experts'}); "
          f"checkpoint written in {setup_s:.0f} s; chunk {hf_common.CHUNK_BYTES >> 20} MiB; interpreter alone {base_rss:.0f} MB")
    print(f"{'what':<34} {'peak RSS MB':>12} {'- interp. MB':>13} {'s':>7} {'files':>6} {'largest MB':>11} {'written MB':>11}")
    for r in rows:
        print(f"{r['what']:<34} {r['peak_rss_mb']:>12.0f} {r['peak_rss_mb'] - base_rss:>13.0f} {r['seconds']:>7.1f} {r['files']:>6} "
              f"{r['largest_file_mb']:>11.0f} {r['written_mb']:>11.0f}")
    bound = 3 * hf_common.CHUNK_BYTES / 1e6
    added = max(r["peak_rss_mb"] - base_rss for r in rows if r["what"].startswith("export-hf"))
    print(f"export adds at most {added:.0f} MB over the interpreter (bound {bound:.0f} MB: {'met' if added <= bound else 'NOT met'})")
    if args.json:
        print(json.dumps({"benchmark": "export_memory", "model_gb": model_bytes / 1e9, "nf4": args.nf4, "interpreter_rss_mb": base_rss,
                          "chunk_mb": hf_common.CHUNK_BYTES / 1e6, "bound_mb": bound, "export_added_mb": added, "rows": rows}))


if __name__ == "__main__":
    main()
