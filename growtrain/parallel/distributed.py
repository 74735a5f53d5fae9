"""`growtrain run` under `torchrun --nproc-per-node N` (or `accelerate launch`): one process per
GPU (per CPU process on gloo), experts sharded over all of them, dense parameters data-parallel
(DESIGN.md §12). A single process gets `Dist()`, whose every method is a no-op.

What each rank does differently from a single process:
- data: every rank walks the same global stream and reads only its own rows of each batch
  (so the data cursor, and a resume at another EP size, do not depend on N);
- experts: rank r holds experts [r·E/N, (r+1)·E/N) of every MoE layer
  (growtrain/model/expert_parallel.py); their gradients come from every rank's tokens through the
  all-to-all and are only scaled (each expert has one replica, nothing to reduce);
- dense parameters: gradients all-reduced (mean); optimizer state sharded ZeRO-1 style (each
  dense parameter's moments live on one owner rank, which steps it and broadcasts the result);
- the clip norm is the global one (each rank's owned share of the squared norm, summed);
- growth runs on the expert shards where every operator of a transition can (stages/sharding.py:
  each rank grows its own experts, children move to their new ranks by all-to-all, the checks'
  verdicts are taken over all ranks; the optimizer state stays sharded, each dense entry mapped
  and stepped by its ZeRO-1 owner); otherwise it
  gathers the full model and optimizer state on every rank, runs the operators and their checks
  identically everywhere (seeded), and re-shards (see `gather_full`);
- checkpoints: rank 0 writes the dense state; each rank writes its experts' slices and its
  owned optimizer state into the same checkpoint (growtrain/checkpoint/store.py, growtrain/model/expert_shards.py);
- failures: a rank that fails writes its message under `run_dir/.rank-errors/`; the others, whose
  next collective then fails, report that message (or that a peer died) instead of hanging.

Under `distributed.layout: af` (growtrain/model/af.py) the ranks split in two: attention ranks
0..A-1 read the batch's rows (B / A each), hold everything but the routed experts, and reduce the
dense gradients and own their ZeRO-1 state among themselves (a group of their own); expert ranks
A..W-1 hold E / F of every MoE layer's experts (F = W - A) and nothing else (their dense tensors
are on the meta device: any use of one fails), read no data, and serve the attention ranks' MoE
calls. An expert's gradient sums every attention rank's tokens and is divided by A; the clip norm
sums every rank's owned share as above. Growth runs on the layout's shards (growth_ep: every rank,
the attention ranks holding no expert; the expert ranks hold a copy of the dense part meanwhile)
where every operator of the transition can, else it gathers the whole model. Under
`af_schedule: pingpong` the attention ranks form two lanes (even, odd ranks), each with a group of
its own holding every expert rank; an expert rank serves the lanes in turn (model/af.py); under
`af_schedule: interleaved` each attention rank keeps two micro-batches in flight
(model/af_interleaved.py) and the expert ranks serve the calls as they come, taking in the next
while they compute and send back the current one (its results through a group of their own).

Legend: W ranks.
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from growtrain.parallel import collective_guard
from growtrain.model.expert_shards import is_expert_tensor, slice_entry
from growtrain.model import GrowLM
from growtrain.model.af import AFGroup, shard_af_model
from growtrain.model.expert_parallel import EPGroup, shard_experts
from growtrain.optim.adamw import ParamState
from growtrain.optim.adamw8bit import packed_fields, with_packed
from growtrain.recipe import DistributedConfig, RecipeError


def world_size_problems(recipe, shapes, world_size: int) -> list[str]:
    """What a launch over `world_size` processes (expert parallelism: each rank trains
    batch_size / W rows and holds E / W experts; AF layout: each of the A attention ranks trains
    batch_size / A rows, each of the W - A expert ranks holds E / (W - A) experts) needs of the
    recipe, all problems at once;
    `shapes` are the stages' model configs (stages.plan_stage_models)."""
    W = world_size
    if W == 1:
        return []
    problems = []
    rows, experts, what, readers = W, W, "expert-parallel ranks", "ranks"
    if recipe.distributed.layout == "af":
        A = recipe.distributed.attention_ranks
        if not A < W:
            return [f"distributed.attention_ranks {A}: an AF layout of {W} ranks needs 1..{W - 1} attention ranks (the rest hold the experts)"]
        rows, experts, what, readers = A, W - A, "expert ranks", "attention ranks"
        if recipe.distributed.af_schedule == "pingpong" and A < 2:
            problems.append(f"distributed.af_schedule: pingpong needs 2+ attention ranks (two lanes), attention_ranks is {A}")
        if recipe.distributed.af_schedule == "interleaved":
            problems += interleaved_problems(recipe, shapes)
    for stage, shape in zip(recipe.stages, shapes):
        if stage.batch_size % rows:
            problems.append(f"stages '{stage.name}': batch_size {stage.batch_size} does not divide over {rows} {readers} (each trains its share of the rows)")
        if shape.moe is not None and shape.moe_layers and shape.moe.num_experts % experts:
            problems.append(f"stages '{stage.name}': {shape.moe.num_experts} experts do not divide over {experts} {what}")
    # AF grows on its shards too, in a group of every rank (Dist.growth_ep)
    if any(stage.grow for stage in recipe.stages) and recipe.invariance.probe_batch_size < W:
        problems.append(
            f"invariance.probe_batch_size {recipe.invariance.probe_batch_size} is smaller than the {W} ranks "
            "(growth on expert shards checks each rank on its share of the probe rows)"
        )
    return problems


def interleaved_problems(recipe, shapes) -> list[str]:
    """What af_schedule: interleaved (two micro-batches in flight, model/af_interleaved.py) needs
    of the recipe: the reversible stack (run by hand, split at the MoE calls) and, in every stage
    with MoE layers, two micro-batches per step to pair up."""
    problems = []
    if recipe.model.block == "residual":
        problems.append(
            "distributed.af_schedule: interleaved splits the coupling blocks' reversible backward at its MoE calls, which "
            "model.block: residual does not have; use af_schedule: sequential or pingpong (checkpointed or plain autograd)"
        )
    elif not recipe.model.reversible:
        problems.append("distributed.af_schedule: interleaved runs the reversible stack (model.reversible: true); use sequential or pingpong with plain autograd")
    for stage, shape in zip(recipe.stages, shapes):
        if shape.moe is not None and shape.moe_layers and stage.grad_accum < 2:
            problems.append(
                f"stages '{stage.name}': distributed.af_schedule: interleaved keeps two micro-batches of a step in flight, "
                f"grad_accum is {stage.grad_accum} (give 2+, e.g. half the batch_size and grad_accum 2)"
            )
    return problems


def resolve_attention_ranks(recipe, shapes, world_size: int):
    """`recipe` with distributed.attention_ranks: auto replaced by the planner's choice for
    `world_size` processes (the fastest split for the recipe's af_schedule that fits on the
    distributed.hardware preset, among those the recipe divides over: world_size_problems), and a
    line saying so; unchanged (and None) where there is nothing to resolve. RecipeError where no
    split works."""
    from dataclasses import replace

    cfg = recipe.distributed
    if cfg.layout != "af" or cfg.attention_ranks != "auto" or world_size < 2:
        return recipe, None
    from growtrain.planning import PlanError, get_hardware, plan_recipe
    from growtrain.planning.af_measured import predict

    try:
        plan = plan_recipe(recipe, get_hardware(cfg.hardware, gpus_per_node=world_size, nodes=1))
    except PlanError as exc:
        raise RecipeError([f"distributed.attention_ranks: auto: the planner cannot place the recipe on {world_size} x {cfg.hardware}: {exc}"]) from None
    if not plan.af.applicable:
        raise RecipeError([f"distributed.attention_ranks: auto: no AF split to choose ({plan.af.reason}); give a number"])
    tried = []
    step = {split.attention_gpus: predict(split, cfg.af_schedule).step_s for split in plan.af.splits}
    for split in sorted(plan.af.splits, key=lambda s: (not s.fits, step[s.attention_gpus])):
        chosen = replace(recipe, distributed=replace(cfg, attention_ranks=split.attention_gpus))
        problems = world_size_problems(chosen, shapes, world_size)
        if not problems:
            return chosen, (
                f"distributed.attention_ranks: auto -> {split.attention_gpus} (the planner's {'fastest' if not tried else 'fastest workable'} split on "
                f"{world_size} x {cfg.hardware}, stage '{plan.af.stage}', {cfg.af_schedule} schedule: {step[split.attention_gpus]:.3g} s per step"
                f"{'' if split.fits else ', over capacity'}; co-located expert parallelism: {plan.af.colocated_step_time_s:.3g} s)"
            )
        tried.append(f"{split.attention_gpus} attention ranks: {problems[0]}")
    raise RecipeError(["distributed.attention_ranks: auto: no split of the ranks works for this recipe"] + tried)


class PeerFailed(Exception):
    """Another rank failed or died; this rank stopped with its message."""


_STATE_FIELDS = ("step", "exp_avg", "exp_avg_sq", "lr_mult", "wd_mult", "eps_mult", "norm_mult")


def import_before_group() -> None:
    """Import torch._dynamo now, before this process joins a process group. growtrain never
    imports it by itself (model/reversible.py), but torch does at the first use of some functions
    (torch.utils.checkpoint, torch.optim, random ops on meta tensors), and imported then, inside a
    gloo job, it has aborted a rank at exit ("terminate called without an active exception", seen
    twice, commit 637dc61). Every process that makes a group calls this first: the trainer
    (Dist.from_env), and the tests' and benchmarks' workers."""
    importlib.import_module("torch._dynamo")


class Dist:
    """One process's view of the run's processes. `Dist()` is the single-process case."""

    def __init__(
        self, rank: int = 0, size: int = 1, combine: str = "overlapped", attention: int | None = None, dense_group=None, lanes: list | None = None,
        back=None,
    ):
        self.rank, self.size = rank, size
        # layout: af: this rank's place, and the attention ranks' group (dense gradients, ZeRO-1);
        # `back`: the group the MoE calls' results come back through (AFGroup.back), if their own
        self.af = AFGroup(rank, size, attention, combine=combine, back=back) if attention is not None else None
        self.dense_group = dense_group
        # The groups this rank's MoE calls go through: the layout's, or under af_schedule:
        # pingpong its lane's (an attention rank) or every lane's, served in turn (an expert rank).
        self.af_lanes: list[AFGroup] = lanes or ([self.af] if self.af is not None else [])
        self.pingpong = bool(lanes)
        self.interleaved = False  # af_schedule: interleaved (from_env): two micro-batches in flight on an attention rank
        self.ep = EPGroup(rank, size, combine) if size > 1 and self.af is None else None
        self._host_ep: EPGroup | None = None  # growth on the host's group, made at its first use
        # AF: growth on shards runs in every rank's group, the experts where the layout keeps them.
        self._growth_ep = EPGroup(rank, size, combine, attention=attention) if self.af is not None else None
        self.timeout: datetime.timedelta | None = None  # distributed.timeout_s, for groups made later
        self.error_dir: Path | None = None
        self.owner_table: dict[str, int] = {}  # of the current model, set by owned()
        # Where collectives' own tensors live: NCCL takes CUDA tensors only.
        self.device = torch.device("cuda", torch.cuda.current_device()) if size > 1 and dist.get_backend() == "nccl" else torch.device("cpu")

    @classmethod
    def from_env(cls, cfg: DistributedConfig) -> "Dist":
        """Joins the process group torchrun / accelerate described in the environment, if any."""
        size = int(os.environ.get("WORLD_SIZE", "1"))
        if size == 1:
            return cls()
        import_before_group()
        if not dist.is_initialized():
            backend = "nccl" if torch.cuda.is_available() else "gloo"
            if backend == "nccl":
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            dist.init_process_group(backend, timeout=datetime.timedelta(seconds=cfg.timeout_s))
        # The launcher stops the survivors with SIGTERM when a rank dies: say so, not a bare kill.
        if threading_main():
            signal.signal(signal.SIGTERM, _raise_peer_failed)
        attention = dense_group = lanes = back = None
        rank = dist.get_rank()
        if cfg.layout == "af":
            attention = cfg.attention_ranks
            if attention == "auto":
                raise RecipeError(["distributed.attention_ranks: auto is resolved by resolve_attention_ranks before the process group is joined"])
            if not attention < size:
                raise RecipeError([f"distributed.attention_ranks {attention}: an AF layout of {size} ranks needs 1..{size - 1} attention ranks"])
            if cfg.af_schedule == "pingpong" and attention < 2:
                raise RecipeError([f"distributed.af_schedule: pingpong needs 2+ attention ranks (two lanes), attention_ranks is {attention}"])
            dense_group = dist.new_group(ranks=list(range(attention)))  # every rank takes part in making each group
            if cfg.af_schedule == "pingpong":
                lanes = []
                for lane in (0, 1):  # the even and the odd attention ranks, each lane with every expert rank
                    members = [a for a in range(attention) if a % 2 == lane] + list(range(attention, size))
                    group = dist.new_group(ranks=members)
                    if rank in members:
                        lanes.append(AFGroup(members.index(rank), len(members), len(members) - (size - attention), group, cfg.combine))
            if cfg.af_schedule == "interleaved":  # the expert ranks receive the next call while they send this one's (af.serve_calls)
                back = dist.new_group(ranks=list(range(size)))
        d = cls(rank, dist.get_world_size(), cfg.combine, attention, dense_group, lanes, back)
        d.interleaved = cfg.layout == "af" and cfg.af_schedule == "interleaved"
        d.timeout = datetime.timedelta(seconds=cfg.timeout_s)
        collective_guard.install_from_env(d.device)  # GROWTRAIN_CHECK_COLLECTIVES=1: NCCL's rules on any backend
        for group in [dense_group, back] + [lane.group for lane in lanes or []]:
            if group is not None:
                collective_guard.register_group(group, d.device)
        return d

    @property
    def active(self) -> bool:
        return self.size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def is_expert_side(self) -> bool:
        """An AF layout's expert rank: it holds routed experts only and reads no data."""
        return self.af is not None and not self.af.is_attention

    @property
    def data_ranks(self) -> int:
        """How many ranks read rows of each batch and hold the dense parameters' state."""
        return self.af.attention if self.af is not None else self.size

    def expert_shard(self) -> tuple[int, int] | None:
        """Which routed experts this rank loads from a checkpoint (load_checkpoint): (rank, size)
        of the expert-parallel layout, or None on an AF attention rank."""
        if self.af is None:
            return self.rank, self.size
        return None if self.af.is_attention else (self.rank - self.af.attention, self.af.expert_ranks)

    def describe(self) -> str:
        if self.af is not None:
            schedule = (
                ", ping-pong schedule (two lanes)" if self.pingpong
                else ", interleaved schedule (two micro-batches in flight)" if self.interleaved else ", sequential schedule"
            )
            return f"AF layout: {self.af.attention} attention + {self.af.expert_ranks} expert ranks{schedule}, {self.af.combine} combine"
        return f"expert parallelism: {self.size} processes, {self.ep.combine} combine"

    def close(self) -> None:
        if self.active and dist.is_initialized():
            dist.destroy_process_group()

    # -- data ------------------------------------------------------------------------------------

    def row_range(self, batch_size: int) -> tuple[int, int]:
        """This rank's rows [r0, r1) of a global batch (the recipe checks that batch sizes divide by W)."""
        if not self.active:
            return 0, batch_size
        if self.is_expert_side:
            return 0, 0
        n = batch_size // self.data_ranks
        return self.rank * n, (self.rank + 1) * n

    def mean(self, *values: float) -> list[float]:
        """Each value averaged over the ranks that read data (one all-reduce for all of them; an
        AF expert rank's values count for nothing)."""
        if not self.active:
            return list(values)
        return self.mean_tensor(torch.tensor(values, dtype=torch.float64, device=self.device)).tolist()

    def mean_tensor(self, t: torch.Tensor) -> torch.Tensor:
        """`t` averaged over the ranks that read data, on its device, without a host sync."""
        if not self.active:
            return t
        t = t.detach().clone()
        if self.is_expert_side:
            t.zero_()
        dist.all_reduce(t)
        return t / self.data_ranks

    def af_means(self, ce: torch.Tensor, aux: torch.Tensor, wait_fraction: float, busy_s: float) -> list[torch.Tensor]:
        """AF layout, in one all-reduce: the losses averaged over the attention ranks; the
        attention ranks' mean share of the passes spent waiting on the experts and the expert
        ranks' mean share spent idle (`wait_fraction`: this rank's); the attention ranks' and the
        expert ranks' mean seconds of the passes not waiting (`busy_s`: this rank's)."""
        mine = [wait_fraction, 0.0, busy_s, 0.0] if self.af.is_attention else [0.0, wait_fraction, 0.0, busy_s]
        v = torch.stack([ce.double(), aux.double(), *torch.tensor(mine, dtype=torch.float64, device=ce.device)])
        dist.all_reduce(v)
        A, F = self.af.attention, self.af.expert_ranks
        return list((v / torch.tensor([A, A, A, F, A, F], dtype=torch.float64, device=v.device)).unbind(0))

    def sum_tensor(self, t: torch.Tensor) -> torch.Tensor:
        """`t` summed over the ranks, on its device, without a host sync."""
        if not self.active:
            return t
        t = t.detach().clone()
        dist.all_reduce(t)
        return t

    def all_problems(self, mine: list[str]) -> list[str]:
        """Every rank's problem messages (a checkpoint's verification, each rank hashing its share
        of the files), in rank order, so that all ranks reach the same verdict."""
        if not self.active:
            return mine
        every: list = [None] * self.size
        dist.all_gather_object(every, list(mine))  # strings only: NCCL-safe
        return list(dict.fromkeys(p for problems in every for p in problems))  # sizes are checked by all

    def any_rank(self, flag: bool) -> bool:
        """Whether `flag` holds on any rank (a collective): a choice every rank must make alike."""
        if not self.active:
            return flag
        t = torch.tensor([float(flag)], device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    def growth_ep(self) -> EPGroup | None:
        """The group growth on shards runs in (stages/sharding.py): the expert-parallel group, or in
        an AF layout every rank, the first A holding no routed expert (EPGroup.attention)."""
        return self._growth_ep if self.af is not None else self.ep

    def host_ep(self) -> EPGroup:
        """growth_ep's ranks in a gloo group, for growth on the host, whose collectives take CPU
        tensors (NCCL's take CUDA tensors only). Made at its first use, by every rank (a collective)."""
        if self._host_ep is None:
            group = dist.new_group(backend="gloo", timeout=self.timeout)
            collective_guard.register_group(group, "cpu")
            self._host_ep = dataclasses.replace(self.growth_ep(), group=group)
        return self._host_ep

    def barrier(self) -> None:
        if self.active:
            dist.barrier()

    # -- parameters and optimizer state ----------------------------------------------------------

    def owners(self, named_params: dict[str, nn.Parameter]) -> dict[str, int]:
        return zero1_owners(named_params, self.data_ranks)

    def owned(self, named_params: dict[str, nn.Parameter]) -> dict[str, nn.Parameter]:
        """What this rank's optimizer steps: its experts and the dense parameters it owns (in an
        AF layout an attention rank owns no expert, an expert rank no dense parameter)."""
        if not self.active:
            return named_params
        self.owner_table = self.owners(named_params)  # what broadcast_dense sends, until the next growth
        if self.is_expert_side:
            return {n: p for n, p in named_params.items() if is_expert_tensor(n)}
        return {n: p for n, p in named_params.items() if (is_expert_tensor(n) and self.af is None) or self.owner_table.get(n) == self.rank}

    def sync_grads(self, model: nn.Module) -> None:
        """Mean over ranks (mean_grads) of the trainable parameters' gradients; in an AF layout the
        dense ones over the attention ranks, the experts' (every attention rank's tokens) divided by A."""
        if not self.active:
            return
        named = {n: p for n, p in model.named_parameters() if p.requires_grad}
        if self.af is None:
            mean_grads(named, self.size, self.device)
        elif self.is_expert_side:
            scale_expert_grads({n: p for n, p in named.items() if is_expert_tensor(n)}, self.af.attention)
        else:
            mean_grads({n: p for n, p in named.items() if not is_expert_tensor(n)}, self.af.attention, self.device, group=self.dense_group)

    def global_loads(self, loads: list[torch.Tensor]) -> list[torch.Tensor]:
        """The MoE layers' loads over the whole batch (the balance biases' update): under the
        ping-pong schedule each lane's calls count its lane's tokens only, so the lanes' loads are
        summed (each rank's share 1 / its lane's size, in the attention ranks' group)."""
        if not self.pingpong or self.is_expert_side or not loads:
            return loads
        flat = torch.stack(loads) / self.af_lanes[0].attention
        dist.all_reduce(flat, group=self.dense_group)
        return list(flat.unbind(0))

    def sum_squares(self, sq: torch.Tensor) -> torch.Tensor:
        """The global squared gradient norm from each rank's owned share."""
        if self.active:
            sq = sq.detach().to(self.device, torch.float64).reshape(1).clone()  # (a rank without gradients has a CPU zero)
            dist.all_reduce(sq)
            sq = sq.reshape(())
        return sq

    @torch.no_grad()
    def broadcast_dense(self, model: nn.Module) -> None:
        """After the step: each owner sends the dense parameters it stepped to every rank."""
        if not self.active or self.is_expert_side:
            return
        named = dict(model.named_parameters())
        table = self.owner_table
        for owner in range(self.data_ranks):  # AF: attention rank a is global rank a
            params = [named[n] for n in sorted(table) if table[n] == owner]
            if not params:
                continue
            flat = torch.cat([p.detach().reshape(-1).float() for p in params])
            dist.broadcast(flat, src=owner, group=self.dense_group)
            offset = 0
            for p in params:
                p.copy_(flat[offset : offset + p.numel()].view_as(p))
                offset += p.numel()

    # -- growth on an AF layout's shards ---------------------------------------------------------

    @torch.no_grad()
    def af_to_growth(self, model: nn.Module) -> nn.Module:
        """An AF model made ready to grow on its shards in growth_ep, in place, by collectives of
        the default group: an expert rank's dense tensors (on meta) filled from attention rank 0,
        one tensor in flight at a time (the dense part is what a co-located rank holds all along);
        every MoE layer exchanging through growth_ep instead of calling the expert ranks."""
        ep = self.growth_ep()
        where = next((p.device for p in model.parameters() if not p.is_meta), self.device)  # the model's device
        for prefix, module in model.named_modules():
            for table in (module._parameters, module._buffers):
                for key, t in list(table.items()):
                    name = f"{prefix}.{key}" if prefix else key
                    if t is None or on_expert_side(name):
                        continue
                    buf = broadcast_field(t if self.rank == 0 else None, _TensorLayout(tuple(t.shape), t.dtype), 0, self.device)
                    if self.is_expert_side:  # the attention ranks hold these bits already
                        value = buf.to(where)
                        table[key] = nn.Parameter(value, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else value
        for moe in model.moe_layers:
            moe.af, moe.ep = None, ep
        return model

    def af_growth_state(self, state: dict, device: torch.device) -> dict:
        """This rank's optimizer state (name-keyed ParamState) for growth on the AF layout's
        shards: on an attention rank, with empty slices (on `device`) of the expert entries, as
        every rank holds them on expert shards, their shared step counts and multipliers from the
        first expert rank (a collective). The same dict, added to."""
        first = self.af.attention  # the first expert rank, global rank A
        layouts = [{n: {k: _layout(getattr(s, k)) for k in _STATE_FIELDS} for n, s in state.items() if is_expert_tensor(n)} if self.rank == first else None]
        dist.broadcast_object_list(layouts, src=first)  # names, shapes and numbers: no tensor
        for name, fields in sorted(layouts[0].items()):
            entry = {}
            for k, lay in fields.items():
                if not isinstance(lay, _TensorLayout):
                    entry[k] = lay
                elif lay.shape:  # per expert: no row here
                    entry[k] = torch.empty((0, *lay.shape[1:]), dtype=lay.dtype, device=device)
                else:  # a 0-d field shared by the expert slices
                    entry[k] = broadcast_field(getattr(state[name], k) if self.rank == first else None, lay, first, self.device).to(device)
            if self.af.is_attention:
                state[name] = ParamState(**entry)
        return state

    def af_from_growth(self, model: nn.Module) -> nn.Module:
        """A model grown on the AF layout's shards back in the layout, in place: an expert rank's
        dense tensors to meta again, every MoE layer calling the expert ranks (of its lane)."""
        if self.is_expert_side:
            to_meta_except_experts(model)
        return shard_af_model(model, self.af_lanes[0], cut=False)

    # -- growth: gather, grow, re-shard ----------------------------------------------------------

    def shard(self, model: nn.Module) -> nn.Module:
        """`model` cut to this rank's part, in place: its experts (expert parallelism), or its side
        of the AF layout (an expert rank's dense tensors moved to the meta device)."""
        if not self.active:
            return model
        if self.af is None:
            return shard_experts(model, self.ep)
        shard_af_model(model, self.af_lanes[0])  # an attention rank's calls go to its lane
        return to_meta_except_experts(model) if self.is_expert_side else model

    def local_model_state(self, loaded: dict[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
        """A loaded (dense + this rank's experts) state completed for `model` as shard() cut it: an
        AF attention rank's experts are empty, an expert rank's dense tensors stay on meta."""
        if self.af is None:
            return loaded
        own = model.state_dict()
        if self.is_expert_side:
            return {n: loaded[n] if on_expert_side(n) else t for n, t in own.items()}
        where = next(iter(loaded.values())).device  # with the loaded tensors (the trainer moves them all to its device)
        return {n: torch.empty(t.shape, dtype=t.dtype, device=where) if is_expert_tensor(n) else loaded[n] for n, t in own.items()}

    def shard_state(self, state: dict, named_params: dict[str, nn.Parameter], experts_sharded: bool = False) -> dict:
        """A name-keyed optimizer state (ParamState values) cut to what this rank owns: its dense
        parameters' entries, and its slice of every expert entry (`experts_sharded`: the expert
        entries are this rank's already, as sharded growth leaves them)."""
        if not self.active:
            return state
        owned = self.owned(named_params)
        rank, size = (self.rank - self.af.attention, self.af.expert_ranks) if self.af is not None else (self.rank, self.size)
        cut = (lambda s: s) if experts_sharded else (lambda s: _entry(slice_entry(_fields(s), rank, size)))
        return {n: cut(s) if is_expert_tensor(n) else s for n, s in state.items() if n in owned}

    @torch.no_grad()
    def gather_full(self, model: nn.Module, state: dict) -> tuple[nn.Module, dict]:
        """The whole model and optimizer state, on every rank. Growth runs on it as in a single
        process. Every rank then holds the full model for a moment: fine at the sizes CPU tests
        and one node's first stages use; growing a model that only fits sharded needs the
        operators to act on slices (not built yet)."""
        if not self.active:
            return model, state
        full = {}
        own = model.state_dict()
        if self.af is not None:
            # Every tensor from the ranks that hold it: the dense ones from attention rank 0 (the
            # expert ranks have them on meta), each expert tensor from the expert ranks in order.
            shapes: list = [None] * self.size
            dist.all_gather_object(shapes, {n: tuple(t.shape) for n, t in own.items() if is_expert_tensor(n)})
            for name, t in own.items():
                if is_expert_tensor(name):
                    parts = [broadcast_field(t if self.rank == r else None, _TensorLayout(shapes[r][name], t.dtype), r, self.device)
                             for r in range(self.af.attention, self.size)]
                    full[name] = torch.cat(parts).to(t.device)
                else:
                    full[name] = broadcast_field(t if self.rank == 0 else None, _TensorLayout(tuple(t.shape), t.dtype), 0, self.device)
        for name, t in own.items() if self.af is None else ():
            if is_expert_tensor(name):
                parts = [torch.empty_like(t) for _ in range(self.size)]
                dist.all_gather(parts, t.contiguous())
                full[name] = torch.cat(parts)
            else:
                full[name] = t
        with torch.device("meta"):
            grown = GrowLM(model.config)
        grown.load_state_dict(full, strict=True, assign=True)
        trainable = {n for n, p in model.named_parameters() if p.requires_grad}
        for name, p in grown.named_parameters():  # assign=True keeps the loaded tensors' flags
            p.requires_grad_(name in trainable)
        return grown, self._gather_state(state)

    def _gather_state(self, state: dict) -> dict:
        """Every rank's optimizer state, merged: expert entries concatenated over the ranks, each
        dense entry from the one rank that holds it (its ZeRO-1 owner). No tensor goes through an
        object collective (NCCL would pickle it through the host and unpickle it onto the sender's
        GPU): only the entries' layouts do; the tensors travel by all_gather / broadcast on the
        group's device, in an order every rank derives from the same layouts."""
        layouts: list = [None] * self.size
        dist.all_gather_object(layouts, _state_layouts(state))
        merged = {}
        for name in sorted({n for lay in layouts for n in lay}):
            holders = [r for r, lay in enumerate(layouts) if name in lay]
            expert = is_expert_tensor(name)
            expected = list(range(self.af.attention, self.size)) if self.af is not None else list(range(self.size))
            if expert and holders != expected:
                raise ValueError(f"optimizer state of expert tensor {name} is on ranks {holders}, not on ranks {expected}")
            fields = {}
            mine = _fields(state[name]) if name in state else {}
            # the 8-bit codes travel where every holder has them (all expert slices, or the one dense owner)
            for k in [k for k in layouts[holders[0]][name] if all(k in layouts[r][name] for r in holders)]:
                kinds = [layouts[r][name][k] for r in holders]
                first = kinds[0]
                if not isinstance(first, _TensorLayout):
                    if expert and any(v != first for v in kinds):
                        raise ValueError(f"expert shards disagree on the shared {k} of {name}: {kinds}")
                    fields[k] = first
                elif expert and first.shape:  # every rank's slice of the expert dim, in rank order
                    if any(v != first for v in kinds):
                        raise ValueError(f"expert shards of {name}.{k} differ in layout: {kinds}")
                    if self.af is not None:  # the expert ranks' slices, one broadcast each
                        parts = [broadcast_field(mine[k] if self.rank == r else None, first, r, self.device) for r in holders]
                    else:
                        parts = [torch.empty(first.shape, dtype=first.dtype, device=self.device) for _ in range(self.size)]
                        dist.all_gather(parts, mine[k].contiguous())
                    fields[k] = torch.cat(parts)
                else:  # dense (one holder), or a 0-d tensor shared by the expert slices: the first holder's
                    src = holders[0]
                    fields[k] = broadcast_field(mine[k] if self.rank == src else None, first, src, self.device)
            merged[name] = _entry(fields)
        return merged

    # -- failures ----------------------------------------------------------------------------------

    def report_failure(self, exc: BaseException) -> None:
        """Leave this rank's error where the other ranks look for it."""
        if not self.active or self.error_dir is None:
            return
        try:
            self.error_dir.mkdir(parents=True, exist_ok=True)
            (self.error_dir / f"rank-{self.rank}.txt").write_text(f"{type(exc).__name__}: {exc}\n")
        except OSError:
            pass

    def explain_peer_failure(self, exc: BaseException, wait_s: float = 2.0) -> PeerFailed:
        """This rank's collective failed (or the launcher stopped it): name the rank that failed
        first and its message, waiting a moment for that rank to write it."""
        if threading_main():
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the launcher's stop must not cut the explanation short
        deadline = time.monotonic() + wait_s
        while True:
            reports = sorted(self.error_dir.glob("rank-*.txt")) if self.error_dir and self.error_dir.is_dir() else []
            reports = [r for r in reports if r.name != f"rank-{self.rank}.txt"]
            if reports or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        if reports:
            first = reports[0]
            return PeerFailed(f"rank {self.rank} stopped: {first.stem.replace('-', ' ')} failed: {first.read_text().strip()}")
        return PeerFailed(
            f"rank {self.rank} stopped: another rank died or stopped responding ({type(exc).__name__}: {str(exc).strip()[:300]}); "
            "the newest complete checkpoint is intact: run the same command to resume"
        )

    def clear_failures(self) -> None:
        if self.is_main and self.error_dir is not None and self.error_dir.is_dir():
            for f in self.error_dir.glob("rank-*.txt"):
                f.unlink(missing_ok=True)
        self.barrier()


def zero1_owners(named_params: dict[str, nn.Parameter], size: int) -> dict[str, int]:
    """ZeRO-1 owner of each trainable dense parameter over `size` ranks: largest first onto the
    least-loaded rank (deterministic from names and shapes, so every rank computes the same table;
    growth on expert shards keeps the dense optimizer state by it, stages/sharding.py)."""
    dense = sorted(((n, p.numel()) for n, p in named_params.items() if p.requires_grad and not is_expert_tensor(n)), key=lambda x: (-x[1], x[0]))
    load = [0] * size
    table = {}
    for name, numel in dense:
        r = min(range(size), key=lambda i: (load[i], i))
        table[name] = r
        load[r] += numel
    return table


def mean_grads(named: dict[str, nn.Parameter], size: int, device: torch.device | None = None, per_tensor: bool = False, group=None) -> None:
    """The gradients' mean over `size` ranks: dense gradients all-reduced, expert gradients (one
    replica each, summed over every rank's tokens by the all-to-all's backward) divided by W.
    device: where the flags go when there is no dense parameter. per_tensor: each dense gradient
    all-reduced in place, a collective per tensor, instead of through one flat buffer (growth's
    checks: no copy of the gradients next to them at growth's peak). The same parameters, in the
    same order, on every rank (a collective; in `group`, else the default group)."""
    dense = [(n, p) for n, p in named.items() if not is_expert_tensor(n)]
    # A has-gradient flag per tensor, so a parameter without a gradient on every rank stays
    # without one (as in a single process) instead of turning into zeros. The flags live where
    # the gradients do: a buffer of another device would make the cat mix devices; a model off
    # Dist.device is the collective's error (and the guard's) to name.
    device = dense[0][1].device if dense else device
    has = torch.tensor([float(p.grad is not None) for _, p in dense], device=device)
    if per_tensor:
        dist.all_reduce(has, group=group)
        for (_, p), flag in zip(dense, has.tolist()):
            if flag > 0:
                g = torch.zeros_like(p) if p.grad is None else p.grad
                dist.all_reduce(g, group=group)
                p.grad = g.div_(size)
    else:
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).float() for _, p in dense] + [has])
        dist.all_reduce(flat, group=group)
        flags = flat[-len(dense) :].tolist() if dense else []
        flat.div_(size)
        offset = 0
        # Each gradient a view of the buffer (a copy only where the parameter is not fp32): the
        # replaced gradients are freed as the loop goes, so the peak holds them once plus the buffer.
        for (_, p), flag in zip(dense, flags):
            n = p.numel()
            p.grad = flat[offset : offset + n].view_as(p).to(p.dtype) if flag > 0 else None
            offset += n
    scale_expert_grads({n: p for n, p in named.items() if is_expert_tensor(n)}, size)


def scale_expert_grads(named: dict[str, nn.Parameter], size: int) -> None:
    """Expert gradients (one replica each, summed over `size` ranks' tokens) divided by `size`."""
    for p in named.values():
        # A rank whose experts got no token this step has no gradient for them; in one
        # process the stacked tensor always has one (zero rows), and Adam steps it.
        p.grad = torch.zeros_like(p) if p.grad is None else p.grad.div_(size)


def on_expert_side(name: str) -> bool:
    """A tensor an AF expert rank holds: an expert tensor, or a table of an experts module (NF4
    code books), which the rank's expert calls read."""
    return "experts" in name.split(".")[:-1]


def to_meta_except_experts(model: nn.Module) -> nn.Module:
    """An AF expert rank's model, in place: every parameter and buffer off the expert side moved
    to the meta device (shapes, dtypes and trainable flags kept; tied tensors stay tied)."""
    moved: dict[int, torch.Tensor] = {}
    for prefix, module in model.named_modules():
        for table in (module._parameters, module._buffers):
            for key, t in list(table.items()):
                if t is None or on_expert_side(f"{prefix}.{key}" if prefix else key) or t.is_meta:
                    continue
                if id(t) not in moved:
                    meta = torch.empty_like(t, device="meta")
                    moved[id(t)] = nn.Parameter(meta, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else meta
                table[key] = moved[id(t)]
    return model


def is_peer_failure(exc: BaseException) -> bool:
    """An error raised by a collective whose peer went away (gloo / NCCL), or the launcher's stop."""
    if isinstance(exc, PeerFailed):
        return True
    if isinstance(exc, getattr(dist, "DistError", ())):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(k in text for k in ("Connection closed", "Connection reset", "gloo", "NCCL", "Socket", "Timed out"))


def threading_main() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def _raise_peer_failed(signum, frame):
    raise PeerFailed("stopped by the launcher (another rank failed or was killed)")


def _fields(s) -> dict:
    """An optimizer entry's tensors and numbers by name: ParamState's fields, and the 8-bit codes and
    absmax of a state dequantized from 8-bit moments (growtrain/optim/adamw8bit.py), which travel with it."""
    return {k: getattr(s, k) for k in _STATE_FIELDS} | packed_fields(s)


def _state_layouts(state: dict) -> dict:
    return {n: {k: _layout(v) for k, v in _fields(s).items()} for n, s in state.items()}


def _entry(fields: dict) -> ParamState:
    """_fields' inverse."""
    return with_packed(ParamState(**{k: fields[k] for k in _STATE_FIELDS}), fields)


@dataclass(frozen=True)
class _TensorLayout:
    """What a receiver needs to allocate an optimizer-state tensor: it travels as an object, the
    tensor does not."""

    shape: tuple[int, ...]
    dtype: torch.dtype


def _layout(value):
    return _TensorLayout(tuple(value.shape), value.dtype) if isinstance(value, torch.Tensor) else value


def broadcast_field(value: torch.Tensor | None, layout: _TensorLayout, src: int, device: torch.device, group=None) -> torch.Tensor:
    """An optimizer-state tensor of rank `src` (`value` there, None elsewhere, `layout` on every
    rank) on every rank, by one broadcast on `device` (a collective in `group`)."""
    buf = value.detach().to(device).clone() if value is not None else torch.empty(layout.shape, dtype=layout.dtype, device=device)
    dist.broadcast(buf, src=src, group=group)
    return buf
