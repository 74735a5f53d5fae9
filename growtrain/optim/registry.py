"""The optimizer a config asks for: `build_optimizer(named_params, cfg)`.

A registry keyed by (cfg.name, cfg.dense_state_bits). It sits in its own module because it names
both implementations: growtrain/optim/adamw.py (AdamW, 32-bit moments) and growtrain/optim/adamw8bit.py
(AdamW8bit, built on AdamW), so neither of those has to import the other lazily.
"""

from __future__ import annotations

from torch import nn

from growtrain.optim.adamw import AdamW, OptimizerConfig
from growtrain.optim.adamw8bit import AdamW8bit

OPTIMIZERS: dict[tuple[str, int], type[AdamW]] = {
    ("adamw", 32): AdamW,
    ("adamw", 8): AdamW8bit,
}


def build_optimizer(named_params: dict[str, nn.Parameter], cfg: OptimizerConfig) -> AdamW:
    """The optimizer of `cfg` over the trainable tensors of `named_params` (fresh state)."""
    key = (cfg.name, cfg.dense_state_bits)
    if key not in OPTIMIZERS:
        valid = ", ".join(f"name: {n}, dense_state_bits: {b}" for n, b in OPTIMIZERS)
        raise ValueError(f"no optimizer for name: {cfg.name}, dense_state_bits: {cfg.dense_state_bits}; registered: {valid}")
    return OPTIMIZERS[key](named_params, cfg)
