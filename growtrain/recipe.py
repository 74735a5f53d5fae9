"""The recipe: a typed, frozen description of a whole run, loaded strictly from YAML.

Every component owns its config dataclass (model/config.py, data/corpus.py, checkpoint/store.py, runtime/tracking.py);
this module composes them, adds the stage list, and validates a YAML document against the
composition. Validation collects every problem before raising, names the YAML line where it can,
and suggests the nearest valid key for a typo (STYLE.md item 2).
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from growtrain.checkpoint.store import CheckpointConfig
from growtrain.data.corpus import DataConfig, resolve_source_path, resolve_tokenizer_path
from growtrain.model.config import ModelConfig, MoEConfig
from growtrain.optim.adamw import OptimizerConfig
from growtrain.runtime.tracking import TrackingConfig


class RecipeError(Exception):
    """A recipe that cannot run; `problems` lists every reason, one line each."""

    def __init__(self, problems: list[str], source: str = "recipe"):
        self.problems = problems
        self.source = source
        super().__init__(f"{source}: {len(problems)} problem(s)\n" + "\n".join(f"  - {p}" for p in problems))


# ---------------------------------------------------------------------------------------------
# Component configs owned by the recipe itself


@dataclass(frozen=True)
class ScheduleConfig:
    """Learning-rate schedule of one stage; it re-warms from zero at the stage start. Under a
    run-wide schedule (top-level `schedule.kind` wsd or cosine) only `warmup_steps` and `peak_lr`
    are read: a short re-warm from zero to `peak_lr` (0: the run's LR there), then the run's curve."""

    kind: Literal["cosine", "wsd", "constant"] = field(
        default="cosine", metadata={"doc": "cosine: warmup then cosine decay; wsd: warmup-stable-decay; constant: warmup then flat."}
    )
    peak_lr: float = field(
        default=0.0, metadata={"doc": "Peak LR of the stage; 0 uses optimizer.lr (under a run-wide schedule: the re-warm's peak; 0 uses the run's LR there).", "ge": 0.0}
    )
    warmup_steps: int = field(
        default=0, metadata={"doc": "Linear re-warmup steps at the stage start (under a run-wide schedule: the stage's re-warm, 0 for none).", "ge": 0}
    )
    min_lr_ratio: float = field(default=0.1, metadata={"doc": "Final LR as a fraction of the peak.", "ge": 0.0, "le": 1.0})
    decay_fraction: float = field(
        default=0.2, metadata={"doc": "wsd only: fraction of the stage spent in the final linear decay.", "gt": 0.0, "le": 1.0}
    )


@dataclass(frozen=True)
class RunScheduleConfig:
    """Learning-rate schedule over the whole run (the top-level `schedule:`). With kind `stages`
    (the default) every stage runs its own schedule; with `wsd` or `cosine` the LR is one curve
    over the run's total steps, growth happens at whatever LR the run has reached, and a stage's
    own `schedule` may only ask for a short re-warm (its `warmup_steps`, up to its `peak_lr`)."""

    kind: Literal["stages", "wsd", "cosine"] = field(
        default="stages",
        metadata={
            "doc": "stages: each stage its own schedule (stages.N.schedule); wsd: one warmup at the start, the peak "
            "(optimizer.lr) held through every growth, one linear decay at the end; cosine: one warmup, then one "
            "cosine decay over the run's total steps."
        },
    )
    warmup_steps: int = field(default=0, metadata={"doc": "wsd/cosine: linear warmup steps at the run's start.", "ge": 0})
    min_lr_ratio: float = field(default=0.1, metadata={"doc": "wsd/cosine: the run's final LR as a fraction of optimizer.lr.", "ge": 0.0, "le": 1.0})
    decay_fraction: float = field(
        default=0.2, metadata={"doc": "wsd only: fraction of the run's total steps spent in the final linear decay.", "gt": 0.0, "le": 1.0}
    )

    @property
    def run_wide(self) -> bool:
        return self.kind != "stages"

    def decay_steps(self, total: int) -> int:
        return decay_steps(total, self.decay_fraction)

    def lr(self, step: int, total: int, peak: float) -> float:
        """LR at run-wide optimizer step `step` (0-based) of a run of `total` steps."""
        return schedule_lr(self.kind, step, total, self.warmup_steps, peak, self.min_lr_ratio, self.decay_fraction)


# A stage's schedule keys that a run-wide schedule reads (its re-warm); the others would be ignored.
REWARM_KEYS = ("warmup_steps", "peak_lr")


@dataclass(frozen=True)
class GrowthStep:
    """One growth operator applied at a stage start: `{op: NAME, ...its arguments}` in YAML."""

    op: str = field(metadata={"doc": "Operator name (one of the growth operators below); its arguments sit beside it."})
    args: Any = field(metadata={"doc": "The operator's own frozen args dataclass."})

    def to_plain(self) -> dict:
        return {"op": self.op, **to_plain(self.args)}


@dataclass(frozen=True)
class FreshConfig:
    """What the elements a stage's growth creates fresh get: their LR, a warm-up, mapped or reset state.

    Fresh: new parameters (a deepen's new blocks, an upcycled layer's router, LoRA adapters), new
    rows or columns of widened matrices, the neurons a drop-upcycle or clone redraws. Copied and
    carried elements keep the optimizer state growth mapped for them unless `state: fresh`."""

    lr_mult: float = field(
        default=1.0,
        metadata={
            "doc": "LR multiplier of the elements this stage's growth creates fresh, kept for the rest of the run (later "
            "growth carries it like any multiplier); 1: the LR of the others.",
            "gt": 0.0,
        },
    )
    warmup_steps: int = field(
        default=0,
        metadata={
            "doc": "Over the stage's first N steps, the LR of every element that has taken no step before this stage "
            "ramps linearly, 1/N of it on the first step, all of it from step N on; the others train at the run's LR "
            "throughout. 0: no ramp.",
            "ge": 0,
        },
    )
    state: Literal["mapped", "fresh"] = field(
        default="mapped",
        metadata={
            "doc": "mapped: growth maps the optimizer state of the elements it copies or carries (DESIGN.md §7: moments "
            "/S and /S², step counts kept); fresh: the whole optimizer state is reset at the growth (moments zero, step "
            "counts 0; the LR, weight-decay, epsilon and clip-norm multipliers of the grown parametrization are kept), so "
            "every element is fresh and `warmup_steps` ramps all of them."
        },
    )

    @property
    def is_default(self) -> bool:
        return self == FreshConfig()

    def describe(self) -> str:
        """One line for the console: what this section does at the stage's growth."""
        parts = []
        if self.state == "fresh":
            parts.append("optimizer state reset (moments zero, step counts 0, multipliers kept)")
        if self.lr_mult != 1.0:
            parts.append(f"the elements growth created fresh train at {self.lr_mult:g} x the LR")
        if self.warmup_steps:
            if self.state == "fresh":
                who = "every element's LR"
            elif self.lr_mult != 1.0:
                who = "their LR"
            else:
                who = "the LR of the elements growth created fresh"
            parts.append(f"{who} ramped over the stage's first {self.warmup_steps} step(s)")
        return "; ".join(parts)

    def ramp(self, step: int) -> float | None:
        """The LR factor of the stage's fresh elements at its optimizer step `step` (0-based); None
        once the ramp is over (or without one)."""
        if step >= self.warmup_steps:
            return None
        return (step + 1) / self.warmup_steps


@dataclass(frozen=True)
class StageConfig:
    """One training stage: the growth applied at its start, then `steps` optimizer steps."""

    name: str = field(default="", metadata={"doc": "Unique stage name (shown in logs and checkpoints)."})
    steps: int = field(default=100, metadata={"doc": "Optimizer steps in this stage.", "ge": 1})
    seq_len: int = field(default=128, metadata={"doc": "Tokens per sequence.", "ge": 2})
    batch_size: int = field(
        default=16,
        metadata={
            "doc": "Sequences per micro-batch over all processes: under torchrun each of N ranks trains batch_size / N of "
            "them (so it must divide by N), and a step is batch_size x seq_len x grad_accum tokens whatever N is; "
            "`growtrain plan` reads it the same way.",
            "ge": 1,
        },
    )
    grad_accum: int = field(default=1, metadata={"doc": "Micro-batches per optimizer step.", "ge": 1})
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig, metadata={"doc": "LR schedule of the stage."})
    grow: tuple[GrowthStep, ...] = field(
        default=(),
        metadata={"doc": "Growth operators applied, in order, before the stage trains: a list of {op: NAME, ...args}."},
    )
    fresh: FreshConfig = field(
        default_factory=FreshConfig,
        metadata={"doc": "What the elements this stage's growth creates fresh get (LR multiplier, warm-up, mapped or fresh optimizer state)."},
    )

    def lr(self, step: int, base_lr: float) -> float:
        """LR at optimizer step `step` (0-based) of this stage: the stage's schedule as a lookup."""
        s = self.schedule
        return schedule_lr(s.kind, step, self.steps, s.warmup_steps, s.peak_lr or base_lr, s.min_lr_ratio, s.decay_fraction)


def schedule_lr(kind: str, step: int, total: int, warmup: int, peak: float, min_lr_ratio: float, decay_fraction: float) -> float:
    """LR at step `step` (0-based) of a `total`-step curve: a linear warmup over `warmup` steps to
    `peak`, then flat (constant), one cosine (cosine) or flat and a linear decay over the last
    `decay_fraction` of the steps (wsd), to `min_lr_ratio` of the peak on the last step."""
    if step < warmup:
        return peak * (step + 1) / warmup
    floor = peak * min_lr_ratio
    if kind == "constant":
        return peak
    if kind == "cosine":
        progress = min(1.0, (step - warmup + 1) / max(1, total - warmup))
        return floor + 0.5 * (peak - floor) * (1.0 + math.cos(math.pi * progress))
    decay = decay_steps(total, decay_fraction)
    decay_start = total - decay
    if step < decay_start:
        return peak
    return peak - (peak - floor) * min(1.0, (step - decay_start + 1) / decay)


def decay_steps(total: int, decay_fraction: float) -> int:
    """Steps of a wsd schedule's final decay over `total` steps (at least one)."""
    return max(1, round(total * decay_fraction))


def _expert_backend_problem(name: str) -> str | None:
    from growtrain.model.expert_backends import expert_backend_setting_problem  # imported lazily: torch

    return expert_backend_setting_problem(name)


@dataclass(frozen=True)
class TrainConfig:
    """Loop settings shared by all stages."""

    precision: Literal["fp32", "bf16"] = field(
        default="fp32", metadata={"doc": "fp32, or bf16 autocast for the branches (streams and router stay fp32)."}
    )
    log_every: int = field(default=10, metadata={"doc": "Console line every N steps (W&B gets every step).", "ge": 1})
    eval_every: int = field(default=100, metadata={"doc": "Held-out loss every N steps and at each stage end; 0: stage ends only.", "ge": 0})
    eval_batches: int = field(default=4, metadata={"doc": "Held-out batches per evaluation.", "ge": 1})
    threads: int = field(default=0, metadata={"doc": "torch CPU threads; 0 keeps torch's default.", "ge": 0})
    expert_backend: str = field(
        default="auto",
        metadata={
            "doc": "Kernels of the routed experts: auto (the Triton kernels on a CUDA GPU, full precision and NF4 + LoRA; "
            "on a Hopper GPU in bf16 their products run through torch._grouped_mm, NF4 dequantized first; the PyTorch "
            "reference elsewhere), reference, or triton (on the CPU it logs that it runs the reference). A runtime "
            "setting: no part of the model's shape, so a resume may change it.",
            "check": _expert_backend_problem,
        },
    )
    device: Literal["auto", "cpu", "cuda"] = field(
        default="auto",
        metadata={
            "doc": "Where to train: auto (cuda:LOCAL_RANK where CUDA is available, else cpu), cpu or cuda. A runtime "
            "choice: a resume may change it (a CPU checkpoint resumes on a GPU and back)."
        },
    )
    grow_on: Literal["auto", "device", "host"] = field(
        default="auto",
        metadata={
            "doc": "Where a stage's growth runs: device (where it trains), host (the model and optimizer state move to "
            "host memory for the growth and its checks, their collectives go through a gloo group, and everything moves "
            "back before the stage's first step), or auto (the host when growth's planned peak per rank, as "
            "`growtrain plan` computes it, is over 90% of the GPU's memory; the device otherwise, and always on a CPU). "
            "A runtime choice: a resume may change it."
        },
    )
    deterministic: bool = field(
        default=False,
        metadata={
            "doc": "Deterministic GPU kernels (torch.use_deterministic_algorithms; CUBLAS_WORKSPACE_CONFIG is set when "
            "unset), so that a resumed run repeats an uninterrupted one's bits on a GPU, at some cost in speed; an op "
            "with no deterministic version stops the run naming itself. CPU runs are deterministic either way. A runtime "
            "choice: a resume may change it."
        },
    )


@dataclass(frozen=True)
class DistributedConfig:
    """Settings used when launched by torchrun / accelerate launch (ignored in a single process)."""

    combine: Literal["overlapped", "serial"] = field(
        default="overlapped",
        metadata={"doc": "Expert combine: overlapped (results sent as each rank's chunk finishes) or serial (one all-to-all after compute); same bits."},
    )
    timeout_s: int = field(
        default=600, metadata={"doc": "A collective waiting longer than this on a stuck rank fails the run (seconds).", "ge": 10}
    )
    layout: Literal["colocated", "af"] = field(
        default="colocated",
        metadata={
            "doc": "colocated: every rank holds a share of the experts and trains its rows of the batch (expert parallelism). "
            "af: attention/expert disaggregation: the first attention_ranks ranks hold everything but the routed experts "
            "(data parallel among themselves), the others the routed experts (docs/scale.md, AF mode). A runtime choice: a resume "
            "may change it (checkpoints load in either layout)."
        },
    )
    attention_ranks: int | Literal["auto"] = field(
        default=1,
        metadata={
            "doc": "layout: af: how many ranks (the first ones) are attention ranks; the rest hold the experts. auto: the "
            "planner's fastest split that fits (growtrain plan, last stage) on the `hardware` preset with as many GPUs as "
            "processes, among those the recipe divides over.",
            "ge": 1,
        },
    )
    hardware: str = field(
        default="h100-80gb",
        metadata={"doc": "The planner's hardware preset for attention_ranks: auto (a100-80gb, h100-80gb, h200-141gb, b200)."},
    )
    af_schedule: Literal["sequential", "pingpong", "interleaved"] = field(
        default="sequential",
        metadata={
            "doc": "layout: af: sequential: every attention rank makes each MoE call together, the expert ranks serve them "
            "at once (each side idles while the other computes; the co-located run's numbers). pingpong: the attention "
            "ranks in two lanes (even and odd ranks, 2+ attention ranks), the expert ranks serving one lane's call while "
            "the other lane computes its attention; the balance loss then takes each lane's load. interleaved: two "
            "micro-batches in flight on every attention rank (a step's grad_accum micro-batches in pairs: grad_accum 2+ "
            "in every MoE stage, coupling blocks with model.reversible on), one computing its attention while the expert ranks serve the "
            "other's call and take in the next (the transfers overlapping both sides' compute: the planner's AF model); "
            "the co-located run's numbers (docs/scale.md, AF mode)."
        },
    )


@dataclass(frozen=True)
class InvarianceConfig:
    """Thresholds of the checks run around every growth operator (DESIGN.md §8)."""

    exact_rel_tol: float = field(
        default=1e-4, metadata={"doc": "Exact operators: max relative L2 change of the probe logits.", "gt": 0.0}
    )
    max_rel_dloss: float = field(
        default=0.03, metadata={"doc": "Approximate operators: max |Δloss| / loss on the probe batch.", "gt": 0.0}
    )
    min_cosine: float = field(default=0.995, metadata={"doc": "Approximate operators: min cosine of probe logits.", "ge": -1.0, "le": 1.0})
    max_router_kl: float = field(default=0.02, metadata={"doc": "Approximate operators: max per-layer router KL.", "ge": 0.0})
    dynamics: bool = field(
        default=True,
        metadata={
            "doc": "After each operator and for the whole transition, take one optimizer step (the run's optimizer, clip and "
            "the new stage's first LR) from the old and from the new model and state on the probe batch, and compare the "
            "change of the logits; also check that every new trainable element can get a gradient. Costs 3 to 4 forward+backward and 2 forward passes of the probe batch "
            "per operator (docs/growth.md, Growth checks); false turns both off (with a warning)."
        },
    )
    values: bool = field(
        default=True,
        metadata={
            "doc": "After each operator, recompute from its provenance every copied element (β · source, bitwise in fp32), "
            "every copy count S, the redrawn neuron counts, and for NF4 experts bitsandbytes' dequantization of the codes "
            "and its round-trip error on the same weights (stages/values.py); false turns it off (with a warning)."
        },
    )
    stream: bool = field(
        default=True,
        metadata={
            "doc": "Apply a run of split_experts / clone_experts steps and the quantize_experts right after them one MoE "
            "layer at a time (stages/streaming.py): their full-precision results exist for one layer only; each layer's "
            "operators are checked on that layer (values, output and router change), the composed provenance and the "
            "whole model once (old vs quantized: function, structure, one-step dynamics, trainability). false: each "
            "operator on the whole model with its own whole-model checks (the cloned fp32 model and its optimizer state "
            "then exist whole: at the 120B recipe's experts stage ~203 GB per rank over 8 instead of ~66 GB)."
        },
    )
    dynamics_exact_tol: float = field(
        default=1e-4,
        metadata={
            "doc": "Exact operators: max relative L2 difference of the one-step logit changes (on the exact subset), plus 10x "
            "the fp32 rounding of the logits relative to the step (a small first LR is resolved no finer), plus 10x the "
            "measured resolution: the distance of the ungrown model's twin (every weight element moved one ulp with "
            "probability 1/2, 8-bit moments of copied tensors requantized in shifted blocks) from its own step. The clip "
            "norm must agree within 1e-5 + 10x the larger of the twin's clip-norm and step distances. An exact operator these weights keep from "
            "being exact (a split whose top-k can cut a group of tied siblings) is judged by the approximate bars, with "
            "the reason in its record and on the console.",
            "gt": 0.0,
        },
    )
    dynamics_max_rel: float = field(
        default=1.0,
        metadata={
            "doc": "Approximate operators: max relative L2 difference of the one-step logit changes (1: the grown model's "
            "step may be no further from the ungrown model's step than that step is from not stepping).",
            "gt": 0.0,
        },
    )
    probe_batch_size: int = field(default=4, metadata={"doc": "Sequences in the held-out probe batch.", "ge": 1})
    probe_seq_len: int = field(default=64, metadata={"doc": "Tokens per probe sequence.", "ge": 2})


@dataclass(frozen=True)
class Recipe:
    """A whole run: seed model, data, optimizer, stages, checkpoints, tracking."""

    name: str = field(default="run", metadata={"doc": "Run name (W&B name default and log prefix)."})
    seed: int = field(default=0, metadata={"doc": "Seed of init, data order and growth noise.", "ge": 0})
    model: ModelConfig = field(default_factory=ModelConfig, metadata={"doc": "Shape of the seed (first-stage) model."})
    data: DataConfig = field(default_factory=DataConfig, metadata={"doc": "Training text and tokenizer."})
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig, metadata={"doc": "Optimizer settings."})
    train: TrainConfig = field(default_factory=TrainConfig, metadata={"doc": "Loop settings."})
    stages: tuple[StageConfig, ...] = field(default=(), metadata={"doc": "The stages, in order (at least one)."})
    schedule: RunScheduleConfig = field(
        default_factory=RunScheduleConfig, metadata={"doc": "Run-wide LR schedule (default: each stage its own, stages.N.schedule)."}
    )
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig, metadata={"doc": "Checkpoint policy."})
    invariance: InvarianceConfig = field(default_factory=InvarianceConfig, metadata={"doc": "Growth check thresholds."})
    tracking: TrackingConfig = field(default_factory=TrackingConfig, metadata={"doc": "W&B and console."})
    distributed: DistributedConfig = field(
        default_factory=DistributedConfig, metadata={"doc": "Expert parallelism under torchrun (docs/scale.md, Expert parallelism)."}
    )

    @property
    def total_steps(self) -> int:
        return sum(s.steps for s in self.stages)

    def lr(self, stage: int, step: int) -> float:
        """LR of optimizer step `step` (0-based) of stage `stage`: a pure function of the position,
        so a resumed run repeats it."""
        st = self.stages[stage]
        if not self.schedule.run_wide:
            return st.lr(step, self.optimizer.lr)
        at = sum(s.steps for s in self.stages[:stage]) + step
        run_lr = self.schedule.lr(at, self.total_steps, self.optimizer.lr)
        w = st.schedule.warmup_steps
        if step < w:
            return (st.schedule.peak_lr or run_lr) * (step + 1) / w
        return run_lr


# ---------------------------------------------------------------------------------------------
# Loading


def packaged_recipes() -> dict[str, Path]:
    """The recipes shipped in the package (recipes/*.yaml, installed as growtrain.recipes), by name."""
    from importlib.resources import files

    folder = files("growtrain.recipes")
    return {Path(e.name).stem: Path(str(e)) for e in folder.iterdir() if e.name.endswith((".yaml", ".yml"))}


def find_recipe(path: str | Path) -> Path:
    """A recipe file: `path` itself, or, for a bare name (`tiny`, `120b`) that is no file here, the
    packaged recipe of that name."""
    path = Path(path)
    if path.is_file():
        return path
    if path.parent == Path(".") and path.suffix in ("", ".yaml", ".yml"):
        shipped = packaged_recipes()
        if path.stem in shipped:
            return shipped[path.stem]
        names = ", ".join(sorted(shipped))
        raise RecipeError([f"no such recipe file: {path}, and no packaged recipe of that name (packaged: {names})"], str(path))
    raise RecipeError([f"no such recipe file: {path}"], str(path))


def load_recipe(path: str | Path, overrides: list[str] = ()) -> Recipe:
    """Read, override (`key.path=value`), and validate a recipe file; raise RecipeError with every problem.

    Relative data paths (data.source, data.tokenizer) are resolved against the recipe file's
    folder, those given with --set against the working directory, and the recipe keeps them
    resolved: a run means the same files wherever it is resumed or inspected from."""
    path = find_recipe(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise RecipeError([f"cannot read the recipe file: {exc}"], str(path)) from None
    try:
        node = yaml.compose(text)
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        what = getattr(exc, "problem", None) or str(exc).replace("\n", " ")
        raise RecipeError([f"not valid YAML{where}: {what}"], str(path)) from None
    if raw is None:
        raw = {}
    lines = _line_map(node) if node is not None else {}
    problems: list[str] = _duplicate_keys(node) if node is not None else []
    if not isinstance(raw, dict):
        raise RecipeError(["the top level must be a mapping of sections (model, data, stages, ...)"], str(path))
    _resolve_data_paths(raw, path.resolve().parent)
    for item in overrides:
        _apply_override(raw, item, problems, lines)
    _resolve_data_paths(raw, Path.cwd())  # what --set gave (the file's paths are absolute by now)
    _apply_init_from(raw, problems)
    recipe = parse_recipe(raw, problems, lines)
    if problems:
        raise RecipeError(problems, str(path))
    return recipe


def _resolve_data_paths(raw: dict, base: Path) -> None:
    model = raw.get("model")
    if isinstance(model, dict) and isinstance(model.get("init_from"), str) and model["init_from"]:
        model["init_from"] = str((base / Path(model["init_from"]).expanduser()).resolve())
    data = raw.get("data")
    if not isinstance(data, dict):
        return
    for key, resolve in (("source", resolve_source_path), ("tokenizer", resolve_tokenizer_path)):
        if isinstance(data.get(key), str):
            data[key] = resolve(data[key], base)


def _apply_init_from(raw: dict, problems: list[str]) -> None:
    """model.init_from: the shape fields from the checkpoint's config.json (a recipe value that
    disagrees is a problem), block residual, and its tokenizer.json as data.tokenizer unless the
    recipe names one (growtrain/hf/seed_import.py)."""
    model = raw.get("model")
    if not isinstance(model, dict) or not isinstance(model.get("init_from"), str) or not model["init_from"]:
        return
    from growtrain.hf.seed_import import ImportRefused, shape_fields, sliding_window

    path = Path(model["init_from"])
    try:
        fields = shape_fields(path)
        window = sliding_window(path)
    except ImportRefused as exc:
        problems.append(f"model.init_from: {exc}")
        return
    for key, value in fields.items():
        given = model.get(key)
        if given is not None and given != value and not (key == "vocab_size" and given == 0):
            problems.append(f"model.{key}: {given!r}, but model.init_from's config.json says {value!r}; leave it unset (init_from sets the shape)")
        model[key] = value
    if model.get("moe_layers") or model.get("dense_lora"):
        problems.append("model.init_from: the imported seed is the checkpoint's dense model; grow it into an MoE (upcycle_moe) or add LoRA in a stage")
    data = raw.setdefault("data", {})
    if isinstance(data, dict) and "tokenizer" not in data and (path / "tokenizer.json").is_file():
        data["tokenizer"] = str(path)
    for i, stage in enumerate(raw.get("stages") or []):
        if window and isinstance(stage, dict) and isinstance(stage.get("seq_len"), int) and stage["seq_len"] > window:
            problems.append(f"stages.{i}.seq_len: {stage['seq_len']} is longer than model.init_from's attention window ({window}); growtrain attends over the whole sequence")


def without_moved_keys(plain: dict) -> dict:
    """A copy of a recipe's plain form (a checkpoint's meta["recipe"]) without the keys that moved
    elsewhere since it was written: the expert backend, now train.expert_backend, used to be a
    model.moe field and an upcycle_moe argument. Lets resume, inspect and generate read old runs."""
    out = copy.deepcopy(plain)
    if isinstance((out.get("model") or {}).get("moe"), dict):
        out["model"]["moe"].pop("expert_backend", None)
    for stage in out.get("stages") or []:
        for step in (stage.get("grow") or []) if isinstance(stage, dict) else []:
            if isinstance(step, dict):
                step.pop("expert_backend", None)
    return out


def recipe_from_dict(raw: dict) -> Recipe:
    problems: list[str] = []
    recipe = parse_recipe(raw, problems, {})
    if problems:
        raise RecipeError(problems)
    return recipe


def parse_recipe(raw: dict, problems: list[str], lines: dict) -> Recipe:
    ctx = _Ctx(problems, lines)
    recipe = ctx.build(Recipe, raw, ())
    if recipe is not None:
        _check_recipe(recipe.model, list(recipe.stages), ctx)
        _check_schedule(recipe.schedule, list(recipe.stages), ctx)
        return recipe
    # Some field is invalid: still check the sections that did build (None: could not build).
    if not isinstance(raw, dict):
        return Recipe()
    model = ctx.built.get(("model",)) if "model" in raw else ModelConfig()
    raw_stages = raw.get("stages")
    stages = [ctx.built.get(("stages", i)) for i in range(len(raw_stages))] if isinstance(raw_stages, list) else None
    if "stages" not in raw:
        stages = []
    _check_recipe(model, stages, ctx)
    schedule = ctx.built.get(("schedule",)) if "schedule" in raw else RunScheduleConfig()
    if schedule is not None and stages is not None:
        _check_schedule(schedule, stages, ctx)
    return Recipe()


def _apply_override(raw: dict, item: str, problems: list[str], lines: dict) -> None:
    key, sep, value_text = item.partition("=")
    if not sep or not key:
        problems.append(f"--set {item!r}: expected key.path=value")
        return
    try:
        value = yaml.safe_load(value_text) if value_text != "" else ""
    except yaml.YAMLError:
        value = value_text
    parts = key.split(".")
    where: list = []  # the path as the line map spells it (list indices as ints)
    target: Any = raw
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        if isinstance(target, list):
            if not part.isdigit() or int(part) >= len(target):
                problems.append(f"--set {key}: {'.'.join(parts[:i]) or 'recipe'} has no item {part} (it has {len(target)})")
                return
            part = int(part)
        elif not isinstance(target, dict):
            problems.append(f"--set {key}: {'.'.join(parts[:i])} is not a section")
            return
        where.append(part)
        if last:
            target[part] = value
            lines[tuple(where)] = "--set"
        else:
            if isinstance(target, dict) and target.get(part) is None:
                target[part] = {}
            target = target[part]


def _duplicate_keys(node, path=()) -> list[str]:
    """YAML keeps the last of two equal keys silently; a recipe that says `steps:` twice is a mistake."""
    out = []
    if isinstance(node, yaml.MappingNode):
        first: dict = {}
        for key_node, value_node in node.value:
            key, line = key_node.value, key_node.start_mark.line + 1
            dotted = ".".join(str(p) for p in path + (key,))
            if key in first:
                out.append(f"{dotted} (line {line}): duplicate key; it is already set on line {first[key]}")
            else:
                first[key] = line
            out.extend(_duplicate_keys(value_node, path + (key,)))
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            out.extend(_duplicate_keys(item, path + (i,)))
    return out


def _line_map(node, path=()) -> dict:
    """Path (tuple of keys / indices) -> 1-based YAML line."""
    out = {path: node.start_mark.line + 1}
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            out.update(_line_map(value_node, path + (key_node.value,)))
            out[path + (key_node.value,)] = key_node.start_mark.line + 1
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            out.update(_line_map(item, path + (i,)))
    return out


class _Ctx:
    def __init__(self, problems: list[str], lines: dict):
        self.problems = problems
        self.lines = lines
        self.built: dict[tuple, Any] = {}  # path -> the object built there, for cross-checks of a partly invalid recipe

    def where(self, path) -> str:
        dotted = ".".join(str(p) for p in path) or "recipe"
        probe = tuple(str(p) if not isinstance(p, int) else p for p in path)
        while probe and probe not in self.lines:
            probe = probe[:-1]
        line = self.lines.get(probe)
        if line == "--set":
            return f"{dotted} (--set)"
        return f"{dotted} (line {line})" if line else dotted

    def error(self, path, msg: str) -> None:
        self.problems.append(f"{self.where(path)}: {msg}")

    def build(self, cls, raw, path):
        if raw is None:
            raw = {}
        if not isinstance(raw, dict):
            self.error(path, f"expected a mapping of {cls.__name__} fields, got {_kind(raw)}")
            return None
        hints = typing.get_type_hints(cls)
        fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
        moved = getattr(cls, "MOVED_KEYS", {})  # keys that now live elsewhere: name the new place
        for key in [k for k in raw if k in moved and k not in fields]:
            self.error(path + (key,), f"'{key}' is no longer set here: it is `{moved[key]}` now (set `{moved[key]}: {raw[key]}` instead)")
        unknown = [k for k in raw if k not in fields and k not in moved]
        for key in unknown:
            near = difflib.get_close_matches(str(key), list(fields), n=1, cutoff=0.6)
            homes = [h for h in _homes(str(key)) if h.rsplit(".", 1)[0] != _section(path)]
            if homes:  # `train.lr`: the key is right, the section is not
                hint = "; it is set under " + " or ".join(f"`{h}`" + ("" if "." in h else " (top level)") for h in homes)
            else:
                hint = f"; did you mean '{near[0]}'?" if near else f"; valid keys: {', '.join(fields)}"
            self.error(path + (key,), f"unknown key '{key}'{hint}")
        values = {}
        ok = True
        for name, f in fields.items():
            if name not in raw or (cls is StageConfig and name == "grow"):
                continue
            sub = path + (name,)
            value = self.convert(hints[name], raw[name], sub)
            if value is _INVALID:
                ok = False
                continue
            value = self.check_range(f, value, sub)
            if value is _INVALID:
                ok = False
                continue
            problem = f.metadata["check"](value) if "check" in f.metadata else None
            if problem is not None:
                self.error(sub, problem)
                ok = False
                continue
            values[name] = value
            self.built[sub] = value
        if cls is StageConfig:
            grow = self.build_growth(raw["grow"], path + ("grow",)) if "grow" in raw else ()
            self.built[path + ("grow",)] = grow
            ok = ok and grow is not None
            values["grow"] = grow
        if not ok:
            return None
        try:
            self.built[path] = cls(**values)
            return self.built[path]
        except (TypeError, ValueError) as exc:
            self.error(path, str(exc))
            return None

    def build_growth(self, raw, path):
        from growtrain.stages import get_operator

        if raw is None:
            return ()
        if not isinstance(raw, list):
            self.error(path, f"expected a list of {{op: NAME, ...}}, got {_kind(raw)}")
            return None
        steps = []
        for i, item in enumerate(raw):
            sub = path + (i,)
            if not isinstance(item, dict) or "op" not in item:
                self.error(sub, "each growth step is a mapping with an 'op' key")
                continue
            try:
                op = get_operator(str(item["op"]))
            except ValueError as exc:
                self.error(sub + ("op",), str(exc))
                continue
            args = self.build(op.args_type, {k: v for k, v in item.items() if k != "op"}, sub)
            if args is not None:
                steps.append(GrowthStep(op.name, args))
        return tuple(steps) if len(steps) == len(raw) else None

    def convert(self, hint, value, path):
        origin = typing.get_origin(hint)
        args = typing.get_args(hint)
        if origin in (typing.Union, types.UnionType):
            if value is None and type(None) in args:
                return None
            members = [a for a in args if a is not type(None)]
            named = [a for a in members if typing.get_origin(a) is Literal]
            if len(members) > 1 and named:  # an int or a named value ('auto'): a string means the name
                return self.convert(named[0], value, path) if isinstance(value, str) else self.convert(
                    next(a for a in members if a not in named), value, path
                )
            (inner,) = members
            return self.convert(inner, value, path)
        if hint is Any:
            return value
        if origin is Literal:
            if value not in args:
                near = difflib.get_close_matches(str(value), [str(a) for a in args], n=1)
                hint_txt = f"; did you mean '{near[0]}'?" if near else ""
                self.error(path, f"'{value}' is not one of {', '.join(map(str, args))}{hint_txt}")
                return _INVALID
            return value
        if origin is tuple:
            if isinstance(value, (int, float, str)) and not isinstance(value, bool) and args[0] is int:
                value = [value]
            if not isinstance(value, list):
                self.error(path, f"expected a list, got {_kind(value)}")
                return _INVALID
            items = [self.convert(args[0], v, path + (i,)) for i, v in enumerate(value)]
            return _INVALID if any(v is _INVALID for v in items) else tuple(items)
        if dataclasses.is_dataclass(hint):
            built = self.build(hint, value, path)
            return _INVALID if built is None else built
        if hint is bool:
            if not isinstance(value, bool):
                self.error(path, f"expected true or false, got {_kind(value)}")
                return _INVALID
            return value
        if hint is int:
            if isinstance(value, bool) or not isinstance(value, int):
                self.error(path, f"expected an integer, got {_kind(value)}")
                return _INVALID
            return value
        if hint is float:
            if isinstance(value, str):  # YAML 1.1 reads 3e-4 (no dot) as a string
                try:
                    value = float(value)
                except ValueError:
                    pass
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                self.error(path, f"expected a number, got {_kind(value)}")
                return _INVALID
            if not math.isfinite(value):
                # `lr: .inf` would train on until every weight is NaN.
                self.error(path, f"expected a finite number, got {value}")
                return _INVALID
            return float(value)
        if hint is str:
            if not isinstance(value, str):
                self.error(path, f"expected a string, got {_kind(value)}")
                return _INVALID
            return value
        return value

    def check_range(self, f, value, path):
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            return value
        m = f.metadata
        for key, ok, word in (
            ("ge", lambda v, b: v >= b, ">="),
            ("gt", lambda v, b: v > b, ">"),
            ("le", lambda v, b: v <= b, "<="),
            ("lt", lambda v, b: v < b, "<"),
        ):
            if key in m and not ok(value, m[key]):
                self.error(path, f"{value} is out of range: must be {word} {m[key]}")
                return _INVALID
        return value


_INVALID = object()


def _section(path) -> str:
    """A recipe path as the sections it names, list indices as N (stages.0.schedule -> stages.N.schedule)."""
    return ".".join("N" if isinstance(p, int) or str(p).isdigit() else str(p) for p in path)


def _homes(key: str, cls=None, prefix: str = "") -> list[str]:
    """Every place in a recipe where `key` is a field (`lr` -> ['optimizer.lr']), stage items as
    stages.N: for an unknown key, the section it belongs to."""
    cls = cls or Recipe
    found = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        where = f"{prefix}{f.name}"
        if f.name == key:
            found.append(where)
        kind = hints[f.name]
        if typing.get_origin(kind) is tuple:  # stages: tuple[StageConfig, ...]
            kind, where = typing.get_args(kind)[0], f"{where}.N"
        if typing.get_origin(kind) in (typing.Union, types.UnionType):  # model.moe: MoEConfig | None
            kind = next((a for a in typing.get_args(kind) if dataclasses.is_dataclass(a)), kind)
        if dataclasses.is_dataclass(kind):
            found += _homes(key, kind, f"{where}.")
    return found


def _kind(value) -> str:
    if value is None:
        return "nothing (null)"
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list", dict: "a mapping"}.get(
        type(value), type(value).__name__
    ) + (f" ({value!r})" if isinstance(value, (bool, int, float, str)) else "")


def _check_schedule(schedule: RunScheduleConfig, stages: list[StageConfig | None], ctx: _Ctx) -> None:
    """A run-wide schedule against the stages: what it reads of them, and whether it fits the run."""
    # Settings that differ from their defaults (a resolved recipe, `print-config`'s, spells every
    # default out and must load again) but that this kind of schedule would not read.
    if not schedule.run_wide:
        default = RunScheduleConfig()
        for f in dataclasses.fields(RunScheduleConfig):
            if f.name != "kind" and getattr(schedule, f.name) != getattr(default, f.name):
                ctx.error(
                    ("schedule", f.name),
                    f"read only by a run-wide schedule (schedule.kind: wsd or cosine); with kind '{schedule.kind}' each "
                    f"stage's own stages.N.schedule.{f.name} applies",
                )
        return
    if any(s is None for s in stages):  # the run's length is unknown: its fit is checked once the stages build
        return
    default = ScheduleConfig()
    for i, st in enumerate(stages):
        ignored = [f.name for f in dataclasses.fields(ScheduleConfig) if f.name not in REWARM_KEYS and getattr(st.schedule, f.name) != getattr(default, f.name)]
        if ignored:
            ctx.error(
                ("stages", i, "schedule", ignored[0]),
                f"{', '.join(ignored)}: not read under the run-wide schedule (schedule.kind: {schedule.kind}), where a stage may "
                f"only ask for a re-warm ({', '.join(REWARM_KEYS)}); set the curve in the top-level schedule, or "
                f"schedule.kind: stages for per-stage schedules",
            )
    if stages and stages[0].schedule.warmup_steps:
        ctx.error(
            ("stages", 0, "schedule", "warmup_steps"),
            "the first stage starts the run: under a run-wide schedule its warmup is the top-level schedule.warmup_steps",
        )
    total = sum(s.steps for s in stages)
    if schedule.warmup_steps > total:
        ctx.error(("schedule", "warmup_steps"), f"{schedule.warmup_steps} warmup steps exceed the run's {total} steps (all stages)")
    elif schedule.kind == "wsd" and total - schedule.decay_steps(total) < schedule.warmup_steps:
        ctx.error(
            ("schedule", "decay_fraction"),
            f"wsd: the final decay ({schedule.decay_steps(total)} of the run's {total} steps) overlaps the "
            f"{schedule.warmup_steps} warmup steps; lower decay_fraction or warmup_steps",
        )


def _check_recipe(model: ModelConfig | None, stages: list[StageConfig | None] | None, ctx: _Ctx) -> None:
    """Cross-field checks: the model shape, the stage list, and the growth chain. A part that is
    None failed to build (its problems are already listed) and is skipped."""
    if model is not None:
        for where, msg in model_problems(model):
            ctx.error(("model",) + where, msg)
    if stages is None:
        return
    if not stages:
        ctx.error(("stages",), "at least one stage is needed")
        return
    seen: dict[str, int] = {}
    for i, stage in enumerate(stages):
        name = stage.name if stage is not None else ctx.built.get(("stages", i, "name"))
        if name is None:  # invalid stage and name: already reported
            pass
        elif not name:
            ctx.error(("stages", i, "name"), "every stage needs a name")
        elif name in seen:
            ctx.error(("stages", i, "name"), f"stage name '{name}' is already used by stage {seen[name]}")
        else:
            seen[name] = i
        if stage is None:
            continue
        if stage.schedule.warmup_steps > stage.steps:
            ctx.error(("stages", i, "schedule", "warmup_steps"), f"{stage.schedule.warmup_steps} warmup steps exceed the stage's {stage.steps} steps")
        elif stage.schedule.kind == "wsd":
            decay = decay_steps(stage.steps, stage.schedule.decay_fraction)
            if stage.steps - decay < stage.schedule.warmup_steps:
                ctx.error(
                    ("stages", i, "schedule", "decay_fraction"),
                    f"wsd: the final decay ({decay} steps) overlaps the {stage.schedule.warmup_steps} warmup steps of this "
                    f"{stage.steps}-step stage; lower decay_fraction or warmup_steps",
                )
        if not stage.fresh.is_default and not stage.grow:
            ctx.error(("stages", i, "fresh"), "this stage grows nothing, so nothing is fresh: move `fresh` to a stage with `grow`, or drop it")
        elif stage.fresh.warmup_steps > stage.steps:
            ctx.error(("stages", i, "fresh", "warmup_steps"), f"{stage.fresh.warmup_steps} warmup steps exceed the stage's {stage.steps} steps")
    if model is None or model_problems(model):
        return
    # Plan up to the first stage whose growth list is invalid: later shapes are unknown.
    grows = [s.grow if s is not None else ctx.built.get(("stages", i, "grow")) for i, s in enumerate(stages)]
    grows = grows[: grows.index(None)] if None in grows else grows
    from growtrain.stages import GrowthPlanError, plan_stage_models

    try:
        plan_stage_models(model, grows)
    except GrowthPlanError as exc:
        ctx.error(("stages", exc.stage_index, "grow", exc.step_index), exc.message)


def model_problems(cfg: ModelConfig) -> list[tuple[tuple, str]]:
    """Shape problems of a model config, as (path, message); also used on every grown shape."""
    out: list[tuple[tuple, str]] = []
    positive = ("d_model", "n_layers", "n_heads", "ffn_hidden")
    for name in positive:
        if getattr(cfg, name) < 1:
            out.append(((name,), f"must be >= 1, got {getattr(cfg, name)}"))
    for name in ("vocab_size", "n_kv_heads", "head_dim"):
        if getattr(cfg, name) < 0:
            out.append(((name,), f"must be >= 0, got {getattr(cfg, name)}"))
    if out:
        return out
    if not cfg.head_dim and cfg.d_model % cfg.n_heads:
        out.append((("n_heads",), f"d_model {cfg.d_model} is not divisible by n_heads {cfg.n_heads}; set head_dim"))
    if cfg.head_size % 2:
        out.append((("head_dim",), f"head size {cfg.head_size} must be even for RoPE"))
    if cfg.n_heads % cfg.kv_heads:
        out.append((("n_kv_heads",), f"n_heads {cfg.n_heads} is not a multiple of n_kv_heads {cfg.kv_heads}"))
    if cfg.moe_layers and cfg.moe is None:
        out.append((("moe_layers",), "MoE layers are listed but `moe` is not set"))
    for i in cfg.moe_layers:
        if not 0 <= i < cfg.n_layers:
            out.append((("moe_layers",), f"layer {i} does not exist (n_layers is {cfg.n_layers})"))
    if len(set(cfg.moe_layers)) != len(cfg.moe_layers):
        out.append((("moe_layers",), "a layer is listed twice"))
    if cfg.moe is not None:
        out.extend((("moe",) + p, m) for p, m in moe_problems(cfg.moe))
        if cfg.moe.expert_format == "nf4" and (cfg.d_model * cfg.moe.expert_hidden) % 2:
            out.append((("moe", "expert_format"), f"nf4 packs two weights per byte: d_model x expert_hidden ({cfg.d_model} x {cfg.moe.expert_hidden}) must be even"))
    return out


def moe_problems(moe: MoEConfig) -> list[tuple[tuple, str]]:
    out = []
    if moe.num_experts < 1:
        out.append((("num_experts",), f"must be >= 1, got {moe.num_experts}"))
    if not 1 <= moe.top_k <= max(1, moe.num_experts):
        out.append((("top_k",), f"must be between 1 and num_experts ({moe.num_experts}), got {moe.top_k}"))
    if moe.expert_hidden < 1:
        out.append((("expert_hidden",), f"must be >= 1, got {moe.expert_hidden}"))
    if moe.shared_expert_hidden < 0:
        out.append((("shared_expert_hidden",), "must be >= 0"))
    return out


# ---------------------------------------------------------------------------------------------
# Output


def to_plain(obj):
    """A recipe (or any part of it) as plain YAML/JSON-ready data, every default filled in."""
    if isinstance(obj, GrowthStep):
        return obj.to_plain()
    if dataclasses.is_dataclass(obj):
        return {f.name: to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_plain(v) for v in obj]
    return obj


def dump_yaml(recipe: Recipe) -> str:
    return yaml.safe_dump(to_plain(recipe), sort_keys=False, default_flow_style=None, width=100)


def schema_markdown() -> str:
    """The recipe reference: every section and field with its type, default and meaning."""
    from growtrain.stages import OPERATORS

    out = ["# Recipe reference", "", "Generated by `growtrain schema`; every field of a recipe, its type, default and meaning.", ""]
    seen = set()

    def section(cls, title):
        if cls in seen:
            return
        seen.add(cls)
        hints = typing.get_type_hints(cls)
        out.extend([f"## {title}", "", (cls.__doc__ or "").strip().splitlines()[0], "", "| key | type | default | meaning |", "|---|---|---|---|"])
        nested = []
        for f in dataclasses.fields(cls):
            if f.name == "args" and cls is GrowthStep:
                continue
            out.append(_field_row(f, hints[f.name]))
            for inner in _dataclasses_in(hints[f.name]):
                nested.append((inner, f"{title}.{f.name}" if title != "recipe" else f.name))
        out.append("")
        for inner, name in nested:
            section(inner, name)

    section(Recipe, "recipe")
    out.extend(["## Growth operators (`stages[].grow[]`)", ""])
    for op in OPERATORS.values():
        out.append(f"### `{op.name}` ({'exact' if op.exact else 'approximate'})")
        out.extend(["", op.doc, "", "| key | type | default | meaning |", "|---|---|---|---|"])
        hints = typing.get_type_hints(op.args_type)
        for f in dataclasses.fields(op.args_type):
            out.append(_field_row(f, hints[f.name]))
        out.append("")
    return "\n".join(out)


def _field_row(f: dataclasses.Field, hint) -> str:
    """One Markdown table row; defaults spelled as in YAML, '|' escaped so the table stays intact."""
    if f.default is not dataclasses.MISSING:
        default = f"`{_yaml_text(f.default)}`"
    else:
        default = "(section)" if f.default_factory is not dataclasses.MISSING else "required"
    rng = ", ".join(f"{k} {f.metadata[k]}" for k in ("ge", "gt", "le", "lt") if k in f.metadata)
    doc = f.metadata.get("doc", "") + (f" Range: {rng}." if rng else "")
    return f"| `{f.name}` | {_type_name(hint)} | {default} | {doc.replace('|', chr(92) + '|')} |"


def _yaml_text(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, (tuple, list)):
        return "[" + ", ".join(_yaml_text(v) for v in value) + "]"
    if isinstance(value, str):
        return value or "''"
    return repr(value)


def _dataclasses_in(hint):
    if dataclasses.is_dataclass(hint):
        return [hint]
    return [c for a in typing.get_args(hint) for c in _dataclasses_in(a)]


def _type_name(hint) -> str:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin is Literal:
        return " \\| ".join(repr(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in args).replace("NoneType", "null")
    if origin is tuple:
        return f"list of {_type_name(args[0])}"
    return getattr(hint, "__name__", str(hint))
