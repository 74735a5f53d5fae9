"""`growtrain plan`: what every stage of a recipe needs per GPU, and how fast it can run (DESIGN.md §13).

Nothing here trains or allocates weights. Parameter counts and the bytes of weights, NF4 codes,
gradients and optimizer state are exact, read off the real GrowLM and AdamW built on the meta
device (`counting`); activations are modelled op by op and checked against the saved-tensor meter
(`memory`); time is a roofline (`roofline`, `disaggregation`). `recipe` drives them over a
recipe's stages and `format` prints the result.

Imports go one way: errors, hardware and counting at the bottom, then memory, roofline,
disaggregation, recipe, format.
"""

from growtrain.planning.counting import ROLES, ModelCount, TensorInfo, build_meta_model, count_model, optimizer_state_bytes, role_of
from growtrain.planning.disaggregation import AfNotApplicable, AfSearch, AfSplit, af_search
from growtrain.planning.errors import PlanError
from growtrain.planning.format import format_plan
from growtrain.planning.hardware import GB, GIB, PRESETS, Hardware, get_hardware
from growtrain.planning.memory import (
    GRAD_BUCKET_BYTES,
    HEADROOM_TARGET,
    RUNTIME_RESERVE_BYTES,
    Activations,
    MemoryPerGpu,
    activation_bytes,
    autocast_weight_cache,
    growth_peak_bytes_per_rank,
    memory_per_gpu,
    workspace_bytes,
)
from growtrain.planning.recipe import ActivationsDetail, Plan, StagePlan, plan_recipe, resolve_vocab
# Not the `roofline` function: bound here it would hide the `roofline` submodule (it stays
# growtrain.planning.roofline.roofline).
from growtrain.planning.roofline import Side, StepTime, Work, max_micro_batch, micro_batch_work, model_flops_per_token, train_flops_per_token

__all__ = [
    "GB",
    "GIB",
    "GRAD_BUCKET_BYTES",
    "HEADROOM_TARGET",
    "PRESETS",
    "ROLES",
    "RUNTIME_RESERVE_BYTES",
    "Activations",
    "ActivationsDetail",
    "AfNotApplicable",
    "AfSearch",
    "AfSplit",
    "Hardware",
    "MemoryPerGpu",
    "ModelCount",
    "Plan",
    "PlanError",
    "Side",
    "StagePlan",
    "StepTime",
    "TensorInfo",
    "Work",
    "activation_bytes",
    "af_search",
    "autocast_weight_cache",
    "build_meta_model",
    "count_model",
    "format_plan",
    "get_hardware",
    "growth_peak_bytes_per_rank",
    "max_micro_batch",
    "memory_per_gpu",
    "micro_batch_work",
    "model_flops_per_token",
    "optimizer_state_bytes",
    "plan_recipe",
    "resolve_vocab",
    "role_of",
    "train_flops_per_token",
    "workspace_bytes",
]
