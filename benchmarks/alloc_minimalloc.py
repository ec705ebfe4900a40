"""MiniMalloc challenging instances (../shared/reference/minimalloc): placement size, validity, time.

Target (issue 5): a valid placement within 1,048,576 bytes for all 11, each in <= 10 s here.
Writes benchmarks/results/alloc_minimalloc.json.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from memplan.alloc import dsa
from memplan.alloc.minimalloc import read_minimalloc_csv

CAPACITY = 1_048_576
DATA = Path(__file__).resolve().parents[2] / "shared" / "reference" / "minimalloc"


def main() -> None:
    limit = float(sys.argv[1]) if len(sys.argv) > 1 else 10.0
    rows = []
    for path in sorted(DATA.glob("*.csv")):
        buffers = read_minimalloc_csv(path)
        starts, ends, sizes = [b.start for b in buffers], [b.end for b in buffers], [b.size for b in buffers]
        began = time.perf_counter()
        result = dsa.solve(starts, ends, sizes, capacity=CAPACITY, time_limit=limit)
        seconds = time.perf_counter() - began
        row = {
            "instance": path.name, "buffers": len(buffers), "lower_bound": dsa.live_peak(starts, ends, sizes),
            "placement_size": result.peak, "valid": dsa.validate(starts, ends, sizes, result.offsets),
            "within_capacity": result.peak <= CAPACITY, "ratio_to_capacity": round(result.peak / CAPACITY, 4),
            "seconds": round(seconds, 2), "method": result.method,
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    summary = {"capacity": CAPACITY, "time_limit_s": limit, "instances": rows,
               "all_within_capacity": all(r["within_capacity"] for r in rows),
               "all_valid": all(r["valid"] for r in rows)}
    Path(__file__).with_name("results").joinpath("alloc_minimalloc.json").write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
