"""Static plan vs lower bound, and fragmentation vs the caching allocator, on real training traces.

Traces come from ``memplan trace`` (fake-tensor training steps of real model shapes, 2 iterations,
CUDA accounting) and from the real snapshots in ../shared/reference/snapshots. For each trace:
lower bound (peak live requested bytes), simulated caching allocator and expandable segments
(peak reserved), the static plan, plan / lower bound, and the fragmentation reduction
``1 - plan fragmentation / caching fragmentation`` (fragmentation = 1 - peak allocated / peak
reserved). Targets (issue 5): plan <= 1.02 x lower bound; reduction >= 85 %.

Usage: python benchmarks/alloc_traces.py [--quick] [--rows NAME,NAME...]
(--quick: gpt2 and the snapshots only; --rows: only the named rows, e.g. "llama-3.1-8b fsdp=8",
updated in place in the results file, the other rows and the summary kept/recomputed from it).
Writes benchmarks/results/alloc_traces.json. Traces are cached in $TMPDIR/memplan_alloc_traces,
made by ``python -m memplan trace`` of the interpreter running this script.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from memplan.alloc import compare, load_trace_or_snapshot

SNAPSHOTS = Path(__file__).resolve().parents[2] / "shared" / "reference" / "snapshots"
CACHE = Path(tempfile.gettempdir()) / "memplan_alloc_traces"

#: (name, memplan trace arguments)
JOBS: list[tuple[str, list[str]]] = [
    ("gpt2", ["gpt2", "--seq", "1024", "--mbs", "4"]),
    ("gpt2 recompute=full", ["gpt2", "--seq", "1024", "--mbs", "4", "--recompute", "full"]),
    ("gpt2 fsdp=4", ["gpt2", "--seq", "1024", "--mbs", "4", "--fsdp", "4"]),
    ("llama-3.1-8b", ["llama-3.1-8b", "--seq", "2048"]),
    ("llama-3.1-8b recompute=full", ["llama-3.1-8b", "--seq", "2048", "--recompute", "full"]),
    ("llama-3.1-8b fsdp=8", ["llama-3.1-8b", "--seq", "2048", "--fsdp", "8"]),
    ("mixtral-8x7b fsdp=8", ["mixtral-8x7b", "--seq", "1024", "--fsdp", "8"]),
    ("mixtral-8x7b fsdp=8 recompute=full", ["mixtral-8x7b", "--seq", "1024", "--fsdp", "8", "--recompute", "full"]),
]


def _trace_file(name: str, args: list[str], timeout: float) -> Path | None:
    CACHE.mkdir(exist_ok=True)
    path = CACHE / (name.replace(" ", "_").replace("=", "-") + ".mptrace")
    if not path.exists():
        try:
            subprocess.run([sys.executable, "-m", "memplan", "trace", *args, "-o", str(path)], check=True,
                           timeout=timeout, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
            print(f"{name}: trace failed ({type(exc).__name__})", file=sys.stderr)
            path.unlink(missing_ok=True)
            return None
    return path


def _row(name: str, path: Path) -> dict:
    trace, settings = load_trace_or_snapshot(path)
    began = time.perf_counter()
    result = compare(trace, settings, time_limit=10)
    frag_c, frag_p = result.caching.fragmentation, result.plan.fragmentation
    return {
        "trace": name, "events": len(trace), **result.to_dict(),
        "plan_over_lower_bound": round(result.plan_bytes / result.lower_bound_bytes, 5),
        "fragmentation_reduction": round(1 - frag_p / frag_c, 4) if frag_c > 0 else None,
        "plan_counts": result.plan.counts, "plan_method": result.plan.method,
        "seconds": round(time.perf_counter() - began, 2),
    }


def _selected(argv: list[str]) -> set[str] | None:
    if "--rows" not in argv:
        return None
    names = {n.strip() for n in argv[argv.index("--rows") + 1].split(",")}
    known = {name for name, _ in JOBS} | {f"snapshot {p.name}" for p in SNAPSHOTS.glob("*.pickle")}
    if names - known:
        raise SystemExit(f"unknown rows {sorted(names - known)}; known: {sorted(known)}")
    return names


def main() -> None:
    quick = "--quick" in sys.argv
    only = _selected(sys.argv)
    out = Path(__file__).with_name("results") / "alloc_traces.json"
    rows = []
    for name, args in JOBS[:1] if quick else JOBS:
        if only is None or name in only:
            path = _trace_file(name, args, timeout=900)
            if path is not None:
                rows.append(_row(name, path))
                print(json.dumps(rows[-1]), flush=True)
    for path in sorted(SNAPSHOTS.glob("*.pickle")):
        if only is None or f"snapshot {path.name}" in only:
            rows.append(_row(f"snapshot {path.name}", path))
            print(json.dumps(rows[-1]), flush=True)
    if only is not None:  # the other rows as last written
        fresh = {r["trace"]: r for r in rows}
        rows = [fresh.pop(r["trace"], r) for r in json.loads(out.read_text())["rows"]] + list(fresh.values())
    trained = [r for r in rows if not r["trace"].startswith("snapshot")]
    summary = {
        "rows": rows,
        "max_plan_over_lower_bound": max((r["plan_over_lower_bound"] for r in rows), default=None),
        "mean_fragmentation_reduction_memplan_traces": (
            round(sum(r["fragmentation_reduction"] or 0 for r in trained) / len(trained), 4) if trained else None),
    }
    out.write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    main()
