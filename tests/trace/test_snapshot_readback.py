"""A snapshot written by ``memplan trace --snapshot`` is read back by memplan's own restricted
unpickler: ``memplan alloc simulate/compare FILE`` and ``memplan report --trace FILE`` accept it."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from memplan.alloc import load_trace_or_snapshot
from memplan.alloc.simulator import simulate
from memplan.cli import app
from memplan.trace import trace
from memplan.trace.snapshot import write_snapshot

runner = CliRunner()


@pytest.fixture(scope="module", params=["cpu", "cuda"])
def traced(request, tiny_gpt2: str):  # type: ignore[no-untyped-def]
    # device="cuda" traces on fake tensors (no GPU needed) with CUDA's 512-byte rounding.
    return trace(tiny_gpt2, seq=64, mbs=1, precision="fp32", device=request.param, iterations=2)


def test_written_snapshot_reads_back_to_the_same_trace(traced, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "step.pickle"
    write_snapshot(traced.trace, path)
    read, settings = load_trace_or_snapshot(path)
    original = traced.trace.events
    assert [(e.kind, e.size, e.category) for e in read.events] == [(e.kind, e.size, e.category) for e in original]
    mine, theirs = simulate(read, settings), simulate(traced.trace)
    assert (mine.peak_reserved_bytes, mine.peak_allocated_bytes) == (theirs.peak_reserved_bytes, theirs.peak_allocated_bytes)


def test_cli_reads_the_written_snapshot(traced, tiny_gpt2: str, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "step.pickle"
    write_snapshot(traced.trace, path)
    for args in (["alloc", "simulate", str(path)], ["alloc", "compare", str(path)],
                 ["report", tiny_gpt2, "--trace", str(path), "-o", str(tmp_path / "out.html")]):
        result = runner.invoke(app, args, env={"COLUMNS": "200", "NO_COLOR": "1"})
        assert result.exit_code == 0, (args, result.output)
    html = (tmp_path / "out.html").read_text()
    assert "parameter" in html and "<svg" in html
