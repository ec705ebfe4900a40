"""Witness cells of helper fsdphead17 (session 17): FSDP's outer units (the head unit at the loss), estimate vs
``memplan trace``: peak allocated and the communication category, as :func:`memplan.trace.compare.compare_with_estimate`.

Usage: PYTHONPATH=src python benchmarks/fsdp_units_witness.py [--only G1,H4,...] [--json OUT]

G1: the agreement grid's ``qwen2.5-7b s2048 b1 bf16 sdpa selective fsdp 8`` under ``--framework torchtitan``;
G2: the same cell as the grid runs it (hf). H1-H5 (hf) and C1-C5 (torchtitan): helper hffsdp16's cells
(docs/benchmarks.md): the grid's ``llama`` toy (tests/trace/test_agreement_grid.py's config; "v256" at vocabulary
256), 2 ranks ``--fsdp full``, bf16-mixed, seq 256, mbs 2, sdpa, AdamW foreach, 2 iterations, ``--device cuda``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from agreement_grid import GRID, Cell  # noqa: E402

from memplan.trace import trace  # noqa: E402
from memplan.trace.compare import compare_with_estimate  # noqa: E402
from tests.estimate.test_fsdp_adapter_dtype import LLAMA_TOY  # noqa: E402

TOY_FLAGS = {"seq": 256, "mbs": 2, "precision": "bf16-mixed", "attention": "sdpa", "optimizer": "adamw",
             "optimizer_impl": "foreach", "gpus": 2, "fsdp": "full", "device": "cuda", "iterations": 2}
LORA = {"peft": "lora", "lora_rank": 16, "lora_targets": "all-linear"}
#: name -> (vocabulary, framework, recompute, further flags)
TOYS = {"H1": (2048, "hf", "none", {}), "H2": (2048, "hf", "full", {}), "H3": (2048, "hf", "none", LORA),
        "H4": (256, "hf", "none", {}), "H5": (256, "hf", "none", LORA)}
TOYS.update({"C" + name[1]: (vocab, "torchtitan", rc, extra) for name, (vocab, _, rc, extra) in list(TOYS.items())})
GRID_KEY = "qwen2.5-7b s2048 b1 bf16 sdpa rc=selective fsdp=8"


def _grid_cell(framework: str) -> Cell:
    cell = next(c for c in GRID if c.key == GRID_KEY)
    return replace(cell, framework=framework)


def _rows(model: str, result: object) -> dict[str, object]:
    rows = {r.category: r for r in compare_with_estimate(model, result.options, result.summary).rows}  # type: ignore[attr-defined]
    out = {}
    for category in ("peak allocated", "communication"):
        row = rows[category]
        out[category] = {"traced": row.traced_bytes, "estimated": row.estimated_bytes, "relative": row.relative}
    return out


def traced(name: str, folder: Path) -> tuple[str, object]:
    """The model reference and ``memplan trace``'s result of one named cell (toy configs written to ``folder``)."""
    if name in ("G1", "G2"):
        cell = _grid_cell("torchtitan" if name == "G1" else "hf")
        result = trace(cell.model_ref, seq=cell.seq, mbs=cell.mbs, precision=cell.precision,
                       attention=cell.attention, recompute=cell.recompute, optimizer="adamw",
                       optimizer_impl=cell.optimizer_impl, device="cuda", iterations=2, fsdp=cell.fsdp,
                       tp=cell.tp, framework=cell.framework, **dict(cell.flags))
        return cell.model_ref, result
    vocab, framework, recompute, extra = TOYS[name]
    path = folder / f"v{vocab}.json"
    path.write_text(json.dumps({**LLAMA_TOY, "vocab_size": vocab}), encoding="utf-8")
    return str(path), trace(str(path), framework=framework, recompute=recompute, **TOY_FLAGS, **extra)


def measure(name: str, folder: Path) -> dict[str, object]:
    return _rows(*traced(name, folder))


def row_texts(rows: dict[str, object]) -> list[str]:
    """``category traced / estimated (relative)`` for each compared row (dict values) of one cell."""
    out = []
    for category, row in rows.items():
        if isinstance(row, dict):
            rel = row["relative"]
            out.append(f"{category} {row['traced']:,} / {row['estimated']:,} "
                       f"({'—' if rel is None else f'{100 * rel:+.3f}%'})")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="comma-separated cell names (default: all)")
    parser.add_argument("--json", default="", help="write the results here")
    ns = parser.parse_args()
    names = ns.only.split(",") if ns.only else ["G1", "G2", *sorted(TOYS, key=lambda n: (n[0] != "H", n))]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            results[name] = measure(name, Path(tmp))
            print(f"{name}: " + "; ".join(row_texts(results[name])), flush=True)
    if ns.json:
        Path(ns.json).write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
