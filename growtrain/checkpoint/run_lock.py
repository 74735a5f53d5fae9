"""One run per run directory: an exclusive lock on `RUN_DIR/.lock`, held for the whole run.

Two runs on one `--out` used to corrupt each other (the second swept the first's in-progress save
as "left over" and interleaved metrics.jsonl rows). The lock is an flock(2) on an open file, so
the kernel releases it when the holding process dies, however it dies: a kill -9 leaves nothing
to clean up. The file records who holds it (PID, host, start time) for the refusal message.
Under torchrun only rank 0 takes it: the other ranks' writes are ordered by rank 0's barriers.
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import json
import os
import socket
from pathlib import Path

LOCK_FILE = ".lock"


class RunDirLocked(Exception):
    """Another live process holds the run directory."""


class RunDirLock:
    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> None:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
            raise RunDirLocked(f"{self.path.parent} is in use by another run ({self._holder()}); wait for it to end, "
                               "stop it, or choose another --out") from None
        holder = {"pid": os.getpid(), "host": socket.gethostname(),
                  "since": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(holder) + "\n").encode(), 0)
        self._fd = fd

    def _holder(self) -> str:
        try:
            h = json.loads(self.path.read_text())
            return f"PID {h['pid']} on host {h['host']}, since {h['since']}"
        except (OSError, ValueError, KeyError, TypeError):
            return "its holder did not record itself yet"

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None

    def __enter__(self) -> "RunDirLock":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()
