"""Drive the C core with a recorded trace (no torch): what the planned runtime would reserve.

Two ways to run a trace (``memplan alloc replay``):

* ``profile`` (default; STAlloc's model): the whole trace is run once on the fallback pool and
  recorded, planned (persistent blocks included), then run again on the plan; the second run is
  measured. This is what a job whose profiling run is this trace would reserve in its real run.
* ``online`` (the in-loop runtime): each trace iteration is a step of one signature; the first
  steps are recorded, the rest replay. Meaningful for traces of several iterations.

Both report next to :func:`memplan.alloc.simulate`'s caching allocator. The caching allocator's
fragmentation is the simulator's own (``1 - peak allocated / peak reserved``, its "allocated"
including the unsplit tails of blocks it hands out whole); the planned runtime's is ``1 - peak of
live 512-aligned requests / peak reserved``. The caching figure is thus the smaller of the two
definitions: the cut reported is a conservative one.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Literal

from memplan.alloc.runtime._native import Core
from memplan.alloc.runtime.plans import SlotPlan, fingerprint, load_plans, plan_recording, save_plans
from memplan.alloc.runtime.session import ALIGNMENT, Arena, RuntimeSettings
from memplan.alloc.settings import AllocatorSettings
from memplan.errors import ConfigError
from memplan.events import ALLOC, Trace

__all__ = ["RuntimeReplayResult", "replay_trace"]

_ALIGNMENT = ALIGNMENT["virtual"]
_KEY = "trace"


@dataclass(frozen=True)
class RuntimeReplayResult:
    """The caching allocator's simulation and the planned runtime's run of one trace."""

    mode: str
    events: int
    lower_bound_bytes: int
    aligned_peak_bytes: int
    caching_fragmentation: float
    caching_reserved_bytes: int
    planned_reserved_bytes: int
    arena_bytes: int
    fallback_allocs: int
    fallback_peak_bytes: int
    replayed_allocs: int
    requests: int

    @property
    def planned_fragmentation(self) -> float:
        """``1 - peak of live 512-aligned requests / peak reserved``."""
        r = self.planned_reserved_bytes
        return 1.0 - self.aligned_peak_bytes / r if r else 0.0

    @property
    def fragmentation_cut(self) -> float:
        """Share of the caching allocator's fragmentation the plan removes (1.0: all of it)."""
        c = self.caching_fragmentation
        return 1.0 - self.planned_fragmentation / c if c > 0 else 1.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "mode": self.mode, "events": self.events, "requests": self.requests,
            "lower_bound_bytes": self.lower_bound_bytes, "aligned_peak_bytes": self.aligned_peak_bytes,
            "caching": {"reserved_bytes": self.caching_reserved_bytes,
                        "fragmentation": round(self.caching_fragmentation, 6)},
            "planned": {"reserved_bytes": self.planned_reserved_bytes,
                        "fragmentation": round(self.planned_fragmentation, 6), "arena_bytes": self.arena_bytes,
                        "fallback_peak_bytes": self.fallback_peak_bytes, "replayed_allocs": self.replayed_allocs},
            "fallback_allocs": self.fallback_allocs,
            "fragmentation_cut": round(self.fragmentation_cut, 6),
        }

    def __rich__(self) -> Any:
        from rich.table import Table

        from memplan.units import format_bytes

        table = Table(title=f"planned runtime vs caching allocator ({self.mode}, {self.requests:,} requests)")
        for column in ("", "reserved", "fragmentation", "fallback allocs"):
            table.add_column(column, justify="right" if column else "left")
        table.add_row("lower bound (peak live)", format_bytes(self.lower_bound_bytes), "", "")
        table.add_row("caching allocator (simulated)", format_bytes(self.caching_reserved_bytes),
                      f"{self.caching_fragmentation:.1%}", "")
        table.add_row("planned runtime (C core)", format_bytes(self.planned_reserved_bytes),
                      f"{self.planned_fragmentation:.1%}", f"{self.fallback_allocs:,}")
        table.caption = (f"arena {format_bytes(self.arena_bytes)}, fallback peak {format_bytes(self.fallback_peak_bytes)}; "
                         f"fragmentation cut {self.fragmentation_cut:.1%}")
        return table


def _run(core: Core, trace: Trace, *, on_iteration: Any = None) -> dict[int, int]:
    """Every event of ``trace`` through the core; returns the blocks still live (block -> address)."""
    live: dict[int, int] = {}
    iteration = None
    for event in trace.events:
        if on_iteration is not None and event.iteration != iteration:
            if iteration is not None:
                on_iteration(event.iteration)
            iteration = event.iteration
        if event.kind == ALLOC:
            if event.size > 0:
                live[event.block] = core.malloc(event.size, event.stream)
        elif event.block in live:
            core.free(live.pop(event.block))
    return live


def _aligned_peak(trace: Trace) -> int:
    live = peak = 0
    sizes: dict[int, int] = {}
    for event in trace.events:
        if event.kind == ALLOC:
            size = -(-max(event.size, 1) // _ALIGNMENT) * _ALIGNMENT if event.size > 0 else 0
            sizes[event.block] = size
            live += size
            peak = max(peak, live)
        else:
            live -= sizes.pop(event.block, 0)
    return peak


def _requests(trace: Trace) -> tuple[tuple[int, ...], tuple[int, ...]]:
    allocs = [e for e in trace.events if e.kind == ALLOC and e.size > 0]
    return tuple(e.size for e in allocs), tuple(e.stream for e in allocs)


def _profile(core: Core, trace: Trace, plan: SlotPlan | None, time_limit: float) -> SlotPlan:
    if plan is None:
        core.begin_step(-1)
        leftovers = _run(core, trace)
        core.end_step()
        rows = core.finish()
        for address in leftovers.values():
            core.free(address)
        assert rows is not None
        plan = plan_recording(rows, key=_KEY, alignment=_ALIGNMENT, persistent="plan", time_limit=time_limit)
    plan_id = core.add_plan(list(plan.sizes), list(plan.requested), list(plan.offsets), list(plan.streams), plan.pool_bytes)
    core.reset_peaks()
    core.begin_step(plan_id)
    _run(core, trace)
    core.end_step()
    return plan


def replay_trace(trace: Trace, *, mode: Literal["profile", "online"] = "profile", settings: AllocatorSettings | None = None,
                 plan: str | os.PathLike[str] | None = None, save_plan: str | os.PathLike[str] | None = None,
                 time_limit: float = 5.0) -> RuntimeReplayResult:
    """Replay ``trace`` through the C core (virtual addresses: no memory is touched) and the simulator."""
    from memplan.alloc.simulator import simulate

    if mode not in ("profile", "online"):
        raise ConfigError("--mode", "must be 'profile' or 'online'", mode)
    requested, streams = _requests(trace)
    loaded = None
    if plan is not None:
        loaded = load_plans(plan, alignment=_ALIGNMENT).get(_KEY)
        if loaded is None or loaded.fingerprint != fingerprint(requested, streams):
            raise ConfigError("--plan", "was made for another trace, model or shape (its requests differ)", str(plan))
    sim = simulate(trace, settings or AllocatorSettings())
    core = Core("virtual", alignment=_ALIGNMENT)
    try:
        if mode == "profile":
            made = _profile(core, trace, loaded, time_limit)
            stats = core.stats()
            if save_plan is not None:
                save_plans(save_plan, {_KEY: made}, alignment=_ALIGNMENT, model="")
        else:
            arena = Arena(core, RuntimeSettings(device="virtual", time_limit=time_limit))
            arena.begin()
            _run(core, trace, on_iteration=lambda _it: arena.step())
            stats = arena.stats()
    finally:
        core.close()
    return RuntimeReplayResult(mode=mode, events=len(trace.events), lower_bound_bytes=sim.peak_requested_bytes,
                        aligned_peak_bytes=_aligned_peak(trace), caching_fragmentation=sim.fragmentation,
                        caching_reserved_bytes=sim.peak_reserved_bytes,
                        planned_reserved_bytes=stats["peak_reserved_bytes"], arena_bytes=stats["arena_bytes"],
                        fallback_allocs=stats["fallback_allocs"], fallback_peak_bytes=stats["fallback_peak_bytes"],
                        replayed_allocs=stats["replayed_allocs"], requests=len(requested))
