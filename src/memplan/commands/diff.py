"""``memplan diff A B``: the peak difference of two memory snapshots or traces, attributed.

Imports nothing heavy at module level: the readers load inside the command.
"""

from __future__ import annotations

from typing import Annotated

import typer

from memplan.commands.common import Command as _Command
from memplan.commands.common import app, check_output_path, handle_errors, print_json, print_rich
from memplan.errors import ConfigError

_INPUT_HELP = "A torch.cuda.memory._dump_snapshot() pickle or a memplan trace (.mptrace / .jsonl.gz)."
_EPILOG = """\
Examples:

  memplan diff before_upgrade.pickle after_upgrade.pickle

  memplan diff bs8.mptrace bs16.mptrace --html diff.html

  memplan diff a.pickle b.pickle --json

The deltas of each attribution (categories, modules, sites) add up exactly to the peak difference.
Sizes are GiB = 2^30 bytes. Exit codes: 0 ok, 2 invalid input (unreadable, truncated or hostile
pickle, malformed trace, snapshots of different devices).
"""


@app.command("diff", cls=_Command, epilog=_EPILOG)
def diff_command(
    a: Annotated[str, typer.Argument(help="A, the baseline. " + _INPUT_HELP, show_default=False, metavar="A")],
    b: Annotated[str, typer.Argument(help="B, compared with A. " + _INPUT_HELP, show_default=False, metavar="B")],
    html: Annotated[str | None, typer.Option("--html", help="Write one offline HTML page: both timelines overlaid, the tables.", metavar="FILE")] = None,
    device: Annotated[int | None, typer.Option("--device", help="CUDA device of multi-device snapshots (default: the one with most trace entries).", metavar="N")] = None,
    top: Annotated[int, typer.Option("--top", help="Rows per table before the 'other' row.")] = 10,
    json_output: Annotated[bool, typer.Option("--json", help="Print the whole attribution as JSON (nothing else on stdout).")] = False,
) -> None:
    """Where B's peak memory differs from A's: by category, module and allocation site."""
    with handle_errors():
        if top < 0:
            raise ConfigError("--top", "must be >= 0", top)
        check_output_path("--html", html)
        from memplan.diff import diff_files

        result = diff_files(a, b, device=device)
        if html is not None:
            from memplan.report.diff_html import write_diff_html

            write_diff_html(result, html)
    if json_output:
        print_json(result.to_dict())
        return
    from memplan.report.diff_text import render_diff

    print_rich(render_diff(result, top=top))
    if html is not None:
        typer.echo(f"wrote {html}")
