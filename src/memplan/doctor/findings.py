"""Verdicts from each input: an OOM message's figures, a replay at a capacity, a snapshot's segments, a
trace's growth and spikes. Each function returns :class:`~memplan.doctor.report.Finding` objects with
the numbers that show them; :func:`rank_findings` orders them, the verdict first.

The rules (every figure as printed, compared with the message's rounding allowed for):

* **demand**: allocated + requested > what PyTorch could have held (reserved + free, or the
  ``allowed`` cap of ``set_per_process_memory_fraction``), or equal within the message's rounding:
  no packing of the live tensors fits; with a job, also when the estimator's peak allocated memory
  (no fragmentation in it) exceeds the capacity;
* **fragmentation**: allocated + requested fits in reserved + free, so the request failed only
  because no cached block was large enough and the cache could not be returned to the device
  (the request alone fits in the reserved-but-unallocated bytes, or in those plus the free);
* **outside_pytorch**: capacity - reserved - free is more than :data:`CONTEXT_ALLOWANCE_BYTES`
  (a CUDA context with NCCL) by at least the shortfall: without the other processes it would fit;
* **spike**: the failed request alone is at least :data:`SPIKE_MESSAGE_SHARE` of what PyTorch
  could hold (in a trace, one short-lived block is :data:`~memplan.doctor.trace_facts.SPIKE_SHARE`
  of the peak);
* **unknown**: the request fits in the memory the device reported free: the figures do not explain
  the failure.
* **leak**: see :mod:`memplan.doctor.trace_facts`.
"""

from __future__ import annotations

from collections.abc import Iterable

from memplan.alloc.snapshot import Snapshot
from memplan.doctor.message import OOMMessage
from memplan.doctor.replay import ReplayResult
from memplan.doctor.report import Evidence, Finding
from memplan.doctor.trace_facts import TraceFacts
from memplan.doctor.words import format_bytes
from memplan.gpus import DEFAULT_OUTSIDE_ALLOCATOR_BYTES

__all__ = ["CONTEXT_ALLOWANCE_BYTES", "SPIKE_MESSAGE_SHARE", "estimate_findings", "is_bound", "message_findings",
           "peak_findings", "rank_findings", "replay_findings",
           "snapshot_findings", "trace_findings"]

#: Memory a training process normally holds outside PyTorch's allocator (CUDA context, cuBLAS,
#: NCCL): memplan's catalogue figure (:data:`memplan.gpus.DEFAULT_OUTSIDE_ALLOCATOR_BYTES`).
CONTEXT_ALLOWANCE_BYTES = DEFAULT_OUTSIDE_ALLOCATOR_BYTES
#: A failed request at least this share of what PyTorch could hold is a one-op spike (a message
#: has no other blocks to compare with, so the bar is higher than a trace's).
SPIKE_MESSAGE_SHARE = 1 / 3
#: Below this share of reserved memory, reserved-but-unallocated bytes are not fragmentation.
FRAGMENTED_SHARE = 0.1
#: Order of verdicts when several hold: the root cause first.
_PRIORITY = {"leak": 0, "outside_pytorch": 1, "bound": 2, "fragmentation": 3, "spike": 4, "demand": 5}


def _m(name: str, value: int, note: str = "", source: str = "message") -> Evidence:
    return Evidence(name=name, value=value, source=source, note=note)


def _others_bytes(m: OOMMessage) -> tuple[int, int]:
    """(other processes' bytes, this process's non-PyTorch bytes) from the process lines, or the
    whole outside figure as unknown-owner (returned as other processes) when none is printed."""
    reserved = m.reserved.bytes
    if m.process_in_use is not None:
        return max(0, m.total.bytes - m.free.bytes - m.process_in_use.bytes), \
            max(0, m.process_in_use.bytes - reserved)
    if m.processes:
        # This process is the one whose use covers PyTorch's reserve most closely.
        mine = min((f for _, f in m.processes if f.bytes + f.resolution_bytes >= reserved),
                   key=lambda f: f.bytes, default=None)
        own = mine.bytes if mine is not None else 0
        others = sum(f.bytes for _, f in m.processes) - own
        return max(0, others), max(0, own - reserved) if mine is not None else 0
    return m.outside_pytorch_bytes, 0


def message_findings(m: OOMMessage) -> list[Finding]:
    """Findings from the figures of one OOM message (see the module docstring)."""
    req, alloc, unalloc, free = m.requested.bytes, m.allocated.bytes, m.unallocated.bytes, m.free.bytes
    limit = m.pytorch_limit_bytes
    tol = (m.allocated.resolution_bytes + m.requested.resolution_bytes + m.reserved.resolution_bytes
           + m.free.resolution_bytes)
    base = [_m("requested_bytes", req), _m("total_capacity_bytes", m.total.bytes), _m("free_bytes", free),
            _m("allocated_bytes", alloc), _m("reserved_bytes", m.reserved.bytes, m.reserved.text),
            _m("reserved_unallocated_bytes", unalloc, m.unallocated.text),
            _m("outside_pytorch_bytes", m.outside_pytorch_bytes, "capacity - reserved - free")]
    if m.allowed is not None:
        base.append(_m("allowed_bytes", m.allowed.bytes, "set_per_process_memory_fraction cap"))
    if m.process_in_use is not None:
        base.append(_m("process_in_use_bytes", m.process_in_use.bytes, "including non-PyTorch memory"))
    out: list[Finding] = []
    if req + m.requested.resolution_bytes <= free:
        return [Finding(verdict="unknown", magnitude_bytes=0, evidence=tuple(base), summary=(
            f"the request of {format_bytes(req)} fits in the {format_bytes(free)} the device reported free: the "
            "figures do not explain the failure (the driver refused cudaMalloc: a Windows WDDM limit, MIG/MPS, "
            "or another process took the memory meanwhile)"))]
    shortfall = alloc + req - limit
    cap_name = "the allowed cap" if m.allowed is not None and m.allowed.bytes < m.reserved.bytes + free \
        else "reserved + free"
    if shortfall >= -tol:
        out.append(Finding(
            verdict="demand", magnitude_bytes=shortfall, evidence=(*base, _m("shortfall_bytes", shortfall,
                                                                              "allocated + requested - limit")),
            summary=(f"allocated {format_bytes(alloc)} + requested {format_bytes(req)} exceed the "
                     f"{format_bytes(limit)} PyTorch could hold ({cap_name}) by {format_bytes(shortfall)}")))
        out.extend(_outside(m, max(shortfall, 0) + tol, decisive_only=False))
    else:
        where = (f"the {format_bytes(unalloc)} reserved but unallocated" if req <= unalloc + tol else
                 f"free {format_bytes(free)} + reserved-but-unallocated {format_bytes(unalloc)}")
        out.append(Finding(
            verdict="fragmentation", magnitude_bytes=unalloc, evidence=tuple(base),
            summary=(f"the request of {format_bytes(req)} would have fit in {where}; allocated "
                     f"{format_bytes(alloc)} + requested fit in the {format_bytes(limit)} PyTorch could hold, "
                     "but no cached block was large enough")))
    if req >= SPIKE_MESSAGE_SHARE * limit:
        out.append(Finding(
            verdict="spike", magnitude_bytes=req, evidence=(_m("requested_bytes", req), _m("limit_bytes", limit)),
            summary=(f"one request of {format_bytes(req)} is {100 * req / max(limit, 1):.0f}% of the "
                     f"{format_bytes(limit)} PyTorch could hold: a single temporary dominates")))
    return out


def _outside(m: OOMMessage, shortfall: int, *, decisive_only: bool) -> list[Finding]:
    others, own_extra = _others_bytes(m)
    outside = m.outside_pytorch_bytes
    excess = max(0, outside - CONTEXT_ALLOWANCE_BYTES)
    if excess <= m.outside_resolution_bytes:
        return []
    decisive = excess >= shortfall
    if decisive_only and not decisive:
        return []
    ev = (_m("outside_pytorch_bytes", outside, "capacity - reserved - free"),
          _m("other_processes_bytes", others, "capacity - free - this process"),
          _m("this_process_non_pytorch_bytes", own_extra, "context, NCCL, other libraries"),
          _m("context_allowance_bytes", CONTEXT_ALLOWANCE_BYTES, "typical CUDA context + NCCL", "derived"))
    verb = "would have fit" if decisive else "is part of the shortfall"
    return [Finding(verdict="outside_pytorch", magnitude_bytes=excess, evidence=ev, decisive=decisive,
                    summary=(f"{format_bytes(outside)} of the device is outside PyTorch (other processes "
                             f"{format_bytes(others)}), {format_bytes(excess)} more than a CUDA context needs; "
                             f"without it the request {verb} (short by {format_bytes(shortfall)})"))]


def replay_findings(result: ReplayResult, capacity: int) -> list[Finding]:
    """Findings from replaying a trace through the allocator simulator at ``capacity`` bytes."""
    src = "simulation"
    if result.oom is None:
        return [Finding(verdict="fits", magnitude_bytes=capacity - result.peak_reserved_bytes, evidence=(
            _m("peak_reserved_bytes", result.peak_reserved_bytes, source=src),
            _m("peak_allocated_bytes", result.peak_allocated_bytes, source=src),
            _m("capacity_bytes", capacity, source=src)),
            summary=(f"replayed at {format_bytes(capacity)}: peak reserved {format_bytes(result.peak_reserved_bytes)}, "
                     "no out-of-memory"))]
    allocated, reserved = result.allocated_bytes, result.reserved_bytes
    size = result.oom.alloc_size_bytes
    largest = result.largest_free_block_bytes
    ev = (_m("requested_bytes", result.oom.requested_bytes, source=src),
          _m("allocated_bytes", allocated, "at the out-of-memory", src),
          _m("reserved_bytes", reserved, "at the out-of-memory", src),
          _m("largest_free_block_bytes", largest, "largest cached block of any segment", src),
          _m("capacity_bytes", capacity, source=src))
    if allocated + size <= capacity:
        return [Finding(verdict="fragmentation", magnitude_bytes=reserved - allocated, evidence=ev, summary=(
            f"replay runs out at event {result.oom.event_index}: {format_bytes(result.oom.requested_bytes)} requested "
            f"({format_bytes(size)} to allocate), no segment had a free block that large (largest "
            f"{format_bytes(largest)}), yet allocated {format_bytes(allocated)} + request fit in "
            f"{format_bytes(capacity)}"))]
    short = allocated + size - capacity
    return [Finding(verdict="demand", magnitude_bytes=short, evidence=ev, summary=(
        f"replay runs out at event {result.oom.event_index}: allocated {format_bytes(allocated)} + requested "
        f"{format_bytes(size)} exceed {format_bytes(capacity)} by {format_bytes(short)}"))]


def snapshot_findings(snapshot: Snapshot, requested: int | None) -> list[Finding]:
    """Findings from a snapshot's segments (its state when dumped, assumed to be at the OOM)."""
    reserved = sum(s.total_size for s in snapshot.segments)
    allocated = sum(b.size for s in snapshot.segments for b in s.blocks if b.active)
    largest = max((b.size for s in snapshot.segments for b in s.blocks if not b.active), default=0)
    unallocated = reserved - allocated
    src = "snapshot"
    ev = (_m("reserved_bytes", reserved, "sum of segments", src), _m("allocated_bytes", allocated, "active blocks", src),
          _m("reserved_unallocated_bytes", unallocated, source=src),
          _m("largest_free_block_bytes", largest, "largest inactive block of any segment", src))
    if requested is not None and largest < requested <= unallocated:
        return [Finding(verdict="fragmentation", magnitude_bytes=unallocated, evidence=ev, summary=(
            f"no segment had a free block of {format_bytes(requested)} (largest {format_bytes(largest)}) though "
            f"{format_bytes(unallocated)} of {format_bytes(reserved)} reserved was unallocated"))]
    if reserved and unallocated >= FRAGMENTED_SHARE * reserved:
        return [Finding(verdict="fragmentation", magnitude_bytes=unallocated, evidence=ev, summary=(
            f"{format_bytes(unallocated)} of {format_bytes(reserved)} reserved is unallocated "
            f"({100 * unallocated / reserved:.0f}%), in blocks of at most {format_bytes(largest)}"))]
    return [Finding(verdict="demand", magnitude_bytes=allocated, evidence=ev, summary=(
        f"live blocks fill the reserve: {format_bytes(allocated)} allocated of {format_bytes(reserved)} reserved "
        f"({format_bytes(unallocated)} unallocated): the memory is demand, not fragmentation"))]


def trace_findings(facts: TraceFacts, source: str) -> list[Finding]:
    """Leak and spike findings of a trace or a snapshot's trace."""
    out: list[Finding] = []
    if facts.leaking:
        ends = ", ".join(f"{format_bytes(live)}" for _, live in facts.iteration_end_live)
        out.append(Finding(
            verdict="leak", magnitude_bytes=facts.growth_per_iteration_bytes, sites=facts.growing_sites,
            evidence=(_m("growth_per_iteration_bytes", facts.growth_per_iteration_bytes, source=source),
                      Evidence("iterations", len(facts.iteration_end_live), source, "iterations"),
                      Evidence("live_at_iteration_end", ends, source, "text")),
            summary=(f"live memory at the end of each iteration rises by {format_bytes(facts.growth_per_iteration_bytes)} "
                     f"per iteration ({ends}); growing sites: "
                     + ", ".join(s for s, _ in facts.growing_sites[:3]))))
    if facts.spiking:
        share = facts.spike_bytes / facts.peak_live_bytes
        out.append(Finding(
            verdict="spike", magnitude_bytes=facts.spike_bytes, sites=((facts.spike_site, facts.spike_bytes),),
            evidence=(_m("spike_bytes", facts.spike_bytes, source=source),
                      _m("peak_live_bytes", facts.peak_live_bytes, source=source),
                      Evidence("spike_share", round(share, 4), source, "fraction")),
            summary=(f"one short-lived block of {format_bytes(facts.spike_bytes)} ({facts.spike_site}) is "
                     f"{100 * share:.0f}% of the {format_bytes(facts.peak_live_bytes)} live at the peak")))
    return out


def estimate_findings(peak_allocated: int, peak_reserved: int, capacity: int) -> list[Finding]:
    """A job whose estimated peak allocated memory (before any fragmentation) exceeds the capacity is
    demand; one whose estimated peak reserved memory is within it fits (unless something else is found)."""
    ev = (_m("estimated_peak_allocated_bytes", peak_allocated, "memplan estimate", "estimate"),
          _m("estimated_peak_reserved_bytes", peak_reserved, "with the assumed fragmentation", "estimate"),
          _m("capacity_bytes", capacity, source="derived"))
    if peak_reserved <= capacity:
        return [Finding(verdict="fits", magnitude_bytes=capacity - peak_reserved, evidence=ev, summary=(
            f"the job is estimated at {format_bytes(peak_reserved)} reserved at its peak, within the "
            f"{format_bytes(capacity)} PyTorch can have"))]
    if peak_allocated <= capacity:
        return []
    return [Finding(verdict="demand", magnitude_bytes=peak_allocated - capacity, evidence=ev, summary=(
        f"the job as given needs {format_bytes(peak_allocated)} allocated at its peak (memplan estimate), more "
        f"than the {format_bytes(capacity)} PyTorch can have: no allocator setting can fit it"))]


def peak_findings(peak_live_bytes: int, capacity: int, source: str) -> list[Finding]:
    """A trace whose live bytes alone (requested sizes, the lower bound of any allocator) exceed the capacity."""
    if peak_live_bytes <= capacity:
        return []
    ev = (_m("peak_live_bytes", peak_live_bytes, "requested bytes live at once: any allocator's lower bound", source),
          _m("capacity_bytes", capacity, source="derived"))
    return [Finding(verdict="demand", magnitude_bytes=peak_live_bytes - capacity, evidence=ev, summary=(
        f"the trace holds {format_bytes(peak_live_bytes)} live at its peak, more than the {format_bytes(capacity)} "
        "PyTorch can have: no allocator setting can fit it"))]


def is_bound(finding: Finding) -> bool:
    """A demand shown by a lower bound (the estimator's peak allocated, a trace's peak live bytes)."""
    return finding.verdict == "demand" and bool(finding.evidence) and finding.evidence[0].name in (
        "estimated_peak_allocated_bytes", "peak_live_bytes")


def rank_findings(findings: Iterable[Finding]) -> tuple[Finding, ...]:
    """One finding per verdict and source (the first given), root causes first; ``fits`` only when nothing
    else holds.

    A finding that is not decisive (e.g. outside memory that is only part of the shortfall) ranks last.
    """
    seen: dict[str, Finding] = {}
    for f in findings:
        if is_bound(f):
            seen.setdefault("bound", f)  # a lower bound outranks what one message or replay shows; both kept
        else:
            seen.setdefault(f.verdict, f)
    problems = [(k, f) for k, f in seen.items() if k != "fits"]
    if not problems:
        return tuple(seen.values())
    return tuple(f for _, f in sorted(problems, key=lambda kf: (not kf[1].decisive, _PRIORITY.get(kf[0], 9))))
