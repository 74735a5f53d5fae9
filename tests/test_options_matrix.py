"""A sample of benchmarks/options_matrix.py (every operator x layout x expert format x dense state
x block kind, each a real `growtrain run` killed mid-step and resumed): cells chosen to cover every
value of every axis but the operators (which the full matrix covers; its table is in docs/results.md),
picked among the combinations issue 46 opened: widening NF4 experts, 8-bit state over several
processes (under residual blocks too), a split of NF4 experts whose children start inside nested
absmax blocks (their block scales double-quantized again, judged as approximate).
Each cell must run (its resume repeating its losses bit for bit) or be refused at validate for a
listed reason."""

from __future__ import annotations

import sys

import pytest

from conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
from options_matrix import Cell, run_cell  # noqa: E402

CELLS = [
    Cell("widen_ffn", "ep2", "nf4", "8bit", "residual"),
    Cell("clone_experts", "af11", "full", "8bit", "coupling"),
    Cell("split_experts", "one", "nf4", "adamw", "coupling"),
]


def test_the_sample_covers_every_layout_format_optimizer_and_block_kind():
    for i, values in enumerate((("one", "ep2", "af11"), ("full", "nf4"), ("adamw", "8bit"), ("coupling", "residual"))):
        assert {c.name.split("/")[i + 1] for c in CELLS} == set(values)


@pytest.mark.slow
@pytest.mark.parametrize("cell", CELLS, ids=lambda c: c.name)
def test_a_cell_runs_through_a_kill_and_resume_or_is_refused_for_a_listed_reason(cell: Cell, tmp_path):
    r = run_cell(cell, tmp_path)
    assert r["status"] in ("runs", "refused"), r
    if r["status"] == "runs":
        assert r["replayed"], r
