"""The growth-operator registry: the one door through which the trainer reaches growth.

An operator is data plus two pure functions: `plan(config, args) -> config` derives the grown
shape (used by validation, resume and the planner without touching weights), and
`apply(model, args) -> Growth` builds the grown model and says where every new parameter (and
every element of it) came from, which is all the driver needs to map the optimizer state
(transition.map_optimizer_state) and to compare the two models (invariance.py). Each declares
whether it is exact (same logits in exact arithmetic), possibly depending on its arguments.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from growtrain.model.config import ModelConfig


class GrowthPlanError(Exception):
    """An operator cannot apply to a shape (e.g. splitting experts of a dense model)."""

    def __init__(self, message: str, stage_index: int = 0, step_index: int = 0):
        self.message = message
        self.stage_index = stage_index
        self.step_index = step_index
        super().__init__(message)


@dataclass(frozen=True)
class Provenance:
    """Where one parameter of the grown model came from.

    kind: 'carried' (the same tensor, possibly renamed; state kept), 'copy' (built from `source`:
    `transform` maps any tensor shaped like the source (weights, moments, multipliers, step
    counts) to the new shape, and the new element is β times the element it lands on, S being the
    sum of β over all copies of that old element: state mapped by DESIGN.md §7), 'new' (fresh
    optimizer state; `source` only notes where its init came from), or 'reset' (fresh optimizer
    state, replacing `source`, whose values were folded into frozen buffers: an expert matrix
    quantized into its NF4 base, an adapter merged into it; `source` counts as used).

    `copies` (S) and `beta` are floats, or tensors where they vary per element (a split
    down-projection column, a neuron duplicated more often than others).
    `fresh` (copy only): a bool mask of elements that are not copies at all but newly drawn (new
    neurons, new heads, re-initialized rows): they get fresh state with their own step count,
    inside the same tensor.
    A tensor field is shaped like the new parameter, or keeps size 1 along the dims where it does
    not vary (same number of dims, broadcasting to the parameter): a per-neuron field of an expert
    weight [E, F, D] is [E, F, 1].
    `perturbed` (copy only): a bool mask (or True: all) of copied elements the operator moved on
    purpose by noise (widen_hidden's null-space noise, clone's router noise), each by at most
    `perturb_bound` (absolute); the value check (stages/values.py) holds every other copied element
    to β · transform(source) bitwise.
    """

    kind: str
    source: str | None = None
    transform: Callable[[torch.Tensor], torch.Tensor] | None = None
    copies: float | torch.Tensor = 1.0  # S
    beta: float | torch.Tensor = 1.0
    fresh: torch.Tensor | None = None
    perturbed: bool | torch.Tensor | None = None
    perturb_bound: float = 0.0


@dataclass
class Growth:
    """An operator's result. `blocks` maps each new block to the old block whose output streams it
    reproduces (None: the identity over the blocks both models have); `stream_view` maps a new
    stream to the old width (None: identity). `routers` maps a new MoE block to the parent expert of
    each of its experts (a LongTensor, or None for the same experts); None: every new MoE block
    whose mapped old block was MoE with as many experts keeps them. A new MoE block missing from an
    explicit `routers` has no parent router (a fresh one). These feed the per-block and per-layer
    router checks."""

    model: Any  # GrowLM
    provenance: dict[str, Provenance]
    blocks: dict[int, int] | None = None
    routers: dict[int, torch.Tensor | None] | None = None
    stream_view: Callable[[torch.Tensor], torch.Tensor] | None = None
    # Why an exact operator may not be exact on this model's weights (e.g. tied routers): added to a failed check's problems.
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Operator:
    name: str
    exact: bool
    doc: str
    args_type: type
    plan: Callable[[ModelConfig, Any], ModelConfig]
    apply: Callable[[Any, Any], Growth]
    exact_if: Callable[[Any], bool] | None = None  # for an exact operator whose options can make it approximate
    # Whether `apply` can run on expert shards (stages/sharding.py): True, or a test of the arguments.
    shards: bool | Callable[[Any], bool] = False

    def is_exact(self, args) -> bool:
        return self.exact and (self.exact_if is None or self.exact_if(args))

    def runs_sharded(self, args) -> bool:
        return self.shards(args) if callable(self.shards) else bool(self.shards)


OPERATORS: dict[str, Operator] = {}


def register(op: Operator) -> Operator:
    if op.name in OPERATORS:
        raise ValueError(f"growth operator '{op.name}' is registered twice")
    OPERATORS[op.name] = op
    return op


def get_operator(name: str) -> Operator:
    if name not in OPERATORS:
        near = difflib.get_close_matches(name, list(OPERATORS), n=1)
        hint = f"did you mean '{near[0]}'? " if near else ""
        raise ValueError(f"unknown growth operator '{name}'; {hint}valid: {', '.join(sorted(OPERATORS))}")
    return OPERATORS[name]
