"""Witness cells of helper moefsdp18 (session 18): FSDP2 at an MoE block's backward, estimate vs ``memplan trace``
(peak allocated as :func:`memplan.trace.compare.compare_with_estimate` reads it, the communication category, and the
moment of the peak: the trace's phase, op and module, the estimate's phase).

Fixed before any change (the brief of moefsdp18), measured first at 5fd824c. The MoE toys of
tests/trace/test_agreement_grid.py: ``qwen3_moe`` (M cells) and ``qwen3_moe_wide`` (W cells: 32 wider experts,
vocabulary 256, so a layer's backward rather than the loss can set the peak); the grid has no mixtral-like and no
deepseek-v2-lite-like (MLA + shared experts) toy, so M5 is recorded as absent. seq 256, mbs 2, bf16-mixed, sdpa,
AdamW foreach, 2 iterations, ``--device cuda``:

* M1 / W1: torchtitan ``--fsdp full --gpus 2``; M2 / W2: the same with full recompute; M3 / W3: hf ``--fsdp full
  --gpus 2``;
* M4 / W4: M1 with ``--ep 2`` over 2 ranks, M4_4 / W4_4: over 4 ranks: ``memplan trace`` refuses ``--ep`` (its
  sentence is recorded), the estimate alone is recorded.

Usage: PYTHONPATH=src python benchmarks/moe_fsdp_witness.py OUT.json [NAME ...]
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from memplan.errors import ConfigError  # noqa: E402
from memplan.estimate.engine import estimate  # noqa: E402
from memplan.inputs import JobRequest, load_job  # noqa: E402
from memplan.trace import trace  # noqa: E402
from memplan.trace.compare import compare_with_estimate  # noqa: E402
from tests.trace.test_agreement_grid import _COMMON, CONFIGS  # noqa: E402

FLAGS: dict[str, Any] = {"seq": 256, "mbs": 2, "precision": "bf16-mixed", "attention": "sdpa", "optimizer": "adamw",
                         "optimizer_impl": "foreach", "fsdp": "full", "gpus": 2, "recompute": "none",
                         "framework": "torchtitan"}
_JOBS: dict[str, dict[str, Any]] = {"1": {}, "2": {"recompute": "full"}, "3": {"framework": "hf"},
                                    "4": {"ep": 2}, "4_4": {"ep": 2, "gpus": 4}}
CELLS: dict[str, tuple[str, dict[str, Any]]] = {
    f"{letter}{suffix}": (config, job) for letter, config in (("M", "qwen3_moe"), ("W", "qwen3_moe_wide"))
    for suffix, job in _JOBS.items()}
ABSENT = {"M5": "the agreement grid has no deepseek-v2-lite-like (MLA + shared experts) toy"}


def _estimate_only(path: str, flags: dict[str, Any]) -> dict[str, Any]:
    loaded = load_job(JobRequest(model=path, flags=flags))
    stage = estimate(loaded.model, loaded.job).stages[0]
    return {"estimated_peak": stage.peak_allocated_bytes - stage.workspace_bytes,
            "estimated_communication": stage.communication_bytes, "estimate_phase": stage.peak_phase}


def measure(name: str, folder: Path) -> dict[str, Any]:
    if name in ABSENT:
        return {"absent": ABSENT[name]}
    config, job = CELLS[name]
    path = folder / f"{config}.json"
    path.write_text(json.dumps({**_COMMON, **CONFIGS[config]}), encoding="utf-8")
    flags = {**FLAGS, **job}
    out: dict[str, Any] = {"cell": [config, flags]}
    try:
        result = trace(str(path), device="cuda", iterations=2, **flags)
    except ConfigError as error:
        return out | {"trace_refused": str(error)} | _estimate_only(str(path), flags)
    rows = {r.category: r for r in compare_with_estimate(str(path), result.options, result.summary).rows}
    s = result.summary
    return out | {c: {"traced": rows[c].traced_bytes, "estimated": rows[c].estimated_bytes,
                      "relative": rows[c].relative} for c in ("peak allocated", "communication")} | {
        "trace_moment": [s.peak_phase, s.peak_iteration, s.peak_op, s.peak_module],
        "estimate_phase": _estimate_only(str(path), flags)["estimate_phase"]}


def main(argv: list[str]) -> None:
    out, names = Path(argv[0]), argv[1:] or [*CELLS, *ABSENT]
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as folder:
        for name in names:
            results[name] = measure(name, Path(folder))
            print(f"{name}: {json.dumps({k: v for k, v in results[name].items() if k != 'cell'})}", flush=True)
            out.write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main(sys.argv[1:])
