"""What the op-by-op walk of a recomputed layer's backward (:mod:`~memplan.estimate.recomputed_backward`) takes,
and when: each tensor the layer's (recomputed) forward saves, with its role in the walk's plans and the moment
the walk makes it. A whole recomputed layer's tensors are all there when its backward starts; under Megatron's
sub-module checkpoints (:mod:`~memplan.estimate.recompute_modules`) the kept ones are, and each checkpointed
block's are made again where that block's backward starts: the MLP block's (its norm's among them) first, the
attention block's (the input norm and the core) after the MLP block's tensors are freed. The checkpoints' kept
inputs and the tensors only their recompute makes (:func:`~memplan.estimate.recompute_modules.recomputed_only_terms`)
are added.
"""

from __future__ import annotations

from memplan.estimate.activations import KEPT_BY, divided, layer_terms
from memplan.estimate.context import RunContext
from memplan.estimate.recompute_modules import (
    ATTENTION_SITES,
    checkpoint_input_terms,
    recomputed_only_terms,
    term_site,
)
from memplan.estimate.terms import TermRole

#: Roles of a saved tensor in the walk (:func:`saved_tensors`) beside a slot of the op-by-op plans' ``SLOTS``
#: (0 and up): freed before the core's backward, after it, or the last post-norm's normalized input.
EARLY, LATE, NORMALIZED = -1, -2, -3
#: When the walk takes a tensor: saved by the forward, or made again where the MLP block's or the attention
#: block's backward starts (a sub-module checkpoint's).
KEPT, AT_MLP, AT_ATTENTION = 0, 1, 2

def saved_tensors(run: RunContext, index: int) -> list[tuple[int, int, int]]:
    """The tensors layer ``index`` saves (its recomputed forward's), as (bytes, role, when): a slot of the
    op-by-op plans, or freed before the core's backward (``EARLY``), after it (``LATE``), or the last
    post-norm's normalized input (``NORMALIZED``, freed in that norm's backward); taken when the forward
    saved it (``KEPT``) or when a sub-module checkpoint makes it again (:func:`taken_when`)."""
    from memplan.estimate.reserved_backward import early_terms  # beside the tally's classes (as the walk's)
    from memplan.estimate.reserved_mlp_backward import term_slots
    from memplan.estimate.reserved_terms import term_tensors

    layer, shape, dropped = run.model.layers[index], run.shape, run.dropped
    out: list[tuple[int, int, int]] = []
    for term, early in zip(layer_terms(layer, shape), early_terms(layer, run)):
        if dropped and term.keep not in KEPT_BY["none"]:
            continue  # saved under another policy only (the attention module's checkpointed input)
        size, when = divided(term, shape), taken_when(term_site(term), dropped)
        if term.role is TermRole.POST_NORM_NORMALIZED:
            one = size // max(layer.num_post_norms, 1)
            out += [(size - one, EARLY, when), (one, NORMALIZED, when)]
            continue
        pieces = term_tensors(term, size, layer, run)
        found = term_slots(term.role, len(pieces), run)
        roles = [EARLY if early else LATE] * len(pieces) if found is None else found
        out += ((piece, role, when) for piece, role in zip(pieces, roles))
    if dropped:
        modules = run.policy.modules
        out += [(divided(t, shape), LATE if t.site in ATTENTION_SITES else EARLY, KEPT)
                for t in checkpoint_input_terms(layer, shape, modules)]
        out += [(divided(t, shape), LATE if t.site in ATTENTION_SITES else EARLY, taken_when(t.site, dropped))
                for t in recomputed_only_terms(layer, shape, modules)]
    return out


def taken_when(site: str, dropped: frozenset[str]) -> int:
    """When the walk takes a tensor of ``site``: kept, or where its block's backward starts (``dropped``)."""
    if site not in dropped:
        return KEPT
    return AT_ATTENTION if site in ATTENTION_SITES else AT_MLP
