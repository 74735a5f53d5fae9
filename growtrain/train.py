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
import math
import os
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from growtrain.checkpoint.resume import interrupted_message, owning, refuse_other_run
from growtrain.checkpoint.run_lock import RunDirLock, RunDirLocked
from growtrain.checkpoint.store import CheckpointError, CheckpointManager, LoadedCheckpoint
from growtrain.checkpoint.writer import write_checkpoint
from growtrain.data.corpus import Corpus, TokenStream, eval_batches, load_corpus
from growtrain.data.tokenizer import CHECKPOINT_TOKENIZER, tokenizer_file, tokenizer_identity
from growtrain.model import GrowLM
from growtrain.model.af import clock as af_clock, end_calls, serve_calls
from growtrain.model.config import ModelConfig
from growtrain.optim.adamw import to_device
from growtrain.optim.registry import build_optimizer
from growtrain.parallel.distributed import Dist, is_peer_failure, resolve_attention_ranks, world_size_problems
from growtrain.model.expert_shards import is_expert_tensor
from growtrain.planning import model_flops_per_token
from growtrain.recipe import Recipe, RecipeError, StageConfig, dump_yaml, to_plain
from growtrain.runtime import memtrace
from growtrain.runtime.device import environment, gpu_peak_tflops, model_lines, resolve_device, use_deterministic_kernels
from growtrain.runtime.divergence import flat_metrics, report_lines, sibling_divergence, sibling_parents
from growtrain.runtime.faults import maybe_fault
from growtrain.runtime.health import TrainingDiverged, bad_update, nonfinite_count
from growtrain.runtime.progress import Progress, counted_flops, stage_step_costs
from growtrain.runtime.passes import eval_loss, host_to_device, micro_batches
from growtrain.runtime.step_report import StepReport, af_fields
from growtrain.runtime.tracking import Console, MetricsFile, Tracker
from growtrain.stages import grow_stage, import_seed, plan_stage_models, record_line


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


def seed_model_config(recipe: Recipe, corpus: Corpus) -> ModelConfig:
    vocab = corpus.tokenizer.vocab_size
    if recipe.model.vocab_size and recipe.model.vocab_size < vocab:
        raise RecipeError([f"model.vocab_size {recipe.model.vocab_size} is smaller than the tokenizer's {vocab}; set it to 0 to use the tokenizer's size"])
    return recipe.model.with_changes(vocab_size=recipe.model.vocab_size or vocab)


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
        self.divergence: dict[str, dict] = {}  # stage name -> its end's sibling numbers (growtrain/runtime/divergence.py)

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
        refuse_other_run(meta, self.plain, self.tokenizer, self.recipe.data.tokenizer, loaded.path)
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
        model.load_state_dict({n: t if t.is_meta else owning(t.to(self.device)) for n, t in state.items()}, strict=True, assign=True)
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

    # -- checkpoints -----------------------------------------------------------------------------

    def save(self, pos: Position, stage_end: bool, grown: bool = False) -> None:
        if self._bad_update is not None and self._bad_update.item() > 0:  # the last update's check, read now
            raise bad_update(self.model, pos.global_step, self.recipe.stages[pos.stage].name)
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
        extra = {"recipe.yaml": dump_yaml(self.recipe)} | ({CHECKPOINT_TOKENIZER: self.tokenizer_text} if self.tokenizer_text else {})
        path = write_checkpoint(self.ckpt, self.dist, pos.global_step, model_state=model_state, trainer_state=trainer_state, meta=meta,
                                stage_end=stage_end, grown=grown, extra_files=extra)
        if path is not None:
            self.console.write(f"checkpoint {path.name}{' (stage end)' if stage_end else ' (after growth)' if grown else ''}")

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
        probe = tuple(map(lambda t: host_to_device(self.device, t), eval_batches(corpus.eval, recipe.invariance.probe_batch_size, recipe.invariance.probe_seq_len, 1)[0]))

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
                import_seed(self.model, Path(recipe.model.init_from), recipe, self.dist.is_main, self.log)
            self.optimizer = build_optimizer(self.dist.owned(dict(self.model.named_parameters())), recipe.optimizer)
            if self.dist.is_main:
                self.metrics.truncate_after(-1)
        # Runtime state, not shape: set on the model as built or restored, and again after each growth.
        backend = self.model.set_expert_backend(recipe.train.expert_backend)
        for line in model_lines(recipe, backend, self.device):
            self.log(line)
        if self.dist.is_main:
            (self.run_dir / "recipe.yaml").write_text(dump_yaml(recipe))
            if self.tokenizer_text is not None:
                (self.run_dir / CHECKPOINT_TOKENIZER).write_text(self.tokenizer_text, encoding="utf-8")
        self.log(f"resolved recipe: {self.run_dir / 'recipe.yaml'}")

        self.wandb_id = self.tracker.start(self.plain, self.wandb_id, {"environment": self.env})
        if loaded is not None:
            self.tracker.replay(self.metrics)
        total = sum(s.steps for s in recipe.stages)
        self.console = Console(total, pos.global_step, recipe.tracking.progress_bar, quiet=not self.dist.is_main)
        self.progress = Progress(stage_step_costs(shapes, recipe.stages), [s.steps for s in recipe.stages])
        self.step_flops = stage_step_costs(shapes, recipe.stages, model_flops_per_token)  # metrics.jsonl's `flops`
        self.report = StepReport(self.console, self.metrics, self.tracker, self.progress, self.device, self.peak_tflops, self.dist.size,
                                 self.dist.is_main, recipe.train.log_every)
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

    def _grow(self, pos: Position, stage: StageConfig, before: ModelConfig, planned: ModelConfig, probe) -> None:
        if not stage.grow:
            return
        self.model, outcome = grow_stage(self.model, self.optimizer, self.dist, self.recipe, pos.stage, before, planned, probe,
                                         self.device, self.plan_counts, self.run_dir, self.console.write)
        self.history.extend(outcome.records)
        for r in outcome.records:
            self.console.write(record_line(stage.name, r))
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
        """How far the stage's sibling experts have moved apart (growtrain/runtime/divergence.py): kept for
        the checkpoint (inspect), written to the console, returned as metrics."""
        numbers = sibling_divergence(self.model, sibling_parents(self.stage_before, pos.stage), top_k)
        if not numbers:
            return {}
        self.divergence[stage.name] = {str(i): n for i, n in numbers.items()}
        for line in report_lines(stage.name, numbers):
            self.console.write(line)
        return flat_metrics(numbers)

    def _train_stage(self, pos: Position, stage: StageConfig, corpus: Corpus) -> None:
        recipe = self.recipe
        precision = recipe.train.precision
        rows = self.dist.row_range(stage.batch_size)  # this rank reads only its rows of each batch
        expert_side = self.dist.is_expert_side  # AF expert rank: reads no data, serves the MoE calls
        evals = [] if expert_side else [
            (host_to_device(self.device, x), host_to_device(self.device, y)) for x, y in eval_batches(corpus.eval, stage.batch_size, stage.seq_len, recipe.train.eval_batches, rows)
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
            for ce, aux, stats in [] if expert_side else micro_batches(self.model, self.stream, stage, rows, precision, self.dist, self.device):
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
            ce_sum, aux_sum, grad_norm, pending_bad, *rest = numbers
            waits, load_ratios = rest[: len(waits)], rest[len(waits) :]
            if pending_bad > 0:
                raise bad_update(self.model, pos.global_step, stage.name)
            finite = math.isfinite(ce_sum) and math.isfinite(aux_sum) and math.isfinite(grad_norm)
            ramp = stage.fresh.ramp(pos.stage_step)  # the LR factor of the growth's fresh elements (validate: only where it grows)
            if finite:
                with self.optimizer.ramped(pos.stage_step, ramp) if ramp is not None else contextlib.nullcontext():
                    self.optimizer.step(lr)
                self.dist.broadcast_dense(self.model)
                # Read with the next step's numbers (or by the save below): no extra sync here.
                self._bad_update = nonfinite_count(self.model, self.dist, self.device)
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
            if waits:
                record.update(af_fields(waits, passes_s, stage.grad_accum))
            t_last = now
            self.progress.step_done(pos.stage)
            if finite:
                self.last_loss = ce_sum
            stage_end = pos.stage_step == stage.steps
            if stage_end or (recipe.train.eval_every and pos.global_step % recipe.train.eval_every == 0):
                (self.last_eval,) = self.dist.mean(eval_loss(self.model, self.dist, evals, precision, self.device))
                record["eval_loss"] = self.last_eval
            if stage_end and not expert_side:
                record.update(self._sibling_divergence(pos, stage, top_k))
            self.report(record, pos.stage, pos.stage_step, stage_end, now - t_step, load_ratios)
            if stage_end or self.ckpt.should_save(pos.global_step):
                self.save(pos, stage_end)


class Interrupted(KeyboardInterrupt):
    """Ctrl-C during a run; the message says what a re-run will do (the CLI prints it)."""


def run(recipe: Recipe, run_dir: Path, resume: str = "auto", log=print) -> RunResult:
    try:
        return Run(recipe, run_dir, log).execute(resume)
    except KeyboardInterrupt as exc:
        if isinstance(exc, Interrupted):
            raise
        raise Interrupted(interrupted_message(run_dir)) from None

