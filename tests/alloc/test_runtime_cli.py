"""``memplan alloc replay``: the runtime core driven by a trace, next to the caching allocator (no torch)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from runtime_helpers import core_or_skip
from typer.testing import CliRunner

from memplan.cli import app
from memplan.events import AllocEvent, Trace, write_trace

MiB = 1 << 20
SNAPSHOT = Path(__file__).resolve().parents[3] / "shared" / "reference" / "snapshots" / "01_silmont2000_cs336_mem_snapshot.pickle"


@pytest.fixture(autouse=True)
def _core():
    core_or_skip()


def _fragmenting_trace(path: Path, scale: int = 1) -> Path:
    """Interleaved sizes whose frees leave holes the caching allocator cannot reuse for larger requests."""
    events, block = [], 0
    for it in range(2):
        live = []
        for i in range(12):
            size = (3 + (i % 4) * 5) * MiB * scale + 100
            events.append(AllocEvent(len(events), "alloc", block, size, iteration=it))
            live.append((block, size))
            block += 1
            if i % 3 == 2:
                b, z = live.pop(0)
                events.append(AllocEvent(len(events), "free", b, z, iteration=it))
        for b, z in live:
            events.append(AllocEvent(len(events), "free", b, z, iteration=it))
    write_trace(Trace(events=tuple(events)), path)
    return path


def test_replay_json_reports_both_allocators(tmp_path):
    trace = _fragmenting_trace(tmp_path / "t.mptrace")
    result = CliRunner().invoke(app, ["alloc", "replay", str(trace), "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    assert set(out["caching"]) >= {"reserved_bytes", "fragmentation"} and "fallback_allocs" in out
    assert out["fallback_allocs"] == 0
    assert out["planned"]["reserved_bytes"] <= out["caching"]["reserved_bytes"]
    assert out["planned"]["reserved_bytes"] >= out["lower_bound_bytes"]
    assert out["planned"]["fragmentation"] < out["caching"]["fragmentation"]


def test_replay_table_and_saved_plan_round_trip(tmp_path):
    trace = _fragmenting_trace(tmp_path / "t.mptrace")
    plan = tmp_path / "plan.json"
    first = CliRunner().invoke(app, ["alloc", "replay", str(trace), "--save-plan", str(plan)])
    assert first.exit_code == 0 and "planned runtime" in first.output
    again = CliRunner().invoke(app, ["alloc", "replay", str(trace), "--plan", str(plan), "--json"])
    assert again.exit_code == 0 and json.loads(again.output)["fallback_allocs"] == 0


def test_a_plan_for_another_trace_or_a_corrupted_plan_is_exit_2(tmp_path):
    plan = tmp_path / "plan.json"
    assert CliRunner().invoke(app, ["alloc", "replay", str(_fragmenting_trace(tmp_path / "a.mptrace")),
                                    "--save-plan", str(plan)]).exit_code == 0
    other = _fragmenting_trace(tmp_path / "b.mptrace", scale=2)
    result = CliRunner().invoke(app, ["alloc", "replay", str(other), "--plan", str(plan)])
    assert result.exit_code == 2 and "another trace, model or shape" in result.output
    body = json.loads(plan.read_text())
    body["signatures"]["trace"]["requested"][0] += 1
    plan.write_text(json.dumps(body))
    result = CliRunner().invoke(app, ["alloc", "replay", str(other), "--plan", str(plan)])
    assert result.exit_code == 2 and "corrupted" in result.output
    plan.write_text("{not json")
    assert CliRunner().invoke(app, ["alloc", "replay", str(other), "--plan", str(plan)]).exit_code == 2


def test_online_mode_steps_per_iteration(tmp_path):
    trace = _fragmenting_trace(tmp_path / "t.mptrace")
    result = CliRunner().invoke(app, ["alloc", "replay", str(trace), "--mode", "online", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["mode"] == "online"
    bad = CliRunner().invoke(app, ["alloc", "replay", str(trace), "--mode", "sideways"])
    assert bad.exit_code == 2


@pytest.mark.skipif(not SNAPSHOT.is_file(), reason="shared reference snapshots not present")
def test_real_snapshot_fragmentation_is_cut():
    result = CliRunner().invoke(app, ["alloc", "replay", str(SNAPSHOT), "--json"])
    out = json.loads(result.output)
    assert out["caching"]["fragmentation"] > 0.10 and out["planned"]["fragmentation"] < 0.01
