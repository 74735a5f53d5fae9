"""How far a run is and when it will end, told truthfully: the ETA weighs every remaining step by
its stage's cost (a grown stage's step costs more than a seed stage's), and a slow stage still
prints a line every `HEARTBEAT_S` seconds whatever `train.log_every` says.

The cost of a stage's step is the planner's FLOPs per token of that stage's model times the tokens
of one step (growtrain/planning/roofline.py: forward + backward, + the reversible recompute). The
clock measures seconds per unit of cost on the steps that ran, and the ETA is that rate times the
cost still ahead. A measured rate per FLOP carries from one stage to the next far better than a
measured rate per step: the 4-minutes-with-50-steps-left ETA came from applying a seed stage's
seconds per step to the grown stages after it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

# At least one console line this often while training, in seconds (issue 12: a stage whose steps
# take minutes must not look hung between log_every lines).
HEARTBEAT_S = 30.0


def stage_step_costs(shapes, stages, per_token_fn=None) -> list[float]:
    """FLOPs of one optimizer step of each stage: the planner's FLOPs per token of that stage's
    model (meta device, no memory; `train_flops_per_token` unless `per_token_fn` says otherwise)
    times batch_size x seq_len x grad_accum."""
    from growtrain.planning import train_flops_per_token

    per_token_fn = per_token_fn or train_flops_per_token
    per_token: dict = {}
    costs = []
    for cfg, stage in zip(shapes, stages):
        key = (cfg, stage.seq_len)
        if key not in per_token:
            per_token[key] = per_token_fn(cfg, stage.seq_len)
        costs.append(per_token[key] * stage.batch_size * stage.seq_len * stage.grad_accum)
    return costs


def counted_flops(step_flops, stage_steps, stage: int, stage_step: int) -> float:
    """Counted FLOPs of a run at (stage, stage_step): every earlier stage's steps at their cost, and
    this stage's steps so far. A function of the position alone, so a resumed run counts the same."""
    return float(sum(c * n for c, n in zip(step_flops[:stage], stage_steps[:stage])) + step_flops[stage] * stage_step)


class Progress:
    """Remaining cost, measured speed and the heartbeat of one run (all stages).

    `stage_steps[i]` steps of cost `step_costs[i]` each. Call `start_stage()` when a stage's
    first step is about to run (growth, evals and checkpoints between stages are not step time),
    `step_done(stage)` after each step, `eta_seconds(stage, stage_step)` for the estimate and
    `line_due()` / `line_written()` for the heartbeat."""

    def __init__(
        self,
        step_costs: Sequence[float],
        stage_steps: Sequence[int],
        every_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        if len(step_costs) != len(stage_steps):
            raise ValueError(f"{len(step_costs)} step costs for {len(stage_steps)} stages")
        if any(not c > 0 for c in step_costs):
            raise ValueError(f"every stage's step cost must be > 0, got {list(step_costs)}")
        self.step_costs = list(step_costs)
        self.stage_steps = list(stage_steps)
        self.every_s = HEARTBEAT_S if every_s is None else every_s
        self.clock = clock
        self._t_step = clock()
        self._t_line = self._t_step
        self._sec_per_cost = float("nan")

    def start_stage(self) -> None:
        self._t_step = self.clock()

    def step_done(self, stage: int) -> None:
        now = self.clock()
        rate = (now - self._t_step) / self.step_costs[stage]
        # Recent speed, not the run's average (a checkpoint or eval inside a step is noise that
        # decays), in seconds per FLOP so that it carries across stages.
        self._sec_per_cost = rate if self._sec_per_cost != self._sec_per_cost else 0.9 * self._sec_per_cost + 0.1 * rate
        self._t_step = now

    def remaining_cost(self, stage: int, stage_step: int) -> float:
        """FLOPs still ahead once `stage_step` steps of stage `stage` are done."""
        ahead = (self.stage_steps[stage] - stage_step) * self.step_costs[stage]
        return ahead + sum(n * c for n, c in zip(self.stage_steps[stage + 1 :], self.step_costs[stage + 1 :]))

    def eta_seconds(self, stage: int, stage_step: int) -> float:
        """NaN until a step has been timed."""
        return self._sec_per_cost * self.remaining_cost(stage, stage_step)

    def line_due(self) -> bool:
        return self.clock() - self._t_line >= self.every_s

    def line_written(self) -> None:
        self._t_line = self.clock()
