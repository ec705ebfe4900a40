"""The doctor's text: the verdict line says its verdict once, and `use:` lists only fixes not shown to fail."""

from __future__ import annotations

import io
from types import SimpleNamespace

from rich.console import Console

from memplan.doctor.render import render_report


def _fix(setting: str, verified: bool, verified_by: str) -> SimpleNamespace:
    return SimpleNamespace(action=setting, setting=setting, verified=verified, verified_by=verified_by,
                           peak_bytes=None, limit_bytes=None, step_time_s=None, base_step_time_s=None, cost=0.0,
                           saves_bytes=1 << 30, native=None)


def _text(report: SimpleNamespace) -> str:
    console = Console(width=200, file=io.StringIO(), color_system=None)
    console.print(render_report(report))
    return console.file.getvalue()  # type: ignore[attr-defined]


def _report(*fixes: SimpleNamespace, verdict: str = "fragmentation") -> SimpleNamespace:
    return SimpleNamespace(verdict=verdict, capacity_bytes=None, findings=(), fixes=fixes, notes=())


def test_use_leaves_out_fixes_shown_to_still_run_out_of_memory() -> None:
    text = _text(_report(_fix("--mbs 1", True, "estimate"), _fix("--recompute full", False, "estimate"),
                         _fix("expandable_segments:True", False, "arithmetic")))
    use = text.split("use:", 1)[1]
    assert "--mbs 1" in use and "expandable_segments:True" in use and "--recompute full" not in use
    assert "verdict: fragmentation - the request would have fit" in text  # not "fragmentation - fragmentation:"


def test_no_usable_fix_says_so() -> None:
    text = _text(_report(_fix("--recompute full", False, "simulation")))
    assert "none of these fixes is enough alone" in text
