"""Witness cells of helper fsdpcomm18 (session 18): FSDP's communication category at its highest over the step,
the peak allocated, and the reserved figure, estimate vs ``memplan trace``.

Usage: PYTHONPATH=src python benchmarks/fsdpcomm18_witness.py [--only G1,H4,...] [--json OUT]

The cells are fsdphead17's (:mod:`fsdp_units_witness`: G1/G2 the agreement grid's ``qwen2.5-7b s2048 b1 bf16 sdpa
selective fsdp 8`` under torchtitan / hf; H1-H5 hf and C1-C5 torchtitan on the grid's ``llama`` toy, 2 ranks
``--fsdp full``). Each cell records, beside fsdp_units_witness's peak allocated and communication rows
(``compare_with_estimate``), the trace's simulated reserved (its events replayed through memplan's
caching-allocator simulator, ``summary.reserved``) against the estimate's ``peak_reserved_bytes`` (the profile's
reserved mode: simulated under hf and torchtitan).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fsdp_units_witness import TOYS, _rows, row_texts, traced  # noqa: E402

from memplan.estimate.engine import estimate  # noqa: E402
from memplan.model import load_model  # noqa: E402
from memplan.trace.compare import estimate_job  # noqa: E402


def measure(name: str, folder: Path) -> dict[str, object]:
    model, result = traced(name, folder)
    rows = _rows(model, result)
    simulated = result.summary.reserved  # type: ignore[attr-defined]
    est = estimate(load_model(model), estimate_job(result.options))  # type: ignore[attr-defined]
    traced_reserved = simulated.peak_reserved_bytes if simulated is not None else None
    rows["reserved"] = {"traced": traced_reserved, "estimated": est.peak_reserved_bytes,
                        "relative": (est.peak_reserved_bytes - traced_reserved) / traced_reserved
                        if traced_reserved else None}
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="comma-separated cell names (default: all)")
    parser.add_argument("--json", default="", help="write the results here")
    ns = parser.parse_args()
    names = ns.only.split(",") if ns.only else [*sorted(TOYS, key=lambda n: (n[0] != "H", n)), "G1", "G2"]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            results[name] = measure(name, Path(tmp))
            print(f"{name}: " + "; ".join(row_texts(results[name])), flush=True)
    if ns.json:
        Path(ns.json).write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
