"""Plain containers the expert kernels take: stacked NF4 expert matrices and per-expert LoRA pairs.
No Triton here, so growtrain can build them (and the reference can read them) without it.

Legend: E experts, r LoRA rank, (rows, cols) the shape of one expert matrix as stored
(w_gate/w_up: [F, D], w_down: [D, F]); nblk = ceil(rows*cols / blocksize) absmax blocks per expert,
nnest = ceil(nblk / nested_blocksize).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch


@dataclass(frozen=True)
class NF4Weight:
    """E expert matrices, each quantized on its own by bitsandbytes (`quantize_4bit(..., quant_type="nf4")`),
    stacked along a leading expert axis. Element (i, j) of expert e is flat index f = i*cols + j of that
    expert; its code sits in byte f // 2 (high nibble when f is even), its scale in absmax block
    f // blocksize. With double quantization the per-block scale is
    nested_code[absmax[e, b]] * nested_absmax[e, b // nested_blocksize] + offset[e], in fp32.
    """

    codes_EB: torch.Tensor  # uint8 [E, ceil(rows*cols/2)], two 4-bit codes per byte
    absmax_EK: torch.Tensor  # fp32 [E, nblk], or uint8 [E, nblk] when nested
    code_16: torch.Tensor  # fp32 [16]: the NF4 code book (quant_state.code)
    shape: tuple[int, int]  # (rows, cols) of one expert matrix
    blocksize: int = 64
    nested_absmax_EJ: torch.Tensor | None = None  # fp32 [E, nnest]
    nested_code_256: torch.Tensor | None = None  # fp32 [256]: bitsandbytes' dynamic map
    offset_E: torch.Tensor | None = None  # fp32 [E]: the mean subtracted before nesting
    nested_blocksize: int = 256
    dtype: torch.dtype = torch.float32  # what the quantized matrices were (quant_state.dtype)
    # True when each stored matrix is W^T ([in, out]) rather than W ([out, in]); growtrain stores
    # w_down as [F, D] so that neuron slices are row slices for all three matrices.
    transposed: bool = False

    def __post_init__(self):
        problems = []
        E = self.codes_EB.shape[0] if self.codes_EB.dim() == 2 else -1
        rows, cols = self.shape
        numel = rows * cols
        nblk = -(-numel // self.blocksize)
        if self.codes_EB.dtype != torch.uint8 or self.codes_EB.dim() != 2 or self.codes_EB.shape[1] != (numel + 1) // 2:
            problems.append(f"codes_EB must be uint8 [E, {(numel + 1) // 2}], got {self.codes_EB.dtype} {list(self.codes_EB.shape)}")
        if self.blocksize not in (32, 64, 128, 256, 512, 1024, 2048, 4096):
            problems.append(f"blocksize must be a power of two in 32..4096 (bitsandbytes' choices), got {self.blocksize}")
        if tuple(self.absmax_EK.shape) != (E, nblk):
            problems.append(f"absmax_EK must have shape [{E}, {nblk}], got {list(self.absmax_EK.shape)}")
        if self.code_16.numel() != 16 or self.code_16.dtype != torch.float32:
            problems.append(f"code_16 must be 16 fp32 values, got {self.code_16.numel()} {self.code_16.dtype}")
        if self.nested:
            nnest = -(-nblk // self.nested_blocksize)
            if self.absmax_EK.dtype != torch.uint8:
                problems.append(f"nested absmax_EK must be uint8 codes, got {self.absmax_EK.dtype}")
            if self.nested_code_256 is None or self.nested_code_256.numel() != 256:
                problems.append("nested_code_256 must hold bitsandbytes' 256-entry dynamic map")
            if self.offset_E is None or tuple(self.offset_E.shape) != (E,):
                problems.append(f"offset_E must have shape [{E}]")
            if tuple(self.nested_absmax_EJ.shape) != (E, nnest):
                problems.append(f"nested_absmax_EJ must have shape [{E}, {nnest}], got {list(self.nested_absmax_EJ.shape)}")
        elif self.absmax_EK.dtype != torch.float32:
            problems.append(f"absmax_EK must be fp32 without double quantization, got {self.absmax_EK.dtype}")
        for name in ("codes_EB", "absmax_EK", "code_16", "nested_absmax_EJ", "nested_code_256", "offset_E"):
            t = getattr(self, name)
            if t is not None and not t.is_contiguous():
                problems.append(f"{name} must be contiguous")
        if problems:
            raise ValueError("invalid NF4Weight: " + "; ".join(problems))

    @property
    def nested(self) -> bool:
        return self.nested_absmax_EJ is not None

    @property
    def num_experts(self) -> int:
        return self.codes_EB.shape[0]

    @property
    def device(self) -> torch.device:
        return self.codes_EB.device

    @property
    def numel_per_expert(self) -> int:
        return self.shape[0] * self.shape[1]

    def to(self, device) -> NF4Weight:
        move = {
            k: getattr(self, k).to(device)
            for k in ("codes_EB", "absmax_EK", "code_16", "nested_absmax_EJ", "nested_code_256", "offset_E")
            if getattr(self, k) is not None
        }
        return replace(self, **move)

    @classmethod
    def from_bnb(cls, packed: Sequence[torch.Tensor], quant_states: Sequence, transposed: bool = False) -> NF4Weight:
        """Stack E (packed, QuantState) pairs from `bitsandbytes.functional.quantize_4bit(w_e, quant_type="nf4")`,
        one per expert matrix, all of one shape. Reads only the QuantState's attributes, so any object
        with absmax/code/blocksize/shape/dtype/quant_type/offset/state2 works."""
        if len(packed) != len(quant_states) or not packed:
            raise ValueError(f"need one QuantState per packed matrix, got {len(packed)} and {len(quant_states)}")
        qs0 = quant_states[0]
        shape = tuple(qs0.shape)
        if len(shape) == 1:
            shape = (1, shape[0])
        if len(shape) != 2:
            raise ValueError(f"expert matrices must be 2-D, got shape {shape}")
        for e, qs in enumerate(quant_states):
            if getattr(qs, "quant_type", "nf4") != "nf4":
                raise ValueError(f"expert {e}: quant_type must be 'nf4', got {qs.quant_type!r}")
            if tuple(qs.shape) != tuple(qs0.shape) or qs.blocksize != qs0.blocksize or bool(qs.state2) != bool(qs0.state2):
                raise ValueError(f"expert {e}: shape/blocksize/double quantization differ from expert 0")
            if not torch.equal(qs.code.float().cpu(), qs0.code.float().cpu()):
                raise ValueError(f"expert {e}: NF4 code book differs from expert 0")
        # quant_storage other than uint8 (e.g. bf16 for FSDP) holds the same bytes.
        codes = torch.stack([p.contiguous().view(torch.uint8).reshape(-1) for p in packed])
        common = {"code_16": qs0.code.float().contiguous(), "shape": shape, "blocksize": int(qs0.blocksize), "dtype": qs0.dtype, "transposed": transposed}
        if qs0.state2 is None:
            absmax = torch.stack([qs.absmax.float().reshape(-1) for qs in quant_states])
            return cls(codes_EB=codes, absmax_EK=absmax, **common)
        s2 = qs0.state2
        return cls(
            codes_EB=codes,
            absmax_EK=torch.stack([qs.absmax.reshape(-1) for qs in quant_states]).contiguous(),
            nested_absmax_EJ=torch.stack([qs.state2.absmax.float().reshape(-1) for qs in quant_states]),
            nested_code_256=s2.code.float().contiguous(),
            offset_E=torch.stack([torch.as_tensor(qs.offset, dtype=torch.float32).reshape(()) for qs in quant_states]).to(codes.device),
            nested_blocksize=int(s2.blocksize),
            **common,
        )

    @classmethod
    def from_stack(cls, stack, transposed: bool = False) -> NF4Weight:
        """From any object with the fields of growtrain's `NF4Stack` (kernels/nf4_reference.py):
        codes_EP, absmax_EA, quant_map, rows, cols, nested_absmax_EM, offset_E, nested_quant_map,
        blocksize, nested_blocksize. No copies where the tensors are already contiguous."""
        nested = stack.nested_absmax_EM is not None
        return cls(
            codes_EB=stack.codes_EP.contiguous(),
            absmax_EK=stack.absmax_EA.contiguous() if nested else stack.absmax_EA.float().contiguous(),
            code_16=stack.quant_map.float().contiguous(),
            shape=(int(stack.rows), int(stack.cols)),
            blocksize=int(stack.blocksize),
            nested_absmax_EJ=stack.nested_absmax_EM.float().contiguous() if nested else None,
            nested_code_256=stack.nested_quant_map.float().contiguous() if nested else None,
            offset_E=stack.offset_E.float().reshape(-1).contiguous() if nested else None,
            nested_blocksize=int(stack.nested_blocksize),
            transposed=transposed,
        )

    @classmethod
    def quantize(cls, w_ERC: torch.Tensor, compress_statistics: bool = False, blocksize: int = 64, transposed: bool = False) -> NF4Weight:
        """Quantize each expert matrix of a dense [E, rows, cols] stack with bitsandbytes (tests,
        benchmarks); transposed=True when the stack holds W^T."""
        import bitsandbytes.functional as bnbf  # optional dependency: only this helper needs it

        pairs = [
            bnbf.quantize_4bit(w_ERC[e].contiguous(), blocksize=blocksize, compress_statistics=compress_statistics, quant_type="nf4")
            for e in range(w_ERC.shape[0])
        ]
        return cls.from_bnb([p for p, _ in pairs], [qs for _, qs in pairs], transposed=transposed)


@dataclass(frozen=True)
class LoRA:
    """One stacked per-expert LoRA pair: delta W_e = scale * B[e] @ A[e]."""

    A_ERI: torch.Tensor  # [E, r, d_in]
    B_EOR: torch.Tensor  # [E, d_out, r], zero-initialised
    scale: float  # alpha / r

    def __post_init__(self):
        if self.A_ERI.dim() != 3 or self.B_EOR.dim() != 3:
            raise ValueError(f"LoRA A and B must be [E, r, d_in] and [E, d_out, r], got {list(self.A_ERI.shape)} and {list(self.B_EOR.shape)}")
        if self.A_ERI.shape[0] != self.B_EOR.shape[0] or self.A_ERI.shape[1] != self.B_EOR.shape[2]:
            raise ValueError(f"LoRA A {list(self.A_ERI.shape)} and B {list(self.B_EOR.shape)} disagree on E or r")

    @property
    def rank(self) -> int:
        return self.A_ERI.shape[1]


class ExpertWeights(NamedTuple):
    """The three expert matrices; each a dense tensor or an NF4Weight."""

    gate: torch.Tensor | NF4Weight  # [E, F, D]
    up: torch.Tensor | NF4Weight  # [E, F, D]
    down: torch.Tensor | NF4Weight  # [E, D, F]


class ExpertLoRA(NamedTuple):
    gate: LoRA | None = None  # A [E, r, D], B [E, F, r]
    up: LoRA | None = None
    down: LoRA | None = None  # A [E, r, F], B [E, D, r]


def weight_shape(w: torch.Tensor | NF4Weight) -> tuple[int, int, int]:
    """[E, out, in] of a dense or NF4 expert stack (the math orientation, whatever the storage)."""
    if isinstance(w, NF4Weight):
        rows, cols = w.shape
        return (w.num_experts, cols, rows) if w.transposed else (w.num_experts, rows, cols)
    return tuple(w.shape)
