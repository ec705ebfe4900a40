"""ruff's default rules (pyflakes and pycodestyle's errors: unused or undefined names, ambiguous names, statements
run together) hold on the whole tree: src, tests and benchmarks. The rules and the tests' one exception live in
pyproject.toml; ruff is pinned in requirements-test.txt."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("ruff")

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_finds_nothing() -> None:
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise",
                           "src", "tests", "benchmarks"], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
