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
    python benchmarks/growth.py --schedules wsd,cosine       # also grow under each run-wide schedule
    python benchmarks/growth.py --seeds 0 --grow-at 0.25,0.5,0.75   # also: when to grow (first seed)
    python benchmarks/growth.py --fresh warmup_steps=50     # every grown arm with that `fresh` section
    python benchmarks/growth.py --json     # one JSON line (keys below)
    python benchmarks/growth.py --seeds 0 --scale 0.2        # quick: one seed, every stage's steps x0.2

Grown arms: `grown` is the recipe as written; `--schedules wsd,cosine` adds `grown-wsd` and
`grown-cosine`, the same recipe under one run-wide schedule (the first stage's warmup at the run's
start, the last stage's floor at its end, no re-warm at any growth; an arm equal to the recipe as
written is not run twice). They train the same steps at the same shapes, so one scratch and one
dense arm per seed serve them all. `--grow-at F,...` trains, on the first seed, the recipe with its
seed stage lasting F of the counted FLOPs and the later stages' steps scaled together to keep the
total (to rounding), one run per point. `--fresh KEY=VALUE,...` sets the `fresh` section
(recipe.FreshConfig: what the elements growth creates fresh get) of every growing stage of every
grown arm; the table then names the recipe NAME+fresh. The scratch and dense arms do not grow and
are the same with or without it.

Beside the final losses and the FLOPs ratio (per seed, their mean, and their max), the study
reports for every growth the held-out loss at the previous stage's end and the worst held-out loss
of the next 100 steps before the following growth ("excursion", relative), beside it the dense
arm's rise over the same steps (its `control`: the seed model, never grown, on the same batches in
the same order where every stage has the last stage's batch and sequence length, so what the
data and the LR do there without a growth), and how far sibling experts have moved apart at every
stage's end (growtrain/runtime/divergence.py). `--reread` trains nothing: it reads the runs an
earlier study kept with `--out` (run with the same recipe and options) and prints their results,
so a study's table can be printed again, or with what the study reports since. The JSON line holds
`arms`, `grown_minus`, `flops_ratio_per_seed`, `flops_ratio_to_scratch_loss`, `excursions`,
`sibling_divergence` (of the `grown` arm), `variants` (the same numbers per grown arm) and `grow_at`.

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

import yaml

from growtrain.checkpoint.store import CheckpointConfig, CheckpointManager, read_meta
from growtrain.model.config import ModelConfig
from growtrain.recipe import Recipe, RecipeError, RunScheduleConfig, ScheduleConfig, StageConfig, load_recipe, recipe_from_dict, to_plain
from growtrain.runtime.tracking import MetricsFile

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
    batch and sequence length, with one cosine schedule (the grown run's warmup and final floor)."""
    from growtrain.planning import model_flops_per_token
    from growtrain.runtime.progress import stage_step_costs

    last = recipe.stages[-1]
    (per_step,) = stage_step_costs([model], [last], model_flops_per_token)  # the trainer's count of a step
    steps = max(2, math.floor(budget_flops / per_step))
    # The grown run's warmup at its start and floor at its end, whether its schedule is run-wide or per stage.
    warmup, floor = (
        (recipe.schedule.warmup_steps, recipe.schedule.min_lr_ratio)
        if recipe.schedule.run_wide
        else (recipe.stages[0].schedule.warmup_steps, last.schedule.min_lr_ratio)
    )
    schedule = ScheduleConfig(kind="cosine", warmup_steps=min(warmup, steps - 1), min_lr_ratio=floor)
    stage = StageConfig(name=name, steps=steps, seq_len=last.seq_len, batch_size=last.batch_size, grad_accum=last.grad_accum, schedule=schedule)
    # The arm's one cosine whatever the grown run's schedule: one baseline for every grown arm.
    return replace(recipe, name=f"{recipe.name}-{name}", model=model, stages=(stage,), schedule=RunScheduleConfig())


def run_wide(recipe: Recipe, kind: str) -> Recipe:
    """`recipe` under one run-wide schedule of `kind` (wsd or cosine): the first stage's warmup at the
    run's start, the last stage's floor at its end, no re-warm at any growth."""
    first, last = recipe.stages[0].schedule, recipe.stages[-1].schedule
    if recipe.schedule.run_wide:
        warmup, floor = recipe.schedule.warmup_steps, recipe.schedule.min_lr_ratio
    else:
        warmup, floor = first.warmup_steps, last.min_lr_ratio
    stages = tuple(replace(s, schedule=ScheduleConfig()) for s in recipe.stages)
    return replace(recipe, stages=stages, schedule=RunScheduleConfig(kind=kind, warmup_steps=warmup, min_lr_ratio=floor))


def with_fresh(recipe: Recipe, spec: str) -> Recipe:
    """`recipe` with every growing stage's `fresh` section set from `spec` ("warmup_steps=50,lr_mult=0.5",
    keys of recipe.FreshConfig), validated as the recipe would be; named NAME+fresh in the table."""
    fields = {}
    for item in (x.strip() for x in spec.split(",") if x.strip()):
        key, eq, value = item.partition("=")
        if not eq:
            raise RecipeError([f"--fresh: '{item}' is not KEY=VALUE"], "--fresh")
        fields[key.strip()] = yaml.safe_load(value.strip())
    raw = to_plain(recipe)
    for stage in raw["stages"]:
        if stage.get("grow"):
            stage["fresh"] = {**stage.get("fresh", {}), **fields}
    return replace(recipe_from_dict(raw), name=f"{recipe.name}+fresh")


def grown_at(recipe: Recipe, fraction: float, vocab_size: int) -> Recipe:
    """`recipe` with its seed stage trained for `fraction` of the run's counted FLOPs before the
    first growth, the later stages' steps scaled together so that the run's FLOPs stay the same
    (to rounding: the same scratch and dense arms serve every point)."""
    from growtrain.planning import model_flops_per_token
    from growtrain.runtime.progress import stage_step_costs
    from growtrain.stages import plan_stage_models

    shapes = plan_stage_models(recipe.model.with_changes(vocab_size=vocab_size), [s.grow for s in recipe.stages])
    costs = stage_step_costs(shapes, recipe.stages, model_flops_per_token)
    budget = sum(c * s.steps for c, s in zip(costs, recipe.stages))
    first = max(2, round(fraction * budget / costs[0]))
    rest = sum(c * s.steps for c, s in zip(costs[1:], recipe.stages[1:]))
    scale = (budget - first * costs[0]) / rest
    if scale <= 0:
        raise ValueError(f"growing at {fraction:.0%} of the budget leaves no FLOPs for the later stages")
    stages = [replace(recipe.stages[0], steps=first)]
    for st in recipe.stages[1:]:
        steps = max(2, round(st.steps * scale))
        stages.append(replace(st, steps=steps, schedule=replace(st.schedule, warmup_steps=min(st.schedule.warmup_steps, steps - 1))))
    if not recipe.schedule.run_wide:
        stages[0] = replace(stages[0], schedule=replace(stages[0].schedule, warmup_steps=min(stages[0].schedule.warmup_steps, first - 1)))
    return replace(recipe, stages=tuple(stages))


@dataclass
class ArmRun:
    seed: int
    final_eval_loss: float
    flops: float
    tokens: int
    steps: int
    seconds: float
    curve: list[tuple[float, float]]  # (counted FLOPs, held-out loss) at every evaluation
    evals: list[tuple[int, float]]  # (step, held-out loss) at every evaluation
    excursions: list[dict]  # one per growth transition (held-out loss before it, worst in the next EXCURSION_STEPS)
    siblings: dict  # stage name -> {MoE layer: sibling numbers at the stage's end} (growtrain/runtime/divergence.py)

    def to_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k not in ("curve", "evals", "excursions", "siblings")}


EXCURSION_STEPS = 100


def excursions(recipe: Recipe, rows: list[dict]) -> list[dict]:
    """For every stage that grows: the held-out loss at the previous stage's end (right before the
    growth), the worst held-out loss in the next EXCURSION_STEPS steps, and the relative rise."""
    out = []
    for i, st in enumerate(recipe.stages):
        if i == 0 or not st.grow:
            continue
        before = [r for r in rows if r["stage"] == recipe.stages[i - 1].name and "eval_loss" in r]
        start = sum(s.steps for s in recipe.stages[:i])
        # up to the next growth: its own excursion is its own entry
        following = next((k for k in range(i + 1, len(recipe.stages)) if recipe.stages[k].grow), len(recipe.stages))
        stop = min(start + EXCURSION_STEPS, sum(s.steps for s in recipe.stages[:following]))
        after = [r["eval_loss"] for r in rows if "eval_loss" in r and start < r["step"] <= stop]
        if not before or not after:
            continue
        b, worst = before[-1]["eval_loss"], max(after)
        out.append({
            "transition": st.name,
            "operators": [g.op for g in st.grow],
            "step": start,
            "stop": stop,
            "before": b,
            "worst_after": worst,
            "relative": (worst - b) / b,
        })
    return out


def control(entry: dict, evals: list[tuple[int, float]]) -> dict | None:
    """The same window as an excursion, `entry`, read from an arm that never grows (the dense
    arm: the seed model on the same batches, in the same order): its held-out loss at the last
    evaluation at or before the growth's step, its worst in the window, and the relative rise; None
    where that arm has no evaluation before the window or none in it. What the grown arm rises
    beyond it is growth's own part; the rest is the data and the LR at those steps."""
    before = [loss for step, loss in evals if step <= entry["step"]]
    after = [loss for step, loss in evals if entry["step"] < step <= entry["stop"]]
    if not before or not after:
        return None
    b, worst = before[-1], max(after)
    return {"before": b, "worst_after": worst, "relative": (worst - b) / b}


def train_arm(recipe: Recipe, run_dir: Path, reread: bool = False) -> ArmRun:
    """Train `recipe` into `run_dir` and read its results back; with `reread`, only read them
    (a run that an earlier study kept with --out, trained by this recipe; `seconds` is then 0)."""
    t0 = time.perf_counter()
    if reread:
        if not (run_dir / "metrics.jsonl").is_file():
            raise SystemExit(f"--reread: {run_dir} holds no finished run (no metrics.jsonl); run the study with --out first")
    else:
        from growtrain.train import run  # imported late: `--help` stays instant

        run(recipe, run_dir, resume="never", log=lambda msg: None)
    seconds = 0.0 if reread else time.perf_counter() - t0
    rows = MetricsFile(run_dir / "metrics.jsonl").read()
    evaluated = [row for row in rows if "eval_loss" in row]
    evals = [(row["step"], row["eval_loss"]) for row in evaluated]
    curve = [(row["flops"], row["eval_loss"]) for row in evaluated]
    last, total = rows[-1], sum(s.steps for s in recipe.stages)
    if last["step"] != total or not evals:
        raise SystemExit(f"{run_dir}: the run ended at step {last['step']} of {total}, or was never evaluated")
    manager = CheckpointManager(run_dir, CheckpointConfig(), log=lambda msg: None)
    siblings = read_meta(manager.complete_checkpoints()[0]).get("sibling_divergence", {})
    return ArmRun(recipe.seed, evals[-1][1], last["flops"], last["tokens"], last["step"], seconds, curve, evals, excursions(recipe, rows), siblings)


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


def _ratio(curve, scratch: ArmRun) -> float | None:
    reach = flops_to_reach(curve, scratch.final_eval_loss)
    return None if reach is None else reach / scratch.flops


def _mean_if_all(ratios: list[float | None]) -> float | None:
    """The mean over seeds, only where every seed's run reached the scratch loss."""
    return statistics.fmean(ratios) if ratios and all(r is not None for r in ratios) else None


def variants_of(recipe: Recipe, schedules: list[str]) -> dict[str, Recipe]:
    """The grown arms: the recipe as written ('grown'), and under each run-wide schedule asked for
    that differs from it ('grown-wsd', 'grown-cosine')."""
    out = {"grown": recipe}
    for kind in schedules:
        other = run_wide(recipe, kind)
        if other != recipe:
            out[f"grown-{kind}"] = other
    return out


def study(recipe: Recipe, seeds: list[int], out: Path, say, schedules: list[str] = (), grow_at: list[float] = (), reread: bool = False) -> dict:
    variants = variants_of(recipe, list(schedules))
    runs: dict[str, list[ArmRun]] = {name: [] for name in [*variants, *ARMS[1:]]}
    sweep = []
    for seed in seeds:
        arms = {}
        for name, variant in variants.items():
            arms[name] = r = train_arm(replace(variant, seed=seed), out / f"seed{seed}" / name, reread)
            say(f"seed {seed}: {name:<13} {r.steps:>5} steps, {r.flops:.3e} FLOPs, held-out {r.final_eval_loss:.4f} ({r.seconds:.0f}s)")
        grown = arms["grown"]
        seeded = replace(recipe, seed=seed)
        final = final_model_config(out / f"seed{seed}" / "grown")
        for arm, shape in (("scratch", full_precision(final)), ("dense", seeded.model.with_changes(vocab_size=final.vocab_size))):
            arms[arm] = r = train_arm(one_stage(seeded, arm, shape, grown.flops), out / f"seed{seed}" / arm, reread)
            say(f"seed {seed}: {arm:<13} {r.steps:>5} steps, {r.flops:.3e} FLOPs, held-out {r.final_eval_loss:.4f} ({r.seconds:.0f}s)")
        for name, r in arms.items():
            runs[name].append(r)
        if seed == seeds[0]:  # when to grow: one seed per point
            for fraction in grow_at:
                point = grown_at(seeded, fraction, final.vocab_size)
                r = train_arm(point, out / f"seed{seed}" / f"grow-at-{fraction:g}", reread)
                ratio = _ratio(r.curve, arms["scratch"])
                say(f"seed {seed}: grow at {fraction:.0%}: {point.stages[0].steps} seed steps, {r.flops:.3e} FLOPs, held-out {r.final_eval_loss:.4f} ({r.seconds:.0f}s)")
                sweep.append({"fraction": fraction, "seed": seed, "seed_steps": point.stages[0].steps, **r.to_dict(), "flops_ratio": ratio})
    scratch, dense = runs["scratch"], runs["dense"]
    per_variant = {}
    for name in variants:
        ratios = [_ratio(r.curve, sc) for r, sc in zip(runs[name], scratch)]
        per_variant[name] = {
            "final_eval_loss": [r.final_eval_loss for r in runs[name]],
            "flops_ratio_per_seed": ratios,
            "flops_ratio_to_scratch_loss": _mean_if_all(ratios),
            "minus_dense": [r.final_eval_loss - d.final_eval_loss for r, d in zip(runs[name], dense)],
            # Each with the dense arm's rise over the same steps ("control"): the seed model on the same batches.
            "excursions": [{"seed": r.seed, **e, "control": control(e, d.evals)} for r, d in zip(runs[name], dense) for e in r.excursions],
            "sibling_divergence": {str(r.seed): r.siblings for r in runs[name]},
        }
    grown_losses = [r.final_eval_loss for r in runs["grown"]]
    return {
        "recipe": recipe.name,
        "seeds": seeds,
        "arms": {name: [r.to_dict() for r in rs] for name, rs in runs.items()},
        # Grown minus each other arm, seed by seed (the same data order and initial seed): < 0, grown is better.
        "grown_minus": {arm: [g - r.final_eval_loss for g, r in zip(grown_losses, runs[arm])] for arm in ARMS[1:]},
        "flops_ratio_per_seed": per_variant["grown"]["flops_ratio_per_seed"],
        "flops_ratio_to_scratch_loss": per_variant["grown"]["flops_ratio_to_scratch_loss"],
        "excursions": per_variant["grown"]["excursions"],
        # Per seed: stage name -> {MoE layer: sibling numbers at that stage's end}, of the grown arm.
        "sibling_divergence": {str(r.seed): r.siblings for r in runs["grown"]},
        "variants": per_variant,
        "grow_at": sweep,
    }


def _mean_std(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.4f}"
    return f"{statistics.fmean(values):.4f} ± {statistics.stdev(values):.4f}"


def _ratios(ratios: list[float | None], mean: float | None) -> str:
    per_seed = ", ".join("never" if r is None else f"{r:.3f}" for r in ratios)
    if mean is None:
        return f"not reached in every seed ({per_seed})"
    return f"{mean:.3f} (per seed {per_seed}; max {max(ratios):.3f})"


def format_table(result: dict) -> str:
    lines = [f"recipe {result['recipe']}, seeds {', '.join(map(str, result['seeds']))} (mean ± sample std over seeds)"]
    lines.append(f"{'arm':<13} {'steps':>7} {'tokens':>11} {'train FLOPs':>12} {'held-out loss':>18}   per seed")
    for arm, rs in result["arms"].items():
        losses = [r["final_eval_loss"] for r in rs]
        lines.append(
            f"{arm:<13} {round(statistics.fmean(r['steps'] for r in rs)):>7} {round(statistics.fmean(r['tokens'] for r in rs)):>11,} "
            f"{statistics.fmean(r['flops'] for r in rs):>12.3e} {_mean_std(losses):>18}   {' '.join(f'{x:.4f}' for x in losses)}"
        )
    for arm, deltas in result["grown_minus"].items():
        lines.append(f"grown - {arm}, paired by seed: {_mean_std(deltas)}   ({' '.join(f'{d:+.4f}' for d in deltas)})")
    for name, v in result["variants"].items():
        lines.append(f"{name} FLOPs to reach scratch's final loss / scratch FLOPs: {_ratios(v['flops_ratio_per_seed'], v['flops_ratio_to_scratch_loss'])}")
        if name != "grown":
            lines.append(f"{name} - dense, paired by seed: {_mean_std(v['minus_dense'])}")
    for name, v in result["variants"].items():
        if not v["excursions"]:
            continue
        lines.append(
            f"excursions of {name} (held-out loss before each growth, worst of the next {EXCURSION_STEPS} steps; "
            "the dense arm's rise over the same steps, on the same batches):"
        )
        by_transition: dict[str, list[dict]] = {}
        for e in v["excursions"]:
            by_transition.setdefault(e["transition"], []).append(e)
        for transition, es in by_transition.items():
            cells = " ".join(f"{e['before']:.3f}->{e['worst_after']:.3f}" for e in es)
            worst = max(e["relative"] for e in es)
            controls = [e.get("control") for e in es]
            dense = " ".join("-" if c is None else f"{c['relative']:+.1%}" for c in controls)
            lines.append(f"  {transition:<10} {'+'.join(es[0]['operators']):<40} worst {worst:+7.2%}   {cells}   (dense arm, same steps: {dense})")
    for name, v in result["variants"].items():
        per_stage: dict[str, list[dict]] = {}
        for stages in v["sibling_divergence"].values():
            for stage, layers in stages.items():
                per_stage.setdefault(stage, []).extend(layers.values())
        if per_stage:
            lines.append(f"siblings of {name} at each stage's end (all seeds and MoE layers):")
        for stage, ns in per_stage.items():
            picks = [n["topk_two_siblings"] for n in ns if n["topk_two_siblings"] is not None]
            lines.append(
                f"  {stage:<10} tied pairs {sum(n['tied_pairs'] for n in ns)}/{sum(n['pairs'] for n in ns)}, router cos mean "
                f"{statistics.fmean(n['router_cos_mean'] for n in ns):.3f} max {max(n['router_cos_max'] for n in ns):.4f}"
                + (f", top-k holds two siblings for {statistics.fmean(picks):.0%} of tokens" if picks else "")
            )
    for point in result["grow_at"]:
        ratio = "never" if point["flops_ratio"] is None else f"{point['flops_ratio']:.3f}"
        lines.append(
            f"grow at {point['fraction']:.0%} of the budget (seed {point['seed']}, {point['seed_steps']} seed steps): held-out "
            f"{point['final_eval_loss']:.4f}, FLOPs to scratch's loss / scratch's {ratio}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default=str(REPO / "recipes" / "tiny.yaml"), help="recipe file or packaged name (default recipes/tiny.yaml)")
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated recipe seeds (default 0,1,2)")
    parser.add_argument("--scale", type=float, default=1.0, help="multiply every stage's steps (quick runs)")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads for every run; 0 keeps the recipe's")
    parser.add_argument("--out", default="", help="keep every run directory here (default: a temporary directory)")
    parser.add_argument("--plot", default="", metavar="FILE.png", help="also draw the first seed's three arms with `growtrain plot`")
    parser.add_argument("--schedules", default="", help="also grow under these run-wide schedules (comma-separated: wsd, cosine), each its own arm")
    parser.add_argument("--grow-at", default="", help="on the first seed, also train the seed stage for these fractions of the budget before growing (e.g. 0.25,0.5,0.75)")
    parser.add_argument(
        "--fresh",
        default="",
        metavar="KEY=VALUE,...",
        help="train every grown arm with this `fresh` section on each growing stage (e.g. warmup_steps=50,lr_mult=0.5; recipe reference: stages.N.fresh)",
    )
    parser.add_argument(
        "--reread",
        action="store_true",
        help="train nothing: read the runs an earlier study kept in --out (the same recipe and options) and print their results",
    )
    parser.add_argument("--json", action="store_true", help="print only the JSON result on stdout")
    args = parser.parse_args(argv)
    if args.reread and not args.out:
        parser.error("--reread reads the runs of an earlier study's --out DIR: give --out")
    try:
        seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError:
        parser.error(f"--seeds takes comma-separated integers, got {args.seeds!r}")
    if not seeds:
        parser.error("--seeds names no seed")
    schedules = [k.strip() for k in args.schedules.split(",") if k.strip()]
    if any(k not in ("wsd", "cosine") for k in schedules):
        parser.error(f"--schedules takes wsd and/or cosine, got {args.schedules!r}")
    try:
        grow_at = [float(f) for f in args.grow_at.split(",") if f.strip()]
    except ValueError:
        parser.error(f"--grow-at takes comma-separated fractions, got {args.grow_at!r}")
    if any(not 0 < f < 1 for f in grow_at):
        parser.error(f"--grow-at fractions must lie strictly between 0 and 1, got {args.grow_at!r}")
    recipe = quiet_recipe(scaled(load_recipe(args.recipe), args.scale), args.threads)
    if args.fresh:
        try:
            recipe = with_fresh(recipe, args.fresh)
        except RecipeError as exc:
            parser.error(str(exc))
    say = (lambda msg: print(msg, file=sys.stderr, flush=True)) if args.json else (lambda msg: print(msg, flush=True))
    # The trainer's console lines go to stderr, so that stdout holds only the result.
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(args.out or tmp)
        with contextlib.redirect_stdout(sys.stderr):
            result = study(recipe, seeds, out, say, schedules, grow_at, args.reread)
        if args.plot:
            from growtrain.plot import plot_runs

            first = out / f"seed{seeds[0]}"
            names = list(result["arms"])
            plot_runs([first / arm for arm in names], Path(args.plot), labels=[f"{arm} (seed {seeds[0]})" for arm in names])
            say(f"figure: {args.plot}")
    if args.json:
        print(json.dumps(result))
    else:
        print(format_table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
