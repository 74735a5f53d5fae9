"""The command line as a user meets it: help, exit codes, messages instead of tracebacks, and the
committed recipe reference. In-process through `main` where that suffices; a subprocess where the
exit path or the imported modules matter."""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from conftest import cli_env, run_module, started_env
from growtrain.cli import build_parser, main

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "recipes" / "tiny.yaml"
REFERENCE = REPO / "docs" / "recipe-reference.md"


def run_cli(*args) -> subprocess.CompletedProcess:
    return run_module("growtrain", *args, env=started_env(), timeout=120)


def subcommands() -> dict[str, argparse.ArgumentParser]:
    (sub,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


def assert_clean_failure(out: str, err: str) -> None:
    assert "Traceback" not in out + err, out + err


# ---------------------------------------------------------------------------------------------
# Help


def test_help_exits_0_and_lists_every_subcommand(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for name in subcommands():
        assert name in out


@pytest.mark.parametrize("name", sorted(subcommands()))
def test_every_subcommand_help_exits_0_and_mentions_its_arguments(name, capsys):
    with pytest.raises(SystemExit) as info:
        main([name, "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for action in subcommands()[name]._actions:
        token = action.option_strings[-1] if action.option_strings else action.dest
        assert token in out, f"`growtrain {name} --help` does not mention {token}"


def test_no_command_prints_help_and_exits_0(capsys):
    assert main([]) == 0
    assert "usage: growtrain" in capsys.readouterr().out


def test_importing_the_cli_imports_no_heavy_dependency():
    # --help must be instant: torch, datasets and wandb are imported by the commands that need them.
    code = (
        "import sys, growtrain.cli as c; c.build_parser().format_help(); "
        "print(','.join(m for m in ('torch', 'datasets', 'wandb') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "", f"importing growtrain.cli imported: {done.stdout.strip()}"


def test_one_process_never_imports_torch_dynamo_and_a_process_group_is_joined_after_it(micro_recipe, tmp_path):
    """torch._dynamo costs ~2 s of every start (half of `validate`'s). validate and plan (meta
    models: model/layers.normal_init_) and a one-process run with growth (the reversible stack's
    mark is taken only under torch.compile) must not import it. A process joining a process group
    must import it first: imported inside a gloo job it has aborted a rank at exit
    (parallel/distributed.import_before_group)."""
    recipe = micro_recipe()
    code = f"""
import sys
import torch.distributed as dist
from growtrain.cli import main
from growtrain.model.config import MoEConfig
from growtrain.planning import count_model
from growtrain.recipe import load_recipe

for args in (["validate", "recipes/tiny.yaml"], ["validate", "recipes/120b.yaml", "--world-size", "8"], ["plan", "recipes/120b.yaml"]):
    assert main(args) == 0, args
cfg = load_recipe("recipes/small.yaml").model.with_changes(vocab_size=256, moe=MoEConfig(num_experts=8, top_k=2), moe_layers=(1,))
assert count_model(cfg).params_total > 0
assert "torch._dynamo" not in sys.modules, "a command that runs no model imported torch._dynamo"
assert main(["run", {str(recipe)!r}, "--out", {str(tmp_path / "run")!r}]) == 0
assert main(["inspect", {str(tmp_path / "run")!r}]) == 0
assert "torch._dynamo" not in sys.modules, "a one-process run, or inspect, imported torch._dynamo"
import os
from growtrain.parallel.distributed import Dist
from growtrain.recipe import DistributedConfig

def joined(*args, **kwargs):
    print("dynamo before the group:", "torch._dynamo" in sys.modules)
    raise SystemExit(0)

dist.init_process_group = joined
os.environ.update(WORLD_SIZE="2", RANK="0", LOCAL_RANK="0")
Dist.from_env(DistributedConfig())
"""
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert done.stdout.strip().endswith("dynamo before the group: True"), done.stdout[-500:]


# ---------------------------------------------------------------------------------------------
# validate / print-config / schema

BROKEN = """\
name: broken
model:
  d_model: 32
  n_layers: 2
  n_heads: 2
  d_modle: 64
train:
  log_every: "often"
data:
  eval_fraction: 0.9
optimizer:
  lr: 3e-4
  beta2: 1.0
stagse: []
stages:
  - name: dense
    steps: 0
    bach_size: 4
  - name: dense
    steps: 10
    schedule: {warmup_steps: 20}
  - name: deep
    grow:
      - {op: deepen, after: [5]}
"""

BROKEN_PROBLEMS = [
    "model.d_modle (line 6): unknown key 'd_modle'; did you mean 'd_model'?",
    "train.log_every (line 8): expected an integer, got a string ('often')",
    "data.eval_fraction (line 10): 0.9 is out of range",
    "optimizer.beta2 (line 13): 1.0 is out of range",
    "stagse (line 14): unknown key 'stagse'; did you mean 'stages'?",
    "stages.0.steps (line 17): 0 is out of range",
    "stages.0.bach_size (line 18): unknown key 'bach_size'; did you mean 'batch_size'?",
    "stages.1.name (line 19): stage name 'dense' is already used by stage 0",
    "stages.1.schedule.warmup_steps (line 21): 20 warmup steps exceed the stage's 10 steps",
    "stages.2.grow.0 (line 24): deepen: block 5 does not exist",
]


def test_validate_lists_every_problem_once_with_line_numbers(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text(BROKEN)
    done = run_cli("validate", path)
    assert done.returncode == 2, done.stdout + done.stderr
    assert_clean_failure(done.stdout, done.stderr)
    listed = [line.strip()[2:] for line in done.stderr.splitlines() if line.strip().startswith("- ")]
    assert not [p for p, n in Counter(listed).items() if n > 1], "problems listed twice:\n" + done.stderr
    for expected in BROKEN_PROBLEMS:
        hits = [p for p in listed if p.startswith(expected)]
        assert len(hits) == 1, f"expected one problem starting {expected!r} in:\n{done.stderr}"
    assert len(listed) == len(BROKEN_PROBLEMS), done.stderr
    assert f"{len(BROKEN_PROBLEMS)} problem(s)" in done.stderr


def test_a_key_in_the_wrong_section_names_the_section_it_belongs_to(tmp_path, capsys):
    path = tmp_path / "misplaced.yaml"
    path.write_text("name: m\nseed: 1\nmodel: {d_model: 32, seed: 2, top_k: 2}\ntrain: {lr: 0.01, log_evry: 5}\n"
                    "steps: 10\nstages:\n  - {name: dense, steps: 4, every_steps: 2}\n")
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err
    for expected in (
        "train.lr (line 4): unknown key 'lr'; it is set under `optimizer.lr`",
        "model.seed (line 3): unknown key 'seed'; it is set under `seed` (top level)",
        "model.top_k (line 3): unknown key 'top_k'; it is set under `model.moe.top_k`",  # through MoEConfig | None
        "steps (line 5): unknown key 'steps'; it is set under `stages.N.steps`",
        "stages.0.every_steps (line 7): unknown key 'every_steps'; it is set under `checkpoint.every_steps`",
        "train.log_evry (line 4): unknown key 'log_evry'; did you mean 'log_every'?",  # a typo, no other home
    ):
        assert expected in err, err


def test_a_resume_path_that_does_not_exist_is_refused_before_anything_is_read(tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["run", "tiny", "--out", str(out), "--resume", "nevr"]) == 2  # a mistyped `never` is a path
    captured = capsys.readouterr()
    assert "--resume nevr: no such checkpoint or run directory (--resume takes auto, never or a path)" in captured.err
    assert_clean_failure(captured.out, captured.err)
    assert "data:" not in captured.out and not out.exists()


def test_validate_a_missing_file_exits_2_without_traceback(tmp_path, capsys):
    assert main(["validate", str(tmp_path / "nope.yaml")]) == 2
    captured = capsys.readouterr()
    assert "no such recipe file" in captured.err
    assert_clean_failure(captured.out, captured.err)


def test_validate_invalid_yaml_exits_2_with_its_line(tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text("name: x\nmodel: {d_model: 32\nstages: []\n")
    assert main(["validate", str(path)]) == 2
    captured = capsys.readouterr()
    assert "not valid YAML at line" in captured.err
    assert_clean_failure(captured.out, captured.err)


def test_validate_a_file_that_is_not_utf8_exits_2(tmp_path, capsys):
    path = tmp_path / "binary.yaml"
    path.write_bytes(b"\xff\xfe\x00garbage")
    assert main(["validate", str(path)]) == 2
    captured = capsys.readouterr()
    assert "cannot read the recipe file" in captured.err
    assert_clean_failure(captured.out, captured.err)


def test_validate_the_tiny_recipe_exits_0_and_summarizes_its_stages(capsys):
    assert main(["validate", str(TINY)]) == 0
    out = capsys.readouterr().out
    assert "ok" in out and "4 stage(s)" in out
    assert "deep: 4 blocks" in out and "nf4: 4 blocks" in out


def test_validate_reports_a_bad_override(capsys):
    assert main(["validate", str(TINY), "--set", "stages.7.steps=5"]) == 2
    assert "stages has no item 7" in capsys.readouterr().err


def test_print_config_fills_in_defaults_and_applies_overrides(capsys):
    assert main(["print-config", str(TINY), "--set", "seed=7"]) == 0
    out = capsys.readouterr().out
    assert "beta2: 0.95" in out  # not written in tiny.yaml
    assert "decay_fraction: 0.2" in out
    assert "seed: 7" in out


def test_print_config_of_a_broken_recipe_exits_2(tmp_path, capsys):
    path = tmp_path / "broken.yaml"
    path.write_text(BROKEN)
    assert main(["print-config", str(path)]) == 2
    captured = capsys.readouterr()
    assert "did you mean 'stages'?" in captured.err
    assert captured.out == ""


def test_schema_mentions_every_section_and_growth_operator(capsys):
    from growtrain.recipe import Recipe
    from growtrain.stages import OPERATORS

    assert main(["schema"]) == 0
    out = capsys.readouterr().out
    for name in Recipe.__dataclass_fields__:
        assert f"`{name}`" in out
    for section in ("model", "model.moe", "data", "optimizer", "train", "stages", "stages.schedule", "checkpoint", "invariance", "tracking"):
        assert f"## {section}\n" in out
    for op in OPERATORS:
        assert f"### `{op}`" in out


def test_recipe_reference_is_up_to_date(capsys):
    assert main(["schema"]) == 0
    current = capsys.readouterr().out
    committed = REFERENCE.read_text() if REFERENCE.is_file() else ""
    assert committed == current, (
        "docs/recipe-reference.md is out of date with the recipe fields; regenerate it with "
        "`growtrain schema > docs/recipe-reference.md`"
    )


def test_a_reader_that_closes_the_pipe_early_causes_no_traceback():
    # `growtrain print-config r.yaml | head -1`: the read end is gone before growtrain writes.
    proc = subprocess.Popen(
        [sys.executable, "-m", "growtrain", "print-config", str(TINY)],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    proc.stdout.close()
    err = proc.stderr.read()
    proc.wait(timeout=60)
    assert "Traceback" not in err and "BrokenPipeError" not in err, err


# ---------------------------------------------------------------------------------------------
# inspect / generate / run on bad input


@pytest.mark.parametrize(
    "argv",
    [
        ["inspect", "{missing}"],
        ["inspect", "{missing}", "--json"],
        ["generate", "{missing}", "--prompt", "The "],
    ],
    ids=["inspect", "inspect-json", "generate"],
)
def test_commands_on_a_path_that_does_not_exist_exit_2_with_a_message(argv, tmp_path, capsys):
    missing = tmp_path / "no-such-run"
    assert main([a.format(missing=missing) for a in argv]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("error: ") and str(missing) in captured.err
    assert_clean_failure(captured.out, captured.err)


def test_run_with_a_broken_recipe_exits_2_without_traceback(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text(BROKEN)
    done = run_cli("run", path, "--out", tmp_path / "run")
    assert done.returncode == 2, done.stdout + done.stderr
    assert_clean_failure(done.stdout, done.stderr)
    assert "did you mean 'batch_size'?" in done.stderr
    assert not (tmp_path / "run").exists()


def test_a_ranks_error_line_is_one_write_so_ranks_lines_do_not_run_together(tmp_path, monkeypatch):
    """Under torchrun every rank prints its error at once; with PYTHONUNBUFFERED (common in
    containers) a print() writes its text and its newline apart, and two ranks' lines ran together
    in the 120B rehearsal's kill ('...resume[rank 2] error: ...'). The line is one write."""
    import io

    class Writes(io.StringIO):
        def __init__(self):
            super().__init__()
            self.calls = []

        def write(self, s):
            self.calls.append(s)
            return super().write(s)

    err = Writes()
    monkeypatch.setattr(sys, "stderr", err)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    missing = tmp_path / "no-such-run"
    assert main(["inspect", str(missing)]) == 2
    lines = [c for c in err.calls if c]
    assert len(lines) == 1 and lines[0].startswith("[rank 1] error: ") and lines[0].endswith("\n") and str(missing) in lines[0], err.calls
