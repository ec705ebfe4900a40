"""numpy and matplotlib are optional: the core works without them, and a feature that needs one
says so in one line (exit 1) naming the ``memplan[extra]`` that installs it.

Absence is simulated in a subprocess with ``sys.modules[name] = None`` (``import name`` then
raises ModuleNotFoundError, as when the package is not installed).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import memplan
from memplan.events import AllocEvent, Trace, write_trace

MiB = 2**20
SRC = str(Path(memplan.__file__).resolve().parents[1])


def _synthetic_trace(path: Path) -> Path:
    """Blocks of mixed sizes allocated, then freed in a different order, over three rounds."""
    events, index, block = [], 0, 0
    for r in range(3):
        live = []
        for size in (3, 30, 7, 64, 5, 12):
            events.append(AllocEvent(index, "alloc", block, size * MiB + 512 * r, "activation", "forward", r))
            live.append((block, size * MiB + 512 * r))
            index, block = index + 1, block + 1
        for b, size in live[::2] + live[1::2]:
            events.append(AllocEvent(index, "free", b, size, "activation", "backward", r))
            index += 1
    write_trace(Trace(events=tuple(events)), path)
    return path


def _run_without(missing: tuple[str, ...], *args: str, timeout: int = 120) -> subprocess.CompletedProcess[str]:
    code = (
        "import sys\n"
        f"for name in {missing!r}:\n    sys.modules[name] = None\n"
        f"sys.argv = ['memplan', *{list(args)!r}]\n"
        "from memplan.cli import main\n"
        "main()\n"
    )
    env = {**os.environ, "PYTHONPATH": SRC, "NO_COLOR": "1", "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout,
                          env=env, check=False)


def _assert_needs(done: subprocess.CompletedProcess[str], feature: str, package: str, extra: str) -> None:
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines() == [
        f"error: {feature} needs {package}; install it with pip install 'memplan[{extra}]'"
    ]


@pytest.fixture(scope="module")
def trace_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _synthetic_trace(tmp_path_factory.mktemp("optional") / "small.mptrace")


def test_importing_alloc_and_the_report_data_imports_no_numpy() -> None:
    code = "import sys, memplan.alloc, memplan.report.trace_data; print('numpy' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": SRC}, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


def test_simulate_and_report_trace_work_without_numpy_or_matplotlib(trace_file: Path, tmp_path: Path) -> None:
    done = _run_without(("numpy", "matplotlib"), "alloc", "simulate", str(trace_file), "--json")
    assert done.returncode == 0, done.stderr
    assert '"peak_reserved_bytes"' in done.stdout
    out = tmp_path / "report.html"
    done = _run_without(("numpy", "matplotlib"), "report", "llama-3.2-1b", "--trace", str(trace_file), "-o", str(out))
    assert done.returncode == 0, done.stderr
    assert "<svg" in out.read_text()


@pytest.mark.parametrize("args", [["compare"], ["plan", "-o", "{tmp}/plan.json"]], ids=["compare", "plan"])
def test_static_plan_needs_numpy(args: list[str], trace_file: Path, tmp_path: Path) -> None:
    argv = ["alloc", args[0], str(trace_file), *[a.format(tmp=tmp_path) for a in args[1:]]]
    _assert_needs(_run_without(("numpy",), *argv), "the static plan (memplan alloc plan, alloc compare)",
                  "numpy", "alloc")


def test_minimalloc_csv_plan_needs_numpy(tmp_path: Path) -> None:
    csv = tmp_path / "buffers.csv"
    csv.write_text("id,lower,upper,size\n0,0,10,600\n1,5,15,300\n")
    done = _run_without(("numpy",), "alloc", "plan", str(csv), "-o", str(tmp_path / "out.csv"))
    _assert_needs(done, "the DSA solver (memplan alloc plan)", "numpy", "alloc")


def test_fit_plot_needs_matplotlib(tmp_path: Path) -> None:
    done = _run_without(("matplotlib",), "fit", "llama-3.2-1b", "--gpus", "8", "--max-mbs",
                        "--plot", str(tmp_path / "curve.png"))
    _assert_needs(done, "--plot (the memory-curve PNG)", "matplotlib", "plot")


def test_ckpt_needs_numpy(tmp_path: Path) -> None:
    _assert_needs(_run_without(("numpy",), "ckpt", "profile", "llama-3.2-1b"), "memplan ckpt", "numpy", "ckpt")


def test_trace_needs_torch() -> None:
    _assert_needs(_run_without(("torch",), "trace", "llama-3.2-1b", "--seq", "32"), "memplan trace", "torch", "trace")


def test_trace_plot_needs_matplotlib(trace_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from memplan.errors import MissingDependencyError
    from memplan.events import read_trace
    from memplan.trace.plot import plot_timeline

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(MissingDependencyError, match=r"^--plot \(the timeline PNG\) needs matplotlib; "
                                                     r"install it with pip install 'memplan\[plot\]'$"):
        plot_timeline(read_trace(trace_file), tmp_path / "timeline.png")


def test_trace_plot_without_matplotlib_is_refused_before_the_trace(tmp_path: Path) -> None:
    done = _run_without(("matplotlib",), "trace", "llama-3.2-1b", "--seq", "32", "--plot", str(tmp_path / "t.png"))
    _assert_needs(done, "--plot (the timeline PNG)", "matplotlib", "plot")  # no "tracing ..." line first


def test_trace_peft_needs_peft(tmp_path: Path) -> None:
    done = _run_without(("peft",), "trace", "llama-3.2-1b", "--seq", "32", "--peft", "lora")
    _assert_needs(done, "--peft (memplan trace)", "peft", "finetune")


@pytest.mark.parametrize("package", ["starlette", "uvicorn"])
def test_serve_without_its_extra_names_it(package: str) -> None:
    done = _run_without((package,), "serve", "--port", "0")
    _assert_needs(done, "memplan serve", package, "serve")
