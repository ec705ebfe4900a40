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


def _invoke(*args):
    return runner.invoke(app, ["alloc", *map(str, args)])


def test_compare_json_has_the_four_numbers():
    result = _invoke("compare", SNAPSHOTS[0], "--json", "--time-limit", "2")
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


def test_simulate_predicts_oom_with_pytorch_message():
    result = _invoke("simulate", SNAPSHOTS[0], "--capacity", "3GiB", "--json")
    assert result.exit_code == 0
    assert json.loads(result.stdout)["oom"]["message"].startswith("CUDA out of memory. Tried to allocate")


def test_plan_csv_writes_offsets(tmp_path):
    out = tmp_path / "out.csv"
    result = _invoke("plan", MINIMALLOC[0], "-o", out, "--time-limit", "0.5")
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
    truncated.write_bytes(SNAPSHOTS[0].read_bytes()[:5000])
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
        ("simulate", SNAPSHOTS[0], "--max-split-size-mb", "10"),
    ]
    for case in cases:
        result = _invoke(*case)
        assert result.exit_code == 2, (case, result.output)
        assert "error:" in result.output
    assert not marker.exists()


def test_capacity_below_lower_bound_exit_2_with_numbers(tmp_path):
    result = _invoke("plan", SNAPSHOTS[0], "-o", tmp_path / "p.json", "--capacity", "1GiB")
    assert result.exit_code == 2
    assert "3249143816" in result.output
    csv = _invoke("plan", MINIMALLOC[0], "-o", tmp_path / "o.csv", "--capacity", "1000")
    assert csv.exit_code == 2 and "1048576" in csv.output


@pytest.mark.parametrize("command", ["simulate", "plan", "compare"])
def test_help_has_examples(command):
    result = _invoke(command, "--help")
    assert result.exit_code == 0 and "Examples" in result.output
