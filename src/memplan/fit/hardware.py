"""Speeds of the catalogue's GPUs and their links, for the step-time model.

Kept apart from :mod:`memplan.gpus` (memory facts) and keyed by the same GPU names. Figures are
vendor data-sheet values; the network is the usual NIC per GPU of that generation's reference
systems (DGX A100: HDR 200 Gb/s; DGX H100/H200/B200: NDR 400 Gb/s), all per GPU and direction.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["HARDWARE", "Hardware", "hardware_for"]


@dataclass(frozen=True, kw_only=True)
class Hardware:
    """Speeds of one GPU model and its links (per GPU, one direction)."""

    name: str
    #: Dense BF16 tensor-core peak, FLOP/s (no sparsity).
    peak_flops: float
    #: HBM bandwidth, bytes/s.
    hbm_bytes_per_s: float
    #: NVLink / Infinity Fabric bandwidth per GPU and direction within a node, bytes/s.
    intra_node_bytes_per_s: float
    #: Network bandwidth per GPU and direction between nodes (one NIC per GPU), bytes/s.
    inter_node_bytes_per_s: float


_GB = 1e9
#: Dense BF16 peak, HBM, NVLink (per direction) and NIC bandwidth of each GPU.
HARDWARE: dict[str, Hardware] = {
    h.name: h
    for h in (
        Hardware(name="a100-40gb", peak_flops=312e12, hbm_bytes_per_s=1555 * _GB,
                 intra_node_bytes_per_s=300 * _GB, inter_node_bytes_per_s=25 * _GB),
        Hardware(name="a100-80gb", peak_flops=312e12, hbm_bytes_per_s=2039 * _GB,
                 intra_node_bytes_per_s=300 * _GB, inter_node_bytes_per_s=25 * _GB),
        Hardware(name="h100-80gb", peak_flops=989e12, hbm_bytes_per_s=3350 * _GB,
                 intra_node_bytes_per_s=450 * _GB, inter_node_bytes_per_s=50 * _GB),
        Hardware(name="h100-94gb", peak_flops=835e12, hbm_bytes_per_s=3900 * _GB,
                 intra_node_bytes_per_s=300 * _GB, inter_node_bytes_per_s=50 * _GB),
        Hardware(name="h200", peak_flops=989e12, hbm_bytes_per_s=4800 * _GB,
                 intra_node_bytes_per_s=450 * _GB, inter_node_bytes_per_s=50 * _GB),
        Hardware(name="b200", peak_flops=2250e12, hbm_bytes_per_s=8000 * _GB,
                 intra_node_bytes_per_s=900 * _GB, inter_node_bytes_per_s=50 * _GB),
        Hardware(name="l40s", peak_flops=362e12, hbm_bytes_per_s=864 * _GB,
                 intra_node_bytes_per_s=32 * _GB, inter_node_bytes_per_s=25 * _GB),
        Hardware(name="rtx-4090", peak_flops=165e12, hbm_bytes_per_s=1008 * _GB,
                 intra_node_bytes_per_s=32 * _GB, inter_node_bytes_per_s=12.5 * _GB),
        # Fine-tuners' cards (data sheets; PCIe 4.0 x16 ~32 GB/s or 5.0 ~64 GB/s between GPUs without
        # NVLink, a 100 Gb/s NIC between nodes). V100 and T4: FP16 peaks (no BF16).
        Hardware(name="rtx-3090", peak_flops=71e12, hbm_bytes_per_s=936 * _GB,
                 intra_node_bytes_per_s=32 * _GB, inter_node_bytes_per_s=12.5 * _GB),
        Hardware(name="rtx-5090", peak_flops=209.5e12, hbm_bytes_per_s=1792 * _GB,
                 intra_node_bytes_per_s=64 * _GB, inter_node_bytes_per_s=12.5 * _GB),
        Hardware(name="rtx-a6000", peak_flops=154.8e12, hbm_bytes_per_s=768 * _GB,
                 intra_node_bytes_per_s=32 * _GB, inter_node_bytes_per_s=12.5 * _GB),
        Hardware(name="rtx-6000-ada", peak_flops=364.2e12, hbm_bytes_per_s=960 * _GB,
                 intra_node_bytes_per_s=32 * _GB, inter_node_bytes_per_s=12.5 * _GB),
        Hardware(name="a10g", peak_flops=70e12, hbm_bytes_per_s=600 * _GB,
                 intra_node_bytes_per_s=32 * _GB, inter_node_bytes_per_s=12.5 * _GB),
        Hardware(name="a10", peak_flops=125e12, hbm_bytes_per_s=600 * _GB,
                 intra_node_bytes_per_s=32 * _GB, inter_node_bytes_per_s=12.5 * _GB),
        Hardware(name="l4", peak_flops=121e12, hbm_bytes_per_s=300 * _GB,
                 intra_node_bytes_per_s=32 * _GB, inter_node_bytes_per_s=12.5 * _GB),
        Hardware(name="t4", peak_flops=65e12, hbm_bytes_per_s=320 * _GB,
                 intra_node_bytes_per_s=16 * _GB, inter_node_bytes_per_s=12.5 * _GB),
        Hardware(name="v100-16gb", peak_flops=125e12, hbm_bytes_per_s=900 * _GB,
                 intra_node_bytes_per_s=150 * _GB, inter_node_bytes_per_s=12.5 * _GB),
        Hardware(name="v100-32gb", peak_flops=125e12, hbm_bytes_per_s=900 * _GB,
                 intra_node_bytes_per_s=150 * _GB, inter_node_bytes_per_s=12.5 * _GB),
        Hardware(name="a40", peak_flops=149.7e12, hbm_bytes_per_s=696 * _GB,
                 intra_node_bytes_per_s=56 * _GB, inter_node_bytes_per_s=25 * _GB),
        Hardware(name="mi300x", peak_flops=1307e12, hbm_bytes_per_s=5300 * _GB,
                 intra_node_bytes_per_s=448 * _GB, inter_node_bytes_per_s=50 * _GB),
        # Not in the memory catalogue: the export H100 with NVLink cut to 400 GB/s (DeepSeek-V3).
        Hardware(name="h800", peak_flops=989e12, hbm_bytes_per_s=3350 * _GB,
                 intra_node_bytes_per_s=200 * _GB, inter_node_bytes_per_s=50 * _GB),
    )
}


def hardware_for(gpu_name: str) -> Hardware:
    """Speeds of a catalogue GPU (``memplan.gpus`` names); MIG slices use the whole GPU's entry."""
    base = gpu_name.split(":", 1)[0]
    try:
        return HARDWARE[base]
    except KeyError:
        raise KeyError(f"no step-time data for GPU {gpu_name!r}") from None
