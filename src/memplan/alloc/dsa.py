"""Dynamic storage allocation: give buffers with fixed lifetimes offsets so live ones never overlap.

:func:`solve` minimises the peak (``max(offset + size)``) of buffers live on ``[start, end)``:

1. **Split** into independent time components (no buffer crosses a cut) and solve each.
2. **Greedy placements** over several orderings (size, lifetime, area, start time), each buffer at
   the lowest gap that fits among the placed buffers it overlaps in time (first fit) or at the
   tightest such gap (best fit) — the "greedy by size" family used by TFLite and STAlloc.
3. **Search** at the capacity (or at the lower bound): MiniMalloc's depth-first search
   (Moffitt, ASPLOS'23; see :class:`_Search`) with its canonical, dominance and section-inference
   pruning, round-robin over preorderings with a doubling node limit.

Large components (more than :data:`SEARCH_LIMIT` buffers) get the greedy passes only.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["SEARCH_LIMIT", "DSAResult", "live_peak", "solve", "validate"]

#: Components with more buffers than this are not searched (greedy passes only).
SEARCH_LIMIT = 2500
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


class _Timeout(Exception):
    pass


class _NodeLimit(Exception):
    pass


class _Search:
    """MiniMalloc's search (Moffitt, ASPLOS'23), re-implemented from its published description.

    Buffers are placed in non-decreasing offset order, each at its minimum offset (the highest top
    of the placed buffers it overlaps in time). Pruning: *canonical* (an offset below the last one,
    or equal with a smaller preorder index, is skipped), *dominance* (no buffer is placed at or
    above the lowest top any unplaced buffer could reach — that would leave a needless gap), and
    *section inference*: in every time section, ``max(offset, floor) + unplaced sizes <= capacity``
    where the floor is raised to the lowest minimum offset of the section's unplaced buffers.
    """

    def __init__(self, starts: list[int], ends: list[int], sizes: list[int], capacity: int,
                 deadline: float, key: str, node_limit: int) -> None:
        n = len(starts)
        self.n, self.sizes, self.capacity, self.deadline, self.node_limit = n, sizes, capacity, deadline, node_limit
        points = sorted(set(starts) | set(ends))
        where = {p: k for k, p in enumerate(points)}
        self.sec = [(where[starts[i]], where[ends[i]]) for i in range(n)]
        n_sec = max(len(points) - 1, 1)
        self.total = [0] * n_sec
        members: list[list[int]] = [[] for _ in range(n_sec)]
        for i, (a, b) in enumerate(self.sec):
            for s in range(a, b):
                self.total[s] += sizes[i]
                members[s].append(i)
        # buffers of every section, flattened, for a vectorised per-section minimum (reduceat)
        self.flat = np.asarray([i for m in members for i in m] or [0], dtype=np.int64)
        self.flat_starts = np.cumsum([0] + [len(m) for m in members[:-1]]).astype(np.int64)
        self.nonempty = np.asarray([bool(m) for m in members])
        self.floor = [0] * n_sec
        self.overlaps = [[j for j in range(n) if j != i and starts[j] < ends[i] and starts[i] < ends[j]]
                         for i in range(n)]
        features = {"T": [max(self.total[a:b]) for a, b in self.sec], "W": [b - a for a, b in self.sec],
                    "A": [sizes[i] * (ends[i] - starts[i]) for i in range(n)]}
        preorder = sorted(range(n), key=lambda i: tuple(-features[c][i] for c in key) + (i,))
        self.rank = [0] * n
        for r, i in enumerate(preorder):
            self.rank[i] = r
        self.min_off = [0] * n
        self.min_off_np = np.zeros(n, dtype=np.int64)
        self.unplaced_np = np.ones(n, dtype=bool)
        self.unplaced = set(range(n))
        self.offsets = [0] * n
        self.nodes = 0
        self._saved: list[list[int]] = []

    def run(self) -> list[int] | None:
        sys.setrecursionlimit(max(sys.getrecursionlimit(), 4 * self.n + 1000))
        return list(self.offsets) if self._search(0, 0) else None

    def _search(self, last: int, last_rank: int) -> bool:
        unplaced = self.unplaced
        if not unplaced:
            return True
        self.nodes += 1
        if self.nodes > self.node_limit:
            raise _NodeLimit
        if self.nodes & 63 == 0 and time.perf_counter() > self.deadline:
            raise _Timeout
        sizes, min_off, rank = self.sizes, self.min_off, self.rank
        order = sorted((min_off[i], rank[i], i) for i in unplaced)
        lowest_top = min(min_off[i] + sizes[i] for i in unplaced)
        for off, r, i in order:
            if off >= lowest_top:
                break  # dominance: every remaining choice leaves a needless gap
            if off < last or (off == last and r < last_rank):
                continue  # canonical order
            changes = self._place(i, off)
            if self._feasible(i, off) and self._search(off, r):
                return True
            self._unplace(i, changes)
        return False

    def _place(self, i: int, off: int) -> list[tuple[int, int]]:
        top = off + self.sizes[i]
        changes = []
        for j in self.overlaps[i]:
            if j in self.unplaced and self.min_off[j] < top:
                changes.append((j, self.min_off[j]))
                self.min_off[j] = top
                self.min_off_np[j] = top
        a, b = self.sec[i]
        self._saved.append(self.floor[a:b])
        for s in range(a, b):
            self.floor[s] = top
            self.total[s] -= self.sizes[i]
        self.unplaced.discard(i)
        self.unplaced_np[i] = False
        self.offsets[i] = off
        return changes

    def _unplace(self, i: int, changes: list[tuple[int, int]]) -> None:
        a, b = self.sec[i]
        self.floor[a:b] = self._saved.pop()
        for s in range(a, b):
            self.total[s] += self.sizes[i]
        for j, value in reversed(changes):
            self.min_off[j] = value
            self.min_off_np[j] = value
        self.unplaced.add(i)
        self.unplaced_np[i] = True

    def _feasible(self, i: int, off: int) -> bool:
        cap, total, floor = self.capacity, self.total, self.floor
        if off + max(total) > cap:
            return False
        a, b = self.sec[i]
        if any(floor[s] + total[s] > cap for s in range(a, b)):
            return False
        if not self.unplaced:
            return True
        values = np.where(self.unplaced_np[self.flat], self.min_off_np[self.flat], _BIG)
        lowest = np.minimum.reduceat(values, self.flat_starts)
        lowest[~self.nonempty] = _BIG
        tot = np.asarray(total)
        eff = np.maximum(np.maximum(np.asarray(floor), lowest), off)
        return bool(((eff + tot)[tot > 0] <= cap).all())


_BIG = np.int64(1) << 62
_HEURISTICS = ("TWA", "WAT", "ATW", "TAW")


def _search_with_restarts(starts: list[int], ends: list[int], sizes: list[int], capacity: int,
                          deadline: float) -> list[int] | None:
    """MiniMalloc's round robin: each preordering (T total, W width, A area) under a node limit
    that doubles until one finds a solution or time runs out."""
    limit = max(len(starts), 1)
    while time.perf_counter() < deadline:
        limit *= 2
        for key in _HEURISTICS:
            try:
                return _Search(starts, ends, sizes, capacity, deadline, key, limit).run()
            except _NodeLimit:
                continue
            except _Timeout:
                return None
    return None


def _orders(starts: np.ndarray, ends: np.ndarray, sizes: np.ndarray) -> dict[str, np.ndarray]:
    life = ends - starts
    return {
        "size": np.lexsort((starts, -life, -sizes)),
        "lifetime": np.lexsort((starts, -sizes, -life)),
        "area": np.lexsort((starts, -sizes, -(life * sizes))),
        "start": np.lexsort((-sizes, -life, starts)),
    }


def _solve_component(starts: np.ndarray, ends: np.ndarray, sizes: np.ndarray, capacity: int | None,
                     deadline: float, rng: np.random.Generator) -> tuple[np.ndarray, str, bool]:
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
    if n <= SEARCH_LIMIT:
        # the lower bound first (tight: the pruning is strongest), then the capacity, half the time each
        targets = [lower] + ([capacity] if capacity is not None and lower < capacity < best_peak else [])
        for k, target in enumerate(targets):
            now = time.perf_counter()
            if now > deadline:
                break
            share = now + (deadline - now) / (len(targets) - k)
            found = _search_with_restarts(starts.tolist(), ends.tolist(), sizes.tolist(), target, share)
            if found is not None:
                return np.asarray(found, dtype=np.int64), "search", target == lower
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
          time_limit: float = 10.0, seed: int = 0) -> DSAResult:
    """Offsets for buffers live on ``[start, end)``; tries to fit ``capacity`` when one is given.

    Example::

        >>> solve([0, 0, 2], [2, 3, 4], [4, 4, 8]).peak
        12
    """
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
        offs, method, opt = _solve_component(s[idx], e[idx], z[idx], capacity, time.perf_counter() + share, rng)
        offsets[idx] = offs
        methods.add(method)
        optimal &= opt
    peak = int((offsets + z).max())
    lower = max((live_peak(s[c].tolist(), e[c].tolist(), z[c].tolist()) for c in
                 (nonzero[comp] for comp in comps)), default=0)
    return DSAResult(tuple(int(o) for o in offsets), peak, lower, "+".join(sorted(methods)), optimal)
