"""Mechanic: when the backward releases the 4-D attention masks checkpointed layers keep.

Eager attention gets one additive ``(batch, 1, seq, seq)`` mask per kind of layer (global; sliding-window),
built once per forward (:func:`memplan.estimate.extras.checkpointed_mask_bytes`). A checkpointed layer or
attention module keeps its inputs, the mask of its kind among them, until its backward has run
(``torch.utils.checkpoint``: the recompute's closure holds them until the layer's graph is freed); once the
forward has returned nothing else refers to the mask. So a kind's mask is freed after the backward of the
last layer of that kind the backward visits: the stage's lowest-index one. On gpt-oss's alternating sliding
and full layers the full mask goes after layer 1's backward, the sliding one after layer 0's.
"""

from __future__ import annotations

from memplan.model.spec import ModelSpec


def mask_releases(model: ModelSpec, layer_indices: tuple[int, ...] | list[int],
                  masks: int) -> tuple[tuple[int, int], ...]:
    """Per kind of layer with a layer on the stage: (its lowest layer index on the stage, its mask's bytes),
    from ``masks``, the bytes of every kind's mask held (one mask per kind of the model, all the same size). A
    kind without a layer on the stage keeps its mask (nothing on the stage releases it)."""
    kinds = {layer.attention.sliding_window for layer in model.layers}
    first: dict[object, int] = {}
    for index in layer_indices:
        kind = model.layers[index].attention.sliding_window
        first[kind] = min(first.get(kind, index), index)
    share = masks // max(len(kinds), 1)
    return tuple((index, share) for index in first.values())


def released_masks(releases: tuple[tuple[int, int], ...], index: int) -> int:
    """The masks already released when the backward reaches layer ``index``: those whose last user (in the
    backward's order) comes after it."""
    return sum(nbytes for first, nbytes in releases if first > index)
