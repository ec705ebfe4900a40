"""Export to PyTorch's memory snapshot (rendered by torch.cuda._memory_viz) and the PNG timeline."""

from __future__ import annotations

import base64
import contextlib
import io
import json
import pickle
import re
from pathlib import Path

import pytest
import torch.cuda._memory_viz as memory_viz

from memplan.events import ALLOC
from memplan.trace import trace
from memplan.trace.snapshot import to_snapshot, write_snapshot


@pytest.fixture(scope="module")
def result(tiny_llama: str):  # type: ignore[no-untyped-def]
    return trace(tiny_llama, seq=32, mbs=1, precision="bf16", device="cuda", iterations=2)


def _embedded_snapshot(html: str) -> dict:  # type: ignore[type-arg]
    match = re.search(r'\[\{"name": "snapshot.pickle", "base64": "([^"]+)"\}\]', html)
    assert match, "trace_plot did not embed the snapshot"
    return pickle.loads(base64.b64decode(match.group(1)))


def test_trace_plot_renders_the_exported_snapshot(result) -> None:  # type: ignore[no-untyped-def]
    snapshot = to_snapshot(result.trace)
    html = memory_viz.trace_plot(snapshot)
    assert "Active Memory Timeline" in html
    embedded = _embedded_snapshot(html)
    entries = embedded["device_traces"][0]
    allocs = [e for e in entries if e["action"] == "alloc"]
    assert len(allocs) == sum(1 for e in result.trace.events if e.kind == ALLOC)
    assert all(e["size"] % 512 == 0 for e in allocs)


def test_memory_viz_text_tools_read_the_snapshot(result) -> None:  # type: ignore[no-untyped-def]
    snapshot = to_snapshot(result.trace)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        summary = memory_viz.segsum(snapshot)
    assert "total_allocated" in summary
    live_at_end = sum(s["total_size"] for s in snapshot["segments"])
    sizes = {e.block: e.size for e in result.trace.events if e.kind == ALLOC}
    freed = {e.block for e in result.trace.events if e.kind != ALLOC}
    from memplan.trace.cuda.rounding import cuda_allocated_size

    assert live_at_end == sum(cuda_allocated_size(s) for b, s in sizes.items() if b not in freed)
    # Replay the alloc/free actions as the viewer does: the high-water mark is the traced peak.
    live = peak = 0
    for entry in snapshot["device_traces"][0]:
        if entry["action"] == "alloc":
            live += entry["size"]
        elif entry["action"] == "free_completed":
            live -= entry["size"]
        peak = max(peak, live)
    assert peak == result.summary.peak_allocated_bytes


def test_snapshot_pickle_file(result, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "snapshot.pickle"
    write_snapshot(result.trace, path)
    data = pickle.loads(path.read_bytes())
    assert set(data) >= {"segments", "device_traces"}
    json.dumps(data)  # plain containers and scalars only


def test_plot_writes_a_png(result, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from memplan.trace.plot import plot_timeline

    path = tmp_path / "timeline.png"
    plot_timeline(result.trace, path, title="tiny llama")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
