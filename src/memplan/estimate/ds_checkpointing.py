"""DeepSpeed activation checkpointing (``deepspeed.checkpointing``) applied to full recompute's kept layer inputs.

Megatron-DeepSpeed wraps each transformer layer in ``deepspeed.checkpointing.checkpoint``; what the
checkpoint keeps of a layer is its input, and three config switches (``activation_checkpointing`` in
the DeepSpeed config; ``deepspeed/runtime/activation_checkpointing/checkpointing.py``) move it:

* ``partition_activations``: each tensor-parallel rank keeps 1/tp of the input (``get_partition_size``);
  the backward all-gathers it into a full-size tensor that replaces the partition (the partition is
  freed) before recomputing the layer; at tp 1 the partition is the input and nothing is gathered.
* ``cpu_checkpointing``: with partitioning, the partition is copied to CPU memory (the GPU keeps none)
  and brought back, then gathered, in the backward (the full input again, once gathered). Without partitioning an asynchronous offload engine
  copies the inputs to CPU but keeps the newest one on the GPU (``keep_last_count=1``) and the one being
  copied (a forward stash of two ids): two layer inputs stay on the GPU.
* ``contiguous_memory_optimization`` (needs partitioning; ``number_checkpoints`` = N): the first
  checkpoint of a forward allocates N partition-sized buffers (on the CPU with ``cpu_checkpointing``)
  and the partitions are copied into them; each backward drops the unused ones. Before a backward a
  stage holds its in-flight micro-batches' checkpoints plus N - L unused buffers (L: the checkpointed
  layers of the newest forward); DeepSpeed fails (buffer index) when one warm-up of forwards
  checkpoints more than N times, which is refused here.

Example (a 4 MiB layer input, tp 4, partitioned, on the GPU)::

    >>> place_checkpoint(4 << 20, partition=True, cpu=False, tp=4)
    CheckpointPlacement(gpu_keep=1048576, cpu_keep=0, backward_extra=3145728)

Known limitations: partition sizes round up (DeepSpeed refuses inputs not divisible by tp); the
small per-input size tensors and the pinned CPU buffer pool of the offload engine are not priced.
"""

from __future__ import annotations

from memplan.errors import JobConfigError
from memplan.frozen import frozen_dataclass
from memplan.job import Job, Recompute
from memplan.policies import ActivationPolicy, resolve_policy
from memplan.profiles.framework import get_profile


@frozen_dataclass
class CheckpointPlacement:
    """Where one recomputed layer's checkpointed input lives, in bytes."""

    gpu_keep: int
    cpu_keep: int
    #: What the layer's backward adds on the GPU while it recomputes: the full input (gathered or
    #: fetched) less what the GPU kept of it.
    backward_extra: int


def partition_bytes(keep: int, tp: int) -> int:
    """One tensor-parallel rank's share of a checkpointed input of ``keep`` bytes (rounded up)."""
    return -(-keep // tp)


def place_checkpoint(keep: int, *, partition: bool, cpu: bool, tp: int) -> CheckpointPlacement:
    """The placement of a layer input of ``keep`` bytes under the switches (see the module docstring).

    Without the async engine's two newest inputs (see :func:`gpu_resident_inputs`): a cpu-only
    checkpoint is all on the CPU here; the stage loop keeps two of them on the GPU.
    """
    part = partition_bytes(keep, tp) if partition else keep
    gpu = 0 if cpu else part
    return CheckpointPlacement(gpu, part if cpu else 0, keep - gpu)


#: Inputs the non-partitioned CPU offload engine leaves on the GPU: the newest (``keep_last_count=1``)
#: and the one whose copy is in flight (``max_fwd_stash_count=2``).
GPU_RESIDENT_INPUTS = 2


def contiguous_unused_bytes(rc: Recompute, part: int, warmup_checkpoints: int, newest_checkpoints: int) -> int:
    """Bytes of the contiguous buffers allocated but not yet used before a backward (0 when off).

    ``warmup_checkpoints``: the checkpoints a stage makes before its first backward (its in-flight
    forwards); ``newest_checkpoints``: those of one forward after a backward. Raises when
    ``number_checkpoints`` is smaller than the warm-up needs (DeepSpeed indexes past its buffers).
    """
    count = rc.contiguous_checkpoints
    if count is None or not warmup_checkpoints:
        return 0
    if count < warmup_checkpoints:
        raise JobConfigError("--contiguous-checkpoints", "must be at least the checkpointed "
                             f"layers a pipeline stage runs before its first backward ({warmup_checkpoints}) with "
                             "contiguous_memory_optimization (DeepSpeed indexes past its buffers)", count)
    return (count - newest_checkpoints) * part


def ds_checkpointing_applies(job: Job, policy: ActivationPolicy | None = None) -> bool:
    """Whether DeepSpeed's checkpointing switches change the estimate: they move what full
    recompute keeps (each recomputed layer's input); other recompute modes checkpoint no layer.
    ``policy``: the job's resolved policy, when the caller has it."""
    policy = policy or resolve_policy(job)
    return (policy.kind.checkpoints_layers and (policy.partition_activations or policy.cpu_checkpointing)
            and get_profile(job.framework).deepspeed_checkpointing)


def describe_ds_checkpointing(job: Job) -> str | None:
    """The assumption line for the DeepSpeed switches the job sets (None when it sets none)."""
    rc = job.recompute
    if not (rc.partition_activations or rc.cpu_checkpointing):
        return None
    if not ds_checkpointing_applies(job):
        return (f"DeepSpeed activation checkpointing switches have no effect: they move the inputs of layers "
                f"wrapped in deepspeed.checkpointing.checkpoint, and --recompute {rc.mode} checkpoints none")
    parts = []
    if rc.partition_activations:
        parts.append(f"each recomputed layer's input is partitioned over tp {job.parallel.tp} (1/{job.parallel.tp} "
                     "kept per rank) and all-gathered to full size in its backward")
    if rc.cpu_checkpointing:
        parts.append("the partitions are kept in CPU memory and copied back in the backward" if rc.partition_activations
                     else f"the inputs are kept in CPU memory (the offload engine leaves the {GPU_RESIDENT_INPUTS} "
                     "newest on the GPU) and copied back in the backward")
    if rc.contiguous_checkpoints is not None:
        parts.append(f"contiguous buffers for {rc.contiguous_checkpoints} checkpoints are allocated at a forward's "
                     "first checkpoint" + (" in CPU memory" if rc.cpu_checkpointing else "")
                     + "; the unused ones are freed by the next backward")
    return "DeepSpeed activation checkpointing: " + "; ".join(parts)
