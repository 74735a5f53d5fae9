"""`growtrain prepare-data`: tokenize a source once into token shards (format: shards.py).

The source is read as a stream of documents (every source `data.source` reads: built-in corpora,
local text / jsonl / parquet files and folders, hub datasets), so inputs larger than memory work.
Documents are gathered into buffers of `buffer_bytes`; each buffer is split train / held-out by
each document's hash and its train documents shuffled (assign_documents, as a corpus read into
memory is), then tokenized by worker processes, a bounded number of chunks in flight, and
appended in order to fixed-size shards. A source that fits one buffer therefore gives exactly the
tokens `load_corpus` gives for the same seed: training on it prepared or read at start is the same
run.

Atomic like checkpoints: shards are written as `NAME.tmp`, fsynced and renamed; the manifest comes
last. `.prepare-in-progress` marks the folder while it is written; a prepare interrupted anyhow
(kill -9 included) is restarted cleanly by the next one, which removes what the first one wrote.
"""

from __future__ import annotations

import collections
import hashlib
import multiprocessing
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np

from growtrain.data.corpus import DataConfig, assign_documents, capped, cut_single_document, read_documents
from growtrain.checkpoint.durable import fsync_dir, write_synced
from growtrain.runtime.faults import maybe_fault
from growtrain.checkpoint.run_lock import LOCK_FILE, RunDirLock
from growtrain.data.shards import (
    DTYPES, IN_PROGRESS, MANIFEST, Manifest, ShardInfo, dtype_for_vocab, is_prepared_dir, is_shard_file, read_manifest,
    shard_name,
)
from growtrain.data.tokenizer import CHECKPOINT_TOKENIZER, DataError, Tokenizer, build_tokenizer, tokenizer_file, tokenizer_identity

CHUNK_BYTES = 4 << 20  # text per worker task: large enough that pickling is cheap next to tokenizing


@dataclass(frozen=True)
class PrepareOptions:
    source: str
    out: Path
    tokenizer: str = "byte"
    eval_fraction: float = DataConfig.eval_fraction
    seed: int = 0
    format: str = "auto"
    text_field: str = "text"
    split: str = "train"
    max_bytes: int = 0
    shard_tokens: int = 1 << 27  # 256 MiB of uint16 per shard
    dtype: str = "auto"
    workers: int = 0  # 0: one per CPU core
    buffer_bytes: int = 256 << 20  # documents split and shuffled together (a corpus this size: one buffer)
    overwrite: bool = False

    def data_config(self) -> DataConfig:
        return DataConfig(
            source=self.source, format=self.format, text_field=self.text_field, tokenizer=self.tokenizer,  # type: ignore[arg-type]
            eval_fraction=self.eval_fraction, max_bytes=self.max_bytes, split=self.split,
        )

    def problems(self) -> list[str]:
        found = self.data_config().problems()
        if self.shard_tokens < 1:
            found.append(f"--shard-tokens must be >= 1, got {self.shard_tokens}")
        if self.workers < 0:
            found.append(f"--workers must be >= 0 (0: one per core), got {self.workers}")
        if self.buffer_bytes < 1:
            found.append(f"--buffer-bytes must be >= 1, got {self.buffer_bytes}")
        if self.seed < 0:
            found.append(f"--seed must be >= 0, got {self.seed}")
        return found


# ---------------------------------------------------------------------------------------------
# Shard writing


class ShardWriter:
    """Appends tokens to `SPLIT-NNNNN.bin` shards of `shard_tokens` each; a shard is fsynced and
    renamed from its `.tmp` name once full (or at `close`)."""

    def __init__(self, root: Path, split: str, dtype: str, shard_tokens: int):
        self.root, self.split, self.dtype, self.shard_tokens = root, split, DTYPES[dtype], shard_tokens
        self.limit = 2 ** (8 * self.dtype.itemsize)
        self.done: list[ShardInfo] = []
        self._file = None
        self._count = 0
        self._sha = hashlib.sha256()

    @property
    def tokens(self) -> int:
        return sum(s.tokens for s in self.done) + self._count

    def write(self, tokens_N: np.ndarray) -> None:
        if len(tokens_N) and (int(tokens_N.max()) >= self.limit or int(tokens_N.min()) < 0):
            raise DataError(f"the tokenizer produced id {int(tokens_N.max())}, which does not fit {self.dtype.name} shards")
        data = tokens_N.astype(self.dtype)
        while len(data):
            if self._file is None:
                self._file = open(self.root / (shard_name(self.split, len(self.done)) + ".tmp"), "wb")
            piece, data = data[: self.shard_tokens - self._count], data[self.shard_tokens - self._count :]
            raw = piece.tobytes()
            self._file.write(raw)
            self._sha.update(raw)
            self._count += len(piece)
            if self._count == self.shard_tokens:
                self._finish_shard()

    def _finish_shard(self) -> None:
        name = shard_name(self.split, len(self.done))
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        os.replace(self.root / (name + ".tmp"), self.root / name)
        self.done.append(ShardInfo(name, self._count, self._sha.hexdigest()))
        self._file, self._count, self._sha = None, 0, hashlib.sha256()
        maybe_fault("prepare_shard")

    def close(self) -> tuple[ShardInfo, ...]:
        if self._file is not None:
            self._finish_shard()
        return tuple(self.done)

    def abort(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


# ---------------------------------------------------------------------------------------------
# Tokenizing in worker processes

_worker_tokenizer: Tokenizer | None = None


def _init_worker(spec: str) -> None:
    global _worker_tokenizer
    # One thread per worker: the `tokenizers` package would otherwise start one per core in each.
    os.environ["RAYON_NUM_THREADS"] = "1"
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _worker_tokenizer = build_tokenizer(spec)


def _encode_chunk(docs: list[str]) -> np.ndarray:
    return _worker_tokenizer.encode_documents(docs)


def _chunks(docs: list[str]) -> Iterator[list[str]]:
    chunk, size = [], 0
    for doc in docs:
        chunk.append(doc)
        size += len(doc)
        if size >= CHUNK_BYTES:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


class Encoder:
    """Tokenizes chunks in order: in this process (1 worker) or in a pool with at most
    2 × workers chunks in flight (the pool's own imap would queue the whole input)."""

    def __init__(self, spec: str, tokenizer: Tokenizer, workers: int):
        self.tokenizer, self.workers = tokenizer, workers
        # spawn, not fork: the parent may hold threads (datasets' readers, torch's pool).
        self.pool = multiprocessing.get_context("spawn").Pool(workers, _init_worker, (spec,)) if workers > 1 else None

    def encode(self, tasks: Iterable[tuple[str, list[str]]]) -> Iterator[tuple[str, np.ndarray]]:
        """(split, tokens) for each (split, documents) task, in task order."""
        if self.pool is None:
            for split, docs in tasks:
                yield split, self.tokenizer.encode_documents(docs)
            return
        pending: collections.deque = collections.deque()
        for split, docs in tasks:
            pending.append((split, self.pool.apply_async(_encode_chunk, (docs,))))
            if len(pending) >= 2 * self.workers:
                split_done, result = pending.popleft()
                yield split_done, result.get()
        while pending:
            split_done, result = pending.popleft()
            yield split_done, result.get()

    def close(self) -> None:
        if self.pool is not None:
            self.pool.terminate()
            self.pool.join()


# ---------------------------------------------------------------------------------------------
# The folder


def _check_folder(out: Path, overwrite: bool) -> None:
    """Refuse an --out that holds prepared data (without --overwrite) or files that are not ours."""
    if not out.exists():
        return
    if not out.is_dir():
        raise DataError(f"--out '{out}' is a file, not a folder")
    names = {p.name for p in out.iterdir()}
    if MANIFEST in names and not overwrite:
        try:
            m = read_manifest(out)
            held = f" ({sum(s.tokens for s in m.train) + sum(s.tokens for s in m.eval):,} tokens from {m.source})"
        except DataError:
            held = ""
        raise DataError(f"'{out}' already holds prepared data{held}; pass --overwrite to replace it, or choose another --out")
    foreign = sorted(n for n in names - {MANIFEST, IN_PROGRESS, LOCK_FILE, CHECKPOINT_TOKENIZER} if not is_shard_file(n))
    if foreign:
        shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
        raise DataError(f"'{out}' holds files prepare-data did not write ({shown}); choose an empty or new folder for --out")


def _clear_folder(out: Path) -> None:
    """Remove an interrupted prepare's files, or a finished one's (--overwrite), manifest first:
    a folder never has a manifest that names removed shards. Called with the folder locked."""
    if (out / MANIFEST).exists():
        (out / MANIFEST).unlink()
        fsync_dir(out)
    for path in out.iterdir():
        if is_shard_file(path.name) or path.name in (CHECKPOINT_TOKENIZER, MANIFEST + ".tmp"):
            path.unlink()


def _remove_own_files(out: Path, created: bool) -> None:
    for path in out.iterdir():
        if is_shard_file(path.name) or path.name in (IN_PROGRESS, MANIFEST + ".tmp"):
            path.unlink()
    if created and {p.name for p in out.iterdir()} <= {LOCK_FILE}:
        shutil.rmtree(out)


def _source_bytes(cfg: DataConfig) -> int | None:
    """About how many bytes of text the source holds, for the ETA (None: not known up front)."""
    path = Path(cfg.source).expanduser()
    total = None
    if path.is_file():
        total = path.stat().st_size
    elif path.is_dir():
        total = sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.name.startswith("."))
    if cfg.max_bytes:
        total = cfg.max_bytes if total is None else min(total, cfg.max_bytes)
    return total


class ProgressLine:
    """One line on stderr, redrawn in place on a terminal (a line every 10 s otherwise)."""

    def __init__(self, total_bytes: int | None, stream=None, every_s: float | None = None):
        self.total, self.stream = total_bytes, stream or sys.stderr
        self.tty = self.stream.isatty()
        self.every_s = every_s if every_s is not None else (0.5 if self.tty else 10.0)
        self.t0 = self._t_last = time.monotonic()

    def update(self, text_bytes: int, tokens: int, docs: int, final: bool = False) -> None:
        from growtrain.runtime.tracking import format_duration

        now = time.monotonic()
        if not final and now - self._t_last < self.every_s:
            return
        self._t_last = now
        elapsed = max(now - self.t0, 1e-9)
        line = f"prepare: {docs:,} docs, {text_bytes / 1e6:,.1f} MB read, {tokens:,} tokens, {tokens / elapsed:,.0f} tokens/s"
        if self.total and not final:
            share = min(text_bytes / self.total, 1.0)
            eta = elapsed * (1 - share) / share if share > 0 else float("nan")
            line += f", {share:.0%}, ETA {format_duration(eta)}"
        else:
            line += f", {format_duration(elapsed)}"
        if self.tty:
            self.stream.write("\r" + line.ljust(100) + ("\n" if final else ""))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()


def prepare_data(opts: PrepareOptions, progress: ProgressLine | None = None) -> Manifest:
    problems = opts.problems()
    if problems:
        raise DataError("; ".join(problems))
    cfg = opts.data_config()
    tokenizer = build_tokenizer(opts.tokenizer)
    dtype = dtype_for_vocab(tokenizer.vocab_size, opts.dtype)
    out = opts.out
    source_path = Path(opts.source).expanduser()
    if not opts.source.startswith("builtin:") and source_path.exists():
        if is_prepared_dir(source_path):
            raise DataError(f"'{opts.source}' is prepared data already; train on it with data.source: {opts.source}")
        if out.resolve().is_relative_to(source_path.resolve()):
            raise DataError(f"--out '{out}' is inside the source '{opts.source}'; choose a folder outside it")
    name, doc_iter = read_documents(cfg)  # fails now on a missing source, before the folder is touched
    _check_folder(out, opts.overwrite)
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    with RunDirLock(out):  # a second prepare into the same folder is refused, not interleaved
        _check_folder(out, opts.overwrite)
        _clear_folder(out)
        (out / IN_PROGRESS).write_text(f"pid {os.getpid()}\n")
        fsync_dir(out)
        workers = opts.workers or os.cpu_count() or 1
        writers = {split: ShardWriter(out, split, dtype, opts.shard_tokens) for split in ("train", "eval")}
        encoder = Encoder(opts.tokenizer, tokenizer, workers)
        progress = progress if progress is not None else ProgressLine(_source_bytes(cfg))
        try:
            counts = _write_shards(capped(doc_iter, opts.max_bytes), opts, tokenizer, encoder, writers, progress)
            shards = {split: w.close() for split, w in writers.items()}
        except BaseException:
            # Leave nothing half-done behind (a kill -9 cannot clean: the next prepare does).
            for w in writers.values():
                w.abort()
            _remove_own_files(out, created)
            raise
        finally:
            encoder.close()
        source = tokenizer_file(opts.tokenizer)
        if source is not None:
            shutil.copyfile(source, out / CHECKPOINT_TOKENIZER)  # `data.tokenizer: DIR` then names it
        ident = {**tokenizer_identity(opts.tokenizer), "name": tokenizer.name, "vocab_size": tokenizer.vocab_size, "eos_id": tokenizer.eos_id}
        settings = {k: v for k, v in asdict(opts).items() if k not in ("out", "overwrite")}
        manifest = Manifest(
            dtype=dtype, tokenizer=ident, train=shards["train"], eval=shards["eval"], documents=counts, source=name,
            eval_fraction=opts.eval_fraction, seed=opts.seed, settings=settings,
        )
        write_synced(out / (MANIFEST + ".tmp"), manifest.to_json().encode())
        os.replace(out / (MANIFEST + ".tmp"), out / MANIFEST)
        (out / IN_PROGRESS).unlink()
        fsync_dir(out)
    return manifest


def _write_shards(
    docs: Iterable[str], opts: PrepareOptions, tokenizer: Tokenizer, encoder: Encoder,
    writers: dict[str, ShardWriter], progress: ProgressLine,
) -> dict[str, int]:
    counts = {"train": 0, "eval": 0}
    read = {"bytes": 0, "docs": 0}

    def buffers() -> Iterator[tuple[list[str], bool]]:
        buffer, size = [], 0
        for doc in docs:
            buffer.append(doc)
            size += len(doc)
            read["bytes"] += len(doc.encode("utf-8"))
            read["docs"] += 1
            if size >= opts.buffer_bytes:
                yield buffer, False
                buffer, size = [], 0
        yield buffer, True

    def tasks() -> Iterator[tuple[str, list[str]]]:
        for index, (buffer, last) in enumerate(buffers()):
            if not buffer:
                continue
            whole = last and index == 0
            split = assign_documents(buffer, opts.eval_fraction, opts.seed + index, whole)
            counts["train"] += len(split.train)
            counts["eval"] += len(split.eval)
            if split.cut_single is not None:  # one document in all: split inside it, here
                train_N, eval_N = cut_single_document(tokenizer.encode_documents(split.train), split.cut_single)
                writers["train"].write(train_N)
                writers["eval"].write(eval_N)
                continue
            for part in ("train", "eval"):
                for chunk in _chunks(getattr(split, part)):
                    yield part, chunk

    for part, tokens_N in encoder.encode(tasks()):
        writers[part].write(tokens_N)
        progress.update(read["bytes"], writers["train"].tokens + writers["eval"].tokens, read["docs"])
    progress.update(read["bytes"], writers["train"].tokens + writers["eval"].tokens, read["docs"], final=True)
    if read["docs"] == 0:
        raise DataError(f"data source '{opts.source}' holds no text")
    for part in ("train", "eval"):
        if writers[part].tokens == 0:
            hint = "raise --eval-fraction" if part == "eval" else "lower --eval-fraction"
            raise DataError(f"no document of '{opts.source}' went to the {part} split; {hint}, or add documents")
    return counts
