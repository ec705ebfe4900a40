"""Tables read at 80 columns: every number printed at full width is printed whole at 80 columns too
(wrapped labels, abbreviated units or one small table per row, never a cut number)."""

from __future__ import annotations

import io
import re
from typing import Any

from rich.console import Console, Group
from rich.table import Table

_NUMBER = re.compile(r"(?<![\w.,])\d[\d,]*(?:\.\d+)?%?(?![\w,])")


def _render(renderables: Any, width: int) -> str:
    console = Console(width=width, file=io.StringIO(), color_system=None, highlight=False)
    for item in renderables if isinstance(renderables, list) else [renderables]:
        console.print(item)
    return console.file.getvalue()  # type: ignore[attr-defined]


def _assert_numbers_whole(renderables: Any) -> str:
    wide, narrow = _render(renderables, 250), _render(renderables, 80)
    assert max(map(len, narrow.splitlines())) <= 80
    tokens = set(_NUMBER.findall(narrow))
    missing = sorted(set(_NUMBER.findall(wide)) - tokens)
    assert not missing, f"numbers cut at 80 columns: {missing[:10]}\n{narrow}"
    return narrow


def test_fit_methods_at_80_columns() -> None:
    from memplan.fit.question import FitQuestion, answer
    from memplan.report.fit_text import methods_renderables

    result = answer(FitQuestion(model="llama-3.2-1b", flags={"gpus": 1}, methods=True)).result
    narrow = _assert_numbers_whole(methods_renderables(result))
    assert "tokens/s" in narrow and re.search(r"\d\.\d+M|\d+K", narrow)  # LoRA trains ~0.85M: not "0.00B"


def test_fit_layouts_at_80_columns() -> None:
    from memplan.fit.question import FitQuestion, answer
    from memplan.report.fit_text import fit_renderables

    result = answer(FitQuestion(model="llama-3.1-8b", flags={"gpus": 8}, top=5)).result
    narrow = _assert_numbers_whole(fit_renderables(result, 5))
    assert "MFU" in narrow


def test_a_wide_table_becomes_one_table_per_row() -> None:
    """The ckpt benchmark's 12-column table: at 80 columns each variant gets its own small table."""
    from memplan.report.fitting import Fitting, records

    header = ["variant", "runs", "tokens/s median", "min-max", "x full (median, min-max)", "x full by CPU s",
              "steps over budget", "max peak MiB", "recomputed block fwds", "probe fwds", "sheltered", "misses"]
    rows = [["full", "3", "2188.4", "2150.1-2201.9", "1.000 (1.000-1.000)", "1.000 (1.000-1.000)", "0", "1,234",
             "0/0/0", "0/0/0", "0/0/0", "0/0/0"],
            ["memplan", "3", "2325.7", "2301.0-2350.2", "1.063 (1.050-1.071)", "0.981 (0.970-0.990)", "0", "1,020",
             "12/12/12", "2/2/2", "1/1/1", "0/0/0"]]
    table = Table(title="bench")
    for i, name in enumerate(header):
        table.add_column(name, justify="left" if i == 0 else "right", no_wrap=i > 0)
    for row in rows:
        table.add_row(*row)
    renderable = Group(Fitting(table, records("bench", header, rows)))
    narrow = _assert_numbers_whole(renderable)
    assert "2325.7" in narrow and "tokens/s median" in narrow
    assert _render(renderable, 250).count("\n") < narrow.count("\n")  # the wide form where it fits


def test_names_wrap_between_identifiers() -> None:
    from memplan.report.fitting import BreakAt

    table = Table()
    table.add_column("module", max_width=70)
    for col in ("A at its peak", "B at its peak", "B - A"):
        table.add_column(col, no_wrap=True)
    name = "aten::mm in model.layers.10.mlp.down_proj"
    table.add_row(BreakAt(name), "12.00 GiB", "13.00 GiB", "+1.00 GiB")
    lines = [line.split("│")[1].strip() if "│" in line else "" for line in _render(table, 60).splitlines()]
    pieces = [p for p in lines if p and p != "module"]
    assert "".join(pieces).replace(" ", "") == name.replace(" ", "")
    assert all(p.endswith((".", ":", "_")) or p == pieces[-1] or p.endswith("in") for p in pieces), pieces
