"""CI runs the README's test command, as written, and what that command needs is pinned.

``.ci/run`` must call exactly the README's second quick-start line (a developer who runs the README gets
what CI gets), and the command's pytest plugins (``-n auto``: pytest-xdist) must be installed by the
command itself, from requirements-test.txt.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

ROOT = Path(__file__).parents[1]


def _readme_test_command() -> str:
    block = (ROOT / "README.md").read_text(encoding="utf-8").split("## Quick start", 1)[1].split("```bash\n", 1)[1]
    lines = [line for line in block.split("```", 1)[0].splitlines() if "pytest" in line]
    assert len(lines) == 1, f"the README's quick start should have one test command line, found {lines}"
    return lines[0].strip()


def _pins() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "requirements-test.txt").read_text(encoding="utf-8").splitlines():
        if "==" in line and not line.lstrip().startswith("#"):
            name, version = line.split("#", 1)[0].strip().split("==")
            pins[re.sub(r"[-_.]+", "-", name.lower())] = version
    return pins


def test_ci_runs_the_readme_test_command() -> None:
    command = _readme_test_command()
    ci_lines = [line.strip() for line in (ROOT / ".ci/run").read_text(encoding="utf-8").splitlines()
                if line.strip() and not line.lstrip().startswith("#")]
    assert command in ci_lines, f".ci/run does not run the README's test command: {command}"


def test_the_test_command_runs_in_parallel_with_a_pinned_xdist() -> None:
    args = shlex.split(_readme_test_command().rsplit("&&", 1)[1])
    assert args[:3] == ["python", "-m", "pytest"]
    assert "-n" in args and "--dist" in args, args  # the suite's time target assumes the workers
    pins = _pins()
    assert "pytest-xdist" in pins and "execnet" in pins and "psutil" in pins  # psutil: -n auto counts physical cores
