"""Shared fixtures: a micro recipe (three stages, ~20 steps, a few seconds on CPU) and helpers to
run the CLI in a subprocess, the way a user does."""

from __future__ import annotations

import copy
import json
from contextlib import contextmanager
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

# Without CUDA the Triton kernels run in the interpreter, which must be on before anything imports
# triton (bitsandbytes does, at start-up): set it here, before any test module is collected.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Under pytest-xdist (`make test` runs two workers, one per core of the CI machine) every worker
# and every process it starts computes on one thread: two workers with two OpenMP threads each
# oversubscribe the cores and slow each other down by an order of magnitude.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)

REPO = Path(__file__).resolve().parents[1]

# Property tests (hypothesis): derandomized by default, so CI draws the same examples on every run
# (a red CI run is this change's doing, and it reproduces); `make explore` (HYPOTHESIS_PROFILE=explore)
# draws fresh ones, five times as many, and prints the seed of any failure to replay it.
EXPLORE_FACTOR = 5 if os.environ.get("HYPOTHESIS_PROFILE") == "explore" else 1
try:  # the GPU image may lack hypothesis (tests/test_kernels_combine.py)
    from hypothesis import settings as _hypothesis_settings
except ImportError:
    pass
else:
    _hypothesis_settings.register_profile("ci", derandomize=True, print_blob=True)
    _hypothesis_settings.register_profile("explore", derandomize=False, print_blob=True)
    _hypothesis_settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

MICRO = {
    "name": "micro",
    "seed": 3,
    "model": {"d_model": 32, "n_layers": 1, "n_heads": 2, "n_kv_heads": 1, "ffn_hidden": 64},
    "data": {"source": "builtin:pydoc_topics", "max_bytes": 120_000, "eval_fraction": 0.1},
    "optimizer": {"lr": 0.003},
    "train": {"log_every": 2, "eval_every": 6, "eval_batches": 1},
    "stages": [
        {"name": "dense", "steps": 8, "seq_len": 32, "batch_size": 4, "schedule": {"warmup_steps": 2}},
        {
            "name": "moe",
            "steps": 6,
            "seq_len": 32,
            "batch_size": 4,
            "grad_accum": 2,
            "grow": [{"op": "upcycle_moe", "num_experts": 4, "top_k": 2, "balance_bias_rate": 0.01}],
            "schedule": {"warmup_steps": 2, "kind": "wsd"},
        },
        {
            "name": "deep",
            "steps": 6,
            "seq_len": 48,
            "batch_size": 3,
            "grow": [{"op": "deepen", "after": [0]}],
            "schedule": {"warmup_steps": 1},
        },
    ],
    "checkpoint": {"every_steps": 4, "keep_last": 2},
    "invariance": {"probe_batch_size": 2, "probe_seq_len": 32},
    "tracking": {"wandb": {"mode": "disabled"}, "progress_bar": False},
}


@pytest.fixture
def micro_recipe(tmp_path):
    """Write the micro recipe (optionally changed) and return its path."""

    def write(changes: dict | None = None, name: str = "micro.yaml") -> Path:
        raw = copy.deepcopy(MICRO)
        _merge(raw, changes or {})
        path = tmp_path / name
        path.write_text(yaml.safe_dump(raw, sort_keys=False))
        return path

    return write


def _merge(base: dict, changes: dict) -> None:
    for k, v in changes.items():
        if isinstance(v, dict) and isinstance(base.get(k), dict):
            _merge(base[k], v)
        else:
            base[k] = v


# The slowest modules first (seconds of test time on 2 cores at this file's last change: 130 (one
# test), 154, 140, 137, 106, 83, 76, ... down to 14): xdist's loadfile hands modules out in collection
# order (make test: --no-loadscope-reorder), so the longest start first and the two workers end
# together. xdist's own order (most tests first) left test_gpu_checks_cpu's one test to the end, the
# other worker idle. Modules not listed follow in their own order.
SLOWEST_FIRST = ("test_gpu_checks_cpu", "test_sharded_growth", "test_expert_parallel", "test_af_training", "test_plan",
                 "test_user_defects", "test_residual", "test_optim8bit_layouts", "test_options_matrix", "test_prepared_data",
                 "test_false_failures", "test_growth_mutations", "test_export_hf", "test_docs", "test_growth_operators", "test_resume",
                 "test_gpu_step", "test_af", "test_fresh_params", "test_streaming", "test_kernels_grouped", "test_training")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))  # stable: a module's tests keep their order


def write_bpe_tokenizer(path: Path, text: str, vocab_size: int = 300) -> None:
    """A byte-level BPE tokenizer.json trained on `text` (a user's own tokenizer, as tests need one)."""
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token=None))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                             initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([text], trainer)
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))


# The environment pytest started with: a variable that something this process ran set later is not
# handed on (imports: torch._dynamo's TORCHINDUCTOR_CACHE_DIR, sklearn's KMP_DUPLICATE_LIB_OK, which
# lm_eval brings; growtrain.data.prepare's TOKENIZERS_PARALLELISM); the child's own imports set theirs.
# Handed on, one of them sent every later request of the worker to a fresh interpreter.
_STARTED_WITH = frozenset(os.environ)


def started_env() -> dict:
    """This process's environment, less what was added to it after pytest started."""
    return {k: v for k, v in os.environ.items() if k in _STARTED_WITH}


def cli_env(**extra) -> dict:
    env = {k: v for k, v in started_env().items() if not k.startswith(("WANDB_", "GROWTRAIN_"))}
    env.update({"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", "WANDB_SILENT": "true"})
    env.update(extra)
    return env


def run_cli(*args, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return run_module("growtrain", *args, env=env, timeout=timeout)


# The suite's processes start from fork servers (tests/cli_forkserver.py): `python -m growtrain`,
# torchrun and torchrun's ranks (tests/fork_rank.py) without importing torch afresh each time.
# GROWTRAIN_FRESH_INTERPRETERS=1 starts every one of them as a fresh interpreter instead.
FORK_SERVER = os.name == "posix" and os.environ.get("GROWTRAIN_FRESH_INTERPRETERS") != "1"
_servers: dict[str, tuple[subprocess.Popen, str]] = {}


def fork_server(kind: str) -> str | None:
    """The socket of this test process's fork server `kind` ("base" or "group"), started at its
    first use; None where there is none."""
    import tempfile
    import time

    if not FORK_SERVER:
        return None
    proc, path = _servers.get(kind, (None, ""))
    if proc is None or proc.poll() is not None:
        path = os.path.join(tempfile.mkdtemp(prefix="growtrain-fork-"), kind)
        # ranks get torchrun's environment, which sets OMP_NUM_THREADS=1 where it is not set
        env = cli_env() if kind == "base" else {**cli_env(), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        proc = subprocess.Popen([sys.executable, str(REPO / "tests" / "cli_forkserver.py"), path], cwd=REPO,
                                env=env, stdin=subprocess.PIPE)  # it ends when this process does
        _servers[kind] = (proc, path)
        deadline = time.monotonic() + 120
        while not os.path.exists(path):
            if proc.poll() is not None or time.monotonic() > deadline:
                return None
            time.sleep(0.02)
    return path


def pytest_unconfigure(config):
    """A fork server ends when its stdin closes: close it and reap the server (left to the test
    process's exit, each one was a ResourceWarning at the end of the run)."""
    for proc, _ in _servers.values():
        proc.stdin.close()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    _servers.clear()


def run_module(module: str, *args, env: dict | None = None, timeout: float = 300, cwd: Path = REPO) -> subprocess.CompletedProcess:
    """`python -m MODULE ARGS` as its own process, output captured as text (subprocess.run's
    CompletedProcess; TimeoutExpired after `timeout`), started by the fork server where it can be.
    For torchrun (`torch.distributed.run`) give `--no-python`-free args ending in `-m MODULE ...`
    or `SCRIPT ...`: its ranks start from the `group` server through tests/fork_rank.py."""
    env = dict(env or cli_env())
    args = [str(a) for a in args]
    if module == "torch.distributed.run" and (group := fork_server("group")):
        at = _torchrun_program(args)
        args = [*args[:at], str(REPO / "tests" / "fork_rank.py"), *args[at:]]
        env["GROWTRAIN_TEST_FORKSERVER"] = group
    return _run_python({"module": module, "args": args}, [sys.executable, "-m", module, *args], env, cwd, timeout)


def run_script(script: Path | str, *args, env: dict | None = None, timeout: float = 300, cwd: Path = REPO) -> subprocess.CompletedProcess:
    """`python SCRIPT ARGS`, as run_module runs a module; `python -c CODE ARGS` (script "-c") as a fresh
    interpreter (the fork servers run modules and script files only)."""
    args = [str(a) for a in args]
    if str(script) == "-c":
        return subprocess.run([sys.executable, "-c", *args], cwd=cwd, env=dict(env or cli_env()), capture_output=True, text=True,
                              timeout=timeout)
    return _run_python({"script": str(script), "args": args}, [sys.executable, str(script), *args], dict(env or cli_env()), cwd, timeout)


def _run_python(target: dict, cmd: list[str], env: dict, cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    import signal
    import tempfile

    def fresh() -> subprocess.CompletedProcess:
        return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)

    server = fork_server("base")
    if server is None:
        return fresh()
    from cli_forkserver import Replies, request

    with tempfile.TemporaryDirectory(prefix="cli-") as tmp:
        out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
        fds = [os.open(os.devnull, os.O_RDONLY), os.open(out, os.O_WRONLY | os.O_CREAT), os.open(err, os.O_WRONLY | os.O_CREAT)]
        try:
            conn = request(server, {**target, "cwd": str(cwd), "env": env, "unbuffered": False}, fds)
        except OSError:  # the server is gone: a fresh interpreter (the next request starts a new server)
            return fresh()
        finally:
            for fd in fds:
                os.close(fd)
        with conn:
            replies = Replies(conn)
            first = replies.next()
            if first.get("fallback"):
                _fell_back(first["fallback"])
                return fresh()
            done = replies.next(timeout)
            if done is None:
                os.kill(first["pid"], signal.SIGKILL)
                replies.next()
                raise subprocess.TimeoutExpired(cmd, timeout, out.read_text(errors="replace"), err.read_text(errors="replace"))
        return subprocess.CompletedProcess(cmd, os.waitstatus_to_exitcode(done["status"]), out.read_text(errors="replace"),
                                           err.read_text(errors="replace"))


def _fell_back(variables: list[str]) -> None:
    """A request the server answered with a fresh interpreter (its environment differs from the
    server's in `variables`): a warning, so that the suite's summary shows it. A variable the test
    process itself changed sends every later request of its worker to a fresh interpreter, seconds
    each (seen: +23% on the suite). A test that means to run fresh expects the warning."""
    import warnings

    warnings.warn(f"the fork server ran a fresh interpreter: the request's {', '.join(variables)} differ(s) from the server's",
                  stacklevel=3)


def _torchrun_program(args: list[str]) -> int:
    """Where the program starts in torchrun's arguments (its `-m` flag, or the script)."""
    i = 0
    while args[i] != "-m" and args[i].startswith("-"):
        i += 2 if args[i] in TORCHRUN_VALUED else 1
    return i


# torchrun's options that take a value (the program is the first argument that is neither an option nor one of these values)
TORCHRUN_VALUED = {"--nproc-per-node", "--nproc_per_node", "--nnodes", "--rdzv-backend", "--rdzv_backend", "--rdzv-endpoint",
                   "--rdzv_endpoint", "--master-port", "--master_port", "--monitor-interval", "--max-restarts", "--log-dir",
                   "--redirects", "--tee", "--node-rank", "--master-addr", "--rdzv-id", "--start-method", "--local-addr"}


def kill_and_resume(recipe: Path, out: Path, fault: str) -> subprocess.CompletedProcess:
    """Train `recipe` into `out` with GROWTRAIN_FAULT=fault (it must SIGKILL the run), then run the
    same command again; returns the resumed run (it must succeed and say it resumed)."""
    import signal

    killed = run_cli("run", recipe, "--out", out, env=cli_env(GROWTRAIN_FAULT=fault))
    assert killed.returncode == -signal.SIGKILL, f"the fault {fault} did not fire: {killed.stdout[-500:]}"
    resumed = run_cli("run", recipe, "--out", out)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout
    return resumed


def train_recipe(raw: dict, root: Path, name: str = "recipe") -> tuple[Path, Path, subprocess.CompletedProcess]:
    """Write `raw` to root/NAME.yaml and train it into root/run through the CLI (it must succeed).
    Returns (recipe path, run dir, the finished process)."""
    recipe = root / f"{name}.yaml"
    recipe.write_text(yaml.safe_dump(raw, sort_keys=False))
    out = root / "run"
    done = run_cli("run", recipe, "--out", out)
    assert done.returncode == 0, done.stderr[-3000:]
    return recipe, out, done


def growth_report(run_dir: Path) -> tuple[dict, list[tuple[str, bool, bool]]]:
    """`growtrain inspect --json` of a run, and its transitions as (operator, exact, passed)."""
    report = json.loads(run_cli("inspect", run_dir, "--json").stdout)
    return report, [(t["operator"], t["exact"], t["passed"]) for t in report["transitions"]]


def metrics_rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines() if line.strip()]


def losses(run_dir: Path) -> list[tuple[int, float, float | None]]:
    """(step, loss, eval_loss) per step from metrics.jsonl."""
    return [(r["step"], r["loss"], r.get("eval_loss")) for r in metrics_rows(run_dir)]


@contextmanager
def default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


@pytest.fixture
def fp64():
    """fp64 as the default dtype, not `.double()`: operators draw fresh weights (routers, fresh
    blocks) in the default dtype, and an fp32 router inside an fp64 model would hide fp64 errors."""
    with default_dtype(torch.float64):
        yield


def assert_same_run(run_dir: Path, reference: Path, steps: int) -> dict:
    """A resumed run equals the uninterrupted one: every step's losses, and the final weights bit
    for bit (dtype included). Returns the final state dict for further checks."""
    from safetensors.torch import load_file

    got, want = losses(run_dir), losses(reference)
    assert [s for s, *_ in got] == list(range(1, steps + 1)), "metrics.jsonl must read like one uninterrupted run"
    assert got == want, "resumed losses differ from the uninterrupted run's"
    counted = lambda d: [(r["tokens"], r["flops"]) for r in metrics_rows(d)]  # noqa: E731
    assert counted(run_dir) == counted(reference), "resumed tokens or counted FLOPs differ from the uninterrupted run's"
    final = f"checkpoints/step-{steps:08d}/model.safetensors"
    a, b = load_file(Path(run_dir) / final), load_file(Path(reference) / final)
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), f"final weight {name} differs"
    return a
