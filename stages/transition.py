"""The stage-transition driver: plan every stage's shape, and apply a stage's growth operators
with the optimizer state, checking each application before the next stage may train."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace

import torch

from growtrain.model.expert_shards import is_expert_tensor
from growtrain.runtime.faults import maybe_fault
from growtrain.model import GrowLM
from growtrain.model.config import ModelConfig
from growtrain.optim.adamw import OptimizerConfig, ParamState, decays
from growtrain.stages.dynamics import Side, approximate_step, carry_masks, dynamics_check, fresh_masks, held_patterns, source_names, trainability_check, with_patterns
from growtrain.stages.invariance import (
    block_drift,
    block_pairs,
    function_metrics,
    function_problems,
    optimizer_problems,
    router_kl,
    router_pairs,
    router_problems,
    structure_problems,
)
from growtrain.stages.invariance import probe as run_probe
from growtrain.stages import sharding, streaming
from growtrain.stages.registry import GrowthPlanError, Provenance, get_operator
from growtrain.stages.values import value_check


class GrowthCheckFailed(Exception):
    """An invariance check failed: the run stops before the new stage trains."""

    def __init__(self, record: dict):
        self.record = record
        super().__init__(
            f"growth check failed at stage '{record['stage']}', operator {record['operator']} "
            f"(step {record['index']} of the stage's growth):\n  - " + "\n  - ".join(record["problems"])
        )


def plan_stage_models(seed: ModelConfig, grows) -> list[ModelConfig]:
    """The model shape each stage trains, derived from the seed by the operators' `plan`s alone."""
    from growtrain.recipe import model_problems

    shapes, cfg = [], seed
    for i, steps in enumerate(grows):
        for j, step in enumerate(steps):
            op = get_operator(step.op)
            if cfg.dense_lora is not None:
                # One refusal for every operator: they map parameters by growtrain's names, which
                # peft has renamed (base_layer, lora_A.default, ...).
                raise GrowthPlanError(
                    f"{step.op}: the model holds peft LoRA on its dense layers at this point (add_dense_lora, or model.dense_lora), "
                    "and growth operators cannot act on a peft-wrapped model; move add_dense_lora after the last growth step",
                    i,
                    j,
                )
            try:
                cfg = op.plan(cfg, step.args)
            except GrowthPlanError as exc:
                raise GrowthPlanError(exc.message, i, j) from None
            problems = model_problems(cfg)
            if problems:
                raise GrowthPlanError(f"{step.op} would give an invalid model: " + "; ".join(m for _, m in problems), i, j)
        shapes.append(cfg)
    return shapes


def map_optimizer_state(old: dict[str, ParamState], model, provenance: dict[str, Provenance], fresh_lr_mult: float = 1.0) -> dict[str, ParamState]:
    """DESIGN.md §7: carried state stays; a β-scaled copy among copies summing to S gets m/S, v/S²,
    LR ×β, weight decay ×1/β, epsilon ×1/S, clip-norm weight ×S·β and the same step count; new
    parameters, and the new elements a copy marks fresh, start fresh with their own step count and
    the LR multiplier `fresh_lr_mult` (the recipe's `stages.N.fresh.lr_mult`).

    On expert shards (stages/sharding.py) `old` is this rank's share, as training keeps it: its
    expert slices and the dense entries it owns (ZeRO-1); so is the result, by the grown model's
    owners. A dense entry is mapped on its new owner alone (no reduction over ranks), its source
    broadcast from the rank that holds it where that is another rank; an expert slice built from
    a dense source (upcycling) gets the source by a broadcast on every rank. One entry's state is in
    flight at a time."""
    holders = sharding.dense_holders(old)  # None in one process: every entry is here
    owners = sharding.dense_owners(model)
    new: dict[str, ParamState] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        prov = provenance[name]
        keep = sharding.holds(name, owners)
        if prov.kind in ("carried", "copy"):
            source = _source_state(old, prov.source, holders, None if owners is None or is_expert_tensor(name) else owners[name])
            if source is None:  # another rank owns this entry
                continue
            if prov.kind == "carried":
                new[name] = source
            elif is_expert_tensor(name):
                new[name] = _mapped_copy(source, prov, p, decays(name, p), fresh_lr_mult)  # its collectives run on every rank
            else:
                with sharding.rank_local():  # on the owner alone: the replicated provenance needs no reduction
                    new[name] = _mapped_copy(source, prov, p, decays(name, p), fresh_lr_mult)
        elif keep:
            new[name] = replace(ParamState.fresh(p, decays(name, p)), lr_mult=fresh_lr_mult)
    return new


@torch.no_grad()
def reset_optimizer_state(state) -> dict[str, ParamState]:
    """`state` as if no element had taken a step (the recipe's `fresh.state: fresh`): moments zero,
    step counts 0 (one int per tensor), the multipliers kept (they are the grown parametrization,
    not history). Growing from it maps zeros to zeros, so the growth checks compare like with like.
    The moments are zeroed where they are, not copied: a second copy at growth time would cost 8
    bytes per trainable parameter (~125 GB at the 120B recipe's 15.7B). The trainer's state is
    then the reset one too; a growth that fails stops the run, which resumes from its checkpoint."""
    out = {}
    for name, s in state.items():
        s.exp_avg.zero_()
        s.exp_avg_sq.zero_()
        out[name] = replace(s, step=0)
    return out


def _source_state(old, source: str, holders, dst: int | None):
    """The old entry `source` where it is needed: on rank `dst` (a dense target's owner), or on every
    rank (dst None: an expert target); None elsewhere. Moved by a broadcast from its holder where
    some rank that needs it lacks it (the same decision on every rank: the tables are global)."""
    if holders is None or is_expert_tensor(source):
        return old[source]
    if source not in holders:
        raise KeyError(f"no rank holds optimizer state for {source}")
    src = holders[source][0]
    rank = sharding.current().rank
    if dst == src:
        return old[source] if rank == src else None
    moved = sharding.fetch_state(old, source, holders)
    return moved if dst is None or rank == dst else None


def _mapped_copy(s: ParamState, prov: Provenance, p: torch.Tensor, decay: bool, fresh_lr_mult: float = 1.0) -> ParamState:
    # Operators build S, β and masks on the CPU; the state lives with the parameter. A compact
    # field (see compact_fields) is transformed at its full size, one tensor at a time.
    source_shape = tuple(s.exp_avg.shape)
    t = lambda x: prov.transform(x.expand(source_shape))  # noqa: E731
    S, beta = (x.to(s.exp_avg.device) if isinstance(x, torch.Tensor) else x for x in (prov.copies, prov.beta))
    f32 = lambda x: x.to(torch.float32) if isinstance(x, torch.Tensor) else x  # noqa: E731
    step = t(s.step) if isinstance(s.step, torch.Tensor) else s.step
    state = ParamState(
        step,
        f32(prov.transform(s.exp_avg) / S),
        f32(prov.transform(s.exp_avg_sq) / S**2),
        f32(_scaled(s.lr_mult, t, beta)),
        f32(_scaled(s.wd_mult, t, 1 / beta)),
        f32(_scaled(s.eps_mult, t, 1 / S)),
        f32(_scaled(s.norm_mult, t, S * beta)),
    )
    if prov.fresh is not None and sharding.any_elements(prov.fresh):  # one verdict on every rank: the transforms are collectives
        fresh = prov.fresh.to(state.exp_avg.device)
        counts = step if isinstance(step, torch.Tensor) else torch.full(fresh.shape, step, dtype=torch.int32, device=fresh.device)
        state = ParamState(
            counts.masked_fill(fresh, 0),
            state.exp_avg.masked_fill(fresh, 0.0),
            state.exp_avg_sq.masked_fill(fresh, 0.0),
            _blend(fresh, fresh_lr_mult, state.lr_mult),
            _blend(fresh, 1.0 if decay else 0.0, state.wd_mult),
            _blend(fresh, 1.0, state.eps_mult),
            _blend(fresh, 1.0, state.norm_mult),
        )
    return compact_fields(state, tuple(p.shape))


def compact_fields(s: ParamState, shape: tuple[int, ...]) -> ParamState:
    """`s` with every tensor step count and multiplier shaped like its parameter except along the
    dims (after the first) where it does not vary, which it keeps at size 1 (DESIGN.md §15: per-
    element fields only where elements differ). Lossless: the field broadcasts back to the same
    values. Drop-upcycling's redrawn neurons vary along the expert hidden dim only, so their step
    counts and multipliers cost [E, F, 1] instead of [E, F, D]. The verdict for each dim is taken
    over all ranks (one all-reduce), so every expert shard of a tensor keeps the same layout (the
    checkpoint concatenates them, a later EP size re-cuts them)."""
    names = ("step", "lr_mult", "wd_mult", "eps_mult", "norm_mult")
    values = {k: getattr(s, k) for k in names}
    dims = range(1, len(shape))
    flags = []
    for k in names:
        x = values[k]
        if isinstance(x, torch.Tensor):
            x = x.expand(shape)
            values[k] = x
        flags += [not isinstance(x, torch.Tensor) or bool((x == x.narrow(d, 0, 1)).all()) for d in dims]
    flags = sharding.all_ranks_each(flags)
    for i, k in enumerate(names):
        x = values[k]
        if not isinstance(x, torch.Tensor):
            continue
        for j, d in enumerate(dims):
            if flags[i * len(dims) + j]:
                x = x.narrow(d, 0, 1)
        values[k] = x.contiguous()
    return ParamState(values["step"], s.exp_avg, s.exp_avg_sq, values["lr_mult"], values["wd_mult"], values["eps_mult"], values["norm_mult"])


def _scaled(mult, transform, factor):
    """A multiplier (float, or tensor broadcasting to its parameter) carried through `transform` and scaled."""
    return transform(mult) * factor if isinstance(mult, torch.Tensor) else mult * factor


def _blend(fresh: torch.Tensor, fresh_value: float, mapped):
    """`mapped` with the fresh elements set to `fresh_value`; stays a float where that changes nothing."""
    if not isinstance(mapped, torch.Tensor):
        if mapped == fresh_value:
            return mapped
        mapped = torch.full(fresh.shape, mapped, dtype=torch.float32, device=fresh.device)
    return mapped.expand(torch.broadcast_shapes(fresh.shape, mapped.shape)).masked_fill(fresh, fresh_value)


def growth_seed(seed: int, stage_index: int, step_index: int) -> int:
    """The seed of one operator application: a function of where it is, never of the RNG stream,
    so a resumed run regrows bit for bit."""
    digest = hashlib.blake2b(f"{seed}/{stage_index}/{step_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


@dataclass
class GrowthOutcome:
    model: GrowLM
    optimizer_state: dict[str, ParamState]
    records: list[dict]


def apply_growth(
    model,
    optimizer_state,
    steps,
    *,
    seed,
    stage_index,
    stage_name,
    planned: ModelConfig,
    probe,
    invariance_cfg,
    optimizer_cfg=None,
    lr: float | None = None,
    log=None,
    fresh=None,
    release_folded: bool = False,
) -> GrowthOutcome:
    """Apply `steps` in order; each is checked, and so is the whole transition (first model vs last,
    where several operators' approximations could add up); the first failure raises GrowthCheckFailed.

    optimizer_cfg / lr: the run's optimizer and the LR of the new stage's first step, for the
    dynamics check (stages/dynamics.py; defaults: OptimizerConfig() and its lr). log: a callable
    told each streamed layer as it is done (stages/streaming.py), or None. fresh: the stage's
    `fresh` section (recipe.FreshConfig; None: the defaults): the LR multiplier the mapping gives
    fresh elements, which the fresh-state check expects, and with `state: fresh` the optimizer
    state reset before the first operator. release_folded: the caller hands `optimizer_state` over
    (the trainer, which rebinds its optimizer to the outcome's state): before a quantize_experts
    folds the full-precision experts into NF4 bases, their entries are removed from it (and from
    the mapped state holding the same objects), since no check or mapping reads them (the checks
    hold the folded experts whole, the adapters start fresh). At the 120B recipe's experts stage
    that is the fp32 experts' moments, ~14.5 GB per rank over 8, for the whole stage's growth."""
    fresh_lr_mult = fresh.lr_mult if fresh is not None else 1.0
    if fresh is not None and fresh.state == "fresh":
        optimizer_state = reset_optimizer_state(optimizer_state)
    probe = sharding.probe_share(probe)  # on expert shards each rank checks on its rows of the probe
    inputs_BT, targets_BT = probe
    records = []
    start_model, start_state = model, optimizer_state
    dyn = _Dynamics.of(invariance_cfg, optimizer_cfg, lr, model, fresh_lr_mult)
    chain = _Chain.identity(model)
    after = start = run_probe(model, inputs_BT)
    check_values = getattr(invariance_cfg, "values", True)
    units = _units(steps, getattr(invariance_cfg, "stream", True))
    tie_breaks: list[str] = []  # why an exact operator of this transition was not exact on its weights
    for j, unit in units:
        ops = [get_operator(s.op) for s in unit]
        name = "+".join(op.name for op in ops)
        exact = all(op.is_exact(s.args) for op, s in zip(ops, unit))
        before = after
        streamed = None
        released = _release_folded(unit, model, optimizer_state, start_state) if release_folded else set()
        if len(unit) == 1:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(growth_seed(seed, stage_index, j))
                growth = ops[0].apply(model, unit[0].args)
        else:  # expert operators and quantize_experts, one MoE layer at a time (stages/streaming.py)
            keys = [_draw_key(growth_seed(seed, stage_index, j + i)) for i in range(len(unit))]
            say = (lambda line: log(f"growth [{stage_name}] {name}: {line}")) if log is not None else None
            streamed = streaming.apply_streamed(model, unit, keys, inputs_BT, invariance_cfg, check_values, say)
            growth = streamed.growth
        new_model = growth.model
        new_model.set_expert_backend(model.expert_backend)  # runtime state: the probes compare like with like
        inexact_here = list(growth.notes) if exact else []
        if inexact_here:
            # An exact operator that these weights keep from being exact (a split whose top-k can cut
            # a group of tied siblings, torch.topk's tie-break deciding): judged, and recorded, as
            # approximate, by the recipe's thresholds, with the reason; the run goes on.
            exact = False
            tie_breaks.extend(inexact_here)
            if log is not None:
                log(f"growth [{stage_name}] {name}: not exact on these weights, checked as approximate: {inexact_here[0]}")
        after = run_probe(new_model, inputs_BT)
        blocks = block_pairs(model, new_model, growth)
        routers = router_pairs(model, new_model, growth, blocks)
        metrics, problems = _function_report(before, after, targets_BT, blocks, growth.stream_view, routers, exact, invariance_cfg)
        # The block streams are read by the next report only: this unit's old ones, unless the
        # transition's report compares with them, and with a single unit both sides', are dropped
        # before the dynamics check (probe-sized: at the 120B recipe, one 64-token row per rank, 36
        # blocks x 2 streams x 4096 float64, ~0.15 GB per model).
        if before is not start or len(units) == 1:
            before.streams.clear()
        if len(units) == 1:
            after.streams.clear()
        if problems and growth.notes:  # the operator's own account of what in these weights breaks it
            problems = problems + list(growth.notes)
        planned_here = model.config
        for op, s in zip(ops, unit):
            planned_here = op.plan(planned_here, s.args)
        with torch.device("meta"):
            planned_params = GrowLM(planned_here).num_parameters()
        # On expert shards every verdict is taken over all ranks (stages/sharding.py).
        structure = sharding.union_ranks(structure_problems(model, new_model, growth.provenance, planned_params))
        new_state = None
        if not structure:
            try:
                new_state = map_optimizer_state(optimizer_state, new_model, growth.provenance, fresh_lr_mult)
            except Exception as exc:  # a broken provenance must stop the run with a report, not a traceback
                structure.append(f"optimizer state could not be mapped: {type(exc).__name__}: {exc}")
            else:
                structure += optimizer_problems(new_model, new_state)
            structure = sharding.union_ranks(structure)
        unfolded = released - _reset_sources(growth.provenance)
        if unfolded:  # a state released that the operator still maps: a bug, never train on
            raise RuntimeError(f"stage {stage_name}: optimizer state released for {sorted(unfolded)[:3]}, which {name} did not fold")
        if j and new_state is not None:
            # What replaced a reset parameter's source holds its values (an expert matrix quantized
            # into its NF4 base): the source's state is used by nothing after the mapping, and the
            # checks hold the source whole. Freed here where this transition made it (the first
            # operator's state is the trainer's); with release_folded, before the unit, from the
            # trainer's state too (_release_folded).
            folded = _reset_sources(growth.provenance)
            optimizer_state = {n: s for n, s in optimizer_state.items() if n not in folded}
        if streamed is not None:
            metrics["layers"] = streamed.layers
            problems += streamed.problems
            tie_breaks.extend(streamed.inexact)
            if check_values:
                metrics["values"] = streamed.values
        elif not structure and check_values:
            metrics["values"], found = value_check(unit[0].op, unit[0].args, model, growth)
            problems += found
        if dyn.on and not structure:
            problems += dyn.check_operator(unit, exact, model, optimizer_state, new_model, new_state, growth.provenance, probe, invariance_cfg, metrics, inexact_here)
        args = unit[0].to_plain() if len(unit) == 1 else {"ops": [s.to_plain() for s in unit]}
        record = _record(stage_name, stage_index, j, name, args, exact, metrics, model, new_model, planned_params, sharding.union_ranks(structure + problems))
        if inexact_here or (streamed is not None and streamed.inexact):
            record["inexact_on_these_weights"] = inexact_here or streamed.inexact
        record["provenance"] = _provenance_summary(growth.provenance)
        if streamed is not None:
            record["streamed"] = True
        records.append(record)
        if record["problems"]:
            raise GrowthCheckFailed(record)
        chain = chain.then(blocks, routers, growth.stream_view)
        optimizer_state = new_state
        model = new_model
        maybe_fault("growth_mid")  # an operator applied and checked, the transition not done
    if model.config != planned:  # the recipe's plan and the operators' results disagree: a bug, never train on
        raise RuntimeError(f"stage {stage_name}: grown shape {model.config} differs from the planned {planned}")
    if len(units) > 1:  # one unit: its own check is the transition's
        exact = all(get_operator(s.op).is_exact(s.args) for s in steps) and not tie_breaks
        metrics, problems = _function_report(start, after, targets_BT, chain.blocks, chain.view, chain.routers, exact, invariance_cfg)
        with torch.device("meta"):
            planned_params = GrowLM(planned).num_parameters()
        args = {"ops": [s.op for s in steps]}
        if dyn.on:
            problems += dyn.check_transition([s.op for s in steps], exact, start_model, start_state, model, optimizer_state, probe, invariance_cfg, metrics)
        problems = sharding.union_ranks(problems)
        record = _record(stage_name, stage_index, len(steps), "transition", args, exact, metrics, start_model, model, planned_params, problems)
        records.append(record)
        if problems:
            raise GrowthCheckFailed(record)
    return GrowthOutcome(model, optimizer_state, records)


@dataclass
class _Dynamics:
    """The dynamics and trainability checks of one transition (stages/dynamics.py), and what they
    carry from operator to operator: the fresh elements of the current model and, per current
    parameter, the start model's parameter it descends from."""

    on: bool
    optimizer_cfg: object
    lr: float
    fresh: dict
    origin: dict
    start_held: set
    approximate: list
    regrouped: set  # start-model parameters some operator copied into another shape (dynamics.twin_step)
    fresh_lr_mult: float = 1.0  # the LR multiplier the mapping gives fresh elements (their first step's expected size)

    @classmethod
    def of(cls, invariance_cfg, optimizer_cfg, lr, model, fresh_lr_mult: float = 1.0) -> "_Dynamics":
        opt_cfg = optimizer_cfg if optimizer_cfg is not None else OptimizerConfig()
        # A warmup that starts at LR 0 would make the comparison vacuous: the base LR then.
        lr = lr if lr else opt_cfg.lr
        on = bool(getattr(invariance_cfg, "dynamics", True))
        return cls(on, opt_cfg, lr, {}, {n: n for n, _ in model.named_parameters()}, set(), [], set(), fresh_lr_mult)

    def check_operator(self, unit, exact, model, state, new_model, new_state, provenance, probe, cfg, metrics, inexact_here=()) -> list[str]:
        patterns, why = held_patterns([s.op for s in unit])
        why += list(inexact_here)
        self.approximate += list(inexact_here)
        for s in unit:
            reason = approximate_step(s.op, s.args)
            if reason is not None:
                exact, why = False, why + [f"{s.op}: {reason}"]
                self.approximate.append(reason)
        fresh = fresh_masks(new_model, provenance)
        held_new = with_patterns(new_model, dict(fresh), patterns)
        # Old side: what the wholly held grown parameters came from (a reset's source, whose values
        # now sit in frozen buffers; a declared hold's source), and what growth froze (add_dense_lora's bases).
        frozen = [n for n, p in new_model.named_parameters() if not p.requires_grad]
        whole = [n for n, p in provenance.items() if p.kind == "reset"] + [n for n, m in held_new.items() if m is None] + frozen
        held_old = {n: None for n in source_names(whole, provenance)}
        subset = _subset_words(fresh, held_old, why)
        regrouped = {p.source for p in provenance.values() if p.kind == "copy" and p.source}
        dyn, problems = dynamics_check(
            Side(model, state, held_old), Side(new_model, new_state, held_new), self.optimizer_cfg, self.lr, probe, exact, cfg, subset, provenance, regrouped
        )
        trainability, dead = trainability_check(new_model, new_state, fresh, self.optimizer_cfg, self.lr, probe, self.fresh_lr_mult)
        metrics.update(dynamics=dyn, trainability=trainability)
        # Carried along for the whole transition's check.
        self.start_held |= {self.origin[n] for n in held_old if self.origin.get(n)}
        self.regrouped |= {self.origin[n] for n in regrouped if self.origin.get(n)}
        carried = carry_masks(self.fresh, new_model, provenance)
        self.fresh = {n: carried[n] | fresh[n] if n in carried and n in fresh else carried.get(n, fresh.get(n)) for n in set(carried) | set(fresh)}
        self.origin = {n: self.origin.get(p.source) if p.kind != "new" else None for n, p in provenance.items()}
        return problems + dead

    def check_transition(self, op_names, exact, start_model, start_state, model, state, probe, cfg, metrics) -> list[str]:
        patterns, why = held_patterns(op_names)
        if self.approximate:
            exact, why = False, why + self.approximate
        held_new = with_patterns(model, dict(self.fresh), patterns)
        whole = {self.origin[n] for n, m in held_new.items() if m is None and self.origin.get(n)}
        held_old = {n: None for n in self.start_held | whole}
        dyn, problems = dynamics_check(
            Side(start_model, start_state, held_old), Side(model, state, held_new), self.optimizer_cfg, self.lr, probe, exact, cfg,
            _subset_words(self.fresh, held_old, why), regrouped=self.regrouped,
        )
        metrics["dynamics"] = dyn
        return problems


def _subset_words(fresh: dict, held_old: dict, why: list[str]) -> list[str]:
    words = []
    if fresh:
        words.append(f"{len(fresh)} parameter(s) with elements new to growth held on the grown side (they step where the old model had nothing)")
    if held_old:
        words.append(f"{len(held_old)} parameter(s) held on the old side (folded into frozen buffers, or declared)")
    return words + why


def _function_report(before, after, targets_BT, blocks, view, routers, exact, cfg) -> tuple[dict, list[str]]:
    metrics = function_metrics(before.logits_BTV, after.logits_BTV, targets_BT)
    drift = block_drift(before, after, blocks, view)
    kl, kl_per_token = router_kl(before, after, routers)
    problems = function_problems(metrics, exact, cfg, drift) + router_problems(kl, exact, cfg)
    if kl:
        metrics["max_router_kl"] = max(kl.values())
    metrics.update(router_kl=kl, router_kl_per_token=kl_per_token, block_rel_l2=drift)
    return metrics, problems


def _record(stage_name, stage_index, index, operator, args, exact, metrics, old_model, new_model, planned_params, problems) -> dict:
    return {
        "stage": stage_name,
        "stage_index": stage_index,
        "index": index,
        "operator": operator,
        "args": args,
        "exact": exact,
        "passed": not problems,
        "metrics": metrics,
        "params_before": sharding.count_parameters(old_model),
        "params_after": sharding.count_parameters(new_model),
        "planned_params": planned_params,
        "problems": problems,
    }


@dataclass
class _Chain:
    """The correspondence between the current model and the stage's first one, composed operator by
    operator: block -> first block, MoE block -> (first block, parent expert of each expert), and
    the current streams viewed at the first width."""

    blocks: dict[int, int]
    routers: dict[int, tuple[int, torch.Tensor | None]]
    view: object

    @classmethod
    def identity(cls, model) -> "_Chain":
        moe = {i: (i, None) for i, b in enumerate(model.blocks) if b.is_moe}
        return cls({i: i for i in range(len(model.blocks))}, moe, lambda x: x)

    def then(self, blocks: dict[int, int], routers: dict, view) -> "_Chain":
        composed = {}
        for new, (old, parent) in routers.items():
            if old in self.routers:
                first, earlier = self.routers[old]
                composed[new] = (first, parent if earlier is None else (earlier if parent is None else earlier[parent]))
        outer = self.view
        return _Chain(
            {new: self.blocks[old] for new, old in blocks.items() if old in self.blocks},
            composed,
            outer if view is None else (lambda x: outer(view(x))),
        )


def _units(steps, stream: bool) -> list[tuple[int, list]]:
    """The stage's steps as applied: (index of the first, steps), one step each, or expert
    operators and the quantize_experts after them together (stages/streaming.py)."""
    units, j = [], 0
    while j < len(steps):
        n = streaming.stream_length(steps, j, stream)
        units.append((j, list(steps[j : j + n])))
        j += n
    return units


def _draw_key(seed: int) -> int:
    """The key an operator applied under growth seed `seed` draws first (sharding.draw_key)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return sharding.draw_key()


def _release_folded(unit, model, state: dict, start_state: dict) -> set[str]:
    """Where `unit` ends in quantize_experts: the entries of `state` of the model's full-precision
    routed experts (what the quantization folds into NF4 bases) removed, and the same objects from
    `start_state` (a carried tensor's state is one object in both); their names. Either may be the
    8-bit optimizer's view (growtrain/optim/adamw8bit.py), which drops the packed entry; its 8-bit
    entries are copies when read, so the first model's are kept where it is another mapping."""
    if unit[-1].op != "quantize_experts":
        return set()
    from growtrain.model.nf4 import MATRICES
    from growtrain.stages.operators.experts import moe_blocks

    params = {n for n, p in model.named_parameters() if p.requires_grad}
    names = {f"blocks.{b}.g.ffn.experts.{m}" for b in moe_blocks(model.config) for m in MATRICES} & params
    released = [state.pop(n) for n in names if n in state]  # held until compared: no id is reused meanwhile
    if start_state is not state:
        gone = {id(s) for s in released}
        for n in [n for n, s in start_state.items() if id(s) in gone]:
            del start_state[n]
    return names


def _reset_sources(provenance: dict[str, Provenance]) -> set[str]:
    return {p.source for p in provenance.values() if p.kind == "reset" and p.source}


def _provenance_summary(provenance: dict[str, Provenance]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for p in provenance.values():
        counts[p.kind] = counts.get(p.kind, 0) + 1
    return counts
