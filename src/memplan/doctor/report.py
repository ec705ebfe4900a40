"""What the doctor answers: a verdict, the findings and numbers behind it, and verified fixes.

All bytes are integers; text rendering prints GiB = 2^30 bytes. :meth:`DoctorReport.to_json` is the
``--json`` document (``verdict``, ``evidence``, ``findings``, ``fixes``, ...); :meth:`DoctorReport.to_text`
the plain text a log or ``memplan.watch`` writes; ``__rich__`` the tables ``memplan doctor`` prints.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from memplan.doctor.message import OOMMessage
from memplan.doctor.words import VERDICT_TEXT, format_bytes
from memplan.frameworks.native_fix import native_lines
from memplan.settings import settings_dict

__all__ = ["VERDICTS", "DoctorReport", "Evidence", "Finding", "Fix", "Verdict", "rank_fixes"]

#: The verdicts, most specific first: what the doctor can conclude.
Verdict = Literal["demand", "fragmentation", "outside_pytorch", "leak", "spike", "fits", "unknown"]
VERDICTS: tuple[str, ...] = ("demand", "fragmentation", "outside_pytorch", "leak", "spike", "fits", "unknown")

@dataclass(frozen=True)
class Evidence:
    """One number behind a finding, and where it came from."""

    name: str
    value: int | float | str | None
    #: ``message``, ``snapshot``, ``trace``, ``simulation``, ``estimate`` or ``derived``.
    source: str
    #: ``bytes`` for byte counts (rendered in GiB), else free text (``fraction``, ``events``).
    unit: str = "bytes"
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "value": self.value, "unit": self.unit, "source": self.source, "note": self.note}

    def render(self) -> str:
        if self.unit == "bytes" and isinstance(self.value, int):
            return format_bytes(self.value)
        if self.unit == "fraction" and isinstance(self.value, float):
            return f"{100 * self.value:.1f}%"
        return f"{self.value}" + (f" {self.unit}" if self.unit not in ("", "bytes", "text") else "")


@dataclass(frozen=True)
class Finding:
    """A verdict that holds, with its size and the numbers that show it."""

    verdict: str
    #: One sentence with the numbers.
    summary: str
    #: The size of the problem: bytes short, fragmented, outside, grown per iteration, or of the spike.
    magnitude_bytes: int
    evidence: tuple[Evidence, ...] = ()
    #: Allocation sites (top frames, or module/op) behind a leak or a spike, with their bytes.
    sites: tuple[tuple[str, int], ...] = ()
    #: False when the finding contributes but does not alone explain the out-of-memory.
    decisive: bool = True

    def to_dict(self) -> dict[str, Any]:
        return {"verdict": self.verdict, "summary": self.summary, "magnitude_bytes": self.magnitude_bytes,
                "decisive": self.decisive, "evidence": [e.to_dict() for e in self.evidence],
                "sites": [{"site": s, "bytes": b} for s, b in self.sites]}


@dataclass(frozen=True)
class Fix:
    """One change, what it saves, and whether memplan checked that it fits."""

    #: What to do, for people ("Use expandable segments").
    action: str
    #: ``allocator`` (PYTORCH_CUDA_ALLOC_CONF), ``job`` (a training setting), ``code`` (the training
    #: script, e.g. a leak) or ``environment`` (other processes on the GPU).
    kind: Literal["allocator", "job", "code", "environment"]
    #: The exact line to use: ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``, ``--mbs 2``.
    setting: str
    #: Bytes of peak the change saves (None: not measurable from the inputs).
    saves_bytes: int | None
    #: True when memplan re-ran the job with the change and it fits.
    verified: bool
    #: How it was checked: ``simulation`` (allocator replay), ``reconstruction`` (allocator replay of
    #: the most fragmented history consistent with a message), ``estimate`` (estimator + step
    #: model), ``arithmetic`` (a bound from the message), or ``none``.
    verified_by: str
    #: The check in one sentence, with its numbers.
    verification: str
    #: Predicted peak with the change, and the limit it was checked against.
    peak_bytes: int | None = None
    limit_bytes: int | None = None
    #: Step-time cost: predicted seconds per step before and after (job fixes), None for allocator ones.
    step_time_s: float | None = None
    base_step_time_s: float | None = None
    #: The job-file key (a job flag's name) or the environment variable the setting goes in.
    config_key: str = ""
    #: True when the change alters what the job computes or trains (LoRA/QLoRA), not only how.
    changes_training: bool = False
    #: A job fix in the job's framework's own settings (``NativeChange.to_dict()``: ``dialect``, ``text``,
    #: ``settings``, ``notes``); None for other fixes.
    native: dict[str, Any] | None = None

    @property
    def fits(self) -> bool:
        return self.verified

    @property
    def cost(self) -> float:
        """Relative step-time increase (0 for allocator settings); the ranking key among verified fixes."""
        if self.step_time_s is None or not self.base_step_time_s:
            return 0.0
        return self.step_time_s / self.base_step_time_s - 1.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "action": self.action, "kind": self.kind, "setting": self.setting, "config_key": self.config_key,
            "saves_bytes": self.saves_bytes, "verified": self.verified, "verified_by": self.verified_by,
            "verification": self.verification, "peak_bytes": self.peak_bytes, "limit_bytes": self.limit_bytes,
            "step_time_s": self.step_time_s, "base_step_time_s": self.base_step_time_s,
            "step_time_cost": round(self.cost, 6), "changes_training": self.changes_training,
            "native": self.native,
        }


def rank_fixes(fixes: list[Fix] | tuple[Fix, ...]) -> tuple[Fix, ...]:
    """Verified first; then those that keep the training as it is; then priced before unpriced job changes
    (CPU offload: the step-time model has no term for it); then cheapest, then largest saving."""
    return tuple(sorted(fixes, key=lambda f: (not f.verified, f.changes_training,
                                              f.kind == "job" and f.step_time_s is None, f.cost,
                                              -(f.saves_bytes or 0))))


@dataclass(frozen=True)
class DoctorReport:
    """The doctor's answer. ``verdict`` is the first finding's (or ``fits`` / ``unknown``)."""

    verdict: str
    findings: tuple[Finding, ...]
    #: Ranked: verified before unverified, same training before changed training (LoRA), then by
    #: step-time cost, then by bytes saved.
    fixes: tuple[Fix, ...]
    #: What was given: ``message``, ``snapshot``, ``trace``, ``job``.
    inputs: tuple[str, ...]
    message: OOMMessage | None = None
    #: Memory the allocator could use in the checks (bytes), and where that figure came from.
    capacity_bytes: int | None = None
    capacity_source: str = ""
    #: What could not be checked and why.
    notes: tuple[str, ...] = ()
    #: What the job's input files said, and how memplan treated each (:class:`memplan.settings.InputSetting`).
    input_settings: tuple[Any, ...] = ()
    #: The live bytes over the trace or snapshot's history (:attr:`TraceFacts.live_timeline`); empty without one.
    timeline: tuple[tuple[int, int, int], ...] = ()
    #: Where the live bytes peaked (event index, bytes), and where the run failed (event index), if known.
    peak: tuple[int, int] | None = None
    oom_index: int | None = None

    @property
    def evidence(self) -> tuple[Evidence, ...]:
        """Every finding's evidence, the verdict's first."""
        return tuple(e for f in self.findings for e in f.evidence)

    def to_json(self) -> dict[str, Any]:
        """The ``--json`` document (a plain dict; ``json.dumps`` it)."""
        return {
            "verdict": self.verdict,
            "verdict_text": VERDICT_TEXT.get(self.verdict, ""),
            "evidence": [e.to_dict() for e in self.evidence],
            "findings": [f.to_dict() for f in self.findings],
            "fixes": [f.to_dict() for f in self.fixes],
            "inputs": list(self.inputs),
            "capacity_bytes": self.capacity_bytes,
            "capacity_source": self.capacity_source,
            "message": None if self.message is None else self.message.to_dict(),
            "notes": list(self.notes),
            "timeline": None if not self.timeline else {
                "points": [list(p) for p in self.timeline], "peak_index": self.peak[0] if self.peak else None,
                "peak_live_bytes": self.peak[1] if self.peak else None, "oom_index": self.oom_index,
                "note": "live bytes (requested sizes) over the events; each point is the most live in its stretch"},
            **settings_dict(self.input_settings),
        }

    def to_text(self) -> str:
        """Plain text: the verdict, each finding with its numbers, the fixes ranked (no colour)."""
        lines = [f"memplan doctor: {self.verdict} - {VERDICT_TEXT.get(self.verdict, '')}"]
        for finding in self.findings:
            lines.append(f"  [{finding.verdict}] {finding.summary}")
            for e in finding.evidence:
                lines.append(f"      {e.name}: {e.render()} ({e.source}{'; ' + e.note if e.note else ''})")
            for site, size in finding.sites:
                lines.append(f"      site {site}: {format_bytes(size)}")
        if self.fixes:
            lines.append("fixes (cheapest verified first):")
        for rank, fix in enumerate(self.fixes, start=1):
            mark = "verified" if fix.verified else "NOT verified"
            lines.append(f"  {rank}. {fix.action}: {fix.setting}")
            lines.extend(f"      {line}" for line in native_lines(fix.native))
            lines.append(f"      saves {format_bytes(fix.saves_bytes)}; {mark} by {fix.verified_by}: "
                         f"{fix.verification}")
        lines.extend(f"note: {n}" for n in self.notes)
        return "\n".join(lines)

    def __rich__(self) -> Any:
        from memplan.doctor.render import render_report

        return render_report(self)
