"""``diagnose``: why a job ran out of GPU memory and the cheapest fix that works.

Example::

    >>> from memplan.doctor import diagnose
    >>> report = diagnose("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of "
    ...     "79.15 GiB of which 1.23 GiB is free. Including non-PyTorch memory, this process has 77.90 GiB "
    ...     "memory in use. Of the allocated memory 66.12 GiB is allocated by PyTorch, and 9.82 GiB is "
    ...     "reserved by PyTorch but unallocated.")
    >>> report.verdict
    'fragmentation'

Inputs, alone or together: the OOM message; a snapshot (pickle path, ``torch.cuda.memory._snapshot()``
dict, or loaded) or a memplan trace; a job (for fixes that change the job). The memory the allocator
may use comes from ``capacity_bytes``, else the message (reserved + free at the OOM, or its
``allowed`` cap), else the GPU's usable memory. Known limitations: a message alone cannot replay the
allocator (allocator fixes are then checked by arithmetic, not verified); a snapshot without
``Optimizer.step`` annotations has no iterations, so no growth can be seen in it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from memplan.alloc.settings import AllocatorSettings
from memplan.alloc.snapshot import Snapshot
from memplan.doctor.findings import (
    estimate_findings,
    is_bound,
    message_findings,
    peak_findings,
    rank_findings,
    replay_findings,
    snapshot_findings,
    trace_findings,
)
from memplan.doctor.inputs import SnapshotInput, read_snapshot, with_message_request
from memplan.doctor.message import OOMMessage, parse_oom_message
from memplan.doctor.report import DoctorReport, Finding, Fix, rank_fixes
from memplan.doctor.trace_facts import default_site, trace_facts
from memplan.events import Trace, read_trace

__all__ = ["diagnose"]


def diagnose(
    message: str | OOMMessage | None = None,
    *,
    snapshot: Snapshot | Mapping[str, Any] | str | os.PathLike[str] | None = None,
    trace: Trace | str | os.PathLike[str] | None = None,
    job: Any = None,
    gpu: str | None = None,
    capacity_bytes: int | None = None,
    settings: AllocatorSettings | None = None,
    verify: bool = True,
) -> DoctorReport:
    """Diagnose an out-of-memory (or a run at risk of one) and rank verified fixes.

    ``job``: a :class:`memplan.inputs.LoadedJob` (or :class:`~memplan.inputs.JobRequest`) for job
    fixes; ``gpu``: a catalogue GPU name (capacity and step-time data); ``settings``: the
    ``PYTORCH_CUDA_ALLOC_CONF`` the run used (default: the snapshot's recorded one, else PyTorch's
    defaults); ``verify=False`` skips every re-simulation and re-estimate (findings only).
    Raises :class:`~memplan.errors.ConfigError` for unreadable or malformed inputs.
    """
    case = _gather(message, snapshot, trace, job, gpu, capacity_bytes, settings)
    findings: list[Finding] = []
    if case.msg is not None:
        findings.extend(message_findings(case.msg))
    if case.events is not None and case.capacity is not None and verify:
        case = _replayed(case)
        findings.extend(replay_findings(case.replay, case.capacity))
    snap = case.snap
    if snap is not None and (snap.trace is None or case.msg is not None or snap.oom_requested_bytes is not None):
        requested = case.msg.requested.bytes if case.msg is not None else snap.oom_requested_bytes
        findings.extend(snapshot_findings(snap.snapshot, requested))
    facts = None
    if case.events is not None:
        facts = trace_facts(case.events.events, site_of=case.site_of, categories_known=case.categories_known)
        source = "trace" if case.categories_known else "snapshot"
        findings.extend(trace_findings(facts, source))
        if case.capacity is not None:
            findings.extend(peak_findings(facts.peak_live_bytes, case.capacity, source))
    if case.loaded is not None and case.capacity is not None and verify:
        findings.extend(_estimate_findings(case.loaded, case.capacity))
    ranked = rank_findings(findings)
    notes: list[str] = []
    if not case.inputs:
        notes.append("nothing to diagnose: give an OOM message, a snapshot or trace, or a job")
    if case.events is not None and case.capacity is None:
        if not ranked and snap is None and case.msg is None:
            from memplan.errors import ConfigError

            raise ConfigError("--gpu", "is needed to diagnose a trace alone: the capacity to replay it against "
                              "(or give --capacity, or the OOM message the run printed)")
        notes.append("no capacity (give the OOM message, --gpu or --capacity): the trace was not replayed")
    fixes = _fixes(ranked, case, notes) if verify else ()
    return DoctorReport(verdict=_verdict(ranked, case.events, snap), findings=ranked, fixes=fixes,
                        inputs=case.inputs, message=case.msg, capacity_bytes=case.capacity,
                        capacity_source=case.capacity_source, notes=tuple(notes),
                        input_settings=tuple(case.loaded.settings) if case.loaded is not None else (),
                        timeline=facts.live_timeline if facts is not None else (),
                        peak=(facts.peak_index, facts.peak_live_bytes) if facts is not None else None,
                        oom_index=_oom_index(case))


def _oom_index(case: _Case) -> int | None:
    """The event at which the replay at the run's own settings ran out of memory, if it did."""
    replay = case.replay
    return replay.oom.event_index if replay is not None and replay.oom is not None else None


@dataclass(frozen=True)
class _Case:
    """The inputs made uniform, and the replay of the run as recorded (once a capacity is known)."""

    inputs: tuple[str, ...]
    msg: OOMMessage | None
    snap: SnapshotInput | None
    events: Trace | None
    loaded: Any
    gpu: str | None
    capacity: int | None
    capacity_source: str
    settings: AllocatorSettings
    replay: Any = None
    shape: Any = None

    @property
    def categories_known(self) -> bool:
        """A snapshot's trace has no categories (every block is ``temporary``)."""
        return self.snap is None or self.events is not self.snap.trace

    def site_of(self, position: int) -> str:
        if self.snap is not None and self.events is self.snap.trace and self.snap.sites:
            return self.snap.sites[position] or "?"
        assert self.events is not None
        return default_site(self.events.events[position])


def _gather(message: str | OOMMessage | None, snapshot: Any, trace: Any, job: Any, gpu: str | None,
            capacity_bytes: int | None, settings: AllocatorSettings | None) -> _Case:
    msg = parse_oom_message(message) if isinstance(message, str) else message
    snap = read_snapshot(snapshot) if snapshot is not None else None
    if snap is not None and msg is not None:
        snap = with_message_request(snap, msg.requested.bytes)
    events = _trace(trace, snap)
    loaded = _loaded_job(job)
    given = {"message": msg, "snapshot": snap, "trace": trace, "job": loaded}
    gpu = gpu or (loaded.gpu if loaded is not None else None)
    capacity, capacity_source = _capacity(capacity_bytes, msg, gpu)
    if capacity is None and snap is not None and snap.oom_capacity_bytes is not None:
        capacity, capacity_source = snap.oom_capacity_bytes, "snapshot: reserved + device free at its OOM"
    base = settings or (snap.snapshot.settings if snap is not None else None) or AllocatorSettings()
    return _Case(inputs=tuple(k for k, v in given.items() if v is not None), msg=msg, snap=snap, events=events,
                 loaded=loaded, gpu=gpu, capacity=capacity, capacity_source=capacity_source, settings=base)


def _replayed(case: _Case) -> _Case:
    from memplan.doctor.replay import replay_trace, trace_shape

    assert case.events is not None and case.capacity is not None
    shape = trace_shape(case.events.events)
    replay = replay_trace(case.events, case.settings.with_changes(capacity=case.capacity), shape)
    return replace(case, replay=replay, shape=shape)


def _trace(trace: Trace | str | os.PathLike[str] | None, snap: SnapshotInput | None) -> Trace | None:
    if isinstance(trace, Trace):
        return trace
    if trace is not None:
        return read_trace(trace)
    return snap.trace if snap is not None else None


def _loaded_job(job: Any) -> Any:
    if job is None:
        return None
    from memplan.inputs import JobRequest, LoadedJob, load_job

    if isinstance(job, JobRequest):
        return load_job(job)
    if isinstance(job, LoadedJob):
        return job
    from memplan.errors import ConfigError

    raise ConfigError("job", "must be a memplan.inputs.LoadedJob or JobRequest", type(job).__name__)


def _capacity(capacity_bytes: int | None, msg: OOMMessage | None, gpu: str | None) -> tuple[int | None, str]:
    if capacity_bytes is not None:
        if capacity_bytes <= 0:
            from memplan.errors import ConfigError

            raise ConfigError("capacity", "must be a positive number of bytes", capacity_bytes)
        return capacity_bytes, "given"
    if msg is not None:
        return msg.pytorch_limit_bytes, "message: reserved + free" + (" (allowed cap)" if msg.allowed else "")
    if gpu is not None:
        from memplan.gpus import get_gpu

        return get_gpu(gpu).usable_bytes, f"GPU {gpu}: usable bytes"
    return None, ""


def _estimate_findings(loaded: Any, capacity: int) -> list[Finding]:
    from memplan.estimate.engine import DEFAULT_FRAGMENTATION, estimate

    frag = loaded.fragmentation if loaded.fragmentation is not None else DEFAULT_FRAGMENTATION
    est = estimate(loaded.model, loaded.job, fragmentation=frag)
    return estimate_findings(est.peak_allocated_bytes, est.peak_reserved_bytes, capacity)


def _verdict(ranked: tuple[Finding, ...], events: Trace | None, snap: SnapshotInput | None) -> str:
    if ranked:
        return ranked[0].verdict
    # A recorded run with no out-of-memory in it, and nothing wrong found: it fits.
    if snap is not None and snap.trace is not None and snap.oom_requested_bytes is None:
        return "fits"
    return "unknown"


def _fixes(ranked: tuple[Finding, ...], c: _Case, notes: list[str]) -> tuple[Fix, ...]:
    problems = {f.verdict for f in ranked} - {"fits", "unknown"}
    if not problems:
        return ()
    from memplan.doctor.alloc_fixes import allocator_fixes
    from memplan.doctor.job_fixes import job_fixes
    from memplan.doctor.other_fixes import leak_fix, outside_fix

    fixes: list[Fix] = []
    if any(is_bound(f) for f in ranked):
        notes.append("no allocator setting was tried: the live memory alone exceeds the capacity")
    else:
        fixes.extend(allocator_fixes(problems, c.msg, c.events, c.replay, c.shape, c.settings, c.capacity))
    for finding in ranked:
        if finding.verdict == "leak" and c.events is not None:
            fixes.append(leak_fix(finding, c.events, c.site_of, c.settings, c.capacity))
        if finding.verdict == "outside_pytorch" and finding.decisive and c.msg is not None:
            fixes.append(outside_fix(c.msg, finding))
    if c.loaded is not None:
        fixes.extend(job_fixes(c.loaded, c.msg, c.capacity, c.gpu, notes))
    elif "demand" in problems or "spike" in problems:
        notes.append("give the job (model and flags, or --job FILE) to check job changes with the estimator")
    return rank_fixes(fixes)
