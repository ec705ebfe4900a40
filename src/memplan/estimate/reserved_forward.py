"""A decoder layer's forward in the reserved-memory schedule (issue 25, item 8;
:mod:`memplan.estimate.reserved_sim`): the tensors it saves, split as a trace allocates them
(:mod:`~memplan.estimate.reserved_terms`), those a recompute policy drops made and freed, autocast's
weight copies between them, and each pre-norm's fp32 output under autocast held until its block ends
(:func:`~memplan.estimate.reserved_terms.norm_output`)."""

from __future__ import annotations

from memplan.alloc.blocks import Block
from memplan.estimate.activations import divided, layer_terms
from memplan.estimate.context import StageContext
from memplan.estimate.reserved_backward import early_terms
from memplan.estimate.reserved_replay import Replay
from memplan.estimate.reserved_terms import DROPPED, HELD, KEPT, RELEASE, norm_output, term_tensors


def layer_blocks(ctx: StageContext, index: int, kept: int) -> list[tuple[int, int, bool]]:
    """The tensors layer ``index``'s forward makes, in order, as (size, kind, early): its terms when the kept
    ones add up to ``kept`` (those a recompute policy drops are made and freed in the forward), else one
    block; ``kind`` one of :data:`KEPT`, :data:`DROPPED`, :data:`HELD` (a pre-norm's output held to its
    block's end, :func:`~memplan.estimate.reserved_terms.norm_output`) or :data:`RELEASE` (size 0: the held
    ones freed); ``early``: freed before an eager softmax backward (:mod:`~memplan.estimate.reserved_backward`)."""
    run = ctx.run
    layer = run.model.layers[index]
    terms: list[tuple[int, int, bool]] = []
    saved = layer_terms(layer, run.shape)
    named = {t.name: divided(t, run.shape) for t in saved}
    for t, early in zip(saved, early_terms(layer, run)):
        size = divided(t, run.shape)
        if t.name.endswith("norm input") and terms:
            terms.append((0, RELEASE, False))
        if t.name.endswith("norm output (GEMM input)"):
            terms.append((norm_output(t.name, named, run), HELD, False))
        keep = KEPT if t.keep in run.kept_classes and t.site not in run.dropped else DROPPED
        terms += [(piece, keep, early) for piece in term_tensors(t.name, size, layer, run)]
    terms = [term for term in terms if term[0] > 0 or term[1] == RELEASE] + [(0, RELEASE, False)]
    if sum(size for size, kind, _ in terms if kind == KEPT) != kept:
        return [(kept, KEPT, False)]
    return terms if ctx.run.counts is None else [term for term in terms if term[1] == KEPT]


def forward_layer(replay: Replay, tensors: list[tuple[int, int, bool]], copies: list[int]
                   ) -> tuple[list[Block | None], list[Block | None]]:
    """A layer's forward: its tensors in order, a dropped one freed once the next is made, a held one at
    the next release; autocast's weight copies made between them, spread evenly (each linear casts its
    weight when it runs). Returns the kept blocks the backward frees early, and the others."""
    held: tuple[list[Block | None], list[Block | None]] = ([], [])
    pending, holding = None, []
    done = 0
    made = [t for t in tensors if t[1] != RELEASE]
    position = 0
    for size, kind, early in tensors:
        if kind == RELEASE:
            replay.give(*holding)
            holding = []
            continue
        position += 1
        due = -(-position * len(copies) // len(made))
        held[not early].extend(replay.take_all(copies[done:due]))
        done = max(done, due)
        block = replay.take(size)
        replay.give(pending)
        pending = None
        if kind == KEPT:
            held[not early].append(block)
        elif kind == HELD:
            holding.append(block)
        else:
            pending = block
    replay.give(pending, *holding)
    held[1].extend(replay.take_all(copies[done:]))
    return held
