"""The binary columnar trace encoding: round trips with JSON lines, detection, and every refusal."""

import gzip
import json
import struct
import zlib
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from memplan.categories import MemoryCategory
from memplan.errors import ConfigError
from memplan.events import (
    ALLOC,
    FREE,
    PHASES,
    AllocEvent,
    Trace,
    TraceMeta,
    binary_columns,
    read_trace,
    trace_to_binary,
    write_trace,
)
from memplan.events_binary import ENCODING_VERSION, MAGIC, MAX_EVENTS


def _trace() -> Trace:
    events = (
        AllocEvent(0, ALLOC, 1, 4096, "parameter", "setup", -1, "aten.empty", "model.wte"),
        AllocEvent(1, ALLOC, 2, 1000, "activation", "forward", 0, "aten.mm.default", "model.h.0"),
        AllocEvent(2, FREE, 2, 1000, "activation", "backward", 0, "aten.mm.default", "model.h.0"),
        AllocEvent(3, ALLOC, 2, 2**40, "temporary", "optimizer", 0, "aten.add.Tensor", "blöck \"x\"", 1),
    )
    return Trace(events=events, meta=TraceMeta(device="cpu", iterations=1, extra={"model": "gpt2"}))


def test_mptrace_is_binary_by_default_and_jsonl_by_suffix(tmp_path: Path) -> None:
    binary, jsonl = tmp_path / "t.mptrace", tmp_path / "t.jsonl.gz"
    write_trace(_trace(), binary)
    write_trace(_trace(), jsonl)
    assert binary.read_bytes()[:8] == MAGIC
    assert gzip.decompress(jsonl.read_bytes()).startswith(b'{"format":"memplan-trace"')
    assert read_trace(binary) == read_trace(jsonl) == _trace()
    forced = tmp_path / "forced.mptrace"
    write_trace(_trace(), forced, encoding="jsonl")
    assert forced.read_bytes()[:2] == b"\x1f\x8b" and read_trace(forced) == _trace()


def test_empty_and_single_event_traces_round_trip(tmp_path: Path) -> None:
    for events in ((), (AllocEvent(0, ALLOC, 5, 8),)):
        trace = Trace(events=events)
        write_trace(trace, tmp_path / "t.mptrace")
        assert read_trace(tmp_path / "t.mptrace") == trace


def test_unknown_encoding_and_integers_beyond_64_bits_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="trace encoding: must be one of"):
        write_trace(_trace(), tmp_path / "t.mptrace", encoding="csv")  # type: ignore[arg-type]
    huge = Trace(events=(AllocEvent(0, ALLOC, 2**70, 8), AllocEvent(1, FREE, 2**70, 8)))
    with pytest.raises(ConfigError, match="trace event block: must fit in a signed 64-bit integer"):
        write_trace(huge, tmp_path / "huge.mptrace")
    write_trace(huge, tmp_path / "huge.jsonl.gz")  # the text encoding holds any integer
    assert read_trace(tmp_path / "huge.jsonl.gz") == huge
    flag = Trace(events=(AllocEvent(0, ALLOC, True, 8),))  # not stored as 1 behind the caller's back
    with pytest.raises(ConfigError, match="trace event block: must be an integer"):
        write_trace(flag, tmp_path / "flag.mptrace")


@st.composite
def _traces(draw: st.DrawFn) -> Trace:
    """Valid traces: every free matches a live allocation; any strings for op and module."""
    names = st.text(max_size=12)
    ints = st.integers(-(2**63), 2**63 - 1)
    events: list[AllocEvent] = []
    live: dict[int, int] = {}
    for index in range(draw(st.integers(0, 40))):
        free = bool(live) and draw(st.booleans())
        if free:
            block = draw(st.sampled_from(sorted(live)))
            size = live.pop(block)
        else:
            block = draw(ints.filter(lambda b: b not in live))
            size = live[block] = draw(st.integers(0, 2**63 - 1))
        events.append(AllocEvent(
            draw(st.one_of(st.just(index), ints)), FREE if free else ALLOC, block, size,
            draw(st.sampled_from([c.value for c in MemoryCategory])), draw(st.sampled_from(PHASES)),
            draw(ints), draw(names), draw(names), draw(st.integers(0, 2**40))))
    meta = TraceMeta(device=draw(st.sampled_from(["cuda", "cpu"])), rank=draw(st.integers(0, 7)),
                     extra={"model": draw(names)})
    return Trace(events=tuple(events), meta=meta)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(trace=_traces())
def test_both_encodings_read_back_the_same_trace(tmp_path: Path, trace: Trace) -> None:
    write_trace(trace, tmp_path / "t.mptrace")
    write_trace(trace, tmp_path / "t.jsonl.gz")
    assert read_trace(tmp_path / "t.mptrace") == trace == read_trace(tmp_path / "t.jsonl.gz")


# ----------------------------------------------------------------------------------------------
# Hostile and damaged files: one ConfigError naming the file and the rule


def _header(count: int, version: int = ENCODING_VERSION) -> bytes:
    header = json.dumps({"format": "memplan-trace", "version": 1, "meta": {}}).encode()
    return MAGIC + struct.pack("<II", version, len(header)) + header + struct.pack("<Q", count)


def _column(code: str, values: list[int], table: list[str] | None = None, *, data: bytes | None = None) -> bytes:
    out = code.encode()
    if table is not None:
        packed = zlib.compress(json.dumps(table).encode())
        out += struct.pack("<I", len(packed)) + packed
    blob = zlib.compress(struct.pack(f"<{len(values)}{code}", *values)) if data is None else data
    return out + struct.pack("<Q", len(blob)) + blob


def _file(count: int = 2, **changes: bytes) -> bytes:
    """A hand-built two-event file (alloc then free of block 7); ``changes`` replace named columns."""
    columns = {
        "index": _column("q", [0, 1]), "kind": _column("B", [0, 1], ["alloc", "free"]),
        "block": _column("q", [7, 7]), "size": _column("q", [64, 64]),
        "category": _column("B", [0, 0], ["activation"]), "phase": _column("B", [0, 1], ["forward", "backward"]),
        "iteration": _column("q", [0, 0]), "op": _column("B", [0, 0], [""]), "module": _column("B", [0, 0], [""]),
        "stream": _column("q", [0, 0]),
    }
    columns.update(changes)
    return _header(count) + b"".join(columns.values())


def _refused(tmp_path: Path, data: bytes, match: str) -> str:
    path = tmp_path / "bad.mptrace"
    path.write_bytes(data)
    with pytest.raises(ConfigError, match=match) as caught:
        read_trace(path)
    return str(caught.value)


def test_the_hand_built_file_reads(tmp_path: Path) -> None:
    path = tmp_path / "good.mptrace"
    path.write_bytes(_file())
    assert [(e.kind, e.block, e.size, e.phase) for e in read_trace(path).events] == [
        ("alloc", 7, 64, "forward"), ("free", 7, 64, "backward")]


def test_damaged_magic(tmp_path: Path) -> None:
    message = _refused(tmp_path, b"\x89MPT\n\n\x1a\n" + _file()[8:], "must start with the magic number")
    assert message.startswith("binary trace file: ") and "bad.mptrace" in message


def test_newer_encoding_version(tmp_path: Path) -> None:
    data = _header(2, version=ENCODING_VERSION + 1) + _file()[len(_header(2)):]
    _refused(tmp_path, data, f"encoding version {ENCODING_VERSION + 1}.*upgrade memplan")


@pytest.mark.parametrize("cut", [4, 12, 20, -40, -1])
def test_truncated_anywhere(tmp_path: Path, cut: int) -> None:
    _refused(tmp_path, _file()[:cut], "binary trace file: is truncated: .* needs \\d+ bytes, \\d+ remain")


def test_absurd_event_count(tmp_path: Path) -> None:
    _refused(tmp_path, _file(count=MAX_EVENTS + 1), f"claims {MAX_EVENTS + 1} events")


def test_column_of_the_wrong_length(tmp_path: Path) -> None:
    _refused(tmp_path, _file(count=3), "column 'index' must hold 24 bytes, it holds 16")
    _refused(tmp_path, _file(stream=_column("q", [0, 0, 0])), "column 'stream' must hold 16 bytes, it holds more")


def test_unknown_element_type(tmp_path: Path) -> None:
    _refused(tmp_path, _file(size=_column("d", [0, 0])), "column 'size' must have element type one of")
    _refused(tmp_path, _file(kind=_column("q", [0, 1], ["alloc", "free"])), "column 'kind' must have element type")


def test_bad_zlib_stream(tmp_path: Path) -> None:
    _refused(tmp_path, _file(block=_column("q", [], data=b"not zlib at all")), "column 'block' must be a zlib stream")


def test_bad_tables(tmp_path: Path) -> None:
    _refused(tmp_path, _file(category=_column("B", [0, 0], ["weights"])), "table 'category' must hold only")
    _refused(tmp_path, _file(kind=_column("B", [0, 1], ["alloc", "grow"])), "table 'kind' must hold only")
    not_strings = zlib.compress(b"[1, 2]")
    raw = b"B" + struct.pack("<I", len(not_strings)) + not_strings + _column("B", [0, 0])[1:]
    _refused(tmp_path, _file(op=raw), "table 'op' must be a zlib stream of a JSON array of strings")
    deep = zlib.compress(b"[" * 100_000 + b"]" * 100_000)  # nested past the JSON decoder's recursion limit
    raw = b"B" + struct.pack("<I", len(deep)) + deep + _column("B", [0, 0])[1:]
    _refused(tmp_path, _file(op=raw), "table 'op' must be a zlib stream of a JSON array of strings")


def test_table_that_inflates_too_far(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from memplan import events_binary

    monkeypatch.setattr(events_binary, "MAX_TABLE_BYTES", 1000)
    _refused(tmp_path, _file(module=_column("B", [0, 0], ["m" * 2000])), "table 'module' must inflate to at most 1000")


def test_id_beyond_its_table(tmp_path: Path) -> None:
    _refused(tmp_path, _file(module=_column("B", [0, 3], ["", "m"])), "column 'module' must hold ids below its table's 2")
    _refused(tmp_path, _file(module=_column("H", [0, 300], ["", "m"])), "got 300")


def test_bytes_after_the_last_column(tmp_path: Path) -> None:
    _refused(tmp_path, _file() + b"\x00", "must end after its last column \\(1 bytes follow\\)")


@pytest.mark.parametrize("header, message", [
    (b'{"format": "other"}', "format is 'memplan-trace'"),
    (b"[" * 100_000, "must start with a memplan-trace JSON header line"),
    (b"\xff\xfe", "must have a UTF-8 JSON header"),
])
def test_bad_header(tmp_path: Path, header: bytes, message: str) -> None:
    data = MAGIC + struct.pack("<II", 1, len(header)) + header + _file()[len(_header(2)) - 8:]
    _refused(tmp_path, data, message)


def test_events_are_validated_as_every_trace(tmp_path: Path) -> None:
    _refused(tmp_path, _file(block=_column("q", [7, 8])), "trace event 1 block: is freed but not live")
    _refused(tmp_path, _file(size=_column("q", [64, 32])), "trace event 1 size: must equal the size of its allocation")
    _refused(tmp_path, _file(size=_column("q", [-1, -1])), "trace event 0 size: must be >= 0")


def test_binary_columns_keep_ids_and_tables() -> None:
    meta, cols = binary_columns(trace_to_binary(_trace()), "t")
    assert meta == _trace().meta and cols.count == 4 and cols.tables["kind"] == ("alloc", "free")
    assert list(cols.columns["kind"]) == [0, 0, 1, 0] and cols.columns["size"].typecode in "qlL"


@pytest.mark.parametrize("command", [["doctor"], ["alloc", "simulate"], ["diff"]])
def test_cli_refuses_a_damaged_binary_trace_in_one_line(tmp_path: Path, command: list[str]) -> None:
    from typer.testing import CliRunner

    from memplan.cli import app

    bad = tmp_path / "cut.mptrace"
    bad.write_bytes(_file()[:-1])
    inputs = [str(bad), str(bad)] if command == ["diff"] else [str(bad)]
    result = CliRunner().invoke(app, [*command, *inputs], env={"COLUMNS": "300", "NO_COLOR": "1"})
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "binary trace file: is truncated" in lines[0] and "cut.mptrace" in lines[0]
