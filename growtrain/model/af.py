"""Attention/expert disaggregation (AF mode, issue 18; after DisagMoE, arXiv 2605.11005): the
routed experts on ranks of their own, apart from the ranks that run everything else.

Layout over the W ranks of one group: ranks 0..A-1 are attention ranks (embeddings, attention,
norms, routers, shared experts, head; data parallel among themselves, each with its rows of the
batch), ranks A..W-1 expert ranks (the routed experts, E/F of every MoE layer on each, F = W - A,
contiguous ranges as under expert parallelism). One MoE layer call moves tokens one way and back:

1. counts: one all_gather of each rank's per-expert slot counts ([E]; an expert rank sends zeros)
   gives every rank all of them ([W, E]): the split sizes of both transfers and the global load
   (balance loss, balance bias), as under expert parallelism;
2. dispatch: one all_to_all_single in which attention rank a sends expert rank f the slots routed
   to f's experts (contiguous rows, the slots being sorted by expert); nothing else moves;
3. compute: expert rank f runs each attention rank's chunk through its experts, one grouped call
   per source with that source's offsets;
4. combine, each chunk back to the attention rank it came from, which finds its rows in the order
   it sent them (`distributed.combine`, as under expert parallelism, the same bits either way):
   "overlapped": expert rank f sends attention rank a's chunk (isend) as soon as it is computed,
   while it computes the next; attention rank a posts its receives from every expert rank at once;
   "serial": one all_to_all_single after all chunks. The backward of both is one reverse exchange.

Autograd runs through both transfers (expert_parallel._AllToAll, whose backward is the reverse
exchange): on an attention rank the combine's backward sends the outputs' gradients to the expert
ranks and the dispatch's backward receives the inputs' gradients; on an expert rank, `serve`
builds the same two transfers around its compute (the dispatch from an empty input that requires
a gradient, so that its backward sends the received rows' gradients back) and
`ExpertCall.backward` runs its side of the backward: the same collectives in the same order.
So an expert rank mirrors every MoE call of the attention ranks (the forward, a forward without
gradients, the reversible backward's recompute) and every backward, in their order.

The schedule (the trainer's `distributed.layout: af`, `af_schedule`). A training pass of one
micro-batch makes, per MoE block, three calls: the forward (without gradients: the reversible
stack keeps no activations), the backward's recompute of the block (with gradients) and that
recompute's backward; an evaluation makes the forward only. The expert ranks run the step by
`serve_calls` and nothing else; the attention ranks end each step (and each evaluation) with
`end_calls`.

- sequential: every attention rank makes each call at once, the expert ranks serve all of their
  rows in one exchange. Per call, with a the attention ranks' compute before it, e the expert
  ranks' compute of its rows and x the transfers: the period is a + e + x; the expert ranks idle
  a of it, the attention ranks wait e + x. The numbers are the co-located run's.
- pingpong: the attention ranks in two lanes (even and odd ranks), each lane's calls in a group
  of its own with every expert rank; the expert ranks serve lane 0's k-th event (a call's
  forward or backward, or the end), then lane 1's, and so on (the lanes run the same model on as
  many rows, so their events pair up). While the expert ranks serve one lane, the other computes
  its attention: per pair of calls the period is max(a + (e + x) / 2, e + x), e and x halved per
  lane; the bubble: the expert ranks idle max(0, a - (e + x) / 2) per pair, and each pass's first
  call of lane 1 waits for lane 0's (fill), the last of lane 0 for nothing (drain, e / 2). Each
  lane's calls see its lane's load only: the balance loss's f_e is the lane's (a micro-batch
  level balance loss; the biases are updated from the lanes' loads summed, Dist.global_loads).
- interleaved: two micro-batches of the step in flight on every attention rank, each pass in a
  thread of its own, one running at a time, handing over at each MoE call once its dispatch is
  posted (growtrain/model/af_interleaved.py, which writes down the schedule: forward, recompute
  and backward, and its bubble). Per call the period is max(a, e + x): the expert ranks serve
  one pass's call while the attention ranks compute the other's attention. The numbers are the
  co-located run's (each call sees its own micro-batch, as there). The planner's AF model
  (planning/disaggregation.py) takes max(a, e, x): the transfers overlapping the expert ranks'
  compute as well, which this schedule does not do.

`clock` records each side's wait (the trainer logs af/attention_wait_fraction and
af/expert_idle_fraction per step).

Legend: S slots an attention rank sends (sorted by expert), R slots an expert rank receives,
D d_model, E experts of the layer, L = E / F local experts, A attention ranks, F expert ranks.
"""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from growtrain.expert_shards import expert_range
from growtrain.model.expert_parallel import CombineMode, all_to_all, chunk_dtype, cut_experts, exchange_counts


@dataclass(frozen=True)
class AFGroup:
    """This process's place in an attention/expert layout of `size` ranks, the first `attention`
    of them attention ranks (in `group`, else the default process group)."""

    rank: int
    size: int
    attention: int
    group: Any = field(default=None, compare=False)
    combine: CombineMode = "overlapped"

    def __post_init__(self):
        if self.combine not in ("overlapped", "serial"):
            raise ValueError(f"combine must be overlapped or serial, got {self.combine!r}")
        if not 1 <= self.attention < self.size:
            raise ValueError(f"an AF layout of {self.size} ranks needs 1..{self.size - 1} attention ranks, got {self.attention}")

    def __deepcopy__(self, memo) -> "AFGroup":
        return self  # a handle on the process group, shared by every copy of a model

    @property
    def expert_ranks(self) -> int:
        return self.size - self.attention

    @property
    def is_attention(self) -> bool:
        return self.rank < self.attention

    def experts_of(self, expert_rank: int, num_experts: int) -> tuple[int, int]:
        """The global experts [lo, hi) that expert rank `expert_rank` (0..F-1) holds."""
        return expert_range(num_experts, expert_rank, self.expert_ranks)

    def experts(self, num_experts: int) -> tuple[int, int]:
        """This expert rank's experts."""
        if self.is_attention:
            raise ValueError(f"rank {self.rank} is an attention rank: it holds no routed experts")
        return self.experts_of(self.rank - self.attention, num_experts)


# -- the control header ------------------------------------------------------------------------
#
# Before each exchange, attention rank 0 broadcasts what it is to every rank: [kind, call id,
# MoE layer, grad mode, slot dtype, autocast]. The expert ranks follow the headers, so they need
# no copy of the attention ranks' schedule (forward, a forward without gradients, the
# reversible backward's recompute, the backwards in whatever order autograd runs them); the other
# attention ranks compare it with their own, so that ranks drifting apart fail at once, naming
# the call, instead of exchanging the wrong tensors.

FORWARD, BACKWARD, END = 1, 2, 3
_KINDS = {FORWARD: "forward", BACKWARD: "backward", END: "end"}
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_ids = itertools.count()


@dataclass
class AFClock:
    """Host seconds this process spent waiting on the other side since the last reset: on an
    attention rank inside its MoE calls (the transfers and the expert ranks' compute), on an
    expert rank for the next call's header (nothing to compute). Under NCCL the collectives run
    asynchronously, so on a GPU these are launch-side times, not the device's."""

    wait_s: float = 0.0

    def reset(self) -> None:
        self.wait_s = 0.0


clock = AFClock()


def _header(af: AFGroup, device: torch.device, values: tuple[int, ...] = (0,) * 6) -> tuple[int, ...]:
    mine = torch.tensor(values, dtype=torch.long, device=device)
    got = mine.clone()
    dist.broadcast(got, group_src=0, group=af.group)  # the group's first rank: attention rank 0 of its lane
    if af.is_attention and not torch.equal(got, mine):
        raise RuntimeError(
            f"AF layout: attention rank {af.rank} is at {_describe(mine.tolist())}, attention rank 0 at "
            f"{_describe(got.tolist())}: the attention ranks must make the same MoE calls in the same order"
        )
    return tuple(got.tolist())


def _describe(h) -> str:
    kind, call, layer = h[0], h[1], h[2]
    return f"{_KINDS.get(kind, kind)} of call {call} (MoE layer {layer})" if kind != END else "the end of the calls"


def _post_call(x_sorted_SD: torch.Tensor, af: AFGroup, send: list[int], out_dtype: torch.dtype) -> tuple[torch.Tensor, list]:
    """An attention rank's side of one MoE call, up to the results: the slots dispatched and the
    combine's receives posted. Returns the results' buffer [S, D] and the works to wait on."""
    nothing = [0] * af.size
    sent_0D = x_sorted_SD.new_empty((0, x_sorted_SD.shape[1]))
    dist.all_to_all_single(sent_0D, x_sorted_SD.contiguous(), nothing, send, group=af.group)  # dispatch
    y_SD = x_sorted_SD.new_empty((sum(send), x_sorted_SD.shape[1]), dtype=out_dtype)
    if af.combine == "overlapped":
        # Every expert rank's rows, received as each is sent: its chunk of this rank's slots
        # lies contiguously in y_SD, in expert-rank order (the slots are sorted by expert).
        ops = [dist.P2POp(dist.irecv, part, group=af.group, group_peer=src) for src, part in enumerate(y_SD.split(send)) if part.shape[0]]
        return y_SD, dist.batch_isend_irecv(ops) if ops else []
    empty_0D = x_sorted_SD.new_empty((0, x_sorted_SD.shape[1]), dtype=out_dtype)
    return y_SD, [dist.all_to_all_single(y_SD, empty_0D, send, nothing, group=af.group, async_op=True)]


def _post_backward(grad_y: torch.Tensor, af: AFGroup, send: list[int], call: int, x_dtype: torch.dtype) -> tuple[torch.Tensor, Any]:
    """An attention rank's side of one MoE call's backward, up to the slots' gradients: the
    results' gradients sent, the slots' gradients' receive posted (the buffer and its work)."""
    _header(af, grad_y.device, (BACKWARD, call, 0, 0, 0, 0))
    nothing = [0] * af.size
    dist.all_to_all_single(grad_y.new_empty((0, grad_y.shape[1])), grad_y.contiguous(), nothing, send, group=af.group)
    grad_x = grad_y.new_empty((sum(send), grad_y.shape[1]), dtype=x_dtype)  # the slots' dtype, as the expert ranks send it
    work = dist.all_to_all_single(grad_x, grad_x.new_empty((0, grad_y.shape[1])), send, nothing, group=af.group, async_op=True)
    return grad_x, work


class _AttentionSide(torch.autograd.Function):
    """One MoE call on an attention rank: the slots out and the results back (forward), the
    results' gradients out and the slots' back (backward), each announced by a header."""

    @staticmethod
    def forward(ctx, x_sorted_SD: torch.Tensor, af: AFGroup, send: list[int], call: int, out_dtype: torch.dtype) -> torch.Tensor:
        ctx.af, ctx.send, ctx.call, ctx.x_dtype = af, send, call, x_sorted_SD.dtype
        y_SD, works = _post_call(x_sorted_SD, af, send, out_dtype)
        for work in works:
            work.wait()
        return y_SD

    @staticmethod
    def backward(ctx, grad_y):
        t0 = time.perf_counter()
        grad_x, work = _post_backward(grad_y, ctx.af, ctx.send, ctx.call, ctx.x_dtype)
        work.wait()
        clock.wait_s += time.perf_counter() - t0
        return grad_x, None, None, None, None


# -- two micro-batches in flight (af_schedule: interleaved, growtrain/model/af_interleaved.py) --
#
# Each micro-batch's pass runs in a thread of its own, one thread at a time: a MoE call posts its
# dispatch and the combine's receives, hands over to the other pass (`in_flight.turns.switch()`)
# and takes the results when it is its turn again. Grad mode on, the call is one of the
# reversible backward's recompute (split_g_backward): its results come back as a leaf, and the
# call is recorded so that the backward of G can send that leaf's gradient and, after another
# hand-over, take the slots' gradients (SplitCall.backward). Nothing hands over inside the
# autograd engine: on CUDA it runs a device's backward on one thread shared by both passes.


class InFlight(threading.local):
    """This thread's part in interleaved passes: the hand-over (af_interleaved.Turns) and, during
    a recompute of G, the list that records its MoE calls."""

    turns: Any = None
    split: list | None = None


in_flight = InFlight()


@dataclass
class SplitCall:
    """A MoE call of a recompute whose results came back as a leaf (`y`), apart from the slots'
    graph (`x`): the backward of G sends y's gradient, then pushes the slots' through x."""

    x: torch.Tensor
    y: torch.Tensor
    af: AFGroup
    send: list[int]
    call: int

    def backward(self, grad_y: torch.Tensor) -> torch.Tensor:
        """The slots' gradients for the results' `grad_y`: sent to the expert ranks, the other pass
        running while they compute."""
        t0 = time.perf_counter()
        grad_x, work = _post_backward(grad_y, self.af, self.send, self.call, self.x.dtype)
        posted = time.perf_counter()
        in_flight.turns.switch()
        t1 = time.perf_counter()
        work.wait()
        clock.wait_s += (posted - t0) + (time.perf_counter() - t1)
        return grad_x


def _interleaved_call(x_sorted_SD: torch.Tensor, af: AFGroup, send: list[int], call: int, out_dtype: torch.dtype, grad: bool) -> tuple[torch.Tensor, float]:
    """A MoE call inside interleaved passes (above): the results, and the seconds this thread
    was handed over (the other pass computing, not a wait)."""
    if grad and in_flight.split is None:
        raise RuntimeError("AF interleaved passes: a MoE call with gradients outside the reversible backward's recompute (model.reversible must be on)")
    y_SD, works = _post_call(x_sorted_SD.detach(), af, send, out_dtype)
    t0 = time.perf_counter()
    in_flight.turns.switch()
    away = time.perf_counter() - t0
    for work in works:
        work.wait()
    if grad:
        y_SD.requires_grad_(True)
        in_flight.split.append(SplitCall(x_sorted_SD, y_SD, af, send, call))
    return y_SD, away


def af_expert_ffn(x_sorted_SD: torch.Tensor, counts_E: torch.Tensor, af: AFGroup, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """On an attention rank: the routed experts' output for this rank's expert-sorted slots of
    MoE layer `layer` (its index among the model's MoE layers), computed on the expert ranks, and
    the global load [E]."""
    t0 = time.perf_counter()
    W, A = af.size, af.attention
    E = counts_E.numel()
    call = next(_ids)
    out_dtype = chunk_dtype(x_sorted_SD)
    autocast = torch.is_autocast_enabled(x_sorted_SD.device.type)
    grad = torch.is_grad_enabled() and x_sorted_SD.requires_grad  # a backward will come
    _header(af, x_sorted_SD.device, (FORWARD, call, layer, int(grad), _DTYPES.index(x_sorted_SD.dtype), int(autocast)))
    counts_WE = exchange_counts(counts_E, af)
    send = [0] * W
    for f in range(af.expert_ranks):
        lo, hi = af.experts_of(f, E)
        send[A + f] = int(counts_E[lo:hi].sum())
    away = 0.0
    if in_flight.turns is not None:
        y_SD, away = _interleaved_call(x_sorted_SD, af, send, call, out_dtype, grad)
    else:
        y_SD = _AttentionSide.apply(x_sorted_SD, af, send, call, out_dtype)
    clock.wait_s += time.perf_counter() - t0 - away
    return y_SD, counts_WE.sum(0)


def end_calls(af: AFGroup, device: torch.device) -> None:
    """On every attention rank, after the last MoE call of a step (or pass): the expert ranks'
    `serve_calls` returns."""
    _header(af, device, (END, 0, 0, 0, 0, 0))


@dataclass
class ExpertCall:
    """An expert rank's side of one MoE call: what its backward starts from, and the global load."""

    out: torch.Tensor  # the combine's (empty) output on this rank
    load_E: torch.Tensor

    def backward(self) -> None:
        """This rank's side of the call's backward: receive the outputs' gradients, run them
        through the experts (their parameters' gradients accumulate), send the inputs' back."""
        if not self.out.requires_grad:
            raise RuntimeError("this MoE call was served without gradients: there is no backward to run")
        torch.autograd.backward(self.out, torch.zeros_like(self.out))


def serve(experts: nn.Module, backend: str, num_experts: int, d_model: int, af: AFGroup, dtype: torch.dtype, device: torch.device) -> ExpertCall:
    """On an expert rank, after the call's header: this rank's side of one MoE call of the
    attention ranks (the layer whose experts `experts` are, cut to this rank's range). Gradients
    flow where grad mode is on, as on the attention ranks; `dtype`: the slots' dtype."""
    W, A = af.size, af.attention
    lo, hi = af.experts(num_experts)
    counts_WE = exchange_counts(torch.zeros(num_experts, dtype=torch.long, device=device), af)
    recv = [int(counts_WE[a, lo:hi].sum()) for a in range(A)] + [0] * af.expert_ranks
    nothing = [0] * W
    empty_0D = torch.empty((0, d_model), dtype=dtype, device=device, requires_grad=torch.is_grad_enabled())
    x_recv_RD = all_to_all(empty_0D, recv, nothing, af.group)
    out_dtype = chunk_dtype(x_recv_RD)
    overlapped = af.combine == "overlapped"
    ys, works, sent = [], [], []  # an in-flight isend's buffer must outlive it: `sent`
    for a, chunk in enumerate(x_recv_RD.split(recv[:A])):
        offsets_L1 = torch.zeros(hi - lo + 1, dtype=torch.long, device=device)
        offsets_L1[1:] = torch.cumsum(counts_WE[a, lo:hi].to(device), 0)
        ys.append(experts(chunk, offsets_L1, backend).to(out_dtype))
        if overlapped and ys[-1].shape[0]:  # on its way while the next chunk computes
            sent.append(ys[-1].detach().contiguous())
            works.append(dist.isend(sent[-1], group=af.group, group_dst=a))
    if overlapped:
        out_0D = _SentBack.apply({"works": works, "recv": recv, "group": af.group, "size": W}, *ys)
    else:
        out_0D = all_to_all(torch.cat(ys), nothing, recv, af.group)
    return ExpertCall(out_0D, counts_WE.sum(0))


class _SentBack(torch.autograd.Function):
    """An expert rank's overlapped combine: waits for the chunks' sends (started as each chunk was
    computed) and stands for them in the graph, so that the backward's reverse exchange (the
    serial combine's) brings each chunk's gradient to it. Returns the combine's empty output."""

    @staticmethod
    def forward(ctx, pending: dict, *ys):
        for work in pending["works"]:
            work.wait()
        ctx.recv, ctx.group, ctx.size = pending["recv"], pending["group"], pending["size"]
        ctx.splits = [y.shape[0] for y in ys]
        return ys[0].new_empty((0, ys[0].shape[1]))  # ys: one chunk per attention rank, at least one

    @staticmethod
    def backward(ctx, grad_out):
        grad_in = grad_out.new_empty((sum(ctx.recv), grad_out.shape[1]))
        dist.all_to_all_single(grad_in, grad_out.contiguous(), ctx.recv, [0] * ctx.size, group=ctx.group)
        return (None, *grad_in.split(ctx.splits))


def serve_calls(moe_layers: list[nn.Module], lanes: AFGroup | list[AFGroup], device: torch.device) -> int:
    """On an expert rank: serve the attention ranks' MoE calls, forward and backward, as their
    headers announce them, until they end the step (end_calls). Returns the number of calls. A
    forward with gradients is kept until its backward comes; one still waiting at the end is an
    error (its gradients would be lost).

    `lanes`: the layout's group, or the groups of a ping-pong schedule's lanes (each: one lane's
    attention ranks and every expert rank), served in turn: the k-th event (a call's forward or
    backward, or the end) of lane 0, then lane 1's k-th, and so on. Every lane runs the same
    model on the same number of rows, so every lane has the same events; lanes that do not (one
    ends while another calls) are an error."""
    lanes = lanes if isinstance(lanes, list) else [lanes]
    pending: dict[tuple[int, int], ExpertCall] = {}
    served = 0
    while True:
        ended = []
        for lane, af in enumerate(lanes):
            t0 = time.perf_counter()
            kind, call, layer, grad, dtype, autocast = _header(af, device)
            clock.wait_s += time.perf_counter() - t0
            ended.append(kind == END)
            if kind == END:
                continue
            if kind == BACKWARD:
                if (lane, call) not in pending:
                    raise RuntimeError(f"AF layout: backward of call {call}, which was not served with gradients")
                pending.pop((lane, call)).backward()
                continue
            moe = moe_layers[layer]
            with torch.set_grad_enabled(bool(grad)), torch.autocast(device.type, enabled=bool(autocast)):
                done = serve(moe.experts, moe.expert_backend, moe.num_experts, moe.router.weight.shape[1], af, _DTYPES[dtype], device)
            served += 1
            if grad:
                pending[(lane, call)] = done
        if any(ended):
            if not all(ended):
                raise RuntimeError(f"AF layout: lanes {[i for i, e in enumerate(ended) if e]} ended the step while the others still call")
            if pending:
                raise RuntimeError(f"AF layout: the attention ranks ended the step with the backward of calls {sorted(c for _, c in pending)} not run")
            return served


def shard_af(moe: nn.Module, af: AFGroup, layer: int, cut: bool = True) -> nn.Module:
    """MoE layer number `layer` (among the model's MoE layers) cut to this rank's part of the AF
    layout, in place: on an attention rank no routed expert (its calls go to the expert ranks),
    on an expert rank its range. `cut=False`: the layer holds this rank's part already (a model
    grown on the AF layout's shards, whose MoE layers exchanged through an expert-parallel
    group): it only calls the expert ranks from now on."""
    if cut:
        lo, hi = (0, 0) if af.is_attention else af.experts(moe.num_experts)
        cut_experts(moe.experts, lo, hi)
    moe.af, moe.af_layer, moe.ep = af, layer, None
    return moe


def shard_af_model(model: nn.Module, af: AFGroup, cut: bool = True) -> nn.Module:
    """Every MoE layer of `model` cut to this rank's part of the AF layout (shard_af), in place."""
    for i, moe in enumerate(model.moe_layers):
        shard_af(moe, af, i, cut)
    return model
