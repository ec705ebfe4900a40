"""How a wrapped model sees a training loop it does not run: the optimizer's step, found by hooks.

A plain loop (``loss.backward(); opt.step()``), ``CheckpointController.step`` and an unchanged
``transformers.Trainer`` all call ``Optimizer.step``. torch runs the global optimizer step hooks
(``torch.optim.optimizer.register_optimizer_step_pre_hook`` / ``..._post_hook``) around every
``step`` of every optimizer; :func:`watch_optimizers` registers one pair that hands the controller
the optimizers holding its model's parameters — so their states are counted without
``optimizer=`` — and brackets their step (the optimizer phase of the training step).

The hooks hold the controller through a weak reference and are removed with it (or by
:func:`memplan.ckpt.remove_checkpointing`).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from memplan.ckpt.meter import CpuMeter, MemoryMeter
from memplan.ckpt.model_state import check_budget, model_state_bytes, state_tensors
from memplan.errors import ConfigError

#: Optimizer steps metered whatever the step (their peak, states created on the first, is then known).
OPTIMIZER_STEPS_METERED = 2

__all__ = ["OPTIMIZER_STEPS_METERED", "LoopHooks", "OptimizerSink", "check_optimizer_params", "holds_params_of",
           "watch_optimizers"]


class OptimizerSink(Protocol):
    """What the hooks call: the controller's optimizer-phase methods."""

    def owns_optimizer(self, opt: torch.optim.Optimizer) -> bool: ...

    def on_optimizer_step(self, opt: torch.optim.Optimizer) -> None: ...

    def after_optimizer_step(self, opt: torch.optim.Optimizer) -> None: ...


def holds_params_of(opt: torch.optim.Optimizer, params: set[int]) -> bool:
    """Whether any parameter of ``opt`` is one of ``params`` (ids)."""
    return any(id(p) in params for group in opt.param_groups for p in group["params"])


def check_optimizer_params(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    """Refuse an optimizer holding trainable tensors that are not the model's parameters.

    That happens when the optimizer was created before the model's parameters were replaced
    (``fully_shard``, ``model.to(...)`` with a new dtype on some backends, ``get_peft_model``): its
    steps would update tensors the model no longer uses.
    """
    ours = {id(p) for p in model.parameters()}
    foreign = [p for group in opt.param_groups for p in group["params"] if id(p) not in ours]
    if foreign:
        total = sum(len(group["params"]) for group in opt.param_groups)
        raise ConfigError(
            "optimizer",
            f"holds {len(foreign)} of its {total} parameters that are not the model's (it was created before "
            "the model's parameters were replaced, e.g. by fully_shard, get_peft_model or a device/dtype move)",
            type(opt).__name__,
            hint="create the optimizer from model.parameters() after wrapping and sharding the model",
        )


def watch_optimizers(sink: OptimizerSink) -> Callable[[], None]:
    """Register the global step hooks for ``sink``; return the function that removes them."""
    ref = weakref.ref(sink)

    def pre(opt: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
        target = ref()
        if target is not None and target.owns_optimizer(opt):
            target.on_optimizer_step(opt)

    def post(opt: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
        target = ref()
        if target is not None and target.owns_optimizer(opt):
            target.after_optimizer_step(opt)

    handles = [register_optimizer_step_pre_hook(pre), register_optimizer_step_post_hook(post)]

    def remove() -> None:
        for handle in handles:
            handle.remove()

    weakref.finalize(sink, remove)
    return remove


class LoopHooks:
    """The controller's side of the loop it does not run: the CPU meter's span and the optimizer phase.

    A base of :class:`~memplan.ckpt.controller.CheckpointController`, which owns the attributes
    declared here and calls :meth:`_enter_meter` from its forward pre-hook.
    """

    model: nn.Module
    meter: MemoryMeter
    budget_bytes: int
    optimizer: torch.optim.Optimizer | None
    _owned: bool
    _optimizers: dict[int, Any]
    _opt_depth: int
    _opt_peak: int
    _opt_over: int
    _count: dict[str, int]
    _step: Any

    def _finish_step(self) -> None:  # pragma: no cover - implemented by the controller
        raise NotImplementedError

    def _enter_meter(self) -> None:
        """On CPU, start counting at the step's forward; :meth:`release_meter` stops after the optimizer."""
        if isinstance(self.meter, CpuMeter) and not self.meter.active:
            self.meter.__enter__()
            self._owned = True

    def release_meter(self) -> None:
        """Stop the CPU meter a hook started (after the optimizer's step, or an eval forward).

        Call it after a loop that never steps an optimizer; :func:`remove_checkpointing` does.
        """
        if self._owned:
            self._owned = False
            self.meter.__exit__(None, None, None)

    def owns_optimizer(self, opt: torch.optim.Optimizer) -> bool:
        """Whether ``opt`` updates this model's parameters; the first time, it is checked and adopted."""
        ref = self._optimizers.get(id(opt))
        if ref is not None and ref() is opt:
            return True
        if not holds_params_of(opt, {id(p) for p in self.model.parameters()}):  # now: fully_shard replaces them
            return False
        check_optimizer_params(self.model, opt)
        check_budget(self.budget_bytes, model_state_bytes(self.model, opt))
        self._optimizers[id(opt)] = weakref.ref(opt)
        if self.optimizer is None:
            self.optimizer = opt
        return True

    def on_optimizer_step(self, opt: torch.optim.Optimizer) -> None:
        """Pre-hook of the optimizer's step: the backward is over; meter the optimizer phase.

        On CPU the meter is a dispatch mode (Python work per operator; AdamW's per-parameter update
        is about a thousand operators on the benchmark's model, 30 % more CPU time). The optimizer's
        peak does not depend on the batch, so after :data:`OPTIMIZER_STEPS_METERED` metered optimizer
        steps it is metered only when the step's forward was (a step near the budget, ``step()``).
        """
        self._opt_depth += 1
        if self._opt_depth > 1:  # an optimizer wrapper (accelerate) stepping the inner one
            return
        if self._step is not None:
            self._finish_step()
        if (isinstance(self.meter, CpuMeter) and not self.meter.active
                and self._count["opt_metered"] >= OPTIMIZER_STEPS_METERED):
            return  # an unmetered step: its optimizer phase was measured already (it does not vary by batch)
        self._enter_meter()
        self.meter.adopt(state_tensors(self.model, opt))
        self.meter.mark()

    def after_optimizer_step(self, opt: torch.optim.Optimizer) -> None:
        """Post-hook of the optimizer's step: its peak (states created on the first step included)."""
        self._opt_depth -= 1
        if self._opt_depth > 0:
            return
        self._count["opt_steps"] += 1
        if self.meter.active or not isinstance(self.meter, CpuMeter):
            peak = self.meter.mark()
            self._count["opt_metered"] += 1
            self._opt_peak = max(self._opt_peak, peak)
            self._opt_over += peak > self.budget_bytes
        self.release_meter()

