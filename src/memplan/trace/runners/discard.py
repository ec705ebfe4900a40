"""Megatron's output-discarding checkpoint (``tensor_parallel.CheckpointWithoutOutput``) on eager modules.

Megatron's ``layernorm`` and ``moe_act`` recompute (megatron/core/tensor_parallel/random.py,
transformer_layer.py, moe/experts.py) run a function under ``torch.no_grad`` and keep only its
inputs; once the next module has saved the function's output for its own backward, the output's
storage is released (``untyped_storage().resize_(0)``) and a gradient hook on that module's output
makes it again at the start of the module's backward, pointing the saved references at the new
storage. What stays is the function's inputs; what goes is everything the function saves inside
and its output, wherever the following modules saved it.

:class:`DiscardScope` does the same with PyTorch's own mechanisms: the function runs inside an
``autograd.Function`` under ``no_grad`` that saves its inputs; while the scope is active (one
decoder layer's forward) a ``saved_tensors_hooks`` pair replaces every saved tensor whose storage
is such an output by a placeholder, so the output is freed as soon as the forward drops it; the
placeholder's unpack (or a gradient hook, :meth:`Discarded.recompute_at`) runs the function again
with gradients, and the recomputed output, viewed as the saved tensor was, goes to the backward.
The function's own backward runs on the recomputed graph (``torch.autograd.backward``, as Megatron
does), so gradients are exact; tests compare them with the plain module's.

Known limitation: an output used by code outside the scope is saved there as is (it is not
discarded), as in Megatron, whose caller must make sure the output is only saved by the next module.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["DiscardScope", "Discarded", "autocast_restorer"]


class Discarded:
    """One output-discarding checkpoint of ``function`` (Megatron's ``CheckpointWithoutOutput``)."""

    def __init__(self, function: Callable[..., Any], restore: Callable[[], Any]) -> None:
        self.function = function
        self._restore = restore
        self._ctx: Any = None
        self._storages: list[weakref.ref[Any]] = []

    def run(self, *inputs: torch.Tensor) -> Any:
        """``function(*inputs)`` under ``no_grad``, its inputs saved, its outputs marked discardable."""
        outputs = _NoSave.apply(self, *inputs)
        self._storages = [weakref.ref(t.untyped_storage()) for t in _as_tuple(outputs)]
        return outputs

    def owner_index(self, tensor: torch.Tensor) -> int | None:
        """Which output ``tensor`` shares its storage with (None: none of them)."""
        storage = tensor.untyped_storage()
        for index, ref in enumerate(self._storages):
            if ref() is storage:
                return index
        return None

    def recompute(self) -> tuple[torch.Tensor, ...]:
        """The outputs made again (once per backward) from the saved inputs, with their graph."""
        ctx = self._ctx
        if ctx.recomputed is None:
            inputs = tuple(t.detach().requires_grad_(t.requires_grad) for t in ctx.saved_tensors)
            with torch.enable_grad(), self._restore():
                ctx.recomputed = _as_tuple(self.function(*inputs))
            ctx.inputs = inputs
        return ctx.recomputed  # type: ignore[no-any-return]

    def recompute_at(self, output: Any) -> None:
        """Recompute when the gradient of ``output``'s first tensor needing one arrives (Megatron registers
        the recompute on the next module's output)."""
        for tensor in _as_tuple(output):
            if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                tensor.register_hook(lambda _grad: self.recompute() and None)
                return


class _NoSave(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, holder: Discarded, *inputs: torch.Tensor) -> Any:
        with torch.no_grad():
            outputs = holder.function(*inputs)
        ctx.save_for_backward(*inputs)
        ctx.recomputed = ctx.inputs = None
        holder._ctx = ctx  # the holder reaches the node; the node does not reach the holder
        ctx.function, ctx.restore = holder.function, holder._restore
        return outputs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> Any:
        if ctx.recomputed is None:  # nothing unpacked a placeholder: make the outputs here
            inputs = tuple(t.detach().requires_grad_(t.requires_grad) for t in ctx.saved_tensors)
            with torch.enable_grad(), ctx.restore():
                ctx.recomputed, ctx.inputs = _as_tuple(ctx.function(*inputs)), inputs
        pairs = [(out, grad) for out, grad in zip(ctx.recomputed, grads, strict=True)
                 if grad is not None and out.requires_grad]
        if pairs:
            torch.autograd.backward([out for out, _ in pairs], [grad for _, grad in pairs])
        inputs = ctx.inputs
        ctx.recomputed = ctx.inputs = None
        return (None, *(t.grad if t.requires_grad else None for t in inputs))


@dataclass(frozen=True, slots=True)
class _Placeholder:
    """A saved tensor that was a discarded output (or a view of one): where to find it again."""

    holder: Discarded
    index: int
    size: torch.Size
    stride: tuple[int, ...]
    offset: int


class DiscardScope:
    """The checkpoints of one module's forward (a decoder layer) and the saved-tensor hooks that discard
    their outputs wherever the forward saves them."""

    def __init__(self, capture: Callable[[], Callable[[], Any]]) -> None:
        #: Called in the forward: returns the context factory a recompute runs in (autocast state).
        self._capture = capture
        self._holders: list[Discarded] = []

    def checkpoint(self, function: Callable[..., Any], *inputs: torch.Tensor) -> tuple[Any, Discarded | None]:
        """Run ``function`` output-discarding when gradients are on (else plainly): (outputs, holder)."""
        if not torch.is_grad_enabled() or not any(t.requires_grad for t in inputs):
            return function(*inputs), None
        holder = Discarded(function, self._capture())
        self._holders.append(holder)
        return holder.run(*inputs), holder

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Replace saved discarded outputs by placeholders while inside; the holders end with it."""
        with torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack):
            try:
                yield
            finally:
                self._holders = []

    def _pack(self, tensor: torch.Tensor) -> Any:
        for holder in self._holders:
            index = holder.owner_index(tensor)
            if index is not None:
                return _Placeholder(holder, index, tensor.size(), tensor.stride(), tensor.storage_offset())
        return tensor


def _unpack(packed: Any) -> torch.Tensor:
    if not isinstance(packed, _Placeholder):
        return packed  # type: ignore[no-any-return]
    out = packed.holder.recompute()[packed.index]
    if out.size() == packed.size and out.stride() == packed.stride and out.storage_offset() == packed.offset:
        return out.detach()
    return out.detach().as_strided(packed.size, packed.stride, packed.offset)


def _as_tuple(value: Any) -> tuple[Any, ...]:
    return value if isinstance(value, tuple) else (value,)


def autocast_restorer(cuda_autocast: bool) -> Callable[[], Any]:
    """A factory of the context a recompute runs in: the forward's CPU autocast state (captured when the
    factory is called in the forward) and, on a ``--device cuda`` trace, CUDA's fp32 policies."""

    def capture() -> Callable[[], Any]:
        enabled, dtype = torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")

        def restore() -> Any:
            stack = contextlib.ExitStack()
            if enabled:
                stack.enter_context(torch.autocast("cpu", dtype=dtype))
                if cuda_autocast:
                    from memplan.trace.cuda.autocast import CudaAutocastFp32

                    stack.enter_context(CudaAutocastFp32())
            return stack

        return restore

    return capture
