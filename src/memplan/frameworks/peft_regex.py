"""peft's ``target_modules`` regex, matched in bounded time.

peft full-matches a string ``target_modules`` against each module name with Python's :mod:`re`
(``re.fullmatch(target_modules, key)`` in ``peft.tuners.tuners_utils.check_target_module_exists``);
a list is matched by suffix, which needs no regex. Python's engine backtracks: a pattern such as
``([\\w.]|[\\w.][\\w.])*Z`` takes exponential time on a 40-character name, and a config file is
untrusted input. memplan matches with RE2 (the ``google-re2`` package, ``pip install 'memplan[re2]'``),
which runs in time linear in the name. A pattern RE2 cannot compile (back-references, look-around)
— or every pattern, when RE2 is not installed — is matched by Python's engine in a child process
killed after :data:`REGEX_SECONDS`. Either way the answer is peft's: the same names match.
"""

from __future__ import annotations

import multiprocessing
import re
from collections.abc import Sequence

from memplan.errors import ConfigError

__all__ = ["REGEX_SECONDS", "full_matches"]

#: Seconds Python's engine may take to match a pattern RE2 cannot run, all module names together.
REGEX_SECONDS = 2.0


def full_matches(pattern: str, names: Sequence[str], *, field: str) -> list[str]:
    """The ``names`` that ``pattern`` full-matches, as ``re.fullmatch``; ConfigError (naming ``field``) for an
    invalid pattern or one that Python's engine cannot match within :data:`REGEX_SECONDS`."""
    try:
        re.compile(pattern)
    except (re.error, RecursionError, OverflowError) as exc:
        raise ConfigError(field, f"is not a valid regex ({exc})", pattern) from None
    compiled = _re2(pattern)
    if compiled is not None:
        return [n for n in names if compiled.fullmatch(n)]
    return _isolated(pattern, names, field)


def _re2(pattern: str) -> object | None:
    """The RE2 program of ``pattern``, or None (RE2 not installed, or a construct it does not have)."""
    try:
        import re2
    except ImportError:
        return None
    options = re2.Options()
    options.log_errors = False
    try:
        return re2.compile(pattern, options)
    except Exception:  # noqa: BLE001 - re2.error: a construct RE2 does not have; Python's engine runs it
        return None


def _match_all(pattern: str, names: Sequence[str], conn: object) -> None:
    conn.send([n for n in names if re.fullmatch(pattern, n)])  # type: ignore[attr-defined]


def _isolated(pattern: str, names: Sequence[str], field: str) -> list[str]:
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    ctx = multiprocessing.get_context(method)
    receiver, sender = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_match_all, args=(pattern, list(names), sender), daemon=True)
    proc.start()
    sender.close()
    try:
        if receiver.poll(REGEX_SECONDS):
            try:
                return list(receiver.recv())
            except EOFError:
                pass
        raise ConfigError(field, f"took more than {REGEX_SECONDS:g} s to match the model's module names (a "
                          "backtracking pattern, which RE2 cannot run either); list the module names instead",
                          pattern)
    finally:
        receiver.close()
        proc.kill()
        proc.join()
