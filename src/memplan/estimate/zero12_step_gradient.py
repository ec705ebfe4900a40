"""DeepSpeed ZeRO-1/2's optimizer step: this GPU's gradient partition flattened and cast to fp32.

What ``--zero 1`` / ``--zero 2`` run where the profile's ZeRO is DeepSpeed's (``FrameworkProfile.zero3_buffers``) and
its ZeRO optimizer reduces through contiguous buckets (:func:`memplan.estimate.zero12_bucket.runs_zero_optimizer`).
DeepSpeed 0.19.8, runtime/zero/stage_1_and_2.py ``step``: for each parameter group, ``flatten(averaged_gradients)``
(a copy in the gradients' dtype) is cast to fp32 (``single_grad_partition``, the fp32 partition's ``.grad``), both
alive at the cast beside the gradient partition (freed after): ``partition x (4 + the gradients' bytes where not
fp32)`` at the optimizer step (measured, docs/benchmarks.md, helper zero17: Z1 world size 1, Z2 and Z6 world size 2).
At stage 1 the backward's epilogue has cleared the full gradients by then (``_clear_param_grad_only``): the step
holds the partition only (the rest is ``absent`` there). An offloaded optimizer's gradients are in host memory
already; BF16_Optimizer's are its fp32 buffer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from memplan.estimate.context import StageContext
from memplan.estimate.ledger import ABSENT, TEMPORARY, Contribution
from memplan.estimate.zero12_bucket import runs_zero_optimizer
from memplan.estimate.zero3_buffers import flat_fp32_bytes

if TYPE_CHECKING:
    from memplan.estimate.stage_states import StageStates

__all__ = ["contributions"]


def contributions(ctx: StageContext, st: StageStates) -> list[Contribution]:
    """The optimizer step's flat copy and fp32 cast of the gradient partition, and ZeRO-1's full gradients absent
    there; nothing with the optimizer offloaded."""
    run = ctx.run
    if run.job.offload.optimizer or not runs_zero_optimizer(ctx):
        return []
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
