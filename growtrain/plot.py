"""`growtrain plot`: a run's training and held-out loss against tokens and against counted FLOPs,
with its stage boundaries and growth operators marked, several runs on one figure.

It reads what a run leaves in its directory: metrics.jsonl (one line per step: loss, tokens,
counted FLOPs, eval_loss where the run evaluated) and the newest complete checkpoint's growth
history (each operator and the Δloss its invariance check measured on the probe batch).
matplotlib is an optional extra (`pip install 'growtrain[plot]'`), drawn with the Agg backend: no
display is needed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


class PlotError(Exception):
    """A user mistake or a missing extra: the CLI prints it and exits 2."""


@dataclass
class RunCurves:
    """What one run directory holds, as series to draw."""

    label: str
    tokens: list[int]
    flops: list[float] | None  # None: a run written before metrics.jsonl had `flops`
    loss: list[float]
    eval_tokens: list[int]
    eval_flops: list[float] | None
    eval_loss: list[float]
    # One per stage after the first: (stage name, tokens and FLOPs where it started, growth notes).
    boundaries: list[tuple[str, int, float | None, list[str]]] = field(default_factory=list)


def read_run(run_dir: Path, label: str | None = None) -> RunCurves:
    from growtrain.runtime.tracking import MetricsFile

    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise PlotError(f"{run_dir}: no such run directory")
    rows = [r for r in MetricsFile(run_dir / "metrics.jsonl").read() if not r.get("skipped")]
    if not rows:
        raise PlotError(f"{run_dir}: no metrics.jsonl with steps in it; is it a growtrain run directory (growtrain run --out DIR)?")
    has_flops = all("flops" in r for r in rows)
    evals = [r for r in rows if "eval_loss" in r]
    growth = _growth_notes(run_dir)
    boundaries = []
    for prev, row in zip(rows, rows[1:]):
        if row["stage"] != prev["stage"]:
            # Growth happens between the stages: at the last step of the one before.
            boundaries.append((row["stage"], prev["tokens"], prev["flops"] if has_flops else None, growth.get(row["stage"], [])))
    return RunCurves(
        label=label or run_dir.name,
        tokens=[r["tokens"] for r in rows],
        flops=[r["flops"] for r in rows] if has_flops else None,
        loss=[r["loss"] for r in rows],
        eval_tokens=[r["tokens"] for r in evals],
        eval_flops=[r["flops"] for r in evals] if has_flops else None,
        eval_loss=[r["eval_loss"] for r in evals],
        boundaries=boundaries,
    )


def _growth_notes(run_dir: Path) -> dict[str, list[str]]:
    """Per grown stage, one note per growth operator: its name and the Δloss it caused on the
    probe batch (the transition's own whole-stage record is left out)."""
    from growtrain.checkpoint.store import CheckpointConfig, CheckpointManager, read_meta

    found = CheckpointManager(run_dir, CheckpointConfig(), log=lambda msg: None).complete_checkpoints()
    if not found:
        return {}
    notes: dict[str, list[str]] = {}
    for record in read_meta(found[0]).get("growth_history", []):
        if record.get("operator") == "transition":
            continue
        m = record.get("metrics", {})
        dloss = m.get("loss_after", 0.0) - m.get("loss_before", 0.0)
        notes.setdefault(record["stage"], []).append(f"{record['operator']} Δloss {dloss:+.1e}")
    return notes


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise PlotError("growtrain plot needs matplotlib: pip install 'growtrain[plot]' (or pip install matplotlib)") from None
    matplotlib.use("Agg")  # files only, never a window
    import matplotlib.pyplot as plt

    return plt


def build_figure(runs: list[RunCurves]):
    """Two panels, loss against tokens and against counted FLOPs (the second only when every run
    has FLOPs); per run a thin training-loss line and a held-out line with markers, in one colour,
    and a dashed line at each stage boundary named after the stage. Under the panels, per run, each
    grown stage's operators with the Δloss their invariance checks measured."""
    plt = _pyplot()
    with_flops = all(r.flops is not None for r in runs)
    footer = [f"{run.label}: " + "; ".join(f"{stage}: {', '.join(notes) or 'no growth'}" for stage, _, _, notes in run.boundaries)
              for run in runs if run.boundaries]  # fmt: skip
    fig, axes = plt.subplots(1, 2 if with_flops else 1, figsize=(13 if with_flops else 7, 5 + 0.22 * len(footer)), squeeze=False)
    panels = [("tokens", "tokens seen")] + ([("flops", "counted training FLOPs")] if with_flops else [])
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    held = [x for r in runs for x in r.eval_loss] or [x for r in runs for x in r.loss]
    for ax, (axis, title) in zip(axes[0], panels):
        for i, run in enumerate(runs):
            color = colors[i % len(colors)]
            x = run.tokens if axis == "tokens" else run.flops
            ax.plot(x, run.loss, color=color, alpha=0.35, linewidth=0.8, label=f"{run.label}: training")
            if run.eval_loss:
                ex = run.eval_tokens if axis == "tokens" else run.eval_flops
                ax.plot(ex, run.eval_loss, color=color, marker="o", markersize=3, linewidth=1.6, label=f"{run.label}: held-out")
            for j, (stage, tokens, flops, _) in enumerate(run.boundaries):
                at = tokens if axis == "tokens" else flops
                ax.axvline(at, color=color, linestyle="--", linewidth=0.8, alpha=0.7)
                # Staggered, so that close boundaries (a short stage) keep readable names.
                ax.annotate(stage, (at, 1.0 - 0.05 * (j % 3)), xycoords=("data", "axes fraction"), xytext=(3, -4),
                            textcoords="offset points", va="top", fontsize=7, color=color)
        ax.set_xlabel(title)
        ax.set_ylabel("loss (nats per token)")
        # The first steps' losses (the uniform guess) would flatten everything after them.
        ax.set_ylim(min(min(held), min(x for r in runs for x in r.loss)) * 0.97, max(held) * 1.15)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7, loc="lower left")
    if footer:
        fig.text(0.01, 0.01, "growth (Δloss on the probe batch):\n" + "\n".join(footer), fontsize=7, va="bottom", family="monospace")
    fig.tight_layout(rect=(0, 0.04 * (len(footer) + 1) if footer else 0, 1, 1))
    return fig


def run_labels(run_dirs: list[Path]) -> list[str]:
    """Legend names: the folder names, with runs of one name (seed0/grown, seed1/grown) told apart
    by their parent folder."""
    names = [Path(d).name for d in run_dirs]
    return [str(Path(*Path(d).parts[-2:])) if names.count(n) > 1 else n for d, n in zip(run_dirs, names)]


def plot_runs(run_dirs: list[Path], out: Path, labels: list[str] | None = None) -> Path:
    if labels is not None and len(labels) != len(run_dirs):
        raise PlotError(f"{len(labels)} label(s) for {len(run_dirs)} run(s)")
    runs = [read_run(d, label) for d, label in zip(run_dirs, labels or run_labels(run_dirs))]
    fig = build_figure(runs)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    _pyplot().close(fig)
    return out
