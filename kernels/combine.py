"""Tile-level signaled combine (the overlap of arXiv 2607.19539, used here for training, forward and
backward). A persistent producer walks the plan's tile worklist (remote-bound tiles first),
computes each output tile of an expert projection, stores it, and raises the tile's ready flag with
release semantics. A consumer on a few programs polls the flags with acquire semantics and copies
each ready tile to its destination rank's buffer: a peer's symmetric-memory buffer on a multi-GPU
node, a local buffer on one device. Plan: `combine_plan.build_combine_plan`; reference:
`reference.combine_reference` after the grouped kernel (compute, then copy).

Forward: the producer computes y = h Wd^T (+ LoRA) in the padded layout and the consumer moves
rows to the ranks that own their tokens. Backward: the producer computes dx = dg Wg + du Wu
(+ LoRA), and the same plan (built with each row's token-owner rank) moves input gradients home.

Flags hold an epoch: a tile is ready when its flag equals the epoch of the current round, so a
flag buffer is reused by incrementing the epoch instead of clearing it between rounds.

Legend: P padded rows, O output columns, T tiles, R ranks.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .combine_plan import CombinePlan
from .grouped import _NO_FLAGS, _NO_OPERAND, TileConfig, _dot_precision, _pow2_at_least_16, launch_fitted, low_rank, operand_args, project_tile, tile_config
from .weights import LoRA, weight_shape


@triton.jit
def _producer_kernel(
    tile_row_ptr, tile_expert_ptr, tile_valid_ptr, num_tiles, num_programs,
    y_ptr, stride_ym, flags_ptr, epoch, K, NOUT,
    x1_ptr, stride_x1m,
    w1_ptr, absmax1_ptr, code1_ptr, nabs1_ptr, ncode1_ptr, qoff1_ptr, stride_w1e, stride_w1k, stride_w1n, numel1,
    l1_ptr, stride_l1e, stride_l1r, stride_l1n, z1_ptr, stride_z1m, scale1, R1,
    x2_ptr, stride_x2m,
    w2_ptr, absmax2_ptr, code2_ptr, nabs2_ptr, ncode2_ptr, qoff2_ptr, stride_w2e, stride_w2k, stride_w2n, numel2,
    l2_ptr, stride_l2e, stride_l2r, stride_l2n, z2_ptr, stride_z2m, scale2, R2,
    NF4_1: tl.constexpr, NESTED_1: tl.constexpr, QBLOCK_1: tl.constexpr, NQBLOCK_1: tl.constexpr, LORA_1: tl.constexpr,
    NF4_2: tl.constexpr, NESTED_2: tl.constexpr, QBLOCK_2: tl.constexpr, NQBLOCK_2: tl.constexpr, LORA_2: tl.constexpr,
    DUAL: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr, DOT_PREC: tl.constexpr,
):
    pid = tl.program_id(0)
    tiles_n = tl.cdiv(NOUT, BN)
    # Work item i = (tile i // tiles_n, column block i % tiles_n): the worklist order, remote first.
    for item in range(pid, num_tiles * tiles_n, num_programs):
        t = item // tiles_n
        pn = item % tiles_n
        e = tl.load(tile_expert_ptr + t)
        local = tl.arange(0, BM)
        rows = tl.load(tile_row_ptr + t) + local
        row_mask = local < tl.load(tile_valid_ptr + t)
        n_offs = pn * BN + tl.arange(0, BN)
        n_mask = n_offs < NOUT
        acc = project_tile(
            rows, row_mask, e, n_offs, n_mask, K, x1_ptr, stride_x1m,
            w1_ptr, absmax1_ptr, code1_ptr, nabs1_ptr, ncode1_ptr, qoff1_ptr, stride_w1e, stride_w1k, stride_w1n, numel1,
            l1_ptr, stride_l1e, stride_l1r, stride_l1n, z1_ptr, stride_z1m, scale1, R1,
            NF4_1, NESTED_1, QBLOCK_1, NQBLOCK_1, LORA_1, BM, BN, BK, BR, DOT_PREC,
        )
        if DUAL:
            acc += project_tile(
                rows, row_mask, e, n_offs, n_mask, K, x2_ptr, stride_x2m,
                w2_ptr, absmax2_ptr, code2_ptr, nabs2_ptr, ncode2_ptr, qoff2_ptr, stride_w2e, stride_w2k, stride_w2n, numel2,
                l2_ptr, stride_l2e, stride_l2r, stride_l2n, z2_ptr, stride_z2m, scale2, R2,
                NF4_2, NESTED_2, QBLOCK_2, NQBLOCK_2, LORA_2, BM, BN, BK, BR, DOT_PREC,
            )
        ptrs = y_ptr + rows.to(tl.int64)[:, None] * stride_ym + n_offs[None, :]
        tl.store(ptrs, acc.to(y_ptr.dtype.element_ty), mask=row_mask[:, None] & n_mask[None, :])
        # Every thread's stores happen-before the flag: the CTA barrier orders them before the
        # one thread that issues the (cumulative) release.
        tl.debug_barrier()
        tl.atomic_xchg(flags_ptr + item, epoch, sem="release", scope="gpu")


@triton.jit
def _consumer_kernel(
    y_ptr, stride_ym, tile_row_ptr, tile_dest_ptr, tile_remote_row_ptr, tile_valid_ptr, num_tiles, num_programs,
    flags_ptr, epoch, dest_ptrs_ptr, stride_dm, NOUT, max_spins, timeouts_ptr,
    BM: tl.constexpr, BN: tl.constexpr, CHUNK: tl.constexpr,
):
    pid = tl.program_id(0)
    tiles_n = tl.cdiv(NOUT, BN)
    for item in range(pid, num_tiles * tiles_n, num_programs):
        ready = (tl.atomic_add(flags_ptr + item, 0, sem="acquire", scope="gpu") == epoch).to(tl.int32)
        spins = 0
        while (ready == 0) & (spins < max_spins):
            ready = (tl.atomic_add(flags_ptr + item, 0, sem="acquire", scope="gpu") == epoch).to(tl.int32)
            spins += 1
        tl.debug_barrier()
        if ready != 0:
            t = item // tiles_n
            pn = item % tiles_n
            local = tl.arange(0, BM)
            row_mask = local < tl.load(tile_valid_ptr + t)
            src_rows = (tl.load(tile_row_ptr + t) + local).to(tl.int64)
            dest = tl.load(dest_ptrs_ptr + tl.load(tile_dest_ptr + t)).to(tl.pointer_type(y_ptr.dtype.element_ty))
            dst_rows = (tl.load(tile_remote_row_ptr + t) + local).to(tl.int64)
            # CHUNK columns at a time: a whole 128 x 256 tile in one load would spill registers.
            for c0 in tl.static_range(0, BN, CHUNK):
                n_offs = pn * BN + c0 + tl.arange(0, CHUNK)
                mask = row_mask[:, None] & (n_offs < NOUT)[None, :]
                # .cg: read at L2, where the producer's stores from other SMs are visible.
                tile = tl.load(y_ptr + src_rows[:, None] * stride_ym + n_offs[None, :], mask=mask, other=0.0, cache_modifier=".cg")
                tl.store(dest + dst_rows[:, None] * stride_dm + n_offs[None, :], tile, mask=mask)
        else:
            tl.atomic_add(timeouts_ptr, 1)


# Consumer programs by default. On an H200 (8 destinations, 16,384 rows x 4096, bf16) the combine
# took 5.5 ms with 4, 2.9 with 8 and 1.6 with 16 consumers (compute-then-copy: 1.37 ms): each
# consumer copies its tiles one at a time behind a flag poll, so a few cannot keep up.
CONSUMER_PROGRAMS = 16


def _plan_on(plan: CombinePlan, device: torch.device) -> CombinePlan:
    return plan if plan.tile_row_T.device == device else plan.to(device)


def producer_config(plan: CombinePlan, dual: bool, device, dtype: torch.dtype = torch.bfloat16) -> TileConfig:
    """The producer's tiles: block_m from the plan; the consumer must use the same block_n."""
    return tile_config("dual" if dual else "single", plan.padded_rows, plan.num_experts, torch.device(device), block_m=plan.block_m, dtype=dtype)


def num_flags(plan: CombinePlan, n_out: int, block_n: int) -> int:
    return plan.num_tiles * triton.cdiv(n_out, block_n)


def default_producer_programs(device: torch.device, consumer_programs: int) -> int:
    """A persistent grid that leaves SMs for the consumer, so both run at once."""
    if device.type != "cuda":
        return 2
    return max(1, torch.cuda.get_device_properties(device).multi_processor_count - consumer_programs)


def produce_tiles(
    plan: CombinePlan,
    y_PO: torch.Tensor,
    flags: torch.Tensor,
    epoch: int,
    op1: tuple,
    op2: tuple | None = None,
    num_programs: int | None = None,
) -> TileConfig:
    """Producer launch: y_PO tiles from operand_args tuples (input rows in the padded layout);
    flags[t * tiles_n + n] = epoch after each tile's store. Returns the tile config (its block_n
    is the consumer's)."""
    x = op1[0][0]
    K, NOUT = x.shape[1], y_PO.shape[1]
    args2, flags2 = op2 if op2 is not None else (_NO_OPERAND, _NO_FLAGS)
    cfg = producer_config(plan, op2 is not None, x.device, x.dtype)
    if flags.numel() < num_flags(plan, NOUT, cfg.block_n):
        raise ValueError(f"flags needs {num_flags(plan, NOUT, cfg.block_n)} entries, has {flags.numel()}")
    if plan.num_tiles == 0 or NOUT == 0:
        return cfg
    plan = _plan_on(plan, x.device)
    programs = num_programs or default_producer_programs(x.device, 0)
    ranks = [op1[0][-1]] + ([op2[0][-1]] if op2 is not None else [])
    br = _pow2_at_least_16(max(ranks))

    def launch(c: TileConfig) -> None:
        _producer_kernel[(programs,)](
            plan.tile_row_T, plan.tile_expert_T, plan.tile_valid_T, plan.num_tiles, programs,
            y_PO, y_PO.stride(0), flags, epoch, K, NOUT,
            *op1[0], *args2, *op1[1], *flags2,
            DUAL=op2 is not None,
            BM=c.block_m, BN=c.block_n, BK=c.block_k, BR=br, DOT_PREC=_dot_precision(x.dtype),
            num_warps=c.num_warps, num_stages=c.num_stages, enable_fp_fusion=False,
        )

    # block_n stays as the consumer was told: only stages and block_k shrink
    return launch_fitted("combine_producer", (x.device, x.dtype, op2 is not None, br, op1[1], flags2), cfg, launch)


def consume_tiles(
    plan: CombinePlan,
    y_PO: torch.Tensor,
    flags: torch.Tensor,
    epoch: int,
    dest_buffers: list[torch.Tensor],
    block_n: int,
    num_programs: int = CONSUMER_PROGRAMS,
    max_spins: int = 2**24,
) -> torch.Tensor:
    """Consumer launch: copies every ready tile of y_PO to dest_buffers[tile_dest] (each [rows_d, O],
    one row stride for all; peer symmetric-memory buffers or local tensors). block_n: the
    producer's. A tile whose flag does not reach `epoch` within max_spins polls is skipped and
    counted. Returns the count (int32 [1]; read it after the stream is synchronized)."""
    NOUT = y_PO.shape[1]
    timeouts = torch.zeros(1, dtype=torch.int32, device=y_PO.device)
    if plan.num_tiles == 0 or NOUT == 0:
        return timeouts
    plan = _plan_on(plan, y_PO.device)
    if len(dest_buffers) != plan.num_ranks:
        raise ValueError(f"need one destination buffer per rank ({plan.num_ranks}), got {len(dest_buffers)}")
    stride = dest_buffers[0].stride(0)
    for r, b in enumerate(dest_buffers):
        if b.dtype != y_PO.dtype or b.shape[1] != NOUT or b.stride(0) != stride or b.stride(1) != 1:
            raise ValueError(f"destination buffer {r} must be {y_PO.dtype} [rows, {NOUT}] with row stride {stride}, got {b.dtype} {list(b.shape)} strides {b.stride()}")
    ptrs = torch.tensor([b.data_ptr() for b in dest_buffers], dtype=torch.int64, device=y_PO.device)
    _consumer_kernel[(num_programs,)](
        y_PO, y_PO.stride(0), plan.tile_row_T, plan.tile_dest_T, plan.tile_remote_row_T, plan.tile_valid_T, plan.num_tiles, num_programs,
        flags, epoch, ptrs, stride, NOUT, max_spins, timeouts,
        BM=plan.block_m, BN=block_n, CHUNK=min(block_n, 64), num_warps=4,
    )
    return timeouts


def _run(plan, y_PO, op1, op2, dest_buffers, producer_programs, consumer_programs, overlap, flags, epoch):
    device = y_PO.device
    block_n = producer_config(plan, op2 is not None, device, y_PO.dtype).block_n
    if flags is None:
        flags = torch.zeros(num_flags(plan, y_PO.shape[1], block_n), dtype=torch.int32, device=device)
        epoch = 1
    if overlap and device.type == "cuda":
        side = torch.cuda.Stream(device=device)
        side.wait_stream(torch.cuda.current_stream(device))  # flags and inputs are ready first (not the producer)
        # The producer is launched first: a consumer spinning on the GPU while the producer's
        # first launch loads its module (lazily, at that launch) can wait forever on the load.
        produce_tiles(plan, y_PO, flags, epoch, op1, op2, producer_programs or default_producer_programs(device, consumer_programs))
        with torch.cuda.stream(side):
            for t in (y_PO, flags, *dest_buffers):
                t.record_stream(side)
            timeouts = consume_tiles(plan, y_PO, flags, epoch, dest_buffers, block_n, consumer_programs)
        torch.cuda.current_stream(device).wait_stream(side)
    else:
        # One after the other: the interpreter runs programs in pid order, so a consumer running
        # first would spin on flags no program can raise yet.
        produce_tiles(plan, y_PO, flags, epoch, op1, op2, producer_programs)
        timeouts = consume_tiles(plan, y_PO, flags, epoch, dest_buffers, block_n, consumer_programs)
    return timeouts


def signaled_down_projection(
    plan: CombinePlan,
    h_PF: torch.Tensor,
    w_down,
    lora_down: LoRA | None,
    dest_buffers: list[torch.Tensor],
    *,
    z_PR: torch.Tensor | None = None,
    producer_programs: int | None = None,
    consumer_programs: int = CONSUMER_PROGRAMS,
    overlap: bool = True,
    flags: torch.Tensor | None = None,
    epoch: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward: y = h Wd^T (+ sd (h Ad^T) Bd^T) per tile, each tile moved to its destination as soon
    as it is stored. h in the padded layout (plan.pad_rows). z_PR, if given, receives h Ad^T for the
    LoRA backward. Returns (y_PD, consumer timeouts)."""
    D = weight_shape(w_down)[1]
    y_PD = h_PF.new_empty((plan.padded_rows, D))
    h_PF = h_PF.contiguous()
    plan = _plan_on(plan, h_PF.device)  # once: the launches below find it there
    (z,) = low_rank(h_PF, plan.offsets_E1, [lora_down], True)
    if z is not None and z_PR is not None:
        z_PR.copy_(z)
        z = z_PR
    op1 = operand_args(h_PF, w_down, True, lora_down, z)
    return y_PD, _run(plan, y_PD, op1, None, dest_buffers, producer_programs, consumer_programs, overlap, flags, epoch)


def signaled_input_grad(
    plan: CombinePlan,
    dg_PF: torch.Tensor,
    du_PF: torch.Tensor,
    w_gate,
    w_up,
    lora_gate: LoRA | None,
    lora_up: LoRA | None,
    dest_buffers: list[torch.Tensor],
    *,
    producer_programs: int | None = None,
    consumer_programs: int = CONSUMER_PROGRAMS,
    overlap: bool = True,
    flags: torch.Tensor | None = None,
    epoch: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Backward: dx = dg Wg + du Wu (+ LoRA terms) per tile, each tile moved to the rank that owns
    its token as soon as it is stored. Returns (dx_PD, consumer timeouts)."""
    D = weight_shape(w_gate)[2]
    dx_PD = dg_PF.new_empty((plan.padded_rows, D))
    dg_PF, du_PF = dg_PF.contiguous(), du_PF.contiguous()
    plan = _plan_on(plan, dg_PF.device)  # once: the launches below find it there
    (zg,), (zu,) = low_rank(dg_PF, plan.offsets_E1, [lora_gate], False), low_rank(du_PF, plan.offsets_E1, [lora_up], False)
    op1 = operand_args(dg_PF, w_gate, False, lora_gate, zg)
    op2 = operand_args(du_PF, w_up, False, lora_up, zu)
    return dx_PD, _run(plan, dx_PD, op1, op2, dest_buffers, producer_programs, consumer_programs, overlap, flags, epoch)
