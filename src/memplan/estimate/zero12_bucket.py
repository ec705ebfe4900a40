"""DeepSpeed ZeRO-1/2's reduction buffers beside the model states on one GPU: the reduce (IPG) buckets, the reduction's
copy in ``communication_data_type``, ZeRO-1's gradient partition at the reduction, and ``BF16_Optimizer``'s 16-bit
gradients. The optimizer step's fp32 gradient is :mod:`memplan.estimate.zero12_step_gradient`'s, the offload staging
buffer :mod:`memplan.estimate.zero12_offload_staging`'s.

What ``--zero 1`` / ``--zero 2`` run where the profile's ZeRO is DeepSpeed's (``FrameworkProfile.zero3_buffers``:
DeepSpeed, the Hugging Face Trainer through its integration). DeepSpeed 0.19.8:

* **Reduce buckets** (deepspeed/runtime/zero/stage_1_and_2.py): with ``contiguous_gradients`` (DeepSpeed's default)
  the first gradient hook of a backward (``process_gradients`` -> ``setup_buckets``) allocates ``reduce_bucket_size``
  elements (``torch.empty(int(self.reduce_bucket_size), ...)``, whatever the model's size), a second one with
  ``overlap_comm`` (double buffering; DeepSpeed's default is off below stage 3,
  ``DeepSpeedZeroConfig.overlap_comm_valid``), in ``_gradient_reduction_buffer_dtype()``: the separate accumulation dtype where stage 1 keeps one
  (``use_grad_accum_attribute``: ``gradient_accumulation_dtype`` differs from the model's), else the model's.
  ``_release_ipg_buffers`` frees them in ``independent_gradient_partition_epilogue``: at the end of every backward at
  stage 2 (the engine's ``allreduce_gradients``), at the accumulation boundary at stage 1 (``reduce_gradients``), so a
  stage-1 step with gradient accumulation keeps them through the next micro-batches' forwards. ``"auto"``: Hugging
  Face's ``hidden_size^2`` (:mod:`memplan.profiles.zero3`).
* **The reduction's copy**: both of DeepSpeed's paths, ``reduce_scatter`` true (``average_tensor`` ->
  ``allreduce_bucket``) and false (``gradient_reduction_w_predivide``), reduce a bucket's gradients (or alone a
  parameter larger than the bucket) through ``tensor.to(communication_data_type)`` where that dtype differs from the
  bucket's, and copy the result back: ``min(P, max(bucket, largest parameter))`` elements (the largest this GPU holds:
  its pipeline stage's, split by tensor parallelism, ``zero3_buffers.largest_tensor``) in
  ``communication_data_type`` (the model's dtype by default, engine.py ``communication_data_type``) at each
  reduction. ``reduce_scatter: false`` allocates nothing more than ``true`` (measured, docs/benchmarks.md, ds15).
* **ZeRO-1's gradient partition at the reduction**: the first ``copy_grads_in_partition`` allocates this GPU's whole
  partition (``grads_in_partition``, ``torch.empty(total_size)`` in the model's dtype; with a separate fp32
  accumulation dtype the compact fp32 partition, ``_build_compact_grad_partition_buffer``) while the full gradients
  not reduced yet are still alive; at stage 2 the gradients are the partition already. With ``overlap_comm`` the
  reduction runs in the backward and each gradient's storage becomes a view of the bucket as it is made
  (``process_gradients``), so the partition fills as the full gradients go: not priced beside them.
* **BF16_Optimizer** (runtime/bf16_optimizer.py): ZeRO-1 with bf16 weights, ``grad_accum_dtype`` fp32 and no optimizer
  offload (engine.py ``_do_optimizer_sanity_check``) runs it instead of the ZeRO optimizer. It has no reduce bucket; its
  fp32 gradient buffer (``fp32_groups_gradients_flat``, the whole model on every GPU, allocated at init: the model
  states' fp32 gradients) is filled from the bf16 ``param.grad`` at the end of each backward (``backward_epilogue`` ->
  ``update_hp_grads``), which stay allocated (zeroed, not freed, between micro-batches) until the engine's
  ``zero_grad(set_to_none=True)`` after the step; at the accumulation boundary the engine all-reduces the fp32 buffer
  (``buffered_allreduce_fallback`` -> ``allreduce_bucket``) through its copy in ``communication_data_type`` (bf16 by
  default): the whole buffer at once.

Measured on DeepSpeed 0.19.8's engine (CPU, world size 1, tiny4 Llama; docs/benchmarks.md, helper ds15): BF16_Optimizer
keeps 2 B/param of bf16 gradients beside the 4 B/param fp32 ones and copies all 3,676,416 gradients to bf16 for the
all-reduce; a 1e5 bucket is 200,000 B in bf16 and 400,000 B in fp32.

Known limitations: without ``contiguous_gradients`` the reduction's flattened copies are not priced; at stage 2 every
reduction is counted at the backward moment; BF16_Optimizer's bf16 gradients are counted whole at the backward moment
(they are made layer by layer).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from memplan.estimate.context import StageContext
from memplan.estimate.ledger import COMMUNICATION, GRADIENTS, LIFETIME, TEMPORARY, Contribution
from memplan.job import Job
from memplan.profiles.framework import FrameworkProfile
from memplan.profiles.zero3 import keeps_bucket, reduce_bucket
from memplan.units import dtype_bytes

if TYPE_CHECKING:
    from memplan.estimate.stage_states import StageStates

__all__ = ["applies", "bf16_optimizer", "contributions", "runs_zero_optimizer"]

#: From the backward that makes them to the optimizer step that reads them.
_BACKWARD_TO_STEP = ("backward", "end of backward", "optimizer step")


def applies(job: Job, profile: FrameworkProfile) -> bool:
    """``--zero 1`` or ``--zero 2`` run by DeepSpeed's engine (not PyTorch FSDP)."""
    return profile.zero3_buffers is not None and job.sharding.zero in (1, 2) and job.sharding.fsdp == "none"


def bf16_optimizer(job: Job, param: str, grad: str) -> bool:
    """DeepSpeed runs ``BF16_Optimizer``: ZeRO-1, bf16 weights, fp32 gradient accumulation, no optimizer offload."""
    return job.sharding.zero == 1 and param == "bf16" and grad == "fp32" and not job.offload.optimizer


def runs_zero_optimizer(ctx: StageContext) -> bool:
    """DeepSpeed's ZeRO-1/2 optimizer with its contiguous reduce buckets (not BF16_Optimizer, not without
    ``contiguous_gradients``): where the step's fp32 gradient and the offload staging buffer are priced."""
    run = ctx.run
    d = run.profile.zero3_buffers
    return (d is not None and not bf16_optimizer(run.job, run.prec.param, run.prec.grad)
            and keeps_bucket(run.job.sharding, d))


def contributions(ctx: StageContext, st: StageStates) -> list[Contribution]:
    """The reduction's buffers of the step, each with its sentence."""
    run = ctx.run
    prec = run.prec
    if bf16_optimizer(run.job, prec.param, prec.grad):
        return _bf16_optimizer(ctx, st)
    sh, d = run.job.sharding, run.profile.zero3_buffers
    assert d is not None, "applies() checks the profile runs DeepSpeed's ZeRO"
    if not keeps_bucket(sh, d):
        return [Contribution(COMMUNICATION, 0, note="DeepSpeed ZeRO-1/2 without contiguous_gradients: no reduce "
                                                    "bucket (gradients are reduced in place)")]
    elements, source = reduce_bucket(sh, d, run.model.hidden_size)
    zero = sh.zero
    dtype = prec.grad if zero == 1 and prec.grad != prec.param else prec.param
    buffers = 2 if sh.overlap_comm else 1
    accumulates = zero == 1 and run.job.num_microbatches > 1
    live = ("forward", "loss", "backward", "end of backward") if accumulates else ("backward", "end of backward")
    bucket = Contribution(COMMUNICATION, buffers * elements * dtype_bytes(dtype), live, note=(
        f"DeepSpeed ZeRO-{zero} reduce bucket{'s' if buffers > 1 else ''}: {buffers} x reduce_bucket_size "
        f"{elements:,} elements ({source}) in {dtype}"
        + (" (stage 1 reduces the separate fp32 grad_accum gradients)" if dtype != prec.param else "")
        + ", whatever the model's size, from the backward's first gradient to the end of "
        + ("the last micro-batch's backward (kept across the accumulation)" if accumulates else "the backward")
        + f" (contiguous_gradients; overlap_comm {'on: double buffered' if buffers > 1 else 'off'})"))
    during = zero == 2 or sh.overlap_comm  # else at the accumulation boundary, after the backward
    when = ("backward", "end of backward") if during else ("end of backward",)
    copy = _reduction_copy(ctx, st.params.total, elements, dtype, when)
    # with overlap_comm each gradient moves into the bucket as it is made (its storage becomes a view of the bucket):
    # the partition fills while the full gradients go, never beside them all (the gradients' bytes stand for it)
    partition = [] if sh.overlap_comm else _stage1_partition(ctx, st, when)
    return [bucket, *([] if copy is None else [copy]), *partition]


def _stage1_partition(ctx: StageContext, st: StageStates, live: tuple[str, ...]) -> list[Contribution]:
    """ZeRO-1's gradient partition, allocated whole by the reduction beside the full gradients it has not freed yet:
    ``grads_in_partition`` (``copy_grads_in_partition``, ``torch.empty(partition)`` in the model's dtype) or, with a
    separate fp32 accumulation dtype, the compact fp32 partition (``_build_compact_grad_partition_buffer``); at
    stage 2 the gradients are the partition already. Offloaded optimizers copy to host memory instead."""
    run = ctx.run
    if run.job.sharding.zero != 1 or run.job.offload.optimizer:
        return []
    numel = st.states.optimizer_numel
    return [Contribution(TEMPORARY, numel * run.prec.grad_bytes, live, note=(
        f"DeepSpeed ZeRO-1 reduction: this GPU's gradient partition ({numel:,} {run.prec.grad} elements) allocated "
        "whole at its first copy, beside the full gradients not reduced yet"))]


def _reduction_copy(ctx: StageContext, total: int, bucket: int, reduced: str,
                    live: tuple[str, ...]) -> Contribution | None:
    """The reduction's copy in ``communication_data_type`` where it differs from the dtype the gradients are reduced
    in (``reduced``): a ``bucket``'s worth of this GPU's ``total`` gradients, or alone its largest parameter."""
    from memplan.estimate.zero3_buffers import largest_tensor, reduction_copy

    run = ctx.run
    elements, size, comm = reduction_copy(run, total, bucket, largest_tensor(ctx), reduced)
    if comm == reduced:
        return None
    return Contribution(TEMPORARY, size, live, note=(
        f"DeepSpeed ZeRO-{run.job.sharding.zero} reduction: up to {elements:,} {reduced} gradients copied to {comm} "
        "(communication_data_type) for the collective, "
        + ("while the backward runs" if "backward" in live else "at the accumulation boundary after the backward")))


def _bf16_optimizer(ctx: StageContext, st: StageStates) -> list[Contribution]:
    """BF16_Optimizer's bf16 gradients beside its fp32 buffer (the model states' gradients), and the all-reduce's
    copy of that buffer."""
    run = ctx.run
    prec = run.prec
    numel = st.states.gradients // max(prec.grad_bytes, 1)
    live = _BACKWARD_TO_STEP if run.job.num_microbatches == 1 else LIFETIME
    lp = Contribution(GRADIENTS, numel * prec.param_bytes, live, note=(
        f"DeepSpeed ZeRO-1 with {prec.param} weights and {prec.grad} gradient accumulation runs BF16_Optimizer (no "
        f"reduce bucket): the {prec.param} param.grad ({numel:,} elements) beside its {prec.grad} gradient buffer, "
        "from the backward to the step's zero_grad" + (" (zeroed, not freed, between micro-batches)"
                                                       if live == LIFETIME else "")))
    copy = _reduction_copy(ctx, numel, numel, prec.grad, ("end of backward",))  # the all-reduce: the whole buffer
    return [lp] if copy is None else [lp, copy]
