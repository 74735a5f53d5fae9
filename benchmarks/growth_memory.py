"""Per-rank memory of growth against training, and against the plan (issue 14).

Runs a recipe (default recipes/120b-rehearsal.yaml: the 120B recipe's stages and operators at a
tiny width) under `torchrun --standalone --nproc-per-node N` with GROWTRAIN_MEMORY_TRACE set
(growtrain/runtime/memtrace.py), so that every rank records, for each stage's growth and for its training,
the peak of live tensor bytes (the storages alive at the phase start plus the peak of those made
inside it) and of its resident memory (VmHWM). For every transition it reports the largest over
the ranks of both peaks, their ratio, and what `growtrain plan` predicts per rank
(`growth_peak_bytes_per_rank`, from the same bookkeeping the operators keep).

    python benchmarks/growth_memory.py                  # the rehearsal over 8 processes, a table
    python benchmarks/growth_memory.py --json           # {"transitions": [{"stage", "rank_peak_growth_bytes", ...}]}
    python benchmarks/growth_memory.py --nproc 2 --recipe RECIPE --keep DIR   # keep the run and traces
    python benchmarks/growth_memory.py --set distributed.layout=af --set distributed.attention_ranks=4
                                                        # an AF layout (4 + 4): growth on its shards

In an AF layout the expert ranks hold the experts (E / F each, F expert ranks) and, while growth
runs, the dense part: the plan's figure is then the per-rank peak over F ranks (as the trainer's
train.grow_on: auto reckons it), which over-counts only their share of the dense optimizer state.

Targets (issue 14): growth peak <= 1.5 x the training peak at every transition, and within
+-25% of the plan's per-rank figure. The trace makes every op go through Python: the rehearsal
takes some minutes on 2 CPU cores; run nothing else meanwhile.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from growtrain.planning import PRESETS, plan_recipe  # noqa: E402
from growtrain.recipe import load_recipe  # noqa: E402

GROWTH_TO_TRAIN_TARGET = 1.5
PLAN_TOLERANCE = 0.25


def run(recipe: Path, nproc: int, out: Path, overrides: list[str]) -> tuple[list[dict], float]:
    trace = out / "trace"
    env = {**os.environ, "GROWTRAIN_MEMORY_TRACE": str(trace), "OMP_NUM_THREADS": "1", "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    t0 = time.perf_counter()
    args = ["--standalone", "--nproc-per-node", str(nproc), "-m", "growtrain", "run", str(recipe), "--out", str(out / "run")]
    r = torchrun(args + [a for o in overrides for a in ("--set", o)], env)
    if r.returncode != 0:
        sys.exit(f"the traced run failed (exit {r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    records = [json.loads(line) for f in sorted(trace.glob("rank-*.jsonl")) for line in f.read_text().splitlines()]
    return records, time.perf_counter() - t0


def torchrun(args: list[str], env: dict) -> subprocess.CompletedProcess:
    """`python -m torch.distributed.run ARGS` from the repository, its output captured (the test
    suite puts its own launcher here: tests/test_plan.py)."""
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", *args], cwd=REPO, env=env, capture_output=True, text=True)


def summarize(records: list[dict], planned: dict[str, int]) -> list[dict]:
    def peak(stage: str, phase: str, key: str) -> int:
        values = [r[key] for r in records if r["stage"] == stage and r["phase"] == phase and r[key] is not None]
        return max(values) if values else 0

    rows = []
    for stage in dict.fromkeys(r["stage"] for r in records if r["phase"] == "growth"):
        grow, train = peak(stage, "growth", "live_peak_bytes"), peak(stage, "train", "live_peak_bytes")
        plan = planned.get(stage, 0)
        rows.append({
            "stage": stage,
            "rank_peak_growth_bytes": grow,
            "rank_peak_train_bytes": train,
            "planned_rank_peak_bytes": plan,
            "growth_to_train": grow / train if train else None,
            "growth_to_plan": grow / plan if plan else None,
            "rank_peak_growth_rss_bytes": peak(stage, "growth", "rss_peak_bytes"),
            "rank_peak_train_rss_bytes": peak(stage, "train", "rss_peak_bytes"),
            "growth_seconds": peak(stage, "growth", "seconds"),
        })
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", type=Path, default=REPO / "recipes" / "120b-rehearsal.yaml")
    ap.add_argument("--nproc", type=int, default=8, help="processes (expert-parallel ranks), default 8")
    ap.add_argument("--json", action="store_true", help="print one JSON line")
    ap.add_argument("--keep", type=Path, help="keep the run and its traces in this folder (default: a temporary one, removed)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help="recipe override passed to growtrain run (repeatable)")
    args = ap.parse_args(argv)
    recipe = load_recipe(args.recipe, args.overrides)
    layout = recipe.distributed.layout
    holders = args.nproc
    if layout == "af":
        if not isinstance(recipe.distributed.attention_ranks, int):
            sys.exit("--set distributed.attention_ranks=A: give the split (auto is not resolved here)")
        holders = args.nproc - recipe.distributed.attention_ranks
    # The plan's per-rank figure depends on the rank count only (growth memory is host memory).
    hw = next((h for h in PRESETS.values() if h.gpus == holders), None) or dataclasses.replace(PRESETS["h100-80gb"], gpus_per_node=holders, nodes=1)
    planned = {s.name: s.growth_peak_bytes_per_rank for s in plan_recipe(recipe, hw).stages}
    if args.keep is not None:
        if args.keep.exists() and any(args.keep.iterdir()):
            sys.exit(f"--keep {args.keep}: the folder is not empty")
        records, seconds = run(args.recipe, args.nproc, args.keep, args.overrides)
    else:
        with tempfile.TemporaryDirectory(prefix="growth-memory-") as tmp:
            records, seconds = run(args.recipe, args.nproc, Path(tmp), args.overrides)
    rows = summarize(records, planned)
    if args.json:
        print(json.dumps({"recipe": recipe.name, "nproc": args.nproc, "layout": layout, "expert_ranks": holders, "seconds": round(seconds, 1), "transitions": rows}))
        return 0
    mb = lambda b: f"{b / 2**20:,.1f}"  # noqa: E731
    where = f", AF layout: {args.nproc - holders} + {holders}, plan over {holders} ranks" if layout == "af" else ""
    print(f"{recipe.name} over {args.nproc} processes{where} ({seconds:.0f} s); peaks per rank (the largest over ranks), MiB of live tensors (RSS beside)")
    print(f"{'stage':<10}{'growth':>10}{'train':>10}{'grow/train':>12}{'plan':>10}{'grow/plan':>11}{'growth RSS':>12}{'train RSS':>11}")
    for r in rows:
        ratio = f"{r['growth_to_train']:.2f}" if r["growth_to_train"] else "-"
        vs_plan = f"{r['growth_to_plan']:.2f}" if r["growth_to_plan"] else "-"
        print(
            f"{r['stage']:<10}{mb(r['rank_peak_growth_bytes']):>10}{mb(r['rank_peak_train_bytes']):>10}{ratio:>12}{mb(r['planned_rank_peak_bytes']):>10}"
            f"{vs_plan:>11}{mb(r['rank_peak_growth_rss_bytes']):>12}{mb(r['rank_peak_train_rss_bytes']):>11}"
        )
    print(f"targets: growth <= {GROWTH_TO_TRAIN_TARGET}x training, within +-{PLAN_TOLERANCE:.0%} of the plan")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
