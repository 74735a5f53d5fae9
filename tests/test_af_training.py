"""The trainer in an attention/expert layout (distributed.layout: af, issue 18) on CPU processes
(gloo, torchrun), NCCL's rules checked: the EP tests' recipe (dense → upcycle → split + clone,
20 steps) at 2 + 2 and 1 + 2 ranks against one process, growth reports alike, checkpoints that
load in the other layout and at other sizes, a killed expert or attention rank, an expert rank's error, the
ping-pong schedule."""

from __future__ import annotations

import json
import shutil

import pytest

from conftest import REPO, cli_env, growth_report, losses, run_cli, train_recipe
from test_expert_parallel import EP_RECIPE, assert_close_losses, growtrain_torchrun

AF = ("--set", "distributed.layout=af")


def af_run(world: int, attention: int, recipe, out, *args, **kw):
    return growtrain_torchrun(world, "run", recipe, "--out", out, *AF, "--set", f"distributed.attention_ranks={attention}", *args, **kw)


@pytest.fixture(scope="module")
def af_runs(tmp_path_factory):
    """The recipe in one process, at 2 + 2 (4 processes) and at 1 + 2 (3 processes, growing on
    the host: on a CPU nothing moves, but every collective of the growth must go through the gloo
    group made for it, which the collective guard holds it to)."""
    root = tmp_path_factory.mktemp("af")
    recipe, out, _ = train_recipe(EP_RECIPE, root, "ep")
    runs = {"one": out, "recipe": recipe}
    for world, attention in ((4, 2), (3, 1)):
        run = root / f"af{attention}{world - attention}"
        r = af_run(world, attention, recipe, run, *(("--set", "train.grow_on=host") if attention == 1 else ()))
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
        runs[(attention, world - attention)] = run
        runs[("log", attention)] = r.stdout
    return runs


def _transitions(run):
    """Each transition's verdict and numbers (inspect --json)."""
    report, _ = growth_report(run)
    return report, [(t["operator"], t["exact"], t["passed"], t["max_abs_dlogits"], t["loss_after"] - t["loss_before"]) for t in report["transitions"]]


def test_2_plus_2_and_1_plus_2_train_as_one_process_and_grow_alike(af_runs):
    reference = losses(af_runs["one"])
    one_report, one_growth = _transitions(af_runs["one"])
    for attention, experts in ((2, 2), (1, 2)):
        run = af_runs[(attention, experts)]
        assert_close_losses(losses(run), reference, f"AF {attention} + {experts}")
        log = af_runs[("log", attention)]
        assert f"AF layout: {attention} attention + {experts} expert ranks" in log
        assert f"growth [moe]: on the AF layout's shards (the experts on the {experts} expert ranks" in log
        assert "growth [split]: on the AF layout's shards" in log and "gathering the whole model" not in log
        assert ("growth [split]: on the host (train.grow_on: host" in log) == (attention == 1)
        report, growth = _transitions(run)
        assert [g[:3] for g in growth] == [g[:3] for g in one_growth] and len(growth) == 4  # 3 operators and the transition check
        for got, want in zip(growth, one_growth):  # the same checks on the shards as in one process: fp32 rounding apart
            assert got[3] == pytest.approx(want[3], rel=0.05, abs=1e-6), (got, want)
            assert got[4] == pytest.approx(want[4], rel=1e-3, abs=1e-5), (got, want)  # the loss change across the growth
        assert report["params_total"] == one_report["params_total"]
        assert report["layout"] == {"name": "af", "processes": attention + experts, "attention_ranks": attention, "expert_ranks": experts}
        meta = json.loads((run / "checkpoints/step-00000020/meta.json").read_text())
        assert meta["expert_parallel"] == {
            "size": experts,
            "files": [f"experts-{f:03d}-of-{experts:03d}.pt" for f in range(experts)],
            "dense_files": [f"dense-state-{a:03d}-of-{attention:03d}.pt" for a in range(attention)],
            "layout": "af",
            "attention_ranks": attention,
        }
    r = run_cli("inspect", af_runs[(2, 2)])
    assert "saved by    4 processes in an AF layout (2 attention + 2 expert ranks" in r.stdout


def test_export_hf_of_an_af_checkpoint_holds_the_weights_growtrain_assembles_from_it(af_runs, tmp_path):
    from test_export_hf import assert_export_holds_the_checkpoints_weights

    assert assert_export_holds_the_checkpoints_weights(af_runs[(2, 2)], tmp_path / "hf") > 0


def _resume_from(src, dst, newest_kept: str):
    shutil.copytree(src, dst)
    for ckpt in sorted((dst / "checkpoints").glob("step-*")):
        if ckpt.name > newest_kept:
            shutil.rmtree(ckpt)


@pytest.mark.slow
def test_an_af_checkpoint_resumes_co_located_in_one_process_and_back_at_another_split(af_runs, tmp_path):
    """AF 2 + 2 → co-located EP = 2 (from step 15) → AF 1 + 2 (from the co-located run's step 15);
    AF 1 + 2 → AF 2 + 2 from the end of 'moe' (the split's growth then runs in the new layout);
    AF 2 + 2 → one process."""
    reference = losses(af_runs["one"])
    colocated = tmp_path / "colocated"
    _resume_from(af_runs[(2, 2)], colocated, "step-00000015")
    r = growtrain_torchrun(2, "run", af_runs["recipe"], "--out", colocated)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "resumed from step-00000015" in r.stdout and "expert parallelism: 2 processes" in r.stdout
    assert_close_losses(losses(colocated), reference, "AF 2 + 2 → EP = 2")
    back = tmp_path / "back"
    _resume_from(colocated, back, "step-00000015")
    r = af_run(3, 1, af_runs["recipe"], back)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "resumed from step-00000015" in r.stdout
    assert_close_losses(losses(back), reference, "EP = 2 → AF 1 + 2")
    regrown = tmp_path / "regrown"
    _resume_from(af_runs[(1, 2)], regrown, "step-00000012")
    r = af_run(4, 2, af_runs["recipe"], regrown)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "resumed from step-00000012" in r.stdout and "growth [split] clone_experts" in r.stdout
    assert_close_losses(losses(regrown), reference, "AF 1 + 2 → AF 2 + 2 across the split's growth")
    single = tmp_path / "single"
    _resume_from(af_runs[(2, 2)], single, "step-00000015")
    r = run_cli("run", af_runs["recipe"], "--out", single)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from step-00000015" in r.stdout
    assert_close_losses(losses(single), reference, "AF 2 + 2 → one process")


@pytest.mark.slow
@pytest.mark.parametrize("world,attention,killed", [(4, 2, 3), (3, 1, 0)], ids=["an_expert_rank_of_2_plus_2", "the_attention_rank_of_1_plus_2"])
def test_a_killed_rank_stops_every_rank_with_the_message_and_the_resume_repeats_the_losses(af_runs, tmp_path, world, attention, killed):
    run = tmp_path / "killed"
    env = cli_env(GROWTRAIN_FAULT="step_mid:8", GROWTRAIN_FAULT_RANK=str(killed))  # in the 'moe' stage
    r = af_run(world, attention, af_runs["recipe"], run, env=env, timeout=120)
    assert r.returncode != 0
    for survivor in (rank for rank in range(world) if rank != killed):
        assert f"[rank {survivor}] error: rank {survivor} stopped: another rank died or stopped responding" in r.stderr
    assert "run the same command to resume" in r.stderr and "]: Traceback" not in r.stderr
    if attention == 2:
        r = af_run(world, attention, af_runs["recipe"], run, "--set", "distributed.attention_ranks=auto")  # the planner's split: 2 + 2 here
        assert "distributed.attention_ranks: auto -> 2 (the planner's fastest split on 4 x h100-80gb, stage 'split'" in r.stdout
    else:
        r = af_run(world, attention, af_runs["recipe"], run)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "resumed from step-00000006-grown" in r.stdout
    assert losses(run) == losses(af_runs[(attention, world - attention)]), "a resumed AF run repeats the uninterrupted AF run's losses"


def test_an_error_on_an_expert_rank_is_reported_by_the_attention_ranks(af_runs, tmp_path):
    env = cli_env(GROWTRAIN_FAULT="step_mid:3:raise", GROWTRAIN_FAULT_RANK="2")
    r = af_run(3, 1, af_runs["recipe"], tmp_path / "err", env=env, timeout=120)
    assert r.returncode != 0
    assert "[rank 0] error: rank 0 stopped: rank 2 failed: RuntimeError: injected fault at step_mid" in r.stderr


def test_the_ping_pong_schedule_trains_as_one_process_where_the_balance_loss_is_off(af_runs, tmp_path):
    """Two lanes (attention ranks 0 and 1), the expert ranks serving them in turn. Without the
    balance loss (it takes each lane's load under ping-pong) the losses are one process's, and
    the balance biases (updated from the lanes' loads summed) stay the same. The last stage's
    experts are NF4 bases + LoRA (quantize_experts), trained on the expert ranks."""
    import copy

    import yaml

    raw = copy.deepcopy(EP_RECIPE)
    raw["stages"][1]["grow"][0]["aux_loss_coef"] = 0.0
    raw["stages"][2]["grow"] = [{"op": "quantize_experts", "r": 4, "lora_alpha": 8, "double_quant": False}, {"op": "split_experts"}]
    recipe, one, _ = train_recipe(raw, tmp_path, "no_aux")
    run = tmp_path / "pingpong"
    r = af_run(4, 2, recipe, run, "--set", "distributed.af_schedule=pingpong")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "AF layout: 2 attention + 2 expert ranks, ping-pong schedule (two lanes)" in r.stdout
    assert_close_losses(losses(run), losses(one), "AF 2 + 2, ping-pong")
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    for row in rows:  # each side's measured wait, per step (the planner's pipeline model: benchmarks/af_pipeline.py)
        assert row["af/passes_s"] > 0 and 0 < row["af/expert_idle_fraction"] <= 1
        assert row["af/attention_s_per_microbatch"] > 0, row  # each side's compute (its ranks' mean)
        assert row["af/expert_s_per_microbatch"] >= 0 and row["af/microbatches"] == 1, row
        if row["stage"] == "dense":  # no MoE call: the attention ranks never wait, the expert ranks wait all along
            assert row["af/attention_wait_fraction"] == 0 and row["af/expert_idle_fraction"] > 0.5, row
        else:
            assert 0 < row["af/attention_wait_fraction"] < 1 and row["af/expert_idle_fraction"] < 1, row
    assert yaml.safe_load((run / "recipe.yaml").read_text())["distributed"]["af_schedule"] == "pingpong"
    assert "growth [split] quantize_experts (approximate)" in r.stdout and "— passed" in r.stdout
    # plan --measured: the planner's split of this layout next to what the run measured
    import statistics

    r = run_cli("plan", recipe, "--gpus", "4", "--measured", run, "--json")
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)["af_measured"]
    assert (got["stage"], got["attention_ranks"], got["expert_ranks"], got["schedule"]) == ("split", 2, 2, "pingpong")
    split_rows = [row for row in rows if row["stage"] == "split"][1:]
    assert got["measured"]["expert_idle_fraction"] == statistics.median(row["af/expert_idle_fraction"] for row in split_rows)
    assert got["predicted"]["step_s"] > 0 and 0 <= got["predicted"]["expert_idle_fraction"] < 1
    assert got["measured"]["expert_s"] == statistics.median(row["af/expert_s_per_microbatch"] * row["af/microbatches"] for row in split_rows)
    assert got["predicted"]["attention_s"] > 0 and got["measured"]["attention_s"] > 0
    r = run_cli("plan", recipe, "--gpus", "4", "--measured", run)  # the text form
    assert r.returncode == 0 and "attention compute" in r.stdout and "expert ranks idle" in r.stdout, r.stdout + r.stderr
    r = run_cli("plan", recipe, "--gpus", "4", "--measured", one)
    assert r.returncode != 0 and "was not trained in an AF layout" in r.stderr


def test_the_interleaved_schedule_trains_as_one_process_and_a_killed_run_resumes_bit_for_bit(tmp_path):
    """Two micro-batches in flight on the attention rank of 1 + 2 (af_schedule: interleaved): the
    step's two micro-batches pass their MoE calls to each other (as an evaluation's batches do),
    and the losses and eval losses are one process's, the balance loss included (each call sees
    its own micro-batch's load, as in one process). An expert rank killed mid-run stops the
    attention rank (its passes run in threads) with the message; the resume repeats the
    uninterrupted losses bit for bit."""
    import copy

    raw = copy.deepcopy(EP_RECIPE)
    for stage in raw["stages"]:
        stage["batch_size"], stage["grad_accum"] = 2, 2
    raw["train"] = {**raw["train"], "eval_batches": 3}  # evaluated in pairs: one pair in flight, one batch alone
    recipe, one, _ = train_recipe(raw, tmp_path, "accum2")
    interleaved = ("--set", "distributed.af_schedule=interleaved")
    run = tmp_path / "interleaved"
    r = af_run(3, 1, recipe, run, *interleaved)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "AF layout: 1 attention + 2 expert ranks, interleaved schedule (two micro-batches in flight)" in r.stdout
    assert_close_losses(losses(run), losses(one), "AF 1 + 2, interleaved")
    assert "growth [split] clone_experts" in r.stdout and "FAILED" not in r.stdout
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert all(row["af/microbatches"] == 2 and 0 <= row["af/attention_wait_fraction"] < 1 for row in rows)
    killed = tmp_path / "killed"
    env = cli_env(GROWTRAIN_FAULT="step_mid:18", GROWTRAIN_FAULT_RANK="2")  # in the 'split' stage, after its growth
    r = af_run(3, 1, recipe, killed, *interleaved, env=env, timeout=120)
    assert r.returncode != 0
    assert "[rank 0] error: rank 0 stopped: another rank died or stopped responding" in r.stderr and "]: Traceback" not in r.stderr
    r = af_run(3, 1, recipe, killed, *interleaved)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "resumed from step-00000015" in r.stdout
    assert losses(killed) == losses(run), "a resumed interleaved run repeats the uninterrupted run's losses"


def test_validate_checks_an_af_launch(micro_recipe, tmp_path):
    recipe = micro_recipe({"stages": [{"name": "only", "steps": 2, "seq_len": 16, "batch_size": 4}]})
    r = run_cli("validate", recipe, "--world-size", "4", *AF, "--set", "distributed.attention_ranks=3")
    assert r.returncode == 2
    assert "batch_size 4 does not divide over 3 attention ranks" in r.stderr
    r = run_cli("validate", recipe, "--world-size", "4", *AF, "--set", "distributed.attention_ranks=4")
    assert r.returncode == 2 and "an AF layout of 4 ranks needs 1..3 attention ranks" in r.stderr
    r = run_cli("validate", recipe, "--world-size", "4", *AF, "--set", "distributed.attention_ranks=2")
    assert r.returncode == 0, r.stderr
    assert "ok over 4 processes (AF layout: 2 attention + 2 expert ranks)" in r.stdout
    r = run_cli("validate", recipe, "--world-size", "4", *AF, "--set", "distributed.attention_ranks=auto")
    assert r.returncode == 2  # the micro recipe is dense: no split to choose
    assert "distributed.attention_ranks: auto: no AF split to choose (needs an MoE stage and at least 2 GPUs); give a number" in r.stderr
    r = run_cli("validate", "recipes/120b.yaml", "--world-size", "8", *AF, "--set", "distributed.attention_ranks=auto")
    assert r.returncode == 0, r.stderr
    assert "distributed.attention_ranks: auto -> 4 (the planner's fastest split on 8 x h100-80gb, stage 'long'" in r.stdout
    assert "ok over 8 processes (AF layout: 4 attention + 4 expert ranks)" in r.stdout
    r = run_cli("validate", recipe, "--world-size", "3", *AF, "--set", "distributed.af_schedule=pingpong")
    assert r.returncode == 2 and "af_schedule: pingpong needs 2+ attention ranks (two lanes), attention_ranks is 1" in r.stderr


def test_one_process_with_an_af_layout_says_it_holds_everything(micro_recipe, tmp_path):
    recipe = micro_recipe({"stages": [{"name": "only", "steps": 1, "seq_len": 16, "batch_size": 2}]})
    r = run_cli("run", recipe, "--out", tmp_path / "one", *AF)
    assert r.returncode == 0, r.stderr
    assert "distributed.layout: af needs several processes (torchrun); one process holds everything" in r.stdout


def test_the_af_pipeline_benchmark_compares_its_schedules_with_the_plan(monkeypatch, capsys):
    """benchmarks/af_pipeline.py at its smallest: 2 processes, 1 + 1 (ping-pong, which needs 2
    attention ranks, left out: its prediction is checked against a run by the ping-pong test). Its
    main runs here; its four torchrun launches go through the suite's fork servers (run_module), as
    the benchmark's own launcher would run them (the same arguments and environment)."""
    import importlib.util

    from conftest import run_module

    spec = importlib.util.spec_from_file_location("af_pipeline", REPO / "benchmarks" / "af_pipeline.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)

    def torchrun(n, *args, timeout=600):
        r = run_module("torch.distributed.run", "--standalone", "--nproc-per-node", n, *args,
                       env=cli_env(OMP_NUM_THREADS="1", WANDB_MODE="disabled"), timeout=timeout)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
        return r

    monkeypatch.setattr(bench, "torchrun", torchrun)
    rc = bench.main(["--nproc", "2", "--attention", "1", "--d-model", "32", "--layers", "2", "--experts", "4", "--batch", "4",
                     "--seq", "16", "--steps", "3", "--json"])
    assert rc == 0
    out = capsys.readouterr().out
    got = json.loads(out.strip().splitlines()[-1])["af_pipeline"]
    assert got["colocated_step_s"] > 0
    assert "pingpong" not in got and got["interleaved_vs_sequential_passes"] > 0
    for schedule in ("sequential", "interleaved"):
        c = got[schedule]
        assert (c["schedule"], c["attention_ranks"], c["expert_ranks"]) == (schedule, 1, 1)
        for side in ("predicted", "measured"):
            assert c[side]["step_s"] > 0 and 0 <= c[side]["expert_idle_fraction"] <= 1, (schedule, side, c[side])
            assert c[side]["attention_s"] > 0 and c[side]["expert_s"] > 0, (schedule, side, c[side])
