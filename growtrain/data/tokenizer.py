"""Tokenizers: a built-in byte-level one, and any local Hugging Face `tokenizer.json`.

Both share the small `Tokenizer` protocol below. `encode_documents` is what the corpus loader
calls: it returns one flat int32 array with EOS after every document, so that a fast path (the
byte tokenizer's `np.frombuffer`) can skip Python-level work per token.

`DataError` lives here, the lowest module of the data path, and is re-exported by
`growtrain.data.corpus`; user-facing data and tokenizer problems raise it (the CLI prints the message,
no traceback).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Protocol, Sequence

import numpy as np


class DataError(Exception):
    """A problem with the data or tokenizer that the user can fix; the message says how."""


class Tokenizer(Protocol):
    name: str
    vocab_size: int
    eos_id: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def encode_documents(self, texts: Sequence[str]) -> np.ndarray: ...


class ByteTokenizer:
    """Ids 0..255 are the UTF-8 bytes of the text; id 256 is EOS, the document separator."""

    name = "byte"
    vocab_size = 257
    eos_id = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i for i in ids if i != self.eos_id).decode("utf-8", errors="replace")

    def encode_documents(self, texts: Sequence[str]) -> np.ndarray:
        blobs = [t.encode("utf-8") for t in texts]
        ends = np.cumsum([len(b) for b in blobs], dtype=np.int64)
        tokens = np.frombuffer(b"".join(blobs), dtype=np.uint8).astype(np.int32)
        # np.insert places each EOS before the original index, i.e. right after each document.
        return np.insert(tokens, ends, np.int32(self.eos_id))


# Tried in this order when no EOS token is named: Llama/T5, GPT-2/NeoX, Gemma conventions.
_EOS_CANDIDATES = ("</s>", "<|endoftext|>", "<eos>")


class HFTokenizerFile:
    """A local `tokenizer.json` (or a folder holding one), read with the `tokenizers` package."""

    def __init__(self, path: str | Path, eos_token: str | None = None):
        try:
            from tokenizers import Tokenizer as _HFTokenizer
        except ImportError:
            raise DataError(
                f"tokenizer '{path}' is a tokenizer.json file, which needs the `tokenizers` package: "
                "pip install tokenizers"
            ) from None
        file = Path(path).expanduser()
        if file.is_dir():
            file = file / "tokenizer.json"
        if not file.is_file():
            raise DataError(f"tokenizer file '{file}' does not exist")
        try:
            self._tok = _HFTokenizer.from_file(str(file))
        except Exception as exc:  # the Rust side raises a bare Exception on malformed JSON
            raise DataError(f"could not read tokenizer '{file}': {_first_line(exc)}") from None
        candidates = (eos_token,) if eos_token else _EOS_CANDIDATES
        for token in candidates:
            eos_id = self._tok.token_to_id(token)
            if eos_id is not None:
                break
        else:
            raise DataError(
                f"tokenizer '{file}' has no end-of-document token among {list(candidates)}; "
                "name the one it uses"
            )
        self.eos_id = int(eos_id)
        self.eos_token = token
        self.vocab_size = max(self._tok.get_vocab_size(with_added_tokens=True), self.eos_id + 1)
        self.name = str(file)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([i for i in ids if i != self.eos_id], skip_special_tokens=True)

    def encode_documents(self, texts: Sequence[str]) -> np.ndarray:
        parts: list[np.ndarray] = []
        eos = np.array([self.eos_id], dtype=np.int32)
        for enc in self._tok.encode_batch(list(texts), add_special_tokens=False):
            parts.append(np.asarray(enc.ids, dtype=np.int32))
            parts.append(eos)
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)


def build_tokenizer(spec: str) -> Tokenizer:
    """"byte" → ByteTokenizer; a tokenizer.json file, or a folder holding one → HFTokenizerFile."""
    if spec == "byte":
        return ByteTokenizer()
    path = Path(spec).expanduser()
    if path.is_file() or (path.is_dir() and (path / "tokenizer.json").is_file()):
        return HFTokenizerFile(path)
    if path.is_dir():
        raise DataError(f"tokenizer folder '{spec}' holds no tokenizer.json")
    raise DataError(
        f"unknown tokenizer '{spec}': expected 'byte' or the path of a local tokenizer.json "
        "(or of a folder holding one)"
    )


CHECKPOINT_TOKENIZER = "tokenizer.json"  # the copy every checkpoint of a run with a tokenizer file holds


def tokenizer_file(spec: str) -> Path | None:
    """The tokenizer.json a spec names (None for 'byte')."""
    if spec == "byte":
        return None
    path = Path(spec).expanduser()
    return path / "tokenizer.json" if path.is_dir() else path


def tokenizer_identity(spec: str) -> dict:
    """What a checkpoint records of its tokenizer: the spec, and for a file its sha256, so a resume
    or a `generate` can tell the same tokenizer from another one under the same path."""
    file = tokenizer_file(spec)
    if file is None:
        return {"spec": spec, "file": None, "sha256": None}
    return {"spec": spec, "file": CHECKPOINT_TOKENIZER, "sha256": hashlib.sha256(file.read_bytes()).hexdigest()}


def checkpoint_tokenizer(checkpoint_dir: Path, meta: dict) -> Tokenizer:
    """The tokenizer a checkpoint was trained with: its own copy of the file, wherever the command
    runs from. A checkpoint from before copies were kept falls back to the recipe's path, refused
    when that file is no longer the one it trained with."""
    ident = meta.get("tokenizer")
    spec = meta["recipe"]["data"]["tokenizer"]
    if spec == "byte":
        return ByteTokenizer()
    if ident and ident.get("file"):
        own = Path(checkpoint_dir) / ident["file"]
        if not own.is_file():
            raise DataError(f"checkpoint {checkpoint_dir} names its tokenizer {ident['file']}, which is missing")
        return HFTokenizerFile(own)
    file = tokenizer_file(spec)
    if file is None or not file.is_file() or not Path(spec).is_absolute():
        raise DataError(
            f"checkpoint {checkpoint_dir} holds no copy of its tokenizer and its recipe's tokenizer '{spec}' cannot be "
            "found from here: run the command from the directory the run was started in"
        )
    return build_tokenizer(spec)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
