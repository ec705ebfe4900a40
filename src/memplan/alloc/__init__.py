"""Allocator simulation and planning: what the CUDA caching allocator reserves, and a static plan.

Public surface::

    load_trace_or_snapshot(path)     a memplan trace file or a torch.cuda snapshot pickle -> Trace
    simulate(trace, settings)        replay through PyTorch's caching allocator rules -> SimResult
    plan_trace(trace)                STAlloc-style static plan -> StaticPlan
    compare(trace)                   lower bound / caching / expandable / plan -> AllocatorComparison
    AllocatorSettings                PYTORCH_CUDA_ALLOC_CONF options

Only the static plan (``plan_trace``, and ``compare`` which plans) needs numpy (the ``alloc``
extra); :mod:`memplan.alloc.planner` is imported on first use, so reading and simulating traces
works with the core dependencies alone.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from memplan.alloc.compare import AllocatorComparison, compare
from memplan.alloc.settings import AllocatorSettings
from memplan.alloc.simulator import SimResult, simulate
from memplan.alloc.snapshot import Snapshot, is_pickle, load_snapshot, snapshot_to_trace
from memplan.events import Trace, read_trace

if TYPE_CHECKING:
    from memplan.alloc.planner import StaticPlan, plan_trace

__all__ = [
    "AllocatorComparison",
    "AllocatorSettings",
    "SimResult",
    "Snapshot",
    "StaticPlan",
    "compare",
    "load_trace_or_snapshot",
    "plan_trace",
    "simulate",
]


def load_trace_or_snapshot(path: str | os.PathLike[str]) -> tuple[Trace, AllocatorSettings | None]:
    """Read a memplan trace, or a snapshot pickle (with its recorded allocator settings)."""
    if is_pickle(path):
        snapshot = load_snapshot(path)
        return snapshot_to_trace(snapshot), snapshot.settings
    return read_trace(path), None


def __getattr__(name: str) -> Any:
    """``StaticPlan`` and ``plan_trace`` import the planner (and numpy) on first use."""
    if name in ("StaticPlan", "plan_trace"):
        from memplan.alloc import planner

        return getattr(planner, name)
    raise AttributeError(f"module 'memplan.alloc' has no attribute {name!r}")
