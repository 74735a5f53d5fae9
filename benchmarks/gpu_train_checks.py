"""The training-loop parts of the GPU validation call (issue 13, benchmarks/gpu_checks.sh parts 3-5):

3. the tiny recipe (shortened) trained on the device with `train.expert_backend: auto` (Triton on
   CUDA): every growth check passes; its losses follow a CPU fp32 run of the same recipe, resumed
   from the device run's checkpoint at FORK_AT (one state on both sides), within LOSS_BAR
   (relative) at every step, each stage and growth included (the first COMPARE_STEPS after the
   fork and the worst per stage are reported); killed once with kill -9 mid-run and
   resumed, it repeats the uninterrupted device run's losses exactly (every run with
   train.deterministic: true; the ops torch names as non-deterministic are listed);
   grown on the host
   (`train.grow_on: host`: model and optimizer state moved to host memory for each growth and
   back), its growth checks pass and its losses follow the device-grown run's within LOSS_BAR
   at every step (whether they are bit-equal is reported); trained in bf16 autocast (on a Hopper
   GPU the expert products then go through torch._grouped_mm), its growth checks pass (its
   losses against the fp32 run's are reported);
4. CUDA only: torch.cuda.max_memory_allocated per stage against `growtrain plan` for the same
   recipe on one GPU of the matching preset (ratio reported, within +-25%);
5. host syncs per training step: on CUDA counted by torch.cuda.set_sync_debug_mode("warn"), on the
   CPU by growtrain.runtime.host_syncs (the calls that would sync).

On a GPU machine the five training runs go side by side (the CPU reference on 6 cores); on the
CPU one at a time.

`--device cpu` (what CI runs, so the script cannot rot without a GPU): the same checks on the CPU
with the reference backend, on a shorter recipe (STEPS_CPU, BATCH_CPU); the device run would be the CPU
reference run itself, so it is run once and part 3 has no device-vs-CPU comparison to report
(`max_rel_loss_diff_first_steps` is null); the killed run continues the reference run from its
step-FORK_AT_CPU checkpoint (not from step 0) and its resume must repeat the reference's losses
from there; part 4 is reported as not applicable. Prints a table, writes
summary.json under --out, exits 1 if any part fails.

    python benchmarks/gpu_train_checks.py --device cuda|cpu --out DIR
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STEPS = {"dense": 60, "moe": 40, "deep": 30, "nf4": 10}  # the tiny recipe's stages, shortened
WARMUP = 10  # steps of the run-wide schedule's warmup (the recipe re-warms at no growth)
COMPARE_STEPS = 20
LOSS_BAR = 0.03  # bf16-class bar: Triton's fp32 accumulation order vs the CPU reference, 20 steps
FORK_AT = 25  # the CPU reference continues the device run from this step's checkpoint
KILL_AT = 75  # a step of the 'moe' stage, after a checkpoint (every 25 below)
# The CPU form keeps every stage and growth, with fewer steps. 'deep' keeps its 30 steps: the nf4
# stage's split is exact only once the siblings of deep's two splits have trained apart (shorter,
# and its growth check fails). Its killed run does not train from step 0 again: it continues the
# reference run from FORK_AT_CPU (in 'deep'), checkpoints every CHECKPOINT_EVERY_CPU steps, and is
# killed at KILL_AT_CPU; its resume crosses the growth into 'nf4' (at 65).
STEPS_CPU = {"dense": 20, "moe": 15, "deep": 30, "nf4": 5}
WARMUP_CPU = 5
BATCH_CPU = 8  # half the recipe's 16 sequences a step: the same stages, growths and resume at half the cost
FORK_AT_CPU = 50
CHECKPOINT_EVERY_CPU = 5
KILL_AT_CPU = 63


def recipe_sets(device: str, backend: str, short: bool) -> list[str]:
    """--set arguments of one run; short: the CPU form's step table (whatever device runs it)."""
    steps, warmup = (STEPS_CPU, WARMUP_CPU) if short else (STEPS, WARMUP)
    sets = ["--set", f"train.device={device}", "--set", f"train.expert_backend={backend}", "--set", "tracking.wandb.mode=disabled",
            "--set", "train.log_every=5", "--set", "train.eval_every=25", "--set", "checkpoint.every_steps=25", "--set", "checkpoint.keep_last=10",
            # deterministic kernels: a resumed run must repeat the uninterrupted one's bits
            "--set", "train.deterministic=true"]
    # The tiny recipe runs one run-wide schedule: its warmup is the first stage's, and the later
    # stages continue the run's curve (no re-warm).
    sets += ["--set", f"schedule.warmup_steps={warmup}"]
    for i, name in enumerate(steps):
        sets += ["--set", f"stages.{i}.steps={steps[name]}"]
        if short:
            sets += ["--set", f"stages.{i}.batch_size={BATCH_CPU}"]
    return sets


def env(**extra) -> dict:
    e = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "GROWTRAIN_"))}
    e.update({"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"})
    e.update(extra)
    return e


class Run:
    """One `growtrain run` of the shortened tiny recipe in a subprocess, its console in LOG.out/err
    beside the run directory."""

    def __init__(self, out: Path, device: str, backend: str, short: bool, fault: str | None = None, extra: tuple[str, ...] = (), threads: int = 0):
        self.out = out
        out.parent.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "growtrain", "run", "tiny", "--out", str(out), *recipe_sets(device, backend, short), *extra]
        if threads:
            cmd += ["--set", f"train.threads={threads}"]
        self.stdout_path, self.stderr_path = out.with_name(out.name + ".out"), out.with_name(out.name + ".err")
        self.t0 = time.perf_counter()
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env(**({"GROWTRAIN_FAULT": fault} if fault else {})),
                                     stdout=self.stdout_path.open("w"), stderr=self.stderr_path.open("w"), text=True)
        self.seconds = None

    def wait(self) -> "Run":
        try:
            self.returncode = self.proc.wait(timeout=900)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.returncode = self.proc.wait()
        self.seconds = round(time.perf_counter() - self.t0, 1)
        self.stdout, self.stderr = self.stdout_path.read_text(), self.stderr_path.read_text()
        return self


def nondeterministic_ops(*runs: Run) -> list[str]:
    """The ops torch named as non-deterministic in the runs' output (an op with no deterministic
    version, which train.deterministic makes fail; one that warns it runs a non-deterministic
    algorithm by default)."""
    found = set()
    for r in runs:
        for pattern in (r"(\S+) does not have a deterministic implementation", r"Warning: (.+?) defaults to a non-deterministic algorithm"):
            found.update(m.group(1) for m in re.finditer(pattern, r.stderr))
    return sorted(found)


def losses(run: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {r["step"]: r["loss"] for r in rows}


def rows_of(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]


def part3(out: Path, device: str) -> dict:
    backend = "auto"
    kill_at = KILL_AT_CPU if device == "cpu" else KILL_AT
    # On a GPU machine the runs go side by side (the CPU reference on its own cores); on the CPU one
    # at a time (two training jobs on 2 cores slow each other ~40x). On the CPU, auto is the
    # reference backend: the device run would repeat the reference run, so it is not made.
    parallel = device != "cpu"
    short = not parallel
    # The CPU form's killed run keeps its last two checkpoints (and the stage ends), not ten: the
    # resume reads the last one, and CI machines are short of disk.
    kill_sets = () if parallel else ("--set", f"checkpoint.every_steps={CHECKPOINT_EVERY_CPU}", "--set", "checkpoint.keep_last=2")
    if parallel:
        # The CPU reference continues the device run from its checkpoint at FORK_AT (a resume may
        # change train.device and the backend, not train.threads): both sides start from one state
        # (CUDA's generator draws other initial weights than the CPU's, seen on an H200).
        main = Run(out / "device_run", device, backend, short, threads=3)
        killed = Run(out / "killed", device, backend, short, fault=f"step_mid:{kill_at}", threads=2)
        # growth on the host against growth on the GPU (on the CPU the host is the device:
        # tests/test_growth_placement.py runs that path)
        host = Run(out / "grown_on_host", device, backend, short, extra=("--set", "train.grow_on=host"), threads=4)
        # bf16 autocast: the route training at scale takes (torch._grouped_mm products on Hopper)
        bf16 = Run(out / "device_bf16", device, backend, short, extra=("--set", "train.precision=bf16"), threads=2)
        fork = out / "device_run" / "checkpoints" / f"step-{FORK_AT:08d}"
        while not (fork / "manifest.json").is_file() and main.proc.poll() is None:
            time.sleep(0.5)
        ref = Run(out / "cpu_fp32", "cpu", "reference", short, extra=("--resume", str(fork)), threads=3)
    else:
        # On the CPU, auto is the reference backend: the device run would repeat the reference run.
        ref = main = Run(out / "cpu_fp32", "cpu", "reference", short).wait()
        fork = ref.out / "checkpoints" / f"step-{FORK_AT_CPU:08d}"
        # Only the fork is read again (the losses come from metrics.jsonl): the reference run's
        # other checkpoints go, ~0.6 GB of the tiny recipe's.
        for saved in (ref.out / "checkpoints").glob("step-*"):
            if saved != fork:
                shutil.rmtree(saved)
        killed = Run(out / "killed", device, backend, short, fault=f"step_mid:{kill_at - FORK_AT_CPU}",  # the n-th step of this process
                     extra=("--resume", str(fork), *kill_sets))
        host = bf16 = None
    killed.wait()
    resumed = Run(out / "killed", device, backend, short, threads=2 if parallel else 0, extra=kill_sets).wait()
    for r in (ref, main, host, bf16):
        if r is not None and r.seconds is None:
            r.wait()
    device_dir = main.out
    res = {"reference_rc": ref.returncode, "device_rc": main.returncode,
           "run_seconds": {"cpu_reference": ref.seconds, "device": main.seconds, "killed": killed.seconds, "resumed": resumed.seconds,
                           **({"grown_on_host": host.seconds} if host else {})}}
    if ref.returncode or main.returncode:
        res["ok"] = False
        res["error"] = (ref.stderr if ref.returncode else main.stderr)[-2000:]
        return res
    res["growth_checks"] = "passed" if "growth check failed" not in main.stdout else "failed"
    a, b = losses(ref.out), losses(device_dir)
    if device == "cpu":
        res["max_rel_loss_diff_first_steps"] = None  # nothing to compare: one run
    else:
        rel = {s: abs(a[s] - b[s]) / abs(a[s]) for s in b if s in a}
        res["compared_from_step"] = FORK_AT + 1
        res["max_rel_loss_diff_first_steps"] = max(rel[s] for s in range(FORK_AT + 1, FORK_AT + 1 + COMPARE_STEPS))
        res["max_rel_loss_diff_all_steps"] = max(rel.values())
        res["max_rel_loss_diff_by_stage"] = {}
        for row in rows_of(device_dir):
            if row["step"] in rel:
                by = res["max_rel_loss_diff_by_stage"]
                by[row["stage"]] = max(by.get(row["stage"], 0.0), rel[row["step"]])
    res["final_loss_cpu"], res["final_loss_device"] = a[max(a)], b[max(b)]
    res["killed_rc"], res["resumed_rc"] = killed.returncode, resumed.returncode
    res["resumed"] = "resumed from" in resumed.stdout
    if resumed.returncode == 0:
        # every step the killed run covers (from its start, step 1 or the CPU form's fork)
        c = losses(out / "killed")
        first = 1 if parallel else FORK_AT_CPU + 1
        covered = {s: b[s] for s in b if s >= first}
        res["resume_compared_steps"] = [first, max(b)]
        res["resume_max_abs_loss_diff"] = max(abs(c[s] - b[s]) if s in c else float("inf") for s in covered)
        res["resume_bitwise"] = c == covered
        if not res["resume_bitwise"]:
            res["resume_first_differing_step"] = min(s for s in covered if c.get(s) != b[s])
    else:
        res["resume_error"] = resumed.stderr[-1500:]
    res["nondeterministic_ops"] = nondeterministic_ops(*(r for r in (main, killed, resumed, host) if r is not None))
    host_ok = True
    if host is not None:
        res["host_growth_rc"] = host.returncode
        if host.returncode == 0:
            h = losses(host.out)
            res["host_growth_logged"] = host.stdout.count(": on the host (train.grow_on: host")
            res["host_growth_checks"] = "passed" if "growth check failed" not in host.stdout else "failed"
            res["host_vs_device_max_rel_loss_diff"] = max(abs(h[s] - b[s]) / abs(b[s]) for s in b)
            res["host_vs_device_bitwise"] = h == b
            host_ok = res["host_growth_checks"] == "passed" and res["host_growth_logged"] >= 3 and res["host_vs_device_max_rel_loss_diff"] <= LOSS_BAR
        else:
            res["host_growth_error"] = host.stderr[-1500:]
            host_ok = False
    bf16_ok = True
    if bf16 is not None:
        res["bf16_rc"] = bf16.returncode
        res["bf16_products"] = sorted(set(re.findall(r"products by ([\w.]+)", bf16.stdout)))
        if bf16.returncode == 0:
            h = losses(bf16.out)
            res["bf16_growth_checks"] = "passed" if "growth check failed" not in bf16.stdout else "failed"
            res["bf16_vs_fp32_max_rel_loss_diff"] = max(abs(h[s] - b[s]) / abs(b[s]) for s in b if s in h)
            res["final_loss_bf16"] = h[max(h)]
            bf16_ok = res["bf16_growth_checks"] == "passed"
        else:
            res["bf16_error"] = bf16.stderr[-1500:]
            bf16_ok = False
    res["ok"] = (
        res["growth_checks"] == "passed" and (device == "cpu" or res["max_rel_loss_diff_all_steps"] <= LOSS_BAR) and killed.returncode == -signal.SIGKILL
        and res["resumed"] and res.get("resume_bitwise", False) and host_ok and bf16_ok
    )
    return res


def part4(out: Path, device: str) -> dict:
    if device != "cuda":
        return {"ok": True, "applicable": False, "why": "needs CUDA memory statistics"}
    import torch

    from growtrain.planning import PRESETS

    name = torch.cuda.get_device_name().lower()
    preset = next((k for k in PRESETS if k.split("-")[0] in name), "h100-80gb")
    plan = subprocess.run([sys.executable, "-m", "growtrain", "plan", "tiny", "--hardware", preset, "--gpus", "1", "--json"],
                          cwd=REPO, env=env(), capture_output=True, text=True, timeout=300)
    if plan.returncode not in (0, 1):
        return {"ok": False, "error": plan.stderr[-2000:]}
    planned = {s["name"]: s["memory"] for s in json.loads(plan.stdout)["stages"]}
    measured: dict[str, float] = {}
    for row in rows_of(out / "device_run"):
        if "memory/cuda_peak_gb" in row:
            measured[row["stage"]] = max(measured.get(row["stage"], 0.0), row["memory/cuda_peak_gb"] * 1e9)
    ratios = {}
    for stage, mem in planned.items():
        # The plan's runtime reserve is not allocated memory; everything else is.
        want = mem["total"] - mem.get("runtime_reserve", 0)
        if stage in measured and want > 0:
            ratios[stage] = measured[stage] / want
    return {"ok": bool(ratios) and all(0.75 <= r <= 1.25 for r in ratios.values()), "preset": preset, "measured_over_planned": ratios,
            "measured_gb": {k: v / 1e9 for k, v in measured.items()}, "planned": planned}


def part5(out: Path, device: str) -> dict:
    sys.path.insert(0, str(REPO / "benchmarks"))
    from host_syncs import recipe as sync_recipe

    from growtrain.runtime.host_syncs import call_site, per_step_syncs

    raw = sync_recipe(4, 2)
    raw["train"]["device"] = device
    raw["train"]["expert_backend"] = "auto"
    if device == "cuda":
        import torch

        from growtrain.recipe import recipe_from_dict
        from growtrain.train import run

        sites: dict[int, collections.Counter] = {}

        def show(message, category, filename, lineno, file=None, line=None):
            if "synchroniz" in str(message):
                sites[n][call_site()] += 1

        torch.cuda.set_sync_debug_mode("warn")
        try:
            for n in (3, 6):
                raw["stages"][0]["steps"] = n
                sites[n] = collections.Counter()
                with warnings.catch_warnings():
                    warnings.simplefilter("always")
                    warnings.showwarning = show  # restored on leaving catch_warnings
                    run(recipe_from_dict(raw), out / f"syncs{n}", resume="never", log=lambda *a, **k: None)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        per_step = (sum(sites[6].values()) - sum(sites[3].values())) / 3
        by_site = {k: round(v / 3, 2) for k, v in (sites[6] - sites[3]).most_common(8)}
        # One per step: the grad norm's finite check; nothing per layer or micro-batch.
        return {"ok": per_step <= 1, "syncs_per_step_4_moe_blocks_accum2": per_step, "per_step_by_site": by_site,
                "counted_by": "torch.cuda.set_sync_debug_mode"}
    got = per_step_syncs(raw, 3, out / "syncs")
    return {"ok": got["trainer"] <= 1, "syncs_per_step_4_moe_blocks_accum2": got["trainer"], "reference_backend": got["expert_backend"],
            "counted_by": "growtrain.runtime.host_syncs"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--out", type=Path, default=Path("gpu_checks_out") / "train")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    summary = {}
    for name, part in (("3_train_resume", part3), ("4_memory_vs_plan", part4), ("5_host_syncs", part5)):
        t0 = time.perf_counter()
        try:
            summary[name] = part(args.out, args.device)
        except Exception as exc:  # noqa: BLE001 — a part's failure is reported, the others still run
            summary[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        summary[name]["seconds"] = round(time.perf_counter() - t0, 1)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    print(f"training checks on {args.device}")
    for name, res in summary.items():
        shown = {k: v for k, v in res.items() if k not in ("ok", "error")}
        print(f"  {name:<18} {'ok  ' if res['ok'] else 'FAIL'} {json.dumps(shown, default=str)}")
        if "error" in res:
            print(f"    error: {res['error'][-600:]}")
    return 0 if all(r["ok"] for r in summary.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
