"""Model: shape config, layers, MoE, and the coupled two-stream LM."""

from growtrain.model.config import ModelConfig, MoEConfig
from growtrain.model.lm import CouplingBlock, GrowLM, ModelOutput
from growtrain.model.expert_backends import EXPERT_BACKENDS, get_expert_backend
from growtrain.model.moe import MoE, MoEStats, update_balance_bias

__all__ = [
    "EXPERT_BACKENDS",
    "CouplingBlock",
    "GrowLM",
    "ModelConfig",
    "ModelOutput",
    "MoE",
    "MoEConfig",
    "MoEStats",
    "get_expert_backend",
    "update_balance_bias",
]
