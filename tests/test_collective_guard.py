"""growtrain.parallel.collective_guard in this process (no process group: a call the guard lets through
reaches torch, which then says the group is not initialized). The two-process gloo run that
proves it refuses wrong calls on every rank is in tests/test_expert_parallel.py."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from conftest import REPO
from growtrain.parallel import collective_guard as guard
from growtrain.optim.adamw import ParamState


@pytest.fixture
def guarded():
    guard.install("cpu")
    try:
        yield
    finally:
        guard.uninstall()


def test_the_guard_wraps_nothing_unless_the_environment_asks(monkeypatch):
    original = dist.all_reduce
    monkeypatch.delenv(guard.ENV, raising=False)
    assert not guard.install_from_env("cpu")
    assert dist.all_reduce is original and not guard.installed()
    monkeypatch.setenv(guard.ENV, "1")
    try:
        assert guard.install_from_env("cpu")
        assert dist.all_reduce is not original and dist.distributed_c10d.all_reduce is dist.all_reduce
    finally:
        guard.uninstall()
    assert dist.all_reduce is original and dist.distributed_c10d.all_reduce is original


def test_a_tensor_off_the_group_device_is_refused_before_torch_sees_the_call(guarded):
    with pytest.raises(guard.CollectiveRuleError, match=r"all_reduce: argument tensor is on meta, but .* on cpu only"):
        dist.all_reduce(torch.zeros(2, device="meta"))
    with pytest.raises(guard.CollectiveRuleError, match=r"all_gather: argument tensor_list\[0\] is on meta,.*mixes tensors on cpu, meta"):
        dist.all_gather([torch.empty(2, device="meta"), torch.empty(2)], torch.zeros(2))
    # On the right device the call goes through to torch (which has no process group here).
    with pytest.raises(ValueError, match="not been initialized") as exc:
        dist.all_reduce(torch.zeros(2))
    assert not isinstance(exc.value, guard.CollectiveRuleError)


def test_a_group_of_its_own_has_its_own_device_and_only_in_refuses_every_other_group(guarded):
    """Growth on the host: its gloo group takes CPU tensors while the default group (NCCL on the
    node) takes CUDA ones; inside only_in(that group) a call in the default group is refused."""
    host_group, other = object(), object()  # stand-ins: the guard refuses before torch sees them
    guard.register_group(host_group, "meta")  # "meta": a device the default group (cpu here) is not
    with pytest.raises(guard.CollectiveRuleError, match=r"all_reduce: argument tensor is on cpu, but .* on meta only"):
        dist.all_reduce(torch.zeros(2), group=host_group)
    with pytest.raises(guard.CollectiveRuleError, match=r"broadcast: argument tensor is on meta, but .* on cpu only"):
        dist.broadcast(torch.zeros(2, device="meta"), src=0)  # the default group keeps its device
    with guard.only_in(host_group):
        with pytest.raises(guard.CollectiveRuleError, match="all_reduce runs in the default process group while growth runs on the host"):
            dist.all_reduce(torch.zeros(2))
        with pytest.raises(guard.CollectiveRuleError, match="all_gather_object runs in another process group"):
            dist.all_gather_object([None, None], "a path", group=other)
    with pytest.raises(ValueError, match="not been initialized"):  # outside it, the default group is fine again
        dist.all_reduce(torch.zeros(2))


def test_a_tensor_inside_an_object_collective_is_refused_with_its_path(guarded):
    state = {"w": ParamState(3, torch.zeros(2), torch.zeros(2))}
    with pytest.raises(guard.CollectiveRuleError, match=r"all_gather_object: argument obj\['w'\]\.exp_avg is a tensor"):
        dist.all_gather_object([None, None], state)
    with pytest.raises(ValueError, match="not been initialized"):
        dist.broadcast_object_list(["a path", {"shape": (2, 3), "dtype": torch.float32}], src=0)


class Opaque:
    """No __dict__ to walk: a tensor in it is found by pickling it, as the collective would."""

    __slots__ = ("t",)

    def __init__(self, t):
        self.t = t

    def __reduce__(self):
        return (Opaque, (self.t,))


def test_find_tensor_sees_through_containers_dataclasses_and_pickling():
    assert guard.find_tensor({"a": [1, (2.0, {"b": torch.ones(1)})]}) == "obj['a'][1][1]['b']"
    assert guard.find_tensor(ParamState(1, torch.ones(1), torch.ones(1)), "s") == "s.exp_avg"
    assert guard.find_tensor([Opaque(torch.ones(1))]) == "something inside obj"
    assert guard.find_tensor({"path": "/tmp/x", "shape": torch.Size([2]), "dtype": torch.bfloat16, "n": None}) is None


def test_the_collective_code_builds_every_tensor_on_an_explicit_device():
    for path in ("growtrain/parallel/distributed.py", "growtrain/model/expert_parallel.py", "growtrain/model/af.py", "growtrain/parallel/collective_guard.py"):
        assert guard.factory_calls_without_device((REPO / path).read_text()) == [], path


def test_the_source_check_flags_default_device_and_host_tensors():
    # sync_grads' old shape: gradients (on the model's device) next to flags made on the default one.
    bad = (
        "flat = torch.cat([g.reshape(-1) for g in grads] + [torch.tensor(flags)])\n"
        "parts = [t.cpu() for t in parts]\n"
        "buf = torch.empty(3, device='cpu')\n"
        "x = y.to('cpu')\n"
    )
    assert guard.factory_calls_without_device(bad) == [
        "line 1: torch.tensor(...) without device=",
        "line 2: .cpu()",
        "line 3: a tensor put on the cpu explicitly",
        "line 4: a tensor put on the cpu explicitly",
    ]
    good = "buf = torch.empty(3, device=self.device)\nout = x.new_empty((n, d))\nz = torch.zeros_like(p)\n"
    assert guard.factory_calls_without_device(good) == []
