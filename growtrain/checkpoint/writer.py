"""The run's checkpoint-writing protocol: one process's state, or every rank's part of it under
expert parallelism and in the AF layout, written as one atomic checkpoint (the files and their
atomicity: store.py).

Rank 0's files hold the replicated state; each rank adds its experts and its share of the optimizer
state, in the EP layout, so any EP size can load it (model/expert_shards.py). AF: the expert ranks
write the expert shards (an EP layout of F ranks), the attention ranks their dense optimizer shares;
either layout loads it (store.py). The ranks write their shards into rank 0's temporary directory at
once and hash them in parallel; rank 0 renames the whole into place.
"""

from __future__ import annotations

from pathlib import Path

import torch

from growtrain.checkpoint.store import CheckpointManager, dense_state_file_name, file_entry, shard_file_name, write_shard_file
from growtrain.parallel.distributed import Dist
from growtrain.model.expert_shards import is_expert_tensor
from growtrain.runtime.health import TrainingDiverged, nonfinite_tensors, tensors_in


def write_checkpoint(
    ckpt: CheckpointManager, dist: Dist, step: int, *, model_state: dict[str, torch.Tensor], trainer_state: dict, meta: dict,
    stage_end: bool, grown: bool, extra_files: dict[str, str],
) -> Path | None:
    """Write this rank's part of the checkpoint of `step`; rank 0 returns its path once every rank's
    part is in it, the other ranks None. A non-finite tensor anywhere refuses the whole save."""
    # The last line of defence: whatever produced it, a non-finite state is never saved (a resume
    # would load it and train on NaNs).
    bad = nonfinite_tensors(model_state.items()) + nonfinite_tensors(tensors_in(trainer_state["optimizer"], "optimizer"))
    if bad:
        raise TrainingDiverged(
            f"refusing to checkpoint step {step}: {len(bad)} tensor(s) hold non-finite values "
            f"(first: {bad[0]}); the last checkpoint written is intact: resume restarts from it"
        )
    write_shards = None
    if dist.active:
        experts = {n: t for n, t in model_state.items() if is_expert_tensor(n)}
        model_state = {n: t for n, t in model_state.items() if not is_expert_tensor(n)}
        trainer_state = dict(trainer_state)
        optimizer_share = trainer_state.pop("optimizer")
        trainer_state["optimizer"] = {}
        name, shard, meta["expert_parallel"] = _layout(dist, experts, optimizer_share)
        write_shards = lambda tmp: _write_shards(dist, tmp, name, shard)  # noqa: E731
        if not dist.is_main:
            _write_shards(dist, None, name, shard)
            dist.barrier()  # rank 0 has renamed the checkpoint into place
            return None
    path = ckpt.save(
        step, model_state=model_state, trainer_state=trainer_state, meta=meta, stage_end=stage_end, grown=grown,
        extra_files=extra_files, write_shards=write_shards,
    )
    dist.barrier()
    return path


def _layout(dist: Dist, experts: dict, optimizer_share: dict) -> tuple[str, dict, dict]:
    """This rank's shard file (name, content) and the checkpoint's `expert_parallel` meta entry."""
    af = dist.af
    if af is None:
        shard = {"ep_rank": dist.rank, "ep_size": dist.size, "model": experts, "optimizer": optimizer_share}
        entry = {"size": dist.size, "files": [shard_file_name(r, dist.size) for r in range(dist.size)]}
        return shard_file_name(dist.rank, dist.size), shard, entry
    n_expert = af.expert_ranks
    if af.is_attention:
        name, shard = dense_state_file_name(dist.rank, af.attention), {"optimizer": optimizer_share}
    else:
        name = shard_file_name(dist.rank - af.attention, n_expert)
        shard = {"ep_rank": dist.rank - af.attention, "ep_size": n_expert, "model": experts, "optimizer": optimizer_share}
    entry = {
        "size": n_expert,
        "files": [shard_file_name(f, n_expert) for f in range(n_expert)],
        "dense_files": [dense_state_file_name(a, af.attention) for a in range(af.attention)],
        "layout": "af",
        "attention_ranks": af.attention,
    }
    return name, shard, entry


def _write_shards(dist: Dist, tmp: Path | None, name: str, shard: dict) -> dict[str, dict]:
    """Every rank writes its shard into rank 0's temporary checkpoint dir and hashes it, all at once
    (rank 0 would otherwise hash every shard after the others: ~117 GB at the 120B recipe's last
    stage); rank 0 gets every shard's manifest entry."""
    import torch.distributed as tdist

    where = [str(tmp) if tmp is not None else None]
    tdist.broadcast_object_list(where, src=0)
    path = Path(where[0]) / name
    write_shard_file(path, shard)
    entries: list = [None] * dist.size
    tdist.all_gather_object(entries, (name, file_entry(path)))  # names and digests, no tensors
    return dict(entries)
