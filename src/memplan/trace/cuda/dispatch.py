"""Operators dispatched as CUDA dispatches them, on the fake CPU tensors of a ``--device cuda`` trace.

A trace runs PyTorch's CPU build on fake tensors, so composite operators pick CPU kernels whose
saved tensors are not CUDA's. Inside :func:`cuda_dispatch`, the composites of a transformer
training step whose CUDA kernels keep different memory run, on fake tensors, as the operators an
H100/H200 (sm90) runs:

* ``F.scaled_dot_product_attention``: the backend CUDA picks and its kernel operator
  (:mod:`memplan.trace.cuda.sdpa`);
* ``F.rms_norm``: ``aten._fused_rms_norm`` (``rms_norm_symint`` in
  ``aten/src/ATen/native/layer_norm.cpp`` on CUDA), which saves the input and an fp32 ``rstd``
  where the CPU composite keeps fp32 copies;
* ``F.dropout`` (training, not in place, 0 < p < 1): ``aten.native_dropout``, as ``at::dropout``
  does on CUDA (``is_fused_kernel_acceptable`` in ``aten/src/ATen/native/Dropout.cpp``), which
  saves a 1-byte boolean mask where the CPU composite saves a scaled noise tensor of the input's
  dtype.

Values are not computed: it acts only on fake tensors and leaves real ones (and tensor subclasses
such as DTensor) to PyTorch. Other differences are listed in docs/trace.md ("Fidelity to CUDA").
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from memplan.trace.cuda.sdpa import cuda_sdpa

__all__ = ["cuda_dispatch", "cuda_dropout", "cuda_rms_norm"]

_HALF = (torch.float16, torch.bfloat16)


def cuda_rms_norm(input: torch.Tensor, normalized_shape: Sequence[int], weight: torch.Tensor | None = None,
                  eps: float | None = None) -> torch.Tensor:
    """``rms_norm`` as CUDA runs it: the fused kernel unless ``rms_norm_symint`` falls back to the composite
    (channels-last or complex input, a weight of another dtype)."""
    if torch.is_autocast_enabled("cpu"):  # rms_norm is on CUDA autocast's fp32 list (autocast_mode.h)
        input = input.float() if input.dtype in _HALF else input
        weight = weight.float() if weight is not None and weight.dtype in _HALF else weight
    fallback = input.is_complex() or _channels_last(input) or (weight is not None and weight.dtype != input.dtype)
    if fallback:
        return torch.rms_norm(input, list(normalized_shape), weight, eps)
    return _FusedRmsNorm.apply(input, weight, tuple(normalized_shape))


def _channels_last(tensor: torch.Tensor) -> bool:
    """``suggest_memory_format()`` is channels-last (2-D or 3-D) and the tensor is not plainly contiguous."""
    formats = {4: torch.channels_last, 5: torch.channels_last_3d}
    layout = formats.get(tensor.dim())
    return layout is not None and not tensor.is_contiguous() and tensor.is_contiguous(memory_format=layout)


def _accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


class _FusedRmsNorm(torch.autograd.Function):
    """``aten._fused_rms_norm`` with its CUDA autograd formula: saves ``input``, ``weight`` and ``rstd``
    (``derivatives.yaml``); the backward is ``aten._fused_rms_norm_backward`` (meta kernel shapes).
    The CPU build registers the operator as a composite only, so its forward is the kernel's
    allocation: a contiguous output like the input and ``rstd`` of the accumulate dtype."""

    @staticmethod
    def forward(ctx: Any, input: torch.Tensor, weight: torch.Tensor | None,
                normalized_shape: tuple[int, ...]) -> torch.Tensor:
        stat_shape = (*input.shape[:input.dim() - len(normalized_shape)], *([1] * len(normalized_shape)))
        out = torch.empty(input.shape, dtype=input.dtype, device=input.device)
        rstd = torch.empty(stat_shape, dtype=_accumulate_dtype(input.dtype), device=input.device)
        ctx.save_for_backward(input, weight, rstd)
        ctx.normalized_shape = normalized_shape
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        input, weight, rstd = ctx.saved_tensors
        mask = [ctx.needs_input_grad[0], weight is not None and ctx.needs_input_grad[1]]
        grad_input, grad_weight = torch.ops.aten._fused_rms_norm_backward(
            grad_out, input, list(ctx.normalized_shape), rstd, weight, mask)
        return (grad_input if mask[0] else None), (grad_weight if mask[1] else None), None


def _shardable_rms_norm(input: Any, weight: Any, normalized_dims: int) -> bool:
    """A DTensor input of fake shards, sharded only outside the normalized dims, with no weight or a
    replicated DTensor weight on the same mesh: what DTensor's ``_fused_rms_norm`` strategy takes
    (``rms_norm_single_dim_strategy`` in torch/distributed/tensor/_ops/_math_ops.py); torchtitan's
    ``SequenceParallel`` norms (``Shard(1)`` activations)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not isinstance(input, DTensor) or not _fake(input.to_local()):
        return False
    first_normalized = input.dim() - normalized_dims
    if not all(isinstance(p, Replicate) or (isinstance(p, Shard) and p.dim % input.dim() < first_normalized)
               for p in input.placements):
        return False
    if weight is None:
        return True
    return (isinstance(weight, DTensor) and weight.device_mesh == input.device_mesh and _fake(weight.to_local())
            and all(isinstance(p, Replicate) for p in weight.placements))


def _dtensor_rms_norm(input: Any, normalized_shape: Sequence[int], weight: Any = None, eps: float | None = None) -> Any:
    """``rms_norm`` of a DTensor as CUDA runs it: ``rms_norm_symint`` calls ``aten._fused_rms_norm``
    (the input's device is CUDA) and DTensor runs it on each rank's shard; the CPU build would
    decompose it into the composite, which keeps fp32 copies. The weight's gradient of a shard is a
    partial sum over the sharded mesh dims, as DTensor's strategy makes it."""
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    local_weight = None
    if weight is not None:
        partial = [Partial() if isinstance(p, Shard) else Replicate() for p in input.placements]
        local_weight = weight.to_local(grad_placements=partial)
    out = cuda_rms_norm(input.to_local(), normalized_shape, local_weight, eps)
    return DTensor.from_local(out, input.device_mesh, input.placements, run_check=False, shape=input.shape,
                              stride=input.stride())


def cuda_dropout(input: torch.Tensor, p: float) -> torch.Tensor:
    """Training-mode dropout as CUDA runs it: ``native_dropout``, whose backward keeps a boolean mask."""
    return torch.native_dropout(input, p, True)[0]


def _fake(*values: Any) -> bool:
    """Every tensor argument is a plain fake tensor (no values, no subclass)."""
    from torch._subclasses.fake_tensor import FakeTensor

    tensors = [v for v in values if isinstance(v, torch.Tensor)]
    return bool(tensors) and all(type(_unwrapped(t)) is FakeTensor for t in tensors)


def _unwrapped(tensor: torch.Tensor) -> torch.Tensor:
    """The fake tensor under AOT autograd's functionalization (``--compile`` traces each layer's graph
    on fake tensors wrapped as ``FunctionalTensor``); any other tensor as it is."""
    from torch._subclasses.functional_tensor import FunctionalTensor

    if type(tensor) is FunctionalTensor:
        return torch._from_functional_tensor(tensor.elem)  # type: ignore[attr-defined]
    return tensor


def _sdpa_arguments(query: Any, key: Any, value: Any, attn_mask: Any = None, dropout_p: float = 0.0,
                    is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False) -> dict[str, Any]:
    return {"query": query, "key": key, "value": value, "attn_mask": attn_mask, "dropout_p": dropout_p,
            "is_causal": is_causal, "scale": scale, "enable_gqa": enable_gqa}


def _rms_norm_arguments(input: Any, normalized_shape: Any, weight: Any = None, eps: Any = None) -> dict[str, Any]:
    return {"input": input, "normalized_shape": normalized_shape, "weight": weight, "eps": eps}


@contextmanager
def cuda_dispatch(on_host: Callable[[torch.Tensor], None] | None = None) -> Iterator[None]:
    """While inside, ``F.scaled_dot_product_attention``, ``F.rms_norm`` and ``F.dropout`` run on fake
    tensors as CUDA (sm90) runs them; real tensors and tensor subclasses (DTensor) go to PyTorch's own functions.

    The ``torch.nn.functional`` attributes are replaced (and restored on exit) rather than
    intercepted by a ``TorchFunctionMode``: a mode is popped while it handles ``Tensor.backward``,
    so a checkpoint's recompute inside the backward would run the CPU kernels. Code that imported
    the functions by name before entering keeps PyTorch's. ``on_host``: called with the outputs
    CUDA keeps in host memory (for a recorder to leave out).
    """
    functional = torch.nn.functional
    original_sdpa, original_rms_norm = functional.scaled_dot_product_attention, functional.rms_norm
    original_dropout = functional.dropout

    def scaled_dot_product_attention(*args: Any, **kwargs: Any) -> torch.Tensor:
        call = _sdpa_arguments(*args, **kwargs)
        if _fake(call["query"], call["key"], call["value"], call["attn_mask"]):
            return cuda_sdpa(**call, on_host=on_host)
        return original_sdpa(*args, **kwargs)

    def rms_norm(*args: Any, **kwargs: Any) -> torch.Tensor:
        call = _rms_norm_arguments(*args, **kwargs)
        if _fake(call["input"], call["weight"]):
            return cuda_rms_norm(**call)
        if _shardable_rms_norm(call["input"], call["weight"], len(call["normalized_shape"])):
            return _dtensor_rms_norm(**call)
        return original_rms_norm(*args, **kwargs)

    def dropout(input: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False) -> torch.Tensor:
        if _fake(input) and training and not inplace and 0 < p < 1 and input.numel() > 0:
            return cuda_dropout(input, p)
        return original_dropout(input, p, training, inplace)

    functional.scaled_dot_product_attention = scaled_dot_product_attention
    functional.rms_norm = rms_norm
    functional.dropout = dropout
    try:
        yield
    finally:
        functional.scaled_dot_product_attention = original_sdpa
        functional.rms_norm = original_rms_norm
        functional.dropout = original_dropout
