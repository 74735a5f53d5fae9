"""Shared set-up of the kernel tests: import this before any growtrain.kernels Triton module.

Without CUDA, Triton kernels run in the interpreter, which must be switched on before `@triton.jit`
decorates them; without Triton the kernel tests skip with the reason. `assert_close` prints where
and by how much two tensors differ."""

from __future__ import annotations

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

try:
    import triton  # noqa: F401

    TRITON_MISSING = None
except ImportError as exc:  # the CLI works without it; the kernel tests cannot
    TRITON_MISSING = f"triton is not importable ({exc}); install the 'test' extra"

needs_triton = pytest.mark.skipif(TRITON_MISSING is not None, reason=TRITON_MISSING or "triton missing")
# GPU-only tests carry both @pytest.mark.gpu (selection: `pytest -m gpu`) and this skip.
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")


def require_triton() -> None:
    """Module-level skip (call before importing the kernels)."""
    if TRITON_MISSING is not None:
        pytest.skip(TRITON_MISSING, allow_module_level=True)


def mismatch_report(name: str, got: torch.Tensor, want: torch.Tensor) -> str:
    if got.shape != want.shape:
        return f"{name}: shape {list(got.shape)} != expected {list(want.shape)}"
    if got.numel() == 0:
        return f"{name}: empty"
    diff = (got.double() - want.double()).abs()
    flat = int(diff.argmax())
    where = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), diff.shape))
    bad = int((got != want).sum())
    return (
        f"{name}: max abs error {diff.max().item():.3e} at {where} (got {got.reshape(-1)[flat].item():.6g}, "
        f"expected {want.reshape(-1)[flat].item():.6g}); {bad}/{got.numel()} elements differ; "
        f"max |expected| {want.double().abs().max().item():.3e}"
    )


def assert_close(name: str, got: torch.Tensor, want: torch.Tensor, atol: float, rtol: float) -> None:
    """|got - want| <= atol + rtol * max|want| everywhere (a scale-aware bound: matmul errors grow with
    the magnitude of the whole output, not of each element)."""
    assert got.shape == want.shape, mismatch_report(name, got, want)
    if got.numel() == 0:
        return
    scale = want.double().abs().max().item()
    err = (got.double() - want.double()).abs().max().item()
    assert err <= atol + rtol * scale, mismatch_report(name, got, want)


def assert_equal(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype, mismatch_report(name, got, want) + f" (dtypes {got.dtype}, {want.dtype})"
    same = (got == want) | (got.isnan() & want.isnan())
    assert bool(same.all()), mismatch_report(name, got, want)
