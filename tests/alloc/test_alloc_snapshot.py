"""Snapshot loading: the restricted unpickler, truncated files, conversion to a memplan trace."""

from __future__ import annotations

import os
import pickle

import pytest
from alloc_reference import SNAPSHOTS

from memplan.alloc.snapshot import load_snapshot, safe_loads, snapshot_to_trace
from memplan.errors import ConfigError
from memplan.events import validate_events


class _Hostile:
    """Unpickling this would create a file through os.system."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def test_hostile_pickle_is_refused_without_running_anything(tmp_path):
    marker = tmp_path / "pwned"
    bad = tmp_path / "evil.pickle"
    bad.write_bytes(pickle.dumps({"segments": [], "device_traces": [[_Hostile(str(marker))]]}))
    with pytest.raises(ConfigError, match="refused for safety"):
        load_snapshot(bad)
    assert not marker.exists()


def test_pickle_of_any_class_is_refused():
    with pytest.raises(ConfigError):
        safe_loads(pickle.dumps({"segments": [], "x": ConfigError("a", "b")}))


@pytest.mark.parametrize("path", SNAPSHOTS[:2], ids=lambda p: p.name)
def test_truncated_snapshot_is_a_clear_error(tmp_path, path):
    cut = tmp_path / "cut.pickle"
    cut.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(ConfigError, match="truncated or corrupt"):
        load_snapshot(cut)


def test_not_a_snapshot_is_refused(tmp_path):
    other = tmp_path / "list.pickle"
    other.write_bytes(pickle.dumps({"hello": 1}))
    with pytest.raises(ConfigError, match="segments"):
        load_snapshot(other)


@pytest.mark.parametrize("path", SNAPSHOTS, ids=lambda p: p.name)
def test_every_real_snapshot_loads_and_converts(path):
    snapshot = load_snapshot(path)
    assert snapshot.segments
    trace = snapshot_to_trace(snapshot)
    validate_events(trace.events)
    assert trace.meta.source == "cuda snapshot"
    # every block active at dump time is live at the end of the trace, with its requested size
    active = sum(b.requested_size for s in snapshot.segments for b in s.blocks if b.state == "active_allocated")
    live = list(trace.live_bytes())[-1]
    assert live == active


@pytest.mark.skipif(not SNAPSHOTS, reason="no real snapshots in ../shared/reference/snapshots")
def test_allocator_settings_are_read():
    snapshot = load_snapshot(SNAPSHOTS[0])
    assert snapshot.settings is not None
    assert snapshot.settings.expandable_segments is False
