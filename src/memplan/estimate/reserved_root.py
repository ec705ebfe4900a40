"""The root unit's gradients in a reserved-memory schedule without FSDP (issue 25, item 8;
:mod:`memplan.estimate.reserved_sim`; FSDP2's own order is :mod:`memplan.estimate.reserved_fsdp`).

Autograd makes the output head's weight gradient in the head's backward, right after the loss, and
keeps it through the whole backward; the embedding's gradient comes last (``embedding_dense_backward``).
With tied embeddings both are gradients of one parameter: autograd sums them into a third tensor
(``aten.add``) that becomes ``.grad``, and frees the two, as a trace of a tied model shows at the end of
its backward. The head's gradient is the root's largest trainable tensor (the embedding's, when tied).
"""

from __future__ import annotations

from dataclasses import dataclass

from memplan.alloc.blocks import Block


@dataclass(frozen=True)
class RootGradients:
    """The root unit's gradient sizes, split as the backward makes them."""

    #: The head's weight gradient (0: the head does not train or the stage has none).
    head: int
    #: The root's other gradients (the embedding's first when untied).
    rest: list[int]
    tied: bool


def root_gradients(sizes: list[int], has_head: bool, tied: bool, position: int | None = None) -> RootGradients:
    """Split the root's gradient tensors ``sizes`` into the head's and the rest: the head's is at ``position``
    (the head's own tensor, :func:`~memplan.estimate.reserved_sizes.head_position`), else the largest (a tied
    head's is the embedding's; a fine-tuned root lists only its trainable tensors). Under Hugging Face's TP plan an
    untied head is split and the embedding whole: the largest was the embedding's, so the schedule made the
    embedding's whole gradient right after the loss and the head's share at the end, where a trace of qwen2.5-7b
    (cut to 4 layers, TP 2) makes the head's 1,040 MiB ``_to_copy`` after the loss and the embedding's 2,079 MiB
    ``embedding_dense_backward`` at the end."""
    if not has_head or not sizes:
        return RootGradients(0, list(sizes), tied)
    at = position if position is not None and position < len(sizes) else max(range(len(sizes)),
                                                                               key=sizes.__getitem__)
    return RootGradients(sizes[at], sizes[:at] + sizes[at + 1:], tied)


def finish_root(replay: object, root: RootGradients,
                head: Block | None) -> tuple[list[Block | None], list[Block | None]]:
    """At the end of the backward: the embedding's gradient beside the head's ``head`` (when tied, their
    sum made), then the root's other gradients. Returns the blocks alive after the step's backward and
    the tied pair, which autograd frees right after the sum (the caller frees them after the ledger's
    end-of-backward moment, which counts them)."""
    take = replay.take  # type: ignore[attr-defined]
    if root.tied and head is not None:
        embedding = take(root.head)
        total = take(root.head)
        return [total, *(take(size) for size in root.rest)], [head, embedding]
    return [head, *(take(size) for size in root.rest)], []
