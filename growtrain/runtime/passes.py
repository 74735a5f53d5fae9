"""A training step's forward and backward passes and the held-out evaluation, in every layout: one
process or expert-parallel (each rank its rows of a batch), and AF, whose expert ranks serve the
attention ranks' MoE calls and whose interleaved schedule puts two micro-batches in flight together
(model/af_interleaved.py).

Shape legend: B batch rows, T sequence length.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from growtrain.data.corpus import TokenStream
from growtrain.model import GrowLM
from growtrain.model.af import end_calls, serve_calls
from growtrain.model.af_interleaved import in_pairs, interleaved_passes
from growtrain.parallel.distributed import Dist
from growtrain.recipe import StageConfig


def host_to_device(device: torch.device, batch: torch.Tensor) -> torch.Tensor:
    """A host batch on the training device: pinned and copied without blocking the host."""
    if device.type == "cpu":
        return batch
    return batch.pin_memory().to(device, non_blocking=True)


def forward_loss(model: GrowLM, inputs_BT, targets_BT, precision: str):
    """Cross-entropy and aux loss of one micro-batch (a module-level function so tests can fake it)."""
    with torch.autocast(inputs_BT.device.type, dtype=torch.bfloat16, enabled=precision == "bf16"):
        out = model(inputs_BT)
    ce = F.cross_entropy(out.logits.float().flatten(0, 1), targets_BT.flatten())
    return ce, out.aux_loss.float(), out.moe_stats


def evaluate(model: GrowLM, batches, precision: str, pairs_on: torch.device | None = None) -> float:
    """The mean loss over `batches`. `pairs_on`: an AF attention rank's device under af_schedule:
    interleaved, where the batches go two at a time, in flight together (model/af_interleaved.py)."""

    def loss(x, y) -> torch.Tensor:
        with torch.no_grad():  # here, not around evaluate: grad mode is per thread, and in_pairs runs threads
            return forward_loss(model, x, y, precision)[0].double()

    model.eval()
    if pairs_on is None:
        losses = [loss(x, y) for x, y in batches]
    else:
        losses = in_pairs([lambda x=x, y=y: loss(x, y) for x, y in batches], pairs_on)
    model.train()
    values = torch.stack(losses).tolist()  # one host sync
    return sum(values) / len(values)


def eval_loss(model, dist: Dist, evals, precision: str, device: torch.device) -> float:
    """This rank's eval loss; an AF expert rank serves the attention ranks' calls (and counts 0),
    which under af_schedule: interleaved make two batches at a time."""
    if dist.is_expert_side:
        serve_calls(model.moe_layers, dist.af_lanes, device)
        return 0.0
    loss = evaluate(model, evals, precision, device if dist.interleaved else None)
    if dist.af is not None:
        end_calls(dist.af_lanes[0], device)
    return loss


def micro_batches(model, stream: TokenStream, stage: StageConfig, rows, precision: str, dist: Dist, device: torch.device):
    """The step's micro-batches, each's (cross-entropy, aux loss, MoE stats) once its backward
    has run. AF interleaved: two at a time, in flight together (model/af_interleaved.py)."""
    if not dist.interleaved:
        for _ in range(stage.grad_accum):
            inputs, targets = stream.next_batch(stage.batch_size, stage.seq_len, rows)
            ce, aux, stats = forward_loss(model, host_to_device(device, inputs), host_to_device(device, targets), precision)
            ((ce + aux) / stage.grad_accum).backward()
            yield ce, aux, stats
        return
    for first in range(0, stage.grad_accum, 2):
        batches = [stream.next_batch(stage.batch_size, stage.seq_len, rows) for _ in range(min(2, stage.grad_accum - first))]
        yield from interleaved_passes(model, [(host_to_device(device, x), host_to_device(device, y)) for x, y in batches], precision, stage.grad_accum, device)
