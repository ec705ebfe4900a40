"""Files that are not text (binary, compressed, empty, a directory) given to any input flag: one
``error:`` line naming the flag, the rule and the path, exit 2, never a traceback."""

from __future__ import annotations

import gzip
from collections.abc import Callable
from pathlib import Path

import pytest
from typer.testing import CliRunner

from memplan.cli import app

runner = CliRunner()


def _binary(path: Path) -> Path:
    path.write_bytes(bytes(range(256)))
    return path


def _gzip(path: Path) -> Path:
    path.write_bytes(gzip.compress(b'{"num_layers": 2}'))
    return path


def _latin1(path: Path) -> Path:
    path.write_bytes("# caf\u00e9\n--num-layers 2\n".encode("latin-1"))
    return path


def _empty(path: Path) -> Path:
    path.write_text(" \n\n")
    return path


def _directory(path: Path) -> Path:
    path.mkdir()
    return path


BAD_FILES: dict[str, tuple[Callable[[Path], Path], str]] = {
    "binary": (_binary, "is a binary file, not text"),
    "gzip": (_gzip, "is a gzip-compressed file, not text"),
    "latin-1": (_latin1, "is not UTF-8 text"),
    "empty": (_empty, "is empty"),
    "directory": (_directory, "is a directory, not a file"),
}

#: How each input flag is given a path, and the name its error line starts with.
FLAGS: dict[str, tuple[Callable[[str], list[str]], str]] = {
    "megatron-args": (lambda p: ["estimate", "--megatron-args", p], "--megatron-args"),
    "deepspeed-config": (lambda p: ["estimate", "llama-3.2-1b", "--deepspeed-config", p], "--deepspeed-config"),
    "job": (lambda p: ["estimate", "--job", p], "--job"),
    "config-json": (lambda p: ["estimate", p], "model"),
}


@pytest.mark.parametrize("kind", list(BAD_FILES))
@pytest.mark.parametrize("flag", list(FLAGS))
def test_unreadable_input_file_is_one_line(tmp_path: Path, flag: str, kind: str) -> None:
    make, rule = BAD_FILES[kind]
    args, field = FLAGS[flag]
    if flag == "config-json" and kind == "directory":
        # A directory is how a Hub snapshot is given: the config.json inside it is read.
        folder = _directory(tmp_path / "model")
        path = _binary(folder / "config.json")
        rule = "is a binary file, not text"
    else:
        path = make(tmp_path / "input.json")
    result = runner.invoke(app, args(str(path)), env={"COLUMNS": "400", "NO_COLOR": "1"})
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"error: {field}: {rule}")
    assert str(path) in lines[0]


def test_reads_stop_at_their_cap(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """An endless stream or a gzip bomb is refused at the cap, having read no more than the cap."""
    import gzip
    import zlib

    import pytest

    from memplan.errors import ConfigError
    from memplan.textfile import read_binary_file, read_capped, read_inflated

    with pytest.raises(ConfigError, match="binary file"):
        read_capped("/dev/zero", field="--job")
    with pytest.raises(ConfigError, match="larger than 1,000 bytes"):
        read_binary_file("/dev/zero", field="trace file", limit=1000, limit_name="X")
    squeeze = zlib.compressobj(9, zlib.DEFLATED, 31)
    bomb = b"".join(squeeze.compress(b"\n" * (1 << 20)) for _ in range(64)) + squeeze.flush()
    (tmp_path / "bomb.gz").write_bytes(bomb)
    assert len(bomb) < 1 << 20
    with pytest.raises(ConfigError, match="inflates to more than 1,048,576 bytes"):
        read_inflated(tmp_path / "bomb.gz", field="trace file", limit=1 << 20, limit_name="MAX_TRACE_BYTES")
    (tmp_path / "small.gz").write_bytes(gzip.compress(b"hello"))
    assert read_inflated(tmp_path / "small.gz", field="f", limit=100, limit_name="X") == b"hello"


def test_write_atomic_writes_text_bytes_and_by_function(tmp_path):
    from memplan.textfile import write_atomic

    write_atomic(tmp_path / "a.txt", "é\n")
    write_atomic(tmp_path / "b.bin", b"\x00\x01")
    write_atomic(tmp_path / "c.npy", lambda partial: partial.write_text(partial.suffix), suffix=".npy")
    assert (tmp_path / "a.txt").read_text(encoding="utf-8") == "é\n"
    assert (tmp_path / "b.bin").read_bytes() == b"\x00\x01" and (tmp_path / "c.npy").read_text() == ".npy"
    assert (tmp_path / "a.txt").stat().st_mode & 0o777 == 0o644
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "b.bin", "c.npy"]


def test_write_atomic_failure_keeps_the_old_file_and_leaves_nothing(tmp_path):
    import pytest

    from memplan.textfile import write_atomic

    target = tmp_path / "out.yaml"
    target.write_text("old")

    def half_then_fail(partial):
        partial.write_text("half")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        write_atomic(target, half_then_fail)
    assert target.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["out.yaml"]
