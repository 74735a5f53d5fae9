"""NCCL's rules for collectives, checked on any backend (DESIGN.md §15, "Collectives").

With GROWTRAIN_CHECK_COLLECTIVES=1 (the tests set it in every torchrun run), `install` wraps every
torch.distributed collective and point-to-point op, so that a call fails at once, on the calling
rank, before anything is sent, with a message naming the op, the argument, its device and the
expected one, when
- a tensor handed to it is not on the process group's device (`Dist.device`: cuda:LOCAL_RANK
  under NCCL, cpu under gloo). NCCL refuses any other device; gloo quietly takes CPU tensors, so
  without this check a CPU test passes code that fails on the node. Since every tensor of one call
  must equal that one device, a call that mixes devices fails too;
- an object handed to an *_object collective holds a tensor: it is pickled, which under NCCL is a
  device-to-host copy and a host sync on the sender, and the receiver unpickles it onto the
  sender's device (rank 0's GPU). Objects that are not tensors (a path, a layout) are fine;
- an *_object collective is told to stage its bytes on another `device=`;
- while growth runs on the host (`only_in(group)`, the trainer's gloo group under NCCL), a
  collective in any other group, the default one included: under NCCL the default group takes
  CUDA tensors, and the host holds none then. A group's own device is `register_group`'s
  (cpu for that gloo group), so the first rule checks its calls against that.

A CPU run cannot hold a CUDA tensor, so the first rule alone cannot see code that would put a
CPU-made tensor next to a CUDA one on the node: that part is `factory_calls_without_device`, a
source check that the collective code builds every tensor on an explicit device (tests run it on
growtrain/parallel/distributed.py and growtrain/model/expert_parallel.py).

Off (the default) nothing is wrapped: no cost at all.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import functools
import inspect
import os
import pickle
import sys

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

ENV = "GROWTRAIN_CHECK_COLLECTIVES"

# Ops whose arguments are tensors (or lists of them, or P2POps). Missing names (older torch) are skipped.
TENSOR_OPS = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_to_all",
    "all_to_all_single",
    "broadcast",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "gather",
    "scatter",
    "send",
    "recv",
    "isend",
    "irecv",
    "batch_isend_irecv",
)
# Ops that pickle objects: the arguments they pickle (outputs and placeholders are not checked).
OBJECT_OPS = {
    "all_gather_object": ("obj",),
    "broadcast_object_list": ("object_list",),
    "gather_object": ("obj",),
    "scatter_object_list": ("scatter_object_input_list",),
    "send_object_list": ("object_list",),
    "recv_object_list": (),
}

# torch.distributed re-exports distributed_c10d's functions: both names are wrapped, so that
# `dist.P2POp(dist.isend, ...)` passes c10d's own `op in [isend, irecv]` check and the internal calls
# of the object collectives (their staging tensors) are checked too.
_MODULES = (dist, c10d)
_originals: dict[str, object] = {}
_expected: torch.device | None = None  # the default group's device
_group_devices: dict[int, torch.device] = {}  # id(process group) -> its device, for the other groups
_only: list = []  # while growth runs on the host: the one group every collective must run in


class CollectiveRuleError(ValueError):
    """A collective was handed something NCCL would refuse. Not a RuntimeError: growtrain reads
    RuntimeErrors that mention gloo/NCCL as a dead peer (distributed.is_peer_failure)."""


def enabled_by_env() -> bool:
    return os.environ.get(ENV, "") not in ("", "0")


def installed() -> bool:
    return bool(_originals)


def expected_device() -> torch.device | None:
    return _expected


def install(device: torch.device | str) -> None:
    """Wrap the collectives; every tensor handed to one must be on `device` (the group's device)."""
    global _expected
    _expected = torch.device(device)
    if _originals:
        return
    for name in (*TENSOR_OPS, *OBJECT_OPS):
        original = getattr(c10d, name, None)
        if original is None:
            continue
        _originals[name] = original
        wrapper = _wrap(name, original)
        for module in _MODULES:
            if hasattr(module, name):
                setattr(module, name, wrapper)


def register_group(group, device: torch.device | str) -> None:
    """Collectives in `group` (not the default group) take tensors on `device`."""
    _group_devices[id(group)] = torch.device(device)


@contextlib.contextmanager
def only_in(group):
    """Inside, a collective in any group but `group` fails (when the checks are installed)."""
    _only.append(group)
    try:
        yield
    finally:
        _only.pop()


def _call_group(name: str, arguments: dict):
    """The process group a call runs in (None: the default group)."""
    if name == "batch_isend_irecv":
        groups = {id(op.group): op.group for op in arguments.get("p2p_op_list") or [] if isinstance(op, dist.P2POp)}
        group = next(iter(groups.values()), None) if len(groups) == 1 else None
    else:
        group = arguments.get("group")
    return None if group is None or group is dist.group.WORLD else group


def install_from_env(device: torch.device | str) -> bool:
    """`install(device)` if GROWTRAIN_CHECK_COLLECTIVES is set; says so on stderr, once per rank
    (the tests look for that line to know every rank ran checked)."""
    if not enabled_by_env():
        return False
    first = not installed()
    install(device)
    if first:
        rank = dist.get_rank() if dist.is_initialized() else 0
        print(f"[rank {rank}] collective checks on: every collective tensor on {_expected}, no tensor in an *_object collective", file=sys.stderr, flush=True)
    return True


def uninstall() -> None:
    global _expected
    for name, original in _originals.items():
        for module in _MODULES:
            if hasattr(module, name):
                setattr(module, name, original)
    _originals.clear()
    _group_devices.clear()
    _expected = None


def _wrap(name: str, original):
    signature = inspect.signature(original)
    objects = OBJECT_OPS.get(name)

    @functools.wraps(original)
    def checked(*args, **kwargs):
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError:
            return original(*args, **kwargs)  # let torch say what is wrong with the call itself
        group = _call_group(name, bound.arguments)
        if _only and group is not _only[-1]:
            raise CollectiveRuleError(
                f"{name} runs in {'the default' if group is None else 'another'} process group while growth runs on the host: "
                f"every collective of that growth must go through its gloo group (under NCCL the default group takes CUDA "
                f"tensors only, and the host holds them all then): pass the EP group's `group`"
            )
        expected = _expected if group is None else _group_devices.get(id(group), _expected)
        if objects is None:
            check_tensors(name, bound.arguments, expected)
        else:
            check_objects(name, {k: bound.arguments[k] for k in objects if k in bound.arguments}, expected)
            device = bound.arguments.get("device")
            if device is not None and torch.device(device) != expected:
                raise CollectiveRuleError(f"{name}: device={torch.device(device)}, but this process group's collectives run on {expected} (Dist.device)")
        return original(*args, **kwargs)

    return checked


def check_tensors(op: str, arguments: dict, expected: torch.device) -> None:
    """Every tensor in `arguments` (name → value: tensors, lists of them, P2POps) on `expected`."""
    found = [(where, t) for key, value in arguments.items() for where, t in _tensors(value, f"argument {key}")]
    wrong = [(where, t) for where, t in found if t.device != expected]
    if wrong:
        where, t = wrong[0]
        devices = sorted({str(t.device) for _, t in found})
        mixed = f" (this call mixes tensors on {', '.join(devices)})" if len(devices) > 1 else ""
        raise CollectiveRuleError(
            f"{op}: {where} is on {t.device}, but this process group's collectives take tensors on {expected} only{mixed}. "
            f"NCCL refuses a tensor on another device (gloo would take it, hiding the bug): build the buffer on Dist.device "
            f"or from the tensor it carries (new_empty, empty_like)"
        )


def check_objects(op: str, arguments: dict, expected: torch.device) -> None:
    """No tensor inside the objects an *_object collective pickles."""
    for key, value in arguments.items():
        where = find_tensor(value, f"argument {key}")
        if where is not None:
            raise CollectiveRuleError(
                f"{op}: {where} is a tensor: an *_object collective pickles it (under NCCL a device-to-host copy and sync, "
                f"and the receiver unpickles it onto the sender's device, not {expected}). Send tensors through tensor "
                f"collectives (broadcast, all_gather) on Dist.device, and only their layout (shape, dtype) as an object"
            )


def find_tensor(obj, where: str = "obj") -> str | None:
    """Where inside `obj` a tensor is (e.g. "obj['w'].exp_avg"), or None. Containers and dataclasses
    are walked for a readable path; anything else is probed by pickling it, as the collective will."""
    seen: set[int] = set()

    def walk(x, path):
        if isinstance(x, torch.Tensor):
            return path
        if isinstance(x, (str, bytes, int, float, bool, type(None), torch.dtype, torch.device, torch.Size)) or id(x) in seen:
            return None
        seen.add(id(x))
        if isinstance(x, dict):
            items = ((f"{path}[{k!r}]", v) for k, v in x.items())
        elif isinstance(x, (list, tuple)):
            items = ((f"{path}[{i}]", v) for i, v in enumerate(x))
        elif isinstance(x, (set, frozenset)):
            items = ((f"{path}{{…}}", v) for v in x)
        elif dataclasses.is_dataclass(x) and not isinstance(x, type):
            items = ((f"{path}.{f.name}", getattr(x, f.name)) for f in dataclasses.fields(x))
        elif hasattr(x, "__dict__") and not isinstance(x, type):
            items = ((f"{path}.{k}", v) for k, v in vars(x).items())
        else:
            items = ()
        for p, v in items:
            hit = walk(v, p)
            if hit is not None:
                return hit
        return None

    hit = walk(obj, where)
    if hit is None and _pickles_a_tensor(obj):
        hit = f"something inside {where}"
    return hit


class _FoundTensor(Exception):
    pass


class _TensorProbe(pickle.Pickler):
    def reducer_override(self, obj):
        if isinstance(obj, torch.Tensor):
            raise _FoundTensor
        return NotImplemented


class _Discard:
    def write(self, b):
        return len(b)


def _pickles_a_tensor(obj) -> bool:
    try:
        _TensorProbe(_Discard()).dump(obj)
    except _FoundTensor:
        return True
    except Exception:  # unpicklable: the collective itself will say so
        return False
    return False


def _tensors(value, where):
    if isinstance(value, torch.Tensor):
        yield where, value
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from _tensors(v, f"{where}[{i}]")
    elif isinstance(value, dist.P2POp):
        yield f"{where} ({value.op.__name__} {'from' if 'recv' in value.op.__name__ else 'to'} rank {value.peer})", value.tensor


# -- source check ---------------------------------------------------------------------------------

# torch functions that make a new tensor on the default device unless told otherwise.
FACTORIES = frozenset(
    "tensor as_tensor zeros ones empty full arange linspace eye rand randn randint randperm".split()
)


def factory_calls_without_device(source: str) -> list[str]:
    """Lines of `source` that build a tensor on the default device (a torch factory without
    `device=`) or move one to the host (`.cpu()`, `device="cpu"`, `.to("cpu")`): on the node, such a
    tensor next to the CUDA ones fails the collective it feeds. `*_like` and `new_*` inherit the
    device of the tensor they come from and pass."""
    problems = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        kwargs = {k.arg: k.value for k in node.keywords if k.arg}
        if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "torch" and f.attr in FACTORIES and "device" not in kwargs:
            problems.append((node.lineno, f"torch.{f.attr}(...) without device="))
        elif isinstance(f, ast.Attribute) and f.attr == "cpu" and not node.args:
            problems.append((node.lineno, ".cpu()"))
        elif _is_cpu_literal(kwargs.get("device")) or (isinstance(f, ast.Attribute) and f.attr == "to" and node.args and _is_cpu_literal(node.args[0])):
            problems.append((node.lineno, "a tensor put on the cpu explicitly"))
    return [f"line {n}: {what}" for n, what in sorted(problems)]


def _is_cpu_literal(node) -> bool:
    return isinstance(node, ast.Constant) and node.value == "cpu"
