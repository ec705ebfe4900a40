"""Mechanic: the weights ``save_on_cpu`` brings back to the GPU in a layer's backward.

``torch.autograd.graph.save_on_cpu`` packs every tensor autograd saves into host memory, parameters
included: a linear layer saves the weight it multiplied by (the 16-bit copy autocast or FSDP made, or
the stored weight itself, a frozen 16-bit base's for instance), and its backward unpacks it into a new
device tensor the size of that weight. For a dense layer that is one projection's weight; for the routed
experts of a Hugging Face MoE block it is a whole stacked tensor (``gate_up_proj``, every local expert's
gate and up halves; transformers' grouped GEMM saves it; torchtitan's ``w1``/``w3`` apart), which can outweigh every activation of the
layer: on Mixtral 8x7B at 1,024 tokens with LoRA on a frozen bf16 base, 1.88 GB against 0.12 GB.

The bring-back is priced per operator as the largest tensor it saved (:func:`memplan.estimate.stage_activations`
takes the larger of this and the largest saved activation). Not brought back: the weights of layers that
are recomputed (their recompute runs in the backward, outside the hooks) and of bitsandbytes' quantized
layers (its autograd functions keep the layer on ``ctx``, not as a saved tensor).
"""

from __future__ import annotations

from collections.abc import Iterable

from memplan.estimate.context import RunContext
from memplan.estimate.finetune import frozen_bytes_per_element
from memplan.estimate.states import layer_numel_on_rank
from memplan.frameworks.model_code import model_code
from memplan.model.linears import layer_linears
from memplan.units import dtype_bytes

#: The --explain sentence of the weights save_on_cpu brings back.
NOTE = ("save_on_cpu packs the weights autograd saves too: a layer's backward brings back its largest saved "
        "tensor, a GEMM's weight (a stacked experts tensor in an MoE layer) where that is larger than any "
        "activation it saved")


def largest_saved_weight(run: RunContext, layer_indices: Iterable[int]) -> int:
    """Bytes of the largest weight one of ``layer_indices``' operators saves (one rank)."""
    return max((_layer_weight(run, index) for index in layer_indices), default=0)


def _layer_weight(run: RunContext, index: int) -> int:
    model, job = run.model, run.job
    layer = model.layers[index]
    tp = job.parallel.tp
    dense = max((m.weight_numel for m in layer_linears(layer, model.hidden_size, model.model_type)), default=0) // tp
    dense_bytes, _ = _saved_bytes(run)
    return max(dense * dense_bytes, largest_expert_weight(run, index))


def largest_expert_weight(run: RunContext, index: int) -> int:
    """Bytes of the largest stacked routed-experts weight layer ``index``'s grouped GEMMs save (one rank; 0 for
    a dense layer)."""
    model, layer = run.model, run.model.layers[index]
    if layer.moe is None:
        return 0
    _, expert_numel = layer_numel_on_rank(model.layer_param_groups[index], run.job)
    part, whole = _largest_share(run, layer.moe.expert.gated)
    return expert_numel * part // whole * _saved_bytes(run)[1]


def _largest_share(run: RunContext, gated: bool) -> tuple[int, int]:
    """The routed experts' largest saved tensor as a share (part, whole) of their parameters: transformers stacks ``gate_up_proj``
    (gated) or ``up_proj`` and ``down_proj``; torchtitan's own model code (a job read from its TOML) keeps
    ``w1``, ``w2`` and ``w3`` apart."""
    if not gated:
        return 1, 2
    return (2, 3) if model_code(run.job).stacked_gate_up else (1, 3)


def _saved_bytes(run: RunContext) -> tuple[int, int]:
    """Bytes per element of the (dense, expert) weights autograd saves."""
    job, prec = run.job, run.prec
    copied = prec.weight_copies in ("autocast", "fsdp")
    trained = dtype_bytes(prec.compute) if copied else prec.param_bytes
    # Hugging Face's eager experts multiply by the stored weights (no autocast copy)
    expert = prec.param_bytes if run.profile.kernels == "eager" and prec.weight_copies == "autocast" else trained
    if run.counts is None:
        return trained, expert
    frozen = frozen_bytes_per_element(job)
    # bitsandbytes' layers keep their packed weight on ctx: nothing of a quantized linear is saved
    return (0 if job.finetune.quantize_base != "none" else frozen), frozen
