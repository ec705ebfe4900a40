"""Real snapshots and memplan traces replayed through the runtime's C core (``memplan alloc replay``).

Parameters fixed before the run: every snapshot of ../shared/reference/snapshots and the three gpt2
traces of benchmarks/alloc_traces.py (``memplan trace``: seq 1024, mbs 4; recompute=full; fsdp=4),
profile mode (the whole trace recorded on the fallback pool, planned, replayed), plan search 5 s.
Judge: the caching allocator's simulation of the same trace (memplan.alloc.simulate, its own
fragmentation: 1 - peak allocated / peak reserved) against the core's measured peak reserved
(arena + fallback pool) with fragmentation 1 - peak of live 512-aligned requests / peak reserved.
Target (issue 26): fragmentation cut by >= 80 % on average (STAlloc reports 79.2 %).
Writes benchmarks/results/runtime_replay.json. Usage: python benchmarks/runtime_replay.py
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from alloc_traces import JOBS, SNAPSHOTS, _trace_file  # noqa: E402

from memplan.alloc import load_trace_or_snapshot  # noqa: E402
from memplan.alloc.runtime import replay_trace  # noqa: E402

OUT = Path(__file__).resolve().parent / "results" / "runtime_replay.json"
TRACES = ("gpt2", "gpt2 recompute=full", "gpt2 fsdp=4")


def _row(name: str, path: Path) -> dict:
    trace, settings = load_trace_or_snapshot(path)
    began = time.perf_counter()
    result = replay_trace(trace, settings=settings, time_limit=5.0).to_dict()
    return {"trace": name, **result, "seconds": round(time.perf_counter() - began, 2)}


def main() -> None:
    rows = []
    for path in sorted(SNAPSHOTS.glob("*.pickle")):
        rows.append(_row(f"snapshot {path.stem}", path))
        print(rows[-1]["trace"], rows[-1]["fragmentation_cut"], flush=True)
    for name, args in JOBS:
        if name in TRACES and (path := _trace_file(name, args, timeout=900)) is not None:
            rows.append(_row(name, path))
            print(rows[-1]["trace"], rows[-1]["fragmentation_cut"], flush=True)
    judged = [r for r in rows if r["caching"]["fragmentation"] > 0]
    cuts = [r["fragmentation_cut"] for r in judged]
    summary = {"rows": len(rows), "judged_rows": len(judged), "mean_fragmentation_cut": statistics.mean(cuts),
               "min_fragmentation_cut": min(cuts), "fallback_allocs": sum(r["fallback_allocs"] for r in rows),
               "target_mean_cut_ge_80pct": statistics.mean(cuts) >= 0.80}
    OUT.write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "summary": summary,
                               "rows": rows}, indent=2) + "\n")
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
