"""`memplan report --trace`: the timeline by category and the allocator's segments at peak reserved."""

from __future__ import annotations

from typer.testing import CliRunner

from memplan.cli import app
from memplan.events import ALLOC, FREE, AllocEvent, Trace, TraceMeta, write_trace
from memplan.report.trace_data import category_timeline, peak_segments

MiB = 2**20


def _trace() -> Trace:
    sizes = [("parameter", 30 * MiB), ("activation", 8 * MiB), ("activation", 12 * MiB), ("temporary", 3 * MiB)]
    events = [AllocEvent(i, ALLOC, i, size, cat, "forward") for i, (cat, size) in enumerate(sizes)]
    events += [AllocEvent(4, FREE, 3, 3 * MiB, "temporary", "backward"),
               AllocEvent(5, FREE, 1, 8 * MiB, "activation", "backward"),
               AllocEvent(6, ALLOC, 4, 5 * MiB, "gradient", "backward")]
    return Trace(events=tuple(events), meta=TraceMeta(device="cuda"))


def test_timeline_keeps_the_peak_and_categories():
    points = category_timeline(_trace(), max_points=2)
    peak = max(points, key=lambda p: sum(p[1].values()))
    assert peak[0] == 3 and peak[1] == {"parameter": 30 * MiB, "activation": 20 * MiB, "temporary": 3 * MiB}
    assert points[-1][1]["gradient"] == 5 * MiB


def test_segments_are_those_at_peak_reserved():
    segments = peak_segments(_trace())
    allocated = sum(b["size"] for s in segments for b in s["blocks"] if b["allocated"])
    assert allocated == (30 + 8 + 12 + 3) * MiB  # every block of the peak is live there
    assert all(sum(b["size"] for b in s["blocks"]) == s["size"] for s in segments)


def test_report_with_a_trace_has_all_sections(tmp_path):
    trace_path, html = tmp_path / "t.mptrace", tmp_path / "r.html"
    write_trace(_trace(), trace_path)
    result = CliRunner().invoke(app, ["report", "gpt2", "--trace", str(trace_path), "-o", str(html)])
    assert result.exit_code == 0, result.output
    text = html.read_text()
    for heading in ("Per-stage memory", "Memory timeline by category", "Allocator segments"):
        assert heading in text
    assert "activation" in text and "<script src=" not in text
    missing = CliRunner().invoke(app, ["report", "gpt2", "--trace", str(tmp_path / "nope"), "-o", str(html)])
    assert missing.exit_code == 2 and "--trace" in missing.stderr


def test_report_of_a_trace_alone_needs_no_model(tmp_path):
    """``memplan report --trace FILE``: the timeline and segments without an estimate."""
    trace_path, html = tmp_path / "t.mptrace", tmp_path / "r.html"
    write_trace(_trace(), trace_path)
    result = CliRunner().invoke(app, ["report", "--trace", str(trace_path), "-o", str(html)])
    assert result.exit_code == 0, result.output
    page = html.read_text(encoding="utf-8")
    assert "t.mptrace" in page and "parameter" in page
    refused = CliRunner().invoke(app, ["report", "--trace", str(trace_path), "--fit", "-o", str(html)])
    assert refused.exit_code == 2 and "--fit: needs a MODEL" in refused.output
