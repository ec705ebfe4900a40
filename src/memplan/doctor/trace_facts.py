"""What a trace says about growth across iterations (a leak) and one-op spikes.

Two passes over the events, both linear: the first records the live bytes (requested sizes) at the
end of every iteration, where the peak is, and a timeline of at most :data:`TIMELINE_POINTS` points; the second rebuilds the live set at the peak and
finds the largest short-lived block in it. A million events take well under a second.

* **Growth**: the live bytes at the end of iteration ``i`` (the same point of every iteration),
  for the iterations after the first (which creates the optimizer states and caches). Growth is
  reported when every one of them is above the one before, by at least :data:`LEAK_MIN_BYTES`
  per iteration on average, over at least :data:`LEAK_MIN_ITERATIONS` of them. The growing
  sites are those whose blocks, allocated inside an iteration, are still live at the end of the
  trace, ranked by bytes per iteration.
* **Spike**: the largest block live at the peak that is short-lived (a ``temporary``,
  ``workspace`` or ``logits`` block; in a snapshot, whose categories are unknown, one freed soon
  after it was allocated) and at least :data:`SPIKE_SHARE` of the peak.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from memplan.events import ALLOC, AllocEvent
from memplan.units import MiB

__all__ = ["LEAK_MIN_BYTES", "LEAK_MIN_ITERATIONS", "SPIKE_SHARE", "TIMELINE_POINTS", "TraceFacts", "trace_facts"]

#: Smallest average growth per iteration reported as a leak (below it: noise of caches).
LEAK_MIN_BYTES = 1 * MiB
#: Iterations after the first that must each end with more live bytes than the one before.
LEAK_MIN_ITERATIONS = 2
#: A short-lived block at the peak is a spike when it is at least this share of the peak live bytes.
SPIKE_SHARE = 0.2
#: Without categories, a block freed within this share of the trace's events is short-lived.
SHORT_LIFETIME_SHARE = 0.05
#: Points of the live-bytes timeline (each the most live in its stretch of events, so peaks show).
TIMELINE_POINTS = 400
#: Categories that are short-lived by nature.
_SHORT_CATEGORIES = frozenset({"temporary", "workspace", "logits"})


@dataclass(frozen=True)
class TraceFacts:
    """Growth and spike facts of one trace (bytes are requested sizes, no allocator rounding)."""

    events: int
    peak_live_bytes: int
    peak_index: int
    #: (iteration, live bytes at its end), iterations >= 0 in order.
    iteration_end_live: tuple[tuple[int, int], ...]
    #: Average growth per iteration after the first, when every step grew (else 0).
    growth_per_iteration_bytes: int
    #: Sites whose blocks outlive their iteration and stay live to the end: (site, bytes per iteration).
    growing_sites: tuple[tuple[str, int], ...]
    #: The largest short-lived block at the peak: size, site, event index (0 when none).
    spike_bytes: int
    spike_site: str
    spike_index: int
    #: The live bytes over the trace, at most :data:`TIMELINE_POINTS` points: (last event index of the
    #: stretch, most live bytes in it, iteration at its end).
    live_timeline: tuple[tuple[int, int, int], ...] = ()

    @property
    def leaking(self) -> bool:
        return self.growth_per_iteration_bytes >= LEAK_MIN_BYTES

    @property
    def spiking(self) -> bool:
        return self.peak_live_bytes > 0 and self.spike_bytes >= SPIKE_SHARE * self.peak_live_bytes


def default_site(event: AllocEvent) -> str:
    """Where an allocation comes from in a memplan trace: module and op, or its category."""
    where = " ".join(p for p in (event.module, event.op) if p)
    return where or event.category


def trace_facts(events: Sequence[AllocEvent], *, site_of: Callable[[int], str] | None = None,
                categories_known: bool = True) -> TraceFacts:
    """Growth and spike facts of ``events`` (see the module docstring).

    ``site_of(position)`` names the allocation site of the alloc event at ``position`` (a
    snapshot's top user frame); by default, the event's module and op. Without known categories
    (a snapshot), a block is short-lived when it is freed within :data:`SHORT_LIFETIME_SHARE` of the
    trace's events.
    """
    live = 0
    peak, peak_index = 0, -1
    ends: list[tuple[int, int]] = []
    current = None
    width = max(1, -(-len(events) // TIMELINE_POINTS))  # events per timeline point
    timeline: list[tuple[int, int, int]] = []
    most, cut = 0, width - 1
    for position, event in enumerate(events):
        iteration = event.iteration
        if iteration != current:
            if current is not None and current >= 0:
                ends.append((current, live))
            current = iteration
        if event.kind == ALLOC:
            live += event.size
            if live > peak:
                peak, peak_index = live, position
            if live > most:  # noqa: PLR1730 - a comparison is cheaper than max() per event
                most = live
        else:
            live -= event.size
        if position == cut:
            timeline.append((position, most, iteration))
            most, cut = live, cut + width
    if current is not None and current >= 0:
        ends.append((current, live))
    if events and (not timeline or timeline[-1][0] != len(events) - 1):
        timeline.append((len(events) - 1, most, events[-1].iteration))
    name = site_of or (lambda position: default_site(events[position]))
    growth = _growth(ends)
    sites = _growing_sites(events, name, len(ends)) if growth else ()
    spike_bytes, spike_site, spike_index = _spike(events, peak_index, name, categories_known)
    return TraceFacts(events=len(events), peak_live_bytes=peak, peak_index=peak_index,
                      iteration_end_live=tuple(ends), growth_per_iteration_bytes=growth, growing_sites=sites,
                      spike_bytes=spike_bytes, spike_site=spike_site, spike_index=spike_index,
                      live_timeline=tuple(timeline))


def _growth(ends: list[tuple[int, int]]) -> int:
    """Average growth per iteration after the first when every step grew, else 0."""
    later = [live for iteration, live in ends if iteration >= 1]
    if len(later) < LEAK_MIN_ITERATIONS or any(b <= a for a, b in itertools.pairwise(later)):
        return 0
    growth = (later[-1] - later[0]) // (len(later) - 1)
    return growth if growth >= LEAK_MIN_BYTES else 0


def _growing_sites(events: Sequence[AllocEvent], name: Callable[[int], str], iterations: int) -> tuple[
        tuple[str, int], ...]:
    """Sites of blocks allocated in an iteration >= 1 and live at the end, bytes per iteration."""
    live: dict[int, tuple[int, int]] = {}
    for position, event in enumerate(events):
        if event.kind == ALLOC:
            if event.iteration >= 1:
                live[event.block] = (position, event.size)
        else:
            live.pop(event.block, None)
    by_site: dict[str, int] = {}
    for position, size in live.values():
        site = name(position)
        by_site[site] = by_site.get(site, 0) + size
    per_iteration = max(1, iterations - 1)
    ranked = sorted(((s, b // per_iteration) for s, b in by_site.items()), key=lambda item: -item[1])
    return tuple(ranked[:5])


def _spike(events: Sequence[AllocEvent], peak_index: int, name: Callable[[int], str],
           categories_known: bool) -> tuple[int, str, int]:
    """The largest short-lived block live at the peak: (bytes, site, alloc position)."""
    if peak_index < 0:
        return 0, "", -1
    live: dict[int, int] = {}
    for position in range(peak_index + 1):
        event = events[position]
        if event.kind == ALLOC:
            live[event.block] = position
        else:
            live.pop(event.block, None)
    freed_at: dict[int, int] = {}
    for position in range(peak_index + 1, len(events)):
        event = events[position]
        if event.kind != ALLOC and event.block in live and event.block not in freed_at:
            freed_at[event.block] = position
    window = max(16, int(SHORT_LIFETIME_SHARE * len(events)))
    best = (0, "", -1)
    for block, position in live.items():
        event = events[position]
        end = freed_at.get(block)
        if categories_known:
            short = event.category in _SHORT_CATEGORIES
        else:
            short = end is not None and end - position <= window
        if short and event.size > best[0]:
            best = (event.size, name(position), position)
    return best
