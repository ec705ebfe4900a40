"""The caching-allocator rules, one test each, and hypothesis invariants of the simulator."""

from __future__ import annotations

from itertools import pairwise

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from memplan.alloc.allocator import CachingAllocator, OutOfMemory, allocation_size, format_size, round_size
from memplan.alloc.settings import AllocatorSettings
from memplan.alloc.simulator import simulate
from memplan.errors import ConfigError
from memplan.events import AllocEvent, Trace
from memplan.units import MiB

DEFAULT = AllocatorSettings()


def test_round_size_and_allocation_size():
    assert round_size(1, DEFAULT) == 512
    assert round_size(513, DEFAULT) == 1024
    assert allocation_size(512) == 2 * MiB
    assert allocation_size(MiB + 512) == 20 * MiB
    assert allocation_size(10 * MiB) == 10 * MiB
    assert allocation_size(11 * MiB + 1) == 12 * MiB


def test_roundup_power2_divisions():
    s = AllocatorSettings.parse("roundup_power2_divisions:4")
    assert round_size(1200 * 1024, s) == 1280 * 1024  # 1200 KiB -> 1.25 MiB, the docstring's example
    assert round_size(2 * MiB, s) == 2 * MiB
    listed = AllocatorSettings.parse("roundup_power2_divisions:[256:1,512:2,>:8]")
    assert listed.divisions_for(300 * MiB) == 1 and listed.divisions_for(600 * MiB) == 2
    assert listed.divisions_for(4096 * MiB) == 8


@pytest.mark.parametrize("conf", ["max_split_size_mb:20", "garbage_collection_threshold:1.5",
                                  "expandable_segments:maybe", "roundup_power2_divisions:3", "nonsense:1"])
def test_bad_alloc_conf(conf):
    with pytest.raises(ConfigError):
        AllocatorSettings.parse(conf)


def test_small_requests_share_a_2mib_segment_and_split():
    alloc = CachingAllocator(DEFAULT)
    a, b = alloc.malloc(1000), alloc.malloc(1000)
    assert alloc.reserved == 2 * MiB and b.address == a.address + 1024


def test_large_pool_split_rule_keeps_remainders_of_1mib_or_less():
    alloc = CachingAllocator(DEFAULT)
    block = alloc.malloc(19 * MiB + 512)  # remainder 0.5 MiB <= kSmallSize: not split
    assert block.size == 20 * MiB
    alloc.free(block)
    small = alloc.malloc(2 * MiB)  # remainder 18 MiB > 1 MiB: split
    assert small.size == 2 * MiB and alloc.reserved == 20 * MiB


def test_best_fit_prefers_smallest_then_lowest_address():
    alloc = CachingAllocator(DEFAULT)
    big = [alloc.malloc(s * MiB) for s in (30, 12, 12)]
    for b in big:
        alloc.free(b)
    chosen = alloc.malloc(11 * MiB)
    assert chosen.size == 12 * MiB and chosen.address == big[1].address


def test_free_coalesces_neighbours():
    alloc = CachingAllocator(DEFAULT)
    blocks = [alloc.malloc(2 * MiB) for _ in range(3)]
    for b in blocks:
        alloc.free(b)
    assert len(alloc.large_pool.keys) == 1 and alloc.free_blocks()[0].size == 20 * MiB


def test_max_split_size_oversize_rules():
    s = AllocatorSettings.parse("max_split_size_mb:100")
    alloc = CachingAllocator(s)
    big = alloc.malloc(200 * MiB)
    alloc.free(big)
    small = alloc.malloc(50 * MiB)  # may not take the oversize block: new segment
    assert small.address != big.address and alloc.reserved == 250 * MiB
    near = alloc.malloc(190 * MiB)  # within kLargeBuffer of 200 MiB: reuses it, unsplit
    assert near.address == big.address and near.size == 200 * MiB


def test_streams_do_not_share_cached_blocks():
    alloc = CachingAllocator(DEFAULT)
    alloc.free(alloc.malloc(4 * MiB, stream=0))
    alloc.malloc(4 * MiB, stream=1)
    assert alloc.reserved == 40 * MiB


def test_capacity_frees_cache_and_retries_then_ooms_with_pytorch_message():
    alloc = CachingAllocator(AllocatorSettings(capacity=64 * MiB))
    alloc.free(alloc.malloc(40 * MiB))
    kept = alloc.malloc(30 * MiB)  # fits in the cached 40 MiB segment
    assert alloc.reserved == 40 * MiB and kept.size == 30 * MiB
    with pytest.raises(OutOfMemory) as info:
        alloc.malloc(30 * MiB)
    assert str(info.value).startswith("CUDA out of memory. Tried to allocate 30.00 MiB. GPU 0 has a total "
                                      "capacity of 64.00 MiB of which 24.00 MiB is free.")
    assert "reserved by PyTorch but unallocated" in str(info.value)


def test_release_cached_blocks_lets_a_large_request_fit():
    alloc = CachingAllocator(AllocatorSettings(capacity=64 * MiB))
    alloc.free(alloc.malloc(40 * MiB))
    alloc.malloc(50 * MiB)  # 40 + 50 > 64: free the cached segment and retry
    assert alloc.reserved == 50 * MiB and alloc.num_alloc_retries == 1


def test_expandable_segments_map_pages_and_grow_one_segment():
    alloc = CachingAllocator(AllocatorSettings(expandable_segments=True))
    a = alloc.malloc(30 * MiB)
    b = alloc.malloc(30 * MiB)
    assert b.address == a.address + 30 * MiB  # one contiguous segment
    assert alloc.reserved == 60 * MiB  # three 20 MiB pages
    alloc.free(a)
    alloc.free(b)
    alloc.empty_cache()
    assert alloc.reserved == 0


def test_format_size():
    assert format_size(1024) == "1024 bytes" and format_size(1536) == "1.50 KiB"
    assert format_size(20 * MiB) == "20.00 MiB" and format_size(3 * 2**30) == "3.00 GiB"


def test_garbage_collection_releases_old_blocks():
    s = AllocatorSettings.parse("garbage_collection_threshold:0.5", capacity=100 * MiB)
    alloc = CachingAllocator(s)
    alloc.free(alloc.malloc(40 * MiB))
    alloc.malloc(30 * MiB + 1)  # reuses the 40 MiB block (no GC needed)
    alloc.malloc(20 * MiB)  # new segment: reserved 40 > 50? no -> no GC
    assert alloc.reserved == 60 * MiB


# ----------------------------------------------------------------------------------------------
# invariants

sizes = st.one_of(st.integers(1, 4096), st.integers(4096, 2 * MiB), st.integers(2 * MiB, 64 * MiB))
ops = st.lists(st.tuples(st.booleans(), sizes, st.integers(0, 1), st.integers(0, 10**6)), min_size=1, max_size=80)


def _run(ops_list, settings):
    alloc = CachingAllocator(settings)
    live = []
    for is_alloc, size, stream, pick in ops_list:
        if is_alloc or not live:
            live.append(alloc.malloc(size, stream))
        else:
            alloc.free(live.pop(pick % len(live)))
        _check(alloc, live)
    return alloc, live


def _check(alloc, live):
    alloc.check_free_pool_keys()
    assert alloc.allocated == sum(b.size for b in live) <= alloc.reserved
    everything = sorted([*live, *alloc.free_blocks()], key=lambda b: b.address)
    for a, b in pairwise(everything):
        assert a.address + a.size <= b.address  # no overlap
    for b in everything:
        seg = b.segment
        assert seg.address <= b.address and b.address + b.size <= seg.address + seg.size
    if not alloc.settings.expandable_segments:
        assert alloc.reserved == sum(s.size for s in alloc.segments.values())
        covered = {}
        for b in everything:
            covered[b.segment.address] = covered.get(b.segment.address, 0) + b.size
        assert covered == {a: s.size for a, s in alloc.segments.items()}  # segments fully tiled
    else:
        assert alloc.reserved == sum(b.size for b in everything)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops, st.sampled_from(["", "max_split_size_mb:40", "expandable_segments:True", "roundup_power2_divisions:4"]))
def test_simulator_invariants(ops_list, conf):
    alloc, live = _run(ops_list, AllocatorSettings.parse(conf))
    for block in live:  # every freed byte is reusable: after freeing all, all cached memory is free
        alloc.free(block)
    _check(alloc, [])
    assert alloc.allocated == 0
    alloc.empty_cache()
    assert alloc.reserved == 0


def test_simulate_reports_peaks_and_timeline():
    ev = (AllocEvent(0, "alloc", 1, 3_000_000), AllocEvent(1, "alloc", 2, 100),
          AllocEvent(2, "free", 1, 3_000_000), AllocEvent(3, "free", 2, 100))
    result = simulate(Trace(events=ev))
    assert result.peak_reserved_bytes == 22 * MiB
    assert list(result.reserved_timeline) == [20 * MiB, 22 * MiB, 22 * MiB, 22 * MiB]
    assert result.fragmentation == pytest.approx(1 - (3_000_320 + 512) / (22 * MiB))
    assert result.to_dict()["peak_reserved_bytes"] == 22 * MiB
