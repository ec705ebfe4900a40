"""Presentation of memplan's results: rich terminal renderables, HTML, the data behind the plots.

One module per subject, each turning typed results into ``rich`` objects and nothing else:

* :mod:`memplan.report.text` -- ``memplan estimate``, ``models``, ``gpus``
* :mod:`memplan.report.trace_text` -- ``memplan trace``
* :mod:`memplan.report.alloc_text` -- ``memplan alloc``
* :mod:`memplan.report.ckpt_text` -- ``memplan ckpt``
* :mod:`memplan.report.fit_text` -- ``memplan fit``
* :mod:`memplan.report.diff_text` -- ``memplan diff`` (its page: :mod:`memplan.report.diff_html`)

The maths never prints; commands hand typed results to these functions and print what they
return. Importing this package is cheap: a rendering module (and rich) is loaded on first use of
one of its names, so ``memplan estimate --json`` never imports rich.
"""

from __future__ import annotations

import importlib
from typing import Any

#: Each public renderer and the module under :mod:`memplan.report` that defines it.
_RENDERERS = {
    "gpus_table": "text",
    "presets_table": "text",
    "render_estimate": "text",
    "render_comparison": "trace_text",
    "render_summary": "trace_text",
    "comparison_table": "alloc_text",
    "simulation_table": "alloc_text",
    "static_plan_table": "alloc_text",
    "bench_markdown": "ckpt_text",
    "bench_tables": "ckpt_text",
    "profile_table": "ckpt_text",
    "colocation_table": "fit_text",
    "fit_renderables": "fit_text",
    "limit_renderables": "fit_text",
    "render_diff": "diff_text",
}

__all__ = sorted(_RENDERERS)


def __getattr__(name: str) -> Any:
    if name in _RENDERERS:
        return getattr(importlib.import_module(f"memplan.report.{_RENDERERS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
