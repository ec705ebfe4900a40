"""A message alone: the most fragmented history consistent with its figures, replayed per allocator setting."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memplan.alloc.allocator import CachingAllocator, round_size
from memplan.alloc.settings import AllocatorSettings
from memplan.doctor import diagnose, parse_oom_message
from memplan.doctor.reconstruct import message_history
from memplan.doctor.replay import replay_trace
from memplan.events import ALLOC
from memplan.units import GiB, MiB

ROOT = Path(__file__).resolve().parents[2]
CORPUS = json.loads((ROOT / "tests/data/oom_messages/corpus.json").read_text())["cases"]
FRAGMENTATION = [c for c in CORPUS if c["label"] == "fragmentation"]


def _message(request: int, allocated: int, unallocated: int, free: int, total: int) -> str:
    def mib(n: int) -> str:
        return f"{n / MiB:.2f} MiB"

    return (f"CUDA out of memory. Tried to allocate {mib(request)}. GPU 0 has a total capacity of {mib(total)} of "
            f"which {mib(free)} is free. Of the allocated memory {mib(allocated)} is allocated by PyTorch, and "
            f"{mib(unallocated)} is reserved by PyTorch but unallocated.")


@pytest.mark.parametrize("case", FRAGMENTATION, ids=[c["id"] for c in FRAGMENTATION])
def test_every_fragmentation_message_gets_a_setting_whose_replay_fits(case: dict) -> None:
    report = diagnose(case["message"])
    assert report.verdict == "fragmentation"
    fitting = [f for f in report.fixes if f.kind == "allocator" and f.verified]
    assert fitting and all(f.verified_by == "reconstruction" for f in fitting)
    assert fitting[0].peak_bytes <= fitting[0].limit_bytes
    assert fitting[0].setting.startswith("PYTORCH_CUDA_ALLOC_CONF=")


@pytest.mark.parametrize("case", FRAGMENTATION, ids=[c["id"] for c in FRAGMENTATION])
def test_the_history_reproduces_the_message(case: dict) -> None:
    msg = parse_oom_message(case["message"])
    history = message_history(msg, AllocatorSettings())
    assert history is not None
    # Replayed by hand: the figures at the out-of-memory are the message's (to its printed resolution).
    alloc = CachingAllocator(AllocatorSettings(capacity=history.limit_bytes))
    live = {}
    events = history.trace.events
    for event in events[:-1]:
        if event.kind == ALLOC:
            live[event.block] = alloc.malloc(event.size)
        else:
            alloc.free(live.pop(event.block))
    assert abs(alloc.reserved - msg.reserved.bytes) <= msg.reserved.resolution_bytes + 2 * MiB
    assert abs(alloc.allocated - msg.allocated.bytes) <= msg.allocated.resolution_bytes + 512
    request = round_size(msg.requested.bytes, AllocatorSettings())
    assert max(b.size for b in alloc.free_blocks()) < request  # no cached block was large enough
    assert alloc.reserved - alloc.allocated >= request  # though the bytes were there
    assert events[-1].size == msg.requested.bytes
    with pytest.raises(Exception, match="out of memory"):
        alloc.malloc(events[-1].size)


def test_a_torch_2_0_message_is_not_offered_expandable_segments() -> None:
    # 2.0's layout: the same figures as a fragmentation case, printed the old way.
    text = ("CUDA out of memory. Tried to allocate 448.00 MiB (GPU 0; 15.77 GiB total capacity; 14.66 GiB already "
            "allocated; 289.38 MiB free; 15.13 GiB reserved in total by PyTorch)")
    report = diagnose(text)
    assert report.verdict == "fragmentation"
    assert not any("expandable" in f.setting for f in report.fixes)
    assert any(f.verified and f.verified_by == "reconstruction" and "max_split_size_mb" in f.setting
               for f in report.fixes)


def test_no_consistent_history_falls_back_to_arithmetic() -> None:
    # A request within the small pool (<= 1 MiB) is not rebuilt: the fix stays an unverified bound.
    text = _message(512 * 1024, 900 * MiB, 100 * MiB, 0, 1024 * MiB)
    report = diagnose(text)
    assert report.verdict == "fragmentation"
    allocator = [f for f in report.fixes if f.kind == "allocator"]
    assert allocator and not allocator[0].verified and allocator[0].verified_by == "arithmetic"


@settings(max_examples=60, deadline=None)
@given(request_mib=st.integers(3, 4096), allocated_mib=st.integers(64, 60_000),
       unallocated_frac=st.floats(1.05, 6.0), free_mib=st.integers(0, 2000))
def test_any_history_built_is_consistent_and_replays_to_the_out_of_memory(
        request_mib: int, allocated_mib: int, unallocated_frac: float, free_mib: int) -> None:
    request, allocated = request_mib * MiB, allocated_mib * MiB
    unallocated = int(request * unallocated_frac) // (2 * MiB) * (2 * MiB) + 2 * MiB
    free = min(free_mib * MiB, request - 2 * MiB)
    total = allocated + unallocated + free + 1 * GiB
    msg = parse_oom_message(_message(request, allocated, unallocated, free, total))
    history = message_history(msg, AllocatorSettings())
    if history is None:
        return
    result = replay_trace(history.trace, AllocatorSettings(capacity=history.limit_bytes))
    assert result.oom is not None and result.oom.event_index == len(history.trace.events) - 1
    assert history.largest_hole_bytes < round_size(request, AllocatorSettings())
    assert history.reserved_bytes - history.allocated_bytes >= request  # the bytes were there
    # Without a limit the same history never runs out, and its live bytes never exceed the message's.
    unlimited = replay_trace(history.trace, replace(AllocatorSettings(), capacity=None))
    assert unlimited.oom is None
    # (the request's block may be its whole 2 MiB-rounded segment: a remainder under 1 MiB is not split off)
    assert unlimited.peak_allocated_bytes <= history.allocated_bytes + round_size(request, AllocatorSettings()) + 2 * MiB
