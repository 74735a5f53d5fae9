"""Reversible backward over the coupling-block stack (DESIGN.md §5): flat activation memory in depth.

The forward runs every block without recording a graph and keeps only the final streams (y1, y2),
the stack's input streams (the first block is never inverted: see the forward) and, per MoE block,
its chosen experts [T, K] (stored as the narrowest integer type that holds the
expert ids: uint8 for up to 256 experts, so 32 MoE blocks add ~2 bytes per token-slot each). The
backward walks the blocks in reverse; for each block it recomputes G(y1) with grad enabled, inverts
x2 = y2 - G(y1), recomputes F(x2), inverts x1 = y1 - F(x2), and pushes the gradients through the
two small graphs it has just built. F and G are whatever modules the block holds (`block.f`,
`block.g`): their parameters are collected with `.parameters()` at call time, so LoRA adapters,
frozen 4-bit bases (no gradient asked for) and blocks inserted by growth need nothing special.

- Routing: recompute passes the forward's expert indices back to the MoE layer, so top-k is never
  re-run: a changed balancing bias or bf16 noise cannot flip an expert between forward and
  backward. Gates, the load-balance loss and the z-loss are recomputed from the same router
  weights and the same indices, so they equal the forward's.
- Aux losses: each MoE block's aux loss is an output of the autograd function; its incoming
  gradient is pushed through G together with the stream gradient, so the router gets gradient
  from both the gates and the aux loss, as with plain autograd.
- Autocast: the forward's autocast state (enabled, dtype, for the streams' device and the CPU) is
  captured and re-entered for the recompute, so F and G replay the same bf16 (or fp32) arithmetic.
  Streams stay fp32: the branches' outputs are cast to the stream dtype before they are added.
- Dropout: the model has none, so no RNG state is saved. A block holding an active nn.Dropout is
  refused rather than silently given a recompute that draws a different mask.
- The two halves, `forward_blocks` and `backward_blocks`, are also run by hand, outside this
  autograd function: the AF layout's interleaved passes (growtrain/model/af_interleaved.py) split
  each MoE block's G backward at its MoE call.
- torch.compile: dynamo cannot trace this function's backward (it calls autograd.grad on modules),
  so under a trace `reversible_blocks` calls the stack through a dynamo-disabled form: a compiled
  model graph-breaks around the block stack, compiles the embedding and the head, and runs the
  stack eagerly. The form is torch's own lazy mark (`torch._disable_dynamo`), taken only when
  `torch.compiler.is_compiling()`: outside a trace the stack does not load torch._dynamo (~2 s of
  imports), so `validate`, `plan`, `inspect` and a one-process run of a full-precision coupling
  model never load it (bitsandbytes and torch.utils.checkpoint do, where a run uses them). A
  process that joins a process group imports it before it does
  (parallel/distributed.import_before_group).

Legend: B batch, T sequence (or tokens), D d_model, K top-k.
"""

from __future__ import annotations

from contextlib import ExitStack, nullcontext
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from growtrain.model.af import replaying
from growtrain.model.moe import MoEStats


def autocast_state(device_type: str) -> list[tuple[str, bool, torch.dtype]]:
    """(device type, enabled, dtype) for the streams' device and the CPU, as the forward saw them."""
    types = [device_type] if device_type == "cpu" else [device_type, "cpu"]
    state = []
    for dev in types:
        if torch.amp.is_autocast_available(dev):
            state.append((dev, torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev)))
    return state


def replay_autocast(state: list[tuple[str, bool, torch.dtype]]) -> ExitStack:
    stack = ExitStack()
    for dev, enabled, dtype in state:
        stack.enter_context(torch.autocast(dev, dtype=dtype, enabled=enabled))
    return stack


def _compact_routing(idx_TK: torch.Tensor, num_experts: int | None) -> torch.Tensor:
    """Expert ids in the narrowest integer type that holds them (the MoE layer widens them back)."""
    if num_experts is None:
        return idx_TK
    for dtype in (torch.uint8, torch.int16, torch.int32):
        if num_experts - 1 <= torch.iinfo(dtype).max:
            return idx_TK.to(dtype)
    return idx_TK


def check_no_dropout(blocks: nn.ModuleList) -> None:
    for m in blocks.modules():
        if isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0 and m.training:
            raise NotImplementedError(
                "reversible blocks with active dropout would recompute a different mask; "
                "set model.reversible: false, or save and replay the RNG state per block"
            )


def _unique_trainable(module: nn.Module) -> list[nn.Parameter]:
    return [p for p in module.parameters() if p.requires_grad]


class _ReversibleStack(torch.autograd.Function):
    """Inputs: x1, x2, the blocks, the per-block parameter plan, then every trainable parameter of
    the blocks (so autograd routes their gradients through this node). Outputs: y1, y2, then one
    aux loss, one load and one [T, K] index tensor per MoE block."""

    @staticmethod
    def forward(ctx, x1, x2, blocks, plan, *params):
        ctx.blocks, ctx.plan, ctx.num_params = blocks, plan, len(params)
        ctx.params = params  # leaf parameters: held by reference, not through saved-tensor hooks
        ctx.autocast = autocast_state(x1.device.type)
        y1, y2, stats, routings = forward_blocks(blocks, x1, x2)
        ctx.num_moe = len(stats)
        # The stack's own inputs are kept too (two streams, whatever the depth): the first block's
        # outputs can dwarf the embedding streams (|x| ~13 -> |y| ~2e3 in a trained 4-block model),
        # and inverting it would leave ~1% fp32 error in x1 (eps * |y| / |x|), in every gradient of
        # that block and of the embedding.
        ctx.save_for_backward(y1, y2, x1, x2, *routings)
        loads, indices = [s.load for s in stats], [s.top_k_indices for s in stats]
        ctx.mark_non_differentiable(*loads, *indices)
        return (y1, y2, *(s.aux_loss for s in stats), *loads, *indices)

    @staticmethod
    def backward(ctx, dy1, dy2, *rest):
        y1, y2, in1, in2, *routings = ctx.saved_tensors
        saved = SavedStack(y1, y2, in1, in2, routings, ctx.autocast)
        dx1, dx2, grads = backward_blocks(ctx.blocks, ctx.plan, ctx.params, saved, dy1, dy2, rest[: ctx.num_moe])
        need_x1, need_x2 = ctx.needs_input_grad[:2]
        return (dx1 if need_x1 else None, dx2 if need_x2 else None, None, None, *grads)


def forward_blocks(blocks: nn.ModuleList, x1: torch.Tensor, x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, list[MoEStats], list[torch.Tensor]]:
    """The reversible forward, run without a graph (inside an autograd function, or under
    no_grad): the final streams, each MoE block's stats and its compact routing (what the
    backward keeps)."""
    stats, routings = [], []
    for block in blocks:
        x1, x2, s = block(x1, x2)
        if s is not None:
            stats.append(s)
            routings.append(_compact_routing(s.top_k_indices, getattr(block.g.ffn, "num_experts", None)))
    return x1, x2, stats, routings


@dataclass
class SavedStack:
    """What the reversible backward starts from: the final streams, the stack's input streams,
    the MoE blocks' routings and the forward's autocast state."""

    y1: torch.Tensor
    y2: torch.Tensor
    in1: torch.Tensor
    in2: torch.Tensor
    routings: list[torch.Tensor]
    autocast: list[tuple[str, bool, torch.dtype]]


def g_backward(block: nn.Module, y1: torch.Tensor, routing, dy2: torch.Tensor, d_aux, params: list[nn.Parameter], autocast) -> tuple[torch.Tensor, torch.Tensor | None, tuple]:
    """G's part of one block's backward: G(y1) recomputed with a graph, then (G's output,
    detached, for the inversion; d/dy1; d/dθ_G). d_aux: the block's aux loss gradient (MoE)."""
    with torch.enable_grad(), replay_autocast(autocast):
        y1_ = y1.detach().requires_grad_(True)
        g_out, stats = block.g(y1_, routing=routing)
        g_out = g_out.to(dy2.dtype)
    outs, outs_grad = [g_out], [dy2]
    if stats is not None and stats.aux_loss.requires_grad:
        outs.append(stats.aux_loss)
        outs_grad.append(d_aux.to(stats.aux_loss.dtype))
    got = torch.autograd.grad(outs, [y1_, *params], outs_grad, allow_unused=True)
    return g_out.detach(), got[0], got[1:]


GBackward = Callable[..., tuple[torch.Tensor, "torch.Tensor | None", tuple]]


def backward_blocks(
    blocks: nn.ModuleList, plan, params, saved: SavedStack, dy1: torch.Tensor, dy2: torch.Tensor, d_aux, g_part: GBackward = g_backward
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor | None]]:
    """The reversible backward over the stack, from the gradients of its final streams (and of
    each MoE block's aux loss): the gradients of its input streams and of `params` (None where
    none came). `g_part`: G's recompute and backward (AF's interleaved passes split it at the
    MoE call, growtrain/model/af_interleaved.py)."""
    y1, y2, in1, in2 = saved.y1, saved.y2, saved.in1, saved.in2
    grads: list[torch.Tensor | None] = [None] * len(params)
    moe_i = len(saved.routings)
    first = len(blocks) - 1  # the last one the backward reaches: its inputs are the saved ones
    for k, (block, (f_idx, g_idx)) in enumerate(zip(reversed(blocks), reversed(plan))):
        routing = aux_grad = None
        if block.is_moe:
            moe_i -= 1
            routing, aux_grad = saved.routings[moe_i], d_aux[moe_i]

        # G: y2 = x2 + G(y1). Its graph gives x2 and d/dy1, d/dθ_G (aux loss included).
        g_out, d_y1, got = g_part(block, y1, routing, dy2, aux_grad, [params[i] for i in g_idx], saved.autocast)
        with torch.no_grad():
            x2 = in2 if k == first else y2 - g_out
        if d_y1 is not None:
            dy1 = dy1 + d_y1
        _accumulate(grads, g_idx, got)
        del g_out, d_y1, got

        # F: y1 = x1 + F(x2). Its graph gives x1 and d/dx2, d/dθ_F.
        with torch.enable_grad(), replay_autocast(saved.autocast):
            x2_ = x2.detach().requires_grad_(True)
            f_out = block.f(x2_).to(y1.dtype)
        with torch.no_grad():
            x1 = in1 if k == first else y1 - f_out
        got = torch.autograd.grad(f_out, [x2_, *(params[i] for i in f_idx)], dy1, allow_unused=True)
        dx2 = dy2 if got[0] is None else dy2 + got[0]
        _accumulate(grads, f_idx, got[1:])
        del f_out, got

        y1, y2, dy1, dy2 = x1, x2.detach(), dy1, dx2
    return dy1, dy2, grads


def _accumulate(grads: list, indices: list[int], new: tuple) -> None:
    for i, g in zip(indices, new):
        if g is not None:
            grads[i] = g if grads[i] is None else grads[i] + g


def stack_plan(blocks: nn.ModuleList) -> tuple[list[nn.Parameter], list[tuple[list[int], list[int]]]]:
    """Every trainable parameter of the blocks once, and per block the indices of F's and G's."""
    params: list[nn.Parameter] = []
    where: dict[int, int] = {}

    def index(p: nn.Parameter) -> int:
        if id(p) not in where:
            where[id(p)] = len(params)
            params.append(p)
        return where[id(p)]

    plan = []
    for block in blocks:
        f_idx = [index(p) for p in _unique_trainable(block.f)]
        g_idx = [index(p) for p in _unique_trainable(block.g)]
        plan.append((f_idx, g_idx))
    return params, plan


def reversible_blocks(
    blocks: nn.ModuleList, x1: torch.Tensor, x2: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, list[MoEStats]]:
    """Run the coupling blocks with the reversible backward. Same results as `plain_blocks`; only
    the final streams and the MoE routing are kept for the backward. Under torch.compile the stack
    runs eagerly (`_not_traced`, the module docstring); outside a trace nothing touches dynamo."""
    if torch.compiler.is_compiling():
        return _not_traced(blocks, x1, x2)
    return _reversible_blocks(blocks, x1, x2)


def _reversible_blocks(
    blocks: nn.ModuleList, x1: torch.Tensor, x2: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, list[MoEStats]]:
    if len(blocks) == 0:
        return x1, x2, []
    check_no_dropout(blocks)
    params, plan = stack_plan(blocks)
    out = _ReversibleStack.apply(x1, x2, blocks, plan, *params)
    n = (len(out) - 2) // 3
    aux, loads, indices = out[2 : 2 + n], out[2 + n : 2 + 2 * n], out[2 + 2 * n :]
    stats = [MoEStats(aux_loss=a, load=l, top_k_indices=i) for a, l, i in zip(aux, loads, indices)]
    return out[0], out[1], stats


_not_traced = torch._disable_dynamo(_reversible_blocks)  # torch's lazy mark: dynamo is imported at its first call


def plain_blocks(
    blocks: nn.ModuleList, x1: torch.Tensor, x2: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, list[MoEStats]]:
    """The blocks in a plain loop (autograd stores every block's activations when grad is on)."""
    stats: list[MoEStats] = []
    for block in blocks:
        x1, x2, s = block(x1, x2)
        if s is not None:
            stats.append(s)
    return x1, x2, stats


def checkpointed_blocks(
    blocks: nn.ModuleList, x1: torch.Tensor, x2: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, list[MoEStats]]:
    """Residual blocks (not invertible) with activation checkpointing: each block keeps its input and
    is recomputed in backward. The recompute reuses the forward's routing, as the reversible
    backward does, so top-k cannot flip between the two (bf16 noise, GPU nondeterminism). In the
    AF layout the recompute's MoE calls fetch their results without a graph (af.replaying)."""
    from torch.utils.checkpoint import checkpoint

    check_no_dropout(blocks)
    stats: list[MoEStats] = []
    for block in blocks:
        routing: list[torch.Tensor] = []

        def run(a: torch.Tensor, b: torch.Tensor, block=block, routing=routing):
            y1, y2, s = block(a, b, routing=routing[0] if routing else None)
            if s is not None and not routing:
                routing.append(s.top_k_indices)
            return y1, y2, s

        x1, x2, s = checkpoint(run, x1, x2, use_reentrant=False, context_fn=lambda: (nullcontext(), replaying()))
        if s is not None:
            stats.append(s)
    return x1, x2, stats


@torch.no_grad()
def invert_blocks(
    blocks: nn.ModuleList, y1: torch.Tensor, y2: torch.Tensor, routings: list[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The stack's input streams reconstructed from its outputs (the reversible backward's inverse,
    without gradients): routings are the MoE blocks' [T, K] expert indices in block order. Runs
    under whatever autocast the caller has entered."""
    moe_i = len(routings)
    for block in reversed(blocks):
        routing = None
        if block.is_moe:
            moe_i -= 1
            routing = routings[moe_i]
        y2 = y2 - block.g(y1, routing=routing)[0].to(y2.dtype)
        y1 = y1 - block.f(y2).to(y1.dtype)
    return y1, y2
