"""Freed host memory kept in the process: on CPU, activations reuse pages instead of faulting fresh ones.

On a CPU device the activations live in the C library's heap. glibc's ``malloc`` returns memory to
the kernel as soon as enough of it is free at the top of the heap (its trim threshold, at most
64 MiB once tuned dynamically) and serves requests of 32 MiB or more with their own ``mmap``, unmapped
when freed. A training step frees almost everything it allocated, so the next step gets its
activation memory as fresh pages, and every 4 KiB page costs a page fault (the kernel zeroes it).
On the benchmark's virtual machine a fault cost 10–20 µs (docs/ckpt.md, issue-29 follow-up 3): a
step keeping every block of the 30M GPT-2 at 4 x 544 tokens faulted about 230,000 pages (3–4 s of a
10-s step), a step under selective checkpointing, whose peak is lower, none. Keeping activations
then looks slower than recomputing them although the recompute costs more arithmetic.

:func:`retain_freed_memory` asks glibc to keep freed memory in the process (``mallopt``: no trimming,
no ``mmap`` for large requests), as PyTorch's CUDA caching allocator keeps GPU memory: the heap grows
to the largest step's peak once, and later steps reuse those pages. The process's resident memory
then stays at its highest live bytes (plus fragmentation) instead of falling between steps; the live
bytes the budget limits are unchanged. It is process-wide, applied by
:func:`~memplan.ckpt.auto_checkpoint` for a CPU device (``retain_host_memory=False`` leaves the
allocator alone) and reported in ``stats().host_memory``. With another C library (musl, macOS) it
does nothing and says so.
"""

from __future__ import annotations

import ctypes
import ctypes.util

__all__ = ["M_MMAP_MAX", "M_TRIM_THRESHOLD", "retain_freed_memory"]

#: ``mallopt`` parameters (glibc's malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4


def _glibc() -> ctypes.CDLL | None:
    """The process's C library if it is glibc (it exports ``gnu_get_libc_version``), else None."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    if not hasattr(libc, "gnu_get_libc_version") or not hasattr(libc, "mallopt"):
        return None
    return libc


def retain_freed_memory() -> str:
    """Tell glibc's ``malloc`` to keep freed memory in the process; returns what was done, in words.

    ``M_TRIM_THRESHOLD = -1`` (never give the top of the heap back) and ``M_MMAP_MAX = 0`` (serve large
    requests from the heap, not from their own mappings). Idempotent; the settings last for the process.
    """
    libc = _glibc()
    if libc is None:
        return "unchanged: the C library is not glibc"
    libc.gnu_get_libc_version.restype = ctypes.c_char_p
    version = libc.gnu_get_libc_version().decode()
    libc.mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    if not (libc.mallopt(M_TRIM_THRESHOLD, -1) and libc.mallopt(M_MMAP_MAX, 0)):
        return f"unchanged: glibc {version} refused mallopt"
    return f"retained: glibc {version} keeps freed memory (mallopt M_TRIM_THRESHOLD=-1, M_MMAP_MAX=0)"
