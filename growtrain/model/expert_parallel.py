"""Expert-parallel dispatch and combine (DESIGN.md §12): each rank routes its own tokens, sends
every token-slot to the rank that holds its expert, computes the slots it received, and sends the
results back.

1. Counts: all ranks all-gather their per-expert slot counts ([W, E]); that gives every split size
   of both exchanges and the global load (balance loss, balance bias).
2. Dispatch: one `all_to_all_single` with variable splits (the list form fails on gloo with uneven
   sizes), autograd through it (its backward is the reverse exchange).
3. Compute: the received rows come grouped by source rank and, within a source, sorted by expert,
   so each source's chunk is computed by one grouped-expert call with its own offsets. Chunks for
   remote ranks are computed first, the rank's own chunk last.
4. Combine, two paths with the same arithmetic (so the same bits):
   - "serial": after all chunks, one `all_to_all_single` sends them back;
   - "overlapped": each remote chunk is sent (`isend`, paired with the receive of the chunk the
     ring's opposite rank sends at the same step) as soon as it is finished, while the next one
     computes, so the transfer hides behind compute.
     On GPUs the tile-signaled producer/consumer of growtrain/kernels/combine.py plays this role at
     tile granularity; this chunk-level path runs on gloo and NCCL alike.
   The backward of both is one reverse all-to-all of the gradients.

Legend: S token-slots sent by this rank (sorted by expert), R slots received, D d_model,
E experts of the layer (global), L = E / W local experts, W ranks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

from growtrain.model.expert_shards import expert_range, is_expert_tensor

CombineMode = Literal["overlapped", "serial"]


@dataclass(frozen=True)
class EPGroup:
    """This process's place in the expert-parallel group: the ranks of one node, in the default
    process group, or in `group` (a torch.distributed process group over the same ranks: the gloo
    group growth on the host runs in, Dist.host_ep).

    `attention` > 0: the first `attention` ranks hold no routed expert and the others E / F each
    (F = size - attention), the AF layout's placement, in which an AF model grows on its shards
    (Dist.growth_ep): every rank still routes its own tokens and sends each slot to its expert's
    rank; the dense parameters' ZeRO-1 owners are the first `attention` ranks, as AF training
    keeps them."""

    rank: int
    size: int
    combine: CombineMode = "overlapped"
    group: Any = field(default=None, compare=False)
    attention: int = 0

    def __post_init__(self):
        if not 0 <= self.attention < self.size:
            raise ValueError(f"an expert-parallel group of {self.size} ranks can leave 0..{self.size - 1} ranks without experts, got {self.attention}")

    def __deepcopy__(self, memo) -> "EPGroup":
        return self  # a handle on the process group, shared by every copy of a model (growth keeps copies)

    @property
    def expert_ranks(self) -> int:
        """How many ranks hold experts (F)."""
        return self.size - self.attention

    @property
    def dense_ranks(self) -> int:
        """How many ranks own the dense parameters' optimizer state (ZeRO-1): all, or the AF
        layout's attention ranks."""
        return self.attention or self.size

    def holder(self, rank: int | None = None) -> int | None:
        """`rank`'s (default: this rank's) index among the ranks that hold experts, or None."""
        rank = self.rank if rank is None else rank
        return rank - self.attention if rank >= self.attention else None

    def experts(self, num_experts: int) -> tuple[int, int]:
        """This rank's experts [lo, hi): (0, 0) where it holds none."""
        h = self.holder()
        return (0, 0) if h is None else expert_range(num_experts, h, self.expert_ranks)

    def splits(self, counts_E: torch.Tensor) -> list[int]:
        """Per rank, how many of the slots counted per expert in `counts_E` [E] its experts take
        (the experts being contiguous per rank)."""
        per_holder = counts_E.view(self.expert_ranks, -1).sum(1).tolist()
        return [0] * self.attention + per_holder


class _AllToAll(torch.autograd.Function):
    """all_to_all_single over rows with variable splits; backward sends the gradients back."""

    @staticmethod
    def forward(ctx, x_ND: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x_ND.new_empty((sum(out_splits), *x_ND.shape[1:]))
        dist.all_to_all_single(out, x_ND.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        out_splits, in_splits = ctx.splits
        grad_in = grad_out.new_empty((sum(in_splits), *grad_out.shape[1:]))
        dist.all_to_all_single(grad_in, grad_out.contiguous(), in_splits, out_splits, group=ctx.group)
        return grad_in, None, None, None


def all_to_all(x_ND: torch.Tensor, out_splits: list[int], in_splits: list[int], group=None) -> torch.Tensor:
    return _AllToAll.apply(x_ND, out_splits, in_splits, group)


class _FinishOverlappedCombine(torch.autograd.Function):
    """Waits for the sends and receives started during the compute and returns the rows this rank
    gets back, in source-rank order. Its inputs are the chunks computed here (ys[s] for rank s's
    tokens), so autograd routes the reverse exchange's gradients to them."""

    @staticmethod
    def forward(ctx, pending: dict, *ys):
        rank, recv_bufs, works = pending["rank"], pending["recv"], pending["works"]
        ctx.group = pending["group"]
        for w in works:
            w.wait()
        ctx.y_splits = [y.shape[0] for y in ys]
        ctx.out_splits = [b.shape[0] for b in recv_bufs]
        parts = [ys[s] if s == rank else recv_bufs[s] for s in range(len(ys))]
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad_out):
        grad_in = grad_out.new_empty((sum(ctx.y_splits), *grad_out.shape[1:]))
        dist.all_to_all_single(grad_in, grad_out.contiguous(), ctx.y_splits, ctx.out_splits, group=ctx.group)
        return (None, *grad_in.split(ctx.y_splits))


def chunk_dtype(x: torch.Tensor) -> torch.dtype:
    """The one dtype every rank's result chunks travel in: the autocast dtype under autocast, else
    the input's (an empty chunk would otherwise come back in the input's dtype, and a receiver
    expecting bf16 would get twice the bytes)."""
    device_type = x.device.type
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else x.dtype


def exchange_counts(counts_E: torch.Tensor, ep) -> torch.Tensor:
    """[W, E]: every rank's slot count per expert (`ep`: an EPGroup, or an AF layout's AFGroup)."""
    gathered = [torch.empty_like(counts_E) for _ in range(ep.size)]
    dist.all_gather(gathered, counts_E.contiguous(), group=ep.group)
    return torch.stack(gathered)


def expert_parallel_ffn(
    experts: nn.Module, backend: str, x_sorted_SD: torch.Tensor, counts_E: torch.Tensor, ep: EPGroup
) -> tuple[torch.Tensor, torch.Tensor]:
    """The routed experts' output for this rank's expert-sorted slots, and the global load [E]."""
    W = ep.size
    E = counts_E.numel()
    lo, hi = ep.experts(E)
    counts_WE = exchange_counts(counts_E, ep)
    send_splits = ep.splits(counts_E)  # slots to each rank (experts are contiguous)
    recv_WL = counts_WE[:, lo:hi]
    recv_splits = recv_WL.sum(1).tolist()
    x_recv_RD = all_to_all(x_sorted_SD, recv_splits, send_splits, ep.group)
    chunks = x_recv_RD.split(recv_splits)

    out_dtype = chunk_dtype(x_sorted_SD)
    overlapped = ep.combine == "overlapped"
    recv_bufs = [x_sorted_SD.new_empty((send_splits[r], x_sorted_SD.shape[1]), dtype=out_dtype) for r in range(W)]
    works, sent = [], []  # an in-flight isend's buffer must outlive it: `sent`
    ys: list[torch.Tensor | None] = [None] * W
    for i in range(1, W + 1):  # remote-bound chunks first (ring order), own chunk last
        s = (ep.rank + i) % W
        if hi > lo:
            offsets_L1 = torch.zeros(hi - lo + 1, dtype=torch.long, device=x_sorted_SD.device)
            offsets_L1[1:] = torch.cumsum(recv_WL[s].to(offsets_L1.device), 0)
            ys[s] = experts(chunks[s], offsets_L1, backend).to(out_dtype)
        else:  # a rank without experts receives no slot: its empty chunk stays in the graph, so
            ys[s] = chunks[s].to(out_dtype)  # the dispatch's backward (a collective) runs here too
        if overlapped and s != ep.rank:
            # Step i of a ring: send to rank + i what was just computed, receive from rank − i,
            # which is sending this rank its results at the same step. Pairing them in one batch
            # keeps every rank's sends and receives in a matching order (NCCL point-to-point ops
            # on one pair's stream would deadlock if both sides posted a receive first).
            src = (ep.rank - i) % W
            ops = []
            if ys[s].shape[0]:
                sent.append(ys[s].detach().contiguous())
                ops.append(dist.P2POp(dist.isend, sent[-1], s, ep.group))
            if send_splits[src]:
                ops.append(dist.P2POp(dist.irecv, recv_bufs[src], src, ep.group))
            if ops:
                works.extend(dist.batch_isend_irecv(ops))
    if overlapped:
        y_SD = _FinishOverlappedCombine.apply({"rank": ep.rank, "recv": recv_bufs, "works": works, "sent": sent, "group": ep.group}, *ys)
    else:
        y_SD = all_to_all(torch.cat(ys), send_splits, recv_splits, ep.group)
    return y_SD, counts_WE.sum(0)


def shard_experts(model: nn.Module, ep: EPGroup) -> nn.Module:
    """Cut every MoE layer of `model` to this rank's experts, in place (see shard_moe)."""
    for moe in model.moe_layers:
        shard_moe(moe, ep)
    return model


def use_group(model: nn.Module, ep: EPGroup) -> nn.Module:
    """Every MoE layer of `model` (cut to this rank's experts already) exchanges through `ep` from
    now on: growth on the host runs the model's forwards in its gloo group, and back."""
    for moe in model.moe_layers:
        moe.ep = ep
    return model


def shard_moe(moe: nn.Module, ep: EPGroup) -> nn.Module:
    """Cut an MoE layer's experts to this rank's contiguous range, in place, and mark the layer
    expert-parallel. Parameters and buffers keep their names, with E/W rows instead of E."""
    cut_experts(moe.experts, *ep.experts(moe.num_experts))
    moe.ep = ep
    return moe


def cut_experts(module: nn.Module, lo: int, hi: int) -> nn.Module:
    """An experts module (full or NF4) cut to its experts [lo, hi), in place: every per-expert
    parameter and buffer keeps rows lo..hi-1 under its name; the shared code books stay whole."""
    for name, p in list(module.named_parameters(recurse=False)):
        setattr(module, name, nn.Parameter(p.detach()[lo:hi].clone(), requires_grad=p.requires_grad))
    for name, b in list(module.named_buffers(recurse=False)):
        if b.ndim and is_expert_tensor(f"experts.{name}"):
            module._buffers[name] = b[lo:hi].clone()
    if hasattr(module, "num_experts"):
        module.num_experts = hi - lo
    return module
