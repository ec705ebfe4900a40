"""DeepSpeed ZeRO-1/2 with the optimizer offloaded: the device buffer each gradient is staged in on its way to host
memory.

What ``--zero 1`` / ``--zero 2`` with ``--offload-optimizer`` run where the profile's ZeRO is DeepSpeed's and its ZeRO
optimizer reduces through contiguous buckets (:func:`memplan.estimate.zero12_bucket.runs_zero_optimizer`). DeepSpeed
0.19.8, runtime/zero/stage_1_and_2.py ``__init__``: ``temp_grad_buffer_for_gpu_offload``, the largest parameter's
elements in the model's dtype, is allocated when the optimizer is built and kept (measured, helper zero17: Z7,
512,000 B for tiny4's 256,000-element head); in the backward the gradient one reduction takes waits on the device
beside it before its copy into the reduce bucket (``reduce_ipg_grads``: with contiguous gradients each one becomes a
view of the bucket, so one raw gradient waits at a time, at most the largest parameter).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from memplan.estimate.context import StageContext
from memplan.estimate.ledger import COMMUNICATION, TEMPORARY, Contribution
from memplan.estimate.zero12_bucket import runs_zero_optimizer
from memplan.estimate.zero3_buffers import largest_tensor

if TYPE_CHECKING:
    from memplan.estimate.stage_states import StageStates

__all__ = ["contributions"]


def contributions(ctx: StageContext, st: StageStates) -> list[Contribution]:
    """The staging buffer kept for the whole step and the gradient waiting beside it in the backward; nothing
    without an offloaded optimizer."""
    run = ctx.run
    if not run.job.offload.optimizer or not runs_zero_optimizer(ctx):
        return []
    numel, sh = largest_tensor(ctx), run.job.sharding
    return [Contribution(COMMUNICATION, numel * run.prec.param_bytes, note=(
        f"DeepSpeed ZeRO-{sh.zero} with the optimizer offloaded: a device buffer of the largest "
        f"parameter ({numel:,} {run.prec.param} elements) stages each gradient on its way to host memory, kept for "
        "the whole step")),
            Contribution(TEMPORARY, numel * run.prec.grad_bytes, ("backward",), note=(
                f"DeepSpeed ZeRO-{sh.zero} with the optimizer offloaded: a gradient waits on the device before its copy "
                f"into the reduce bucket (at most the largest parameter, {numel:,} elements)"))]
