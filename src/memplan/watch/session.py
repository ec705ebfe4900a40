"""Catch an out-of-memory error live: record memory history, and on an OOM write the snapshot and a report.

Two lines in a training script::

    import memplan
    memplan.watch("oom_reports")          # before the training loop

or, to also put the error's own message in the report and a note on the exception, around the
code that may run out::

    with memplan.watch("oom_reports"):
        train()

How it works: :meth:`Watch.start` turns on PyTorch's memory history
(``torch.cuda.memory._record_memory_history``) and attaches an OOM observer to the caching
allocator (``torch._C._cuda_attach_out_of_memory_observer``). When a request fails, the allocator
calls the observer *before* it raises ``torch.OutOfMemoryError``; the observer takes the
snapshot then — the memory state of the failure, history included — and writes, in the
directory, ``oom_<time>_rank<R>_pid<P>_<N>.pickle`` (a ``_dump_snapshot`` pickle for
``memplan doctor``, ``memplan diff`` or pytorch.org/memory_viz), ``..._report.txt`` and
``..._report.json`` (:mod:`memplan.watch.report`). Only then does the exception propagate. As a
context manager, an ``OutOfMemoryError`` leaving the block adds its message to the report (or,
when no observer call came first, triggers the snapshot and report itself), gets a note naming
the files, and propagates unchanged.

Known limitations: PyTorch cannot detach an OOM observer, so a stopped watch leaves a disarmed
one behind; recording history costs a few microseconds per allocation and ``max_entries``
entries of host memory (several KB each with ``stacks="all"``); with ``backend:cudaMallocAsync``
the caching allocator's observers are not called and only the context-manager path writes;
without CUDA the watch warns once and records nothing. Each process (rank) writes its own files.
"""

from __future__ import annotations

import json
import os
import pickle
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Literal

from memplan.errors import ConfigError
from memplan.textfile import write_atomic
from memplan.watch.hooks import MemoryHooks, TorchCudaHooks, cuda_unavailable_reason
from memplan.watch.report import OomEvent, oom_report, report_text, with_doctor

__all__ = ["OomRecord", "Watch", "watch"]


@dataclass(frozen=True)
class OomRecord:
    """The files written for one out-of-memory error, and the report's data."""

    snapshot_path: Path | None
    report_path: Path
    json_path: Path
    report: Mapping[str, Any]


def _is_oom(exc: BaseException) -> bool:
    return any(cls.__name__ == "OutOfMemoryError" and cls.__module__.startswith("torch")
               for cls in type(exc).__mro__)


class Watch:
    """Records memory history and writes a snapshot and a report when CUDA memory runs out.

    ``directory``: where the files go (created when missing). ``max_entries``: alloc/free events
    PyTorch keeps (a ring buffer). ``stacks``: ``"all"`` records C++ frames too (the allocation
    sites of the autograd thread), ``"python"`` only Python frames. ``max_reports``: files are
    written for at most this many OOMs (a retry loop catching OOMs would otherwise write many).
    ``on_oom``: called with each :class:`OomRecord` once its files are written. ``hooks``: where
    history and snapshots come from (default: ``torch.cuda``'s, :class:`~memplan.watch.hooks.TorchCudaHooks`).
    """

    def __init__(self, directory: str | os.PathLike[str] = "oom_reports", *, max_entries: int = 100_000,
                 stacks: Literal["python", "all"] = "all", max_reports: int = 1,
                 on_oom: Callable[[OomRecord], None] | None = None, hooks: MemoryHooks | None = None) -> None:
        if type(max_entries) is not int or max_entries < 1:
            raise ConfigError("watch max_entries", "must be an integer >= 1", max_entries)
        if stacks not in ("python", "all"):
            raise ConfigError("watch stacks", "must be 'python' or 'all'", stacks)
        if type(max_reports) is not int or max_reports < 1:
            raise ConfigError("watch max_reports", "must be an integer >= 1", max_reports)
        self.directory = Path(directory)
        self.max_entries, self.stacks, self.max_reports = max_entries, stacks, max_reports
        self.on_oom = on_oom
        self.records: list[OomRecord] = []
        self.active = False
        self._hooks = hooks
        self._attached = False
        self._warned = False
        self._unmatched: OomRecord | None = None  # written by the observer, its exception not seen yet

    # -- lifecycle -------------------------------------------------------------------------------

    def start(self) -> Watch:
        """Start recording and arm the OOM observer (again after :meth:`stop`). Returns ``self``."""
        if self.active:
            return self
        if self._hooks is None:
            reason = cuda_unavailable_reason()
            if reason is not None:
                if not self._warned:
                    warnings.warn(f"memplan.watch records nothing: {reason}", RuntimeWarning, stacklevel=3)
                    self._warned = True
                return self
            self._hooks = TorchCudaHooks()
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError("watch directory", f"cannot be created ({exc.strerror})",
                              str(self.directory)) from None
        self._hooks.start(max_entries=self.max_entries, stacks=self.stacks)
        if not self._attached:
            self._hooks.attach_oom_observer(self._observer)
            self._attached = True
        self.active = True
        return self

    def stop(self) -> None:
        """Stop recording memory history and disarm the observer."""
        if self.active and self._hooks is not None:
            self.active = False
            self._hooks.stop()

    def __enter__(self) -> Watch:  # noqa: PYI034 - typing.Self needs Python 3.11
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> Literal[False]:
        try:
            if exc is not None and self.active and _is_oom(exc):
                self._on_exception(exc)
        finally:
            self.stop()
        return False

    # -- the OOM paths ---------------------------------------------------------------------------

    def _observer(self, device: int, alloc: int, device_total: int, device_free: int) -> None:
        """Called by the caching allocator before it raises; must never raise itself."""
        if not self.active:
            return
        if len(self.records) >= self.max_reports:
            self._unmatched = None  # this OOM is not the one the files were written for
            return
        try:
            event = OomEvent(int(device), int(alloc), int(device_total), int(device_free))
            self._unmatched = self._record(event, message="")
        except Exception as exc:  # noqa: BLE001 - an error here would replace the user's OOM error
            warnings.warn(f"memplan.watch could not write its OOM report: {exc!r}", RuntimeWarning,
                          stacklevel=2)

    def _on_exception(self, exc: BaseException) -> None:
        record, self._unmatched = self._unmatched, None
        if record is not None:
            record = self._rewrite(record, message=str(exc))
        elif len(self.records) < self.max_reports:
            record = self._record(None, message=str(exc))
        if record is not None and hasattr(exc, "add_note"):
            names = ", ".join(str(p) for p in (record.snapshot_path, record.report_path) if p is not None)
            exc.add_note(f"memplan.watch wrote {names}")

    def _record(self, event: OomEvent | None, *, message: str) -> OomRecord:
        stem = (f"oom_{time.strftime('%Y%m%d-%H%M%S')}_rank{os.environ.get('RANK', '0')}_pid{os.getpid()}"
                f"_{len(self.records) + 1}")
        snapshot_path: Path | None = self.directory / f"{stem}.pickle"
        snapshot: Mapping[str, Any] | None = None
        problems: list[str] = []
        try:
            snapshot = self._hooks.snapshot() if self._hooks is not None else None
            write_atomic(snapshot_path, pickle.dumps(dict(snapshot or {}), protocol=pickle.HIGHEST_PROTOCOL))
        except Exception as exc:  # noqa: BLE001 - the report says what failed; the OOM still propagates
            problems.append(f"no snapshot written: {exc!r}")
            snapshot_path = None
        report = oom_report(snapshot, event=event, message=message,
                            snapshot_path=str(snapshot_path) if snapshot_path else None,
                            problems=tuple(problems))
        record = OomRecord(snapshot_path, self.directory / f"{stem}_report.txt",
                           self.directory / f"{stem}_report.json", report)
        self._write_report(record)
        self.records.append(record)
        if self.on_oom is not None:
            self.on_oom(record)
        return record

    def _rewrite(self, record: OomRecord, *, message: str) -> OomRecord:
        snapshot = str(record.snapshot_path) if record.snapshot_path is not None else None
        updated = OomRecord(record.snapshot_path, record.report_path, record.json_path,
                            with_doctor({**record.report, "message": message}, snapshot))
        self._write_report(updated)
        self.records[self.records.index(record)] = updated
        return updated

    @staticmethod
    def _write_report(record: OomRecord) -> None:
        write_atomic(record.report_path, report_text(record.report).encode("utf-8"))
        data = {key: value for key, value in record.report.items() if key != "doctor_text"}
        write_atomic(record.json_path, (json.dumps(data, indent=2) + "\n").encode("utf-8"))


def watch(directory: str | os.PathLike[str] = "oom_reports", **kwargs: Any) -> Watch:
    """A started :class:`Watch` (use it bare, or as a context manager); see the module docstring."""
    return Watch(directory, **kwargs).start()
