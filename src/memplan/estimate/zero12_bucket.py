"""DeepSpeed ZeRO-1/2's gradient (IPG) reduce buckets on one GPU.

What ``--zero 1`` / ``--zero 2`` run where the profile's ZeRO is DeepSpeed's (``FrameworkProfile.zero3_buffers``:
DeepSpeed, the Hugging Face Trainer through its integration). DeepSpeed 0.19.8, deepspeed/runtime/zero/
stage_1_and_2.py: with ``contiguous_gradients`` (DeepSpeed's default) the first gradient hook of a backward
(``process_gradients`` -> ``setup_buckets``) allocates ``reduce_bucket_size`` elements (``torch.empty(int(
self.reduce_bucket_size), ...)``, whatever the model's size), a second one with ``overlap_comm`` (double buffering;
DeepSpeed's default is off below stage 3, ``DeepSpeedZeroConfig.overlap_comm_valid``), in
``_gradient_reduction_buffer_dtype()``: the separate accumulation dtype where stage 1 keeps one
(``use_grad_accum_attribute``), else the model's. ``_release_ipg_buffers`` frees them in
``independent_gradient_partition_epilogue``: at the end of every backward at stage 2 (the engine's
``allreduce_gradients``), at the accumulation boundary at stage 1 (``reduce_gradients``), so a stage-1 step with
gradient accumulation keeps them through the next micro-batches' forwards; the optimizer step never holds them.
Stage 1 with bf16 weights and fp32 accumulation runs DeepSpeed's ``BF16_Optimizer`` instead
(engine.py ``_do_optimizer_sanity_check``), which allocates no reduce bucket. ``"auto"``: Hugging Face's
``hidden_size^2`` (:mod:`memplan.profiles.zero3`).

Before, memplan priced one bucket of ``min(reduce_bucket_size, every parameter)`` elements and read neither the
config's size nor ``overlap_comm``: a model under 5e8 parameters got a bucket the size of its gradients.
"""

from __future__ import annotations

from memplan.estimate.context import StageContext
from memplan.estimate.ledger import COMMUNICATION, Contribution
from memplan.job import Job
from memplan.profiles.framework import FrameworkProfile
from memplan.profiles.zero3 import keeps_bucket, reduce_bucket
from memplan.units import dtype_bytes

__all__ = ["applies", "contributions"]


def applies(job: Job, profile: FrameworkProfile) -> bool:
    """``--zero 1`` or ``--zero 2`` run by DeepSpeed's engine (not PyTorch FSDP)."""
    return profile.zero3_buffers is not None and job.sharding.zero in (1, 2) and job.sharding.fsdp == "none"


def contributions(ctx: StageContext) -> list[Contribution]:
    """The reduce buckets for the whole step, with their sentence."""
    run = ctx.run
    sh, d = run.job.sharding, run.profile.zero3_buffers
    assert d is not None, "applies() checks the profile runs DeepSpeed's ZeRO"
    if not keeps_bucket(sh, d):
        return [Contribution(COMMUNICATION, 0, note="DeepSpeed ZeRO-1/2 without contiguous_gradients: no reduce "
                                                    "bucket (gradients are reduced in place)")]
    elements, source = reduce_bucket(sh, d, run.model.hidden_size)
    prec, zero = run.prec, sh.zero
    if zero == 1 and prec.grad != prec.param:
        return [Contribution(COMMUNICATION, 0, note=(
            f"DeepSpeed ZeRO-1 with {prec.param} weights and {prec.grad} gradient accumulation runs BF16_Optimizer "
            "(DeepSpeed refuses the mix for other weights), which allocates no reduce bucket"))]
    buffers = 2 if sh.overlap_comm else 1
    accumulates = zero == 1 and run.job.num_microbatches > 1
    live = ("forward", "loss", "backward", "end of backward") if accumulates else ("backward", "end of backward")
    return [Contribution(COMMUNICATION, buffers * elements * dtype_bytes(prec.param), live, note=(
        f"DeepSpeed ZeRO-{zero} reduce bucket{'s' if buffers > 1 else ''}: {buffers} x reduce_bucket_size "
        f"{elements:,} elements ({source}) in {prec.param}, whatever the model's size, from the backward's first "
        "gradient to the end of "
        + ("the last micro-batch's backward (kept across the accumulation)" if accumulates else "the backward")
        + f" (contiguous_gradients; overlap_comm {'on: double buffered' if buffers > 1 else 'off'})"))]

