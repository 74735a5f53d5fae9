"""The growth-operator registry: the one door through which the trainer reaches growth.

An operator is data plus two pure functions: `plan(config, args) -> config` derives the grown
shape (used by validation, resume and the planner without touching weights), and
`apply(model, optimizer_state, args) -> Growth` builds the grown model, maps optimizer state and
says where every new parameter came from. Each declares whether it is exact (same logits in exact
arithmetic).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
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

    kind: 'carried' (the same tensor, possibly renamed; state kept), 'copy' (built from `source` by
    `transform`, every element a β-scaled copy with S summed over the copies: state mapped by
    DESIGN.md §7), or 'new' (fresh optimizer state; `source` only notes where its init came from).
    """

    kind: str
    source: str | None = None
    transform: Callable[[torch.Tensor], torch.Tensor] | None = None
    copies: float = 1.0  # S
    beta: float = 1.0


@dataclass
class Growth:
    model: Any  # GrowLM
    provenance: dict[str, Provenance]


@dataclass(frozen=True)
class Operator:
    name: str
    exact: bool
    doc: str
    args_type: type
    plan: Callable[[ModelConfig, Any], ModelConfig]
    apply: Callable[[Any, Any], Growth]


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
