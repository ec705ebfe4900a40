"""``memplan.watch(...)``: on a CUDA out-of-memory error, write the snapshot and a report first.

::

    import memplan
    memplan.watch("oom_reports")        # or: with memplan.watch("oom_reports"): train()

See :mod:`memplan.watch.session` (how, and the known limitations) and :mod:`memplan.watch.report`
(what the report holds). Importing this package imports no torch; :meth:`Watch.start` does.
"""

from __future__ import annotations

import sys
import types
from typing import Any

from memplan.watch.hooks import MemoryHooks, TorchCudaHooks
from memplan.watch.report import OomEvent, oom_report
from memplan.watch.session import OomRecord, Watch, watch

__all__ = ["MemoryHooks", "OomEvent", "OomRecord", "TorchCudaHooks", "Watch", "oom_report", "watch"]


class _CallablePackage(types.ModuleType):
    """This package, callable as its main function: ``memplan.watch(...)`` is ``memplan.watch.watch(...)``."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return watch(*args, **kwargs)


sys.modules[__name__].__class__ = _CallablePackage
