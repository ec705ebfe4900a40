"""The memory categories shared by estimate, trace, alloc and ckpt.

Every byte memplan reports belongs to exactly one category, so the engines line up
category by category when they are cross-checked.
"""

from __future__ import annotations

from enum import Enum

__all__ = ["MemoryCategory"]


class MemoryCategory(str, Enum):
    """Where a byte of GPU memory goes."""

    #: Model weights in the dtype the forward pass reads them in.
    PARAMETER = "parameter"
    #: Gradients of the weights (including fp32 main-grad buffers).
    GRADIENT = "gradient"
    #: Optimizer moments (Adam's m and v, SGD momentum, ...).
    OPTIMIZER_STATE = "optimizer_state"
    #: fp32 master copies of low-precision weights kept by mixed-precision optimizers.
    MASTER_WEIGHT = "master_weight"
    #: Tensors saved by the forward pass for the backward pass.
    ACTIVATION = "activation"
    #: Logits and cross-entropy buffers alive around the loss computation.
    LOGITS = "logits"
    #: Short-lived intermediates (backward temporaries, optimizer foreach buffers).
    TEMPORARY = "temporary"
    #: The batch itself (token ids, labels, masks).
    INPUT = "input"
    #: Non-trainable module buffers (rotary caches, masks registered as buffers).
    BUFFER = "buffer"
    #: Collective-communication staging buffers (all-gather, reduce-scatter, DDP buckets).
    COMMUNICATION = "communication"
    #: Library workspaces (cuBLAS, cuDNN, NCCL) that the caching allocator serves.
    WORKSPACE = "workspace"
