"""torchtitan's per-op selective activation checkpointing, run for real on a traced model.

torchtitan's ``SelectiveAC`` (``torchtitan/distributed/activation_checkpoint.py``) wraps every
transformer block in non-reentrant ``torch.utils.checkpoint`` whose ``context_fn`` is
``create_selective_checkpoint_contexts(policy)``: the outputs of the ops its policy marks
``MUST_SAVE`` are cached for the backward, everything else in the block is recomputed. The policy
here follows torchtitan's:

* its save list: the partitioner's compute-intensive ops (``get_default_op_list()``: ``mm``,
  ``addmm``, ``bmm``, the CUDA SDPA flash / efficient kernels, ...), the other SDPA variants,
  ``max`` (FP8 amax), ``linear``, ``topk``, flex attention and the reduce-scatter / all-to-all
  collectives;
* every ``mm`` (or ``linear``) is counted per block call, separately in the forward and in the
  recompute, and the even-numbered ones are recomputed instead of kept.

The attention op saved is whichever SDPA kernel the trace runs
(:data:`memplan.trace.cuda.sdpa.SDPA_KERNEL_OPS`): on ``--device cuda`` the kernel CUDA picks
(cuDNN, flash, efficient; :mod:`memplan.trace.cuda.sdpa`), on ``--device cpu`` the CPU flash
kernel ``aten._scaled_dot_product_flash_attention_for_cpu``. Not followed: torchtitan's
``force_recompute_mm_shapes_by_fqns`` (default ``moe.router.gate``, a torchtitan module name no
Hugging Face model has) and its device-to-host copies rule (no CUDA tensors here).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from memplan.errors import UnsupportedError
from memplan.trace.cuda.sdpa import SDPA_KERNEL_OPS

__all__ = ["apply_torchtitan_sac", "decoder_layers", "torchtitan_policy", "torchtitan_save_ops"]


def torchtitan_save_ops() -> frozenset[Any]:
    """The ops whose outputs torchtitan's policy keeps (``mm``: every other one)."""
    from torch._functorch.partitioners import get_default_op_list

    aten = torch.ops.aten
    ops: set[Any] = {op.default for op in get_default_op_list().compute_intensive_ops}
    ops.update({aten.max.default, aten.linear.default, aten.topk.default, torch._higher_order_ops.flex_attention,
                torch.ops._c10d_functional.reduce_scatter_tensor.default,
                torch.ops._c10d_functional.all_to_all_single.default})
    ops.update(SDPA_KERNEL_OPS)  # the SDPA kernel the trace runs (CUDA's or, on --device cpu, the CPU one)
    return frozenset(ops)


def torchtitan_policy(save_ops: frozenset[Any] | None = None) -> Callable[..., Any]:
    """A fresh policy for one block call: its own forward and recompute mm counters."""
    from torch.utils.checkpoint import CheckpointPolicy

    saved = torchtitan_save_ops() if save_ops is None else save_ops
    mm_ops = (torch.ops.aten.mm.default, torch.ops.aten.linear.default)
    counts = {False: 0, True: 0}

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
        if func in mm_ops:
            counts[ctx.is_recompute] += 1
            if counts[ctx.is_recompute] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if func in saved else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder layers: the children of the model's first ``layers`` module list (``model.layers``)."""
    for path, module in model.named_modules():
        if path.rsplit(".", 1)[-1] == "layers" and isinstance(module, torch.nn.ModuleList) and len(module):
            return list(module)
    raise UnsupportedError("--recompute selective (torchtitan) found no decoder layers in a module list named layers")


def apply_torchtitan_sac(model: torch.nn.Module, recompute_context: Callable[[], Any] | None = None) -> None:
    """Checkpoint every decoder layer with torchtitan's per-op policy (non-reentrant).

    ``recompute_context``: a context the recompute also runs under (the CUDA autocast policies of a
    ``--device cuda`` trace, which the forward already has).
    """
    save_ops = torchtitan_save_ops()
    for layer in decoder_layers(model):
        _checkpoint_layer(layer, save_ops, recompute_context)


def _checkpoint_layer(layer: torch.nn.Module, save_ops: frozenset[Any],
                      recompute_context: Callable[[], Any] | None) -> None:
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    forward = layer.forward

    def contexts() -> tuple[Any, Any]:
        caching, cached = create_selective_checkpoint_contexts(torchtitan_policy(save_ops))
        if recompute_context is None:
            return caching, cached
        return caching, _both(cached, recompute_context())

    def checkpointed(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(forward, *args, use_reentrant=False, context_fn=contexts, **kwargs)

    layer.forward = checkpointed  # type: ignore[method-assign]


@contextlib.contextmanager
def _both(first: Any, second: Any) -> Iterator[None]:
    with first, second:
        yield
