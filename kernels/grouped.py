"""Grouped SwiGLU expert GEMM over expert-sorted rows, in Triton: dense or NF4 base weights (NF4
decoded per tile inside the kernel), LoRA fused, forward and backward as one autograd.Function.
Functional entry: `grouped_swiglu`; reference: `reference.grouped_swiglu_lora_reference`.

Math per expert e over its rows x (n of them):
  g = x Wg^T + sg (x Ag^T) Bg^T,  u = x Wu^T + su (x Au^T) Bu^T,  h = silu(g) * u,
  y = h Wd^T + sd (h Ad^T) Bd^T.
Backward: dh = dy Wd + sd (dy Bd) Ad; dg = dh * u * silu'(g); du = dh * silu(g);
  dx = dg Wg + du Wu + LoRA terms; per-expert weight/LoRA gradients as row reductions.

Kernels: `_grouped_mm_kernel` computes, for one (row tile, column tile), X @ W_logical with the
low-rank term X @ L1 accumulated in the same K loop (one read of each X tile serves both) and
applied as (X L1) @ L2 in the epilogue; an optional second operand is summed (dx) or combined by
SwiGLU (forward gate/up); a third epilogue turns dh into dg, du. `_grouped_wgrad_kernel` reduces
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

from .nf4 import nf4_kernel_args, nf4_values
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
    rows, row_mask, e, n_offs, n_mask, K, save_z,
    x_ptr, stride_xm,
    w_ptr, absmax_ptr, code_ptr, nabs_ptr, ncode_ptr, qoff_ptr, stride_we, stride_wk, stride_wn, numel,
    l1_ptr, stride_l1e, stride_l1k, stride_l1r, l2_ptr, stride_l2e, stride_l2r, stride_l2n, z_ptr, scale, R,
    NF4: tl.constexpr, NESTED: tl.constexpr, QBLOCK: tl.constexpr, NQBLOCK: tl.constexpr,
    LORA: tl.constexpr, SAVE_Z: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """fp32 [BM, BN] = X[rows] @ W_e[:, n] + scale * (X[rows] @ L1_e) @ L2_e[:, n].
    Stores X[rows] @ L1_e (in X's dtype) to z when SAVE_Z and save_z."""
    dt = x_ptr.dtype.element_ty
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    lacc = tl.zeros((BM, BR), dtype=tl.float32)
    r_offs = tl.arange(0, BR)
    r_mask = r_offs < R
    e64 = e.to(tl.int64)
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
            l1 = tl.load(
                l1_ptr + e64 * stride_l1e + k_offs[:, None] * stride_l1k + r_offs[None, :] * stride_l1r,
                mask=k_mask[:, None] & r_mask[None, :],
                other=0.0,
            )
            lacc = tl.dot(x, l1.to(dt), lacc, input_precision=DOT_PREC)
    if LORA:
        low = lacc.to(dt)
        if SAVE_Z:
            z_cols = R * save_z.to(tl.int32)  # only one column tile writes z
            z_mask = row_mask[:, None] & (r_offs < z_cols)[None, :]
            tl.store(z_ptr + rows.to(tl.int64)[:, None] * R + r_offs[None, :], low, mask=z_mask)
        l2 = tl.load(
            l2_ptr + e64 * stride_l2e + r_offs[:, None] * stride_l2r + n_offs[None, :] * stride_l2n,
            mask=r_mask[:, None] & n_mask[None, :],
            other=0.0,
        )
        acc += scale * tl.dot(low, l2.to(dt), input_precision=DOT_PREC)
    return acc


@triton.jit
def _grouped_mm_kernel(
    tile_expert_ptr, tile_row_ptr, offsets_ptr,
    out_ptr, g_ptr, u_ptr, du_ptr, h_ptr, stride_om, K, NOUT,
    x1_ptr, stride_x1m,
    w1_ptr, absmax1_ptr, code1_ptr, nabs1_ptr, ncode1_ptr, qoff1_ptr, stride_w1e, stride_w1k, stride_w1n, numel1,
    l1a_ptr, stride_l1ae, stride_l1ak, stride_l1ar, l1b_ptr, stride_l1be, stride_l1br, stride_l1bn, z1_ptr, scale1, R1,
    x2_ptr, stride_x2m,
    w2_ptr, absmax2_ptr, code2_ptr, nabs2_ptr, ncode2_ptr, qoff2_ptr, stride_w2e, stride_w2k, stride_w2n, numel2,
    l2a_ptr, stride_l2ae, stride_l2ak, stride_l2ar, l2b_ptr, stride_l2be, stride_l2br, stride_l2bn, z2_ptr, scale2, R2,
    NF4_1: tl.constexpr, NESTED_1: tl.constexpr, QBLOCK_1: tl.constexpr, NQBLOCK_1: tl.constexpr, LORA_1: tl.constexpr, SAVE_Z_1: tl.constexpr,
    NF4_2: tl.constexpr, NESTED_2: tl.constexpr, QBLOCK_2: tl.constexpr, NQBLOCK_2: tl.constexpr, LORA_2: tl.constexpr, SAVE_Z_2: tl.constexpr,
    MODE: tl.constexpr, DUAL: tl.constexpr, SAVE_AUX: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr, DOT_PREC: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(tile_expert_ptr + pid_m)
    # The tile list is an upper bound computed without a host sync; spare entries hold -1.
    if e >= 0:
        row_end = tl.load(offsets_ptr + e + 1)
        rows = tl.load(tile_row_ptr + pid_m) + tl.arange(0, BM)
        row_mask = rows < row_end
        n_offs = pid_n * BN + tl.arange(0, BN)
        n_mask = n_offs < NOUT
        save_z = pid_n == 0
        acc = project_tile(
            rows, row_mask, e, n_offs, n_mask, K, save_z, x1_ptr, stride_x1m,
            w1_ptr, absmax1_ptr, code1_ptr, nabs1_ptr, ncode1_ptr, qoff1_ptr, stride_w1e, stride_w1k, stride_w1n, numel1,
            l1a_ptr, stride_l1ae, stride_l1ak, stride_l1ar, l1b_ptr, stride_l1be, stride_l1br, stride_l1bn, z1_ptr, scale1, R1,
            NF4_1, NESTED_1, QBLOCK_1, NQBLOCK_1, LORA_1, SAVE_Z_1, BM, BN, BK, BR, DOT_PREC,
        )
        if DUAL:
            acc2 = project_tile(
                rows, row_mask, e, n_offs, n_mask, K, save_z, x2_ptr, stride_x2m,
                w2_ptr, absmax2_ptr, code2_ptr, nabs2_ptr, ncode2_ptr, qoff2_ptr, stride_w2e, stride_w2k, stride_w2n, numel2,
                l2a_ptr, stride_l2ae, stride_l2ak, stride_l2ar, l2b_ptr, stride_l2be, stride_l2br, stride_l2bn, z2_ptr, scale2, R2,
                NF4_2, NESTED_2, QBLOCK_2, NQBLOCK_2, LORA_2, SAVE_Z_2, BM, BN, BK, BR, DOT_PREC,
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
            h = acc * tl.sigmoid(acc) * acc2
            tl.store(out_ptr + offs, h.to(dt), mask=mask)
            if SAVE_AUX:
                tl.store(g_ptr + offs, acc.to(dt), mask=mask)
                tl.store(u_ptr + offs, acc2.to(dt), mask=mask)
        else:
            # acc = dh; g and u come from the forward pass
            g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            sig = tl.sigmoid(g)
            silu = g * sig
            tl.store(out_ptr + offs, (acc * u * (sig * (1.0 + g * (1.0 - sig)))).to(dt), mask=mask)
            tl.store(du_ptr + offs, (acc * silu).to(dt), mask=mask)
            if SAVE_AUX:
                tl.store(h_ptr + offs, (silu * u).to(dt), mask=mask)


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


# Fixed configs instead of @triton.autotune (which needs an explicit do_bench under the
# interpreter and costs minutes of tuning per shape). Two accumulators (gate and up) share a
# register file, hence the narrower N for the dual kernel. Small experts waste most of a 128-row
# tile, hence BM=64 below 128 rows per expert on average.
_GPU_CONFIGS = {
    ("single", 128): TileConfig(128, 128, 64, 8, 3),
    ("single", 64): TileConfig(64, 128, 64, 4, 4),
    ("dual", 128): TileConfig(128, 64, 64, 8, 3),
    ("dual", 64): TileConfig(64, 64, 64, 4, 4),
}
# The interpreter runs programs one at a time in numpy: small tiles keep the masks exercised.
_CPU_CONFIG = TileConfig(16, 32, 32, 1, 1)


def tile_config(
    kind: str, n_rows: int, n_experts: int, device: torch.device, block_m: int | None = None, dtype: torch.dtype = torch.bfloat16,
    lora: bool = False,
) -> TileConfig:
    """kind: "single" (one projection) or "dual" (gate and up, or the two halves of dx).
    block_m forces the row tile (a combine plan fixes it); otherwise it follows rows per expert.
    lora: an operand has a LoRA pair (its reduction tile is narrower on a GPU; block_n stays)."""
    if device.type != "cuda":
        return _CPU_CONFIG if block_m is None else replace(_CPU_CONFIG, block_m=block_m)
    if block_m is None:
        block_m = 128 if n_rows / max(n_experts, 1) >= 128 else 64
    cfg = _GPU_CONFIGS.get((kind, block_m)) or replace(_GPU_CONFIGS[(kind, 64)], block_m=block_m)
    if dtype == torch.float32:
        # 4-byte tiles: 3 stages of 128x64 + 64x128 fp32 would take ~192 KB of shared memory.
        cfg = replace(cfg, block_n=64, block_k=32, num_stages=2)
    if lora:
        # With bf16 and 64-wide reduction tiles the adapter's dot (x @ L1, N = 16) read shared
        # memory out of bounds on an H200 (compute-sanitizer, Triton 3.6): wrong input gradients,
        # then an illegal address. 32 x 2 stages passed the same tests; 64 x 1 stage and 32-wide
        # columns did not.
        cfg = replace(cfg, block_k=min(cfg.block_k, 32), num_stages=min(cfg.num_stages, 2))
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


_NO_OPERAND = [None] * 23
_NO_FLAGS = (False, False, 64, 256, False, False)
LORA_FLAG = 4  # where operand_args' constexpr flags say whether the operand has a LoRA pair


def operand_args(x: torch.Tensor, w, transpose: bool, lora: LoRA | None, z: torch.Tensor | None):
    """Kernel arguments for one operand X @ W' (+ scale (X L1) L2): W' = W^T when `transpose`
    (a forward projection) else W (an input gradient); L1, L2 = A^T, B^T or B, A accordingly.
    Returns (23 runtime args, 6 constexpr flags)."""
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
        largs = [None, 0, 0, 0, None, 0, 0, 0, None, 0.0, 0]
    else:
        A, B = lora.A_ERI, lora.B_EOR
        if transpose:
            first, fk, fr, second, sr, sn2 = A, A.stride(2), A.stride(1), B, B.stride(2), B.stride(1)
        else:
            first, fk, fr, second, sr, sn2 = B, B.stride(1), B.stride(2), A, A.stride(1), A.stride(2)
        largs = [first, first.stride(0), fk, fr, second, second.stride(0), sr, sn2, z, float(lora.scale), lora.rank]
    return [x, x.stride(0), *wargs, *largs], (*nf4, lora is not None, z is not None)


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
) -> None:
    """out[N, O] (+ epilogue outputs) from operand(s) given as operand_args(...) argument tuples."""
    x = op1[0][0]
    N, K = x.shape
    NOUT = out.shape[1]
    if N == 0 or NOUT == 0:
        return
    E = offsets_E1.numel() - 1
    lora = op1[1][LORA_FLAG] or (op2 is not None and op2[1][LORA_FLAG])
    cfg = config or tile_config("dual" if op2 is not None else "single", N, E, x.device, dtype=x.dtype, lora=lora)
    tile_expert, tile_row = row_tiles(offsets_E1, N, cfg.block_m)
    ranks = [op1[0][-1]] + ([op2[0][-1]] if op2 is not None else [])
    args2, flags2 = op2 if op2 is not None else (_NO_OPERAND, _NO_FLAGS)
    grid = (tile_expert.numel(), triton.cdiv(NOUT, cfg.block_n))
    br = _pow2_at_least_16(max(ranks))

    def launch(c: TileConfig) -> None:
        _grouped_mm_kernel[grid](
            tile_expert, tile_row, offsets_E1,
            out, g, u, du, h, out.stride(0), K, NOUT,
            *op1[0], *args2,
            *op1[1], *flags2,
            MODE=mode, DUAL=op2 is not None, SAVE_AUX=save_aux,
            BM=c.block_m, BN=c.block_n, BK=c.block_k, BR=br,
            DOT_PREC=_dot_precision(x.dtype),
            num_warps=c.num_warps, num_stages=c.num_stages,
            # Keeps in-kernel NF4 decoding bit-identical to dequantize_4bit (no FMA in the nested scale).
            enable_fp_fusion=False,
        )

    launch_fitted("grouped_mm", (x.device, x.dtype, mode, save_aux, br, op1[1], flags2), cfg, launch)


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


@dataclass(frozen=True)
class _Spec:
    nf4: tuple  # (NF4Weight | None) per matrix: gate, up, down
    scales: tuple  # LoRA scale per matrix (unused where there is no LoRA)
    save_for_backward: bool


class GroupedSwiGLUFunction(torch.autograd.Function):
    """Inputs: x [N, D] (compute dtype), offsets [E1] int64, spec, then the dense weights
    (None where NF4), then LoRA A, B per matrix (None where absent)."""

    @staticmethod
    def forward(ctx, x, offsets, spec: _Spec, wg, wu, wd, ag, bg, au, bu, ad, bd):
        weights = [spec.nf4[i] if w is None else w for i, w in enumerate((wg, wu, wd))]
        loras = [LoRA(a, b, s) if a is not None else None for a, b, s in zip((ag, au, ad), (bg, bu, bd), spec.scales)]
        N, D = x.shape
        F = weight_shape(weights[0])[1]
        save = spec.save_for_backward
        h = x.new_empty((N, F))
        g = x.new_empty((N, F)) if save else None
        u = x.new_empty((N, F)) if save else None
        z = [x.new_empty((N, lo.rank)) if save and lo is not None else None for lo in loras]
        launch_grouped_mm(
            MODE_SWIGLU, offsets, h,
            operand_args(x, weights[0], True, loras[0], z[0]),
            operand_args(x, weights[1], True, loras[1], z[1]),
            g=g, u=u, save_aux=save,
        )
        y = x.new_empty((N, D))
        launch_grouped_mm(MODE_PLAIN, offsets, y, operand_args(h, weights[2], True, loras[2], z[2]))
        if save:
            ctx.spec = spec
            ctx.save_for_backward(x, offsets, g, u, *z, wg, wu, wd, ag, bg, au, bu, ad, bd)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, offsets, g, u, zg, zu, zd, wg, wu, wd, ag, bg, au, bu, ad, bd = ctx.saved_tensors
        spec = ctx.spec
        needs = ctx.needs_input_grad
        weights = [spec.nf4[i] if w is None else w for i, w in enumerate((wg, wu, wd))]
        loras = [LoRA(a, b, s) if a is not None else None for a, b, s in zip((ag, au, ad), (bg, bu, bd), spec.scales)]
        dy = dy.to(x.dtype).contiguous()
        N, D = x.shape
        F = g.shape[1]
        need_dA = (needs[6], needs[8], needs[10])
        need_dB = (needs[7], needs[9], needs[11])
        need_dW = (needs[3], needs[4], needs[5])

        # dh = dy Wd + sd (dy Bd) Ad, turned into dg, du (and h, recomputed, for the down-projection grads)
        dg, du = x.new_empty((N, F)), x.new_empty((N, F))
        need_h = need_dW[2] or need_dA[2]
        h = x.new_empty((N, F)) if need_h else None
        zb = [x.new_empty((N, lo.rank)) if lo is not None and need_dA[i] else None for i, lo in enumerate(loras)]
        launch_grouped_mm(MODE_SWIGLU_BWD, offsets, dg, operand_args(dy, weights[2], False, loras[2], zb[2]), g=g, u=u, du=du, h=h, save_aux=need_h)

        dx = None
        if needs[0] or need_dA[0] or need_dA[1]:
            dx = x.new_empty((N, D))
            launch_grouped_mm(
                MODE_PLAIN, offsets, dx,
                operand_args(dg, weights[0], False, loras[0], zb[0]),
                operand_args(du, weights[1], False, loras[1], zb[1]),
            )

        def wgrad(p, q, like, scale=1.0):
            return grouped_wgrad(p, q, offsets, torch.empty_like(like, memory_format=torch.contiguous_format), scale)

        d_in = (dg, du, dy)  # gradient at each projection's output
        x_in = (x, x, h)  # each projection's input
        dW = [wgrad(d_in[i], x_in[i], w) if need_dW[i] else None for i, w in enumerate((wg, wu, wd))]
        dA, dB = [None] * 3, [None] * 3
        for i, (lo, zf) in enumerate(zip(loras, (zg, zu, zd))):
            if lo is None:
                continue
            if need_dB[i]:
                dB[i] = wgrad(d_in[i], zf, lo.B_EOR, lo.scale)
            if need_dA[i]:
                dA[i] = wgrad(zb[i], x_in[i], lo.A_ERI, lo.scale)
        return (dx if needs[0] else None), None, None, *dW, dA[0], dB[0], dA[1], dB[1], dA[2], dB[2]


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


def grouped_swiglu(x_sorted_ND: torch.Tensor, offsets_E1: torch.Tensor, weights, lora=None) -> torch.Tensor:
    """y_sorted_ND for rows sorted by expert (offsets_E1[e]:offsets_E1[e+1] belong to expert e).
    weights = (gate [E,F,D], up [E,F,D], down [E,D,F]), each a tensor or an NF4Weight; lora =
    (gate, up, down) LoRA pairs, each optional. Computes in x's dtype (the autocast dtype under
    autocast), accumulating in fp32. Gradients flow to x, LoRA A/B, and dense weights that
    require grad; NF4 bases are frozen."""
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
    spec = _Spec(nf4=nf4, scales=tuple(lo.scale if lo is not None else 0.0 for lo in lora), save_for_backward=save)
    return GroupedSwiGLUFunction.apply(x, offsets, spec, *dense, *lora_tensors)
