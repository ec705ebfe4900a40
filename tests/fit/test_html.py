"""The HTML report: self-contained, and it renders in a real browser (headless Chromium)."""

from __future__ import annotations

import re
import shutil
import struct
import subprocess
import zlib
from pathlib import Path

import pytest

from memplan import Job, Parallelism, Sharding, estimate, get_gpu, load_model
from memplan.fit import fit
from memplan.report.html import render_html

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
TITLE = "memplan report: test"


def _report() -> str:
    model = load_model("llama-3.1-8b")
    est = estimate(model, Job(parallel=Parallelism(world_size=8, pp=4), sharding=Sharding(distributed_optimizer=True)),
                   gpu=get_gpu("h100-80gb"))
    timeline = [(i, {"parameter": 8 * 2**30, "activation": i * 2**28, "temporary": (i % 4) * 2**27}) for i in range(50)]
    segments = [{"address": 0x7F0000000000 + i * 2**26, "size": 2**25,
                 "blocks": [{"offset": 0, "size": 2**24, "allocated": True, "category": "activation"},
                            {"offset": 2**24, "size": 2**24, "allocated": False}]} for i in range(5)]
    return render_html(title=TITLE, estimate=est, fit=fit(model, gpus=8), timeline=timeline, segments=segments)


def test_report_is_self_contained() -> None:
    page = _report()
    assert "<svg" in page and "<style>" in page and "<script>" in page
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page), "no external resources"
    assert "@import" not in page and "url(" not in page
    for section in ("Per-stage memory", "Configurations that fit", "Memory timeline by category", "Allocator segments"):
        assert section in page


def test_sections_are_optional() -> None:
    page = render_html(title="empty")
    assert "<title>empty</title>" in page and "<svg" not in page


def _png_pixels(path: Path) -> tuple[int, int, int, bytes]:
    """(width, height, bytes per pixel, unfiltered rows) of an 8-bit non-interlaced PNG."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, header = 8, b"", None
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        chunk = data[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", chunk)
        elif kind == b"IDAT":
            idat += chunk
        pos += 12 + length
    assert header is not None
    width, height, depth, color, _, _, interlace = header
    assert depth == 8 and interlace == 0
    bpp = {2: 3, 6: 4, 0: 1, 4: 2}[color]
    raw = zlib.decompress(idat)
    stride = width * bpp
    out = bytearray()
    prev = bytearray(stride)
    for y in range(height):
        filt, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        for x in range(stride):
            a = line[x - bpp] if x >= bpp else 0
            b, c = prev[x], prev[x - bpp] if x >= bpp else 0
            if filt == 1:
                line[x] = (line[x] + a) & 255
            elif filt == 2:
                line[x] = (line[x] + b) & 255
            elif filt == 3:
                line[x] = (line[x] + (a + b) // 2) & 255
            elif filt == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[x] = (line[x] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        out += line
        prev = line
    return width, height, bpp, bytes(out)


def _chromium(tmp_path: Path, page: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    assert CHROMIUM is not None
    args = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync",
            f"--user-data-dir={tmp_path / 'profile'}", "--enable-logging=stderr", "--v=0", *extra, page.as_uri()]
    return subprocess.run(args, check=False, capture_output=True, text=True, timeout=120)


def _console_errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "CONSOLE" in line and ("Uncaught" in line or "Error" in line)]


needs_chromium = pytest.mark.skipif(
    CHROMIUM is None, reason="Chromium is not installed (Debian: apt-get install -y chromium); .ci/run installs it")


@needs_chromium
def test_console_error_detection_works(tmp_path: Path) -> None:
    """Negative control: a page with a script error must be caught by the same check."""
    bad = tmp_path / "bad.html"
    bad.write_text("<html><head><title>bad</title></head><body><script>notAFunction();</script></body></html>")
    run = _chromium(tmp_path, bad, f"--screenshot={tmp_path / 'bad.png'}")
    assert _console_errors(run.stderr), run.stderr[-2000:]


@needs_chromium
def test_report_renders_in_chromium(tmp_path: Path) -> None:
    page = tmp_path / "report.html"
    page.write_text(_report(), encoding="utf-8")
    shot = tmp_path / "shot.png"
    run = _chromium(tmp_path, page, f"--screenshot={shot}", "--window-size=1000,1400")
    assert run.returncode == 0, run.stderr[-2000:]
    assert not _console_errors(run.stderr), _console_errors(run.stderr)
    width, height, bpp, pixels = _png_pixels(shot)
    assert (width, height) == (1000, 1400)
    colours = {pixels[i:i + 3] for i in range(0, len(pixels), bpp * 7)}
    assert len(colours) > 20, "the screenshot must not be blank"
    white = sum(1 for i in range(0, len(pixels), bpp) if pixels[i:i + 3] == b"\xff\xff\xff")
    assert white < 0.97 * width * height
    dom = _chromium(tmp_path, page, "--dump-dom")
    assert f"<title>{TITLE}</title>" in dom.stdout
    assert not _console_errors(dom.stderr)
