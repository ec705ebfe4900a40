"""``memplan diff``: the peak difference of two traces or snapshots, attributed exactly."""

from __future__ import annotations

import gzip
import json
import os
import pickle
from pathlib import Path

import pytest
from typer.testing import CliRunner

from memplan.cli import app
from memplan.diff import diff_files, load_profile
from memplan.diff import files as diff_files_module
from memplan.diff.snapshot_reader import BEFORE_TRACE
from memplan.diff.trace_reader import profile_trace, profile_trace_file
from memplan.errors import ConfigError
from memplan.events import AllocEvent, Trace, TraceMeta, read_trace, write_trace

SNAPSHOTS = Path(__file__).resolve().parents[3] / "shared" / "reference" / "snapshots"
MiB = 2**20
runner = CliRunner()
WIDE = {"COLUMNS": "300", "NO_COLOR": "1"}


def _step(batch: int, *, extra_workspace: bool = False) -> list[tuple]:
    """(kind, block, size, category, phase, op, module) of a small training step at ``batch``."""
    ev = [("alloc", 1, 64 * MiB, "parameter", "setup", "", ""),
          ("alloc", 2, 128 * MiB, "optimizer_state", "setup", "", "")]
    for layer in range(2):
        module = f"model.layers.{layer}"
        ev.append(("alloc", 10 + layer, 8 * MiB * batch, "activation", "forward", "aten.mm.default", module))
        ev.append(("alloc", 20 + layer, 2 * MiB * batch, "temporary", "forward", "aten.gelu.default", module))
        ev.append(("free", 20 + layer, 2 * MiB * batch, "temporary", "forward", "aten.gelu.default", module))
    if extra_workspace:
        ev.append(("alloc", 30, 32 * MiB, "workspace", "forward", "aten.mm.default", "model.layers.1"))
    ev.append(("alloc", 40, 3 * MiB * batch, "logits", "forward", "aten.mm.default", "lm_head"))
    for layer in reversed(range(2)):
        ev.append(("free", 10 + layer, 8 * MiB * batch, "activation", "backward", "", f"model.layers.{layer}"))
    ev.append(("free", 40, 3 * MiB * batch, "logits", "backward", "", "lm_head"))
    return ev


def _write(path: Path, rows: list[tuple], *, device: str = "cuda", encoding: str = "jsonl") -> Path:
    """A trace file (JSON lines unless ``encoding="binary"``: the JSON fast reader's tests split its lines)."""
    events = tuple(AllocEvent(i, kind, block, size, cat, phase, 0, op, module)
                   for i, (kind, block, size, cat, phase, op, module) in enumerate(rows))
    write_trace(Trace(events, TraceMeta(device=device)), path, encoding=encoding)  # type: ignore[arg-type]
    return path


def _invoke(*args: object):  # type: ignore[no-untyped-def]
    return runner.invoke(app, ["diff", *map(str, args)], env=WIDE)


def test_peak_difference_is_attributed_exactly(tmp_path: Path) -> None:
    a = _write(tmp_path / "bs2.mptrace", _step(2))
    b = _write(tmp_path / "bs4.mptrace", _step(4, extra_workspace=True))
    result = diff_files(a, b)
    # A's peak: 192 MiB of states + 2x16 MiB activations + 6 MiB logits; B: 192 + 2x32 + 32 + 12.
    assert result.a.peak_bytes == (192 + 32 + 6) * MiB
    assert result.b.peak_bytes == (192 + 64 + 32 + 12) * MiB
    by_category = {d.key: d.delta_bytes for d in result.categories}
    assert by_category == {"activation": 32 * MiB, "workspace": 32 * MiB, "logits": 6 * MiB,
                           "parameter": 0, "optimizer_state": 0}
    assert result.categories[0].key in ("activation", "workspace")
    by_module = {d.key: d.delta_bytes for d in result.modules}
    assert by_module["model.layers.1"] == 16 * MiB + 32 * MiB
    assert by_module["(outside any module)"] == 0
    by_site = {d.key: d.delta_bytes for d in result.sites}
    assert by_site["aten.mm.default in lm_head"] == 6 * MiB
    for deltas in result.attributions().values():
        assert sum(d.delta_bytes for d in deltas) == result.peak_delta_bytes


def test_json_deltas_add_up_to_the_peak_difference(tmp_path: Path) -> None:
    a = _write(tmp_path / "a.mptrace", _step(4, extra_workspace=True))
    b = _write(tmp_path / "b.mptrace", _step(1))
    out = _invoke(a, b, "--json")
    assert out.exit_code == 0, out.output
    data = json.loads(out.stdout)
    assert data["peak_delta_bytes"] == data["b"]["peak_bytes"] - data["a"]["peak_bytes"] < 0
    for name in ("categories", "modules", "sites"):
        assert sum(row["delta_bytes"] for row in data[name]) == data["peak_delta_bytes"]
        assert all(row["delta_bytes"] == row["b_bytes"] - row["a_bytes"] for row in data[name])


def test_tables_and_page(tmp_path: Path) -> None:
    a = _write(tmp_path / "a.mptrace", _step(2))
    b = _write(tmp_path / "b.mptrace", _step(4, extra_workspace=True))
    page = tmp_path / "diff.html"
    out = _invoke(a, b, "--html", page, "--top", "1")
    assert out.exit_code == 0, out.output
    assert "peak difference B − A: +70.00 MiB" in out.output
    assert "(aten.mm.default in lm_head, forward of iteration 0)" in out.output  # where each peak falls
    assert "other (" in out.output  # --top 1 folds the rest into one row
    text = page.read_text()
    assert text.count("<polyline") == 2 and text.count("<circle") == 2
    assert "http://" not in text and "https://" not in text and "<script src" not in text
    assert "model.layers.1" in text


def test_fast_reader_agrees_with_read_trace(tmp_path: Path) -> None:
    path = _write(tmp_path / "a.mptrace", _step(3, extra_workspace=True))
    fast = profile_trace_file(path)
    slow = profile_trace(read_trace(path), path=str(path))
    assert fast == slow
    # Another JSON spelling (spaces) is read through read_trace, with the same result.
    spaced = tmp_path / "spaced.jsonl"
    lines = gzip.decompress(path.read_bytes()).decode().splitlines()
    spaced.write_text("\n".join([lines[0], *(json.dumps(json.loads(line)) for line in lines[1:])]) + "\n")
    assert profile_trace_file(spaced).by_site == fast.by_site


def test_binary_trace_reads_as_its_events(tmp_path: Path) -> None:
    rows = [(kind, block, size, cat, phase, 'aten.custom("x, y")', "model.blöck,0") if op else
            (kind, block, size, cat, phase, op, module) for kind, block, size, cat, phase, op, module in _step(3)]
    binary = _write(tmp_path / "b.mptrace", rows, encoding="binary")
    jsonl = _write(tmp_path / "j.mptrace", rows)
    fast = profile_trace_file(binary)
    assert fast == profile_trace(read_trace(binary), path=str(binary))
    assert fast.by_site == profile_trace_file(jsonl).by_site and fast.peak_bytes == profile_trace_file(jsonl).peak_bytes
    assert 'aten.custom("x, y") in model.blöck,0' in fast.by_site


def test_binary_trace_with_unpaired_free_is_refused_like_read_trace(tmp_path: Path) -> None:
    rows = [*_step(1), ("free", 77, 5, "temporary", "forward", "", "")]
    path = _write(tmp_path / "bad.mptrace", rows, encoding="binary")
    with pytest.raises(ConfigError) as expected:
        read_trace(path)
    with pytest.raises(ConfigError) as got:
        profile_trace_file(path)
    assert str(got.value) == str(expected.value) and "freed but not live" in str(got.value)


def test_names_with_escapes_and_commas_are_read_alike(tmp_path: Path) -> None:
    rows = [(kind, block, size, cat, phase, 'aten.custom("x, y")', "model.blöck,0") if op else
            (kind, block, size, cat, phase, op, module) for kind, block, size, cat, phase, op, module in _step(2)]
    path = _write(tmp_path / "odd.mptrace", rows)
    fast = profile_trace_file(path)
    assert fast == profile_trace(read_trace(path), path=str(path))
    assert 'aten.custom("x, y") in model.blöck,0' in fast.by_site


@pytest.mark.parametrize("bad_line", [
    '[9,"alloc",99,5,"no_such_category","forward",0,"","",0]',
    '[9,"free",77,5,"temporary","forward",0,"","",0]',
    '[9,"alloc",1,5,"temporary","forward",0,"","",0]',  # block 1 is still live
    '[9,"alloc",99,-5,"temporary","forward",0,"","",0]',
    'not json',
])
def test_fast_reader_refuses_what_read_trace_refuses(tmp_path: Path, bad_line: str) -> None:
    path = _write(tmp_path / "a.mptrace", _step(1))
    lines = gzip.decompress(path.read_bytes()).decode().splitlines()
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join([*lines[:4], bad_line, *lines[4:]]) + "\n")
    with pytest.raises(ConfigError) as expected:
        read_trace(bad)
    with pytest.raises(ConfigError) as got:
        profile_trace_file(bad)
    assert str(got.value) == str(expected.value)


def test_invalid_utf8_is_refused_like_read_trace(tmp_path: Path) -> None:
    path = _write(tmp_path / "a.mptrace", _step(1))
    lines = gzip.decompress(path.read_bytes()).splitlines()
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b"\n".join([*lines[:4], b'[9,"alloc",99,5,"temporary","forward",0,"\xff","",0]', *lines[4:]]))
    with pytest.raises(ConfigError) as expected:
        read_trace(bad)
    with pytest.raises(ConfigError) as got:
        profile_trace_file(bad)
    assert str(got.value) == str(expected.value)


def test_parallel_reading_gives_the_serial_result(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    a = _write(tmp_path / "a.mptrace", _step(2))
    b = _write(tmp_path / "b.mptrace", _step(5))
    monkeypatch.setattr(diff_files_module, "PARALLEL_MIN_BYTES", 1)
    workers = diff_files_module._parallel((str(a), str(b)), None)
    assert workers == [load_profile(a), load_profile(b)]  # both came back from the worker processes
    assert diff_files(a, b, parallel=True) == diff_files(a, b, parallel=False)


def _snapshot(device: int, sizes: list[int]) -> dict:
    frames = [{"name": "forward", "filename": "/home/u/model.py", "line": 12},
              {"name": "forward", "filename": "/home/u/train.py", "line": 40}]
    traces: list[list[dict]] = [[] for _ in range(device + 1)]
    for i, size in enumerate(sizes):
        traces[device].append({"action": "alloc", "addr": 4096 * (i + 1), "size": size, "stream": 0, "frames": frames})
    return {"segments": [], "device_traces": traces}


def test_snapshots_of_different_devices_exit_2(tmp_path: Path) -> None:
    a, b = tmp_path / "a.pickle", tmp_path / "b.pickle"
    a.write_bytes(pickle.dumps(_snapshot(0, [MiB])))
    b.write_bytes(pickle.dumps(_snapshot(1, [2 * MiB])))
    out = _invoke(a, b)
    assert out.exit_code == 2
    assert out.output.strip().count("\n") == 0 and "device" in out.output and "cuda:1" in out.output
    same = tmp_path / "c.pickle"
    same.write_bytes(pickle.dumps(_snapshot(0, [2 * MiB, MiB])))
    result = diff_files(a, same)
    assert {d.key: d.delta_bytes for d in result.sites} == {"u/model.py:12 forward": 2 * MiB}
    assert result.modules[0].key == "u/train.py:40 > u/model.py forward"


def test_cpu_trace_against_cuda_trace_exit_2(tmp_path: Path) -> None:
    a = _write(tmp_path / "a.mptrace", _step(1))
    b = _write(tmp_path / "b.mptrace", _step(1), device="cpu")
    out = _invoke(a, b)
    assert out.exit_code == 2 and out.output.strip().count("\n") == 0 and "cpu" in out.output


def test_truncated_pickle_exit_2(tmp_path: Path) -> None:
    whole = pickle.dumps(_snapshot(0, [MiB] * 200))
    cut = tmp_path / "cut.pickle"
    cut.write_bytes(whole[: len(whole) // 2])
    good = tmp_path / "good.pickle"
    good.write_bytes(whole)
    out = _invoke(good, cut)
    assert out.exit_code == 2 and out.output.strip().count("\n") == 0
    assert "truncated or corrupt" in out.output


def test_hostile_pickle_exit_2_and_runs_nothing(tmp_path: Path) -> None:
    marker = tmp_path / "created"

    class Evil:
        def __reduce__(self):  # type: ignore[no-untyped-def]
            return (os.system, (f"touch {marker}",))

    evil = tmp_path / "evil.pickle"
    evil.write_bytes(pickle.dumps({"segments": [], "device_traces": [[Evil()]]}))
    good = tmp_path / "good.pickle"
    good.write_bytes(pickle.dumps(_snapshot(0, [MiB])))
    out = _invoke(evil, good)
    assert out.exit_code == 2 and out.output.strip().count("\n") == 0
    assert "refused for safety" in out.output
    assert not marker.exists()


def test_missing_file_and_device_on_a_trace_exit_2(tmp_path: Path) -> None:
    a = _write(tmp_path / "a.mptrace", _step(1))
    assert _invoke(a, tmp_path / "missing.pickle").exit_code == 2
    assert _invoke(a, a, "--device", "1").exit_code == 2


needs_snapshots = pytest.mark.skipif(not SNAPSHOTS.is_dir(), reason="../shared/reference/snapshots not present")


@needs_snapshots
def test_real_snapshots_attribute_exactly() -> None:
    first = SNAPSHOTS / "01_silmont2000_cs336_mem_snapshot.pickle"
    forward = SNAPSHOTS / "02_silmont2000_cs336_forward_bf16_ctx128.pickle"
    result = diff_files(forward, first)
    for deltas in result.attributions().values():
        assert sum(d.delta_bytes for d in deltas) == result.peak_delta_bytes
    # The CS336 step's cuBLAS workspace is recognised from its frames (at::cuda::getNewWorkspace).
    workspace = {d.key: d for d in result.categories}["workspace"]
    assert workspace.b_bytes > 0 and workspace.a_bytes == 0
    # Its peak is in the backward pass, on the autograd thread: sites are autograd nodes there.
    assert any(d.key.startswith("autograd ") and d.b_bytes for d in result.sites)


@needs_snapshots
def test_state_only_snapshot_is_its_dump_time_state() -> None:
    profile = load_profile(SNAPSHOTS / "10_Yiyi_flexgen_opt_oom_state_only.pickle")
    assert set(profile.by_site) == {BEFORE_TRACE}
    assert any("state only" in note for note in profile.notes)


def test_a_trace_and_its_memplan_snapshot_are_the_same(tmp_path: Path) -> None:
    """``memplan trace --snapshot`` writes a snapshot whose frames carry module and operator: the diff is 0."""
    from memplan.trace.snapshot import to_snapshot

    trace_path = _write(tmp_path / "a.mptrace", _step(3, extra_workspace=True))
    snapshot_path = tmp_path / "a.pickle"
    snapshot_path.write_bytes(pickle.dumps(to_snapshot(read_trace(trace_path))))
    result = diff_files(snapshot_path, trace_path)
    assert result.a.peak_bytes == result.b.peak_bytes > 0
    assert all(d.delta_bytes == 0 for deltas in result.attributions().values() for d in deltas)
    assert {d.key for d in result.sites} == {d.key for d in diff_files(trace_path, trace_path).sites}


def test_device_picks_one_device_of_multi_device_snapshots(tmp_path: Path) -> None:
    two = _snapshot(1, [3 * MiB])
    two["device_traces"][0] = _snapshot(0, [MiB, MiB])["device_traces"][0]
    a = tmp_path / "a.pickle"
    a.write_bytes(pickle.dumps(two))
    assert load_profile(a).device == "cuda:0"  # the device with most trace entries by default
    picked = diff_files(a, a, device=1)
    assert picked.a.device == "cuda:1" and picked.a.peak_bytes == 3 * MiB
    for device in ("5", "-1"):
        out = _invoke(a, a, "--device", device)
        assert out.exit_code == 2 and "--device" in out.output and out.output.strip().count("\n") == 0
