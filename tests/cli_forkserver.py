"""A fork server for the suite's processes: `python -m growtrain ...`, `python -m
torch.distributed.run ...` and torchrun's ranks, as the tests start them, minus the seconds each
fresh interpreter spends importing torch and the libraries growtrain imports lazily: torch ~1.6 s on
a CI core, torch._dynamo another ~1.4 s (a rank imports it before joining a group,
parallel/distributed.import_before_group), peft another ~3.4 s (it brings transformers, bitsandbytes
and triton; every run with NF4 experts or LoRA adapters imports it).

tests/conftest.py (`run_module`) starts two per test worker at its first request, `base` and `group`
(for ranks: torchrun's environment, OMP_NUM_THREADS set); both import torch, torch._dynamo and peft
before they listen. Each listens on a unix socket. A request is one JSON line {module or script,
args, cwd, env, unbuffered} with three file descriptors (the SCM_RIGHTS of a unix socket) for stdin,
stdout and stderr; the server forks a child that is then what `python [-u] -m MODULE ARGS` (or
`python SCRIPT ARGS`) would be: its own process (own pid, exit status, signals: a fault's SIGKILL
kills it alone), the request's working directory, environment, argv, sys.path[0] and standard
streams, `runpy` running it as `__main__` exactly as the interpreter does, and the interpreter's own
exit up to its finalization (threads joined, atexit handlers, flushing, an uncaught exception's
traceback and status 1; see _exit_as_the_interpreter for what is skipped and why). It replies
{"pid": N}, then {"status": S} (waitpid's) when the child ends; if the requester goes away first
(killed), the child is killed. The server ends when its stdin (a pipe from the test process) closes.
What a child can tell from a fresh interpreter is only that those modules are in sys.modules already,
and that nothing of its finalization runs after the atexit handlers.

Nothing of growtrain is imported before the fork, so growtrain's import-time reads of the environment
(GROWTRAIN_*, WANDB_*) see the request's. A request whose environment differs from the server's in a
variable that the preloaded libraries may read at their import (SENSITIVE: TRITON_INTERPRET, HF_*,
OMP_*, ...) is answered {"fallback": true}: the requester then starts a fresh interpreter, as it does
for any other program.
"""

from __future__ import annotations

import io
import json
import os
import runpy
import select
import signal
import socket
import sys
import time

# What the interpreter, torch, peft, transformers, bitsandbytes or triton may read at import: a
# request differing from the server here runs fresh.
SENSITIVE = ("PYTHON", "OMP_", "MKL_", "KMP_", "GOMP", "CUDA", "NVIDIA", "LD_", "PYTORCH", "TORCH_LOGS", "TORCHDYNAMO",
             "TORCHINDUCTOR", "TORCH_COMPILE", "TORCH_SHOW", "TRITON", "HF_", "HUGGINGFACE", "TRANSFORMERS", "PEFT", "BNB_",
             "XDG_", "HOME", "USE_TORCH", "USE_TF", "USE_FLAX", "USE_JAX", "SAFETENSORS", "ACCELERATE")
# Not TOKENIZERS_*: tokenizers reads them when it runs, and growtrain.data.prepare sets
# TOKENIZERS_PARALLELISM in the test process (every later request would run fresh).
# Imported before the server listens, so that every child inherits them (peft imports transformers,
# bitsandbytes and triton).
PRELOAD = ("torch", "torch._dynamo", "peft")
INERT = ("PYTHONUNBUFFERED",)  # honoured by the child itself (`unbuffered`)


def mismatch(env: dict, base: dict, imported: dict) -> list[str]:
    """The sensitive variables in which `env` differs from the server's as started (`base`), a
    variable the server's imports set counting as equal where `env` holds the value they set (a
    test process that imported torch._dynamo itself has TORCHINDUCTOR_CACHE_DIR)."""
    keys = {k for k in set(env) | set(base) if k.startswith(SENSITIVE) and k not in INERT}
    return sorted(k for k in keys if env.get(k) != base.get(k) and not (k in imported and env.get(k) == imported[k]))


def recv_request(conn: socket.socket) -> tuple[dict, list[int]]:
    data, fds, _, _ = socket.recv_fds(conn, 1 << 16, 3)
    while not data.endswith(b"\n"):
        more = conn.recv(1 << 16)
        if not more:
            raise ConnectionError("request cut short")
        data += more
    return json.loads(data), fds


def _child(req: dict, fds: list[int]) -> None:
    for fd, target in zip(fds, (0, 1, 2)):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    unbuffered = req["unbuffered"] or bool(os.environ.get("PYTHONUNBUFFERED"))
    sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False), encoding="utf-8")
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), encoding="utf-8", write_through=unbuffered)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), encoding="utf-8", errors="backslashreplace",
                                  line_buffering=True)
    sys.__stdin__, sys.__stdout__, sys.__stderr__ = sys.stdin, sys.stdout, sys.stderr
    if req.get("module"):
        sys.path[0] = os.getcwd()  # what `python -m` puts first
        sys.argv = ["-m", *req["args"]]
        runpy._run_module_as_main(req["module"], alter_argv=True)  # the call `python -m` makes
    else:
        script = os.path.abspath(req["script"])
        sys.path[0] = os.path.dirname(script)  # what `python SCRIPT` puts first
        sys.argv = [req["script"], *req["args"]]
        runpy.run_path(script, run_name="__main__")


def _exit_as_the_interpreter(program, *args) -> None:
    """Run `program(*args)` and end the process as the interpreter ends one, less its finalization:
    the status of a SystemExit (its message on stderr), an uncaught exception's traceback and status
    1 (KeyboardInterrupt: killed by SIGINT), then what the interpreter does before finalizing (wait
    for non-daemon threads, run the atexit handlers, flush the standard streams), then `os._exit`.
    Finalizing (the last garbage collection and the modules' teardown) would walk every object the
    preloads made, ~480k, and write to each one's page, copying it from the server: 1.5 s of CPU per
    child against 0.03 s, measured. What a child skips is what a fresh interpreter does after the
    atexit handlers: a crash or message there would go unseen here (the wheel's test, the GPU checks'
    CPU form, test_expert_parallel's fresh EP 2 and AF runs and GROWTRAIN_FRESH_INTERPRETERS=1 run
    fresh interpreters)."""
    import atexit
    import threading
    import traceback

    code, interrupted = 0, False
    try:
        program(*args)
    except SystemExit as stop:
        if stop.code is None:
            code = 0
        elif isinstance(stop.code, int):
            code = stop.code
        else:
            print(stop.code, file=sys.stderr)
            code = 1
    except BaseException as error:  # noqa: BLE001 (what the interpreter does with an uncaught exception)
        interrupted = isinstance(error, KeyboardInterrupt)
        try:
            sys.excepthook(type(error), error, error.__traceback__)
        except Exception:  # noqa: BLE001
            traceback.print_exception(error)
        code = 1
    try:
        threading._shutdown()  # what Py_FinalizeEx calls first: joins the non-daemon threads
    except BaseException:  # noqa: BLE001
        pass
    atexit._run_exitfuncs()  # prints a failing handler's traceback itself, as at exit
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        try:
            stream.flush()
        except (AttributeError, ValueError, OSError):
            pass
    if interrupted:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code & 0xFF)


def serve(path: str) -> None:
    import importlib

    base = dict(os.environ)  # as started: the imports may set variables of their own
    for name in PRELOAD:  # the point of the server: imported once, inherited by every child
        importlib.import_module(name)
    # what those imports set (TORCHINDUCTOR_CACHE_DIR): a fresh interpreter's imports would set it too
    set_by_imports = {k: v for k, v in os.environ.items() if base.get(k) != v}
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".tmp")
    listener.listen(64)
    os.rename(path + ".tmp", path)  # the socket appears once it accepts
    children: dict[socket.socket, int] = {}
    while True:
        ready = select.select([listener, sys.stdin, *children], [], [], 0.02)[0]
        for s in ready:
            if s is sys.stdin:  # the test process that started the server is gone (its pipe closed)
                if not os.read(0, 1 << 12):
                    os.unlink(path)
                    os.rmdir(os.path.dirname(path))
                    return
            elif s is listener:
                conn, _ = listener.accept()
                try:
                    req, fds = recv_request(conn)
                except (ConnectionError, ValueError, OSError):
                    conn.close()
                    continue
                if differs := mismatch(req["env"], base, set_by_imports):
                    for fd in fds:
                        os.close(fd)
                    conn.sendall(json.dumps({"fallback": differs}).encode() + b"\n")
                    conn.close()
                    continue
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    listener.close()
                    for other in (conn, *children):
                        other.close()
                    req["env"] = {**set_by_imports, **req["env"]}
                    _exit_as_the_interpreter(_child, req, fds)
                for fd in fds:
                    os.close(fd)
                conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
                children[conn] = pid
            elif not s.recv(1):  # the requester is gone: its child goes too
                try:
                    os.kill(children[s], signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for conn, pid in list(children.items()):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                try:
                    conn.sendall(json.dumps({"status": status}).encode() + b"\n")
                except OSError:
                    pass
                conn.close()
                del children[conn]


def request(path: str, req: dict, fds: list[int]) -> socket.socket:
    """Send a request; returns the connection, whose first reply is {"pid"} or {"fallback"}."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(path)
    socket.send_fds(conn, [json.dumps(req).encode() + b"\n"], fds)
    return conn


class Replies:
    """The server's reply lines on one connection."""

    def __init__(self, conn: socket.socket):
        self.conn, self.pending = conn, b""

    def next(self, timeout: float | None = None) -> dict | None:
        """The next reply, or None if none came within `timeout` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self.pending:
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([self.conn], [], [], wait)[0]:
                return None
            chunk = self.conn.recv(1 << 16)
            if not chunk:
                raise ConnectionError("the fork server (tests/cli_forkserver.py) closed the connection")
            self.pending += chunk
        line, self.pending = self.pending.split(b"\n", 1)
        return json.loads(line)


if __name__ == "__main__":
    serve(sys.argv[1])
