"""While a request is answered, the process opens no file outside the places it may read.

:mod:`memplan.serve.bodies` already refuses paths where a field could name a file; this is the
backstop for fields it does not know to name one (a dialect key that points at another file, a
model name a TOML derives). Python's audit hooks (PEP 578) see every ``open``; :func:`read_guard`
marks the current thread or task (a :class:`contextvars.ContextVar`, so concurrent requests and the
rest of the process are unaffected) and the hook refuses any path outside the request's own folder,
memplan's package (its presets), the Python installation (lazy imports) and the Hugging Face cache
(Hub ids). A refused open raises :class:`PermissionError`, which the loaders report as "cannot read
the file" (a 400 with the field's name), never the file's content.

The hook is installed once per process (audit hooks cannot be removed) and costs one context-variable
read per audited event outside a request.
"""

from __future__ import annotations

import contextvars
import os
import site
import sys
import sysconfig
from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path

__all__ = ["allowed_roots", "read_guard"]

_ROOTS: contextvars.ContextVar[tuple[str, ...] | None] = contextvars.ContextVar("memplan_serve_roots", default=None)
_installed: list[bool] = []  # the hook, once per process


def _hook(event: str, args: tuple[object, ...]) -> None:
    if event != "open":
        return
    roots = _ROOTS.get()
    if roots is None or not args or not isinstance(args[0], (str, bytes, os.PathLike)):
        return
    path = os.path.realpath(os.fsdecode(args[0]))
    if not any(path == root or path.startswith(root + os.sep) for root in roots):
        raise PermissionError(f"memplan serve reads no files outside the request: {os.fsdecode(args[0])}")


def allowed_roots(*folders: Path) -> tuple[str, ...]:
    """The folders a request may read: memplan's package, Python's, the Hub cache, and ``folders``
    (the request's own)."""
    return _base_roots() + tuple(os.path.realpath(p) for p in folders)


@lru_cache(maxsize=1)
def _base_roots() -> tuple[str, ...]:
    """memplan's package, the Python installation and site-packages, the Hub cache (facts of the
    process's environment, read once)."""
    import memplan

    candidates = [Path(memplan.__file__).parent, Path(sys.prefix), Path(sys.base_prefix), Path(sys.exec_prefix)]
    candidates += [Path(p) for p in sysconfig.get_paths().values()]
    candidates += [Path(p) for p in site.getsitepackages() + [site.getusersitepackages()]]
    candidates += [Path(p) for p in sys.path if p and Path(p).is_dir() and "site-packages" in p]
    hub = os.environ.get("HF_HUB_CACHE") or os.path.join(
        os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface"), "hub")
    candidates.append(Path(hub))
    return tuple(sorted({os.path.realpath(p) for p in candidates}))


@contextmanager
def read_guard(roots: tuple[str, ...]) -> Iterator[None]:
    """Within the block (this thread or task only), opening a file outside ``roots`` is refused."""
    if not _installed:
        sys.addaudithook(_hook)
        _installed.append(True)
    token = _ROOTS.set(roots)
    try:
        yield
    finally:
        _ROOTS.reset(token)
