"""Corpus loading, the resumable training token stream, and the fixed eval set.

Shape legend: B batch rows, T sequence length (stage's `seq_len`), N tokens in a stream.

A corpus comes either from a folder `growtrain prepare-data` wrote (memory-mapped token shards,
see shards.py: nothing is read whole) or, for small sources, from text read into memory at start.
Both split train/eval by a hash of each document's text (so the eval set depends on neither the
seed nor the document order; `assign_documents`, shared with prepare-data) and end as the same
`Corpus` of two `TokenArray`s, so the training loop has one code path. `TokenStream` walks the
train array sequentially; its position is a few integers (`cursor`, `epoch`, and the shuffle seed
of a sharded stream's per-epoch shard order), so a checkpoint stores it and a resumed run sees the
same batches. Each rank reads only its own rows of a batch.

torch and datasets are imported inside the functions that need them, so that importing this module
for `DataConfig` (recipe validation, `--help`) stays instant.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable, Iterator, Literal

import numpy as np

from growtrain.data.shards import TokenArray, check_tokenizer, is_prepared_dir, open_split, read_manifest
from growtrain.data.tokenizer import DataError, Tokenizer, _first_line, build_tokenizer

if TYPE_CHECKING:
    import torch

__all__ = [
    "BUILTIN_SOURCES",
    "Corpus",
    "DataConfig",
    "DataError",
    "TokenArray",
    "TokenStream",
    "assign_documents",
    "eval_batches",
    "capped",
    "load_corpus",
    "read_documents",
]

_FORMAT_BY_SUFFIX = {
    ".txt": "text",
    ".md": "text",
    ".py": "text",
    ".json": "jsonl",
    ".jsonl": "jsonl",
    ".parquet": "parquet",
}
# Name of the `datasets` packaged builder for each of our formats.
_BUILDER = {"text": "text", "jsonl": "json", "parquet": "parquet"}


@dataclass(frozen=True)
class DataConfig:
    """Where the training text comes from and how it becomes tokens."""

    source: str = field(
        default="builtin:pydoc_topics",
        metadata={
            "doc": "Corpus: a folder written by `growtrain prepare-data` (token shards, memory-mapped: the way to train "
            "on large data), or text read into memory at start: 'builtin:pydoc_topics' (Python's pydoc prose, ~0.5 MB), "
            "'builtin:python_stdlib' (the standard library's .py files), a local file or folder, or a Hugging Face hub "
            "dataset name. A relative path is relative to the recipe file's folder (with --set, to the working "
            "directory; stored resolved)."
        },
    )
    format: Literal["auto", "text", "jsonl", "parquet"] = field(
        default="auto",
        metadata={
            "doc": "Format of local files; 'auto' goes by extension (.txt/.md/.py text, .json/.jsonl jsonl, .parquet)."
        },
    )
    text_field: str = field(
        default="text", metadata={"doc": "Column holding the document text in jsonl, parquet and hub data."}
    )
    tokenizer: str = field(
        default="byte",
        metadata={
            "doc": "'byte' (UTF-8 bytes plus EOS, 257 ids) or the path of a local tokenizer.json or its folder (relative "
            "as data.source). The run keeps a copy in every checkpoint (generate and export-adapters use that one) "
            "and a resume refuses a different file under the same path. Prepared data must name the tokenizer its "
            "shards were written with (the prepared folder itself holds a copy)."
        },
    )
    eval_fraction: float = field(
        default=0.05,
        metadata={
            "doc": "Share of documents held out for eval loss, chosen by a hash of each document's text (prepared "
            "data was split by prepare-data: its own share applies).",
            "gt": 0.0,
            "lt": 0.5,
        },
    )
    max_bytes: int = field(
        default=0,
        metadata={"doc": "Cap on the UTF-8 bytes of text read, taken in document order; 0 means no cap (not for "
                       "prepared data: prepare-data --max-bytes)."},
    )
    split: str = field(default="train", metadata={"doc": "Split to read from a hub dataset."})

    def problems(self) -> list[str]:
        """Everything wrong with this config, as messages that say how to fix it (empty when valid)."""
        found = []
        formats = ("auto", *_BUILDER)
        if self.format not in formats:
            found.append(f"data.format '{self.format}' is not one of {list(formats)}")
        if not 0.0 < self.eval_fraction < 0.5:
            found.append(f"data.eval_fraction must be in (0, 0.5), got {self.eval_fraction}")
        if self.max_bytes < 0:
            found.append(f"data.max_bytes must be >= 0 (0 means no cap), got {self.max_bytes}")
        if not self.text_field:
            found.append("data.text_field must name a column")
        return found


@dataclass
class Corpus:
    tokenizer: Tokenizer
    train: TokenArray  # documents shuffled by seed, EOS after each
    eval: TokenArray  # documents in source order, EOS after each
    num_documents: int
    description: str
    fingerprint: str  # names the token content; a resume refuses other data
    warnings: tuple[str, ...] = ()  # problems worth a line in the log that do not stop the run


# ---------------------------------------------------------------------------------------------
# Reading documents


def _pydoc_topics() -> Iterator[str]:
    from pydoc_data.topics import topics

    # Sorted so the document order does not depend on how the module lists its topics.
    for key in sorted(topics):
        yield topics[key]


_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}


def _python_stdlib() -> Iterator[str]:
    root = Path(sysconfig.get_paths()["stdlib"])
    paths = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS and not d.startswith(".")]
        paths.extend(Path(dirpath) / f for f in filenames if f.endswith(".py"))
    for path in sorted(paths):
        yield path.read_text(encoding="utf-8", errors="replace")


BUILTIN_SOURCES: dict[str, Callable[[], Iterator[str]]] = {
    "builtin:pydoc_topics": _pydoc_topics,
    "builtin:python_stdlib": _python_stdlib,
}


def _local_files(root: Path, fmt: str) -> tuple[list[Path], str]:
    """The files to read under `root` (a file or folder) and their format."""
    if root.is_file():
        if fmt != "auto":
            return [root], fmt
        found = _FORMAT_BY_SUFFIX.get(root.suffix.lower())
        if found is None:
            raise DataError(
                f"cannot tell the format of '{root}' from its extension; set data.format to text, jsonl or parquet"
            )
        return [root], found
    files = sorted(
        p
        for p in root.rglob("*")
        if p.is_file()
        and p.suffix.lower() in _FORMAT_BY_SUFFIX
        and not any(part.startswith(".") for part in p.relative_to(root).parts)
    )
    if fmt != "auto":
        files = [p for p in files if _FORMAT_BY_SUFFIX[p.suffix.lower()] == fmt]
    kinds = sorted({_FORMAT_BY_SUFFIX[p.suffix.lower()] for p in files})
    if not files:
        wanted = [s for s, f in _FORMAT_BY_SUFFIX.items() if fmt in ("auto", f)]
        raise DataError(f"no {'/'.join(wanted)} files under '{root}'")
    if len(kinds) > 1:
        raise DataError(f"'{root}' mixes {', '.join(kinds)} files; set data.format to read one kind")
    return files, kinds[0]


def _column_texts(rows: Iterable[dict], text_field: str, where: str, columns: list[str] | None) -> Iterator[str]:
    if columns is not None and text_field not in columns:
        raise DataError(f"{where} has no column '{text_field}'; its columns are {columns}; set data.text_field")
    for row in rows:
        if text_field not in row:
            raise DataError(f"{where} has no column '{text_field}'; its columns are {sorted(row)}; set data.text_field")
        text = row[text_field]
        if text is None:
            continue
        if not isinstance(text, str):
            raise DataError(f"{where}: column '{text_field}' holds {type(text).__name__}, not text")
        yield text


# Share of a text file's characters that are U+FFFD (bytes that are not UTF-8, replaced on read)
# or NUL (UTF-16 and binary files) above which the file is reported. Measured: random bytes read
# as 44% U+FFFD, ASCII text saved as UTF-16 as 54% NUL and U+FFFD, an English text in Latin-1 with
# an accent here and there as ~1% (each non-ASCII letter is one U+FFFD).
UNDECODABLE_WARN_SHARE = 0.1


def _undecodable_share(text: str) -> float:
    return (text.count("\ufffd") + text.count("\x00")) / max(1, len(text))


def _check_decoded(files: list[Path], texts: Iterable[str], undecodable: list[str]) -> Iterator[str]:
    """Pass the texts through (the text builder yields one row per file, in order), noting in
    `undecodable` each file read that is not UTF-8 text, as it is read: max_bytes may stop early."""
    for path, text in zip(files, texts):
        share = _undecodable_share(text)
        if share > UNDECODABLE_WARN_SHARE:
            undecodable.append(f"{path} ({share:.0%})")
        yield text


def _undecodable_warning(undecodable: list[str]) -> str:
    shown = ", ".join(undecodable[:3]) + (f" and {len(undecodable) - 3} more" if len(undecodable) > 3 else "")
    return (
        f"{len(undecodable)} text file(s) are not UTF-8 text (the share of their characters read as U+FFFD or NUL): "
        f"{shown}; those bytes train as noise: convert the files to UTF-8, or remove them from data.source"
    )


def _local_documents(root: Path, cfg: DataConfig, undecodable: list[str] | None = None) -> Iterator[str]:
    files, fmt = _local_files(root, cfg.format)
    import datasets

    kwargs: dict = {"sample_by": "document", "encoding_errors": "replace"} if fmt == "text" else {}
    try:
        # Streaming reads the files in order without writing an Arrow cache, and lets max_bytes
        # stop the read early.
        ds = datasets.load_dataset(
            _BUILDER[fmt], data_files=[str(p) for p in files], split="train", streaming=True, **kwargs
        )
        if fmt == "text":
            yield from _check_decoded(files, (row["text"] for row in ds), undecodable if undecodable is not None else [])
        else:
            columns = list(ds.column_names) if ds.column_names is not None else None
            yield from _column_texts(ds, cfg.text_field, f"'{root}'", columns)
    except DataError:
        raise
    except Exception as exc:
        raise DataError(f"could not read {fmt} data from '{root}': {_first_line(exc)}") from None


def _hub_documents(name: str, cfg: DataConfig) -> Iterator[str]:
    advice = (
        f"'{name}' is not a local path, and the Hugging Face hub is offline here; download it elsewhere "
        "and pass a local file or folder (text, jsonl or parquet)"
    )
    if os.environ.get("HF_DATASETS_OFFLINE") == "1" or os.environ.get("HF_HUB_OFFLINE") == "1":
        raise DataError(advice)
    import datasets

    try:
        # Streamed: prepare-data reads datasets larger than memory (and no Arrow cache is written).
        ds = datasets.load_dataset(name, split=cfg.split, streaming=True)
        columns = list(ds.column_names) if ds.column_names is not None else None
        yield from _column_texts(ds, cfg.text_field, f"dataset '{name}'", columns)
    except DataError:
        raise
    except Exception as exc:
        raise DataError(f"{advice} ({_first_line(exc)})") from None


_PATH_LIKE_SUFFIXES = tuple(_FORMAT_BY_SUFFIX)


def resolve_source_path(source: str, base: Path) -> str:
    """data.source with a relative local path made absolute against `base` (the recipe's folder);
    built-in corpora and hub names unchanged. A relative path counts as local when it exists under
    `base` or is clearly meant as a path (starts with '.' or '~', or has a data file's suffix)."""
    if source.startswith("builtin:") or not source:
        return source
    path = Path(source).expanduser()
    if path.is_absolute():
        return str(path)
    if (base / path).exists() or source.startswith((".", "~")) or source.lower().endswith(_PATH_LIKE_SUFFIXES):
        return str((base / path).resolve())
    return source


def resolve_tokenizer_path(spec: str, base: Path) -> str:
    """data.tokenizer: 'byte' unchanged, a path made absolute against `base`."""
    if spec == "byte" or not spec:
        return spec
    path = Path(spec).expanduser()
    return str(path if path.is_absolute() else (base / path).resolve())


def read_documents(cfg: DataConfig, undecodable: list[str] | None = None) -> tuple[str, Iterator[str]]:
    """A short name for the corpus and a lazy iterator over its documents, in source order
    (reading a local text file that is not UTF-8 text appends it to `undecodable`)."""
    source = cfg.source
    if source.startswith("builtin:"):
        if source not in BUILTIN_SOURCES:
            raise DataError(f"unknown built-in corpus '{source}'; valid: {sorted(BUILTIN_SOURCES)}")
        return source.removeprefix("builtin:"), BUILTIN_SOURCES[source]()
    path = Path(source).expanduser()
    if path.exists():
        return path.name or str(path), _local_documents(path, cfg, undecodable)
    # Things that are clearly meant as paths get a "not found", not a hub lookup.
    if source.startswith(("/", ".", "~")) or source.lower().endswith(_PATH_LIKE_SUFFIXES):
        raise DataError(f"data source '{source}' does not exist (expected a local file or folder)")
    return source, _hub_documents(source, cfg)


def capped(docs: Iterable[str], max_bytes: int) -> Iterator[str]:
    """Non-empty documents in order, the last one cut so the total is at most max_bytes (0: all)."""
    budget = max_bytes
    for doc in docs:
        if not doc:
            continue
        if max_bytes:
            size = len(doc.encode("utf-8"))
            if size >= budget:
                # errors="ignore" drops a multi-byte character split by the cut.
                doc = doc.encode("utf-8")[:budget].decode("utf-8", errors="ignore")
                if doc:
                    yield doc
                return
            budget -= size
        yield doc


# ---------------------------------------------------------------------------------------------
# Corpus


def _hash_unit(text: str) -> float:
    """A float in [0, 1) fixed by the text alone; duplicates of a document land on the same side."""
    digest = hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


@dataclass
class Assignment:
    """Which documents train (in training order) and which are held out (in source order). A
    corpus of one document is split inside it: `cut_single` is the share of its tokens that train."""

    train: list[str]
    eval: list[str]
    cut_single: float | None = None


def assign_documents(docs: list[str], eval_fraction: float, seed: int, whole: bool) -> Assignment:
    """Split by each document's hash, then shuffle the train documents by seed. `whole`: `docs`
    is the whole corpus (not one buffer of a streamed one), so a side left empty by the hash gets
    its nearest document moved across, and a single document is cut by tokens."""
    import torch

    if whole and len(docs) == 1:
        return Assignment(docs, [], cut_single=1.0 - eval_fraction)
    units = [_hash_unit(d) for d in docs]
    is_eval = [u < eval_fraction for u in units]
    if whole:
        # Tiny corpora may hash entirely to one side; move the nearest document across.
        if not any(is_eval):
            is_eval[min(range(len(docs)), key=units.__getitem__)] = True
        if all(is_eval):
            is_eval[max(range(len(docs)), key=units.__getitem__)] = False
    eval_docs = [d for d, e in zip(docs, is_eval) if e]
    train_docs = [d for d, e in zip(docs, is_eval) if not e]
    order = torch.randperm(len(train_docs), generator=torch.Generator().manual_seed(seed)).tolist()
    return Assignment([train_docs[i] for i in order], eval_docs)


def cut_single_document(tokens_N: np.ndarray, train_share: float) -> tuple[np.ndarray, np.ndarray]:
    """A one-document corpus's tokens, split so that both sides hold at least one token."""
    cut = max(1, min(len(tokens_N) - 1, int(len(tokens_N) * train_share)))
    return tokens_N[:cut], tokens_N[cut:]


def memory_fingerprint(train_N: np.ndarray, eval_N: np.ndarray) -> str:
    """The fingerprint of a corpus read into memory: its int32 tokens, hashed (what checkpoints
    have always recorded for such corpora, so their resumes keep matching)."""
    digest = hashlib.blake2b(digest_size=8)
    digest.update(np.ascontiguousarray(train_N, dtype=np.int32).tobytes())
    digest.update(np.ascontiguousarray(eval_N, dtype=np.int32).tobytes())
    return digest.hexdigest()


def load_corpus(cfg: DataConfig, seed: int) -> Corpus:
    """The corpus of `cfg`: prepared shards memory-mapped, or a small source read, split,
    tokenized and packed in memory. Same (cfg, seed) → identical token arrays."""
    problems = cfg.problems()
    if problems:
        raise DataError("; ".join(problems))
    tokenizer = build_tokenizer(cfg.tokenizer)
    path = Path(cfg.source).expanduser()
    if not cfg.source.startswith("builtin:") and is_prepared_dir(path):
        return _prepared_corpus(path, cfg, tokenizer)
    undecodable: list[str] = []
    name, doc_iter = read_documents(cfg, undecodable)
    docs = list(capped(doc_iter, cfg.max_bytes))
    if not docs:
        raise DataError(f"data source '{cfg.source}' holds no text")

    split = assign_documents(docs, cfg.eval_fraction, seed, whole=True)
    if split.cut_single is not None:
        train_np, eval_np = cut_single_document(tokenizer.encode_documents(split.train), split.cut_single)
    else:
        train_np, eval_np = tokenizer.encode_documents(split.train), tokenizer.encode_documents(split.eval)
    train_np = np.ascontiguousarray(train_np, dtype=np.int32)
    eval_np = np.ascontiguousarray(eval_np, dtype=np.int32)
    n_train, n_eval = len(train_np), len(eval_np)
    description = (
        f"{name}: {len(docs):,} documents, {n_train + n_eval:,} tokens "
        f"(train {n_train:,} / eval {n_eval:,}), tokenizer {tokenizer.name}, in memory"
    )
    warnings = (_undecodable_warning(undecodable),) if undecodable else ()
    return Corpus(
        tokenizer, TokenArray([train_np]), TokenArray([eval_np]), len(docs), description,
        memory_fingerprint(train_np, eval_np), warnings,
    )


def _prepared_corpus(root: Path, cfg: DataConfig, tokenizer: Tokenizer) -> Corpus:
    manifest = read_manifest(root)
    if cfg.max_bytes:
        raise DataError(
            f"data.max_bytes applies to text read at start, and '{root}' is prepared data: drop data.max_bytes, "
            "or cap the text with `growtrain prepare-data --max-bytes`"
        )
    check_tokenizer(root, manifest, cfg.tokenizer, tokenizer)
    train, held_out = open_split(root, manifest, "train"), open_split(root, manifest, "eval")
    if len(train) == 0 or len(held_out) == 0:
        raise DataError(f"'{root}' holds {len(train):,} train and {len(held_out):,} held-out tokens; both must be > 0")
    warnings = []
    if abs(cfg.eval_fraction - manifest.eval_fraction) > 1e-12 and cfg.eval_fraction != DataConfig.eval_fraction:
        warnings.append(
            f"data.eval_fraction {cfg.eval_fraction} is not used: '{root}' was split at prepare time with "
            f"eval_fraction {manifest.eval_fraction}"
        )
    docs = manifest.documents
    description = (
        f"{root.name} (prepared from {manifest.source}): {docs['train'] + docs['eval']:,} documents, "
        f"{len(train) + len(held_out):,} tokens (train {len(train):,} in {len(train.parts)} shard(s) / eval "
        f"{len(held_out):,}), tokenizer {tokenizer.name}, {manifest.dtype}, memory-mapped"
    )
    return Corpus(
        tokenizer, train, held_out, docs["train"] + docs["eval"], description, manifest.fingerprint, tuple(warnings)
    )


# ---------------------------------------------------------------------------------------------
# Batches


def _row_window(start: int, rows: tuple[int, int] | None, batch_size: int, seq_len: int) -> tuple[int, int, int]:
    """(first token, last token + 1, row count) of rows [r0, r1) of the batch at `start`."""
    r0, r1 = rows if rows is not None else (0, batch_size)
    if not 0 <= r0 < r1 <= batch_size:
        raise DataError(f"rows {r0}..{r1} are not a range of a batch of {batch_size}")
    return start + r0 * seq_len, start + r1 * seq_len + 1, r1 - r0


def _as_batch(window_N: np.ndarray, rows: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    import torch

    window = torch.from_numpy(window_N)
    return window[:-1].view(rows, seq_len), window[1:].view(rows, seq_len)


class TokenStream:
    """Sequential packing over a `TokenArray`; the position is `{"cursor", "epoch", "shuffle_seed"}`.

    A batch is B consecutive windows of T+1 tokens that share their boundary token (targets are
    inputs shifted by one). When the next batch would run past the end, the stream starts over at
    0 and `epoch` grows: a batch never mixes the end of one pass with the start of the next, so its
    content depends only on (state, batch_size, seq_len). Epoch 0 reads the parts (shards) in
    their order; each later epoch in a permutation drawn from (shuffle_seed, epoch). A rank asks
    for its rows only and reads only their tokens.
    """

    def __init__(self, tokens: TokenArray, shuffle_seed: int = 0):
        self.tokens = tokens
        self.shuffle_seed = shuffle_seed
        self.cursor = 0
        self.epoch = 0
        self._order_epoch, self._ordered = 0, tokens

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def tokens_consumed(self) -> int:
        """Stream position counting each finished pass as the whole stream (skipped tails included)."""
        return self.epoch * len(self) + self.cursor

    def _epoch_tokens(self) -> TokenArray:
        if self._order_epoch != self.epoch:
            order = list(range(len(self.tokens.parts)))
            if self.epoch > 0 and len(order) > 1:
                rng = np.random.default_rng([self.shuffle_seed, self.epoch])
                order = rng.permutation(len(order)).tolist()
            self._order_epoch, self._ordered = self.epoch, self.tokens.reordered(order)
        return self._ordered

    def state_dict(self) -> dict:
        shard, offset = self._epoch_tokens().locate(self.cursor)
        # shard/offset are for people reading a checkpoint; cursor and epoch say it all.
        return {"cursor": self.cursor, "epoch": self.epoch, "shuffle_seed": self.shuffle_seed, "shard": shard, "offset": offset}

    def load_state_dict(self, state: dict) -> None:
        missing = {"cursor", "epoch"} - set(state)
        if missing:
            raise DataError(f"data position is missing {sorted(missing)}; got {dict(state)}")
        cursor, epoch = int(state["cursor"]), int(state["epoch"])
        if not 0 <= cursor <= len(self) or epoch < 0:
            raise DataError(
                f"data position cursor={cursor}, epoch={epoch} does not fit a stream of {len(self):,} tokens; "
                "was the corpus or its config changed since the checkpoint?"
            )
        if int(state.get("shuffle_seed", self.shuffle_seed)) != self.shuffle_seed:
            raise DataError(
                f"the checkpoint's data stream was shuffled with seed {state['shuffle_seed']}, this run's with "
                f"{self.shuffle_seed}; resume with the recipe's seed unchanged"
            )
        self.cursor, self.epoch = cursor, epoch

    def next_batch(
        self, batch_size: int, seq_len: int, rows: tuple[int, int] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), both int64, of rows [r0, r1) of the next global batch (all rows by
        default); the stream moves on by the whole batch."""
        step = batch_size * seq_len
        if batch_size < 1 or seq_len < 1:
            raise DataError(f"batch_size and seq_len must be >= 1, got {batch_size} and {seq_len}")
        if len(self) < step + 1:
            raise DataError(
                f"the training stream has {len(self):,} tokens, but one batch of {batch_size} x {seq_len} "
                f"needs {step + 1:,}; use more data or a smaller batch_size/seq_len"
            )
        if self.cursor + step + 1 > len(self):
            self.cursor = 0
            self.epoch += 1
        start, stop, n_rows = _row_window(self.cursor, rows, batch_size, seq_len)
        window = self._epoch_tokens().read(start, stop)
        self.cursor += step
        return _as_batch(window, n_rows, seq_len)


def eval_batches(
    tokens: TokenArray, batch_size: int, seq_len: int, max_batches: int, rows: tuple[int, int] | None = None
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Up to `max_batches` full batches of windows from the start of the eval stream (rows
    [r0, r1) of each, all by default).

    When the stream is too short for one full batch, a single smaller batch of the rows that fit
    is returned, so a tiny corpus still gets an eval loss (all of its rows: `rows` needs a full
    batch).
    """
    if batch_size < 1 or seq_len < 1 or max_batches < 1:
        raise DataError(
            f"batch_size, seq_len and max_batches must be >= 1, got {batch_size}, {seq_len}, {max_batches}"
        )
    n_tokens = len(tokens)
    available = (n_tokens - 1) // seq_len if n_tokens > 0 else 0
    if available < 1:
        raise DataError(
            f"the eval stream has {n_tokens:,} tokens, fewer than one window of seq_len+1 = {seq_len + 1}; "
            "raise data.eval_fraction, use more data or a shorter seq_len"
        )
    if available < batch_size:
        batch_size, n_batches, rows = available, 1, None
    else:
        n_batches = min(max_batches, available // batch_size)
    batches = []
    for b in range(n_batches):
        start, stop, n_rows = _row_window(b * batch_size * seq_len, rows, batch_size, seq_len)
        batches.append(_as_batch(tokens.read(start, stop), n_rows, seq_len))
    return batches
