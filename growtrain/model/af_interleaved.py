"""Two micro-batches in flight on every attention rank of an AF layout (`distributed.af_schedule:
interleaved`; the planner's own AF model, max(a, e, x)): while the expert ranks compute one
micro-batch's MoE call, the attention rank computes the other's attention up to its next call,
and the transfers of both run.

Each micro-batch's pass (`reversible_pass`) runs in a thread of its own, and `Turns` lets one
thread run at a time: a MoE call posts its dispatch and the combine's receives, hands over at
`switch()` and waits for its results when its turn comes back (growtrain/model/af.py:
`_interleaved_call`). The hand-overs are the same on every attention rank (the passes are
the same program on as many rows), so the MoE calls reach the expert ranks in one order, which
they follow by the headers as under the sequential schedule; they serve them streamed
(af._serve_streamed: the next call taken in by a thread of their own while they compute the
current one, the results sent back asynchronously through a group of their own).

The reversible stack is run by hand here (reversible.forward_blocks / backward_blocks), not
through its autograd function, so that no hand-over happens inside the autograd engine: on CUDA
the engine runs a device's backward on one worker thread, which both passes share, and a pass
waiting there for its turn would stop the other. The backward of each MoE block's G is split at
its MoE call (`split_g_backward`): the recompute gets the expert outputs as a leaf; one engine
call gives that leaf's gradient (with d/dy1 and d/dθ through the router, the gates and the shared
expert); it goes to the expert ranks, the other pass runs, the slots' gradients come back, and a
second engine call pushes them through the dispatch to y1 and the router. The two parts sum to
the whole G backward (fp32 rounding apart: the norm's backward runs once per part).

Per MoE block a pass makes three calls (forward, recompute, backward), each with one hand-over.
With a the attention ranks' compute between calls, e the expert ranks' compute of one call and
x its transfers (each way, running while both sides compute), the period of two calls (one per
pass) is 2·max(a, e, x), the planner's AF model: the expert ranks idle max(0, max(a, x) - e) per
call, the attention ranks wait max(0, max(e, x) - a). Fill: a pass's first call waits for nothing
of the other; drain: its last call's results have nothing left to overlap with.

An evaluation's batches go in pairs too (`in_pairs`: forwards only, one call per MoE block).

Micro-batches go in pairs (the stage's grad_accum of them, so the gradients and the balance
loss are the co-located run's; an odd last one runs alone). Gradients accumulate into .grad in
the order the passes reach them, the same on every run: a resume repeats the losses bit for bit.

Legend: B batch, T sequence.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from growtrain.model.af import in_flight
from growtrain.model.reversible import SavedStack, autocast_state, backward_blocks, check_no_dropout, forward_blocks, replay_autocast, stack_plan


class PassAbandoned(RuntimeError):
    """Raised in a pass whose partner failed (the partner's error is the one reported)."""


class Turns:
    """Runs functions in threads of their own, one at a time: the running one hands over at
    `switch()` to the next still running (round robin); one that returns or fails hands over too.
    `run` returns their results in order, or raises the first failure."""

    def __init__(self, device: torch.device):
        self.device = device
        self._cond = threading.Condition()
        self._turn = 0
        self._running: list[int] = []
        self._error: BaseException | None = None
        self.handovers = 0  # at switch() to another running thread

    def run(self, fns: list[Callable[[], Any]]) -> list:
        results: list = [None] * len(fns)
        self._running, self._turn, self._error = list(range(len(fns))), 0, None
        threads = [threading.Thread(target=self._worker, args=(i, fn, results), name=f"growtrain-pass-{i}", daemon=True) for i, fn in enumerate(fns)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if self._error is not None:
            raise self._error
        return results

    def _worker(self, i: int, fn: Callable[[], Any], results: list) -> None:
        in_flight.turns, in_flight.index = self, i
        try:
            if self.device.type == "cuda":  # a new thread starts on device 0
                torch.cuda.set_device(self.device)
            self._wait(i)
            results[i] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to run(), which raises it
            with self._cond:
                if self._error is None:
                    self._error = e
        finally:
            with self._cond:
                self._running.remove(i)
                if self._running:
                    self._turn = self._next(i)
                self._cond.notify_all()
            in_flight.turns = None

    def _next(self, i: int) -> int:
        later = [j for j in self._running if j > i]
        return (later or self._running)[0]

    def _wait(self, i: int) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._turn == i or self._error is not None)
            if self._error is not None:
                raise PassAbandoned("the other micro-batch in flight failed")

    def switch(self) -> None:
        """Called by the running thread: let the next one run until it hands back."""
        i = in_flight.index
        with self._cond:
            if self._error is not None:
                raise PassAbandoned("the other micro-batch in flight failed")
            if self._running == [i]:
                return
            self._turn = self._next(i)
            self.handovers += 1
            self._cond.notify_all()
        self._wait(i)


def _add(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
    return b if a is None else a if b is None else a + b


def split_g_backward(block: nn.Module, y1: torch.Tensor, routing, dy2: torch.Tensor, d_aux, params: list[nn.Parameter], autocast):
    """reversible.g_backward with the backward split at the block's MoE call (module docstring)."""
    calls: list = []
    in_flight.split = calls
    try:
        with torch.enable_grad(), replay_autocast(autocast):
            y1_ = y1.detach().requires_grad_(True)
            g_out, stats = block.g(y1_, routing=routing)
            g_out = g_out.to(dy2.dtype)
    finally:
        in_flight.split = None
    outs, outs_grad = [g_out], [dy2]
    if stats is not None and stats.aux_loss.requires_grad:
        outs.append(stats.aux_loss)
        outs_grad.append(d_aux.to(stats.aux_loss.dtype))
    leaves = [c.y for c in calls]
    got = torch.autograd.grad(outs, [y1_, *params, *leaves], outs_grad, allow_unused=True, retain_graph=bool(calls))
    n = 1 + len(params)
    d_y1, d_params = got[0], list(got[1:n])
    for k, (call, grad_y) in enumerate(zip(calls, got[n:])):
        grad_x = call.backward(torch.zeros_like(call.y) if grad_y is None else grad_y)
        more = torch.autograd.grad(call.x, [y1_, *params], grad_x, allow_unused=True, retain_graph=k < len(calls) - 1)
        d_y1 = _add(d_y1, more[0])
        d_params = [_add(a, b) for a, b in zip(d_params, more[1:])]
    return g_out.detach(), d_y1, tuple(d_params)


def reversible_pass(model: nn.Module, inputs_BT: torch.Tensor, targets_BT: torch.Tensor, precision: str, accum: int):
    """One micro-batch's forward and backward, the loss divided by `accum` (train.forward_loss,
    then the backward, with the reversible stack run by hand): its (cross-entropy, aux loss,
    MoE stats); the gradients accumulate into the parameters' .grad."""
    blocks = model.blocks
    check_no_dropout(blocks)
    params, plan = stack_plan(blocks)
    device_type = inputs_BT.device.type
    with torch.autocast(device_type, dtype=torch.bfloat16, enabled=precision == "bf16"):
        x1, x2 = model.embed_streams(inputs_BT)
        autocast = autocast_state(device_type)
        with torch.no_grad():
            y1, y2, stats, routings = forward_blocks(blocks, x1, x2)
        y1.requires_grad_(True)
        y2.requires_grad_(True)
        out = model.head(y1, y2, stats)
    ce = F.cross_entropy(out.logits.float().flatten(0, 1), targets_BT.flatten())
    (ce / accum).backward()  # the head; the stack's final streams get their gradients
    d_aux = [torch.ones((), dtype=torch.float32, device=inputs_BT.device) / accum for _ in stats]  # as ((ce + aux) / accum) gives each
    saved = SavedStack(y1.detach(), y2.detach(), x1.detach(), x2.detach(), routings, autocast)
    dx1, dx2, grads = backward_blocks(blocks, plan, params, saved, y1.grad, y2.grad, d_aux, split_g_backward)
    with torch.no_grad():
        for p, g in zip(params, grads):
            if g is not None:
                p.grad = g if p.grad is None else p.grad.add_(g)
    torch.autograd.backward([x1, x2], [dx1, dx2])  # the embedding
    return ce.detach(), out.aux_loss.detach(), stats


def in_pairs(fns: list[Callable[[], Any]], device: torch.device) -> list:
    """Each of `fns` (forward passes: an evaluation's batches), two at a time in flight together,
    handing over at their MoE calls as the training passes do: their results, in order."""
    results: list = []
    for first in range(0, len(fns), 2):
        results += Turns(device).run(fns[first : first + 2])
    return results


def interleaved_passes(model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]], precision: str, accum: int, device: torch.device) -> list:
    """`reversible_pass` of each (inputs, targets) in `batches` (two: in flight together; one:
    alone), in batch order."""
    return Turns(device).run([lambda x=x, y=y: reversible_pass(model, x, y, precision, accum) for x, y in batches])
