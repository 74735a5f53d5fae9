"""Where a run's numbers go: Weights & Biases (online, offline or off), a metrics.jsonl file in the
run directory, and the console (a progress bar plus one line per log interval)."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal


@dataclass(frozen=True)
class WandbConfig:
    """Weights & Biases settings (DESIGN.md §10)."""

    mode: Literal["auto", "online", "offline", "disabled"] = field(
        default="auto",
        metadata={"doc": "auto: online when an API key is configured (WANDB_API_KEY or ~/.netrc), else offline; disabled needs no network and no key."},
    )
    project: str = field(default="growtrain", metadata={"doc": "W&B project."})
    entity: str | None = field(default=None, metadata={"doc": "W&B entity (team or user); null uses your default."})
    name: str | None = field(default=None, metadata={"doc": "Display name; null uses the recipe name."})
    tags: tuple[str, ...] = field(default=(), metadata={"doc": "Tags attached to the run."})


@dataclass(frozen=True)
class TrackingConfig:
    """Metrics destinations."""

    wandb: WandbConfig = field(default_factory=WandbConfig, metadata={"doc": "Weights & Biases."})
    progress_bar: bool = field(default=True, metadata={"doc": "Show a progress bar on a terminal (log lines are printed either way)."})


def resolve_wandb_mode(mode: str) -> str:
    if mode != "auto":
        return mode
    if os.environ.get("WANDB_API_KEY"):
        return "online"
    netrc = Path.home() / ".netrc"
    if netrc.is_file() and "api.wandb.ai" in netrc.read_text(errors="ignore"):
        return "online"
    return "offline"


class Tracker:
    """One W&B run per training run; its id lives in the checkpoint and is reused on resume."""

    def __init__(self, cfg: TrackingConfig, run_dir: Path, run_name: str, log=print):
        self.cfg = cfg
        self.run_dir = run_dir
        self.mode = resolve_wandb_mode(cfg.wandb.mode)
        self.run_name = cfg.wandb.name or run_name
        self.log = log
        self._run = None
        self.run_id: str | None = None

    def start(self, resolved_recipe: dict, run_id: str | None, extra_config: dict) -> str | None:
        if self.mode == "disabled":
            return run_id
        import wandb  # lazy: slow import, optional at run time

        # Offline runs cannot resume on the W&B side: a resumed offline run starts a new local run
        # directory with the same id, which `wandb sync` merges later.
        self._run = wandb.init(
            project=self.cfg.wandb.project,
            entity=self.cfg.wandb.entity,
            name=self.run_name,
            tags=list(self.cfg.wandb.tags),
            id=run_id,  # None: W&B makes one, and we keep it in every checkpoint
            resume="allow",
            mode=self.mode,
            dir=str(self.run_dir),
            config={"recipe": resolved_recipe, **extra_config},
            settings=wandb.Settings(console="off", silent=True),
        )
        self.run_id = self._run.id
        where = self._run.dir if self.mode == "offline" else getattr(self._run, "url", "")
        self.log(f"W&B {self.mode}: run {self.run_id} ({where})")
        return self.run_id

    def log_metrics(self, metrics: dict, step: int) -> None:
        if self._run is not None:
            # An explicit step: W&B silently drops steps lower than the last one it saw.
            self._run.log(metrics, step=step)

    def replay(self, metrics: "MetricsFile") -> None:
        """On a resume in offline mode: a killed offline run loses what W&B had not flushed, and its
        resume is a new local run, so the durable history is replayed into it: the new one holds
        every step (`wandb sync` that one)."""
        if self.mode != "offline":
            return
        for row in metrics.read():
            self.log_metrics({k: v for k, v in row.items() if k not in ("step", "stage")}, row["step"])

    def log_transition(self, stage: str, records: list[dict], step: int) -> None:
        if self._run is None:
            return
        import wandb

        columns = ["stage", "operator", "exact", "passed", "max_abs_dlogits", "rel_l2", "cosine", "rel_dloss", "params_after"]
        rows = [[stage, r["operator"], r["exact"], r["passed"], *(r["metrics"].get(k) for k in columns[4:8]), r["params_after"]] for r in records]
        self._run.log({f"growth/{stage}": wandb.Table(columns=columns, data=rows)}, step=step)

    def finish(self, exit_code: int = 0) -> None:
        if self._run is not None:
            self._run.finish(exit_code=exit_code)
            self._run = None


class MetricsFile:
    """metrics.jsonl in the run directory: one JSON line per step. On resume it is cut back to the
    checkpoint's step, so the file always reads like a single uninterrupted run."""

    def __init__(self, path: Path):
        self.path = path

    def truncate_after(self, step: int) -> None:
        if not self.path.exists():
            return
        kept = [line for line in self.path.read_text().splitlines() if line.strip() and _step_of(line) <= step]
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        os.replace(tmp, self.path)

    def append(self, record: dict) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")

    def read(self) -> list[dict]:
        if not self.path.exists():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]


def _step_of(line: str) -> int:
    try:
        return int(json.loads(line).get("step", -1))
    except (ValueError, AttributeError):
        return 1 << 62  # a torn last line from a kill: drop it


class Console:
    """A progress bar over all steps of all stages, and one plain line per log interval."""

    def __init__(self, total_steps: int, done_steps: int, progress_bar: bool, quiet: bool = False):
        self.total = total_steps
        self.quiet = quiet  # ranks other than 0 under torchrun: rank 0 alone talks
        self._bar = None
        if progress_bar and not quiet and sys.stderr.isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=total_steps, initial=done_steps, unit="step", dynamic_ncols=True, leave=False)

    def write(self, line: str) -> None:
        if self.quiet:
            return
        if self._bar is not None:
            self._bar.write(line)
        else:
            print(line, flush=True)

    def advance(self, step: int) -> None:
        # The ETA is growtrain/runtime/progress.py's (weighted by each stage's cost per step).
        if self._bar is not None:
            self._bar.update(step - self._bar.n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def format_duration(seconds: float) -> str:
    if seconds != seconds:  # NaN: nothing measured yet
        return "?"
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}" if seconds >= 3600 else f"{seconds // 60}:{seconds % 60:02d}"
