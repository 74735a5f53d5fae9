"""Checkpoints: atomic saves, verified loads, fallback past damaged ones, retention, a real SIGKILL."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from growtrain.checkpoint.store import (
    CheckpointConfig,
    CheckpointError,
    CheckpointManager,
    LoadedCheckpoint,
    read_meta,
    resolve,
    verify_checkpoint,
)

REPO = Path(__file__).resolve().parents[1]


def _model_state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(6, 5, generator=g)
    return {
        "embed.weight": torch.randn(11, 5, generator=g),
        "block.0.w_T": w.t(),  # non-contiguous: must be made contiguous
        "block.0.bias": torch.randn(5, generator=g, dtype=torch.float64),
        "head.codes": torch.randint(0, 255, (7,), generator=g, dtype=torch.uint8),
        "block.0.norm": torch.ones(5, dtype=torch.bfloat16),
        "empty": torch.empty(0),
    }


def _trainer_state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "optimizer": {
            "state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(4, generator=g)}},
            "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "foreach": None, "params": [0]}],
        },
        "schedule": {"step": seed, "name": "cosine", "warm": True},
        "rng": {"torch": torch.get_rng_state(), "python": [3, list(range(5)), None]},
        "data_position": [seed, 17],
    }


def _meta(step: int) -> dict:
    return {"stage": 1, "step": step, "tokens": step * 64, "growth_history": [{"op": "deepen"}], "wandb_id": "x1"}


def _save(mgr: CheckpointManager, step: int, **kw) -> Path:
    return mgr.save(step, model_state=_model_state(step), trainer_state=_trainer_state(step), meta=_meta(step), **kw)


class _Log(list):
    def __call__(self, msg: str) -> None:
        self.append(msg)


@pytest.fixture
def log() -> _Log:
    return _Log()


@pytest.fixture
def mgr(tmp_path: Path, log: _Log) -> CheckpointManager:
    return CheckpointManager(tmp_path / "run", CheckpointConfig(every_steps=10, keep_last=5), log=log)


def _assert_same(a, b) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
        # Compare bytes, not values: bit-for-bit, and NaN-safe.
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b):
            _assert_same(x, y)
    else:
        assert a == b and type(a) is type(b)


def test_save_then_load_round_trips_tensors_trainer_state_and_meta_bit_for_bit(mgr):
    path = mgr.save(
        120,
        model_state=_model_state(1),
        trainer_state=_trainer_state(1),
        meta=_meta(120),
        stage_end=True,
        extra_files={"recipe.yaml": "stages:\n  - name: seed\n"},
    )
    assert path == mgr.run_dir / "checkpoints" / "step-00000120"
    assert (mgr.run_dir / "checkpoints" / "latest").read_text().strip() == "step-00000120"
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["format"] == 1 and manifest["stage_end"] is True
    assert set(manifest["files"]) == {"model.safetensors", "trainer.pt", "meta.json", "recipe.yaml"}

    loaded = mgr.load(path)
    assert isinstance(loaded, LoadedCheckpoint)
    assert loaded.step == 120 and loaded.stage_end is True and loaded.path == path
    _assert_same(_model_state(1), loaded.model_state)
    assert all(t.is_contiguous() for t in loaded.model_state.values())
    _assert_same(_trainer_state(1), loaded.trainer_state)
    assert loaded.meta == _meta(120)
    assert read_meta(path) == _meta(120)
    assert (path / "recipe.yaml").read_text() == "stages:\n  - name: seed\n"
    assert mgr.verify(path) == []


def test_tensors_sharing_storage_are_saved_as_separate_copies(mgr):
    w = torch.randn(4, 3)
    path = mgr.save(1, model_state={"embed": w, "head": w, "row": w[1]}, trainer_state={}, meta={})
    loaded = mgr.load(path)
    assert torch.equal(loaded.model_state["embed"], w) and torch.equal(loaded.model_state["head"], w)
    assert torch.equal(loaded.model_state["row"], w[1])


def test_load_reads_trainer_state_with_weights_only(mgr, monkeypatch):
    path = _save(mgr, 10)
    calls = []
    real_load = torch.load

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return real_load(*args, **kwargs)

    monkeypatch.setattr(torch, "load", spy)
    mgr.load(path)
    assert calls and all(c.get("weights_only") is True for c in calls)


class _Opaque:
    pass


def test_trainer_state_holding_an_arbitrary_object_is_refused_at_save_time(mgr):
    with pytest.raises(TypeError, match=r"trainer_state\['sched'\]\['fn'\].*_Opaque"):
        mgr.save(10, model_state=_model_state(0), trainer_state={"sched": {"fn": _Opaque()}}, meta={})
    assert mgr.complete_checkpoints() == []
    assert not list((mgr.run_dir / "checkpoints").glob(".tmp-*"))


def test_a_pickled_object_smuggled_into_trainer_pt_is_not_unpickled(mgr):
    path = _save(mgr, 10)
    torch.save({"evil": _Opaque()}, path / "trainer.pt")
    _rewrite_manifest_to_match(path)
    assert mgr.verify(path) == []
    with pytest.raises(CheckpointError, match="trainer.pt"):
        mgr.load(path)


def _rewrite_manifest_to_match(path: Path) -> None:
    import hashlib

    manifest = json.loads((path / "manifest.json").read_text())
    for name, entry in manifest["files"].items():
        data = (path / name).read_bytes()
        entry["bytes"], entry["sha256"] = len(data), hashlib.sha256(data).hexdigest()
    (path / "manifest.json").write_text(json.dumps(manifest))


def test_truncated_model_file_is_reported_and_the_previous_checkpoint_is_loaded(mgr, log):
    _save(mgr, 100)
    newest = _save(mgr, 120)
    f = newest / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-7])

    assert any("model.safetensors: size mismatch" in p for p in mgr.verify(newest))
    loaded = mgr.load_latest()
    assert loaded.step == 100
    _assert_same(_model_state(100), loaded.model_state)
    assert any(
        "checkpoint step-00000120 is damaged (model.safetensors: size mismatch" in m
        and m.endswith("falling back to step-00000100")
        for m in log
    ), log


def test_a_flipped_bit_in_trainer_pt_is_reported_and_the_previous_checkpoint_is_loaded(mgr, log):
    _save(mgr, 100)
    newest = _save(mgr, 120)
    f = newest / "trainer.pt"
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x10
    f.write_bytes(bytes(data))

    assert mgr.verify(newest) == ["trainer.pt: sha256 mismatch"]
    with pytest.raises(CheckpointError, match="trainer.pt: sha256 mismatch"):
        mgr.load(newest)
    assert mgr.load_latest().step == 100
    assert "checkpoint step-00000120 is damaged (trainer.pt: sha256 mismatch); falling back to step-00000100" in log


def test_when_every_checkpoint_is_damaged_load_latest_raises_listing_each(mgr):
    for step in (10, 20):
        path = _save(mgr, step)
        (path / "meta.json").unlink()
    (mgr.run_dir / "checkpoints" / "step-00000020" / "manifest.json").write_text("{not json")
    with pytest.raises(CheckpointError) as e:
        mgr.load_latest()
    msg = str(e.value)
    assert "step-00000020" in msg and "manifest.json: unreadable" in msg
    assert "step-00000010" in msg and "meta.json: missing" in msg


def test_load_latest_returns_none_for_a_run_without_checkpoints(mgr):
    assert mgr.load_latest() is None
    assert mgr.complete_checkpoints() == []


def test_a_leftover_tmp_dir_is_ignored_by_loads_and_swept_by_the_next_save(mgr, log):
    _save(mgr, 10)
    ckpts = mgr.run_dir / "checkpoints"
    leftover = ckpts / ".tmp-step-00000020-99999"
    leftover.mkdir()
    (leftover / "model.safetensors").write_bytes(b"half a file")
    (leftover / "manifest.json").write_text('{"format": 1, "files": {}}')

    assert mgr.complete_checkpoints() == [ckpts / "step-00000010"]
    assert mgr.load_latest().step == 10
    _save(mgr, 20)
    assert not leftover.exists()
    assert any(".tmp-step-00000020-99999" in m for m in log)
    assert mgr.load_latest().step == 20


def test_a_checkpoint_dir_without_manifest_is_ignored(mgr):
    _save(mgr, 10)
    half = mgr.run_dir / "checkpoints" / "step-00000020"
    half.mkdir()
    (half / "model.safetensors").write_bytes(b"x")
    assert mgr.complete_checkpoints() == [mgr.run_dir / "checkpoints" / "step-00000010"]
    assert mgr.load_latest().step == 10
    with pytest.raises(CheckpointError, match="manifest.json: missing"):
        mgr.load(half)


def test_retention_keeps_the_newest_keep_last_plus_every_stage_end(tmp_path):
    mgr = CheckpointManager(tmp_path / "run", CheckpointConfig(every_steps=10, keep_last=2), log=lambda m: None)
    for step in (10, 20, 30, 40, 50, 60):
        _save(mgr, step, stage_end=step in (20, 40))
    steps = [int(p.name.split("-")[1]) for p in mgr.complete_checkpoints()]
    assert steps == [60, 50, 40, 20]

    no_stage_ends = CheckpointManager(
        tmp_path / "run2", CheckpointConfig(keep_last=1, keep_stage_ends=False), log=lambda m: None
    )
    for step in (10, 20, 30):
        _save(no_stage_ends, step, stage_end=True)
    assert [p.name for p in no_stage_ends.complete_checkpoints()] == ["step-00000030"]


def test_retention_never_deletes_the_checkpoint_just_written(tmp_path):
    mgr = CheckpointManager(tmp_path / "run", CheckpointConfig(keep_last=1), log=lambda m: None)
    _save(mgr, 100)
    older = _save(mgr, 50)  # e.g. resumed from a fallback, so an older step is saved last
    assert older.exists()


def test_saving_a_step_again_replaces_the_old_checkpoint(mgr):
    path = _save(mgr, 10)
    mgr.save(10, model_state=_model_state(99), trainer_state={}, meta={"again": True})
    loaded = mgr.load(path)
    assert loaded.meta == {"again": True}
    _assert_same(_model_state(99), loaded.model_state)
    assert [p.name for p in (mgr.run_dir / "checkpoints").iterdir() if p.name.startswith(".tmp")] == []


def test_the_newest_verified_checkpoint_wins_when_latest_points_to_an_older_one(mgr, log):
    _save(mgr, 10)
    _save(mgr, 20)
    # A kill between the rename of step-20 and the pointer update leaves `latest` at step-10.
    (mgr.run_dir / "checkpoints" / "latest").write_text("step-00000010\n")
    assert mgr.load_latest().step == 20
    assert any("'latest' names step-00000010" in m for m in log)


def test_should_save_follows_every_steps():
    mgr = CheckpointManager(Path("/nonexistent"), CheckpointConfig(every_steps=50))
    assert [s for s in range(0, 201, 25) if mgr.should_save(s)] == [0, 50, 100, 150, 200]
    assert not CheckpointManager(Path("/nonexistent"), CheckpointConfig(every_steps=0)).should_save(100)


def test_resolve_accepts_a_checkpoint_dir_or_a_run_dir_and_rejects_anything_else(mgr, tmp_path):
    _save(mgr, 10)
    path = _save(mgr, 20)
    assert resolve(path / ".." / "step-00000010").step == 10
    assert mgr.resolve(mgr.run_dir).step == 20
    assert resolve(mgr.run_dir / "checkpoints").step == 20
    (tmp_path / "other").mkdir()
    with pytest.raises(CheckpointError, match="neither a checkpoint directory"):
        resolve(tmp_path / "other")
    with pytest.raises(CheckpointError, match="no such file"):
        resolve(tmp_path / "missing")
    (tmp_path / "empty_run" / "checkpoints").mkdir(parents=True)
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        resolve(tmp_path / "empty_run")


def test_extra_files_may_not_shadow_checkpoint_files_or_leave_the_dir(mgr):
    for bad in ("manifest.json", "model.safetensors", "../escape.txt", "sub/x.yaml", ".hidden"):
        with pytest.raises(ValueError):
            _save(mgr, 10, extra_files={bad: "x"})
    assert mgr.complete_checkpoints() == []


def test_config_fields_carry_docs_and_ranges():
    from dataclasses import fields

    meta = {f.name: f.metadata for f in fields(CheckpointConfig)}
    assert all(m.get("doc") for m in meta.values())
    assert meta["every_steps"]["ge"] == 0 and meta["keep_last"]["ge"] == 1


_CRASHING_SAVE = textwrap.dedent(
    """
    import sys, torch
    from pathlib import Path
    from growtrain.checkpoint.store import CheckpointConfig, CheckpointManager
    mgr = CheckpointManager(Path(sys.argv[1]), CheckpointConfig())
    mgr.save(20, model_state={"w": torch.ones(64, 64)}, trainer_state={"step": 20}, meta={"step": 20})
    print("save finished, the fault did not fire")
    """
)


def test_a_sigkill_mid_save_leaves_the_previous_checkpoint_loadable_and_the_next_save_works(mgr, log):
    _save(mgr, 10)
    env = dict(os.environ, GROWTRAIN_FAULT="checkpoint_mid:1")
    proc = subprocess.run(
        [sys.executable, "-c", _CRASHING_SAVE, str(mgr.run_dir)],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == -9, proc.stdout + proc.stderr
    ckpts = mgr.run_dir / "checkpoints"
    leftovers = list(ckpts.glob(".tmp-step-00000020-*"))
    assert len(leftovers) == 1 and (leftovers[0] / "model.safetensors").exists()
    assert not (leftovers[0] / "manifest.json").exists()

    loaded = mgr.load_latest()
    assert loaded.step == 10
    _assert_same(_model_state(10), loaded.model_state)

    _save(mgr, 20)
    assert not list(ckpts.glob(".tmp-*"))
    assert mgr.load_latest().step == 20


def test_a_checkpoint_saved_after_growth_is_newer_than_the_stage_end_at_the_same_step(tmp_path, log):
    mgr = CheckpointManager(tmp_path / "run", CheckpointConfig(every_steps=10, keep_last=2), log=log)
    _save(mgr, 10)
    _save(mgr, 20, stage_end=True)
    grown = _save(mgr, 20, grown=True)
    assert grown.name == "step-00000020-grown"
    assert [p.name for p in mgr.complete_checkpoints()] == ["step-00000020-grown", "step-00000020"]
    assert mgr.load_latest().path == grown and mgr.load_latest().step == 20
    assert json.loads((grown / "manifest.json").read_text())["grown"] is True
    # Later checkpoints push it out like any other; the stage end stays.
    _save(mgr, 30)
    _save(mgr, 40)
    assert [p.name for p in mgr.complete_checkpoints()] == ["step-00000040", "step-00000030", "step-00000020"]


def test_ranks_hash_disjoint_shares_of_the_files_that_together_cover_every_file(mgr, monkeypatch):
    from growtrain.checkpoint import store as checkpoint

    path = _save(mgr, 10, extra_files={"recipe.yaml": "a: 1\n", "notes.txt": "x"})
    hashed: list[str] = []
    original = checkpoint._sha256
    monkeypatch.setattr(checkpoint, "_sha256", lambda p: hashed.append(p.name) or original(p))
    shares = []
    for k in range(3):
        hashed.clear()
        assert verify_checkpoint(path, (k, 3)) == []
        shares.append(set(hashed))
    files = set(json.loads((path / "manifest.json").read_text())["files"])
    assert set().union(*shares) == files and sum(len(s) for s in shares) == len(files)
    # A changed byte is found by the share that holds the file, and only there.
    target = path / "recipe.yaml"
    target.write_text("a: 2\n")
    found = [verify_checkpoint(path, (k, 3)) for k in range(3)]
    assert sum(bool(f) for f in found) == 1 and any("recipe.yaml: sha256 mismatch" in p for f in found for p in f)


def test_resume_gives_every_loaded_tensor_aligned_storage_of_its_own(tmp_path):
    """safetensors 0.8 returns tensors at 8-byte offsets of the file's buffer; the AVX-512 kernels
    round a misaligned operand otherwise, so a resumed run drifted from the uninterrupted one by a
    few ulps (tests/test_resume.py caught it). The trainer copies such tensors into aligned storage."""
    from safetensors.torch import load_file, save_file

    from growtrain.checkpoint.resume import ALLOCATOR_ALIGNMENT, owning as _owning

    save_file({"a": torch.randn(3), "b": torch.randn(5, 7), "c": torch.randn(64)}, str(tmp_path / "m.safetensors"))
    loaded = load_file(str(tmp_path / "m.safetensors"))
    owned = {n: _owning(t) for n, t in loaded.items()}
    for n, t in owned.items():
        assert t.data_ptr() % ALLOCATOR_ALIGNMENT == 0 and torch.equal(t, loaded[n]), n
        assert t.untyped_storage().nbytes() == t.numel() * t.element_size(), n
    big = torch.randn(10, 4)
    assert _owning(big) is big  # aligned and alone in its storage: no copy
    assert _owning(big[2:4]).untyped_storage().nbytes() == 2 * 4 * 4  # a view of a larger storage: copied
