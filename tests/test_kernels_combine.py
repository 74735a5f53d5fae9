"""Tile-level signaled combine (kernels/combine_plan.py, kernels/combine.py): the plan builder's
invariants (property-tested), and producer-then-consumer reproducing the compute-then-copy
reference combine bit for bit, forward (down projection) and backward (input gradient). In the
interpreter programs run one at a time, so producer and consumer are two launches; running them
concurrently on two streams is a GPU test."""

from __future__ import annotations

import pytest
import torch

try:  # the GPU image may lack hypothesis; only the property test needs it
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from conftest import EXPLORE_FACTOR
except ImportError:
    st = None

from growtrain.kernels.combine_plan import build_combine_plan
from growtrain.kernels.reference import combine_reference, grouped_swiglu_lora_reference
from kernel_testing import TRITON_MISSING, assert_close, assert_equal, needs_cuda, needs_triton

# --- the plan: a pure function ----------------------------------------------------------------


def check_plan_invariants(plan, expert_S, dest_S, base_R):
    S, BM, R = expert_S.numel(), plan.block_m, plan.num_ranks
    src = plan.src_row_P
    # every input row sits in exactly one padded row, and back
    assert sorted(src[src >= 0].tolist()) == list(range(S))
    assert torch.equal(src[plan.pos_S], torch.arange(S))
    assert plan.offsets_E1[0] == 0 and plan.offsets_E1[-1] == plan.padded_rows
    covered = torch.zeros(plan.padded_rows, dtype=torch.bool)
    seen_local = False
    for t in range(plan.num_tiles):
        row, e, d = int(plan.tile_row_T[t]), int(plan.tile_expert_T[t]), int(plan.tile_dest_T[t])
        valid, remote = int(plan.tile_valid_T[t]), int(plan.tile_remote_row_T[t])
        # remote-bound tiles first
        if d == plan.rank:
            seen_local = True
        else:
            assert not seen_local, f"tile {t} goes to rank {d} after a local tile"
        assert t < plan.num_remote_tiles or d == plan.rank
        assert 1 <= valid <= BM and plan.offsets_E1[e] <= row and row + BM <= plan.offsets_E1[e + 1]
        rows = src[row : row + BM]
        # valid rows first, then padding; one expert and one destination per tile
        assert (rows[:valid] >= 0).all() and (rows[valid:] < 0).all()
        s = rows[:valid]
        assert (expert_S[s] == e).all() and (dest_S[s] == d).all()
        # contiguous rows at the destination
        assert torch.equal(plan.dest_row_S[s], remote + torch.arange(valid))
        assert not covered[row : row + valid].any()
        covered[row : row + valid] = True
    assert int(covered.sum()) == S
    for d in range(R):
        rows_d = plan.dest_row_S[dest_S == d]
        assert sorted(rows_d.tolist()) == list(range(int(base_R[d]), int(base_R[d]) + int(plan.rows_to_R[d])))


if st is not None:

    @st.composite
    def plan_inputs(draw):
        E = draw(st.integers(1, 5))
        R = draw(st.integers(1, 4))
        S = draw(st.integers(0, 50))
        expert = draw(st.lists(st.integers(0, E - 1), min_size=S, max_size=S))
        dest = draw(st.lists(st.integers(0, R - 1), min_size=S, max_size=S))
        rank = draw(st.integers(0, R - 1))
        bm = draw(st.sampled_from([1, 2, 3, 16]))
        base = draw(st.lists(st.integers(0, 7), min_size=R, max_size=R))
        return E, R, rank, bm, torch.tensor(expert, dtype=torch.int64), torch.tensor(dest, dtype=torch.int64), torch.tensor(base)

    @settings(max_examples=80 * EXPLORE_FACTOR, deadline=None)
    @given(plan_inputs())
    def test_plan_gives_every_tile_one_destination_and_lands_rows_contiguously(inputs):
        E, R, rank, bm, expert_S, dest_S, base_R = inputs
        plan = build_combine_plan(expert_S, dest_S, E, R, rank, bm, base_R)
        check_plan_invariants(plan, expert_S, dest_S, base_R)

else:

    @pytest.mark.skip(reason="hypothesis is not installed (the 'test' extra)")
    def test_plan_gives_every_tile_one_destination_and_lands_rows_contiguously():
        pass


def test_plan_pads_each_rank_segment_and_orders_remote_tiles_first():
    # expert 0: rows to ranks 1, 0, 1; expert 1: one row to rank 0. This is rank 0; block of 2.
    plan = build_combine_plan(torch.tensor([0, 0, 0, 1]), torch.tensor([1, 0, 1, 0]), 2, 2, rank=0, block_m=2)
    assert plan.src_row_P.tolist() == [1, -1, 0, 2, 3, -1]  # (e0, r0) padded, (e0, r1) full, (e1, r0) padded
    assert plan.offsets_E1.tolist() == [0, 4, 6]
    assert plan.tile_dest_T.tolist() == [1, 0, 0] and plan.num_remote_tiles == 1
    assert plan.tile_row_T.tolist() == [2, 0, 4] and plan.tile_valid_T.tolist() == [2, 1, 1]
    assert plan.tile_remote_row_T.tolist() == [0, 0, 1]
    assert plan.dest_row_S.tolist() == [0, 0, 1, 1] and plan.rows_to_R.tolist() == [2, 2]


def test_plan_rejects_bad_ids_with_every_problem_named():
    with pytest.raises(ValueError) as err:
        build_combine_plan(torch.tensor([0, 3]), torch.tensor([0]), 2, 2, rank=5, block_m=4)
    assert "one entry per row" in str(err.value) and "rank must be in 0..1" in str(err.value)


# --- producer and consumer (the plan tests above need no Triton) ---------------------------------

if TRITON_MISSING is None:
    from growtrain.kernels.combine import consume_tiles, produce_tiles, producer_config, signaled_down_projection, signaled_input_grad
    from growtrain.kernels.grouped import MODE_PLAIN, MODE_SWIGLU, launch_grouped_mm, low_rank, operand_args
from growtrain.kernels.weights import LoRA, NF4Weight

D, F, R_LORA = 40, 24, 3
BM_CPU = 16  # the interpreter's row tile


def _routing(name: str, gen: torch.Generator):
    """(expert_S sorted, dest_S, E, ranks, rank) for a named case."""
    if name == "top2_three_ranks":
        T, E, K, ranks = 23, 4, 2, 3
        idx_TK = torch.rand(T, E, generator=gen).topk(K, dim=1).indices
        owner_T = torch.randint(0, ranks, (T,), generator=gen)
        expert_S, dest_S = idx_TK.reshape(-1), owner_T.repeat_interleave(K)
    elif name == "top8_two_ranks":
        T, E, ranks = 4, 8, 2
        expert_S = torch.arange(E).repeat(T)
        dest_S = torch.randint(0, ranks, (T,), generator=gen).repeat_interleave(E)
    elif name == "all_rows_on_one_expert":
        E, ranks = 3, 2
        expert_S, dest_S = torch.full((21,), 1), torch.randint(0, ranks, (21,), generator=gen)
    elif name == "fewer_rows_than_a_block":
        E, ranks = 4, 3
        expert_S, dest_S = torch.tensor([0, 2, 2]), torch.tensor([2, 0, 1])
    elif name == "everything_local":
        E, ranks = 3, 2
        expert_S, dest_S = torch.randint(0, E, (18,), generator=gen), torch.ones(18, dtype=torch.int64)
    elif name == "no_rows":
        E, ranks = 3, 2
        expert_S = dest_S = torch.zeros(0, dtype=torch.int64)
    else:
        raise KeyError(name)
    order = torch.argsort(expert_S, stable=True)  # rows as the MoE layer hands them: sorted by expert
    return expert_S[order], dest_S[order], E, ranks, 1 % ranks


CASES = ["top2_three_ranks", "top8_two_ranks", "all_rows_on_one_expert", "fewer_rows_than_a_block", "everything_local", "no_rows"]


def _offsets(expert_S, E):
    off = torch.zeros(E + 1, dtype=torch.int64)
    off[1:] = torch.cumsum(torch.bincount(expert_S, minlength=E), 0)
    return off


def _buffers(plan, width):
    # NaN-filled: a row the consumer fails to write cannot pass for a copied one.
    return [torch.full((int(n), width), float("nan")) for n in plan.rows_to_R]


def _weights(fmt, E, gen):
    wd = torch.randn(E, D, F, generator=gen) * 0.3
    wg, wu = torch.randn(E, F, D, generator=gen) * 0.3, torch.randn(E, F, D, generator=gen) * 0.3
    if fmt == "dense":
        return wg, wu, wd, (None, None, None)
    lora = tuple(LoRA(torch.randn(E, R_LORA, i, generator=gen), torch.randn(E, o, R_LORA, generator=gen), 0.5) for o, i in ((F, D), (F, D), (D, F)))
    return (
        NF4Weight.quantize(wg, compress_statistics=True),
        NF4Weight.quantize(wu),
        NF4Weight.quantize(wd.transpose(1, 2).contiguous(), compress_statistics=True, transposed=True),
        lora,
    )


@needs_triton
@pytest.mark.parametrize("fmt", ["dense", "nf4_lora"])
@pytest.mark.parametrize("case", CASES)
def test_forward_producer_then_consumer_reproduces_compute_then_copy_bit_for_bit(case, fmt):
    gen = torch.Generator().manual_seed(11)
    expert_S, dest_S, E, ranks, rank = _routing(case, gen)
    plan = build_combine_plan(expert_S, dest_S, E, ranks, rank, BM_CPU)
    _, _, wd, lora = _weights(fmt, E, gen)
    h_SF = torch.randn(expert_S.numel(), F, generator=gen)
    # compute, then copy: the grouped kernel over the same padded tiles the producer computes (in
    # Triton's interpreter a tile is a BLAS call, whose rounding may depend on how rows fall into
    # it on some CPUs: AMD EPYC's OpenBLAS), then the reference combine of the unpadded rows
    y_PD = torch.empty(plan.padded_rows, D)
    h_PF = plan.pad_rows(h_SF)
    (z,) = low_rank(h_PF, plan.offsets_E1, [lora[2]], True)
    launch_grouped_mm(MODE_PLAIN, plan.offsets_E1, y_PD, operand_args(h_PF, wd, True, lora[2], z))
    y_SD = y_PD[plan.pos_S]
    want = combine_reference(y_SD, plan.dest_S, plan.dest_row_S, _buffers(plan, D))
    got = _buffers(plan, D)
    z_PR = torch.full((plan.padded_rows, R_LORA), float("nan")) if lora[2] is not None else None
    _, timeouts = signaled_down_projection(plan, plan.pad_rows(h_SF), wd, lora[2], got, z_PR=z_PR, producer_programs=3, consumer_programs=2)
    assert int(timeouts) == 0
    for r in range(ranks):
        assert_equal(f"rank {r} buffer", got[r], want[r])
    if z_PR is not None and expert_S.numel():
        z_want = torch.einsum("sf,srf->sr", h_SF, lora[2].A_ERI[expert_S])
        assert_close("saved h @ A_down^T", z_PR[plan.pos_S], z_want, atol=1e-5, rtol=1e-5)


@needs_triton
@pytest.mark.parametrize("case", ["top2_three_ranks", "fewer_rows_than_a_block"])
def test_forward_combine_matches_the_pure_pytorch_swiglu_reference(case):
    gen = torch.Generator().manual_seed(12)
    expert_S, dest_S, E, ranks, rank = _routing(case, gen)
    plan = build_combine_plan(expert_S, dest_S, E, ranks, rank, BM_CPU)
    wg, wu, wd, lora = _weights("nf4_lora", E, gen)
    x_SD = torch.randn(expert_S.numel(), D, generator=gen)
    # gate/up on the padded rows, then the signaled down projection
    h_PF = torch.empty(plan.padded_rows, F)
    x_PD = plan.pad_rows(x_SD)
    zg, zu = low_rank(x_PD, plan.offsets_E1, lora[:2], True)
    launch_grouped_mm(MODE_SWIGLU, plan.offsets_E1, h_PF, operand_args(x_PD, wg, True, lora[0], zg), operand_args(x_PD, wu, True, lora[1], zu))
    got = _buffers(plan, D)
    signaled_down_projection(plan, h_PF, wd, lora[2], got, producer_programs=2, consumer_programs=3)
    y_ref = grouped_swiglu_lora_reference(x_SD, _offsets(expert_S, E), (wg, wu, wd), lora)
    want = combine_reference(y_ref, plan.dest_S, plan.dest_row_S, _buffers(plan, D))
    for r in range(ranks):
        assert_close(f"rank {r} buffer", got[r], want[r], atol=1e-5, rtol=1e-5)


@needs_triton
@pytest.mark.parametrize("fmt", ["dense", "nf4_lora"])
@pytest.mark.parametrize("case", ["top2_three_ranks", "all_rows_on_one_expert", "no_rows"])
def test_backward_producer_then_consumer_returns_input_gradients_bit_for_bit(case, fmt):
    gen = torch.Generator().manual_seed(13)
    expert_S, dest_S, E, ranks, rank = _routing(case, gen)
    plan = build_combine_plan(expert_S, dest_S, E, ranks, rank, BM_CPU)
    wg, wu, _, lora = _weights(fmt, E, gen)
    S = expert_S.numel()
    dg_SF, du_SF = torch.randn(S, F, generator=gen), torch.randn(S, F, generator=gen)
    dx_PD = torch.empty(plan.padded_rows, D)  # the producer's padded tiles (see the forward test)
    dg_PF, du_PF = plan.pad_rows(dg_SF), plan.pad_rows(du_SF)
    (zg,), (zu,) = low_rank(dg_PF, plan.offsets_E1, [lora[0]], False), low_rank(du_PF, plan.offsets_E1, [lora[1]], False)
    launch_grouped_mm(MODE_PLAIN, plan.offsets_E1, dx_PD, operand_args(dg_PF, wg, False, lora[0], zg), operand_args(du_PF, wu, False, lora[1], zu))
    dx_SD = dx_PD[plan.pos_S]
    want = combine_reference(dx_SD, plan.dest_S, plan.dest_row_S, _buffers(plan, D))
    got = _buffers(plan, D)
    _, timeouts = signaled_input_grad(plan, plan.pad_rows(dg_SF), plan.pad_rows(du_SF), wg, wu, lora[0], lora[1], got, producer_programs=3, consumer_programs=2)
    assert int(timeouts) == 0
    for r in range(ranks):
        assert_equal(f"rank {r} buffer", got[r], want[r])


@needs_triton
def test_consumer_leaves_tiles_whose_flag_was_not_raised_and_counts_them():
    gen = torch.Generator().manual_seed(14)
    expert_S, dest_S, E, ranks, rank = _routing("top2_three_ranks", gen)
    plan = build_combine_plan(expert_S, dest_S, E, ranks, rank, BM_CPU)
    wd = torch.randn(E, D, F, generator=gen)
    h_PF = plan.pad_rows(torch.randn(expert_S.numel(), F, generator=gen))
    cfg = producer_config(plan, False, "cpu")
    y_PD = torch.empty(plan.padded_rows, D)
    flags = torch.zeros(plan.num_tiles * -(-D // cfg.block_n), dtype=torch.int32)
    produce_tiles(plan, y_PD, flags, 7, operand_args(h_PF, wd, True, None, None), num_programs=2)
    assert (flags == 7).all()
    stale = torch.tensor([0, 3])  # items 0 and 3: (tile 0, column block 0), (tile 1, column block 1)
    flags[stale] = 6
    got = _buffers(plan, D)
    timeouts = consume_tiles(plan, y_PD, flags, 7, got, cfg.block_n, num_programs=2, max_spins=5)
    assert int(timeouts) == 2
    want = combine_reference(y_PD[plan.pos_S], plan.dest_S, plan.dest_row_S, _buffers(plan, D))
    tiles_n = -(-D // cfg.block_n)
    for item in stale.tolist():
        t, n = divmod(item, tiles_n)
        d, r0, valid = int(plan.tile_dest_T[t]), int(plan.tile_remote_row_T[t]), int(plan.tile_valid_T[t])
        cols = slice(n * cfg.block_n, (n + 1) * cfg.block_n)
        assert got[d][r0 : r0 + valid, cols].isnan().all(), f"item {item} was copied without its flag"
        want[d][r0 : r0 + valid, cols] = float("nan")
    for r in range(ranks):
        assert_equal(f"rank {r} buffer", got[r], want[r])


@needs_triton
def test_flags_are_reused_across_rounds_by_raising_the_epoch():
    gen = torch.Generator().manual_seed(15)
    expert_S, dest_S, E, ranks, rank = _routing("top8_two_ranks", gen)
    plan = build_combine_plan(expert_S, dest_S, E, ranks, rank, BM_CPU)
    wd = torch.randn(E, D, F, generator=gen)
    cfg = producer_config(plan, False, "cpu")
    flags = torch.zeros(plan.num_tiles * -(-D // cfg.block_n), dtype=torch.int32)
    for epoch in (1, 2):
        h_SF = torch.randn(expert_S.numel(), F, generator=gen)
        y_SD = torch.empty(expert_S.numel(), D)
        launch_grouped_mm(MODE_PLAIN, _offsets(expert_S, E), y_SD, operand_args(h_SF, wd, True, None, None))
        want = combine_reference(y_SD, plan.dest_S, plan.dest_row_S, _buffers(plan, D))
        got = _buffers(plan, D)
        _, timeouts = signaled_down_projection(plan, plan.pad_rows(h_SF), wd, None, got, flags=flags, epoch=epoch, producer_programs=2, consumer_programs=2)
        assert int(timeouts) == 0
        for r in range(ranks):
            assert_equal(f"round {epoch}, rank {r}", got[r], want[r])


# --- GPU: producer and consumer concurrently on two streams -------------------------------------


@needs_triton
@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_concurrent_producer_and_consumer_on_two_streams_match_compute_then_copy(dtype):
    from growtrain.kernels.combine import tile_config

    gen = torch.Generator().manual_seed(16)
    dev = torch.device("cuda")
    T, E, K, ranks, d, f = 2048, 16, 2, 8, 512, 384
    idx_TK = torch.rand(T, E, generator=gen).topk(K, dim=1).indices
    expert_S, dest_S = idx_TK.reshape(-1), torch.randint(0, ranks, (T,), generator=gen).repeat_interleave(K)
    order = torch.argsort(expert_S, stable=True)
    expert_S, dest_S = expert_S[order], dest_S[order]
    bm = tile_config("single", expert_S.numel(), E, dev).block_m
    plan = build_combine_plan(expert_S, dest_S, E, ranks, 3, bm).to(dev)
    wd = (torch.randn(E, d, f, generator=gen) * 0.05).to(dev, dtype)
    h_SF = torch.randn(expert_S.numel(), f, generator=gen).to(dev, dtype)
    y_SD = torch.empty(expert_S.numel(), d, device=dev, dtype=dtype)
    launch_grouped_mm(MODE_PLAIN, _offsets(expert_S, E).to(dev), y_SD, operand_args(h_SF, wd, True, None, None))
    want = combine_reference(y_SD, plan.dest_S, plan.dest_row_S, [torch.full((int(n), d), float("nan"), device=dev, dtype=dtype) for n in plan.rows_to_R])
    for trial in range(5):
        got = [torch.full((int(n), d), float("nan"), device=dev, dtype=dtype) for n in plan.rows_to_R]
        _, timeouts = signaled_down_projection(plan, plan.pad_rows(h_SF), wd, None, got, consumer_programs=4, overlap=True)
        torch.cuda.synchronize()
        assert int(timeouts.item()) == 0
        for r in range(ranks):
            assert_equal(f"trial {trial}, rank {r}", got[r], want[r])
