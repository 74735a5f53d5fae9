"""Run by torchrun (gloo) from tests/test_expert_parallel.py with GROWTRAIN_CHECK_COLLECTIVES=1:
deliberately wrong collective calls, each of which the guard must refuse on every rank before
anything is sent, then correct ones that must still work, then Dist's optimizer-state gather
(tensors by all_gather / broadcast, only layouts as objects) against the full state it came from.
Rank 0 writes a JSON report to argv[1]: {"refused": {case: message or null}, "worked": {...}}."""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

from growtrain.parallel import collective_guard
from growtrain.parallel.distributed import Dist, import_before_group
from growtrain.model.expert_shards import slice_entry
from growtrain.optim.adamw import ParamState


def wrong_calls(W: int) -> dict:
    """Each case builds a tensor with an explicit device that is not the group's (meta: a CPU run
    has no second real device), mixes devices, or hands a tensor to an object collective."""
    rank = dist.get_rank()
    cases = {
        "all_reduce_other_device": lambda: dist.all_reduce(torch.zeros(3, device="meta")),
        "all_gather_mixed_devices": lambda: dist.all_gather([torch.empty(3), torch.empty(3, device="meta")][:W], torch.zeros(3)),
        "all_to_all_single_output_elsewhere": lambda: dist.all_to_all_single(torch.empty(W, device="meta"), torch.zeros(W)),
        "broadcast_other_device": lambda: dist.broadcast(torch.zeros(2, device="meta"), src=0),
        "p2p_other_device": lambda: dist.batch_isend_irecv(
            [dist.P2POp(dist.isend, torch.zeros(2, device="meta"), (rank + 1) % W), dist.P2POp(dist.irecv, torch.empty(2), (rank - 1) % W)]
        ),
        # The pattern gather_full used: an optimizer state (tensors inside) through all_gather_object.
        "all_gather_object_with_tensors": lambda: dist.all_gather_object(
            [None] * W, {"w": {"step": 3, "exp_avg": torch.zeros(2), "lr_mult": 1.0}}
        ),
        "broadcast_object_list_tensor": lambda: dist.broadcast_object_list([torch.ones(1)], src=0),
        "broadcast_object_list_other_device": lambda: dist.broadcast_object_list(["a path"], src=0, device=torch.device("meta")),
    }
    refused = {}
    for case, call in cases.items():
        try:
            call()
        except collective_guard.CollectiveRuleError as exc:
            refused[case] = str(exc)
        else:
            refused[case] = None
    return refused


def right_calls(W: int) -> dict:
    rank = dist.get_rank()
    t = torch.ones(2)
    dist.all_reduce(t)
    got = torch.empty(2)
    ops = [dist.P2POp(dist.isend, torch.full((2,), float(rank)), (rank + 1) % W), dist.P2POp(dist.irecv, got, (rank - 1) % W)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    where = ["a path" if rank == 0 else None]
    dist.broadcast_object_list(where, src=0)  # an object that is not a tensor: fine
    return {
        "all_reduce": t.tolist() == [float(W)] * 2,
        "ring": got.tolist() == [float((rank - 1) % W)] * 2,
        "broadcast_object_list": where == ["a path"],
    }


def gather_state(W: int) -> bool:
    """The state of an expert tensor (sliced on every rank, a per-element step tensor and a float
    multiplier) and of two dense tensors (each on one owner rank), merged back on every rank."""
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(0)
    E = 2 * W
    full = {
        "blocks.0.g.ffn.experts.w_up": ParamState(
            torch.randint(0, 9, (E, 3), generator=g), torch.randn(E, 3, generator=g), torch.rand(E, 3, generator=g), 0.5, torch.rand(E, 3, generator=g), 1.0, 1.0
        ),
        "blocks.0.g.ffn.router.weight": ParamState(4, torch.randn(E, 5, generator=g), torch.rand(E, 5, generator=g), torch.rand(E, 5, generator=g)),
        "embed.weight": ParamState(4, torch.randn(7, 5, generator=g), torch.rand(7, 5, generator=g), 2.0, 0.0),
    }
    owner = {"blocks.0.g.ffn.router.weight": 0, "embed.weight": W - 1}
    mine = {}
    for name, s in full.items():
        if name in owner:
            if owner[name] == rank:
                mine[name] = s
        else:
            fields = {k: getattr(s, k) for k in ("step", "exp_avg", "exp_avg_sq", "lr_mult", "wd_mult", "eps_mult", "norm_mult")}
            mine[name] = ParamState(**slice_entry(fields, rank, W))
    merged = Dist(rank, W)._gather_state(mine)
    if merged.keys() != full.keys():
        return False
    for name, s in full.items():
        for k, want in vars(s).items():
            got = getattr(merged[name], k)
            same = torch.equal(got, want) if isinstance(want, torch.Tensor) else (not isinstance(got, torch.Tensor) and got == want)
            if not same:
                return False
    return True


def main(out: str) -> None:
    import_before_group()  # before the group, as the trainer does
    dist.init_process_group("gloo")
    W = dist.get_world_size()
    on = collective_guard.install_from_env(torch.device("cpu"))
    report = {"guard_on": on, "refused": wrong_calls(W), "worked": right_calls(W)}
    report["worked"]["gather_state"] = gather_state(W)
    # Every rank must agree: a case refused on one rank only would leave the others waiting.
    flags = torch.tensor([float(v is not None) for v in report["refused"].values()] + [float(v) for v in report["worked"].values()])
    low, high = flags.clone(), flags.clone()
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    report["all_ranks_agree"] = torch.equal(low, high)
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(report, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
