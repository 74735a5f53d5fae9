"""Fault injection for the crash-and-resume tests.

`GROWTRAIN_FAULT=point:n` kills the process with SIGKILL the n-th time (1-based) execution passes
`maybe_fault(point)`; `point:n:raise` raises a RuntimeError there instead (a rank's own error), and
`point:n:hang` sleeps there for good (a stuck rank). Points used: `step_mid` (between backward and optimizer step),
`checkpoint_mid` (some checkpoint files written, manifest not yet), `growth_mid` (an operator
of a transition applied and checked, the next not yet), `after_transition` (growth applied,
nothing saved yet), `prepare_shard` (prepare-data: a shard finished, no manifest yet).
Under torchrun, `GROWTRAIN_FAULT_RANK=r` limits the fault to rank r
(the others see the death of a peer). Unset in normal use: one dict lookup per call.
"""

from __future__ import annotations

import os
import signal
import time

_hits: dict[str, int] = {}


def maybe_fault(point: str) -> None:
    spec = os.environ.get("GROWTRAIN_FAULT")
    if not spec:
        return
    name, _, rest = spec.partition(":")
    count, _, action = rest.partition(":")
    if name != point:
        return
    only_rank = os.environ.get("GROWTRAIN_FAULT_RANK")
    if only_rank is not None and only_rank != os.environ.get("RANK", "0"):
        return
    _hits[point] = _hits.get(point, 0) + 1
    if _hits[point] == int(count or 1):
        if action == "raise":
            raise RuntimeError(f"injected fault at {point} (GROWTRAIN_FAULT={spec})")
        if action == "hang":
            while True:
                time.sleep(3600)
        os.kill(os.getpid(), signal.SIGKILL)
