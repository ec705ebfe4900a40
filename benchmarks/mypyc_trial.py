"""Issue 24's feasibility trial: does compiling the estimator's fixed path with mypyc reach 12,000 new-job
``estimate()`` calls/s (3x the interpreter on this machine)? A measurement, not a build: nothing compiled ships.

Run from the repository root (needs ``pip install mypy==2.4.1``, which brings mypyc, and a C compiler;
about 13 minutes of compiling on two shared cores)::

    python benchmarks/mypyc_trial.py [--write] [--keep DIR]

What is compiled (fixed before the results were seen): the modules the new-job estimate of speed.py's
``RATE_CASE`` spends its time in by cProfile -- every module of ``estimate/`` except the ``reserved_*`` ones
(kept interpreted: other work owns them), ``job``, ``jobcheck``, ``policies``, ``profiles.defaults``,
``profiles.framework``, ``model.params`` and ``units``. ``model.spec`` stays interpreted: compiled code reads a
``functools.cached_property`` through its getter on every access (``ModelSpec.total_parameters`` recounted the
model on every estimate: 2.02 M instructions per new-job estimate against 1.06 M interpreted).

mypyc compiles a class to a native class (C struct fields, direct attribute reads) only when its decorator is
``dataclasses.dataclass``; :func:`memplan.frozen.frozen_dataclass` classes would stay Python classes. In a copy
of ``src`` the compiled modules' ``@frozen_dataclass`` therefore become ``@dataclass(frozen=True)`` (the same
fields, equality, hash and frozenness); the working tree is not touched.

Measured against the same copy's source interpreted (the working tree's ``src``): callgrind instructions per
new-job estimate (speed.py's ``callgrind``, which the load does not move), and speed.py's ``RATE_CASE`` in
alternating runs (wall and CPU calls/s: same job memoised, and a new job each call). ``--write`` stores
``benchmarks/results/mypyc_trial.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from speed import RATE_CASE, _timed, callgrind

ROOT = Path(__file__).resolve().parents[1]
RESULT = ROOT / "benchmarks" / "results" / "mypyc_trial.json"
OTHER_MODULES = ["job.py", "jobcheck.py", "policies/__init__.py", "profiles/defaults.py", "profiles/framework.py",
                 "model/params.py", "units.py"]
RATE_RUNS = 5


def compiled_modules() -> list[str]:
    """Paths under ``src/`` of the compiled modules (module doc)."""
    estimate = sorted(p.name for p in (ROOT / "src" / "memplan" / "estimate").glob("*.py")
                      if not p.name.startswith("reserved_"))
    return [f"memplan/estimate/{name}" for name in estimate] + [f"memplan/{name}" for name in OTHER_MODULES]


def native_classes(path: Path) -> int:
    """Make ``path``'s frozen_dataclass classes ``dataclasses.dataclass(frozen=True)`` ones; how many."""
    text = path.read_text()
    text, kw = re.subn(r"@frozen_dataclass\(kw_only=True\)\n", "@_native_dc(frozen=True, kw_only=True)\n", text)
    text, plain = re.subn(r"@frozen_dataclass\n", "@_native_dc(frozen=True)\n", text)
    if kw + plain:
        text = text.replace("from __future__ import annotations\n",
                            "from __future__ import annotations\n\nfrom dataclasses import dataclass as _native_dc\n", 1)
        path.write_text(text)
    return kw + plain


def build(src: Path, modules: list[str]) -> dict[str, object]:
    """Compile ``modules`` in ``src`` with mypyc in place; build time and sizes."""
    classes = sum(native_classes(src / m) for m in modules)
    start = time.perf_counter()
    done = subprocess.run(["mypyc", "--follow-imports=silent", "--ignore-missing-imports", *modules], cwd=src,
                          capture_output=True, text=True, check=False)
    seconds = time.perf_counter() - start
    if done.returncode:
        sys.exit(f"mypyc failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    shared = [p for p in src.glob("*__mypyc*.so")]
    shims = [src / m.replace(".py", "") for m in modules]
    shim_bytes = sum(p.stat().st_size for stem in shims for p in stem.parent.glob(f"{stem.name}.cpython-*.so"))
    return {"modules": len(modules), "native classes": classes, "build_s (niced, shared cores)": round(seconds),
            "shared library bytes": sum(p.stat().st_size for p in shared), "module shims bytes": shim_bytes,
            "mypyc warnings": [line for line in done.stdout.splitlines() if ": warning:" in line]}


def rates(trees: dict[str, str]) -> dict[str, list[list[int]]]:
    out: dict[str, list[list[int]]] = {name: [] for name in trees}
    for _ in range(RATE_RUNS):
        for name, src in trees.items():
            out[name].append([round(float(x)) for x in _timed(["-c", RATE_CASE], dict(os.environ, PYTHONPATH=src))[2].split()])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"store the result in {RESULT}")
    parser.add_argument("--keep", help="build in this folder (kept) instead of a temporary one")
    args = parser.parse_args()
    if shutil.which("mypyc") is None:
        sys.exit("mypyc is not installed: pip install mypy==2.4.1")
    work = Path(args.keep or tempfile.mkdtemp(prefix="memplan-mypyc-"))
    src = work / "src"
    if src.exists():
        shutil.rmtree(src)
    shutil.copytree(ROOT / "src", src, ignore=shutil.ignore_patterns("__pycache__"))
    modules = compiled_modules()
    result: dict[str, object] = {"measured": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                                 "mypy": subprocess.run(["mypyc", "--version"], capture_output=True, text=True,
                                                       check=True).stdout.strip(),
                                 "compiled": modules, "build": build(src, modules)}
    trees = {"interpreted": str(ROOT / "src"), "mypyc": str(src)}
    result["callgrind instructions (import + model + first estimate; per new-job estimate)"] = callgrind(trees)
    result["RATE_CASE calls/s (wall same job, CPU same job, CPU new job), alternating runs"] = rates(trees)
    result["machine"] = (f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
                         f"load average {os.getloadavg()[0]:.1f} at the end")
    print(json.dumps(result, indent=1))
    if args.write:
        RESULT.write_text(json.dumps(result, indent=1) + "\n")
    if not args.keep:
        shutil.rmtree(work)


if __name__ == "__main__":
    main()
