"""Whether the model states' gradients are freed after the optimizer step, and the moments of a one-micro-batch step
they are then ``absent`` at (:mod:`memplan.estimate.stage_peak`).

* ``zero_grad(set_to_none=True)`` after the step (PyTorch's and the Hugging Face Trainer's default, FSDP2): the
  profile's ``frees_gradients``. The backward then makes them layer by layer
  (:func:`memplan.estimate.backward_walk.walked_backward`).
* DeepSpeed's engine (the profile's ``frees_gradients_zero``; DeepSpeed 0.19.8): at stages 1 and 2 the engine's
  ``_take_model_step`` calls ``DeepSpeedZeroOptimizer.zero_grad(set_to_none=True)`` (runtime/zero/stage_1_and_2.py:
  ``p.grad = None``, ``p.grad_accum = None``) and the reduction's ``_release_ipg_buffers`` has dropped the
  contiguous partition; without ZeRO its FP16 optimizers do the same. Measured (docs/benchmarks.md, helper
  dsfree15): after the step E1 (ZeRO-1), E9 (ZeRO-2), E10 (stage 0) and a LoRA ZeRO-2 engine hold no gradient.
  Two gradient buffers persist and keep their bytes at every moment: ``BF16_Optimizer``'s fp32 buffer (ZeRO-1, bf16
  weights, fp32 accumulation: ``fp32_groups_gradients_flat``, allocated at init; its bf16 ``param.grad`` are priced
  from the backward to the step, :mod:`memplan.estimate.zero12_bucket`) and ZeRO-3's flat gradient partition
  (runtime/zero/stage3.py ``grad_partitions_flat_buffer``, allocated at init): 3 is not in the tuple.
* ZeRO-2's backward with ``contiguous_gradients`` (DeepSpeed's default) allocates this GPU's whole partition at its
  first ``copy_grads_in_partition`` (``torch.empty(total_size)``), after the first reduce bucket fills; the gradients
  before it sit in the bucket (priced as communication). On the GPU whose partition holds the head (the last rank;
  at one data-parallel rank the partition is every gradient) that is the backward's first reduction: once the
  gradients made reach ``reduce_bucket_size`` elements the walk holds the whole partition
  (:func:`whole_partition_after`; measured, docs/benchmarks.md, helper zero17: Z1 at world size 1, Z2 at 2). ZeRO-1
  makes the full gradients layer by layer and reduces at the boundary; the walk counts the partition's share of the
  gradients made so far there.
"""

from __future__ import annotations

from memplan.estimate.context import StageContext
from memplan.estimate.zero12_bucket import bf16_optimizer
from memplan.profiles.zero3 import keeps_bucket, reduce_bucket

__all__ = ["freed_after_step", "made_in_backward", "note", "whole_partition_after"]


def freed_after_step(ctx: StageContext) -> bool:
    """Whether no gradient of the model states outlives the optimizer step (see the module)."""
    profile = ctx.profile
    if profile.frees_gradients or not profile.frees_gradients_zero:
        return profile.frees_gradients
    job = ctx.job
    if job.sharding.zero not in profile.frees_gradients_zero or job.sharding.fsdp != "none":
        return False
    return not bf16_optimizer(job, ctx.run.prec.param, ctx.run.prec.grad)


def made_in_backward(ctx: StageContext) -> bool:
    """Whether a step's only micro-batch holds no gradient at its forward and loss (they are ``absent`` there and at
    the backward's start) and makes them layer by layer in its backward."""
    profile = ctx.profile
    if not (profile.frees_gradients or profile.frees_gradients_zero) or ctx.job.num_microbatches != 1:
        return False  # the common case first: a framework that keeps its gradient buffers
    return freed_after_step(ctx)


def whole_partition_after(ctx: StageContext) -> int | None:
    """The gradient elements a backward makes before DeepSpeed ZeRO-2 holds this GPU's whole contiguous gradient
    partition (its first reduction, once ``reduce_bucket_size`` elements are made; see the module), None where the
    walk counts the partition's share of the gradients made (other stages, ``contiguous_gradients`` off, the
    optimizer offloaded: its partition is in host memory)."""
    job, d = ctx.job, ctx.profile.zero3_buffers
    if (d is None or job.sharding.zero != 2 or job.sharding.fsdp != "none" or job.offload.optimizer
            or not keeps_bucket(job.sharding, d)):
        return None
    return reduce_bucket(job.sharding, d, ctx.model.hidden_size)[0]


def note(ctx: StageContext) -> str:
    """The sentence for gradients a ZeRO stage's engine frees after the step where :func:`made_in_backward`; "" where
    the profile frees them always (``frees_gradients``)."""
    if ctx.profile.frees_gradients:
        return ""
    zero = ctx.job.sharding.zero
    stage = f"ZeRO-{zero}" if zero else "without ZeRO"
    whole = whole_partition_after(ctx)
    return (f"{ctx.profile.name} {stage} frees every gradient after the optimizer step (zero_grad(set_to_none=True)): "
            "a step's only micro-batch holds none at its forward and loss and makes them again layer by layer in its "
            "backward" + ("" if whole is None else (
                f"; ZeRO-2 allocates this GPU's whole gradient partition (contiguous_gradients) at the backward's "
                f"first reduction, once {whole:,} gradient elements (reduce_bucket_size) are made, and the walk holds "
                "it whole from then on (the GPU whose partition holds the head; the others allocate theirs later)")))
