"""The benchmark's static baselines: one checkpointing policy for every batch, written without memplan.

* ``half`` — every second block (0, 2, 4, …) under non-reentrant ``torch.utils.checkpoint``;
* ``sac`` — every block under per-op selective checkpointing (torchtitan's op-level AC idea): the
  outputs of the compute-bound ops (matrix multiplies, attention kernels) are saved, every other op
  is recomputed in the backward (PyTorch's ``create_selective_checkpoint_contexts``).

Both patch the blocks' ``forward`` in place, as Hugging Face's own checkpointing does; ``full`` (every
block) uses Hugging Face's ``activation_checkpointing_enable``. Nothing here shares code with
``memplan.ckpt``'s planner or runtime: the baselines are what a user would write by hand.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

__all__ = ["STATIC", "SAVED_OPS", "apply_static"]

STATIC = ("half", "sac")
#: Operators whose outputs the ``sac`` baseline saves (matrix multiplies and attention kernels).
SAVED_OPS = frozenset({
    torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
    torch.ops.aten.baddbmm.default, torch.ops.aten.linear.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
})


def _policy(_ctx: Any, func: Any, *_args: Any, **_kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if func in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _sac_context() -> Any:
    return create_selective_checkpoint_contexts(_policy)


def _checkpointed(forward: Callable[..., Any], selective: bool, *args: Any, **kwargs: Any) -> Any:
    if not (torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad
                                            for a in (*args, *kwargs.values()))):
        return forward(*args, **kwargs)
    extra = {"context_fn": _sac_context} if selective else {}
    return checkpoint(forward, *args, use_reentrant=False, **extra, **kwargs)


def apply_static(blocks: Sequence[torch.nn.Module], variant: str) -> None:
    """Patch ``blocks`` for the static ``variant`` (``half`` or ``sac``)."""
    if variant not in STATIC:
        raise ValueError(f"unknown static variant {variant!r}")
    for j, block in enumerate(blocks):
        if variant == "half" and j % 2:
            continue
        block.forward = functools.partial(_checkpointed, block.forward, variant == "sac")  # type: ignore[method-assign]
