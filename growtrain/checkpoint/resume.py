"""What a resume checks, and how it takes a checkpoint's tensors: which recipe settings a resume may
change (the rest must match the checkpoint's recipe, listed as leaf-level differences when they do
not), and tensors given storage of their own, aligned as the allocator aligns."""

from __future__ import annotations

from pathlib import Path

import torch

from growtrain.checkpoint.store import CheckpointConfig, CheckpointManager
from growtrain.data.tokenizer import CHECKPOINT_TOKENIZER
from growtrain.recipe import RecipeError, without_moved_keys


# Recipe settings a resume may change: none of them can change what the run computes (weights,
# losses, data order, growth), only where its numbers go and how often it talks. This is the one
# list; every other field must match the checkpoint's recipe. Not here on purpose: train.threads
# (CPU reductions split differently: other bits), train.eval_every / eval_batches (the recorded
# eval losses would change meaning mid-run), invariance.* (decides whether growth passes).
RESUME_MAY_CHANGE = (
    "name",  # W&B display name and log prefix
    "train.log_every",  # console lines only; W&B and metrics.jsonl get every step
    "tracking",  # W&B mode/project/tags and the progress bar
    "checkpoint",  # how often checkpoints are written and how many are kept
    "distributed",  # combine mode (same bits either way) and the collective timeout
    "train.expert_backend",  # other kernels, same experts: the same function, its bits within kernel rounding
    "train.device",  # where it computes, not what: another device's kernels round differently
    "train.grow_on",  # where growth computes: the same copies and draws, the checks' numbers within rounding
    "train.deterministic",  # which kernels: the same function, other rounding orders
)


def comparable(recipe_plain: dict) -> dict:
    """The recipe without the RESUME_MAY_CHANGE settings (nor keys that moved since it was written)."""
    out = without_moved_keys(recipe_plain)
    for dotted in RESUME_MAY_CHANGE:
        *parents, leaf = dotted.split(".")
        node = out
        for key in parents:
            node = node.get(key) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node.pop(leaf, None)
    return out


_ABSENT = object()


def _short(value, limit: int = 60) -> str:
    text = "(absent)" if value is _ABSENT else repr(value)
    return text if len(text) <= limit else text[: limit - 4] + " ..."


def recipe_diff(a, b, path="") -> list[str]:
    """Leaf-level differences, one short line each: `stages.3.steps: checkpoint 6 -> recipe 10`."""
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in sorted(set(a) | set(b), key=str) for d in recipe_diff(a.get(k, _ABSENT), b.get(k, _ABSENT), f"{path}.{k}" if path else str(k))]
    if isinstance(a, list) and isinstance(b, list) and (len(a) != len(b) or any(isinstance(v, (dict, list)) for v in a + b)):
        out = [] if len(a) == len(b) else [f"{path}: checkpoint {len(a)} items -> recipe {len(b)} items"]
        return out + [d for i in range(min(len(a), len(b))) for d in recipe_diff(a[i], b[i], f"{path}.{i}")]
    return [] if a == b else [f"{path}: checkpoint {_short(a)} -> recipe {_short(b)}"]


def refuse_other_run(meta: dict, recipe_plain: dict, tokenizer: dict, tokenizer_setting: str, path: Path) -> None:
    """A checkpoint resumes only under the recipe and tokenizer it was written with (but for the
    RESUME_MAY_CHANGE settings); otherwise a RecipeError says what differs and what to do."""
    diff = recipe_diff(comparable(meta["recipe"]), comparable(recipe_plain))
    if diff:
        raise RecipeError(
            diff[:10] + ["resume with the recipe the run was started with, or start a new run (--out elsewhere or --resume never)"],
            f"{path} was written by a different recipe",
        )
    had = (meta.get("tokenizer") or {}).get("sha256")
    if had is not None and had != tokenizer["sha256"]:
        raise RecipeError(
            [f"data.tokenizer '{tokenizer_setting}' is not the file this run was trained with (sha256 "
             f"{tokenizer['sha256'] and tokenizer['sha256'][:12]}, the checkpoint's is {had[:12]}); "
             f"the original is kept in {path / CHECKPOINT_TOKENIZER}"],
            f"{path}",
        )


ALLOCATOR_ALIGNMENT = 64  # bytes: PyTorch's CPU allocator (c10 alignment), and the widest vector load


def owning(t: torch.Tensor) -> torch.Tensor:
    """`t`, or a copy of it in storage of its own, aligned as the allocator aligns, when it views a
    larger storage (an expert shard cut from a memory-mapped checkpoint file: a parameter assigned
    from it would otherwise keep the whole storage alive) or starts off a 64-byte boundary
    (safetensors 0.8 loads tensors at 8-byte offsets in the file's buffer, and the AVX-512 CPU
    kernels round such an operand otherwise than an aligned one: a resumed run would drift from the
    uninterrupted one by a few ulps per step)."""
    if t.untyped_storage().nbytes() != t.numel() * t.element_size() or t.data_ptr() % ALLOCATOR_ALIGNMENT:
        return t.clone()
    return t


def interrupted_message(run_dir: Path) -> str:
    """What is on disk after an interrupt. Saves are atomic (store.py), so the newest complete
    checkpoint is whole; it is not checksummed here, a Ctrl-C must not wait on hundreds of GB."""
    found = CheckpointManager(Path(run_dir), CheckpointConfig(), log=lambda msg: None).complete_checkpoints()
    if not found:
        return f"no checkpoint was written yet under {run_dir}: running the same command starts the run over from step 0"
    return f"the newest complete checkpoint is {found[0]}: run the same command to resume from it"
