"""The optimizer states' creation order in the reserved-memory schedule (session 12, optorder12): gpt-oss's
reserved figure against the trace's simulated reserved, on the cut-down cells of
``reserved_experts_gpt_oss.json`` (gpt-oss-20b cut to 4 layers and 4 experts; traced figures recorded there, MiB)
and the published config's cells of ``agreement_grid_gpt_oss.json``. ``--trace`` traces the FSDP2 cell again
(memplan trace, fake tensors, 2 ranks) and records its peak allocated beside the estimate's.

    PYTHONPATH=src python benchmarks/optimizer_order.py [--trace] [--out benchmarks/results/optimizer_order.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import tempfile
from pathlib import Path
from typing import Any

from memplan.estimate.engine import estimate
from memplan.model import load_model
from memplan.trace.setup import trace_setup

_HERE = Path(__file__).parent
_RESULTS = _HERE / "results"
MiB = 2**20


def cut_config(folder: Path) -> Path:
    """gpt-oss-20b with 4 layers (``layer_types`` cut to them) and 4 experts, as the cut cells were traced."""
    config = json.loads((_HERE / "configs" / "gpt-oss-20b.json").read_text())
    config.update(num_hidden_layers=4, layer_types=config["layer_types"][:4], num_local_experts=4)
    path = folder / "gpt-oss-cut.json"
    path.write_text(json.dumps(config))
    return path


def cut_flags(key: str) -> dict[str, Any]:
    """A cut cell's flags from its key (``s4096 b1 bf16-mixed full fsdp=2``)."""
    seq, mbs, precision, recompute, *extra = key.split()
    flags: dict[str, Any] = {"seq": int(seq[1:]), "mbs": int(mbs[1:]), "precision": precision, "recompute": recompute,
                             "attention": "eager", "optimizer": "adamw", "optimizer_impl": "foreach",
                             "framework": "hf"}
    for item in extra:
        name, value = item.split("=")
        flags[name] = int(value) if value.isdigit() else value
    return flags


def _estimated(config: str, flags: dict[str, Any]) -> Any:
    return estimate(load_model(config), trace_setup(None, **flags, device="cuda", iterations=2).job)


def _traced(config: str, flags: dict[str, Any]) -> dict[str, float]:
    from memplan.trace import trace

    result = trace(config, **flags, device="cuda", iterations=2)
    return {"traced_allocated_mib": result.summary.peak_allocated_bytes / MiB,
            "traced_simulated_mib": result.summary.reserved.peak_reserved_bytes / MiB}  # type: ignore[union-attr]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", action="store_true", help="trace the FSDP2 cut cell again")
    parser.add_argument("--out", type=Path, default=_RESULTS / "optimizer_order.json")
    args = parser.parse_args()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as folder:
        config = str(cut_config(Path(folder)))
        for cell in json.loads((_RESULTS / "reserved_experts_gpt_oss.json").read_text())["repro_cells"]:
            flags = cut_flags(cell["key"])
            est = _estimated(config, flags)
            row = {"key": f"cut {cell['key']}", "traced_mib": cell["traced_mib"],
                   "estimated_mib": est.peak_reserved_bytes / MiB,
                   "estimated_allocated_mib": est.peak_allocated_bytes / MiB}
            if args.trace and "fsdp" in flags:
                row.update(_traced(config, flags))
            rows.append(row)
    for cell in json.loads((_RESULTS / "agreement_grid_gpt_oss.json").read_text())["cells"]:
        flags = {k: cell[k] for k in ("seq", "mbs", "precision", "attention", "recompute", "fsdp", "tp",
                                      "optimizer_impl", "framework")} | {"optimizer": "adamw", **cell["flags"]}
        est = _estimated(str(_HERE / "configs" / "gpt-oss-20b.json"), flags)
        rows.append({"key": cell["key"], "traced_mib": cell["reserved"]["traced_simulated_bytes"] / MiB,
                     "estimated_mib": est.peak_reserved_bytes / MiB,
                     "estimated_allocated_mib": est.peak_allocated_bytes / MiB})
    for row in rows:
        row["error"] = round((row["estimated_mib"] - row["traced_mib"]) / row["traced_mib"], 5)
        print(f"{row['key']:60s} trace {row['traced_mib']:>11,.0f} MiB  estimate {row['estimated_mib']:>11,.0f} "
              f"({100 * row['error']:+.2f}%)", flush=True)
    measured = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes")
    args.out.write_text(json.dumps({"measured": measured, "cells": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
