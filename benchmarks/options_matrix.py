"""Every growth operator in every layout: a micro recipe through each operator x {one process,
expert parallel over 2, AF 1 + 1} x {full-precision, NF4 + LoRA experts} x {AdamW, 8-bit dense
state} x {coupling, residual blocks}, each cell a real `growtrain run` (torchrun for 2 processes)
that is killed mid-step at a step drawn for the cell and resumed with the same command.

A cell is
- refused: `growtrain validate RECIPE --world-size N` rejects it before any compute, for a reason
  listed in MEANINGLESS (the combination means nothing) or GAPS (not supported yet, named); a
  refusal for any other reason counts as a failure;
- runs: validation passes, the run is killed at the drawn step, the same command resumes it to
  the end, and the steps it ran twice (after the last checkpoint before the kill) give the same
  losses bit for bit;
- fails: anything else (a refusal only at run time, an error, a resume that does not finish or
  does not repeat its losses).

The recipe: d_model 64, 2 blocks; stage 'dense' (4 steps); stage 'moe' upcycles block 1 into 4
experts (and quantizes them for the NF4 column); stage 'op' applies the operator under test (4
steps); checkpoints every 2 steps; residual blocks checkpointed (model.reversible: true, the
default) in every layout. The kill step is even, drawn per cell from 4..12 (seeded by the
cell's name), so the step before it always runs twice.

    python benchmarks/options_matrix.py                # the full matrix (about 40 min on 2 CPU cores)
    python benchmarks/options_matrix.py --sample 6     # 6 cells spread over every axis
    python benchmarks/options_matrix.py --only widen_ffn --json
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]

OPERATORS = {
    "deepen": {"after": [0]},
    "widen_hidden": {"factor": 2},
    "widen_ffn": {"ffn_hidden": 192, "expert_hidden": 192},
    "add_heads": {"add": 2},
    "upcycle_moe": {"num_experts": 4, "top_k": 2, "layers": [0]},
    "split_experts": {},
    "clone_experts": {"factor": 2},  # NF4 cells: reinit_fraction 0 (redrawing frozen NF4 neurons means nothing)
    "quantize_experts": {"r": 4, "lora_alpha": 8.0},
    "merge_adapters": {},
    "add_dense_lora": {"r": 4, "lora_alpha": 8.0},
}
LAYOUTS = ("one", "ep2", "af11")
FORMATS = ("full", "nf4")
OPTIMIZERS = ("adamw", "8bit")
BLOCKS = ("coupling", "residual")
STEPS = (4, 4, 4)


# Refusals at validate that the matrix accepts, by the reason's text: combinations that mean
# nothing (quantizing experts that are NF4 already, merging adapters into experts that have none),
# and the gaps not closed yet, each named (a cell refused for any other reason fails).
MEANINGLESS = {
    "the experts are already NF4": "quantize_experts on NF4 experts: they are quantized already",
    "no NF4 experts at this point": "merge_adapters on full-precision experts: there are no adapters to merge",
}
GAPS: dict[str, str] = {}  # none left: checkpointed residual blocks run in the AF layout since 2026-12-07


def classify(reason: str) -> str:
    """meaningless, gap or unexpected: what a refusal at validate counts as."""
    if any(k in reason for k in MEANINGLESS):
        return "meaningless"
    return "gap" if any(k in reason for k in GAPS) else "unexpected"


@dataclass(frozen=True)
class Cell:
    op: str
    layout: str
    fmt: str
    opt: str
    block: str

    @property
    def name(self) -> str:
        return f"{self.op}/{self.layout}/{self.fmt}/{self.opt}/{self.block}"

    @property
    def world(self) -> int:
        return 1 if self.layout == "one" else 2

    @property
    def kill_step(self) -> int:
        return random.Random(zlib.crc32(self.name.encode())).choice(range(4, sum(STEPS) + 1, 2))


def recipe(cell: Cell) -> dict:
    moe_grow = [{"op": "upcycle_moe", "num_experts": 4, "top_k": 2, "layers": [1]}]
    if cell.fmt == "nf4":
        moe_grow.append({"op": "quantize_experts", "r": 4, "lora_alpha": 8.0})
    stage = {"seq_len": 32, "batch_size": 4, "schedule": {"warmup_steps": 1}}
    raw = {
        "name": "matrix",
        "seed": 5,
        "model": {"d_model": 64, "n_layers": 2, "n_heads": 2, "n_kv_heads": 1, "ffn_hidden": 128, "block": cell.block},
        "data": {"source": "builtin:pydoc_topics", "max_bytes": 60_000, "eval_fraction": 0.1},
        "optimizer": {"lr": 0.003, "dense_state_bits": 8 if cell.opt == "8bit" else 32},
        "train": {"log_every": 1, "eval_every": 100, "eval_batches": 1},
        "stages": [
            {"name": "dense", "steps": STEPS[0], **stage},
            {"name": "moe", "steps": STEPS[1], "grow": moe_grow, **stage},
            {"name": "op", "steps": STEPS[2], "grow": [{"op": cell.op, **OPERATORS[cell.op], **_format_args(cell)}], **stage},
        ],
        "checkpoint": {"every_steps": 2, "keep_last": 3},
        "invariance": {"probe_batch_size": 4, "probe_seq_len": 32},
        "tracking": {"wandb": {"mode": "disabled"}, "progress_bar": False},
    }
    if cell.layout == "af11":
        raw["distributed"] = {"layout": "af", "attention_ranks": 1}
    return raw


def _format_args(cell: Cell) -> dict:
    return {"reinit_fraction": 0.0} if cell.op == "clone_experts" and cell.fmt == "nf4" else {}


def _env(extra: dict | None = None) -> dict:
    """The CLI's environment: NCCL's rules checked under torchrun, no fault unless `extra` sets one."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GROWTRAIN_FAULT")}
    return {**env, "GROWTRAIN_CHECK_COLLECTIVES": "1", "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled", **(extra or {})}


def _launch(cell: Cell, *args, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    if cell.world == 1:
        cmd = [sys.executable, "-m", "growtrain", *map(str, args)]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(cell.world), "-m", "growtrain", *map(str, args)]
    return subprocess.run(cmd, cwd=REPO, env=_env(env), capture_output=True, text=True, timeout=timeout)


def _losses(run: Path) -> dict[int, float]:
    path = run / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def _reason(text: str) -> str:
    """The message a user sees: the last 'error' line, else the last non-empty line."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    errors = [ln for ln in lines if "error" in ln.lower() and "Traceback" not in ln and not ln.startswith("E1") and "elastic" not in ln]
    return (errors or lines or ["(no output)"])[-1][:300]


def run_cell(cell: Cell, root: Path) -> dict:
    """One cell: validate, run killed at cell.kill_step, resume; its verdict and why (a launch that
    hangs past its timeout fails the cell, not the matrix)."""
    start = time.monotonic()
    try:
        return _run_cell(cell, root, start)
    except subprocess.TimeoutExpired as exc:
        return {"cell": cell.name, "kill_step": cell.kill_step, "status": "fails", "reason": f"timed out after {exc.timeout:.0f} s: {exc.cmd[-4:]}",
                "seconds": round(time.monotonic() - start, 1)}


def _run_cell(cell: Cell, root: Path, start: float) -> dict:
    where = root / cell.name.replace("/", "-")
    shutil.rmtree(where, ignore_errors=True)
    where.mkdir(parents=True)
    path = where / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe(cell), sort_keys=False))
    out = {"cell": cell.name, "kill_step": cell.kill_step}
    v = subprocess.run(
        [sys.executable, "-m", "growtrain", "validate", str(path), "--world-size", str(cell.world)],
        cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300,
    )
    if v.returncode != 0:
        reason = _reason(v.stdout + v.stderr)
        kind = classify(reason)
        return out | {"status": "fails" if kind == "unexpected" else "refused", "refusal": kind, "reason": reason, "seconds": round(time.monotonic() - start, 1)}
    run = where / "run"
    killed = _launch(cell, "run", path, "--out", run, env={"GROWTRAIN_FAULT": f"step_mid:{cell.kill_step}", "GROWTRAIN_FAULT_RANK": "0"})
    before = _losses(run)
    total = sum(STEPS)
    if killed.returncode == 0:
        return out | {"status": "fails", "reason": f"the kill at step {cell.kill_step} did not happen", "seconds": round(time.monotonic() - start, 1)}
    if max(before, default=0) < cell.kill_step - 1:
        return out | {"status": "fails", "reason": f"stopped before the kill (step {max(before, default=0)}): {_reason(killed.stdout + killed.stderr)}",
                      "seconds": round(time.monotonic() - start, 1)}
    resumed = _launch(cell, "run", path, "--out", run)
    after = _losses(run)
    if resumed.returncode != 0:
        return out | {"status": "fails", "reason": f"resume: {_reason(resumed.stdout + resumed.stderr)}", "seconds": round(time.monotonic() - start, 1)}
    if sorted(after) != list(range(1, total + 1)):
        return out | {"status": "fails", "reason": f"the resumed run logged steps {sorted(after)[:3]}..{max(after, default=0)}", "seconds": round(time.monotonic() - start, 1)}
    resumed_from = _resumed_step(resumed.stdout)
    replayed = [s for s in before if s > resumed_from]
    differ = [s for s in replayed if before[s] != after[s]]
    if not replayed or differ:
        why = f"steps {differ} gave other losses when run again" if differ else "no step ran twice"
        return out | {"status": "fails", "reason": why, "seconds": round(time.monotonic() - start, 1)}
    return out | {"status": "runs", "resumed_from": resumed_from, "replayed": replayed, "seconds": round(time.monotonic() - start, 1)}


def _resumed_step(stdout: str) -> int:
    for line in stdout.splitlines():
        if line.startswith("resumed from step-"):
            return int(line.split("step-")[1][:8])
    return 0


def all_cells() -> list[Cell]:
    return [Cell(*c) for c in itertools.product(OPERATORS, LAYOUTS, FORMATS, OPTIMIZERS, BLOCKS)]


def sample(n: int) -> list[Cell]:
    """n cells that together cover every value of every axis (where n allows), spread evenly."""
    cells = all_cells()
    rng = random.Random(0)
    chosen: list[Cell] = []
    axes = [(0, OPERATORS), (1, LAYOUTS), (2, FORMATS), (3, OPTIMIZERS), (4, BLOCKS)]
    while len(chosen) < n:
        uncovered = [(i, v) for i, values in axes for v in values if not any(astuple(c)[i] == v for c in chosen)]
        pool = [c for c in cells if c not in chosen and (not uncovered or any(astuple(c)[i] == v for i, v in uncovered))]
        if not pool:
            break
        best = max(pool, key=lambda c: (sum(astuple(c)[i] == v for i, v in uncovered), rng.random()))
        chosen.append(best)
    return chosen


def astuple(c: Cell) -> tuple:
    return (c.op, c.layout, c.fmt, c.opt, c.block)


def table(results: list[dict]) -> str:
    lines = ["| operator | layout | experts | dense state | blocks | verdict | detail |", "|---|---|---|---|---|---|---|"]
    for r in results:
        op, layout, fmt, opt, block = r["cell"].split("/")
        detail = r.get("reason") or f"killed at step {r['kill_step']}, resumed from step {r['resumed_from']}, steps {r['replayed']} repeated bit for bit"
        verdict = r["status"] + (f" ({r['refusal']})" if "refusal" in r else "")
        lines.append(f"| {op} | {layout} | {fmt} | {opt} | {block} | {verdict} | {detail} |")
    counts = {k: sum(r["status"] == k for r in results) for k in ("runs", "refused", "fails")}
    gaps = sum(r.get("refusal") == "gap" for r in results)
    lines.append("")
    lines.append(
        f"{len(results)} cells: {counts['runs']} run, {counts['refused']} refused at validate "
        f"({counts['refused'] - gaps} meaningless, {gaps} not supported yet), {counts['fails']} fail"
    )
    return "\n".join(lines)


def summary(results: list[dict]) -> str:
    """Per operator and layout: how many of its cells (2 formats x 2 optimizers x 2 block kinds)
    run, are refused (and why, by reason), or fail; the table in docs/results.md."""
    lines = ["| operator | " + " | ".join(LAYOUTS) + " |", "|---|" + "---|" * len(LAYOUTS)]
    reasons: dict[str, list[str]] = {}
    for op in OPERATORS:
        row = []
        for layout in LAYOUTS:
            mine = [r for r in results if r["cell"].startswith(f"{op}/{layout}/")]
            runs = sum(r["status"] == "runs" for r in mine)
            parts = [f"{runs}/{len(mine)} run"] if mine else ["—"]
            for kind, label in (("meaningless", "refused (meaningless)"), ("gap", "refused (not supported yet)"), ("unexpected", "**refused unexpectedly**")):
                n = sum(r.get("refusal") == kind for r in mine)
                if n:
                    parts.append(f"{n} {label}")
            fails = sum(r["status"] == "fails" and "refusal" not in r for r in mine)
            if fails:
                parts.append(f"**{fails} fail**")
            row.append(", ".join(parts))
            for r in mine:
                if r["status"] != "runs":  # grouped by the message less where it points in the recipe file
                    reasons.setdefault(re.sub(r"^- stages\.\d+\.grow\.\d+ \(line \d+\): ", "", r["reason"]), []).append(r["cell"])
        lines.append(f"| {op} | " + " | ".join(row) + " |")
    lines.append("")
    for reason, cells in reasons.items():
        lines.append(f"- {len(cells)} cells ({', '.join(sorted({c.split('/')[0] + ' ' + c.split('/')[2] for c in cells}))}): {reason}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sample", type=int, default=0, help="run N cells that cover every axis instead of the whole matrix")
    ap.add_argument("--only", action="append", default=[], help="cells whose name (op/layout/format/optimizer/blocks) contains this (repeat: all of them)")
    ap.add_argument("--out", type=Path, default=None, help="keep the runs here (default: a temporary folder, removed)")
    ap.add_argument("--json", action="store_true", help="also print one machine-readable line")
    ap.add_argument("--from-json", type=Path, default=None, help="print the tables of an earlier --json output instead of running")
    args = ap.parse_args(argv)
    if args.from_json is not None:
        results = json.loads(args.from_json.read_text().strip().splitlines()[-1])["cells"]
        for r in results:  # classified by today's lists
            if "reason" in r and r["status"] in ("refused", "fails") and not r["reason"].startswith(("the kill", "stopped before", "resume:", "the resumed", "steps ", "no step")):
                r["refusal"] = classify(r["reason"])
                r["status"] = "fails" if r["refusal"] == "unexpected" else "refused"
        print(table(results) + "\n\n" + summary(results))
        return 1 if any(r["status"] == "fails" for r in results) else 0
    cells = sample(args.sample) if args.sample else all_cells()
    cells = [c for c in cells if all(part in c.name for part in args.only)]
    root = args.out or Path(tempfile.mkdtemp(prefix="options-matrix-"))
    results = []
    try:
        for i, cell in enumerate(cells, 1):
            r = run_cell(cell, root)
            results.append(r)
            print(f"[{i}/{len(cells)}] {cell.name}: {r['status']} ({r['seconds']} s){' — ' + r['reason'] if 'reason' in r else ''}", file=sys.stderr, flush=True)
    finally:
        if args.out is None:
            shutil.rmtree(root, ignore_errors=True)
    print(table(results))
    print()
    print(summary(results))
    if args.json:
        print(json.dumps({"cells": results, "counts": {k: sum(r["status"] == k for r in results) for k in ("runs", "refused", "fails")}}))
    return 1 if any(r["status"] == "fails" for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
