"""NF4 routed experts with a trainable LoRA pair per expert and matrix (DESIGN.md §6), and the pure
helpers that quantize, select, slice and rescale NF4 expert stacks without touching the codes.

Storage of one MoE layer's `experts` module (`blocks.{i}.g.ffn.experts.`), for each matrix
m in w_gate, w_up, w_down, all with the expert hidden width F leading ([F, D]; w_down is stored
transposed so that a neuron slice is a row slice of every matrix):

    {m}_codes          uint8   [E, F*D/2]      persistent buffer: 4-bit codes, two per byte (bitsandbytes order)
    {m}_absmax         uint8   [E, F*D/64]     buffer: 8-bit absmax codes (float32 without double quantization)
    {m}_nested_absmax  float32 [E, ceil(F*D/64/256)]   buffer, double quantization only
    {m}_offset         float32 [E]             buffer, double quantization only (bitsandbytes' absmax mean)
    {m}_lora_A         float32 [E, r, in]      parameter (in: D for gate/up, F for down)
    {m}_lora_B         float32 [E, out, r]     parameter, zero at init (out: F for gate/up, D for down)
    quant_map          float32 [16]            buffer: the NF4 code book
    nested_quant_map   float32 [256]           buffer: the dynamic map of the absmax codes (double quantization only)

Every expert's matrix is quantized on its own (its own offset and nested blocks), so those tensors
rebuild bitsandbytes' QuantState exactly (`kernels.nf4_reference.quant_state`), a state dict
round-trips bit for bit, and selecting experts is exact. The base is buffers, so it gets no
gradient and (the optimizer tracks trainable parameters only) no optimizer state.

Legend: E experts, F expert hidden width, D d_model, R LoRA rank, P packed code bytes per expert,
A absmax blocks per expert, M nested absmax blocks per expert.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch
from torch import nn

from growtrain.kernels.nf4_reference import (
    NESTED_BLOCKSIZE,
    NF4_BLOCKSIZE,
    LoRAStack,
    NF4LoRAExperts,
    NF4Stack,
    absmax_values,
    bitsandbytes_functional,
    dequantize_experts_bitsandbytes,
    nf4_buffer_shapes,
)
from growtrain.model.config import ExpertLoRAConfig
from growtrain.model.expert_backends import get_expert_backend

MATRICES = ("w_gate", "w_up", "w_down")


class NF4SliceError(ValueError):
    """A slice of NF4 codes that would not dequantize to the same values without requantizing."""


# ---------------------------------------------------------------------------------------------
# Quantize / dequantize whole stacks


def quantize_stack(w_ERC: torch.Tensor, double_quant: bool = True) -> NF4Stack:
    """E matrices [rows, cols] quantized one by one with bitsandbytes (NF4, blocksize 64)."""
    bnbf = bitsandbytes_functional()
    E, rows, cols = w_ERC.shape
    if not E:  # no expert (an AF layout's attention rank, growing): the code books alone, which are constants
        return nf4_take_experts(quantize_stack(w_ERC.new_zeros((1, rows, cols)), double_quant), [])
    parts = [
        bnbf.quantize_4bit(w_ERC[e].detach().float().reshape(-1).contiguous(), blocksize=NF4_BLOCKSIZE, quant_type="nf4", compress_statistics=double_quant)
        for e in range(E)
    ]
    first = parts[0][1]
    return NF4Stack(
        codes_EP=torch.stack([q.reshape(-1) for q, _ in parts]),
        absmax_EA=torch.stack([s.absmax for _, s in parts]),
        quant_map=first.code.float(),
        rows=rows,
        cols=cols,
        nested_absmax_EM=torch.stack([s.state2.absmax.float() for _, s in parts]) if double_quant else None,
        offset_E=torch.stack([s.offset.float().reshape(()) for _, s in parts]) if double_quant else None,
        nested_quant_map=first.state2.code.float() if double_quant else None,
        nested_blocksize=first.state2.blocksize if double_quant else NESTED_BLOCKSIZE,
    )


def dequantize_stack(stack: NF4Stack, experts: list[int] | None = None) -> torch.Tensor:
    """[len(experts), rows, cols] float32 through bitsandbytes (every expert by default)."""
    experts = list(range(stack.num_experts)) if experts is None else list(experts)
    if not experts:
        return torch.empty(0, stack.rows, stack.cols, device=stack.codes_EP.device)
    return dequantize_experts_bitsandbytes(stack, experts)


# ---------------------------------------------------------------------------------------------
# Exact manipulations (no requantization): what split / clone / scale operators use


def nf4_per_expert(stack: NF4Stack, fn) -> dict:
    """fn applied to every per-expert tensor of the stack (the shared code books stay)."""
    out = {"codes_EP": fn(stack.codes_EP), "absmax_EA": fn(stack.absmax_EA)}
    if stack.double_quant:
        out["nested_absmax_EM"] = fn(stack.nested_absmax_EM)
        out["offset_E"] = fn(stack.offset_E)
    return out


def nf4_take_experts(stack: NF4Stack, index_K: torch.Tensor | list[int]) -> NF4Stack:
    """The experts at `index_K`, in that order, repeats allowed (cloning): always bit-exact, since
    each expert's matrix carries its own quantization state."""
    index_K = torch.as_tensor(index_K, dtype=torch.long, device=stack.codes_EP.device)
    return replace(stack, **nf4_per_expert(stack, lambda t: t.index_select(0, index_K)))


def nf4_cat_experts(stacks: list[NF4Stack]) -> NF4Stack:
    """Expert stacks of the same matrix shape and format, concatenated along the experts."""
    first = stacks[0]
    for s in stacks[1:]:
        if (s.rows, s.cols, s.double_quant, s.blocksize, s.nested_blocksize) != (first.rows, first.cols, first.double_quant, first.blocksize, first.nested_blocksize):
            raise ValueError("nf4_cat_experts: the stacks differ in shape or format")
        if not torch.equal(s.quant_map, first.quant_map) or (first.double_quant and not torch.equal(s.nested_quant_map, first.nested_quant_map)):
            raise ValueError("nf4_cat_experts: the stacks use different code books")
    fields = nf4_per_expert(first, lambda t: t).keys()
    return replace(first, **{f: torch.cat([getattr(s, f) for s in stacks]) for f in fields})


def row_slice_problem(
    rows: int, cols: int, start: int, stop: int, double_quant: bool, blocksize: int = NF4_BLOCKSIZE, nested_blocksize: int = NESTED_BLOCKSIZE
) -> str | None:
    """Why rows [start, stop) of [rows, cols] NF4 matrices cannot be cut out bit-exactly (None:
    they can). Shapes only, so an operator's `plan` can decide its exactness before any weights.

    Exact when the slice starts on a quantization block (start * cols a multiple of 64: any start
    when the row length is a multiple of 64) and, with double quantization, on a nested absmax
    block too (start * cols a multiple of 64 * 256 = 16384, so the 8-bit absmax codes keep their
    nested scale). The end needs no alignment: a partial last block keeps its parent's absmax."""
    if not 0 <= start < stop <= rows:
        return f"rows [{start}, {stop}) are not inside 0..{rows}"
    first = start * cols
    if first % blocksize:
        return f"the slice starts at element {first} of each matrix, not on a {blocksize}-element quantization block"
    if ((stop - start) * cols) % 2:
        return "the slice has an odd number of elements (codes are packed two per byte)"
    if double_quant and (first // blocksize) % nested_blocksize:
        return (
            f"with double quantization the slice must start on a nested absmax block of {nested_blocksize} blocks "
            f"({nested_blocksize * blocksize} elements); it starts at element {first}"
        )
    return None


def nf4_row_slice_problem(stack: NF4Stack, start: int, stop: int) -> str | None:
    """`row_slice_problem` for a stack."""
    return row_slice_problem(stack.rows, stack.cols, start, stop, stack.double_quant, stack.blocksize, stack.nested_blocksize)


def nf4_slice_rows(stack: NF4Stack, start: int, stop: int) -> NF4Stack:
    """Rows [start, stop) of every expert's matrix, cut from the codes and quantization state
    without requantizing: dequantizes to exactly the same values as the parent's rows. Raises
    NF4SliceError (saying why) where that is impossible; see `nf4_row_slice_problem`."""
    problem = nf4_row_slice_problem(stack, start, stop)
    if problem:
        raise NF4SliceError(f"nf4_slice_rows({start}, {stop}) of [{stack.rows}, {stack.cols}] matrices: {problem}")
    first, last = start * stack.cols, stop * stack.cols
    b0, b1 = first // stack.blocksize, math.ceil(last / stack.blocksize)
    out = {
        "codes_EP": stack.codes_EP[:, first // 2 : last // 2].contiguous(),
        "absmax_EA": stack.absmax_EA[:, b0:b1].contiguous(),
    }
    if stack.double_quant:
        n0, n1 = b0 // stack.nested_blocksize, math.ceil(b1 / stack.nested_blocksize)
        out["nested_absmax_EM"] = stack.nested_absmax_EM[:, n0:n1].contiguous()
        out["offset_E"] = stack.offset_E.clone()
    return replace(stack, rows=stop - start, **out)


def nf4_scale(stack: NF4Stack, factor: float) -> NF4Stack:
    """Every weight times `factor`, a power of two (e.g. the split's down-projection x2): exact,
    because only the absmax scales (and with double quantization its nested absmax and offset,
    so absmax' = map[q] * 2^k nested + 2^k offset = 2^k absmax with no rounding)."""
    mantissa, _ = math.frexp(factor)
    if factor <= 0 or mantissa != 0.5:
        raise ValueError(f"nf4_scale is exact only for positive powers of two, got {factor}")
    if stack.double_quant:
        return replace(stack, nested_absmax_EM=stack.nested_absmax_EM * factor, offset_E=stack.offset_E * factor)
    return replace(stack, absmax_EA=stack.absmax_EA * factor)


def nf4_zeros_like(stack: NF4Stack) -> NF4Stack:
    """The same format with every weight exactly 0 (a zero output projection for an identity block):
    zero absmax (with double quantization: zero nested absmax and offset), codes kept."""
    if stack.double_quant:
        return replace(stack, nested_absmax_EM=torch.zeros_like(stack.nested_absmax_EM), offset_E=torch.zeros_like(stack.offset_E))
    return replace(stack, absmax_EA=torch.zeros_like(stack.absmax_EA))


def nf4_renest_rows(stack: NF4Stack, start: int, stop: int) -> NF4Stack:
    """Rows [start, stop) when `nf4_slice_rows` cannot cut them exactly because of the nested
    absmax blocks: the 4-bit codes are kept and the absmax values (exact float32) are
    double-quantized again for the slice, so each block's scale moves by at most one 8-bit step.
    Approximate: an operator using it must declare itself approximate."""
    if not stack.double_quant:
        raise ValueError("nf4_renest_rows is for double-quantized stacks; nf4_slice_rows is exact without double quantization")
    flat = replace(stack, absmax_EA=absmax_values(stack, list(range(stack.num_experts))), nested_absmax_EM=None, offset_E=None, nested_quant_map=None)
    sliced = nf4_slice_rows(flat, start, stop)
    bnbf = bitsandbytes_functional()
    absmax, nested, offsets = [], [], []
    for e in range(sliced.num_experts):
        a = sliced.absmax_EA[e]
        offset = a.mean()
        q, state2 = bnbf.quantize_blockwise(a - offset, blocksize=stack.nested_blocksize)
        absmax.append(q)
        nested.append(state2.absmax.float())
        offsets.append(offset)
    return replace(
        sliced,
        absmax_EA=torch.stack(absmax),
        nested_absmax_EM=torch.stack(nested),
        offset_E=torch.stack(offsets),
        nested_quant_map=stack.nested_quant_map,
    )


def nf4_append_rows(stack: NF4Stack, rows_ERC: torch.Tensor) -> NF4Stack | None:
    """`stack` with rows appended to every expert's matrix (`rows_ERC`: [E, n, cols] values),
    quantized on blocks of their own: the old codes, absmax, nested absmax and offset stay as they
    are, so the old rows dequantize exactly as before (widen_ffn's new neurons). With double
    quantization the new absmax values are quantized into new nested blocks around the expert's
    existing offset. None where the layout does not allow it: the old rows end inside a
    quantization block, or (double quantization) inside a nested absmax block; see
    `append_rows_problem`."""
    E, n, cols = rows_ERC.shape
    if append_rows_problem(stack.rows, cols, stack.double_quant, stack.blocksize, stack.nested_blocksize) or (n * cols) % 2:
        return None
    if not E:  # no expert here (an AF attention rank): the shapes alone
        return nf4_take_experts(quantize_stack(rows_ERC.new_zeros((1, stack.rows + n, cols)), stack.double_quant), [])
    bnbf = bitsandbytes_functional()
    codes, absmax = [], []
    for e in range(E):
        q, st = bnbf.quantize_4bit(
            rows_ERC[e].detach().float().reshape(-1).contiguous(), blocksize=stack.blocksize, quant_type="nf4", compress_statistics=False
        )
        codes.append(q.reshape(-1))
        absmax.append(st.absmax.float())
    out = {"codes_EP": torch.cat([stack.codes_EP, torch.stack(codes).to(stack.codes_EP.device)], 1)}
    if not stack.double_quant:
        out["absmax_EA"] = torch.cat([stack.absmax_EA, torch.stack(absmax).to(stack.absmax_EA.device)], 1)
        return replace(stack, rows=stack.rows + n, **out)
    q8, nested = [], []
    for e in range(E):
        q, st2 = bnbf.quantize_blockwise(absmax[e] - stack.offset_E[e].to(absmax[e].device), code=stack.nested_quant_map.to(absmax[e].device), blocksize=stack.nested_blocksize)
        q8.append(q)
        nested.append(st2.absmax.float())
    out["absmax_EA"] = torch.cat([stack.absmax_EA, torch.stack(q8).to(stack.absmax_EA.device)], 1)
    out["nested_absmax_EM"] = torch.cat([stack.nested_absmax_EM, torch.stack(nested).to(stack.nested_absmax_EM.device)], 1)
    return replace(stack, rows=stack.rows + n, **out)


def append_rows_problem(rows: int, cols: int, double_quant: bool, blocksize: int = NF4_BLOCKSIZE, nested_blocksize: int = NESTED_BLOCKSIZE) -> str | None:
    """Why rows cannot be appended to [rows, cols] NF4 matrices on blocks of their own (None: they can)."""
    elements = rows * cols
    if elements % blocksize:
        return f"the {rows} x {cols} matrices end inside a {blocksize}-element quantization block"
    if double_quant and (elements // blocksize) % nested_blocksize:
        return (
            f"with double quantization they end inside a nested absmax block ({rows} x {cols} = {elements} elements, "
            f"not a multiple of {blocksize} x {nested_blocksize} = {blocksize * nested_blocksize})"
        )
    return None


def nf4_requantized(stack: NF4Stack, w_ERC: torch.Tensor, kept_R: torch.Tensor | None = None) -> tuple[NF4Stack, float]:
    """`w_ERC` quantized in `stack`'s format (each expert on its own), and how far the result moves
    the values it should keep: the largest |dequantized - w| over the rows `kept_R` marks (all by
    default), relative to the largest |w| there. 0.0 where requantizing gives them back exactly (NF4
    without double quantization is idempotent on blocks that keep their elements: its code book
    holds -1 and 1, so a block's absmax comes back bit for bit)."""
    grown = quantize_stack(w_ERC, stack.double_quant)
    if not w_ERC.shape[0]:
        return grown, 0.0
    got = dequantize_stack(grown).to(w_ERC.device)
    if kept_R is not None:
        got, w_ERC = got[:, kept_R.to(got.device)], w_ERC[:, kept_R.to(w_ERC.device)]
    scale = float(w_ERC.abs().max()) if w_ERC.numel() else 0.0
    moved = float((got - w_ERC).abs().max()) if w_ERC.numel() else 0.0
    return grown, (moved / scale if scale else moved)


# ---------------------------------------------------------------------------------------------
# The module


def lora_dims(matrix: str, d_model: int, hidden: int) -> tuple[int, int]:
    """(in, out) of a matrix in the math orientation y = x W^T."""
    return (hidden, d_model) if matrix == "w_down" else (d_model, hidden)


class NF4Experts(nn.Module):
    """E SwiGLU experts: frozen NF4 bases (buffers) plus a trainable LoRA pair per expert and matrix."""

    is_nf4 = True

    def __init__(
        self,
        num_experts: int,
        d_model: int,
        hidden: int,
        lora: ExpertLoRAConfig,
        double_quant: bool = True,
        init_std: float = 0.02,
        out_std: float | None = None,
    ):
        super().__init__()
        self.num_experts, self.d_model, self.hidden = num_experts, d_model, hidden
        self.lora = lora
        self.double_quant = double_quant
        self.init_std = init_std
        self.out_std = init_std if out_std is None else out_std
        E = num_experts
        for m in MATRICES:
            for part, shape in nf4_buffer_shapes(hidden, d_model, double_quant).items():
                dtype = torch.uint8 if part == "codes" or (part == "absmax" and double_quant) else torch.float32
                self.register_buffer(f"{m}_{part}", torch.zeros(E, *shape, dtype=dtype), persistent=True)
            d_in, d_out = lora_dims(m, d_model, hidden)
            setattr(self, f"{m}_lora_A", nn.Parameter(torch.empty(E, lora.r, d_in)))
            setattr(self, f"{m}_lora_B", nn.Parameter(torch.empty(E, d_out, lora.r)))
        self.register_buffer("quant_map", torch.zeros(16), persistent=True)
        if double_quant:
            self.register_buffer("nested_quant_map", torch.zeros(256), persistent=True)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        self.reset_adapters()
        if self.quant_map.is_meta:
            return
        # A random base like the full-precision experts' init, quantized (drawn on the CPU: the same
        # draws whatever the device).
        for m in MATRICES:
            std = self.out_std if m == "w_down" else self.init_std
            w = torch.randn(self.num_experts, self.hidden, self.d_model) * std
            self.set_stack(m, quantize_stack(w.to(self.quant_map.device), self.double_quant))

    @torch.no_grad()
    def reset_adapters(self) -> None:
        """peft's LoRA init: A kaiming-uniform (bound 1/sqrt(in), as nn.Linear), B zero, so the
        adapters start as the identity change."""
        for m in MATRICES:
            A, B = getattr(self, f"{m}_lora_A"), getattr(self, f"{m}_lora_B")
            bound = 1.0 / math.sqrt(A.shape[-1])
            nn.init.uniform_(A, -bound, bound)
            nn.init.zeros_(B)

    @property
    def scale(self) -> float:
        return self.lora.scale

    def stack(self, m: str) -> NF4Stack:
        """Matrix m's base as an NF4Stack view of the buffers (stored layout, [F, D] per expert)."""
        dq = self.double_quant
        return NF4Stack(
            codes_EP=getattr(self, f"{m}_codes"),
            absmax_EA=getattr(self, f"{m}_absmax"),
            quant_map=self.quant_map.float(),
            rows=self.hidden,
            cols=self.d_model,
            nested_absmax_EM=getattr(self, f"{m}_nested_absmax").float() if dq else None,
            offset_E=getattr(self, f"{m}_offset").float() if dq else None,
            nested_quant_map=self.nested_quant_map.float() if dq else None,
        )

    @torch.no_grad()
    def set_stack(self, m: str, stack: NF4Stack) -> None:
        if (stack.rows, stack.cols, stack.double_quant, stack.num_experts) != (self.hidden, self.d_model, self.double_quant, self.num_experts):
            raise ValueError(
                f"{m}: an NF4 stack of {stack.num_experts} x [{stack.rows}, {stack.cols}] (double quant {stack.double_quant}) does not fit "
                f"{self.num_experts} x [{self.hidden}, {self.d_model}] (double quant {self.double_quant})"
            )
        for part, value in nf4_per_expert(stack, lambda t: t).items():
            name = {"codes_EP": "codes", "absmax_EA": "absmax", "nested_absmax_EM": "nested_absmax", "offset_E": "offset"}[part]
            getattr(self, f"{m}_{name}").copy_(value)
        self.quant_map.copy_(stack.quant_map)
        if self.double_quant:
            self.nested_quant_map.copy_(stack.nested_quant_map)

    def lora_stack(self, m: str) -> LoRAStack:
        return LoRAStack(getattr(self, f"{m}_lora_A"), getattr(self, f"{m}_lora_B"), self.scale)

    def weights(self) -> NF4LoRAExperts:
        """What an NF4 expert backend receives. Built from the buffers and parameters at each call:
        nothing dequantized is cached, so a recompute (reversible backward) sees the same weights."""
        return NF4LoRAExperts(*(self.stack(m) for m in MATRICES), *(self.lora_stack(m) for m in MATRICES))

    @torch.no_grad()
    def dequantized(self, m: str) -> torch.Tensor:
        """Matrix m's base, float32, in the full-precision layout (w_down as [E, D, F])."""
        w = dequantize_stack(self.stack(m))
        return w.transpose(1, 2).contiguous() if m == "w_down" else w

    @torch.no_grad()
    def merged(self, m: str) -> torch.Tensor:
        """Base plus the LoRA update, float32, in the full-precision layout."""
        A, B = getattr(self, f"{m}_lora_A").float(), getattr(self, f"{m}_lora_B").float()
        return self.dequantized(m) + self.scale * (B @ A)

    # A `dequantize(stack, experts)` for the reference backend to use instead of bitsandbytes'
    # (growtrain/generate.py sets one that dequantizes every base once, for decoding).
    dequantize = None

    def forward(self, x_sorted_ND: torch.Tensor, offsets_E1: torch.Tensor, backend: str = "reference") -> torch.Tensor:
        run = get_expert_backend(backend, "nf4")
        if self.dequantize is not None and backend == "reference":
            return run(x_sorted_ND, offsets_E1, self.weights(), dequantize=self.dequantize)
        return run(x_sorted_ND, offsets_E1, self.weights())


def stored_layout(m: str, w_EOI: torch.Tensor) -> torch.Tensor:
    """A full-precision expert matrix [E, out, in] in the NF4 storage layout ([E, F, D])."""
    return w_EOI.transpose(1, 2).contiguous() if m == "w_down" else w_EOI


def stack_state(m: str, stack: NF4Stack) -> dict[str, torch.Tensor]:
    """The NF4Experts buffers (names relative to the experts module) that hold matrix m's `stack`,
    plus the shared code books: what an operator writes into a state dict for `materialize`."""
    names = {"codes_EP": "codes", "absmax_EA": "absmax", "nested_absmax_EM": "nested_absmax", "offset_E": "offset"}
    out = {f"{m}_{names[k]}": v.contiguous() for k, v in nf4_per_expert(stack, lambda t: t).items()}
    out["quant_map"] = stack.quant_map
    if stack.double_quant:
        out["nested_quant_map"] = stack.nested_quant_map
    return out


def state_stack(m: str, state: dict[str, torch.Tensor], rows: int, cols: int) -> NF4Stack:
    """Inverse of `stack_state`: matrix m's NF4Stack from NF4Experts buffers (names relative to the
    experts module, [rows, cols] per expert in the stored layout)."""
    dq = f"{m}_nested_absmax" in state
    return NF4Stack(
        codes_EP=state[f"{m}_codes"],
        absmax_EA=state[f"{m}_absmax"],
        quant_map=state["quant_map"].float(),
        rows=rows,
        cols=cols,
        nested_absmax_EM=state[f"{m}_nested_absmax"].float() if dq else None,
        offset_E=state[f"{m}_offset"].float() if dq else None,
        nested_quant_map=state["nested_quant_map"].float() if dq else None,
    )
