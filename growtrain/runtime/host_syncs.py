"""Count the host syncs a piece of code would make on a GPU, on any device (DESIGN.md §15).

A sync stalls the GPU's queue until everything before it has run. On the CPU nothing stalls, but
the same calls are there to count: a TorchDispatchMode sees `aten._local_scalar_dense` (`.item()`,
`float(t)`, `bool(t)`, Python conditionals on tensors), device-to-host copies, and the ops whose
output size depends on the data (`nonzero`, boolean-mask indexing, `unique`, `repeat_interleave`
without `output_size`), and ops that read their input's range on the host (`bincount`, `histc`),
which sync on CUDA. `Tensor.tolist()` and `Tensor.numpy()` do not pass
through the dispatcher, so they are counted by wrapping them.

Each sync is attributed to the first frame of growtrain code that made it (file:line), so a
report says where they come from: `SyncCounter.by_site`.
"""

from __future__ import annotations

import collections
import contextlib
import io
import traceback
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_DATA_DEPENDENT = {
    "aten.nonzero.default",
    "aten.masked_select.default",
    "aten.unique_dim.default",
    "aten._unique2.default",
    "aten.unique_consecutive.default",
    "aten.index.Tensor",  # counted only with a boolean index (below)
    "aten.repeat_interleave.Tensor",
    "aten.bincount.default",  # CUDA reads the input's min and max on the host
    "aten.histc.default",  # CUDA reads min and max when no range is given
}
_ROOT = str(Path(__file__).resolve().parents[2])


def call_site() -> str:
    """file:line, from the repository root, of the innermost frame of growtrain's own code on the
    stack: not this module's, a benchmark's or an installed package's (torch's Python layers)."""
    for frame in reversed(traceback.extract_stack()):
        if not frame.filename.startswith(_ROOT):
            continue
        rel = str(Path(frame.filename).relative_to(_ROOT))
        if not (rel.endswith("growtrain/runtime/host_syncs.py") or rel.startswith("benchmarks") or "site-packages" in rel):
            return f"{rel}:{frame.lineno}"
    return "elsewhere"


class SyncCounter(TorchDispatchMode):
    """`with SyncCounter() as c: ...` then `c.count` and `c.by_site`."""

    def __init__(self):
        super().__init__()
        self.by_site: collections.Counter[str] = collections.Counter()
        self._saved = None

    @property
    def count(self) -> int:
        return sum(self.by_site.values())

    def _hit(self) -> None:
        self.by_site[call_site()] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func)
        if name == "aten._local_scalar_dense.default":
            self._hit()
        elif name in _DATA_DEPENDENT:
            if name == "aten.index.Tensor":
                if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] if len(args) > 1 else [])):
                    self._hit()
            elif not (name == "aten.repeat_interleave.Tensor" and kwargs.get("output_size") is not None):
                self._hit()
        elif name.startswith("aten._to_copy") or name.startswith("aten.copy_"):
            src = args[0] if name.startswith("aten._to_copy") else args[1]
            dst_device = kwargs.get("device") if name.startswith("aten._to_copy") else args[0].device
            if isinstance(src, torch.Tensor) and src.device.type not in ("cpu", "meta") and dst_device is not None and torch.device(dst_device).type == "cpu":
                self._hit()
        return func(*args, **kwargs)

    def __enter__(self):
        counter = self
        tolist, numpy = torch.Tensor.tolist, torch.Tensor.numpy

        def counted_tolist(t, *a, **k):
            counter._hit()
            return tolist(t, *a, **k)

        def counted_numpy(t, *a, **k):
            counter._hit()
            return numpy(t, *a, **k)

        self._saved = (tolist, numpy)
        torch.Tensor.tolist, torch.Tensor.numpy = counted_tolist, counted_numpy
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist, torch.Tensor.numpy = self._saved
        return super().__exit__(*exc)


def per_step_syncs(raw_recipe: dict, steps: int, run_root: Path) -> dict[str, float]:
    """Host syncs per training step of the real loop (growtrain.train.run), by source: the same
    one-stage recipe trained for `steps` and for 2 x `steps` steps, the difference divided by
    `steps`, so setup, the stage-end eval and checkpoint cancel out. Returns {"trainer": n,
    "expert_backend": n} (the reference expert backends read each MoE call's offsets on the host;
    the Triton path keeps them on the device) and "by_site" for the trainer's."""
    import copy

    from growtrain.recipe import recipe_from_dict
    from growtrain.train import run

    counts = []
    for n in (steps, 2 * steps):
        raw = copy.deepcopy(raw_recipe)
        raw["stages"][0]["steps"] = n
        with SyncCounter() as counter, contextlib.redirect_stdout(io.StringIO()):
            run(recipe_from_dict(raw), Path(run_root) / f"steps{n}", resume="never", log=lambda *a, **k: None)
        counts.append(counter.by_site)
    diff = collections.Counter(counts[1])
    diff.subtract(counts[0])
    backend = sum(v for k, v in diff.items() if k.startswith("kernels/"))
    trainer = {k: v / steps for k, v in diff.items() if not k.startswith("kernels/") and v}
    return {"trainer": sum(trainer.values()), "expert_backend": backend / steps, "by_site": trainer}
