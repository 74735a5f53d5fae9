"""8-bit Adam moments for the dense parts (`optimizer.dense_state_bits: 8`): growtrain's name-keyed
AdamW (growtrain/optim/adamw.py), with each selected parameter's two moments stored blockwise-quantized
as bitsandbytes' 8-bit optimizers store them: blocks of 256, one float32 absmax per block, the
signed dynamic map for exp_avg and the unsigned one for exp_avg_sq. About 2.03 bytes per parameter
instead of 8.

Which parameters: every trainable tensor of at least 4096 elements (bitsandbytes' min_8bit_size;
smaller ones gain nothing), except the routed experts' LoRA adapters (the state the NF4 regime
keeps in 32 bits), the router weights (top-k decisions are sensitive to their updates) and the
token embeddings, as bitsandbytes' StableEmbedding does (it registers a 32-bit state override
for its weight; arXiv 2110.02861 §2.3): their gradient is row-sparse, and a rare token's second
moment, 8-bit in a block shared with frequent tokens, can round to zero under a nonzero first
moment, which makes its step m / eps.

The update: a tensor whose multipliers are floats and whose step is an int goes through
bitsandbytes' blockwise 8-bit Adam update (`optimizer_update_8bit_blockwise`, what
`bitsandbytes.optim.AdamW8bit` runs: dequantize, step and requantize in one call, codes and absmax
updated in place) with lr·lr_mult, weight_decay·wd_mult and eps·eps_mult. Its formula is AdamW's
(decoupled decay applied first, then m/(1 - beta1^t) / (sqrt(v)/sqrt(1 - beta2^t) + eps), as its
CPU and pure-PyTorch implementations read; its CUDA kernel is not checked against this yet): the
same step within fp32 rounding for the same moments (tests/test_optim8bit.py). A tensor with
per-element multipliers or step counts (grown ones) is dequantized, stepped by growtrain's exact
element-by-element update (growtrain.optim.adamw.adamw_step) and requantized, so DESIGN.md §7's fields
stay exact; tensors kept in 32 bits step with growtrain.optim.adamw.adamw_step as in AdamW.

Everything outside the optimizer sees float32 `ParamState`s: `state` is a read-only mapping that
dequantizes on access, so growth (transition.map_optimizer_state) maps moments as it does for
32-bit state, and a state handed back unchanged (a carried parameter) keeps its codes without a
requantization round trip. Checkpoints hold the codes and absmax as tensors (loadable with
torch.load(weights_only=True)), so a resume continues bit for bit.

Legend: N elements of a parameter, B = ceil(N / 256) blocks.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace

import torch
from torch import nn

from growtrain.model.expert_shards import is_expert_tensor
from growtrain.kernels.nf4_reference import bitsandbytes_functional
from growtrain.optim.adamw import FUSED_DEVICES, AdamW, ParamState, adamw_step

BLOCKSIZE = 256  # bitsandbytes' blockwise optimizer state
MIN_8BIT_NUMEL = 4096


EXCLUDED_SUFFIXES = ("router.weight", "embed.weight")


def uses_8bit_state(name: str, p: torch.Tensor) -> bool:
    """Dense parts with enough elements; never the experts' adapters, the routers or the embeddings.
    A stacked expert tensor [E, ...] only where each expert fills whole quantization blocks: then
    its blocks never straddle two experts, and an expert-parallel rank's slice of the experts holds
    exactly the codes and absmax one process holds for them (the same update, any EP size)."""
    is_adapter = ".ffn.experts." in name and "_lora_" in name
    if is_expert_tensor(name) and p.ndim and (p.numel() // max(p.shape[0], 1)) % BLOCKSIZE:
        return False
    return p.numel() >= MIN_8BIT_NUMEL and not is_adapter and not name.endswith(EXCLUDED_SUFFIXES)


_MAPS: dict[tuple[bool, str], torch.Tensor] = {}


def dynamic_map(signed: bool, device: torch.device) -> torch.Tensor:
    key = (signed, str(device))
    if key not in _MAPS:
        _MAPS[key] = bitsandbytes_functional().create_dynamic_map(signed=signed).to(device)
    return _MAPS[key]


def _zero_code(signed: bool, device: torch.device) -> int:
    """The code of the dynamic map whose value is exactly 0."""
    (index,) = (dynamic_map(signed, device) == 0).nonzero()[0].tolist()
    return index


@dataclass
class Moment8bit:
    """One moment tensor stored as 8-bit codes (shaped like the parameter) and per-block absmax."""

    codes: torch.Tensor  # uint8, shaped like the parameter
    absmax_B: torch.Tensor  # float32
    signed: bool

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    @classmethod
    def quantize(cls, x: torch.Tensor, signed: bool) -> Moment8bit:
        if x.is_meta:  # planning on the meta device: shapes only
            return cls(torch.empty(x.shape, dtype=torch.uint8, device="meta"), torch.empty(math.ceil(x.numel() / BLOCKSIZE), device="meta"), signed)
        bnbf = bitsandbytes_functional()
        x = x.detach().float().contiguous()
        codes, qs = bnbf.quantize_blockwise(x, code=dynamic_map(signed, x.device), blocksize=BLOCKSIZE)
        # bitsandbytes rounds an exact zero in a block with nonzero values to a nonzero code (~2e-5
        # of the block's absmax for exp_avg): a zero moment must stay zero, or an element growth
        # added fresh inside a copied tensor starts with ghost moments and its first Adam step is
        # off by up to ~1x the LR (found by the fresh-state check, stages/dynamics.py).
        codes = codes.masked_fill(x.view(codes.shape) == 0, _zero_code(signed, x.device))
        return cls(codes, qs.absmax.float(), signed)

    def dequantize(self) -> torch.Tensor:
        bnbf = bitsandbytes_functional()
        out = bnbf.dequantize_blockwise(self.codes, absmax=self.absmax_B, code=dynamic_map(self.signed, self.codes.device), blocksize=BLOCKSIZE)
        return out.float()


class _Float32View(Mapping):
    """name -> float32 ParamState, dequantized on access (the optimizer's `state` for outsiders)."""

    def __init__(self, opt: AdamW8bit):
        self._opt = opt

    def __getitem__(self, name: str) -> ParamState:
        return self._opt._logical(name)

    def __iter__(self):
        return iter(self._opt._packed)

    def __len__(self) -> int:
        return len(self._opt._packed)

    def __delitem__(self, name: str) -> None:
        """Drop an entry (growth releasing the state of experts a quantization folds)."""
        del self._opt._packed[name]

    def pop(self, name: str) -> ParamState:
        s = self[name]
        del self[name]
        return s


class AdamW8bit(AdamW):
    """AdamW with 8-bit moments on the dense parts (`dense_state_bits: 8`; built by
    growtrain.optim.registry.build_optimizer)."""

    state_bits = 8

    def __init__(self, named_params: dict[str, nn.Parameter], cfg):
        self._packed: dict[str, ParamState] = {}
        super().__init__(named_params, cfg)

    # -- state as the rest of growtrain sees it (float32) ----------------------------------------

    @property
    def state(self):
        return _Float32View(self)

    @state.setter
    def state(self, value) -> None:
        packed, kept = {}, set()
        for name, s in value.items():
            s = self._pack(name, s)
            if isinstance(s.exp_avg, Moment8bit):  # steps update codes in place: no two entries may share them
                moments = [m if id(m) not in kept else replace(m, codes=m.codes.clone(), absmax_B=m.absmax_B.clone()) for m in (s.exp_avg, s.exp_avg_sq)]
                kept.update(id(m) for m in moments)
                s = replace(s, exp_avg=moments[0], exp_avg_sq=moments[1])
            packed[name] = s
        self._packed = packed

    def _stored(self) -> dict[str, ParamState]:
        # The multipliers are the same objects in the packed states: no dequantization needed.
        return self._packed

    def _is_8bit(self, name: str) -> bool:
        p = self.params.get(name)
        return p is not None and uses_8bit_state(name, p)

    def _pack(self, name: str, s: ParamState) -> ParamState:
        if not self._is_8bit(name) or isinstance(s.exp_avg, Moment8bit):
            return s
        return replace(s, exp_avg=_requantized(s.exp_avg, True), exp_avg_sq=_requantized(s.exp_avg_sq, False))

    def _logical(self, name: str) -> ParamState:
        s = self._packed[name]
        if not isinstance(s.exp_avg, Moment8bit):
            return s
        return replace(s, exp_avg=_tagged(s.exp_avg), exp_avg_sq=_tagged(s.exp_avg_sq))

    # -- the update ------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, lr: float) -> None:
        plain, blockwise, unpacked = [], [], []
        for name, p in self.params.items():
            if p.grad is None:
                continue
            s = self._packed[name]
            if not isinstance(s.exp_avg, Moment8bit):
                plain.append((p, s))
            elif _blockwise_update_fits(p, s):
                blockwise.append((p, s))
            else:  # per-element multipliers or steps: growtrain's exact update on float32 moments
                unpacked.append((name, p, replace(s, exp_avg=s.exp_avg.dequantize(), exp_avg_sq=s.exp_avg_sq.dequantize())))
        adamw_step(plain + [(p, s) for _, p, s in unpacked], lr, self.cfg)
        for name, _, s in unpacked:
            self._packed[name] = replace(s, exp_avg=Moment8bit.quantize(s.exp_avg, True), exp_avg_sq=Moment8bit.quantize(s.exp_avg_sq, False))
        if blockwise:
            _blockwise_step(blockwise, lr, self.cfg)

    # -- checkpoints -----------------------------------------------------------------------------

    def state_dict(self) -> dict:
        out = {}
        for name, s in self._packed.items():
            entry = {f.name: getattr(s, f.name) for f in fields(s)}
            if isinstance(s.exp_avg, Moment8bit):
                for key in ("exp_avg", "exp_avg_sq"):
                    m = entry.pop(key)
                    entry[f"{key}_codes"], entry[f"{key}_absmax"] = m.codes, _absmax_layout(name, m)
            out[name] = entry
        return out

    def load_state_dict(self, d: dict) -> None:
        states = {}
        for name, entry in d.items():
            entry = dict(entry)
            if "exp_avg_codes" in entry:
                # Rebuilt from the stored codes: no requantization, so a resume is bit-exact.
                for key, signed in (("exp_avg", True), ("exp_avg_sq", False)):
                    codes, absmax = entry.pop(f"{key}_codes"), entry.pop(f"{key}_absmax").reshape(-1)
                    if absmax.numel() != math.ceil(codes.numel() / BLOCKSIZE):
                        raise ValueError(
                            f"8-bit optimizer state of {name}: {absmax.numel()} absmax values for {codes.numel()} codes "
                            f"(blocks of {BLOCKSIZE}); its blocks straddle experts, so it cannot be cut to another EP size"
                        )
                    entry[key] = Moment8bit(codes, absmax, signed)
            states[name] = ParamState(**entry)
        missing = sorted(set(self.params) - set(states))
        stray = sorted(set(states) - set(self.params))
        if missing or stray:
            raise ValueError(f"optimizer state does not match the model: missing {missing[:5]}, stray {stray[:5]}")
        for n, p in self.params.items():
            if tuple(states[n].exp_avg.shape) != tuple(p.shape):
                raise ValueError(f"optimizer state of {n} has shape {tuple(states[n].exp_avg.shape)}, parameter {tuple(p.shape)}")
        self._packed = {n: self._pack(n, s) for n, s in states.items()}


# A float32 moment handed out by the optimizer carries the 8-bit moment it was dequantized from
# (attribute PACKED on the tensor object). Quantization is not idempotent (the signed map's most
# negative code is -0.993, so a block whose largest magnitude is negative comes back with a smaller
# absmax): a moment that growth carries unchanged, or moves to another rank (ZeRO-1 owners change,
# a gather and re-shard), must keep its codes, or the 8-bit state would drift at every growth and
# differ between layouts. The movers (growtrain/parallel/distributed.py, stages/sharding.py) send the codes
# and absmax along (packed_fields / with_packed); whoever rebinds the optimizer keeps them where
# they still dequantize to exactly the float32 values handed back.
PACKED = "_growtrain_8bit"
PACKED_KEYS = ("exp_avg_codes", "exp_avg_absmax", "exp_avg_sq_codes", "exp_avg_sq_absmax")


def _tagged(m: Moment8bit) -> torch.Tensor:
    out = m.dequantize()
    setattr(out, PACKED, m)
    return out


def _requantized(x: torch.Tensor, signed: bool) -> Moment8bit:
    """x's 8-bit moment: the one it was dequantized from where x still equals that exactly (a view
    handed out before a step no longer does: the step updates the codes in place), else quantized."""
    m = getattr(x, PACKED, None)
    if m is not None and not x.is_meta and m.signed == signed and m.codes.shape == x.shape and m.codes.device == x.device:
        if torch.equal(m.dequantize(), x):
            return m
    return Moment8bit.quantize(x, signed)


def packed_fields(s: ParamState) -> dict[str, torch.Tensor]:
    """The 8-bit codes and absmax a float32 state was dequantized from (PACKED_KEYS), or {}: what a
    mover sends along with the state's fields."""
    m, v = getattr(s.exp_avg, PACKED, None), getattr(s.exp_avg_sq, PACKED, None)
    if m is None or v is None:
        return {}
    return {"exp_avg_codes": m.codes, "exp_avg_absmax": m.absmax_B, "exp_avg_sq_codes": v.codes, "exp_avg_sq_absmax": v.absmax_B}


def with_packed(s: ParamState, fields: dict[str, torch.Tensor]) -> ParamState:
    """`s` (a float32 state just received or cut) tagged with the codes and absmax that came with it."""
    if all(k in fields for k in PACKED_KEYS):
        setattr(s.exp_avg, PACKED, Moment8bit(fields["exp_avg_codes"], fields["exp_avg_absmax"], True))
        setattr(s.exp_avg_sq, PACKED, Moment8bit(fields["exp_avg_sq_codes"], fields["exp_avg_sq_absmax"], False))
    return s


def _absmax_layout(name: str, m: Moment8bit) -> torch.Tensor:
    """A stacked expert tensor's absmax as [E, blocks per expert] in checkpoints: expert-parallel
    checkpoints cut and join every expert entry along dim 0 (growtrain/model/expert_shards.py), the absmax with
    the codes. Other tensors' absmax stays flat."""
    E = m.codes.shape[0] if m.codes.ndim else 0
    if is_expert_tensor(name) and E and m.absmax_B.numel() % E == 0 and (m.codes.numel() // E) % BLOCKSIZE == 0:
        return m.absmax_B.view(E, -1)
    return m.absmax_B


def _blockwise_update_fits(p: torch.Tensor, s: ParamState) -> bool:
    """bitsandbytes' update takes one step count and float hyperparameters per tensor."""
    g = p.grad
    return (
        s.has_scalar_schedule()
        and p.device.type in FUSED_DEVICES
        and p.dtype == g.dtype == torch.float32
        and p.is_contiguous()
        and g.is_contiguous()
        and g.layout == torch.strided
        and s.exp_avg.codes.device == p.device
    )


def _blockwise_step(items: list[tuple[torch.Tensor, ParamState]], lr: float, cfg) -> None:
    bnbf = bitsandbytes_functional()
    for p, s in items:
        s.step += 1
        m, v = s.exp_avg, s.exp_avg_sq
        bnbf.optimizer_update_8bit_blockwise(
            "adam", p.grad, p, m.codes, v.codes,
            cfg.beta1, cfg.beta2, 0.0, 0.0,  # beta3 and alpha: AdEMAMix only
            cfg.eps * s.eps_mult, s.step, lr * s.lr_mult,
            dynamic_map(True, p.device), dynamic_map(False, p.device), m.absmax_B, v.absmax_B,
            weight_decay=cfg.weight_decay * s.wd_mult, gnorm_scale=1.0,
        )


def state_bytes(opt: AdamW) -> int:
    """Bytes of every tensor the optimizer stores (moments, absmax, tensor multipliers, steps)."""
    total = 0
    for entry in opt.state_dict().values():
        for v in entry.values():
            if isinstance(v, torch.Tensor):
                total += v.numel() * v.element_size()
    return total
