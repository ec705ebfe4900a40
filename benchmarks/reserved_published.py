"""Issue 25, item 8: the estimate's reserved memory, fixed 10% against simulated, on published real runs.

The published runs whose counter contains the reserved memory: the comparable entries of
``benchmarks/configs/published_finetune.json`` with ``compare_with: peak_reserved`` or ``nvidia_smi``
(Qwen's profile, read as nvidia-smi: reserved + what lives outside the allocator; torchtune) and torchtitan's published rows of :mod:`torchtitan_published` (the 8B FSDP 8 row from flags,
and every row of its TOML table: 8B FSDP 8 and 128 expressible, the compiled Float8 70B/405B rows not). Each is estimated
with ``--reserved fixed`` and ``--reserved simulated``; the error is against the published figure
(fixed before this comparison was written). No trace is run.

    PYTHONPATH=src python benchmarks/reserved_published.py  (from the repository root: the
    entries name their configs relative to it) [--out benchmarks/results/reserved_published.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import finetune_published as ft  # noqa: I001 - benchmarks/ is on the path when run as a script
import torchtitan_published as tt

from memplan.estimate import estimate
from memplan.inputs import JobRequest, load_job

HERE = Path(__file__).resolve().parent
MODES = ("fixed", "simulated")
#: The published counters that contain the reserved memory: the peak reserved itself, and nvidia-smi
#: (reserved + the CUDA context, NCCL and library buffers outside PyTorch's allocator).
RESERVED_COUNTERS = ("peak_reserved", "nvidia_smi")


def _errors(loaded, published: float, entry: dict | None = None) -> dict[str, object]:  # type: ignore[no-untyped-def]
    """Each mode's figure on the entry's counter (peak reserved, or nvidia-smi: reserved + outside the
    allocator, :func:`finetune_published.matching_bytes`) against the published bytes."""
    counter = (entry or {}).get("compare_with", "peak_reserved")
    out: dict[str, object] = {"published_bytes": published, "counter": counter}
    for mode in MODES:
        start = time.perf_counter()
        est = estimate(loaded.model, loaded.job, settings=loaded.settings, reserved=mode)
        out[f"{mode}_ms"] = round(1000 * (time.perf_counter() - start), 1)
        figure = ft.matching_bytes(entry, est) if entry else est.peak_reserved_bytes
        out[f"{mode}_reserved_bytes"] = est.peak_reserved_bytes
        out[f"{mode}_bytes"] = figure
        out[f"{mode}_error"] = figure / published - 1
    return out


def rows() -> list[dict[str, object]]:
    out: list[dict[str, object]] = []
    entries = json.loads((HERE / "configs" / "published_finetune.json").read_text())
    entries = entries["entries"] if isinstance(entries, dict) else entries
    for entry in entries:
        if entry.get("comparable") == "no" or entry.get("compare_with") not in RESERVED_COUNTERS or not entry.get(
                "memplan_flags"):
            continue
        try:
            loaded = load_job(JobRequest(model=entry["memplan_model"], flags=entry["memplan_flags"]))
        except Exception as error:  # noqa: BLE001 - recorded, as finetune_published records it
            out.append({"id": entry["id"], "status": f"error: {error}"})
            continue
        published = entry["published_value"] * ft.unit_bytes(entry["unit"])
        out.append({"id": entry["id"], "comparable": entry["comparable"], **_errors(loaded, published, entry)})
    for row in tt.ROWS:
        flags, published = row["flags"], row["published_gib"] * tt.GiB
        loaded = load_job(JobRequest(model=row["model"], flags={**flags, "gpus": flags["fsdp"]}))
        out.append({"id": row["name"] + " (flags)", "comparable": "yes", **_errors(loaded, published)})
    for row in tt.TOML_ROWS:  # compile + Float8 rows: not expressible (priced as eager, bf16)
        loaded = load_job(JobRequest(model=row["model"], torchtitan_config=str(HERE / "configs" / row["toml"]),
                                     flags={"gpus": row["gpus"]}))
        out.append({"id": row["name"] + " (TOML)", "comparable": "yes" if row["expressible"] else "approximate",
                    **_errors(loaded, row["published_gib"] * tt.GiB)})
    return out


def summary(results: list[dict[str, object]], comparable: tuple[str, ...]) -> dict[str, object]:
    chosen = [r for r in results if r.get("comparable") in comparable and "fixed_error" in r]
    return {mode: {"median_abs": statistics.median(abs(float(r[f"{mode}_error"])) for r in chosen),  # type: ignore[arg-type]
                   "worst_abs": max(abs(float(r[f"{mode}_error"])) for r in chosen), "runs": len(chosen)}  # type: ignore[arg-type]
            for mode in MODES} if chosen else {}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    results = rows()
    for r in results:
        if "fixed_error" in r:
            print(f"{str(r['id'])[:70]:<70} {r['comparable']:<12} fixed {100 * float(r['fixed_error']):+6.1f}%  "  # type: ignore[arg-type]
                  f"simulated {100 * float(r['simulated_error']):+6.1f}%  {r['simulated_ms']} ms")  # type: ignore[arg-type]
        else:
            print(r["id"], r["status"])
    result = {"runs": results, "summary_expressible": summary(results, ("yes",)),
              "summary_all": summary(results, ("yes", "approximate"))}
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
