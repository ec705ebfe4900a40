"""Pure-Python parts: the peak and its breakdown, CUDA rounding, options validation."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from memplan.errors import ConfigError
from memplan.events import AllocEvent, Trace, TraceMeta
from memplan.trace.cuda.rounding import cuda_allocated_size
from memplan.trace.setup import trace_setup
from memplan.trace.core.summary import summarize


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
                                              ("fsdp", 0), ("attention", "flashy"), ("dropout", 1.0),
                                              ("recompute", "some"), ("iterations", 0), ("moe_routing", "x")])
def test_bad_options_name_the_flag(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match=f"--{field.replace('_', '-')}"):
        trace_setup(**{field: value})


@pytest.mark.parametrize(("flags", "flag"), [
    ({"pp": 2, "gpus": 2}, "--pp"), ({"zero": 2}, "--zero"), ({"fp8": "hybrid"}, "--fp8"),
    ({"framework": "megatron"}, "--framework"), ({"gpus": 4}, "--gpus"), ({"recompute_layers": 2}, "--recompute-layers"),
    ({"offload_activations": True, "device": "cpu"}, "--offload-activations"), ({"gbs": 8}, "--gbs"),
    ({"loss": "fused"}, "--loss"), ({"optimizer": "adafactor"}, "--optimizer"),
    ({"mtp_layers": 1}, "--mtp-layers"), ({"grad_dtype": "bf16"}, "--grad-dtype"),
    ({"framework": "torchtitan", "tp": 2}, "--tp"),
    # hybrid sharding is traced (HSDP, tests/trace/test_hsdp_trace.py) over whole replicas of the shard group only
    ({"fsdp": "hybrid", "fsdp_shard_size": 4, "gpus": 6}, "--fsdp-shard-size"),
])
def test_settings_the_tracer_cannot_run_are_refused_by_flag(flags: dict[str, object], flag: str) -> None:
    with pytest.raises(ConfigError) as info:
        trace_setup(**flags)
    assert info.value.field == flag


def test_defaults_are_the_jobs_and_the_frameworks() -> None:
    """One job, one vocabulary: the trace's defaults are the Job's; auto means the profile's choice."""
    from memplan.job import Job

    setup = trace_setup()
    assert setup.job == Job(framework="hf")
    assert (setup.seq, setup.attention, setup.resolved_optimizer_impl) == (4096, "sdpa", "fused")
    assert trace_setup(optimizer_impl="foreach").resolved_optimizer_impl == "foreach"
    assert trace_setup(framework="torchtitan").job.framework == "torchtitan"
    ranks = trace_setup(fsdp=4, tp=2)
    assert (ranks.fsdp, ranks.tp, ranks.world_size) == (4, 2, 8)
    assert trace_setup(tp=2).world_size == 2


def test_timeline_keeps_each_stretchs_peak() -> None:
    """A one-event spike inside a stretch of events is kept: the plotted peak is the summary's peak."""
    from memplan.events import AllocEvent, Trace, TraceMeta
    from memplan.trace.core.summary import summarize, timeline

    events = []
    for i in range(0, 20_000, 2):
        size = 3 << 30 if i == 12_346 else 1 << 20  # the spike sits between two sampled strides
        events += [AllocEvent(i, "alloc", i, size, "activation", "forward", 0, "", "", 0),
                   AllocEvent(i + 1, "free", i, size, "activation", "forward", 0, "", "", 0)]
    trace = Trace(events=tuple(events), meta=TraceMeta())
    xs, series = timeline(trace, max_points=100)
    totals = [sum(values) for values in zip(*series.values())]
    assert len(xs) <= 102
    assert max(totals) == summarize(trace).peak_allocated_bytes == 3 << 30
    assert xs == sorted(xs)


def test_modules_of_equal_size_sort_naturally() -> None:
    """h.2 before h.10 (not the string order h.10, h.2) when both hold the same bytes."""
    from memplan.events import AllocEvent, Trace, TraceMeta
    from memplan.trace.core.summary import summarize
    from memplan.units import natural_key

    names = ["h.10", "h.2", "h.1", "h.11"]
    events = tuple(AllocEvent(i, "alloc", i, 1 << 20, "activation", "forward", 0, "", name, 0)
                   for i, name in enumerate(names))
    summary = summarize(Trace(events=events, meta=TraceMeta()))
    assert [name for name, _ in summary.by_module] == ["h.1", "h.2", "h.10", "h.11"]
    assert sorted(["layers.10", "layers.9"], key=natural_key) == ["layers.9", "layers.10"]
