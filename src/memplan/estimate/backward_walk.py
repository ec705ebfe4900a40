"""The ledger's backward moment walked layer by layer (:mod:`memplan.estimate.stage_peak`), and the layer it
stops at, which the reserved-memory schedule checks the ledger in (:mod:`memplan.estimate.reserved_layers`).

A backward that starts without gradients (``zero_grad(set_to_none=True)``, one micro-batch in flight, one
model chunk) visits the layers last to first; when it reaches a layer, the later layers have released what
they kept and made their gradients. Where a layer keeps less than its gradients weigh (recompute, short
sequences, ``save_on_cpu``) the worst layer is the first one, otherwise the last one. Under FSDP2 each layer's step
holds FSDP's own tensors too (:mod:`~memplan.estimate.fsdp_block_backward`).
"""

from __future__ import annotations

from typing import NamedTuple

from memplan.estimate.context import StageContext
from memplan.estimate.fsdp_block_backward import block_backward
from memplan.estimate.layer_walk import LayerWalk
from memplan.estimate.mask_lifetime import mask_releases, released_masks
from memplan.estimate.stage_activations import StageActivations, head_numel
from memplan.estimate.stage_states import StageStates
from memplan.estimate.states import layer_numel_on_rank
from memplan.estimate.step_gradients import made_in_backward, whole_partition_after
from memplan.model.params import final_norm_params


class WalkedBackward(NamedTuple):
    """The ledger's backward moment: what it holds at its worst layer, and where that layer is."""

    #: Layer activations still kept (the layers before the worst one, and its own), less the shared masks
    #: already released (:mod:`memplan.estimate.mask_lifetime`).
    layers: int
    #: Temporaries: the worst layer's backward working set and the gradients made before it (the head's too).
    temp: int
    #: The worst layer's position in :attr:`LayerWalk.per_layer`; None where the moment is not walked (every
    #: layer's activations beside the worst working set: the last layer's backward) or the stage has no layer.
    position: int | None
    #: Whether the moment was walked layer by layer.
    walked: bool


#: Frameworks that free gradients after each step (zero_grad(set_to_none=True)) hold none during the forward, the loss
#: and the start of the backward of a step's only micro-batch; the backward then builds them up while it frees
#: activations: the head's gradient first (:func:`memplan.estimate.step_gradients.made_in_backward`).
no_grads_yet = made_in_backward


def head_gradients(ctx: StageContext, st: StageStates) -> int:
    """The output head's and the final norm's gradients, made before any layer's backward (where the backward
    starts without gradients and the whole model trains; else 0)."""
    if not (no_grads_yet(ctx) and st.ft is None and ctx.layout.has_head):
        return 0
    numel = head_numel(ctx) + final_norm_params(ctx.run.model)
    return st.states.gradients * numel // max(st.params.total, 1)


def walked_backward(ctx: StageContext, st: StageStates, walk: LayerWalk, acts: StageActivations) -> WalkedBackward:
    """The ledger's backward moment (see the module): the output head's gradient (a tied one waits in autograd's
    buffer) and the final norm's made first, the embedding's last, after every layer; walked layer by layer
    where the backward starts without gradients, else every layer's activations beside the worst working set."""
    run, layout = ctx.run, ctx.layout
    grads_yet = no_grads_yet(ctx)
    head_grads = head_gradients(ctx, st)
    fsdp = block_backward(ctx, st, walk)  # FSDP2's own tensors at each block's backward
    if not (grads_yet and layout.inflight_microbatches == 1 and len(layout.chunks) == 1
            and (not run.job.offload.activations or acts.per_tensor_offload)):
        return WalkedBackward(acts.layers, acts.worst_backward + head_grads + (fsdp.last if fsdp else 0), None, False)
    per_param = st.states.gradients / max(st.params.total, 1)
    remaining, made = acts.layers, head_grads
    whole_after, numel = whole_partition_after(ctx), int(head_grads / per_param) if per_param else 0
    best = WalkedBackward(acts.layers, head_grads, None, True)
    best_total = -1
    # a mask kind's last user in the backward is its lowest layer: below it the mask is gone
    releases = mask_releases(run.model, layout.layer_indices, acts.masks) if acts.masks else ()
    early = walk.early_gradients if fsdp is None else fsdp.early(walk.early_gradients)
    for position in range(len(walk.per_layer) - 1, -1, -1):
        index, kept, worst = walk.per_layer[position]
        worst += early.get(index, 0)  # the layer's own gradients made before its worst op (and FSDP2's tensors)
        held = remaining - released_masks(releases, index) if releases else remaining
        if whole_after is not None and numel >= whole_after:
            made = st.states.gradients  # ZeRO-2's contiguous partition, allocated whole: the later ones go into it
        if held + made + worst > best_total:
            best_total, best = held + made + worst, WalkedBackward(held, made + worst, position, True)
        remaining -= 0 if acts.per_tensor_offload else kept
        dense, expert = layer_numel_on_rank(ctx.model.layer_param_groups[index], ctx.job)
        made += int((dense + expert) * per_param) if made < st.states.gradients else 0
        numel += dense + expert
    return best
