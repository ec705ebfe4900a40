"""DoRA on a bitsandbytes base under ``torch.autocast``: the fp32 stream after the first DoRA-adapted linear.

peft's bitsandbytes LoRA layers (peft 0.21 ``tuners/lora/bnb.py``, ``Linear4bit`` and ``Linear8bitLt``
``forward``) cast the adapters' sum back to the base result's dtype only without autocast
(``requires_conversion = not torch.is_autocast_enabled()``), unlike peft's plain ``Linear`` (``result.to(
torch_result_dtype)``). DoRA's term (``tuners/lora/dora.py`` ``DoraLinearLayer.forward``) is ``(mag_norm_scale - 1)
* base_result + mag_norm_scale * lora_result * scaling`` with ``mag_norm_scale = magnitude / weight_norm`` in the
magnitude's dtype: with fp32 adapters (peft's ``autocast_adapter_dtype``) a DoRA-adapted quantized linear returns
fp32 under autocast. What follows it and is no autocast op is then fp32 too: the residual stream (a 16-bit tensor
plus an fp32 one), the norms' outputs (``weight * x.to(input_dtype)``), bitsandbytes' outputs (its layers return
their input's dtype), the MLP's gate, up and activation outputs. Autocast ops (the attention kernel and matmuls,
the adapters' linears) still return 16 bits and save 16-bit copies of fp32 inputs.

Against the 16-bit stream, a block that reads the fp32 stream saves (:func:`fp32_blocks` says which blocks do):

* its input, the residual, in fp32, of which the eager norm's fp32 cast is the tensor itself
  (``ActivationShape.residual_bytes`` 4: :func:`fp32_stream_shape`);
* the gated MLP's gate, up and activation outputs in fp32, and an 8-bit base's kept GEMM inputs (the norm's
  output, the product the output projection reads) in fp32 (:func:`widened_terms`);
* its adapters' terms as for an fp32 input (:func:`adapter_input_bytes`): each ``lora_A`` its own 16-bit autocast
  copy (no 16-bit input shared by the block), DoRA's saved base result in fp32. The attention's output projection
  reads the attention kernel's 16-bit output: its adapter is priced as on the 16-bit stream.

A frozen base stored in fp32 (``--frozen-dtype fp32`` under ``*-mixed``) makes the same stream from the embedding on:
every block reads it, with LoRA as with DoRA (:data:`FP32_STREAM`).

The DoRA stream starts at the first DoRA-adapted linear whose output reaches the residual stream (not a q/k/v projection:
the attention kernel, an autocast op, reads it and returns 16 bits). Its own layer: where it sits in the attention
block (the output projection), the layer's MLP block reads the fp32 stream; where it sits in the MLP block, only the
layers after it do (a DoRA adapter on a gate or up
projection alone makes the rest of that MLP fp32 as well: :mod:`~memplan.estimate.gated_mlp_outputs`). Checked against ``memplan trace`` (the
stand-ins of :mod:`memplan.trace.standins.quantized` under peft's own bitsandbytes layers).
"""

from __future__ import annotations

from dataclasses import replace

from memplan.estimate.activations import NORM_COMPUTE_BYTES, ActivationShape, Term
from memplan.estimate.adapter_acts import feeds_attention, in_mlp_block, module_dora, on_attention_output
from memplan.estimate.terms import TermRole
from memplan.peft.params import Adapter

__all__ = ["FP32_STREAM", "NO_FP32", "adapter_input_bytes", "fp32_blocks", "fp32_start", "fp32_stream_shape",
           "widened_terms"]

#: (attention block, MLP block) of a layer that reads the 16-bit stream only; of one whose blocks both read fp32.
NO_FP32, FP32_STREAM = (False, False), (True, True)


def _fp32_result(adapters: tuple[Adapter, ...]) -> bool:
    """One of ``adapters`` is DoRA on a (quantized) module linear whose fp32 result reaches the residual stream: not
    a q/k/v projection, whose output the attention kernel (an autocast op) reads and returns in 16 bits."""
    return any(module_dora(a) and not feeds_attention(a) for a in adapters)


def fp32_start(layer_adapters: tuple[tuple[Adapter, ...], ...]) -> int:
    """The first layer holding a DoRA adapter whose fp32 result reaches the residual stream (``len(layer_adapters)``
    if none), ``layer_adapters`` the adapters of every layer: read once per estimate by :func:`fp32_blocks`'s
    callers."""
    return next((i for i, adapters in enumerate(layer_adapters) if _fp32_result(adapters)), len(layer_adapters))


def fp32_blocks(layer_adapters: tuple[tuple[Adapter, ...], ...], index: int, start: int) -> tuple[bool, bool]:
    """(attention block, MLP block) of layer ``index`` that read the fp32 stream, ``layer_adapters`` the adapters of
    every layer of a model whose quantized base runs under autocast with fp32 DoRA magnitudes and ``start`` their
    :func:`fp32_start`."""
    if index > start:
        return FP32_STREAM
    own = layer_adapters[index]
    return False, _fp32_result(tuple(a for a in own if not in_mlp_block(a)))


def fp32_stream_shape(shape: ActivationShape, blocks: tuple[bool, bool]) -> ActivationShape:
    """The layer's shape where its input, the residual stream, is fp32 (``blocks[0]``)."""
    return replace(shape, residual_bytes=NORM_COMPUTE_BYTES) if blocks[0] else shape


#: A norm output's 16-bit copies, one per further linear reading it under autocast (``nn.Linear``s only).
_AUTOCAST_INPUT_COPIES = frozenset({TermRole.NORM_COPIES, TermRole.SHARED_EXPERT_NORM_COPIES})
#: Terms of a frozen gated MLP whose tensors are bitsandbytes outputs (or their activation) in the input's dtype.
_MLP_OUTPUTS = frozenset({TermRole.MLP_FC1})


def widened_terms(terms: list[Term], shape: ActivationShape, *, gemm_inputs: bool) -> list[Term]:
    """``terms`` of a block reading the fp32 stream: the MLP's gate/up/activation outputs in fp32 and, where the
    base keeps its GEMM inputs (``gemm_inputs``: bitsandbytes' 8-bit matmul), those in fp32 (the attention
    kernel's output, which the output projection reads, stays 16-bit); no autocast copies of a norm's output for
    its other linears (the fp32 frozen base's shape prices them for ``nn.Linear`` layers)."""
    wide = NORM_COMPUTE_BYTES
    out = []
    for t in terms:
        if t.role in _AUTOCAST_INPUT_COPIES:
            continue  # bitsandbytes' linears are no autocast ops: no 16-bit copy of their input (fp32 weights' shape)
        fp32 = t.role in _MLP_OUTPUTS or (gemm_inputs and t.gemm_input and t.role is not TermRole.OUTPUT_PROJECTION_INPUT)
        out.append(replace(t, bytes=t.bytes * wide // shape.act_bytes) if fp32 and shape.act_bytes < wide else t)
    return out


def adapter_input_bytes(adapter: Adapter, blocks: tuple[bool, bool]) -> int:
    """Bytes per element of what ``adapter`` reads where its block reads the fp32 stream (0: the compute dtype's)."""
    if on_attention_output(adapter):
        return 0
    return NORM_COMPUTE_BYTES if blocks[1 if in_mlp_block(adapter) else 0] else 0
