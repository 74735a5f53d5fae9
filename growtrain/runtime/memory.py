"""Memory meters that work on the CPU, where there are no allocator statistics: bytes held for
backward (saved-tensor hooks) and live tensor bytes (a dispatch mode that sees every op's output).
Used by the reversible-backward tests and benchmarks/reversible_memory.py. And what the host has
left (growth on the host warns when it may not fit).

Both count storages, not tensors: autograd saves the same activation for several ops (x for
wq, wk and wv), and views share one storage, so counting tensors would overstate what is held.
"""

from __future__ import annotations

import sys
import weakref
from typing import Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


def host_available_bytes() -> int | None:
    """Host memory available to new allocations (Linux's MemAvailable), or None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _storage(t: torch.Tensor):
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # tensor subclasses without a plain storage
        return None


def _tensors(tree) -> list[torch.Tensor]:
    return [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]


class _Held:
    """What a pack hook returns: keeps the tensor, and tells the meter when autograd drops it."""

    __slots__ = ("tensor", "meter", "key", "__weakref__")

    def __init__(self, meter: "SavedTensorMeter", tensor: torch.Tensor, key):
        self.tensor, self.meter, self.key = tensor, meter, key

    def __del__(self):
        if self.key is not None:
            self.meter._release(self.key)


class SavedTensorMeter:
    """Bytes of the storages that autograd holds for backward, live and at peak, over everything run
    inside the `with` block (forward and backward: a recompute inside backward counts too).
    Storages of `exclude` (pass the parameters: saving a weight costs nothing) are not counted."""

    def __init__(self, exclude: Iterable[torch.Tensor] = ()):
        self.exclude = {s.data_ptr() for s in map(_storage, exclude) if s is not None}
        self.live: dict[int, list[int]] = {}  # storage pointer -> [holders, bytes]
        self.current = 0
        self.peak = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def __enter__(self) -> "SavedTensorMeter":
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)

    def _pack(self, t: torch.Tensor) -> _Held:
        st = _storage(t)
        if st is None or st.data_ptr() in self.exclude or st.nbytes() == 0:
            return _Held(self, t, None)
        key = st.data_ptr()
        entry = self.live.setdefault(key, [0, st.nbytes()])
        if entry[0] == 0:
            self.current += entry[1]
            self.peak = max(self.peak, self.current)
        entry[0] += 1
        return _Held(self, t, key)

    @staticmethod
    def _unpack(held: _Held) -> torch.Tensor:
        return held.tensor

    def _release(self, key: int) -> None:
        entry = self.live[key]
        entry[0] -= 1
        if entry[0] == 0:
            self.current -= entry[1]
            del self.live[key]


class LiveTensorMeter(TorchDispatchMode):
    """Peak bytes of the storages created inside the `with` block and still alive: every op's
    output storage is counted once, from the op that made it until it is freed. Storages that
    existed before (parameters, inputs, optimizer state) are not counted, so `peak` is what a
    forward+backward adds on top of the model. CPU and CUDA alike; slow (Python per op).

    `where`: with `sites=True`, growtrain's own frames (innermost last, "module:function:line") at
    the op that reached the peak, so that a benchmark can say which phase sets it."""

    def __init__(self, sites: bool = False):
        super().__init__()
        self.current = 0
        self.peak = 0
        self.where: list[str] = []
        self._sites = sites
        self._seen: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # In-place ops and views return an input's storage: nothing new was allocated.
        inputs = {s.data_ptr() for s in map(_storage, _tensors((args, kwargs))) if s is not None}
        for t in _tensors(out):
            self._track(t, inputs)
        return out

    def _track(self, t: torch.Tensor, inputs: set[int]) -> None:
        st = _storage(t)
        # Meta tensors hold no memory (a model built on meta to count its parameters).
        if st is None or t.device.type == "meta" or id(st) in self._seen or st.nbytes() == 0 or st.data_ptr() in inputs:
            return
        nbytes = st.nbytes()
        self._seen.add(id(st))
        self.current += nbytes
        if self.current > self.peak:
            self.peak = self.current
            if self._sites:
                self.where = _own_frames()
        # Storage Python objects live exactly as long as the storage (PyObject preservation), so
        # a weakref callback marks the free. Storages made before the block are never in _seen.
        weakref.finalize(st, self._free, id(st), nbytes)

    def _free(self, key: int, nbytes: int) -> None:
        self._seen.discard(key)
        self.current -= nbytes

    def outside_freed(self, nbytes: int) -> None:
        """A storage made before the block was freed inside it: the count goes down (below zero,
        when nothing made inside is alive)."""
        self.current -= nbytes


def _own_frames() -> list[str]:
    frames, f = [], sys._getframe(2)
    while f is not None:
        module = f.f_globals.get("__name__", "")
        if module.startswith("growtrain") and module != __name__:
            frames.append(f"{module}:{f.f_code.co_name}:{f.f_lineno}")
        f = f.f_back
    return frames[::-1]
