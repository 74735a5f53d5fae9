"""Pure-PyTorch references for NF4 routed experts with per-expert LoRA: the NF4 weight format as
plain data, dequantization (through bitsandbytes, and a bit-compatible pure-PyTorch version that a
Triton kernel will be tested against), and the grouped SwiGLU over expert-sorted tokens whose base
matrices are NF4 and frozen and whose LoRA pairs train. Autograd flows through ordinary ops; only
the experts that received tokens are dequantized, one matrix at a time.

Format (bitsandbytes NF4, blocksize 64, optional double quantization of the absmax with nested
blocks of 256 around a per-matrix offset): every expert's matrix is quantized on its own, so
selecting experts never crosses a quantization block and is bit-exact. All three matrices are
stored with the expert hidden width F leading, [F, D] (the down-projection transposed), so that
neuron slices are row slices for every matrix.

Legend: N rows (token-slots, sorted by expert), D d_model, E experts, F expert hidden width,
E1 = E + 1 offsets, R LoRA rank, I/O a matrix's input/output width, P = rows*cols/2 packed bytes,
A absmax blocks (rows*cols/64), M nested absmax blocks (A/256, rounded up).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .reference import _GroupedSwiGLU, _Plan, _cast, _compute_dtypes, expert_bounds

NF4_BLOCKSIZE = 64
NESTED_BLOCKSIZE = 256  # what bitsandbytes' quantize_4bit(compress_statistics=True) uses


@dataclass(frozen=True)
class NF4Stack:
    """E matrices of shape [rows, cols], each NF4-quantized on its own (bitsandbytes layout)."""

    codes_EP: torch.Tensor  # uint8, two 4-bit codes per byte, first element in the high nibble
    absmax_EA: torch.Tensor  # uint8 with double quantization, else float32
    quant_map: torch.Tensor  # [16] float32: the NF4 code book
    rows: int
    cols: int
    nested_absmax_EM: torch.Tensor | None = None  # float32, double quantization only
    offset_E: torch.Tensor | None = None  # float32, double quantization only (mean absmax)
    nested_quant_map: torch.Tensor | None = None  # [256] float32 dynamic map, double quantization only
    blocksize: int = NF4_BLOCKSIZE
    nested_blocksize: int = NESTED_BLOCKSIZE

    @property
    def num_experts(self) -> int:
        return self.codes_EP.shape[0]

    @property
    def double_quant(self) -> bool:
        return self.nested_absmax_EM is not None


@dataclass(frozen=True)
class LoRAStack:
    """One LoRA pair per expert: delta W[e] = scale * B[e] @ A[e], W[e] of shape [O, I]."""

    A_ERI: torch.Tensor
    B_EOR: torch.Tensor
    scale: float


@dataclass(frozen=True)
class NF4LoRAExperts:
    """What an NF4 expert backend receives: the frozen bases and the trainable adapters. `down` is
    stored transposed ([F, D]); its LoRA pair is in the math orientation (A [E, R, F], B [E, D, R])."""

    gate: NF4Stack
    up: NF4Stack
    down: NF4Stack
    gate_lora: LoRAStack
    up_lora: LoRAStack
    down_lora: LoRAStack

    @property
    def num_experts(self) -> int:
        return self.gate.num_experts


Dequantize = Callable[[NF4Stack, list[int]], torch.Tensor]


_BNB = None


def _silence_bitsandbytes_start_up() -> None:
    # On CPUs with AVX512-bf16, bitsandbytes logs a warning at import when the optional
    # `kernels` package (a faster CPU 4-bit GEMV) is absent; the dequantize path does not use it.
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)


def bitsandbytes_functional():
    """bitsandbytes.functional, imported on first use (the import takes seconds)."""
    global _BNB
    if _BNB is None:
        _silence_bitsandbytes_start_up()
        import bitsandbytes.functional as bnbf

        _BNB = bnbf
    return _BNB


def quant_state(stack: NF4Stack, e: int, dtype: torch.dtype = torch.float32):
    """bitsandbytes' QuantState of expert e's matrix, rebuilt from the stored tensors (lossless).
    Its shape is the flat [rows * cols]: blocks run over the flat element index, and bitsandbytes'
    CPU dequantizer (0.50.2), given a 2-D shape whose rows are not a multiple of 64, restarts the
    blocks at every row, which disagrees with its own quantizer."""
    bnbf = bitsandbytes_functional()
    state2 = offset = None
    if stack.double_quant:
        state2 = bnbf.QuantState(
            absmax=stack.nested_absmax_EM[e].float(),
            code=stack.nested_quant_map.float(),
            blocksize=stack.nested_blocksize,
            dtype=torch.float32,
        )
        offset = stack.offset_E[e].float()
    return bnbf.QuantState(
        absmax=stack.absmax_EA[e] if stack.double_quant else stack.absmax_EA[e].float(),
        shape=torch.Size([stack.rows * stack.cols]),
        code=stack.quant_map.float(),
        blocksize=stack.blocksize,
        quant_type="nf4",
        dtype=dtype,
        offset=offset,
        state2=state2,
    )


def dequantize_nf4_bitsandbytes(stack: NF4Stack, e: int) -> torch.Tensor:
    """Expert e's [rows, cols] matrix in float32, dequantized by bitsandbytes (its QuantState as is)."""
    bnbf = bitsandbytes_functional()
    return bnbf.dequantize_4bit(stack.codes_EP[e].reshape(-1, 1), quant_state(stack, e)).view(stack.rows, stack.cols)


def _blockwise_scale(values_KN: torch.Tensor, scales_KB: torch.Tensor, blocksize: int) -> torch.Tensor:
    """values [K, N] times the scale of their block of `blocksize` (blocks restart at each row)."""
    K, n = values_KN.shape
    pad = (-n) % blocksize
    padded = F.pad(values_KN, (0, pad)).view(K, -1, blocksize)
    return (padded * scales_KB.view(K, -1, 1)).reshape(K, -1)[:, :n]


def absmax_values(stack: NF4Stack, experts_K: list[int]) -> torch.Tensor:
    """[K, A] float32 block scales of the listed experts, as bitsandbytes computes them
    (dequantize_blockwise, then + offset): map[q] * nested_absmax, then + offset, one fp32 rounding
    each (no fused multiply-add), so bit for bit the same."""
    idx = torch.as_tensor(experts_K, dtype=torch.long, device=stack.codes_EP.device)
    if not stack.double_quant:
        return stack.absmax_EA.index_select(0, idx).float()
    codes_KA = stack.absmax_EA.index_select(0, idx).long()
    nested_KM = stack.nested_absmax_EM.index_select(0, idx).float()
    absmax_KA = _blockwise_scale(stack.nested_quant_map.float()[codes_KA], nested_KM, stack.nested_blocksize)
    return absmax_KA + stack.offset_E.index_select(0, idx).float().view(-1, 1)


def dequantize_nf4_torch(stack: NF4Stack, e: int) -> torch.Tensor:
    """The same as `dequantize_nf4_bitsandbytes`, bit for bit, in plain PyTorch ops (the ground
    truth of a fused dequantizing kernel): absmax = dynamic_map[q] * nested_absmax + offset, then
    weight = nf4_map[code] * absmax, each one fp32 multiply as in bitsandbytes."""
    return dequantize_experts_torch(stack, [e])[0]


def dequantize_experts_torch(stack: NF4Stack, experts_K: list[int]) -> torch.Tensor:
    """[K, rows, cols] float32 of the listed experts, in plain PyTorch ops."""
    idx = torch.as_tensor(experts_K, dtype=torch.long, device=stack.codes_EP.device)
    packed_KP = stack.codes_EP.index_select(0, idx)
    codes_KN = torch.stack(((packed_KP >> 4).long(), (packed_KP & 0xF).long()), dim=-1).reshape(len(experts_K), -1)
    n = stack.rows * stack.cols
    values_KN = stack.quant_map.float()[codes_KN[:, :n]]
    return _blockwise_scale(values_KN, absmax_values(stack, experts_K), stack.blocksize).view(-1, stack.rows, stack.cols)


def dequantize_experts_bitsandbytes(stack: NF4Stack, experts_K: list[int]) -> torch.Tensor:
    """[K, rows, cols] float32 of the listed experts: the block scales as bitsandbytes computes them
    (`absmax_values`), then one bitsandbytes dequantize_4bit over all K experts' codes (their blocks
    line up end to end when a matrix holds a whole number of blocks; otherwise one call per
    expert). One call instead of K matters: each bitsandbytes call costs tens of microseconds, and
    far more when its OpenMP threads compete for busy cores."""
    n = stack.rows * stack.cols
    if not len(experts_K):
        return torch.empty((0, stack.rows, stack.cols), dtype=torch.float32, device=stack.codes_EP.device)
    if n % stack.blocksize or n % 2:
        return torch.stack([dequantize_nf4_bitsandbytes(stack, e) for e in experts_K])
    bnbf = bitsandbytes_functional()
    idx = torch.as_tensor(experts_K, dtype=torch.long, device=stack.codes_EP.device)
    codes = stack.codes_EP.index_select(0, idx).reshape(-1, 1)
    state = bnbf.QuantState(
        absmax=absmax_values(stack, experts_K).reshape(-1).contiguous(),
        shape=torch.Size([len(experts_K) * n]),
        code=stack.quant_map.float(),
        blocksize=stack.blocksize,
        quant_type="nf4",
        dtype=torch.float32,
    )
    return bnbf.dequantize_4bit(codes, state).view(-1, stack.rows, stack.cols)


# Experts dequantized together, at most this many weights per matrix at a time (64 MiB in fp32).
DEQUANT_GROUP_NUMEL = 1 << 24


def _lora(x_nI: torch.Tensor, lora: LoRAStack, e: int) -> torch.Tensor:
    return lora.scale * ((x_nI @ lora.A_ERI[e].T) @ lora.B_EOR[e].T)


def grouped_swiglu_nf4_lora_reference(
    x_sorted_ND: torch.Tensor,
    offsets_E1: torch.Tensor,
    experts: NF4LoRAExperts,
    dequantize: Dequantize | None = None,
) -> torch.Tensor:
    """Rows offsets[e]:offsets[e+1] of x go through expert e, whose matrices are the frozen NF4
    bases plus LoRA: g = x Wg^T + s (x Ag^T) Bg^T, u likewise, h = silu(g) * u,
    y = h Wd^T + s (h Ad^T) Bd^T. Only experts with rows are dequantized (in groups of up to
    DEQUANT_GROUP_NUMEL weights); the dequantized bases are constants of the graph (no gradient),
    so backward reaches x and the LoRA pairs only. `dequantize(stack, experts) -> [K, rows, cols]`
    defaults to `dequantize_experts_bitsandbytes`. Returns y_sorted_ND.

    Runs as one autograd Function over all experts (kernels/reference.py), bitwise the same as the
    per-expert loop `grouped_swiglu_nf4_lora_reference_loop` without its per-expert full-size
    gradient buffers. The dequantized groups are kept for the backward when it will run (as the
    loop's saved tensors kept them), freed group by group otherwise."""
    dequantize = dequantize or dequantize_experts_bitsandbytes
    E = experts.num_experts
    bounds = expert_bounds(offsets_E1, E, x_sorted_ND.shape[0])  # one host sync per call
    active = [e for e in range(E) if bounds[e + 1] > bounds[e]]
    loras = (experts.gate_lora, experts.up_lora, experts.down_lora)
    if not active:
        zero = x_sorted_ND.sum() + sum(p.sum() for l in loras for p in (l.A_ERI, l.B_EOR))
        return x_sorted_ND.new_zeros((0, experts.down.cols)) + 0 * zero
    # fp64 inputs (exact tests) get fp64 bases; otherwise fp32, and autocast picks the matmul dtype.
    base_dtype = torch.promote_types(x_sorted_ND.dtype, torch.float32)
    dt, cast = _compute_dtypes(x_sorted_ND)
    per_group = max(1, DEQUANT_GROUP_NUMEL // (experts.gate.rows * experts.gate.cols))

    def bases(group: list[int]):
        w_gate_KFD, w_up_KFD, w_down_t_KFD = (
            _cast(dequantize(st, group).to(base_dtype), cast) for st in (experts.gate, experts.up, experts.down)
        )
        # mm right operands [in, out]: gate/up W^T (a view), down stored [F, D] = W_down^T already.
        return [(w_gate_KFD[k].T, w_up_KFD[k].T, w_down_t_KFD[k]) for k in range(len(group))]

    params = [p for l in loras for p in (l.A_ERI, l.B_EOR)]
    backward_runs = torch.is_grad_enabled() and any(t.requires_grad for t in (x_sorted_ND, *params))
    plan = _Plan(
        bounds,
        active,
        [active[i : i + per_group] for i in range(0, len(active), per_group)],
        bases,
        tuple(l.scale for l in loras),
        dt,
        cast,
        keep_bases=backward_runs,
    )
    return _GroupedSwiGLU.apply(plan, x_sorted_ND, None, None, None, *params)


def grouped_swiglu_nf4_lora_reference_loop(
    x_sorted_ND: torch.Tensor,
    offsets_E1: torch.Tensor,
    experts: NF4LoRAExperts,
    dequantize: Dequantize | None = None,
) -> torch.Tensor:
    """The per-expert loop that `grouped_swiglu_nf4_lora_reference` replaced, autograd through plain
    ops (one zero tensor of every LoRA stack and of x per expert in the backward): the tests' baseline."""
    dequantize = dequantize or dequantize_experts_bitsandbytes
    E = experts.num_experts
    if offsets_E1.numel() != E + 1:
        raise ValueError(f"offsets must have E + 1 = {E + 1} entries, got {offsets_E1.numel()}")
    bounds = offsets_E1.tolist()  # one host sync per call, as in the full-precision reference
    if bounds[0] != 0 or bounds[-1] != x_sorted_ND.shape[0]:
        raise ValueError(f"offsets must run from 0 to N = {x_sorted_ND.shape[0]}, got {bounds[0]}..{bounds[-1]}")
    for e in range(E):
        if bounds[e + 1] < bounds[e]:
            raise ValueError(f"offsets must be non-decreasing, got {bounds[e]} > {bounds[e + 1]} at expert {e}")
    active = [e for e in range(E) if bounds[e + 1] > bounds[e]]
    if not active:
        zero = x_sorted_ND.sum() + sum(p.sum() for l in (experts.gate_lora, experts.up_lora, experts.down_lora) for p in (l.A_ERI, l.B_EOR))
        return x_sorted_ND.new_zeros((0, experts.down.cols)) + 0 * zero
    # fp64 inputs (exact tests) get fp64 bases; otherwise fp32, and autocast picks the matmul dtype.
    base_dtype = torch.promote_types(x_sorted_ND.dtype, torch.float32)
    per_group = max(1, DEQUANT_GROUP_NUMEL // (experts.gate.rows * experts.gate.cols))
    chunks = []
    for g0 in range(0, len(active), per_group):
        group = active[g0 : g0 + per_group]
        w_gate_KFD, w_up_KFD, w_down_t_KFD = (dequantize(st, group).to(base_dtype) for st in (experts.gate, experts.up, experts.down))
        for k, e in enumerate(group):
            x_nD = x_sorted_ND[bounds[e] : bounds[e + 1]]
            g_nF = x_nD @ w_gate_KFD[k].T + _lora(x_nD, experts.gate_lora, e)
            u_nF = x_nD @ w_up_KFD[k].T + _lora(x_nD, experts.up_lora, e)
            h_nF = F.silu(g_nF) * u_nF
            chunks.append(h_nF @ w_down_t_KFD[k] + _lora(h_nF, experts.down_lora, e))
    return torch.cat(chunks, dim=0)


def nf4_bytes_per_weight(double_quant: bool, blocksize: int = NF4_BLOCKSIZE, nested_blocksize: int = NESTED_BLOCKSIZE) -> float:
    """Storage per quantized weight, ignoring the per-matrix offset and the code books: half a byte
    of code plus the absmax (fp32 per block, or one byte per block plus fp32 per nested block)."""
    if double_quant:
        return 0.5 + 1 / blocksize + 4 / (blocksize * nested_blocksize)
    return 0.5 + 4 / blocksize


def nf4_buffer_shapes(rows: int, cols: int, double_quant: bool) -> dict[str, tuple[int, ...]]:
    """Per-expert shapes of one NF4 matrix's tensors (without the leading E)."""
    n = rows * cols
    if n % 2:
        raise ValueError(f"an NF4 matrix needs an even number of elements, got {rows} x {cols}")
    blocks = math.ceil(n / NF4_BLOCKSIZE)
    shapes = {"codes": (n // 2,), "absmax": (blocks,)}
    if double_quant:
        shapes["nested_absmax"] = (math.ceil(blocks / NESTED_BLOCKSIZE),)
        shapes["offset"] = ()
    return shapes
