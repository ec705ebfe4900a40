"""Presentation of memplan's results: rich terminal renderables (:mod:`memplan.report.text`).

The maths never prints; commands hand typed results (``Estimate``, preset and GPU lists) to these
functions and print what they return. Importing this package is cheap: the rich-based module is
loaded on first use, so ``memplan estimate --json`` never imports rich.
"""

from __future__ import annotations

from typing import Any

__all__ = ["gpus_table", "presets_table", "render_estimate"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from memplan.report import text

        return getattr(text, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
