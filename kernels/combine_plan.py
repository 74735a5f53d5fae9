"""The combine plan for tile-level signaling (DESIGN.md §11): a pure function from each row's expert
and destination rank to a padded row layout and a tile worklist in which every output tile has
exactly one destination. No Triton here.

Layout: rows grouped by expert, then by destination rank, then in input order; each
(expert, destination) segment padded to a multiple of block_m, so a tile never straddles a rank
(or an expert) boundary. At destination d, the rows this rank sends sit at dest_base[d] onwards in
(expert, input order), so each tile lands as one contiguous block of rows.

Legend: S input rows, P padded rows, T tiles, E experts, R ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CombinePlan:
    block_m: int
    num_experts: int
    num_ranks: int
    rank: int
    padded_rows: int
    src_row_P: torch.Tensor  # int64 [P]: input row feeding padded row p, -1 for padding
    pos_S: torch.Tensor  # int64 [S]: padded row of input row s (inverse of src_row_P)
    offsets_E1: torch.Tensor  # int64 [E+1]: expert boundaries in the padded layout
    tile_row_T: torch.Tensor  # int32 [T]: first padded row; remote-bound tiles first
    tile_expert_T: torch.Tensor  # int32 [T]
    tile_dest_T: torch.Tensor  # int32 [T]: destination rank
    tile_remote_row_T: torch.Tensor  # int32 [T]: first row in the destination buffer
    tile_valid_T: torch.Tensor  # int32 [T]: rows of the tile that are real (the rest is padding)
    num_remote_tiles: int  # tiles 0..num_remote_tiles-1 leave this rank
    dest_S: torch.Tensor  # int64 [S]
    dest_row_S: torch.Tensor  # int64 [S]: row of input row s in its destination buffer
    rows_to_R: torch.Tensor  # int64 [R]: rows this rank sends to each rank (itself included)

    @property
    def num_tiles(self) -> int:
        return self.tile_row_T.numel()

    def to(self, device) -> CombinePlan:
        fields = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in self.__dict__.items()}
        return CombinePlan(**fields)

    def pad_rows(self, x_SD: torch.Tensor) -> torch.Tensor:
        """x in the padded layout, zeros in padding rows."""
        x_PD = x_SD.new_zeros((self.padded_rows, *x_SD.shape[1:]))
        x_PD[self.pos_S.to(x_SD.device)] = x_SD
        return x_PD


def _exclusive_cumsum(t: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(t, 0) - t


def build_combine_plan(
    expert_S: torch.Tensor,
    dest_S: torch.Tensor,
    num_experts: int,
    num_ranks: int,
    rank: int,
    block_m: int,
    dest_base_R: torch.Tensor | None = None,
) -> CombinePlan:
    """Plan for rows with expert expert_S[s] bound for rank dest_S[s]. dest_base_R[d] is where this
    rank's rows start in rank d's receive buffer (default 0). Computed on the CPU; deterministic."""
    expert_S = torch.as_tensor(expert_S).to("cpu", torch.int64).reshape(-1)
    dest_S = torch.as_tensor(dest_S).to("cpu", torch.int64).reshape(-1)
    E, R, BM = int(num_experts), int(num_ranks), int(block_m)
    problems = []
    if expert_S.shape != dest_S.shape:
        problems.append(f"expert_S and dest_S must have one entry per row, got {expert_S.numel()} and {dest_S.numel()}")
    if E < 1 or R < 1 or BM < 1:
        problems.append(f"num_experts, num_ranks and block_m must be positive, got {E}, {R}, {BM}")
    if not 0 <= rank < max(R, 1):
        problems.append(f"rank must be in 0..{R - 1}, got {rank}")
    if not problems and expert_S.numel() and not (0 <= int(expert_S.min()) and int(expert_S.max()) < E):
        problems.append(f"expert ids must be in 0..{E - 1}")
    if not problems and dest_S.numel() and not (0 <= int(dest_S.min()) and int(dest_S.max()) < R):
        problems.append(f"destination ranks must be in 0..{R - 1}")
    if problems:
        raise ValueError("build_combine_plan: " + "; ".join(problems))
    base_R = torch.zeros(R, dtype=torch.int64) if dest_base_R is None else torch.as_tensor(dest_base_R).to("cpu", torch.int64)

    S = expert_S.numel()
    key_S = expert_S * R + dest_S  # segment id, expert-major
    order = torch.argsort(key_S, stable=True)  # sorted position i -> input row
    counts_G = torch.bincount(key_S, minlength=E * R)  # G = E*R segments
    padded_G = (counts_G + BM - 1) // BM * BM
    pad_start_G = _exclusive_cumsum(padded_G)
    sorted_start_G = _exclusive_cumsum(counts_G)
    # rows sent to rank d by experts before e: where segment (e, d) starts in d's buffer
    before_G = _exclusive_cumsum(counts_G.view(E, R)).reshape(-1)

    key_sorted = key_S[order]
    local_sorted = torch.arange(S) - sorted_start_G[key_sorted]
    P = int(padded_G.sum())
    pos_S = torch.empty(S, dtype=torch.int64)
    pos_S[order] = pad_start_G[key_sorted] + local_sorted
    src_row_P = torch.full((P,), -1, dtype=torch.int64)
    src_row_P[pos_S] = torch.arange(S)
    dest_row_S = torch.empty(S, dtype=torch.int64)
    dest_row_S[order] = base_R[dest_S[order]] + before_G[key_sorted] + local_sorted

    offsets_E1 = torch.zeros(E + 1, dtype=torch.int64)
    offsets_E1[1:] = torch.cumsum(padded_G.view(E, R).sum(1), 0)

    tiles_G = padded_G // BM
    seg_T = torch.repeat_interleave(torch.arange(E * R), tiles_G)
    j_T = torch.arange(seg_T.numel()) - torch.repeat_interleave(_exclusive_cumsum(tiles_G), tiles_G)
    dest_T = seg_T % R
    # Remote-bound tiles first, so their transfers start while local tiles are still computing.
    first = torch.argsort((dest_T == rank).to(torch.int8), stable=True)
    seg_T, j_T, dest_T = seg_T[first], j_T[first], dest_T[first]
    i32 = torch.int32
    return CombinePlan(
        block_m=BM,
        num_experts=E,
        num_ranks=R,
        rank=rank,
        padded_rows=P,
        src_row_P=src_row_P,
        pos_S=pos_S,
        offsets_E1=offsets_E1,
        tile_row_T=(pad_start_G[seg_T] + j_T * BM).to(i32),
        tile_expert_T=(seg_T // R).to(i32),
        tile_dest_T=dest_T.to(i32),
        tile_remote_row_T=(base_R[dest_T] + before_G[seg_T] + j_T * BM).to(i32),
        tile_valid_T=torch.clamp(counts_G[seg_T] - j_T * BM, max=BM).to(i32),
        num_remote_tiles=int((dest_T != rank).sum()),
        dest_S=dest_S,
        dest_row_S=dest_row_S,
        rows_to_R=counts_G.view(E, R).sum(0),
    )
