"""Where growth runs (train.grow_on, issue 14): on the training device, or on the host, with the
model and optimizer state moved there for the growth and back before the stage's first step.
On a CPU machine the host is the device, so nothing moves; what runs here is the path itself
through a real `growtrain run` (NF4 experts and 8-bit dense state included), and the moves of
the optimizer state to another device (meta). The same growth on a GPU is part 3 of
benchmarks/gpu_checks.sh; the collectives of host growth under expert parallelism are in
tests/test_expert_parallel.py; where auto places the 120B recipe's growths, in tests/test_plan.py."""

from __future__ import annotations

import torch
from torch import nn

from conftest import losses, run_cli
from growtrain.optim.adamw import AdamW, OptimizerConfig
from growtrain.optim.adamw8bit import AdamW8bit, Moment8bit

# The micro recipe with its experts quantized right after the upcycling, and 8-bit dense state.
NF4_8BIT = {
    "optimizer": {"dense_state_bits": 8},
    "stages": [
        {"name": "dense", "steps": 4, "seq_len": 32, "batch_size": 4, "schedule": {"warmup_steps": 1}},
        {
            "name": "moe",
            "steps": 4,
            "seq_len": 32,
            "batch_size": 4,
            "grow": [
                {"op": "upcycle_moe", "num_experts": 4, "top_k": 2, "balance_bias_rate": 0.01},
                {"op": "quantize_experts", "r": 4},
            ],
            "schedule": {"warmup_steps": 1},
        },
    ],
}


def test_growth_on_the_host_trains_as_growth_on_the_device_with_nf4_experts_and_8bit_state(tmp_path, micro_recipe):
    recipe = micro_recipe(NF4_8BIT)
    runs = {}
    for where in ("device", "host"):
        r = run_cli("run", recipe, "--out", tmp_path / where, "--set", f"train.grow_on={where}")
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
        runs[where] = r.stdout
    assert "growth [moe]: on the host (train.grow_on: host; planned peak" in runs["host"]
    assert "on the host" not in runs["device"]
    assert len(losses(tmp_path / "host")) == 8
    assert losses(tmp_path / "host") == losses(tmp_path / "device")


def test_auto_grows_on_the_host_when_the_planned_peak_is_over_the_device_budget(tmp_path, micro_recipe, monkeypatch, capsys):
    """The auto rule, in-process, with the device's budget made smaller than the plan's peak (on a
    CPU there is none: auto stays in place) for the moe stage only."""
    import growtrain.stages.placement as placement
    import growtrain.train as train_module
    from growtrain.recipe import load_recipe

    budgets = iter([1e3, 1e12])  # moe's growth over it, deep's within
    monkeypatch.setattr(placement, "growth_budget_bytes", lambda device: next(budgets))
    train_module.run(load_recipe(micro_recipe()), tmp_path / "auto", resume="never", log=print)
    said = [line for line in capsys.readouterr().out.splitlines() if line.startswith("growth [") and ": on " in line]
    assert len(said) == 2, said
    assert said[0].startswith("growth [moe]: on the host (planned peak ") and "per rank is over the 0.0 MB usable on cpu)" in said[0]
    assert said[1].startswith("growth [deep]: on cpu (planned peak ") and "1000.0 GB usable)" in said[1]


def _state_devices(opt: AdamW) -> set[str]:
    found = set()
    for s in opt._stored().values():
        for value in vars(s).values():
            parts = (value.codes, value.absmax_B) if isinstance(value, Moment8bit) else (value,)
            found |= {t.device.type for t in parts if isinstance(t, torch.Tensor)}
    return found


def test_the_optimizer_moves_every_state_tensor_packed_8bit_codes_included():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(300, 256), nn.Linear(256, 256))
    named = dict(model.named_parameters())
    for cls, bits in ((AdamW, 32), (AdamW8bit, 8)):
        opt = cls(named, OptimizerConfig(dense_state_bits=bits))
        model(torch.randint(0, 300, (4,))).sum().backward()
        opt.step(1e-3)
        packed = [s for s in opt._stored().values() if isinstance(s.exp_avg, Moment8bit)]
        assert (len(packed) > 0) == (bits == 8), "the 8-bit optimizer must hold packed moments to move"
        assert _state_devices(opt) == {"cpu"}
        opt.to("meta")  # "another device" on a CPU machine
        assert _state_devices(opt) == {"meta"}
        assert set(opt.state) == set(named)
        model.zero_grad()


def test_a_resume_may_change_where_it_trains_and_grows_but_not_the_cpu_threads():
    from growtrain.checkpoint.resume import comparable as _comparable, recipe_diff as _recipe_diff

    base = {"train": {"device": "auto", "grow_on": "auto", "threads": 0}, "stages": []}
    moved = {"train": {"device": "cpu", "grow_on": "host", "threads": 0}, "stages": []}
    assert _recipe_diff(_comparable(base), _comparable(moved)) == []
    threads = {"train": {"device": "auto", "grow_on": "auto", "threads": 2}, "stages": []}
    assert _recipe_diff(_comparable(base), _comparable(threads)) == ["train.threads: checkpoint 0 -> recipe 2"]
