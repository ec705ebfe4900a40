"""Megatron's global memory buffer under ``--transformer-impl local``.

``GlobalMemoryBuffer.get_tensor(shape, dtype, "mpu")`` (megatron/core/utils.py) hands out a view of
one tensor per (name, dtype), reallocated to the largest size ever asked for and kept for the run.
Besides the all-gather MoE dispatcher (priced in :func:`memplan.estimate.stage_buffers.moe_allgather_buffer_bytes`),
the local (non-Transformer-Engine) layers ask it for:

* the sequence-parallel all-gather of a column-parallel linear layer's input, forward and backward
  (megatron/core/tensor_parallel/layers.py ``LinearWithGradAccumulationAndAsyncCommunication``):
  ``[s * b, h]`` in the activation dtype, for the QKV and FC1 projections;
* the raw attention scores of Megatron's unfused ``DotProductAttention``
  (megatron/core/transformer/dot_product_attention.py, ``matmul_input_buffer`` of ``baddbmm``):
  ``[b * heads / tp, s, s]`` in the query's dtype; the softmax writes a new tensor, so the
  buffer is not what the attention saves.

All share the ``"mpu"`` buffer, so it holds the largest of these requests (and of the MoE
dispatcher's). Transformer Engine's layers gather and score in tensors of their own. The output
layer's sequence-parallel gather also uses this buffer under either implementation; memplan prices
it as the head's gathered input (:func:`memplan.estimate.extras.head_activation_bytes`).
"""

from __future__ import annotations

from memplan.estimate.activations import ActivationShape
from memplan.model.spec import ModelSpec


def local_impl_requests(model: ModelSpec, layer_indices: tuple[int, ...], shape: ActivationShape,
                        *, eager_attention: bool) -> int:
    """The largest ``"mpu"`` request of a stage's local-implementation layers (0 without layers)."""
    if not layer_indices:
        return 0
    tokens = shape.seq * shape.micro_batch
    gather = tokens * shape.hidden * shape.act_bytes if shape.sequence_parallel and shape.tp > 1 else 0
    scores = 0
    if eager_attention:
        heads = max(model.layers[i].attention.num_heads for i in layer_indices) // shape.tp
        scores = shape.micro_batch * heads * shape.seq * shape.kv_seq * shape.act_bytes
    return max(gather, scores)
