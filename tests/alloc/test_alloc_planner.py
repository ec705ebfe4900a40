"""DSA solver, planner and MiniMalloc CSV: validity (hypothesis), reference instances, bad input."""

from __future__ import annotations

import pytest
from alloc_reference import MINIMALLOC
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from memplan.alloc import dsa
from memplan.alloc.minimalloc import read_minimalloc_csv, write_minimalloc_csv
from memplan.alloc.planner import DYNAMIC, PERIODIC, PERSISTENT, plan_trace
from memplan.errors import ConfigError
from memplan.events import AllocEvent, Trace

buffers = st.lists(st.tuples(st.integers(0, 50), st.integers(1, 20), st.integers(0, 5000)), min_size=1, max_size=40)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(buffers)
def test_dsa_never_overlaps_and_respects_the_lower_bound(rows):
    starts = [s for s, _, _ in rows]
    ends = [s + d for s, d, _ in rows]
    sizes = [z for _, _, z in rows]
    result = dsa.solve(starts, ends, sizes, time_limit=0.2)
    assert dsa.validate(starts, ends, sizes, result.offsets)
    assert result.peak >= dsa.live_peak(starts, ends, sizes) == result.lower_bound or not any(sizes)


def _trace(rows, iterations=1):
    """Build a trace from (size, lifetime) rows repeated each iteration; block ids unique."""
    events, pending, block, index = [], [], 0, 0
    for it in range(iterations):
        for size, life in rows:
            events.append(AllocEvent(index, "alloc", block, size, "activation", "forward", it))
            pending.append((index + life, block, size, it))
            block += 1
            index += 1
            for due in sorted(p for p in pending if p[0] <= index):
                pending.remove(due)
                events.append(AllocEvent(index, "free", due[1], due[2], "activation", "forward", it))
                index += 1
        for due in sorted(pending):
            events.append(AllocEvent(index, "free", due[1], due[2], "activation", "forward", it))
            index += 1
        pending.clear()
    return Trace(events=tuple(events))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(1, 10**6), st.integers(1, 6)), min_size=1, max_size=30), st.integers(1, 3))
def test_plan_is_valid_and_inside_the_pool(rows, iterations):
    trace = _trace(rows, iterations)
    plan = plan_trace(trace, time_limit=0.5)
    ends = {}
    for position, e in enumerate(trace.events):
        if e.kind == "free":
            ends[e.block] = position
    starts = list(plan.alloc_events)
    stops = [ends[b] for b in plan.blocks]
    assert dsa.validate(starts, stops, plan.sizes, plan.offsets, plan.pool_bytes)
    assert plan.pool_bytes >= plan.lower_bound_bytes
    assert all(o % plan.alignment == 0 for o in plan.offsets)


def test_classification():
    ev = [AllocEvent(0, "alloc", 0, 1024, "parameter", "setup", -1)]
    ev += [AllocEvent(1, "alloc", 1, 4096, "activation", "forward", 0), AllocEvent(2, "free", 1, 4096, "activation", "forward", 0)]
    ev += [AllocEvent(3, "alloc", 2, 4096, "activation", "forward", 1), AllocEvent(4, "free", 2, 4096, "activation", "forward", 1)]
    ev += [AllocEvent(5, "alloc", 3, 777, "temporary", "forward", 1), AllocEvent(6, "free", 3, 777, "temporary", "forward", 1)]
    plan = plan_trace(Trace(events=tuple(ev)))
    assert plan.classes == (PERSISTENT, PERIODIC, PERIODIC, DYNAMIC)
    assert plan.counts == {PERSISTENT: 1, PERIODIC: 2, DYNAMIC: 1}


def test_capacity_below_lower_bound_names_the_numbers():
    trace = _trace([(10_000, 2), (20_000, 2)])
    with pytest.raises(ConfigError, match=str(trace.peak_live_bytes)):
        plan_trace(trace, capacity=1000)


@pytest.mark.parametrize("path", MINIMALLOC[:3], ids=lambda p: p.name)
def test_minimalloc_placement_is_valid(path, tmp_path):
    rows = read_minimalloc_csv(path)
    starts, ends, sizes = [b.start for b in rows], [b.end for b in rows], [b.size for b in rows]
    result = dsa.solve(starts, ends, sizes, capacity=1_048_576, time_limit=0.5)
    assert dsa.validate(starts, ends, sizes, result.offsets)
    out = tmp_path / "out.csv"
    write_minimalloc_csv(out, rows, result.offsets)
    again = read_minimalloc_csv(out)
    assert [b.offset for b in again] == list(result.offsets)


@pytest.mark.parametrize("name", ["C.1048576.csv", "H.1048576.csv"])
def test_minimalloc_search_packs_these_at_the_capacity(name):
    """The MiniMalloc-style search packs C and H (H: zero slack) within 1,048,576 bytes."""
    path = next((p for p in MINIMALLOC if p.name == name), None)
    if path is None:
        pytest.skip("instance not present")
    rows = read_minimalloc_csv(path)
    starts, ends, sizes = [b.start for b in rows], [b.end for b in rows], [b.size for b in rows]
    result = dsa.solve(starts, ends, sizes, capacity=1_048_576, time_limit=8)
    assert result.peak <= 1_048_576
    assert dsa.validate(starts, ends, sizes, result.offsets, 1_048_576)


@pytest.mark.parametrize(("body", "message"), [
    ("id,lower,upper,size\n0,0,10,5\n0,2,4,5\n", "line 3 id"),
    ("id,lower,upper,size\n0,0,10,-5\n", "line 2 size"),
    ("id,lower,upper,size\n0,10,10,5\n", "line 2 upper"),
    ("id,lower,upper,size\n0,10,x,5\n", "integers"),
    ("a,b\n", "header"),
])
def test_bad_csv(tmp_path, body, message):
    path = tmp_path / "bad.csv"
    path.write_text(body)
    with pytest.raises(ConfigError, match=message):
        read_minimalloc_csv(path)
