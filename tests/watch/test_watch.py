"""``memplan.watch``: on an out-of-memory error, the snapshot and the report are written before it propagates.

No GPU here: the hooks replay a recorded snapshot (the shape ``torch.cuda.memory._snapshot()``
returns), and the OOM is simulated the way the caching allocator produces it — the observer is
called with ``(device, alloc_size, device_total, device_free)``, then ``torch.OutOfMemoryError``
is raised. Everything after that (snapshot file, report files, the note on the exception) is
the real code path.
"""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

import memplan
from memplan.alloc.snapshot import safe_loads
from memplan.diff import load_profile
from memplan.doctor import diagnose
from memplan.errors import ConfigError
from memplan.watch import OomRecord, Watch
from memplan.watch.hooks import cuda_unavailable_reason

torch = pytest.importorskip("torch")

GiB, MiB = 2**30, 2**20
SNAPSHOTS = Path(__file__).resolve().parents[3] / "shared" / "reference" / "snapshots"
MESSAGE = ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.11 GiB of which "
           "1.20 GiB is free. Of the allocated memory 70.00 GiB is allocated by PyTorch, and 6.00 GiB is reserved "
           "by PyTorch but unallocated.")
_FRAMES = [{"name": "forward", "filename": "/home/u/model.py", "line": 54},
           {"name": "_call_impl", "filename": "/venv/lib/python3.11/site-packages/torch/nn/modules/module.py",
            "line": 1790},
           {"name": "train_step", "filename": "/home/u/train.py", "line": 88}]


def _recorded_snapshot() -> dict[str, Any]:
    """Two segments on device 0: 70 GiB active, 6 GiB free inside them; the trace ends in the OOM."""
    segments = [
        {"device": 0, "address": 0x7F0000000000, "total_size": 64 * GiB, "stream": 0, "segment_type": "large",
         "blocks": [{"address": 0x7F0000000000, "size": 60 * GiB, "requested_size": 60 * GiB - 512,
                     "state": "active_allocated", "frames": _FRAMES},
                    {"address": 0x7F0000000000 + 60 * GiB, "size": 4 * GiB, "requested_size": 4 * GiB,
                     "state": "inactive", "frames": []}]},
        {"device": 0, "address": 0x7E0000000000, "total_size": 12 * GiB, "stream": 0, "segment_type": "large",
         "blocks": [{"address": 0x7E0000000000, "size": 10 * GiB, "requested_size": 10 * GiB,
                     "state": "active_allocated", "frames": _FRAMES[2:]},
                    {"address": 0x7E0000000000 + 10 * GiB, "size": 2 * GiB, "requested_size": 2 * GiB,
                     "state": "inactive", "frames": []}]},
    ]
    trace = [{"action": "alloc", "addr": 0x7E0000000000, "size": 10 * GiB, "stream": 0, "frames": _FRAMES[2:]},
             {"action": "oom", "addr": int(1.2 * GiB), "size": 2 * GiB, "stream": 0, "frames": _FRAMES}]
    return {"segments": segments, "device_traces": [trace]}


class ReplayHooks:
    """Stands in for ``torch.cuda``'s hooks: gives back a recorded snapshot, keeps the observer."""

    def __init__(self, snapshot: Mapping[str, Any] | None = None, *, fail: bool = False) -> None:
        self.recorded = snapshot if snapshot is not None else _recorded_snapshot()
        self.fail = fail
        self.calls: list[tuple[str, Any]] = []
        self.observer: Any = None

    def start(self, *, max_entries: int, stacks: str) -> None:
        self.calls.append(("start", (max_entries, stacks)))

    def stop(self) -> None:
        self.calls.append(("stop", None))

    def snapshot(self) -> Mapping[str, Any]:
        if self.fail:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return self.recorded

    def attach_oom_observer(self, observer: Any) -> None:
        self.observer = observer


def _oom_now(hooks: ReplayHooks) -> None:
    """What the caching allocator does when a 2 GiB request fails on an 80 GB card with 1.2 GiB free."""
    hooks.observer(0, 2 * GiB, 85_520_809_984, int(1.2 * GiB))
    raise torch.OutOfMemoryError(MESSAGE)


def test_observer_writes_snapshot_and_report(tmp_path: Path) -> None:
    hooks = ReplayHooks()
    watcher = memplan.watch(tmp_path / "oom", hooks=hooks, max_entries=5000)
    assert watcher.active and hooks.calls == [("start", (5000, "all"))]
    hooks.observer(0, 2 * GiB, 85_520_809_984, int(1.2 * GiB))
    (record,) = watcher.records
    assert record.snapshot_path is not None and record.snapshot_path.parent == tmp_path / "oom"
    assert safe_loads(record.snapshot_path.read_bytes()) == hooks.recorded  # readable without pickle.load
    data = json.loads(record.json_path.read_text())
    assert data["oom"] == {"device": 0, "requested_bytes": 2 * GiB, "device_total_bytes": 85_520_809_984,
                           "device_free_bytes": int(1.2 * GiB)}
    state = data["state"]
    assert state["reserved_bytes"] == 76 * GiB and state["allocated_bytes"] == 70 * GiB
    assert state["reserved_unallocated_bytes"] == 6 * GiB and state["largest_free_block_bytes"] == 4 * GiB
    assert state["outside_pytorch_bytes"] == 85_520_809_984 - 76 * GiB - int(1.2 * GiB)
    assert state["top_sites"][0] == {"site": "u/model.py:54 forward", "bytes": 60 * GiB}
    assert data["kind"] == "memplan.watch report" and "memplan doctor" in data["note"]
    assert data["doctor"]["verdict"] == diagnose(snapshot=hooks.recorded, capacity_bytes=85_520_809_984).to_json()[
        "verdict"]
    text = record.report_path.read_text()
    assert "u/model.py:54 forward" in text and "verdict" in text
    # memplan diff reads what the watch wrote.
    assert load_profile(record.snapshot_path).device == "cuda:0"
    watcher.stop()
    assert hooks.calls[-1] == ("stop", None)


def test_context_manager_adds_the_message_and_a_note(tmp_path: Path) -> None:
    hooks = ReplayHooks()
    with pytest.raises(torch.OutOfMemoryError) as caught, Watch(tmp_path, hooks=hooks) as watcher:
        _oom_now(hooks)
    (record,) = watcher.records  # one OOM, one set of files: the observer's, completed on the way out
    data = json.loads(record.json_path.read_text())
    assert data["message"] == MESSAGE
    # The doctor read the message's figures once the exception was seen.
    assert data["doctor"] is not None and any(e["source"] == "message" for e in data["doctor"]["evidence"])
    assert f"error: {MESSAGE}" in record.report_path.read_text()
    assert any(str(record.snapshot_path) in note for note in caught.value.__notes__)
    assert str(caught.value) == MESSAGE and not watcher.active and hooks.calls[-1] == ("stop", None)


def test_oom_without_observer_call_is_caught_on_the_way_out(tmp_path: Path) -> None:
    hooks = ReplayHooks()
    with pytest.raises(torch.OutOfMemoryError), Watch(tmp_path, hooks=hooks) as watcher:
        raise torch.OutOfMemoryError(MESSAGE)
    (record,) = watcher.records
    data = json.loads(record.json_path.read_text())
    assert data["oom"] is None and data["message"] == MESSAGE and data["state"]["reserved_bytes"] == 76 * GiB


def test_other_errors_write_nothing(tmp_path: Path) -> None:
    hooks = ReplayHooks()
    with pytest.raises(ValueError, match="shape"), Watch(tmp_path, hooks=hooks) as watcher:
        raise ValueError("shape mismatch")
    assert watcher.records == [] and list(tmp_path.iterdir()) == [] and not watcher.active


def test_at_most_max_reports_and_the_callback(tmp_path: Path) -> None:
    hooks = ReplayHooks()
    seen: list[OomRecord] = []
    watcher = memplan.watch(tmp_path, hooks=hooks, max_reports=1, on_oom=seen.append)
    for _ in range(3):  # a retry loop that catches its OOMs
        try:
            _oom_now(hooks)
        except torch.OutOfMemoryError:
            pass
    assert len(watcher.records) == 1 and seen == watcher.records
    assert len(list(tmp_path.glob("*.pickle"))) == 1
    with pytest.raises(torch.OutOfMemoryError), watcher:  # a later OOM is not put in the first one's report
        _oom_now(hooks)
    assert watcher.records[0].report["message"] == ""


def test_a_failing_snapshot_never_replaces_the_oom(tmp_path: Path) -> None:
    hooks = ReplayHooks(fail=True)
    with pytest.raises(torch.OutOfMemoryError), Watch(tmp_path, hooks=hooks) as watcher:
        _oom_now(hooks)
    (record,) = watcher.records
    assert record.snapshot_path is None and list(tmp_path.glob("*.pickle")) == []
    data = json.loads(record.json_path.read_text())
    assert "illegal memory access" in data["problems"][0] and data["oom"]["requested_bytes"] == 2 * GiB


def test_disarmed_after_stop(tmp_path: Path) -> None:
    hooks = ReplayHooks()
    watcher = memplan.watch(tmp_path, hooks=hooks)
    watcher.stop()
    hooks.observer(0, 2 * GiB, 80 * GiB, GiB)  # PyTorch cannot detach it: it must do nothing
    assert watcher.records == [] and list(tmp_path.iterdir()) == []


@pytest.mark.skipif(cuda_unavailable_reason() is None, reason="a CUDA device is present")
def test_without_cuda_it_warns_and_lets_errors_through(tmp_path: Path) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        watcher = memplan.watch(tmp_path / "never")
        assert not watcher.active and "records nothing" in str(caught[0].message)
        with pytest.raises(torch.OutOfMemoryError), watcher:
            raise torch.OutOfMemoryError(MESSAGE)
    assert len(caught) == 1  # warned once, not again on entering the block
    assert not (tmp_path / "never").exists()


def test_bad_arguments_name_the_field(tmp_path: Path) -> None:
    for kwargs, field in (({"max_entries": 0}, "max_entries"), ({"stacks": "cpp"}, "stacks"),
                          ({"max_reports": 0}, "max_reports")):
        with pytest.raises(ConfigError, match=field):
            Watch(tmp_path, **kwargs)


def test_importing_watch_imports_no_torch() -> None:
    code = ("import sys, memplan\nw = memplan.watch\nassert callable(w)\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr


@pytest.mark.skipif(not SNAPSHOTS.is_dir(), reason="../shared/reference/snapshots not present")
def test_a_real_recorded_snapshot(tmp_path: Path) -> None:
    recorded = safe_loads((SNAPSHOTS / "01_silmont2000_cs336_mem_snapshot.pickle").read_bytes())
    hooks = ReplayHooks(recorded)
    with pytest.raises(torch.OutOfMemoryError), Watch(tmp_path, hooks=hooks) as watcher:
        _oom_now(hooks)
    state = watcher.records[0].report["state"]
    assert state["reserved_bytes"] == sum(s["total_size"] for s in recorded["segments"])
    assert state["segments"] == len(recorded["segments"]) and state["top_sites"]
