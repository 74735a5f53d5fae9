"""Is growing worth it? Three arms at equal counted training FLOPs, over several seeds:

  grown    the recipe as written: its seed model grown through its stages;
  scratch  the recipe's final shape trained from scratch;
  dense    the recipe's seed shape trained on, never grown.

For each seed, the grown run's counted FLOPs are the budget; the other two arms get as many steps
as that budget buys at their shape. The study reports every arm's final held-out loss (mean ± std
over seeds, and each seed's), and the FLOPs the grown run took to first reach the scratch run's
final held-out loss, as a ratio of the scratch run's FLOPs (< 1: growing got there with less).

    python benchmarks/growth.py                              # recipes/tiny.yaml, seeds 0,1,2, a table
    python benchmarks/growth.py --recipe recipes/small.yaml --plot study.png
    python benchmarks/growth.py --json     # {"arms": {"grown": [...], "scratch": [...], "dense": [...]}, "flops_ratio_to_scratch_loss": r}
    python benchmarks/growth.py --seeds 0 --scale 0.2        # quick: one seed, every stage's steps x0.2

Counted FLOPs are metrics.jsonl's `flops` (growtrain/planning/roofline.py `model_flops_per_token`):
forward + backward of every matmul and of causal attention, per token of every step at that step's
shape; a frozen NF4 base counts its input gradient only; the reversible recompute, embeddings,
norms and the optimizer are not counted (the same recipe setting for all arms).

What differs between arms, and what does not: the seed sets the initialisation and the data order
(the same for the three arms of one seed). Every arm evaluates on the same held-out batches (the
last stage's batch and sequence length, `train.eval_batches` of them). The scratch and dense arms
train one stage at the last stage's batch and sequence length with one cosine schedule (the
recipe's base LR, the first stage's warmup and the last stage's floor); at equal FLOPs an arm whose
model costs more per token sees fewer tokens. A final shape with NF4 experts (quantize_experts) or
peft adapters is trained from scratch in full precision: frozen random 4-bit bases would measure
nothing.

The ratio is interpolated linearly in FLOPs between the grown run's held-out evaluations
(`train.eval_every`); a seed whose grown run never reaches the scratch loss has no ratio, and the
reported ratio is then null (said in the table).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from growtrain.checkpoint import CheckpointConfig, CheckpointManager, read_meta
from growtrain.model.config import ModelConfig
from growtrain.recipe import Recipe, StageConfig, load_recipe
from growtrain.tracking import MetricsFile

REPO = Path(__file__).resolve().parents[1]
ARMS = ("grown", "scratch", "dense")


def scaled(recipe: Recipe, scale: float) -> Recipe:
    if scale == 1.0:
        return recipe
    stages = []
    for s in recipe.stages:
        steps = max(2, round(s.steps * scale))
        warmup = min(steps - 1, round(s.schedule.warmup_steps * scale))
        stages.append(replace(s, steps=steps, schedule=replace(s.schedule, warmup_steps=warmup)))
    return replace(recipe, stages=tuple(stages))


def quiet_recipe(recipe: Recipe, threads: int) -> Recipe:
    tracking = replace(recipe.tracking, wandb=replace(recipe.tracking.wandb, mode="disabled"), progress_bar=False)
    train = replace(recipe.train, threads=threads or recipe.train.threads)
    return replace(recipe, tracking=tracking, train=train, checkpoint=CheckpointConfig(every_steps=0, keep_last=1))


def final_model_config(run_dir: Path) -> ModelConfig:
    manager = CheckpointManager(run_dir, CheckpointConfig(), log=lambda msg: None)
    newest = manager.complete_checkpoints()[0]  # newest first
    return ModelConfig.from_dict(read_meta(newest)["model_config"])


def full_precision(cfg: ModelConfig) -> ModelConfig:
    """`cfg` trainable from scratch: NF4 experts in full precision, no peft adapters."""
    cfg = cfg.with_changes(dense_lora=None)
    if cfg.moe is not None and cfg.moe.expert_format != "full":
        cfg = cfg.with_changes(moe=replace(cfg.moe, expert_format="full"))
    return cfg


def one_stage(recipe: Recipe, name: str, model: ModelConfig, budget_flops: float) -> Recipe:
    """`model` trained as one stage for as many steps as `budget_flops` buys, at the last stage's
    batch and sequence length, with one cosine schedule."""
    from growtrain.planning import model_flops_per_token
    from growtrain.progress import stage_step_costs

    last, first = recipe.stages[-1], recipe.stages[0].schedule
    (per_step,) = stage_step_costs([model], [last], model_flops_per_token)  # the trainer's count of a step
    steps = max(2, math.floor(budget_flops / per_step))
    schedule = replace(first, kind="cosine", peak_lr=0.0, warmup_steps=min(first.warmup_steps, steps - 1), min_lr_ratio=last.schedule.min_lr_ratio)
    stage = StageConfig(name=name, steps=steps, seq_len=last.seq_len, batch_size=last.batch_size, grad_accum=last.grad_accum, schedule=schedule)
    return replace(recipe, name=f"{recipe.name}-{name}", model=model, stages=(stage,))


@dataclass
class ArmRun:
    seed: int
    final_eval_loss: float
    flops: float
    tokens: int
    steps: int
    seconds: float
    curve: list[tuple[float, float]]  # (counted FLOPs, held-out loss) at every evaluation

    def to_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k != "curve"}


def train_arm(recipe: Recipe, run_dir: Path) -> ArmRun:
    from growtrain.train import run  # imported late: `--help` stays instant

    t0 = time.perf_counter()
    result = run(recipe, run_dir, resume="never", log=lambda msg: None)
    seconds = time.perf_counter() - t0
    rows = MetricsFile(run_dir / "metrics.jsonl").read()
    curve = [(row["flops"], row["eval_loss"]) for row in rows if "eval_loss" in row]
    last = rows[-1]
    return ArmRun(recipe.seed, result.final_eval_loss, last["flops"], last["tokens"], last["step"], seconds, curve)


def flops_to_reach(curve: list[tuple[float, float]], target: float) -> float | None:
    """The counted FLOPs at which a run's held-out loss first reaches `target`, linear between
    evaluations (from the start of the run, at no FLOPs, for a first evaluation already below);
    None if it never does."""
    prev = None
    for flops, loss in curve:
        if loss <= target:
            if prev is None or prev[1] == loss:
                return flops
            f0, l0 = prev
            return f0 + (flops - f0) * (l0 - target) / (l0 - loss)
        prev = (flops, loss)
    return None


def study(recipe: Recipe, seeds: list[int], out: Path, say) -> dict:
    runs: dict[str, list[ArmRun]] = {arm: [] for arm in ARMS}
    ratios: list[float | None] = []
    for seed in seeds:
        seeded = replace(recipe, seed=seed)
        grown = train_arm(seeded, out / f"seed{seed}" / "grown")
        say(f"seed {seed}: grown   {grown.steps:>5} steps, {grown.flops:.3e} FLOPs, held-out {grown.final_eval_loss:.4f} ({grown.seconds:.0f}s)")
        final = final_model_config(out / f"seed{seed}" / "grown")
        arms = {"grown": grown}
        for arm, shape in (("scratch", full_precision(final)), ("dense", seeded.model.with_changes(vocab_size=final.vocab_size))):
            arms[arm] = train_arm(one_stage(seeded, arm, shape, grown.flops), out / f"seed{seed}" / arm)
            r = arms[arm]
            say(f"seed {seed}: {arm:<7} {r.steps:>5} steps, {r.flops:.3e} FLOPs, held-out {r.final_eval_loss:.4f} ({r.seconds:.0f}s)")
        for arm in ARMS:
            runs[arm].append(arms[arm])
        reach = flops_to_reach(grown.curve, arms["scratch"].final_eval_loss)
        ratios.append(None if reach is None else reach / arms["scratch"].flops)
    reached = [r for r in ratios if r is not None]
    grown_losses = [r.final_eval_loss for r in runs["grown"]]
    return {
        "recipe": recipe.name,
        "seeds": seeds,
        "arms": {arm: [r.to_dict() for r in runs[arm]] for arm in ARMS},
        # Grown minus each other arm, seed by seed (the same data order and initial seed): < 0, grown is better.
        "grown_minus": {arm: [g - r.final_eval_loss for g, r in zip(grown_losses, runs[arm])] for arm in ARMS[1:]},
        "flops_ratio_per_seed": ratios,
        # The mean over seeds, only where every seed's grown run reached the scratch loss.
        "flops_ratio_to_scratch_loss": statistics.fmean(reached) if reached and len(reached) == len(ratios) else None,
    }


def _mean_std(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.4f}"
    return f"{statistics.fmean(values):.4f} ± {statistics.stdev(values):.4f}"


def format_table(result: dict) -> str:
    lines = [f"recipe {result['recipe']}, seeds {', '.join(map(str, result['seeds']))} (mean ± sample std over seeds)"]
    lines.append(f"{'arm':<8} {'steps':>7} {'tokens':>11} {'train FLOPs':>12} {'held-out loss':>18}   per seed")
    for arm in ARMS:
        rs = result["arms"][arm]
        losses = [r["final_eval_loss"] for r in rs]
        lines.append(
            f"{arm:<8} {round(statistics.fmean(r['steps'] for r in rs)):>7} {round(statistics.fmean(r['tokens'] for r in rs)):>11,} "
            f"{statistics.fmean(r['flops'] for r in rs):>12.3e} {_mean_std(losses):>18}   {' '.join(f'{x:.4f}' for x in losses)}"
        )
    for arm, deltas in result["grown_minus"].items():
        lines.append(f"grown - {arm}, paired by seed: {_mean_std(deltas)}   ({' '.join(f'{d:+.4f}' for d in deltas)})")
    per_seed = ", ".join("never" if r is None else f"{r:.3f}" for r in result["flops_ratio_per_seed"])
    ratio = result["flops_ratio_to_scratch_loss"]
    if ratio is None:
        lines.append(f"grown FLOPs to reach scratch's final loss / scratch FLOPs: not reached in every seed ({per_seed})")
    else:
        lines.append(f"grown FLOPs to reach scratch's final loss / scratch FLOPs: {ratio:.3f} (per seed {per_seed})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default=str(REPO / "recipes" / "tiny.yaml"), help="recipe file or packaged name (default recipes/tiny.yaml)")
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated recipe seeds (default 0,1,2)")
    parser.add_argument("--scale", type=float, default=1.0, help="multiply every stage's steps (quick runs)")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads for every run; 0 keeps the recipe's")
    parser.add_argument("--out", default="", help="keep every run directory here (default: a temporary directory)")
    parser.add_argument("--plot", default="", metavar="FILE.png", help="also draw the first seed's three arms with `growtrain plot`")
    parser.add_argument("--json", action="store_true", help="print only the JSON result on stdout")
    args = parser.parse_args(argv)
    try:
        seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError:
        parser.error(f"--seeds takes comma-separated integers, got {args.seeds!r}")
    if not seeds:
        parser.error("--seeds names no seed")
    recipe = quiet_recipe(scaled(load_recipe(args.recipe), args.scale), args.threads)
    say = (lambda msg: print(msg, file=sys.stderr, flush=True)) if args.json else (lambda msg: print(msg, flush=True))
    # The trainer's console lines go to stderr, so that stdout holds only the result.
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(args.out or tmp)
        with contextlib.redirect_stdout(sys.stderr):
            result = study(recipe, seeds, out, say)
        if args.plot:
            from growtrain.plot import plot_runs

            first = out / f"seed{seeds[0]}"
            plot_runs([first / arm for arm in ARMS], Path(args.plot), labels=[f"{arm} (seed {seeds[0]})" for arm in ARMS])
            say(f"figure: {args.plot}")
    if args.json:
        print(json.dumps(result))
    else:
        print(format_table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
