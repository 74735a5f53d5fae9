"""Grouped SwiGLU expert GEMM over expert-sorted rows, in Triton: dense or NF4 base weights (NF4
decoded per tile inside the kernel, or dequantized first: `resolve_nf4_decode`), LoRA in the
epilogue, forward and backward as one autograd.Function. On a Hopper GPU in bf16 the same Function
runs its products through torch._grouped_mm instead (kernels/grouped_torch.py, `resolve_gemm`).
Functional entry: `grouped_swiglu`; reference: `reference.grouped_swiglu_lora_reference`.

Math per expert e over its rows x (n of them):
  g = x Wg^T + sg (x Ag^T) Bg^T,  u = x Wu^T + su (x Au^T) Bu^T,  h = silu(g) * u,
  y = h Wd^T + sd (h Ad^T) Bd^T.
Backward: dh = dy Wd + sd (dy Bd) Ad; dg = dh * u * silu'(g); du = dh * silu(g);
  dx = dg Wg + du Wu + LoRA terms; per-expert weight/LoRA gradients as row reductions.

Kernels: `_grouped_mm_kernel` computes, for one (row tile, column tile), X @ W_logical plus the
low-rank term Z @ L2 in the epilogue, Z = X @ L1 from a thin launch before (`low_rank`; inside the
reduction loop its dot read shared memory out of bounds on an H200); an optional second operand is
summed (dx) or combined by SwiGLU (forward gate/up); a third epilogue turns dh into dg, du. `_grouped_wgrad_kernel` reduces
over an expert's rows: out[e] = scale * P[rows]^T @ Q[rows]. No atomics: every output element is
written by exactly one program, so gradients are bitwise reproducible.

Legend: N rows, D d_model, F expert hidden, E experts, E1 = E + 1 offsets, r LoRA rank,
T row tiles, K reduction length, O output columns.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from . import grouped_torch
from ._swiglu_triton import silu_mul, silu_mul_backward
from .nf4 import dequantize_nf4_experts, nf4_kernel_args, nf4_values
from .weights import ExpertLoRA, ExpertWeights, LoRA, NF4Weight, weight_shape

MODE_PLAIN, MODE_SWIGLU, MODE_SWIGLU_BWD = 0, 1, 2


@triton.jit
def _weight_tile(
    w_ptr, absmax_ptr, code_ptr, nabs_ptr, ncode_ptr, qoff_ptr, e, k_offs, n_offs, mask,
    stride_we, stride_wk, stride_wn, numel,
    NF4: tl.constexpr, NESTED: tl.constexpr, QBLOCK: tl.constexpr, NQBLOCK: tl.constexpr,
):
    """[BK, BN] tile of expert e's weight seen as a [K, O] matrix (strides select W or W^T), fp32 for NF4."""
    if NF4:
        flat = k_offs[:, None] * stride_wk + n_offs[None, :] * stride_wn
        w = nf4_values(w_ptr, absmax_ptr, code_ptr, nabs_ptr, ncode_ptr, qoff_ptr, e, flat, mask, numel, NESTED, QBLOCK, NQBLOCK)
    else:
        ptrs = w_ptr + e.to(tl.int64) * stride_we + k_offs[:, None] * stride_wk + n_offs[None, :] * stride_wn
        w = tl.load(ptrs, mask=mask, other=0.0)
    return w


@triton.jit
def project_tile(
    rows, row_mask, e, n_offs, n_mask, K,
    x_ptr, stride_xm,
    w_ptr, absmax_ptr, code_ptr, nabs_ptr, ncode_ptr, qoff_ptr, stride_we, stride_wk, stride_wn, numel,
    l2_ptr, stride_l2e, stride_l2r, stride_l2n, z_ptr, stride_zm, scale, R,
    NF4: tl.constexpr, NESTED: tl.constexpr, QBLOCK: tl.constexpr, NQBLOCK: tl.constexpr, LORA: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """fp32 [BM, BN] = X[rows] @ W_e[:, n] + scale * Z[rows] @ L2_e[:, n], with Z = X @ L1 computed
    beforehand (`low_rank`): the reduction loop holds one dot, so it takes the same tiles with or
    without an adapter."""
    dt = x_ptr.dtype.element_ty
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
    for k0 in range(0, K, BK):
        k_offs = k0 + tl.arange(0, BK)
        k_mask = k_offs < K
        x = tl.load(x_rows + k_offs[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w = _weight_tile(
            w_ptr, absmax_ptr, code_ptr, nabs_ptr, ncode_ptr, qoff_ptr, e, k_offs, n_offs, k_mask[:, None] & n_mask[None, :],
            stride_we, stride_wk, stride_wn, numel, NF4, NESTED, QBLOCK, NQBLOCK,
        )
        acc = tl.dot(x, w.to(dt), acc, input_precision=DOT_PREC)
    if LORA:
        r_offs = tl.arange(0, BR)
        r_mask = r_offs < R
        z = tl.load(z_ptr + rows.to(tl.int64)[:, None] * stride_zm + r_offs[None, :], mask=row_mask[:, None] & r_mask[None, :], other=0.0)
        l2 = tl.load(
            l2_ptr + e.to(tl.int64) * stride_l2e + r_offs[:, None] * stride_l2r + n_offs[None, :] * stride_l2n,
            mask=r_mask[:, None] & n_mask[None, :],
            other=0.0,
        )
        acc += scale * tl.dot(z, l2.to(dt), input_precision=DOT_PREC)
    return acc


@triton.jit
def _grouped_mm_kernel(
    tile_expert_ptr, tile_row_ptr, offsets_ptr, num_tiles,
    out_ptr, g_ptr, u_ptr, du_ptr, h_ptr, stride_om, K, NOUT,
    x1_ptr, stride_x1m,
    w1_ptr, absmax1_ptr, code1_ptr, nabs1_ptr, ncode1_ptr, qoff1_ptr, stride_w1e, stride_w1k, stride_w1n, numel1,
    l1_ptr, stride_l1e, stride_l1r, stride_l1n, z1_ptr, stride_z1m, scale1, R1,
    x2_ptr, stride_x2m,
    w2_ptr, absmax2_ptr, code2_ptr, nabs2_ptr, ncode2_ptr, qoff2_ptr, stride_w2e, stride_w2k, stride_w2n, numel2,
    l2_ptr, stride_l2e, stride_l2r, stride_l2n, z2_ptr, stride_z2m, scale2, R2,
    NF4_1: tl.constexpr, NESTED_1: tl.constexpr, QBLOCK_1: tl.constexpr, NQBLOCK_1: tl.constexpr, LORA_1: tl.constexpr,
    NF4_2: tl.constexpr, NESTED_2: tl.constexpr, QBLOCK_2: tl.constexpr, NQBLOCK_2: tl.constexpr, LORA_2: tl.constexpr,
    MODE: tl.constexpr, DUAL: tl.constexpr, SAVE_AUX: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr, DOT_PREC: tl.constexpr, GROUP_M: tl.constexpr,
):
    # Programs run GROUP_M row tiles across all column tiles before moving on, so the rows a wave
    # reads stay in L2 (row tiles outermost re-read all of X once per column tile).
    pid = tl.program_id(0)
    tiles_n = tl.cdiv(NOUT, BN)
    width = GROUP_M * tiles_n
    first_m = (pid // width) * GROUP_M
    size_m = tl.minimum(num_tiles - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % size_m
    pid_n = (pid % width) // size_m
    e = tl.load(tile_expert_ptr + pid_m)
    # The tile list is an upper bound computed without a host sync; spare entries hold -1.
    if e >= 0:
        row_end = tl.load(offsets_ptr + e + 1)
        rows = tl.load(tile_row_ptr + pid_m) + tl.arange(0, BM)
        row_mask = rows < row_end
        n_offs = pid_n * BN + tl.arange(0, BN)
        n_mask = n_offs < NOUT
        acc = project_tile(
            rows, row_mask, e, n_offs, n_mask, K, x1_ptr, stride_x1m,
            w1_ptr, absmax1_ptr, code1_ptr, nabs1_ptr, ncode1_ptr, qoff1_ptr, stride_w1e, stride_w1k, stride_w1n, numel1,
            l1_ptr, stride_l1e, stride_l1r, stride_l1n, z1_ptr, stride_z1m, scale1, R1,
            NF4_1, NESTED_1, QBLOCK_1, NQBLOCK_1, LORA_1, BM, BN, BK, BR, DOT_PREC,
        )
        if DUAL:
            acc2 = project_tile(
                rows, row_mask, e, n_offs, n_mask, K, x2_ptr, stride_x2m,
                w2_ptr, absmax2_ptr, code2_ptr, nabs2_ptr, ncode2_ptr, qoff2_ptr, stride_w2e, stride_w2k, stride_w2n, numel2,
                l2_ptr, stride_l2e, stride_l2r, stride_l2n, z2_ptr, stride_z2m, scale2, R2,
                NF4_2, NESTED_2, QBLOCK_2, NQBLOCK_2, LORA_2, BM, BN, BK, BR, DOT_PREC,
            )
        offs = rows.to(tl.int64)[:, None] * stride_om + n_offs[None, :]
        mask = row_mask[:, None] & n_mask[None, :]
        dt = out_ptr.dtype.element_ty
        if MODE == 0:
            if DUAL:
                acc = acc + acc2
            tl.store(out_ptr + offs, acc.to(dt), mask=mask)
        elif MODE == 1:
            # acc = gate pre-activation, acc2 = up; h = silu(g) * u
            h = silu_mul(acc, acc2)
            tl.store(out_ptr + offs, h.to(dt), mask=mask)
            if SAVE_AUX:
                tl.store(g_ptr + offs, acc.to(dt), mask=mask)
                tl.store(u_ptr + offs, acc2.to(dt), mask=mask)
        else:
            # acc = dh; g and u come from the forward pass
            g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            dg, du, h = silu_mul_backward(acc, g, u)
            tl.store(out_ptr + offs, dg.to(dt), mask=mask)
            tl.store(du_ptr + offs, du.to(dt), mask=mask)
            if SAVE_AUX:
                tl.store(h_ptr + offs, h.to(dt), mask=mask)


@triton.jit
def _grouped_wgrad_kernel(
    p_ptr, stride_pm, q_ptr, stride_qm, offsets_ptr, out_ptr, stride_oe, stride_om, stride_on, M, NN, scale,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, DOT_PREC: tl.constexpr,
):
    e = tl.program_id(0)
    pid = tl.program_id(1)
    tiles_n = tl.cdiv(NN, BN)
    m_offs = (pid // tiles_n) * BM + tl.arange(0, BM)
    n_offs = (pid % tiles_n) * BN + tl.arange(0, BN)
    m_mask = m_offs < M
    n_mask = n_offs < NN
    lo = tl.load(offsets_ptr + e)
    hi = tl.load(offsets_ptr + e + 1)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for r0 in range(lo, hi, BK):
        rows = r0 + tl.arange(0, BK)
        r_mask = rows < hi
        p = tl.load(p_ptr + rows.to(tl.int64)[None, :] * stride_pm + m_offs[:, None], mask=m_mask[:, None] & r_mask[None, :], other=0.0)
        q = tl.load(q_ptr + rows.to(tl.int64)[:, None] * stride_qm + n_offs[None, :], mask=r_mask[:, None] & n_mask[None, :], other=0.0)
        acc = tl.dot(p, q.to(p.dtype), acc, input_precision=DOT_PREC)
    out = out_ptr + e.to(tl.int64) * stride_oe + m_offs[:, None] * stride_om + n_offs[None, :] * stride_on
    tl.store(out, (acc * scale).to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


# ---------------------------------------------------------------------------------------------
# Host side


@dataclass(frozen=True)
class TileConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


# Fixed configs instead of @triton.autotune: autotuning costs minutes per shape, needs an explicit
# do_bench under the interpreter, and a config picked by timing can differ between runs, which
# would change the summation order and so the bits a resumed run repeats. Two accumulators (gate
# and up) share a register file, hence the narrower N for the dual kernel. Small experts waste
# most of a 128-row tile, hence BM=64 below 128 rows per expert on average.
# `benchmarks/kernels.py --sweep` times the candidates below on a GPU; GPU_CONFIGS holds its pick
# from an H200 (bf16, TFLOP/s at the 120B expert shapes and at E 8, D 4096, F 2048): a plain
# projection 404 and 351 at 128 x 256 (316 and 255 at 128 x 128); the dh launch, whose epilogue
# reads g, u and writes dg, du, h, 217 and 175 at 128 x 128 (138 and 126 at 128 x 256); the dual
# launches 349-416 at 128 x 128 x 64, 8 warps, 3 stages. The 64-row configs were not swept except
# the dual one (342 at E 8, F 2048, gate + up).
GPU_CONFIGS = {
    ("single", 128): TileConfig(128, 256, 64, 8, 3),
    ("single", 64): TileConfig(64, 128, 64, 4, 4),
    ("swiglu_bwd", 128): TileConfig(128, 128, 64, 8, 3),
    ("swiglu_bwd", 64): TileConfig(64, 128, 64, 4, 4),
    ("dual", 128): TileConfig(128, 128, 64, 8, 3),
    ("dual", 64): TileConfig(64, 128, 64, 4, 3),
}
SWEEP_CANDIDATES = {
    "single": [TileConfig(*c) for c in ((128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (128, 128, 64, 4, 4), (128, 128, 128, 8, 2), (128, 256, 64, 8, 4), (64, 256, 64, 4, 3))],
    "swiglu_bwd": [TileConfig(*c) for c in ((128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (128, 128, 64, 4, 4), (128, 128, 128, 8, 2), (128, 64, 64, 4, 4), (64, 128, 64, 4, 3))],
    "dual": [TileConfig(*c) for c in ((128, 64, 64, 8, 3), (128, 128, 64, 8, 3), (128, 64, 64, 4, 4), (128, 128, 64, 8, 2), (64, 128, 64, 4, 3), (128, 128, 32, 8, 4))],
}
# The interpreter runs programs one at a time in numpy: small tiles keep the masks exercised.
_CPU_CONFIG = TileConfig(16, 32, 32, 1, 1)
# Row tiles a group of programs walks across all column tiles (the L2 swizzle of _grouped_mm_kernel).
_GROUP_M = 8


def tile_config(
    kind: str, n_rows: int, n_experts: int, device: torch.device, block_m: int | None = None, dtype: torch.dtype = torch.bfloat16,
    n_out: int | None = None,
) -> TileConfig:
    """kind: "single" (one projection), "swiglu_bwd" (dh, turned into dg and du), "dual" (gate
    and up, or the two halves of dx) or "low_rank"
    (X @ L1, n_out = the adapters' rank or ranks). block_m forces the row tile (a combine plan fixes
    it); otherwise it follows rows per expert."""
    if device.type != "cuda":
        return _CPU_CONFIG if block_m is None else replace(_CPU_CONFIG, block_m=block_m)
    if block_m is None:
        block_m = 128 if n_rows / max(n_experts, 1) >= 128 else 64
    if kind == "low_rank":
        # A thin output: the launch reads X once; the column tile covers all ranks up to 64.
        return TileConfig(block_m, min(64, _pow2_at_least_16(n_out or 16)), 64, 4, 3)
    cfg = GPU_CONFIGS.get((kind, block_m)) or replace(GPU_CONFIGS[(kind, 64)], block_m=block_m)
    if dtype == torch.float32:
        # 4-byte tiles: 3 stages of 128x64 + 64x128 fp32 would take ~192 KB of shared memory.
        cfg = replace(cfg, block_n=min(cfg.block_n, 64), block_k=32, num_stages=2)
    return cfg


_log = logging.getLogger(__name__)
# Configs shrunk to fit a GPU's shared memory, by (kernel, device, config, specialisation): the
# fixed configs above are sized for Hopper's 227 KB, but the NF4 decode and LoRA tiles add
# buffers that Triton's pipeliner multiplies by num_stages (an H200 refused 256 KB for the NF4
# down projection at 128 x 128 x 64, 3 stages).
_FITTED: dict[tuple, TileConfig] = {}


def _smaller(cfg: TileConfig) -> TileConfig | None:
    """The next config to try after `cfg` ran out of shared memory: fewer pipeline stages, then a
    shorter reduction tile. The row and column tiles stay (a combine plan and its consumer fix them)."""
    if cfg.num_stages > 1:
        return replace(cfg, num_stages=cfg.num_stages - 1)
    if cfg.block_k > 16:
        return replace(cfg, block_k=cfg.block_k // 2, num_stages=2)
    return None


def launch_fitted(name: str, key: tuple, cfg: TileConfig, launch) -> TileConfig:
    """launch(cfg), stepping down through _smaller(cfg) while the GPU has too little shared memory
    for it; the config that fits is remembered for the same key and logged once. Returns it."""
    key = (name, *key, cfg)
    tried = _FITTED.get(key, cfg)
    while True:
        try:
            launch(tried)
            return tried
        except OutOfResources as exc:
            smaller = _smaller(tried)
            if smaller is None:
                raise
            _log.warning("%s: %s; retrying with block_k %d, %d stages", name, exc, smaller.block_k, smaller.num_stages)
            _FITTED[key] = tried = smaller


def _pow2_at_least_16(n: int) -> int:
    return max(16, triton.next_power_of_2(max(n, 1)))


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs: full-precision products ("ieee"), since tf32 would miss the fp32 reference by ~1e-3.
    return "ieee" if dtype == torch.float32 else "tf32"


def row_tiles(offsets_E1: torch.Tensor, n_rows: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(tile_expert_T, tile_row_T) int32: each expert's rows cut into block_m-row tiles, in expert
    order, computed on the device without a host sync. T = min(N, ceil(N/BM) + E) bounds the real
    count; spare tiles have expert -1."""
    E = offsets_E1.numel() - 1
    T = min(n_rows, triton.cdiv(n_rows, block_m) + E)
    counts_E = offsets_E1[1:] - offsets_E1[:-1]
    tiles_E = (counts_E + block_m - 1) // block_m
    ends_E = torch.cumsum(tiles_E, 0)
    t_T = torch.arange(T, device=offsets_E1.device)
    e_T = torch.searchsorted(ends_E, t_T, right=True)
    ec_T = e_T.clamp(max=E - 1)
    row_T = offsets_E1[ec_T] + (t_T - (ends_E[ec_T] - tiles_E[ec_T])) * block_m
    return torch.where(e_T < E, ec_T, -1).to(torch.int32), row_T.to(torch.int32)


_NO_OPERAND = [None] * 20
_NO_FLAGS = (False, False, 64, 256, False)


def operand_args(x: torch.Tensor, w, transpose: bool, lora: LoRA | None, z: torch.Tensor | None):
    """Kernel arguments for one operand X @ W' (+ scale Z L2, Z = X L1 from `low_rank`): W' = W^T
    when `transpose` (a forward projection) else W (an input gradient); L1, L2 = A^T, B^T or B, A
    accordingly. Returns (20 runtime args, 5 constexpr flags)."""
    if isinstance(w, NF4Weight):
        rows, cols = w.shape
        sk, sn = (1, cols) if transpose != w.transposed else (cols, 1)
        codes, absmax, code, nabs, ncode, qoff = nf4_kernel_args(w)
        wargs = [codes, absmax, code, nabs, ncode, qoff, 0, sk, sn, rows * cols]
        nf4 = (True, w.nested, w.blocksize, w.nested_blocksize)
    else:
        se, s0, s1 = w.stride()
        sk, sn = (s1, s0) if transpose else (s0, s1)
        wargs = [w, None, None, None, None, None, se, sk, sn, 0]
        nf4 = (False, False, 64, 256)
    if lora is None:
        largs = [None, 0, 0, 0, None, 0, 0.0, 0]
    else:
        if z is None or z.shape != (x.shape[0], lora.rank) or z.stride(1) != 1:
            raise ValueError(f"an operand with a LoRA pair needs z = X @ L1 [{x.shape[0]}, {lora.rank}] (low_rank), got {None if z is None else list(z.shape)}")
        A, B = lora.A_ERI, lora.B_EOR
        second, sr, sn2 = (B, B.stride(2), B.stride(1)) if transpose else (A, A.stride(1), A.stride(2))
        largs = [second, second.stride(0), sr, sn2, z, z.stride(0), float(lora.scale), lora.rank]
    return [x, x.stride(0), *wargs, *largs], (*nf4, lora is not None)


def launch_grouped_mm(
    mode: int,
    offsets_E1: torch.Tensor,
    out: torch.Tensor,
    op1: tuple,
    op2: tuple | None = None,
    *,
    g: torch.Tensor | None = None,
    u: torch.Tensor | None = None,
    du: torch.Tensor | None = None,
    h: torch.Tensor | None = None,
    save_aux: bool = False,
    config: TileConfig | None = None,
    kind: str | None = None,
) -> TileConfig | None:
    """out[N, O] (+ epilogue outputs) from operand(s) given as operand_args(...) argument tuples.
    Returns the tile config that ran (None when there was nothing to compute)."""
    x = op1[0][0]
    N, K = x.shape
    NOUT = out.shape[1]
    if N == 0 or NOUT == 0:
        return None
    E = offsets_E1.numel() - 1
    kind = kind or ("dual" if op2 is not None else "swiglu_bwd" if mode == MODE_SWIGLU_BWD else "single")
    cfg = config or tile_config(kind, N, E, x.device, dtype=x.dtype, n_out=NOUT)
    tile_expert, tile_row = row_tiles(offsets_E1, N, cfg.block_m)
    num_tiles = tile_expert.numel()
    ranks = [op1[0][-1]] + ([op2[0][-1]] if op2 is not None else [])
    args2, flags2 = op2 if op2 is not None else (_NO_OPERAND, _NO_FLAGS)
    br = _pow2_at_least_16(max(ranks))

    def launch(c: TileConfig) -> None:
        grid = (num_tiles * triton.cdiv(NOUT, c.block_n),)
        _grouped_mm_kernel[grid](
            tile_expert, tile_row, offsets_E1, num_tiles,
            out, g, u, du, h, out.stride(0), K, NOUT,
            *op1[0], *args2,
            *op1[1], *flags2,
            MODE=mode, DUAL=op2 is not None, SAVE_AUX=save_aux,
            BM=c.block_m, BN=c.block_n, BK=c.block_k, BR=br,
            DOT_PREC=_dot_precision(x.dtype), GROUP_M=_GROUP_M,
            num_warps=c.num_warps, num_stages=c.num_stages,
            # Keeps in-kernel NF4 decoding bit-identical to dequantize_4bit (no FMA in the nested scale).
            enable_fp_fusion=False,
        )

    return launch_fitted("grouped_mm", (x.device, x.dtype, mode, save_aux, br, op1[1], flags2), cfg, launch)


def low_rank(x: torch.Tensor, offsets_E1: torch.Tensor, loras, transpose: bool) -> list[torch.Tensor | None]:
    """Z = X @ L1 per expert for each LoRA pair in `loras` (None entries give None): X A^T when
    `transpose` (forward), X B otherwise (input gradient). Pairs that share X run as one launch
    over their L1s side by side; each Z is a column view of that [N, sum r] result."""
    present = [lo for lo in loras if lo is not None]
    if not present:
        return [None] * len(loras)
    if transpose:
        l1 = present[0].A_ERI if len(present) == 1 else torch.cat([lo.A_ERI for lo in present], dim=1)
    else:
        l1 = present[0].B_EOR if len(present) == 1 else torch.cat([lo.B_EOR for lo in present], dim=2)
    width = sum(lo.rank for lo in present)
    z_all = x.new_empty((x.shape[0], width))
    launch_grouped_mm(MODE_PLAIN, offsets_E1, z_all, operand_args(x, l1, transpose, None, None), kind="low_rank")
    out, col = [], 0
    for lo in loras:
        if lo is None:
            out.append(None)
        else:
            out.append(z_all[:, col : col + lo.rank])
            col += lo.rank
    return out


def grouped_wgrad(p_NM: torch.Tensor, q_NO: torch.Tensor, offsets_E1: torch.Tensor, out_EMO: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """out[e] = scale * p[rows_e]^T @ q[rows_e] for every expert (zeros for empty ones)."""
    E, M, NN = out_EMO.shape
    if out_EMO.numel() == 0:
        return out_EMO
    cuda = p_NM.device.type == "cuda"
    cap = 128 if cuda else 32
    bm, bn = min(cap, _pow2_at_least_16(M)), min(cap, _pow2_at_least_16(NN))
    grid = (E, triton.cdiv(M, bm) * triton.cdiv(NN, bn))
    cfg = TileConfig(bm, bn, 64 if cuda else 32, 8 if cuda and bm * bn >= 128 * 128 else 4, 3 if cuda else 1)

    def launch(c: TileConfig) -> None:
        _grouped_wgrad_kernel[grid](
            p_NM, p_NM.stride(0), q_NO, q_NO.stride(0), offsets_E1, out_EMO, *out_EMO.stride(), M, NN, float(scale),
            BM=c.block_m, BN=c.block_n, BK=c.block_k, DOT_PREC=_dot_precision(p_NM.dtype), num_warps=c.num_warps, num_stages=c.num_stages,
        )

    launch_fitted("grouped_wgrad", (p_NM.device, p_NM.dtype, q_NO.dtype, out_EMO.dtype), cfg, launch)
    return out_EMO


NF4_DECODES = ("auto", "fused", "dequantize")


def resolve_nf4_decode(decode: str, device: torch.device) -> str:
    """auto: dequantize on a GPU, fused elsewhere. On an H200 the in-kernel decode (a dependent
    gather chain per weight element inside the reduction loop) ran 15x slower than dequantizing
    every expert matrix first (29.1 vs 1.9 ms, 64 experts x 8,192 rows); the interpreter has no
    such cost and the fused path is the one whose masks the CPU tests exercise."""
    if decode not in NF4_DECODES:
        raise ValueError(f"nf4_decode must be one of {', '.join(NF4_DECODES)}, got {decode!r}")
    if decode == "auto":
        return "dequantize" if device.type == "cuda" else "fused"
    return decode


def _kernel_weights(spec: "_Spec", dense: tuple, dtype: torch.dtype, kept: tuple = (None, None, None)) -> list:
    """The three weights as the kernel reads them: dense tensors as given; NF4 stacks decoded inside
    the kernel, or dequantized here to `dtype` (bit-identical values: the same nf4_values) and
    handed over as dense [E, out, in] views (`kept`: the forward's dequantized copies, reused)."""
    out = []
    for w, q, k in zip(dense, spec.nf4, kept):
        if w is not None:
            out.append(w)
        elif k is not None:
            out.append(k)
        elif spec.nf4_decode == "dequantize":
            full = dequantize_nf4_experts(q, dtype)
            out.append(full.transpose(1, 2) if q.transposed else full)
        else:
            out.append(q)
    return out


def _kept(spec: "_Spec", weights: list) -> list:
    """What the forward keeps for the backward of the dequantized NF4 bases (spec.keep): the copies
    themselves, so the backward does not dequantize again; None elsewhere."""
    return [w if spec.keep and q is not None and spec.nf4_decode == "dequantize" else None for w, q in zip(weights, spec.nf4)]


def _down_weight(spec: "_Spec", wd, dtype: torch.dtype) -> torch.Tensor:
    """The folded route's down projection [E, D, F] in `dtype`: the dense weight cast, or the NF4
    base dequantized (a transposed view of its stored [F, D])."""
    (w,) = _kernel_weights(replace(spec, nf4=spec.nf4[2:]), (wd,), dtype)
    return w.to(dtype)


def _stacked_x_side(spec: "_Spec", wg, wu, loras: list, dtype: torch.dtype, F: int, D: int) -> torch.Tensor:
    """The folded route's Wx = [Wg; Wu; Ag; Au] [E, K, D] in `dtype` (grouped_torch.x_side_rows;
    `loras` padded): NF4 bases dequantized straight into their rows, dense ones and the A factors
    cast into theirs."""
    rows = grouped_torch.x_side_rows(F, loras)
    present = [r for r in rows if r is not None]
    E = spec.nf4[0].num_experts if wg is None else wg.shape[0]
    device = spec.nf4[0].device if wg is None else wg.device
    wx = torch.empty((E, present[-1][1], D), dtype=dtype, device=device)
    for (lo, hi), w, q in zip(rows[:2], (wg, wu), spec.nf4[:2]):
        if w is not None:
            wx[:, lo:hi].copy_(w)
        else:
            dequantize_nf4_experts(q, dtype, out=wx[:, lo:hi])
    for r, pair in zip(rows[2:], loras[:2]):
        if r is not None:
            wx[:, r[0] : r[1]].copy_(pair.A_ERI)
    return wx


GEMMS = ("auto", "triton", "torch")
FOLDS = ("auto", "on", "off")


def resolve_gemm(gemm: str, x: torch.Tensor, widths: list[int], tensors: list[torch.Tensor]) -> str:
    """auto: torch._grouped_mm on a GPU where it runs (grouped_torch.gemm_unavailable_reason), the
    Triton kernels otherwise. "torch" where it cannot run is an error naming why."""
    if gemm not in GEMMS:
        raise ValueError(f"gemm must be one of {', '.join(GEMMS)}, got {gemm!r}")
    if gemm == "triton":
        return gemm
    reason = grouped_torch.gemm_unavailable_reason(x, widths, tensors)
    if gemm == "torch" and reason is not None:
        raise ValueError(f"gemm='torch': {reason}")
    return "torch" if reason is None and (gemm == "torch" or x.device.type == "cuda") else "triton"


@dataclass(frozen=True)
class _Spec:
    nf4: tuple  # (NF4Weight | None) per matrix: gate, up, down
    scales: tuple  # LoRA scale per matrix (unused where there is no LoRA)
    save_for_backward: bool
    nf4_decode: str = "fused"  # resolved: "fused" or "dequantize"
    gemm: str = "triton"  # resolved: "triton" or "torch"
    keep: bool = True  # keep the forward's dequantized NF4 bases for the backward
    fold: bool = False  # resolved: the folded torch route (grouped_torch.forward_folded)


class GroupedSwiGLUFunction(torch.autograd.Function):
    """Inputs: x [N, D] (compute dtype), offsets [E1] int64, spec, then the dense weights
    (None where NF4), then LoRA A, B per matrix (None where absent)."""

    @staticmethod
    def forward(ctx, x, offsets, spec: _Spec, wg, wu, wd, ag, bg, au, bu, ad, bd):
        loras = [LoRA(a, b, s) if a is not None else None for a, b, s in zip((ag, au, ad), (bg, bu, bd), spec.scales)]
        save = spec.save_for_backward
        if spec.gemm == "torch" and spec.fold:
            _, padded = grouped_torch.in_dtype([], loras, x.dtype)
            F = weight_shape(spec.nf4[0] if wg is None else wg)[1]
            wx = _stacked_x_side(spec, wg, wu, padded, x.dtype, F, x.shape[1])
            w_down = _down_weight(spec, wd, x.dtype)
            y, saved = grouped_torch.forward_folded(x, _ends(offsets), wx, w_down, padded, save)
            if save:
                ctx.spec, ctx.n_saved = spec, 2 + len(saved) + 2  # x, offsets, the route's, the kept copies
                kept = (wx if spec.keep else None, _kept(spec, [None, None, w_down])[2])
                ctx.save_for_backward(x, offsets, *saved, *kept, wg, wu, wd, ag, bg, au, bu, ad, bd)
            return y
        weights = _kernel_weights(spec, (wg, wu, wd), x.dtype)
        if spec.gemm == "torch":
            weights, padded = grouped_torch.in_dtype(weights, loras, x.dtype)
            y, saved = grouped_torch.forward(x, _ends(offsets), weights, padded, save)
            if save:
                ctx.spec, ctx.n_saved = spec, 2 + len(saved) + 3
                ctx.save_for_backward(x, offsets, *saved, *_kept(spec, weights), wg, wu, wd, ag, bg, au, bu, ad, bd)
            return y
        N, D = x.shape
        F = weight_shape(weights[0])[1]
        h = x.new_empty((N, F))
        g = x.new_empty((N, F)) if save else None
        u = x.new_empty((N, F)) if save else None
        zg, zu = low_rank(x, offsets, loras[:2], True)
        launch_grouped_mm(
            MODE_SWIGLU, offsets, h,
            operand_args(x, weights[0], True, loras[0], zg),
            operand_args(x, weights[1], True, loras[1], zu),
            g=g, u=u, save_aux=save,
        )
        (zd,) = low_rank(h, offsets, loras[2:], True)
        y = x.new_empty((N, D))
        launch_grouped_mm(MODE_PLAIN, offsets, y, operand_args(h, weights[2], True, loras[2], zd))
        if save:
            ctx.spec, ctx.n_saved = spec, 2 + 5 + 3
            ctx.save_for_backward(x, offsets, g, u, zg, zu, zd, *_kept(spec, weights), wg, wu, wd, ag, bg, au, bu, ad, bd)
        return y

    @staticmethod
    def backward(ctx, dy):
        saved = ctx.saved_tensors
        x, offsets, route = saved[0], saved[1], saved[2 : ctx.n_saved]
        wg, wu, wd, ag, bg, au, bu, ad, bd = saved[ctx.n_saved :]
        spec = ctx.spec
        needs = ctx.needs_input_grad
        loras = [LoRA(a, b, s) if a is not None else None for a, b, s in zip((ag, au, ad), (bg, bu, bd), spec.scales)]
        dy = dy.to(x.dtype).contiguous()
        N, D = x.shape
        need_dx = needs[0]
        need_dW = (needs[3], needs[4], needs[5])
        need_dA = (needs[6], needs[8], needs[10])
        need_dB = (needs[7], needs[9], needs[11])
        if spec.gemm == "torch" and spec.fold:
            gu, zd, wx, w_down = route
            _, padded = grouped_torch.in_dtype([], loras, x.dtype)
            if w_down is None:
                w_down = _down_weight(spec, wd, x.dtype)
            if wx is None:
                wx = _stacked_x_side(spec, wg, wu, padded, x.dtype, w_down.shape[2], D)
            dx, dW, dA, dB = grouped_torch.backward_folded(dy, x, _ends(offsets), gu, zd, wx, w_down, padded, need_dx, need_dW, need_dA, need_dB)
        elif spec.gemm == "torch":
            (g, u, zg, zu, zd), kept = route[:5], route[5:]
            weights = _kernel_weights(spec, (wg, wu, wd), x.dtype, kept)
            dx, dW, dA, dB = grouped_torch.backward(
                dy, x, _ends(offsets), g, u, (zg, zu, zd), *grouped_torch.in_dtype(weights, loras, x.dtype), need_dx, need_dW, need_dA, need_dB,
            )
        if spec.gemm == "torch":
            like = (wg, wu, wd, ag, bg, au, bu, ad, bd)
            grads = [*dW, dA[0], dB[0], dA[1], dB[1], dA[2], dB[2]]
            # the adapters' gradients at their own rank (the route padded it): the leading rows / columns
            grads = [None if d is None else d[tuple(slice(0, n) for n in t.shape)].to(t.dtype) for d, t in zip(grads, like)]
            return dx, None, None, *grads

        (g, u, zg, zu, zd), kept = route[:5], route[5:]
        weights = _kernel_weights(spec, (wg, wu, wd), x.dtype, kept)
        F = g.shape[1]
        # dh = dy Wd + sd (dy Bd) Ad, turned into dg, du (and h, recomputed, for the down-projection grads)
        dg, du = x.new_empty((N, F)), x.new_empty((N, F))
        need_h = need_dW[2] or need_dA[2]
        h = x.new_empty((N, F)) if need_h else None
        (zbd,) = low_rank(dy, offsets, loras[2:], False)
        launch_grouped_mm(MODE_SWIGLU_BWD, offsets, dg, operand_args(dy, weights[2], False, loras[2], zbd), g=g, u=u, du=du, h=h, save_aux=need_h)

        # dg Bg, du Bu: for dx's LoRA terms and for dAg, dAu
        zbg, zbu = (
            low_rank(d, offsets, [lo if lo is not None and (need_dx or need_dA[i]) else None], False)[0]
            for i, (d, lo) in enumerate(zip((dg, du), loras[:2]))
        )
        dx = None
        if need_dx:
            dx = x.new_empty((N, D))
            launch_grouped_mm(
                MODE_PLAIN, offsets, dx,
                operand_args(dg, weights[0], False, loras[0], zbg),
                operand_args(du, weights[1], False, loras[1], zbu),
            )

        def wgrad(p, q, like, scale=1.0):
            return grouped_wgrad(p, q, offsets, torch.empty_like(like, memory_format=torch.contiguous_format), scale)

        d_in = (dg, du, dy)  # gradient at each projection's output
        x_in = (x, x, h)  # each projection's input
        dW = [wgrad(d_in[i], x_in[i], w) if need_dW[i] else None for i, w in enumerate((wg, wu, wd))]
        dA, dB = [None] * 3, [None] * 3
        for i, (lo, zf, zb) in enumerate(zip(loras, (zg, zu, zd), (zbg, zbu, zbd))):
            if lo is None:
                continue
            if need_dB[i]:
                dB[i] = wgrad(d_in[i], zf, lo.B_EOR, lo.scale)
            if need_dA[i]:
                dA[i] = wgrad(zb, x_in[i], lo.A_ERI, lo.scale)
        return dx, None, None, *dW, dA[0], dB[0], dA[1], dB[1], dA[2], dB[2]


def _ends(offsets_E1: torch.Tensor) -> torch.Tensor:
    """torch._grouped_mm's offs: each expert's end row, int32, on the device (no host sync)."""
    return offsets_E1[1:].to(torch.int32)


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


def grouped_swiglu(
    x_sorted_ND: torch.Tensor, offsets_E1: torch.Tensor, weights, lora=None, nf4_decode: str = "auto", gemm: str = "auto",
    keep_dequantized: bool = True, fold: str = "auto",
) -> torch.Tensor:
    """y_sorted_ND for rows sorted by expert (offsets_E1[e]:offsets_E1[e+1] belong to expert e).
    weights = (gate [E,F,D], up [E,F,D], down [E,D,F]), each a tensor or an NF4Weight; lora =
    (gate, up, down) LoRA pairs, each optional. Computes in x's dtype (the autocast dtype under
    autocast), accumulating in fp32. Gradients flow to x, LoRA A/B, and dense weights that
    require grad; NF4 bases are frozen. nf4_decode: where NF4 bases are decoded ("fused" inside the
    GEMM, "dequantize" first to the compute dtype, "auto": resolve_nf4_decode); same values either way.
    gemm: what runs the products ("triton" kernels, "torch" for torch._grouped_mm, "auto":
    resolve_gemm); the torch route dequantizes NF4 first. keep_dequantized: the forward's
    dequantized NF4 bases are kept for the backward's input gradient (the reference backend keeps
    them too, and the plan counts them as saved; under reversible blocks only one block's recompute
    holds them) instead of dequantized again. fold: "on" stacks the gate and up products and their
    adapters' A factors into one product forward and one for the input gradient
    (grouped_torch.forward_folded; the torch route only), "off" does not, "auto" is off until a GPU
    shows it faster (benchmarks/kernels.py times both)."""
    weights = ExpertWeights(*weights)
    lora = ExpertLoRA(*(lora if lora is not None else (None, None, None)))
    dt = _compute_dtype(x_sorted_ND)
    x = x_sorted_ND.to(dt).contiguous()
    offsets = offsets_E1.to(device=x.device, dtype=torch.int64).contiguous()
    E, F, D = weight_shape(weights.gate)
    expect = {"gate": (E, F, D), "up": (E, F, D), "down": (E, D, F)}
    problems = [f"{k} weight is {list(weight_shape(w))}, expected {list(v)}" for (k, v), w in zip(expect.items(), weights) if tuple(weight_shape(w)) != v]
    if x.shape[1] != D:
        problems.append(f"x has {x.shape[1]} columns, weights expect D = {D}")
    if offsets.numel() != E + 1:
        problems.append(f"offsets must have E + 1 = {E + 1} entries, got {offsets.numel()}")
    for (k, (e_, o, i)), lo in zip(expect.items(), lora):
        if lo is not None and (lo.A_ERI.shape[0] != E or lo.A_ERI.shape[2] != i or lo.B_EOR.shape[1] != o):
            problems.append(f"{k} LoRA A {list(lo.A_ERI.shape)}, B {list(lo.B_EOR.shape)} do not fit a [{o}, {i}] weight with E = {E}")
    if problems:
        raise ValueError("grouped_swiglu: " + "; ".join(problems))

    dense = [None if isinstance(w, NF4Weight) else w for w in weights]  # any strides: transposed views are fine
    nf4 = tuple(w if isinstance(w, NF4Weight) else None for w in weights)
    lora_tensors = []
    for lo in lora:
        lora_tensors += [None, None] if lo is None else [lo.A_ERI, lo.B_EOR]
    tensors = [x, *[t for t in dense if t is not None], *[t for t in lora_tensors if t is not None]]
    save = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    # The LoRA ranks need not be multiples of 16 bytes: the torch route pads them (a copy, laid out
    # as it needs); pairs it passes as they are have their layout checked.
    as_they_are = [t for lo in lora if lo is not None and grouped_torch.padded_rank(lo.rank, x.dtype) == lo.rank for t in (lo.A_ERI, lo.B_EOR)]
    engine = resolve_gemm(gemm, x, [D, F], [x, *[t for t in dense if t is not None], *as_they_are])
    decode = resolve_nf4_decode(nf4_decode, x.device)
    if engine == "torch" and decode == "fused":
        if nf4_decode == "fused":
            raise ValueError("nf4_decode='fused' needs gemm='triton' (torch._grouped_mm takes dense weights)")
        decode = "dequantize"
    if fold not in FOLDS:
        raise ValueError(f"fold must be one of {', '.join(FOLDS)}, got {fold!r}")
    if fold == "on" and engine != "torch":
        raise ValueError("fold='on' needs the torch._grouped_mm route (gemm='torch')")
    spec = _Spec(
        nf4=nf4, scales=tuple(lo.scale if lo is not None else 0.0 for lo in lora), save_for_backward=save,
        nf4_decode=decode, gemm=engine, keep=keep_dequantized, fold=fold == "on",
    )
    return GroupedSwiGLUFunction.apply(x, offsets, spec, *dense, *lora_tensors)
