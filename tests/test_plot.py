"""`growtrain plot` (issue 19) on a real micro run: the PNG is written by the CLI the way a user
runs it, and the figure holds the run's curves, its stage boundaries and growth notes."""

from __future__ import annotations

import shutil
import sys

import pytest

from conftest import MICRO, metrics_rows, run_cli, train_recipe

from growtrain.plot import PlotError, build_figure, plot_runs, read_run, run_labels


@pytest.fixture(scope="module")
def micro_run(tmp_path_factory):
    _, out, _ = train_recipe(MICRO, tmp_path_factory.mktemp("plot"), "micro")
    return out


def labelled(ax) -> list:
    return [line for line in ax.get_lines() if not line.get_label().startswith("_")]


def test_the_cli_writes_a_png_of_the_run(micro_run, tmp_path):
    out = tmp_path / "figs" / "loss.png"
    done = run_cli("plot", micro_run, "--out", out)
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"wrote {out}" in done.stdout
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000


def test_the_figure_draws_the_runs_losses_against_tokens_and_flops_with_growth_marked(micro_run):
    rows = metrics_rows(micro_run)
    evals = [r for r in rows if "eval_loss" in r]
    run = read_run(micro_run)
    fig = build_figure([run])
    tokens_ax, flops_ax = fig.axes
    for ax, key in ((tokens_ax, "tokens"), (flops_ax, "flops")):
        train, held = labelled(ax)
        assert list(train.get_xdata()) == [r[key] for r in rows] and list(train.get_ydata()) == [r["loss"] for r in rows]
        assert list(held.get_xdata()) == [r[key] for r in evals] and list(held.get_ydata()) == [r["eval_loss"] for r in evals]
        # One boundary per grown stage, at the last step before it.
        assert [t.get_text() for t in ax.texts] == ["moe", "deep"]
    # Under the panels: each grown stage's operators with the Δloss their checks measured.
    (footer,) = [t.get_text() for t in fig.texts]
    assert "moe: upcycle_moe Δloss " in footer and "deep: deepen Δloss " in footer
    assert [b[1] for b in run.boundaries] == [r["tokens"] for r in rows if r["step"] in (8, 14)]


def test_several_runs_share_one_figure_with_their_folders_told_apart(micro_run, tmp_path):
    for seed in ("seed0", "seed1"):
        shutil.copytree(micro_run, tmp_path / seed / "grown")
    dirs = [tmp_path / "seed0" / "grown", tmp_path / "seed1" / "grown"]
    assert plot_runs(dirs, tmp_path / "two.png").exists()
    assert run_labels(dirs) == ["seed0/grown", "seed1/grown"] and run_labels(dirs[:1]) == ["grown"]
    fig = build_figure([read_run(d, label) for d, label in zip(dirs, run_labels(dirs))])
    assert [line.get_label() for line in labelled(fig.axes[0])] == [
        "seed0/grown: training", "seed0/grown: held-out", "seed1/grown: training", "seed1/grown: held-out"]  # fmt: skip


def test_a_folder_that_is_not_a_run_exits_2_with_a_message(tmp_path):
    done = run_cli("plot", tmp_path, "--out", tmp_path / "x.png")
    assert done.returncode == 2
    assert "no metrics.jsonl" in done.stderr and "Traceback" not in done.stderr
    done = run_cli("plot", tmp_path / "missing")
    assert done.returncode == 2 and "no such run directory" in done.stderr


def test_without_matplotlib_the_message_says_how_to_install_it(micro_run, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    with pytest.raises(PlotError, match=r"pip install 'growtrain\[plot\]'"):
        plot_runs([micro_run], tmp_path / "x.png")
