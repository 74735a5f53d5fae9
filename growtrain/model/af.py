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
recompute's backward; checkpointed residual blocks make the forward (with gradients), the
recompute's call (without: `replaying`) and the forward's backward; plain autograd the forward
and its backward; an evaluation makes the forward only. The expert ranks run the step by
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
  and backward, and its bubble). The expert ranks serve streamed (`_serve_streamed`): a thread
  takes in the next call while the rank computes the current one and sends its results back
  through a group of their own (AFGroup.back). Per call the period is max(a, e, x), the
  planner's AF model (planning/disaggregation.py): the expert ranks compute one pass's call
  while the attention ranks compute the other's attention and the transfers of both run. The
  numbers are the co-located run's (each call sees its own micro-batch, as there).

`clock` records each side's wait (the trainer logs af/attention_wait_fraction and
af/expert_idle_fraction per step).

Legend: S slots an attention rank sends (sorted by expert), R slots an expert rank receives,
D d_model, E experts of the layer, L = E / F local experts, A attention ranks, F expert ranks.
"""

from __future__ import annotations

import contextlib
import itertools
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from growtrain.model.expert_shards import expert_range
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
    # The group the results and the slots' gradients come back through, where it is not `group`:
    # under the interleaved schedule an expert rank receives the next call in `group`, on a
    # thread of its own, while it computes and sends this one's (`serve_calls`).
    back: Any = field(default=None, compare=False)

    def __post_init__(self):
        if self.combine not in ("overlapped", "serial"):
            raise ValueError(f"combine must be overlapped or serial, got {self.combine!r}")
        if not 1 <= self.attention < self.size:
            raise ValueError(f"an AF layout of {self.size} ranks needs 1..{self.size - 1} attention ranks, got {self.attention}")

    def __deepcopy__(self, memo) -> "AFGroup":
        return self  # a handle on the process group, shared by every copy of a model

    @property
    def returns(self):
        """The group the expert ranks' results and the slots' gradients travel back through."""
        return self.back if self.back is not None else self.group

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
# MoE layer, grad mode, slot dtype, autocast (0: off, else 1 + its dtype's index in _DTYPES)].
# The expert ranks follow the headers, so they need no copy of the attention ranks' schedule
# (forward, a forward without gradients, the reversible backward's recompute, the backwards in
# whatever order autograd runs them); the other attention ranks compare it with their own, so
# that ranks drifting apart fail at once, naming the call, instead of exchanging the wrong tensors.

FORWARD, BACKWARD, END = 1, 2, 3
_KINDS = {FORWARD: "forward", BACKWARD: "backward", END: "end"}
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_ids = itertools.count()


@dataclass
class AFClock:
    """Host seconds this process spent waiting on the other side since the last reset: on an
    attention rank inside its MoE calls (the transfers and the expert ranks' compute), on an
    expert rank for the next call (its header; served streamed, the receiving thread's next item:
    nothing to compute). Under NCCL the collectives run asynchronously, so on a GPU these are
    launch-side times, not the device's."""

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


def _autocast_code(device: torch.device) -> int:
    """This thread's autocast state for a header: 0 off, else 1 + the autocast dtype's index."""
    if not torch.is_autocast_enabled(device.type):
        return 0
    return 1 + _DTYPES.index(torch.get_autocast_dtype(device.type))


def _autocast(device: torch.device, code: int):
    """The attention ranks' autocast state on an expert rank, from the header's code: the same
    dtype (a bare torch.autocast would take the device's default, float16 on CUDA, and the results
    would travel in other bytes than the attention ranks read)."""
    return torch.autocast(device.type, dtype=_DTYPES[code - 1]) if code else contextlib.nullcontext()


def _describe(h) -> str:
    kind, call, layer = h[0], h[1], h[2]
    return f"{_KINDS.get(kind, kind)} of call {call} (MoE layer {layer})" if kind != END else "the end of the calls"


def _post_call(x_sorted_SD: torch.Tensor, af: AFGroup, send: list[int], out_dtype: torch.dtype) -> tuple[torch.Tensor, list]:
    """An attention rank's side of one MoE call, up to the results: the slots' dispatch and the
    combine's receives posted. Returns the results' buffer [S, D] and the works to wait on."""
    nothing = [0] * af.size
    sent_0D = x_sorted_SD.new_empty((0, x_sorted_SD.shape[1]))
    works = [dist.all_to_all_single(sent_0D, x_sorted_SD.contiguous(), nothing, send, group=af.group, async_op=True)]  # dispatch
    y_SD = x_sorted_SD.new_empty((sum(send), x_sorted_SD.shape[1]), dtype=out_dtype)
    if af.combine == "overlapped":
        # Every expert rank's rows, received as each is sent: its chunk of this rank's slots
        # lies contiguously in y_SD, in expert-rank order (the slots are sorted by expert).
        ops = [dist.P2POp(dist.irecv, part, group=af.returns, group_peer=src) for src, part in enumerate(y_SD.split(send)) if part.shape[0]]
        return y_SD, works + (dist.batch_isend_irecv(ops) if ops else [])
    empty_0D = x_sorted_SD.new_empty((0, x_sorted_SD.shape[1]), dtype=out_dtype)
    return y_SD, works + [dist.all_to_all_single(y_SD, empty_0D, send, nothing, group=af.returns, async_op=True)]


def _post_backward(grad_y: torch.Tensor, af: AFGroup, send: list[int], call: int, x_dtype: torch.dtype) -> tuple[torch.Tensor, list]:
    """An attention rank's side of one MoE call's backward, up to the slots' gradients: the
    results' gradients sent, the slots' gradients' receive posted (the buffer and the works)."""
    _header(af, grad_y.device, (BACKWARD, call, 0, 0, 0, 0))
    nothing = [0] * af.size
    sending = dist.all_to_all_single(grad_y.new_empty((0, grad_y.shape[1])), grad_y.contiguous(), nothing, send, group=af.group, async_op=True)
    grad_x = grad_y.new_empty((sum(send), grad_y.shape[1]), dtype=x_dtype)  # the slots' dtype, as the expert ranks send it
    receiving = dist.all_to_all_single(grad_x, grad_x.new_empty((0, grad_y.shape[1])), send, nothing, group=af.returns, async_op=True)
    return grad_x, [sending, receiving]


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
        grad_x, works = _post_backward(grad_y, ctx.af, ctx.send, ctx.call, ctx.x_dtype)
        for work in works:
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
    a recompute of G, the list that records its MoE calls; and whether it is replaying a
    checkpointed residual block's forward (`replaying`)."""

    turns: Any = None
    split: list | None = None
    replay: bool = False


in_flight = InFlight()


@contextlib.contextmanager
def replaying():
    """Around a checkpointed residual block's recompute (torch.utils.checkpoint's recompute
    context, model/reversible.py): the block's MoE calls are made again for their results only.
    The forward's calls were made with gradients and their backward runs from the forward's graph
    (`_AttentionSide`), so a replayed call asks the expert ranks for a forward without gradients
    and its results come back as a leaf: the recompute needs the values its saved tensors are cut
    from, not a second graph the expert ranks would keep and never see a backward for."""
    before = in_flight.replay
    in_flight.replay = True
    try:
        yield
    finally:
        in_flight.replay = before


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
        grad_x, works = _post_backward(grad_y, self.af, self.send, self.call, self.x.dtype)
        posted = time.perf_counter()
        in_flight.turns.switch()
        t1 = time.perf_counter()
        for work in works:
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
    grad = torch.is_grad_enabled() and x_sorted_SD.requires_grad
    replay = grad and in_flight.replay  # no backward will come for this call (`replaying`)
    grad = grad and not replay  # a backward will come
    _header(af, x_sorted_SD.device, (FORWARD, call, layer, int(grad), _DTYPES.index(x_sorted_SD.dtype), _autocast_code(x_sorted_SD.device)))
    counts_WE = exchange_counts(counts_E, af)
    send = [0] * W
    for f in range(af.expert_ranks):
        lo, hi = af.experts_of(f, E)
        send[A + f] = int(counts_E[lo:hi].sum())
    away = 0.0
    if in_flight.turns is not None:
        y_SD, away = _interleaved_call(x_sorted_SD, af, send, call, out_dtype, grad)
    elif replay:
        with torch.no_grad():
            y_SD = _AttentionSide.apply(x_sorted_SD, af, send, call, out_dtype)
        y_SD.requires_grad_(True)  # as the forward's were: the ops after it save what they saved then
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


def _expert_chunks(
    moe: nn.Module, x_recv_RD: torch.Tensor, counts_WE: torch.Tensor, recv: list[int], af: AFGroup, out_dtype: torch.dtype, sent: list
) -> list[torch.Tensor]:
    """An expert rank's compute of one call of MoE layer `moe`: each attention rank's chunk of the
    received slots through this rank's experts, one grouped call per source with its offsets.
    Under the overlapped combine each result leaves (isend) as soon as it is computed, while the
    next computes; (work, buffer) pairs go to `sent`, the buffer to outlive its send. Returns the
    results, one per attention rank."""
    lo, hi = af.experts(moe.num_experts)
    ys = []
    for a, chunk in enumerate(x_recv_RD.split(recv[: af.attention])):
        offsets_L1 = torch.zeros(hi - lo + 1, dtype=torch.long, device=chunk.device)
        offsets_L1[1:] = torch.cumsum(counts_WE[a, lo:hi].to(chunk.device), 0)
        ys.append(moe.experts(chunk, offsets_L1, moe.expert_backend).to(out_dtype))
        if af.combine == "overlapped" and ys[-1].shape[0]:
            buffer = ys[-1].detach().contiguous()
            sent.append((dist.isend(buffer, group=af.returns, group_dst=a), buffer))
    return ys


def _receive_sizes(moe: nn.Module, af: AFGroup, device: torch.device) -> tuple[torch.Tensor, list[int]]:
    """On an expert rank, a forward call's counts exchange: every rank's counts [W, E] and the rows
    this rank receives from each rank."""
    lo, hi = af.experts(moe.num_experts)
    counts_WE = exchange_counts(torch.zeros(moe.num_experts, dtype=torch.long, device=device), af)
    return counts_WE, [int(counts_WE[a, lo:hi].sum()) for a in range(af.attention)] + [0] * af.expert_ranks


def serve(moe: nn.Module, af: AFGroup, dtype: torch.dtype, device: torch.device) -> ExpertCall:
    """On an expert rank, after the call's header: this rank's side of one MoE call of the
    attention ranks (MoE layer `moe`, cut to this rank's experts), with autograd through both
    transfers. Gradients flow where grad mode is on, as on the attention ranks; `dtype`: the
    slots' dtype."""
    nothing = [0] * af.size
    counts_WE, recv = _receive_sizes(moe, af, device)
    empty_0D = torch.empty((0, moe.router.weight.shape[1]), dtype=dtype, device=device, requires_grad=torch.is_grad_enabled())
    x_recv_RD = all_to_all(empty_0D, recv, nothing, af.group)
    sent: list = []
    ys = _expert_chunks(moe, x_recv_RD, counts_WE, recv, af, chunk_dtype(x_recv_RD), sent)
    if af.combine == "overlapped":
        out_0D = _SentBack.apply({"works": [w for w, _ in sent], "recv": recv, "group": af.group, "size": af.size}, *ys)
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
    ends while another calls) are an error. A group whose results go back through a group of
    their own (AFGroup.back, the interleaved schedule) is served streamed (`_serve_streamed`)."""
    lanes = lanes if isinstance(lanes, list) else [lanes]
    if len(lanes) == 1 and lanes[0].back is not None:
        return _serve_streamed(moe_layers, lanes[0], device)
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
            with torch.set_grad_enabled(bool(grad)), _autocast(device, autocast):
                done = serve(moe_layers[layer], af, _DTYPES[dtype], device)
            served += 1
            if grad:
                pending[(lane, call)] = done
        if any(ended):
            if not all(ended):
                raise RuntimeError(f"AF layout: lanes {[i for i, e in enumerate(ended) if e]} ended the step while the others still call")
            if pending:
                raise RuntimeError(f"AF layout: the attention ranks ended the step with the backward of calls {sorted(c for _, c in pending)} not run")
            return served


# -- streamed serving (af_schedule: interleaved) -----------------------------------------------
#
# Two calls are in flight from the attention ranks, so an expert rank can take in the next while
# it computes this one: a receiving thread takes every header and every row that comes to the
# expert rank (the layout's group: counts, slots, the results' gradients) into an inbox, and the
# rank's own thread computes each call and sends its results and the slots' gradients back
# asynchronously through a group of their own (AFGroup.back), so that neither direction waits on
# the other or on the compute. Per call the expert ranks then take max(e, x) instead of e + x.
# Each thread's collectives are in a group of its own, in header order on every rank. The
# backward runs through a leaf (the received slots), not through the transfers: the gradients of
# the results come from the inbox, the slots' gradients leave by an all_to_all in `back`.


@dataclass
class _Received:
    header: tuple[int, ...]
    rows: torch.Tensor | None = None  # the call's slots (forward) or its results' gradients (backward)
    counts_WE: torch.Tensor | None = None
    recv: list[int] = field(default_factory=list)


def _receive(moe_layers: list[nn.Module], af: AFGroup, device: torch.device, inbox: queue.Queue) -> None:
    """An expert rank's receiving thread: every call's header and rows, into `inbox`, until the
    end of the calls (or a failure, handed over in the inbox)."""
    try:
        if device.type == "cuda":  # a new thread starts on device 0
            torch.cuda.set_device(device)
        nothing = [0] * af.size
        backward_of: dict[int, tuple[list[int], torch.dtype, int]] = {}  # call -> its rows, its results' dtype, d_model
        while True:
            h = _header(af, device)
            kind, call, layer, grad, dtype, autocast = h
            if kind == END:
                inbox.put(_Received(h))
                return
            counts_WE = None
            if kind == BACKWARD:
                if call not in backward_of:
                    raise RuntimeError(f"AF layout: backward of call {call}, which was not served with gradients")
                recv, rows_dtype, d_model = backward_of.pop(call)
            else:
                counts_WE, recv = _receive_sizes(moe_layers[layer], af, device)
                rows_dtype, d_model = _DTYPES[dtype], moe_layers[layer].router.weight.shape[1]
                if grad:  # the results' gradients come in the results' dtype (chunk_dtype's)
                    backward_of[call] = (recv, _DTYPES[autocast - 1] if autocast else rows_dtype, d_model)
            rows = torch.empty((sum(recv), d_model), dtype=rows_dtype, device=device)
            dist.all_to_all_single(rows, rows.new_empty((0, rows.shape[1])), recv, nothing, group=af.group)
            inbox.put(_Received(h, rows, counts_WE, recv))
    except BaseException as e:  # noqa: BLE001 - raised by the serving thread
        inbox.put(e)


def _serve_streamed(moe_layers: list[nn.Module], af: AFGroup, device: torch.device) -> int:
    """serve_calls for a group whose results go back through `af.back` (the section above)."""
    inbox: queue.Queue = queue.Queue()
    receiver = threading.Thread(target=_receive, args=(moe_layers, af, device, inbox), name="growtrain-af-receive", daemon=True)
    receiver.start()
    nothing = [0] * af.size
    pending: dict[int, tuple[torch.Tensor, list[torch.Tensor]]] = {}  # call -> its slots (a leaf) and results
    sent: list = []  # (work, buffer) of the sends in flight
    served = 0
    while True:
        t0 = time.perf_counter()
        item = inbox.get()
        clock.wait_s += time.perf_counter() - t0
        if isinstance(item, BaseException):
            raise item
        kind, call, layer, grad, dtype, autocast = item.header
        if kind == END:
            break
        if kind == BACKWARD:
            x_RD, ys = pending.pop(call)
            torch.autograd.backward(ys, list(item.rows.split([y.shape[0] for y in ys])))
            grad_x = x_RD.grad if x_RD.grad is not None else torch.zeros_like(x_RD)
            work = dist.all_to_all_single(grad_x.new_empty((0, grad_x.shape[1])), grad_x, nothing, item.recv, group=af.returns, async_op=True)
            sent.append((work, grad_x))
        else:
            with torch.set_grad_enabled(bool(grad)), _autocast(device, autocast):
                x_RD = item.rows.requires_grad_(bool(grad))
                out_dtype = chunk_dtype(x_RD)
                ys = _expert_chunks(moe_layers[layer], x_RD, item.counts_WE, item.recv, af, out_dtype, sent)
            if af.combine == "serial":
                results = torch.cat(ys).detach()
                work = dist.all_to_all_single(results.new_empty((0, results.shape[1])), results, nothing, item.recv, group=af.returns, async_op=True)
                sent.append((work, results))
            served += 1
            if grad:
                pending[call] = (x_RD, ys)
        in_flight_sends = []
        for work, buffer in sent:
            if work.is_completed():
                work.wait()  # returns at once, or raises a failed send's error
            else:
                in_flight_sends.append((work, buffer))
        sent = in_flight_sends
    for work, _ in sent:
        work.wait()
    receiver.join()
    if pending:
        raise RuntimeError(f"AF layout: the attention ranks ended the step with the backward of calls {sorted(pending)} not run")
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
