"""Allocator simulation and planning: what the CUDA caching allocator reserves, and a static plan.

Public surface::

    load_trace_or_snapshot(path)     a memplan trace file or a torch.cuda snapshot pickle -> Trace
    simulate(trace, settings)        replay through PyTorch's caching allocator rules -> SimResult
    plan_trace(trace)                STAlloc-style static plan -> StaticPlan
    compare(trace)                   lower bound / caching / expandable / plan -> AllocatorComparison
    AllocatorSettings                PYTORCH_CUDA_ALLOC_CONF options

Only the static plan (``plan_trace``, and ``compare`` which plans) needs numpy (the ``alloc``
extra); every name is imported from its module on first use, so reading and simulating traces
works with the core dependencies alone.
"""

from __future__ import annotations

import os
from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from memplan.alloc.compare import AllocatorComparison, compare
    from memplan.alloc.planner import StaticPlan, plan_trace
    from memplan.alloc.settings import AllocatorSettings
    from memplan.alloc.simulator import SimResult, simulate
    from memplan.alloc.snapshot import Snapshot
    from memplan.events import Trace

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

#: Where each public name lives: imported on first use, so that a module of this package (the estimator's
#: reserved-memory schedule reads :mod:`memplan.alloc.schedule`) does not import the others with it.
_HOMES = {
    "AllocatorComparison": "compare", "compare": "compare", "AllocatorSettings": "settings",
    "SimResult": "simulator", "simulate": "simulator", "Snapshot": "snapshot",
    "StaticPlan": "planner", "plan_trace": "planner",  # the planner needs numpy (the ``alloc`` extra)
}


def load_trace_or_snapshot(path: str | os.PathLike[str]) -> tuple[Trace, AllocatorSettings | None]:
    """Read a memplan trace, or a snapshot pickle (with its recorded allocator settings)."""
    from memplan.alloc.snapshot import is_pickle, load_snapshot, snapshot_to_trace
    from memplan.events import read_trace

    if is_pickle(path):
        snapshot = load_snapshot(path)
        return snapshot_to_trace(snapshot), snapshot.settings
    return read_trace(path), None


def __getattr__(name: str) -> Any:
    """The public names, each from its module on first use."""
    if name in _HOMES:
        return getattr(import_module(f"memplan.alloc.{_HOMES[name]}"), name)
    raise AttributeError(f"module 'memplan.alloc' has no attribute {name!r}")
