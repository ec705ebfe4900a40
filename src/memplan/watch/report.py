"""What :func:`memplan.watch` writes beside the snapshot when memory runs out.

:func:`oom_report` is the one place that turns an out-of-memory moment into a report: the figures
of the failed request, what the snapshot holds, the allocation sites holding most memory, and
``memplan doctor``'s verdict with its verified fixes (:func:`memplan.doctor.diagnose` on the
same snapshot, the device's capacity and, once the exception is seen, its message). A doctor
that cannot read its inputs leaves the figures in place and says why under ``problems``.

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

__all__ = ["REPORT_KIND", "OomEvent", "oom_report", "report_text", "with_doctor"]

#: ``kind`` of the report.
REPORT_KIND = "memplan.watch report"
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
        "note": ("the failure's figures and memplan doctor's verdict with verified fixes (`memplan doctor "
                 "SNAPSHOT --gpu ... --job ...` adds job changes)"),
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
    return with_doctor(report, snapshot)


def with_doctor(report: Mapping[str, Any], snapshot: Mapping[str, Any] | str | None) -> dict[str, Any]:
    """``report`` with ``doctor`` (the doctor's JSON) and ``doctor_text`` from
    :func:`memplan.doctor.diagnose` on its message (when it has one the doctor can read), the
    snapshot (data or a path) and the device capacity; what stops the doctor goes to ``problems``."""
    from memplan.doctor import diagnose

    out = {**report, "doctor": None, "doctor_text": "",
           "problems": [p for p in report.get("problems", ()) if not p.startswith(_DOCTOR_PROBLEM)]}
    oom = report.get("oom") or {}
    capacity = oom.get("device_total_bytes")
    message = str(report.get("message") or "").strip()
    if snapshot is None and not message:
        return out
    attempts = [message, None] if message else [None]
    for text in attempts:
        try:
            diagnosis = diagnose(text, snapshot=snapshot, capacity_bytes=capacity)
        except ConfigError as exc:
            if text is None or snapshot is None:
                out["problems"].append(f"{_DOCTOR_PROBLEM}: {exc}")
                return out
            continue  # the message holds no figures the doctor reads: the snapshot alone
        except Exception as exc:  # noqa: BLE001 - the user's OOM must still propagate; the report says why
            out["problems"].append(f"{_DOCTOR_PROBLEM}: {exc!r}")
            return out
        out["doctor"], out["doctor_text"] = diagnosis.to_json(), diagnosis.to_text()
        return out
    return out


_DOCTOR_PROBLEM = "memplan doctor could not diagnose"


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
    if report.get("doctor_text"):
        lines += ["", report["doctor_text"].rstrip()]
    lines += [f"problem: {p}" for p in report.get("problems", ())]
    return "\n".join(lines) + "\n"
