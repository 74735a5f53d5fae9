"""Expert parallelism on CPU processes (gloo, launched by torchrun): the layer against the unsharded
one, the overlapped combine against the serial one, whole runs at EP = 1, 2, 4 across a split,
resuming at another EP size, and a rank that dies or fails. Every torchrun here runs with NCCL's
rules checked (GROWTRAIN_CHECK_COLLECTIVES=1, growtrain/parallel/collective_guard.py): a collective tensor
off the group's device, or a tensor through an *_object collective, fails the run."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from conftest import REPO, cli_env, losses, run_cli, run_module, train_recipe
from growtrain.model.expert_shards import assemble, is_expert_tensor, slice_state

# 20 steps: dense → upcycle block 1 into 4 experts → split them into 8 (top-4) and clone them
# into 16 (drop-upcycling: random redraws), batch 4 (divides over 1, 2 and 4 ranks), checkpoints
# every 5 steps.
EP_RECIPE = {
    "name": "ep",
    "seed": 3,
    "model": {"d_model": 32, "n_layers": 2, "n_heads": 2, "n_kv_heads": 1, "ffn_hidden": 64},
    "data": {"source": "builtin:pydoc_topics", "max_bytes": 120_000, "eval_fraction": 0.1},
    "optimizer": {"lr": 0.003},
    "train": {"log_every": 5, "eval_every": 10, "eval_batches": 1},
    "stages": [
        {"name": "dense", "steps": 6, "seq_len": 32, "batch_size": 4, "schedule": {"warmup_steps": 2}},
        {
            "name": "moe",
            "steps": 6,
            "seq_len": 32,
            "batch_size": 4,
            "grow": [{"op": "upcycle_moe", "num_experts": 4, "top_k": 2, "layers": [1], "balance_bias_rate": 0.01}],
            "schedule": {"warmup_steps": 2},
        },
        {
            "name": "split",
            "steps": 8,
            "seq_len": 32,
            "batch_size": 4,
            "grow": [{"op": "split_experts"}, {"op": "clone_experts", "factor": 2}],
            "schedule": {"warmup_steps": 1},
        },
    ],
    "checkpoint": {"every_steps": 5, "keep_last": 2},
    "invariance": {"probe_batch_size": 4, "probe_seq_len": 32},  # a row per rank at EP = 4
    "tracking": {"wandb": {"mode": "disabled"}, "progress_bar": False},
}
STEPS = 20
FP32_RTOL = 1e-5  # measured: ≤ 1.5e-7 relative at EP = 2 and 4 (summation order of the batch means)


# What each rank prints on stderr when growtrain.parallel.collective_guard is on.
CHECKS_ON = "collective checks on: every collective tensor on cpu"


def checked_env(env: dict | None = None) -> dict:
    return {**(env or cli_env()), "GROWTRAIN_CHECK_COLLECTIVES": "1"}


def assert_checked(r: subprocess.CompletedProcess, n: int) -> None:
    assert r.stderr.count(CHECKS_ON) == n, f"collective checks must be on in all {n} ranks:\n{r.stderr[-2000:]}"


def torchrun(n: int, *args, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    r = run_module("torch.distributed.run", "--standalone", "--nproc-per-node", n, *args, env=checked_env(env), timeout=timeout)
    assert_checked(r, n)
    return r


def growtrain_torchrun(n: int, *args, **kw) -> subprocess.CompletedProcess:
    return torchrun(n, "-m", "growtrain", *args, **kw)


def assert_close_losses(got, want, what: str) -> None:
    assert [s for s, *_ in got] == list(range(1, STEPS + 1)), f"{what}: metrics.jsonl must hold steps 1..{STEPS} once"
    for (step, a, ea), (_, b, eb) in zip(got, want):
        assert a == pytest.approx(b, rel=FP32_RTOL), f"{what}: step {step} loss {a} vs {b}"
        assert (ea is None) == (eb is None)
        if ea is not None:
            assert ea == pytest.approx(eb, rel=FP32_RTOL), f"{what}: step {step} eval loss {ea} vs {eb}"


@pytest.fixture(scope="module")
def ep_runs(tmp_path_factory):
    """The same recipe at EP = 1 (one process), 2 and 4 (torchrun)."""
    root = tmp_path_factory.mktemp("ep")
    recipe, out, _ = train_recipe(EP_RECIPE, root, "ep")
    runs = {1: out}
    for n in (2, 4):
        r = growtrain_torchrun(n, "run", recipe, "--out", root / f"ep{n}")
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
        runs[n] = root / f"ep{n}"
    runs["recipe"] = recipe
    return runs


# ------------------------------------------------------------------------- shards (no processes)


def test_expert_tensors_are_the_routed_experts_only():
    assert is_expert_tensor("blocks.1.g.ffn.experts.w_gate")
    assert is_expert_tensor("blocks.1.g.ffn.experts.w_down_codes")
    assert not is_expert_tensor("blocks.1.g.ffn.experts.quant_map")
    assert not is_expert_tensor("blocks.1.g.ffn.router.weight")
    assert not is_expert_tensor("blocks.1.g.ffn.shared.w_down.weight")


def test_slices_saved_at_one_ep_size_assemble_at_another():
    torch.manual_seed(0)
    full = {
        "blocks.0.g.ffn.experts.w_up": torch.randn(8, 3, 2),
        "blocks.0.g.ffn.router.weight": torch.randn(8, 2),
    }
    opt = {"blocks.0.g.ffn.experts.w_up": {"step": 7, "exp_avg": torch.randn(8, 3, 2), "lr_mult": 0.5, "norm_mult": torch.rand(8, 3, 2)}}
    saved = [(r, 4, slice_state(full, r, 4)) for r in range(4)]
    saved_opt = [(r, 4, slice_state(opt, r, 4)) for r in range(4)]
    experts = [(r, 4, {n: t for n, t in s.items() if is_expert_tensor(n)}) for r, _, s in saved]
    for size in (1, 2, 4, 8):
        for rank in range(size):
            got = assemble(experts, rank, size)["blocks.0.g.ffn.experts.w_up"]
            n = 8 // size
            assert torch.equal(got, full["blocks.0.g.ffn.experts.w_up"][rank * n : (rank + 1) * n])
            entry = assemble(saved_opt, rank, size)["blocks.0.g.ffn.experts.w_up"]
            assert entry["step"] == 7 and entry["lr_mult"] == 0.5
            assert torch.equal(entry["norm_mult"], opt["blocks.0.g.ffn.experts.w_up"]["norm_mult"][rank * n : (rank + 1) * n])
    assert torch.equal(saved[1][2]["blocks.0.g.ffn.router.weight"], full["blocks.0.g.ffn.router.weight"])  # replicated


def _save_sharded(tmp_path, shard_of) -> Path:
    """A checkpoint whose experts live in 4 shard files, as 4 ranks would write it."""
    from growtrain.checkpoint.store import CheckpointConfig, CheckpointManager, file_entry, shard_file_name, write_shard_file

    names = [shard_file_name(r, 4) for r in range(4)]

    def write(tmp):  # each rank writes and hashes its own file
        for r in range(4):
            write_shard_file(tmp / names[r], shard_of(r))
        return {n: file_entry(tmp / n) for n in names}

    manager = CheckpointManager(tmp_path, CheckpointConfig(), log=lambda *_: None)
    return manager.save(
        5,
        model_state={"blocks.0.g.ffn.router.weight": torch.ones(8, 2)},
        trainer_state={"optimizer": {}},
        meta={"expert_parallel": {"size": 4, "files": names}},
        write_shards=write,
    )


def test_a_checkpoint_with_expert_shards_loads_at_any_size(tmp_path):
    from growtrain.checkpoint.store import load_checkpoint

    torch.manual_seed(0)
    w = torch.randn(8, 3, 2)
    opt = {
        "blocks.0.g.ffn.experts.w_up": {"step": 3, "exp_avg": torch.randn(8, 3, 2), "lr_mult": 1.0},
        "blocks.0.g.ffn.router.weight": {"step": 3, "exp_avg": torch.randn(8, 2), "lr_mult": 1.0},
    }

    def shard_of(r):  # the router's moments live on its ZeRO-1 owner, rank 2
        optimizer = slice_state({"blocks.0.g.ffn.experts.w_up": opt["blocks.0.g.ffn.experts.w_up"]}, r, 4)
        if r == 2:
            optimizer["blocks.0.g.ffn.router.weight"] = opt["blocks.0.g.ffn.router.weight"]
        return {"ep_rank": r, "ep_size": 4, "model": {"blocks.0.g.ffn.experts.w_up": w[2 * r : 2 * r + 2]}, "optimizer": optimizer}

    path = _save_sharded(tmp_path, shard_of)
    whole = load_checkpoint(path)
    assert torch.equal(whole.model_state["blocks.0.g.ffn.experts.w_up"], w)
    assert torch.equal(whole.trainer_state["optimizer"]["blocks.0.g.ffn.experts.w_up"]["exp_avg"], opt["blocks.0.g.ffn.experts.w_up"]["exp_avg"])
    assert torch.equal(whole.trainer_state["optimizer"]["blocks.0.g.ffn.router.weight"]["exp_avg"], opt["blocks.0.g.ffn.router.weight"]["exp_avg"])
    half = load_checkpoint(path, expert_shard=(1, 2))
    assert torch.equal(half.model_state["blocks.0.g.ffn.experts.w_up"], w[4:])
    assert torch.equal(half.trainer_state["optimizer"]["blocks.0.g.ffn.experts.w_up"]["exp_avg"], opt["blocks.0.g.ffn.experts.w_up"]["exp_avg"][4:])


def test_a_foreign_file_in_place_of_an_expert_shard_is_a_checkpoint_error(tmp_path):
    from growtrain.checkpoint.store import CheckpointError, load_checkpoint

    path = _save_sharded(tmp_path, lambda r: {"ep_rank": r, "something": "else"})
    with pytest.raises(CheckpointError, match="not an expert shard"):
        load_checkpoint(path)


# ------------------------------------------------------------------------- one layer


@pytest.mark.parametrize(
    "world,routing,fmt,precision",
    [
        (2, "topk", "full", "fp32"),
        (4, "topk", "full", "fp32"),
        (2, "one_rank", "full", "fp32"),
        (4, "skewed", "full", "fp32"),
        (2, "topk", "nf4", "fp32"),
        (4, "topk", "full", "bf16"),
        (4, "one_rank", "full", "bf16"),  # empty chunks must travel in the autocast dtype too
    ],
)
def test_overlapped_combine_equals_serial_bit_for_bit_and_the_whole_layer(tmp_path, world, routing, fmt, precision):
    out = tmp_path / "report.json"
    r = torchrun(world, REPO / "tests" / "ep_layer_worker.py", out, routing, fmt, precision)
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["collective_checks"], "the worker must run with the collective guard on"
    assert report["bitwise"], "the overlapped combine must give the serial combine's output and gradients bit for bit"
    assert report["load_is_global"], "the reported load must count every rank's tokens"
    # vs the unsharded layer on all tokens at once: fp32 rounding; under bf16 autocast the expert
    # outputs are rounded to bf16 (2^-8 relative) in a different grouping of rows.
    tol = 1e-6 if precision == "fp32" else 2e-2
    for name, err in report["rel_err"].items():
        assert err < tol, f"{name}: relative error {err:.2e} vs the unsharded layer"


# ------------------------------------------------------------------------- NCCL's rules on gloo

# Case of tests/collective_guard_worker.py → what its refusal must say.
GUARD_REFUSALS = {
    "all_reduce_other_device": ["all_reduce: argument tensor is on meta", "take tensors on cpu only"],
    "all_gather_mixed_devices": ["all_gather: argument tensor_list[1] is on meta", "mixes tensors on cpu, meta"],
    "all_to_all_single_output_elsewhere": ["all_to_all_single: argument output is on meta", "mixes tensors on cpu, meta"],
    "broadcast_other_device": ["broadcast: argument tensor is on meta"],
    "p2p_other_device": ["batch_isend_irecv: argument p2p_op_list[0] (isend to rank 1) is on meta"],
    "all_gather_object_with_tensors": ["all_gather_object: argument obj['w']['exp_avg'] is a tensor"],
    "broadcast_object_list_tensor": ["broadcast_object_list: argument object_list[0] is a tensor"],
    "broadcast_object_list_other_device": ["broadcast_object_list: device=meta", "run on cpu"],
}


def test_the_collective_guard_refuses_what_nccl_would_in_a_two_process_gloo_run(tmp_path):
    out = tmp_path / "guard.json"
    r = torchrun(2, REPO / "tests" / "collective_guard_worker.py", out, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["guard_on"]
    assert report["refused"].keys() == GUARD_REFUSALS.keys()
    for case, parts in GUARD_REFUSALS.items():
        message = report["refused"][case]
        assert message is not None, f"{case}: the guard let the call through"
        for part in parts:
            assert part in message, f"{case}: {part!r} not in {message!r}"
    # Right calls still work through the wrappers, and Dist's state gather (tensors by all_gather /
    # broadcast, layouts as objects) rebuilds the full optimizer state on every rank.
    assert report["worked"] == {"all_reduce": True, "ring": True, "broadcast_object_list": True, "gather_state": True}
    assert report["all_ranks_agree"], "a refusal must happen on every rank, or the others wait in the collective"


# ------------------------------------------------------------------------- whole runs


@pytest.mark.slow
def test_ep1_ep2_ep4_give_the_same_losses_across_a_split(ep_runs):
    reference = losses(ep_runs[1])
    for n in (2, 4):
        assert_close_losses(losses(ep_runs[n]), reference, f"EP={n}")
    meta = json.loads((ep_runs[4] / "checkpoints/step-00000020/meta.json").read_text())
    assert meta["expert_parallel"] == {"size": 4, "files": [f"experts-{r:03d}-of-004.pt" for r in range(4)]}
    assert [h["operator"] for h in meta["growth_history"]][:3] == ["upcycle_moe", "split_experts", "clone_experts"]
    assert meta["params_total"] == json.loads((ep_runs[1] / "checkpoints/step-00000020/meta.json").read_text())["params_total"]


@pytest.mark.slow
def test_bf16_autocast_at_ep4_follows_the_one_process_run(ep_runs, tmp_path):
    r = run_cli("run", ep_runs["recipe"], "--out", tmp_path / "one", "--set", "train.precision=bf16")
    assert r.returncode == 0, r.stderr[-3000:]
    r = growtrain_torchrun(4, "run", ep_runs["recipe"], "--out", tmp_path / "ep4", "--set", "train.precision=bf16")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    got, want = losses(tmp_path / "ep4"), losses(tmp_path / "one")
    assert [s for s, *_ in got] == list(range(1, STEPS + 1))
    for (step, a, _), (_, b, _) in zip(got, want):  # measured ≤ 1.9e-4: bf16 rounding, other row groupings
        assert a == pytest.approx(b, rel=2e-3), f"step {step}: bf16 loss {a} at EP=4 vs {b} in one process"


@pytest.mark.slow
def test_saved_at_ep4_resumes_at_ep2_and_in_one_process(ep_runs, tmp_path):
    import shutil

    reference = losses(ep_runs[1])
    for how in ("ep2", "single"):
        run = tmp_path / how
        shutil.copytree(ep_runs[4], run)
        shutil.rmtree(run / "checkpoints/step-00000020")  # resume from step 15, mid 'split' stage
        if how == "ep2":
            r = growtrain_torchrun(2, "run", ep_runs["recipe"], "--out", run)
        else:
            r = run_cli("run", ep_runs["recipe"], "--out", run)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
        assert "resumed from step-00000015" in r.stdout
        assert_close_losses(losses(run), reference, f"EP=4 → {how}")


@pytest.mark.slow
@pytest.mark.parametrize("damaged", ["experts-000-of-002.pt", "experts-001-of-002.pt", "model.safetensors"])
def test_a_shard_changed_on_disk_is_found_by_whichever_rank_hashes_it_and_all_ranks_fall_back(ep_runs, tmp_path, damaged):
    """Each rank hashes its share of the checkpoint's files (not every rank every file); a bad
    byte in any of them is still found, and every rank makes the same fallback."""
    import json
    import shutil

    run = tmp_path / "run"
    shutil.copytree(ep_runs[2], run)
    shutil.rmtree(run / "checkpoints/step-00000020")
    newest = run / "checkpoints/step-00000015"
    manifest = json.loads((newest / "manifest.json").read_text())
    assert {"experts-000-of-002.pt", "experts-001-of-002.pt"} <= set(manifest["files"])
    target = newest / damaged
    raw = bytearray(target.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # same size: only the sha256 can tell
    target.write_bytes(bytes(raw))
    r = growtrain_torchrun(2, "run", ep_runs["recipe"], "--out", run)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert f"{damaged}: sha256 mismatch" in r.stdout + r.stderr
    resumed = [line for line in r.stdout.splitlines() if "resumed from" in line]
    assert resumed and "resumed from step-00000012" in resumed[0], resumed
    assert losses(run) == losses(ep_runs[2])


@pytest.mark.slow
@pytest.mark.parametrize(
    "fault,killed,resumed_from",
    [("step_mid:8", 1, "step-00000006"), ("checkpoint_mid:2", 0, "step-00000005")],  # the 2nd: rank 0 dies mid-save of step 6
)
def test_a_killed_rank_stops_the_others_with_a_message_and_the_run_resumes(ep_runs, tmp_path, fault, killed, resumed_from):
    run = tmp_path / "killed"
    survivor = 1 - killed
    env = cli_env(GROWTRAIN_FAULT=fault, GROWTRAIN_FAULT_RANK=str(killed))
    t0 = time.monotonic()
    r = growtrain_torchrun(2, "run", ep_runs["recipe"], "--out", run, env=env, timeout=120)
    elapsed = time.monotonic() - t0
    assert r.returncode != 0
    assert f"[rank {survivor}] error: rank {survivor} stopped: another rank died or stopped responding" in r.stderr
    assert "run the same command to resume" in r.stderr
    assert f"[rank{survivor}]: Traceback" not in r.stderr
    assert elapsed < 90, f"the surviving rank took {elapsed:.0f} s to stop"
    r = growtrain_torchrun(2, "run", ep_runs["recipe"], "--out", run)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"resumed from {resumed_from}" in r.stdout
    assert losses(run) == losses(ep_runs[2]), "a resumed EP=2 run repeats the uninterrupted EP=2 run's losses"


@pytest.mark.slow
def test_growth_on_the_host_runs_in_a_gloo_group_of_its_own_and_a_kill_inside_it_resumes_on_the_device(ep_runs, tmp_path):
    """train.grow_on: host at EP = 2. On a CPU nothing moves; what a CPU can check is where the
    growth's collectives go: every one of them (the probe forwards' all-to-alls and combine, the
    operators' relayouts, the checks' reductions and state broadcasts) through the gloo group the
    trainer made for it, since the guard's only_in refuses any other group then (on the node the
    default group is NCCL's, with CUDA tensors only). Rank 1 is killed inside the 'split' stage's
    growth on the host (after clone_experts, before the transition's own check): rank 0 stops with
    the peer message, and the run resumes with train.grow_on changed (a runtime choice) and
    repeats the uninterrupted EP = 2 run's losses bit for bit."""
    run = tmp_path / "host"
    env = cli_env(GROWTRAIN_FAULT="growth_mid:3", GROWTRAIN_FAULT_RANK="1")  # upcycle_moe, split_experts, then clone_experts
    r = growtrain_torchrun(2, "run", ep_runs["recipe"], "--out", run, "--set", "train.grow_on=host", env=env, timeout=120)
    assert r.returncode != 0
    assert "growth [moe]: on the host (train.grow_on: host" in r.stdout
    assert "growth [split]: on the host" in r.stdout
    assert "growth [split] transition" not in r.stdout
    assert "[rank 0] error: rank 0 stopped: another rank died or stopped responding" in r.stderr
    assert "CollectiveRuleError" not in r.stderr
    r = growtrain_torchrun(2, "run", ep_runs["recipe"], "--out", run)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "growth [split]: on the host" not in r.stdout and "growth [split] transition" in r.stdout
    assert losses(run) == losses(ep_runs[2]), "growth on the host, and a resume onto the device, change no bit"


@pytest.mark.slow
def test_an_error_on_one_rank_is_reported_by_the_others(ep_runs, tmp_path):
    env = cli_env(GROWTRAIN_FAULT="step_mid:3:raise", GROWTRAIN_FAULT_RANK="1")
    r = growtrain_torchrun(2, "run", ep_runs["recipe"], "--out", tmp_path / "err", env=env, timeout=120)
    assert r.returncode != 0
    assert "[rank 0] error: rank 0 stopped: rank 1 failed: RuntimeError: injected fault at step_mid" in r.stderr


@pytest.mark.slow
def test_accelerate_launch_trains_as_torchrun_does(ep_runs, tmp_path):
    accelerate = Path(sys.executable).parent / "accelerate"
    if not accelerate.exists():
        pytest.skip("accelerate is not installed in this environment")
    # --multi_gpu is accelerate's multi-process launcher; on a machine without GPUs it starts CPU
    # processes (gloo) as torchrun does. (--cpu --num_processes N starts one process.)
    cmd = [accelerate, "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no"]
    cmd += ["--dynamo_backend", "no", "-m", "growtrain", "run", ep_runs["recipe"], "--out", tmp_path / "acc"]
    r = subprocess.run([str(c) for c in cmd], cwd=REPO, env=checked_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert_checked(r, 2)
    assert "expert parallelism: 2 processes" in r.stdout
    assert losses(tmp_path / "acc") == losses(ep_runs[2])


@pytest.mark.slow
def test_a_stuck_rank_fails_the_others_after_the_timeout(ep_runs, tmp_path):
    env = cli_env(GROWTRAIN_FAULT="step_mid:3:hang", GROWTRAIN_FAULT_RANK="1")
    t0 = time.monotonic()
    r = growtrain_torchrun(2, "run", ep_runs["recipe"], "--out", tmp_path / "stuck", "--set", "distributed.timeout_s=10", env=env, timeout=150)
    elapsed = time.monotonic() - t0
    assert r.returncode != 0
    assert "[rank 0] error: rank 0 stopped: another rank died or stopped responding" in r.stderr
    assert elapsed < 120, f"took {elapsed:.0f} s with a 10 s collective timeout"


def test_a_recipe_that_does_not_divide_over_the_ranks_is_refused(micro_recipe):
    recipe = micro_recipe({"stages": [{"name": "only", "steps": 2, "seq_len": 16, "batch_size": 3}]})
    r = growtrain_torchrun(2, "run", recipe, "--out", recipe.parent / "run", "--set", "optimizer.dense_state_bits=8", timeout=120)
    assert r.returncode != 0
    assert "batch_size 3 does not divide over 2 ranks" in r.stderr
    assert "dense_state_bits" not in r.stderr  # 8-bit state runs in every layout (test_optim8bit_layouts.py)
    assert "]: Traceback" not in r.stderr  # torchrun prefixes a worker's traceback with [rankN]


@pytest.mark.slow
def test_inspect_and_generate_read_a_checkpoint_saved_under_expert_parallelism(ep_runs):
    from growtrain.checkpoint.store import load_checkpoint

    r = run_cli("inspect", ep_runs[4], "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["expert_parallel"] == 4
    r = run_cli("generate", ep_runs[4], "--prompt", "The ", "--max-new-tokens", "8", "--seed", "1")
    assert r.returncode == 0, r.stderr
    sharded = load_checkpoint(ep_runs[4] / "checkpoints/step-00000020")
    whole = load_checkpoint(ep_runs[1] / "checkpoints/step-00000020")
    assert sharded.model_state.keys() == whole.model_state.keys()
    for name, t in whole.model_state.items():  # the assembled model is the one-process model (fp32 drift)
        assert sharded.model_state[name].shape == t.shape, name
        torch.testing.assert_close(sharded.model_state[name], t, rtol=1e-4, atol=1e-6, msg=name)
    opt_s, opt_w = sharded.trainer_state["optimizer"], whole.trainer_state["optimizer"]
    assert opt_s.keys() == opt_w.keys()
    for name in opt_w:
        assert opt_s[name]["exp_avg"].shape == opt_w[name]["exp_avg"].shape, name


def test_export_hf_of_an_ep4_checkpoint_holds_the_weights_growtrain_assembles_from_it(ep_runs, tmp_path):
    from test_export_hf import assert_export_holds_the_checkpoints_weights

    assert assert_export_holds_the_checkpoints_weights(ep_runs[4], tmp_path / "hf") > 0


def test_a_single_process_run_has_no_expert_shards(micro_recipe, tmp_path):
    recipe = micro_recipe({"stages": [{"name": "only", "steps": 1, "seq_len": 16, "batch_size": 2}]})
    r = run_cli("run", recipe, "--out", tmp_path / "one")
    assert r.returncode == 0, r.stderr
    ckpt = next((tmp_path / "one/checkpoints").glob("step-*"))
    assert not list(ckpt.glob("experts-*")) and "expert_parallel" not in json.loads((ckpt / "meta.json").read_text())


@pytest.mark.parametrize("layout", [(), ("--set", "distributed.layout=af", "--set", "distributed.attention_ranks=1")], ids=["ep2", "af_1_plus_1"])
def test_ranks_started_as_fresh_interpreters_train_grow_and_exit_cleanly(tmp_path, layout):
    """The fork servers' children skip the interpreter's finalization (tests/cli_forkserver.py), where
    a rank of a gloo job has crashed before ("terminate called without an active exception", commit
    637dc61, parallel/distributed.import_before_group): here torchrun and both ranks are fresh
    interpreters, as a user's are, through two growths and their exit."""
    recipe = tmp_path / "ep.yaml"
    recipe.write_text(yaml.safe_dump(EP_RECIPE, sort_keys=False))
    steps = [a for i in range(3) for a in ("--set", f"stages.{i}.steps=2")]
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "growtrain", "run",
                           str(recipe), "--out", str(tmp_path / "run"), *steps, *layout],
                          cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    for sign in ("terminate called", "Traceback", "Signal", "leaked", "core dumped"):
        assert sign not in done.stderr, done.stderr[-3000:]
    assert [s for s, *_ in losses(tmp_path / "run")] == list(range(1, 7))
