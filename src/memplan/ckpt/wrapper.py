"""``auto_checkpoint``: give a model input-aware activation checkpointing under a memory budget."""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from memplan.ckpt.blocks import find_blocks, validate_blocks
from memplan.ckpt.controller import CheckpointController
from memplan.ckpt.hostmem import retain_freed_memory
from memplan.ckpt.loop_hooks import check_optimizer_params, watch_optimizers
from memplan.ckpt.meter import make_meter
from memplan.ckpt.model_state import check_budget, model_state_bytes
from memplan.ckpt.sizes import SizeFn, default_size
from memplan.errors import ConfigError, UnsupportedError
from memplan.units import parse_bytes

__all__ = ["CKPT_BUDGET_MARGIN", "auto_checkpoint", "controller_of", "remove_checkpointing"]

#: Share of the budget kept free for what the predictors cannot see (allocator rounding, noise).
CKPT_BUDGET_MARGIN = 0.02
_ATTR = "memplan_ckpt"


def auto_checkpoint(
    model: nn.Module,
    budget: int | str,
    *,
    blocks: Iterable[nn.Module] | None = None,
    size_fn: SizeFn | None = None,
    device: torch.device | str | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    margin: float = CKPT_BUDGET_MARGIN,
    step_arms: bool = True,
    retain_host_memory: bool = True,
) -> nn.Module:
    """Make each training forward of ``model`` checkpoint only the blocks this batch needs to fit ``budget``.

    Example (any loop: plain, ``model.memplan_ckpt.step(fn)`` for the safety net, ``transformers.Trainer``)::

        model = auto_checkpoint(GPT2LMHeadModel(config), "6GiB")
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4)   # found through its step hooks
        for batch in loader:
            model(**batch).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

    Args:
        model: any ``nn.Module``; returned with its blocks' ``forward`` patched in place (state-dict
            keys unchanged) and its controller at ``model.memplan_ckpt``.
        budget: bytes, or a size string such as ``"6GiB"`` / ``"24GB"`` (GiB = 2^30, GB = 10^9).
        blocks: the modules to checkpoint one by one, in forward order (default: the model's
            repeated layers, e.g. ``transformer.h`` of GPT-2 or ``model.layers`` of Llama).
        size_fn: ``size_fn(batch) -> int``, the input size the predictors use; ``batch`` is the
            forward's first positional argument, or its keyword arguments as a dict (default:
            batch × sequence length of ``input_ids`` / the first tensor).
        device: where the model trains (default: its first parameter's device); CUDA uses the
            allocator's statistics, anything else the CPU meter.
        optimizer: counted in the model states. Default: the optimizer is found when it first steps
            (global optimizer step hooks: the one holding the model's parameters); until then the
            budget check assumes AdamW's two moments per weight.
        margin: share of the budget kept free for what the predictors cannot see.
        step_arms: price per-op selective checkpointing (SAC) per block from whole steps: every
            planned step is timed whole, and where the budget makes a plan shed memory at a size
            where no step with SAC blocks was measured, one step runs every block under SAC to
            measure it (:mod:`memplan.ckpt.explore`). The planner then picks keep, SAC or whole
            recompute per block. ``False``: no whole-step timing and no such step; SAC is priced
            by its per-block clock or the roofline.
        retain_host_memory: on a CPU device, ask glibc's ``malloc`` to keep freed memory in the
            process (:mod:`memplan.ckpt.hostmem`), so that each step reuses the pages of the last
            instead of faulting in fresh ones; process-wide, reported in ``stats().host_memory``.

    Assumptions: blocks run in the given order, once per forward; each training forward is followed
    by its backward (gradient accumulation: one planned micro-step per forward, the gradients
    already accumulated counted as live).

    Known limitations: eval / ``no_grad`` forwards pass straight through; the safety net (a step
    redone after an out-of-memory) exists only in :meth:`~CheckpointController.step`; on CPU the
    meter (a dispatch mode) stays entered from a training forward to the end of the optimizer's
    step, so another dispatch mode entered inside that span must also be left inside it;
    ``torch.compile`` is refused.
    """
    budget_bytes = parse_bytes(budget, field="budget")
    if budget_bytes <= 0:
        raise ConfigError("budget", "must be a positive size such as 6GiB", budget)
    if not 0.0 <= margin < 0.5:
        raise ConfigError("margin", "must be a share of the budget in [0, 0.5)", margin)
    if getattr(model, _ATTR, None) is not None:
        raise ConfigError("model", "already has auto_checkpoint applied", type(model).__name__,
                          hint="call remove_checkpointing(model) first to change the budget")
    if _hf_checkpointing(model):
        raise ConfigError("model", "has Hugging Face gradient checkpointing enabled", type(model).__name__,
                          hint="call model.gradient_checkpointing_disable() first; memplan decides per block")
    if type(model).__name__ == "OptimizedModule" or hasattr(model, "_orig_mod"):
        raise UnsupportedError(
            "auto_checkpoint: torch.compile is not supported (the plan changes per batch); wrap the "
            "uncompiled model and train it uncompiled")
    found = validate_blocks(model, blocks) if blocks is not None else find_blocks(model)[0]
    if optimizer is not None:
        check_optimizer_params(model, optimizer)
    if not _sharded_later(model):
        check_budget(budget_bytes, model_state_bytes(model, optimizer))
    dev = torch.device(device) if device is not None else _model_device(model)
    controller = CheckpointController(
        model, found, budget_bytes=budget_bytes, size_fn=size_fn or default_size,
        meter=make_meter(dev, limit_bytes=budget_bytes if dev.type == "cuda" else None), device=dev,
        optimizer=optimizer, margin=margin, step_arms=step_arms,
    )
    if dev.type == "cpu":
        controller.host_memory = retain_freed_memory() if retain_host_memory else "unchanged: retain_host_memory=False"
    _install(model, controller)
    return model


def _hf_checkpointing(model: nn.Module) -> bool:
    """Whether Hugging Face's own gradient checkpointing is on (its attribute was renamed in v5);
    a peft ``PeftModel`` is asked about the transformers model it wraps (``get_base_model()``)."""
    base = getattr(model, "get_base_model", None)
    if callable(base) and base() is not model:
        return _hf_checkpointing(base())
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        if hasattr(type(model), name) or name in vars(model):
            return bool(getattr(model, name))
    return False


def _sharded_later(model: nn.Module) -> bool:
    """Whether the model states cannot be checked yet: under torch.distributed with several ranks,
    parameters not yet sharded (``fully_shard`` comes after wrapping) are the whole model, not this
    rank's part. The check then runs when the optimizer first steps, on the parameters in place then."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return False
    from torch.distributed.tensor import DTensor

    return not any(isinstance(p, DTensor) for p in model.parameters())


def _model_device(model: nn.Module) -> torch.device:
    first = next(iter(model.parameters()), None)
    return first.device if first is not None else torch.device("cpu")


def _install(model: nn.Module, controller: CheckpointController) -> None:
    handles: list[Any] = [model.register_forward_pre_hook(controller.on_model_forward, with_kwargs=True)]
    for j, block in enumerate(controller.blocks):
        if "forward" in vars(block):
            raise ConfigError("blocks", f"block {j} ({type(block).__name__}) already has a patched forward")
        block.forward = functools.partial(controller.block_forward, j, block.forward)  # type: ignore[method-assign]
    handles.append(_Removal(watch_optimizers(controller)))
    controller._handles = handles
    setattr(model, _ATTR, controller)


class _Removal:
    """A removal function behind the ``remove()`` of a hook handle."""

    def __init__(self, remove: Any) -> None:
        self.remove = remove


def controller_of(model: nn.Module) -> CheckpointController:
    """The controller :func:`auto_checkpoint` attached to ``model`` (unwraps DDP's ``.module``)."""
    inner = getattr(model, "module", model)
    controller = getattr(inner, _ATTR, None) or getattr(model, _ATTR, None)
    if controller is None:
        raise ConfigError("model", "has no auto_checkpoint applied", type(model).__name__)
    return controller


def remove_checkpointing(model: nn.Module) -> nn.Module:
    """Undo :func:`auto_checkpoint`: restore the blocks' own ``forward`` and drop the hook."""
    controller = controller_of(model)
    controller.release_meter()
    for handle in controller._handles:
        handle.remove()
    for block in controller.blocks:
        vars(block).pop("forward", None)
    delattr(getattr(model, "module", model) if hasattr(getattr(model, "module", model), _ATTR) else model, _ATTR)
    return model
