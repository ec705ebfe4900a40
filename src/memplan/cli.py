"""The ``memplan`` command line: one typer app, a thin client of the library (parse → call → render).

The app and what the commands share live in :mod:`memplan.commands.common`; each command lives
in its own module under :mod:`memplan.commands`, listed in :data:`COMMAND_MODULES`. This module
only assembles them, so nothing imports it back.

Startup matters (``memplan estimate`` must answer in well under a second): no command module
imports torch, numpy or matplotlib at module level.

Exit codes: 0 success; 1 a :class:`~memplan.errors.MemplanError` that is not a configuration
error; 2 bad input — a :class:`~memplan.errors.ConfigError` or a usage error reported by typer.
"""

from __future__ import annotations

import importlib
from typing import Annotated

import typer

from memplan.commands.common import app

__all__ = ["COMMAND_MODULES", "app", "main"]

#: Modules under :mod:`memplan.commands` that register commands on :data:`app` when imported,
#: in the order ``memplan --help`` lists them.
COMMAND_MODULES: tuple[str, ...] = ("estimate", "alloc", "ckpt", "fit", "report", "trace", "doctor", "diff",
                                     "serve")


def _version(value: bool) -> None:
    if value:
        from memplan import __version__

        typer.echo(f"memplan {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version.")] = False,
) -> None:
    """memplan: how much GPU memory a training job needs, where it goes, and how to make it fit."""


for _name in COMMAND_MODULES:
    importlib.import_module(f"memplan.commands.{_name}")


def main() -> None:
    """Console-script entry point (``memplan``)."""
    app(prog_name="memplan")
