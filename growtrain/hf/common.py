"""What both exports (growtrain/hf/export.py: remote code; growtrain/hf/native.py: transformers'
own classes) share: a tensor to write, made a chunk of rows at a time, and the config fields every
export writes under transformers' names."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from growtrain.hf.adapters import ExportError
from growtrain.model.config import ModelConfig

# Rows per chunk are chosen so that a chunk is at most this many bytes at float32: the export's
# memory bound (benchmarks/export_memory.py).
CHUNK_BYTES = 256 << 20


@dataclass
class OutTensor:
    name: str  # growtrain's base-model name, then the exported model's (hf_name, hf_native)
    shape: tuple[int, ...]
    dtype: torch.dtype
    rows: Callable[[int, int], torch.Tensor]  # rows [lo, hi) along dim 0, float32 or the source dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()

    def chunks(self) -> Iterator[torch.Tensor]:
        """The tensor in row chunks of at most CHUNK_BYTES at float32, cast to `dtype`."""
        if not self.shape:
            yield self.rows(0, 1).reshape(()).to(self.dtype)
            return
        per_row = max(1, math.prod(self.shape[1:]) * 4)
        step = max(1, CHUNK_BYTES // per_row)
        for lo in range(0, self.shape[0], step):
            hi = min(lo + step, self.shape[0])
            chunk = self.rows(lo, hi)
            if tuple(chunk.shape) != (hi - lo, *self.shape[1:]):
                raise ExportError(f"{self.name}: rows {lo}..{hi} came out as {tuple(chunk.shape)}, expected {(hi - lo, *self.shape[1:])}")
            yield chunk.to(self.dtype).contiguous()


def shape_config(cfg: ModelConfig, max_positions: int, eos_id: int) -> dict:
    """The config.json fields every export shares, under transformers' names."""
    return {
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_size,
        "rope_theta": cfg.rope_theta,
        "rms_norm_eps": cfg.norm_eps,
        "max_position_embeddings": max_positions,
        "initializer_range": cfg.init_std,
        "use_cache": True,
        "eos_token_id": eos_id,
        "tie_word_embeddings": False,
    }


