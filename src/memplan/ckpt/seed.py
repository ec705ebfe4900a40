"""Seeding the predictors from fake-tensor runs: no compute, no memory, no sheltered training steps.

A learning step measures what the predictors need on real data: every block checkpointed and
probed (the recompute phase and each block's kept bytes), or blocks kept (the kept-block phase).
Under ``torch``'s ``FakeTensorMode`` the same forward + backward runs on tensors that have shapes,
dtypes and storages but no data: the controller's CPU meter counts their storage bytes exactly as
it counts real ones, while nothing is computed or allocated. So a sample batch of any size, even
one that would not fit the budget, can be measured before training.

:func:`fake_parameters` swaps a model's parameters and buffers for fake copies (ties kept: one
fake per real tensor) and puts the real ones back afterwards; gradients of the fake run land on
the fakes, so the real ``.grad`` are untouched. :func:`seed_from_fake` runs each sample step
twice — every block checkpointed and probed, then none — and feeds the measurements to the
controller's predictors (bytes only: a fake kernel takes no time, so block times are learnt from
the first real steps).

Known limitations: the CPU meter only (on CUDA the allocator's statistics see no fake tensor,
and the storage bytes a fake run counts omit the allocator's rounding and workspaces); a step
whose Python code reads tensor values (``.item()``, data-dependent shapes) cannot run on fake
tensors and is refused with the error torch raises.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from memplan.ckpt.meter import CpuMeter
from memplan.ckpt.safety import rng_state, set_rng_state
from memplan.errors import UnsupportedError

if TYPE_CHECKING:
    from torch._subclasses.fake_tensor import FakeTensorMode

    from memplan.ckpt.controller import CheckpointController

__all__ = ["fake_parameters", "seed_from_fake"]


@contextmanager
def fake_parameters(model: nn.Module, mode: FakeTensorMode) -> Iterator[None]:
    """Inside the block, every parameter and buffer of ``model`` is a fake copy made by ``mode``.

    A tensor shared by several modules (tied embeddings) becomes one shared fake. The real
    tensors are put back on exit, whatever happens inside.
    """
    fakes: dict[int, torch.Tensor] = {}
    saved: list[tuple[dict[str, Any], str, torch.Tensor]] = []
    try:
        for module in model.modules():
            for table in (module._parameters, module._buffers):
                for name, real in list(table.items()):
                    if real is None:
                        continue
                    fake = fakes.get(id(real))
                    if fake is None:
                        fake = fakes[id(real)] = mode.from_tensor(real)
                    saved.append((table, name, real))
                    table[name] = fake
        yield
    finally:
        for table, name, real in reversed(saved):
            table[name] = real


def seed_from_fake(controller: CheckpointController, steps: Iterable[Callable[[], object]]) -> int:
    """Run each sample step (forward + backward) on fake tensors, twice, to seed ``controller``.

    Returns the number of fake passes run. Tensors a step creates are fake; real tensors it
    captures are read as constants. The first pass checkpoints and probes every block, the second
    checkpoints none (a size that would not fit the budget is fine: nothing is allocated). RNG
    state, gradients and the controller's training counters are as before.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    if not isinstance(controller.meter, CpuMeter):
        raise UnsupportedError(
            f"seed_from_fake: needs the CPU meter; on {controller.device.type} the allocator's statistics see "
            "no fake tensor — warm up on real sample batches (warm_up) instead")
    if controller.meter.active:
        raise UnsupportedError("seed_from_fake: call it between training steps, not inside one")
    passes = 0
    rng = rng_state(controller.device)
    try:
        for fn in steps:
            for force in ("shelter", "none"):
                mode = FakeTensorMode(allow_non_fake_inputs=True)
                with fake_parameters(controller.model, mode), mode:
                    controller.run_seed_pass(fn, force=force)
                passes += 1
    finally:
        set_rng_state(rng, controller.device)
    return passes
