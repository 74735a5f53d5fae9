"""Grouped SwiGLU expert GEMM (kernels/grouped.py) against the pure-PyTorch references, forward and
backward: dense trainable experts, NF4 bases with fused LoRA, odd sizes, empty experts, all rows on
one expert, fewer rows than a block, top-1/2/8 routing. fp32 in the interpreter (its tl.dot is
wrong on bf16); bf16 on a GPU behind the `gpu` marker."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch
from kernel_testing import assert_close, assert_equal, needs_cuda, require_triton

require_triton()

from growtrain.kernels import backend
from growtrain.kernels.grouped import MODE_PLAIN, grouped_swiglu, launch_grouped_mm, operand_args
from growtrain.kernels.nf4 import dequantize_nf4_experts
from growtrain.kernels.reference import grouped_swiglu_lora_reference, grouped_swiglu_reference
from growtrain.kernels.weights import LoRA, NF4Weight

# D and F are not multiples of the interpreter's 32-wide tiles; r is not a multiple of 16.
D, F, R = 40, 24, 3
FP32 = {"atol": 1e-5, "rtol": 1e-5}
BF16 = {"atol": 1e-2, "rtol": 3e-2}


def _counts_from_routing(tokens: int, experts: int, top_k: int, gen: torch.Generator) -> list[int]:
    idx_TK = torch.rand(tokens, experts, generator=gen).topk(top_k, dim=1).indices
    return torch.bincount(idx_TK.reshape(-1), minlength=experts).tolist()


def _routing_case(name: str) -> list[int]:
    """Rows per expert for a named case."""
    gen = torch.Generator().manual_seed(sum(map(ord, name)))
    return {
        "top1": lambda: _counts_from_routing(29, 4, 1, gen),
        "top2": lambda: _counts_from_routing(19, 5, 2, gen),
        "top8": lambda: _counts_from_routing(5, 8, 8, gen),
        "empty_experts": lambda: [0, 19, 0, 0, 4, 0],
        "all_on_one_expert": lambda: [0, 0, 37, 0],
        "fewer_rows_than_a_block": lambda: [3, 0, 2],
        "no_rows": lambda: [0, 0, 0],
    }[name]()


CASES = ["top1", "top2", "top8", "empty_experts", "all_on_one_expert", "fewer_rows_than_a_block", "no_rows"]


def _offsets(counts: list[int], device="cpu") -> torch.Tensor:
    off = torch.zeros(len(counts) + 1, dtype=torch.int64)
    off[1:] = torch.cumsum(torch.tensor(counts), 0)
    return off.to(device)


def _randn(*shape, gen, scale=0.3, device="cpu", dtype=torch.float32, grad=True):
    t = (torch.randn(*shape, generator=gen) * scale).to(device, dtype)
    return t.requires_grad_(grad)


def _lora(E, d_out, d_in, gen, scale, device="cpu", rank=R):
    # B non-zero (a trained adapter), so every LoRA gradient path carries signal.
    return LoRA(_randn(E, rank, d_in, gen=gen, device=device), _randn(E, d_out, rank, gen=gen, device=device), scale)


def _grads(y, dy, tensors):
    for t in tensors:
        t.grad = None
    y.backward(dy)
    return [t.grad for t in tensors]


def _compare(got_y, want_y, got_grads, want_grads, names, tol):
    assert_close("y", got_y.detach(), want_y.detach(), **tol)
    for name, g, w in zip(names, got_grads, want_grads):
        assert g is not None, f"{name}: no gradient"
        assert_close(f"grad {name}", g, w, **tol)


@pytest.mark.parametrize("case", CASES)
def test_dense_experts_forward_and_backward_match_the_reference(case):
    counts = _routing_case(case)
    E, N = len(counts), sum(counts)
    gen = torch.Generator().manual_seed(1)
    x = _randn(N, D, gen=gen, scale=1.0)
    w = [_randn(E, F, D, gen=gen), _randn(E, F, D, gen=gen), _randn(E, D, F, gen=gen)]
    off = _offsets(counts)
    dy = torch.randn(N, D, generator=gen)
    leaves = [x, *w]
    y = grouped_swiglu(x, off, w)
    got = _grads(y, dy, leaves)
    y_ref = grouped_swiglu_reference(x, off, *w)
    want = [g if g is not None else torch.zeros_like(t) for g, t in zip(_grads(y_ref, dy, leaves), leaves)]
    _compare(y, y_ref, got, want, ["x", "w_gate", "w_up", "w_down"], FP32)


def _nf4_experts(E, gen):
    """Gate double-quantized, up plain, down stored transposed ([F, D]) and double-quantized."""
    wg, wu, wd = (torch.randn(E, F, D, generator=gen), torch.randn(E, F, D, generator=gen), torch.randn(E, D, F, generator=gen))
    return (
        NF4Weight.quantize(wg * 0.3, compress_statistics=True),
        NF4Weight.quantize(wu * 0.3),
        NF4Weight.quantize((wd * 0.3).transpose(1, 2).contiguous(), compress_statistics=True, transposed=True),
    )


@pytest.mark.parametrize("case", CASES)
def test_nf4_experts_with_fused_lora_forward_and_backward_match_the_reference(case):
    counts = _routing_case(case)
    E, N = len(counts), sum(counts)
    gen = torch.Generator().manual_seed(2)
    weights = _nf4_experts(E, gen)
    lora = (_lora(E, F, D, gen, 0.5), _lora(E, F, D, gen, 2.0), _lora(E, D, F, gen, 0.25))
    x = _randn(N, D, gen=gen, scale=1.0)
    off = _offsets(counts)
    dy = torch.randn(N, D, generator=gen)
    leaves = [x] + [t for lo in lora for t in (lo.A_ERI, lo.B_EOR)]
    y = grouped_swiglu(x, off, weights, lora)
    got = _grads(y, dy, leaves)
    y_ref = grouped_swiglu_lora_reference(x, off, weights, lora)
    want = [g if g is not None else torch.zeros_like(t) for g, t in zip(_grads(y_ref, dy, leaves), leaves)]
    names = ["x"] + [f"{m}_{ab}" for m in ("gate", "up", "down") for ab in ("A", "B")]
    _compare(y, y_ref, got, want, names, FP32)


def test_lora_gradients_without_an_input_gradient_and_on_some_matrices_only():
    counts = _routing_case("top2")
    E, N = len(counts), sum(counts)
    gen = torch.Generator().manual_seed(3)
    w = [_randn(E, F, D, gen=gen, grad=False), _randn(E, F, D, gen=gen, grad=False), _randn(E, D, F, gen=gen, grad=False)]
    lora = (None, _lora(E, F, D, gen, 1.5), _lora(E, D, F, gen, 0.5))
    x = _randn(N, D, gen=gen, scale=1.0, grad=False)
    off = _offsets(counts)
    dy = torch.randn(N, D, generator=gen)
    leaves = [t for lo in lora if lo is not None for t in (lo.A_ERI, lo.B_EOR)]
    y = grouped_swiglu(x, off, w, lora)
    got = _grads(y, dy, leaves)
    y_ref = grouped_swiglu_lora_reference(x, off, w, lora)
    _compare(y, y_ref, got, _grads(y_ref, dy, leaves), ["up_A", "up_B", "down_A", "down_B"], FP32)


def test_nf4_fused_projection_equals_dense_kernel_on_dequantized_weights_bit_for_bit():
    counts = _routing_case("top2")
    E, N = len(counts), sum(counts)
    gen = torch.Generator().manual_seed(4)
    w_nf4 = NF4Weight.quantize(torch.randn(E, F, D, generator=gen), compress_statistics=True)
    x = torch.randn(N, D, generator=gen)
    off = _offsets(counts)
    fused, dense = torch.empty(N, F), torch.empty(N, F)
    launch_grouped_mm(MODE_PLAIN, off, fused, operand_args(x, w_nf4, True, None, None))
    launch_grouped_mm(MODE_PLAIN, off, dense, operand_args(x, dequantize_nf4_experts(w_nf4), True, None, None))
    assert_equal("NF4-fused vs dequantize-then-matmul", fused, dense)


def test_nf4_decoded_in_the_kernel_or_dequantized_first_gives_the_same_bits_forward_and_backward():
    # A GPU dequantizes first (resolve_nf4_decode); the interpreter decodes in the kernel. Both read
    # the values nf4_values gives, so outputs and every gradient agree bit for bit.
    from growtrain.kernels.grouped import resolve_nf4_decode

    assert resolve_nf4_decode("auto", torch.device("cuda")) == "dequantize"
    assert resolve_nf4_decode("auto", torch.device("cpu")) == "fused"
    with pytest.raises(ValueError, match="fused, dequantize"):
        resolve_nf4_decode("sometimes", torch.device("cpu"))
    counts = _routing_case("top2")
    E, N = len(counts), sum(counts)
    results = []
    for decode in ("fused", "dequantize"):
        gen = torch.Generator().manual_seed(6)
        weights = _nf4_experts(E, gen)
        lora = (_lora(E, F, D, gen, 0.5), None, _lora(E, D, F, gen, 0.25))
        x = _randn(N, D, gen=gen, scale=1.0)
        dy = torch.randn(N, D, generator=gen)
        leaves = [x] + [t for lo in lora if lo is not None for t in (lo.A_ERI, lo.B_EOR)]
        y = grouped_swiglu(x, _offsets(counts), weights, lora, nf4_decode=decode)
        results.append([y.detach()] + _grads(y, dy, leaves))
    for name, a, b in zip(["y", "x", "gate A", "gate B", "down A", "down B"], *results):
        assert_equal(f"{name}: fused vs dequantized first", a, b)


@pytest.mark.parametrize("fold, keep", [("off", True), ("off", False), ("on", True), ("on", False)], ids=["kept", "dequantized_again", "folded", "folded_dequantized_again"])
@pytest.mark.parametrize("fmt, r", [("dense", 0), ("nf4_lora", 4), ("nf4_lora", 3)], ids=["dense", "nf4_lora", "nf4_lora_rank_padded"])
def test_torch_grouped_mm_route_matches_the_reference_forward_and_backward(fmt, r, fold, keep):
    # The route a Hopper GPU takes in bf16 (resolve_gemm), run here on the CPU in fp32, where
    # torch._grouped_mm is a loop of matmuls: the same math, orientation and gradients. D and F are
    # multiples of 16 bytes, as the op requires; a rank of 3 (12 bytes) is zero-padded to 4 by the
    # route, and its adapters' gradients come back at rank 3; expert 1 has no rows. Folded: the
    # gate and up products and their A factors stacked into one product each way
    # (grouped_torch.forward_folded); kept or not: the forward's dequantized bases reused by the
    # backward or dequantized again.
    from growtrain.kernels.grouped import resolve_gemm
    from growtrain.kernels.grouped_torch import padded_rank

    counts = [5, 0, 9, 3]
    E, N, d, f = len(counts), sum(counts), 32, 16
    gen = torch.Generator().manual_seed(21)
    if fmt == "dense":
        w = [_randn(E, f, d, gen=gen), _randn(E, f, d, gen=gen), _randn(E, d, f, gen=gen)]
        lora = (None, None, None)
    else:
        w = (
            NF4Weight.quantize(torch.randn(E, f, d, generator=gen) * 0.3, compress_statistics=True),
            NF4Weight.quantize(torch.randn(E, f, d, generator=gen) * 0.3),
            NF4Weight.quantize(torch.randn(E, f, d, generator=gen) * 0.3, transposed=True),
        )
        lora = (_lora(E, f, d, gen, 0.5, rank=r), _lora(E, f, d, gen, 2.0, rank=r), _lora(E, d, f, gen, 0.25, rank=r))
    x = _randn(N, d, gen=gen, scale=1.0)
    dy = torch.randn(N, d, generator=gen)
    off = _offsets(counts)
    leaves = [x] + [t for t in w if isinstance(t, torch.Tensor)] + [t for lo in lora if lo is not None for t in (lo.A_ERI, lo.B_EOR)]
    y = grouped_swiglu(x, off, w, lora, gemm="torch", fold=fold, keep_dequantized=keep)
    got = _grads(y, dy, leaves)
    y_ref = grouped_swiglu_lora_reference(x, off, w, lora)
    want = [g if g is not None else torch.zeros_like(t) for g, t in zip(_grads(y_ref, dy, leaves), leaves)]
    _compare(y, y_ref, got, want, [f"leaf {i}" for i in range(len(leaves))], FP32)
    assert resolve_gemm("auto", x, [d, f], [x]) == "triton"  # the CPU keeps the Triton kernels unless asked
    assert resolve_gemm("torch", x, [d, f], [x]) == "torch"
    with pytest.raises(ValueError, match="multiples of 16 bytes"):
        resolve_gemm("torch", x, [d, 3], [x])
    with pytest.raises(ValueError, match="gemm must be one of"):
        resolve_gemm("cutlass", x, [d, f], [x])
    if fmt == "nf4_lora":
        with pytest.raises(ValueError, match="needs gemm='triton'"):
            grouped_swiglu(x, off, w, lora, gemm="torch", nf4_decode="fused")
    assert [padded_rank(k, torch.bfloat16) for k in (1, 4, 8, 9, 16)] == [8, 8, 8, 16, 16]
    assert [padded_rank(k, torch.float32) for k in (3, 4, 5)] == [4, 4, 8]


def test_shape_errors_name_every_problem():
    gen = torch.Generator().manual_seed(5)
    w = [torch.randn(3, F, D, generator=gen), torch.randn(3, F, D + 1, generator=gen), torch.randn(3, D, F, generator=gen)]
    with pytest.raises(ValueError) as err:
        grouped_swiglu(torch.randn(4, D), torch.tensor([0, 4, 4]), w)
    assert "up weight" in str(err.value) and "offsets must have E + 1 = 4" in str(err.value)


def test_triton_backend_runs_the_kernel_when_triton_can_run():
    counts = _routing_case("top1")
    gen = torch.Generator().manual_seed(6)
    E, N = len(counts), sum(counts)
    w = [torch.randn(E, F, D, generator=gen), torch.randn(E, F, D, generator=gen), torch.randn(E, D, F, generator=gen)]
    x, off = torch.randn(N, D, generator=gen), _offsets(counts)
    assert backend.triton_unavailable_reason(x.device) is None
    assert_close("backend", backend.triton_expert_backend(x, off, *w), grouped_swiglu_reference(x, off, *w), **FP32)


def test_triton_backend_logs_and_runs_the_reference_where_triton_cannot_run(monkeypatch, caplog):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(backend, "_reported", set())
    counts = _routing_case("top1")
    gen = torch.Generator().manual_seed(7)
    E, N = len(counts), sum(counts)
    w = [torch.randn(E, F, D, generator=gen), torch.randn(E, F, D, generator=gen), torch.randn(E, D, F, generator=gen)]
    x, off = torch.randn(N, D, generator=gen), _offsets(counts)
    with caplog.at_level(logging.WARNING, logger="growtrain.kernels"):
        y = backend.triton_expert_backend(x, off, *w)
        backend.triton_expert_backend(x, off, *w)
    messages = [r.getMessage() for r in caplog.records if r.name == "growtrain.kernels"]
    assert len(messages) == 1 and "TRITON_INTERPRET" in messages[0] and "reference" in messages[0], messages
    assert_equal("fallback", y, grouped_swiglu_reference(x, off, *w))


def test_nf4_backend_takes_growtrain_nf4_lora_experts():
    counts = _routing_case("empty_experts")
    E, N = len(counts), sum(counts)
    gen = torch.Generator().manual_seed(8)
    weights = _nf4_experts(E, gen)
    lora = (_lora(E, F, D, gen, 0.5), _lora(E, F, D, gen, 0.5), _lora(E, D, F, gen, 0.5))

    def stack(w):
        return SimpleNamespace(
            codes_EP=w.codes_EB, absmax_EA=w.absmax_EK, quant_map=w.code_16, rows=w.shape[0], cols=w.shape[1],
            nested_absmax_EM=w.nested_absmax_EJ, offset_E=w.offset_E, nested_quant_map=w.nested_code_256,
            blocksize=w.blocksize, nested_blocksize=w.nested_blocksize,
        )

    experts = SimpleNamespace(
        gate=stack(weights[0]), up=stack(weights[1]), down=stack(weights[2]),
        gate_lora=lora[0], up_lora=lora[1], down_lora=lora[2],
    )
    x, off = torch.randn(N, D, generator=gen), _offsets(counts)
    y = backend.triton_nf4_expert_backend(x, off, experts)
    assert_close("nf4 backend", y, grouped_swiglu_lora_reference(x, off, weights, lora), **FP32)


@pytest.mark.slow
def test_larger_top2_nf4_lora_case_matches_the_reference():
    gen = torch.Generator().manual_seed(9)
    counts = _counts_from_routing(48, 8, 2, gen)
    E, N = len(counts), sum(counts)
    weights = _nf4_experts(E, gen)
    lora = (_lora(E, F, D, gen, 0.5), _lora(E, F, D, gen, 0.5), _lora(E, D, F, gen, 0.5))
    x = _randn(N, D, gen=gen, scale=1.0)
    off = _offsets(counts)
    dy = torch.randn(N, D, generator=gen)
    leaves = [x] + [t for lo in lora for t in (lo.A_ERI, lo.B_EOR)]
    y = grouped_swiglu(x, off, weights, lora)
    got = _grads(y, dy, leaves)
    y_ref = grouped_swiglu_lora_reference(x, off, weights, lora)
    want = _grads(y_ref, dy, leaves)
    _compare(y, y_ref, got, want, ["x"] + [f"lora{i}" for i in range(6)], FP32)


# --- GPU: bf16 against an fp32 reference ------------------------------------------------------

GPU_SHAPES = [(8, [300, 0, 1, 517, 64, 0, 129, 33], 256, 384), (4, [0, 1000, 0, 0], 512, 256)]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("E,counts,d,f", GPU_SHAPES, ids=["mixed", "one_expert"])
@pytest.mark.parametrize("fmt", ["dense", "nf4_lora"])
@pytest.mark.parametrize("gemm", ["triton", "auto"])  # auto: torch._grouped_mm on Hopper
def test_bf16_forward_and_backward_match_the_fp32_reference_on_gpu(E, counts, d, f, fmt, gemm):
    gen = torch.Generator().manual_seed(10)
    dev = "cuda"
    N = sum(counts)
    off = _offsets(counts, dev)
    x32 = torch.randn(N, d, generator=gen).to(dev)
    dy32 = torch.randn(N, d, generator=gen).to(dev)
    if fmt == "dense":
        w32 = [torch.randn(E, f, d, generator=gen) * 0.05, torch.randn(E, f, d, generator=gen) * 0.05, torch.randn(E, d, f, generator=gen) * 0.05]
        w32 = [t.to(dev).requires_grad_(True) for t in w32]
        w16 = [t.detach().bfloat16().requires_grad_(True) for t in w32]
        lora32 = lora16 = None
    else:
        pytest.importorskip("bitsandbytes", reason="NF4 weights are quantized by bitsandbytes")
        w32 = w16 = [
            NF4Weight.quantize(torch.randn(E, f, d, generator=gen).to(dev) * 0.05, True),
            NF4Weight.quantize(torch.randn(E, f, d, generator=gen).to(dev) * 0.05),
            NF4Weight.quantize(torch.randn(E, f, d, generator=gen).to(dev) * 0.05, True, transposed=True),
        ]
        lora32 = [LoRA((torch.randn(E, 16, i, generator=gen) * 0.05).to(dev).requires_grad_(True), (torch.randn(E, o, 16, generator=gen) * 0.05).to(dev).requires_grad_(True), 2.0) for o, i in ((f, d), (f, d), (d, f))]
        lora16 = lora32
    x16 = x32.bfloat16().requires_grad_(True)
    x32.requires_grad_(True)
    y16 = grouped_swiglu(x16, off, w16, lora16, gemm=gemm)
    y16.backward(dy32.bfloat16())
    y32 = grouped_swiglu_lora_reference(x32, off, w32, lora32)
    assert_close("y bf16", y16.float(), y32.detach(), **BF16)
    grads16 = [x16.grad.float()]
    leaves32 = [x32]
    if fmt == "dense":
        grads16 += [t.grad.float() for t in w16]
        leaves32 += w32
    else:
        grads16 += [t.grad.clone() for lo in lora16 for t in (lo.A_ERI, lo.B_EOR)]
        leaves32 += [t for lo in lora32 for t in (lo.A_ERI, lo.B_EOR)]
    want = _grads(y32, dy32, leaves32)
    for i, (g, w) in enumerate(zip(grads16, want)):
        assert_close(f"grad {i} bf16", g, w, **BF16)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("gemm", ["triton", "auto", "torch+fold"])  # +fold: grouped_torch.forward_folded
def test_nf4_lora_at_the_120b_recipes_shapes_matches_the_fp32_reference_in_bf16(gemm):
    """The last stage's per-GPU expert work of recipes/120b.yaml: 32 local experts of D 4096, F 1024,
    LoRA r 16, ~64k token-slots routed unevenly (one expert empty), forward and backward in bf16
    against the fp32 reference."""
    pytest.importorskip("bitsandbytes", reason="NF4 weights are quantized by bitsandbytes")
    gen = torch.Generator().manual_seed(120)
    dev, E, d, f, r = "cuda", 32, 4096, 1024, 16
    share = torch.rand(E, generator=gen) + 0.2
    share[5] = 0.0
    counts = (share / share.sum() * 65536).long()
    counts[0] += 65536 - int(counts.sum())
    off = _offsets(counts.tolist(), dev)
    N = int(counts.sum())
    x32 = torch.randn(N, d, generator=gen).to(dev).requires_grad_(True)
    dy32 = torch.randn(N, d, generator=gen).to(dev)
    w = [
        NF4Weight.quantize(torch.randn(E, f, d, generator=gen).to(dev) * 0.02, True),
        NF4Weight.quantize(torch.randn(E, f, d, generator=gen).to(dev) * 0.02),
        NF4Weight.quantize(torch.randn(E, f, d, generator=gen).to(dev) * 0.02, True, transposed=True),  # holds down^T
    ]
    lora32 = [LoRA((torch.randn(E, r, i, generator=gen) * 0.02).to(dev).requires_grad_(True), (torch.randn(E, o, r, generator=gen) * 0.02).to(dev).requires_grad_(True), 2.0)
              for o, i in ((f, d), (f, d), (d, f))]
    lora16 = [LoRA(lo.A_ERI.detach().bfloat16().requires_grad_(True), lo.B_EOR.detach().bfloat16().requires_grad_(True), lo.scale) for lo in lora32]
    x16 = x32.detach().bfloat16().requires_grad_(True)
    gemm, _, fold = gemm.partition("+")
    if fold:
        from growtrain.kernels.grouped_torch import gemm_unavailable_reason

        reason = gemm_unavailable_reason(x16, [d, f], [])
        if reason is not None:
            pytest.skip(f"the folded route runs on torch._grouped_mm: {reason}")
    y16 = grouped_swiglu(x16, off, w, lora16, gemm=gemm, fold="on" if fold else "off")
    y16.backward(dy32.bfloat16())
    y32 = grouped_swiglu_lora_reference(x32, off, w, lora32)
    assert_close("y bf16", y16.float(), y32.detach(), **BF16)
    leaves32 = [x32] + [t for lo in lora32 for t in (lo.A_ERI, lo.B_EOR)]
    got = [x16.grad] + [t.grad for lo in lora16 for t in (lo.A_ERI, lo.B_EOR)]
    want = _grads(y32, dy32, leaves32)
    for name, g, w_ in zip(["x", "gate A", "gate B", "up A", "up B", "down A", "down B"], got, want):
        assert g is not None, f"{name}: no gradient"
        assert_close(f"grad {name} bf16", g.float(), w_, **BF16)


def test_a_launch_out_of_shared_memory_retries_smaller_and_remembers_the_fit():
    from triton.runtime.errors import OutOfResources

    from growtrain.kernels import grouped

    tried = []

    def launch(cfg):
        tried.append(cfg)
        if cfg.num_stages * cfg.block_k > 64:  # a GPU with room for at most 64 x 1 or 32 x 2
            raise OutOfResources(cfg.num_stages * cfg.block_k * 4096, 64 * 4096, "shared memory")

    start = grouped.TileConfig(128, 128, 64, 8, 3)
    key = ("test-device", object())
    got = grouped.launch_fitted("test_kernel", key, start, launch)
    assert (got.block_k, got.num_stages) == (64, 1) and [c.num_stages for c in tried] == [3, 2, 1]
    tried.clear()
    assert grouped.launch_fitted("test_kernel", key, start, launch) == got and tried == [got]  # remembered

    def never(cfg):
        raise OutOfResources(1, 0, "shared memory")

    with pytest.raises(OutOfResources):
        grouped.launch_fitted("test_kernel", ("other",), grouped.TileConfig(16, 16, 16, 1, 1), never)


def test_an_adapter_does_not_change_the_main_tiles_and_its_low_rank_product_is_given():
    # The adapter's X @ L1 runs before the launch (low_rank), so the reduction loop holds one dot
    # whatever the operand: with it inside the loop, 64-wide bf16 tiles read shared memory out of
    # bounds on an H200 (compute-sanitizer, Triton 3.6), and 32 x 2 stages was the only fix found.
    from growtrain.kernels.grouped import low_rank, tile_config

    cuda = torch.device("cuda")
    assert "lora" not in tile_config.__code__.co_varnames
    assert tile_config("low_rank", 4096, 8, cuda, n_out=32).block_n == 32
    gen = torch.Generator().manual_seed(9)
    E, N = 3, 10
    lo = _lora(E, F, D, gen, 0.5)
    w = _randn(E, F, D, gen=gen, grad=False)
    x = torch.randn(N, D, generator=gen)
    with pytest.raises(ValueError, match="low_rank"):
        operand_args(x, w, True, lo, None)
    (z,) = low_rank(x, _offsets([4, 0, 6]), [lo], True)
    want = torch.cat([x[:4] @ lo.A_ERI[0].T, x[4:] @ lo.A_ERI[2].T])
    assert_close("X @ A^T", z, want, atol=1e-5, rtol=1e-5)


def test_swiglu_elementwise_kernels_match_their_reference():
    # The torch._grouped_mm route's SwiGLU steps (kernels/swiglu.py), one pass each on a GPU; run
    # here through the interpreter on a length that is not a multiple of the block.
    from growtrain.kernels._swiglu_triton import launch_backward, launch_forward
    from growtrain.kernels.swiglu import swiglu_backward_reference, swiglu_forward_reference

    gen = torch.Generator().manual_seed(31)
    g, u, dh = (torch.randn(37, 29, generator=gen) * 3 for _ in range(3))
    assert_close("h", launch_forward(g, u, 256), swiglu_forward_reference(g, u), **FP32)
    got, want = launch_backward(dh, g, u, True, 256), swiglu_backward_reference(dh, g, u, True)
    for name, a, b in zip(("dg", "du", "h"), got, want):
        assert_close(name, a, b, **FP32)
    assert launch_backward(dh, g, u, False, 256)[2] is None


def test_the_dequantized_bases_are_kept_for_the_backward_or_dequantized_again(monkeypatch):
    # keep_dequantized: the forward's copies serve the input gradient (one dequantization per
    # matrix per forward + backward, as the reference backend and the plan count it); without it
    # the backward dequantizes every base again. Same values either way (bit for bit).
    from growtrain.kernels import grouped

    calls = []
    real = grouped.dequantize_nf4_experts

    def counted(w, dtype=torch.float32, out=None):
        calls.append(w.shape)
        return real(w, dtype, out=out)

    monkeypatch.setattr(grouped, "dequantize_nf4_experts", counted)
    counts = [4, 0, 7]
    E, N, d, f = len(counts), sum(counts), 32, 16
    results = {}
    for gemm, fold in (("triton", "off"), ("torch", "off"), ("torch", "on")):
        for keep in (True, False):
            gen = torch.Generator().manual_seed(5)
            w = tuple(NF4Weight.quantize(torch.randn(E, f, d, generator=gen) * 0.3, transposed=t) for t in (False, False, True))
            lora = tuple(_lora(E, o, i, gen, 0.5, rank=4) for o, i in ((f, d), (f, d), (d, f)))
            x = _randn(N, d, gen=gen, scale=1.0)
            calls.clear()
            y = grouped_swiglu(x, _offsets(counts), w, lora, gemm=gemm, nf4_decode="dequantize", fold=fold, keep_dequantized=keep)
            grads = _grads(y, torch.ones_like(y), [x] + [t for lo in lora for t in (lo.A_ERI, lo.B_EOR)])
            assert len(calls) == (3 if keep else 6), f"{gemm} fold {fold} keep {keep}: {len(calls)} dequantizations"
            results.setdefault((gemm, fold), []).append([y.detach(), *grads])
    for route, (kept, again) in results.items():
        for i, (a, b) in enumerate(zip(kept, again)):
            assert_equal(f"{route} output/gradient {i}: kept vs dequantized again", a, b)
    x = torch.randn(3, d)
    with pytest.raises(ValueError, match="fold='on' needs"):
        grouped_swiglu(x, _offsets([3, 0, 0]), w, lora, gemm="triton", fold="on")
    with pytest.raises(ValueError, match="fold must be one of"):
        grouped_swiglu(x, _offsets([3, 0, 0]), w, lora, fold="sometimes")


def test_dequantizing_into_a_slice_of_a_stack_gives_the_same_values():
    gen = torch.Generator().manual_seed(8)
    w = NF4Weight.quantize(torch.randn(3, 16, 32, generator=gen), compress_statistics=True)
    stack = torch.full((3, 40, 32), 7.0)
    got = dequantize_nf4_experts(w, torch.float32, out=stack[:, 8:24])
    assert got.data_ptr() == stack[:, 8:24].data_ptr()
    assert_equal("slice", stack[:, 8:24], dequantize_nf4_experts(w))
    assert bool((stack[:, :8] == 7).all() and (stack[:, 24:] == 7).all()), "rows outside the slice were written"
    with pytest.raises(ValueError, match="each expert contiguous"):
        dequantize_nf4_experts(w, torch.float32, out=torch.empty(3, 32, 16).transpose(1, 2))


def test_swiglu_kernels_read_and_write_column_slices_of_a_wider_tensor():
    # The folded route hands g and u as column slices of [g | u | zg | zu] and takes dg, du into
    # the input gradient's stacked operand: the same values as contiguous copies.
    from growtrain.kernels._swiglu_triton import launch_backward, launch_forward
    from growtrain.kernels.swiglu import swiglu_backward_reference, swiglu_forward_reference

    gen = torch.Generator().manual_seed(32)
    gu = torch.randn(37, 70, generator=gen) * 3
    g, u, dh = gu[:, :29], gu[:, 29:58], torch.randn(37, 29, generator=gen)
    assert_close("h", launch_forward(g, u, 256), swiglu_forward_reference(g.contiguous(), u.contiguous()), **FP32)
    stacked = torch.zeros(37, 64)
    out = (stacked[:, :29], stacked[:, 29:58])
    got = launch_backward(dh, g, u, True, 256, out=out)
    want = swiglu_backward_reference(dh, g.contiguous(), u.contiguous(), True)
    assert got[0].data_ptr() == stacked.data_ptr()
    for name, a, b in zip(("dg", "du", "h"), got, want):
        assert_close(name, a, b, **FP32)
    assert bool((stacked[:, 58:] == 0).all())
