"""Partial freezing (issue 25, item 4): estimate vs trace when only some parameters train.

Usage: PYTHONPATH=src python benchmarks/partial_freeze.py [--only NAME,...] [--json OUT]
(results in benchmarks/results/partial_freeze.json; a markdown table on stdout)

The grid, fixed before the estimator was changed: llama-3.2-1b (16 layers, tied embedding), seq 512, mbs 1,
``--framework hf --precision bf16-mixed --optimizer adamw --attention sdpa``; what trains: the final norm
only; every norm (LN tuning); the last two layers; the first two; one layer's MLP (``layers.8.mlp``); the
embedding (tied to the head); LoRA on q/v of the last two layers; LoRA on the first layer's down projection;
and the final norm and the last two layers under full recompute. The witness is ``memplan trace`` with the
same flags (real autograd on fake tensors, 2 iterations); the target is the fine-tuning grid's: activations
and peak allocated within 3%.
"""

from __future__ import annotations

import argparse
import datetime
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE / "results" / "partial_freeze.json"
MODEL = "llama-3.2-1b"
TOLERANCE = 0.03
BASE: dict[str, Any] = {"seq": 512, "mbs": 1, "precision": "bf16-mixed", "optimizer": "adamw", "attention": "sdpa",
                        "framework": "hf"}
_LAST2_QV = ",".join(f"layers.{i}.self_attn.{p}" for i in (14, 15) for p in ("q_proj", "v_proj"))
CELLS: dict[str, dict[str, Any]] = {
    "final norm": {"trainable": "norm"},
    "LN tuning (every norm)": {"trainable": "input_layernorm,post_attention_layernorm,norm"},
    "last 2 layers": {"trainable": "layers.14,layers.15"},
    "first 2 layers": {"trainable": "layers.0,layers.1"},
    "layer 8's MLP": {"trainable": "layers.8.mlp"},
    "embedding (tied head)": {"trainable": "embed_tokens"},
    "LoRA q,v of the last 2 layers": {"peft": "lora", "lora_targets": _LAST2_QV},
    "LoRA down_proj of layer 0": {"peft": "lora", "lora_targets": "layers.0.mlp.down_proj"},
    "final norm, full recompute": {"trainable": "norm", "recompute": "full"},
    "last 2 layers, full recompute": {"trainable": "layers.14,layers.15", "recompute": "full"},
}


def compare(model: str, flags: dict[str, Any]) -> dict[str, Any]:
    """Trace ``model`` with ``flags`` and estimate the same job: activations and peak rows, within tolerance."""
    from memplan.trace import trace
    from memplan.trace.compare import compare_with_estimate

    start = time.perf_counter()
    result = trace(model, device="cuda", iterations=2, **flags)
    rows = {r.category: {"traced_bytes": r.traced_bytes, "estimated_bytes": r.estimated_bytes, "relative": r.relative}
            for r in compare_with_estimate(model, result.options, result.summary).rows
            if r.category in ("activation", "peak allocated")}
    ok = all(abs(rows[c]["relative"] or 0.0) <= TOLERANCE for c in rows)
    return {"rows": rows, "within_tolerance": ok, "seconds": round(time.perf_counter() - start, 1)}


def measure(name: str) -> dict[str, Any]:
    return {"name": name, "flags": CELLS[name], **compare(MODEL, {**BASE, **CELLS[name]})}


def table(results: list[dict[str, Any]]) -> str:
    mib = 2**20
    lines = ["| what trains | activations MiB traced / estimated (err) | peak MiB traced / estimated (err) | ok |",
             "|---|---:|---:|---|"]
    for r in results:
        cols = [f"{row['traced_bytes'] / mib:,.1f} / {row['estimated_bytes'] / mib:,.1f} "
                f"({100 * (row['relative'] or 0.0):+.1f}%)" for row in r["rows"].values()]
        lines.append(f"| {r['name']} | {' | '.join(cols)} | {'yes' if r['within_tolerance'] else '**no**'} |")
    return "\n".join(lines)


def run_grid(doc: str, cells: list[str], measure_cell: Callable[[str], dict[str, Any]], default_out: Path,
             header: dict[str, Any]) -> None:
    """Parse ``--only`` / ``--json``, measure the chosen cells, write the results JSON and print the table."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--only", default="", help="comma list of cell names to run")
    parser.add_argument("--json", default=str(default_out))
    ns = parser.parse_args()
    names = [n for n in cells if not ns.only or n in ns.only.split(",")]
    results = []
    for name in names:
        results.append(measure_cell(name))
        print(f"{name}: {'ok' if results[-1]['within_tolerance'] else 'MISS'}", flush=True)
    measured = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes")
    Path(ns.json).write_text(json.dumps({"measured": measured, **header, "tolerance": TOLERANCE,
                                         "cells": results}, indent=1) + "\n", encoding="utf-8")
    print(table(results))


def main() -> None:
    run_grid(__doc__, list(CELLS), measure, DEFAULT_OUT, {"model": MODEL, "base": BASE})


if __name__ == "__main__":
    main()
