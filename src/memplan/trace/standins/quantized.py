"""Stand-ins for bitsandbytes' quantized linear layers (QLoRA), which cannot run on fake tensors.

:class:`Linear4bitStandIn` replaces a decoder ``nn.Linear`` (never the output head nor the
embeddings) before peft wraps the model, and allocates what ``bitsandbytes.nn.Linear4bit`` holds
(bitsandbytes 0.50, ``functional.quantize_4bit``; checked byte for byte in the tests):

* the weight packed two 4-bit values per byte: ``uint8`` of shape ``(ceil(numel/2), 1)``;
* ``absmax``, one per 64-weight block: fp32, or with double quantization ``uint8`` plus the nested
  state — fp32 absmax per 256 blocks, its 256-entry fp32 code and an fp32 offset;
* the 16-entry fp32 code of NF4/FP4.

Forward and backward follow ``bitsandbytes.autograd._functions.MatMul4Bit``: the weight is
dequantized to the compute dtype (a temporary the size of the weight) and multiplied; nothing but
the packed weight is saved; the backward dequantizes again for the input's gradient. The stand-in
subclasses ``nn.Linear``; the trace has peft wrap it with peft's own bitsandbytes LoRA layer
(``peft/tuners/lora/bnb.py``, :func:`memplan.trace.finetune.lora_config`), as it wraps the real one.

:class:`Linear8bitStandIn` does the same for ``Linear8bitLt`` (LLM.int8, ``--quantize-base int8``):
the int8 weight and an fp32 scale per row; no outlier decomposition (``threshold`` 0: with
transformers' default 6.0 the outlier columns of each input, a data-dependent few, are also kept).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from memplan.tuning import QUANT_FORMATS, QUANTIZING_FORMATS

__all__ = ["BLOCKSIZE", "NESTED_BLOCKSIZE", "Linear4bitStandIn", "Linear8bitStandIn", "quantize_linears"]

#: bitsandbytes ``Linear4bit`` default ``blocksize`` (weights per absmax).
BLOCKSIZE = 64
#: Blocks per second-level absmax with ``compress_statistics`` (double quantization).
NESTED_BLOCKSIZE = 256
#: Entries of the NF4/FP4 code and of the 8-bit dynamic map of the nested state.
_CODE_4BIT, _CODE_8BIT = 16, 256
_HEAD_NAMES = ("lm_head",)


def _blocks(numel: int, size: int) -> int:
    return -(-numel // size)


class _MatMul4Bit(torch.autograd.Function):
    """``x @ dequantize(W).T + b``: saves nothing new; dequantizes again in the backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, packed: torch.Tensor, layer: Linear4bitStandIn) -> torch.Tensor:
        ctx.layer = layer
        with torch.autocast("cpu", enabled=False):
            weight = layer.dequantized(x.dtype)
            out = nn.functional.linear(x, weight, None if layer.bias is None else layer.bias.to(x.dtype))
        del weight
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None]:
        if not ctx.needs_input_grad[0]:
            return None, None, None
        weight = ctx.layer.dequantized(grad.dtype)
        return torch.matmul(grad, weight), None, None


class Linear4bitStandIn(nn.Linear):
    """What ``bitsandbytes.nn.Linear4bit`` allocates and computes, runnable on fake tensors."""

    #: The buffers are the quantized weight's state: the trace counts them as parameter memory.
    buffers_are_weight_state = True

    def __init__(self, linear: nn.Linear, *, double_quant: bool, compute_dtype: torch.dtype) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.compute_dtype = compute_dtype
        device = linear.weight.device
        numel = self.in_features * self.out_features
        weight = nn.Parameter(torch.empty((_blocks(numel, 2), 1), dtype=torch.uint8, device=device),
                              requires_grad=False)
        weight.unpacked_numel = numel  # type: ignore[attr-defined]  # peft counts 4-bit weights unpacked
        self.weight = weight
        self.quant_dtype = linear.weight.dtype  # quant_state.dtype: the weight's dtype when it was quantized
        self.bias = linear.bias
        blocks = _blocks(numel, BLOCKSIZE)
        self.register_buffer("absmax", torch.empty(blocks, dtype=torch.uint8 if double_quant else torch.float32,
                                                   device=device))
        self.register_buffer("code", torch.empty(_CODE_4BIT, dtype=torch.float32, device=device))
        if double_quant:
            self.register_buffer("nested_absmax", torch.empty(_blocks(blocks, NESTED_BLOCKSIZE),
                                                              dtype=torch.float32, device=device))
            self.register_buffer("nested_code", torch.empty(_CODE_8BIT, dtype=torch.float32, device=device))
            self.register_buffer("offset", torch.empty((), dtype=torch.float32, device=device))

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight in ``dtype``: the temporary bitsandbytes' dequantization allocates."""
        return torch.empty((self.out_features, self.in_features), dtype=dtype, device=self.weight.device)

    def storage_bytes(self) -> int:
        """Bytes the layer's quantized weight and quantization state hold (not the bias)."""
        return self.weight.nbytes + sum(b.nbytes for b in self.buffers())

    @property
    def W_q(self) -> torch.Tensor:  # peft's name
        """The packed weight, under the name peft's ``dequantize_module_weight`` looks for (:meth:`dequantize`)."""
        return self.weight

    def dequantize(self) -> torch.Tensor:
        """What peft's ``dequantize_module_weight`` returns for DoRA's weight norm (``utils/integrations.py``:
        ``bnb.functional.dequantize_4bit(weight.data, weight.quant_state)``, in ``quant_state.dtype``, the weight's
        dtype when it was quantized). peft calls a module's ``dequantize()`` where it has ``W_q``."""
        return self.dequantized(self.quant_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        return _MatMul4Bit.apply(x.to(self.compute_dtype), self.weight, self).to(dtype)


class _MatMul8bitLt(torch.autograd.Function):
    """``bitsandbytes.autograd._functions.MatMul8bitLt`` without outlier columns (threshold 0):
    the input is cast to fp16 and quantized per row (int8 + fp32 scale), multiplied in int32 and
    dequantized; the input is saved; the backward dequantizes the weight (a copy in the input's
    dtype, scaled per row) for the input's gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, layer: Linear8bitStandIn) -> torch.Tensor:
        ctx.layer = layer
        rows = x.reshape(-1, x.shape[-1])
        half = rows.to(torch.float16)
        quantized = torch.empty(rows.shape, dtype=torch.int8, device=x.device)
        scales = torch.empty(rows.shape[0], dtype=torch.float32, device=x.device)
        del half
        accumulated = torch.empty((rows.shape[0], layer.out_features), dtype=torch.int32, device=x.device)
        out = torch.empty((*x.shape[:-1], layer.out_features), dtype=x.dtype, device=x.device)
        del accumulated, quantized, scales
        if layer.bias is not None:
            out = out + layer.bias.to(x.dtype)
        ctx.save_for_backward(x)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None]:
        if not ctx.needs_input_grad[0]:
            return None, None, None
        (x,) = ctx.saved_tensors
        layer = ctx.layer
        weight = layer.weight.to(x.dtype, copy=True)
        weight.mul_(layer.SCB.unsqueeze(1).mul(1.0 / 127.0))
        return torch.matmul(grad.to(x.dtype), weight), None, None


class Linear8bitStandIn(nn.Linear):
    """What ``bitsandbytes.nn.Linear8bitLt`` (``has_fp16_weights=False``) holds: the int8 weight
    (``Int8Params``, out x in) and an fp32 scale per output row (``SCB``)."""

    #: The buffers are the quantized weight's state: the trace counts them as parameter memory.
    buffers_are_weight_state = True

    def __init__(self, linear: nn.Linear) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        device = linear.weight.device
        self.weight = nn.Parameter(torch.empty((self.out_features, self.in_features), dtype=torch.int8,
                                               device=device), requires_grad=False)
        self.bias = linear.bias
        self.register_buffer("SCB", torch.empty(self.out_features, dtype=torch.float32, device=device))

    def storage_bytes(self) -> int:
        """Bytes of the int8 weight and its row scales (not the bias)."""
        return self.weight.nbytes + self.SCB.nbytes

    @property
    def W_q(self) -> torch.Tensor:  # peft's name
        """The int8 weight, under the name peft's ``dequantize_module_weight`` looks for (:meth:`dequantize`)."""
        return self.weight

    def dequantize(self) -> torch.Tensor:
        """What peft's ``dequantize_bnb_weight`` returns for an 8-bit weight (``int8_vectorwise_dequant``: ``A *
        stats.view(-1, 1) * 7.874e-3``, int8 times the fp32 row scales: an fp32 product, then the fp32 result)."""
        product = self.weight * self.SCB.view(-1, 1)
        return product * 7.874015718698502e-3

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _MatMul8bitLt.apply(x, self.weight, self)


def quantize_linears(model: nn.Module, quant: str, *, double_quant: bool, compute_dtype: torch.dtype) -> int:
    """Replace every ``nn.Linear`` of the decoder (not the head) by a 4-bit stand-in; returns how many.

    As ``from_pretrained(quantization_config=BitsAndBytesConfig(load_in_4bit=True))`` does, every
    linear layer but the output head is quantized, whatever peft later targets.
    """
    fmt = QUANT_FORMATS.get(quant)
    if fmt is None or not fmt.quantizes:
        raise ValueError(f"quantize_linears: {quant!r} is not one of {', '.join(QUANTIZING_FORMATS)}")
    swaps = [(path, module) for path, module in model.named_modules()
             if type(module) is nn.Linear and path.rsplit(".", 1)[-1] not in _HEAD_NAMES]
    for path, module in swaps:
        parent_path, _, name = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        stand_in = (Linear4bitStandIn(module, double_quant=double_quant, compute_dtype=compute_dtype)
                    if fmt.four_bit else Linear8bitStandIn(module))
        setattr(parent, name, stand_in)
    return len(swaps)
