"""From a recorded step to a plan of slots, and plan files.

A step's recording (:class:`~memplan.alloc.runtime._native.LogRows`) lists its requests in call
order with start/end positions. :func:`plan_recording` lays them out with memplan's DSA solver
(:func:`memplan.alloc.dsa.solve`, the planner of ``memplan alloc plan``):

* a request freed inside its step lives on ``[start, end)``;
* a request freed during the *next* step (``END_WRAP``: a gradient freed by the next
  ``zero_grad``, a loss held by a loop variable) gets the whole step, ``[0, n)``: its previous
  instance still holds the slot when the step begins;
* a request still live after the next step (``END_LIVE``: optimizer states created at the first
  step, tensors appended to a list) is *persistent*: with ``persistent="fallback"`` (in the loop) its
  slot is marked for the fallback pool (it will not recur); with ``persistent="plan"`` (a profiled
  whole run, STAlloc's model) it is planned up to the end of the step.

Streams get disjoint parts of the arena (each stream's requests are solved apart and stacked), so
the plan never hands one stream an address another stream may still be using. Slot sizes are the
aligned requested sizes; with several recordings of the same shape (data-dependent sizes), each
slot is the largest size recorded there (a *window*) and each lifetime the union of those recorded
(a request freed later in one step than in another keeps its slot for the longer of the two).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from typing import Any, Literal

from memplan.alloc.runtime._native import END_LIVE, END_WRAP, NO_SLOT, LogRows
from memplan.errors import ConfigError

__all__ = ["PLAN_FORMAT", "SlotPlan", "fingerprint", "load_plans", "plan_recording", "save_plans"]

PLAN_FORMAT = "memplan-runtime-plan"
PLAN_VERSION = 1


@dataclass(frozen=True)
class SlotPlan:
    """One signature's plan: per request of a step (call order), its slot."""

    key: str
    sizes: tuple[int, ...]
    requested: tuple[int, ...]
    offsets: tuple[int, ...]
    streams: tuple[int, ...]
    pool_bytes: int
    peak_live_bytes: int
    fingerprint: str
    recordings: int = 1
    starts: tuple[int, ...] = ()
    ends: tuple[int, ...] = ()

    @property
    def planned(self) -> int:
        return sum(1 for o in self.offsets if o != NO_SLOT)

    def to_dict(self) -> dict[str, Any]:
        return {"key": self.key, "sizes": list(self.sizes), "requested": list(self.requested),
                "offsets": [-1 if o == NO_SLOT else o for o in self.offsets], "streams": list(self.streams),
                "pool_bytes": self.pool_bytes, "peak_live_bytes": self.peak_live_bytes,
                "fingerprint": self.fingerprint, "recordings": self.recordings,
                "starts": list(self.starts), "ends": list(self.ends)}


def fingerprint(requested: tuple[int, ...], streams: tuple[int, ...]) -> str:
    """sha256 of a step's (requested size, stream) sequence: what a plan was made for."""
    digest = hashlib.sha256()
    for size, stream in zip(requested, streams):
        digest.update(f"{size}:{stream};".encode())
    return digest.hexdigest()


def _intervals(rows: LogRows, persistent: str) -> tuple[list[int], list[int], list[bool]]:
    horizon = max([*rows.starts, *(e for e in rows.ends if e >= 0)], default=-1) + 1
    starts, ends, planned = [], [], []
    for start, end in zip(rows.starts, rows.ends):
        if end == END_WRAP:
            starts.append(0), ends.append(horizon), planned.append(True)
        elif end == END_LIVE:
            starts.append(start), ends.append(horizon), planned.append(persistent == "plan")
        else:
            starts.append(start), ends.append(max(end, start + 1)), planned.append(True)
    return starts, ends, planned


def plan_recording(rows: LogRows, *, key: str, alignment: int, persistent: Literal["fallback", "plan"] = "fallback",
                   previous: SlotPlan | None = None, time_limit: float = 2.0) -> SlotPlan:
    """Lay out a recorded step. With a ``previous`` plan of the same shape (the same streams in the
    same order), each request gets the largest size and the union of the lifetimes recorded."""
    from memplan.alloc import dsa

    starts, ends, planned = _intervals(rows, persistent)
    base: tuple[int, ...] = rows.requested
    same = previous is not None and previous.streams == rows.streams and len(previous.starts) == len(starts)
    if same and previous is not None:
        base = tuple(max(a, b) for a, b in zip(previous.sizes, rows.requested))
        starts = [min(a, b) for a, b in zip(previous.starts, starts)]
        ends = [max(a, b) for a, b in zip(previous.ends, ends)]
        planned = [p and o != NO_SLOT for p, o in zip(planned, previous.offsets)]
    recordings = previous.recordings + 1 if previous is not None else 1
    sizes = [-(-max(z, 1) // alignment) * alignment for z in base]
    offsets = [NO_SLOT] * len(sizes)
    pool = 0
    for stream in sorted(set(rows.streams)):
        members = [i for i, s in enumerate(rows.streams) if s == stream and planned[i]]
        if not members:
            continue
        result = dsa.solve([starts[i] for i in members], [ends[i] for i in members], [sizes[i] for i in members],
                           time_limit=time_limit)
        for i, offset in zip(members, result.offsets):
            offsets[i] = pool + offset
        pool += -(-result.peak // alignment) * alignment
    chosen = [i for i, p in enumerate(planned) if p]
    peak_live = dsa.live_peak([starts[i] for i in chosen], [ends[i] for i in chosen], [rows.requested[i] for i in chosen])
    return SlotPlan(key=key, sizes=tuple(sizes), requested=rows.requested, offsets=tuple(offsets), streams=rows.streams,
                    pool_bytes=pool, peak_live_bytes=peak_live, fingerprint=fingerprint(rows.requested, rows.streams),
                    recordings=recordings, starts=tuple(starts), ends=tuple(ends))


def save_plans(path: str | os.PathLike[str], plans: dict[str, SlotPlan], *, alignment: int, model: str) -> None:
    body = {"format": PLAN_FORMAT, "version": PLAN_VERSION, "alignment": alignment, "model": model,
            "signatures": {k: p.to_dict() for k, p in plans.items()}}
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(body, handle)


def _plan_from(raw: Any, where: str) -> SlotPlan:
    if not isinstance(raw, dict):
        raise ConfigError(where, "must be an object")
    lists = {name: raw.get(name) for name in ("sizes", "requested", "offsets", "streams")}
    for name, values in lists.items():
        if not isinstance(values, list) or not all(isinstance(v, int) for v in values):
            raise ConfigError(f"{where}.{name}", "must be a list of integers", type(values).__name__)
    if len({len(v) for v in lists.values()}) != 1:
        raise ConfigError(where, "sizes, requested, offsets and streams must have the same length")
    pool = raw.get("pool_bytes")
    offsets = tuple(NO_SLOT if o < 0 else o for o in lists["offsets"])
    if not isinstance(pool, int) or any(o != NO_SLOT and o + z > pool for o, z in zip(offsets, lists["sizes"])):
        raise ConfigError(f"{where}.pool_bytes", "must hold every slot (offset + size <= pool_bytes)", pool)
    requested, streams = tuple(lists["requested"]), tuple(lists["streams"])
    if raw.get("fingerprint") != fingerprint(requested, streams):
        raise ConfigError(f"{where}.fingerprint", "does not match its requests (the plan file is corrupted)")
    return SlotPlan(key=str(raw.get("key")), sizes=tuple(lists["sizes"]), requested=requested, offsets=offsets,
                    streams=streams, pool_bytes=pool, peak_live_bytes=int(raw.get("peak_live_bytes", 0)),
                    fingerprint=raw["fingerprint"], recordings=int(raw.get("recordings", 1)),
                    starts=tuple(raw.get("starts") or ()), ends=tuple(raw.get("ends") or ()))


def load_plans(path: str | os.PathLike[str], *, alignment: int, model: str | None = None) -> dict[str, SlotPlan]:
    """Read a plan file; a corrupted file, another alignment or another ``model`` is a ConfigError."""
    try:
        with open(path, encoding="utf-8") as handle:
            body = json.load(handle)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError("plan", f"must be a readable memplan runtime plan file ({type(exc).__name__})", str(path)) from None
    if not isinstance(body, dict) or body.get("format") != PLAN_FORMAT:
        raise ConfigError("plan.format", f"must be {PLAN_FORMAT!r}", body.get("format") if isinstance(body, dict) else None)
    if not isinstance(body.get("version"), int) or body["version"] > PLAN_VERSION:
        raise ConfigError("plan.version", f"must be an integer <= {PLAN_VERSION}", body.get("version"))
    if body.get("alignment") != alignment:
        raise ConfigError("plan.alignment", f"must be {alignment} for this device", body.get("alignment"))
    if model is not None and body.get("model") != model:
        raise ConfigError("plan.model", f"was made for another model or shape (this run is {model!r})", body.get("model"))
    signatures = body.get("signatures")
    if not isinstance(signatures, dict):
        raise ConfigError("plan.signatures", "must be an object of plans by signature")
    return {str(k): _plan_from(v, f"plan.signatures[{k!r}]") for k, v in signatures.items()}
