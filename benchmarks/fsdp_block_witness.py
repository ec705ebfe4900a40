"""Witness cells of helper rcmlp18 (session 18): FSDP2's tensors at a block's backward, estimate vs ``memplan trace``
(peak allocated as :func:`memplan.trace.compare.compare_with_estimate` reads it, and the communication category).

Fixed before any change (the brief of rcmlp18), measured first at f30d0e2:

* C2 (fsdp_units_witness: toy llama, torchtitan, 2 ranks ``--fsdp full``, full recompute, bf16-mixed, seq 256, mbs 2,
  sdpa, AdamW foreach), C4 (the same at vocabulary 256, no recompute), H4 (C4 under ``--framework hf``);
  Y2 and Y2_full2 (hsdp_witness: C2's job hybrid 2 x 2, and full over 2);
* controls: C1, C3, C5, H1-H5 (fsdp_units_witness), Y1, Y3-Y5, Y2_full4 (hsdp_witness), A1-A5: the FSDP cells of
  tests/trace/test_agreement_grid.py in its order; G1, G2 (fsdp_units_witness's qwen2.5-7b cells) with ``--big``.

Usage: PYTHONPATH=src python benchmarks/fsdp_block_witness.py OUT.json [--big] [NAME ...]
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import fsdp_units_witness as units  # noqa: E402
import hsdp_witness as hsdp  # noqa: E402

from memplan.trace import trace  # noqa: E402
from memplan.trace.compare import compare_with_estimate  # noqa: E402
from tests.trace.test_agreement_grid import _COMMON, CELLS, CONFIGS  # noqa: E402

UNITS = ["C2", "C4", "H4", "C1", "C3", "C5", "H1", "H2", "H3", "H5"]
HYBRID = ["Y2", "Y2_full2", "Y1", "Y3", "Y4", "Y5", "Y2_full4"]
GRID = {f"A{i + 1}": cell for i, cell in enumerate(c for c in CELLS if "fsdp" in (c[5] if len(c) > 5 else {}))}


def _grid_cell(cell: tuple[Any, ...], folder: Path) -> dict[str, Any]:
    name, seq, precision, attention, recompute, extra = cell
    path = folder / f"{name}.json"
    path.write_text(json.dumps({**_COMMON, **CONFIGS[name]}), encoding="utf-8")
    job = {"optimizer_impl": "foreach", "mbs": 2, **extra}
    result = trace(str(path), seq=seq, precision=precision, attention=attention, recompute=recompute,
                   optimizer="adamw", device="cuda", iterations=2, **job)
    rows = {r.category: r for r in compare_with_estimate(str(path), result.options, result.summary).rows}
    return {c: {"traced": rows[c].traced_bytes, "estimated": rows[c].estimated_bytes, "relative": rows[c].relative}
            for c in ("peak allocated", "communication")} | {"cell": [name, seq, precision, attention, recompute,
                                                                     extra]}


def measure(name: str, folder: Path) -> dict[str, Any]:
    if name in GRID:
        return _grid_cell(GRID[name], folder)
    if name in hsdp.CELLS:
        path = folder / "llama.json"
        path.write_text(json.dumps(hsdp.LLAMA), encoding="utf-8")
        out = hsdp.run_cell(str(path), hsdp.CELLS[name])
        return {c: {"traced": out[c]["traced"], "estimated": out[c]["estimated"], "relative": out[c]["rel"]}
                for c in ("peak allocated", "communication")}
    return units.measure(name, folder)


def main(argv: list[str]) -> None:
    out, rest = Path(argv[0]), argv[1:]
    big = "--big" in rest
    names = [n for n in rest if n != "--big"] or [*UNITS, *HYBRID, *GRID, *(("G1", "G2") if big else ())]
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as folder:
        for name in names:
            results[name] = measure(name, Path(folder))
            print(f"{name}: " + "; ".join(units.row_texts(results[name])), flush=True)
            out.write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main(sys.argv[1:])
