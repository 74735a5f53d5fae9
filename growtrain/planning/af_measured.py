"""The planner's AF split against a run of the same shape (`growtrain plan --measured RUN_DIR`,
benchmarks/af_pipeline.py): each schedule's step and each side's waiting share as the roofline
predicts them, next to what the run's metrics.jsonl recorded (af/* per step, train.py).

From one split's per-step times (planning/disaggregation.py: ta the attention side, te the
expert side, tx the transfers), per schedule (growtrain/model/af.py writes the schedules down):
- sequential: step ta + te + tx; the attention ranks wait te + tx of it, the expert ranks idle ta;
- pingpong: step max(ta + (te + tx) / 2, te + tx) (two lanes, the expert ranks serving one while
  the other computes);
- interleaved: step max(ta, te, tx) (two micro-batches in flight on every attention rank, the
  expert ranks taking in the next call while they compute one: model/af_interleaved.py), the
  planner's own AF model (af_search).
The measured side covers the forward and backward passes (af/passes_s; the optimizer step and
the gradient reduction are outside them), the predicted side the planner's whole step.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from growtrain.planning.disaggregation import AfSplit
from growtrain.planning.errors import PlanError


@dataclass(frozen=True)
class ScheduleTimes:
    step_s: float
    attention_wait_fraction: float
    expert_idle_fraction: float
    # each side's compute per step (predicted: the split's ta and te; measured: the run's per
    # micro-batch figures times its micro-batches; None for a run logged before they were)
    attention_s: float | None = None
    expert_s: float | None = None

    def to_dict(self) -> dict:
        return {
            "step_s": self.step_s, "attention_wait_fraction": self.attention_wait_fraction, "expert_idle_fraction": self.expert_idle_fraction,
            "attention_s": self.attention_s, "expert_s": self.expert_s,
        }


def predict(split: AfSplit, schedule: str) -> ScheduleTimes:
    """`schedule` (sequential, pingpong, interleaved, or planner: af_search's own) on `split`."""
    ta, te, tx = split.attention_s, split.experts_s, split.transfer_s
    if schedule == "sequential":
        step = ta + te + tx
    elif schedule == "pingpong":
        step = max(ta + (te + tx) / 2, te + tx)
    elif schedule in ("interleaved", "planner"):
        step = split.step_time_s  # max(ta, te, tx)
    else:
        raise ValueError(f"unknown AF schedule {schedule!r}")
    return ScheduleTimes(step, max(0.0, 1 - ta / step), max(0.0, 1 - te / step), ta, te)


def measured(rows: list[dict], stage: str, skip: int = 1) -> ScheduleTimes:
    """The median over stage `stage`'s steps of a run's metrics (its first `skip` steps left out:
    the first step after a growth or a start pays one-off costs)."""
    mine = [r for r in rows if r.get("stage") == stage and "af/passes_s" in r][skip:]
    if not mine:
        raise PlanError(f"the run's metrics.jsonl has no AF steps of stage '{stage}' (beyond its first {skip}): was it trained with distributed.layout: af?")
    med = lambda key: statistics.median(r[key] for r in mine)  # noqa: E731
    sides = [None, None]
    if all("af/attention_s_per_microbatch" in r for r in mine):
        sides = [statistics.median(r[f"af/{side}_s_per_microbatch"] * r["af/microbatches"] for r in mine) for side in ("attention", "expert")]
    return ScheduleTimes(med("af/passes_s"), med("af/attention_wait_fraction"), med("af/expert_idle_fraction"), *sides)


def compare(split: AfSplit, schedule: str, rows: list[dict], stage: str) -> dict:
    """Predicted (for `schedule` and the planner's own) and measured, as one dict."""
    return {
        "stage": stage,
        "attention_ranks": split.attention_gpus,
        "expert_ranks": split.expert_gpus,
        "schedule": schedule,
        "predicted": predict(split, schedule).to_dict(),
        "planner_pipelined": predict(split, "planner").to_dict(),
        "measured": measured(rows, stage).to_dict(),
    }


def format_comparison(c: dict) -> str:
    p, m, best = c["predicted"], c["measured"], c["planner_pipelined"]
    lines = [
        f"AF layout, stage '{c['stage']}', {c['attention_ranks']} attention + {c['expert_ranks']} expert ranks, {c['schedule']} schedule:",
        f"  {'':<24}{'predicted':>12}{'measured':>12}{'planner (2 in flight)':>24}",
        f"  {'step (passes)':<24}{_s(p['step_s']):>12}{_s(m['step_s']):>12}{_s(best['step_s']):>24}",
        f"  {'attention ranks waiting':<24}{p['attention_wait_fraction']:>12.0%}{m['attention_wait_fraction']:>12.0%}{best['attention_wait_fraction']:>24.0%}",
        f"  {'expert ranks idle':<24}{p['expert_idle_fraction']:>12.0%}{m['expert_idle_fraction']:>12.0%}{best['expert_idle_fraction']:>24.0%}",
        f"  {'attention compute':<24}{_s(p['attention_s']):>12}{_s(m['attention_s']):>12}{_s(best['attention_s']):>24}",
        f"  {'expert compute':<24}{_s(p['expert_s']):>12}{_s(m['expert_s']):>12}{_s(best['expert_s']):>24}",
        "  predicted: the roofline's whole step on the plan's hardware; measured: the run's forward and backward passes "
        "(median over the stage's steps; host clocks)",
    ]
    return "\n".join(lines)


def _s(t: float | None) -> str:
    if t is None:
        return "-"
    return f"{t * 1e6:.0f} us" if t < 1e-3 else f"{t * 1e3:.1f} ms" if t < 1 else f"{t:.2f} s"
