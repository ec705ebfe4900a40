"""``torch.autocast`` as it behaves on CUDA, for fake tensors that live on the CPU.

The trace runs on (fake) CPU tensors, so ``torch.autocast("cpu")`` applies the CPU op lists. The
lower-precision lists (linear, matmul, bmm, addmm, baddbmm, convolutions, SDPA) are the same on
both devices, but CUDA also runs a set of operators in fp32 that CPU autocast leaves alone —
``pow``, ``rsqrt``, ``exp``, ``log``, ``softmax``, ``log_softmax``, ``layer_norm``, ``sum``, ...
(``at::autocast`` "fp32" and "fp32_set_opt_dtype" lists in PyTorch's
``aten/src/ATen/autocast_mode.cpp``). A Python-level GELU such as GPT-2's ``gelu_new`` then keeps
fp32 intermediates on a GPU. :class:`CudaAutocastFp32` is a ``TorchFunctionMode`` that applies
these two CUDA policies while CPU autocast is enabled:

* *fp32*: 16-bit floating tensor arguments are cast to fp32 first (autocast's copies, which
  autograd records and may save);
* *fp32_set_opt_dtype*: reductions and softmaxes get ``dtype=torch.float32`` (no input copy).

While the mode is entered, ``torch.is_autocast_enabled()`` and ``torch.get_autocast_dtype`` answer
for ``"cuda"`` (and with no device, which means CUDA) what CPU autocast is doing: code that asks
whether CUDA autocast is on — peft's bitsandbytes LoRA layers skip their fp32 input cast when it
is — takes the path it takes on a GPU.
"""

from __future__ import annotations

from typing import Any, Self

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["CUDA_FP32_OPS", "CUDA_FP32_SET_DTYPE_OPS", "CudaAutocastFp32"]

#: Function names CUDA autocast runs in fp32 by casting their inputs (autocast_mode.cpp, "fp32").
CUDA_FP32_OPS = frozenset({
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt",
    "sinh", "tan", "pow", "__pow__", "__rpow__", "softplus", "layer_norm", "rms_norm", "group_norm", "norm", "dist", "pdist",
    "cdist", "renorm", "logsumexp", "cosine_similarity", "nll_loss", "mse_loss", "l1_loss", "smooth_l1_loss",
    "huber_loss", "kl_div", "binary_cross_entropy_with_logits", "cosine_embedding_loss", "poisson_nll_loss",
})
#: Function names CUDA autocast runs with ``dtype=torch.float32`` ("fp32_set_opt_dtype").
CUDA_FP32_SET_DTYPE_OPS = frozenset({"softmax", "log_softmax", "cumsum", "cumprod", "sum", "prod"})

_LOW = (torch.bfloat16, torch.float16)


def _upcast(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.dtype in _LOW:
        return value.float()
    if isinstance(value, (list, tuple)):
        return type(value)(_upcast(v) for v in value)
    return value


def _has_low(args: tuple[Any, ...]) -> bool:
    return any(isinstance(a, torch.Tensor) and a.dtype in _LOW for a in args)


class CudaAutocastFp32(TorchFunctionMode):
    """Apply CUDA autocast's fp32 policies on top of CPU autocast (active only while it is enabled)."""

    def __enter__(self) -> Self:
        self._saved = (torch.is_autocast_enabled, torch.get_autocast_dtype)
        enabled, dtype = self._saved

        def is_autocast_enabled(device_type: str | None = None) -> bool:
            return enabled("cpu" if device_type in (None, "cuda") else device_type)

        def get_autocast_dtype(device_type: str) -> torch.dtype:
            return dtype("cpu" if device_type == "cuda" else device_type)

        torch.is_autocast_enabled = is_autocast_enabled  # type: ignore[assignment]
        torch.get_autocast_dtype = get_autocast_dtype  # type: ignore[assignment]
        super().__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            super().__exit__(*exc)
        finally:
            torch.is_autocast_enabled, torch.get_autocast_dtype = self._saved  # type: ignore[assignment]

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if (name in CUDA_FP32_OPS or name in CUDA_FP32_SET_DTYPE_OPS) and torch.is_autocast_enabled("cpu") \
                and _has_low(args):
            if name in CUDA_FP32_OPS:
                args = tuple(_upcast(a) for a in args)
            elif kwargs.get("dtype") is None:
                kwargs = {**kwargs, "dtype": torch.float32}
        return func(*args, **kwargs)
