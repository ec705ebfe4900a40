"""Replay a trace through memplan's caching-allocator simulator for the doctor.

One function so that every check the doctor makes (the run as recorded, each candidate setting)
replays the same way: :func:`memplan.alloc.simulator.simulate` at the given settings and capacity.
"""

from __future__ import annotations

from memplan.alloc.settings import AllocatorSettings
from memplan.alloc.simulator import SimResult, simulate
from memplan.events import Trace

__all__ = ["replay_trace"]


def replay_trace(trace: Trace, settings: AllocatorSettings) -> SimResult:
    """The simulator's result for ``trace`` at ``settings`` (stops at the first out-of-memory)."""
    return simulate(trace, settings)
