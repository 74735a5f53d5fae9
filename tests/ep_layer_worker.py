"""Run by torchrun from tests/test_expert_parallel.py: one MoE layer with its experts sharded over
the ranks, forward and backward with the serial and the overlapped combine, against the unsharded
layer run on every rank's tokens at once. Rank 0 writes a JSON report to argv[1].

argv[2] routing: "topk" (the router's choice), "one_rank" (every token to experts of rank 0, so
the others' experts are empty), "skewed" (tokens of rank r all to expert r, other ranks' experts
get nothing from it). argv[3] expert format: full or nf4."""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

from growtrain.parallel import collective_guard
from growtrain.parallel.distributed import import_before_group
from growtrain.model.config import ExpertLoRAConfig, ModelConfig, MoEConfig
from growtrain.model.expert_parallel import EPGroup, shard_moe
from growtrain.model.moe import MoE


def main(out: str, routing: str, expert_format: str, precision: str = "fp32") -> None:
    import_before_group()  # before the group, as the trainer does
    dist.init_process_group("gloo")
    guard_on = collective_guard.install_from_env(torch.device("cpu"))  # the test sets GROWTRAIN_CHECK_COLLECTIVES=1
    rank, W = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    E, K, T, D = 8, 2, 13, 24  # an odd token count per rank
    moe = MoEConfig(num_experts=E, top_k=K, expert_hidden=64, expert_format=expert_format, lora=ExpertLoRAConfig(r=4))
    cfg = ModelConfig(d_model=D, n_layers=1, n_heads=2, ffn_hidden=64, moe=moe, moe_layers=(0,))
    reference = MoE(cfg)
    if expert_format == "nf4":  # nonzero B so the adapters take part
        with torch.no_grad():
            for m in ("w_gate", "w_up", "w_down"):
                getattr(reference.experts, f"{m}_lora_B").normal_(0, 0.02)
    state = reference.state_dict()
    x_all = torch.randn(W, T, D)
    g_all = torch.randn(W, T, D)
    if routing == "topk":
        route_all = None
    elif routing == "one_rank":
        route_all = torch.stack([torch.arange(T) % (E // W), (torch.arange(T) + 1) % (E // W)], 1).expand(W, T, K)
    else:  # skewed: rank r's tokens to experts r and r+1 (mod E)
        route_all = torch.stack([torch.full((T, K), 0, dtype=torch.long) + torch.tensor([r, (r + 1) % E]) for r in range(W)])

    # The reference: every rank's tokens through the whole layer at once.
    x_ref = x_all.reshape(W * T, D).clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
        y_ref, _ = reference(x_ref, None if route_all is None else route_all.reshape(W * T, K))
    (y_ref * g_all.reshape(W * T, D)).sum().backward()
    lo, hi = rank * E // W, (rank + 1) * E // W

    got = {}
    for mode in ("serial", "overlapped"):
        layer = MoE(cfg)
        layer.load_state_dict(state)
        shard_moe(layer, EPGroup(rank, W, mode))
        x = x_all[rank].clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            y, stats = layer(x, None if route_all is None else route_all[rank])
        (y * g_all[rank]).sum().backward()
        # An expert range that received no token has no gradient: zeros, as in the whole layer.
        grads = {n: p.grad.clone() if p.grad is not None else torch.zeros_like(p) for n, p in layer.named_parameters()}
        got[mode] = (y.detach(), x.grad.clone(), grads, stats.load)

    ys, yo = got["serial"], got["overlapped"]
    bitwise = torch.equal(ys[0], yo[0]) and torch.equal(ys[1], yo[1]) and ys[2].keys() == yo[2].keys()
    bitwise = bitwise and all(torch.equal(ys[2][n], yo[2][n]) for n in ys[2])
    ref_params = dict(reference.named_parameters())

    def rel(a, b):
        return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()

    errors = {"y": rel(ys[0], y_ref.detach()[rank * T : (rank + 1) * T]), "x_grad": rel(ys[1], x_ref.grad[rank * T : (rank + 1) * T])}
    for n, g in ys[2].items():
        # The router is replicated: its gradient here is this rank's tokens' share; the experts'
        # gradients are complete (every rank's tokens reach them through the all-to-all).
        if ".experts." in f".{n}":
            errors[n] = rel(g, ref_params[n].grad[lo:hi])
    router_grads = [torch.empty_like(ys[2]["router.weight"]) for _ in range(W)]
    dist.all_gather(router_grads, ys[2]["router.weight"])
    errors["router.weight"] = rel(sum(router_grads), ref_params["router.weight"].grad)
    load_ok = torch.equal(ys[3], torch.bincount(torch.as_tensor(_indices(reference, x_ref, route_all, W, T, K)).reshape(-1), minlength=E).float())
    bits = torch.tensor([float(bitwise), float(load_ok)])
    dist.all_reduce(bits, op=dist.ReduceOp.MIN)
    worst = {k: torch.tensor(v) for k, v in errors.items()}
    for v in worst.values():
        dist.all_reduce(v, op=dist.ReduceOp.MAX)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"collective_checks": guard_on, "bitwise": bool(bits[0]), "load_is_global": bool(bits[1]), "rel_err": {k: v.item() for k, v in worst.items()}}, f)
    dist.destroy_process_group()


def _indices(reference, x_ref, route_all, W, T, K):
    if route_all is not None:
        return route_all.reshape(W * T, K)
    with torch.no_grad():
        scores = reference.scores(reference.router(x_ref))
        return torch.topk(scores + reference.router.balance_bias, K, dim=-1).indices


if __name__ == "__main__":
    main(*sys.argv[1:5])
