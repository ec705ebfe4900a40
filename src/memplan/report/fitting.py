"""Tables that fit the terminal without cutting a number.

rich shrinks a table that is wider than the terminal by folding its wrappable cells and, past that,
by cropping cells — a number such as ``2,325`` can then show as ``2,3``. :class:`Fitting` holds a
wide renderable and a narrow one and, at render time, prints the wide one when its minimum width fits
the console and the narrow one otherwise; :func:`records` is the usual narrow form of a wide table:
one small two-column table (field, value) per row, which fits any terminal of 40 columns or more.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from typing import Any

from rich.console import Console, ConsoleOptions, Group
from rich.measure import Measurement
from rich.table import Table

__all__ = ["BreakAt", "Fitting", "records"]


class Fitting:
    """``wide`` when it fits the console's width unbroken, else ``narrow``."""

    def __init__(self, wide: Any, narrow: Any) -> None:
        self.wide, self.narrow = wide, narrow

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> Iterator[Any]:
        needed = Measurement.get(console, options.update(width=10_000), self.wide).minimum
        yield self.wide if needed <= options.max_width else self.narrow


def records(title: str, header: Sequence[str], rows: Sequence[Sequence[Any]], *, caption: str = "") -> Group:
    """One ``field | value`` table per row (its first cell as the table's title), under ``title``."""
    from rich.text import Text

    parts: list[Any] = [Text(title, style="italic")]
    for row in rows:
        table = Table(title=str(row[0]), title_justify="left", show_header=False, show_edge=False, pad_edge=False)
        table.add_column("field", overflow="fold")
        table.add_column("value", justify="right", no_wrap=True)
        for name, value in zip(header[1:], row[1:]):
            table.add_row(name, value)
        parts.append(table)
    if caption:
        parts.append(Text(caption, style="dim"))
    return Group(*parts)


class BreakAt:
    """A name that wraps only after one of ``breaks`` (``.``, ``/``, ``_``, ``:``, a space) when its column is
    too narrow, so ``model.layers.10.mlp.down_proj`` becomes ``model.layers.10.`` / ``mlp.down_proj`` rather
    than ``model.layers.10.mlp.do`` / ``wn_proj``; a part longer than the column is folded."""

    def __init__(self, text: str, breaks: str = "./_: ", style: str = "") -> None:
        self.text, self.style = text, style
        self.parts = re.findall(rf"[^{re.escape(breaks)}]*(?:[{re.escape(breaks)}]|$)", text)
        self.parts = [p for p in self.parts if p]

    def __rich_measure__(self, console: Console, options: ConsoleOptions) -> Measurement:
        longest = max((len(p) for p in self.parts), default=0)
        return Measurement(min(longest, options.max_width), min(len(self.text), options.max_width))

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> Iterator[Any]:
        from rich.text import Text

        width, lines, line = max(1, options.max_width), [], ""
        for part in self.parts:
            if line and len(line) + len(part.rstrip()) > width:
                lines.append(line)
                line = ""
            line += part
        lines.append(line)
        text = Text("\n".join(lines).replace(" \n", "\n"), style=self.style, overflow="fold")
        yield text
