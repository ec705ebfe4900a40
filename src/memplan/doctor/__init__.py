"""``memplan doctor``: why a job ran out of GPU memory, and the cheapest fix that works.

Public surface::

    diagnose(message, snapshot=..., trace=..., job=..., gpu=..., capacity_bytes=...) -> DoctorReport
    parse_oom_message(text) -> OOMMessage       every figure of a PyTorch 1.13-2.x OOM message
    DoctorReport, Finding, Evidence, Fix         frozen results; report.to_json(), report.to_text()

See docs/doctor.md for the rules behind each verdict and how each fix is verified.
"""

from __future__ import annotations

from memplan.doctor.api import diagnose
from memplan.doctor.message import Figure, OOMMessage, parse_oom_message
from memplan.doctor.report import VERDICTS, DoctorReport, Evidence, Finding, Fix

__all__ = [
    "VERDICTS",
    "DoctorReport",
    "Evidence",
    "Figure",
    "Finding",
    "Fix",
    "OOMMessage",
    "diagnose",
    "parse_oom_message",
]
