"""`growtrain inspect`: where a run stands, read from a checkpoint's meta.json (no tensors loaded),
and what is wrong with the checkpoints it had to pass over or was pointed at."""

from __future__ import annotations

import re
from pathlib import Path

from growtrain.checkpoint.store import CheckpointConfig, CheckpointError, CheckpointManager, read_meta, verify_checkpoint
from growtrain.runtime.divergence import format_line as format_sibling_line


def find_checkpoint(path: Path) -> tuple[Path, list[str], list[dict]]:
    """(the checkpoint to show, its problems, the newer damaged ones skipped to reach it). A
    checkpoint named directly is shown even when damaged, with its problems, as long as its
    meta.json is intact; a run directory shows its newest intact checkpoint."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path}: no such file or directory")
    if (path / "manifest.json").is_file():
        problems = verify_checkpoint(path)
        if any(p.startswith(("meta.json", "manifest.json")) for p in problems):
            raise CheckpointError(f"{path} is damaged and its meta data cannot be trusted: " + "; ".join(problems))
        return path, problems, []
    if re.fullmatch(r"step-\d{8,}(-grown)?", path.name) and path.is_dir():
        raise CheckpointError(f"{path}: not a complete checkpoint (no manifest.json: its save was interrupted); inspect the run directory {path.parent.parent}")
    if path.name == "checkpoints":
        path = path.parent
    if not (path / "checkpoints").is_dir():
        raise CheckpointError(f"{path}: neither a checkpoint directory (with manifest.json) nor a run directory (with checkpoints/)")
    manager = CheckpointManager(path, CheckpointConfig(), log=lambda msg: None)
    skipped: list[dict] = []
    for candidate in manager.complete_checkpoints():
        problems = manager.verify(candidate)
        if not problems:
            return candidate, [], skipped
        skipped.append({"checkpoint": str(candidate), "problems": problems})
    if skipped:
        raise CheckpointError(
            f"{path}: every checkpoint under checkpoints/ is damaged:\n"
            + "\n".join(f"  {Path(s['checkpoint']).name}: {'; '.join(s['problems'])}" for s in skipped)
        )
    raise CheckpointError(f"{path}: no complete checkpoint under checkpoints/ yet")


def _stored_weights(meta: dict) -> tuple[int, dict[tuple[int, int], tuple[int, int]]]:
    """Weights the model stores, NF4 expert bases included (a buffer of 4-bit codes holds two
    weights a byte; meta's params_total counts nn.Parameters only, so a quantize step read as a 9x
    shrink), for the checkpoint's model and before/after each growth record, keyed by (stage
    index, record index). Records are left out where the checkpoint's recipe no longer plans
    (written by another growtrain version)."""
    from growtrain.model.config import ModelConfig
    from growtrain.planning import count_model
    from growtrain.recipe import RecipeError, recipe_from_dict, without_moved_keys
    from growtrain.stages import GrowthPlanError, get_operator

    counts: dict = {}

    def weights(cfg) -> int:
        if cfg not in counts:
            counts[cfg] = count_model(cfg).params_total
        return counts[cfg]

    current = ModelConfig.from_dict(meta["model_config"])
    per_record: dict[tuple[int, int], tuple[int, int]] = {}
    try:
        recipe = recipe_from_dict(without_moved_keys(meta["recipe"]))
        cfg = recipe.model.with_changes(vocab_size=current.vocab_size)
        for i, stage in enumerate(recipe.stages[: meta["stage"] + 1]):
            start = cfg
            for j, step in enumerate(stage.grow):
                after = get_operator(step.op).plan(cfg, step.args)
                per_record[(i, j)] = (weights(cfg), weights(after))
                cfg = after
            per_record[(i, len(stage.grow))] = (weights(start), weights(cfg))  # the whole transition
    except (RecipeError, GrowthPlanError, KeyError, TypeError, ValueError):
        per_record = {}
    return weights(current), per_record


def inspect_report(path: Path) -> dict:
    ckpt, problems, skipped = find_checkpoint(path)
    return checkpoint_report(ckpt, problems, skipped)


def checkpoint_report(ckpt: Path, problems: list[str] | None = None, skipped: list[dict] | None = None) -> dict:
    """The report of checkpoint dir `ckpt` (found and verified by find_checkpoint) from its meta.json."""
    problems, skipped = problems or [], skipped or []
    meta = read_meta(ckpt)
    cfg = meta["model_config"]
    weights_total, record_weights = _stored_weights(meta)
    transitions = [
        {
            "stage": r["stage"],
            "operator": r["operator"],
            "args": r["args"],
            "exact": r["exact"],
            "passed": r["passed"],
            **r["metrics"],
            "params_before": r["params_before"],
            "params_after": r["params_after"],
            # Stored weights, NF4 bases included (None: the recipe no longer plans).
            "weights_before": record_weights.get((r.get("stage_index"), r.get("index")), (None, None))[0],
            "weights_after": record_weights.get((r.get("stage_index"), r.get("index")), (None, None))[1],
            "planned_params": r["planned_params"],
            "problems": r["problems"],
        }
        for r in meta["growth_history"]
    ]
    return {
        "checkpoint": str(ckpt),
        "problems": problems,  # of this checkpoint; non-empty only when it was named directly
        "skipped": skipped,  # newer checkpoints of the run that are damaged
        "stage": meta["stage"],
        "stage_name": meta["stage_name"],
        "stage_step": meta["stage_step"],
        "step": meta["step"],
        "tokens": meta["tokens"],
        "params_total": meta["params_total"],
        "weights_total": weights_total,  # params_total + the NF4 expert bases' weights
        "loss": meta.get("loss"),
        "eval_loss": meta.get("eval_loss"),
        "model": {
            "n_layers": cfg["n_layers"],
            "d_model": cfg["d_model"],
            "moe_layers": cfg["moe_layers"],
            "num_experts": (cfg.get("moe") or {}).get("num_experts", 0),
            "top_k": (cfg.get("moe") or {}).get("top_k", 0),
        },
        "stages": [{"name": s["name"], "steps": s["steps"]} for s in meta["recipe"]["stages"]],
        "wandb_id": meta.get("wandb_id"),
        "data_position": meta.get("data_position"),  # None in checkpoints from before it was recorded
        "expert_parallel": (meta.get("expert_parallel") or {}).get("size", 1),  # ranks that saved its experts
        "layout": _layout(meta.get("expert_parallel")),
        "transitions": transitions,
        # stage name -> {MoE layer index: sibling numbers at the stage's end} (growtrain/runtime/divergence.py)
        "sibling_divergence": meta.get("sibling_divergence", {}),
    }


def _layout(saved: dict | None) -> dict:
    """How the processes that saved a checkpoint were laid out."""
    if not saved:
        return {"name": "single", "processes": 1}
    if saved.get("layout") == "af":
        A, F = saved["attention_ranks"], saved["size"]
        return {"name": "af", "processes": A + F, "attention_ranks": A, "expert_ranks": F}
    return {"name": "colocated", "processes": saved["size"]}


def _saved_by(r: dict) -> str:
    lay = r["layout"]
    anywhere = "loads in either layout at any size that divides the experts"
    if lay["name"] == "af":
        return (f"{lay['processes']} processes in an AF layout ({lay['attention_ranks']} attention + {lay['expert_ranks']} expert ranks; "
                f"experts in per-rank shard files; {anywhere})")
    if lay["name"] == "colocated":
        return f"{lay['processes']} processes (experts in per-rank shard files; {anywhere})"
    return "1 process"


def format_report(r: dict) -> str:
    m = r["model"]
    moe = f", {m['num_experts']} experts top-{m['top_k']} in blocks {m['moe_layers']}" if m["moe_layers"] else ", dense"
    nf4 = r["weights_total"] - r["params_total"]
    held = f"{r['weights_total']:,} weights ({nf4:,} in NF4 expert bases + {r['params_total']:,} parameters; " if nf4 else f"{r['params_total']:,} ("
    lines = [
        *(f"damaged     {Path(s['checkpoint']).name}, skipped: {'; '.join(s['problems'])}" for s in r["skipped"]),
        f"checkpoint  {r['checkpoint']}" + (" (the newest intact one)" if r["skipped"] else ""),
        *([f"DAMAGED     {'; '.join(r['problems'])} (a resume skips this checkpoint; its meta data below is intact)"] if r["problems"] else []),
        f"stage       {r['stage'] + 1}/{len(r['stages'])} '{r['stage_name']}' (step {r['stage_step']} of {r['stages'][r['stage']]['steps']})",
        f"step        {r['step']:,}",
        f"tokens      {r['tokens']:,}",
        f"parameters  {held}{m['n_layers']} blocks, d_model {m['d_model']}{moe})",
        f"loss        {r['loss']:.4f} (eval {r['eval_loss']:.4f})",
        f"wandb id    {r['wandb_id'] or '-'}",
        *([f"data        epoch {d['epoch']}, {d['shard']} at token {d['offset']:,} (stream position {d['cursor']:,})"] if (d := r["data_position"]) else []),
        f"saved by    {_saved_by(r)}",
        "",
        "growth history:" if r["transitions"] else "growth history: none yet",
    ]
    if r["transitions"]:
        lines.append(f"  {'stage':<12} {'operator':<14} {'exact':<6} {'passed':<7} {'max|Δlogit|':>12} {'rel L2':>10} {'cosine':>10} {'Δloss':>10} {'weights (NF4 bases included)':>28}")
        for t in r["transitions"]:
            before = t["weights_before"] if t["weights_before"] is not None else t["params_before"]
            after = t["weights_after"] if t["weights_after"] is not None else t["params_after"]
            lines.append(
                f"  {t['stage']:<12} {t['operator']:<14} {str(t['exact']):<6} {str(t['passed']):<7} {t['max_abs_dlogits']:>12.2e} "
                f"{t['rel_l2']:>10.2e} {t['cosine']:>10.6f} {t['loss_after'] - t['loss_before']:>+10.2e} "
                f"{before:>13,} -> {after:<13,}"
            )
    if r["sibling_divergence"]:
        lines += ["", "sibling experts at each stage's end (growtrain/runtime/divergence.py):"]
        for stage, layers in r["sibling_divergence"].items():
            lines += [f"  {stage:<12} {format_sibling_line(int(i), n)}" for i, n in layers.items()]
    return "\n".join(lines)
