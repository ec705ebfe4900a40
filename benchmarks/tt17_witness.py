"""Witness cells of helper tt17 (session 17): torchtitan's loss computed after the model's forward in
``memplan trace``. Estimate vs trace (as :func:`memplan.trace.compare.compare_with_estimate`) on G1 and C1-C5
(benchmarks/fsdp_units_witness.py) and every ``--framework torchtitan`` cell of tests/trace/test_agreement_grid.py
(T1.., in the test's order; the test's tolerances: states equal, activations, logits and the peak within 3%).

Usage: PYTHONPATH=src python benchmarks/tt17_witness.py [--only G1,C1,T1,...] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from fsdp_units_witness import measure, row_texts  # noqa: E402

from memplan.trace import trace  # noqa: E402
from memplan.trace.compare import compare_with_estimate  # noqa: E402
from tests.trace.test_agreement_grid import _COMMON, CELLS, CLOSE, EXACT, TOLERANCE, CONFIGS  # noqa: E402


def _grid_cells() -> dict[str, tuple]:
    cells = [c.values if hasattr(c, "values") else c for c in CELLS]
    titan = [c for c in cells if len(c) > 5 and c[5].get("framework") == "torchtitan"]
    return {f"T{i + 1}": c for i, c in enumerate(titan)}


def measure_grid(values: tuple, folder: Path) -> dict[str, object]:
    name, seq, precision, attention, recompute, extra = values
    path = folder / f"{name}.json"
    path.write_text(json.dumps({**_COMMON, **CONFIGS[name]}), encoding="utf-8")
    job = {"optimizer_impl": "foreach", "mbs": 2, **extra}
    result = trace(str(path), seq=seq, precision=precision, attention=attention, recompute=recompute,
                   optimizer="adamw", device="cuda", iterations=2, **job)
    rows = {r.category: r for r in compare_with_estimate(str(path), result.options, result.summary).rows}
    ok = all(rows[c].estimated_bytes == rows[c].traced_bytes for c in EXACT) and \
        all(abs(rows[c].relative or 0.0) <= TOLERANCE for c in CLOSE)
    out: dict[str, object] = {"cell": f"{name} s{seq} {precision} {attention} {recompute} {extra}", "passes": ok}
    for category in ("peak allocated", "communication", "logits"):
        row = rows[category]
        out[category] = {"traced": row.traced_bytes, "estimated": row.estimated_bytes, "relative": row.relative}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="comma-separated cell names (default: all)")
    parser.add_argument("--json", default="", help="write the results here")
    ns = parser.parse_args()
    grid = _grid_cells()
    names = ns.only.split(",") if ns.only else ["G1", "C1", "C2", "C3", "C4", "C5", *grid]
    results: dict[str, dict[str, object]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            results[name] = measure_grid(grid[name], Path(tmp)) if name in grid else measure(name, Path(tmp))
            cells = [str(results[name].get("cell", "")), f"passes={results[name]['passes']}"] \
                if name in grid else []
            print(f"{name}: " + "; ".join(cells + row_texts(results[name])), flush=True)
    if ns.json:
        Path(ns.json).write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
