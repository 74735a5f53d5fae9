"""Kill -9 at awkward moments, resume with the same command, and get the uninterrupted run's
per-step losses and final weights bit for bit (DESIGN.md §9, STYLE.md item 8)."""

from __future__ import annotations

import random
import shutil
import signal
import subprocess
import sys
import time

import pytest

from conftest import REPO, assert_same_run, cli_env, kill_and_resume, run_cli

pytestmark = pytest.mark.slow

FINAL = "checkpoints/step-00000020/model.safetensors"


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory, request):
    """The uninterrupted micro run, shared by the tests of this module."""
    from conftest import MICRO, train_recipe

    recipe, out, _ = train_recipe(MICRO, tmp_path_factory.mktemp("reference"), "micro")
    return recipe, out


@pytest.mark.parametrize(
    "fault",
    [
        "step_mid:6",  # between backward and optimizer step, stage 1, after the step-4 checkpoint
        "step_mid:11",  # mid-step in the MoE stage (grad accumulation)
        "checkpoint_mid:3",  # weights written, manifest not: the step-12 checkpoint is torn
        "checkpoint_mid:2",  # the stage-end checkpoint itself is torn: stage 1 is redone from step 4
        "after_transition:1",  # just after the dense -> MoE growth, nothing saved since
        "after_transition:2",  # just after the deepen growth
    ],
)
def test_kill_and_resume_reproduces_the_uninterrupted_run(reference_run, tmp_path, fault):
    recipe, reference = reference_run
    out = tmp_path / "run"
    kill_and_resume(recipe, out, fault)
    assert_same_run(out, reference, 20)


def test_two_kills_in_a_row_still_reproduce_the_run(reference_run, tmp_path):
    recipe, reference = reference_run
    out = tmp_path / "run"
    for fault in ("after_transition:1", "checkpoint_mid:2"):
        assert run_cli("run", recipe, "--out", out, env=cli_env(GROWTRAIN_FAULT=fault)).returncode == -signal.SIGKILL
    assert run_cli("run", recipe, "--out", out).returncode == 0
    assert_same_run(out, reference, 20)


@pytest.mark.parametrize("seed", [0, 1])
def test_kill_at_a_random_moment_then_resume_reproduces_the_run(reference_run, tmp_path, seed):
    recipe, reference = reference_run
    out = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "growtrain", "run", str(recipe), "--out", str(out)],
        cwd=REPO, env=cli_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 120
    while not (out / "checkpoints" / "latest").exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(random.Random(seed).uniform(0.0, 0.6))
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert run_cli("run", recipe, "--out", out).returncode == 0
    assert_same_run(out, reference, 20)


@pytest.mark.parametrize("damage", ["truncate", "bitflip"])
def test_damaged_newest_checkpoint_is_reported_and_the_previous_one_used(reference_run, tmp_path, damage):
    recipe, reference = reference_run
    out = tmp_path / "run"
    shutil.copytree(reference, out)
    newest = out / FINAL
    data = bytearray(newest.read_bytes())
    if damage == "truncate":
        data = data[: len(data) // 2]
    else:
        data[len(data) // 2] ^= 0x01
    newest.write_bytes(bytes(data))

    inspected = run_cli("inspect", out, "--json")
    assert inspected.returncode == 0, inspected.stderr
    assert '"step": 16' in inspected.stdout, "inspect must skip the damaged checkpoint"

    resumed = run_cli("run", recipe, "--out", out)
    assert resumed.returncode == 0, resumed.stderr
    assert "step-00000020 is damaged" in resumed.stdout + resumed.stderr
    assert "resumed from step-00000016" in resumed.stdout
    assert_same_run(out, reference, 20)


def test_resuming_a_finished_run_changes_nothing(reference_run, tmp_path):
    recipe, reference = reference_run
    out = tmp_path / "run"
    shutil.copytree(reference, out)
    done = run_cli("run", recipe, "--out", out)
    assert done.returncode == 0, done.stderr
    assert_same_run(out, reference, 20)


def test_resume_refuses_a_run_directory_of_a_different_recipe(reference_run, tmp_path, micro_recipe):
    _, reference = reference_run
    out = tmp_path / "run"
    shutil.copytree(reference, out)
    other = micro_recipe({"optimizer": {"lr": 0.001}})
    result = run_cli("run", other, "--out", out)
    assert result.returncode == 2
    assert "optimizer.lr" in result.stderr and "Traceback" not in result.stderr
    never = run_cli("run", other, "--out", out, "--resume", "never")
    assert never.returncode == 2 and "already holds checkpoints" in never.stderr


def test_a_kill_early_in_a_grown_stage_resumes_after_the_growth_without_repeating_it(reference_run, tmp_path):
    recipe, reference = reference_run
    out = tmp_path / "run"
    resumed = kill_and_resume(recipe, out, "step_mid:9")  # the first step of the MoE stage
    assert "step-00000008-grown" in resumed.stdout, resumed.stdout[-2000:]
    assert "growth [moe]" not in resumed.stdout, "the growth was done and saved before the kill: it must not run again"
    assert_same_run(out, reference, 20)
    grown = sorted(p.name for p in (reference / "checkpoints").glob("step-*-grown"))
    assert grown == [], "retention drops a grown checkpoint once newer ones exist (stage ends stay)"
