"""Words and units of the doctor's reports: the sentence for each verdict, bytes as GiB/MiB."""

from __future__ import annotations

from memplan.units import GiB, MiB

__all__ = ["VERDICT_TEXT", "format_bytes"]

#: One line per verdict, for people.
VERDICT_TEXT: dict[str, str] = {
    "demand": "the live tensors and the request do not fit in the memory PyTorch can have",
    "fragmentation": "the request would have fit in memory PyTorch had reserved but not allocated (it was in pieces "
                     "too small)",
    "outside_pytorch": "memory outside PyTorch (other processes, NCCL, the CUDA context) took what was missing",
    "leak": "growth across iterations: live memory at the same point of each iteration keeps rising",
    "spike": "a one-op spike: one temporary or workspace dominates the peak",
    "fits": "no out-of-memory: the job fits",
    "unknown": "not enough input to tell",
}


def format_bytes(value: int | None) -> str:
    """``12.34 GiB`` / ``512.0 MiB`` (binary units), ``-`` for None."""
    if value is None:
        return "-"
    sign = "-" if value < 0 else ""
    value = abs(value)
    if value >= GiB:
        return f"{sign}{value / GiB:.2f} GiB"
    return f"{sign}{value / MiB:.1f} MiB"
