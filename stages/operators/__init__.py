"""Growth operators; importing this package registers them."""

from growtrain.stages.operators import deepen, upcycle  # noqa: F401
