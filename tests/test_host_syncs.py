"""Host syncs of the training loop (issue 13, DESIGN.md §15): counted on the CPU as they would
sync on a GPU, the trainer's do not grow with depth, MoE layers or micro-batches."""

from __future__ import annotations

import sys

import pytest
import torch

from conftest import REPO
from growtrain.runtime.host_syncs import SyncCounter, per_step_syncs

sys.path.insert(0, str(REPO / "benchmarks"))
from host_syncs import recipe as sync_recipe  # noqa: E402  (the benchmark's recipes: one definition)


def test_the_counter_sees_every_kind_of_host_sync_and_nothing_else():
    x = torch.arange(6.0)
    with SyncCounter() as plain:
        y = (x * 2).sum() + x.mean()
        torch.repeat_interleave(x, torch.full((6,), 2), output_size=12)
    assert plain.count == 0, plain.by_site
    with SyncCounter() as c:
        y.item()
        x.tolist()
        x.numpy()
        x.nonzero()
        x[x > 2]
        bool(x.any())
        torch.repeat_interleave(torch.tensor([1, 2]))
    assert c.count == 7, c.by_site
    assert x.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0], "tolist must be restored after the block"


@pytest.mark.slow
def test_the_trainer_makes_one_host_sync_per_step_at_any_depth_and_accumulation(tmp_path):
    got = {(b, a): per_step_syncs(sync_recipe(b, a), 2, tmp_path / f"{b}-{a}") for b in (2, 8) for a in (1, 4)}
    for key, row in got.items():
        assert row["trainer"] == 1, (key, row["by_site"])
    # The reference expert backends read each MoE call's offsets: 2 calls per layer and micro-batch
    # (the forward, and the reversible backward's recompute). Reported apart, and exactly that.
    for (blocks, accum), row in got.items():
        assert row["expert_backend"] == 2 * blocks * accum, ((blocks, accum), row)


def test_train_device_cuda_without_a_gpu_is_a_message(tmp_path, micro_recipe):
    from conftest import run_cli

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    done = run_cli("run", micro_recipe(), "--out", tmp_path / "run", "--set", "train.device=cuda")
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert "no CUDA device is available" in done.stderr


def test_optimizer_state_from_a_checkpoint_lands_on_the_training_device():
    from growtrain.optim.adamw import to_device

    state = {"w": {"step": 3, "exp_avg": torch.ones(2), "lr_mult": torch.full((2,), 0.5), "nested": [torch.zeros(1)]}}
    moved = to_device(state, torch.device("meta"))
    assert moved["w"]["step"] == 3
    assert all(t.device.type == "meta" for t in (moved["w"]["exp_avg"], moved["w"]["lr_mult"], moved["w"]["nested"][0]))
