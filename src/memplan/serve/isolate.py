"""Run one request's work in a child process with a time limit and a memory limit.

A layout search or a doctor replay can take seconds and, on a hostile input, much more; a thread
cannot be stopped, a process can. :func:`run_isolated` forks a child from the ``forkserver`` (which
has memplan imported, so a child starts in milliseconds), caps its address space
(``RLIMIT_AS``), waits at most ``seconds`` for its answer and kills it otherwise. The server process
itself never runs the work, so nothing a request does can take it down.

What crosses back is plain data: the answer, or an :class:`Refusal` (a status, a message and the
field, rule and value of a :class:`~memplan.errors.ConfigError`).
"""

from __future__ import annotations

import multiprocessing
import re
import resource
from collections.abc import Callable
from typing import Any

__all__ = ["Refusal", "past_time_limit", "refusal_of", "run_isolated"]

#: Modules the forkserver imports once, so that each child starts with them loaded and its caches
#: warm (``__main__`` too: a child then does not import the server's main module again).
PRELOAD = ["__main__", "memplan.serve.preload"]


class Refusal(Exception):
    """A request the server answers with an error status and a JSON body naming what was wrong."""

    def __init__(self, status: int, message: str, field: str | None = None, rule: str | None = None,
                 value: Any = None) -> None:
        super().__init__(status, message, field, rule, value)
        self.status, self.message, self.field, self.rule, self.value = status, message, field, rule, value

    def __str__(self) -> str:
        return self.message

    def to_dict(self) -> dict[str, Any]:
        return {"error": {"status": self.status, "message": self.message, "field": self.field, "rule": self.rule,
                          "value": _plain(self.value)}}


def _plain(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


def past_time_limit(seconds: float) -> Refusal:
    """The answer to a request stopped at the server's time limit (``seconds``: what it had left)."""
    return Refusal(503, "the request ran past this server's time limit and was stopped; ask a narrower question "
                   "(a fixed layout, a smaller trace) or raise --time-limit", "time limit", "at most", seconds)


#: A path inside a request's own folder or its saved upload (``/tmp/memplan-serve-HEX/model/config.json``,
#: ``/tmp/memplan-upload-XYZ/upload``): messages name what the client sent, never where the server put it.
_TEMP_PATH = re.compile(r"""(?:/[^\s'"()]*)?/memplan-(?P<kind>upload|serve)-[\w]+(?:/(?P<rest>[^\s'"()]*))?""")


def without_paths(text: str) -> str:
    """``text`` with the server's temporary paths replaced by what they hold (``upload``, ``config.json``)."""
    return _TEMP_PATH.sub(lambda m: "upload" if m["kind"] == "upload" else (m["rest"] or "the request"), text)


def _clean(refusal: Refusal) -> Refusal:
    value = without_paths(refusal.value) if isinstance(refusal.value, str) else refusal.value
    return Refusal(refusal.status, without_paths(refusal.message), refusal.field and without_paths(refusal.field),
                   refusal.rule and without_paths(refusal.rule), value)


def refusal_of(exc: BaseException) -> Refusal:
    """The status and body memplan's own errors get (anything else is a server error, 500); the server's
    temporary paths are left out of every message."""
    return _clean(_refusal_of(exc))


def _refusal_of(exc: BaseException) -> Refusal:
    from memplan.errors import ConfigError, MissingDependencyError, UnsupportedError

    if isinstance(exc, Refusal):
        return exc
    if isinstance(exc, ConfigError):  # a body's field is named as in a job file: tp, not --tp
        name = exc.field.removeprefix("--")
        text = str(exc)
        return Refusal(400, name + text[len(exc.field):] if text.startswith(exc.field) else text, name, exc.rule,
                       exc.value)
    if isinstance(exc, UnsupportedError):
        return Refusal(422, str(exc))
    if isinstance(exc, MissingDependencyError):
        return Refusal(501, str(exc))
    if isinstance(exc, MemoryError):
        return Refusal(503, "the request needs more memory than this server allows a request")
    return Refusal(500, f"internal error ({type(exc).__name__}); the server logged it")


def _child(conn: Any, func: Callable[..., Any], args: tuple[Any, ...], memory_bytes: int | None) -> None:
    if memory_bytes is not None:
        resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    try:
        conn.send(("ok", func(*args)))
    except BaseException as exc:  # noqa: BLE001 - every failure goes back as a refusal
        refusal = refusal_of(exc)
        if refusal.status == 500:
            import traceback

            traceback.print_exc()
        try:
            conn.send(("refused", refusal))
        except BaseException:  # noqa: BLE001 - an unpicklable value: send the message alone
            conn.send(("refused", Refusal(refusal.status, refusal.message, refusal.field, refusal.rule)))
    finally:
        conn.close()
    # The answer is sent: leave at once. A normal exit tears down the interpreter (its modules, caches and
    # the request's objects), tens of milliseconds the server would wait for in join().
    import os
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _context() -> Any:
    methods = multiprocessing.get_all_start_methods()
    ctx = multiprocessing.get_context("forkserver" if "forkserver" in methods else "spawn")
    if "forkserver" in methods:
        ctx.set_forkserver_preload(PRELOAD)
    return ctx


def run_isolated(func: Callable[..., Any], args: tuple[Any, ...], *, seconds: float,
                 memory_bytes: int | None) -> Any:
    """``func(*args)`` in a child process; its answer, or the :class:`Refusal` it raised.

    Raises a 503 :class:`Refusal` when the child runs past ``seconds`` (it is killed) or dies
    (e.g. past ``memory_bytes``).
    """
    ctx = _context()
    receiver, sender = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(sender, func, args, memory_bytes), daemon=True)
    try:
        proc.start()
    except (EOFError, OSError) as exc:  # the forkserver itself failed (its preload raised, or no process left)
        receiver.close()
        sender.close()
        raise Refusal(503, f"the server could not start a worker process ({type(exc).__name__}); it logged why") \
            from exc
    sender.close()
    answered = False
    try:
        if not receiver.poll(seconds):
            raise past_time_limit(seconds)
        try:
            kind, payload = receiver.recv()
            answered = True
        except EOFError:
            proc.join(5)
            raise Refusal(503, "the request's worker process died (exit code "
                          f"{proc.exitcode}), most likely past this server's memory limit per request") from None
    finally:
        receiver.close()
        if not answered:  # past the limit, or dead: nothing of the request may go on running
            proc.kill()
            proc.join()
        # an answered child leaves at once (os._exit in _child); multiprocessing reaps it at the next start
    if kind == "refused":
        raise payload
    return payload
