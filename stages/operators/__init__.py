"""Growth operators; importing this package registers them (in this order in `growtrain schema`)."""

from growtrain.stages.operators import deepen, widen, widen_ffn, heads, upcycle, experts  # noqa: F401, I001
from growtrain.stages.operators import quantize  # noqa: F401  (NF4 experts: quantize_experts, merge_adapters)
from growtrain.stages.operators import dense_lora  # noqa: F401  (add_dense_lora: peft LoRA on dense layers, the model's last form)
