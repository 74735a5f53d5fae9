"""Run by torchrun from tests/test_af.py: a whole reversible model (dense block, two MoE blocks) in
an attention/expert layout, the first A ranks attention ranks with their rows of the batch, the
others expert ranks that only follow the attention ranks' headers (growtrain/model/af.py
serve_calls): an evaluation of two micro-batches (forwards without gradients), then two
micro-batches of training forward and backward (the reversible backward recomputes each block,
MoE calls included), against one process running the whole batch. Rank 0 writes a JSON report
to argv[1]; argv[2] is A, argv[3] the expert format (full or nf4), argv[4] the precision (fp32 or
bf16), argv[5] the attention ranks' schedule of the micro-batches: sequential (one after the
other) or interleaved (two in flight, growtrain/model/af_interleaved.py)."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from af_layer_worker import write_report
from growtrain.parallel import collective_guard
from growtrain.parallel.distributed import import_before_group
from growtrain.model.expert_shards import is_expert_tensor
from growtrain.model import GrowLM
from growtrain.model.af import AFGroup, end_calls, serve_calls, shard_af_model
from growtrain.model.af_interleaved import Turns, reversible_pass
from growtrain.model.config import ExpertLoRAConfig, ModelConfig, MoEConfig
from growtrain.runtime.passes import evaluate, forward_loss


def count_handovers():
    """From now on, count the hand-overs of every Turns made: returns the count so far."""
    made = []
    init = Turns.__init__

    def recording(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append(self)

    Turns.__init__ = recording
    return lambda: sum(t.handovers for t in made)


def main(out: str, attention: str, expert_format: str, precision: str, schedule: str = "sequential") -> None:
    import_before_group()  # before the group, as the trainer does
    dist.init_process_group("gloo")
    guard_on = collective_guard.install_from_env(torch.device("cpu"))
    rank, W = dist.get_rank(), dist.get_world_size()
    # interleaved: the results come back through a group of their own, the expert ranks serving streamed
    back = dist.new_group(ranks=list(range(W))) if schedule == "interleaved" else None
    if back is not None:
        collective_guard.register_group(back, torch.device("cpu"))
    af = AFGroup(rank, W, int(attention), back=back)
    A = af.attention
    torch.manual_seed(0)
    moe = MoEConfig(num_experts=8, top_k=2, expert_hidden=32, expert_format=expert_format, lora=ExpertLoRAConfig(r=4))
    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=3, n_heads=2, n_kv_heads=1, ffn_hidden=64, moe=moe, moe_layers=(0, 2), reversible=True)
    reference = GrowLM(cfg)
    if expert_format == "nf4":  # nonzero B so the adapters take part
        with torch.no_grad():
            for layer in reference.moe_layers:
                for m in ("w_gate", "w_up", "w_down"):
                    getattr(layer.experts, f"{m}_lora_B").normal_(0, 0.02)
    state = reference.state_dict()
    B, T, M = 2, 8, 2  # rows per attention rank, sequence, micro-batches
    data = torch.randint(0, 64, (M, A * B, T + 1))

    def micro(m: int, rows: slice):
        return data[m, rows, :-1], data[m, rows, 1:]

    # One process, the whole batch: the mean over micro-batches of the loss over all rows.
    ref_losses = []
    ref_eval = evaluate(reference, [micro(m, slice(None)) for m in range(M)], precision)
    for m in range(M):
        ce, aux, _ = forward_loss(reference, *micro(m, slice(None)), precision)
        ((ce + aux) / M).backward()
        ref_losses.append(ce.item())
    ref_grads = {n: p.grad for n, p in reference.named_parameters() if p.grad is not None}

    model = GrowLM(cfg)
    model.load_state_dict(state)
    shard_af_model(model, af)
    errors: dict[str, float] = {}
    flags: dict[str, bool] = {}

    def rel(a, b):
        return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()

    if af.is_attention:
        rows = slice(rank * B, (rank + 1) * B)
        # an evaluation of the M micro-batches (interleaved: in flight together, as the trainer's)
        handovers = count_handovers()
        pairs_on = torch.device("cpu") if schedule == "interleaved" else None
        ev = torch.tensor([evaluate(model, [micro(m, rows) for m in range(M)], precision, pairs_on)], dtype=torch.float64)
        if schedule == "interleaved":  # each MoE call of each evaluation pass handed over to the other
            flags["eval_handed_over"] = handovers() == M * len(cfg.moe_layers)
        end_calls(af, torch.device("cpu"))
        losses = torch.zeros(M, dtype=torch.float64)
        if schedule == "interleaved":
            turns = Turns(torch.device("cpu"))
            passes = turns.run([lambda m=m: reversible_pass(model, *micro(m, rows), precision, M) for m in range(M)])
            for m, (ce, _, _) in enumerate(passes):
                losses[m] = ce.item()
            # each MoE call (forward, recompute, backward per MoE block and pass) handed over to the other pass
            flags["handed_over"] = turns.handovers == M * 3 * len(cfg.moe_layers)
        else:
            for m in range(M):
                ce, aux, _ = forward_loss(model, *micro(m, rows), precision)
                ((ce + aux) / M).backward()
                losses[m] = ce.item()
        end_calls(af, torch.device("cpu"))
    else:
        ev, losses = torch.zeros(1, dtype=torch.float64), torch.zeros(M, dtype=torch.float64)
        flags["eval_calls"] = serve_calls(model.moe_layers, af, torch.device("cpu")) == M * len(cfg.moe_layers)
        # Two micro-batches, each: the no-gradient forward, then every MoE block's recompute.
        flags["train_calls"] = serve_calls(model.moe_layers, af, torch.device("cpu")) == 2 * M * len(cfg.moe_layers)
    # The attention ranks' losses, each over its rows: their mean is the whole batch's.
    for t in (ev, losses):
        dist.all_reduce(t)
        t /= A
    errors["eval_loss"] = abs(ev.item() - ref_eval) / ref_eval
    errors["losses"] = max(abs(a - b) / b for a, b in zip(losses.tolist(), ref_losses))
    # Dense gradients: each attention rank's rows' share (their sum over A ranks, over A, as data
    # parallelism takes it); expert gradients: every row reaches them, so they hold A times the
    # mean's (a trainer divides by A, as by W under expert parallelism).
    for n, p in model.named_parameters():
        if is_expert_tensor(n):
            if not af.is_attention:
                lo, hi = af.experts(cfg.moe.num_experts)
                errors[n] = rel(p.grad / A, ref_grads[n][lo:hi])
            continue
        g = p.grad.clone() if (af.is_attention and p.grad is not None) else torch.zeros_like(p)
        dist.all_reduce(g)
        if n in ref_grads:
            errors[n] = rel(g / A, ref_grads[n])
    write_report(out, errors, flags, {"collective_checks": guard_on, "expert_tensors": sum(map(is_expert_tensor, ref_grads))})
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:6])
