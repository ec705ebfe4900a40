"""``memplan trace``: run a real training step of any PyTorch model on fake tensors and record
every allocation (see docs/trace.md).

Importing this package imports no torch; :func:`trace` imports it on first call.
"""

from __future__ import annotations

import sys
import types
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from memplan.trace.api import TraceResult

__all__ = ["RunSettings", "TraceResult", "TraceSetup", "trace"]


def trace(model: Any, **kwargs: Any) -> TraceResult:
    """Trace a training step of ``model`` on fake tensors; see :func:`memplan.trace.api.trace`."""
    from memplan.trace.api import trace as _trace

    return _trace(model, **kwargs)


def __getattr__(name: str) -> Any:
    if name == "TraceResult":
        from memplan.trace.api import TraceResult

        return TraceResult
    if name in ("TraceSetup", "RunSettings"):
        from memplan.trace import setup

        return getattr(setup, name)
    raise AttributeError(f"module 'memplan.trace' has no attribute {name!r}")


class _CallablePackage(types.ModuleType):
    """This package, callable as its main function: ``memplan.trace(...)`` is ``memplan.trace.trace(...)``."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return trace(*args, **kwargs)


sys.modules[__name__].__class__ = _CallablePackage
