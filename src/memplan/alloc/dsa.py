"""Dynamic storage allocation: give buffers with fixed lifetimes offsets so live ones never overlap.

:func:`solve` minimises the peak (``max(offset + size)``) of buffers live on ``[start, end)``:

1. **Split** into independent time components (no buffer crosses a cut) and solve each.
2. **Greedy placements** over several orderings (size, lifetime, area, start time), each buffer at
   the lowest gap that fits among the placed buffers it overlaps in time (first fit) or at the
   tightest such gap (best fit) — the "greedy by size" family used by TFLite and STAlloc.
3. **Search** at the lower bound (briefly, when a looser capacity is given), then at the capacity:
   MiniMalloc's depth-first search (Moffitt, ASPLOS'23; see :class:`_Search`) with its canonical,
   dominance, section-inference and hatless pruning and dynamic decomposition, round robin over
   preorderings with a doubling node limit. It runs in the optional C extension ``_dsa_search``
   when built (``setup.py``), else in pure Python (same offsets, ~65x slower).

Large components (more than :data:`SEARCH_LIMIT` buffers) get the greedy passes only.
"""

from __future__ import annotations

import importlib
import itertools
import operator
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Literal

try:
    import numpy as np
except ImportError:
    from memplan.errors import MissingDependencyError

    raise MissingDependencyError("numpy", feature="the DSA solver (memplan alloc plan)", extra="alloc") from None

_native: ModuleType | None
try:  # the optional C extension (setup.py); without it the same search runs in pure Python
    _native = importlib.import_module("memplan.alloc._dsa_search")
except ImportError:  # pragma: no cover - depends on the build
    _native = None

__all__ = ["HAS_NATIVE", "PURE_PYTHON_ENV", "SEARCH_LIMIT", "DSAResult", "live_peak", "solve", "validate"]

#: True when the C search core (``memplan.alloc._dsa_search``) was built and imported.
HAS_NATIVE = _native is not None
#: Set this environment variable to ``1`` to run the pure-Python search even when the C core is built.
PURE_PYTHON_ENV = "MEMPLAN_DSA_PURE_PYTHON"

#: Components with more buffers than this are not searched (greedy passes only).
SEARCH_LIMIT = 2500
#: Given a capacity above the lower bound, the search tries the bound first for this share of the
#: time, at most LOWER_BOUND_SECONDS (MiniMalloc C: 0.02 s at its bound; D and J: bound infeasible or hard).
LOWER_BOUND_SHARE = 0.1
LOWER_BOUND_SECONDS = 1.0
#: Above this many buffers only the size ordering is tried (a greedy pass costs O(n^2) vector work).
GREEDY_LIMIT = 6000


@dataclass(frozen=True)
class DSAResult:
    offsets: tuple[int, ...]
    peak: int
    lower_bound: int
    method: str
    optimal: bool


def live_peak(starts: Sequence[int], ends: Sequence[int], sizes: Sequence[int]) -> int:
    """Largest sum of sizes live at one time: a lower bound of every placement."""
    points = sorted([(s, 1, z) for s, z in zip(starts, sizes)] + [(e, 0, z) for e, z in zip(ends, sizes)])
    live = peak = 0
    for _, kind, size in points:  # frees (0) sort before allocs (1) at the same time
        live += size if kind else -size
        peak = max(peak, live)
    return peak


def validate(starts: Sequence[int], ends: Sequence[int], sizes: Sequence[int], offsets: Sequence[int],
             capacity: int | None = None) -> bool:
    """True when no two buffers overlap in both time and address (and all fit in ``capacity``)."""
    order = sorted(range(len(starts)), key=lambda i: starts[i])
    active: list[int] = []
    for i in order:
        if sizes[i] == 0:
            continue
        if offsets[i] < 0 or (capacity is not None and offsets[i] + sizes[i] > capacity):
            return False
        active = [j for j in active if ends[j] > starts[i]]
        for j in active:
            if offsets[i] < offsets[j] + sizes[j] and offsets[j] < offsets[i] + sizes[i]:
                return False
        active.append(i)
    return True


def _components(starts: np.ndarray, ends: np.ndarray) -> list[np.ndarray]:
    order = np.argsort(starts, kind="stable")
    reach = np.maximum.accumulate(ends[order])
    cuts = np.nonzero(reach[:-1] <= starts[order][1:])[0] + 1
    return np.split(order, cuts)


def _greedy(starts: np.ndarray, ends: np.ndarray, sizes: np.ndarray, order: np.ndarray, best_fit: bool) -> np.ndarray:
    """Place buffers in ``order``, each in the lowest (or tightest) gap among those it overlaps."""
    n = len(order)
    offsets = np.zeros(len(starts), dtype=np.int64)
    p_start = np.empty(n, dtype=np.int64)
    p_end = np.empty(n, dtype=np.int64)
    p_off = np.empty(n, dtype=np.int64)
    p_top = np.empty(n, dtype=np.int64)
    for count, i in enumerate(order):
        s, e, z = starts[i], ends[i], sizes[i]
        mask = (p_start[:count] < e) & (p_end[:count] > s)
        offs = p_off[:count][mask]
        off = 0
        if offs.size:
            idx = np.argsort(offs, kind="stable")
            offs = offs[idx]
            tops = p_top[:count][mask][idx]
            prev = np.zeros(offs.size, dtype=np.int64)
            if offs.size > 1:
                prev[1:] = np.maximum.accumulate(tops[:-1])
            gaps = offs - prev
            fits = np.nonzero(gaps >= z)[0]
            if fits.size:
                k = fits[np.argmin(gaps[fits])] if best_fit else fits[0]
                off = int(prev[k])
            else:
                off = int(tops.max())
        offsets[i] = off
        p_start[count], p_end[count], p_off[count], p_top[count] = s, e, off, off + z
    return offsets


_OK, _NOT_FOUND, _ABORTED, _TIMEOUT = range(4)
_STATUS = {_OK: "ok", _NOT_FOUND: "infeasible", _ABORTED: "timeout", _TIMEOUT: "timeout"}
#: MiniMalloc's default preorderings, tried round robin: letters of T (largest unplaced total of a
#: section the buffer spans), W (lifetime), A (size x lifetime), each larger first.
HEURISTICS = ("WAT", "TAW", "TWA")
_CLOCK_EVERY = 16


class _Search:
    """MiniMalloc's search (Moffitt, ASPLOS'23), re-implemented from its published description.

    The pure-Python twin of ``_dsa_search.c`` (same algorithm, same offsets, ~65x slower). Buffers
    are placed in non-decreasing offset order, each at its minimum offset (the highest top of the
    placed buffers it overlaps in time); candidates are ordered by (minimum offset, preorder rank).
    Pruning: *canonical* (an offset below the last one, or equal with a smaller rank, is skipped),
    *dominance* (no buffer goes at or above the lowest top an unplaced buffer could reach),
    *section inference* (in every time section ``max(offset, floor) + unplaced bytes <= capacity``,
    the floor raised to the lowest minimum offset of the section's unplaced buffers) and *hatless*
    (a buffer with no unplaced buffer overlapping it is tried at one place only). *Dynamic
    decomposition*: once no unplaced buffer crosses a section boundary, each side is solved apart.
    """

    def __init__(self, starts: list[int], ends: list[int], sizes: list[int], capacity: int,
                 deadline: float) -> None:
        n = len(starts)
        if any(z <= 0 for z in sizes) or any(e <= s for s, e in zip(starts, ends)):
            raise ValueError("the search needs positive sizes (zero defeats dominance) and start < end")
        self.n, self.sizes, self.capacity, self.deadline = n, sizes, capacity, deadline
        self.width = [e - s for s, e in zip(starts, ends)]
        points = sorted(set(starts) | set(ends))
        where = {p: k for k, p in enumerate(points)}
        self.lo = [where[t] for t in starts]
        self.hi = [where[t] for t in ends]
        self.n_sec = max(len(points) - 1, 1)
        self.members: list[list[int]] = [[] for _ in range(self.n_sec)]
        self.total0 = [0] * self.n_sec
        self.cuts0 = [0] * self.n_sec
        for i in range(n):
            for s in range(self.lo[i], self.hi[i]):
                self.members[s].append(i)
                self.total0[s] += sizes[i]
                if s + 1 < self.hi[i]:
                    self.cuts0[s] += 1
        s_np, e_np = np.asarray(starts), np.asarray(ends)
        self.overlaps = [[int(j) for j in np.nonzero((s_np < ends[i]) & (e_np > starts[i]))[0] if j != i]
                         for i in range(n)]
        self.nodes = 0

    def run(self, heuristics: Sequence[str]) -> tuple[str, list[int] | None, int]:
        """Round robin over the preorderings under a node limit that doubles each round."""
        sys.setrecursionlimit(max(sys.getrecursionlimit(), 8 * self.n + 1000))
        limit = max(self.n, 1)
        while True:
            limit *= 2
            for key in heuristics:
                self._reset(key, limit)
                # independent partitions from the start: the section boundaries no buffer crosses
                points = [0] + [s + 1 for s in range(self.n_sec - 1) if self.cuts0[s] == 0] + [self.n_sec]
                status = self._solve_parts(list(range(self.n)), points)
                if status != _ABORTED:
                    return _STATUS[status], (self.solution if status == _OK else None), self.nodes
                if time.perf_counter() > self.deadline:
                    return "timeout", None, self.nodes

    def _reset(self, key: str, limit: int) -> None:
        self.key, self.nodes_left = key, limit
        self.off = [-1] * self.n
        self.min_off = [0] * self.n
        self.solution = [-1] * self.n
        self.floor = [0] * self.n_sec
        self.total = list(self.total0)
        self.cuts = list(self.cuts0)

    def _preorder(self, bufs: list[int]) -> list[int]:
        total, sizes, width = self.total, self.sizes, self.width

        def features(i: int) -> tuple[int, ...]:
            value = {"T": max(total[self.lo[i]:self.hi[i]]), "W": width[i], "A": sizes[i] * width[i]}
            return tuple(-value[ch] for ch in self.key) + (i,)

        return sorted(bufs, key=features)

    def _sub_solve(self, bufs: list[int], plo: int, phi: int) -> int:
        return self._search(self._preorder(bufs), plo, phi, 0, 0)

    def _solve_parts(self, order: list[int], points: list[int]) -> int:
        """Unplaced buffers of ``order`` as independent partitions split at the boundaries ``points``."""
        off, lo, hi = self.off, self.lo, self.hi
        for a, b in itertools.pairwise(points):
            sub = [j for j in order if off[j] < 0 and lo[j] < b and a < hi[j]]
            if sub:
                status = self._sub_solve(sub, a, b)
                if status != _OK:
                    return status
        return _OK

    def _search(self, order: list[int], plo: int, phi: int, min_offset: int, min_rank: int) -> int:
        if self.nodes_left <= 0:
            return _ABORTED
        self.nodes_left -= 1
        self.nodes += 1
        if self.nodes % _CLOCK_EVERY == 0 and time.perf_counter() > self.deadline:
            return _TIMEOUT
        off, min_off, sizes = self.off, self.min_off, self.sizes
        cands = sorted((min_off[i], r, i) for r, i in enumerate(order) if off[i] < 0)
        if not cands:  # a leaf: every buffer of this partition is placed
            for i in order:
                self.solution[i] = off[i]
            return _OK
        min_height = min(o + sizes[i] for o, _, i in cands)
        totals = self.total[plo:phi]
        most, hot_at = max(totals), -1
        for o, r, i in cands:
            if o < min_offset or (o == min_offset and r < min_rank):
                continue  # canonical order
            if o >= min_height:
                break  # dominance: a gap an unplaced buffer could fill
            excess = o + most - self.capacity
            if excess > 0:  # i must cover every section it would leave over capacity (exact shortcut)
                if hot_at != o:
                    hot = [s for s, t in enumerate(totals, plo) if o + t > self.capacity]
                    hot_at = o
                if sizes[i] < excess or self.lo[i] > hot[0] or self.hi[i] <= hot[-1]:
                    if all(off[j] >= 0 for j in self.overlaps[i]):
                        return _NOT_FOUND  # hatless
                    continue
            saved, hatless, ok = self._place(i, o, plo, phi)
            status = self._decompose(order, plo, phi, o, r, i) if ok else _NOT_FOUND
            self._unplace(i, saved)
            if status != _NOT_FOUND or hatless:
                return status
        return _NOT_FOUND

    def _place(self, i: int, o: int, plo: int, phi: int) -> tuple[tuple[list, list], bool, bool]:
        """Place i at o; returns the undo record, whether i is hatless, and whether the partial
        placement passes section inference on ``[plo, phi)``."""
        off, min_off, floor, total, lo, hi = self.off, self.min_off, self.floor, self.total, self.lo, self.hi
        top = o + self.sizes[i]
        off[i] = o
        min_changes: list[tuple[int, int]] = []
        floor_changes: list[tuple[int, int]] = []
        for s in range(lo[i], hi[i]):
            floor_changes.append((s, floor[s]))
            floor[s] = top
            total[s] -= self.sizes[i]
        if not self._feasible(plo, phi, o):  # raising floors below can only make it worse
            return (min_changes, floor_changes), all(off[j] >= 0 for j in self.overlaps[i]), False
        affected: set[int] = set()
        hatless = True
        for j in self.overlaps[i]:
            if off[j] >= 0:
                continue
            hatless = False
            if min_off[j] < top:
                min_changes.append((j, min_off[j]))
                min_off[j] = top
                affected.update(range(lo[j], hi[j]))
        ok = True
        for s in affected:  # a section's floor is at least the lowest minimum offset of its unplaced buffers
            if floor[s] >= top:
                continue  # a changed buffer here now has minimum offset top: no raise
            lowest = min((min_off[b] for b in self.members[s] if off[b] < 0), default=None)
            if lowest is not None and floor[s] < lowest:
                floor_changes.append((s, floor[s]))
                floor[s] = lowest
                ok = ok and not (plo <= s < phi and max(lowest, o) + total[s] > self.capacity)
        return (min_changes, floor_changes), hatless, ok

    def _unplace(self, i: int, saved: tuple[list, list]) -> None:
        min_changes, floor_changes = saved
        for s, value in reversed(floor_changes):
            self.floor[s] = value
        for s in range(self.lo[i], self.hi[i]):
            self.total[s] += self.sizes[i]
        for j, value in reversed(min_changes):
            self.min_off[j] = value
        self.off[i] = -1

    def _feasible(self, plo: int, phi: int, o: int) -> bool:
        floor, total = self.floor[plo:phi], self.total[plo:phi]
        return o + max(total) <= self.capacity and max(map(operator.add, floor, total)) <= self.capacity

    def _decompose(self, order: list[int], plo: int, phi: int, o: int, rank: int, i: int) -> int:
        self.solution[i] = o
        cuts, lo, hi = self.cuts, self.lo, self.hi
        points = [plo]
        for s in range(lo[i], hi[i] - 1):
            cuts[s] -= 1
            if cuts[s] == 0:
                points.append(s + 1)
        if len(points) == 1:
            status = self._search(order, plo, phi, o, rank)
        else:
            status = self._solve_parts(order, [*points, phi])
        for s in range(lo[i], hi[i] - 1):
            cuts[s] += 1
        return status


def _search_offsets(starts: list[int], ends: list[int], sizes: list[int], capacity: int, deadline: float,
                    engine: str) -> list[int] | None:
    """Offsets within ``capacity`` from the C search core (or its pure-Python twin), or None."""
    budget = deadline - time.perf_counter()
    if budget <= 0:
        return None
    native = engine == "c" or (engine == "auto" and os.environ.get(PURE_PYTHON_ENV) != "1")
    if _native is not None and native:
        _, offsets, _ = _native.search(starts, ends, sizes, capacity, budget, list(HEURISTICS))
    else:
        _, offsets, _ = _Search(starts, ends, sizes, capacity, deadline).run(HEURISTICS)
    return offsets


def _orders(starts: np.ndarray, ends: np.ndarray, sizes: np.ndarray) -> dict[str, np.ndarray]:
    life = ends - starts
    return {
        "size": np.lexsort((starts, -life, -sizes)),
        "lifetime": np.lexsort((starts, -sizes, -life)),
        "area": np.lexsort((starts, -sizes, -(life * sizes))),
        "start": np.lexsort((-sizes, -life, starts)),
    }


def _solve_component(starts: np.ndarray, ends: np.ndarray, sizes: np.ndarray, capacity: int | None,
                     deadline: float, rng: np.random.Generator, engine: str) -> tuple[np.ndarray, str, bool]:
    n = len(starts)
    lower = live_peak(starts.tolist(), ends.tolist(), sizes.tolist())
    best, best_peak, method = np.zeros(n, dtype=np.int64), None, ""
    orders = _orders(starts, ends, sizes)
    if n > GREEDY_LIMIT:
        orders = {"size": orders["size"]}
    for name, order in orders.items():
        for fit in (False, True):
            offs = _greedy(starts, ends, sizes, order, fit)
            peak = int((offs + sizes).max()) if n else 0
            if best_peak is None or peak < best_peak:
                best, best_peak, method = offs, peak, f"greedy-{name}-{'best' if fit else 'first'}-fit"
            if peak == lower:
                return best, method, True
    assert best_peak is not None
    fits = capacity is not None and best_peak <= capacity
    if n <= SEARCH_LIMIT and not fits:
        # the lower bound first (the pruning is strongest when tight; a short try when a looser
        # capacity is asked for), then that capacity with the rest of the time
        targets = [lower] + ([capacity] if capacity is not None and capacity > lower else [])
        for target in targets:
            now = time.perf_counter()
            until = deadline if target != lower or len(targets) == 1 else \
                now + min(LOWER_BOUND_SHARE * (deadline - now), LOWER_BOUND_SECONDS)
            found = _search_offsets(starts.tolist(), ends.tolist(), sizes.tolist(), target, until, engine)
            if found is not None:
                offs = np.asarray(found, dtype=np.int64)
                return offs, "search", int((offs + sizes).max()) == lower
        # perturbation: random swaps of the best greedy order, keep the best
        base = orders["size"]
        while time.perf_counter() < deadline and n > 1:
            order = base.copy()
            for _ in range(max(1, n // 20)):
                a, b = rng.integers(0, n, size=2)
                order[a], order[b] = order[b], order[a]
            offs = _greedy(starts, ends, sizes, order, bool(rng.integers(0, 2)))
            peak = int((offs + sizes).max())
            if peak < best_peak:
                best, best_peak, method, base = offs, peak, "greedy-perturbed", order
            if best_peak == lower or (capacity is not None and best_peak <= capacity):
                break
    return best, method, best_peak == lower


def solve(starts: Sequence[int], ends: Sequence[int], sizes: Sequence[int], *, capacity: int | None = None,
          time_limit: float = 10.0, seed: int = 0,
          engine: Literal["auto", "c", "python"] = "auto") -> DSAResult:
    """Offsets for buffers live on ``[start, end)``; tries to fit ``capacity`` when one is given.

    ``engine`` picks the search core: ``"auto"`` (C when built, unless the environment variable
    :data:`PURE_PYTHON_ENV` is ``1``), ``"c"`` (C when built, whatever the environment says) or
    ``"python"`` (always pure Python).

    Example::

        >>> solve([0, 0, 2], [2, 3, 4], [4, 4, 8]).peak
        12
    """
    if engine not in ("auto", "c", "python"):
        raise ValueError(f"engine must be 'auto', 'c' or 'python', not {engine!r}")
    s = np.asarray(starts, dtype=np.int64)
    e = np.asarray(ends, dtype=np.int64)
    z = np.asarray(sizes, dtype=np.int64)
    n = len(s)
    offsets = np.zeros(n, dtype=np.int64)
    if n == 0:
        return DSAResult((), 0, 0, "empty", True)
    deadline_total = time.perf_counter() + time_limit
    rng = np.random.default_rng(seed)
    nonzero = np.nonzero(z > 0)[0]
    comps = _components(s[nonzero], e[nonzero]) if nonzero.size else []
    methods, optimal = set(), True
    for k, comp in enumerate(comps):
        idx = nonzero[comp]
        remaining = deadline_total - time.perf_counter()
        share = remaining * max(len(idx), 1) / max(sum(len(c) for c in comps[k:]), 1)
        until = time.perf_counter() + share
        offs, method, opt = _solve_component(s[idx], e[idx], z[idx], capacity, until, rng, engine)
        offsets[idx] = offs
        methods.add(method)
        optimal &= opt
    peak = int((offsets + z).max())
    lower = max((live_peak(s[c].tolist(), e[c].tolist(), z[c].tolist()) for c in
                 (nonzero[comp] for comp in comps)), default=0)
    return DSAResult(tuple(int(o) for o in offsets), peak, lower, "+".join(sorted(methods)), optimal)
