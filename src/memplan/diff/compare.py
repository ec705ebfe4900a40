"""``memplan diff A B``: where the peak of B differs from the peak of A.

Each side is read into a :class:`~memplan.diff.profile.Profile` (its peak of live requested
bytes and what is alive at it). The difference of the two peaks is attributed three ways — by
memory category, by module, by allocation site — as ``B's bytes at its peak − A's bytes at its
peak`` for every key either side has; since each side's breakdown sums to its peak, the deltas of
each attribution add up to ``peak(B) − peak(A)`` exactly (an integer identity, checked).

Example::

    from memplan.diff import diff_files

    result = diff_files("bs8.mptrace", "bs16.mptrace")
    print(result.peak_delta_bytes, result.categories[0].key, result.categories[0].delta_bytes)

Assumptions and limitations: the peak is of requested bytes, before the caching allocator's
rounding and without its cached free blocks (``memplan alloc simulate`` gives reserved bytes);
a snapshot records no categories or module names, so most of its bytes are ``unknown`` and its
modules are named by the lines of the ``forward`` calls that led to them (:mod:`memplan.diff.frames`);
a snapshot's trace covers only the ring buffer's last ``max_entries`` events.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from memplan.diff.profile import Profile
from memplan.errors import ConfigError
from memplan.units import natural_key

__all__ = ["Delta", "DiffResult", "check_comparable", "diff_profiles"]


@dataclass(frozen=True)
class Delta:
    """One key's bytes alive at A's peak and at B's peak."""

    key: str
    a_bytes: int
    b_bytes: int

    @property
    def delta_bytes(self) -> int:
        return self.b_bytes - self.a_bytes

    def to_dict(self) -> dict[str, Any]:
        return {"key": self.key, "a_bytes": self.a_bytes, "b_bytes": self.b_bytes,
                "delta_bytes": self.delta_bytes}


@dataclass(frozen=True)
class DiffResult:
    """The peak difference of B over A, attributed by category, module and site (largest change first)."""

    a: Profile
    b: Profile
    categories: tuple[Delta, ...]
    modules: tuple[Delta, ...]
    sites: tuple[Delta, ...]
    notes: tuple[str, ...] = ()

    @property
    def peak_delta_bytes(self) -> int:
        return self.b.peak_bytes - self.a.peak_bytes

    def attributions(self) -> dict[str, tuple[Delta, ...]]:
        return {"categories": self.categories, "modules": self.modules, "sites": self.sites}

    def to_dict(self) -> dict[str, Any]:
        """The JSON of ``memplan diff --json``: every key of every attribution, none left out."""
        out: dict[str, Any] = {
            "a": self.a.summary(), "b": self.b.summary(), "peak_delta_bytes": self.peak_delta_bytes,
            "bytes": "requested bytes alive at each side's peak (no allocator rounding)",
        }
        for name, deltas in self.attributions().items():
            out[name] = [d.to_dict() for d in deltas]
        out["notes"] = list(self.notes)
        return out


def _deltas(a: Mapping[str, int], b: Mapping[str, int], expected: int) -> tuple[Delta, ...]:
    keys = set(a) | set(b)
    out = [Delta(k, a.get(k, 0), b.get(k, 0)) for k in keys]
    out.sort(key=lambda d: (-abs(d.delta_bytes), -max(d.a_bytes, d.b_bytes), natural_key(d.key)))
    total = sum(d.delta_bytes for d in out)
    if total != expected:  # pragma: no cover - each profile's breakdown sums to its peak by construction
        raise AssertionError(f"deltas add up to {total}, not to the peak difference {expected}")
    return tuple(out)


def check_comparable(a: Profile, b: Profile) -> None:
    """Refuse two sides that were not recorded on the same kind of device (ConfigError, exit 2).

    Two snapshots must come from the same CUDA device index (the file format does not record the
    GPU model); two traces must have been recorded for the same device type (``cuda`` sizes are
    what the caching allocator is asked for, ``cpu`` sizes what a CPU run asks for); a snapshot
    is a CUDA record, so a trace beside it must be a ``cuda`` trace.
    """
    if a.device_index is not None and b.device_index is not None and a.device_index != b.device_index:
        raise ConfigError("B snapshot device", f"must be the same CUDA device as A's (cuda:{a.device_index}):"
                          " "
                          "snapshots of different devices are not comparable", f"cuda:{b.device_index}",
                          hint="pick a device of a multi-device snapshot with --device")
    kinds = [p.device.split()[0] if p.kind == "trace" else "cuda" for p in (a, b)]
    if kinds[0] != kinds[1]:
        raise ConfigError("B device", f"must be the device type A was recorded on ({kinds[0]})", kinds[1],
                          hint="a cpu trace and a cuda record count different bytes")


def diff_profiles(a: Profile, b: Profile) -> DiffResult:
    """Attribute ``b.peak_bytes - a.peak_bytes`` by category, module and site."""
    check_comparable(a, b)
    expected = b.peak_bytes - a.peak_bytes
    notes = [f"A: {n}" for n in a.notes] + [f"B: {n}" for n in b.notes]
    if a.kind != b.kind:
        notes.append("A and B are of different kinds (a trace and a snapshot): a snapshot's categories are "
                     "mostly unknown and its modules and sites are named differently")
    if os.path.abspath(a.path) == os.path.abspath(b.path):
        notes.append("A and B are the same file")
    return DiffResult(a=a, b=b, categories=_deltas(a.by_category, b.by_category, expected),
                      modules=_deltas(a.by_module, b.by_module, expected),
                      sites=_deltas(a.by_site, b.by_site, expected), notes=tuple(notes))
