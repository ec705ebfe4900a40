"""FSDP2 under a pipeline schedule: every block of the stage stays unsharded for the whole step, and
its gradients accumulate unsharded in the reduce dtype until the last micro-batch.

Two rules meet on a pipeline stage that ``fully_shard`` wrapped (profiles with
:attr:`~memplan.profiles.framework.FrameworkProfile.pipeline_fsdp_unsharded`):

* torchtitan's ``apply_fsdp`` (``fsdp_reshard_after_forward = "default"``, every release since the
  pipelining of December 2024: ``reshard_after_forward = not pp_enabled``; the final norm and the
  output are never resharded after forward) keeps each block's all-gathered compute-dtype
  parameters after its forward, so a block is not gathered again per micro-batch;
* torch's pipelining stage (``torch/distributed/pipelining/stage.py``,
  ``backward_maybe_with_nosync``) runs every micro-batch's backward with
  ``set_requires_gradient_sync(False)`` and ``set_reshard_after_backward(False)``; FSDP's
  ``post_backward`` then neither reshards nor reduce-scatters, and ``to_accumulated_grad_if_needed``
  / ``accumulate_unsharded_grad_if_needed`` (``_fsdp_param.py``) turn the compute-dtype gradient
  into an unsharded ``unsharded_accumulated_grad`` of the reduce dtype and add each later
  micro-batch's into it. Only after the last micro-batch (``perform_reduce_grad``, torch 2.13; inside
  the last ``backward_maybe_with_nosync`` in torch 2.5-2.7) does ``post_backward`` reduce-scatter
  the accumulated gradients and reshard the parameters.

So from the first forward to the end of the backward a GPU of the stage holds all its parameters
(after tensor parallelism) unsharded in the compute dtype; from the first micro-batch's backward on,
all their gradients unsharded in the reduce dtype, beside the compute-dtype gradient of the layer
whose backward runs; the sharded gradients appear only at the reduce-scatter, unit by unit as the
accumulated ones are released (its worst moment: the first unit's reduce-scatter input beside
all the accumulated gradients). The optimizer step
runs on resharded parameters. These replace the two prefetched blocks of plain FSDP
(:func:`memplan.estimate.extras.communication_by_phase`).

The moment of most memory is a backward with every in-flight micro-batch alive and the gradients
accumulated. On the first stage of a 1F1B schedule with as many micro-batches as stages, the only
backward with ``pp`` micro-batches in flight is the first one (no gradients yet); the next one has
one micro-batch fewer: the stage's worst backward is the larger of the two. The interleaved schedule
is priced with every gradient accumulated at its most micro-batches in flight (an upper bound).

Known limitations: FP8 all-gathers (unsharded weights in 8 bits) are priced in the compute dtype;
``fsdp_reshard_after_forward = "always"`` under PP is priced as the default; fine-tuning jobs keep the
plain FSDP pricing (torchtitan pipelines train every weight), and their estimate says so (:func:`finetune_note`).
"""

from __future__ import annotations

from collections.abc import Iterator

from memplan.estimate.context import StageContext
from memplan.estimate.ledger import ABSENT, COMMUNICATION, GRADIENTS, TEMPORARY, Contribution
from memplan.estimate.stage_activations import StageActivations
from memplan.estimate.stage_states import StageStates
from memplan.units import dtype_bytes

__all__ = ["applies", "finetune_note", "pipeline_fsdp_contributions"]

_HELD = ("loss", "backward", "end of backward")
_BEFORE_REDUCE = ("loss", "backward", "forward", "end of backward")


def _pipelined_fsdp(ctx: StageContext) -> bool:
    """Whether the stage runs FSDP2 under a pipeline schedule on a profile that keeps its blocks unsharded."""
    job = ctx.job
    return (ctx.profile.pipeline_fsdp_unsharded and job.parallel.pp > 1 and job.sharding.fsdp != "none"
            and ctx.profile.torch_optimizer)


def applies(ctx: StageContext, st: StageStates) -> bool:
    """Whether the stage runs FSDP2 under a pipeline schedule that keeps its blocks unsharded (a job that
    trains every weight: fine-tuning keeps the plain FSDP pricing, :func:`finetune_note`)."""
    return _pipelined_fsdp(ctx) and st.ft is None


def finetune_note(ctx: StageContext, st: StageStates) -> Contribution | None:
    """The sentence that says a fine-tuning job under FSDP and a pipeline schedule is priced as plain FSDP
    (nothing when the profile does not keep pipelined blocks unsharded, or the job trains every weight)."""
    if st.ft is None or not _pipelined_fsdp(ctx):
        return None
    return Contribution(COMMUNICATION, 0, ("backward",), note=(
        f"fine-tuning under FSDP with pipeline parallelism is priced as plain FSDP (blocks resharded after "
        f"use): {ctx.profile.name}'s pipelines keep a stage's blocks unsharded from the first forward to the "
        f"end of the backward when they train every weight, and memplan does not model that lifetime for a "
        f"frozen base with adapters"))


def pipeline_fsdp_contributions(ctx: StageContext, st: StageStates,
                                acts: StageActivations) -> Iterator[Contribution]:
    """The unsharded parameters, the accumulated unsharded gradients and the final reduce-scatter's
    input of one GPU of the stage, at each moment (the caller checked :func:`applies`)."""
    params = st.params
    compute, reduce = dtype_bytes(ctx.prec.compute), ctx.prec.reduce_bytes
    unsharded = params.total * compute
    accumulated = params.total * reduce
    layer_grad = params.largest_layer * compute  # the layer's gradient before it is added in
    yield Contribution(COMMUNICATION, unsharded, _HELD + ("forward",), note=(
        f"FSDP under pipeline parallelism ({ctx.profile.name} keeps reshard_after_forward=False, the stage "
        f"defers the reduce-scatter to the last micro-batch): the stage's {params.total:,} parameters per GPU "
        f"stay unsharded in {ctx.prec.compute} from the first forward to the end of the backward"))
    yield Contribution(GRADIENTS, accumulated, ("loss", "end of backward"), note=(
        f"their gradients accumulate unsharded in {ctx.prec.reduce or ctx.prec.grad} over the micro-batches "
        f"(FSDP's unsharded_accumulated_grad); the sharded gradients exist only after the reduce-scatter"))
    yield Contribution(GRADIENTS, max(0, accumulated - _fewer_in_flight(ctx, acts)), ("backward",))
    yield Contribution(TEMPORARY, layer_grad, ("backward",))
    # The final reduce-scatter copies one FSDP unit's accumulated gradients into its input buffer; the
    # sharded gradients replace the accumulated ones unit by unit (at the first unit, none exist yet).
    yield Contribution(COMMUNICATION, max(params.largest_layer, params.root) * reduce, ("end of backward",))
    yield Contribution(ABSENT, st.states.gradients, _BEFORE_REDUCE)


def _fewer_in_flight(ctx: StageContext, acts: StageActivations) -> int:
    """Activations of the micro-batch fewer in flight at the first backward with gradients accumulated:
    one micro-batch's on a single-chunk stage whose in-flight count equals the micro-batches, else 0."""
    layout = ctx.layout
    inflight = layout.inflight_microbatches
    if len(layout.chunks) != 1 or inflight < ctx.job.num_microbatches or inflight == 0:
        return 0
    return acts.layers // inflight
