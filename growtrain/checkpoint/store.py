"""Atomic, verified checkpoints (DESIGN.md §9).

Layout under a run directory::

    run_dir/checkpoints/
        step-00000120/          model.safetensors, trainer.pt, meta.json, [extra files], manifest.json
        latest                  text: the name of the newest checkpoint dir (a hint, see load_latest)
        .tmp-step-...-<pid>/    a save in progress, or the remains of one that was killed

A save writes everything into a `.tmp-*` dir, fsyncs each file, writes `manifest.json` last (sizes
and sha256 of every other file), then renames the dir into place and updates `latest`. A run can be
SIGKILLed at any instant: a dir named `step-*` with a manifest is complete, anything else is ignored
by loads and swept by the next save. Loads check the manifest and fall back to the previous complete
checkpoint, saying why, so a resumed run never reads half a checkpoint.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from growtrain.checkpoint.durable import fsync_dir, fsync_file, write_synced
from growtrain.model.expert_shards import assemble, is_expert_tensor, slice_state
from growtrain.runtime.faults import maybe_fault

MANIFEST_FORMAT = 1
MODEL_FILE = "model.safetensors"
TRAINER_FILE = "trainer.pt"
META_FILE = "meta.json"
MANIFEST_FILE = "manifest.json"
LATEST_FILE = "latest"
_RESERVED = {MODEL_FILE, TRAINER_FILE, META_FILE, MANIFEST_FILE}
_CHUNK = 1 << 20
# step-NNNNNNNN, or step-NNNNNNNN-grown: saved right after a stage's growth, before its first step
# (the same global step as the previous stage's end, and newer than it).
_STEP_DIR = re.compile(r"step-(\d{8,})(-grown)?")
GROWN_SUFFIX = "-grown"


@dataclass(frozen=True)
class CheckpointConfig:
    """When checkpoints are written and how many are kept."""

    every_steps: int = field(
        default=100,
        metadata={"doc": "Save every N global steps; 0 saves only at stage ends.", "ge": 0},
    )
    keep_last: int = field(
        default=2,
        metadata={"doc": "How many of the most recent checkpoints to keep.", "ge": 1},
    )
    keep_stage_ends: bool = field(
        default=True,
        metadata={"doc": "Never delete the checkpoint written at the end of a stage."},
    )
    after_growth: bool = field(
        default=True,
        metadata={
            "doc": "Save a checkpoint right after each stage's growth, before its first step (step-N-grown), so that a "
            "crash early in the stage resumes without repeating the growth and its checks."
        },
    )


class CheckpointError(Exception):
    """A checkpoint is missing, incomplete or damaged."""


@dataclass
class LoadedCheckpoint:
    path: Path
    step: int
    model_state: dict[str, torch.Tensor]
    trainer_state: dict[str, Any]
    meta: dict[str, Any]
    stage_end: bool


def step_dir_name(step: int, grown: bool = False) -> str:
    return f"step-{step:08d}" + (GROWN_SUFFIX if grown else "")


# ---------------------------------------------------------------------------------------------
# Disk space


def _disk_full(path: Path) -> bool:
    try:
        return shutil.disk_usage(path).free < (1 << 20)
    except OSError:
        return False


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------
# What may go into a checkpoint


def _plain_model_state(model_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Detached, contiguous tensors with no two sharing storage (safetensors refuses shared ones)."""
    out: dict[str, torch.Tensor] = {}
    seen: set[tuple[str, int]] = set()
    for name, t in model_state.items():
        if not isinstance(name, str):
            raise TypeError(f"model_state keys must be str, got {type(name).__name__} ({name!r})")
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"model_state[{name!r}] is a {type(t).__name__}, expected a torch.Tensor")
        t = t.detach().contiguous()
        key = (str(t.device), t.untyped_storage().data_ptr())
        if key[1] != 0 and key in seen:
            t = t.clone()
        seen.add((str(t.device), t.untyped_storage().data_ptr()))
        out[name] = t
    return out


_PLAIN_SCALARS = (int, float, str, bool, type(None), bytes, torch.dtype, torch.device)


def _check_plain(obj: Any, where: str) -> None:
    """Refuse at save time what torch.load(weights_only=True) would refuse at resume time."""
    if isinstance(obj, (torch.Tensor, torch.Size) + _PLAIN_SCALARS):
        return
    if isinstance(obj, dict):
        for k, v in obj.items():
            if not isinstance(k, (str, int, float, bool, type(None))):
                raise TypeError(f"{where}: key {k!r} is a {type(k).__name__}; use str or int keys")
            _check_plain(v, f"{where}[{k!r}]")
        return
    if isinstance(obj, (list, tuple)):
        if isinstance(obj, tuple) and type(obj) is not tuple:
            raise TypeError(f"{where}: {type(obj).__name__} (a named tuple) cannot be loaded with weights_only")
        for i, v in enumerate(obj):
            _check_plain(v, f"{where}[{i}]")
        return
    raise TypeError(
        f"{where}: {type(obj).__module__}.{type(obj).__qualname__} cannot be loaded with "
        "torch.load(weights_only=True); convert it to tensors, numbers, strings, lists or dicts"
    )


def _check_extra_name(name: str) -> None:
    if name in _RESERVED or name == LATEST_FILE:
        raise ValueError(f"extra file name {name!r} is reserved by the checkpoint format")
    if not name or "/" in name or "\\" in name or name.startswith(".") or name != os.path.basename(name):
        raise ValueError(f"extra file name {name!r} must be a plain file name (no directories, no leading dot)")


# ---------------------------------------------------------------------------------------------
# Reading and verifying


def _read_manifest(path: Path) -> dict[str, Any]:
    mpath = path / MANIFEST_FILE
    try:
        manifest = json.loads(mpath.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{MANIFEST_FILE}: missing (the save did not finish)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{MANIFEST_FILE}: unreadable ({e})") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        raise CheckpointError(f"{MANIFEST_FILE}: unreadable (no 'files' table)")
    if manifest.get("format") != MANIFEST_FORMAT:
        raise CheckpointError(
            f"{MANIFEST_FILE}: format {manifest.get('format')!r}, this growtrain reads format {MANIFEST_FORMAT}"
        )
    return manifest


def file_entry(path: Path) -> dict:
    """A file's manifest entry: its size and sha256."""
    return {"bytes": path.stat().st_size, "sha256": _sha256(path)}


def verify_checkpoint(path: Path, part: tuple[int, int] = (0, 1)) -> list[str]:
    """Problems with the checkpoint dir `path`, as 'file: what is wrong'; empty if it is intact.

    part = (k, n): every file's presence and size are checked, the sha256 only of the files whose
    index in the manifest's sorted names is k mod n: n ranks, each with its own k, hash every file
    once between them, in parallel (combine their problems for the verdict)."""
    path = Path(path)
    try:
        manifest = _read_manifest(path)
    except CheckpointError as e:
        return [str(e)]
    problems = []
    files = manifest["files"]
    for required in (MODEL_FILE, TRAINER_FILE, META_FILE):
        if required not in files:
            problems.append(f"{required}: not listed in {MANIFEST_FILE}")
    k, n = part
    hashed = {name for i, name in enumerate(sorted(files, key=str)) if i % n == k}
    for name, entry in files.items():
        if not isinstance(name, str) or name != os.path.basename(name) or name in ("", ".", ".."):
            problems.append(f"{name!r}: not a plain file name in {MANIFEST_FILE}")
            continue
        if not isinstance(entry, dict) or not isinstance(entry.get("bytes"), int) or not isinstance(
            entry.get("sha256"), str
        ):
            problems.append(f"{name}: malformed entry in {MANIFEST_FILE}")
            continue
        fpath = path / name
        try:
            size = fpath.stat().st_size
        except FileNotFoundError:
            problems.append(f"{name}: missing")
            continue
        except OSError as e:
            problems.append(f"{name}: unreadable ({e})")
            continue
        if size != entry["bytes"]:
            problems.append(f"{name}: size mismatch ({size} bytes, manifest says {entry['bytes']})")
            continue
        if name not in hashed:
            continue
        try:
            digest = _sha256(fpath)
        except OSError as e:
            problems.append(f"{name}: unreadable ({e})")
            continue
        if digest != entry["sha256"]:
            problems.append(f"{name}: sha256 mismatch")
    return problems


def _step_of(path: Path) -> tuple[int, int] | None:
    """(step, 1 for a checkpoint saved after growth else 0): the order of a run's checkpoints."""
    m = _STEP_DIR.fullmatch(path.name)
    return (int(m.group(1)), 1 if m.group(2) else 0) if m else None


def write_shard_file(path: Path, shard: dict) -> None:
    """One rank's expert shard (growtrain/model/expert_shards.py), fsynced: written by every rank into the
    temporary dir of a save that rank 0 finishes."""
    _check_plain(shard, "expert shard")
    with open(path, "wb") as f:
        torch.save(shard, f)
        f.flush()
        os.fsync(f.fileno())


def shard_file_name(rank: int, size: int) -> str:
    return f"experts-{rank:03d}-of-{size:03d}.pt"


def dense_state_file_name(rank: int, size: int) -> str:
    """An AF attention rank's file: its ZeRO-1 share of the dense optimizer state."""
    return f"dense-state-{rank:03d}-of-{size:03d}.pt"


def _merge_expert_shards(path: Path, model_state: dict, trainer_state: dict, meta: dict, expert_shard: tuple[int, int] | None) -> None:
    """Put the experts of `expert_shard` = (rank, size) into model_state and the optimizer state:
    from the per-rank shard files of a checkpoint saved under expert parallelism or in an AF
    layout (each read only over the needed range: memory-mapped), or cut from the full tensors of
    one saved by one process. expert_shard None: no routed expert at all (an AF attention rank),
    the dense optimizer entries still gathered from every file that holds some."""
    saved = meta.get("expert_parallel")
    optimizer = trainer_state.get("optimizer", {})
    if not saved:
        if expert_shard is None:
            for state in (model_state, optimizer):
                for n in [n for n in state if is_expert_tensor(n)]:
                    del state[n]
        elif expert_shard[1] > 1:
            rank, size = expert_shard
            model_state.update(slice_state({n: t for n, t in model_state.items() if is_expert_tensor(n)}, rank, size))
            trainer_state["optimizer"] = slice_state(optimizer, rank, size)
        return
    for fname in saved.get("dense_files", []):  # AF: each attention rank's ZeRO-1 share of the dense state
        try:
            part = torch.load(path / fname, weights_only=True, map_location="cpu", mmap=True)
            optimizer.update(part["optimizer"])
        except Exception as e:  # noqa: BLE001
            raise CheckpointError(f"checkpoint {path.name} is damaged ({fname}: {e})") from e
    model_pieces, optim_pieces = [], []
    for fname in saved["files"]:
        try:
            shard = torch.load(path / fname, weights_only=True, map_location="cpu", mmap=True)
        except Exception as e:  # noqa: BLE001
            raise CheckpointError(f"checkpoint {path.name} is damaged ({fname}: {e})") from e
        try:
            model_pieces.append((shard["ep_rank"], shard["ep_size"], shard["model"]))
            optim_pieces.append((shard["ep_rank"], shard["ep_size"], {n: v for n, v in shard["optimizer"].items() if is_expert_tensor(n)}))
            for n, v in shard["optimizer"].items():  # dense entries: each on its ZeRO-1 owner, whole
                if not is_expert_tensor(n):
                    optimizer[n] = v
        except (KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"checkpoint {path.name} is damaged ({fname}: not an expert shard: {e})") from e
    if len(model_pieces) != saved["size"]:
        raise CheckpointError(f"checkpoint {path.name}: {len(model_pieces)} expert shards, meta.json says {saved['size']}")
    trainer_state["optimizer"] = optimizer
    if expert_shard is None:
        return
    rank, size = expert_shard
    try:
        model_state.update(assemble(model_pieces, rank, size))
        optimizer.update(assemble(optim_pieces, rank, size))
    except (KeyError, ValueError, IndexError) as e:  # shards that do not fit together
        raise CheckpointError(f"checkpoint {path.name}: its expert shards do not fit together ({type(e).__name__}: {e})") from e
    trainer_state["optimizer"] = optimizer


def load_checkpoint(
    path: Path,
    expert_shard: tuple[int, int] | None = (0, 1),
    combine: Callable[[list[str]], list[str]] | None = None,
    part: tuple[int, int] | None = None,
) -> LoadedCheckpoint:
    """Verify, then load the checkpoint dir `path`; CheckpointError listing the problems if damaged.
    expert_shard = (rank, size): the routed experts of that expert-parallel rank (the default,
    (0, 1), is the whole model), whatever EP size or layout the checkpoint was saved at; None: no
    routed expert (an AF attention rank). combine: with several processes, every rank's problems
    for all of them (each rank hashes its share of the files, verify_checkpoint's part: `part`, by
    default expert_shard); without, this rank hashes every file."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a directory")
    part = part or expert_shard or (0, 1)
    problems = combine(verify_checkpoint(path, part)) if combine is not None else verify_checkpoint(path)
    if problems:
        raise CheckpointError(f"checkpoint {path.name} is damaged ({'; '.join(problems)})")
    manifest = _read_manifest(path)
    try:
        model_state = load_file(str(path / MODEL_FILE), device="cpu")
    except Exception as e:  # noqa: BLE001 - any parse failure means the same thing to the caller
        raise CheckpointError(f"checkpoint {path.name} is damaged ({MODEL_FILE}: {e})") from e
    try:
        # weights_only: a checkpoint is data; unpickling arbitrary objects from it would run code.
        trainer_state = torch.load(path / TRAINER_FILE, weights_only=True, map_location="cpu")
    except Exception as e:  # noqa: BLE001
        raise CheckpointError(f"checkpoint {path.name} is damaged ({TRAINER_FILE}: {e})") from e
    meta = _read_meta_file(path)
    _merge_expert_shards(path, model_state, trainer_state, meta, expert_shard)
    step = manifest.get("step")
    if not isinstance(step, int):
        order = _step_of(path)
        if order is None:
            raise CheckpointError(f"checkpoint {path.name}: no step in {MANIFEST_FILE} nor in the dir name")
        step = order[0]
    return LoadedCheckpoint(
        path=path,
        step=step,
        model_state=model_state,
        trainer_state=trainer_state,
        meta=meta,
        stage_end=bool(manifest.get("stage_end", False)),
    )


def _read_meta_file(path: Path) -> dict[str, Any]:
    try:
        meta = json.loads((path / META_FILE).read_text())
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path.name}: {META_FILE} is missing") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"checkpoint {path.name}: {META_FILE} is unreadable ({e})") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"checkpoint {path.name}: {META_FILE} does not hold a JSON object")
    return meta


def read_meta(path: Path) -> dict[str, Any]:
    """meta.json of a complete checkpoint dir, without touching (or checksumming) the tensors."""
    path = Path(path)
    if not (path / MANIFEST_FILE).is_file():
        raise CheckpointError(f"{path}: not a complete checkpoint (no {MANIFEST_FILE})")
    return _read_meta_file(path)


def resolve(
    path_or_dir: Path,
    log: Callable[[str], None] = print,
    expert_shard: tuple[int, int] | None = (0, 1),
    combine: Callable[[list[str]], list[str]] | None = None,
    part: tuple[int, int] | None = None,
) -> LoadedCheckpoint:
    """Load a checkpoint dir, or the newest intact checkpoint of a run dir (load_checkpoint's arguments)."""
    p = Path(path_or_dir)
    if not p.exists():
        raise CheckpointError(f"{p}: no such file or directory")
    if (p / MANIFEST_FILE).is_file() or _step_of(p) is not None:
        return load_checkpoint(p, expert_shard, combine, part)
    if (p / "checkpoints").is_dir():
        loaded = CheckpointManager(p, CheckpointConfig(), log=log, expert_shard=expert_shard, combine=combine, part=part).load_latest()
        if loaded is None:
            raise CheckpointError(f"{p}: run directory has no complete checkpoint under checkpoints/")
        return loaded
    if p.name == "checkpoints" and p.is_dir():
        return resolve(p.parent, log, expert_shard, combine, part)
    raise CheckpointError(
        f"{p}: neither a checkpoint directory (with {MANIFEST_FILE}) nor a run directory (with checkpoints/)"
    )


# ---------------------------------------------------------------------------------------------


class CheckpointManager:
    """Saves, retains and loads the checkpoints of one run directory."""

    def __init__(
        self,
        run_dir: Path,
        cfg: CheckpointConfig,
        log: Callable[[str], None] = print,
        expert_shard: tuple[int, int] | None = (0, 1),
        combine: Callable[[list[str]], list[str]] | None = None,
        part: tuple[int, int] | None = None,
    ):
        self.expert_shard = expert_shard  # (rank, size): which experts loads return (load_checkpoint)
        self.combine = combine  # every rank's verification problems (load_checkpoint)
        self.part = part  # (rank, size): which files this rank hashes (load_checkpoint)
        self.run_dir = Path(run_dir)
        self.cfg = cfg
        self.log = log
        self.dir = self.run_dir / "checkpoints"

    # -- saving ---------------------------------------------------------------------------------

    def should_save(self, step: int) -> bool:
        return self.cfg.every_steps > 0 and step % self.cfg.every_steps == 0

    def save(
        self,
        step: int,
        *,
        model_state: dict[str, torch.Tensor],
        trainer_state: dict,
        meta: dict,
        stage_end: bool = False,
        grown: bool = False,
        extra_files: dict[str, str] | None = None,
        write_shards: Callable[[Path], dict[str, dict]] | None = None,
    ) -> Path:
        """write_shards: under expert parallelism, called with the temporary dir once this rank's
        files are written; it has every rank write its expert shard there and hash it (in
        parallel), and returns their manifest entries, which this rank merges (checking sizes)."""
        if not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        extra_files = dict(extra_files or {})
        for name in extra_files:
            _check_extra_name(name)
        # Everything that can be refused is refused before the first byte is written.
        tensors = _plain_model_state(model_state)
        _check_plain(trainer_state, "trainer_state")
        meta_text = json.dumps(meta, indent=2) + "\n"

        self.dir.mkdir(parents=True, exist_ok=True)
        self._sweep_leftovers()
        name = step_dir_name(step, grown)
        tmp = self.dir / f".tmp-{name}-{os.getpid()}"
        tmp.mkdir()
        try:
            save_file(tensors, str(tmp / MODEL_FILE))
            fsync_file(tmp / MODEL_FILE)
            maybe_fault("checkpoint_mid")
            with open(tmp / TRAINER_FILE, "wb") as f:
                torch.save(trainer_state, f)
                f.flush()
                os.fsync(f.fileno())
            write_synced(tmp / META_FILE, meta_text.encode())
            for fname, text in extra_files.items():
                write_synced(tmp / fname, text.encode())
            shard_entries = write_shards(tmp) if write_shards is not None else {}

            files = {fname: file_entry(tmp / fname) for fname in [MODEL_FILE, TRAINER_FILE, META_FILE, *extra_files]}
            for fname, entry in shard_entries.items():
                if (tmp / fname).stat().st_size != entry["bytes"]:
                    raise OSError(errno.EIO, f"expert shard {fname} is {(tmp / fname).stat().st_size} bytes, its writer hashed {entry['bytes']}")
                files[fname] = entry
            manifest = {"format": MANIFEST_FORMAT, "step": step, "stage_end": bool(stage_end), "grown": bool(grown), "files": files}
            write_synced(tmp / MANIFEST_FILE, (json.dumps(manifest, indent=2) + "\n").encode())
            fsync_dir(tmp)

            final = self.dir / name
            if final.exists():
                # A re-run after a crash (or after falling back past a damaged one) saves the same
                # step again. Move the old one aside first: rename is atomic, rmtree is not.
                old = self.dir / f".tmp-old-{name}-{os.getpid()}"
                os.rename(final, old)
                os.rename(tmp, final)
                fsync_dir(self.dir)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.rename(tmp, final)
            fsync_dir(self.dir)
        except BaseException as exc:
            # torch.save reports a full disk as "unexpected pos ..." (the errno is lost in C++):
            # ask the disk while the partial files still fill it, then say what happened.
            full = isinstance(exc, (RuntimeError, OSError)) and _disk_full(tmp)
            shutil.rmtree(tmp, ignore_errors=True)
            if full and not (isinstance(exc, OSError) and exc.errno == errno.ENOSPC):
                raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} while writing checkpoint {name}", str(self.dir)) from exc
            raise

        self._write_latest(name)
        self._apply_retention(keep=final)
        return final

    def _write_latest(self, name: str) -> None:
        tmp = self.dir / (LATEST_FILE + ".tmp")
        write_synced(tmp, (name + "\n").encode())
        os.replace(tmp, self.dir / LATEST_FILE)
        fsync_dir(self.dir)

    def _sweep_leftovers(self) -> None:
        for p in sorted(self.dir.glob(".tmp-*")):
            if p.is_dir():
                self.log(f"checkpoint: removing {p.name}, left over from an interrupted save")
                shutil.rmtree(p, ignore_errors=True)
        stale = self.dir / (LATEST_FILE + ".tmp")
        if stale.exists():
            stale.unlink()

    def _apply_retention(self, keep: Path) -> None:
        complete = self.complete_checkpoints()
        kept = set(complete[: self.cfg.keep_last]) | {keep}
        for p in complete:
            if p in kept:
                continue
            if self.cfg.keep_stage_ends and self._is_stage_end(p):
                continue
            shutil.rmtree(p, ignore_errors=True)

    @staticmethod
    def _is_stage_end(path: Path) -> bool:
        try:
            return bool(_read_manifest(path).get("stage_end", False))
        except CheckpointError:
            return False

    # -- finding and loading --------------------------------------------------------------------

    def complete_checkpoints(self) -> list[Path]:
        """Checkpoint dirs that have a manifest, newest (highest step; after growth before the
        stage end at the same step) first; checksums unchecked."""
        if not self.dir.is_dir():
            return []
        found = []
        for p in self.dir.iterdir():
            order = _step_of(p)
            if order is not None and p.is_dir() and (p / MANIFEST_FILE).is_file():
                found.append((order, p))
        return [p for _, p in sorted(found, key=lambda sp: sp[0], reverse=True)]

    def verify(self, path: Path) -> list[str]:
        return verify_checkpoint(path)

    def load(self, path: Path) -> LoadedCheckpoint:
        return load_checkpoint(path, self.expert_shard, self.combine, self.part)

    def latest_hint(self) -> str | None:
        try:
            return (self.dir / LATEST_FILE).read_text().strip() or None
        except (OSError, UnicodeDecodeError):
            return None

    def load_latest(self) -> LoadedCheckpoint | None:
        """The newest intact checkpoint, skipping (and reporting) damaged ones; None if there are none.

        `latest` is only a hint: a kill between the rename and the pointer update leaves it naming
        the previous checkpoint while a newer complete one exists, and the newest intact one wins.
        """
        candidates = self.complete_checkpoints()
        if not candidates:
            return None
        hint = self.latest_hint()
        if hint is not None:
            names = [p.name for p in candidates]
            if hint not in names:
                self.log(f"checkpoint: 'latest' names {hint}, which is not a complete checkpoint; ignoring it")
            elif hint != names[0]:
                self.log(
                    f"checkpoint: 'latest' names {hint} but {names[0]} is newer and complete "
                    "(the last save was interrupted after its rename); trying the newest first"
                )
        damaged: list[str] = []
        for i, path in enumerate(candidates):
            try:
                return load_checkpoint(path, self.expert_shard, self.combine, self.part)
            except CheckpointError as e:
                reason = str(e)
                damaged.append(reason)
                nxt = candidates[i + 1].name if i + 1 < len(candidates) else None
                self.log(f"{reason}; " + (f"falling back to {nxt}" if nxt else "no older checkpoint left"))
        raise CheckpointError(
            f"every checkpoint under {self.dir} is damaged:\n" + "\n".join(f"  {d}" for d in damaged)
        )

    def resolve(self, path_or_dir: Path) -> LoadedCheckpoint:
        return resolve(path_or_dir, self.log, self.expert_shard, self.combine, self.part)
