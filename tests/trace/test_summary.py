"""Pure-Python parts: the peak and its breakdown, CUDA rounding, options validation."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from memplan.errors import ConfigError
from memplan.events import AllocEvent, Trace, TraceMeta
from memplan.trace.cuda_rounding import cuda_allocated_size
from memplan.trace.options import TraceOptions
from memplan.trace.summary import summarize


def _trace(device: str) -> Trace:
    rows = [
        ("alloc", 0, 1000, "parameter", "setup", "emb"),
        ("alloc", 1, 300, "activation", "forward", "layer.0"),
        ("alloc", 2, 700, "temporary", "forward", "layer.0"),
        ("free", 2, 700, "temporary", "forward", "layer.0"),
        ("alloc", 3, 100, "gradient", "backward", "layer.0"),
        ("free", 1, 300, "activation", "backward", "layer.0"),
    ]
    events = tuple(AllocEvent(i, k, b, s, c, p, 0, "aten.mm.default", m) for i, (k, b, s, c, p, m) in enumerate(rows))
    return Trace(events, TraceMeta(device=device, iterations=1))


def test_peak_and_breakdown_of_a_cpu_trace() -> None:
    summary = summarize(_trace("cpu"))
    assert summary.peak_allocated_bytes == 2000 == summary.peak_requested_bytes
    assert summary.peak_event_index == 2 and summary.peak_phase == "forward"
    assert summary.by_category["parameter"] == 1000 and summary.by_category["temporary"] == 700
    assert summary.by_module[0] == ("emb", 1000)
    assert summary.by_phase == {"setup": 1000, "forward": 2000, "backward": 1400}
    assert summary.max_by_category["gradient"] == 100


def test_cuda_trace_rounds_each_block() -> None:
    summary = summarize(_trace("cuda"))
    assert summary.peak_allocated_bytes == 1024 + 512 + 1024
    assert summary.peak_requested_bytes == 2000
    assert summary.to_dict()["by_category"]["activation"] == 512


@given(st.integers(min_value=0, max_value=1 << 40))
def test_cuda_rounding_is_the_smallest_multiple_of_512(size: int) -> None:
    rounded = cuda_allocated_size(size)
    assert rounded % 512 == 0 and rounded >= size and rounded - size < 512


@pytest.mark.parametrize(("field", "value"), [("seq", 0), ("mbs", -1), ("precision", "fp33"), ("device", "tpu"),
                                              ("fsdp", 0), ("attention", "flash"), ("optimizer", "adam8bit"),
                                              ("dropout", 1.0), ("recompute", "some")])
def test_bad_options_name_the_flag(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match=f"--{field}"):
        TraceOptions(**{field: value})  # type: ignore[arg-type]


def test_optimizer_implementation_follows_the_device() -> None:
    assert TraceOptions(device="cuda").resolved_optimizer_impl == "foreach"
    assert TraceOptions(device="cpu").resolved_optimizer_impl == "for-loop"
    assert TraceOptions(device="cpu", optimizer_impl="fused").resolved_optimizer_impl == "fused"
