"""Configuration of a growtrain model exported for transformers (`growtrain export-hf`).

Self-contained: imports transformers only, so the exported folder loads where growtrain is not
installed. Field names follow transformers' conventions where one exists (hidden_size,
num_attention_heads, ...); the rest describe growtrain's coupling blocks and MoE layers.
"""

from transformers import PretrainedConfig


class GrowLMConfig(PretrainedConfig):
    model_type = "growlm"
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(
        self,
        vocab_size=257,
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=32,
        intermediate_size=384,
        rope_theta=10000.0,
        qkv_bias=False,
        rms_norm_eps=1e-6,
        max_position_embeddings=2048,
        block_type="coupling",
        moe_layers=(),
        num_experts=0,
        num_experts_per_tok=0,
        moe_intermediate_size=0,
        router_score_func="softmax",
        shared_expert_intermediate_size=0,
        initializer_range=0.02,
        use_cache=True,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        tie_word_embeddings=False,
        **kwargs,
    ):
        if block_type not in ("coupling", "residual"):
            raise ValueError(f"block_type must be 'coupling' or 'residual', got {block_type!r}")
        if router_score_func not in ("softmax", "sigmoid"):
            raise ValueError(f"router_score_func must be 'softmax' or 'sigmoid', got {router_score_func!r}")
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.head_dim = head_dim
        self.intermediate_size = intermediate_size
        self.rope_theta = rope_theta
        self.qkv_bias = qkv_bias
        self.rms_norm_eps = rms_norm_eps
        self.max_position_embeddings = max_position_embeddings
        self.block_type = block_type
        self.moe_layers = list(moe_layers)
        self.num_experts = num_experts
        self.num_experts_per_tok = num_experts_per_tok
        self.moe_intermediate_size = moe_intermediate_size
        self.router_score_func = router_score_func
        self.shared_expert_intermediate_size = shared_expert_intermediate_size
        self.initializer_range = initializer_range
        self.use_cache = use_cache
        super().__init__(
            bos_token_id=bos_token_id,
            eos_token_id=eos_token_id,
            pad_token_id=pad_token_id,
            tie_word_embeddings=tie_word_embeddings,
            **kwargs,
        )
