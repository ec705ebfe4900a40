"""Fixes outside the allocator and the job: a leak in the training code, memory held by other processes.

* **Leak**: the blocks the growing sites allocate inside iterations (the first one included) that
  are still live at the end of the trace are what an iteration keeps by mistake (a loss kept with its graph, a list of tensors appended to). The fix
  is in the code, so there is no setting to print; it is verified by replaying the trace with each
  such block freed at the end of the iteration that allocated it: with a capacity, the replay fits
  or it does not.
* **Memory outside PyTorch**: freeing what other processes hold on the GPU (or giving the job a GPU
  of its own) is checked by arithmetic on the message's figures: the request fits in the free
  memory plus the other processes' memory. Nothing can be replayed, so it is not verified.
"""

from __future__ import annotations

from typing import Any

from memplan.doctor.message import OOMMessage
from memplan.doctor.report import Finding, Fix
from memplan.doctor.words import format_bytes
from memplan.events import ALLOC, FREE, AllocEvent, Trace

__all__ = ["leak_fix", "outside_fix", "without_leaks"]


def without_leaks(trace: Trace, leaked_positions: set[int]) -> Trace:
    """``trace`` with each alloc at ``leaked_positions`` freed after the last event of its iteration."""
    last_of: dict[int, int] = {}
    for position, event in enumerate(trace.events):
        last_of[event.iteration] = position
    frees_after: dict[int, list[AllocEvent]] = {}
    for position in leaked_positions:
        event = trace.events[position]
        frees_after.setdefault(last_of[event.iteration], []).append(
            AllocEvent(0, FREE, event.block, event.size, event.category, event.phase, event.iteration, event.op,
                       event.module, event.stream))
    out: list[AllocEvent] = []
    for position, event in enumerate(trace.events):
        out.append(event)
        out.extend(frees_after.get(position, ()))
    return Trace(events=tuple(out), meta=trace.meta)


def _leaked_positions(trace: Trace, sites: set[str], site_of: Any) -> set[int]:
    live: dict[int, int] = {}
    for position, event in enumerate(trace.events):
        if event.kind == ALLOC:
            if event.iteration >= 0:
                live[event.block] = position
        else:
            live.pop(event.block, None)
    return {p for p in live.values() if site_of(p) in sites}


def leak_fix(leak: Finding, trace: Trace, site_of: Any, settings: Any, capacity: int | None) -> Fix:
    """Free what the growing sites keep; verified by replaying the trace without those blocks."""
    from dataclasses import replace

    from memplan.doctor.replay import replay_trace

    sites = {s for s, _ in leak.sites}
    positions = _leaked_positions(trace, sites, site_of)
    fixed = without_leaks(trace, positions)
    names = ", ".join(sorted(sites)[:3])
    action = f"Free what {names} keeps across iterations (detach / .item() / clear the list)"
    if capacity is None:
        return Fix(action=action, kind="code", setting=f"code at {names}", saves_bytes=leak.magnitude_bytes,
                   verified=False, verified_by="none", verification="no capacity to replay against")
    result = replay_trace(fixed, replace(settings, capacity=capacity))
    fits = result.oom is None
    text = (f"replayed the trace with the {len(positions)} kept blocks freed at the end of their iteration at "
            f"{format_bytes(capacity)}: " + (f"peak reserved {format_bytes(result.peak_reserved_bytes)}, no "
                                              "out-of-memory" if fits else "still out of memory"))
    return Fix(action=action, kind="code", setting=f"code at {names}", saves_bytes=leak.magnitude_bytes,
               verified=fits, verified_by="simulation", verification=text,
               peak_bytes=result.peak_reserved_bytes if fits else None, limit_bytes=capacity)


def outside_fix(msg: OOMMessage, finding: Finding) -> Fix:
    """Free the memory other processes hold (or use a GPU of its own): checked by arithmetic only."""
    others = next((e.value for e in finding.evidence if e.name == "other_processes_bytes"), 0) or 0
    needed = msg.requested.bytes - msg.free.bytes - msg.unallocated.bytes
    text = (f"the request needs {format_bytes(max(needed, 0))} beyond free + reserved-but-unallocated; "
            f"{format_bytes(int(others))} is held outside PyTorch by other processes; not replayed (no trace)")
    return Fix(action="Free the GPU memory other processes hold (nvidia-smi lists them) or give the job a GPU "
               "of its own", kind="environment", setting="CUDA_VISIBLE_DEVICES=<an idle GPU>",
               saves_bytes=finding.magnitude_bytes, verified=False, verified_by="arithmetic", verification=text,
               config_key="CUDA_VISIBLE_DEVICES")
