"""The `triton` expert backend as a run setting (train.expert_backend): same results as the reference where Triton runs
(here: its CPU interpreter), and a logged fallback — never a silent one — where it cannot."""

from __future__ import annotations

import contextlib

import pytest
import torch

from conftest import FORK_SERVER, cli_env, run_cli
from kernel_testing import require_triton

require_triton()

from growtrain.model import GrowLM  # noqa: E402
from growtrain.model.config import ModelConfig, MoEConfig  # noqa: E402


def _model(backend: str) -> GrowLM:
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=61, d_model=32, n_layers=2, n_heads=2, ffn_hidden=48, reversible=False,
                      moe=MoEConfig(num_experts=5, top_k=2, expert_hidden=24), moe_layers=(1,))
    model = GrowLM(cfg)
    model.set_expert_backend(backend)
    return model


def test_triton_backend_matches_the_reference_forward_and_backward(monkeypatch):
    import growtrain.kernels.grouped as grouped
    from growtrain.kernels.backend import triton_unavailable_reason

    # Where Triton cannot run (TRITON_INTERPRET=0 on a CPU), the 'triton' backend falls back to the
    # reference and this comparison would be the reference against itself: skip, saying why.
    device = "cuda" if torch.cuda.is_available() else "cpu"
    reason = triton_unavailable_reason(device)
    if reason is not None:
        pytest.skip(f"the Triton kernels cannot run on {device} tensors here: {reason}")
    launches = {"forward": 0, "wgrad": 0}
    real_launch, real_wgrad = grouped.launch_grouped_mm, grouped.grouped_wgrad

    def counted_launch(*args, **kwargs):
        launches["forward"] += 1
        return real_launch(*args, **kwargs)

    def counted_wgrad(*args, **kwargs):
        launches["wgrad"] += 1
        return real_wgrad(*args, **kwargs)

    monkeypatch.setattr(grouped, "launch_grouped_mm", counted_launch)
    monkeypatch.setattr(grouped, "grouped_wgrad", counted_wgrad)
    tokens = torch.randint(0, 61, (2, 9), device=device)
    results = {}
    for backend in ("reference", "triton"):
        model = _model(backend).to(device)
        out = model(tokens)
        (out.logits.square().mean() + out.aux_loss).backward()
        results[backend] = (out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
        if backend == "reference":
            assert launches == {"forward": 0, "wgrad": 0}, "the reference backend must not launch Triton kernels"
    assert launches["forward"] > 0 and launches["wgrad"] > 0, f"the Triton kernels never ran ({launches}): nothing was compared"
    ref_logits, ref_grads = results["reference"]
    tri_logits, tri_grads = results["triton"]
    torch.testing.assert_close(tri_logits, ref_logits, rtol=1e-5, atol=1e-5)
    for name, g in ref_grads.items():
        torch.testing.assert_close(tri_grads[name], g, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.slow
def test_a_run_on_the_triton_backend_where_triton_cannot_run_says_it_uses_the_reference(micro_recipe, tmp_path):
    grow = [{"op": "upcycle_moe", "num_experts": 4, "top_k": 2}]
    recipe = micro_recipe({"train": {"expert_backend": "triton"}, "stages": [
        {"name": "dense", "steps": 2, "seq_len": 16, "batch_size": 2},
        {"name": "moe", "steps": 2, "seq_len": 16, "batch_size": 2, "grow": grow},
    ]})
    env = {k: v for k, v in cli_env().items() if k != "TRITON_INTERPRET"}
    with pytest.warns(UserWarning, match="TRITON_INTERPRET") if FORK_SERVER else contextlib.nullcontext():  # a fresh interpreter
        done = run_cli("run", recipe, "--out", tmp_path / "run", env=env)
    assert done.returncode == 0, done.stderr
    assert "expert backend 'triton'" in done.stderr and "running the PyTorch reference instead" in done.stderr
    assert "products by the PyTorch reference (Triton cannot run here)" in done.stdout  # the start-up line says so too


def test_the_start_up_line_names_what_runs_the_expert_products(monkeypatch):
    from growtrain.kernels import backend, grouped_torch

    assert backend.triton_route("cpu", torch.float32) == "products by triton kernels (not a GPU), NF4 decoded inside the kernel"
    # a GPU as torch._grouped_mm sees it: Hopper in bf16 takes the library, anything it refuses the kernels
    monkeypatch.setattr(backend, "triton_unavailable_reason", lambda device: None)
    monkeypatch.setattr(grouped_torch, "gemm_unavailable_reason", lambda x, widths, tensors: None)
    monkeypatch.setattr(torch, "empty", lambda *a, **k: torch.zeros(0, dtype=k.get("dtype")))
    assert backend.triton_route("cuda", torch.bfloat16).startswith("products by torch._grouped_mm (bfloat16;")
    monkeypatch.setattr(grouped_torch, "gemm_unavailable_reason", lambda x, widths, tensors: "torch._grouped_mm runs bf16 on a GPU")
    assert backend.triton_route("cuda", torch.float32) == (
        "products by triton kernels (torch._grouped_mm runs bf16 on a GPU), NF4 bases dequantized first")
