"""Catalogue of common training GPUs and the memory a PyTorch process can really use.

``total_bytes`` is what the driver reports (``nvidia-smi`` / ``rocm-smi`` "total", equal to
``torch.cuda.get_device_properties().total_memory``), not the marketing number. A process cannot
give all of it to the caching allocator: the CUDA context (kernels, cuBLAS/cuDNN handles) and
NCCL's own buffers live outside it. ``usable_bytes`` subtracts that overhead; it is what
memplan compares predicted *reserved* memory against.

MIG slices are named ``GPU:PROFILE`` (``h100-80gb:3g.40gb``, :func:`resolve_device`). A profile
``Ng.Mgb`` holds k of the GPU's 8 memory slices; memplan gives it k/8 of the GPU's memory (the driver
reports slightly less, a few hundred MiB, for the slice's own bookkeeping).
"""

from __future__ import annotations

import difflib

from memplan.errors import ConfigError
from memplan.frozen import frozen_dataclass
from memplan.units import MiB

#: CUDA context + library handles + NCCL communicator buffers held outside PyTorch's allocator.
#: Typical CUDA 12 contexts with lazy module loading take 0.4-0.6 GiB; NCCL adds a few hundred
#: MiB per communicator set. 1 GiB is a conservative single figure for a training process.
DEFAULT_OUTSIDE_ALLOCATOR_BYTES = 1024 * MiB
#: A GeForce card usually also drives the desktop: the display server, compositor and browser hold
#: about 0.5 GiB more on a typical Linux/Windows desktop (nvidia-smi's per-process list). memplan
#: assumes consumer cards do; a headless card gains this back (pass a GPU with the default).
DISPLAY_BYTES = 512 * MiB
_CONSUMER = DEFAULT_OUTSIDE_ALLOCATOR_BYTES + DISPLAY_BYTES


@frozen_dataclass(kw_only=True)
class GPU:
    """One GPU model."""

    name: str
    #: Memory the driver reports, bytes.
    total_bytes: int
    #: Bytes taken outside PyTorch's allocator (context, NCCL).
    outside_allocator_bytes: int = DEFAULT_OUTSIDE_ALLOCATOR_BYTES
    #: Dense BF16 tensor-core peak with fp32 accumulation, FLOP/s (for step-time models); FP16's on
    #: GPUs without BF16 (``half_dtype``).
    bf16_flops: float = 0.0
    #: 16-bit dtype the tensor cores run and ``bf16_flops`` measures: V100 and T4 have no BF16.
    half_dtype: str = "bf16"
    description: str = ""

    @property
    def usable_bytes(self) -> int:
        """What the caching allocator can reserve before CUDA reports out of memory."""
        return self.total_bytes - self.outside_allocator_bytes


# Fine-tuners' cards. Totals are nvidia-smi's "total" MiB as users report it (default ECC
# setting: on for data-centre cards, which reserves part of the memory; GeForce and workstation
# cards ship with ECC off). Peaks: NVIDIA data sheets and architecture white papers, dense tensor
# FLOP/s with fp32 accumulation (what PyTorch uses; GeForce Ampere runs it at half the fp16-
# accumulate rate). A10G (AWS g5) has no NVIDIA data sheet: the commonly cited figure.
_FINE_TUNING: tuple[GPU, ...] = (
    GPU(name="rtx-3090", total_bytes=24576 * MiB, outside_allocator_bytes=_CONSUMER, bf16_flops=71e12,
        description="NVIDIA GeForce RTX 3090 24GB (desktop display assumed)"),
    GPU(name="rtx-5090", total_bytes=32607 * MiB, outside_allocator_bytes=_CONSUMER, bf16_flops=209.5e12,
        description="NVIDIA GeForce RTX 5090 32GB (desktop display assumed)"),
    GPU(name="rtx-a6000", total_bytes=49140 * MiB, bf16_flops=154.8e12, description="NVIDIA RTX A6000 48GB"),
    GPU(name="rtx-6000-ada", total_bytes=49140 * MiB, bf16_flops=364.2e12, description="NVIDIA RTX 6000 Ada 48GB"),
    GPU(name="a10g", total_bytes=23028 * MiB, bf16_flops=70e12, description="NVIDIA A10G 24GB (AWS g5)"),
    GPU(name="a10", total_bytes=23028 * MiB, bf16_flops=125e12, description="NVIDIA A10 24GB"),
    GPU(name="l4", total_bytes=23034 * MiB, bf16_flops=121e12, description="NVIDIA L4 24GB"),
    GPU(name="t4", total_bytes=15360 * MiB, bf16_flops=65e12, half_dtype="fp16",
        description="NVIDIA T4 16GB (no BF16: FP16 peak)"),
    GPU(name="v100-16gb", total_bytes=16160 * MiB, bf16_flops=125e12, half_dtype="fp16",
        description="NVIDIA V100 SXM2 16GB (no BF16: FP16 peak)"),
    GPU(name="v100-32gb", total_bytes=32510 * MiB, bf16_flops=125e12, half_dtype="fp16",
        description="NVIDIA V100 SXM2 32GB (no BF16: FP16 peak)"),
    GPU(name="a40", total_bytes=46068 * MiB, bf16_flops=149.7e12, description="NVIDIA A40 48GB"),
)

_CATALOGUE: tuple[GPU, ...] = (
    GPU(name="a100-40gb", total_bytes=40960 * MiB, bf16_flops=312e12, description="NVIDIA A100 40GB"),
    GPU(name="a100-80gb", total_bytes=81920 * MiB, bf16_flops=312e12, description="NVIDIA A100 80GB"),
    GPU(name="h100-80gb", total_bytes=81559 * MiB, bf16_flops=989e12, description="NVIDIA H100 SXM 80GB"),
    GPU(name="h100-94gb", total_bytes=95830 * MiB, bf16_flops=835e12, description="NVIDIA H100 NVL 94GB"),
    GPU(name="h200", total_bytes=143771 * MiB, bf16_flops=989e12, description="NVIDIA H200 141GB"),
    GPU(name="b200", total_bytes=183359 * MiB, bf16_flops=2250e12, description="NVIDIA B200 180GB"),
    GPU(name="l40s", total_bytes=46068 * MiB, bf16_flops=362e12, description="NVIDIA L40S 48GB"),
    GPU(name="rtx-4090", total_bytes=24564 * MiB, outside_allocator_bytes=_CONSUMER, bf16_flops=165e12,
        description="NVIDIA GeForce RTX 4090 24GB (desktop display assumed)"),
    GPU(name="mi300x", total_bytes=196592 * MiB, bf16_flops=1307e12, description="AMD Instinct MI300X 192GB"),
    *_FINE_TUNING,
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
    "3090": "rtx-3090",
    "rtx3090": "rtx-3090",
    "5090": "rtx-5090",
    "rtx5090": "rtx-5090",
    "a6000": "rtx-a6000",
    "rtxa6000": "rtx-a6000",
    "6000-ada": "rtx-6000-ada",
    "rtx6000-ada": "rtx-6000-ada",
    "rtx-6000ada": "rtx-6000-ada",
    "a10g-24gb": "a10g",
    "a10-24gb": "a10",
    "l4-24gb": "l4",
    "t4-16gb": "t4",
    "v100": "v100-32gb",
    "v100-sxm2-16gb": "v100-16gb",
    "v100-sxm2-32gb": "v100-32gb",
    "a40-48gb": "a40",
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


#: Memory slices (of 8) of each MIG profile, per GPU (NVIDIA MIG user guide, "Supported MIG
#: Profiles" for A100 40GB/80GB, H100 80GB/94GB and H200 141GB).
MIG_PROFILES: dict[str, dict[str, int]] = {
    "a100-40gb": {"1g.5gb": 1, "1g.10gb": 2, "2g.10gb": 2, "3g.20gb": 4, "4g.20gb": 4, "7g.40gb": 8},
    "a100-80gb": {"1g.10gb": 1, "1g.20gb": 2, "2g.20gb": 2, "3g.40gb": 4, "4g.40gb": 4, "7g.80gb": 8},
    "h100-80gb": {"1g.10gb": 1, "1g.20gb": 2, "2g.20gb": 2, "3g.40gb": 4, "4g.40gb": 4, "7g.80gb": 8},
    "h100-94gb": {"1g.12gb": 1, "1g.24gb": 2, "2g.24gb": 2, "3g.47gb": 4, "4g.47gb": 4, "7g.94gb": 8},
    "h200": {"1g.18gb": 1, "1g.35gb": 2, "2g.35gb": 2, "3g.71gb": 4, "4g.71gb": 4, "7g.141gb": 8},
}
_MEMORY_SLICES = 8


@frozen_dataclass(kw_only=True)
class Device:
    """A whole GPU or one MIG slice of it."""

    name: str
    gpu: GPU
    #: MIG profile (None: the whole GPU).
    mig_profile: str | None
    #: Memory the device offers to its processes, bytes.
    total_bytes: int


def resolve_device(name: str) -> Device:
    """``h100-80gb`` or ``h100-80gb:3g.40gb``; unknown GPUs or profiles raise ConfigError (exit 2)."""
    base, _, profile = name.partition(":")
    gpu = get_gpu(base)
    if not profile:
        return Device(name=gpu.name, gpu=gpu, mig_profile=None, total_bytes=gpu.total_bytes)
    profiles = MIG_PROFILES.get(gpu.name)
    if profiles is None:
        raise ConfigError("--gpu", f"{gpu.name} has no MIG profiles (MIG: {', '.join(MIG_PROFILES)})", name)
    key = profile.strip().lower()
    if key not in profiles:
        raise ConfigError("--gpu", f"MIG profile of {gpu.name} must be one of {', '.join(profiles)}", profile)
    total = gpu.total_bytes * profiles[key] // _MEMORY_SLICES
    return Device(name=f"{gpu.name}:{key}", gpu=gpu, mig_profile=key, total_bytes=total)
