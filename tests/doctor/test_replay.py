"""The doctor's replay stops once iterations repeat: it must give what a full simulation gives."""

from __future__ import annotations

import random

import pytest

from memplan.alloc.settings import AllocatorSettings
from memplan.alloc.simulator import simulate
from memplan.doctor.replay import replay_trace, trace_shape
from memplan.events import AllocEvent, Trace
from memplan.units import MiB


def _step_trace(iterations: int, *, vary: bool, seed: int = 0) -> Trace:
    """Setup weights, then iterations of saved activations, temporaries and a gradient carried over."""
    rng = random.Random(seed)
    events: list[AllocEvent] = []
    block = 0

    def alloc(size: int, it: int) -> tuple[int, int, int]:
        nonlocal block
        block += 1
        events.append(AllocEvent(len(events), "alloc", block, size, "activation", "forward", it))
        return block, size, it

    def free(b: tuple[int, int, int]) -> None:
        events.append(AllocEvent(len(events), "free", b[0], b[1], "activation", "forward", b[2]))

    for layer in range(6):
        alloc((layer + 3) * MiB, -1)
    carried = None
    for it in range(iterations):
        saved = [alloc((k % 4 + 1) * 3 * MiB + 512 * k, it) for k in range(12)]
        for k in range(30):
            free(alloc(rng.randrange(1, 40) * MiB if vary and k == 7 else (k % 5 + 1) * 700 * 1024, it))
        for b in reversed(saved):
            free(b)
        if carried is not None:
            events.append(AllocEvent(len(events), "free", carried[0], carried[1], "activation", "forward", it))
        carried = alloc(25 * MiB, it)
    return Trace(events=tuple(events))


SETTINGS = [AllocatorSettings(), AllocatorSettings(expandable_segments=True),
            AllocatorSettings(max_split_size=128 * MiB), AllocatorSettings(roundup_power2_divisions=(4,) * 16),
            AllocatorSettings(garbage_collection_threshold=0.7, capacity=300 * MiB)]


@pytest.mark.parametrize("vary", [False, True])
@pytest.mark.parametrize("settings", SETTINGS, ids=["default", "expandable", "max_split", "roundup", "gc"])
def test_replay_equals_full_simulation(vary: bool, settings: AllocatorSettings) -> None:
    trace = _step_trace(40, vary=vary)
    full = simulate(trace, settings)
    fast = replay_trace(trace, settings)
    assert (fast.peak_reserved_bytes, fast.peak_allocated_bytes) == (full.peak_reserved_bytes, full.peak_allocated_bytes)
    assert (fast.oom is None) == (full.oom is None)
    if vary:
        assert fast.repeated_from is None and fast.events_replayed == len(trace)
    elif settings.garbage_collection_threshold == 0:  # with GC, cached blocks age: states never repeat
        assert fast.repeated_from is not None and fast.events_replayed < len(trace) // 4


def test_replay_finds_the_same_out_of_memory() -> None:
    trace = _step_trace(40, vary=False)
    full = simulate(trace)
    capacity = (full.peak_reserved_bytes + full.peak_allocated_bytes) // 2
    a = simulate(trace, AllocatorSettings(capacity=capacity))
    b = replay_trace(trace, AllocatorSettings(capacity=capacity))
    assert a.oom is not None and b.oom is not None and a.oom.event_index == b.oom.event_index


def test_shape_marks_repeating_iterations() -> None:
    shape = trace_shape(_step_trace(5, vary=False).events)
    assert len(shape.run_starts) == 6  # setup + 5 iterations
    # Iteration 0 frees no carried gradient; iteration 1 allocates it one position later than 0 did.
    assert shape.same_as_previous == (False, False, False, False, True, True)
