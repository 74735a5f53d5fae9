"""Step time of an expert-parallel MoE layer with the overlapped combine against the serial one,
side by side in one run (growtrain/model/expert_parallel.py).

    python benchmarks/ep_overlap.py                      # 2 CPU processes (gloo), a table
    python benchmarks/ep_overlap.py --nproc 4 --json     # one JSON line
    python benchmarks/ep_overlap.py --nproc 8            # on an 8-GPU node: NCCL, one GPU each

The script starts torchrun itself (`--nproc` processes) and runs one MoE layer per process, the
experts sharded over the processes, each process with its own tokens. A step is forward +
backward of the layer. The two combine modes alternate step by step (serial, overlapped, serial,
...) after --warmup steps of each, so machine noise hits both alike; the median over --steps is
reported, as the slowest rank's time (a step ends when every rank is done).

  serial      every received chunk computed, then one all_to_all_single sends the results back
  overlapped  receives posted first; each remote-bound chunk sent (isend) as soon as it is
              computed, while the next chunk computes; the own chunk last

Both compute the same chunks in the same way (the test suite checks they give the same bits), so
the ratio isolates the transfer/compute overlap. On CPU processes sharing few cores, the transfer
is a memcpy through the loopback and compete with compute for the same cores: expect a ratio near
1 there; the overlap is meant for NVLink-connected GPUs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=2, help="processes (expert-parallel ranks), default 2")
    p.add_argument("--tokens", type=int, default=2048, help="tokens per rank per step (default 2048)")
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--experts", type=int, default=16, help="routed experts in the layer (divisible by --nproc)")
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--hidden", type=int, default=512, help="expert hidden width")
    p.add_argument("--steps", type=int, default=10, help="timed steps per mode")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--json", action="store_true", help="print one JSON line instead of the table")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # set by the launcher: the result file
    return p.parse_args(argv)


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    from growtrain.model.config import ModelConfig, MoEConfig
    from growtrain.model.expert_parallel import EPGroup, shard_moe
    from growtrain.model.moe import MoE

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    from growtrain.parallel.distributed import import_before_group

    import_before_group()  # before the group, as the trainer does
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda") if cuda else torch.device("cpu")
    torch.manual_seed(0)
    moe = MoEConfig(num_experts=args.experts, top_k=args.top_k, expert_hidden=args.hidden, aux_loss_coef=0.0, z_loss_coef=0.0)
    cfg = ModelConfig(d_model=args.d_model, n_layers=1, n_heads=4, ffn_hidden=args.hidden, moe=moe, moe_layers=(0,))
    layers = {}
    base = MoE(cfg).state_dict()
    for mode in ("serial", "overlapped"):
        layer = MoE(cfg)
        layer.load_state_dict(base)
        layers[mode] = shard_moe(layer, EPGroup(rank, world, mode)).to(device)
    torch.manual_seed(1 + rank)
    x = torch.randn(args.tokens, args.d_model, device=device)
    g = torch.randn(args.tokens, args.d_model, device=device)

    def step(layer) -> float:
        dist.barrier()
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        y, _ = layer(x)
        (y * g).sum().backward()
        if cuda:
            torch.cuda.synchronize()
        elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the step ends with its slowest rank
        layer.zero_grad(set_to_none=True)
        return elapsed.item()

    times = {"serial": [], "overlapped": []}
    for i in range(args.warmup + args.steps):
        for mode in ("serial", "overlapped"):
            t = step(layers[mode])
            if i >= args.warmup:
                times[mode].append(t)
    if rank == 0:
        device_name = torch.cuda.get_device_name(0) if cuda else f"cpu, {os.cpu_count()} cores"
        Path(args.worker).write_text(json.dumps({"times": times, "device": device_name, "backend": dist.get_backend()}))
    dist.destroy_process_group()


def main(argv=None) -> int:
    args = parse(argv)
    if args.worker:
        worker(args)
        return 0
    if args.experts % args.nproc:
        print(f"--experts {args.experts} must divide over --nproc {args.nproc}", file=sys.stderr)
        return 2
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "times.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.nproc), __file__]
        cmd += [f"--tokens={args.tokens}", f"--d-model={args.d_model}", f"--experts={args.experts}", f"--top-k={args.top_k}"]
        cmd += [f"--hidden={args.hidden}", f"--steps={args.steps}", f"--warmup={args.warmup}", f"--worker={result}"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            print(proc.stdout[-2000:] + proc.stderr[-4000:], file=sys.stderr)
            return 1
        data = json.loads(result.read_text())
    serial = statistics.median(data["times"]["serial"])
    overlapped = statistics.median(data["times"]["overlapped"])
    out = {
        "nproc": args.nproc,
        "device": data["device"],
        "backend": data["backend"],
        "tokens_per_rank": args.tokens,
        "experts": args.experts,
        "serial_s": serial,
        "overlapped_s": overlapped,
        "overlapped_over_serial": overlapped / serial,
    }
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"MoE layer fwd+bwd, {args.nproc} ranks ({data['backend']}, {data['device']}), {args.tokens} tokens/rank, "
          f"{args.experts} experts top-{args.top_k}, d_model {args.d_model}, hidden {args.hidden}; median of {args.steps}")
    print(f"{'combine':<12}{'step (ms)':>12}{'vs serial':>12}")
    print(f"{'serial':<12}{serial * 1e3:>12.2f}{1.0:>12.3f}")
    print(f"{'overlapped':<12}{overlapped * 1e3:>12.2f}{overlapped / serial:>12.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
