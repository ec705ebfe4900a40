"""Replaying real snapshots: the simulator must make the allocator's own decisions.

Match rates measured (teacher-forced and free-running alike): 01: 36/36 allocs, 9/9 segment
allocs; 02: 937/937; 03: 1721/1721; 04: 2162/2162; 10 has no trace (state only). The final block
layout of every segment equals the dump's. See docs/alloc.md.
"""

from __future__ import annotations

import pytest
from alloc_reference import SNAPSHOTS

from memplan.alloc.fidelity import replay_snapshot
from memplan.alloc.settings import AllocatorSettings
from memplan.alloc.snapshot import load_snapshot

WITH_TRACE = [p for p in SNAPSHOTS if load_snapshot(p).has_trace]
pytestmark = pytest.mark.skipif(not WITH_TRACE, reason="no real snapshots in ../shared/reference/snapshots")


@pytest.mark.parametrize("path", WITH_TRACE, ids=lambda p: p.name)
@pytest.mark.parametrize("forced", [True, False], ids=["teacher-forced", "free-running"])
def test_snapshot_replay_matches_every_decision(path, forced):
    report = replay_snapshot(load_snapshot(path), teacher_forcing=forced)
    print(f"{path.name}: {report.alloc_matches}/{report.allocs} allocs, "
          f"{len(report.recorded_segment_events)} segment events, layout {report.segments_matching}/"
          f"{report.segments_compared}")
    assert report.allocs > 0
    assert report.alloc_match_rate == 1.0
    assert report.segment_sequence_match
    assert report.layout_match_rate == 1.0
    assert report.unplaceable == 0


def test_snapshot_replay_from_empty_reproduces_segment_allocs():
    report = replay_snapshot(load_snapshot(SNAPSHOTS[0]))
    assert report.starts_empty
    assert [e[0] for e in report.recorded_segment_events] == ["segment_alloc"] * 9
    assert report.forced_segments == 0


@pytest.mark.parametrize("conf", ["roundup_power2_divisions:4", "max_split_size_mb:64"])
def test_wrong_settings_are_detected(conf):
    """The fidelity check can fail: other allocator settings change the decisions."""
    rates = [replay_snapshot(load_snapshot(p), AllocatorSettings.parse(conf)).alloc_match_rate
             for p in WITH_TRACE]
    assert min(rates) < 1.0
