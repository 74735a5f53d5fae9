"""torchrun's worker program in the suite: `torchrun ... tests/fork_rank.py -m growtrain ARGS`
(or `tests/fork_rank.py SCRIPT ARGS`) has the `group` fork server (tests/cli_forkserver.py, named by
GROWTRAIN_TEST_FORKSERVER) start the rank as `python -u -m growtrain ARGS`, with this process's
environment (RANK, WORLD_SIZE, MASTER_ADDR, ... as torchrun set them), working directory and
standard streams, and stands in for it towards torchrun: it passes on the signals torchrun sends,
ends with the rank's status (killed by the same signal, or exiting with its code), and if torchrun
kills it outright the server kills the rank. Without the server, or where the server answers
that the environment needs a fresh interpreter, it becomes the interpreter itself (exec)."""

import os
import signal
import sys

from cli_forkserver import Replies, request  # tests/, this script's folder, is first on sys.path


def fresh() -> None:
    os.execv(sys.executable, [sys.executable, "-u", *sys.argv[1:]])


def main() -> None:
    path = os.environ.get("GROWTRAIN_TEST_FORKSERVER")
    if not path or len(sys.argv) < 2:
        fresh()
    if sys.argv[1] == "-m":
        req = {"module": sys.argv[2], "args": sys.argv[3:]}
    else:
        req = {"script": sys.argv[1], "args": sys.argv[2:]}
    req.update(cwd=os.getcwd(), env=dict(os.environ), unbuffered=True)
    try:
        conn = request(path, req, [0, 1, 2])
    except OSError:
        fresh()
    replies = Replies(conn)
    first = replies.next()
    if first.get("fallback"):
        fresh()
    pid = first["pid"]

    def forward(sig, _frame):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, forward)
    status = None
    while status is None:
        try:
            status = replies.next()["status"]
        except InterruptedError:
            continue
    code = os.waitstatus_to_exitcode(status)
    if code < 0:  # killed: by the same signal, its default action restored where it has a handler here
        if -code not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    sys.exit(code)


if __name__ == "__main__":
    main()
