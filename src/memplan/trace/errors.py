"""Turning what goes wrong on fake tensors into one clear memplan error.

* an operator without a fake-tensor (meta) implementation → :class:`UnsupportedError` naming the
  operator and the module that ran it;
* an operator whose output shape depends on tensor *values* (``nonzero``, boolean masking, MoE
  routing) → :class:`UnsupportedError` naming the operator and module, suggesting
  ``--moe-routing balanced`` for MoE models;
* running out of host memory even for fake tensors' bookkeeping → :class:`UnsupportedError`.

The tracker attaches ``memplan_where = (op, module)`` to the exception where it happened.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from memplan.errors import MemplanError, UnsupportedError

__all__ = ["translate_errors", "where"]


def where(exc: BaseException) -> tuple[str, str]:
    """The (op, module) recorded on ``exc`` by the tracker, or ("", "")."""
    found = getattr(exc, "memplan_where", None)
    return found if isinstance(found, tuple) else ("", "")


def _place(exc: BaseException) -> str:
    op, module = where(exc)
    parts = []
    if op:
        parts.append(f"operator {op}")
    parts.append(f"in module {module!r}" if module else "outside any module")
    return " ".join(parts)


@contextmanager
def translate_errors(model: Any) -> Iterator[None]:
    """Re-raise fake-tensor failures of tracing ``model`` as one-sentence memplan errors."""
    from torch._subclasses.fake_tensor import (
        DataDependentOutputException,
        DynamicOutputShapeException,
        UnsupportedOperatorException,
    )

    label = model if isinstance(model, str) else getattr(
        model, "__memplan_source__", getattr(model, "__name__", "the model"))
    try:
        yield
    except MemplanError:
        raise
    except (DynamicOutputShapeException, DataDependentOutputException) as exc:
        raise UnsupportedError(
            f"tracing {label}: {_place(exc)} has an output whose shape or value depends on tensor data, "
            "which fake tensors do not have; for MoE routing use --moe-routing balanced, otherwise make "
            "the shape static in the model code"
        ) from None
    except UnsupportedOperatorException as exc:
        raise UnsupportedError(
            f"tracing {label}: {_place(exc)} has no fake-tensor (meta) implementation; register one with "
            "torch.library.register_fake or replace the operator"
        ) from None
    except MemoryError:
        raise UnsupportedError(
            f"tracing {label}: the host ran out of memory for fake tensors' bookkeeping; try fewer layers "
            "(a config.json with num_hidden_layers reduced) and scale the per-layer result"
        ) from None
    except Exception as exc:
        op, _module = where(exc)
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        source = getattr(model, "__memplan_source__", None)
        if source is not None:
            raise UnsupportedError(f"{source}: the training step raised {type(exc).__name__} "
                                   f"({_place(exc)}): {first}") from None
        if not op:
            raise
        raise UnsupportedError(f"tracing {label}: {_place(exc)} failed on fake tensors: {first}") from None
