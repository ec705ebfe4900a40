"""What an eager gated MLP keeps of its gate, up and ``act(gate)`` outputs where the block's input needs no gradient
and an adapter sits on only one of its input projections, and their dtypes where one of them is a DoRA-adapted
quantized linear returning fp32 (:mod:`~memplan.estimate.dora_fp32_stream`).

transformers' ``down_proj(act_fn(gate_proj(x)) * up_proj(x))`` (``LlamaMLP.forward``): ``silu`` saves its input (the
gate output) only where that input requires grad, and ``mul`` saves each factor only for the other's gradient
(``tools/autograd/derivatives.yaml``: ``self: grad * other``, ``other: grad * self``). In the first layer of a job
whose embedding is frozen and whose layers are not checkpointed, the MLP's input needs no gradient, so an adapter on
``gate_proj`` alone keeps the gate and up outputs (``act(gate)`` needs a gradient, ``up`` does not), one on ``up_proj``
alone keeps ``act(gate)`` only. A DoRA adapter on a bitsandbytes linear under autocast returns fp32 (peft's
``lora/bnb.py`` casts back only without autocast): its output, and ``silu`` of a gate output, are fp32 in the layer
whose MLP still reads the 16-bit stream, and so is their product, which an 8-bit base keeps. Checked with ``memplan trace`` on the Llama toy (helper dq16): LoRA or DoRA on
``up_proj`` alone kept ``act(gate)`` only (16-bit); DoRA on a 4-bit ``gate_proj`` alone kept its fp32 output and the
16-bit up output; on an 8-bit base, the fp32 product too.
"""

from __future__ import annotations

from dataclasses import replace

from memplan.estimate.activations import NORM_COMPUTE_BYTES, ActivationShape, Term
from memplan.estimate.adapter_acts import in_mlp_block, on_module
from memplan.estimate.terms import TermRole
from memplan.peft.params import Adapter

__all__ = ["gated_mlp_outputs"]

#: A gated MLP's two input projections (transformers' names), in the order of the fc1 term's tensors' owners.
_GATE, _UP = "gate_proj", "up_proj"


def _adapted(adapters: tuple[Adapter, ...], name: str) -> tuple[bool, bool]:
    """(an adapter sits on the MLP's ``name`` projection, it is DoRA)."""
    found = [a for a in adapters if in_mlp_block(a) and on_module(a) and a.module.name.rpartition(".")[2] == name]
    return bool(found), any(a.dora for a in found)


def gated_mlp_outputs(terms: list[Term], shape: ActivationShape, adapters: tuple[Adapter, ...], *, input_grad: bool,
                      dora_fp32: bool, gemm_inputs: bool = False) -> list[Term]:
    """``terms`` (an MLP block's) with the eager gated MLP's fc1 term (gate, up and ``act(gate)``: three tensors)
    holding what is kept: all three where the block's input (or its norm's output) needs a gradient (``input_grad``),
    else those the adapted projections' gradients need; each in fp32 where ``dora_fp32`` (a quantized base under
    autocast with fp32 DoRA magnitudes, the block on the 16-bit stream) and a DoRA adapter makes it. ``terms``
    unchanged where neither applies. ``gemm_inputs`` (bitsandbytes' 8-bit matmul keeps its input): the output
    projection's kept input, ``act(gate) * up``, is fp32 where either factor is."""
    gate, gate_dora = _adapted(adapters, _GATE)
    up, up_dora = _adapted(adapters, _UP)
    wide = (gate_dora or up_dora) and dora_fp32 and shape.act_bytes < NORM_COMPUTE_BYTES
    if (input_grad or gate == up) and not wide:
        return terms
    out = []
    for t in terms:
        if t.role is TermRole.MLP_FC2 and wide and gemm_inputs and t.gemm_input:
            out.append(replace(t, bytes=t.bytes * NORM_COMPUTE_BYTES // shape.act_bytes))
            continue
        if t.role is not TermRole.MLP_FC1 or t.tensors != 3:
            out.append(t)
            continue
        each = t.bytes // 3
        gate_bytes = each * NORM_COMPUTE_BYTES // shape.act_bytes if wide and gate_dora else each
        up_bytes = each * NORM_COMPUTE_BYTES // shape.act_bytes if wide and up_dora else each
        gate_grad, up_grad = input_grad or gate, input_grad or up
        # silu saves the gate output and mul the up output for act(gate)'s gradient; mul saves act(gate) for up's
        kept = [gate_bytes, up_bytes] * gate_grad + [gate_bytes] * up_grad
        if kept:
            out.append(replace(t, bytes=sum(kept), tensors=len(kept), node_saves=min(t.node_saves, len(kept))))
    return out
