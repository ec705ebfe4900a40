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


def _all_candidates_replayed(trace: Trace, capacity: int) -> list[tuple[str, bool, int | None, int | None]]:
    """The allocator fixes with every candidate and the unlimited base replayed (no replay skipped)."""
    from dataclasses import replace

    from memplan.doctor.alloc_fixes import _candidates, conf_string

    base = AllocatorSettings()
    base_peak = replay_trace(trace, base).peak_reserved_bytes
    rows = []
    for _, candidate in _candidates(base):
        result = replay_trace(trace, replace(candidate, capacity=capacity))
        fits = result.oom is None
        peak = result.peak_reserved_bytes if fits else None
        rows.append((f"PYTORCH_CUDA_ALLOC_CONF={conf_string(candidate)}", fits, peak,
                     None if peak is None else base_peak - peak))
    splits = [r for r in rows if "max_split_size_mb" in r[0]]
    keep = next((r for r in splits if r[1]), splits[-1])
    return [r for r in rows if r not in splits or r is keep]


@pytest.mark.parametrize("where", [0.5, 0.9, 0.1])  # 0.1: no candidate fits, the base is never replayed
def test_skipped_replays_do_not_change_the_fixes(where: float) -> None:
    from memplan.doctor.alloc_fixes import _replayed

    trace = _step_trace(12, vary=True, seed=3)
    full = simulate(trace)
    capacity = int(full.peak_allocated_bytes + where * (full.peak_reserved_bytes - full.peak_allocated_bytes))
    fixes = _replayed(trace, trace_shape(trace.events), AllocatorSettings(), capacity)
    expected = _all_candidates_replayed(trace, capacity)
    assert [(f.setting, f.verified, f.peak_bytes, f.saves_bytes) for f in fixes] == expected
    assert any(r[1] for r in expected) == (where > 0.1) and any("max_split" in r[0] for r in expected)


def test_skipped_replays_with_a_fitting_split_value() -> None:
    """A cached 1 GiB block split by a 100 MiB request, then 1 GiB more on 1.4 GiB: every split value fits."""
    from memplan.doctor.alloc_fixes import _replayed

    gib = 1024 * MiB
    trace = Trace(events=(AllocEvent(0, "alloc", 1, gib), AllocEvent(1, "free", 1, gib),
                          AllocEvent(2, "alloc", 2, 100 * MiB), AllocEvent(3, "alloc", 3, gib)))
    capacity = gib + 400 * MiB
    fixes = _replayed(trace, trace_shape(trace.events), AllocatorSettings(), capacity)
    expected = _all_candidates_replayed(trace, capacity)
    assert [(f.setting, f.verified, f.peak_bytes, f.saves_bytes) for f in fixes] == expected
    assert any("max_split_size_mb:512" in r[0] and r[1] for r in expected)  # the first split value fits


def _shape_by_events(events: tuple[AllocEvent, ...]) -> tuple[tuple[int, ...], tuple[bool, ...]]:
    """The module docstring's definition, event by event: the reference for ``trace_shape``'s columns."""
    starts, same, where = [], [], {}
    runs: list[list[tuple[int, ...]]] = []
    for position, event in enumerate(events):
        if not starts or event.iteration != events[position - 1].iteration:
            starts.append(position)
            runs.append([])
        run, offset = len(starts) - 1, position - starts[-1]
        if event.kind == "alloc":
            where[event.block] = (run, offset)
            runs[-1].append((1, event.size, event.stream))
        else:
            alloc_run, alloc_offset = where.pop(event.block, (-1, -1))
            runs[-1].append((0, run - alloc_run, alloc_offset, event.stream))
    same = [r > 0 and runs[r] == runs[r - 1] for r in range(len(runs))]
    return tuple(starts), tuple(same)


@pytest.mark.parametrize("seed", range(6))
def test_shape_by_columns_equals_the_definition(seed: int) -> None:
    rng = random.Random(seed)
    base = _step_trace(8, vary=seed % 2 == 1, seed=seed).events
    # Streams, a repeated iteration value after another, and a free of a block never allocated.
    events = tuple(e._replace(stream=rng.choice((0, 0, 1)) if seed > 2 else 0,
                              iteration=e.iteration if seed != 4 else e.iteration % 3) for e in base)
    events += (AllocEvent(len(events), "free", 10**9, 8, iteration=99),)
    shape = trace_shape(events)
    assert (shape.run_starts, shape.same_as_previous) == _shape_by_events(events)
    assert trace_shape(()).run_starts == () and trace_shape(()).same_as_previous == ()
