"""The C replay core (``memplan.alloc._replay_core``) gives what the pure-Python allocator model gives."""

from __future__ import annotations

import random
from dataclasses import asdict

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from memplan.alloc.constants import NO_MAX_SPLIT, ROUNDUP_INTERVALS
from memplan.alloc.schedule import alloc_op, free_op, repeat_copies, replay_schedule
from memplan.alloc.settings import AllocatorSettings
from memplan.doctor import diagnose, replay
from memplan.doctor.replay import replay_native, replay_trace, trace_shape
from memplan.events import AllocEvent, Trace
from memplan.units import MiB

needs_native = pytest.mark.skipif(not replay.HAS_NATIVE, reason="C extension _replay_core not built")

#: Request sizes around every boundary of the rules: 512-byte rounding, the 1 MiB small pool, the
#: 10 MiB large-allocation limit, 2 MiB / 20 MiB pages, and large blocks that max_split_size splits or not.
_SIZES = st.one_of(
    st.integers(0, 4096),
    st.integers(4096, 2 * MiB),
    st.integers(MiB, 24 * MiB),
    st.integers(20 * MiB, 400 * MiB),
    st.sampled_from([512, MiB, MiB + 1, 2 * MiB, 10 * MiB - 1, 10 * MiB, 20 * MiB, 64 * MiB, 128 * MiB]),
)


@st.composite
def _traces(draw: st.DrawFn) -> Trace:
    """Random allocations and frees of live blocks on up to three streams, iterations that do not repeat."""
    rng = random.Random(draw(st.integers(0, 2**32)))
    sizes = draw(st.lists(_SIZES, min_size=1, max_size=120))
    streams = draw(st.integers(1, 3))
    free_share = draw(st.floats(0.2, 0.7))
    events: list[AllocEvent] = []
    live: list[tuple[int, int, int]] = []
    for block, size in enumerate(sizes, start=1):
        while live and rng.random() < free_share:
            freed = live.pop(rng.randrange(len(live)))
            events.append(AllocEvent(len(events), "free", freed[0], freed[1], iteration=len(events) // 7,
                                     stream=freed[2]))
        stream = rng.randrange(streams)
        events.append(AllocEvent(len(events), "alloc", block, size, iteration=len(events) // 7, stream=stream))
        live.append((block, size, stream))
    return Trace(events=tuple(events))


@st.composite
def _settings(draw: st.DrawFn) -> AllocatorSettings:
    max_split = draw(st.one_of(st.just(NO_MAX_SPLIT), st.integers(21, 300).map(lambda mb: mb * MiB)))
    divisions = draw(st.one_of(st.just((0,) * ROUNDUP_INTERVALS), st.sampled_from([2, 4, 8]).map(
        lambda d: (d,) * ROUNDUP_INTERVALS), st.lists(st.sampled_from([0, 1, 2, 4, 8, 16]), min_size=ROUNDUP_INTERVALS,
                                                      max_size=ROUNDUP_INTERVALS).map(tuple)))
    gc = draw(st.one_of(st.just(0.0), st.floats(0.3, 0.95)))
    capacity = draw(st.one_of(st.none(), st.integers(24, 1500).map(lambda mb: mb * MiB)))
    return AllocatorSettings(max_split_size=max_split, roundup_power2_divisions=divisions,
                             garbage_collection_threshold=gc, expandable_segments=draw(st.booleans()),
                             capacity=capacity)


@needs_native
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(trace=_traces(), alloc_settings=_settings())
def test_native_replay_equals_python(trace: Trace, alloc_settings: AllocatorSettings) -> None:
    assert not trace_shape(trace.events).has_repeating_tail
    python = replay_trace(trace, alloc_settings, engine="python")
    native = replay_native(trace, alloc_settings)
    assert native == python  # every field: peaks, end state, largest free block, OOM event, sizes and message


@st.composite
def _repeating_traces(draw: st.DrawFn) -> Trace:
    """Iterations made of a few bodies (so some repeat the one before), blocks kept across iterations,
    ids reused after their free, frees of blocks never allocated, iteration numbers that come back."""
    rng = random.Random(draw(st.integers(0, 2**32)))
    bodies = [[(rng.random() < 0.6, rng.choice([512, 3 * MiB, 25 * MiB]), rng.randrange(2)) for _ in range(rng.randrange(1, 8))]
              for _ in range(draw(st.integers(1, 3)))]
    events: list[AllocEvent] = []
    live: list[int] = []
    next_id = 0
    for it in draw(st.lists(st.integers(-1, 4), min_size=1, max_size=12)):
        for is_alloc, size, stream in bodies[it % len(bodies)]:
            if is_alloc or not live:
                next_id = next_id + 1 if rng.random() < 0.8 else 0  # an id used again
                live.append(next_id)
                events.append(AllocEvent(len(events), "alloc", next_id, size, iteration=it, stream=stream))
            else:
                block = live.pop(0) if rng.random() < 0.9 else 10**6  # 10**6: never allocated
                events.append(AllocEvent(len(events), "free", block, size, iteration=it, stream=stream))
    return Trace(events=tuple(events))


@needs_native
@settings(max_examples=300, deadline=None)
@given(trace=_repeating_traces())
def test_native_shape_equals_python(trace: Trace) -> None:
    assert trace_shape(trace.events) == trace_shape(trace.events, engine="python")


@needs_native
def test_native_replay_meets_every_rule() -> None:
    """The random traces above reach out-of-memory and release-and-retry at each kind of setting."""
    rng = random.Random(3)
    events: list[AllocEvent] = []
    live: list[tuple[int, int]] = []
    for block in range(1, 3000):
        while live and rng.random() < 0.5:
            freed = live.pop(rng.randrange(len(live)))
            events.append(AllocEvent(len(events), "free", freed[0], freed[1], iteration=len(events)))
        size = rng.choice([rng.randrange(1, MiB), rng.randrange(MiB, 12 * MiB), rng.randrange(12 * MiB, 90 * MiB)])
        events.append(AllocEvent(len(events), "alloc", block, size, iteration=len(events)))
        live.append((block, size))
    trace = Trace(events=tuple(events))
    ooms = 0
    for options in ({}, {"expandable_segments": True}, {"max_split_size": 40 * MiB},
                    {"garbage_collection_threshold": 0.6}, {"roundup_power2_divisions": (4,) * ROUNDUP_INTERVALS}):
        for capacity in (None, 600 * MiB, 900 * MiB, 1400 * MiB):
            one = AllocatorSettings(capacity=capacity, **options)
            native = replay_native(trace, one)
            assert native == replay_trace(trace, one, engine="python")
            ooms += native.oom is not None
    assert ooms > 0


@needs_native
def test_native_replay_with_many_live_blocks_and_any_64_bit_ids() -> None:
    """Thousands of blocks live at once under random 64-bit ids (negative ones too), freed in random order."""
    rng = random.Random(11)
    ids = list({rng.randrange(-(2**63), 2**63) for _ in range(6000)})
    events = [AllocEvent(i, "alloc", block, rng.randrange(1, 3 * MiB)) for i, block in enumerate(ids)]
    rng.shuffle(ids)
    events += [AllocEvent(len(events) + i, "free", block, 0) for i, block in enumerate(ids[:5000])]
    trace = Trace(events=tuple(events))
    for one in (AllocatorSettings(), AllocatorSettings(expandable_segments=True)):
        native = replay_native(trace, one)
        assert native is not None and native == replay_trace(trace, one, engine="python")


@needs_native
@pytest.mark.parametrize("events", [
    (AllocEvent(0, "alloc", 1, 2 * MiB), AllocEvent(1, "free", 2, 2 * MiB)),  # a free of a block never allocated
    (AllocEvent(0, "alloc", 1, 2**60),),  # a size beyond what the C core handles
    (AllocEvent(0, "alloc", 2**70, MiB),),  # a block id beyond 64 bits
])
def test_native_replay_declines_what_it_does_not_handle(events: tuple[AllocEvent, ...]) -> None:
    assert replay_native(Trace(events=events), AllocatorSettings()) is None


@needs_native
def test_native_shape_declines_iterations_beyond_64_bits() -> None:
    """The shape of such a trace is the pure-Python one (the C core declines it)."""
    events = (AllocEvent(0, "alloc", 1, MiB, iteration=2**70), AllocEvent(1, "free", 1, MiB, iteration=2**70))
    assert replay._native.shape(events, "alloc") is None
    assert trace_shape(events) == trace_shape(events, engine="python")


def test_pure_python_environment_and_fallback_give_the_same_diagnosis(monkeypatch: pytest.MonkeyPatch) -> None:
    """A non-repeating trace at a capacity just above its peak allocated: the doctor's whole answer is the same
    with the C core (when built) and in pure Python (the environment switch, or no C core at all)."""
    rng = random.Random(5)
    events: list[AllocEvent] = []
    saved: list[tuple[int, int]] = []
    block = 0
    for it in range(6):
        for k in range(20):
            block += 1
            size = rng.randrange(3, 60) * MiB + 4096 * k
            events.append(AllocEvent(len(events), "alloc", block, size, "activation", "forward", it))
            saved.append((block, size))
            block += 1
            events.append(AllocEvent(len(events), "alloc", block, rng.randrange(1, 30) * MiB, "temporary", "forward", it))
            events.append(AllocEvent(len(events), "free", block, events[-1].size, "temporary", "forward", it))
        while saved:
            freed = saved.pop()
            events.append(AllocEvent(len(events), "free", freed[0], freed[1], "activation", "backward", it))
    trace = Trace(events=tuple(events))
    full = replay_trace(trace, AllocatorSettings(), engine="python")
    capacity = full.peak_allocated_bytes + (full.peak_reserved_bytes - full.peak_allocated_bytes) * 3 // 10
    auto = asdict(diagnose(trace=trace, capacity_bytes=capacity))
    monkeypatch.setenv(replay.PURE_PYTHON_ENV, "1")
    pure = asdict(diagnose(trace=trace, capacity_bytes=capacity))
    monkeypatch.delenv(replay.PURE_PYTHON_ENV)
    monkeypatch.setattr(replay, "_native", None)
    without = asdict(diagnose(trace=trace, capacity_bytes=capacity))
    assert auto == pure == without
    assert auto["verdict"] == "fragmentation" and any(f["verified"] for f in auto["fixes"])


def _schedule_ops(trace: Trace) -> list[int]:
    """The trace as a schedule of plain ints (:mod:`memplan.alloc.schedule`)."""
    where: dict[int, int] = {}
    ops: list[int] = []
    for event in trace.events:
        if event.kind == "alloc":
            where[event.block] = len(ops)
            ops.append(alloc_op(event.size, event.stream))
        else:
            ops.append(free_op(where.pop(event.block)))
    return ops


@needs_native
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(trace=_traces(), alloc_settings=_settings())
def test_native_schedule_equals_python_and_the_trace_replay(trace: Trace, alloc_settings: AllocatorSettings) -> None:
    """The C core's ``schedule`` entry (the estimator's reserved-memory schedule) gives what the pure-Python
    schedule replay gives, and both what the trace replay gives for the same events."""
    ops = _schedule_ops(trace)
    python = replay_schedule(ops, alloc_settings, engine="python")
    assert replay_schedule(ops, alloc_settings) == python
    traced = replay_trace(trace, alloc_settings, engine="python")
    assert (python.peak_reserved_bytes, python.peak_allocated_bytes) == (traced.peak_reserved_bytes,
                                                                         traced.peak_allocated_bytes)
    assert python.oom_at == (None if traced.oom is None else traced.oom.event_index)  # one op per event
    if traced.oom is None:
        assert (python.reserved_bytes, python.allocated_bytes) == (traced.reserved_bytes, traced.allocated_bytes)


def test_schedule_rejects_a_free_of_no_live_allocation() -> None:
    with pytest.raises(ValueError, match="op 2 frees position 0"):
        replay_schedule([alloc_op(1024), free_op(0), free_op(0)], AllocatorSettings())
    with pytest.raises(ValueError, match="op 0 frees position 3"):
        replay_schedule([free_op(3)], AllocatorSettings())


@st.composite
def _stretches(draw: st.DrawFn) -> tuple[object, ...]:
    """A schedule, a recorded stretch of it (its own frees and frees of earlier blocks) and sides to copy it for."""
    before = draw(st.lists(st.integers(0, 2**40), min_size=1, max_size=12))
    ops = [alloc_op(size, draw(st.integers(0, 3))) for size in before]
    outside = draw(st.lists(st.one_of(st.none(), st.integers(0, len(ops) - 1)), max_size=4))
    start = len(ops)
    template: list[int] = []
    outside_at: list[int] = []
    for _ in range(draw(st.integers(0, 10))):
        own = [at for at, op in enumerate(template) if op >= 0]
        choice = draw(st.integers(0, 2))
        if choice == 1 and own:
            template.append(free_op(start + draw(st.sampled_from(own))))
        elif choice == 2 and any(b is not None for b in outside):
            index = draw(st.sampled_from([i for i, b in enumerate(outside) if b is not None]))
            outside_at += [len(template), index]
            template.append(free_op(outside[index]))  # type: ignore[arg-type]
        else:
            template.append(alloc_op(draw(st.integers(0, 2**40))))
    made = [start + at for at, op in enumerate(template) if op >= 0]
    result = [draw(st.lists(st.one_of(st.none(), st.sampled_from(made)) if made else st.none(), max_size=3))
              for _ in range(draw(st.integers(0, 3)))]
    ops += template
    sizes = tuple(-1 if b is None else ops[b] for b in outside)
    sides = [list(outside) if draw(st.booleans()) else
             [None if b is None else draw(st.integers(0, len(ops) - 1)) for b in outside]
             for _ in range(draw(st.integers(0, 4)))]
    return ops, template, outside_at, sides, sizes, result, len(ops) - start


@needs_native
@settings(max_examples=300, deadline=None)
@given(case=_stretches())
def test_native_repeat_copies_equals_python(case: tuple[object, ...]) -> None:
    """``repeat_copies`` (Replay.repeat_run's copies) appends the same ops and returns the same blocks in the C
    core as in Python, and declines (None, the schedule unchanged) the same sides."""
    ops, *rest = case
    native, python = list(ops), list(ops)  # type: ignore[call-overload]
    got = repeat_copies(native, *rest, engine="auto")  # type: ignore[arg-type]
    want = repeat_copies(python, *rest, engine="python")  # type: ignore[arg-type]
    assert got == want and native == python
    if want is None:
        assert native == ops
