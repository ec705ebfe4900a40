"""The ``memplan`` command line: one typer app, a thin client of the library (parse → call → render).

The app and what the commands share live in :mod:`memplan.commands.common`; each command lives
in its own module under :mod:`memplan.commands`, listed in :data:`COMMAND_MODULES`. This module
only assembles them, so nothing imports it back. ``memplan.cli.app`` is the app with every command;
:func:`main` registers only the module of the command it runs (:data:`COMMAND_OWNERS`).

Startup matters (``memplan estimate`` must answer in well under a second): no command module
imports torch, numpy or matplotlib at module level.

Exit codes: 0 success; 1 a :class:`~memplan.errors.MemplanError` that is not a configuration
error; 2 bad input — a :class:`~memplan.errors.ConfigError` or a usage error reported by typer.
"""

from __future__ import annotations

import importlib
import sys
from typing import Annotated

import typer

from memplan.commands.common import app as _app

__all__ = ["COMMAND_MODULES", "app", "main"]  # noqa: F822 - ``app`` comes from the module __getattr__ below

#: Modules under :mod:`memplan.commands` that register commands on :data:`app` when imported,
#: in the order ``memplan --help`` lists them.
COMMAND_MODULES: tuple[str, ...] = ("estimate", "alloc", "ckpt", "fit", "report", "trace", "doctor", "diff",
                                     "serve")


def _version(value: bool) -> None:
    if value:
        from memplan import __version__

        typer.echo(f"memplan {__version__}")
        raise typer.Exit()


@_app.callback()
def _root(
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version.")] = False,
) -> None:
    """memplan: how much GPU memory a training job needs, where it goes, and how to make it fit."""


#: The module that registers each top-level command: ``memplan estimate ...`` imports and builds only
#: that module's commands (typer builds every registered command's parameters on each run, and
#: ``estimate`` carries every job flag), so start-up does not pay for the other commands.
COMMAND_OWNERS: dict[str, str] = {"estimate": "estimate", "models": "estimate", "gpus": "estimate",
                                  "alloc": "alloc", "ckpt": "ckpt", "fit": "fit", "report": "report",
                                  "trace": "trace", "doctor": "doctor", "diff": "diff", "serve": "serve"}


def load_commands(modules: tuple[str, ...] = COMMAND_MODULES) -> typer.Typer:
    """Import ``modules`` (they register their commands on the app) and return the app."""
    for name in modules:
        importlib.import_module(f"memplan.commands.{name}")
    return _app


def __getattr__(name: str) -> typer.Typer:
    # ``memplan.cli.app``: the app with every command (what tests and embedders invoke).
    if name == "app":
        return load_commands()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def main() -> None:
    """Console-script entry point (``memplan``): registers the named command's module only (every
    module for ``--help``, ``--version`` or an unknown word, so typer lists or refuses as usual)."""
    first = next((word for word in sys.argv[1:] if not word.startswith("-")), "")
    owner = COMMAND_OWNERS.get(first)
    load_commands((owner,) if owner else COMMAND_MODULES)(prog_name="memplan")
