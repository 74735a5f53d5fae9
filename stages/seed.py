"""model.init_from: a local Hugging Face checkpoint's weights as the seed model
(growtrain/hf/seed_import.py maps them), checked like an exact growth operator: the seed's logits
against transformers' own forward of the checkpoint."""

from __future__ import annotations

from pathlib import Path

import torch

from growtrain.hf.seed_import import import_check, import_state
from growtrain.recipe import Recipe, RecipeError
from growtrain.stages.transition import GrowthCheckFailed


def import_seed(model, path: Path, recipe: Recipe, checks: bool, log) -> None:
    """model.init_from: the checkpoint's weights into the seed `model`, then checked like an exact
    growth operator against transformers' own forward of it (on the rank with `checks`: every rank
    holds the same dense seed, and one check, a second copy of the checkpoint in host memory, is
    enough; its failure reaches the other ranks as a peer's error)."""
    state = import_state(path, model.config.n_layers)
    with torch.no_grad():
        missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise RecipeError([f"model.init_from: {path} does not fill the seed model (missing {missing[:3]}, unexpected {unexpected[:3]})"])
    log(f"model: the seed's weights imported from {path} ({len(state)} tensors)")
    if not checks:
        return
    seq = recipe.invariance.probe_seq_len or recipe.stages[0].seq_len
    was_training = model.training
    model.eval()
    numbers = import_check(model, path, model.config.vocab_size, seq)
    model.train(was_training)
    bar = recipe.invariance.exact_rel_tol
    verdict = "passed" if numbers["rel_l2"] <= bar else "FAILED"
    log(f"import check: logits against transformers' {numbers['architecture']} of the checkpoint: rel L2 {numbers['rel_l2']:.2e} "
        f"(bar {bar:.0e}), max|Δlogit| {numbers['max_abs_dlogits']:.2e} — {verdict}")
    if numbers["rel_l2"] > bar:
        raise GrowthCheckFailed({"stage": recipe.stages[0].name, "operator": "init_from", "index": 0,
                                 "problems": [f"imported logits differ from transformers' by rel L2 {numbers['rel_l2']:.2e} > {bar:.0e}"]})
