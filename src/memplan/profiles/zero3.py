"""DeepSpeed ZeRO-3's buffer settings: DeepSpeed's defaults and Hugging Face's ``"auto"`` values, in one place.

``--zero 3`` runs DeepSpeed's ZeRO-3 under the ``deepspeed`` and ``hf`` profiles (the Hugging Face Trainer through its
DeepSpeed integration; their ``FrameworkProfile.zero3_buffers``; Megatron's ``--zero`` is Megatron-FSDP's), so a job
that names none of these keys (flags, a job file, a config that leaves them out) gets DeepSpeed's own defaults
(deepspeed/runtime/zero/config.py, ``DeepSpeedZeroConfig``: ``reduce_bucket_size`` 5e8, ``contiguous_gradients``
true, ``stage3_prefetch_bucket_size`` 5e7, ``stage3_max_live_parameters`` 1e9, ``stage3_max_reuse_distance`` 1e9,
``sub_group_size`` 1e9, ``stage3_param_persistence_threshold`` 1e5).
``"auto"`` is what the Hugging Face integration fills in from the model's hidden size ``h``
(transformers/integrations/deepspeed.py, ``HfTrainerDeepSpeedConfig.trainer_config_finalize``):
``reduce_bucket_size = h*h`` and, under ZeRO-3, ``stage3_prefetch_bucket_size = int(0.9*h*h)`` and
``stage3_param_persistence_threshold = 10*h``.
"""

from __future__ import annotations

from typing import Any

from memplan.frozen import frozen_dataclass

#: The ZeRO buffer keys a :class:`~memplan.job.Sharding` carries, as DeepSpeed's config takes them: (field, the names
#: DeepSpeed accepts, its ``stage3_`` alias first, the least value it accepts, whether Hugging Face's integration fills
#: in ``"auto"``). deepspeed/runtime/zero/config.py declares ``reduce_bucket_size`` Field(gt=0) and the others
#: Field(ge=0); the config reader (:mod:`memplan.frameworks.deepspeed_config`) and ``Job``'s check read this table.
ZERO_BUFFER_KEYS: tuple[tuple[str, tuple[str, ...], int, bool], ...] = (
    ("reduce_bucket_size", ("reduce_bucket_size",), 1, True),
    ("prefetch_bucket_size", ("stage3_prefetch_bucket_size", "prefetch_bucket_size"), 0, True),
    ("max_live_parameters", ("stage3_max_live_parameters", "max_live_parameters"), 0, False),
    ("max_reuse_distance", ("stage3_max_reuse_distance", "max_reuse_distance"), 0, False),
    ("sub_group_size", ("sub_group_size",), 0, False),
    ("param_persistence_threshold", ("stage3_param_persistence_threshold", "param_persistence_threshold"), 0, True),
    ("model_persistence_threshold", ("stage3_model_persistence_threshold", "model_persistence_threshold"), 0, False),
)
#: Beyond this a bucket size is a typo (a petabyte of 16-bit elements).
MOST_ELEMENTS = 10**15
#: The dtypes ``communication_data_type`` takes, as memplan names them (DeepSpeed's ``get_communication_data_type``).
COMMUNICATION_DTYPES = ("fp32", "fp16", "bf16")


@frozen_dataclass(kw_only=True)
class Zero3Defaults:
    """DeepSpeed's values of the ZeRO-3 keys memplan prices (elements, not bytes)."""

    #: ``reduce_bucket_size``: the gradient (IPG) bucket ZeRO-3 allocates once when the optimizer is built, and
    #: ZeRO-1/2 in each backward (:mod:`memplan.estimate.zero12_bucket`).
    reduce_bucket_elements: int = 500_000_000
    #: ``contiguous_gradients``: without it no bucket buffer is allocated (gradients are reduced in place).
    contiguous_gradients: bool = True
    #: ``stage3_prefetch_bucket_size``: parameters fetched ahead of use (0: no prefetching).
    prefetch_bucket_elements: int = 50_000_000
    #: ``stage3_max_live_parameters``: the prefetcher stops when this many parameters are gathered.
    max_live_parameters: int = 1_000_000_000
    #: ``stage3_max_reuse_distance``: a parameter used again within this many elements of the trace is kept.
    max_reuse_distance: int = 1_000_000_000
    #: ``sub_group_size``: the optimizer steps the partition in sub-groups of about this many elements, making
    #: each one's fp32 gradient from the 16-bit gradient partition as it goes.
    sub_group_size: int = 1_000_000_000
    #: ``stage3_param_persistence_threshold``: parameter tensors of at most this many elements stay gathered.
    param_persistence_threshold: int = 100_000


#: DeepSpeed 0.19.8's defaults (deepspeed/runtime/zero/config.py: ``reduce_bucket_size`` Field(5e8),
#: ``contiguous_gradients`` True, ``prefetch_bucket_size`` Field(5e7), ``max_live_parameters`` Field(1e9),
#: ``max_reuse_distance`` Field(1e9), ``sub_group_size`` Field(1e9), ``param_persistence_threshold`` Field(1e5)).
DEEPSPEED_ZERO3 = Zero3Defaults()


def hf_auto_reduce_bucket(hidden: int) -> int:
    """Hugging Face's ``"auto"`` ``reduce_bucket_size``: ``hidden_size * hidden_size``."""
    return hidden * hidden


def hf_auto_prefetch_bucket(hidden: int) -> int:
    """Hugging Face's ``"auto"`` ``stage3_prefetch_bucket_size``: ``int(0.9 * hidden_size * hidden_size)``."""
    return int(0.9 * hidden * hidden)


def hf_auto_persistence_threshold(hidden: int) -> int:
    """Hugging Face's ``"auto"`` ``stage3_param_persistence_threshold``: ``10 * hidden_size``."""
    return 10 * hidden


def setting(value: int | str | None, default: int, auto: int) -> tuple[int, str]:
    """(elements, where they come from) of one key: the config's value, Hugging Face's ``"auto"``, or DeepSpeed's
    default."""
    if value is None:
        return default, "DeepSpeed's default"
    if value == "auto":
        return auto, "Hugging Face's \"auto\""
    return int(value), "the config"


def reduce_bucket(sharding: Any, defaults: Zero3Defaults, hidden: int) -> tuple[int, str]:
    """``reduce_bucket_size`` of a job's sharding (a :class:`memplan.job.Sharding`) in elements, and its source."""
    return setting(sharding.reduce_bucket_size, defaults.reduce_bucket_elements, hf_auto_reduce_bucket(hidden))


def keeps_bucket(sharding: Any, defaults: Zero3Defaults) -> bool:
    """``contiguous_gradients`` (the config's, else DeepSpeed's default): without it ZeRO keeps no reduce bucket."""
    return defaults.contiguous_gradients if sharding.contiguous_gradients is None else sharding.contiguous_gradients
