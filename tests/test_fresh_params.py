"""What the elements a growth creates fresh get (the recipe's `stages.N.fresh`, issue 43): an LR
multiplier of their own, which the mapping writes and the fresh-state check expects (a mapping
that drops it stops the growth); a warm-up that ramps the LR of exactly the elements that took no
step before the stage, read from the step counts, so a resume mid-ramp repeats it; `state: fresh`,
which resets the optimizer state before growing and keeps the multipliers; and what `validate`
refuses. Through real `growtrain run`s where the trainer is involved.

Legend: E experts, F hidden width, D d_model.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import yaml
from torch import nn

from conftest import MICRO, assert_same_run, kill_and_resume, losses, metrics_rows, run_cli, train_recipe
from growtrain.optim.adamw import OptimizerConfig, ParamState
from growtrain.optim.registry import build_optimizer
from growtrain.recipe import FreshConfig, InvarianceConfig, RecipeError, recipe_from_dict
from growtrain.stages import transition
from growtrain.stages.operators.experts import CloneExpertsArgs, SplitExpertsArgs
from growtrain.stages.operators.upcycle import UpcycleArgs
from test_growth_operators import LENIENT, dense_config, grow, moe_config, trained

DEFAULT = InvarianceConfig()  # the recipe's bars (these models are fp32)

EXPERT = "blocks.1.g.ffn.experts."


# ---------------------------------------------------------------------------------------------
# The ramp, on the optimizer


def _state(p: torch.Tensor, step) -> ParamState:
    g = torch.Generator().manual_seed(p.numel())
    m = torch.randn(p.shape, generator=g) * 1e-2
    return ParamState(step, m, m.square() + 1e-4, 1.0, 1.0, 1.0, 1.0)


@pytest.mark.parametrize("bits", [32, 8])
def test_the_ramp_scales_the_lr_of_the_elements_that_took_no_step_before_the_stage_and_nothing_else(bits):
    """Two steps into a stage (since = 2): a tensor whose rows 2-3 joined at the growth (counts 2)
    next to rows carried from before (counts 9), a whole new tensor (int count 2) and an old one
    (int count 9; 64 x 64 so that the 8-bit optimizer keeps its moments in 8 bits). Each element
    must step as it would at LR x factor if it joined, at LR otherwise; the multipliers come back."""
    torch.manual_seed(0)
    shapes = {"mixed": (4, 64, 64), "new": (5, 3), "old": (64, 64)}
    steps = {"mixed": torch.tensor([9, 9, 2, 2], dtype=torch.int32).view(4, 1, 1), "new": 2, "old": 9}
    young = {"mixed": torch.tensor([0, 0, 1, 1], dtype=torch.bool).view(4, 1, 1), "new": torch.tensor(True), "old": torch.tensor(False)}
    cfg = OptimizerConfig(lr=1e-2, weight_decay=0.1, dense_state_bits=bits)
    lr, factor = 1e-2, 0.25

    def optimizer():
        params = {n: nn.Parameter(torch.randn(s, generator=torch.Generator().manual_seed(len(n)))) for n, s in shapes.items()}
        opt = build_optimizer(params, cfg)
        opt.rebind(params, {n: _state(p.detach(), copy.deepcopy(steps[n])) for n, p in params.items()})
        for n, p in params.items():
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(7 + len(n)))
        return params, opt

    ramped, opt = optimizer()
    multipliers = {n: s.lr_mult for n, s in opt.state.items()}
    with opt.ramped(2, factor):
        opt.step(lr)
    assert {n: s.lr_mult for n, s in opt.state.items()} == multipliers, "the ramp must leave the multipliers as it found them"
    at_lr, opt_a = optimizer()
    opt_a.step(lr)
    at_ramp, opt_b = optimizer()
    opt_b.step(lr * factor)
    for n in shapes:
        want = torch.where(young[n], at_ramp[n], at_lr[n])
        torch.testing.assert_close(ramped[n].detach(), want.detach(), rtol=1e-6, atol=0, msg=n)
        assert not torch.equal(at_ramp[n], at_lr[n]), n  # the two LRs move every tensor differently
    for n in shapes:  # the step counts advanced as usual
        s = opt.state[n].step
        want = steps[n] + 1
        assert torch.equal(s, want) if isinstance(s, torch.Tensor) else s == want, n


def test_the_ramp_over_the_stage_is_linear_and_ends():
    fresh = FreshConfig(warmup_steps=4)
    assert [fresh.ramp(t) for t in range(6)] == [0.25, 0.5, 0.75, 1.0, None, None]
    assert FreshConfig().ramp(0) is None


# ---------------------------------------------------------------------------------------------
# The mapping and the fresh-state check


def grow_with(model, state, op: str, args, fresh: FreshConfig, cfg=DEFAULT):
    """test_growth_operators.grow with a `fresh` section, on a copy of the state (reset zeroes it in place)."""
    return grow(model, copy.deepcopy(state), op, args, cfg=cfg, fresh=fresh)


def test_growth_gives_its_fresh_elements_the_recipes_lr_multiplier_and_the_check_expects_it():
    # Clones with redrawn neurons: fresh elements inside copied tensors (per-neuron fields).
    model, opt = trained(moe_config(E=4, k=2))
    args = CloneExpertsArgs(factor=2, reinit_fraction=0.5, router_noise=0.01)
    outcome = grow_with(copy.deepcopy(model), opt.state, "clone_experts", args, FreshConfig(lr_mult=0.25), LENIENT)
    (record,) = outcome.records
    assert record["passed"], record["problems"]
    assert record["metrics"]["trainability"]["fresh_first_step"], "the fresh-state check judged nothing"
    default = grow_with(copy.deepcopy(model), opt.state, "clone_experts", args, FreshConfig(), LENIENT).optimizer_state
    for m in ("w_gate", "w_up", "w_down"):
        s, d = outcome.optimizer_state[EXPERT + m], default[EXPERT + m]
        joined = (s.step.expand(s.exp_avg.shape) == 0)
        assert joined.any() and (~joined).any()
        lr_mult = s.lr_mult.expand(s.exp_avg.shape)
        assert torch.all(lr_mult[joined] == 0.25), m
        assert torch.all(lr_mult[~joined] == (d.lr_mult.expand(s.exp_avg.shape)[~joined] if isinstance(d.lr_mult, torch.Tensor) else d.lr_mult)), m
    # A new parameter (the router of an upcycled layer) gets it whole.
    dense, dense_opt = trained(dense_config())
    up = UpcycleArgs(num_experts=4, top_k=2, layers=(1,), router_init_std=0.5)
    grown = grow_with(dense, dense_opt.state, "upcycle_moe", up, FreshConfig(lr_mult=0.25))
    assert grown.records[0]["passed"], grown.records[0]["problems"]
    assert grown.optimizer_state["blocks.1.g.ffn.router.weight"].lr_mult == 0.25
    assert grown.optimizer_state["blocks.1.g.ffn.experts.w_up"].lr_mult != 0.25  # copies keep their mapped state


def test_a_mapping_that_drops_the_fresh_multiplier_stops_the_growth(monkeypatch):
    original = transition.map_optimizer_state
    monkeypatch.setattr(transition, "map_optimizer_state", lambda old, model, provenance, *_: original(old, model, provenance))
    model, opt = trained(moe_config(E=4, k=2))
    args = CloneExpertsArgs(factor=2, reinit_fraction=0.5, router_noise=0.01)
    with pytest.raises(transition.GrowthCheckFailed) as info:
        grow_with(model, opt.state, "clone_experts", args, FreshConfig(lr_mult=0.25), LENIENT)
    problems = info.value.record["problems"]
    assert any(p.startswith("fresh state: the first step of") and "w_" in p for p in problems), problems


def test_state_fresh_resets_every_moment_and_step_count_and_keeps_the_multipliers():
    model, opt = trained(moe_config(E=4, k=2))
    reset = grow_with(copy.deepcopy(model), opt.state, "split_experts", SplitExpertsArgs(), FreshConfig(state="fresh"))
    mapped = grow_with(copy.deepcopy(model), opt.state, "split_experts", SplitExpertsArgs(), FreshConfig())
    for record in reset.records:  # an exact operator's checks pass on the reset state: like is compared with like
        assert record["passed"], record["problems"]
    assert reset.optimizer_state.keys() == mapped.optimizer_state.keys()
    for name, s in reset.optimizer_state.items():
        m = mapped.optimizer_state[name]
        assert not torch.as_tensor(s.step).any(), name
        assert not s.exp_avg.any() and not s.exp_avg_sq.any(), name
        for k in ("lr_mult", "wd_mult", "eps_mult", "norm_mult"):
            a, b = getattr(s, k), getattr(m, k)
            assert torch.equal(torch.as_tensor(a), torch.as_tensor(b)), (name, k)
    assert any(torch.as_tensor(m.exp_avg).any() for m in mapped.optimizer_state.values())  # the mapped state was not zero


# ---------------------------------------------------------------------------------------------
# Through `growtrain run`


def fresh_recipe() -> dict:
    """MICRO (dense 8, moe 6, deep 6 steps; checkpoints every 4) with the upcycle's fresh elements
    (the router) at 0.3 x the LR, ramped over the whole moe stage, and the deep stage's state reset
    and ramped over 2 steps."""
    raw = copy.deepcopy(MICRO)
    raw["stages"][1]["fresh"] = {"lr_mult": 0.3, "warmup_steps": 6}
    raw["stages"][2]["fresh"] = {"state": "fresh", "warmup_steps": 2}
    raw["stages"][2]["grow"] = [{"op": "deepen", "after": [0]}, {"op": "split_experts"}]
    raw["checkpoint"]["keep_last"] = 10  # the grown checkpoints too
    return raw


def test_a_run_with_fresh_options_changes_only_what_follows_the_growth_and_resumes_mid_ramp(tmp_path):
    (tmp_path / "fresh").mkdir()
    (tmp_path / "plain").mkdir()
    recipe, out, done = train_recipe(fresh_recipe(), tmp_path / "fresh")
    assert "growth [moe] upcycle_moe (exact)" in done.stdout and "growth [deep] transition (exact)" in done.stdout
    plain_raw = fresh_recipe()
    for stage in plain_raw["stages"]:
        stage.pop("fresh", None)
    _, plain, _ = train_recipe(plain_raw, tmp_path / "plain")
    factors = {r["step"]: r.get("fresh_lr_factor") for r in metrics_rows(out)}
    assert factors == {s: None for s in range(1, 9)} | {9 + t: (t + 1) / 6 for t in range(6)} | {15: 0.5, 16: 1.0} | {s: None for s in range(17, 21)}
    shown = run_cli("validate", recipe)
    assert "fresh: the elements growth created fresh train at 0.3 x the LR; their LR ramped over the stage's first 6 step(s)" in shown.stdout
    got, want = losses(out), losses(plain)
    # Step 9's loss is taken before the moe stage's first update: equal through it, apart after.
    assert got[:9] == want[:9]
    assert got[9][1] != want[9][1]
    # The ramp is applied, not only logged: without it (the same multiplier and reset) step 10 differs.
    (tmp_path / "unramped").mkdir()
    unramped_raw = fresh_recipe()
    for stage in unramped_raw["stages"][1:]:
        stage["fresh"].pop("warmup_steps")
    _, unramped, _ = train_recipe(unramped_raw, tmp_path / "unramped")
    assert losses(unramped)[:9] == got[:9] and losses(unramped)[9][1] != got[9][1]
    # The deep stage's growth reset the state: its grown checkpoint holds no moment and no count.
    state = torch.load(out / "checkpoints/step-00000014-grown/trainer.pt", weights_only=True)["optimizer"]
    assert state and all(not torch.as_tensor(e["step"]).any() and not e["exp_avg"].any() and not e["exp_avg_sq"].any() for e in state.values())
    # Killed at step 13 (the moe stage's 5th step, inside its 6-step ramp), resumed from step 12's
    # checkpoint: the ramp reads the saved step counts, so the run is the uninterrupted one.
    resumed = tmp_path / "resumed"
    kill_and_resume(recipe, resumed, "step_mid:13")
    assert_same_run(resumed, out, 20)


@pytest.mark.parametrize(
    "stage, fresh, message",
    [
        (0, {"lr_mult": 0.5}, "this stage grows nothing, so nothing is fresh"),
        (1, {"warmup_steps": 7}, "7 warmup steps exceed the stage's 6 steps"),
        (1, {"lr_mult": 0}, "must be > 0"),
        (1, {"state": "reset"}, "'reset' is not one of mapped, fresh"),
    ],
)
def test_validate_refuses_fresh_settings_that_cannot_apply(stage, fresh, message, tmp_path):
    raw = copy.deepcopy(MICRO)
    raw["stages"][stage]["fresh"] = fresh
    with pytest.raises(RecipeError) as info:
        recipe_from_dict(raw)
    assert any(message in p for p in info.value.problems), info.value.problems
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    done = run_cli("validate", path)
    assert done.returncode == 2 and message in done.stdout + done.stderr, done.stdout + done.stderr


def test_the_defaults_change_nothing():
    recipe = recipe_from_dict(copy.deepcopy(MICRO))
    assert all(stage.fresh == FreshConfig() for stage in recipe.stages)
    assert dataclasses.asdict(FreshConfig()) == {"lr_mult": 1.0, "warmup_steps": 0, "state": "mapped"}


@pytest.mark.slow
def test_fresh_options_train_alike_in_one_process_at_ep_2_and_in_the_af_layout(tmp_path):
    """The ramp reads each rank's own step counts and the reset runs on each rank's share of the
    state: the expert-parallel and AF runs follow the one-process run as without the options (and
    so does a noisy split, whose router noise every rank draws alike)."""
    from test_expert_parallel import EP_RECIPE, assert_close_losses, growtrain_torchrun

    raw = copy.deepcopy(EP_RECIPE)
    raw["stages"][1]["fresh"] = {"lr_mult": 0.3, "warmup_steps": 4}
    raw["stages"][2]["fresh"] = {"state": "fresh", "warmup_steps": 3}
    raw["stages"][2]["grow"][0]["router_noise"] = 0.02  # split_experts' noisy siblings, drawn alike on every rank
    recipe, one, done = train_recipe(raw, tmp_path, "fresh")
    assert "growth [split] split_experts+clone_experts (approximate)" in done.stdout or "growth [split] split_experts (approximate)" in done.stdout, done.stdout[-3000:]
    for key, extra in (("ep2", ()), ("af11", ("--set", "distributed.layout=af", "--set", "distributed.attention_ranks=1"))):
        r = growtrain_torchrun(2, "run", recipe, "--out", tmp_path / key, *extra)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
        assert "optimizer state reset" in r.stdout
        assert_close_losses(losses(tmp_path / key), losses(one), key)
