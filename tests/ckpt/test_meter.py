"""The CPU meter counts live storage bytes exactly, once per storage, and enforces its limit."""

from __future__ import annotations

import pytest
import torch

from memplan.ckpt.meter import CpuMeter, OutOfBudgetError, make_meter, storage_bytes


def test_counts_new_storages_and_frees_them() -> None:
    meter = CpuMeter()
    with meter:
        a = torch.ones(1000)  # 4000 bytes
        b = a * 2  # 4000 more
        assert meter.current_bytes == 8000
        del b
        assert meter.current_bytes == 4000
    assert meter.peak_bytes == 8000


def test_views_and_inplace_ops_are_not_counted_again() -> None:
    meter = CpuMeter()
    with meter:
        a = torch.zeros(256, 4)
        v = a.view(-1)[:10]
        a.add_(1.0)
        a.t_()
        assert meter.current_bytes == 256 * 4 * 4
        del v


def test_adopted_tensors_count_once_and_views_of_them_not_at_all() -> None:
    x = torch.randn(100, 100)  # created before the meter
    meter = CpuMeter()
    with meter:
        meter.adopt([x, x, x[0]])
        assert meter.current_bytes == 40_000
        y = x.detach()
        assert meter.current_bytes == 40_000
        del y


def test_operators_with_several_or_list_outputs_count_each_new_storage_once() -> None:
    x = torch.randn(8, 16)  # 512 bytes, created before the meter: not counted
    meter = CpuMeter()
    with meter:
        parts = torch.split(x, 4)  # views: nothing new
        assert meter.current_bytes == 0
        values, indices = torch.max(x, dim=1)  # two new storages: 8 floats + 8 int64
        assert meter.current_bytes == 32 + 64
        doubled = torch._foreach_mul([x, x], 2.0)  # one list return: both new
        assert meter.current_bytes == 96 + 1024
        torch._foreach_mul_(doubled, 2.0)  # in place
        assert meter.current_bytes == 96 + 1024
        del values, indices, doubled, parts
        assert meter.current_bytes == 0


def test_backward_bytes_are_seen_and_released() -> None:
    x = torch.randn(64, 64, requires_grad=True)
    meter = CpuMeter()
    with meter:
        meter.adopt([x])
        (x @ x).relu().sum().backward()
        assert meter.current_bytes == 2 * 64 * 64 * 4  # x and x.grad
        x.grad = None
        assert meter.current_bytes == 64 * 64 * 4
    assert meter.peak_bytes > 2 * 64 * 64 * 4


def test_limit_raises_a_simulated_out_of_memory_at_the_crossing_op() -> None:
    meter = CpuMeter(limit_bytes=10_000)
    with meter:
        keep = torch.ones(2000)  # 8000 bytes: fine
        with pytest.raises(torch.OutOfMemoryError) as info:
            torch.ones(1000)  # 12000 > 10000
        assert isinstance(info.value, OutOfBudgetError)
        del keep


def test_mark_returns_the_phase_peak_and_restarts_it() -> None:
    meter = CpuMeter()
    with meter:
        a = torch.ones(1000)
        b = torch.ones(1000)
        del b
        assert meter.mark() == 8000
        assert meter.peak_bytes == 4000
        del a


def test_make_meter_picks_the_cpu_meter_off_cuda() -> None:
    assert isinstance(make_meter(torch.device("cpu")), CpuMeter)


def test_storage_bytes_deduplicates_shared_storage() -> None:
    a = torch.ones(10)
    assert storage_bytes([a, a[2:], a.view(2, 5)]) == 40


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_meter_reads_the_allocator() -> None:
    from memplan.ckpt.meter import CudaMeter

    meter = make_meter(torch.device("cuda"))
    assert isinstance(meter, CudaMeter)
    with meter:
        meter.mark()
        before = meter.current_bytes
        x = torch.empty(1 << 20, device="cuda")  # 4 MiB
        assert meter.current_bytes - before >= 4 << 20
        del x
        assert meter.mark() - before >= 4 << 20


def test_a_buffer_resized_in_place_is_counted_once_written_and_uncounted_at_the_mark_after_its_free() -> None:
    """FSDP2's all-gathered weights: storages resized up before a collective (or FSDP2's copy) writes
    into them and resized to 0 after use — resizes no operator shows a dispatch mode."""
    pytest.importorskip("torch.distributed.fsdp")  # registers torch.ops.fsdp
    buf, src = torch.empty(256), torch.ones(256)
    buf.untyped_storage().resize_(0)  # freed by a reshard before the meter started
    meter = CpuMeter()
    with meter:
        meter.adopt([src])
        buf.untyped_storage().resize_(1024)  # re-allocated for an all-gather: unseen
        assert meter.current_bytes == 1024
        torch.ops.fsdp.split_with_sizes_copy(src, [256], dim=0, out=[buf])
        assert meter.current_bytes == meter.peak_bytes == 2048
        buf.untyped_storage().resize_(0)  # freed after the block: seen at the next mark
        assert meter.mark() == 2048 and meter.current_bytes == 1024
        buf.untyped_storage().resize_(1024)
        torch.ops.fsdp.split_with_sizes_copy(src, [256], dim=0, out=[buf])
        assert meter.current_bytes == 2048
