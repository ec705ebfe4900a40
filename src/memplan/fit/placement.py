"""Where can a job go? The GPUs on offer, each with the jobs already there, ranked by headroom.

The question a scheduler asks before placing a job (``POST /v1/place`` of :mod:`memplan.serve`):
for each GPU (or MIG slice) on offer, does the new job fit beside the jobs already there, and with
how much room to spare? It is :func:`memplan.fit.colocate`'s rule per GPU — every process holds its
context and its peak reserved memory, and ``margin`` of the device stays free — with two facts a
scheduler may add:

- ``total_bytes``: the memory the driver reports for the device (else the catalogue's, or the MIG
  slice's share of it);
- ``free_bytes``: the free memory measured now (``nvidia-smi --query-gpu=memory.free``). It already
  counts what the jobs there hold *now*; their peaks may still be ahead, so the room left is the
  smaller of the two bounds: ``limit − Σ predicted jobs there`` and ``free − margin × total``.

Example::

    >>> from memplan import Job, load_model
    >>> from memplan.fit.colocate import SharedJob
    >>> new = SharedJob(name="new", model=load_model("gpt2"), job=Job())
    >>> result = place(new, [OfferedGPU(id="n1/0", gpu="h100-80gb")])
    >>> result.placements[0].fits
    True
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

from memplan.errors import ConfigError
from memplan.fit.colocate import SharedJob, process_memory
from memplan.gpus import resolve_device
from memplan.fit.results import FIT_MARGIN

__all__ = ["OfferedGPU", "Placement", "PlacementResult", "place"]


@dataclass(frozen=True, kw_only=True)
class OfferedGPU:
    """One GPU (or MIG slice) a job could be placed on."""

    #: The scheduler's name for it (``node-3/gpu-5``).
    id: str
    #: Catalogue name, or ``GPU:MIG-PROFILE`` (``h100-80gb:3g.40gb``).
    gpu: str
    #: Memory the driver reports for the device, bytes (None: the catalogue's, or the slice's share).
    total_bytes: int | None = None
    #: Free memory measured now, bytes (None: not measured).
    free_bytes: int | None = None
    #: The jobs already running there.
    jobs: tuple[SharedJob, ...] = ()


@dataclass(frozen=True, kw_only=True)
class Placement:
    """Whether the job fits one offered GPU, and the room it leaves (negative: the overflow)."""

    id: str
    device: str
    capacity_bytes: int
    #: capacity × (1 − margin).
    limit_bytes: int
    #: The new job's process on this device: its context plus its peak reserved memory.
    demand_bytes: int
    #: The jobs already there, predicted the same way (each its context plus its peak reserved).
    jobs_there_bytes: int
    free_bytes: int | None
    #: Room for the new job before it starts: the smaller bound of ``bound``.
    available_bytes: int
    #: Which bound decided ``available_bytes``.
    bound: Literal["predicted jobs", "measured free memory"]
    fits: bool
    headroom_bytes: int


@dataclass(frozen=True, kw_only=True)
class PlacementResult:
    """Every offered GPU's placement, in the order offered, and the ids that fit, most headroom first."""

    job: str
    margin: float
    placements: tuple[Placement, ...]
    #: Ids of the GPUs that can take the job, most headroom first.
    fitting: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def place(job: SharedJob, offered: Sequence[OfferedGPU], *, margin: float = FIT_MARGIN) -> PlacementResult:
    """Which of ``offered`` can take ``job`` (see the module docstring for the rule)."""
    if not offered:
        raise ConfigError("gpus", "must list at least one GPU on offer")
    if not 0.0 <= margin < 1.0:
        raise ConfigError("margin", "must be in [0, 1)", margin)
    seen: set[str] = set()
    placements = []
    for index, gpu in enumerate(offered):
        if gpu.id in seen:
            raise ConfigError(f"gpus[{index}].id", "must be unique among the GPUs offered", gpu.id)
        seen.add(gpu.id)
        placements.append(_placement(job, gpu, margin, index))
    fitting = sorted((p for p in placements if p.fits), key=lambda p: -p.headroom_bytes)
    return PlacementResult(job=job.name, margin=margin, placements=tuple(placements),
                           fitting=tuple(p.id for p in fitting))


def _placement(job: SharedJob, gpu: OfferedGPU, margin: float, index: int) -> Placement:
    device = resolve_device(gpu.gpu)
    capacity = device.total_bytes if gpu.total_bytes is None else gpu.total_bytes
    if capacity <= 0:
        raise ConfigError(f"gpus[{index}].total_bytes", "must be positive", gpu.total_bytes)
    if gpu.free_bytes is not None and not 0 <= gpu.free_bytes <= capacity:
        raise ConfigError(f"gpus[{index}].free_bytes", f"must be between 0 and the device's total ({capacity})",
                          gpu.free_bytes)
    limit = int(capacity * (1.0 - margin))
    demand = process_memory(job, device).total_bytes
    there = sum(process_memory(other, device).total_bytes for other in gpu.jobs)
    available, bound = limit - there, "predicted jobs"
    if gpu.free_bytes is not None:
        measured = gpu.free_bytes - (capacity - limit)
        if measured < available:
            available, bound = measured, "measured free memory"
    headroom = available - demand
    return Placement(id=gpu.id, device=device.name, capacity_bytes=capacity, limit_bytes=limit, demand_bytes=demand,
                     jobs_there_bytes=there, free_bytes=gpu.free_bytes, available_bytes=available,
                     bound=bound, fits=headroom >= 0, headroom_bytes=headroom)
