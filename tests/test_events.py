"""The shared trace file format: round trip, validation, refusal of newer versions and bad lines."""

import gzip
import json

import pytest

from memplan.errors import ConfigError
from memplan.events import ALLOC, FREE, TRACE_VERSION, AllocEvent, Trace, TraceMeta, read_trace, write_trace


def _trace() -> Trace:
    events = (
        AllocEvent(0, ALLOC, 1, 4096, "parameter", "setup", -1, "aten.empty", "model.wte"),
        AllocEvent(1, ALLOC, 2, 1000, "activation", "forward", 0, "aten.mm.default", "model.h.0"),
        AllocEvent(2, FREE, 2, 1000, "activation", "backward", 0, "aten.mm.default", "model.h.0"),
        AllocEvent(3, ALLOC, 2, 512, "temporary", "optimizer", 0, "aten.add.Tensor", "", 1),
    )
    return Trace(events=events, meta=TraceMeta(device="cpu", iterations=1, extra={"model": "gpt2"}))


def test_round_trip(tmp_path):
    path = tmp_path / "t.mptrace"
    write_trace(_trace(), path)
    back = read_trace(path)
    assert back == _trace()
    assert back.peak_live_bytes == 5096
    assert list(back.live_bytes()) == [4096, 5096, 4096, 4608]


def _write(path, header, lines):
    with gzip.open(path, "wt") as handle:
        handle.write(json.dumps(header) + "\n")
        for line in lines:
            handle.write(line + "\n")


def test_newer_version_is_refused(tmp_path):
    path = tmp_path / "new.mptrace"
    _write(path, {"format": "memplan-trace", "version": TRACE_VERSION + 1, "meta": {}}, [])
    with pytest.raises(ConfigError, match="newer than this memplan reads"):
        read_trace(path)


@pytest.mark.parametrize("line, message", [
    ('[0, "alloc", 1]', "JSON array of 10 fields"),
    ('[0, "grow", 1, 8, "activation", "forward", 0, "", "", 0]', "kind 'alloc'/'free'"),
    ('[0, "alloc", 1, -8, "activation", "forward", 0, "", "", 0]', "size >= 0"),
    ('[0, "alloc", 1, 8, "weights", "forward", 0, "", "", 0]', "category"),
    ('[0, "alloc", 1, 8, "activation", "lunch", 0, "", "", 0]', "phase"),
    ('[0, "alloc", 1, true, "activation", "forward", 0, "", "", 0]', "size >= 0"),
    ('[0, "alloc", 1.5, 8, "activation", "forward", 0, "", "", 0]', "integer block"),
    ('{"kind": "alloc"}', "JSON array of 10 fields"),
    ('[0, "free", 1, 8, "activation", "forward", 0, "", "", 0]', "freed but not live"),
    ("not json", "JSON array"),
])
def test_bad_lines_are_named(tmp_path, line, message):
    path = tmp_path / "bad.mptrace"
    good = '[0, "alloc", 7, 8, "activation", "forward", 0, "", "", 0]'
    _write(path, {"format": "memplan-trace", "version": 1, "meta": {}}, [good, line])
    with pytest.raises(ConfigError, match=message) as caught:
        read_trace(path)
    if "not live" not in message:
        assert "line 3" in str(caught.value)  # the bad line is named, after the header and the good line


def test_blank_lines_and_escaped_strings_read_as_written(tmp_path):
    path = tmp_path / "odd.mptrace"
    module = 'a\\"b,[c]\n'  # a backslash, a quote, a comma, brackets and a newline, JSON-escaped in the file
    lines = [json.dumps([0, "alloc", 1, 8, "activation", "forward", 0, "aten.mm", module, 0]), "",
             json.dumps([1, "free", 1, 8, "activation", "backward", 0, "", "", 0])]
    _write(path, {"format": "memplan-trace", "version": 1, "meta": {}}, lines)
    events = read_trace(path).events
    assert [e.module for e in events] == [module, ""] and [e.index for e in events] == [0, 1]


def test_truncated_and_foreign_files(tmp_path):
    path = tmp_path / "t.mptrace"
    write_trace(_trace(), path)
    data = path.read_bytes()
    (tmp_path / "cut.mptrace").write_bytes(data[: len(data) // 2])
    with pytest.raises(ConfigError, match="trace file"):
        read_trace(tmp_path / "cut.mptrace")
    (tmp_path / "x.json").write_text('{"format": "something-else"}\n')
    with pytest.raises(ConfigError, match="format is 'memplan-trace'"):
        read_trace(tmp_path / "x.json")
    with pytest.raises(ConfigError, match="readable file"):
        read_trace(tmp_path / "missing.mptrace")
