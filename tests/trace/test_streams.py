"""Streams in a trace: FSDP2's side streams are recorded per allocation, and ``trace`` reports the
reserved memory the caching-allocator simulator gives for the trace's own events, per stream."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch

from memplan.alloc import simulate
from memplan.categories import MemoryCategory
from memplan.events import ALLOC, Trace
from memplan.trace import trace
from memplan.trace.core.recorder import AllocationRecorder
from memplan.trace.core.streams import DEFAULT_STREAM, FIRST_OTHER_STREAM, FSDP_STREAMS, StreamIds, stream_names
from memplan.trace.core.summary import summarize

ALL_GATHER_COPY_IN = FSDP_STREAMS["all_gather_copy_in_stream"]
REDUCE_SCATTER = FSDP_STREAMS["reduce_scatter_stream"]
COMMUNICATION = MemoryCategory.COMMUNICATION.value
GRADIENT = MemoryCategory.GRADIENT.value


@pytest.fixture(scope="module")
def fsdp_trace(tiny_llama: str):
    return trace(tiny_llama, seq=64, mbs=1, precision="bf16-mixed", device="cuda", fsdp=2)


def test_stream_ids_follow_the_emulated_current_stream() -> None:
    ids = StreamIds()
    assert ids() == DEFAULT_STREAM
    side, other = torch.cpu.Stream(), torch.cpu.Stream()
    with torch.cpu.stream(side):
        assert ids() == FIRST_OTHER_STREAM
        with torch.cpu.stream(other):
            assert ids() == FIRST_OTHER_STREAM + 1
        assert ids() == FIRST_OTHER_STREAM
    assert ids() == DEFAULT_STREAM
    with torch.cpu.stream(other):
        assert ids() == FIRST_OTHER_STREAM + 1  # the same stream keeps its id


def test_recorder_gives_a_free_the_stream_of_its_allocation() -> None:
    ids = StreamIds()
    recorder = AllocationRecorder(stream_of=ids)
    with torch.cpu.stream(torch.cpu.Stream()):
        tensor = torch.empty(1024)
        recorder.see(tensor.untyped_storage(), "aten.empty.memory_format")
    kept = torch.empty(256)
    recorder.see(kept.untyped_storage(), "aten.empty.memory_format")
    del tensor  # freed on the default stream, still a block of the side stream's pool
    events = recorder.events(drop_host=False)
    assert [(e.kind, e.size, e.stream) for e in events] == [
        ("alloc", 4096, FIRST_OTHER_STREAM), ("alloc", 1024, DEFAULT_STREAM), ("free", 4096, FIRST_OTHER_STREAM)]


def test_fsdp2_allocates_all_gathers_and_reduce_scatters_on_their_streams(fsdp_trace) -> None:
    allocs = [e for e in fsdp_trace.trace.events if e.kind == ALLOC]
    streams = Counter(e.stream for e in allocs)
    assert set(streams) == {DEFAULT_STREAM, ALL_GATHER_COPY_IN, REDUCE_SCATTER}
    # The all-gather output buffers (communication) are cut from the copy-in stream's pool ...
    copy_in = [e for e in allocs if e.stream == ALL_GATHER_COPY_IN]
    assert any(e.category == COMMUNICATION for e in copy_in)
    # ... the unsharded parameters (copy-out, resize_) from the default stream's.
    assert any(e.op == "resize_" and e.stream == DEFAULT_STREAM for e in allocs)
    # Sharded gradients are views of the reduce-scatter output: all of them on its stream.
    gradients = [e for e in allocs if e.category == GRADIENT]
    assert gradients and {e.stream for e in gradients} == {REDUCE_SCATTER}
    # Every free carries the stream of its allocation.
    stream_of: dict[int, int] = {}
    for event in fsdp_trace.trace.events:
        if event.kind == ALLOC:
            stream_of[event.block] = event.stream
        else:
            assert event.stream == stream_of[event.block]


def test_reserved_is_simulated_per_stream(fsdp_trace) -> None:
    reserved = fsdp_trace.summary.reserved
    assert reserved is not None
    # The simulator counts whole blocks (a large block is not split for a remainder under 1 MiB).
    assert reserved.peak_allocated_bytes >= fsdp_trace.summary.peak_allocated_bytes
    assert sum(reserved.by_stream.values()) == reserved.peak_reserved_bytes
    assert reserved.by_stream[ALL_GATHER_COPY_IN] > 0 and reserved.by_stream[REDUCE_SCATTER] > 0
    one_stream = Trace(events=tuple(e._replace(stream=0) for e in fsdp_trace.trace.events), meta=fsdp_trace.trace.meta)
    flat = simulate(one_stream)
    assert summarize(one_stream).peak_allocated_bytes == fsdp_trace.summary.peak_allocated_bytes
    assert reserved.peak_reserved_bytes >= flat.peak_reserved_bytes
    assert reserved.peak_reserved_bytes == simulate(fsdp_trace.trace).peak_reserved_bytes


def test_single_rank_trace_is_all_on_the_default_stream(tiny_llama: str) -> None:
    result = trace(tiny_llama, seq=32, mbs=1, precision="bf16-mixed", device="cuda")
    assert {e.stream for e in result.trace.events} == {DEFAULT_STREAM}
    assert result.summary.reserved is not None
    assert result.summary.reserved.by_stream == {DEFAULT_STREAM: result.summary.reserved.peak_reserved_bytes}
    assert result.summary.reserved.peak_reserved_bytes >= result.summary.peak_allocated_bytes


def test_cpu_trace_reports_no_reserved_memory(tiny_llama: str) -> None:
    result = trace(tiny_llama, seq=32, mbs=1, precision="fp32", device="cpu")
    assert result.summary.reserved is None
    assert "simulated_reserved" not in result.to_dict()


def test_trace_json_and_text_label_reserved_as_simulated(fsdp_trace) -> None:
    data = json.loads(json.dumps(fsdp_trace.to_dict()))
    reserved = data["simulated_reserved"]
    assert reserved["source"].startswith("simulated")
    names = {row["name"]: row["reserved_bytes"] for row in reserved["by_stream"]}
    assert set(names) == {"default", "all_gather_copy_in", "reduce_scatter"}
    assert sum(names.values()) == reserved["peak_reserved_bytes"]
    from rich.console import Console

    from memplan.report.trace_text import render_summary

    console = Console(width=200, record=True)
    console.print(render_summary("tiny", fsdp_trace.summary))
    text = console.export_text()
    assert "peak reserved" in text and "simulated caching allocator" in text
    assert "all_gather_copy_in" in text and "reduce_scatter" in text


def test_stream_names() -> None:
    assert stream_names({0, 1, 3, 4, FIRST_OTHER_STREAM}) == {
        0: "default", 1: "all_gather_copy_in", 3: "reduce_scatter", 4: "all_reduce",
        FIRST_OTHER_STREAM: f"side stream {FIRST_OTHER_STREAM}"}
