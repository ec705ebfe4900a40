"""memplan's static plan as the allocator of a running job (see docs/runtime.md).

Example::

    from memplan.alloc import runtime
    with runtime.planned(device="cpu") as arena:   # records the first steps, then replays
        for batch in loader:
            train_step(batch)
            arena.step()
    print(arena.stats())   # planned_bytes, arena_bytes, fallback_allocs, fallback_peak_bytes, ...

Public surface: :func:`planned` (the context manager), :class:`Arena`, :class:`RuntimeSettings`,
:func:`replay_trace` (drive the core with a recorded trace, no torch), :class:`RuntimeUnavailable`
(no built C core and no compiler). Importing this package imports neither torch nor numpy.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

from memplan.alloc.runtime._native import Core, RuntimeUnavailable
from memplan.alloc.runtime.session import Arena, RuntimeSettings, StepRecord
from memplan.errors import ConfigError

__all__ = ["Arena", "RuntimeSettings", "RuntimeUnavailable", "StepRecord", "planned", "replay_trace"]


@contextlib.contextmanager
def planned(device: str = "cpu", *, plan: str | os.PathLike[str] | None = None, save_plan: str | os.PathLike[str] | None = None,
            model: str = "", key: object = "", **settings: Any) -> Iterator[Arena]:
    """Run the block on the planned arena of ``device`` ("cpu" or "cuda").

    ``plan``: a plan file saved by an earlier run (``save_plan``) for the same ``model`` string (a
    name you choose, e.g. "gpt2-seq128"): its signatures replay from the first step. ``key``: the
    signature of the first step. Other keywords are :class:`RuntimeSettings` fields.
    """
    if device not in ("cpu", "cuda"):
        raise ConfigError("device", "must be 'cpu' or 'cuda'", device)
    config = RuntimeSettings(device=device, **settings)  # type: ignore[arg-type]
    from memplan.alloc.runtime.plans import load_plans, save_plans

    loaded = load_plans(plan, alignment=config.alignment, model=model) if plan is not None else None
    core = Core(device, alignment=config.alignment, fallback_limit=config.fallback_limit_bytes,
                arena_limit=config.arena_limit_bytes, library=os.environ.get("MEMPLAN_CUDART"))
    arena = Arena(core, config, plans=loaded)
    scope = _backend_scope(device, core)
    try:
        with scope:
            arena.signature(key)
            try:
                yield arena
            finally:
                arena.close()
    except RuntimeUnavailable:
        core.close()
        raise
    if save_plan is not None:
        save_plans(save_plan, arena.plans, alignment=config.alignment, model=model)


def _backend_scope(device: str, core: Core) -> contextlib.AbstractContextManager[None]:
    if device == "cpu":
        from memplan.alloc.runtime.cpu import installed_on_cpu

        return installed_on_cpu(core)
    from memplan.alloc.runtime.cuda import in_cuda_pool

    return in_cuda_pool(core)


def replay_trace(*args: Any, **kwargs: Any) -> Any:
    """See :func:`memplan.alloc.runtime.replay.replay_trace`."""
    from memplan.alloc.runtime.replay import replay_trace as run

    return run(*args, **kwargs)

