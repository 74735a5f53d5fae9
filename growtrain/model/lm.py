"""The growtrain language model (DESIGN.md §4): embeddings, a stack of RevNet-style additive
coupling blocks over two fp32 residual streams (or, with `config.block: residual`, standard pre-norm
residual blocks on one stream), final norm, untied LM head. With `config.reversible` (the default)
a training forward keeps no per-block activations: the backward rebuilds them from the block
outputs (growtrain/model/reversible.py); residual blocks are checkpointed instead. With `config.dense_lora` the
dense Linear layers it names are wrapped by peft LoRA when the model is built. `forward_cached`
decodes incrementally with a `KVCache` (growtrain/generate.py).

Legend: B batch, T sequence, D d_model, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from growtrain.model.config import ModelConfig
from growtrain.model.layers import AttentionBranch, AttentionCache, FFNBranch, RMSNorm, SwiGLU, compute_dtype, normal_init_, out_proj_std
from growtrain.model.expert_backends import resolve_expert_backend
from growtrain.model.moe import MoE, MoEStats, update_balance_bias
from growtrain.model.reversible import checkpointed_blocks, plain_blocks, reversible_blocks


@dataclass
class ModelOutput:
    logits: torch.Tensor  # [B, T, V]
    aux_loss: torch.Tensor  # scalar: sum of the MoE layers' aux losses (0 for a dense model)
    moe_stats: list[MoEStats] = field(default_factory=list)  # one per MoE block, in block order


class KVCache:
    """What incremental decoding keeps between calls: each block's attention keys and values.
    Nothing else is needed: in y1 = x1 + F(x2), y2 = x2 + G(y1) only F (attention) mixes
    positions; norms, the FFN and the MoE router act on each token alone, so a new token's two
    streams follow from its own streams and the K/V of the earlier positions."""

    def __init__(self, n_layers: int, capacity: int = 0):
        self.layers = [AttentionCache(capacity) for _ in range(n_layers)]
        self.length = 0  # positions held (also without blocks, where no layer counts them)


def check_config(config: ModelConfig) -> None:
    """Raise once with every problem that would stop the model from being built."""
    problems = []
    if config.vocab_size <= 0:
        problems.append(f"vocab_size must be positive (the trainer fills it from the tokenizer), got {config.vocab_size}")
    if config.n_heads <= 0 or config.n_heads % config.kv_heads:
        problems.append(f"n_heads ({config.n_heads}) must be a positive multiple of n_kv_heads ({config.kv_heads})")
    if config.head_size <= 0 or config.head_size % 2:
        problems.append(f"head size must be positive and even for RoPE, got {config.head_size}")
    bad = [i for i in config.moe_layers if not 0 <= i < config.n_layers]
    if bad:
        problems.append(f"moe_layers {bad} are outside 0..{config.n_layers - 1}")
    if config.moe_layers and config.moe is None:
        problems.append("moe_layers is set but moe is null; set moe or clear moe_layers")
    if problems:
        raise ValueError("invalid model config:\n  - " + "\n  - ".join(problems))


class _Block(nn.Module):
    """What both block kinds hold, under the same names (growth operators and checkpoints address
    them alike): F = attention(RMSNorm(.)) as `f`, G = FFN or MoE (RMSNorm(.)) as `g`."""

    def __init__(self, config: ModelConfig, index: int):
        super().__init__()
        self.index = index
        self.f = AttentionBranch(config)
        if config.is_moe_layer(index):
            ffn: nn.Module = MoE(config)
        else:
            ffn = SwiGLU(config.d_model, config.ffn_hidden, config.init_std, out_proj_std(config))
        self.g = FFNBranch(config, ffn)

    @property
    def is_moe(self) -> bool:
        return self.g.is_moe


class CouplingBlock(_Block):
    """y1 = x1 + F(x2); y2 = x2 + G(y1). Inverse: x2 = y2 - G(y1); x1 = y1 - F(x2)."""

    def forward(
        self, x1: torch.Tensor, x2: torch.Tensor, routing: torch.Tensor | None = None, cache: AttentionCache | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, MoEStats | None]:
        # Branch outputs are cast back to the stream dtype: under autocast they come out bf16, and
        # adding bf16 into the streams would break the (near-)exact inverse.
        y1 = x1 + self.f(x2, cache).to(x1.dtype)
        g_out, stats = self.g(y1, routing=routing)
        y2 = x2 + g_out.to(x2.dtype)
        return y1, y2, stats


class ResidualBlock(_Block):
    """The standard pre-norm block on one stream: h = x + F(x); y = h + G(h).

    It takes and returns the coupling blocks' two streams, both holding the one residual stream:
    x2 is x1 on the way in, and y is returned as both outputs, so the embedding, the head's
    (y1 + y2) / 2 (exactly y: doubling and halving are exact in binary floating point), the KV-cache
    decoding and the block loops are shared with the coupling model."""

    def forward(
        self, x1: torch.Tensor, x2: torch.Tensor, routing: torch.Tensor | None = None, cache: AttentionCache | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, MoEStats | None]:
        h = x1 + self.f(x1, cache).to(x1.dtype)
        g_out, stats = self.g(h, routing=routing)
        y = h + g_out.to(h.dtype)
        return y, y, stats


BLOCKS = {"coupling": CouplingBlock, "residual": ResidualBlock}


class GrowLM(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        check_config(config)
        self.config = config
        # nn.Embedding draws its own N(0, 1) init, redrawn below: kept where it consumes the generator
        # (the models a seed builds stay the same), given an empty weight on meta (layers.normal_init_).
        meta = torch.empty(0).is_meta
        self.embed = nn.Embedding(config.vocab_size, config.d_model, _weight=torch.empty(config.vocab_size, config.d_model) if meta else None)
        self.blocks = nn.ModuleList(BLOCKS[config.block](config, i) for i in range(config.n_layers))
        self.final_norm = RMSNorm(config.d_model, config.norm_eps)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self._init_own_weights()
        if config.dense_lora is not None:
            # Wrapped at build time (peft renames the wrapped weights), so a checkpoint of a wrapped
            # model loads strictly into GrowLM(its config), as resume and export do.
            from growtrain.model.dense_lora import apply_dense_lora

            apply_dense_lora(self, config.dense_lora)

    def _init_own_weights(self) -> None:
        normal_init_(self.embed.weight, self.config.init_std)
        normal_init_(self.lm_head.weight, self.config.init_std)

    def init_weights(self) -> None:
        """Re-run the initialization of every parameter and buffer (e.g. after `to_empty`)."""
        for module in self.modules():
            if module is not self and hasattr(module, "reset_parameters"):
                if not isinstance(module, (nn.Embedding, nn.Linear)):
                    module.reset_parameters()
            if hasattr(module, "reset_lora_parameters"):  # a peft LoRA layer (dense_lora): A as peft draws it, B zero
                for adapter in module.lora_A:
                    module.reset_lora_parameters(adapter, True)
        self._init_own_weights()

    # The expert backend the MoE layers run: runtime state, not shape (ModelConfig holds none), so
    # a checkpoint resumes on any hardware. Growth copies it to the grown model (stages/transition.py).
    expert_backend: str = "reference"

    def set_expert_backend(self, setting: str) -> str:
        """Run every MoE layer on train.expert_backend `setting` ('auto' resolved for the device of
        the model's parameters, those it holds: an AF expert rank's dense ones are on meta);
        returns the backend name it resolved to."""
        device = next((p.device for p in self.parameters() if not p.is_meta), torch.device("meta"))
        name = resolve_expert_backend(setting, device)
        for layer in self.moe_layers:
            layer.set_expert_backend(name)
        self.expert_backend = name
        return name

    @property
    def moe_layers(self) -> list[MoE]:
        return [block.g.ffn for block in self.blocks if block.is_moe]

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(self, tokens_BT: torch.Tensor) -> ModelOutput:
        x1, x2 = self.embed_streams(tokens_BT)
        if self.config.reversible and torch.is_grad_enabled() and self.config.block == "residual":
            x1, x2, stats = checkpointed_blocks(self.blocks, x1, x2)
        elif self.config.reversible and torch.is_grad_enabled():
            x1, x2, stats = reversible_blocks(self.blocks, x1, x2)
        else:
            x1, x2, stats = plain_blocks(self.blocks, x1, x2)
        return self.head(x1, x2, stats)

    def new_cache(self, capacity: int = 0) -> KVCache:
        """An empty KV cache for `forward_cached` (its buffers sized for `capacity` positions)."""
        return KVCache(len(self.blocks), capacity)

    @torch.no_grad()
    def forward_cached(self, tokens_BT: torch.Tensor, cache: KVCache) -> ModelOutput:
        """Logits of `tokens_BT` as the positions after those in `cache`, which it extends.

        With an empty cache this runs the ops of `forward` on the same operands, so the logits are
        bit for bit the same. After that, position t's logits equal row t of a full forward over all
        tokens so far within fp32 rounding, not bitwise: the projections see one row instead of a
        whole sequence and the softmax one query against cached keys (other BLAS blocking, other
        summation order). Decoding only: no autograd graph."""
        x1, x2 = self.embed_streams(tokens_BT)
        stats: list[MoEStats] = []
        for block, layer_cache in zip(self.blocks, cache.layers):
            x1, x2, s = block(x1, x2, cache=layer_cache)
            if s is not None:
                stats.append(s)
        cache.length += tokens_BT.shape[1]
        return self.head(x1, x2, stats)

    def embed_streams(self, tokens_BT: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The two input streams (both the embedding)."""
        # Streams in fp32 (bf16 streams drift ~1e-3 per block); an fp64 model keeps fp64 for exact tests.
        x_BTD = self.embed(tokens_BT)
        x_BTD = x_BTD.to(compute_dtype(x_BTD.dtype))
        return x_BTD, x_BTD

    def head(self, x1_BTD: torch.Tensor, x2_BTD: torch.Tensor, stats: list[MoEStats]) -> ModelOutput:
        """Logits from the final streams; the aux loss summed over the MoE blocks' stats."""
        h_BTD = self.final_norm((x1_BTD + x2_BTD) / 2)
        logits_BTV = self.lm_head(h_BTD)
        aux = torch.zeros((), device=x1_BTD.device, dtype=torch.float32)
        for s in stats:
            aux = aux + s.aux_loss.float()
        return ModelOutput(logits=logits_BTV, aux_loss=aux, moe_stats=stats)

    def update_balance_biases(self, loads_E: list[torch.Tensor]) -> None:
        """One loss-free balancing step per MoE layer from its expert loads (summed over the step's micro-batches)."""
        layers = self.moe_layers
        if len(loads_E) != len(layers):
            raise ValueError(f"got {len(loads_E)} expert loads for {len(layers)} MoE layers")
        for layer, load in zip(layers, loads_E):
            update_balance_bias(layer, load)
