"""Hardware presets: one GPU model and its node, from vendor datasheets, with per-flag overrides."""

from __future__ import annotations

from dataclasses import dataclass, replace

from growtrain.planning.errors import PlanError

GB = 1e9
GIB = 2**30


@dataclass(frozen=True)
class Hardware:
    """One GPU model and the node it sits in. Bandwidths are per GPU and per direction."""

    name: str
    peak_tflops: float  # dense BF16 tensor-core peak (no 2:4 sparsity)
    hbm_gbps: float
    nvlink_gbps: float  # per direction (datasheets quote both directions added)
    nic_gbps: float  # GB/s per GPU to other nodes, per direction (one NIC per GPU)
    capacity_gb: float
    gpus_per_node: int = 8
    nodes: int = 1
    source: str = ""
    host_memory_gb: float = 2000.0  # per node: where growth too big for the GPU runs (train.grow_on)

    @property
    def gpus(self) -> int:
        return self.gpus_per_node * self.nodes

    @property
    def peak_flops(self) -> float:
        return self.peak_tflops * 1e12

    @property
    def capacity_bytes(self) -> int:
        return int(self.capacity_gb * GB)

    @property
    def host_bytes_per_gpu(self) -> int:
        """One rank's share of the node's host memory."""
        return int(self.host_memory_gb * GB / self.gpus_per_node)


# Vendor datasheet figures (NVIDIA A100, H100, H200 and HGX/DGX B200 datasheets): dense BF16
# tensor-core TFLOP/s (half the "with sparsity" figure), HBM bandwidth, NVLink (900 GB/s
# bidirectional on Hopper = 450 GB/s each way; 600 -> 300 on A100; 1.8 TB/s -> 900 on Blackwell),
# the DGX systems' one ConnectX NIC per GPU (A100: 200 Gb/s HDR = 25 GB/s; H100/H200/B200:
# 400 Gb/s NDR = 50 GB/s), and memory as sold (GB = 1e9 bytes; B200: 1,440 GB per DGX B200 / 8).
# Host memory: the DGX systems' 2 TB of system memory (DGX A100 640GB, DGX H100, DGX H200, DGX
# B200 as shipped), the default of every preset.
PRESETS: dict[str, Hardware] = {
    "a100-80gb": Hardware("a100-80gb", 312.0, 2039.0, 300.0, 25.0, 80.0, source="NVIDIA A100 80GB SXM datasheet"),
    "h100-80gb": Hardware("h100-80gb", 989.0, 3350.0, 450.0, 50.0, 80.0, source="NVIDIA H100 SXM5 datasheet"),
    "h200-141gb": Hardware("h200-141gb", 989.0, 4800.0, 450.0, 50.0, 141.0, source="NVIDIA H200 SXM datasheet"),
    "b200": Hardware("b200", 2250.0, 8000.0, 900.0, 50.0, 180.0, source="NVIDIA HGX/DGX B200 datasheet"),
}


def get_hardware(name: str, **overrides) -> Hardware:
    """A preset by name, with any of its figures overridden (None: keep the preset's)."""
    if name not in PRESETS:
        raise PlanError(f"unknown hardware preset '{name}'; valid: {', '.join(PRESETS)}")
    hw = PRESETS[name]
    changes = {k: v for k, v in overrides.items() if v is not None}
    for key, value in changes.items():
        if value <= 0:
            raise PlanError(f"--{key.replace('_', '-')} must be positive, got {value}")
    if changes:
        hw = replace(hw, **changes, source=hw.source + " (overridden: " + ", ".join(sorted(changes)) + ")")
    return hw
