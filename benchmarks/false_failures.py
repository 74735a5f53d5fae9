"""The false-failure search (issue 42): many random short runs, each a real `growtrain run` of a
recipe drawn at random, in which every exact growth operator must pass its checks. A growth check
that stops a good run is as much a defect as one that misses a broken operator; this searches for
the first kind (tests/test_growth_mutations.py keeps the second in view).

What a run draws (every recipe valid by construction, and validated as a user's would be): the
seed, the width (d_model 32 or 64), depth (1-2 blocks), GQA, LR and warm-up, fp32 or bf16 autocast,
32- or 8-bit dense Adam state (in one process and over several: each ZeRO-1 owner holds its
entries' 8-bit state); then a dense stage, optionally a widening stage (widen_hidden,
add_heads, widen_ffn), an upcycle (4 or 8 experts, top-1 or top-2, with or without loss-free
balancing), a stage of 1-3 expert operators (deepen, split_experts, widen_ffn of the experts,
clone_experts), and optionally NF4 experts (quantize_experts) followed by a stage of split / clone /
deepen on the 4-bit codes. Every stage trains 1-5 steps, so that the Adam state growth maps is
young (Adam's first steps are ~sign(g)) and split siblings may still tie. A run may go over
several processes (--ep-share: the experts sharded over 2, torchrun with gloo), and a share of those in
the AF layout (--af-share: 1 attention rank and 1 expert rank).

A run counts as a false failure when it stops with exit 3 on an exact operator (or a transition
of exact operators); an approximate operator stopping on its thresholds is counted apart. Every
check's margin is kept: the largest one-step relative L2 over its bar, and clip-norm change over
its bar, over every exact check of every run.

    python benchmarks/false_failures.py                      # 24 runs, one process each, a table
    python benchmarks/false_failures.py --runs 200 --ep-share 0.25
    python benchmarks/false_failures.py --runs 8 --json      # {"runs": n, "exact_checks": n, "false_failures": 0, ...}
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]


def draw_recipe(rng: random.Random, name: str) -> dict:
    """One random recipe (see the module docstring)."""
    seed_width = d_model = rng.choice([32, 64])
    n_layers = rng.choice([1, 2])
    ffn = 64
    steps = lambda: rng.randint(1, 5)  # noqa: E731
    schedule = lambda: {"warmup_steps": rng.randint(0, 1)}  # noqa: E731
    stage = lambda stage_name, grow: {"name": stage_name, "steps": steps(), "seq_len": 32, "batch_size": 4, "grow": grow, "schedule": schedule()}  # noqa: E731
    stages = [{"name": "dense", "steps": rng.randint(2, 6), "seq_len": 32, "batch_size": 4, "schedule": {"warmup_steps": rng.randint(0, 2)}}]
    if rng.random() < 0.3:
        grow = [{"op": "widen_hidden", "factor": 2}]
        if rng.random() < 0.5:
            grow.append({"op": "add_heads", "add": 2, "kv": "grow"})
        if rng.random() < 0.5:
            ffn = 96
            grow.append({"op": "widen_ffn", "ffn_hidden": ffn, "init": rng.choice(["zero", "split"])})
        stages.append(stage("wide", grow))
        d_model *= 2
    num_experts, top_k = rng.choice([4, 8]), rng.choice([1, 2])
    upcycle = {"op": "upcycle_moe", "num_experts": num_experts, "top_k": top_k, "layers": [n_layers - 1]}
    if rng.random() < 0.5:
        upcycle["balance_bias_rate"] = 0.01
    stages.append(stage("moe", [upcycle]))
    hidden, blocks = ffn, n_layers
    grow = []
    for op in rng.sample(["deepen", "split_experts", "widen_ffn", "clone_experts"], rng.randint(1, 3)):
        if op == "deepen":
            grow.append({"op": "deepen", "after": [rng.randrange(blocks)]})
            blocks += 1
        elif op == "split_experts":
            grow.append({"op": "split_experts"})
            hidden //= 2
        elif op == "widen_ffn":
            hidden += hidden // 2
            grow.append({"op": "widen_ffn", "expert_hidden": hidden, "init": rng.choice(["zero", "split"])})
        else:
            grow.append({"op": "clone_experts", "factor": 2, "reinit_fraction": rng.choice([0.0, 0.25])})
    stages.append(stage("experts", grow))
    if rng.random() < 0.6:
        stages.append(stage("nf4", [{"op": "quantize_experts", "r": 4, "lora_alpha": 8, "double_quant": False}]))
        grow = []
        for op in rng.sample(["split_experts", "clone_experts", "deepen"], rng.randint(1, 2)):
            if op == "split_experts" and (hidden // 2) * d_model % 64 == 0 and hidden % 2 == 0:
                grow.append({"op": "split_experts"})
                hidden //= 2
            elif op == "clone_experts":
                grow.append({"op": "clone_experts", "factor": 2, "reinit_fraction": 0.0})
            elif op == "deepen":
                grow.append({"op": "deepen", "after": [rng.randrange(blocks)]})
                blocks += 1
        if grow:
            stages.append(stage("nf4grow", grow))
    return {
        "name": name,
        "seed": rng.randrange(1_000_000),
        "model": {"d_model": seed_width, "n_layers": n_layers, "n_heads": 2, "n_kv_heads": rng.choice([1, 2]), "ffn_hidden": 64},
        "data": {"source": "builtin:pydoc_topics", "max_bytes": 120_000, "eval_fraction": 0.1},
        "optimizer": {"lr": rng.choice([1e-3, 3e-3]), "dense_state_bits": rng.choice([32, 32, 8])},
        "train": {"log_every": 50, "eval_every": 0, "eval_batches": 1, "precision": rng.choice(["fp32", "bf16"])},
        "stages": stages,
        "checkpoint": {"every_steps": 0, "keep_last": 1},
        "invariance": {"probe_batch_size": 2, "probe_seq_len": 32},
        "tracking": {"wandb": {"mode": "disabled"}, "progress_bar": False},
    }


@dataclass
class Tally:
    runs: int = 0
    processes: dict = field(default_factory=dict)  # process count -> runs
    exact_checks: int = 0  # exact operator and transition records that passed
    approximate_checks: int = 0
    false_failures: list = field(default_factory=list)  # (run, record) of exact checks that stopped a run
    approximate_failures: list = field(default_factory=list)
    other_errors: list = field(default_factory=list)  # a run that ended otherwise (a bug of its own)
    judged_inexact: int = 0  # exact operators these weights kept from being exact (tied siblings)
    worst_step: float = 0.0  # max over exact checks of one-step rel L2 / its bar
    worst_clip: float = 0.0  # max over exact checks of clip-norm rel / its bar
    seconds: float = 0.0

    def add_records(self, records: list[dict]) -> None:
        for r in records:
            if r.get("inexact_on_these_weights"):
                self.judged_inexact += 1
            if not r["passed"]:
                continue
            if r["exact"]:
                self.exact_checks += 1
                dyn = r["metrics"].get("dynamics")
                if dyn is not None and dyn.get("exact"):  # the step judged exact too (not widen's noise)
                    self.worst_step = max(self.worst_step, dyn["rel_l2"] / dyn["bar"])
                    if dyn.get("clip_norm_bar"):
                        self.worst_clip = max(self.worst_clip, dyn["clip_norm_rel"] / dyn["clip_norm_bar"])
            else:
                self.approximate_checks += 1

    def as_json(self) -> dict:
        return {
            "runs": self.runs,
            "processes": self.processes,
            "exact_checks": self.exact_checks,
            "approximate_checks": self.approximate_checks,
            "false_failures": len(self.false_failures),
            "approximate_failures": len(self.approximate_failures),
            "other_errors": len(self.other_errors),
            "judged_inexact_on_weights": self.judged_inexact,
            "worst_step_over_bar": self.worst_step,
            "worst_clip_norm_over_bar": self.worst_clip,
            "seconds": round(self.seconds, 1),
            "failures": [{"run": run, "operator": rec.get("operator"), "problems": rec.get("problems")} for run, rec in self.false_failures + self.approximate_failures]
            + [{"run": run, "error": err} for run, err in self.other_errors],
        }


def run_one(recipe: dict, work: Path, nproc: int, tally: Tally) -> None:
    """One recipe through `growtrain run` (a subprocess, as a user runs it; torchrun for nproc > 1),
    its growth records read from the run's checkpoint, or its failure report."""
    work.mkdir(parents=True, exist_ok=True)
    path = work / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    out = work / "run"
    cli = ["-m", "growtrain", "run", str(path), "--out", str(out)]
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), *cli]
    else:
        cmd = [sys.executable, *cli]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "disabled"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    tally.runs += 1
    key = f"{nproc} (af)" if recipe.get("distributed", {}).get("layout") == "af" else str(nproc)
    tally.processes[key] = tally.processes.get(key, 0) + 1
    failure = out / "growth-failure.json"
    if proc.returncode == 3 and failure.exists():
        record = json.loads(failure.read_text())
        (tally.false_failures if record.get("exact") else tally.approximate_failures).append((recipe["name"], record))
        return
    if proc.returncode != 0:
        said = [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith(("error", "  - "))]
        tally.other_errors.append((recipe["name"], f"exit {proc.returncode}: " + ("\n".join(said[:8]) or (proc.stderr or proc.stdout)[-2000:])))
        return
    tally.add_records(growth_history(out))


def growth_history(run_dir: Path) -> list[dict]:
    """The growth records of a finished run: its newest checkpoint's meta."""
    from growtrain.checkpoint.store import read_meta

    checkpoints = run_dir / "checkpoints"
    return list(read_meta(checkpoints / (checkpoints / "latest").read_text().strip())["growth_history"])


def search(runs: int, seed: int, ep_share: float, work: Path, say=print, af_share: float = 0.0) -> Tally:
    """af_share: the fraction of the runs over 2 processes in the AF layout (1 attention rank + 1
    expert rank), drawn from a generator of its own, so that the recipes a seed draws do not change."""
    rng, layouts = random.Random(seed), random.Random(f"{seed}-af")
    tally = Tally()
    t0 = time.perf_counter()
    for i in range(runs):
        recipe = draw_recipe(rng, f"ff{seed}-{i}")
        nproc = 2 if rng.random() < ep_share else 1  # torchrun shards the experts over the processes
        if nproc > 1 and layouts.random() < af_share:
            recipe["distributed"] = {"layout": "af", "attention_ranks": 1}
        before = len(tally.false_failures) + len(tally.approximate_failures) + len(tally.other_errors)
        run_one(recipe, work / recipe["name"], nproc, tally)
        ops = [s["op"] for st in recipe["stages"] for s in st.get("grow", [])]
        verdict = "passed" if len(tally.false_failures) + len(tally.approximate_failures) + len(tally.other_errors) == before else "STOPPED"
        where = " in the AF layout" if "distributed" in recipe else ""
        say(f"run {i + 1}/{runs} ({nproc} process{'es' if nproc > 1 else ''}{where}, {recipe['train']['precision']}, "
            f"{recipe['optimizer']['dense_state_bits']}-bit state): {' '.join(ops)} — {verdict}")
    tally.seconds = time.perf_counter() - t0
    return tally


def table(t: Tally) -> str:
    rows = [
        ("runs", f"{t.runs} ({', '.join(f'{n} x {p} process(es)' for p, n in sorted(t.processes.items()))})"),
        ("exact operator checks passed", t.exact_checks),
        ("approximate operator checks passed", t.approximate_checks),
        ("exact operators judged approximate on their weights (tied siblings)", t.judged_inexact),
        ("false failures (an exact check stopped a run)", len(t.false_failures)),
        ("approximate checks that stopped a run", len(t.approximate_failures)),
        ("runs that ended otherwise", len(t.other_errors)),
        ("worst exact one-step rel L2 / bar", f"{t.worst_step:.3g}"),
        ("worst exact clip-norm change / bar", f"{t.worst_clip:.3g}"),
        ("seconds", f"{t.seconds:.0f}"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=24, help="random runs (default 24)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the draw of recipes (default 0)")
    parser.add_argument("--ep-share", type=float, default=0.0, help="fraction of runs with their experts over 2 processes (default 0)")
    parser.add_argument("--af-share", type=float, default=0.0,
                        help="fraction of the runs over 2 processes in the AF layout, 1 attention + 1 expert rank (default 0)")
    parser.add_argument("--out", default="", help="keep every run directory here (default: a temporary directory)")
    parser.add_argument("--json", action="store_true", help="print only the JSON result on stdout")
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    for name in ("ep_share", "af_share"):
        if not 0.0 <= getattr(args, name) <= 1.0:
            parser.error(f"--{name.replace('_', '-')} must be in [0, 1]")
    say = (lambda msg: print(msg, file=sys.stderr, flush=True)) if args.json else (lambda msg: print(msg, flush=True))
    with tempfile.TemporaryDirectory(prefix="growtrain-ff-") as tmp:
        tally = search(args.runs, args.seed, args.ep_share, Path(args.out) if args.out else Path(tmp), say, args.af_share)
    if args.json:
        print(json.dumps(tally.as_json()))
    else:
        print(table(tally))
        for run, rec in tally.false_failures + tally.approximate_failures:
            print(f"\n{run}: {rec.get('operator')} stopped the run:\n  - " + "\n  - ".join(rec.get("problems", [])))
        for run, err in tally.other_errors:
            print(f"\n{run}: {err}")
    return 0 if not (tally.false_failures or tally.approximate_failures or tally.other_errors) else 1


if __name__ == "__main__":
    sys.exit(main())
