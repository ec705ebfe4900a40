"""Every option of the chosen ``memplan`` commands given hostile values: never a traceback.

The rule, fixed before a run: each invocation exits 0, 1 or 2, and none raises out of the command or prints a
Python traceback. Values: -1, 0, 1e30, nan, inf, "", abc, "1,2,x", 3.5, a missing path, a malformed JSON file,
an empty file and a pickle that would run a shell command if loaded. Options of the base command line are given
on top of a small valid job (``llama-3.2-1b``); ``ckpt bench`` runs ``--quick`` with one step.

    python benchmarks/sweep_cli.py alloc ckpt doctor diff gpus models   # ~1,200 runs, minutes
    python benchmarks/sweep_cli.py fit report                           # ~2,300 runs

It runs in a temporary folder (some options write files) and prints the runs, the problems and each problem's
command line. Exit 1 when any run breaks the rule. ``trace`` and ``serve`` are left out (a trace per value takes
seconds to minutes; the server's bodies are fuzzed in tests/serve).
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path
from typing import Any

BAD = ("-1", "0", "1e30", "nan", "inf", "", "abc", "1,2,x", "3.5")
#: Arguments that make each command's base line valid (a model, an output path, a quick run).
BASE = {"estimate": ["llama-3.2-1b"], "fit": ["llama-3.2-1b"], "report": ["llama-3.2-1b", "-o", "r.html"],
        "ckpt bench": ["--quick", "--steps", "1", "--repeats", "1"]}
LEFT_OUT = {"trace", "serve"}


def _files(folder: Path) -> tuple[str, ...]:
    (folder / "garbage.json").write_text("{not json")
    (folder / "empty").write_text("")
    (folder / "pickle.pkl").write_bytes(b"\x80\x04\x95\x00cos\nsystem\n(S'echo pwned'\ntR.")
    return (str(folder / "missing.json"), str(folder / "garbage.json"), str(folder / "empty"),
            str(folder / "pickle.pkl"))


def _commands(command: Any, path: list[str]) -> Any:
    if hasattr(command, "commands"):
        for name, sub in command.commands.items():
            yield from _commands(sub, [*path, name])
    else:
        yield path, command


def sweep(names: list[str]) -> tuple[int, list[tuple[list[str], int, str]]]:
    import typer
    from typer.testing import CliRunner

    from memplan.cli import app

    runner = CliRunner()
    values = BAD + _files(Path.cwd())
    runs, problems = 0, []
    for path, command in _commands(typer.main.get_command(app), []):
        if path[0] in LEFT_OUT or (names and path[0] not in names):
            continue
        base = BASE.get(" ".join(path), BASE.get(path[0], []))
        for param in command.params:
            if type(param).__name__ not in ("TyperOption", "Option") or getattr(param, "is_flag", False):
                continue
            option = max(param.opts, key=len)
            if option in ("--help", "--json"):
                continue
            for value in values:
                args = [*path, *base, option, value]
                result = runner.invoke(app, args, catch_exceptions=True)
                runs += 1
                raised = result.exception is not None and not isinstance(result.exception, SystemExit)
                if raised or result.exit_code not in (0, 1, 2) or "Traceback" in (result.output or ""):
                    problems.append((args, result.exit_code, repr(result.exception)[:200]))
    return runs, problems


def main() -> int:
    names = sys.argv[1:]
    here = Path.cwd()
    with tempfile.TemporaryDirectory() as folder:
        os.chdir(folder)
        try:
            runs, problems = sweep(names)
        finally:
            os.chdir(here)
    print(f"{runs} runs, {len(problems)} problems")
    for args, code, error in problems:
        print(f"  exit {code}: memplan {' '.join(args)}  {error}")
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
