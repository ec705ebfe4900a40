"""``--script file.py:make_job``: trace the user's own model and training step.

The function is called with no arguments *inside* the fake mode, so every tensor it creates
(the model's parameters, the batch) is fake and costs no memory. It returns either a mapping with
keys ``model``, ``batch``, ``optimizer``, ``loss_fn`` or the tuple ``(model, batch, optimizer,
loss_fn)``; ``loss_fn(output, batch)`` turns the model output into a scalar loss. Example::

    def make_job():
        model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 10))
        batch = torch.randn(64, 1024)
        optimizer = torch.optim.AdamW(model.parameters())
        return model, batch, optimizer, lambda out, batch: out.square().mean()

An exception raised by the script becomes an error naming the file and the exception (exit 1).
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from memplan.errors import ConfigError, UnsupportedError
from memplan.trace.options import TraceOptions
from memplan.trace.run import StepJob

__all__ = ["ScriptError", "job_from_callable", "load_script_function"]


class ScriptError(UnsupportedError):
    """The user's script raised or returned something unusable (CLI exit 1)."""


def load_script_function(spec: str) -> Callable[[], Any]:
    """``path/to/file.py:function`` → the function (the module is imported under a private name)."""
    path_text, sep, name = spec.rpartition(":")
    if not sep or not path_text or not name.isidentifier():
        raise ConfigError("--script", "must be FILE.py:FUNCTION", spec)
    path = Path(path_text).expanduser()
    if not path.is_file():
        raise ConfigError("--script", "file does not exist", str(path))
    module_spec = importlib.util.spec_from_file_location(f"_memplan_user_script_{path.stem}", path)
    if module_spec is None or module_spec.loader is None:
        raise ConfigError("--script", "is not a Python file", str(path))
    module = importlib.util.module_from_spec(module_spec)
    sys.path.insert(0, str(path.parent))
    try:
        module_spec.loader.exec_module(module)
    except Exception as exc:  # noqa: BLE001 - any user error is reported, never a traceback
        raise ScriptError(f"{path} raised {type(exc).__name__} while being imported: {exc}") from None
    finally:
        sys.path.remove(str(path.parent))
    function = getattr(module, name, None)
    if not callable(function):
        raise ConfigError("--script", f"{path} defines no function {name!r}", spec)
    function.__memplan_source__ = str(path)  # type: ignore[attr-defined]
    return function  # type: ignore[no-any-return]


def job_from_callable(function: Callable[[], Any], options: TraceOptions) -> tuple[str, StepJob]:
    """Call ``function`` (inside the fake mode) and check what it returns."""
    source = getattr(function, "__memplan_source__", getattr(function, "__qualname__", "the job function"))
    try:
        returned = function()
    except Exception as exc:  # noqa: BLE001
        raise ScriptError(f"{source}: {getattr(function, '__name__', 'the function')}() raised "
                          f"{type(exc).__name__}: {exc}") from None
    model, batch, optimizer, loss_fn = _unpack(returned, source)
    name = f"{Path(str(source)).name}:{getattr(function, '__name__', '?')}"
    job = StepJob(model, batch, optimizer, _guarded(loss_fn, source), None)
    return name, job


def _unpack(returned: Any, source: str) -> tuple[Any, Any, Any, Any]:
    if isinstance(returned, Mapping):
        missing = [k for k in ("model", "batch", "optimizer", "loss_fn") if k not in returned]
        if missing:
            raise ScriptError(f"{source}: the returned mapping lacks {', '.join(missing)}")
        returned = (returned["model"], returned["batch"], returned["optimizer"], returned["loss_fn"])
    if not isinstance(returned, (tuple, list)) or len(returned) != 4:
        raise ScriptError(f"{source}: the job function must return (model, batch, optimizer, loss_fn), "
                          f"got {type(returned).__name__}")
    model, batch, optimizer, loss_fn = returned
    if not isinstance(model, torch.nn.Module):
        raise ScriptError(f"{source}: model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ScriptError(f"{source}: optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if not callable(loss_fn):
        raise ScriptError(f"{source}: loss_fn must be callable, got {type(loss_fn).__name__}")
    return model, batch, optimizer, loss_fn


def _guarded(loss_fn: Callable[[Any, Any], torch.Tensor], source: str) -> Callable[[Any, Any], torch.Tensor]:
    def loss(output: Any, batch: Any) -> torch.Tensor:
        value = loss_fn(output, batch)
        if not isinstance(value, torch.Tensor) or value.numel() != 1:
            raise ScriptError(f"{source}: loss_fn must return a scalar tensor, got {type(value).__name__}")
        return value

    return loss
