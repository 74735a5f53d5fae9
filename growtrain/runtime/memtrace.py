"""Per-rank memory of growth and training, for benchmarks/growth_memory.py (issue 14): with
GROWTRAIN_MEMORY_TRACE=DIR set, `growtrain run` records for every stage's growth and for its
training steps the peak of live tensor bytes and of the process's resident memory, one JSON line
per phase in DIR/rank-R.jsonl. Unset (the normal case), `phase` does nothing.

Live tensor bytes: the storages alive when the phase starts (found by a scan of the garbage
collector's objects: model, optimizer state, batches), plus the peak of the storages created
inside it and still alive (memory.LiveTensorMeter, a dispatch mode that sees every op's output;
slow, Python per op), less those of the first that were freed inside it before that peak (a
growth that drops the old experts' optimizer state: each old storage is watched by a weakref
finalizer while the phase runs). Resident memory: the kernel's
high-water mark (VmHWM), reset at the phase start (/proc/self/clear_refs), on Linux; None elsewhere.
"""

from __future__ import annotations

import gc
import json
import os
import time
import weakref
from contextlib import contextmanager
from pathlib import Path

import torch

ENV = "GROWTRAIN_MEMORY_TRACE"


def enabled() -> bool:
    return bool(os.environ.get(ENV))


def live_storage_bytes() -> int:
    """Bytes of every distinct storage held by a tensor object alive now (meta tensors excluded)."""
    return sum(st.nbytes() for st in live_storages())


def live_storages() -> list:
    """Every distinct non-empty storage held by a tensor object alive now (meta tensors excluded)."""
    seen, out = set(), []
    for obj in gc.get_objects():
        if not issubclass(type(obj), torch.Tensor) or obj.device.type == "meta":  # type(): no proxy's __class__
            continue
        try:
            st = obj.untyped_storage()
            key = (st.data_ptr(), st.device)
        except (RuntimeError, NotImplementedError):  # fake and functional tensors have no data
            continue
        if key in seen or st.nbytes() == 0:
            continue
        seen.add(key)
        out.append(st)
    return out


def _reset_hwm() -> None:
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def _hwm_bytes() -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


@contextmanager
def phase(stage: str, kind: str, rank: int = 0):
    """Record the peak memory of the block as one line of DIR/rank-R.jsonl (no-op when unset)."""
    if not enabled():
        yield
        return
    from growtrain.runtime.memory import LiveTensorMeter

    gc.collect()
    storages = live_storages()
    baseline = sum(st.nbytes() for st in storages)
    _reset_hwm()
    t0 = time.perf_counter()
    meter = LiveTensorMeter(sites=True)
    # An old storage freed inside the phase lowers the meter's count (it may go below zero).
    watches = [weakref.finalize(st, meter.outside_freed, st.nbytes()) for st in storages]
    del storages
    try:
        with meter:
            yield
    finally:
        for w in watches:
            w.detach()
    record = {
        "stage": stage,
        "phase": kind,
        "rank": rank,
        "baseline_bytes": baseline,
        "live_peak_bytes": baseline + meter.peak,
        "rss_peak_bytes": _hwm_bytes(),
        "peak_at": meter.where,
        "seconds": time.perf_counter() - t0,
    }
    out = Path(os.environ[ENV])
    out.mkdir(parents=True, exist_ok=True)
    with open(out / f"rank-{rank}.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")
