"""The training run, top to bottom: resume or start, then for each stage grow, train, evaluate and
checkpoint. This is the file to read when a run misbehaves.

Position convention: a checkpoint at (stage i, stage_step s) holds the model of stage i, i.e. after
stage i's growth and s of its steps. A fresh run starts before stage 0's growth. Everything that
decides what happens next (weights, optimizer moments and multipliers, data cursor, RNG states,
consecutive bad steps) is in the checkpoint, and growth draws its randomness from a seed derived
from (seed, stage, operator index), so a killed-and-resumed CPU run repeats the uninterrupted
run's losses and weights bit for bit.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import math
import os
import platform
import resource
import subprocess
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from growtrain.checkpoint import (
    CheckpointConfig, CheckpointError, CheckpointManager, LoadedCheckpoint, dense_state_file_name, file_entry, shard_file_name, write_shard_file,
)
from growtrain.data import Corpus, TokenStream, eval_batches, load_corpus
from growtrain.divergence import flat_metrics, format_line as format_sibling_line, sibling_divergence, sibling_parents
from growtrain.distributed import Dist, is_peer_failure, resolve_attention_ranks, world_size_problems
from growtrain.expert_shards import is_expert_tensor
from growtrain import collective_guard, memtrace
from growtrain.memory import host_available_bytes
from growtrain.faults import maybe_fault
from growtrain.kernels.backend import triton_route
from growtrain.model import GrowLM
from growtrain.model.config import ModelConfig
from growtrain.model.af import clock as af_clock, end_calls, serve_calls
from growtrain.model.af_interleaved import in_pairs, interleaved_passes
from growtrain.model.expert_parallel import use_group
from growtrain.optim import to_device
from growtrain.optim_registry import build_optimizer
from growtrain.planning import HEADROOM_TARGET, growth_peak_bytes_per_rank, model_flops_per_token
from growtrain.progress import Progress, counted_flops, stage_step_costs
from growtrain.recipe import Recipe, RecipeError, StageConfig, dump_yaml, to_plain, without_moved_keys
from growtrain.run_lock import RunDirLock, RunDirLocked
from growtrain.stages import GrowthCheckFailed, apply_growth, get_operator, plan_stage_models, sharding
from growtrain.tokenizer import CHECKPOINT_TOKENIZER, tokenizer_file, tokenizer_identity
from growtrain.tracking import Console, MetricsFile, Tracker, format_duration


class TrainingDiverged(Exception):
    """Too many consecutive non-finite steps; no checkpoint of the bad state was written."""


@dataclass
class RunResult:
    run_dir: Path
    global_step: int
    tokens: int
    final_loss: float
    final_eval_loss: float
    growth_history: list[dict] = field(default_factory=list)


@dataclass
class Position:
    stage: int = 0
    stage_step: int = 0
    global_step: int = 0
    tokens: int = 0
    bad_steps: int = 0
    grown: bool = False  # stage `stage`'s growth has been applied


# ---------------------------------------------------------------------------------------------


def forward_loss(model: GrowLM, inputs_BT, targets_BT, precision: str):
    """Cross-entropy and aux loss of one micro-batch (a module-level function so tests can fake it)."""
    with torch.autocast(inputs_BT.device.type, dtype=torch.bfloat16, enabled=precision == "bf16"):
        out = model(inputs_BT)
    ce = F.cross_entropy(out.logits.float().flatten(0, 1), targets_BT.flatten())
    return ce, out.aux_loss.float(), out.moe_stats


def evaluate(model: GrowLM, batches, precision: str, pairs_on: torch.device | None = None) -> float:
    """The mean loss over `batches`. `pairs_on`: an AF attention rank's device under af_schedule:
    interleaved, where the batches go two at a time, in flight together (model/af_interleaved.py)."""

    def loss(x, y) -> torch.Tensor:
        with torch.no_grad():  # here, not around evaluate: grad mode is per thread, and in_pairs runs threads
            return forward_loss(model, x, y, precision)[0].double()

    model.eval()
    if pairs_on is None:
        losses = [loss(x, y) for x, y in batches]
    else:
        losses = in_pairs([lambda x=x, y=y: loss(x, y) for x, y in batches], pairs_on)
    model.train()
    values = torch.stack(losses).tolist()  # one host sync
    return sum(values) / len(values)


def seed_model_config(recipe: Recipe, corpus: Corpus) -> ModelConfig:
    vocab = corpus.tokenizer.vocab_size
    if recipe.model.vocab_size and recipe.model.vocab_size < vocab:
        raise RecipeError([f"model.vocab_size {recipe.model.vocab_size} is smaller than the tokenizer's {vocab}; set it to 0 to use the tokenizer's size"])
    return recipe.model.with_changes(vocab_size=recipe.model.vocab_size or vocab)


def resolve_device(setting: str, dist: Dist) -> torch.device:
    """train.device: auto is cuda:LOCAL_RANK where CUDA is available (under NCCL, the process
    group's device), else the CPU."""
    if setting == "cpu":
        if dist.active and dist.device.type != "cpu":
            raise RecipeError([f"train.device: cpu, but the process group runs on {dist.device} (NCCL); use auto or cuda"])
        return torch.device("cpu")
    if setting == "cuda" and not torch.cuda.is_available():
        raise RecipeError(["train.device: cuda, but no CUDA device is available here; use auto or cpu"])
    if setting == "cuda" or (setting == "auto" and torch.cuda.is_available()):
        if dist.active and dist.device.type == "cuda":
            return dist.device
        index = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def use_deterministic_kernels() -> None:
    """train.deterministic: the same bits from the same state on a GPU. cuBLAS needs a fixed
    workspace for that (read when its first handle is made, so set before the first matmul). Not
    warn_only: with it, memory-efficient attention keeps its non-deterministic backward (it only
    warns, seen on an H200); strict, it takes its deterministic one, and an op with no
    deterministic version fails naming itself."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)


ALLOCATOR_ALIGNMENT = 64  # bytes: PyTorch's CPU allocator (c10 alignment), and the widest vector load


def _owning(t: torch.Tensor) -> torch.Tensor:
    """`t`, or a copy of it in storage of its own, aligned as the allocator aligns, when it views a
    larger storage (an expert shard cut from a memory-mapped checkpoint file: a parameter assigned
    from it would otherwise keep the whole storage alive) or starts off a 64-byte boundary
    (safetensors 0.8 loads tensors at 8-byte offsets in the file's buffer, and the AVX-512 CPU
    kernels round such an operand otherwise than an aligned one: a resumed run would drift from the
    uninterrupted one by a few ulps per step)."""
    if t.untyped_storage().nbytes() != t.numel() * t.element_size() or t.data_ptr() % ALLOCATOR_ALIGNMENT:
        return t.clone()
    return t


def gpu_peak_tflops(device: torch.device) -> float | None:
    """Dense bf16 peak of a GPU the planner has a preset for (by name), else None."""
    if device.type != "cuda":
        return None
    from growtrain.planning import PRESETS

    name = torch.cuda.get_device_name(device).lower()
    for key, hw in PRESETS.items():
        if key.split("-")[0] in name:
            return hw.peak_tflops
    return None


def environment(device: torch.device | None = None) -> dict:
    """What ran: code version, package versions, device (STYLE.md item 12)."""
    try:
        commit = subprocess.run(
            ["git", "describe", "--always", "--dirty"], cwd=Path(__file__).parent, capture_output=True, text=True, timeout=5
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    device = device or torch.device("cpu")
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        device = f"{device} ({props.name}, {props.total_memory / 2**30:.0f} GiB; {torch.cuda.device_count()} GPU(s) visible)"
    else:
        device = f"cpu ({torch.get_num_threads()} threads)"
    return {"code": commit or "unknown", "python": platform.python_version(), "torch": torch.__version__, "device": device}


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


def _comparable(recipe_plain: dict) -> dict:
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


def growth_budget_bytes(device: torch.device) -> float | None:
    """What growth may hold per rank on `device` (train.grow_on: auto): a GPU's memory less the
    planner's headroom target; None on the CPU, where the host is the device."""
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_properties(device).total_memory * (1 - HEADROOM_TARGET)


def _size(n: float) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def _short(value, limit: int = 60) -> str:
    text = "(absent)" if value is _ABSENT else repr(value)
    return text if len(text) <= limit else text[: limit - 4] + " ..."


def _recipe_diff(a, b, path="") -> list[str]:
    """Leaf-level differences, one short line each: `stages.3.steps: checkpoint 6 -> recipe 10`."""
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in sorted(set(a) | set(b), key=str) for d in _recipe_diff(a.get(k, _ABSENT), b.get(k, _ABSENT), f"{path}.{k}" if path else str(k))]
    if isinstance(a, list) and isinstance(b, list) and (len(a) != len(b) or any(isinstance(v, (dict, list)) for v in a + b)):
        out = [] if len(a) == len(b) else [f"{path}: checkpoint {len(a)} items -> recipe {len(b)} items"]
        return out + [d for i in range(min(len(a), len(b))) for d in _recipe_diff(a[i], b[i], f"{path}.{i}")]
    return [] if a == b else [f"{path}: checkpoint {_short(a)} -> recipe {_short(b)}"]


def _finite_flags(tensors: list[torch.Tensor]) -> torch.Tensor:
    """One bool per tensor, on the device: no NaN or infinity in it (no host sync)."""
    return torch.stack([t.isfinite().all() for t in tensors])


def nonfinite_tensors(named) -> list[str]:
    """Names of the floating-point tensors holding a NaN or an infinity (one host sync for all)."""
    named = [(n, t) for n, t in named if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel()]
    if not named:
        return []
    finite = _finite_flags([t for _, t in named]).tolist()
    return [n for (n, _), ok in zip(named, finite) if not ok]


def _tensors_in(obj, prefix: str):
    """(name, tensor) pairs of a nested dict/list (optimizer state)."""
    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _tensors_in(v, f"{prefix}.{k}")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _tensors_in(v, f"{prefix}.{i}")


# ---------------------------------------------------------------------------------------------


class Run:
    def __init__(self, recipe: Recipe, run_dir: Path, log=print):
        # Under torchrun every rank runs this file; rank 0 alone logs, tracks and writes metrics.
        # distributed.attention_ranks: auto is the planner's, the same on every rank.
        shapes = plan_stage_models(recipe.model, [s.grow for s in recipe.stages])
        recipe, chosen = resolve_attention_ranks(recipe, shapes, int(os.environ.get("WORLD_SIZE", "1")))
        self.dist = Dist.from_env(recipe.distributed)
        self.recipe = recipe
        self.run_dir = Path(run_dir)
        self.log = log if self.dist.is_main else (lambda *a, **k: None)
        if chosen:
            self.log(chosen)
        self.plain = to_plain(recipe)
        self.ckpt = CheckpointManager(
            self.run_dir, recipe.checkpoint, self.log, expert_shard=self.dist.expert_shard(),
            combine=self.dist.all_problems if self.dist.active else None, part=(self.dist.rank, self.dist.size),
        )
        self.metrics = MetricsFile(self.run_dir / "metrics.jsonl")
        tracking = recipe.tracking if self.dist.is_main else replace(recipe.tracking, wandb=replace(recipe.tracking.wandb, mode="disabled"))
        self.tracker = Tracker(tracking, self.run_dir, recipe.name, self.log)
        self.dist.error_dir = self.run_dir / ".rank-errors"
        self.history: list[dict] = []
        self.plan_counts: dict = {}  # the planner's per-shape counts (growth's planned peak, train.grow_on)
        self.device = torch.device("cpu")
        self._bad_update: torch.Tensor | None = None  # non-finite parameter count after the last update, not yet read
        self.last_loss = math.nan
        self.last_eval = math.nan
        self.stage_before: list[ModelConfig] = []  # [i]: the model before stage i's growth; [i + 1] after it
        self.divergence: dict[str, dict] = {}  # stage name -> its end's sibling numbers (growtrain/divergence.py)

    # -- setup -----------------------------------------------------------------------------------

    def _find_checkpoint(self, resume: str) -> LoadedCheckpoint | None:
        if resume == "never":
            if self.ckpt.complete_checkpoints():
                raise CheckpointError(
                    f"{self.run_dir} already holds checkpoints and --resume never was given; "
                    "choose another --out, or remove that directory to start over"
                )
            return None
        if resume == "auto":
            return self.ckpt.load_latest()
        return self.ckpt.resolve(Path(resume))

    def _restore(self, loaded: LoadedCheckpoint, shapes: list[ModelConfig]) -> Position:
        meta = loaded.meta
        diff = _recipe_diff(_comparable(meta["recipe"]), _comparable(self.plain))
        if diff:
            raise RecipeError(
                diff[:10] + ["resume with the recipe the run was started with, or start a new run (--out elsewhere or --resume never)"],
                f"{loaded.path} was written by a different recipe",
            )
        had = (meta.get("tokenizer") or {}).get("sha256")
        if had is not None and had != self.tokenizer["sha256"]:
            raise RecipeError(
                [f"data.tokenizer '{self.recipe.data.tokenizer}' is not the file this run was trained with (sha256 "
                 f"{self.tokenizer['sha256'] and self.tokenizer['sha256'][:12]}, the checkpoint's is {had[:12]}); "
                 f"the original is kept in {loaded.path / CHECKPOINT_TOKENIZER}"],
                f"{loaded.path}",
            )
        if meta.get("data_fingerprint") not in (None, self.data_fingerprint):
            # Same recipe, other text (a changed local folder, another Python's stdlib): the run
            # continues, but it cannot repeat the losses it would have had.
            self.log(
                f"warning: the training data differs from the data this run started with "
                f"(fingerprint {self.data_fingerprint}, checkpoint has {meta['data_fingerprint']})"
            )
        pos = Position(meta["stage"], meta["stage_step"], meta["step"], meta["tokens"], loaded.trainer_state["bad_steps"], True)
        # The checkpoint loader already cut the experts (and their optimizer state) to this rank.
        # Built on meta and given the checkpoint's tensors (assign): no random init to throw away
        # (at scale, initialising and quantizing the experts takes longer than reading them).
        with torch.device("meta"):
            model = self.dist.shard(GrowLM(shapes[pos.stage]))
        state = self.dist.local_model_state(loaded.model_state, model)  # AF: what this side does not hold stays empty / meta
        model.load_state_dict({n: t if t.is_meta else _owning(t.to(self.device)) for n, t in state.items()}, strict=True, assign=True)
        self.model = model
        self.optimizer = build_optimizer(self.dist.owned(dict(self.model.named_parameters())), self.recipe.optimizer)
        owned = {n: v for n, v in loaded.trainer_state["optimizer"].items() if n in self.optimizer.params}
        self.optimizer.load_state_dict(to_device(owned, self.device))  # a checkpoint from another device resumes here
        self.stream.load_state_dict(loaded.trainer_state["data"])
        torch.set_rng_state(loaded.trainer_state["rng"]["torch"])
        cuda_rng = loaded.trainer_state["rng"].get("cuda")
        if cuda_rng is not None and self.device.type == "cuda":  # from a CPU checkpoint there is none to restore
            torch.cuda.set_rng_state(cuda_rng.cpu(), self.device)
        self.history = list(meta["growth_history"])
        self.wandb_id = meta.get("wandb_id")
        self.last_loss, self.last_eval = meta.get("loss", math.nan), meta.get("eval_loss", math.nan)
        self.divergence = dict(meta.get("sibling_divergence", {}))
        if self.dist.is_main:
            self.metrics.truncate_after(pos.global_step)
        self.log(
            f"resumed from {loaded.path.name}: stage {pos.stage} '{self.recipe.stages[pos.stage].name}', "
            f"step {pos.global_step}, {pos.tokens:,} tokens"
        )
        return pos

    def to_device(self, batch: torch.Tensor) -> torch.Tensor:
        """A host batch on the training device: pinned and copied without blocking the host."""
        if self.device.type == "cpu":
            return batch
        return batch.pin_memory().to(self.device, non_blocking=True)

    def _nonfinite_count(self) -> torch.Tensor:
        """How many parameters hold a NaN or an infinity, over all ranks, as a device tensor (no
        host sync). Finite gradients can still give non-finite weights (an LR or multiplier that
        overflows the update); undoing the update would need a second copy of the weights and
        optimizer state, so such a step stops the run before anything of it is checkpointed."""
        params = [p for p in self.model.parameters() if p.is_floating_point() and p.numel() and not p.is_meta]
        if not params:  # a rank without any (an AF expert rank in a dense stage) still takes part in the sum
            return self.dist.sum_tensor(torch.zeros((), dtype=torch.float64, device=self.dist.device if self.dist.active else self.device))
        bad = _finite_flags(params).logical_not().sum().double()
        return self.dist.sum_tensor(bad)

    def _raise_bad_update(self, step: int, stage: StageConfig) -> None:
        bad = nonfinite_tensors(self.model.named_parameters())
        where = f" (first: {bad[0]})" if bad else " (on another rank)"
        raise TrainingDiverged(
            f"the update of step {step} (stage '{stage.name}') made parameters non-finite{where}, from finite "
            "gradients: the learning rate or a multiplier overflows it. No checkpoint of this state was written: "
            "resume restarts from the last good one. Lower the LR."
        )

    # -- checkpoints -----------------------------------------------------------------------------

    def save(self, pos: Position, stage_end: bool, grown: bool = False) -> None:
        if self._bad_update is not None and self._bad_update.item() > 0:  # the last update's check, read now
            self._raise_bad_update(pos.global_step, self.recipe.stages[pos.stage])
        meta = {
            "stage": pos.stage,
            "stage_name": self.recipe.stages[pos.stage].name,
            "stage_step": pos.stage_step,
            "step": pos.global_step,
            "tokens": pos.tokens,
            "params_total": self.num_parameters(),
            "model_config": to_plain(self.model.config),
            "loss": self.last_loss,
            "eval_loss": self.last_eval,
            "wandb_id": self.wandb_id,
            "data_fingerprint": self.data_fingerprint,
            "data_position": self.stream.state_dict(),  # for people (inspect); a resume reads trainer.pt's
            "tokenizer": self.tokenizer,
            "growth_history": self.history,
            "sibling_divergence": self.divergence,
            "recipe": self.plain,
            "environment": self.env,
            "saved_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        }
        trainer_state = {
            "optimizer": self.optimizer.state_dict(),
            "data": self.stream.state_dict(),
            "rng": {"torch": torch.get_rng_state(), **({"cuda": torch.cuda.get_rng_state(self.device)} if self.device.type == "cuda" else {})},
            "bad_steps": pos.bad_steps,
        }
        model_state = {n: t for n, t in self.model.state_dict().items() if not t.is_meta}  # AF expert rank: its experts only
        # The last line of defence: whatever produced it, a non-finite state is never saved (a
        # resume would load it and train on NaNs).
        bad = nonfinite_tensors(model_state.items()) + nonfinite_tensors(_tensors_in(trainer_state["optimizer"], "optimizer"))
        if bad:
            raise TrainingDiverged(
                f"refusing to checkpoint step {pos.global_step}: {len(bad)} tensor(s) hold non-finite values "
                f"(first: {bad[0]}); the last checkpoint written is intact: resume restarts from it"
            )
        write_shards = None
        if self.dist.active:
            # Rank 0's files hold the replicated state; each rank adds its experts and its share of
            # the optimizer state, with the EP layout, so any EP size can load it (expert_shards.py).
            # AF: the expert ranks write the expert shards (an EP layout of F ranks), the attention
            # ranks their dense optimizer shares; either layout loads it (checkpoint.py).
            experts = {n: t for n, t in model_state.items() if is_expert_tensor(n)}
            model_state = {n: t for n, t in model_state.items() if not is_expert_tensor(n)}
            optimizer_share = trainer_state.pop("optimizer")
            trainer_state["optimizer"] = {}
            af = self.dist.af
            if af is None:
                name = shard_file_name(self.dist.rank, self.dist.size)
                shard = {"ep_rank": self.dist.rank, "ep_size": self.dist.size, "model": experts, "optimizer": optimizer_share}
                meta["expert_parallel"] = {"size": self.dist.size, "files": [shard_file_name(r, self.dist.size) for r in range(self.dist.size)]}
            else:
                n_expert = af.expert_ranks
                if af.is_attention:
                    name, shard = dense_state_file_name(self.dist.rank, af.attention), {"optimizer": optimizer_share}
                else:
                    name = shard_file_name(self.dist.rank - af.attention, n_expert)
                    shard = {"ep_rank": self.dist.rank - af.attention, "ep_size": n_expert, "model": experts, "optimizer": optimizer_share}
                meta["expert_parallel"] = {
                    "size": n_expert,
                    "files": [shard_file_name(f, n_expert) for f in range(n_expert)],
                    "dense_files": [dense_state_file_name(a, af.attention) for a in range(af.attention)],
                    "layout": "af",
                    "attention_ranks": af.attention,
                }
            write_shards = lambda tmp: self._write_shards(tmp, name, shard)  # noqa: E731
            if not self.dist.is_main:
                self._write_shards(None, name, shard)
                self.dist.barrier()  # rank 0 has renamed the checkpoint into place
                return
        path = self.ckpt.save(
            pos.global_step,
            model_state=model_state,
            trainer_state=trainer_state,
            meta=meta,
            stage_end=stage_end,
            grown=grown,
            extra_files={"recipe.yaml": dump_yaml(self.recipe)} | ({CHECKPOINT_TOKENIZER: self.tokenizer_text} if self.tokenizer_text else {}),
            write_shards=write_shards,
        )
        self.dist.barrier()
        self.console.write(f"checkpoint {path.name}{' (stage end)' if stage_end else ' (after growth)' if grown else ''}")

    def _import_seed(self, path: str) -> None:
        """model.init_from: the seed's weights from a local Hugging Face checkpoint (growtrain/hf_import.py),
        checked like an exact growth operator against transformers' own forward of it."""
        from growtrain.hf_import import import_check, import_state

        state = import_state(Path(path), self.model.config.n_layers)
        with torch.no_grad():
            missing, unexpected = self.model.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise RecipeError([f"model.init_from: {path} does not fill the seed model (missing {missing[:3]}, unexpected {unexpected[:3]})"])
        self.log(f"model: the seed's weights imported from {path} ({len(state)} tensors)")
        if not self.dist.is_main:
            # Every rank holds the same dense seed; one check (a second copy of the checkpoint in host
            # memory) is enough, and its failure reaches the other ranks as a peer's error.
            return
        seq = self.recipe.invariance.probe_seq_len or self.recipe.stages[0].seq_len
        was_training = self.model.training
        self.model.eval()
        numbers = import_check(self.model, Path(path), self.model.config.vocab_size, seq)
        self.model.train(was_training)
        bar = self.recipe.invariance.exact_rel_tol
        verdict = "passed" if numbers["rel_l2"] <= bar else "FAILED"
        self.log(
            f"import check: logits against transformers' {numbers['architecture']} of the checkpoint: rel L2 {numbers['rel_l2']:.2e} "
            f"(bar {bar:.0e}), max|Δlogit| {numbers['max_abs_dlogits']:.2e} — {verdict}"
        )
        if numbers["rel_l2"] > bar:
            raise GrowthCheckFailed({"stage": self.recipe.stages[0].name, "operator": "init_from", "index": 0,
                                     "problems": [f"imported logits differ from transformers' by rel L2 {numbers['rel_l2']:.2e} > {bar:.0e}"]})

    def _write_shards(self, tmp: Path | None, name: str, shard: dict) -> dict[str, dict]:
        """Every rank writes its expert shard into rank 0's temporary checkpoint dir and hashes it,
        all at once (rank 0 would otherwise hash every shard after the others: ~117 GB at the
        120B recipe's last stage); rank 0 gets every shard's manifest entry."""
        import torch.distributed as dist

        where = [str(tmp) if tmp is not None else None]
        dist.broadcast_object_list(where, src=0)
        path = Path(where[0]) / name
        write_shard_file(path, shard)
        entries: list = [None] * self.dist.size
        dist.all_gather_object(entries, (name, file_entry(path)))  # names and digests, no tensors
        return dict(entries)

    def num_parameters(self) -> int:
        """The whole model's count (a rank holds 1/W of the experts; in an AF layout, counted on a
        meta copy of the whole model)."""
        if self.dist.af is not None:
            with torch.device("meta"):
                return sum(p.numel() for p in GrowLM(self.model.config).parameters())
        return sum(p.numel() * (self.dist.size if is_expert_tensor(n) else 1) for n, p in self.model.named_parameters())

    def _check_parallel(self, shapes: list[ModelConfig]) -> None:
        problems = world_size_problems(self.recipe, shapes, self.dist.size)
        if problems:
            raise RecipeError(problems, f"{self.recipe.name} under torchrun with {self.dist.size} processes")

    # -- the run ---------------------------------------------------------------------------------

    def execute(self, resume: str = "auto") -> RunResult:
        if resume not in ("auto", "never") and not Path(resume).exists():  # before the run dir is made or the data read
            raise CheckpointError(f"--resume {resume}: no such checkpoint or run directory (--resume takes auto, never or a path)")
        lock = RunDirLock(self.run_dir) if self.dist.is_main else None
        try:
            if lock is not None:
                self.run_dir.mkdir(parents=True, exist_ok=True)
                lock.acquire()  # before anything is read or written there: a second run on it exits 2
            result = self._execute(resume)
        except BaseException as exc:
            if self.dist.active:
                if is_peer_failure(exc):
                    raise self.dist.explain_peer_failure(exc) from None
                if not isinstance(exc, RunDirLocked):  # the run dir is another run's: leave nothing in it
                    self.dist.report_failure(exc)  # the other ranks' next collective fails: they read this
            raise
        finally:
            if lock is not None:
                lock.release()
        self.dist.close()
        return result

    def _execute(self, resume: str) -> RunResult:
        recipe = self.recipe
        if recipe.train.threads:
            torch.set_num_threads(recipe.train.threads)
        self.device = resolve_device(recipe.train.device, self.dist)
        if recipe.train.deterministic:
            use_deterministic_kernels()
        self.env = environment(self.device)
        self.peak_tflops = gpu_peak_tflops(self.device)
        torch.manual_seed(recipe.seed)
        self.log(f"growtrain {recipe.name}: {self.env['code']}, torch {self.env['torch']}, {self.env['device']}")
        if recipe.train.deterministic:
            self.log("deterministic kernels (train.deterministic): an op without a deterministic version fails by name")

        corpus = load_corpus(recipe.data, recipe.seed)
        self.data_fingerprint = corpus.fingerprint
        # The tokenizer travels with the run: each checkpoint holds a copy (generate and export
        # read that one, wherever they run from) and records its sha256 (a resume compares it).
        self.tokenizer = tokenizer_identity(recipe.data.tokenizer)
        source = tokenizer_file(recipe.data.tokenizer)
        self.tokenizer_text = source.read_text(encoding="utf-8") if source is not None else None
        self.log(f"data: {corpus.description} (fingerprint {self.data_fingerprint})")
        for warning in corpus.warnings:
            self.log(f"warning: {warning}")
        self.stream = TokenStream(corpus.train, recipe.seed)  # the seed orders a sharded stream's later epochs
        seed_shape = seed_model_config(recipe, corpus)
        shapes = plan_stage_models(seed_shape, [s.grow for s in recipe.stages])
        self.stage_before = [seed_shape] + shapes
        self._check_parallel(shapes)
        probe = tuple(map(self.to_device, eval_batches(corpus.eval, recipe.invariance.probe_batch_size, recipe.invariance.probe_seq_len, 1)[0]))

        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.dist.clear_failures()
        if self.dist.active:
            self.log(self.dist.describe())
        elif recipe.distributed.layout == "af":
            self.log("warning: distributed.layout: af needs several processes (torchrun); one process holds everything")
        loaded = self._find_checkpoint(resume)
        self.wandb_id = None
        if loaded is not None:
            pos = self._restore(loaded, shapes)
        else:
            pos = Position()
            with torch.device(self.device):  # initialised where it trains: no host copy first
                self.model = self.dist.shard(GrowLM(seed_shape))
            if recipe.model.init_from:
                self._import_seed(recipe.model.init_from)
            self.optimizer = build_optimizer(self.dist.owned(dict(self.model.named_parameters())), recipe.optimizer)
            if self.dist.is_main:
                self.metrics.truncate_after(-1)
        # Runtime state, not shape: set on the model as built or restored, and again after each growth.
        backend = self.model.set_expert_backend(recipe.train.expert_backend)
        self.log(f"expert backend: {backend} (train.expert_backend: {recipe.train.expert_backend})")
        if recipe.model.block == "residual":
            self.log("model: residual blocks, " + (
                "each checkpointed (model.reversible: residual blocks are not invertible; each block's input is kept and the "
                "block recomputed in backward with the forward's routing)" if recipe.model.reversible else "plain autograd (model.reversible: false)"))
        if backend == "triton":
            self.log(f"  {triton_route(self.device, torch.bfloat16 if recipe.train.precision == 'bf16' else torch.float32)}")
        if self.dist.is_main:
            (self.run_dir / "recipe.yaml").write_text(dump_yaml(recipe))
            if self.tokenizer_text is not None:
                (self.run_dir / CHECKPOINT_TOKENIZER).write_text(self.tokenizer_text, encoding="utf-8")
        self.log(f"resolved recipe: {self.run_dir / 'recipe.yaml'}")

        self.wandb_id = self.tracker.start(self.plain, self.wandb_id, {"environment": self.env})
        if loaded is not None and self.tracker.mode == "offline":
            # A killed offline run loses what W&B had not flushed, and its resume is a new local run:
            # replay the durable history so the new one holds every step (`wandb sync` that one).
            for row in self.metrics.read():
                self.tracker.log_metrics({k: v for k, v in row.items() if k not in ("step", "stage")}, row["step"])
        total = sum(s.steps for s in recipe.stages)
        self.console = Console(total, pos.global_step, recipe.tracking.progress_bar, quiet=not self.dist.is_main)
        self.progress = Progress(stage_step_costs(shapes, recipe.stages), [s.steps for s in recipe.stages])
        self.step_flops = stage_step_costs(shapes, recipe.stages, model_flops_per_token)  # metrics.jsonl's `flops`
        exit_code = 1
        try:
            while pos.stage < len(recipe.stages):
                stage = recipe.stages[pos.stage]
                if pos.stage_step == stage.steps:  # resumed from this stage's end checkpoint
                    pos = Position(pos.stage + 1, 0, pos.global_step, pos.tokens, pos.bad_steps)
                    continue
                if not pos.grown:
                    with memtrace.phase(stage.name, "growth", self.dist.rank) if stage.grow else contextlib.nullcontext():
                        self._grow(pos, stage, ([seed_shape] + shapes)[pos.stage], shapes[pos.stage], probe)
                    pos.grown = True
                    if stage.grow and recipe.checkpoint.after_growth:
                        # A crash early in the stage resumes here, not before the growth.
                        self.save(pos, stage_end=False, grown=True)
                with memtrace.phase(stage.name, "train", self.dist.rank):  # GROWTRAIN_MEMORY_TRACE only
                    self._train_stage(pos, stage, corpus)
                pos = Position(pos.stage + 1, 0, pos.global_step, pos.tokens, pos.bad_steps)
            exit_code = 0
        finally:
            self.console.close()
            self.tracker.finish(exit_code)
        self.log(f"done: step {pos.global_step}, {pos.tokens:,} tokens, loss {self.last_loss:.4f}, eval loss {self.last_eval:.4f}")
        return RunResult(self.run_dir, pos.global_step, pos.tokens, self.last_loss, self.last_eval, self.history)

    def _grows_on_host(self, stage: StageConfig, before: ModelConfig, can: bool) -> bool:
        """train.grow_on for this stage's growth: host, device, or auto (the host when growth's
        planned peak per rank is over the GPU's budget). The same answer on every rank. `can`:
        whether the transition grows without a gather (on shards, or in one process)."""
        setting = self.recipe.train.grow_on
        budget = growth_budget_bytes(self.device) if setting == "auto" else None
        if setting == "device" or (setting == "auto" and budget is None):
            return False
        invariance = self.recipe.invariance
        # An AF layout's expert ranks hold its experts (E / F each) and, while growth runs, the dense
        # part: the planner's peak for F ranks over-counts only their share of the dense state.
        ranks = self.dist.af.expert_ranks if self.dist.af is not None else self.dist.size
        peak = growth_peak_bytes_per_rank(
            before, stage.grow, self.recipe.optimizer, self.plan_counts, ranks,
            (invariance.probe_batch_size, invariance.probe_seq_len), invariance.stream,
        )
        if setting == "auto":
            if not self.dist.any_rank(peak > budget):
                self.console.write(f"growth [{stage.name}]: on {self.device} (planned peak {_size(peak)} per rank, {_size(budget)} usable)")
                return False
            why = f"planned peak {_size(peak)} per rank is over the {_size(budget)} usable on {self.device}"
        else:
            why = f"train.grow_on: host; planned peak {_size(peak)} per rank"
        if not can:
            self.console.write(f"growth [{stage.name}]: stays on {self.device} ({why}, but it gathers the whole model, which growth on the host does not do)")
            return False
        available = host_available_bytes()
        ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        if available is not None and peak * ranks_here > available:
            self.console.write(
                f"warning: growth [{stage.name}] on the host may run out of memory: {ranks_here} process(es) here x {_size(peak)} "
                f"planned, {_size(available)} available"
            )
        self.console.write(f"growth [{stage.name}]: on the host ({why})")
        return True

    def _grow(self, pos: Position, stage: StageConfig, before: ModelConfig, planned: ModelConfig, probe) -> None:
        if not stage.grow:
            return
        if not self.recipe.invariance.dynamics:
            self.console.write("warning: invariance.dynamics is false: no one-step dynamics or trainability check of this growth")
        if not self.recipe.invariance.values:
            self.console.write("warning: invariance.values is false: no check of the grown values against their provenance")
        # Under expert parallelism: on the expert shards where every operator of the transition can
        # (stages/sharding.py; the optimizer state stays this rank's share: its experts and the
        # dense entries it owns), else on the gathered model, grown identically on every rank and
        # re-sharded. An AF layout grows on its shards as an expert-parallel group whose attention
        # ranks hold no expert (Dist.growth_ep); its expert ranks hold a copy of the dense part meanwhile.
        on_shards = self.dist.active and all(get_operator(s.op).runs_sharded(s.args) for s in stage.grow)
        af_shards = on_shards and self.dist.af is not None
        if af_shards:
            self.console.write(
                f"growth [{stage.name}]: on the AF layout's shards (the experts on the {self.dist.af.expert_ranks} expert ranks, "
                "the dense parameters copied to them while it runs)"
            )
            self.dist.af_to_growth(self.model)
        on_host = self._grows_on_host(stage, before, on_shards or not self.dist.active)
        ep = self.dist.growth_ep()
        if on_host:
            # The model and its state move to host memory, the growth's collectives to a gloo
            # group (NCCL's take CUDA tensors only); all of it comes back before the first step.
            ep = self.dist.host_ep() if self.dist.active else None
            host = torch.device("cpu")
            self.model.to(host)
            self.optimizer.to(host)
            if ep is not None:
                use_group(self.model, ep)
            self.model.set_expert_backend("auto")  # the reference, on the host
            probe = tuple(t.to(host) for t in probe)
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        if on_shards:
            model, state = self.model, self.optimizer.state
            if af_shards:  # an attention rank holds empty slices of the expert entries meanwhile
                state = self.dist.af_growth_state(dict(state), torch.device("cpu") if on_host else self.device)
        else:
            if self.dist.active:
                unsharded = [s.op for s in stage.grow if not get_operator(s.op).runs_sharded(s.args)]
                self.console.write(f"growth [{stage.name}]: gathering the whole model on every rank ({', '.join(unsharded)} cannot grow expert shards yet)")
            model, state = self.dist.gather_full(self.model, self.optimizer.state)
        try:
            with sharding.sharded(ep if on_shards else None), collective_guard.only_in(ep.group) if on_host and ep is not None else contextlib.nullcontext():
                outcome = apply_growth(
                    model,
                    state,
                    stage.grow,
                    seed=self.recipe.seed,
                    stage_index=pos.stage,
                    stage_name=stage.name,
                    planned=planned,
                    probe=probe,
                    invariance_cfg=self.recipe.invariance,
                    optimizer_cfg=self.recipe.optimizer,
                    lr=self.recipe.lr(pos.stage, 0),
                    log=self.console.write,
                    fresh=stage.fresh,
                )
        except GrowthCheckFailed as exc:
            # Nothing of the failed growth is checkpointed; its report is kept for the post-mortem.
            report = self.run_dir / "growth-failure.json"
            if self.dist.is_main:
                report.write_text(json.dumps(exc.record, indent=2, default=str) + "\n")
            self.console.write(f"growth check failed; full report in {report}")
            raise
        self.model = outcome.model if on_shards else self.dist.shard(outcome.model)
        if on_host:
            self.model.to(self.device)
        if af_shards:
            self.dist.af_from_growth(self.model)
        elif on_host and ep is not None:
            use_group(self.model, self.dist.ep)
        named = dict(self.model.named_parameters())
        self.optimizer.rebind(self.dist.owned(named), self.dist.shard_state(outcome.optimizer_state, named, experts_sharded=on_shards))
        if on_host:
            self.optimizer.to(self.device)
        self.model.set_expert_backend(self.recipe.train.expert_backend)
        self.history.extend(outcome.records)
        for r in outcome.records:
            m = r["metrics"]
            self.console.write(
                f"growth [{stage.name}] {r['operator']} ({'exact' if r['exact'] else 'approximate'}): "
                f"params {r['params_before']:,} -> {r['params_after']:,}, max|Δlogit| {m['max_abs_dlogits']:.2e}, "
                f"rel L2 {m['rel_l2']:.2e}, cosine {m['cosine']:.6f}, Δloss {m['loss_after'] - m['loss_before']:+.2e}"
                + (f", router KL ≤ {m['max_router_kl']:.1e}" if "max_router_kl" in m else "")
                + (f", one-step Δ rel {m['dynamics']['rel_l2']:.1e} ({m['dynamics']['seconds'] + m.get('trainability', {}).get('seconds', 0.0):.2f}s)" if "dynamics" in m else "")
                + (f", values checked ({m['values']['elements']:,} copied elements, {m['values']['seconds']:.2f}s)" if "values" in m else "")
                + " — passed"
            )
        if not stage.fresh.is_default:
            self.console.write(f"growth [{stage.name}]: {stage.fresh.describe()}")
        self.tracker.log_transition(stage.name, outcome.records, pos.global_step)
        router_kl = {
            f"growth/{stage.name}/{r['index']}_{r['operator']}/router_kl/block{b}": v
            for r in outcome.records
            for b, v in r["metrics"].get("router_kl", {}).items()
        }
        if router_kl:
            self.tracker.log_metrics(router_kl, pos.global_step)
        maybe_fault("after_transition")

    def _sibling_divergence(self, pos: Position, stage: StageConfig, top_k) -> dict[str, float]:
        """How far the stage's sibling experts have moved apart (growtrain/divergence.py): kept for
        the checkpoint (inspect), written to the console, returned as metrics."""
        numbers = sibling_divergence(self.model, sibling_parents(self.stage_before, pos.stage), top_k)
        if not numbers:
            return {}
        self.divergence[stage.name] = {str(i): n for i, n in numbers.items()}
        for i, n in numbers.items():
            self.console.write(f"siblings [{stage.name}]: {format_sibling_line(i, n)}")
            if n["tied_pairs"]:
                self.console.write(
                    f"warning: siblings [{stage.name}]: MoE layer {i} ends the stage with {n['tied_pairs']} of {n['pairs']} sibling "
                    "pairs still tied (same router row and bias: they act as one expert); train longer after the growth (a split's "
                    "children separate as their router rows train), or clone with router_noise"
                )
        return flat_metrics(numbers)

    def _evaluate(self, evals, precision: str) -> float:
        """This rank's eval loss; an AF expert rank serves the attention ranks' calls (and counts 0),
        which under af_schedule: interleaved make two batches at a time."""
        if self.dist.is_expert_side:
            serve_calls(self.model.moe_layers, self.dist.af_lanes, self.device)
            return 0.0
        loss = evaluate(self.model, evals, precision, self.device if self.dist.interleaved else None)
        if self.dist.af is not None:
            end_calls(self.dist.af_lanes[0], self.device)
        return loss

    def _micro_batches(self, stage: StageConfig, rows, precision: str):
        """The step's micro-batches, each's (cross-entropy, aux loss, MoE stats) once its backward
        has run. AF interleaved: two at a time, in flight together (model/af_interleaved.py)."""
        if not self.dist.interleaved:
            for _ in range(stage.grad_accum):
                inputs, targets = self.stream.next_batch(stage.batch_size, stage.seq_len, rows)
                ce, aux, stats = forward_loss(self.model, self.to_device(inputs), self.to_device(targets), precision)
                ((ce + aux) / stage.grad_accum).backward()
                yield ce, aux, stats
            return
        for first in range(0, stage.grad_accum, 2):
            batches = [self.stream.next_batch(stage.batch_size, stage.seq_len, rows) for _ in range(min(2, stage.grad_accum - first))]
            yield from interleaved_passes(self.model, [(self.to_device(x), self.to_device(y)) for x, y in batches], precision, stage.grad_accum, self.device)

    def _train_stage(self, pos: Position, stage: StageConfig, corpus: Corpus) -> None:
        recipe = self.recipe
        precision = recipe.train.precision
        rows = self.dist.row_range(stage.batch_size)  # this rank reads only its rows of each batch
        expert_side = self.dist.is_expert_side  # AF expert rank: reads no data, serves the MoE calls
        evals = [] if expert_side else [
            (self.to_device(x), self.to_device(y)) for x, y in eval_batches(corpus.eval, stage.batch_size, stage.seq_len, recipe.train.eval_batches, rows)
        ]
        tokens_per_step = stage.batch_size * stage.seq_len * stage.grad_accum
        self.console.write(
            f"stage {pos.stage + 1}/{len(recipe.stages)} '{stage.name}': {self.num_parameters():,} params, "
            f"{stage.steps} steps of {tokens_per_step:,} tokens (seq {stage.seq_len} x batch {stage.batch_size} x accum {stage.grad_accum})"
        )
        if self.device.type == "cuda":  # the stage's peak is its training's, not its growth's
            torch.cuda.reset_peak_memory_stats(self.device)
        t_last = time.perf_counter()
        self.progress.start_stage()
        while pos.stage_step < stage.steps:
            lr = recipe.lr(pos.stage, pos.stage_step)
            # The step's numbers stay on the device (float64, summed as Python floats would be)
            # and are read once, together, below: one host sync per step whatever the depth, the
            # MoE layers or the micro-batches (DESIGN.md §15).
            ce_acc = aux_acc = None
            loads = None
            top_k = None
            af_clock.reset()
            t_passes = time.perf_counter()
            if expert_side:  # every micro-batch's MoE calls, forward and backward, until the attention ranks end the step
                serve_calls(self.model.moe_layers, self.dist.af_lanes, self.device)
                ce_acc = aux_acc = torch.zeros((), dtype=torch.float64, device=self.device)
            for ce, aux, stats in [] if expert_side else self._micro_batches(stage, rows, precision):
                ce_part, aux_part = ce.detach().double() / stage.grad_accum, aux.detach().double() / stage.grad_accum
                ce_acc = ce_part if ce_acc is None else ce_acc + ce_part
                aux_acc = aux_part if aux_acc is None else aux_acc + aux_part
                loads = [s.load for s in stats] if loads is None else [a + s.load for a, s in zip(loads, stats)]
                top_k = [s.top_k_indices for s in stats]
            if self.dist.af is not None and not expert_side:
                end_calls(self.dist.af_lanes[0], self.device)
            loads = self.dist.global_loads(loads)
            passes_s = time.perf_counter() - t_passes  # the step's forward and backward passes, on this rank
            self.dist.sync_grads(self.model)
            if self.dist.af is None:
                ce_acc, aux_acc = self.dist.mean_tensor(torch.stack([ce_acc, aux_acc])).unbind(0)
                waits = []
            else:  # and each side's share of the passes spent waiting on the other (af.AFClock)
                ce_acc, aux_acc, *waits = self.dist.af_means(ce_acc, aux_acc, af_clock.wait_s / max(passes_s, 1e-9), passes_s - af_clock.wait_s)
            maybe_fault("step_mid")
            # Measured in the seed model's parametrization (per-element weights set by growth), so
            # clipping scales a grown model's step as it would have scaled the ungrown one's.
            norm_t = self.optimizer.clip_grad_norm_(recipe.optimizer.grad_clip, self.dist.sum_squares if self.dist.active else None)
            load_ratios = [(load.max() / load.mean().clamp_min(1e-9)).double() for load in loads or []]
            pending = self._bad_update if self._bad_update is not None else torch.zeros((), dtype=torch.float64, device=ce_acc.device)
            numbers = torch.stack([ce_acc, aux_acc, norm_t.double().to(ce_acc.device), pending.to(ce_acc.device), *waits, *load_ratios]).tolist()
            ce_sum, aux_sum, grad_norm, bad_update, *rest = numbers
            waits, load_ratios = rest[: len(waits)], rest[len(waits) :]
            if bad_update > 0:
                self._raise_bad_update(pos.global_step, stage)
            finite = math.isfinite(ce_sum) and math.isfinite(aux_sum) and math.isfinite(grad_norm)
            ramp = stage.fresh.ramp(pos.stage_step)  # the LR factor of the growth's fresh elements (validate: only where it grows)
            if finite:
                with self.optimizer.ramped(pos.stage_step, ramp) if ramp is not None else contextlib.nullcontext():
                    self.optimizer.step(lr)
                self.dist.broadcast_dense(self.model)
                # Read with the next step's numbers (or by the save below): no extra sync here.
                self._bad_update = self._nonfinite_count()
                if loads:
                    self.model.update_balance_biases(loads)
                pos.bad_steps = 0
            else:
                pos.bad_steps += 1
                self.console.write(
                    f"step {pos.global_step + 1}: non-finite loss {ce_sum} / grad norm {grad_norm}; step skipped "
                    f"({pos.bad_steps} in a row, stopping after {recipe.optimizer.max_bad_steps})"
                )
                if pos.bad_steps > recipe.optimizer.max_bad_steps:
                    raise TrainingDiverged(
                        f"{pos.bad_steps} consecutive non-finite steps at step {pos.global_step + 1} (stage '{stage.name}'); "
                        "no checkpoint of this state was written: resume restarts from the last good one. "
                        "Lower the LR, raise warmup, or use fp32."
                    )
            self.model.zero_grad(set_to_none=True)  # also the dense gradients this rank does not step
            pos.stage_step += 1
            pos.global_step += 1
            pos.tokens += tokens_per_step
            now = time.perf_counter()
            t_step = t_last
            record = {
                "step": pos.global_step,
                "stage": stage.name,
                "loss": ce_sum,
                "aux_loss": aux_sum,
                "lr": lr,
                "grad_norm": grad_norm,
                "tokens": pos.tokens,
                "flops": counted_flops(self.step_flops, self.progress.stage_steps, pos.stage, pos.stage_step),
                "tokens_per_s": tokens_per_step / max(now - t_last, 1e-9),
                "skipped": not finite,
            }
            if ramp is not None:
                record["fresh_lr_factor"] = ramp
            if waits:  # AF layout: what the planner's pipeline model predicts (README: AF mode)
                record["af/attention_wait_fraction"], record["af/expert_idle_fraction"], attention_busy, expert_busy = waits
                record["af/passes_s"] = passes_s
                # each side's compute per micro-batch (its ranks' mean; the passes less the waits)
                record["af/attention_s_per_microbatch"] = attention_busy / stage.grad_accum
                record["af/expert_s_per_microbatch"] = expert_busy / stage.grad_accum
                record["af/microbatches"] = stage.grad_accum
            t_last = now
            self.progress.step_done(pos.stage)
            if finite:
                self.last_loss = ce_sum
            stage_end = pos.stage_step == stage.steps
            if stage_end or (recipe.train.eval_every and pos.global_step % recipe.train.eval_every == 0):
                (self.last_eval,) = self.dist.mean(self._evaluate(evals, precision))
                record["eval_loss"] = self.last_eval
            if stage_end and not expert_side:
                record.update(self._sibling_divergence(pos, stage, top_k))
            # A slow stage still talks every HEARTBEAT_S seconds (progress.py), whatever log_every says.
            line_due = pos.global_step % recipe.train.log_every == 0 or stage_end or self.progress.line_due()
            if line_due and self.device.type == "cuda":  # in metrics.jsonl too: the GPU checks read them there
                record["memory/cuda_peak_gb"] = torch.cuda.max_memory_allocated(self.device) / 1e9
                record["memory/cuda_reserved_gb"] = torch.cuda.memory_reserved(self.device) / 1e9
                torch.cuda.reset_peak_memory_stats(self.device)  # the next line's peak is since this one
            if self.dist.is_main:
                self.metrics.append(record)
            wandb_metrics = {k: v for k, v in record.items() if k not in ("step", "stage")}
            wandb_metrics["stage_index"] = pos.stage
            for i, ratio in enumerate(load_ratios):
                wandb_metrics[f"moe/layer{i}/load_max_over_mean"] = ratio
            if line_due:
                rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
                wandb_metrics["memory/peak_rss_mb"] = rss_mb
                # Counted FLOPs (the planner's, reversible recompute included) per second of this step.
                tflops = self.progress.step_costs[pos.stage] / max(now - t_step, 1e-9) / 1e12 / self.dist.size
                wandb_metrics["perf/tflops_per_device"] = tflops
                gpu = ""
                if self.device.type == "cuda":
                    peak_gb = record["memory/cuda_peak_gb"]
                    gpu = f" gpu {peak_gb:.1f}GB"
                    if self.peak_tflops:
                        wandb_metrics["perf/flops_utilisation"] = tflops / self.peak_tflops
                        gpu += f" fu {tflops / self.peak_tflops:.0%}"
                evl = f" eval {record['eval_loss']:.4f}" if "eval_loss" in record else ""
                if waits:
                    gpu += f" af wait {waits[0]:.0%} idle {waits[1]:.0%}"
                self.console.write(
                    f"[{stage.name}] step {pos.global_step}/{self.console.total} loss {ce_sum:.4f}{evl} lr {lr:.2e} "
                    f"gnorm {grad_norm:.3f} tok/s {record['tokens_per_s']:,.0f} mem {rss_mb:,.0f}MB{gpu} "
                    f"eta {format_duration(self.progress.eta_seconds(pos.stage, pos.stage_step))}"
                )
                self.progress.line_written()
            self.tracker.log_metrics(wandb_metrics, pos.global_step)
            self.console.advance(pos.global_step)
            if stage_end or self.ckpt.should_save(pos.global_step):
                self.save(pos, stage_end)


class Interrupted(KeyboardInterrupt):
    """Ctrl-C during a run; the message says what a re-run will do (the CLI prints it)."""


def interrupted_message(run_dir: Path) -> str:
    """What is on disk after an interrupt. Saves are atomic (checkpoint.py), so the newest complete
    checkpoint is whole; it is not checksummed here, a Ctrl-C must not wait on hundreds of GB."""
    found = CheckpointManager(Path(run_dir), CheckpointConfig(), log=lambda msg: None).complete_checkpoints()
    if not found:
        return f"no checkpoint was written yet under {run_dir}: running the same command starts the run over from step 0"
    return f"the newest complete checkpoint is {found[0]}: run the same command to resume from it"


def run(recipe: Recipe, run_dir: Path, resume: str = "auto", log=print) -> RunResult:
    try:
        return Run(recipe, run_dir, log).execute(resume)
    except KeyboardInterrupt as exc:
        if isinstance(exc, Interrupted):
            raise
        raise Interrupted(interrupted_message(run_dir)) from None

