"""The C core (``_core.c``) loaded with ctypes: one :class:`Core` per arena.

The core is a plain shared library, not a CPython module: the CUDA pluggable allocator loads it by
path and calls ``mpr_cuda_malloc``/``mpr_cuda_free`` itself, and the CPU allocator calls
``mpr_malloc_block``/``mpr_free_block`` through function pointers, so Python only drives steps,
plans and counters. ``setup.py`` builds it in place as an optional extension; without that build,
the first use compiles it with the system C compiler into ``~/.cache/memplan/runtime`` (or
``$MEMPLAN_RUNTIME_CACHE``); with neither, :class:`RuntimeUnavailable` says so in one line.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import importlib.machinery
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from memplan.errors import MemplanError

__all__ = ["BACKENDS", "STAT_NAMES", "Core", "LogRows", "RuntimeUnavailable", "core_library_path",
           "load_core", "runtime_cache_dir"]

_HERE = Path(__file__).resolve().parent
_SOURCE = _HERE / "_core.c"
#: Backends of the core, by the number ``mpr_create`` takes.
BACKENDS: dict[str, int] = {"virtual": 0, "cpu": 1, "cuda": 2}
#: ``mpr_stats`` counters, in the core's order (enum in ``_core.c``).
STAT_NAMES: tuple[str, ...] = (
    "planned_bytes", "arena_bytes", "fallback_allocs", "fallback_bytes", "fallback_reserved_bytes",
    "fallback_peak_bytes", "replayed_allocs", "replayed_bytes", "recorded_allocs", "allocs", "allocated_bytes",
    "live_bytes", "peak_live_bytes", "mismatches", "overlap_refusals", "pending_frees", "arena_peak_live_bytes",
    "small_allocs", "raw_allocs", "raw_frees", "skipped_slots", "steps", "oversize", "reserved_bytes",
    "peak_reserved_bytes", "planned_fallbacks", "arena_live_bytes", "arena_failures", "stream_waits",
    "swapped_slots", "recorded_in_arena",
)
#: End markers of a recorded request (see ``mpr_read_log``).
END_WRAP, END_LIVE = -2, -1
NO_SLOT = 2**64 - 1


class RuntimeUnavailable(MemplanError):
    """The C core is neither built nor buildable here (no C compiler)."""


def runtime_cache_dir() -> Path:
    """Where builds of the runtime's native code are cached: ``$MEMPLAN_RUNTIME_CACHE``, else
    ``~/.cache/memplan/runtime`` (the C core here, the CPU allocator's torch extension in :mod:`.cpu`)."""
    return Path(os.environ.get("MEMPLAN_RUNTIME_CACHE") or Path.home() / ".cache" / "memplan" / "runtime")


def core_library_path() -> Path:
    """The built core: the in-place extension of ``setup.py``, else a cached build from ``_core.c``."""
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        built = _HERE / f"_core{suffix}"
        if built.is_file() and built.stat().st_mtime >= _SOURCE.stat().st_mtime:
            return built
    digest = hashlib.sha256(_SOURCE.read_bytes()).hexdigest()[:16]
    cached = runtime_cache_dir() / f"mpr_core_{digest}.so"
    if cached.is_file():
        return cached
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if compiler is None:
        raise RuntimeUnavailable("the memplan runtime needs its C core: no C compiler was found to build "
                                 "src/memplan/alloc/runtime/_core.c (install one and reinstall memplan)")
    cached.parent.mkdir(parents=True, exist_ok=True)
    tmp = cached.with_suffix(f".{os.getpid()}.tmp")
    cmd = [compiler, "-std=c99", "-D_POSIX_C_SOURCE=200809L", "-O2", "-shared", "-fPIC", str(_SOURCE), "-o", str(tmp),
           "-ldl", "-lpthread"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeUnavailable(f"building the runtime core failed: {done.stderr.strip().splitlines()[-1:]}")
    os.replace(tmp, cached)
    return cached


_u64, _i64, _p = ctypes.c_uint64, ctypes.c_int64, ctypes.c_void_p
_SIGNATURES = {
    "mpr_create": (_p, [ctypes.c_int, ctypes.c_char_p, _u64, _u64, _u64, ctypes.c_char_p, ctypes.c_size_t]),
    "mpr_malloc": (_p, [_p, _u64, _i64]),
    "mpr_malloc_block": (_p, [_p, _u64, _i64, ctypes.POINTER(_p)]),
    "mpr_free": (ctypes.c_int, [_p, _p]),
    "mpr_free_block": (None, [_p]),
    "mpr_record_stream": (ctypes.c_int, [_p, _p, _i64]),
    "mpr_stream_marker": (_u64, [_p, _i64]),
    "mpr_stream_complete": (_u64, [_p, _i64, _u64]),
    "mpr_add_plan": (ctypes.c_int, [_p, _u64, _p, _p, _p, _p, _u64]),
    "mpr_begin_step": (ctypes.c_int, [_p, ctypes.c_int]),
    "mpr_end_step": (_i64, [_p]),
    "mpr_finish": (_i64, [_p]),
    "mpr_read_log": (_i64, [_p, ctypes.c_int, _p, _p, _p, _p, _i64]),
    "mpr_recent_length": (_i64, [_p]),
    "mpr_trace_enable": (ctypes.c_int, [_p, _i64]),
    "mpr_trace_read": (_i64, [_p, _p, _p, _p, _p, _p, _i64]),
    "mpr_trace_length": (_i64, [_p]),
    "mpr_stats": (None, [_p, _p, ctypes.c_int]),
    "mpr_reset_peaks": (None, [_p]),
    "mpr_synchronize": (_u64, [_p]),
    "mpr_close": (None, [_p]),
    "mpr_set_current": (None, [_p]),
    "mpr_set_hugepages": (None, [_p, ctypes.c_int]),
}


@functools.lru_cache(maxsize=1)
def load_core() -> ctypes.CDLL:
    """The core library with its argument types declared (loaded once per process)."""
    lib = ctypes.CDLL(str(core_library_path()))
    for name, (restype, argtypes) in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    return lib


@dataclass(frozen=True)
class LogRows:
    """A finished recording: per request, the requested bytes, the stream, and start/end positions."""

    requested: tuple[int, ...]
    streams: tuple[int, ...]
    starts: tuple[int, ...]
    ends: tuple[int, ...]


def _array(ctype: type, values: list[int]) -> ctypes.Array:
    return (ctype * max(1, len(values)))(*values)


class Core:
    """One arena of the C core (``mpr_create``); every method is a thin call into C."""

    def __init__(self, backend: str, *, alignment: int, fallback_limit: int = 0, arena_limit: int = 0,
                 library: str | None = None) -> None:
        self.lib = load_core()
        err = ctypes.create_string_buffer(256)
        handle = self.lib.mpr_create(BACKENDS[backend], library.encode() if library else None, alignment,
                                     fallback_limit, arena_limit, err, len(err))
        if not handle:
            raise RuntimeUnavailable(f"the runtime core could not start its {backend} backend: {err.value.decode()}")
        self.handle: int = handle
        self.backend = backend

    def malloc(self, size: int, stream: int = 0) -> int:
        return self.lib.mpr_malloc(self.handle, size, stream) or 0

    def free(self, address: int) -> bool:
        return self.lib.mpr_free(self.handle, address) == 0

    def record_stream(self, address: int, stream: int) -> bool:
        return self.lib.mpr_record_stream(self.handle, address, stream) == 0

    def stream_marker(self, stream: int) -> int:
        return int(self.lib.mpr_stream_marker(self.handle, stream))

    def stream_complete(self, stream: int, marker: int) -> int:
        return int(self.lib.mpr_stream_complete(self.handle, stream, marker))

    def synchronize(self) -> int:
        """Every stream is idle: pending frees go back, ranges freed by one stream serve any other."""
        return int(self.lib.mpr_synchronize(self.handle))

    def add_plan(self, sizes: list[int], requested: list[int], offsets: list[int], streams: list[int], pool: int) -> int:
        n = len(sizes)
        plan = self.lib.mpr_add_plan(self.handle, n, _array(_u64, sizes), _array(_u64, requested),
                                     _array(_u64, offsets), _array(_i64, streams), pool)
        if plan < 0:
            raise MemplanError("the runtime core could not store a plan (out of host memory)")
        return plan

    def begin_step(self, plan: int = -1) -> bool:
        """Start a step (``plan`` < 0: record it); False when the arena could not be allocated."""
        return self.lib.mpr_begin_step(self.handle, plan) == 0

    def end_step(self) -> LogRows | None:
        """End the step; the recording made final by it (the one of the step before), if any."""
        return self._read(self.lib.mpr_end_step(self.handle))

    def finish(self) -> LogRows | None:
        return self._read(self.lib.mpr_finish(self.handle))

    def recent(self) -> LogRows | None:
        """The step just recorded, not final yet (blocks not freed yet are END_LIVE)."""
        return self._read(self.lib.mpr_recent_length(self.handle), which=1)

    def _read(self, n: int, which: int = 0) -> LogRows | None:
        if n < 0:
            return None
        req, streams = (_u64 * max(1, n))(), (_i64 * max(1, n))()
        starts, ends = (_i64 * max(1, n))(), (_i64 * max(1, n))()
        got = self.lib.mpr_read_log(self.handle, which, req, streams, starts, ends, n)
        return LogRows(tuple(req[:got]), tuple(streams[:got]), tuple(starts[:got]), tuple(ends[:got]))

    def keep_trace(self, capacity: int) -> None:
        """Keep every request and free (up to ``capacity`` events) from now on: see :meth:`trace`."""
        if self.lib.mpr_trace_enable(self.handle, capacity) != 0:
            raise MemplanError("the runtime core could not keep a trace (out of host memory)")

    def trace(self) -> list[tuple[int, int, int, int, int]]:
        """The kept events: (kind 0 request / 1 free, block id, requested bytes, stream, step)."""
        n = int(self.lib.mpr_trace_length(self.handle))
        kind = (ctypes.c_ubyte * max(1, n))()
        cols = [(_i64 * max(1, n))() for _ in range(4)]
        got = self.lib.mpr_trace_read(self.handle, kind, *cols, n)
        return [(kind[i], cols[0][i], cols[1][i], cols[2][i], cols[3][i]) for i in range(got)]

    def stats(self) -> dict[str, int]:
        out = (_u64 * len(STAT_NAMES))()
        self.lib.mpr_stats(self.handle, out, len(STAT_NAMES))
        return dict(zip(STAT_NAMES, out))

    def reset_peaks(self) -> None:
        self.lib.mpr_reset_peaks(self.handle)

    def set_hugepages(self, on: bool) -> None:
        """Advise huge pages for the host arena's regions allocated from now on (default: on)."""
        self.lib.mpr_set_hugepages(self.handle, int(on))

    def set_current(self) -> None:
        self.lib.mpr_set_current(self.handle)

    def close(self) -> None:
        """No new requests; the memory goes back when the last live block is freed."""
        if self.handle:
            self.lib.mpr_close(self.handle)
            self.handle = 0
