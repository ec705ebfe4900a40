"""PyTorch's ``save_on_cpu`` (per-tensor activation offload) in the reserved-memory schedule (issue 25,
item 8; :mod:`memplan.estimate.reserved_sim`).

Under ``save_on_cpu`` every tensor autograd saves is copied to host memory when it is saved, so a
layer's forward keeps nothing on the GPU: its tensors are made and freed as the forward moves on
(:func:`~memplan.estimate.reserved_forward.layer_blocks`: all of them, an eager core's score temporaries
too), and its backward brings the saved tensors back one operator's at a time (the estimate's ``bring_back``, the
largest tensor a layer saved, beside the layer's backward transient). Under ``torch.autocast`` the
16-bit weight copies are the exception: autocast's cache keeps each one (the head's too) on the GPU
until the forward's autocast region exits, after the loss's forward
(:data:`memplan.estimate.stage_activations.OFFLOADED_COPIES_NOTE`), so in the schedule they are
cached copies, freed after the loss.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from memplan.estimate.context import StageContext
from memplan.estimate.layer_walk import LayerWalk
from memplan.estimate.reserved_autocast import layer_cached_copies
from memplan.estimate.stage_activations import StageActivations, cached_adapter_copies


@dataclass(frozen=True)
class OffloadedPlan:
    """The schedule's inputs under ``save_on_cpu``."""

    #: The walk with nothing kept per layer and each layer's backward transient grown by its bring-back.
    walk: LayerWalk
    #: Per layer the weight copies autocast's cache holds until the loss (saved ones included).
    cached: list[list[int]]
    #: The head's copy, held by the cache from the head until the loss's forward returns.
    head_cached: int


def offloaded_plan(ctx: StageContext, walk: LayerWalk, layers: list[int], acts: StageActivations,
                   units: tuple[list[list[int]] | None, list[list[int]]]) -> OffloadedPlan:
    """The schedule's walk and cached copies for an offloaded stage (see the module); ``units``: the
    trainable tensors (:func:`~memplan.estimate.reserved_trainable.trainable_units`) and per layer the
    weight copies autograd saves (:func:`~memplan.estimate.reserved_autocast.layer_weight_copies`)."""
    trained, saved = units
    per_layer = [(index, 0, transient + (acts.bring_back if index not in ctx.recomputed else 0))
                 for index, _, transient in walk.per_layer]
    plain = replace(walk, per_layer=per_layer)
    run = ctx.run
    adapters = sum(cached_adapter_copies(ctx, i, True) for i in layers) if run.counts is not None else 0
    base = layer_cached_copies(ctx, layers, walk.recomputed_copies + adapters, trained, offloaded=True)
    cached = [list(c) + list(s) for c, s in zip(base, saved)]
    head = acts.autocast_cache - sum(map(sum, cached))
    if head < 0 or (walk.recomputed_copies + adapters and not any(base)):
        return OffloadedPlan(plain, [[] for _ in layers], 0)  # not laid out: the ledger's top-up holds them
    return OffloadedPlan(plain, cached, head)
