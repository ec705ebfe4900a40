"""What :func:`memplan.watch` writes beside the snapshot when memory runs out.

:func:`oom_report` is the one place that turns an out-of-memory moment into a report. Today it
writes a **minimal summary** — the figures of the failed request, what the snapshot holds, and
the allocation sites holding most memory — and no verdict: diagnosing the cause and verifying
fixes is ``memplan doctor``'s job, which reads the same snapshot (``memplan doctor SNAPSHOT``).
When ``memplan.doctor`` offers a Python API, this function is where it is called.

Figures (bytes, integers): ``requested`` is the size of the failed request; ``device_total`` the
device's memory (or the allowed maximum under ``set_per_process_memory_fraction``) and
``device_free`` what CUDA reported free, both as the caching allocator passed them to its OOM
observers; ``reserved`` is the sum of the snapshot's segments, ``allocated`` of its active
blocks (rounded block sizes, as ``torch.cuda.memory_allocated`` counts), ``requested_live`` of
their requested sizes; ``outside_pytorch = device_total − reserved − device_free`` (other
processes, the CUDA context, NCCL); ``largest_free_block`` the largest inactive block inside the
reserved segments.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from memplan.alloc.snapshot import parse_snapshot
from memplan.diff.frames import frame_keys
from memplan.errors import ConfigError
from memplan.units import format_bytes

__all__ = ["REPORT_KIND", "OomEvent", "oom_report", "report_text"]

#: ``kind`` of the report written today (the doctor's report will say ``"memplan doctor"``).
REPORT_KIND = "memplan.watch minimal summary"
_TOP_SITES = 10


@dataclass(frozen=True)
class OomEvent:
    """The arguments of the caching allocator's OOM observer call."""

    device: int
    requested_bytes: int
    device_total_bytes: int
    device_free_bytes: int


def _state(snapshot: Mapping[str, Any], device: int | None) -> dict[str, Any]:
    parsed = parse_snapshot(snapshot, device=device)
    raw_segments = [s for s in snapshot.get("segments", []) if isinstance(s, Mapping)
                    and s.get("device", 0) == parsed.device]
    sites: dict[str, int] = {}
    for raw in raw_segments:
        for block in raw.get("blocks") or []:
            if isinstance(block, Mapping) and str(block.get("state", "")).startswith("active"):
                site = frame_keys(block.get("frames"))[2]
                sites[site] = sites.get(site, 0) + int(block.get("size", 0))
    blocks = [b for s in parsed.segments for b in s.blocks]
    top = sorted(sites.items(), key=lambda item: (-item[1], item[0]))[:_TOP_SITES]
    return {
        "device": parsed.device,
        "segments": len(parsed.segments),
        "reserved_bytes": sum(s.total_size for s in parsed.segments),
        "allocated_bytes": sum(b.size for b in blocks if b.active),
        "requested_live_bytes": sum(b.requested_size for b in blocks if b.active),
        "largest_free_block_bytes": max((b.size for b in blocks if not b.active), default=0),
        "trace_entries": len(parsed.entries),
        "top_sites": [{"site": site, "bytes": size} for site, size in top],
    }


def oom_report(snapshot: Mapping[str, Any] | None, *, event: OomEvent | None, message: str,
               snapshot_path: str | None, problems: tuple[str, ...] = ()) -> dict[str, Any]:
    """The report of one out-of-memory moment, as JSON-ready data (see the module docstring)."""
    report: dict[str, Any] = {
        "kind": REPORT_KIND,
        "note": ("figures only, no verdict: run `memplan doctor` on the snapshot for the cause and "
                 "verified fixes"),
        "snapshot": snapshot_path,
        "message": message,
        "oom": None,
        "state": None,
        "problems": list(problems),
    }
    if event is not None:
        report["oom"] = {"device": event.device, "requested_bytes": event.requested_bytes,
                         "device_total_bytes": event.device_total_bytes,
                         "device_free_bytes": event.device_free_bytes}
    if snapshot is not None:
        try:
            report["state"] = _state(snapshot, event.device if event is not None else None)
        except ConfigError as exc:
            report["problems"].append(f"the snapshot could not be read: {exc}")
    if report["oom"] is not None and report["state"] is not None:
        oom, state = report["oom"], report["state"]
        state["reserved_unallocated_bytes"] = state["reserved_bytes"] - state["allocated_bytes"]
        state["outside_pytorch_bytes"] = (oom["device_total_bytes"] - state["reserved_bytes"]
                                          - oom["device_free_bytes"])
    return report


def report_text(report: Mapping[str, Any]) -> str:
    """The report as lines for people (binary units: GiB = 2^30 bytes)."""
    lines = [f"{report['kind']} — {report['note']}"]
    if report.get("message"):
        lines.append(f"error: {report['message'].strip().splitlines()[0]}")
    if report.get("snapshot"):
        lines.append(f"snapshot: {report['snapshot']}")
    oom = report.get("oom")
    if oom:
        lines.append(f"failed request on cuda:{oom['device']}: {format_bytes(oom['requested_bytes'])}; "
                     f"device total {format_bytes(oom['device_total_bytes'])}, "
                     f"free {format_bytes(oom['device_free_bytes'])}")
    state = report.get("state")
    if state:
        lines.append(f"reserved by PyTorch {format_bytes(state['reserved_bytes'])} in {state['segments']} "
                     "segments; "
                     f"allocated {format_bytes(state['allocated_bytes'])}; largest free block inside them "
                     f"{format_bytes(state['largest_free_block_bytes'])}")
        if "outside_pytorch_bytes" in state:
            lines.append(f"reserved but unallocated {format_bytes(state['reserved_unallocated_bytes'])}; "
                         "outside "
                         f"PyTorch (total - reserved - free) {format_bytes(state['outside_pytorch_bytes'])}")
        if state["top_sites"]:
            lines.append("largest live allocation sites:")
            lines += [f"  {format_bytes(row['bytes']):>12}  {row['site']}" for row in state["top_sites"]]
    lines += [f"problem: {p}" for p in report.get("problems", ())]
    return "\n".join(lines) + "\n"
