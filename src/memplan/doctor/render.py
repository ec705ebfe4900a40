"""Rich tables of a :class:`~memplan.doctor.report.DoctorReport` for people (GiB = 2^30 bytes).

The report is taken untyped: :mod:`memplan.doctor.report` imports this module to render itself.
"""

from __future__ import annotations

from typing import Any

from memplan.doctor.words import VERDICT_TEXT, format_bytes
from memplan.frameworks.native_fix import native_lines

__all__ = ["render_report"]

_COLOUR = {"fits": "green", "unknown": "yellow"}


def _shown_to_fail(fix: Any) -> bool:
    """The fix was replayed or re-estimated and still ran out of memory (unlike one checked by arithmetic only)."""
    return not fix.verified and fix.verified_by in ("simulation", "reconstruction", "estimate")


def render_report(report: Any) -> Any:
    """A group of renderables: the verdict line, the findings with their numbers, the ranked fixes."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    colour = _COLOUR.get(report.verdict, "red")
    parts: list[Any] = [Text.assemble(("verdict: ", "bold"), (report.verdict, f"bold {colour}"),
                                      f" - {VERDICT_TEXT.get(report.verdict, '')}")]
    if report.capacity_bytes is not None:
        parts.append(Text(f"capacity checked: {format_bytes(report.capacity_bytes)} ({report.capacity_source})"))
    for finding in report.findings:
        table = Table(title=f"{finding.verdict}: {finding.summary}", title_justify="left", show_edge=False)
        table.add_column("evidence")
        table.add_column("value", justify="right")
        table.add_column("source")
        table.add_column("note")
        for e in finding.evidence:
            table.add_row(e.name, e.render(), e.source, e.note)
        for site, size in finding.sites:
            table.add_row("site", format_bytes(size), finding.verdict, site)
        parts.append(table)
    if report.fixes:
        fixes = Table(title="fixes, cheapest verified first", title_justify="left", show_edge=False)
        for name, justify in (("#", "right"), ("action", "left"), ("saves", "right"), ("verified", "left"),
                              ("how", "left")):
            fixes.add_column(name, justify=justify, overflow="fold")  # type: ignore[arg-type]
        for rank, fix in enumerate(report.fixes, start=1):
            mark = Text("yes", style="green") if fix.verified else Text("no", style="red")
            check = fix.verified_by
            if not fix.verified:
                check += {"simulation": ": still out of memory", "reconstruction": ": still out of memory", "estimate": ": over the limit",
                          "arithmetic": " only (no trace to replay)"}.get(fix.verified_by, "")
            elif fix.peak_bytes is not None and fix.limit_bytes is not None:
                check += f": {format_bytes(fix.peak_bytes)} vs {format_bytes(fix.limit_bytes)}"
            if fix.step_time_s is not None and fix.base_step_time_s:
                check += f", step {100 * fix.cost:+.0f}%"
            fixes.add_row(str(rank), fix.action, format_bytes(fix.saves_bytes), mark, check)
        parts.append(fixes)
        # The exact lines to use, never wrapped (a wrapped environment line cannot be pasted); a fix the
        # replay or the estimate has just shown to still run out of memory is not one to use.
        usable = [(rank, fix) for rank, fix in enumerate(report.fixes, start=1) if not _shown_to_fail(fix)]
        if usable:
            parts.append(Text("use:", style="bold"))
            for rank, fix in usable:
                parts.append(Text(f"  {rank}. {fix.setting}", no_wrap=True, overflow="ignore"))
                parts.extend(Text(f"     {line}", overflow="fold", style="dim" if line.startswith("(") else "")
                             for line in native_lines(fix.native))
        else:
            parts.append(Text("use: none of these fixes is enough alone (each still runs out of memory); combine "
                              "them or give the job more memory", style="yellow"))
    parts.extend(Text(f"note: {n}", style="yellow") for n in report.notes)
    return Group(*parts)
