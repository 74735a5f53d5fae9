"""Growth tests: upcycle_moe and deepen keep the logits (fp64), random chains of them keep the
function and the structure, optimizer state follows DESIGN.md §7, one AdamW step after deepen moves
carried weights as the ungrown step does, every structure/function check can fail, impossible
plans name their stage and step, and growth is seeded by position only. CPU, tiny shapes.

Legend: B batch, T sequence, V vocabulary, D d_model, E experts.
"""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch

from conftest import EXPLORE_FACTOR, default_dtype
import torch.nn.functional as F
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from growtrain.model import GrowLM, ModelConfig
from growtrain.optim.adamw import AdamW
from growtrain.optim.registry import build_optimizer
from growtrain.recipe import GrowthStep, InvarianceConfig, OptimizerConfig
from growtrain.stages import (
    OPERATORS,
    GrowthCheckFailed,
    GrowthPlanError,
    Operator,
    Provenance,
    apply_growth,
    get_operator,
    plan_stage_models,
    register,
)
from growtrain.stages.common import materialize
from growtrain.stages.invariance import structure_problems
from growtrain.stages.operators.deepen import DeepenArgs
from growtrain.stages.operators.upcycle import UpcycleArgs
from growtrain.stages.registry import Growth
from growtrain.stages.transition import map_optimizer_state

V, D, H, KV, F_DENSE = 29, 16, 4, 2, 24
OUTPUT_PROJECTIONS = ("f.attn.wo.weight", "g.ffn.w_down.weight", "g.ffn.experts.w_down", "g.ffn.shared.w_down.weight")
FFN_MATRICES = ("w_gate", "w_up", "w_down")

deepen = get_operator("deepen")
upcycle = get_operator("upcycle_moe")


# ---------------------------------------------------------------- helpers




def dense_config(n_layers: int = 3) -> ModelConfig:
    # init_std 0.2 (not 0.02): blocks must move the logits visibly, or a broken exact operator
    # could slip under the tolerance.
    return ModelConfig(vocab_size=V, d_model=D, n_layers=n_layers, n_heads=H, n_kv_heads=KV, ffn_hidden=F_DENSE, init_std=0.2)


SEED_UPCYCLE = UpcycleArgs(num_experts=4, top_k=2, router_init_std=0.5)


def moe_config(n_layers: int = 3, moe_layers=(1,), shared: int = 0) -> ModelConfig:
    """An MoE seed whose MoE settings are upcycle_moe's own, so later upcycles may join it."""
    cfg = upcycle.plan(dense_config(n_layers), replace(SEED_UPCYCLE, layers=tuple(moe_layers)))
    return cfg.with_changes(moe=replace(cfg.moe, shared_expert_hidden=shared)) if shared else cfg


SEEDS = {
    "dense": lambda: dense_config(3),
    "moe": lambda: moe_config(3, (1,)),
    "moe_shared_everywhere": lambda: moe_config(2, (0, 1), shared=8),
}


def logits_of(model: GrowLM, tokens_BT: torch.Tensor) -> torch.Tensor:
    """The model's logits in its own dtype: GrowLM.forward casts the embedding to fp32, which an
    fp64 model cannot take, so this runs the same path (embed, blocks, final norm, head) uncast."""
    with torch.no_grad():
        x1 = x2 = model.embed(tokens_BT)
        for block in model.blocks:
            x1, x2, _ = block(x1, x2)
        return model.lm_head(model.final_norm((x1 + x2) / 2))


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((b - a).norm() / a.norm()).item()


def planned_param_count(cfg: ModelConfig) -> int:
    with torch.device("meta"):
        return GrowLM(cfg).num_parameters()


def tokens(seed: int = 0, B: int = 2, T: int = 6) -> torch.Tensor:
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


def train_step(model: GrowLM, opt: AdamW, batch_BT: torch.Tensor, with_aux: bool = True, lr: float = 1e-2) -> None:
    out = model(batch_BT[:, :-1])
    loss = F.cross_entropy(out.logits.flatten(0, 1), batch_BT[:, 1:].flatten())
    if with_aux:
        loss = loss + out.aux_loss
    opt.zero_grad()
    loss.backward()
    opt.step(lr)


def inserted_blocks(n_layers: int, after: tuple[int, ...]) -> list[tuple[int, bool]]:
    """The grown stack as (old block index, inserted?) per new index, written independently of deepen."""
    after = after or tuple(range(n_layers))
    out = []
    for i in range(n_layers):
        out.append((i, False))
        out.extend((i, True) for _ in range(after.count(i)))
    return out


def grow_once(model, args, op, seed=0, stage_index=1):
    """apply_growth for one operator with a fresh probe and default thresholds."""
    probe = (tokens(seed=99, T=8), tokens(seed=98, T=8))
    state = build_optimizer(dict(model.named_parameters()), OptimizerConfig()).state
    return apply_growth(
        model,
        state,
        [GrowthStep(op.name, args)],
        seed=seed,
        stage_index=stage_index,
        stage_name="grown",
        planned=op.plan(model.config, args),
        probe=probe,
        invariance_cfg=InvarianceConfig(),
    )


# ---------------------------------------------------------------- upcycle_moe


UPCYCLES = {
    "E4_k2_softmax_all": (2, UpcycleArgs(num_experts=4, top_k=2, score_func="softmax", router_init_std=0.5)),
    "E4_k1_sigmoid_layer1": (2, UpcycleArgs(num_experts=4, top_k=1, score_func="sigmoid", layers=(1,), router_init_std=0.5)),
    "E3_k3_softmax_layer0": (3, UpcycleArgs(num_experts=3, top_k=3, score_func="softmax", layers=(0,))),
    "E5_k2_sigmoid_layers02": (3, UpcycleArgs(num_experts=5, top_k=2, score_func="sigmoid", layers=(0, 2), router_init_std=1.0)),
    "E1_k1_softmax_all": (1, UpcycleArgs(num_experts=1, top_k=1)),
}


@pytest.mark.parametrize("case", UPCYCLES)
def test_upcycle_moe_keeps_the_logits_and_builds_exactly_the_planned_model(case, fp64):
    n_layers, args = UPCYCLES[case]
    torch.manual_seed(0)
    cfg = dense_config(n_layers)
    model = GrowLM(cfg)
    x_BT = tokens()
    before = logits_of(model, x_BT)
    growth = upcycle.apply(model, args)
    after = logits_of(growth.model, x_BT)
    assert (after - before).abs().max().item() < 1e-12 and rel_diff(before, after) < 1e-12

    planned = upcycle.plan(cfg, args)
    assert growth.model.config == planned
    targets = args.layers or tuple(range(n_layers))
    assert planned.moe_layers == tuple(sorted(targets))
    with torch.device("meta"):
        reference = GrowLM(planned)
    names = {n: tuple(p.shape) for n, p in growth.model.named_parameters()}
    assert names == {n: tuple(p.shape) for n, p in reference.named_parameters()}
    assert growth.model.num_parameters() == reference.num_parameters()
    assert all(p.dtype == torch.float64 for p in growth.model.parameters())
    assert structure_problems(model, growth.model, growth.provenance, reference.num_parameters()) == []
    for i in targets:
        for m in FFN_MATRICES:
            dense_W = model.state_dict()[f"blocks.{i}.g.ffn.{m}.weight"]
            experts_W = growth.model.state_dict()[f"blocks.{i}.g.ffn.experts.{m}"]
            assert all(torch.equal(experts_W[e], dense_W) for e in range(args.num_experts))
        assert growth.provenance[f"blocks.{i}.g.ffn.router.weight"].kind == "new"


def test_upcycle_moe_joins_existing_moe_layers_and_keeps_them_carried(fp64):
    torch.manual_seed(1)
    cfg = moe_config(3, (1,))
    model = GrowLM(cfg)
    x_BT = tokens()
    growth = upcycle.apply(model, SEED_UPCYCLE)  # layers=(): every dense block, i.e. 0 and 2
    assert growth.model.config.moe_layers == (0, 1, 2)
    assert rel_diff(logits_of(model, x_BT), logits_of(growth.model, x_BT)) < 1e-12
    assert growth.provenance["blocks.1.g.ffn.experts.w_up"] == Provenance("carried", "blocks.1.g.ffn.experts.w_up")
    assert structure_problems(model, growth.model, growth.provenance, planned_param_count(growth.model.config)) == []


@pytest.mark.parametrize("op_name, args", [("upcycle_moe", UPCYCLES["E4_k2_softmax_all"][1]), ("deepen", DeepenArgs(after=(0, 0)))])
def test_apply_growth_records_a_passed_check_with_metrics(op_name, args):
    torch.manual_seed(2)
    model = GrowLM(dense_config(2))
    op = get_operator(op_name)
    outcome = grow_once(model, args, op)
    (record,) = outcome.records
    assert record["passed"] is True and record["problems"] == []
    assert record["operator"] == op_name and record["exact"] is True and record["stage"] == "grown"
    m = record["metrics"]
    assert set(m) >= {"max_abs_dlogits", "rel_l2", "cosine", "loss_before", "loss_after", "rel_dloss"}
    assert m["rel_l2"] < 1e-6 and m["cosine"] > 1 - 1e-9 and m["loss_before"] > 0
    assert record["params_after"] == record["planned_params"] == outcome.model.num_parameters() > record["params_before"]
    assert sum(record["provenance"].values()) == len(dict(outcome.model.named_parameters()))
    assert outcome.model.config == op.plan(model.config, args)
    assert set(outcome.optimizer_state) == {n for n, _ in outcome.model.named_parameters()}


# ---------------------------------------------------------------- deepen


AFTERS = {
    "every_block": lambda n: (),
    "first": lambda n: (0,),
    "first_twice": lambda n: (0, 0),
    "last": lambda n: (n - 1,),
    "last_twice_and_first_unsorted": lambda n: (n - 1, 0, n - 1),
}


@pytest.mark.parametrize("init", ["copy", "fresh"])
@pytest.mark.parametrize("after", AFTERS)
@pytest.mark.parametrize("seed_kind", SEEDS)
def test_deepen_inserts_identity_blocks_and_keeps_the_logits(seed_kind, after, init, fp64):
    torch.manual_seed(3)
    cfg = SEEDS[seed_kind]()
    model = GrowLM(cfg)
    args = DeepenArgs(after=AFTERS[after](cfg.n_layers), init=init)
    x_BT = tokens()
    before = logits_of(model, x_BT)
    growth = deepen.apply(model, args)
    new = growth.model
    after_logits = logits_of(new, x_BT)
    assert (after_logits - before).abs().max().item() < 1e-12 and rel_diff(before, after_logits) < 1e-12

    layout = inserted_blocks(cfg.n_layers, args.after)
    planned = deepen.plan(cfg, args)
    assert new.config == planned and planned.n_layers == len(layout)
    assert planned.moe_layers == tuple(j for j, (src, _) in enumerate(layout) if src in cfg.moe_layers)
    assert structure_problems(model, new, growth.provenance, planned_param_count(planned)) == []
    old_state, new_state = model.state_dict(), new.state_dict()
    for name, value in new_state.items():
        if not name.startswith("blocks."):
            assert torch.equal(value, old_state[name])
            continue
        j, rest = int(name.split(".")[1]), name.split(".", 2)[2]
        src, is_new = layout[j]
        neighbour = old_state[f"blocks.{src}.{rest}"]
        if not is_new:
            assert torch.equal(value, neighbour)
            if name in growth.provenance:  # buffers (balance_bias) have no provenance
                assert growth.provenance[name] == Provenance("carried", f"blocks.{src}.{rest}")
        elif rest in OUTPUT_PROJECTIONS:
            assert torch.count_nonzero(value) == 0, f"{name} must be zero for the block to be an identity"
        elif init == "copy" or rest.endswith("norm.weight") or rest.endswith("balance_bias"):
            assert torch.equal(value, neighbour)  # norms start at ones and the bias at zero either way
        else:
            assert not torch.equal(value, neighbour), f"{name} should be freshly drawn"
        if is_new and name in growth.provenance:
            assert growth.provenance[name].kind == "new"


# ---------------------------------------------------------------- random chains (hypothesis)


@st.composite
def seed_shapes(draw) -> ModelConfig:
    n_heads = draw(st.sampled_from([1, 2, 4]))
    kv = draw(st.sampled_from([k for k in (0, 1, 2, 4) if k == 0 or n_heads % k == 0]))
    head = draw(st.sampled_from([2, 4]))
    cfg = ModelConfig(
        vocab_size=draw(st.integers(3, 23)),
        d_model=n_heads * head,
        n_layers=draw(st.integers(1, 3)),
        n_heads=n_heads,
        n_kv_heads=kv,
        ffn_hidden=draw(st.integers(1, 12)),
        init_std=0.2,
    )
    if draw(st.booleans()):
        layers = draw(st.lists(st.integers(0, cfg.n_layers - 1), min_size=1, max_size=cfg.n_layers, unique=True))
        cfg = upcycle.plan(cfg, replace(SEED_UPCYCLE, layers=tuple(layers)))
    return cfg


@settings(max_examples=30 * EXPLORE_FACTOR, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(cfg=seed_shapes(), data=st.data())
def test_random_chains_of_upcycle_and_deepen_keep_logits_and_structure(cfg, data):
    with default_dtype(torch.float64):
        torch.manual_seed(data.draw(st.integers(0, 2**16), label="torch seed"))
        # One MoE setting per chain: upcycle_moe refuses to mix settings across layers.
        moe_args = cfg.moe and SEED_UPCYCLE
        if moe_args is None:
            E = data.draw(st.integers(1, 4), label="num_experts")
            moe_args = UpcycleArgs(
                num_experts=E,
                top_k=data.draw(st.integers(1, E), label="top_k"),
                score_func=data.draw(st.sampled_from(["softmax", "sigmoid"]), label="score_func"),
                router_init_std=1.0,
            )
        model = GrowLM(cfg)
        x_BT = torch.randint(0, cfg.vocab_size, (2, 5))
        reference = logits_of(model, x_BT)
        for _ in range(data.draw(st.integers(1, 4), label="chain length")):
            n = model.config.n_layers
            dense = [i for i in range(n) if not model.config.is_moe_layer(i)]
            kinds = ["deepen"] + (["upcycle_moe"] if dense else [])
            if data.draw(st.sampled_from(kinds), label="operator") == "deepen":
                after = data.draw(st.lists(st.integers(0, n - 1), max_size=3), label="after")
                op, args = deepen, DeepenArgs(after=tuple(after), init=data.draw(st.sampled_from(["copy", "fresh"]), label="init"))
            else:
                layers = data.draw(st.lists(st.sampled_from(dense), max_size=len(dense), unique=True), label="layers")
                op, args = upcycle, replace(moe_args, layers=tuple(layers))
            try:
                planned = op.plan(model.config, args)
            except GrowthPlanError:
                assume(False)
            if planned.n_layers > 12:
                break  # keeps each example a few milliseconds
            growth = op.apply(model, args)
            assert growth.model.config == planned
            assert structure_problems(model, growth.model, growth.provenance, planned_param_count(planned)) == []
            assert rel_diff(reference, logits_of(growth.model, x_BT)) < 1e-10
            model = growth.model


# ---------------------------------------------------------------- optimizer state (DESIGN.md §7)


def trained(cfg: ModelConfig, steps: int = 2, seed: int = 4) -> tuple[GrowLM, AdamW]:
    torch.manual_seed(seed)
    model = GrowLM(cfg)
    opt = build_optimizer(dict(model.named_parameters()), OptimizerConfig())
    for k in range(steps):
        train_step(model, opt, tokens(seed=k, T=7))
    return model, opt


def assert_fresh(state, name: str) -> None:
    assert state.step == 0 and torch.count_nonzero(state.exp_avg) == 0 and torch.count_nonzero(state.exp_avg_sq) == 0, name
    assert state.lr_mult == 1.0 and state.eps_mult == 1.0


def test_upcycle_maps_optimizer_state_as_copies_over_e_and_fresh_routers():
    E = 4
    model, opt = trained(dense_config(3))
    old = opt.state
    args = UpcycleArgs(num_experts=E, top_k=2, layers=(0, 2))
    growth = upcycle.apply(model, args)
    new = map_optimizer_state(old, growth.model, growth.provenance)
    assert set(new) == {n for n, _ in growth.model.named_parameters()}
    for i in args.layers:
        for m in FFN_MATRICES:
            src, dst = old[f"blocks.{i}.g.ffn.{m}.weight"], new[f"blocks.{i}.g.ffn.experts.{m}"]
            assert src.step == 2 and dst.step == src.step
            assert torch.count_nonzero(src.exp_avg) > 0 and torch.count_nonzero(src.exp_avg_sq) > 0
            for e in range(E):
                assert torch.equal(dst.exp_avg[e], src.exp_avg / E)
                assert torch.equal(dst.exp_avg_sq[e], src.exp_avg_sq / E**2)
            assert dst.eps_mult == pytest.approx(1 / E, rel=1e-15) and dst.lr_mult == 1.0 and dst.wd_mult == 1.0
        router = new[f"blocks.{i}.g.ffn.router.weight"]
        assert_fresh(router, f"router {i}")
        assert router.exp_avg.shape == (E, D) and router.wd_mult == 1.0
    for name, s in new.items():
        if growth.provenance[name].kind == "carried":
            assert s is old[name]
    assert {n for n, p in growth.provenance.items() if p.kind == "carried"} == set(old) - {
        f"blocks.{i}.g.ffn.{m}.weight" for i in args.layers for m in FFN_MATRICES
    }

    opt.rebind(dict(growth.model.named_parameters()), new)
    train_step(growth.model, opt, tokens(seed=5, T=7))  # the mapped state drives a real step
    assert new["blocks.0.g.ffn.router.weight"].step == 1 and new["blocks.0.g.ffn.experts.w_up"].step == 3
    missing = dict(new)
    del missing["blocks.2.g.ffn.experts.w_down"]
    with pytest.raises(ValueError, match="missing.*blocks.2.g.ffn.experts.w_down"):
        opt.rebind(dict(growth.model.named_parameters()), missing)


def test_deepen_gives_new_blocks_fresh_state_and_carried_blocks_their_own_under_new_indices():
    model, opt = trained(moe_config(3, (1,)))
    old = opt.state
    growth = deepen.apply(model, DeepenArgs(after=(1, 0)))  # new layout: 0, new, 1, new, 2
    new = map_optimizer_state(old, growth.model, growth.provenance)
    assert set(new) == {n for n, _ in growth.model.named_parameters()}
    renamed = {0: 0, 2: 1, 4: 2}
    for name, s in new.items():
        parts = name.split(".")
        if parts[0] != "blocks":
            assert s is old[name]
        elif int(parts[1]) in renamed:
            src = ".".join(["blocks", str(renamed[int(parts[1])]), *parts[2:]])
            assert s is old[src] and s.step == 2 and torch.count_nonzero(s.exp_avg) > 0
        else:
            assert_fresh(s, name)
            assert s.wd_mult == (1.0 if s.exp_avg.ndim >= 2 else 0.0)
    assert "blocks.3.g.ffn.router.weight" in new  # the block inserted after the MoE block is MoE too
    opt.rebind(dict(growth.model.named_parameters()), new)
    stray = {**new, "blocks.9.f.norm.weight": new["blocks.0.f.norm.weight"]}
    with pytest.raises(ValueError, match="stray"):
        opt.rebind(dict(growth.model.named_parameters()), stray)


CARRIED_STEP_CASES = {
    # New dense blocks: the full training loss (CE + carried layers' aux) is unchanged by growth.
    "dense_after_every_block_copy": (lambda: dense_config(2), (), "copy", True),
    "moe_seed_new_dense_block_fresh": (lambda: moe_config(3, (1,)), (0, 2), "fresh", True),
    # A new MoE block adds its own aux loss, whose gradient reaches the carried weights below it
    # through its router; with the CE alone the step must be unchanged.
    "moe_seed_new_moe_block_ce_only": (lambda: moe_config(2, (1,)), (1,), "copy", False),
}


@pytest.mark.parametrize("case", CARRIED_STEP_CASES)
def test_one_adamw_step_after_deepen_moves_carried_weights_as_the_ungrown_step(case):
    make_cfg, after, init, with_aux = CARRIED_STEP_CASES[case]
    model, opt = trained(make_cfg())
    ref_model, ref_state = copy.deepcopy(model), copy.deepcopy(opt.state)
    growth = deepen.apply(model, DeepenArgs(after=after, init=init))
    grown = growth.model
    grown_opt = build_optimizer(dict(grown.named_parameters()), OptimizerConfig())
    grown_opt.rebind(dict(grown.named_parameters()), map_optimizer_state(opt.state, grown, growth.provenance))
    ref_opt = build_optimizer(dict(ref_model.named_parameters()), OptimizerConfig())
    ref_opt.rebind(dict(ref_model.named_parameters()), ref_state)

    ref_before = {n: p.detach().clone() for n, p in ref_model.named_parameters()}
    grown_before = {n: p.detach().clone() for n, p in grown.named_parameters()}
    batch = tokens(seed=7, T=7)
    train_step(ref_model, ref_opt, batch, with_aux=with_aux)
    train_step(grown, grown_opt, batch, with_aux=with_aux)

    ref_params, grown_params = dict(ref_model.named_parameters()), dict(grown.named_parameters())
    carried = {n: p.source for n, p in growth.provenance.items() if p.kind == "carried"}
    assert len(carried) == len(ref_params)
    for name, src in carried.items():
        assert torch.equal(grown_params[name].grad, ref_params[src].grad), f"gradient of {name} (was {src})"
        update = grown_params[name].detach() - grown_before[name]
        ref_update = ref_params[src].detach() - ref_before[src]
        assert torch.equal(update, ref_update), f"{name} (was {src}) moved differently: max diff {(update - ref_update).abs().max():.3g}"
        assert torch.count_nonzero(ref_update) > 0
    new_names = [n for n, p in growth.provenance.items() if p.kind == "new" and not n.endswith("router.weight")]
    assert new_names
    for name in new_names:
        grad = grown_params[name].grad
        if name.split(".", 2)[2] in OUTPUT_PROJECTIONS:
            assert torch.count_nonzero(grad) > 0, f"{name}: the zero output projection must start learning"
        else:
            assert torch.count_nonzero(grad) == 0, f"{name}: non-output weights of an identity block get no gradient at first"


# ---------------------------------------------------------------- the checks can fail


@pytest.fixture
def throwaway_operator():
    """Register test-only operators (deepen's plan and args by default); remove them afterwards so
    the global registry is left as it was."""
    before = dict(OPERATORS)
    added: list[str] = []

    def add(name: str, apply, plan=deepen.plan, exact: bool = True) -> Operator:
        added.append(name)
        return register(Operator(name, exact, "test-only broken operator", DeepenArgs, plan, apply))

    yield add
    for name in added:
        OPERATORS.pop(name, None)
    assert OPERATORS == before


def seed_model(n_layers: int = 2) -> GrowLM:
    torch.manual_seed(5)
    return GrowLM(dense_config(n_layers))


def test_structure_check_names_a_parameter_missing_from_the_provenance(throwaway_operator):
    def apply(model, args):
        growth = deepen.apply(model, args)
        del growth.provenance["blocks.0.f.attn.wq.weight"]
        return growth

    op = throwaway_operator("deepen_forgets_a_parameter", apply)
    model, args = seed_model(), DeepenArgs(after=(1,))
    growth = op.apply(model, args)
    problems = structure_problems(model, growth.model, growth.provenance, planned_param_count(op.plan(model.config, args)))
    assert any("produced by no rule" in p and "blocks.0.f.attn.wq.weight" in p for p in problems), problems
    with pytest.raises(GrowthCheckFailed, match="deepen_forgets_a_parameter(.|\n)*blocks.0.f.attn.wq.weight"):
        grow_once(model, args, op)


def test_materialize_refuses_a_state_dict_with_a_renamed_key(throwaway_operator):
    def apply(model, args):
        state = model.state_dict()
        state["blocks.0.f.attn.query.weight"] = state.pop("blocks.0.f.attn.wq.weight")
        return Growth(materialize(model.config, state), {})

    op = throwaway_operator("identity_with_a_renamed_key", apply, plan=lambda cfg, args: cfg)
    with pytest.raises(RuntimeError, match=r"(?s)Missing key.*blocks\.0\.f\.attn\.wq\.weight.*Unexpected key.*blocks\.0\.f\.attn\.query\.weight"):
        grow_once(seed_model(), DeepenArgs(after=(0,)), op)


def test_structure_check_reports_a_parameter_count_other_than_planned(throwaway_operator):
    def apply(model, args):
        return deepen.apply(model, replace(args, after=args.after + (0,)))  # one block more than planned

    op = throwaway_operator("deepen_grows_too_much", apply)
    model, args = seed_model(), DeepenArgs(after=(1,))
    growth = op.apply(model, args)
    planned = planned_param_count(op.plan(model.config, args))
    problems = structure_problems(model, growth.model, growth.provenance, planned)
    assert problems == [f"parameter count {growth.model.num_parameters():,} differs from the planned {planned:,}"]
    with pytest.raises(GrowthCheckFailed, match="parameter count"):
        grow_once(model, args, op)


def test_apply_growth_stops_an_exact_operator_that_moves_the_logits(throwaway_operator):
    def apply(model, args):
        growth = deepen.apply(model, replace(args, init="copy"))
        with torch.no_grad():  # "forget" to zero the new block's output projections
            growth.model.blocks[1].f.attn.wo.weight.copy_(model.blocks[0].f.attn.wo.weight)
            growth.model.blocks[1].g.ffn.w_down.weight.copy_(model.blocks[0].g.ffn.w_down.weight)
        return growth

    op = throwaway_operator("deepen_without_zeroing", apply)
    with pytest.raises(GrowthCheckFailed) as err:
        grow_once(seed_model(), DeepenArgs(after=(0,)), op)
    record = err.value.record
    rel = record["metrics"]["rel_l2"]
    assert record["operator"] == "deepen_without_zeroing" and record["passed"] is False and record["index"] == 0
    assert rel > InvarianceConfig().exact_rel_tol
    msg = str(err.value)
    assert "deepen_without_zeroing" in msg and "stage 'grown'" in msg and f"relative L2 {rel:.3g}" in msg


def test_structure_check_reports_one_source_carried_into_two_parameters(throwaway_operator):
    def apply(model, args):
        growth = deepen.apply(model, replace(args, init="copy"))
        for name, prov in list(growth.provenance.items()):
            if prov.kind == "new":  # claim the copied block is the old one, carried again
                growth.provenance[name] = Provenance("carried", prov.source)
        return growth

    op = throwaway_operator("deepen_carries_twice", apply)
    model, args = seed_model(), DeepenArgs(after=(0,))
    growth = op.apply(model, args)
    problems = structure_problems(model, growth.model, growth.provenance, planned_param_count(op.plan(model.config, args)))
    assert any("carried into two places" in p and "blocks.0." in p for p in problems), problems
    with pytest.raises(GrowthCheckFailed, match="carried into two places"):
        grow_once(model, args, op)


# ---------------------------------------------------------------- planning


def test_plan_stage_models_names_the_stage_and_step_of_a_deepen_past_the_last_block():
    grows = [
        (),
        (GrowthStep("upcycle_moe", UpcycleArgs(num_experts=4, top_k=2)), GrowthStep("deepen", DeepenArgs(after=(1,)))),
        (GrowthStep("deepen", DeepenArgs(after=(0,))), GrowthStep("deepen", DeepenArgs(after=(7,)))),
    ]
    with pytest.raises(GrowthPlanError, match="block 7 does not exist") as err:
        plan_stage_models(dense_config(2), grows)
    assert (err.value.stage_index, err.value.step_index) == (2, 1)
    shapes = plan_stage_models(dense_config(2), grows[:2])
    assert [s.n_layers for s in shapes] == [2, 3] and shapes[1].moe_layers == (0, 1, 2)


def test_plan_stage_models_names_the_stage_and_step_that_upcycles_an_moe_layer():
    grows = [
        (GrowthStep("upcycle_moe", UpcycleArgs(layers=(1,))),),
        (GrowthStep("deepen", DeepenArgs(after=(0,))),),
        (GrowthStep("upcycle_moe", UpcycleArgs(layers=(0,))), GrowthStep("upcycle_moe", UpcycleArgs(layers=(2,)))),
    ]
    # After stage 1 the old block 1 sits at index 2: upcycling it again is the error, at (2, 1).
    with pytest.raises(GrowthPlanError, match="layer 2 is already an MoE layer") as err:
        plan_stage_models(dense_config(2), grows)
    assert (err.value.stage_index, err.value.step_index) == (2, 1)


# ---------------------------------------------------------------- seeding


def test_growth_is_a_function_of_its_position_and_leaves_the_global_rng_alone():
    torch.manual_seed(6)
    model = GrowLM(dense_config(2))
    state = build_optimizer(dict(model.named_parameters()), OptimizerConfig()).state
    steps = [GrowthStep("upcycle_moe", UpcycleArgs(num_experts=4, top_k=2)), GrowthStep("deepen", DeepenArgs(after=(1,), init="fresh"))]
    planned = plan_stage_models(model.config, [steps])[0]
    probe = (tokens(seed=11), tokens(seed=12))

    def grow(stage_index: int):
        rng = torch.get_rng_state()
        outcome = apply_growth(
            model, state, steps, seed=7, stage_index=stage_index, stage_name="s", planned=planned, probe=probe, invariance_cfg=InvarianceConfig()
        )
        assert torch.equal(torch.get_rng_state(), rng), "growth advanced the global RNG"
        return outcome.model.state_dict()

    first, second, elsewhere = grow(1), grow(1), grow(2)
    assert first.keys() == second.keys()
    assert all(torch.equal(first[k], second[k]) for k in first)
    router = "blocks.0.g.ffn.router.weight"
    assert torch.count_nonzero(first[router]) > 0
    assert not torch.equal(first[router], elsewhere[router])
    assert not torch.equal(first["blocks.2.f.attn.wq.weight"], elsewhere["blocks.2.f.attn.wq.weight"])  # fresh block


# ---------------------------------------------------------------- the twin (issue 42)


def test_jittering_moves_about_half_the_nonzero_weights_one_ulp_and_restores_them_bitwise():
    from growtrain.stages.dynamics import jittered

    model = GrowLM(moe_config())
    with torch.no_grad():
        model.blocks[0].f.attn.wo.weight[:2].zero_()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with jittered(model):
        for n, p in model.named_parameters():
            moved = p != before[n]
            assert not bool(moved[before[n] == 0].any()), f"{n}: a zero moved"
            ulp = (torch.nextafter(before[n].abs(), torch.full_like(p, float("inf"))) - before[n].abs())
            assert torch.equal((p - before[n]).abs()[moved], ulp[moved]), f"{n}: moved by other than one ulp away from zero"
            if p.numel() > 100:
                assert 0.4 < moved.float().mean() < 0.6, (n, moved.float().mean())
        jittered_once = {n: p.detach().clone() for n, p in model.named_parameters()}
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    with jittered(model):  # the same elements every time: drawn from the names
        assert all(torch.equal(p, jittered_once[n]) for n, p in model.named_parameters())


def test_the_twin_regroups_only_the_8bit_moments_growth_copies():
    from growtrain.stages.dynamics import Reblocked

    model = GrowLM(ModelConfig(vocab_size=V, d_model=64, n_layers=1, n_heads=4, n_kv_heads=2, ffn_hidden=128, init_std=0.2))
    opt = build_optimizer(dict(model.named_parameters()), OptimizerConfig(dense_state_bits=8))
    for _ in range(2):
        train_step(model, opt, tokens(seed=5, B=2, T=16), lr=1e-2)
    named = dict(model.named_parameters())
    state = opt.state
    name = "blocks.0.g.ffn.w_up.weight"  # 128 x 64: 8-bit moments
    twin = Reblocked(state, named, opt.cfg, regrouped={name})
    other = next(n for n in state if n != name)
    assert twin[other] is state[other] or torch.equal(twin[other].exp_avg, state[other].exp_avg)
    m, m_twin = state[name].exp_avg, twin[name].exp_avg
    assert not torch.equal(m, m_twin), "shifted blocks must requantize differently"
    assert float((m - m_twin).abs().max()) <= 0.2 * float(m.abs().max()), "the same moments up to 8-bit resolution"
    assert torch.equal(Reblocked(state, named, OptimizerConfig(), {name})[name].exp_avg, m), "32-bit state passes through"
