"""DeepSpeed ZeRO-1/2's gradient buffers beside the model states on one GPU: the reduce (IPG) buckets, the reduction's
copy in ``communication_data_type``, ZeRO-1's gradient partition at the reduction, and ``BF16_Optimizer``'s 16-bit
gradients.

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
* **The optimizer step's fp32 gradient**: ``step`` flattens this GPU's gradient partition (a copy in the gradients'
  dtype) and casts it to fp32 (``single_grad_partition``, the fp32 partition's ``.grad``), both alive at the cast
  beside the gradient partition (freed after): ``partition x (4 + the gradients' bytes where not fp32)`` at the
  optimizer step (measured, docs/benchmarks.md, helper zero17: Z1 world size 1, Z2 and Z6 world size 2). At stage 1
  the backward's epilogue has cleared the full gradients by then (``_clear_param_grad_only``): the step holds the
  partition only (the rest is ``absent`` there). An offloaded optimizer's gradients are in host memory already;
  BF16_Optimizer's are its fp32 buffer.
* **The offload staging buffer**: with ``offload_optimizer`` the optimizer keeps a device buffer of the largest
  parameter's elements in the model's dtype (``temp_grad_buffer_for_gpu_offload``) from its construction on
  (measured, helper zero17: Z7, 512,000 B for tiny4's 256,000-element head); in the backward the gradients one
  reduction takes wait on the device beside it (a bucket's worth or the largest parameter).
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
from memplan.estimate.ledger import ABSENT, COMMUNICATION, GRADIENTS, LIFETIME, TEMPORARY, Contribution
from memplan.job import Job
from memplan.profiles.framework import FrameworkProfile
from memplan.profiles.zero3 import keeps_bucket, reduce_bucket
from memplan.units import dtype_bytes

if TYPE_CHECKING:
    from memplan.estimate.stage_states import StageStates

__all__ = ["applies", "bf16_optimizer", "contributions"]

#: From the backward that makes them to the optimizer step that reads them.
_BACKWARD_TO_STEP = ("backward", "end of backward", "optimizer step")


def applies(job: Job, profile: FrameworkProfile) -> bool:
    """``--zero 1`` or ``--zero 2`` run by DeepSpeed's engine (not PyTorch FSDP)."""
    return profile.zero3_buffers is not None and job.sharding.zero in (1, 2) and job.sharding.fsdp == "none"


def bf16_optimizer(job: Job, param: str, grad: str) -> bool:
    """DeepSpeed runs ``BF16_Optimizer``: ZeRO-1, bf16 weights, fp32 gradient accumulation, no optimizer offload."""
    return job.sharding.zero == 1 and param == "bf16" and grad == "fp32" and not job.offload.optimizer


def contributions(ctx: StageContext, st: StageStates) -> list[Contribution]:
    """The buffers of the step, each with its sentence."""
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
    return [bucket, *([] if copy is None else [copy]), *partition, *_step_gradient(ctx, st),
            *_offload_buffer(ctx, st)]


def _offload_buffer(ctx: StageContext, st: StageStates) -> list[Contribution]:
    """With the optimizer offloaded, the device buffer one gradient is staged in on its way to host memory
    (stage_1_and_2.py ``temp_grad_buffer_for_gpu_offload``: the largest parameter's elements in the model's dtype,
    allocated when the optimizer is built and kept)."""
    from memplan.estimate.zero3_buffers import largest_tensor

    run = ctx.run
    if not run.job.offload.optimizer:
        return []
    numel, sh = largest_tensor(ctx), run.job.sharding
    # with contiguous gradients (the only case here: keeps_bucket) each gradient is copied into the reduce bucket and
    # becomes a view of it (stage_1_and_2.py, reduce_ipg_grads): one raw gradient waits at a time, at most the largest
    waiting = numel
    return [Contribution(COMMUNICATION, numel * run.prec.param_bytes, note=(
        f"DeepSpeed ZeRO-{sh.zero} with the optimizer offloaded: a device buffer of the largest "
        f"parameter ({numel:,} {run.prec.param} elements) stages each gradient on its way to host memory, kept for "
        "the whole step")),
            Contribution(TEMPORARY, waiting * run.prec.grad_bytes, ("backward",), note=(
                f"DeepSpeed ZeRO-{sh.zero} with the optimizer offloaded: a gradient waits on the device before its copy "
                f"into the reduce bucket (at most the largest parameter, {waiting:,} elements)"))]


def _step_gradient(ctx: StageContext, st: StageStates) -> list[Contribution]:
    """The optimizer step's fp32 gradient partition (stage_1_and_2.py ``step``: ``flatten(averaged_gradients)
    .to(fp32)``, the flat copy in the gradients' dtype and its fp32 cast alive together beside the gradient
    partition, which is freed after); an offloaded optimizer's gradients are in host memory already."""
    run = ctx.run
    if run.job.offload.optimizer:
        return []
    from memplan.estimate.zero3_buffers import flat_fp32_bytes

    numel, grad = st.states.optimizer_numel, run.prec.grad_bytes
    out = [Contribution(TEMPORARY, flat_fp32_bytes(grad) * numel, ("optimizer step",), note=(
        f"DeepSpeed ZeRO-{run.job.sharding.zero} optimizer step: this GPU's gradient partition ({numel:,} elements) "
        f"flattened ({run.prec.grad}) and cast to fp32 for the optimizer, both alive at the cast"))]
    others = st.states.gradients - numel * grad
    if run.job.sharding.zero == 1 and others > 0:
        out.append(Contribution(ABSENT, others, ("optimizer step",), note=(
            "DeepSpeed ZeRO-1: the reduction at the end of the backward keeps only this GPU's gradient partition "
            "(independent_gradient_partition_epilogue clears every param.grad), so the optimizer step holds no "
            "other gradient")))
    return out


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
