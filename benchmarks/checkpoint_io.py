"""Checkpoint hashing throughput and what it means for the 120B recipe (issue 14).

Every checkpoint file is covered by a sha256 in its manifest. Under expert parallelism each rank
now hashes the shard it wrote, all ranks at once, and on load each rank hashes its share of the
files (growtrain/checkpoint/store.py); before, rank 0 hashed every file of a save, and every rank every
file of a load. This measures growtrain's own hashing (checkpoint._sha256, 1 MiB reads) on a file
of --gb GB, cold (after dropping it from the page cache where the OS allows) and warm, and states
how long a peer waits at the 120B recipe's last stage (~117 GB per checkpoint over 8 ranks)
against distributed.timeout_s.

    python benchmarks/checkpoint_io.py [--json] [--gb 1.0] [--checkpoint-gb 117] [--ranks 8]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from growtrain.checkpoint.store import _sha256  # noqa: E402
from growtrain.recipe import DistributedConfig  # noqa: E402


def drop_from_cache(path: Path) -> bool:
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        return True
    except (AttributeError, OSError):
        return False


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="print one JSON line")
    ap.add_argument("--gb", type=float, default=1.0, help="size of the test file, GB (default 1)")
    ap.add_argument("--checkpoint-gb", type=float, default=117.0, help="checkpoint size to state the bound for (default 117)")
    ap.add_argument("--ranks", type=int, default=8, help="ranks sharing the hashing (default 8)")
    args = ap.parse_args()
    size = int(args.gb * 1e9)
    with tempfile.TemporaryDirectory(prefix="ckpt-io-") as tmp:
        path = Path(tmp) / "blob.bin"
        with open(path, "wb") as f:
            left = size
            while left:
                chunk = os.urandom(min(left, 64 << 20))
                f.write(chunk)
                left -= len(chunk)
        cold = drop_from_cache(path)
        t0 = time.perf_counter()
        _sha256(path)
        first = time.perf_counter() - t0
        t0 = time.perf_counter()
        _sha256(path)
        warm = time.perf_counter() - t0
    rate_first, rate_warm = size / first / 1e9, size / warm / 1e9
    rate = min(rate_first, rate_warm)
    per_rank_gb = args.checkpoint_gb / args.ranks
    timeout = DistributedConfig().timeout_s
    result = {
        "hash_gb_per_s_first_read": rate_first,
        "hash_gb_per_s_warm": rate_warm,
        "first_read_cold": cold,
        "checkpoint_gb": args.checkpoint_gb,
        "ranks": args.ranks,
        "per_rank_hash_s": per_rank_gb / rate,
        "rank0_alone_hash_s": args.checkpoint_gb / rate,
        "timeout_s": timeout,
        "within_timeout": per_rank_gb / rate < timeout,
    }
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"sha256 of a {args.gb:g} GB file: {rate_first:.2f} GB/s first read ({'cold' if cold else 'cache not dropped'}), {rate_warm:.2f} GB/s warm")
    print(f"{args.checkpoint_gb:g} GB checkpoint: {per_rank_gb:.1f} GB per rank over {args.ranks} ranks -> {result['per_rank_hash_s']:.0f} s of hashing "
          f"per rank (rank 0 alone: {result['rank0_alone_hash_s']:.0f} s); distributed.timeout_s {timeout} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
