"""DeepSpeed's own ZeRO-3 model-state rule, as a pure function to check memplan's estimator against.

DeepSpeed ships ``estimate_zero3_model_states_mem_needs_all_live(model, num_gpus_per_node,
num_nodes)`` (``deepspeed/runtime/zero/stage3.py``). It counts the model's parameters ``Ψ`` and
its largest layer ``L`` (the most parameters any one module owns directly) and prints, per GPU:

* no offload: ``4·L + 18·Ψ/N`` bytes — 2 (fp16/bf16 weights) + 4 (fp32 gradient partitions)
  + 12 (fp32 master weights and Adam moments) bytes per parameter, sharded over ``N`` GPUs, plus
  the gathered 16-bit weights and gradients of the largest layer;
* optimizer offloaded to CPU: ``4·L + 2·Ψ/N`` (only the 16-bit weight partitions stay);
* parameters offloaded too: ``4·L``.

It prints bytes / 2**30 with the suffix "GB", so its "GB" is GiB: the Hugging Face DeepSpeed docs'
example for ``bigscience/T0_3B`` (1 GPU: 46.91 / 5.43 / 0.25) comes out only in GiB.
"""

from __future__ import annotations

from memplan.errors import ConfigError, UnsupportedError

#: Bytes per parameter of the sharded states without offload: 2 (16-bit weights) + 4 (fp32
#: gradients) + 4 (fp32 master) + 8 (fp32 Adam moments) (DeepSpeed stage3.py,
#: ``estimate_zero3_model_states_mem_needs``: ``int(18 * total_params / total_gpus)``).
ZERO3_STATE_BYTES_PER_PARAM = 18
#: With the optimizer offloaded only the 16-bit weight partitions stay on the GPU.
ZERO3_OFFLOAD_OPTIMIZER_BYTES_PER_PARAM = 2
#: The largest layer gathered in 16 bits, weights and gradients: ``4 * largest_layer_params``.
LARGEST_LAYER_BYTES_PER_PARAM = 4


def zero3_model_states_bytes(
    total_params: int,
    largest_layer_params: int,
    num_gpus: int,
    *,
    offload_optimizer: bool = False,
    offload_params: bool = False,
) -> int:
    """Per-GPU bytes of model states under ZeRO-3, by DeepSpeed's estimator rule.

    Example (``bigscience/T0_3B`` loaded with ``AutoModel``: 2,783,959,040 parameters, largest
    layer the 32128 x 2048 shared embedding)::

        >>> round(zero3_model_states_bytes(2_783_959_040, 65_798_144, 1) / 2**30, 2)
        46.91
        >>> round(zero3_model_states_bytes(2_783_959_040, 65_798_144, 2, offload_optimizer=True) / 2**30, 2)
        2.84

    Assumptions: mixed-precision Adam; ``num_gpus`` is every GPU ZeRO shards over
    (``num_nodes * num_gpus_per_node``). Integer division replaces DeepSpeed's
    ``int(18 * total / gpus)``; both truncate.

    Known limitations: activations, communication buckets beyond the largest layer, allocator
    fragmentation and CUDA context are not included (DeepSpeed's rule leaves them out too);
    DeepSpeed's CPU-memory column is not modelled. Offloading parameters without offloading the
    optimizer is a combination DeepSpeed's estimator skips, and so does this function.
    """
    for name, value in (("total_params", total_params), ("largest_layer_params", largest_layer_params)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ConfigError(name, "must be a non-negative integer", value)
    if not isinstance(num_gpus, int) or isinstance(num_gpus, bool) or num_gpus < 1:
        raise ConfigError("num_gpus", "must be a positive integer", num_gpus)
    if offload_params and not offload_optimizer:
        raise UnsupportedError(
            "offload_params without offload_optimizer: DeepSpeed's estimator has no such row; "
            "pass offload_optimizer=True as well"
        )
    largest = LARGEST_LAYER_BYTES_PER_PARAM * largest_layer_params
    if offload_params:
        return largest
    per_param = ZERO3_OFFLOAD_OPTIMIZER_BYTES_PER_PARAM if offload_optimizer else ZERO3_STATE_BYTES_PER_PARAM
    return largest + per_param * total_params // num_gpus
