"""Token sequences for training: in memory or memory-mapped from prepared shards.

Shape legend: N tokens.

`growtrain prepare-data` (prepare.py) writes a folder of token shards: `train-00000.bin`, ...,
`eval-00000.bin`, ..., each the raw little-endian token ids of whole documents with EOS after each
(uint16 when the vocabulary fits, else uint32), and `manifest.json` last, atomically: shard names,
token counts, sha256, tokenizer identity, the train / held-out split. While a prepare runs, the
folder holds `.prepare-in-progress` and no manifest, so a manifest never names a half-written
shard.

`TokenArray` is one flat token sequence stored in parts (one in-memory array, or one memory map per
shard). Reading a window copies only that window, so a training process holds the rows it trains,
not the corpus. Opening checks each shard's size against the manifest (a truncated or missing
shard is an error at once); the sha256 are checked by `growtrain check-data`, which reads
everything.

Imports only numpy and the tokenizer module: `growtrain.data.corpus` builds on this, prepare.py on both.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from growtrain.data.tokenizer import DataError, Tokenizer, tokenizer_identity

MANIFEST = "manifest.json"
FORMAT = "growtrain-token-shards"
FORMAT_VERSION = 1
IN_PROGRESS = ".prepare-in-progress"
SPLITS = ("train", "eval")
DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}


def shard_name(split: str, index: int) -> str:
    return f"{split}-{index:05d}.bin"


def is_shard_file(name: str) -> bool:
    """A file prepare-data writes (a shard, or one still being written)."""
    stem = name.removesuffix(".tmp")
    return stem.endswith(".bin") and stem.split("-", 1)[0] in SPLITS


def dtype_for_vocab(vocab_size: int, requested: str = "auto") -> str:
    """The shard dtype: uint16 where every id fits (vocab <= 65,536), else uint32."""
    if requested == "auto":
        requested = "uint16" if vocab_size <= 2**16 else "uint32"
    if requested not in DTYPES:
        raise DataError(f"shard dtype '{requested}' is not one of {['auto', *DTYPES]}")
    limit = 2 ** (8 * DTYPES[requested].itemsize)
    if vocab_size > limit:
        raise DataError(
            f"a vocabulary of {vocab_size:,} ids does not fit {requested} shards (ids up to {limit - 1:,}); "
            "use --dtype uint32 (or auto)"
        )
    return requested


# ---------------------------------------------------------------------------------------------
# Token arrays


class TokenArray:
    """A flat token sequence in parts; `read(start, stop)` is the int64 window [start, stop)."""

    def __init__(self, parts: Sequence[np.ndarray], names: Sequence[str] | None = None):
        keep = [i for i, p in enumerate(parts) if len(p)]
        self.parts = [parts[i] for i in keep]
        self.names = [names[i] for i in keep] if names is not None else [f"part {i}" for i in keep]
        self.ends_P = np.cumsum([len(p) for p in self.parts], dtype=np.int64)

    def __len__(self) -> int:
        return int(self.ends_P[-1]) if len(self.ends_P) else 0

    def read(self, start: int, stop: int) -> np.ndarray:
        if not 0 <= start <= stop <= len(self):
            raise IndexError(f"window [{start}, {stop}) is outside a stream of {len(self):,} tokens")
        pieces = []
        part = int(np.searchsorted(self.ends_P, start, side="right"))
        while start < stop:
            begin = int(self.ends_P[part - 1]) if part else 0
            end = min(stop, int(self.ends_P[part]))
            pieces.append(np.asarray(self.parts[part][start - begin : end - begin], dtype=np.int64))
            start, part = end, part + 1
        return np.concatenate(pieces) if len(pieces) != 1 else pieces[0]

    def reordered(self, order: Sequence[int]) -> TokenArray:
        """The same parts in another order (a prepared stream's epochs each read its shards in
        their own order)."""
        return TokenArray([self.parts[i] for i in order], [self.names[i] for i in order])

    def locate(self, position: int) -> tuple[str, int]:
        """(part name, offset in it) of a stream position, for logs and checkpoints."""
        if not self.parts:
            return ("", 0)
        part = min(int(np.searchsorted(self.ends_P, position, side="right")), len(self.parts) - 1)
        return self.names[part], position - (int(self.ends_P[part - 1]) if part else 0)


# ---------------------------------------------------------------------------------------------
# Manifest


@dataclass(frozen=True)
class ShardInfo:
    name: str
    tokens: int
    sha256: str


@dataclass(frozen=True)
class Manifest:
    dtype: str
    tokenizer: dict  # tokenizer_identity() plus name, vocab_size and eos_id
    train: tuple[ShardInfo, ...]
    eval: tuple[ShardInfo, ...]
    documents: dict  # {"train": n, "eval": n}
    source: str
    eval_fraction: float
    seed: int
    settings: dict = field(default_factory=dict)  # the prepare options, for the record

    @property
    def fingerprint(self) -> str:
        """Names the data without reading it: the shards' names, sizes and sha256, in order."""
        digest = hashlib.blake2b(digest_size=8)
        for split in SPLITS:
            for shard in getattr(self, split):
                digest.update(f"{split}/{shard.name}/{shard.tokens}/{shard.sha256};".encode())
        return "shards-" + digest.hexdigest()

    def to_json(self) -> str:
        body = {"format": FORMAT, "version": FORMAT_VERSION, **asdict(self)}
        return json.dumps(body, indent=1) + "\n"


def is_prepared_dir(path: Path) -> bool:
    """A folder prepare-data wrote, or started to write."""
    return path.is_dir() and ((path / MANIFEST).is_file() or (path / IN_PROGRESS).exists())


def read_manifest(root: Path) -> Manifest:
    file = root / MANIFEST
    if not file.is_file():
        if (root / IN_PROGRESS).exists():
            raise DataError(
                f"'{root}' holds an unfinished prepare-data (no {MANIFEST} yet): wait for it to end, or run "
                "`growtrain prepare-data` into it again, which starts over"
            )
        raise DataError(f"'{root}' has no {MANIFEST}; prepare it with `growtrain prepare-data SOURCE --out {root}`")
    try:
        body = json.loads(file.read_text(encoding="utf-8"))
        if body.get("format") != FORMAT:
            raise DataError(f"{file} is not a growtrain token-shard manifest (format {body.get('format')!r})")
        if body.get("version") != FORMAT_VERSION:
            raise DataError(f"{file} has format version {body.get('version')}; this growtrain reads {FORMAT_VERSION}")
        shards = {s: tuple(ShardInfo(**x) for x in body[s]) for s in SPLITS}
        manifest = Manifest(
            dtype=body["dtype"], tokenizer=dict(body["tokenizer"]), train=shards["train"], eval=shards["eval"],
            documents=dict(body["documents"]), source=str(body["source"]), eval_fraction=float(body["eval_fraction"]),
            seed=int(body["seed"]), settings=dict(body.get("settings", {})),
        )
    except DataError:
        raise
    except (ValueError, KeyError, TypeError) as exc:
        raise DataError(f"{file} is damaged ({type(exc).__name__}: {exc}); prepare the data again") from None
    if manifest.dtype not in DTYPES:
        raise DataError(f"{file} names shard dtype '{manifest.dtype}', not one of {list(DTYPES)}")
    return manifest


def check_tokenizer(root: Path, manifest: Manifest, spec: str, tokenizer: Tokenizer) -> None:
    """The recipe's tokenizer must be the one the shards were written with (ids mean nothing under
    another)."""
    theirs, ours = manifest.tokenizer, tokenizer_identity(spec)
    if theirs.get("sha256") == ours["sha256"]:  # both None only for the byte tokenizer
        if int(theirs.get("vocab_size", tokenizer.vocab_size)) != tokenizer.vocab_size:
            raise DataError(f"'{root}' was written with a vocabulary of {theirs['vocab_size']:,}; the tokenizer has {tokenizer.vocab_size:,}")
        return
    described = "the byte tokenizer" if theirs.get("spec") == "byte" else f"tokenizer '{theirs.get('name')}' (sha256 {str(theirs.get('sha256'))[:12]})"
    mine = "the byte tokenizer" if spec == "byte" else f"'{spec}' (sha256 {str(ours['sha256'])[:12]})"
    raise DataError(
        f"'{root}' was prepared with {described}, but data.tokenizer is {mine}: set data.tokenizer to the tokenizer "
        "the shards were written with, or prepare the data again with this one"
    )


def open_split(root: Path, manifest: Manifest, split: str) -> TokenArray:
    """Memory maps of one split's shards; each file's size must match the manifest."""
    dtype = DTYPES[manifest.dtype]
    parts, names = [], []
    for shard in getattr(manifest, split):
        path = root / shard.name
        if not path.is_file():
            raise DataError(f"shard {path} named in {root / MANIFEST} is missing; prepare the data again")
        size, expected = path.stat().st_size, shard.tokens * dtype.itemsize
        if size != expected:
            raise DataError(
                f"shard {path} holds {size:,} bytes, but the manifest says {shard.tokens:,} {manifest.dtype} tokens "
                f"({expected:,} bytes): the file is truncated or was replaced; prepare the data again"
            )
        parts.append(np.memmap(path, dtype=dtype, mode="r") if shard.tokens else np.zeros(0, dtype))
        names.append(shard.name)
    return TokenArray(parts, names)


def verify_shards(root: Path, manifest: Manifest, progress: Callable[[int, int], None] | None = None) -> list[str]:
    """Every shard's sha256 against the manifest (reads all of them): the problems found."""
    problems = []
    total = sum(s.tokens for split in SPLITS for s in getattr(manifest, split)) * DTYPES[manifest.dtype].itemsize
    done = 0
    for split in SPLITS:
        for shard in getattr(manifest, split):
            path = root / shard.name
            if not path.is_file():
                problems.append(f"{path}: missing")
                continue
            digest = hashlib.sha256()
            with open(path, "rb") as f:
                while chunk := f.read(1 << 24):
                    digest.update(chunk)
                    done += len(chunk)
                    if progress is not None:
                        progress(done, total)
            if digest.hexdigest() != shard.sha256:
                problems.append(f"{path}: sha256 {digest.hexdigest()[:12]}, the manifest says {shard.sha256[:12]}")
    return problems
