"""``scaled_dot_product_attention`` as CUDA (sm90) runs it, on fake CPU tensors.

:func:`sdpa_backend` is CUDA's ``select_sdp_backend``
(``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp``) for an H100/H200 with torch 2.13 and
its bundled cuDNN 9.20: ``priority_order`` puts cuDNN attention first (``check_prefer_cudnn_attention``:
cuDNN newer than 9.15.0 on sm90), then flash, memory-efficient and math; the
``torch.backends.cuda.*_sdp_enabled()`` switches (``sdpa_kernel``) are honoured. :func:`cuda_sdpa`
then does what ``scaled_dot_product_attention`` in ``aten/src/ATen/native/transformers/attention.cpp``
does before the kernel (autocast's cast, boolean masks made additive, flash's head-dim padding, the
efficient kernel's bias padding) and calls the kernel operator, whose autograd formula saves what
CUDA's saves; its outputs have the shapes of PyTorch's meta kernels (``torch/_meta_registrations.py``).
No CUDA-graph capture is assumed (the efficient kernel's seed and offset then live on the host).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Literal

import torch

__all__ = ["SDPA_KERNEL_OPS", "SdpaBackend", "cuda_sdpa", "sdpa_backend"]

SdpaBackend = Literal["cudnn", "flash", "efficient", "math"]

#: The order ``priority_order`` gives on sm90 with cuDNN newer than 9.15.0 (sdp_utils.cpp).
SM90_PRIORITY: tuple[SdpaBackend, ...] = ("cudnn", "flash", "efficient", "math")
#: cuDNN 9.20 (torch 2.13's) is not newer than 9.22: head dims up to 128, or (192, 128)
#: (``check_cudnn_tensor_shapes``); flash takes up to 256.
CUDNN_MAX_HEAD_DIM = 128
FLASH_MAX_HEAD_DIM = 256
#: ``check_cudnn_tensor_shapes``: batch and heads at most this.
CUDNN_MAX_DIM = 65535
#: ``pad_last_dim<8>`` before the flash kernel; ``preprocess_mask``'s ``mem_eff_alignment``.
FLASH_HEAD_ALIGNMENT = 8
EFFICIENT_BIAS_ALIGNMENT = 8
#: ``convert_boolean_attn_mask_cudnn``: the masked-out value of the additive mask given to cuDNN.
CUDNN_MASKED = -65504.0
_HALF = (torch.float16, torch.bfloat16)

#: Every kernel operator ``scaled_dot_product_attention`` can call (CUDA's, the CPU flash kernel
#: a ``--device cpu`` trace runs, math, the overrideable one): the attention op of torchtitan's
#: selective-checkpointing save list, whichever device the trace follows.
SDPA_KERNEL_OPS = frozenset({
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten._scaled_dot_product_attention_math.default,
    torch.ops.aten._scaled_dot_product_fused_attention_overrideable.default,
})


def sdpa_backend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None = None,
                 dropout_p: float = 0.0, is_causal: bool = False, enable_gqa: bool = False) -> SdpaBackend:
    """The backend CUDA's ``select_sdp_backend`` picks on sm90 for these inputs (shapes, dtypes, strides).

    >>> q = torch.empty(1, 8, 64, 64, dtype=torch.bfloat16); kv = torch.empty(1, 2, 64, 64, dtype=torch.bfloat16)
    >>> sdpa_backend(q, kv, kv, enable_gqa=True), sdpa_backend(q.float(), kv.float(), kv.float(), enable_gqa=True)
    ('cudnn', 'efficient')
    """
    checks: dict[SdpaBackend, Callable[[], bool]] = {
        "cudnn": lambda: torch.backends.cuda.cudnn_sdp_enabled() and _cudnn_ok(query, key, value, attn_mask,
                                                                                 dropout_p, enable_gqa),
        "flash": lambda: torch.backends.cuda.flash_sdp_enabled() and _flash_ok(query, key, value, attn_mask,
                                                                               is_causal, enable_gqa),
        "efficient": lambda: torch.backends.cuda.mem_efficient_sdp_enabled() and _efficient_ok(query, key, value,
                                                                                               enable_gqa),
        "math": lambda: True,
    }
    return next(backend for backend in SM90_PRIORITY if checks[backend]())


def _dense_ok(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, enable_gqa: bool,
              ignore_singleton: bool = True) -> bool:
    """4-D inputs, non-empty sequences, unit last stride, equal batch, heads equal or GQA-divisible."""
    tensors = (query, key, value)
    if any(t.dim() != 4 for t in tensors) or any(t.size(2) == 0 for t in tensors):
        return False
    if any(t.stride(-1) != 1 and not (ignore_singleton and t.size(-1) == 1) for t in tensors):
        return False
    if not query.size(0) == key.size(0) == value.size(0):
        return False
    heads, kv_heads = query.size(1), key.size(1)
    if heads == kv_heads == value.size(1):
        return True
    return enable_gqa and kv_heads == value.size(1) and kv_heads > 0 and heads % kv_heads == 0


def _mask_shape_ok(query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor | None) -> bool:
    """``check_attn_mask_shape``: 2-D, or 4-D broadcastable over batch and heads; no gradient."""
    if mask is None:
        return True
    if mask.requires_grad or mask.size(-2) not in (query.size(2), 1) or mask.size(-1) not in (key.size(2), 1):
        return False
    if mask.dim() == 2:
        return True
    return mask.dim() == 4 and mask.size(0) in (1, query.size(0)) and mask.size(1) in (1, query.size(1))


def _cudnn_ok(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
              dropout_p: float, enable_gqa: bool) -> bool:
    if torch.are_deterministic_algorithms_enabled() and not torch.is_deterministic_algorithms_warn_only_enabled():
        return False
    if not (query.dtype in _HALF and key.dtype == value.dtype == query.dtype) or dropout_p * 16 != int(dropout_p * 16):
        return False
    if not (_dense_ok(query, key, value, enable_gqa) and _mask_shape_ok(query, key, mask)):
        return False
    d_qk, d_v = query.size(3), value.size(3)
    limit = 192 if (d_qk, d_v) == (192, 128) else CUDNN_MAX_HEAD_DIM
    return (query.size(0) <= CUDNN_MAX_DIM and query.size(1) <= CUDNN_MAX_DIM and d_qk <= limit and d_v <= limit
            and d_qk % 8 == 0 and d_v % 8 == 0 and key.size(2) != 1 and not (dropout_p and query.size(2) == 1))


def _flash_ok(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
              is_causal: bool, enable_gqa: bool) -> bool:
    if mask is not None or not (query.dtype in _HALF and key.dtype == value.dtype == query.dtype):
        return False
    if not query.size(-1) == key.size(-1) == value.size(-1) <= FLASH_MAX_HEAD_DIM:
        return False
    if is_causal and query.dim() == 4 and query.size(2) != key.size(2):
        return False
    return _dense_ok(query, key, value, enable_gqa)


def _efficient_ok(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, enable_gqa: bool) -> bool:
    if query.dtype not in (*_HALF, torch.float32) or not key.dtype == value.dtype == query.dtype:
        return False
    alignment = 8 if query.dtype in _HALF else 4  # minimum_gemm_alignment on sm80+: 128 bits of tensor core
    d_q, d_v = query.size(-1), value.size(-1)
    if d_q != key.size(-1) or d_q % alignment or d_v % alignment or d_q == 0 or d_v == 0:
        return False
    if any(t.storage_offset() % alignment for t in (query, key, value) if t.numel()):
        return False  # check_data_ptr_alignment_mem_efficient
    return _dense_ok(query, key, value, enable_gqa, ignore_singleton=False)


def cuda_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None = None,
              dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
              enable_gqa: bool = False, on_host: Callable[[torch.Tensor], None] | None = None) -> torch.Tensor:
    """``scaled_dot_product_attention`` as CUDA runs it (autocast's cast, backend, preprocessing, kernel).

    ``on_host`` is told of outputs that CUDA keeps in host memory (the efficient kernel's seed and
    offset when not capturing a graph)."""
    query, key, value, attn_mask = _autocast(query, key, value, attn_mask)
    backend = sdpa_backend(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa)
    aten = torch.ops.aten
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    if backend == "cudnn":
        mask = _additive(attn_mask, query.dtype, CUDNN_MASKED)
        return aten._scaled_dot_product_cudnn_attention(query, key, value, mask, grad, dropout_p, is_causal, False,
                                                        scale=scale)[0]
    if backend == "flash":
        head_dim = query.size(-1)
        padded = [_pad_last(t, FLASH_HEAD_ALIGNMENT) for t in (query, key, value)]
        og_scale = scale if scale is not None else 1.0 / math.sqrt(head_dim)
        out = aten._scaled_dot_product_flash_attention(*padded, dropout_p, is_causal, False, scale=og_scale)[0]
        return out[..., :head_dim] if out.size(-1) != head_dim else out
    mask = _additive(attn_mask, query.dtype, -math.inf)
    if backend == "efficient":
        if mask is not None:
            mask = _efficient_bias(mask, query, key)
        if key.size(1) != query.size(1):
            return _EfficientGqa.apply(query, key, value, mask, grad, dropout_p, is_causal, scale, on_host)
        out, _lse, seed, offset = aten._scaled_dot_product_efficient_attention(query, key, value, mask, grad,
                                                                               dropout_p, is_causal, scale=scale)
        _tell_host(on_host, seed, offset)
        return out
    with torch.autocast("cpu", enabled=False):  # CUDA runs the math composite below its autocast wrapper
        return aten._scaled_dot_product_attention_math(query, key, value, mask, dropout_p, is_causal, None,
                                                       scale=scale, enable_gqa=enable_gqa)[0]


def _autocast(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Autocast's lower-precision cast of SDPA's floating arguments (the same op list on CPU and CUDA)."""
    if not torch.is_autocast_enabled("cpu"):
        return query, key, value, mask
    dtype = torch.get_autocast_dtype("cpu")

    def cast(t: torch.Tensor | None) -> Any:
        eligible = t is not None and t.is_floating_point() and t.dtype not in (dtype, torch.float64)
        return t.to(dtype) if eligible else t  # type: ignore[union-attr]

    return cast(query), cast(key), cast(value), cast(mask)


def _additive(mask: torch.Tensor | None, dtype: torch.dtype, masked: float) -> torch.Tensor | None:
    """``convert_boolean_attn_mask`` (-inf) / ``..._cudnn`` (-65504): a boolean mask becomes a new additive one."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.where(mask.logical_not(), masked, torch.zeros((), dtype=dtype, device=mask.device))


def _pad_last(tensor: torch.Tensor, alignment: int) -> torch.Tensor:
    extra = -tensor.size(-1) % alignment
    return torch.nn.functional.pad(tensor, (0, extra)) if extra else tensor


def _efficient_bias(mask: torch.Tensor, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """``preprocess_mask``: pad the bias's last dim (then slice it back) unless its strides are aligned; expand."""
    aligned = all(s % EFFICIENT_BIAS_ALIGNMENT == 0 for s in mask.stride()[:-1]) and mask.stride(-1) == 1
    if not aligned:
        extra = EFFICIENT_BIAS_ALIGNMENT - mask.size(-1) % EFFICIENT_BIAS_ALIGNMENT
        mask = torch.nn.functional.pad(mask, (0, extra))[..., :mask.size(-1)]
    return mask.expand(query.size(0), query.size(1), query.size(2), key.size(2))


def _tell_host(on_host: Callable[[torch.Tensor], None] | None, *tensors: torch.Tensor) -> None:
    if on_host is not None:
        for tensor in tensors:
            on_host(tensor)


class _EfficientGqa(torch.autograd.Function):
    """The efficient kernel with fewer key/value heads than query heads: CUDA's backward returns
    gradients the size of the keys and values, reducing per-query-head ones in a follow-up kernel
    (pytorch#191085); PyTorch's meta backward returns the per-query-head ones, reduced here."""

    @staticmethod
    def forward(ctx: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bias: torch.Tensor | None,
                grad: bool, dropout_p: float, is_causal: bool, scale: float | None,
                on_host: Callable[[torch.Tensor], None] | None) -> torch.Tensor:
        out, lse, seed, offset = torch.ops.aten._scaled_dot_product_efficient_attention(
            query, key, value, bias, grad, dropout_p, is_causal, scale=scale)
        _tell_host(on_host, seed, offset)
        ctx.save_for_backward(query, key, value, bias, out, lse, seed, offset)
        ctx.options = (dropout_p, is_causal, scale)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        query, key, value, bias, out, lse, seed, offset = ctx.saved_tensors
        dropout_p, is_causal, scale = ctx.options
        grad_q, grad_k, grad_v, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            grad_out, query, key, value, bias, out, lse, seed, offset, dropout_p, [True, True, True, False],
            is_causal, scale=scale)
        groups = (key.size(0), key.size(1), query.size(1) // key.size(1))
        grad_k = grad_k.reshape(*groups, *grad_k.shape[2:]).sum(2)
        grad_v = grad_v.reshape(*groups, *grad_v.shape[2:]).sum(2)
        return grad_q, grad_k, grad_v, None, None, None, None, None, None
