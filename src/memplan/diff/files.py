"""Files in, a :class:`~memplan.diff.compare.DiffResult` out: the reader each file needs; both read at once.

A file that starts like a pickle (protocol 2 or later) is read as a CUDA memory snapshot, anything
else as a memplan trace. Two large files are read in two worker processes at the same time
(reading a million-event trace is CPU-bound Python); a worker that fails is not trusted to carry
the error back, the file is read again here so the error is raised as it would have been.
"""

from __future__ import annotations

import os
import sys
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_all_start_methods, get_context

from memplan.diff.compare import DiffResult, diff_profiles
from memplan.diff.profile import Profile
from memplan.diff.trace_reader import profile_trace_file
from memplan.errors import ConfigError, MemplanError

__all__ = ["PARALLEL_MIN_BYTES", "diff_files", "load_profile"]

#: Files at least this large (both of them) are read in parallel: below it a worker costs more than it saves.
PARALLEL_MIN_BYTES = 2 * 2**20


def load_profile(path: str | os.PathLike[str], *, device: int | None = None) -> Profile:
    """The :class:`Profile` of a snapshot pickle or a memplan trace file.

    ``device`` picks the CUDA device of a multi-device snapshot (default: the one with most trace
    entries); it is an error for a trace.
    """
    name = os.fspath(path)
    if device is not None and device < 0:
        raise ConfigError("--device", "must be a CUDA device index >= 0", device)
    if not os.path.isfile(name):
        raise ConfigError("input file", "must be an existing file (a memory snapshot or a memplan trace)",
                          name)
    try:
        with open(name, "rb") as handle:
            pickled = handle.read(1) == b"\x80"  # a pickle of protocol 2 or later, as torch writes them
    except OSError as exc:
        raise ConfigError("input file", "must be a readable file", name, hint=exc.strerror or "") from None
    if pickled:
        # imported here: the snapshot reader loads memplan.alloc, which a diff of traces does not need
        from memplan.diff.snapshot_reader import profile_snapshot_file

        return profile_snapshot_file(name, device=device)
    if device is not None:
        raise ConfigError("--device", "applies to memory snapshots only, and this file is a memplan trace",
                          name)
    return profile_trace_file(name)


def _worker(path: str, device: int | None) -> Profile | None:
    try:
        return load_profile(path, device=device)
    except MemplanError:
        return None


def _parallel(paths: tuple[str, str], device: int | None) -> list[Profile | None]:
    sizes = [os.path.getsize(p) if os.path.isfile(p) else 0 for p in paths]
    if min(sizes) < PARALLEL_MIN_BYTES or (os.cpu_count() or 1) < 2:
        return [None, None]
    # fork shares the imports already made (spawn re-imports memplan: about 0.5 s); not once torch is
    # imported, whose CUDA state and threads a forked child must not inherit.
    method = "fork" if "fork" in get_all_start_methods() and "torch" not in sys.modules else "spawn"
    try:
        with ProcessPoolExecutor(max_workers=2, mp_context=get_context(method)) as pool:
            futures = [pool.submit(_worker, p, device) for p in paths]
            return [f.result() for f in futures]
    except (OSError, RuntimeError):  # no processes here (sandbox, frozen app): read them in turn
        return [None, None]


def diff_files(a: str | os.PathLike[str], b: str | os.PathLike[str], *, device: int | None = None,
               parallel: bool = True) -> DiffResult:
    """Diff two snapshots or traces (any mix); see :mod:`memplan.diff.compare`.

    Bad input raises :class:`~memplan.errors.ConfigError` naming the file and what is wrong:
    unreadable, truncated or hostile pickles, malformed traces, two snapshots of different devices.
    """
    paths = (os.fspath(a), os.fspath(b))
    read = _parallel(paths, device) if parallel else [None, None]
    profiles = [p if p is not None else load_profile(path, device=device) for p, path in zip(read, paths)]
    return diff_profiles(profiles[0], profiles[1])
