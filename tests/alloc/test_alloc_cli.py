"""``memplan alloc``: commands, JSON output and exit code 2 for every kind of bad input."""

from __future__ import annotations

import gzip
import json
import os
import pickle

import pytest
from alloc_reference import MINIMALLOC, SNAPSHOTS
from typer.testing import CliRunner

from memplan.cli import app
from memplan.events import AllocEvent, Trace, write_trace

runner = CliRunner()
MiB = 2**20
needs_reference = pytest.mark.skipif(not (SNAPSHOTS and MINIMALLOC), reason="../shared/reference data not found")


def _synthetic_trace(path, *, sizes=(3, 30, 7, 64, 5, 12, 90, 2, 40, 9), rounds=4):
    """A small training-like log: blocks of mixed sizes allocated and freed in a changing order."""
    events, live, index, block = [], [], 0, 0
    for r in range(rounds):
        for size in sizes:
            events.append(AllocEvent(index, "alloc", block, size * MiB + 1000 * r, "activation", "forward", r))
            live.append((block, size * MiB + 1000 * r))
            index, block = index + 1, block + 1
        for b, size in live[::2] + live[1::2]:
            events.append(AllocEvent(index, "free", b, size, "activation", "backward", r))
            index += 1
        live = []
    write_trace(Trace(events=tuple(events)), path)
    return path


def _synthetic_csv(path):
    path.write_text("id,lower,upper,size\n0,0,10,600\n1,5,15,300\n2,12,20,500\n3,0,4,200\n")
    return path


def _invoke(*args):
    return runner.invoke(app, ["alloc", *map(str, args)])


def test_compare_json_has_the_four_numbers(tmp_path):
    result = _invoke("compare", _synthetic_trace(tmp_path / "t.mptrace"), "--json", "--time-limit", "2")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    for key in ("lower_bound_bytes", "caching_reserved_bytes", "expandable_reserved_bytes", "plan_bytes"):
        assert isinstance(data[key], int)
    assert data["lower_bound_bytes"] <= data["plan_bytes"] <= data["caching_reserved_bytes"]


def test_simulate_and_plan_a_memplan_trace(tmp_path):
    path = tmp_path / "t.mptrace"
    write_trace(Trace(events=(AllocEvent(0, "alloc", 1, 3_000_000), AllocEvent(1, "free", 1, 3_000_000))), path)
    sim = _invoke("simulate", path, "--json")
    assert sim.exit_code == 0 and json.loads(sim.stdout)["peak_reserved_bytes"] == 20 * 2**20
    out = tmp_path / "plan.json"
    plan = _invoke("plan", path, "-o", out, "--json")
    assert plan.exit_code == 0, plan.output
    assert json.loads(out.read_text())["requests"][0]["offset"] == 0


def test_simulate_predicts_oom_with_pytorch_message(tmp_path):
    result = _invoke("simulate", _synthetic_trace(tmp_path / "t.mptrace"), "--capacity", "200MiB", "--json")
    assert result.exit_code == 0
    assert json.loads(result.stdout)["oom"]["message"].startswith("CUDA out of memory. Tried to allocate")


@needs_reference
def test_real_snapshot_compare_and_oom():
    result = _invoke("compare", SNAPSHOTS[0], "--json", "--time-limit", "2")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["lower_bound_bytes"] <= data["plan_bytes"] <= data["caching_reserved_bytes"]
    result = _invoke("simulate", SNAPSHOTS[0], "--capacity", "3GiB", "--json")
    assert json.loads(result.stdout)["oom"]["message"].startswith("CUDA out of memory. Tried to allocate")


def test_plan_csv_writes_offsets(tmp_path):
    out = tmp_path / "out.csv"
    result = _invoke("plan", _synthetic_csv(tmp_path / "in.csv"), "-o", out, "--time-limit", "0.5")
    assert result.exit_code == 0, result.output
    assert out.read_text().splitlines()[0] == "id,lower,upper,size,offset"


def _hostile(tmp_path):
    marker = tmp_path / "created"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    path = tmp_path / "evil.pickle"
    path.write_bytes(pickle.dumps({"segments": [Evil()]}))
    return path, marker


def test_bad_inputs_exit_2(tmp_path):
    evil, marker = _hostile(tmp_path)
    truncated = tmp_path / "cut.pickle"
    whole = pickle.dumps({"segments": [{"address": i, "total_size": 2 * MiB, "blocks": []} for i in range(500)],
                          "device_traces": [[]]})
    truncated.write_bytes(whole[: len(whole) // 2])
    trace_file = _synthetic_trace(tmp_path / "t.mptrace")
    newer = tmp_path / "new.mptrace"
    with gzip.open(newer, "wt") as handle:
        handle.write(json.dumps({"format": "memplan-trace", "version": 99, "meta": {}}) + "\n")
    overlapping = tmp_path / "dup.csv"
    overlapping.write_text("id,lower,upper,size\n0,0,10,5\n0,5,12,5\n")
    negative = tmp_path / "neg.csv"
    negative.write_text("id,lower,upper,size\n0,0,10,-5\n")
    backwards = tmp_path / "back.csv"
    backwards.write_text("id,lower,upper,size\n0,10,3,5\n")
    cases = [
        ("simulate", evil), ("compare", truncated), ("simulate", newer),
        ("plan", overlapping, "-o", tmp_path / "o.csv"), ("plan", negative, "-o", tmp_path / "o.csv"),
        ("plan", backwards, "-o", tmp_path / "o.csv"), ("simulate", tmp_path / "missing.mptrace"),
        ("simulate", trace_file, "--max-split-size-mb", "10"),
    ]
    for case in cases:
        result = _invoke(*case)
        assert result.exit_code == 2, (case, result.output)
        assert "error:" in result.output
    assert not marker.exists()


def test_capacity_below_lower_bound_exit_2_with_numbers(tmp_path):
    trace_file = _synthetic_trace(tmp_path / "t.mptrace")
    from memplan.events import read_trace

    lower = read_trace(trace_file).peak_live_bytes
    result = _invoke("plan", trace_file, "-o", tmp_path / "p.json", "--capacity", "100MiB")
    assert result.exit_code == 2
    assert str(lower) in result.output
    csv = _invoke("plan", _synthetic_csv(tmp_path / "in.csv"), "-o", tmp_path / "o.csv", "--capacity", "800")
    assert csv.exit_code == 2 and "900" in csv.output  # 600 + 300 bytes live on [5, 10)


@needs_reference
def test_real_capacity_messages():
    result = runner.invoke(app, ["alloc", "plan", str(SNAPSHOTS[0]), "-o", "/dev/null", "--capacity", "1GiB"])
    assert result.exit_code == 2 and "3249143816" in result.output
    csv = runner.invoke(app, ["alloc", "plan", str(MINIMALLOC[0]), "-o", "/dev/null", "--capacity", "1000"])
    assert csv.exit_code == 2 and "1048576" in csv.output


@pytest.mark.parametrize("command", ["simulate", "plan", "compare"])
def test_help_has_examples(command):
    result = _invoke(command, "--help")
    assert result.exit_code == 0 and "Examples" in result.output
