"""The runtime's C core driven directly (virtual addresses, a stub CUDA runtime): matcher, fallback, streams."""

from __future__ import annotations

import ctypes

import pytest
from runtime_helpers import build_stub, core_or_skip

from memplan.alloc.runtime import RuntimeSettings, RuntimeUnavailable
from memplan.alloc.runtime._native import NO_SLOT, Core
from memplan.alloc.runtime.plans import plan_recording
from memplan.alloc.runtime.session import Arena

MiB = 1 << 20


@pytest.fixture(autouse=True)
def _core():
    core_or_skip()


def _iteration(core: Core, sizes: list[int], stream: int = 0) -> list[int]:
    """A step shaped like a forward/backward: allocate all, free in reverse."""
    addrs = [core.malloc(z, stream) for z in sizes]
    for a in reversed(addrs):
        assert core.free(a)
    return addrs


def _arena(**kw) -> tuple[Core, Arena]:
    settings = RuntimeSettings(device="virtual", **{"warmup_steps": 0, **kw})
    core = Core("virtual", alignment=512, arena_limit=settings.arena_limit_bytes)
    arena = Arena(core, settings)
    arena.begin()
    return core, arena


def test_record_plan_replay_serves_every_request_from_the_arena():
    core, arena = _arena()
    sizes = [3 * MiB, 700, 5 * MiB, 128, 2 * MiB]
    for _ in range(5):
        _iteration(core, sizes)
        arena.step()
    modes = [h.mode for h in arena.history]
    assert modes == ["record", "replay", "replay", "replay", "replay"]  # a provisional plan after one step
    replayed = [h for h in arena.history if h.mode == "replay"]
    assert all(h.fallback_allocs == 0 and h.replayed_allocs == len(sizes) for h in replayed)
    stats = arena.stats()
    assert stats["signatures"] == 1
    # allocated all at once: the plan needs the sum of the aligned sizes, no more
    assert stats["planned_bytes"] == sum(-(-z // 512) * 512 for z in sizes)
    # replayed addresses are the plan's: the same in every replayed step
    a = _iteration(core, sizes)
    arena.step()
    b = _iteration(core, sizes)
    assert a == b
    arena.close()


def test_mismatch_goes_to_the_fallback_and_resynchronises():
    core, arena = _arena()
    sizes = [MiB, 2 * MiB, 3 * MiB, 4 * MiB]
    for _ in range(3):
        _iteration(core, sizes)
        arena.step()
    before = core.stats()
    # an extra request the plan did not foresee, then the planned ones
    _iteration(core, [MiB, 7 * MiB, 2 * MiB, 3 * MiB, 4 * MiB])
    after = core.stats()
    assert after["fallback_allocs"] - before["fallback_allocs"] == 1
    assert after["mismatches"] - before["mismatches"] == 1
    assert after["replayed_allocs"] - before["replayed_allocs"] == 4
    arena.close()


def test_a_slot_still_in_use_is_never_handed_out_twice():
    core, arena = _arena()
    for _ in range(3):
        _iteration(core, [MiB, MiB])
        arena.step()
    first = core.malloc(MiB)
    core.free(core.malloc(MiB))
    arena.step()  # `first` is kept past the step
    again = core.malloc(MiB)  # slot 0 again: occupied by `first`, slot 1 (same size, free) serves
    third = core.malloc(MiB)  # slot 1: taken; slot 0: still `first`'s: the fallback pool serves
    assert len({first, again, third}) == 3
    assert core.stats()["swapped_slots"] == 1 and core.stats()["overlap_refusals"] == 1
    arena.close()


def test_record_stream_keeps_a_block_until_the_other_stream_is_done():
    core = Core("virtual", alignment=512)
    core.begin_step(-1)
    a = core.malloc(MiB, stream=7)
    assert core.record_stream(a, 9)
    core.free(a)
    assert core.stats()["pending_frees"] == 1
    b = core.malloc(MiB, stream=7)
    assert b != a  # not reused while stream 9 may still read it
    marker = core.stream_marker(9)
    assert core.stream_complete(9, marker) == 1
    assert core.stats()["pending_frees"] == 0
    core.free(b)
    core.close()


def test_arena_range_freed_by_one_stream_waits_for_a_synchronisation_before_another_uses_it():
    core = Core("virtual", alignment=512)
    plan = core.add_plan([MiB, MiB], [MiB, MiB], [0, 0], [1, 2], MiB)
    core.begin_step(plan)
    a = core.malloc(MiB, stream=1)
    core.free(a)
    b = core.malloc(MiB, stream=2)
    assert b != a and core.stats()["stream_waits"] == 1
    core.end_step()
    core.synchronize()
    core.begin_step(plan)
    core.free(core.malloc(MiB, stream=1))
    core.synchronize()
    assert core.malloc(MiB, stream=2) == a
    core.close()


def test_persistent_requests_are_marked_for_the_fallback_in_the_loop():
    core, arena = _arena()
    kept = []
    for step in range(4):
        if step == 0:
            kept.append(core.malloc(8 * MiB))  # an optimizer state: created once, never freed
        _iteration(core, [MiB, 2 * MiB])
        arena.step()
    plan = arena.plans[""]
    assert plan.offsets[0] == NO_SLOT and NO_SLOT not in plan.offsets[1:]  # the state: left to the fallback
    assert all(h.fallback_allocs == 0 for h in arena.history[1:])  # its slot is skipped, never served
    arena.close()


def test_windows_take_the_largest_size_recorded():
    core, arena = _arena(rerecord_share=0.0)
    for size in (MiB, 3 * MiB, 3 * MiB, 3 * MiB, 3 * MiB, 2 * MiB, MiB, 2 * MiB):
        _iteration(core, [size, 4 * MiB])
        arena.step()
    # replays of 3 MiB fell back twice in a row: recorded again (step 4), slot widened to 3 MiB
    assert arena.history[4].mode == "record" and arena.plans[""].sizes[0] == 3 * MiB
    assert [h.fallback_allocs for h in arena.history[-2:]] == [0, 0]
    arena.close()


def test_an_arena_that_cannot_be_allocated_falls_back_to_the_default_allocator_with_a_warning():
    core, arena = _arena(arena_limit_bytes=MiB)
    _iteration(core, [MiB, MiB])
    with pytest.warns(RuntimeWarning, match="could not be allocated"):
        arena.step()  # the (provisional) plan is ready: its 2 MiB arena is over the limit
    assert core.malloc(MiB) == 0  # passes every request on
    assert core.stats()["arena_failures"] == 1
    arena.close()


def test_signatures_get_their_own_plans():
    core, arena = _arena()
    shapes = {"short": [MiB, 2 * MiB], "long": [4 * MiB, 8 * MiB, MiB]}
    for key in ["short", "long", "short", "long", "short", "long", "short"]:
        arena.signature(key)
        _iteration(core, shapes[key])
        arena.step()
    assert set(arena.plans) == {"short", "long"}
    assert [h.mode for h in arena.history[-2:]] == ["replay", "replay"]
    assert all(h.fallback_allocs == 0 for h in arena.history if h.mode == "replay")
    arena.close()


def test_cuda_backend_calls_the_runtime_library_it_loads(tmp_path):
    stub = ctypes.CDLL(str(build_stub(tmp_path)))
    lib = core_or_skip()
    core = Core("cuda", alignment=512, library=str(tmp_path / "libstub_cudart.so"))
    core.set_current()
    lib.mpr_cuda_malloc.restype = ctypes.c_void_p
    lib.mpr_cuda_malloc.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    lib.mpr_cuda_free.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    core.begin_step(-1)
    p = lib.mpr_cuda_malloc(3 * MiB, 0, None)
    q = lib.mpr_cuda_malloc(1000, 0, None)
    assert p and q and stub.stub_mallocs() == 2  # one large segment, one small-pool segment
    ctypes.memset(p, 1, 3 * MiB)  # real memory from the stub's cudaMalloc
    lib.mpr_cuda_free(p, 3 * MiB, 0, None)
    lib.mpr_cuda_free(q, 1000, 0, None)
    core.end_step()
    core.close()
    assert stub.stub_live() == 0 and stub.stub_frees() == 2


def test_missing_cuda_runtime_is_one_clear_error(tmp_path):
    with pytest.raises(RuntimeUnavailable, match="cannot load the CUDA runtime"):
        Core("cuda", alignment=512, library=str(tmp_path / "missing.so"))


def test_plan_recording_keeps_streams_apart():
    from memplan.alloc.runtime._native import LogRows

    rows = LogRows(requested=(MiB, MiB), streams=(0, 5), starts=(0, 2), ends=(1, 3))
    plan = plan_recording(rows, key="k", alignment=512)
    assert plan.offsets == (0, MiB) and plan.pool_bytes == 2 * MiB  # disjoint in time, not in space


def test_settings_refuse_an_unknown_device():
    from memplan.errors import ConfigError

    with pytest.raises(ConfigError, match="device"):
        RuntimeSettings(device="tpu")  # type: ignore[arg-type]


@pytest.mark.parametrize("hugepages", [True, False])
def test_host_regions_are_huge_page_aligned_unless_told_not_to(hugepages):
    core = Core("cpu", alignment=64)
    core.set_hugepages(hugepages)
    plan = core.add_plan([3 * MiB], [3 * MiB], [0], [0], 3 * MiB)
    assert core.begin_step(plan)  # True: the region was allocated
    address = core.malloc(3 * MiB)
    assert address and address % (2 * MiB if hugepages else 64) == 0  # the region's base: slot 0 at offset 0
    assert core.stats()["replayed_allocs"] == 1
    ctypes.memset(address, 1, 3 * MiB)  # the region is real host memory
    assert core.free(address)
    core.end_step()
    core.close()


def test_settings_refuse_a_hugepages_value_that_is_not_a_bool():
    from memplan.errors import ConfigError

    with pytest.raises(ConfigError, match="hugepages: must be True or False"):
        RuntimeSettings(hugepages="yes")  # type: ignore[arg-type]
