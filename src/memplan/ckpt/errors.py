"""Errors of :mod:`memplan.ckpt`.

Hierarchy (under :class:`memplan.errors.MemplanError`)::

    CkptError                 base of the checkpointing subsystem's runtime errors (CLI exit 1)
    └── BatchTooLargeError    a batch does not fit the budget even with every block checkpointed

Bad arguments (budget, blocks, size_fn) are :class:`memplan.errors.ConfigError` (exit 2).
"""

from __future__ import annotations

from memplan.errors import MemplanError

__all__ = ["BatchTooLargeError", "CkptError"]


class CkptError(MemplanError):
    """Something the checkpointing runtime could not do."""


class BatchTooLargeError(CkptError):
    """The step exceeded the budget with every block checkpointed: no plan can make it fit."""
