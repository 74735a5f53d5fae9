"""Growth on expert shards (issue 14, DESIGN.md §15): under expert parallelism each rank grows only
what it holds, the dense parts (replicated) identically everywhere and the routed experts of its
own range, instead of gathering the whole model first.

An operator that declares `shards` (registry.Operator) runs unchanged on the sharded model inside
`sharded(ep)`: `model.state_dict()` then holds this rank's E/W experts of every expert tensor and
the full replicated rest, and the operator asks this module where it is:
- `local_range(E)`: the global indices of the rows it holds;
- `children_to_owners(t, m, E)`: an operator whose layout sends the children of this rank's
  parents elsewhere (split and clone: child j of parent e is expert j·E + e, round-robin) builds
  them in local order, child j of local parent l at row j·L + l, and this one all-to-all moves
  every child row to the rank that holds it in the new layout. Used inside `Provenance.transform`,
  so the optimizer state, masks and the checks' references travel the same way: each
  call is a collective, which every rank makes, in the same order, for the same tensors;
- `expert_normal(...)`: random draws of one expert's rows from a generator of its own, keyed by
  its global index, so a grown model is the same whatever the EP size;
- the checks' reductions (`sum_ranks`, `any_ranks`, `union_ranks`, ...): verdicts and counts
  taken over all ranks, so that every rank reaches the same verdict (a rank that stopped alone
  would leave the others waiting in a collective);
- the dense optimizer state as training keeps it, each entry on its ZeRO-1 owner only
  (`dense_owners`, `dense_holders`, `fetch_state`): growth maps an entry on its new owner, and the
  checks' optimizer steps step it there and broadcast the result (`broadcast_`).
Outside `sharded(...)` every helper is the single-process identity.

An AF layout grows on its shards in a group whose first A ranks (its attention ranks) hold no
routed expert (EPGroup.attention, Dist.growth_ep): they hold the dense parameters and their
optimizer state, and take part in every collective with empty expert slices; the expert ranks
hold E / F experts each and, while growth runs, a copy of the dense parameters.

Legend: E experts of a layer before growth, F ranks that hold experts (W, or W - A), L = E / F
local experts, m children per parent, W ranks, r this rank.
"""

from __future__ import annotations

import contextvars
import hashlib
import math
from contextlib import contextmanager

import torch
import torch.distributed as dist

_EP: contextvars.ContextVar = contextvars.ContextVar("growtrain_growth_ep", default=None)


@contextmanager
def sharded(ep):
    """Growth inside runs on expert shards of the group `ep` (model.expert_parallel.EPGroup)."""
    token = _EP.set(ep)
    try:
        yield
    finally:
        _EP.reset(token)


def current():
    """The EP group growth runs sharded over, or None (one process, or gathered growth)."""
    return _EP.get()


def local_range(num_experts: int) -> tuple[int, int]:
    ep = current()
    return ep.experts(num_experts) if ep is not None else (0, num_experts)


def _group():
    """The process group growth's collectives run in: the EP group's own (the gloo group of growth
    on the host), else the default one."""
    ep = current()
    return ep.group if ep is not None else None


def _device() -> torch.device:
    """Where collective tensors go: NCCL takes CUDA tensors only."""
    if dist.get_backend(_group()) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def children_to_owners(t: torch.Tensor, m: int, num_experts: int) -> torch.Tensor:
    """Rows in local child order (row j·L + l: child j of this rank's l-th parent, global expert
    j·E + r·L + l) → this rank's rows of the grown layout (global experts [r·mL, (r+1)·mL), in
    order), by one all-to-all. The identity in one process (there the local order is the global one)."""
    ep = current()
    if ep is None or ep.size == 1:
        return t
    W, E, A = ep.size, num_experts, ep.attention  # the first A ranks hold no expert (an AF layout)
    h = ep.holder()  # this rank's index among the F = W - A ranks that hold experts
    L = E // ep.expert_ranks
    n = m * L  # rows per holder, before and after
    if t.shape[0] != (0 if h is None else n):
        raise ValueError(f"children_to_owners: {t.shape[0]} rows, expected {m} children of {0 if h is None else L} local experts")
    if h is None:
        child = mine = torch.zeros(0, dtype=torch.long)
    else:
        j = torch.arange(m).repeat_interleave(L)
        child = j * E + h * L + torch.arange(L).repeat(m)  # global index of each local row
        mine = torch.arange(h * n, (h + 1) * n)  # the global experts this rank holds after
    dest = A + child // n
    send_order = torch.argsort(dest * (m * E) + child)  # by destination, then global index
    send_counts = torch.bincount(dest, minlength=W).tolist()
    src = A + (mine % E) // L  # the rank that held each one's parent
    recv_counts = torch.bincount(src, minlength=W).tolist()
    recv_order = torch.argsort(src * (m * E) + mine)  # arrival order: by source, then global index
    device, dtype = t.device, t.dtype
    wire = t.to(torch.uint8) if dtype == torch.bool else t  # gloo has no bool
    flat = wire.reshape(t.shape[0], math.prod(t.shape[1:]))[send_order.to(device)].to(_device()).contiguous()
    got = torch.empty_like(flat)
    dist.all_to_all_single(got, flat, recv_counts, send_counts, group=_group())
    out = torch.empty_like(got)
    out[recv_order.to(got.device)] = got
    out = out.to(device).reshape(t.shape)
    return out.to(torch.bool) if dtype == torch.bool else out


def expert_normal(shape_per_expert: tuple[int, ...], experts: torch.Tensor, key: int) -> torch.Tensor:
    """[len(experts), *shape_per_expert] float64 standard normal draws, each expert's from its own
    generator seeded by (key, global index): the same numbers whichever rank draws them."""
    return _per_expert(lambda g: torch.randn(shape_per_expert, dtype=torch.float64, generator=g), experts, key, shape_per_expert, torch.float64)


def expert_uniform(shape_per_expert: tuple[int, ...], experts: torch.Tensor, key: int) -> torch.Tensor:
    """As expert_normal, U[0, 1) draws in float32."""
    return _per_expert(lambda g: torch.rand(shape_per_expert, generator=g), experts, key, shape_per_expert, torch.float32)


def _per_expert(draw, experts: torch.Tensor, key: int, shape_per_expert: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    if not experts.numel():  # a rank without experts (an AF layout's attention rank)
        return torch.empty((0, *shape_per_expert), dtype=dtype)
    return torch.stack([draw(torch.Generator().manual_seed(sub_key(key, e))) for e in experts.tolist()])


def draw_key() -> int:
    """A key for expert_normal / expert_uniform from the current (seeded) RNG: one draw, the same
    on every rank, so the operator's later draws stay in step across ranks too."""
    return int(torch.randint(0, 2**62, (1,)).item())


def sub_key(key: int, label) -> int:
    """A seed derived from `key` and a label (an expert's global index, a module's name)."""
    digest = hashlib.blake2b(f"{key}/{label}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


# ---------------------------------------------------------------- reductions over ranks


def _active() -> bool:
    ep = current()
    return ep is not None and ep.size > 1


def sum_ranks(*values: float) -> list[float]:
    """Each value summed over the ranks (one all-reduce), in float64."""
    if not _active():
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=_device())
    dist.all_reduce(t, group=_group())
    return t.tolist()


def max_ranks(*values: float) -> list[float]:
    if not _active():
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=_group())
    return t.tolist()


def any_ranks(flag: bool) -> bool:
    """True when `flag` holds on some rank: for a decision that leads to collectives."""
    if not _active():
        return bool(flag)
    return max_ranks(float(bool(flag)))[0] > 0


def all_ranks(flag: bool) -> bool:
    return not any_ranks(not flag)


def all_ranks_each(flags: list[bool]) -> list[bool]:
    """Per flag, whether it holds on every rank (one all-reduce for all of them)."""
    if not _active() or not flags:
        return [bool(f) for f in flags]
    return [v == 0 for v in max_ranks(*(float(not f) for f in flags))]


def any_elements(mask: torch.Tensor | None) -> bool:
    """Whether a (sharded) mask has a True element on some rank."""
    return any_ranks(mask is not None and bool(mask.any()))


def gather_objects(obj) -> list:
    """Every rank's `obj` (picklable, no tensors: NCCL would move them through the host), in rank order."""
    if not _active():
        return [obj]
    every: list = [None] * current().size
    dist.all_gather_object(every, obj, group=_group())
    return every


def union_ranks(problems: list[str]) -> list[str]:
    """Every rank's problems, in rank order, each once."""
    if not _active():
        return list(problems)
    return list(dict.fromkeys(p for ps in gather_objects(list(problems)) for p in ps))


def sum_tensor(t: torch.Tensor) -> torch.Tensor:
    """`t` summed over the ranks (a copy; `t` unchanged)."""
    if not _active():
        return t
    out = t.to(_device()).clone()
    dist.all_reduce(out, group=_group())
    return out.to(t.device)


def reduce_tensor(t: torch.Tensor, dst: int) -> torch.Tensor:
    """`t` summed over the ranks onto rank `dst` (a copy; on the other ranks it holds partial sums)."""
    if not _active():
        return t
    out = t.to(_device()).clone()
    dist.reduce(out, dst=dst, group=_group())
    return out.to(t.device)


def count_parameters(model) -> int:
    """The model's parameter count: the replicated ones once, the expert shards summed over ranks."""
    from growtrain.model.expert_shards import is_expert_tensor

    dense = sum(p.numel() for n, p in model.named_parameters() if not is_expert_tensor(n))
    experts = sum(p.numel() for n, p in model.named_parameters() if is_expert_tensor(n))
    return dense + int(sum_ranks(float(experts))[0])


def clip_grad_norm(params: list[torch.Tensor], max_norm: float, weights: list) -> float:
    """The run's optimizer's clip_grad_norm of `params`, each weighted by its state's `norm_mult`
    (optim/adamw.clip_grad_norm_). On expert shards `params` are this rank's share: its expert
    shards and the dense parameters whose ZeRO-1 state it holds (their gradients are the same on
    every rank), and each element's squared gradient is counted once: summed over the ranks."""
    from growtrain.optim.adamw import clip_grad_norm_

    return float(clip_grad_norm_(params, max_norm, weights, sum_tensor if _active() else None))


# ---------------------------------------------------------------- dense optimizer state (ZeRO-1)
#
# On expert shards the dense parameters' optimizer state stays where training keeps it: each entry
# on its ZeRO-1 owner alone (distributed.zero1_owners over the current model), not on every rank.
# Growth maps an entry on the rank that owns its target, moving a source that another rank holds
# by one broadcast (one tensor's state in flight at a time); the checks' optimizer steps step a
# dense parameter on its holder and broadcast its new value. Every rank makes these calls for the
# same names in the same order: the tables below are the same on every rank.


def dense_owners(model) -> dict[str, int] | None:
    """The ZeRO-1 owner of each trainable dense parameter of `model` (over the group's dense ranks:
    every rank, or an AF layout's attention ranks); None outside expert shards (every entry is
    local)."""
    if not _active():
        return None
    from growtrain.parallel.distributed import zero1_owners

    return zero1_owners(dict(model.named_parameters()), current().dense_ranks)


def holds(name: str, owners: dict[str, int] | None) -> bool:
    """Whether this rank keeps the optimizer state of parameter `name` (owners: dense_owners)."""
    from growtrain.model.expert_shards import is_expert_tensor

    return owners is None or is_expert_tensor(name) or owners.get(name) == current().rank


def dense_holders(state, names=None) -> dict[str, tuple[int, dict]] | None:
    """Which rank holds each dense entry of a ZeRO-1 optimizer state (of its entries `names`, or
    all), with its fields' layouts (what a receiver allocates): one object all-gather of names,
    shapes and dtypes, no tensor. The entries are read one at a time (8-bit state dequantizes on
    access). None outside expert shards."""
    if not _active():
        return None
    from growtrain.parallel.distributed import _state_layouts
    from growtrain.model.expert_shards import is_expert_tensor

    mine = {}
    for n in state if names is None else names:
        if not is_expert_tensor(n):
            mine.update(_state_layouts({n: state[n]}))
    table: dict[str, tuple[int, dict]] = {}
    for rank, held in enumerate(gather_objects(mine)):
        for name, layout in held.items():
            if name in table:
                raise ValueError(f"optimizer state of dense parameter {name} is on ranks {table[name][0]} and {rank}: ZeRO-1 keeps one")
            table[name] = (rank, layout)
    return table


def fetch_state(state, name: str, holders: dict[str, tuple[int, dict]]):
    """Dense entry `name` on every rank, broadcast from the rank that holds it (a collective)."""
    from growtrain.parallel.distributed import _TensorLayout, _entry, _fields, broadcast_field

    if name not in holders:
        raise KeyError(f"no rank holds optimizer state for {name}")
    src, layout = holders[name]
    mine = _fields(state[name]) if current().rank == src else None
    fields = {}
    for k, lay in layout.items():  # ParamState's fields, and an 8-bit state's codes and absmax
        if not isinstance(lay, _TensorLayout):
            fields[k] = lay  # a Python number: it came with the layout
            continue
        fields[k] = broadcast_field(mine[k] if mine is not None else None, lay, src, _device(), _group())
    return _entry(fields)


def broadcast_(t: torch.Tensor, src: int) -> None:
    """`t` overwritten in place with rank `src`'s values (a collective)."""
    if not _active():
        return
    wire = t.detach() if t.device == _device() else t.detach().to(_device())
    dist.broadcast(wire, src=src, group=_group())
    if wire is not t:
        t.detach().copy_(wire)


def rank_local():
    """The block runs as in one process: no reduction over ranks (work only some ranks do, on a
    replicated parameter, such as mapping a dense entry on its owner)."""
    return sharded(None)


def probe_share(batch: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """This rank's rows of the probe batch (inputs and targets [B, T], split as evenly as B goes).
    Under expert parallelism each rank runs its share of the probe, as it runs its share of a
    training batch: a check costs a rank B/W of the probe's tokens, and each expert sees each probe
    token once (the whole probe on every rank sent the experts W copies of it). The checks'
    figures are then reduced over the ranks (sum_ranks, max_ranks, rel_l2, probe_grads)."""
    if not _active():
        return batch
    ep = current()
    if batch[0].shape[0] < ep.size:
        raise ValueError(
            f"invariance.probe_batch_size {batch[0].shape[0]} is smaller than the {ep.size} expert-parallel ranks: "
            "each rank runs its share of the probe; set it to at least the number of processes"
        )
    return tuple(torch.tensor_split(t, ep.size)[ep.rank] for t in batch)


def probe_tokens(local: int) -> float:
    """Tokens per rank of the probe, on average (the whole probe's in one process): a probe loss
    summed over this rank's tokens and divided by it has, averaged over the ranks, the mean
    over the whole probe for its gradient (probe_grads averages)."""
    if not _active():
        return float(local)
    return sum_ranks(float(local))[0] / current().size


def probe_grads(named: dict) -> None:
    """After a backward of each rank's probe share (its loss scaled by probe_tokens): the
    gradients the whole probe gives in one process, the mean over ranks that training's
    sync_grads takes of a batch's (distributed.mean_grads), each dense gradient all-reduced in
    place so that no flat copy of them sits next to them at growth's peak."""
    if not _active():
        return
    from growtrain.parallel.distributed import mean_grads

    mean_grads(named, current().size, _device(), per_tensor=True, group=_group())


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    """||b - a|| / ||a|| over every rank's rows of a probe output (float64)."""
    num, den = sum_ranks(float((b - a).double().pow(2).sum()), float(a.double().pow(2).sum()))
    return num**0.5 / max(den**0.5, 1e-30)


def max_abs(t: torch.Tensor) -> float:
    """max |t| over every rank's rows (0 for none)."""
    return max_ranks(float(t.abs().max()) if t.numel() else 0.0)[0]
