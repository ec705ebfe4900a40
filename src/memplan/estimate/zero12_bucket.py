"""DeepSpeed ZeRO-1/2's gradient (IPG) reduce buckets on one GPU.

What ``--zero 1`` / ``--zero 2`` run where the profile's ZeRO is DeepSpeed's (``FrameworkProfile.zero3_buffers``:
DeepSpeed, the Hugging Face Trainer through its integration). DeepSpeed 0.19.8, deepspeed/runtime/zero/
stage_1_and_2.py ``setup_buckets``: with ``contiguous_gradients`` (DeepSpeed's default) each micro-step's backward
allocates ``reduce_bucket_size`` elements (``torch.empty(int(self.reduce_bucket_size), ...)``, whatever the model's
size) in ``_gradient_reduction_buffer_dtype()`` (the gradient accumulation dtype where gradients accumulate apart,
else the model's), and a second one with ``overlap_comm`` (double buffering; DeepSpeed's default is off below stage 3,
``DeepSpeedZeroConfig.overlap_comm_valid``). The buckets are cleared only when the next backward sets them up again,
so they are alive for the whole step. ``"auto"``: Hugging Face's ``hidden_size^2`` (:mod:`memplan.profiles.zero3`).

Before, memplan priced one bucket of ``min(reduce_bucket_size, every parameter)`` elements and read neither the
config's size nor ``overlap_comm``: a model under 5e8 parameters got a bucket the size of its gradients.
"""

from __future__ import annotations

from memplan.estimate.context import StageContext
from memplan.estimate.ledger import COMMUNICATION, Contribution
from memplan.job import Job
from memplan.profiles.framework import FrameworkProfile
from memplan.profiles.zero3 import hf_auto_reduce_bucket
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
    if not (d.contiguous_gradients if sh.contiguous_gradients is None else sh.contiguous_gradients):
        return [Contribution(COMMUNICATION, 0, note="DeepSpeed ZeRO-1/2 without contiguous_gradients: no reduce "
                                                    "bucket (gradients are reduced in place)")]
    if sh.reduce_bucket_size is None:
        elements, source = d.reduce_bucket_elements, "DeepSpeed's default"
    elif sh.reduce_bucket_size == "auto":
        elements, source = hf_auto_reduce_bucket(run.model.hidden_size), "Hugging Face's \"auto\""
    else:
        elements, source = int(sh.reduce_bucket_size), "the config"
    buffers = 2 if sh.overlap_comm else 1
    grad = run.prec.grad
    return [Contribution(COMMUNICATION, buffers * elements * dtype_bytes(grad), note=(
        f"DeepSpeed ZeRO-{sh.zero} reduce bucket{'s' if buffers > 1 else ''}: {buffers} x reduce_bucket_size "
        f"{elements:,} elements ({source}) in {grad}, whatever the model's size, set up by each backward and kept "
        f"until the next (contiguous_gradients; overlap_comm {'on: double buffered' if buffers > 1 else 'off'})"))]
