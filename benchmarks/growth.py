"""Grown vs from scratch at equal training FLOPs: a recipe's model grown through its stages, against
its final-stage shape trained from scratch on the same data, optimizer and seed for the same
number of (counted) training FLOPs; both final held-out losses. A final shape with NF4 experts
(quantize_experts) or peft adapters is trained from scratch in full precision: frozen random 4-bit
bases would measure nothing.

    python benchmarks/growth.py                        # recipes/tiny.yaml, a table
    python benchmarks/growth.py --json                 # {"grown_loss": a, "scratch_loss": b, "flops": f}
    python benchmarks/growth.py --scale 0.2 --threads 1   # every stage's steps x0.2, one CPU thread

FLOPs are counted, not timed: 3 x the forward matmul FLOPs per token (backward = 2 x forward),
summed over every step of every stage at that stage's shape. Per token and layer: attention
projections 2·D·(2·H + 2·K)·hd, scores and values 2·2·H·hd per attended position ((T+1)/2 on
average, causal), a dense SwiGLU 6·D·F, an MoE layer 2·D·E (router) + top_k·6·D·F_expert (+ the
shared expert); the LM head 2·D·V. Embedding lookups, norms, softmaxes and the optimizer are not
counted (the same for both runs up to a few percent), nor the reversible backward's recomputation
(both runs use the recipe's setting). The scratch run's steps are the counted budget divided by
its per-step FLOPs at the last stage's batch and sequence length, so it sees fewer tokens than the
grown run when its model costs more per token; its LR schedule is one cosine with the recipe's
base LR and the first stage's warmup. Both losses are the trainer's held-out evaluation at the end
(the last stage's batch and sequence length, `train.eval_batches` batches).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from growtrain.checkpoint import CheckpointConfig, CheckpointManager, read_meta
from growtrain.model.config import ModelConfig
from growtrain.recipe import Recipe, StageConfig, load_recipe
from growtrain.stages import plan_stage_models

REPO = Path(__file__).resolve().parents[1]


def forward_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    D, hd, H, K = cfg.d_model, cfg.head_size, cfg.n_heads, cfg.kv_heads
    attended = (seq_len + 1) / 2
    attention = 2 * D * (2 * H + 2 * K) * hd + 2 * 2 * H * hd * attended
    total = 2 * D * cfg.vocab_size
    for i in range(cfg.n_layers):
        total += attention
        if cfg.is_moe_layer(i):
            m = cfg.moe
            total += 2 * D * m.num_experts + m.top_k * 6 * D * m.expert_hidden + 6 * D * m.shared_expert_hidden
        else:
            total += 6 * D * cfg.ffn_hidden
    return total


def step_flops(cfg: ModelConfig, stage: StageConfig) -> float:
    tokens = stage.batch_size * stage.seq_len * stage.grad_accum
    return 3 * forward_flops_per_token(cfg, stage.seq_len) * tokens


def scaled(recipe: Recipe, scale: float) -> Recipe:
    if scale == 1.0:
        return recipe
    stages = []
    for s in recipe.stages:
        steps = max(2, round(s.steps * scale))
        warmup = min(steps - 1, round(s.schedule.warmup_steps * scale))
        stages.append(replace(s, steps=steps, schedule=replace(s.schedule, warmup_steps=warmup)))
    return replace(recipe, stages=tuple(stages))


def quiet_recipe(recipe: Recipe, threads: int) -> Recipe:
    tracking = replace(recipe.tracking, wandb=replace(recipe.tracking.wandb, mode="disabled"), progress_bar=False)
    train = replace(recipe.train, threads=threads or recipe.train.threads)
    return replace(recipe, tracking=tracking, train=train, checkpoint=CheckpointConfig(every_steps=0, keep_last=1))


def final_model_config(run_dir: Path) -> ModelConfig:
    manager = CheckpointManager(run_dir, CheckpointConfig(), log=lambda msg: None)
    newest = manager.complete_checkpoints()[0]  # newest first
    return ModelConfig.from_dict(read_meta(newest)["model_config"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default=str(REPO / "recipes" / "tiny.yaml"))
    parser.add_argument("--scale", type=float, default=1.0, help="multiply every stage's steps (quick runs)")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads for both runs; 0 keeps the recipe's")
    parser.add_argument("--out", default="", help="keep both run directories here (default: a temporary directory)")
    parser.add_argument("--json", action="store_true", help="print only the JSON result on stdout")
    args = parser.parse_args(argv)

    from growtrain.train import run  # imported late: `--help` stays instant

    recipe = quiet_recipe(scaled(load_recipe(args.recipe), args.scale), args.threads)
    # The trainer's console lines go to stderr, so that stdout holds only the result.
    with tempfile.TemporaryDirectory() as tmp, contextlib.redirect_stdout(sys.stderr):
        out = Path(args.out or tmp)
        t0 = time.perf_counter()
        grown = run(recipe, out / "grown", log=lambda msg: None)
        grown_s = time.perf_counter() - t0
        final = final_model_config(out / "grown")
        shapes = plan_stage_models(recipe.model.with_changes(vocab_size=final.vocab_size), [s.grow for s in recipe.stages])
        if shapes[-1] != final:
            raise RuntimeError(f"the trained model's shape {final} differs from the planned {shapes[-1]}")
        flops = sum(step_flops(cfg, s) * s.steps for cfg, s in zip(shapes, recipe.stages))
        tokens = sum(s.batch_size * s.seq_len * s.grad_accum * s.steps for s in recipe.stages)

        last = recipe.stages[-1]
        per_step = step_flops(final, last)
        steps = max(2, math.floor(flops / per_step))
        first = recipe.stages[0].schedule
        scratch_stage = StageConfig(
            name="scratch",
            steps=steps,
            seq_len=last.seq_len,
            batch_size=last.batch_size,
            grad_accum=last.grad_accum,
            schedule=replace(first, peak_lr=0.0, warmup_steps=min(first.warmup_steps, steps - 1), min_lr_ratio=last.schedule.min_lr_ratio),
        )
        scratch_model = final.with_changes(dense_lora=None)
        if final.moe is not None and final.moe.expert_format != "full":
            scratch_model = scratch_model.with_changes(moe=replace(final.moe, expert_format="full"))
        scratch_recipe = replace(recipe, name=f"{recipe.name}-scratch", model=scratch_model, stages=(scratch_stage,))
        t0 = time.perf_counter()
        scratch = run(scratch_recipe, out / "scratch", log=lambda msg: None)
        scratch_s = time.perf_counter() - t0

    result = {"grown_loss": grown.final_eval_loss, "scratch_loss": scratch.final_eval_loss, "flops": flops}
    log = print
    if args.json:
        print(json.dumps(result))
        return 0
    log(f"recipe {args.recipe} (steps x{args.scale:g}); final shape: {final.n_layers} blocks, d_model {final.d_model}, "
        f"{final.moe.num_experts if final.moe else 0} experts top-{final.moe.top_k if final.moe else 0} in {len(final.moe_layers)} layer(s)")  # fmt: skip
    log(f"{'run':<8} {'steps':>6} {'tokens':>11} {'train FLOPs':>12} {'wall':>8} {'held-out loss':>14}")
    log(f"{'grown':<8} {grown.global_step:>6} {tokens:>11,} {flops:>12.3e} {grown_s:>7.0f}s {grown.final_eval_loss:>14.4f}")
    scratch_tokens = steps * last.batch_size * last.seq_len * last.grad_accum
    log(f"{'scratch':<8} {steps:>6} {scratch_tokens:>11,} {steps * per_step:>12.3e} {scratch_s:>7.0f}s {scratch.final_eval_loss:>14.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
