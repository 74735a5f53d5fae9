"""Run by torchrun (or plainly, as one process) from tests/test_sharded_growth.py: a small MoE model
trained two steps, its experts and their optimizer state sharded over the ranks, grown on the
shards by a list of operators (stages/sharding.py) with every check on. Each rank writes
rank-R.json under argv[1]: the growth records (or the failed one), its verdict, its grown expert
tensors and dense tensors, and the optimizer state it holds (its expert slices, the dense
entries it owns).

argv[2]: the operators, JSON [[name, {args}], ...]; argv[3]: a mutation ("none"; "local_layout":
split and clone leave their children in the local order instead of moving them to their owners;
"wrong_copies": the last rank's clones declare half their copy count S; "whole": no mutation, clone_experts
and quantize_experts each applied to the whole model instead of one layer at a time); argv[4]
(optional, default 0): how many of the first ranks hold no expert, as an AF layout's attention
ranks while it grows (EPGroup.attention): they own the dense optimizer state, the others the experts.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from growtrain.parallel import collective_guard
from growtrain.parallel.distributed import import_before_group, zero1_owners
from growtrain.model.expert_shards import is_expert_tensor, slice_entry
from growtrain.model import GrowLM, ModelConfig
from growtrain.model.config import MoEConfig
from growtrain.model.expert_parallel import EPGroup, shard_experts
from growtrain.optim.adamw import ParamState
from growtrain.optim.registry import build_optimizer
from growtrain.recipe import GrowthStep, InvarianceConfig, OptimizerConfig
from growtrain.stages import GrowthCheckFailed, apply_growth, get_operator, plan_stage_models, sharding

V = 64


def tokens(seed: int, B: int = 4, T: int = 12) -> torch.Tensor:
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


def trained(cfg: ModelConfig, opt_cfg: OptimizerConfig):
    """The same model and optimizer state on every rank (seeded, one process's arithmetic)."""
    torch.manual_seed(0)
    model = GrowLM(cfg)
    opt = build_optimizer(dict(model.named_parameters()), opt_cfg)
    for k in range(2):
        x = tokens(100 + k)
        out = model(x[:, :-1])
        loss = F.cross_entropy(out.logits.flatten(0, 1), x[:, 1:].flatten()) + out.aux_loss
        opt.zero_grad()
        loss.backward()
        opt.clip_grad_norm(opt_cfg.grad_clip)
        opt.step(opt_cfg.lr)
    return model, opt.state


def main(out: str, ops_json: str, mutation: str, attention: str = "0") -> None:
    W = int(os.environ.get("WORLD_SIZE", "1"))
    rank = 0
    if W > 1:
        import_before_group()  # before the group, as the trainer does
        dist.init_process_group("gloo")
        collective_guard.install_from_env(torch.device("cpu"))  # the test sets GROWTRAIN_CHECK_COLLECTIVES=1
        rank = dist.get_rank()
    moe = MoEConfig(num_experts=4, top_k=2, expert_hidden=64, balance_bias_rate=0.01)
    cfg = ModelConfig(vocab_size=V, d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, ffn_hidden=64, moe=moe, moe_layers=(1,))
    opt_cfg = OptimizerConfig(lr=3e-3, grad_clip=1.0)
    model, state = trained(cfg, opt_cfg)
    ep = EPGroup(rank, W, attention=int(attention)) if W > 1 else None
    if ep is not None:
        shard_experts(model, ep)
        # As training keeps it: each rank its experts' slices (none on a rank without experts) and
        # the dense entries it owns (ZeRO-1 over the dense ranks).
        owners = zero1_owners(dict(model.named_parameters()), ep.dense_ranks)
        h = ep.holder()
        if h is None:  # no row of any expert entry; its shared numbers kept
            cut = lambda s: ParamState(**{k: v[:0] if isinstance(v, torch.Tensor) and v.ndim else v for k, v in vars(s).items()})  # noqa: E731
        else:
            cut = lambda s: ParamState(**slice_entry(vars(s), h, ep.expert_ranks))  # noqa: E731
        state = {n: cut(s) if is_expert_tensor(n) else s for n, s in state.items() if is_expert_tensor(n) or owners[n] == rank}
    if mutation == "local_layout":
        import growtrain.stages.operators.experts as experts

        experts.children_to_owners = lambda t, m, E: t
    if mutation == "wrong_copies":  # the last rank's clones declare half their copy count S
        import growtrain.stages.operators.experts as experts

        true_copies, last = experts.sibling_copies, rank == W - 1
        experts.sibling_copies = lambda *a: true_copies(*a) * (0.5 if last else 1.0)
    steps = [GrowthStep(name, get_operator(name).args_type(**args)) for name, args in json.loads(ops_json)]
    planned = plan_stage_models(cfg, [steps])[0]
    probe = (tokens(99), tokens(98))
    report = {"rank": rank, "world": W}
    try:
        with sharding.sharded(ep):
            outcome = apply_growth(
                model, state, steps, seed=0, stage_index=1, stage_name="grown", planned=planned, probe=probe,
                invariance_cfg=InvarianceConfig(stream=mutation != "whole"), optimizer_cfg=opt_cfg, lr=opt_cfg.lr,
            )
    except GrowthCheckFailed as exc:
        report.update(passed=False, records=[exc.record])
    else:
        report.update(passed=True, records=outcome.records)
        grown = outcome.model
        report["experts"] = {n: t.tolist() for n, t in grown.state_dict().items() if is_expert_tensor(n) and t.is_floating_point()}
        report["dense"] = {n: t.tolist() for n, t in grown.state_dict().items() if not is_expert_tensor(n) and t.is_floating_point()}
        report["owners"] = zero1_owners(dict(grown.named_parameters()), ep.dense_ranks if ep is not None else 1)
        report["state"] = {
            n: {k: (v.tolist() if isinstance(v, torch.Tensor) else v) for k, v in vars(s).items()}
            for n, s in outcome.optimizer_state.items()
        }
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / f"rank-{rank}.json").write_text(json.dumps(report, default=str))
    if W > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:5])
