"""The suite's fork servers (tests/cli_forkserver.py, tests/fork_rank.py) start processes that
behave as fresh interpreters do: the same output, exit status, exceptions, signals, environment
and timeouts, for `python -m`, for scripts and for torchrun's ranks."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import FORK_SERVER, REPO, cli_env, run_module

pytestmark = pytest.mark.skipif(not FORK_SERVER, reason="GROWTRAIN_FRESH_INTERPRETERS=1: no fork server")

PROBE = """
import json, os, sys
print(json.dumps({"argv": sys.argv, "path0": sys.path[0], "cwd": os.getcwd(), "main": __name__,
                  "probe": os.environ.get("PROBE"), "rank": os.environ.get("RANK"),
                  "dynamo": "torch._dynamo" in sys.modules, "pid": os.getpid(), "hash": hash("abc")}))
mode = sys.argv[1] if len(sys.argv) > 1 else ""
if mode == "raise":
    raise ValueError("from the probe")
if mode == "exit":
    print("to stderr", file=sys.stderr)
    sys.exit(3)
if mode == "kill":
    os.kill(os.getpid(), 9)
if mode == "sleep":
    import time; time.sleep(60)
"""


def fresh(*argv, env=None, cwd=REPO) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *map(str, argv)], cwd=cwd, env=env or cli_env(), capture_output=True, text=True,
                          timeout=120)


@pytest.fixture
def probe(tmp_path):
    pkg = tmp_path / "probe_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "__main__.py").write_text(PROBE)
    return tmp_path


@pytest.mark.parametrize("mode", ["", "raise", "exit", "kill"])
def test_a_forked_module_run_is_a_fresh_interpreters_run(probe, mode):
    import json

    env = cli_env(PROBE="x")
    got = run_module("probe_pkg", mode, env=env, cwd=probe)
    want = fresh("-m", "probe_pkg", mode, env=env, cwd=probe)
    assert got.returncode == want.returncode == {"": 0, "raise": 1, "exit": 3, "kill": -signal.SIGKILL}[mode]
    g, w = json.loads(got.stdout.splitlines()[0]), json.loads(want.stdout.splitlines()[0])
    assert g["pid"] != os.getpid() and g["pid"] != w["pid"]
    # a fresh interpreter draws its own hash seed; the server's child has the preloaded modules
    assert g["dynamo"] and not w["dynamo"]
    differ = ("pid", "hash", "dynamo")
    assert {k: v for k, v in g.items() if k not in differ} == {k: v for k, v in w.items() if k not in differ}
    if mode == "raise":
        assert got.stderr.splitlines()[-1] == want.stderr.splitlines()[-1] == "ValueError: from the probe"
        assert "Traceback (most recent call last)" in got.stderr
    else:
        assert got.stderr == want.stderr


def test_growtrains_own_output_is_the_fresh_interpreters(micro_recipe):
    recipe = micro_recipe()
    got = run_module("growtrain", "validate", recipe)
    want = fresh("-m", "growtrain", "validate", recipe)
    assert got.returncode == want.returncode == 0
    assert got.stdout == want.stdout and got.stderr == want.stderr


def test_a_request_that_torch_could_read_at_import_runs_fresh_and_a_timeout_kills_the_child(probe):
    import json

    env = cli_env(PYTHONHASHSEED="7")
    with pytest.warns(UserWarning, match="PYTHONHASHSEED"):  # the suite says that a request ran fresh
        changed = run_module("probe_pkg", env=env, cwd=probe)
    want = fresh("-m", "probe_pkg", env=env, cwd=probe)
    assert changed.returncode == 0
    assert json.loads(changed.stdout)["hash"] == json.loads(want.stdout)["hash"], "PYTHONHASHSEED was not applied"
    slow = None
    with pytest.raises(subprocess.TimeoutExpired) as timed_out:
        slow = run_module("probe_pkg", "sleep", cwd=probe, timeout=3)
    assert slow is None
    pid = json.loads(timed_out.value.output.splitlines()[0])["pid"]
    with pytest.raises(ProcessLookupError):  # killed and reaped by the server
        for _ in range(100):
            os.kill(pid, 0)
            time.sleep(0.05)


def test_a_variable_the_servers_imports_set_does_not_keep_a_request_from_the_server():
    from cli_forkserver import mismatch

    base, imported = {"OMP_NUM_THREADS": "1"}, {"TORCHINDUCTOR_CACHE_DIR": "/tmp/x"}
    assert mismatch({"OMP_NUM_THREADS": "1", "TORCHINDUCTOR_CACHE_DIR": "/tmp/x", "GROWTRAIN_FAULT": "a"}, base, imported) == []
    assert mismatch({"OMP_NUM_THREADS": "1", "TORCHINDUCTOR_CACHE_DIR": "/tmp/y"}, base, imported) == ["TORCHINDUCTOR_CACHE_DIR"]
    assert mismatch({"OMP_NUM_THREADS": "2"}, base, imported) == ["OMP_NUM_THREADS"]
    assert mismatch({}, base, imported) == ["OMP_NUM_THREADS"]


def test_torchruns_ranks_start_from_the_group_server_and_a_killed_rank_fails_the_launch(tmp_path):
    import json

    import torch._dynamo  # noqa: F401  (as a test process may have: it sets TORCHINDUCTOR_CACHE_DIR)

    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    ok = run_module("torch.distributed.run", "--standalone", "--nproc-per-node", 2, script, "")
    assert ok.returncode == 0, ok.stderr[-2000:]
    ranks = sorted((json.loads(line) for line in ok.stdout.splitlines() if line.startswith("{")), key=lambda r: r["rank"])
    assert [r["rank"] for r in ranks] == ["0", "1"]
    # forked from the server that imported torch._dynamo (a fresh rank would not have it at start)
    assert all(r["dynamo"] and r["argv"] == [str(script), ""] and r["path0"] == str(tmp_path) for r in ranks), json.dumps([(r["dynamo"], r["argv"], r["path0"]) for r in ranks]) + ok.stderr[-1500:]
    killed = run_module("torch.distributed.run", "--standalone", "--nproc-per-node", 2, script, "kill")
    assert killed.returncode != 0
    assert "Signal 9 (SIGKILL)" in killed.stderr, killed.stderr[-2000:]
