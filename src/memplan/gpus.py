"""Catalogue of common training GPUs and the memory a PyTorch process can really use.

``total_bytes`` is what the driver reports (``nvidia-smi`` / ``rocm-smi`` "total", equal to
``torch.cuda.get_device_properties().total_memory``), not the marketing number. A process cannot
give all of it to the caching allocator: the CUDA context (kernels, cuBLAS/cuDNN handles) and
NCCL's own buffers live outside it. ``usable_bytes`` subtracts that overhead; it is what
memplan compares predicted *reserved* memory against.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass

from memplan.errors import ConfigError
from memplan.units import MiB

#: CUDA context + library handles + NCCL communicator buffers held outside PyTorch's allocator.
#: Typical CUDA 12 contexts with lazy module loading take 0.4-0.6 GiB; NCCL adds a few hundred
#: MiB per communicator set. 1 GiB is a conservative single figure for a training process.
DEFAULT_OUTSIDE_ALLOCATOR_BYTES = 1024 * MiB


@dataclass(frozen=True, kw_only=True)
class GPU:
    """One GPU model."""

    name: str
    #: Memory the driver reports, bytes.
    total_bytes: int
    #: Bytes taken outside PyTorch's allocator (context, NCCL).
    outside_allocator_bytes: int = DEFAULT_OUTSIDE_ALLOCATOR_BYTES
    #: Dense BF16 tensor-core peak, FLOP/s (for step-time models).
    bf16_flops: float = 0.0
    description: str = ""

    @property
    def usable_bytes(self) -> int:
        """What the caching allocator can reserve before CUDA reports out of memory."""
        return self.total_bytes - self.outside_allocator_bytes


_CATALOGUE: tuple[GPU, ...] = (
    GPU(name="a100-40gb", total_bytes=40960 * MiB, bf16_flops=312e12, description="NVIDIA A100 40GB"),
    GPU(name="a100-80gb", total_bytes=81920 * MiB, bf16_flops=312e12, description="NVIDIA A100 80GB"),
    GPU(name="h100-80gb", total_bytes=81559 * MiB, bf16_flops=989e12, description="NVIDIA H100 SXM 80GB"),
    GPU(name="h100-94gb", total_bytes=95830 * MiB, bf16_flops=835e12, description="NVIDIA H100 NVL 94GB"),
    GPU(name="h200", total_bytes=143771 * MiB, bf16_flops=989e12, description="NVIDIA H200 141GB"),
    GPU(name="b200", total_bytes=183359 * MiB, bf16_flops=2250e12, description="NVIDIA B200 180GB"),
    GPU(name="l40s", total_bytes=46068 * MiB, bf16_flops=362e12, description="NVIDIA L40S 48GB"),
    GPU(name="rtx-4090", total_bytes=24564 * MiB, bf16_flops=165e12, description="NVIDIA GeForce RTX 4090 24GB"),
    GPU(name="mi300x", total_bytes=196592 * MiB, bf16_flops=1307e12, description="AMD Instinct MI300X 192GB"),
)

_ALIASES = {
    "a100": "a100-80gb",
    "h100": "h100-80gb",
    "h100-sxm": "h100-80gb",
    "h100-nvl": "h100-94gb",
    "h200-141gb": "h200",
    "b200-180gb": "b200",
    "l40s-48gb": "l40s",
    "4090": "rtx-4090",
    "rtx4090": "rtx-4090",
    "mi300x-192gb": "mi300x",
}


def list_gpus() -> tuple[GPU, ...]:
    """Every GPU in the catalogue."""
    return _CATALOGUE


def get_gpu(name: str) -> GPU:
    """Look a GPU up by name (case-insensitive, a few aliases); unknown names list the catalogue."""
    key = name.strip().lower().replace("_", "-")
    key = _ALIASES.get(key, key)
    for gpu in _CATALOGUE:
        if gpu.name == key:
            return gpu
    names = [g.name for g in _CATALOGUE]
    close = difflib.get_close_matches(key, names, n=1)
    hint = f"did you mean {close[0]}?" if close else ""
    raise ConfigError("--gpu", f"must be one of {', '.join(names)}", name, hint=hint)
