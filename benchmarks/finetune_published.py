"""`memplan estimate` against published fine-tuning peak-memory measurements (benchmarks/configs/published_finetune.json).

Usage: PYTHONPATH=src python benchmarks/finetune_published.py [--only SUBSTRING] [--json OUT] [--markdown]
(results in benchmarks/results/finetune_published.json)

Each entry of the configs file carries its source URL, the published number with its unit, what the
source says the number is (allocated, reserved, nvidia-smi, or not stated) and ``memplan_flags``: the
memplan job describing the run as the source states it. The estimate (``memplan.estimate`` on the
job built by :func:`memplan.load_job`) is compared with the published value on the counter the
entry names (``compare_with``: ``peak_reserved`` — the estimator's predicted reserved bytes, its
allocated peak plus the assumed fragmentation —, ``peak_allocated``, or ``nvidia_smi`` — the predicted
reserved bytes plus what lives outside PyTorch's allocator: the estimate's library buffers and the GPU
catalogue's CUDA context + NCCL figure, :func:`outside_allocator_bytes`). Entries whose settings are not
stated (``comparable: no``) are listed, not estimated; ``approximate`` entries say in their notes
which setting memplan cannot express exactly.

Robust before the fine-tuning work is merged: each entry's estimate is also run with the fine-tuning
flags removed; when both are equal the row says "fine-tuning flags not priced" instead of an error
figure, and an estimate that raises is recorded with its message.

Targets: none are claimed — the published settings are incomplete for most rows (unit, counter,
torch.compile, kernels) — the table reports the ratio estimated / published.
"""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
ENTRIES = HERE / "configs" / "published_finetune.json"
DEFAULT_OUT = HERE / "results" / "finetune_published.json"
GiB, GB = 2**30, 10**9
#: Job flags that describe fine-tuning (removed to check whether the estimator priced them).
FINETUNE_FLAGS = ("peft", "lora_rank", "lora_alpha", "lora_dropout", "lora_targets", "lora_rank_pattern", "rslora",
                  "trainable", "modules_to_save", "quantize_base", "double_quant", "quant_compute_dtype",
                  "frozen_dtype")


def unit_bytes(unit: str) -> int:
    """Bytes per published unit: GiB when the source prints GiB or leaves the unit open (read as GiB), else GB."""
    text = unit.split("(")[0].lower()
    return GiB if "gib" in text or text.strip().startswith("g as printed") else GB


def outside_allocator_bytes(entry: dict[str, Any], result: Any) -> int:
    """What nvidia-smi counts beyond PyTorch's reserved memory: the library buffers the estimate names
    outside the allocator, plus the CUDA context and NCCL figure of memplan's GPU catalogue for the
    entry's ``memplan_gpu`` (:data:`memplan.gpus.DEFAULT_OUTSIDE_ALLOCATOR_BYTES` when it names none)."""
    from memplan.gpus import DEFAULT_OUTSIDE_ALLOCATOR_BYTES, get_gpu

    gpu = entry.get("memplan_gpu")
    context = get_gpu(gpu).outside_allocator_bytes if gpu else DEFAULT_OUTSIDE_ALLOCATOR_BYTES
    return result.outside_allocator_bytes + context


def matching_bytes(entry: dict[str, Any], result: Any, reserved: int | None = None) -> int:
    """The estimate's figure for the counter the entry's source logs (``compare_with``): peak allocated,
    peak reserved (``reserved``, default the estimate's own) or nvidia-smi (reserved + outside the allocator)."""
    reserved = result.peak_reserved_bytes if reserved is None else reserved
    counter = entry.get("compare_with")
    if counter == "peak_allocated":
        return int(result.peak_allocated_bytes)
    if counter == "nvidia_smi":
        return int(reserved) + outside_allocator_bytes(entry, result)
    return int(reserved)


def _model_ref(name: str) -> str:
    local = REPO / name
    return str(local) if name.endswith(".json") and local.exists() else name


def _estimate(model: str, flags: dict[str, Any]) -> Any:
    import memplan
    from memplan.inputs import JobRequest, load_job

    loaded = load_job(JobRequest(model=_model_ref(model), flags=flags))
    return memplan.estimate(loaded.model, loaded.job)


def compare(entry: dict[str, Any]) -> dict[str, Any]:
    """The estimate of one entry against its published number; errors recorded, never raised."""
    row: dict[str, Any] = {"id": entry["id"], "comparable": entry["comparable"], "url": entry["url"],
                           "published_value": entry["published_value"], "unit": entry["unit"],
                           "compare_with": entry.get("compare_with")}
    if entry["comparable"] == "no" or not entry.get("memplan_flags"):
        row["status"] = "not compared: " + "; ".join(entry.get("notes", []))
        return row
    published = entry["published_value"] * unit_bytes(entry["unit"])
    row["published_bytes"] = published
    flags = entry["memplan_flags"]
    try:
        result = _estimate(entry["memplan_model"], flags)
        base = _estimate(entry["memplan_model"], {k: v for k, v in flags.items() if k not in FINETUNE_FLAGS})
    except Exception as error:  # noqa: BLE001 - recorded: a flag may be refused before the merge
        row["status"] = f"error: {type(error).__name__}: {error}"
        return row
    estimated = matching_bytes(entry, result)
    row.update({"estimated_allocated_bytes": result.peak_allocated_bytes,
                "estimated_reserved_bytes": result.peak_reserved_bytes, "estimated_bytes": estimated,
                "ratio": estimated / published, "full_finetune_reserved_bytes": base.peak_reserved_bytes,
                "finetune_priced": result.peak_allocated_bytes != base.peak_allocated_bytes,
                "assumptions": list(result.assumptions)})
    row["status"] = "compared" if row["finetune_priced"] else "fine-tuning flags not priced (estimate = full fine-tuning)"
    return row


def table(rows: list[dict[str, Any]]) -> str:
    """Markdown: published vs estimated, in the published unit."""
    lines = ["| entry | comparable | published | counter | estimated (same unit) | estimated / published | status |",
             "|---|---|---:|---|---:|---:|---|"]
    for r in rows:
        unit = "GiB" if unit_bytes(r["unit"]) == GiB else "GB"
        est = (f"{r['estimated_bytes'] / unit_bytes(r['unit']):.1f} {unit}" if "estimated_bytes" in r else "—")
        ratio = f"{r['ratio']:.2f}" if "ratio" in r and r.get("finetune_priced") else "—"
        status = r["status"] if len(r["status"]) < 120 else r["status"][:117] + "..."
        lines.append(f"| [{r['id']}]({r['url']}) | {r['comparable']} | {r['published_value']} {unit} | "
                     f"{r.get('compare_with') or '—'} | {est} | {ratio} | {status} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="compare only the entries whose id contains this text")
    parser.add_argument("--json", default=str(DEFAULT_OUT), help="where to write the results")
    parser.add_argument("--markdown", action="store_true", help="print the table as markdown")
    ns = parser.parse_args()
    entries = json.loads(ENTRIES.read_text(encoding="utf-8"))["entries"]
    rows = [compare(e) for e in entries if ns.only in e["id"]]
    for r in rows:
        print(f"{r['id']}: {r['status'][:100]}" + (f" ratio {r['ratio']:.2f}" if r.get("finetune_priced") else ""), flush=True)
    stamp = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes")
    Path(ns.json).parent.mkdir(parents=True, exist_ok=True)
    Path(ns.json).write_text(json.dumps({"measured": stamp, "entries_file": ENTRIES.name, "rows": rows}, indent=1)
                             + "\n", encoding="utf-8")
    if ns.markdown:
        print(table(rows))


if __name__ == "__main__":
    main()
