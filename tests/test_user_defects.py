"""Defects a new user hit (issue 12): each test reproduces the user's steps through the CLI, in a
subprocess, from the directory a user would be in, and failed before its fix."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from conftest import MICRO, REPO, cli_env, losses, run_cli, run_module, write_bpe_tokenizer


def run_in(cwd: Path, *args, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """The CLI run from `cwd` (the user's current directory), not from the repository."""
    return run_module("growtrain", *args, cwd=cwd, env=env, timeout=timeout)


def short_micro(**changes) -> dict:
    raw = json.loads(json.dumps(MICRO))
    raw["stages"] = raw["stages"][:1]
    raw["stages"][0]["steps"] = 6
    raw["checkpoint"] = {"every_steps": 2, "keep_last": 5}
    for key, value in changes.items():
        section, _, field = key.partition(".")
        raw.setdefault(section, {})[field] = value
    return raw


def assert_user_error(done: subprocess.CompletedProcess, *needles: str) -> None:
    assert done.returncode == 2, (done.returncode, done.stderr[-3000:])
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    for needle in needles:
        assert needle in done.stderr, done.stderr[-3000:]


# --- 3. `kernels/` at the repository root --------------------------------------------------------


def test_peft_transformers_and_bitsandbytes_import_from_the_repository_root(tmp_path):
    code = (
        "import sys, peft, transformers, bitsandbytes\n"
        "from transformers.utils import import_utils\n"
        "assert not import_utils.is_kernels_available(), 'the repository kernels/ folder passed for the PyPI package'\n"
        "k = sys.modules.get('kernels')\n"
        "assert k is None or getattr(k, '__file__', None) is None, k\n"
        "assert not [n for n in sys.modules if n.startswith('kernels.')], 'project kernels imported a second time'\n"
        "print('ok')\n"
    )
    # What it logs is bitsandbytes' own: on CPUs with AVX512-bf16 and no PyPI `kernels`, it warns
    # "Failed to load CPU gemm_4bit_forward ... No module named 'kernels'" from any directory.
    # From the root it must log exactly what it logs elsewhere (growtrain itself silences that line).
    here, elsewhere = (subprocess.run([sys.executable, "-c", code], cwd=cwd, env=cli_env(), capture_output=True, text=True, timeout=120)
                       for cwd in (REPO, tmp_path))
    for done in (here, elsewhere):
        assert done.returncode == 0, done.stderr[-3000:]
        assert done.stdout.strip().endswith("ok")
    assert here.stderr == elsewhere.stderr, (here.stderr[-1500:], elsewhere.stderr[-1500:])


def test_the_kernels_stub_at_the_repository_root_has_no_submodules_and_fails_as_an_absent_package():
    code = (
        "import kernels\n"
        "try:\n    import kernels.grouped\nexcept ImportError:\n    pass\nelse:\n    raise SystemExit('second copy')\n"
        "try:\n    from kernels import get_kernel\nexcept ModuleNotFoundError as e:\n    print(e)\n"
        "print(getattr(kernels, '__version__', 'no version'))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-3000:]
    # Exactly what a Python without the PyPI package says.
    assert done.stdout.splitlines() == ["No module named 'kernels'", "no version"], done.stdout


# --- 1. packaged recipes by name -------------------------------------------------------------------


def test_a_bare_recipe_name_finds_the_packaged_recipe_from_any_directory(tmp_path):
    done = run_in(tmp_path, "validate", "tiny")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "4 stage(s)" in done.stdout
    missing = run_in(tmp_path, "validate", "tinny")
    assert_user_error(missing, "no packaged recipe of that name", "tiny", "120b")


@pytest.mark.slow
def test_the_built_wheel_installed_in_a_fresh_venv_validates_and_trains_outside_the_repository(tmp_path):
    """The wheel, not the editable tree: built from a copy of the tracked files, installed into a
    new venv (its dependencies borrowed from this interpreter's site-packages through a .pth line,
    so nothing is downloaded), run from a directory outside the repository."""
    import shutil
    import site
    import sysconfig
    import venv

    src = tmp_path / "src"
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO, capture_output=True, text=True, check=True)
    for rel in files.stdout.split():
        if (REPO / rel).is_file():
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / rel, src / rel)
    wheels = tmp_path / "wheels"
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(wheels), str(src)],
                           capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = wheels.glob("growtrain-*.whl")

    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=False)
    py = env_dir / "bin" / "python"
    purelib = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                  capture_output=True, text=True, check=True).stdout.strip())
    deps = [p for p in {sysconfig.get_paths()["purelib"], *site.getsitepackages()} if Path(p).is_dir()]
    (purelib / "borrowed-deps.pth").write_text("\n".join(deps) + "\n")
    installed = subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", "-q", str(wheel)],
                               capture_output=True, text=True, timeout=300)
    assert installed.returncode == 0, installed.stderr[-3000:]

    user = tmp_path / "elsewhere"
    user.mkdir()
    growtrain = env_dir / "bin" / "growtrain"
    where = subprocess.run([str(py), "-c", "import growtrain.stages.operators, growtrain.kernels.grouped, growtrain; print(growtrain.__file__)"],
                           cwd=user, capture_output=True, text=True, env=cli_env())
    assert where.returncode == 0, where.stderr[-3000:]
    assert where.stdout.startswith(str(purelib)), f"imported {where.stdout} instead of the installed wheel"
    for args in (["validate", "tiny"], ["validate", "small"], ["validate", "120b"], ["schema"], ["print-config", "tiny"], ["plan", "tiny"]):
        done = subprocess.run([str(growtrain), *args], cwd=user, capture_output=True, text=True, env=cli_env(), timeout=300)
        assert done.returncode == 0, (args, done.stderr[-3000:])
    (user / "micro.yaml").write_text(yaml.safe_dump(short_micro()))
    trained = subprocess.run([str(growtrain), "run", "micro.yaml", "--out", "run"], cwd=user, capture_output=True, text=True,
                             env=cli_env(), timeout=600)
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert "done: step 6" in trained.stdout
    assert (user / "run" / "checkpoints" / "latest").is_file()
    plotted = subprocess.run([str(growtrain), "plot", "run", "--out", "loss.png"], cwd=user, capture_output=True, text=True, env=cli_env(), timeout=300)
    assert plotted.returncode == 0 and (user / "loss.png").stat().st_size > 0, plotted.stderr[-3000:]
    exported = subprocess.run([str(growtrain), "export-hf", "run", "--out", "hf"], cwd=user, capture_output=True, text=True, env=cli_env(), timeout=300)
    assert exported.returncode == 0, exported.stderr[-3000:]
    assert {"modeling_growlm.py", "configuration_growlm.py", "model.safetensors", "tokenizer.json"} <= {p.name for p in (user / "hf").iterdir()}
    evals = Path(exported.stdout.split("--include_path ")[1].split()[0])  # the installed evaluation tasks
    assert evals.is_relative_to(purelib) and (evals / "growtrain_heldout_ppl.yaml").is_file() and (evals / "data" / "heldout.jsonl").is_file()
    # prepare-data from the wheel (its worker processes import the installed package), then the
    # same run on the shards: the same losses.
    micro = short_micro()
    data = micro["data"]
    prepared = subprocess.run([str(growtrain), "prepare-data", data["source"], "--out", "prepared", "--workers", "2",
                               "--max-bytes", str(data["max_bytes"]), "--eval-fraction", str(data["eval_fraction"]),
                               "--seed", str(micro["seed"])], cwd=user, capture_output=True, text=True, env=cli_env(), timeout=300)
    assert prepared.returncode == 0, prepared.stderr[-3000:]
    micro["data"] = {"source": "prepared", "eval_fraction": data["eval_fraction"]}
    (user / "prepared.yaml").write_text(yaml.safe_dump(micro))
    on_shards = subprocess.run([str(growtrain), "run", "prepared.yaml", "--out", "run-prepared"], cwd=user, capture_output=True,
                               text=True, env=cli_env(), timeout=600)
    assert on_shards.returncode == 0, on_shards.stderr[-3000:]
    assert "memory-mapped" in on_shards.stdout
    assert losses(user / "run-prepared") == losses(user / "run")


# --- 4. one run per run directory ------------------------------------------------------------------


def test_a_second_run_on_the_same_out_is_refused_naming_the_holder_and_the_first_is_unharmed(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump(short_micro()))
    out = tmp_path / "run"
    # The first run hangs mid-step, holding the directory.
    first = subprocess.Popen([sys.executable, "-m", "growtrain", "run", recipe, "--out", out], cwd=REPO,
                             env=cli_env(GROWTRAIN_FAULT="step_mid:3:hang"), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not list((out / "checkpoints").glob("step-*")) and time.monotonic() < deadline:
            assert first.poll() is None, first.communicate()
            time.sleep(0.2)
        second = run_cli("run", recipe, "--out", out)
        assert_user_error(second, "in use by another run", f"PID {first.pid}")
        assert first.poll() is None, "the first run must keep running"
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    # The kernel dropped the dead holder's lock: the same command now resumes.
    again = run_cli("run", recipe, "--out", out)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed from step-00000002" in again.stdout
    assert [s for s, *_ in losses(out)] == list(range(1, 7)), "metrics.jsonl must hold one row per step"


# --- 5. non-finite values never reach a checkpoint -------------------------------------------------


def test_validate_rejects_non_finite_numbers(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump(short_micro()))
    done = run_cli("validate", recipe, "--set", "optimizer.lr=.inf", "--set", "optimizer.weight_decay=.nan")
    assert_user_error(done, "optimizer.lr (--set): expected a finite number, got inf", "optimizer.weight_decay")


def _poison_after_step(monkeypatch, at_call: int) -> None:
    """Make the optimizer update of the at_call-th step leave a NaN in a weight, as an overflowing
    LR would (broadcast_dense runs right after every optimizer step)."""
    from growtrain.parallel.distributed import Dist

    calls = {"n": 0}
    original = Dist.broadcast_dense

    def poisoned(self, model):
        original(self, model)
        calls["n"] += 1
        if calls["n"] >= at_call:
            with torch.no_grad():
                next(model.parameters()).view(-1)[0] = float("nan")

    monkeypatch.setattr(Dist, "broadcast_dense", poisoned)


def _checkpointed_steps_all_finite(out: Path) -> list[int]:
    steps = []
    for ckpt in sorted((out / "checkpoints").glob("step-*")):
        for name, t in load_file(ckpt / "model.safetensors").items():
            assert torch.isfinite(t).all(), f"{ckpt.name}: {name} holds non-finite values"
        steps.append(int(ckpt.name.removeprefix("step-")))
    return steps


def test_an_update_that_makes_weights_non_finite_stops_the_run_before_any_checkpoint_of_it(tmp_path, monkeypatch):
    from growtrain.recipe import recipe_from_dict
    from growtrain.train import TrainingDiverged, run

    _poison_after_step(monkeypatch, at_call=3)
    with pytest.raises(TrainingDiverged, match="update of step 3 .* made parameters non-finite"):
        run(recipe_from_dict(short_micro()), tmp_path / "run", log=lambda *a, **k: None)
    assert _checkpointed_steps_all_finite(tmp_path / "run") == [2]


def test_a_non_finite_state_is_never_written_even_when_the_step_check_misses_it(tmp_path, monkeypatch):
    from growtrain.recipe import recipe_from_dict
    import growtrain.train as train_mod
    from growtrain.train import TrainingDiverged, run

    _poison_after_step(monkeypatch, at_call=3)
    monkeypatch.setattr(train_mod, "nonfinite_count", lambda model, dist, device: torch.zeros((), dtype=torch.float64))
    with pytest.raises(TrainingDiverged, match="refusing to checkpoint step 4"):
        run(recipe_from_dict(short_micro()), tmp_path / "run", log=lambda *a, **k: None)
    assert _checkpointed_steps_all_finite(tmp_path / "run") == [2]


# --- 6. relative paths and tokenizers travel with the run -----------------------------------------


def test_relative_data_and_tokenizer_paths_mean_the_recipes_files_from_any_directory(tmp_path):
    project = tmp_path / "project"
    text = "\n\n".join(p.read_text() for p in sorted((REPO / "docs").glob("*.md")))
    (project / "data").mkdir(parents=True)
    (project / "data" / "corpus.txt").write_text(text)
    write_bpe_tokenizer(project / "tok" / "tokenizer.json", text)
    raw = short_micro(**{"data.source": "data/corpus.txt", "data.tokenizer": "tok", "data.max_bytes": 0})
    (project / "r.yaml").write_text(yaml.safe_dump(raw))
    # A decoy in the working directory, where the old code looked.
    user = tmp_path / "user"
    (user / "data").mkdir(parents=True)
    (user / "data" / "corpus.txt").write_text("decoy " * 1000)
    (user / "tok").mkdir()
    write_bpe_tokenizer(user / "tok" / "tokenizer.json", "decoy decoy other words", vocab_size=280)

    first = run_in(user, "run", "../project/r.yaml", "--out", tmp_path / "run", "--set", "stages.0.steps=4")
    assert first.returncode == 0, first.stderr[-3000:]
    assert "corpus.txt" in first.stdout
    ckpt = tmp_path / "run" / "checkpoints" / "step-00000004"
    meta = json.loads((ckpt / "meta.json").read_text())
    assert meta["recipe"]["data"]["source"] == str(project / "data" / "corpus.txt")
    assert (ckpt / "tokenizer.json").read_bytes() == (project / "tok" / "tokenizer.json").read_bytes()
    assert (tmp_path / "run" / "tokenizer.json").is_file()

    # The same file named absolutely from one directory, relatively from another: the same recipe.
    same = run_in(tmp_path, "run", project / "r.yaml", "--out", tmp_path / "run2", "--set", "stages.0.steps=4")
    assert same.returncode == 0, same.stderr[-3000:]
    again = run_in(project, "run", "r.yaml", "--out", tmp_path / "run2", "--set", "stages.0.steps=4")
    assert again.returncode == 0 and "resumed from step-00000004" in again.stdout, again.stdout[-2000:] + again.stderr[-2000:]

    # generate from a third directory, with the recipe's tokenizer gone: the checkpoint's own copy.
    (project / "tok" / "tokenizer.json").unlink()
    gen = run_in(user, "generate", tmp_path / "run", "--prompt", "The ", "--max-new-tokens", "8", "--temperature", "0")
    assert gen.returncode == 0, gen.stderr[-3000:]
    assert gen.stdout.startswith("The ")


def test_a_resume_with_another_tokenizer_under_the_same_path_is_refused(tmp_path):
    text = "\n\n".join(p.read_text() for p in sorted((REPO / "docs").glob("*.md")))
    (tmp_path / "corpus.txt").write_text(text)
    write_bpe_tokenizer(tmp_path / "tokenizer.json", text)
    raw = short_micro(**{"data.source": "corpus.txt", "data.tokenizer": "tokenizer.json", "data.max_bytes": 0})
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(raw))
    first = run_cli("run", tmp_path / "r.yaml", "--out", tmp_path / "run", "--set", "stages.0.steps=2")
    assert first.returncode == 0, first.stderr[-3000:]
    write_bpe_tokenizer(tmp_path / "tokenizer.json", text, vocab_size=290)
    second = run_cli("run", tmp_path / "r.yaml", "--out", tmp_path / "run", "--set", "stages.0.steps=2")
    assert_user_error(second, "is not the file this run was trained with", "tokenizer.json")


# --- 7. the machine's errors are messages ----------------------------------------------------------


def test_out_under_a_file_is_a_message_naming_the_path(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump(short_micro()))
    (tmp_path / "afile").write_text("x")
    done = run_cli("run", recipe, "--out", tmp_path / "afile" / "run")
    assert_user_error(done, str(tmp_path / "afile"), "choose another path")


def _mount_tmpfs(where: Path, options: str) -> bool:
    where.mkdir(parents=True, exist_ok=True)
    return subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)], capture_output=True).returncode == 0


@pytest.fixture
def small_disk(tmp_path):
    """A tmpfs of 800 KiB: two micro checkpoints fit, not three (root only: skipped where mounting is not allowed)."""
    where = tmp_path / "disk"
    if os.geteuid() != 0 or not _mount_tmpfs(where, "size=800k"):
        pytest.skip("needs root and permission to mount a tmpfs")
    yield where
    subprocess.run(["umount", "-l", str(where)], capture_output=True)


def test_a_full_disk_is_a_message_leaves_no_temporary_files_and_the_run_resumes(tmp_path, small_disk):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump(short_micro(**{"checkpoint.keep_last": 50})))
    out = small_disk / "run"
    done = run_cli("run", recipe, "--out", out)
    assert_user_error(done, "No space left on device", "run the same command")
    assert not list((out / "checkpoints").glob(".tmp-*")), "a failed save must leave no temporary files"
    written = [p.name for p in (out / "checkpoints").glob("step-*")]
    subprocess.run(["mount", "-o", "remount,size=64m", str(small_disk)], check=True)
    resumed = run_cli("run", recipe, "--out", out)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert (f"resumed from {max(written)}" in resumed.stdout) if written else "resumed" not in resumed.stdout


def test_a_read_only_out_and_export_to_a_bad_path_are_messages(tmp_path):
    recipe = tmp_path / "r.yaml"
    raw = short_micro()
    raw["model"]["dense_lora"] = {"r": 2}  # something to export
    recipe.write_text(yaml.safe_dump(raw))
    trained = run_cli("run", recipe, "--out", tmp_path / "run", "--set", "stages.0.steps=2")
    assert trained.returncode == 0, trained.stderr[-3000:]
    (tmp_path / "afile").write_text("x")
    fine = run_cli("export-adapters", tmp_path / "run", tmp_path / "adapters")
    assert fine.returncode == 0, fine.stderr[-3000:]
    export = run_cli("export-adapters", tmp_path / "run", tmp_path / "afile" / "adapters")
    assert_user_error(export, str(tmp_path / "afile"))
    ro = tmp_path / "ro"
    if os.geteuid() != 0 or not _mount_tmpfs(ro, "size=1m,ro"):
        pytest.skip("needs root and permission to mount a read-only tmpfs")
    try:
        done = run_cli("run", recipe, "--out", ro / "run")
        assert_user_error(done, "Read-only file system", str(ro / "run"))
    finally:
        subprocess.run(["umount", "-l", str(ro)], capture_output=True)
