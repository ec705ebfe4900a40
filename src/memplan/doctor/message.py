"""Read the figures of a PyTorch CUDA out-of-memory message.

PyTorch builds the message in ``DeviceCachingAllocator::malloc`` (``c10/cuda/CUDACachingAllocator.cpp``)
with ``format_size`` (``N bytes`` up to 1 KiB, then ``%.2f`` KiB / MiB / GiB, binary units). Two
layouts exist:

* torch <= 2.0 (1.13, 2.0 and earlier 1.x)::

      CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; 15.78 GiB total capacity;
      14.56 GiB already allocated; 3.19 MiB free; [4.00 GiB allowed;] 14.70 GiB reserved in total
      by PyTorch) If reserved memory is >> allocated memory try setting max_split_size_mb ...

  (before 1.5 the last figure reads ``... cached)``);

* torch >= 2.1::

      CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.15 GiB
      of which 1.23 GiB is free. [Process 123 has 1.46 GiB memory in use.]... [Including
      non-PyTorch memory, this process has 77.90 GiB memory in use.] [22.08 GiB allowed;] Of the
      allocated memory 66.12 GiB is allocated by PyTorch, [with 104.00 MiB allocated in private
      pools (e.g., CUDA Graphs),] and 9.82 GiB is reserved by PyTorch but unallocated. ...

  (2.1 spells ``total capacty``; ROCm builds say ``HIP out of memory``).

Every printed figure is rounded to 0.01 of its unit, so each parsed figure keeps its resolution
(:attr:`Figure.resolution_bytes`, half a unit of the last digit) and comparisons between figures
allow for it. A message whose figures use decimal units (``GB``, ``MB``), which PyTorch never
prints, or has no figures at all, is refused with a :class:`~memplan.errors.ConfigError`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from memplan.errors import ConfigError, UnsupportedError
from memplan.units import GiB, KiB, MiB

__all__ = ["Figure", "OOMMessage", "parse_oom_message"]

_FIELD = "OOM message"
#: ``format_size``'s units (binary) and the decimal ones a hand-copied message might use instead.
_BINARY = {"bytes": 1, "KiB": KiB, "MiB": MiB, "GiB": GiB}
_DECIMAL = ("B", "KB", "MB", "GB", "TB", "kB")
_NUM = r"(?P<{0}>\d+(?:\.\d+)?)\s*(?P<{0}_unit>bytes|[KMGT]i?B|kB|B)"


def _num(name: str) -> str:
    return _NUM.format(name)


_HEAD = re.compile(r"(?P<backend>CUDA|HIP|XPU|NPU) out of memory\.\s*Tried to allocate\s+" + _num("requested"),
                   re.IGNORECASE)
# torch <= 2.0: the parenthesised list after the request.
_OLD = re.compile(
    r"\(\s*GPU\s+(?P<device>\d+);\s*" + _num("total") + r"\s+total capacity;\s*"
    + _num("allocated") + r"\s+already allocated;\s*"
    + r"(?:" + _num("active") + r"\s+current active;\s*)?"
    + _num("free") + r"\s+free;\s*"
    + r"(?:" + _num("allowed") + r"\s+allowed;\s*)?"
    + _num("reserved") + r"\s+(?:reserved in total by PyTorch|cached)"
)
# torch >= 2.1: sentences.
_NEW_CAPACITY = re.compile(r"GPU\s+(?P<device>\d+)\s+has a total capac(?:i)?ty of\s+" + _num("total")
                           + r"\s+of which\s+" + _num("free") + r"\s+is free")
_NEW_PROCESS = re.compile(r"Process\s+(?P<pid>\d+)\s+has\s+" + _num("used") + r"\s+memory in use")
_NEW_THIS = re.compile(r"(?:Including non-PyTorch memory, this|This) process has\s+" + _num("used")
                       + r"\s+memory in use")
_NEW_ALLOWED = re.compile(_num("allowed") + r"\s+allowed;")
_NEW_ALLOCATED = re.compile(r"Of the allocated memory\s+" + _num("allocated") + r"\s+is allocated by PyTorch")
_NEW_PRIVATE = re.compile(r"with\s+" + _num("private") + r"\s+allocated in private pools")
_NEW_UNALLOCATED = re.compile(_num("unallocated") + r"\s+is reserved by PyTorch but unallocated")


@dataclass(frozen=True)
class Figure:
    """One figure of the message: bytes as printed (rounded) and how far the truth may lie from it."""

    bytes: int
    text: str
    #: Half a unit of the last printed digit (0 for ``N bytes``, exact).
    resolution_bytes: int


@dataclass(frozen=True)
class OOMMessage:
    """Every figure a PyTorch OOM message prints; ``None`` where this version's message has none.

    ``reserved`` is printed by torch <= 2.0 and derived (allocated + reserved-but-unallocated) from
    torch >= 2.1; ``unallocated`` the other way round.
    """

    layout: str  # "torch<=2.0" | "torch>=2.1"
    backend: str
    device: int
    requested: Figure
    total: Figure
    free: Figure
    allocated: Figure
    reserved: Figure
    unallocated: Figure
    #: ``set_per_process_memory_fraction``'s limit, when one was set.
    allowed: Figure | None = None
    #: Memory of this process seen by the driver, PyTorch's and not (torch >= 2.1).
    process_in_use: Figure | None = None
    #: ``Process N has X memory in use`` lines: (pid, figure), which may include this process.
    processes: tuple[tuple[int, Figure], ...] = ()
    #: Of ``allocated``, what CUDA-graph private pools hold (torch >= 2.4).
    private_pools: Figure | None = None
    text: str = ""

    @property
    def outside_pytorch_bytes(self) -> int:
        """Device memory neither free nor reserved by this PyTorch: capacity - reserved - free."""
        return max(0, self.total.bytes - self.reserved.bytes - self.free.bytes)

    @property
    def outside_resolution_bytes(self) -> int:
        return self.total.resolution_bytes + self.reserved.resolution_bytes + self.free.resolution_bytes

    @property
    def pytorch_limit_bytes(self) -> int:
        """What this allocator could have held at the OOM: reserved + free, capped by ``allowed``."""
        limit = self.reserved.bytes + self.free.bytes
        return min(limit, self.allowed.bytes) if self.allowed is not None else limit

    def to_dict(self) -> dict[str, Any]:
        def fig(f: Figure | None) -> dict[str, Any] | None:
            return None if f is None else {"bytes": f.bytes, "text": f.text, "resolution_bytes": f.resolution_bytes}

        return {
            "layout": self.layout, "backend": self.backend, "device": self.device,
            "requested": fig(self.requested), "total_capacity": fig(self.total), "free": fig(self.free),
            "allocated": fig(self.allocated), "reserved": fig(self.reserved),
            "reserved_unallocated": fig(self.unallocated), "allowed": fig(self.allowed),
            "process_in_use": fig(self.process_in_use),
            "processes": [{"pid": pid, **(fig(f) or {})} for pid, f in self.processes],
            "private_pools": fig(self.private_pools), "outside_pytorch_bytes": self.outside_pytorch_bytes,
        }


def _figure(match: re.Match[str], name: str) -> Figure:
    number, unit = match.group(name), match.group(name + "_unit")
    if unit not in _BINARY:
        raise ConfigError(f"{_FIELD} figure '{name}'", "must be in PyTorch's binary units (bytes, KiB, MiB, GiB); "
                          "decimal units mean the message was retyped and its numbers cannot be trusted",
                          f"{number} {unit}")
    scale = _BINARY[unit]
    value = float(number)
    decimals = len(number.partition(".")[2])
    resolution = 0 if unit == "bytes" else int(scale * 0.5 * 10 ** -decimals)
    return Figure(bytes=round(value * scale), text=f"{number} {unit}", resolution_bytes=resolution)


def _derived(value: int, resolution: int, text: str) -> Figure:
    return Figure(bytes=max(0, value), text=text, resolution_bytes=resolution)


#: Where a message ends: PyTorch's advice, a blank line, the next traceback.
_END = re.compile(r"If reserved|See documentation|\n\s*\n|Traceback|\n\S+Error")


#: A launcher's prefix on every log line (``[rank0]: ``, ``host-0: [rank7]: ``).
_RANK_PREFIX = re.compile(r"^[^\n\[]*\[rank\d+\]:[ \t]?", re.MULTILINE)


def _message_text(tail: str) -> str:
    tail = _RANK_PREFIX.sub("", tail)
    end = _END.search(tail, 20)
    return tail[: end.start() if end else 2000][:2000]


def parse_oom_message(text: str) -> OOMMessage:
    """The figures of the (last) PyTorch OOM message in ``text`` (a whole log may be given).

    Example::

        >>> m = parse_oom_message("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity "
        ...     "of 79.15 GiB of which 1.23 GiB is free. Including non-PyTorch memory, this process has 77.90 GiB "
        ...     "memory in use. Of the allocated memory 66.12 GiB is allocated by PyTorch, and 9.82 GiB is "
        ...     "reserved by PyTorch but unallocated.")
        >>> m.requested.bytes, m.unallocated.text
        (2147483648, '9.82 GiB')

    Raises ConfigError when no OOM message with its figures is found, or its units are not PyTorch's.
    """
    if not isinstance(text, str) or not text.strip():
        raise ConfigError(_FIELD, "must be the text of a PyTorch out-of-memory error", "")
    long_number = re.search(r"\d{21,}", text)
    if long_number is not None:  # no memory figure has 21 digits (2^64 has 20)
        raise ConfigError(_FIELD, "holds a number of more than 20 digits; PyTorch prints no such memory figure",
                          long_number.group()[:20] + "...")
    heads = list(_HEAD.finditer(_RANK_PREFIX.sub("", text)))
    text = _RANK_PREFIX.sub("", text)
    if not heads:
        _other_errors(text)
        raise ConfigError(_FIELD, "has no 'out of memory. Tried to allocate <size>' figure; give the text of a "
                          "PyTorch OOM error", text.strip()[:80])
    head = heads[-1]
    # The message ends where the next one would start (logs often repeat it); join wrapped lines.
    # Each figure is checked for PyTorch's binary units as it is read (decimal units: refused).
    body = " ".join(_message_text(text[head.start():]).split())
    body_match = _HEAD.match(body)
    assert body_match is not None
    requested = _figure(body_match, "requested")
    backend = body_match.group("backend").upper()
    old = _OLD.search(body)
    if old is not None:
        return _consistent(_old_layout(body, backend, requested, old))
    capacity = _NEW_CAPACITY.search(body)
    allocated = _NEW_ALLOCATED.search(body)
    if capacity is None or allocated is None:
        missing = "total capacity and free memory" if capacity is None else "allocated memory"
        raise ConfigError(_FIELD, f"has no {missing} figures after 'Tried to allocate'; give the whole message "
                          "(torch 1.13-2.x prints total, free, allocated and reserved memory)", body[:120])
    return _consistent(_new_layout(body, backend, requested, capacity, allocated))


def _consistent(message: OOMMessage) -> OOMMessage:
    """``message``, unless a figure the device holds exceeds its total capacity (an edited message, or the
    figures of two different messages): no diagnosis can rest on it."""
    total = message.total
    for name, figure in (("free", message.free),):  # cudaMemGetInfo's free is part of its total
        if figure is not None and figure.bytes > total.bytes + total.resolution_bytes + figure.resolution_bytes:
            raise ConfigError(_FIELD, f"says {figure.text} {name}, more than the GPU's total capacity of {total.text}; "
                              "the figures contradict each other (give the message as PyTorch printed it)",
                              message.text[:80])
    return message


def _other_errors(text: str) -> None:
    """Out-of-memory errors that are not the caching allocator's: say what they are instead of 'no figures'."""
    if "MPS backend out of memory" in text:
        raise UnsupportedError("the OOM message is from PyTorch's MPS (Apple) allocator; memplan doctor reads the "
                               "CUDA/ROCm caching allocator's messages")
    for marker, what in (("CUDA error: out of memory", ("the CUDA driver's (a kernel, cuBLAS, NCCL or context "
                                                          "creation ran out), not the caching allocator's")),
                         ("CUBLAS_STATUS_ALLOC_FAILED", "cuBLAS's (its workspace allocation failed)")):
        if marker in text:
            raise ConfigError(_FIELD, f"is {what}: it prints no figures to diagnose; give the snapshot or the "
                              "job instead", marker)


def _old_layout(body: str, backend: str, requested: Figure, m: re.Match[str]) -> OOMMessage:
    allocated, reserved = _figure(m, "allocated"), _figure(m, "reserved")
    unallocated = _derived(reserved.bytes - allocated.bytes, reserved.resolution_bytes + allocated.resolution_bytes,
                           "reserved - allocated")
    return OOMMessage(layout="torch<=2.0", backend=backend, device=int(m.group("device")), requested=requested,
                      total=_figure(m, "total"), free=_figure(m, "free"), allocated=allocated, reserved=reserved,
                      unallocated=unallocated, allowed=_figure(m, "allowed") if m.group("allowed") else None,
                      text=body)


def _new_layout(body: str, backend: str, requested: Figure, capacity: re.Match[str],
                allocated_m: re.Match[str]) -> OOMMessage:
    allocated = _figure(allocated_m, "allocated")
    unallocated_m = _NEW_UNALLOCATED.search(body)
    unallocated = _figure(unallocated_m, "unallocated") if unallocated_m else _derived(0, 0, "not printed")
    reserved = _derived(allocated.bytes + unallocated.bytes, allocated.resolution_bytes + unallocated.resolution_bytes,
                        "allocated + reserved but unallocated")
    this = _NEW_THIS.search(body)
    allowed = _NEW_ALLOWED.search(body)
    private = _NEW_PRIVATE.search(body)
    processes = tuple((int(p.group("pid")), _figure(p, "used")) for p in _NEW_PROCESS.finditer(body))
    return OOMMessage(layout="torch>=2.1", backend=backend, device=int(capacity.group("device")), requested=requested,
                      total=_figure(capacity, "total"), free=_figure(capacity, "free"), allocated=allocated,
                      reserved=reserved, unallocated=unallocated,
                      allowed=_figure(allowed, "allowed") if allowed else None,
                      process_in_use=_figure(this, "used") if this else None, processes=processes,
                      private_pools=_figure(private, "private") if private else None, text=body)
