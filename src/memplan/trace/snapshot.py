"""Export a trace as a PyTorch CUDA memory snapshot (the dict ``torch.cuda.memory._snapshot()``
returns), which ``torch.cuda._memory_viz`` renders (``trace_plot``) and https://pytorch.org/memory_viz
opens as a pickle.

The trace has no addresses, so each allocation gets a fresh virtual address (a running sum of
the bytes allocated so far, never reused). Each trace entry carries one frame naming the module
and the operator, and the memplan category. The ``segments`` list holds one segment per block
still alive at the end. Sizes are "as allocated" (CUDA-rounded for a ``cuda`` trace).

The dict holds only plain ``dict``/``list``/``str``/``int`` values (no ``str`` subclass such as
``torch.__version__`` or a ``MemoryCategory``), so memplan's own restricted unpickler
(:func:`memplan.alloc.snapshot.load_snapshot`, used by ``memplan alloc`` and ``memplan report
--trace``) reads the file back.
"""

from __future__ import annotations

import json
import os
import pickle
from typing import Any

from memplan.events import ALLOC, Trace
from memplan.trace.cuda.rounding import cuda_allocated_size

__all__ = ["to_snapshot", "write_snapshot"]

#: Where the virtual addresses start (any non-zero value; CUDA addresses look like this).
_BASE_ADDRESS = 0x7F00_0000_0000


def to_snapshot(trace: Trace) -> dict[str, Any]:
    """The snapshot-shaped dict of ``trace``: ``segments`` and ``device_traces`` (one device)."""
    size_of = cuda_allocated_size if trace.meta.device == "cuda" else int
    entries: list[dict[str, Any]] = []
    live: dict[int, dict[str, Any]] = {}
    next_address = _BASE_ADDRESS
    for event in trace.events:
        frames = [{"filename": _text(event.module) or "(top level)", "line": 0,
                   "name": _text(event.op) or _text(event.phase)}]
        if event.kind == ALLOC:
            entry = {"action": "alloc", "addr": next_address, "size": size_of(event.size), "stream": int(event.stream),
                     "frames": frames, "time_us": int(event.index), "category": _text(event.category),
                     "requested_size": int(event.size)}
            next_address += max(size_of(event.size), 1)
            live[event.block] = entry
            entries.append(entry)
            continue
        alloc = live.pop(event.block)
        for action in ("free_requested", "free_completed"):
            entries.append({"action": action, "addr": alloc["addr"], "size": alloc["size"], "stream": int(event.stream),
                            "frames": frames, "time_us": int(event.index)})
    # A JSON round trip leaves only plain types (the meta's extra holds e.g. torch.__version__).
    meta = json.loads(json.dumps(trace.meta.to_dict(), default=str))
    return {"segments": [_segment(entry) for entry in live.values()], "device_traces": [entries],
            "allocator_settings": {}, "memplan_meta": meta}


def _text(value: str) -> str:
    """``value`` as an exact ``str`` (a str subclass or str enum would pickle as a class reference)."""
    return str.__str__(value)


def _segment(alloc: dict[str, Any]) -> dict[str, Any]:
    block = {"address": alloc["addr"], "size": alloc["size"], "requested_size": alloc["requested_size"],
             "state": "active_allocated", "frames": alloc["frames"]}
    return {"device": 0, "address": alloc["addr"], "total_size": alloc["size"], "allocated_size": alloc["size"],
            "active_size": alloc["size"], "requested_size": alloc["requested_size"], "stream": alloc["stream"],
            "segment_type": "large", "blocks": [block]}


def write_snapshot(trace: Trace, path: str | os.PathLike[str]) -> None:
    """Pickle :func:`to_snapshot` of ``trace`` to ``path`` (open it at pytorch.org/memory_viz)."""
    with open(path, "wb") as handle:
        pickle.dump(to_snapshot(trace), handle, protocol=4)
