"""Fault injection for the crash-and-resume tests.

`GROWTRAIN_FAULT=point:n` kills the process with SIGKILL the n-th time (1-based) execution passes
`maybe_fault(point)`. Points used: `step_mid` (between backward and optimizer step),
`checkpoint_mid` (some checkpoint files written, manifest not yet), `after_transition` (growth
applied, nothing saved yet). Unset in normal use: one dict lookup per call.
"""

from __future__ import annotations

import os
import signal

_hits: dict[str, int] = {}


def maybe_fault(point: str) -> None:
    spec = os.environ.get("GROWTRAIN_FAULT")
    if not spec:
        return
    name, _, count = spec.partition(":")
    if name != point:
        return
    _hits[point] = _hits.get(point, 0) + 1
    if _hits[point] == int(count or 1):
        os.kill(os.getpid(), signal.SIGKILL)
