"""The arena the training loop sees: steps, signatures, record -> plan -> replay, counters.

Backend-neutral: it drives one :class:`~memplan.alloc.runtime._native.Core`; the CPU and CUDA
backends (``cpu.py``, ``cuda.py``) route PyTorch's requests into that core, the trace replay
(``replay.py``) calls it directly.

Lifecycle of a signature (the key of a step; ``""`` unless the loop names one), after the run's
``warmup_steps`` (served by the fallback pool, not planned from):

1. its first step is *recorded*: the fallback pool serves it and the core logs every request;
2. at its end it is planned provisionally (blocks not freed yet go to the fallback pool); the
   recording is final at the end of the following step (then it is known which blocks were freed
   during that step and which stayed) and planned again (``plans.plan_recording``); the key's
   later steps *replay* the plan;
3. when two replayed steps of a key in a row fall back for more than ``rerecord_share`` of their
   requests, the key is recorded again (up to ``max_recordings``); a recording of the same shape with other sizes widens the
   slots to the largest size seen (windows for data-dependent sizes).
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass, field
from typing import Any, Literal

from memplan.alloc.runtime._native import Core, LogRows
from memplan.alloc.constants import K_MIN_BLOCK_SIZE
from memplan.alloc.runtime.plans import SlotPlan, plan_recording
from memplan.errors import ConfigError

__all__ = ["Arena", "RuntimeSettings", "StepRecord"]

#: Slot alignment per device: c10's CPU allocator aligns to 64 bytes (c10/core/alignment.h,
#: gAlignment); CUDA blocks to 512 (kMinBlockSize in CUDACachingAllocator.cpp).
ALIGNMENT = {"cpu": 64, "cuda": K_MIN_BLOCK_SIZE, "virtual": K_MIN_BLOCK_SIZE}


@dataclass(frozen=True, kw_only=True)
class RuntimeSettings:
    """How the runtime records, plans and falls back."""

    device: Literal["cpu", "cuda", "virtual"] = "cpu"
    #: Fully free fallback segments are released while the pool reserves more than this.
    fallback_limit_bytes: int = 0
    #: Refuse an arena larger than this (0: no limit); the default allocator then serves, with a warning.
    arena_limit_bytes: int = 0
    #: The first steps of the run are served by the fallback pool and not planned from: the first
    #: step creates optimizer states and lazily built buffers, which later steps do not repeat.
    warmup_steps: int = 1
    #: Recordings of one signature at most (re-recorded when its replay falls back too often).
    max_recordings: int = 3
    #: Two replayed steps in a row with more fallback requests than this share of their requests: re-record.
    rerecord_share: float = 0.0
    #: Blocks still live one step after their recording: "fallback" (in a loop) or "plan" (a profiled run).
    persistent: Literal["fallback", "plan"] = "fallback"
    #: Keep up to this many request/free events (``Arena.trace()``; 0: none).
    trace_events: int = 0
    #: Seconds the DSA solver may spend on one recording.
    time_limit: float = 0.5
    #: CPU: the arena's regions are 2 MiB aligned and advised for transparent huge pages
    #: (madvise; fewer TLB misses on a region every step walks). False: 64-byte aligned, no advice.
    hugepages: bool = True

    def __post_init__(self) -> None:
        if self.device not in ALIGNMENT:
            raise ConfigError("device", "must be 'cpu' or 'cuda'", self.device)
        if self.persistent not in ("fallback", "plan"):
            raise ConfigError("persistent", "must be 'fallback' or 'plan'", self.persistent)
        if not isinstance(self.hugepages, bool):
            raise ConfigError("hugepages", "must be True or False", self.hugepages)
        for name in ("fallback_limit_bytes", "arena_limit_bytes", "max_recordings", "trace_events", "warmup_steps"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 0:
                raise ConfigError(name, "must be a non-negative integer", getattr(self, name))

    @property
    def alignment(self) -> int:
        return ALIGNMENT[self.device]


@dataclass(frozen=True)
class StepRecord:
    """What one step did: its key, whether it was recorded or replayed, and its counters."""

    index: int
    key: str
    mode: Literal["record", "replay", "default"]
    allocs: int
    allocated_bytes: int
    replayed_allocs: int
    fallback_allocs: int
    fallback_bytes: int


@dataclass
class _State:
    plans: dict[str, SlotPlan] = field(default_factory=dict)
    plan_ids: dict[str, int] = field(default_factory=dict)
    rerecord: set[str] = field(default_factory=set)
    strikes: dict[str, int] = field(default_factory=dict)
    default: bool = False
    awaiting: str | None = None
    key: str = ""
    mode: str = "record"
    began: dict[str, int] = field(default_factory=dict)
    history: list[StepRecord] = field(default_factory=list)


class Arena:
    """Steps of a training loop on the planned arena. Use through ``runtime.planned(...)``."""

    def __init__(self, core: Core, settings: RuntimeSettings, *, plans: dict[str, SlotPlan] | None = None) -> None:
        self._core = core
        self.settings = settings
        self._s = _State()
        self._closed_stats: dict[str, Any] | None = None
        self._trace: Any = None
        if settings.trace_events:
            core.keep_trace(settings.trace_events)
        core.set_hugepages(settings.hugepages)
        for key, plan in (plans or {}).items():
            self._install(key, plan)

    # -- the loop's calls -------------------------------------------------------------------
    def step(self, key: object = None) -> None:
        """End the current step (iteration); the next one has signature ``key`` (default: the same)."""
        self._finish_step()
        self._begin(self._s.key if key is None else str(key))

    def signature(self, key: object) -> None:
        """Name the signature of the step in progress (e.g. the padded length of its batch), before
        its allocations: requests made earlier in the step are not part of its plan. The key the step
        already has: nothing to do."""
        if str(key) != self._s.key or not self._s.began:
            self._begin(str(key))

    @property
    def plans(self) -> dict[str, SlotPlan]:
        return dict(self._s.plans)

    @property
    def history(self) -> tuple[StepRecord, ...]:
        return tuple(self._s.history)

    def trace(self) -> Any:
        """The requests and frees the arena saw (``trace_events`` > 0), as a memplan Trace whose
        iterations are the steps; ``memplan alloc simulate``/``replay`` read it once written."""
        if self._trace is not None:
            return self._trace
        from memplan.events import ALLOC, FREE, AllocEvent, Trace, TraceMeta

        events = tuple(AllocEvent(i, FREE if kind else ALLOC, block, size, iteration=step, stream=stream)
                       for i, (kind, block, size, stream, step) in enumerate(self._core.trace()))
        device = "cuda" if self.settings.device == "cuda" else "cpu"
        return Trace(events=events, meta=TraceMeta(source="memplan runtime", device=device,
                                                   iterations=len(self._s.history) or 1))

    def stats(self) -> dict[str, Any]:
        """Counters of the core plus ``signatures`` (planned keys) and ``steps``."""
        if self._closed_stats is not None:
            return dict(self._closed_stats)
        out: dict[str, Any] = self._core.stats()
        out["signatures"] = len(self._s.plans)
        out["recorded_peak_live_bytes"] = max((p.peak_live_bytes for p in self._s.plans.values()), default=0)
        return out

    # -- internals ------------------------------------------------------------------------------
    def _install(self, key: str, plan: SlotPlan) -> None:
        self._s.plans[key] = plan
        self._s.plan_ids[key] = self._core.add_plan(list(plan.sizes), list(plan.requested), list(plan.offsets),
                                                    list(plan.streams), plan.pool_bytes)

    def _begin(self, key: str) -> None:
        s = self._s
        s.key = key
        plan = s.plan_ids.get(key, -1) if key not in s.rerecord and not s.default else -1
        if len(s.history) < self.settings.warmup_steps:
            plan = -1
        s.rerecord.discard(key)  # one recording per trigger
        s.mode = "default" if s.default else "record" if plan < 0 else "replay"
        if not self._core.begin_step(plan):
            s.mode, s.default = "default", True
            warnings.warn(f"memplan runtime: the arena for signature {key!r} ({s.plans[key].pool_bytes} bytes) could not "
                          "be allocated; the default allocator serves the rest of this run", RuntimeWarning, stacklevel=3)
        s.began = self._core.stats()

    def begin(self) -> None:
        self._begin(self._s.key)

    def _finish_step(self) -> None:
        s = self._s
        rows = self._core.end_step()
        now = self._core.stats()
        record = StepRecord(len(s.history), s.key, s.mode,  # type: ignore[arg-type]
                            now["allocs"] - s.began["allocs"], now["allocated_bytes"] - s.began["allocated_bytes"],
                            now["replayed_allocs"] - s.began["replayed_allocs"],
                            now["fallback_allocs"] - s.began["fallback_allocs"],
                            now["fallback_bytes"] - s.began["fallback_bytes"])
        s.history.append(record)
        if record.mode == "replay":
            over = record.fallback_allocs > self.settings.rerecord_share * max(record.allocs, 1)
            s.strikes[s.key] = s.strikes.get(s.key, 0) + 1 if over else 0
            # two replayed steps in a row: one alone may be a first step creating optimizer states
            if s.strikes[s.key] >= 2 and s.plans[s.key].recordings < self.settings.max_recordings:
                s.rerecord.add(s.key)
        if rows is not None and s.awaiting is not None:
            self._learn(s.awaiting, rows)
        warm = len(s.history) <= self.settings.warmup_steps
        s.awaiting = s.key if record.mode == "record" and not warm else None
        if s.awaiting is not None and s.awaiting not in s.plans:
            recent = self._core.recent()
            if recent is not None:  # provisional: blocks not freed yet go to the fallback until final
                self._learn(s.awaiting, recent, provisional=True)

    def _learn(self, key: str, rows: LogRows, *, provisional: bool = False) -> None:
        old = self._s.plans.get(key)
        if old is not None and (provisional or old.recordings == 0):
            old = None  # a provisional plan is replaced, not merged
        plan = plan_recording(rows, key=key, alignment=self.settings.alignment, persistent=self.settings.persistent,
                              previous=old, time_limit=self.settings.time_limit)
        if provisional:
            plan = dataclasses.replace(plan, recordings=0)
        self._s.rerecord.discard(key)
        self._s.strikes[key] = 0
        if old is not None and old.fingerprint == plan.fingerprint and old.sizes == plan.sizes:
            self._s.plans[key] = plan
            return
        self._install(key, plan)

    def close(self) -> None:
        """End the last step and close the core (its memory goes back once the last block is freed)."""
        if self._closed_stats is not None:
            return
        self._finish_step()
        self._closed_stats = self.stats()
        if self.settings.trace_events:
            self._trace = self.trace()
        self._core.close()
