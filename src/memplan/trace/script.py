"""``--script file.py:make_job``: trace the user's own model and training step.

The function is called *inside* the fake mode, so every tensor it creates (the model's
parameters, the batch) is fake and costs no memory. It returns either a mapping with keys
``model``, ``batch``, ``optimizer``, ``loss_fn`` or the tuple ``(model, batch, optimizer,
loss_fn)``; ``loss_fn(output, batch)`` turns the model output into a scalar loss.

The contract with the command line's job flags:

* ``def make_job():`` — the script defines its own job. Job flags given on the command line
  (``--seq``, ``--precision``, ``--fsdp``...) cannot reach it and are refused (exit 2), never ignored.
* ``def make_job(ctx):`` — the function receives a :class:`ScriptContext`: ``ctx.job`` is the
  :class:`~memplan.job.Job` the flags describe, ``ctx.mesh`` the simulated device mesh under
  ``--fsdp N`` / ``--tp N`` (None on one rank), and helpers that apply the job the way the tracer
  applies it to Hugging Face models (``ctx.parallelize(model, blocks)``, ``ctx.make_optimizer(params)``,
  ``ctx.token_batch(vocab_size)``, ``ctx.param_dtype``). The tracer itself runs the loop: autocast
  for ``*-mixed`` precision on unsharded models, ``--iterations``, ``--device`` accounting. Example::

    def make_job(ctx):
        model = MyModel(dtype=ctx.param_dtype)           # build in the dtype: .to() cannot swap fake weights
        ctx.parallelize(model, blocks=model.blocks)      # FSDP2 / TP as the flags say
        batch = ctx.token_batch(vocab_size=32000)
        return model, batch, ctx.make_optimizer(model.parameters()), lambda out, b: out.loss

An exception raised by the script becomes an error naming the file and the exception (exit 1).
"""

from __future__ import annotations

import importlib.util
import inspect
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from memplan.errors import ConfigError, UnsupportedError
from memplan.job import Job
from memplan.trace.build import TORCH_DTYPES
from memplan.trace.run import StepJob, make_batch, make_optimizer
from memplan.trace.setup import TraceSetup

__all__ = ["ScriptContext", "ScriptError", "check_script_flags", "job_from_callable", "load_script_function", "takes_context"]


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


@dataclass(frozen=True)
class ScriptContext:
    """What a ``make_job(ctx)`` function receives: the job the flags describe and the simulated ranks."""

    #: The job (batch, precision, optimizer, recompute, ranks) the command line describes.
    job: Job
    #: The fake process group's device mesh (dims ``dp`` and/or ``tp``), None on one rank.
    mesh: Any
    #: How the tracer runs the job (device accounting, iterations).
    setup: TraceSetup

    @property
    def param_dtype(self) -> torch.dtype:
        """The dtype to build the weights in: fp32 for ``*-mixed``, else the compute dtype."""
        return torch.float32 if self.setup.mixed else TORCH_DTYPES[self.setup.compute_dtype]

    def make_optimizer(self, params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
        """The job's optimizer (``--optimizer``, ``--momentum``, the framework's implementation)."""
        return make_optimizer(params, self.setup)

    def token_batch(self, vocab_size: int) -> dict[str, torch.Tensor]:
        """``input_ids`` and ``labels`` of ``--mbs`` x ``--seq`` tokens."""
        return make_batch(vocab_size, self.setup)

    def parallelize(self, model: torch.nn.Module, blocks: Iterable[torch.nn.Module] | None = None) -> None:
        """Apply ``--tp`` (Llama-style blocks) and ``--fsdp`` (``fully_shard`` per block and on the
        root, with the precision's ``MixedPrecisionPolicy``) to ``model`` in place; no-op on one rank."""
        from memplan.trace.core.distributed import parallelize

        parallelize(model, self.setup, self.mesh, blocks=None if blocks is None else list(blocks))


def takes_context(function: Callable[..., Any]) -> bool:
    """Whether the job function accepts the :class:`ScriptContext` (one positional parameter)."""
    try:
        params = list(inspect.signature(function).parameters.values())
    except (TypeError, ValueError):
        return False
    return bool(params) and params[0].kind in (params[0].POSITIONAL_ONLY, params[0].POSITIONAL_OR_KEYWORD)


def check_script_flags(function: Callable[..., Any], setup: TraceSetup) -> None:
    """Refuse job flags that a context-less job function cannot honour (before anything runs)."""
    if takes_context(function):
        return
    given = sorted(setup.given - {"framework"})
    if given:
        flag = "--" + given[0].replace("_", "-")
        name = getattr(function, "__name__", "the job function")
        raise ConfigError(flag, f"cannot apply: {name}() takes no argument, so the script builds its own job; "
                          f"accept a ctx argument and read ctx.job (see docs/trace.md, 'Your own model') or "
                          f"leave out {', '.join('--' + g.replace('_', '-') for g in given)}")


def job_from_callable(function: Callable[..., Any], options: TraceSetup, mesh: Any = None) -> tuple[str, StepJob]:
    """Call ``function`` (inside the fake mode), with a :class:`ScriptContext` if it takes one."""
    source = getattr(function, "__memplan_source__", getattr(function, "__qualname__", "the job function"))
    with_context = takes_context(function)
    try:
        returned = function(ScriptContext(options.job, mesh, options)) if with_context else function()
    except Exception as exc:  # noqa: BLE001
        raise ScriptError(f"{source}: {getattr(function, '__name__', 'the function')}() raised "
                          f"{type(exc).__name__}: {exc}") from None
    model, batch, optimizer, loss_fn = _unpack(returned, source)
    name = f"{Path(str(source)).name}:{getattr(function, '__name__', '?')}"
    autocast = TORCH_DTYPES[options.compute_dtype] if with_context and options.mixed and options.fsdp == 1 else None
    job = StepJob(model, batch, optimizer, _guarded(loss_fn, source), autocast,
                  cuda_autocast=options.device == "cuda")
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
