"""Shape of a model: the part of the recipe that the model classes, the growth operators and the
planner all read. Frozen so that a stage's shape can be derived, compared and hashed."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import ClassVar, Literal


@dataclass(frozen=True)
class ExpertLoRAConfig:
    """LoRA pair trained on each routed expert's NF4 matrices (field names as in peft's LoraConfig)."""

    r: int = field(default=16, metadata={"doc": "LoRA rank per expert and matrix.", "ge": 1})
    lora_alpha: float = field(default=16.0, metadata={"doc": "LoRA alpha: the update is scaled by lora_alpha / r.", "gt": 0.0})
    use_rslora: bool = field(default=False, metadata={"doc": "rsLoRA: scale by lora_alpha / sqrt(r) instead."})

    @property
    def scale(self) -> float:
        return self.lora_alpha / (self.r**0.5 if self.use_rslora else self.r)


# The dense nn.Linear modules of a GrowLM (attention; dense SwiGLU FFNs and shared experts; LM head).
DENSE_LINEAR_NAMES = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "lm_head")


@dataclass(frozen=True)
class DenseLoRAConfig:
    """peft LoRA on dense Linear layers: bases frozen, adapters trained (field names as in peft's LoraConfig)."""

    r: int = field(default=16, metadata={"doc": "LoRA rank.", "ge": 1})
    lora_alpha: float = field(default=16.0, metadata={"doc": "LoRA alpha (scale lora_alpha / r).", "gt": 0.0})
    use_rslora: bool = field(default=False, metadata={"doc": "rsLoRA: scale lora_alpha / sqrt(r)."})
    target_modules: tuple[str, ...] = field(
        default=("wq", "wk", "wv", "wo"),
        metadata={"doc": "Names of the nn.Linear modules to adapt (peft suffix match): wq, wk, wv, wo, w_gate, w_up, w_down (dense FFN and shared expert), lm_head."},
    )

    @property
    def scale(self) -> float:
        """peft's scaling of the update B @ A."""
        return self.lora_alpha / (self.r**0.5 if self.use_rslora else self.r)

    def __post_init__(self):
        if isinstance(self.target_modules, list):  # from a checkpoint's plain-dict model_config
            object.__setattr__(self, "target_modules", tuple(self.target_modules))
        unknown = [t for t in self.target_modules if t not in DENSE_LINEAR_NAMES]
        if unknown or not self.target_modules:
            raise ValueError(f"dense_lora.target_modules {list(self.target_modules)}: each must be one of {', '.join(DENSE_LINEAR_NAMES)}")

    def peft_config(self):
        import peft  # imported lazily: seconds

        return peft.LoraConfig(
            r=self.r,
            lora_alpha=self.lora_alpha,
            use_rslora=self.use_rslora,
            target_modules=list(self.target_modules),
            lora_dropout=0.0,  # the reversible backward recomputes F: dropout would draw a different mask
            bias="none",
        )


@dataclass(frozen=True)
class MoEConfig:
    """One routed-expert FFN layer (DESIGN.md §4). Shape and training math only: which kernels run
    the experts is runtime state (train.expert_backend, GrowLM.set_expert_backend), so a resume on
    other hardware is not a change of model."""

    # Keys that used to live here, and where they are set now. Recipes that still give one are
    # refused with that name (growtrain/recipe.py); checkpoints that still hold one load without it.
    MOVED_KEYS: ClassVar[dict[str, str]] = {"expert_backend": "train.expert_backend"}

    num_experts: int = field(default=8, metadata={"doc": "Routed experts per MoE layer."})
    top_k: int = field(default=2, metadata={"doc": "Experts chosen per token."})
    expert_hidden: int = field(default=256, metadata={"doc": "Hidden width of each routed expert's SwiGLU."})
    score_func: Literal["softmax", "sigmoid"] = field(
        default="softmax", metadata={"doc": "Router score function; gates are renormalized over the selected experts."}
    )
    shared_expert_hidden: int = field(
        default=0, metadata={"doc": "Hidden width of an always-on shared SwiGLU expert; 0 disables it."}
    )
    balance_bias_rate: float = field(
        default=0.0,
        metadata={
            "doc": "Loss-free balancing: per-step update of a selection-only router bias "
            "(sign of the load error times this rate); 0 disables it.",
            "ge": 0.0,
        },
    )
    aux_loss_coef: float = field(default=0.01, metadata={"doc": "Weight of the load-balance loss.", "ge": 0.0})
    z_loss_coef: float = field(default=0.001, metadata={"doc": "Weight of the router z-loss.", "ge": 0.0})
    router_init_std: float = field(default=0.02, metadata={"doc": "Std of the router's initial weights.", "gt": 0.0})
    expert_format: Literal["full", "nf4"] = field(
        default="full",
        metadata={
            "doc": "full: trainable full-precision experts; nf4: frozen bitsandbytes NF4 bases (blocksize 64) "
            "plus a trainable LoRA pair per expert and matrix (set by the quantize_experts operator)."
        },
    )
    double_quant: bool = field(
        default=True, metadata={"doc": "nf4 only: quantize the absmax too (8-bit, nested blocks of 256): ~0.516 instead of 0.5625 byte per weight."}
    )
    lora: ExpertLoRAConfig = field(default_factory=ExpertLoRAConfig, metadata={"doc": "nf4 only: the experts' LoRA pairs."})

    def __post_init__(self):
        if isinstance(self.lora, dict):  # from a checkpoint's plain-dict model_config
            object.__setattr__(self, "lora", ExpertLoRAConfig(**self.lora))


@dataclass(frozen=True)
class ModelConfig:
    """The seed model's shape; growth operators derive each later stage's shape from it."""

    vocab_size: int = field(default=0, metadata={"doc": "Vocabulary size; 0 takes the tokenizer's size."})
    d_model: int = field(default=128, metadata={"doc": "Width of each residual stream."})
    n_layers: int = field(default=2, metadata={"doc": "Number of coupling blocks."})
    n_heads: int = field(default=4, metadata={"doc": "Attention query heads."})
    n_kv_heads: int = field(default=0, metadata={"doc": "Key/value heads (GQA); 0 means n_heads."})
    head_dim: int = field(default=0, metadata={"doc": "Per-head width; 0 means d_model // n_heads."})
    ffn_hidden: int = field(default=384, metadata={"doc": "Hidden width of the dense SwiGLU FFN."})
    rope_theta: float = field(default=10000.0, metadata={"doc": "RoPE base."})
    qkv_bias: bool = field(
        default=False, metadata={"doc": "Biases on the query, key and value projections (Qwen2's layout; init_from sets it)."}
    )
    norm_eps: float = field(default=1e-6, metadata={"doc": "RMSNorm epsilon."})
    init_std: float = field(default=0.02, metadata={"doc": "Std of the initial linear weights."})
    moe: MoEConfig | None = field(
        default=None, metadata={"doc": "MoE settings of the MoE blocks; null for a dense model."}
    )
    moe_layers: tuple[int, ...] = field(
        default=(), metadata={"doc": "Indices of the blocks whose FFN is an MoE layer (requires `moe`)."}
    )
    block: Literal["coupling", "residual"] = field(
        default="coupling",
        metadata={
            "doc": "coupling: two-stream additive couplings y1 = x1 + F(x2), y2 = x2 + G(y1) (reversible); residual: the "
            "standard pre-norm block h = x + attention(norm(x)), y = h + ffn(norm(h)) on one stream, the layout of "
            "Llama / Mistral / Mixtral / Qwen2-MoE (what init_from imports and export-hf writes as transformers' own classes)."
        },
    )
    reversible: bool = field(
        default=True,
        metadata={
            "doc": "Reversible backward: keep only the final streams (and MoE routing) and rebuild each block's "
            "inputs from its outputs during backward, so activation memory stays flat in depth for ~1.3x compute; "
            "false: plain autograd. Residual blocks are not invertible: for them it checkpoints each block (keeps its "
            "input, one [batch, seq, d_model] tensor, and recomputes the block in backward with the forward's routing)."
        },
    )
    init_from: str = field(
        default="",
        metadata={
            "doc": "A local Hugging Face checkpoint folder (Llama / Mistral / Qwen2 layout: config.json, safetensors) to start "
            "from instead of random weights: implies block residual, takes every shape field from its config.json "
            "(leave them unset), and its tokenizer.json becomes data.tokenizer unless one is named. A relative path is "
            "relative to the recipe file. No hub access."
        },
    )
    dense_lora: DenseLoRAConfig | None = field(
        default=None,
        metadata={
            "doc": "peft LoRA on dense Linear layers (attention by default): their bases freeze, the adapters train. "
            "Growth operators cannot act on a peft-wrapped model, so it is the model's last form: set it with the "
            "add_dense_lora operator in the last stage that grows (here only for a recipe that never grows)."
        },
    )

    def __post_init__(self):
        if isinstance(self.dense_lora, dict):  # from a checkpoint's plain-dict model_config
            object.__setattr__(self, "dense_lora", DenseLoRAConfig(**self.dense_lora))

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_size(self) -> int:
        return self.head_dim or self.d_model // self.n_heads

    def is_moe_layer(self, index: int) -> bool:
        return self.moe is not None and index in self.moe_layers

    def with_changes(self, **changes) -> "ModelConfig":
        return replace(self, **changes)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        """Inverse of the plain-dict form stored in checkpoints (meta.json's model_config)."""
        moe = d.get("moe")
        if moe:  # checkpoints written before issue 13 hold moe.expert_backend: runtime state now
            moe = {k: v for k, v in moe.items() if k not in MoEConfig.MOVED_KEYS}
        return cls(**{**d, "moe": MoEConfig(**moe) if moe else None, "moe_layers": tuple(d.get("moe_layers", ()))})
