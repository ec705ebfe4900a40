"""Can several training jobs share one GPU (or one MIG slice)?

Each job runs as its own process, so each brings its own CUDA context and NCCL buffers
(``GPU.outside_allocator_bytes``, outside PyTorch's allocator) and its own caching allocator,
which keeps every segment it ever reserved: at steady state a process holds its *peak reserved*
memory, so the sum of the peak reserved memories is what the GPU must hold even if the peaks
never coincide. The demand is compared with the device's (or slice's) total memory, keeping
``margin`` free.

MIG slices are named ``GPU:PROFILE`` (``h100-80gb:3g.40gb``); their memory is
:func:`memplan.gpus.resolve_device`'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from memplan.errors import ConfigError
from memplan.estimate.engine import DEFAULT_FRAGMENTATION, estimate
from memplan.fit.results import FIT_MARGIN
from memplan.gpus import Device, resolve_device
from memplan.job import Job
from memplan.model.spec import ModelSpec

@dataclass(frozen=True, kw_only=True)
class SharedJob:
    """One job that wants a share of the GPU: its model, job and assumed fragmentation."""

    name: str
    model: ModelSpec
    job: Job
    fragmentation: float = DEFAULT_FRAGMENTATION

    @classmethod
    def from_loaded(cls, name: str, loaded: Any) -> SharedJob:
        """The job a :class:`~memplan.inputs.LoadedJob` describes (its fragmentation, else the default)."""
        fragmentation = DEFAULT_FRAGMENTATION if loaded.fragmentation is None else loaded.fragmentation
        return cls(name=name, model=loaded.model, job=loaded.job, fragmentation=fragmentation)


@dataclass(frozen=True, kw_only=True)
class ProcessMemory:
    """What one process holds on the shared device."""

    name: str
    #: CUDA context + NCCL, outside the allocator.
    context_bytes: int
    #: Peak reserved by the caching allocator (peak pipeline stage).
    reserved_bytes: int
    allocated_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.context_bytes + self.reserved_bytes


@dataclass(frozen=True, kw_only=True)
class Colocation:
    """Whether the jobs fit together, with the headroom (positive) or overflow (negative)."""

    device: str
    capacity_bytes: int
    margin: float
    #: capacity x (1 - margin).
    limit_bytes: int
    processes: tuple[ProcessMemory, ...]
    demand_bytes: int
    fits: bool
    headroom_bytes: int

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        for proc, row in zip(self.processes, data["processes"]):
            row["total_bytes"] = proc.total_bytes
        return data


def process_memory(shared: SharedJob, device: Device) -> ProcessMemory:
    """What ``shared`` holds on ``device`` at steady state: its context and its peak reserved memory."""
    est = estimate(shared.model, shared.job, fragmentation=shared.fragmentation)
    return ProcessMemory(name=shared.name, context_bytes=device.gpu.outside_allocator_bytes,
                         reserved_bytes=est.peak_reserved_bytes, allocated_bytes=est.peak_allocated_bytes)


def colocate(jobs: Sequence[SharedJob], *, gpu: str, margin: float = FIT_MARGIN) -> Colocation:
    """Predict whether ``jobs`` can run side by side on one ``gpu`` (or MIG slice).

    Example::

        >>> from memplan import load_model, Job
        >>> small = SharedJob(name="a", model=load_model("gpt2"), job=Job())
        >>> colocate([small, small], gpu="h100-80gb").fits
        True
    """
    if not jobs:
        raise ConfigError("--colocate", "needs at least one job file")
    if not 0.0 <= margin < 1.0:
        raise ConfigError("--margin", "must be in [0, 1)", margin)
    device = resolve_device(gpu)
    procs = [process_memory(shared, device) for shared in jobs]
    demand = sum(p.total_bytes for p in procs)
    limit = int(device.total_bytes * (1.0 - margin))
    return Colocation(device=device.name, capacity_bytes=device.total_bytes, margin=margin, limit_bytes=limit,
                      processes=tuple(procs), demand_bytes=demand, fits=demand <= limit, headroom_bytes=limit - demand)
