"""DeepSpeed without ZeRO: the engine's flattened all-reduce of the gradients at the accumulation boundary.

DeepSpeed 0.19.8 (runtime/engine.py): without ZeRO the engine's ``allreduce_gradients`` runs
``buffered_allreduce_fallback`` after the backward that ends the accumulation; ``allreduce_no_retain`` gathers the
gradients (one dtype at a time) into buckets, flushing one once it holds more than ``MEMORY_OPT_ALLREDUCE_SIZE``
(5e8) elements, and ``allreduce_bucket`` flattens each (``self.flatten(bucket)``: a new tensor), converts it to
``communication_data_type`` where that differs (another), all-reduces and copies the result back. So beside every
gradient the end of the backward holds ``min(P, elements + largest tensor)`` gradients' copy (this GPU's largest
tensor: its stage's, split by TP). Measured (E10, world
size 1, tiny4 Llama, docs/benchmarks.md, helper dsfree15): 7,352,832 B alive at the all-reduce, the whole bf16
gradients; the bucket keys (``reduce_bucket_size``, ``contiguous_gradients``, ...) change nothing (E11, ds15).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from memplan.estimate.context import StageContext
from memplan.estimate.ledger import COMMUNICATION, TEMPORARY, Contribution
from memplan.job import Job
from memplan.profiles.framework import FrameworkProfile
from memplan.units import dtype_bytes

if TYPE_CHECKING:
    from memplan.estimate.stage_states import StageStates

__all__ = ["applies", "contributions"]

_END = ("end of backward",)


def applies(job: Job, profile: FrameworkProfile) -> bool:
    """The profile's engine all-reduces flattened gradient buckets without ZeRO (``stage0_allreduce_elements``)."""
    return bool(profile.stage0_allreduce_elements) and job.sharding.zero == 0 and job.sharding.fsdp == "none"


def contributions(ctx: StageContext, st: StageStates) -> list[Contribution]:
    """The flattened bucket (and its copy in ``communication_data_type``) at the end of the backward."""
    from memplan.estimate.zero3_buffers import communication_dtype, largest_tensor

    run = ctx.run
    prec = run.prec
    total = st.states.gradients // max(prec.grad_bytes, 1)
    # the tensor that passes the threshold: the largest this GPU holds where it trains (its stage's, split by tensor
    # parallelism; adapters are small beside it)
    trains_weights = st.ft is None or bool(st.ft.full or st.ft.copies)
    cap = run.profile.stage0_allreduce_elements + (largest_tensor(ctx) if trains_weights else 0)
    elements = min(total, cap)
    out = [Contribution(COMMUNICATION, elements * prec.grad_bytes, _END, note=(
        f"DeepSpeed without ZeRO: the engine's all-reduce flattens up to {elements:,} {prec.grad} gradients into one "
        f"bucket (allreduce_no_retain: {run.profile.stage0_allreduce_elements:,} elements and the tensor that passes "
        "them) after the backward, beside every gradient"))]
    comm = communication_dtype(run)  # the model's dtype by default, as the gradients' at stage 0
    if comm != prec.grad and elements:
        out.append(Contribution(TEMPORARY, elements * dtype_bytes(comm), _END, note=(
            f"DeepSpeed without ZeRO: that bucket copied to {comm} (communication_data_type) for the all-reduce")))
    return out
