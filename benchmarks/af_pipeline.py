"""The AF layout's schedules measured against the planner's prediction, side by side in one run
(growtrain/model/af.py, growtrain/planning/af_measured.py).

    python benchmarks/af_pipeline.py                 # 4 CPU processes (gloo): 2 attention + 2 expert ranks, a table
    python benchmarks/af_pipeline.py --json          # one JSON line
    python benchmarks/af_pipeline.py --nproc 8 --attention 4   # on an 8-GPU node (NCCL)

It trains one small MoE recipe (a dense step, then an upcycled MoE stage; balance loss off, so
the schedules compute the same numbers; each step two micro-batches, which the interleaved schedule
keeps in flight together) four times with `growtrain run` under torchrun: co-located expert
parallelism, AF sequential, AF ping-pong and AF interleaved. For the AF runs it reports each
side's measured waiting share and the forward + backward time per step (metrics.jsonl: af/*,
median over the MoE stage's steps) next to the planner's roofline for the same split and
schedule, on hardware figures measured here: one process's matmul throughput and copy
bandwidth, and the processes' all_to_all bandwidth (the --worker pass). The co-located run gives
the whole-step time the AF schedules are compared with.

On a CPU machine with fewer cores than processes the processes share the cores: compute on one
side slows the other, which the roofline (independent devices) does not model; the measured
shares there say how the schedule behaves, not what a GPU node would see. docs/scale.md (AF mode)
lists what a GPU run must confirm.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCHEDULES = ("sequential", "pingpong", "interleaved")


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=4, help="processes (default 4)")
    p.add_argument("--attention", type=int, default=2, help="attention ranks of the AF runs (default 2; ping-pong needs 2+, left out below)")
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=4, help="blocks; every other one MoE")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--batch", type=int, default=8, help="sequences per step over all ranks, in two micro-batches (half of it divides by --attention and --nproc)")
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--steps", type=int, default=10, help="steps of the MoE stage")
    p.add_argument("--json", action="store_true", help="print one JSON line instead of the table")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # set by the launcher: the result file
    return p.parse_args(argv)


def recipe(args) -> dict:
    return {
        "name": "af-bench",
        "seed": 0,
        "model": {"d_model": args.d_model, "n_layers": args.layers, "n_heads": 4, "n_kv_heads": 2, "ffn_hidden": 2 * args.d_model},
        "data": {"source": "builtin:pydoc_topics", "max_bytes": 200_000, "eval_fraction": 0.05},
        "train": {"log_every": 1000, "eval_every": 0, "eval_batches": 1},
        "stages": [
            {"name": "dense", "steps": 1, "seq_len": args.seq, "batch_size": args.batch // 2, "grad_accum": 2},
            {
                "name": "moe",
                "steps": args.steps,
                "seq_len": args.seq,
                "batch_size": args.batch // 2,
                "grad_accum": 2,
                "grow": [{"op": "upcycle_moe", "num_experts": args.experts, "top_k": 2, "layers": list(range(1, args.layers, 2)), "aux_loss_coef": 0.0}],
            },
        ],
        "checkpoint": {"every_steps": 0, "keep_last": 1, "after_growth": False},
        "invariance": {"probe_batch_size": args.nproc, "probe_seq_len": 32},
        "tracking": {"wandb": {"mode": "disabled"}, "progress_bar": False},
    }


def worker(out: str) -> None:
    """Under torchrun: all_to_all_single bandwidth among the processes (bytes each rank sends per second)."""
    import torch
    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    from growtrain.parallel.distributed import import_before_group

    import_before_group()  # before the group, as the trainer does
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda") if cuda else torch.device("cpu")
    W = dist.get_world_size()
    x = torch.randn(W * (1 << 20), device=device)  # 4 MB to each peer
    y = torch.empty_like(x)
    times = []
    for i in range(8):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_to_all_single(y, x)
        if cuda:
            torch.cuda.synchronize()
        t = torch.tensor([time.perf_counter() - t0], device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        if i >= 2:
            times.append(t.item())
    if dist.get_rank() == 0:
        sent = x.numel() * x.element_size() * (W - 1) / W
        Path(out).write_text(json.dumps({"link_gbps": sent / statistics.median(times) / 1e9}))
    dist.destroy_process_group()


def local_figures() -> dict:
    """One process's fp32 matmul TFLOP/s and copy GB/s (on the GPU where there is one)."""
    import torch

    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    n = 4096 if device.type == "cuda" else 512
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    big = torch.empty(1 << 25 if device.type == "cuda" else 1 << 23, device=device)

    def best(fn, reps=5):
        out = []
        for _ in range(reps):
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize()
            out.append(time.perf_counter() - t0)
        return min(out)

    t_mm = best(lambda: a @ b)
    t_copy = best(lambda: big.clone())
    return {"peak_tflops": 2 * n**3 / t_mm / 1e12, "hbm_gbps": 2 * big.numel() * big.element_size() / t_copy / 1e9, "device": str(device)}


def torchrun(n: int, *args, timeout: float = 600) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n), *map(str, args)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        sys.exit(f"af_pipeline: {' '.join(map(str, args[:4]))} failed:\n{r.stdout[-2000:]}{r.stderr[-3000:]}")
    return r


def step_seconds(rows: list[dict], stage: str, tokens_per_step: int) -> float:
    """Median whole-step time of the stage's steps (its first left out), from tokens/s."""
    return statistics.median(tokens_per_step / r["tokens_per_s"] for r in [r for r in rows if r["stage"] == stage][1:])


def main(argv=None) -> int:
    args = parse(argv)
    if args.worker:
        worker(args.worker)
        return 0
    import yaml

    import torch

    from growtrain.planning import Hardware, plan_recipe
    from growtrain.planning.af_measured import compare
    from growtrain.recipe import load_recipe

    with tempfile.TemporaryDirectory(prefix="af-bench-") as tmp:
        tmp = Path(tmp)
        link_file = tmp / "link.json"
        torchrun(args.nproc, __file__, "--worker", link_file)
        link = json.loads(link_file.read_text())["link_gbps"]
        figures = local_figures()
        recipe_file = tmp / "af-bench.yaml"
        recipe_file.write_text(yaml.safe_dump(recipe(args), sort_keys=False))
        runs = {}
        schedules = [name for name in SCHEDULES if name != "pingpong" or args.attention >= 2]  # ping-pong: two lanes
        af = ["distributed.layout=af", f"distributed.attention_ranks={args.attention}"]
        for name, extra in [("colocated", [])] + [(name, [*af, f"distributed.af_schedule={name}"]) for name in schedules]:
            out = tmp / name
            sets = [a for kv in extra for a in ("--set", kv)]
            torchrun(args.nproc, "-m", "growtrain", "run", recipe_file, "--out", out, "--set", "train.threads=1", *sets)
            runs[name] = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
        cores = os.cpu_count() or 1
        hw = Hardware(
            f"measured {figures['device']}", figures["peak_tflops"], figures["hbm_gbps"], link, link,
            capacity_gb=1e6, gpus_per_node=args.nproc, source="benchmarks/af_pipeline.py, measured here",
        )
        plan = plan_recipe(load_recipe(recipe_file, [f"distributed.attention_ranks={args.attention}"]), hw)
        split = next(sp for sp in plan.af.splits if sp.attention_gpus == args.attention)
        result = {
            "hardware": {"peak_tflops": hw.peak_tflops, "hbm_gbps": hw.hbm_gbps, "link_gbps": link, "processes": args.nproc,
                         "cpu_cores": cores if figures["device"] == "cpu" else None, "torch": torch.__version__},
            "shape": {"d_model": args.d_model, "layers": args.layers, "experts": args.experts, "batch": args.batch, "seq": args.seq},
            "colocated_step_s": step_seconds(runs["colocated"], "moe", args.batch * args.seq),
        }
        for name in schedules:
            c = compare(split, name, runs[name], "moe")
            c["measured"]["whole_step_s"] = step_seconds(runs[name], "moe", args.batch * args.seq)
            result[name] = c
            if name != "sequential":
                result[f"{name}_vs_sequential_passes"] = result["sequential"]["measured"]["step_s"] / c["measured"]["step_s"]
                result[f"{name}_vs_sequential_predicted"] = result["sequential"]["predicted"]["step_s"] / c["predicted"]["step_s"]
    if args.json:
        print(json.dumps({"af_pipeline": result}))
        return 0
    print(f"hardware (measured): {hw.peak_tflops:.3f} TFLOP/s, copy {hw.hbm_gbps:.1f} GB/s, all_to_all {link:.2f} GB/s per process; "
          f"{args.nproc} processes on {cores} core(s)" if figures["device"] == "cpu" else f"hardware (measured): {figures}")
    print(f"{'schedule':<12}{'passes pred':>13}{'passes meas':>13}{'whole step':>12}{'attn wait pred':>16}{'meas':>7}{'exp idle pred':>15}{'meas':>7}")
    for name in schedules:
        p, m = result[name]["predicted"], result[name]["measured"]
        print(f"{name:<12}{p['step_s'] * 1e3:>11.1f}ms{m['step_s'] * 1e3:>11.1f}ms{m['whole_step_s'] * 1e3:>10.1f}ms"
              f"{p['attention_wait_fraction']:>16.0%}{m['attention_wait_fraction']:>7.0%}{p['expert_idle_fraction']:>15.0%}{m['expert_idle_fraction']:>7.0%}")
    print(f"co-located expert parallelism: whole step {result['colocated_step_s'] * 1e3:.1f} ms")
    for name in schedules[1:]:
        print(f"{name} vs sequential, passes: measured {result[f'{name}_vs_sequential_passes']:.2f}x, predicted {result[f'{name}_vs_sequential_predicted']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
