"""Growth: operators, their optimizer-state mapping, invariance checks and the stage-transition
driver. The trainer uses only the names exported here."""

from growtrain.stages.registry import OPERATORS, GrowthPlanError, Operator, Provenance, get_operator, register
from growtrain.stages import operators as _operators  # noqa: F401  (registers the built-in operators)
from growtrain.stages.transition import GrowthCheckFailed, GrowthOutcome, apply_growth, plan_stage_models
from growtrain.stages.streaming import stream_length
from growtrain.stages.placement import grow_stage, record_line
from growtrain.stages.seed import import_seed

__all__ = [
    "OPERATORS",
    "GrowthCheckFailed",
    "GrowthOutcome",
    "GrowthPlanError",
    "Operator",
    "Provenance",
    "apply_growth",
    "get_operator",
    "grow_stage",
    "import_seed",
    "plan_stage_models",
    "record_line",
    "register",
    "stream_length",
]
