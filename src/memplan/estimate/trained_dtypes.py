"""Partial freezing on a 16-bit base: the operations that follow a trained weight's own dtype.

Under ``*-mixed`` precision a partially frozen model keeps its frozen base in the 16-bit compute dtype and
the weights that train fully in the job's parameter dtype (fp32), as full training stores them
(:mod:`memplan.trace.finetune`, the Hugging Face recipes' ``torch_dtype=bfloat16`` base with fp32
trainable parameters). ``torch.autocast`` casts what linear layers read, so most of a trained layer still
computes in 16 bits; two of transformers' operations are not autocast operators and follow the trained
weights instead:

* HF's grouped MoE experts (transformers ``integrations/moe.py``: ``_grouped_mm`` casts its input to the
  weights' dtype) run in fp32 where the layer's routed experts train: the dispatched tokens, the gate-up
  and down outputs, the activation's tensors and the outputs the combine keeps are fp32, and no 16-bit
  copy of those weights is made (the full-training rule, ``ActivationShape.expert_bytes``);
* gpt-oss's eager sink softmax runs in the dtype of ``cat([scores, sinks])``: fp32 where the layer's
  sinks train, so its probabilities, its gradients and the max-subtracted logits are fp32 and the PV
  matmul keeps a 16-bit cast of the probabilities (``ActivationShape.sink_bytes``).

A layer whose experts (sinks) stay frozen runs them in the base's 16-bit dtype. :func:`trained_weights_shape`
gives a layer's activation shape for its role; :func:`uncopied_expert_numel` the trained expert weights
autocast never copies; :func:`trained_dtypes_note` the sentence that explains both. Checked against
``memplan trace`` (tests/trace/test_agreement_grid.py, Qwen3-MoE and gpt-oss cells with ``--trainable``).
"""

from __future__ import annotations

from dataclasses import replace

from memplan.estimate.activations import ActivationShape
from memplan.estimate.moe_freeze import is_routed_experts
from memplan.estimate.partial_freeze import LayerFlow, layer_flows
from memplan.job import FineTuning
from memplan.model.linears import model_parameters
from memplan.model.spec import ModelSpec

__all__ = ["trained_dtypes_note", "trained_weights_shape", "uncopied_expert_numel"]


def _follows_trained_weights(shape: ActivationShape, trained_bytes: int) -> bool:
    """Trained weights are wider than the 16-bit base the shape was built for (a 16-bit base under
    ``*-mixed``: no autocast shape), and transformers' eager code runs the experts and sinks."""
    return not shape.autocast and shape.kernels == "eager" and trained_bytes > shape.act_bytes


def trained_weights_shape(shape: ActivationShape, flow: LayerFlow, trained_bytes: int) -> ActivationShape:
    """The activation shape of a layer with ``flow`` on a 16-bit base, the trained weights stored in
    ``trained_bytes`` per element: its routed experts and sink softmax in that dtype where they train."""
    if not (flow.trained_experts or flow.trained_sinks) or not _follows_trained_weights(shape, trained_bytes):
        return shape
    return replace(shape, expert_bytes=trained_bytes if flow.trained_experts else shape.expert_bytes,
                   sink_bytes=trained_bytes if flow.trained_sinks else shape.sink_bytes)


def uncopied_expert_numel(model: ModelSpec, ft: FineTuning, layers: tuple[int, ...]) -> int:
    """Trained routed-expert weights (biases included) among ``layers``: HF's grouped experts cast their
    input, not their weights, so autocast makes no 16-bit copy of them."""
    flows = layer_flows(model, ft, False)
    trained = {i for i in layers if flows[i].trained_experts}
    return sum(p.numel for p in model_parameters(model) if p.layer in trained and is_routed_experts(p.module))


def trained_dtypes_note(model: ModelSpec, ft: FineTuning, shape: ActivationShape, trained_bytes: int,
                        trained_dtype: str) -> str:
    """The --explain sentence where a trained layer runs experts or sinks in the trained weights' dtype
    (empty otherwise)."""
    if not _follows_trained_weights(shape, trained_bytes):
        return ""
    flows = layer_flows(model, ft, False)
    experts = any(f.trained_experts for f in flows)
    sinks = any(f.trained_sinks for f in flows)
    if not (experts or sinks):
        return ""
    parts = []
    if experts:
        parts.append(f"a layer whose routed experts train runs them in {trained_dtype} (HF's grouped experts cast "
                     "their input to the weights' dtype), with no 16-bit copies of their weights")
    if sinks:
        parts.append(f"a layer whose attention sinks train runs its sink softmax in {trained_dtype} (the promotion "
                     "of the 16-bit scores with the sinks), its PV matmul keeping a 16-bit cast")
    return (f"partial freezing on a 16-bit base: the weights that train are kept in {trained_dtype}; "
            + "; ".join(parts) + "; frozen experts and sinks run in the base's dtype")
