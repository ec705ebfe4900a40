"""An STAlloc-style spatio-temporal plan: fixed offsets for the predictable requests of a trace.

STAlloc (EuroSys'26) observes that a training iteration allocates the same tensors in the same
order every time, so their addresses can be decided offline. The planner:

1. **Classifies** each request by its lifetime: *persistent* (allocated at setup, never freed,
   or living across an iteration boundary: weights, optimizer states, gradients kept between
   steps), *periodic* (the k-th request of its (category, module, size) in an iteration, found
   in at least half of the iterations, and in at least two; with one iteration, every other
   request) and *dynamic* (the rest, e.g. MoE token-count-dependent shapes).
2. **Places** persistent and periodic requests by solving dynamic storage allocation
   (:mod:`memplan.alloc.dsa`: several orderings, first/best fit, search). Small traces are solved
   as one problem; large ones fold iterations: persistent requests are packed once, each distinct
   iteration pattern once above them, and identical iterations reuse the pattern's offsets.
3. **Serves dynamic requests** from the plan's free gaps (lowest offset free over the request's
   lifetime), falling back to growing the pool.

Sizes are aligned to 512 bytes (the caching allocator's block granularity). The lower bound is
the trace's peak of live requested bytes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

try:
    import numpy as np
except ImportError:
    from memplan.errors import MissingDependencyError

    raise MissingDependencyError("numpy", feature="the static plan (memplan alloc plan, alloc compare)", extra="alloc") from None

from memplan.alloc import dsa
from memplan.errors import ConfigError, MemplanError
from memplan.events import ALLOC, Trace
from memplan.units import format_bytes

__all__ = ["DYNAMIC", "PERIODIC", "PERSISTENT", "StaticPlan", "plan_trace"]

PERSISTENT, PERIODIC, DYNAMIC = "persistent", "periodic", "dynamic"
#: Non-dynamic requests solved as one DSA problem up to this count; above it iterations are folded.
JOINT_LIMIT = dsa.GREEDY_LIMIT


@dataclass(frozen=True)
class StaticPlan:
    """A static memory plan for a trace: one pool, an offset per request."""

    pool_bytes: int
    lower_bound_bytes: int
    peak_aligned_bytes: int
    alignment: int
    counts: dict[str, int]
    method: str
    blocks: tuple[int, ...] = field(repr=False)
    alloc_events: tuple[int, ...] = field(repr=False)
    offsets: tuple[int, ...] = field(repr=False)
    sizes: tuple[int, ...] = field(repr=False)
    classes: tuple[str, ...] = field(repr=False)
    seconds: float = 0.0

    @property
    def predicted_reserved_bytes(self) -> int:
        """What the allocator reserves with this plan: the pool itself."""
        return self.pool_bytes

    @property
    def fragmentation(self) -> float:
        """``1 - peak allocated / pool`` with the plan's aligned sizes as "allocated"."""
        return 1.0 - self.peak_aligned_bytes / self.pool_bytes if self.pool_bytes else 0.0

    @property
    def overhead(self) -> float:
        """Pool over the lower bound (1.0 is perfect)."""
        return self.pool_bytes / self.lower_bound_bytes if self.lower_bound_bytes else 1.0

    def to_dict(self, *, requests: bool = True) -> dict[str, Any]:
        out: dict[str, Any] = {
            "format": "memplan-plan", "version": 1,
            "pool_bytes": self.pool_bytes, "predicted_reserved_bytes": self.predicted_reserved_bytes,
            "lower_bound_bytes": self.lower_bound_bytes, "peak_aligned_bytes": self.peak_aligned_bytes,
            "overhead": round(self.overhead, 6), "fragmentation": round(self.fragmentation, 6),
            "alignment": self.alignment, "counts": dict(self.counts), "method": self.method,
            "seconds": round(self.seconds, 3),
        }
        if requests:
            out["requests"] = [
                {"event": e, "block": b, "offset": o, "size": z, "class": c}
                for e, b, o, z, c in zip(self.alloc_events, self.blocks, self.offsets, self.sizes, self.classes)
            ]
        return out


@dataclass
class _Requests:
    block: np.ndarray
    event: np.ndarray
    start: np.ndarray
    end: np.ndarray
    size: np.ndarray
    iteration: np.ndarray
    cls: list[str]


#: What identifies a request across iterations (with its rank among the iteration's requests of
#: the same identity): category, module, requested size. The allocating op is left out: one
#: storage may be allocated by different ops in different iterations (FSDP2 allocates an
#: unsharded parameter with ``empty`` the first time and re-allocates it with ``resize_`` after).
_Identity = tuple[str, str, int]


def _requests(trace: Trace, alignment: int) -> _Requests:
    events = trace.events
    n_events = len(events)
    open_: dict[int, int] = {}
    rows: list[list[int]] = []
    identities: list[_Identity] = []
    for position, event in enumerate(events):
        if event.kind == ALLOC:
            open_[event.block] = len(rows)
            size = -(-event.size // alignment) * alignment if event.size else 0
            rows.append([event.block, position, position, n_events, size, event.iteration, -1])
            identities.append((event.category, event.module, event.size))
        else:
            row = rows[open_.pop(event.block)]
            row[3] = position
            row[6] = event.iteration
    arr = np.asarray(rows, dtype=np.int64).reshape(-1, 7)
    req = _Requests(arr[:, 0], arr[:, 1], arr[:, 2], arr[:, 3], arr[:, 4], arr[:, 5], [])
    req.cls = _classify(arr, identities)
    return req


def _classify(arr: np.ndarray, identities: list[_Identity]) -> list[str]:
    """Persistent by lifetime alone, whatever the category: a gradient freed in its own iteration
    (``zero_grad(set_to_none=True)``, FSDP2's sharded gradients) recurs like an activation, and
    packing it with the weights would keep its bytes from the activations of every iteration."""
    iterations = sorted({int(i) for i in arr[:, 5] if i >= 0})
    classes: list[str] = []
    occurrence: dict[tuple[int, _Identity], int] = {}
    keys: list[tuple[_Identity, int] | None] = []
    for row, identity in zip(arr, identities):
        iteration, free_iteration = int(row[5]), int(row[6])
        persistent = iteration < 0 or free_iteration != iteration  # free_iteration -1: never freed
        classes.append(PERSISTENT if persistent else PERIODIC)
        if persistent:
            keys.append(None)
            continue
        k = occurrence.get((iteration, identity), 0)
        occurrence[(iteration, identity)] = k + 1
        keys.append((identity, k))
    if len(iterations) >= 2:
        seen: dict[tuple[_Identity, int], set[int]] = {}
        for row, key in zip(arr, keys):
            if key is not None:
                seen.setdefault(key, set()).add(int(row[5]))
        # recurring: found in at least half of the iterations (the last one may be cut short)
        needed = max(2, -(-len(iterations) // 2))
        everywhere = {key for key, its in seen.items() if len(its) >= needed}
        classes = [DYNAMIC if c == PERIODIC and keys[i] not in everywhere else c for i, c in enumerate(classes)]
    return classes


def plan_trace(trace: Trace, *, capacity: int | None = None, alignment: int = 512, time_limit: float = 20.0,
               progress: Callable[[str], None] | None = None) -> StaticPlan:
    """Plan ``trace``; a ``capacity`` below the lower bound is a ConfigError with both numbers."""
    began = time.perf_counter()
    lower = trace.peak_live_bytes
    if capacity is not None and capacity < lower:
        raise ConfigError("--capacity", f"cannot hold the trace: its live bytes peak at {lower} "
                          f"({format_bytes(lower)}), the lower bound of any allocator", capacity,
                          hint=f"give at least {format_bytes(lower)}")
    req = _requests(trace, alignment)
    n = len(req.size)
    offsets = np.zeros(n, dtype=np.int64)
    cls = np.asarray(req.cls)
    planned = np.nonzero(cls != DYNAMIC)[0]
    methods: set[str] = set()
    if len(planned) <= JOINT_LIMIT:
        result = dsa.solve(req.start[planned], req.end[planned], req.size[planned], time_limit=time_limit / 2)
        offsets[planned] = result.offsets
        methods.add(f"joint:{result.method}")
    else:
        _plan_folded(req, cls, offsets, methods, time_limit, progress)
    dynamic = np.nonzero(cls == DYNAMIC)[0]
    if dynamic.size:
        _place_dynamic(req, planned, dynamic, offsets)
        methods.add("dynamic:gaps")
    pool = int((offsets + req.size).max()) if n else 0
    if capacity is not None and pool > capacity:
        raise MemplanError(f"the plan needs {pool} bytes ({format_bytes(pool)}), more than the capacity "
                           f"{capacity} ({format_bytes(capacity)}); the lower bound is {lower}")
    aligned_peak = dsa.live_peak(req.start.tolist(), req.end.tolist(), req.size.tolist())
    counts = {c: int((cls == c).sum()) for c in (PERSISTENT, PERIODIC, DYNAMIC)}
    return StaticPlan(pool_bytes=pool, lower_bound_bytes=lower, peak_aligned_bytes=aligned_peak, alignment=alignment,
                counts=counts, method="+".join(sorted(methods)), blocks=tuple(req.block.tolist()),
                alloc_events=tuple(req.event.tolist()), offsets=tuple(offsets.tolist()),
                sizes=tuple(req.size.tolist()), classes=tuple(cls.tolist()), seconds=time.perf_counter() - began)


def _plan_folded(req: _Requests, cls: np.ndarray, offsets: np.ndarray, methods: set[str], time_limit: float,
                 progress: Callable[[str], None] | None) -> None:
    """Persistent requests packed once at the bottom; each distinct iteration pattern once above."""
    persistent = np.nonzero(cls == PERSISTENT)[0]
    base = 0
    if persistent.size:
        result = dsa.solve(req.start[persistent], req.end[persistent], req.size[persistent], time_limit=time_limit / 4)
        offsets[persistent] = result.offsets
        base = result.peak
        methods.add(f"persistent:{result.method}")
    periodic = np.nonzero(cls == PERIODIC)[0]
    patterns: dict[bytes, tuple[int, ...]] = {}
    for iteration in np.unique(req.iteration[periodic]):
        members = periodic[req.iteration[periodic] == iteration]
        points = np.concatenate([req.start[members], req.end[members]])
        ranks = np.searchsorted(np.unique(points), points)
        starts, ends = ranks[: len(members)], ranks[len(members):]
        key = np.concatenate([starts, ends, req.size[members]]).tobytes()
        if key not in patterns:
            if progress is not None:
                progress(f"iteration {int(iteration)}")
            result = dsa.solve(starts, ends, req.size[members], time_limit=time_limit / 4)
            patterns[key] = result.offsets
            methods.add(f"periodic:{result.method}")
        offsets[members] = np.asarray(patterns[key], dtype=np.int64) + base
    methods.add(f"folded:{len(patterns)}-patterns")


def _place_dynamic(req: _Requests, planned: np.ndarray, dynamic: np.ndarray, offsets: np.ndarray) -> None:
    """Each dynamic request (in time order) at the lowest offset free during its whole life.

    A dynamic request lives inside its iteration, so only persistent requests and the requests of
    the same iteration can overlap it; each iteration is handled with those alone.
    """
    persistent = planned[np.asarray(req.cls)[planned] == PERSISTENT]
    others = np.setdiff1d(np.arange(len(req.size)), persistent, assume_unique=True)
    for iteration in np.unique(req.iteration[dynamic]):
        group_dyn = dynamic[req.iteration[dynamic] == iteration]
        same = others[req.iteration[others] == iteration]
        fixed = np.concatenate([persistent, np.setdiff1d(same, group_dyn, assume_unique=True)])
        n_fixed, total = len(fixed), len(fixed) + len(group_dyn)
        p_start = np.empty(total, dtype=np.int64)
        p_end, p_off, p_top = np.empty_like(p_start), np.empty_like(p_start), np.empty_like(p_start)
        p_start[:n_fixed], p_end[:n_fixed] = req.start[fixed], req.end[fixed]
        p_off[:n_fixed], p_top[:n_fixed] = offsets[fixed], offsets[fixed] + req.size[fixed]
        count = n_fixed
        for i in group_dyn[np.argsort(req.start[group_dyn], kind="stable")]:
            s, e, z = req.start[i], req.end[i], req.size[i]
            mask = (p_start[:count] < e) & (p_end[:count] > s)
            offs, tops = p_off[:count][mask], p_top[:count][mask]
            off = 0
            if offs.size:
                order = np.argsort(offs, kind="stable")
                offs, tops = offs[order], tops[order]
                prev = np.zeros(offs.size, dtype=np.int64)
                if offs.size > 1:
                    prev[1:] = np.maximum.accumulate(tops[:-1])
                fits = np.nonzero(offs - prev >= z)[0]
                off = int(prev[fits[0]]) if fits.size else int(tops.max())
            offsets[i] = off
            p_start[count], p_end[count], p_off[count], p_top[count] = s, e, off, off + z
            count += 1
