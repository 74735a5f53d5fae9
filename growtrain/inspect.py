"""`growtrain inspect`: where a run stands, read from a checkpoint's meta.json (no tensors loaded)."""

from __future__ import annotations

from pathlib import Path

from growtrain.checkpoint import CheckpointConfig, CheckpointError, CheckpointManager, read_meta


def _checkpoint_dir(path: Path) -> Path:
    path = Path(path)
    if (path / "manifest.json").is_file():
        return path
    if path.name == "checkpoints":
        path = path.parent
    if not (path / "checkpoints").is_dir():
        raise CheckpointError(f"{path}: neither a checkpoint directory (with manifest.json) nor a run directory (with checkpoints/)")
    manager = CheckpointManager(path, CheckpointConfig(), log=lambda msg: None)
    for candidate in manager.complete_checkpoints():
        if not manager.verify(candidate):
            return candidate
    raise CheckpointError(f"{path}: no intact checkpoint under checkpoints/")


def inspect_report(path: Path) -> dict:
    ckpt = _checkpoint_dir(path)
    meta = read_meta(ckpt)
    cfg = meta["model_config"]
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
            "planned_params": r["planned_params"],
            "problems": r["problems"],
        }
        for r in meta["growth_history"]
    ]
    return {
        "checkpoint": str(ckpt),
        "stage": meta["stage"],
        "stage_name": meta["stage_name"],
        "stage_step": meta["stage_step"],
        "step": meta["step"],
        "tokens": meta["tokens"],
        "params_total": meta["params_total"],
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
        "expert_parallel": (meta.get("expert_parallel") or {}).get("size", 1),  # processes that saved it
        "transitions": transitions,
    }


def format_report(r: dict) -> str:
    m = r["model"]
    moe = f", {m['num_experts']} experts top-{m['top_k']} in blocks {m['moe_layers']}" if m["moe_layers"] else ", dense"
    lines = [
        f"checkpoint  {r['checkpoint']}",
        f"stage       {r['stage'] + 1}/{len(r['stages'])} '{r['stage_name']}' (step {r['stage_step']} of {r['stages'][r['stage']]['steps']})",
        f"step        {r['step']:,}",
        f"tokens      {r['tokens']:,}",
        f"parameters  {r['params_total']:,} ({m['n_layers']} blocks, d_model {m['d_model']}{moe})",
        f"loss        {r['loss']:.4f} (eval {r['eval_loss']:.4f})",
        f"wandb id    {r['wandb_id'] or '-'}",
        f"saved by    {r['expert_parallel']} process(es)" + (" (experts in per-rank shard files; loads at any EP size that divides them)" if r["expert_parallel"] > 1 else ""),
        "",
        "growth history:" if r["transitions"] else "growth history: none yet",
    ]
    if r["transitions"]:
        lines.append(f"  {'stage':<12} {'operator':<14} {'exact':<6} {'passed':<7} {'max|Δlogit|':>12} {'rel L2':>10} {'cosine':>10} {'Δloss':>10} {'params':>24}")
        for t in r["transitions"]:
            lines.append(
                f"  {t['stage']:<12} {t['operator']:<14} {str(t['exact']):<6} {str(t['passed']):<7} {t['max_abs_dlogits']:>12.2e} "
                f"{t['rel_l2']:>10.2e} {t['cosine']:>10.6f} {t['loss_after'] - t['loss_before']:>+10.2e} "
                f"{t['params_before']:>11,} -> {t['params_after']:<11,}"
            )
    return "\n".join(lines)
