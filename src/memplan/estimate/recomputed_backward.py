"""What a fully recomputed layer's backward holds beyond the tensors its recomputed forward saved, op by op.

Under full activation checkpointing (Hugging Face's non-reentrant ``torch.utils.checkpoint``) a layer's
backward first runs its forward again, saving every tensor a kept layer saves (the allocated peak counts
them as the layer's ``full`` figure), then runs its backward proper. The worst moment of that backward is
not "two of the largest saved tensors" (the rule a layer's transient otherwise follows,
:func:`~memplan.estimate.activations.backward_transient_bytes`): a trace shows the ops one at a time,
each freeing what it no longer needs, so this module replays them on a tally of requested bytes
(:class:`~memplan.estimate.reserved_replay.Replay`, never replayed through the allocator) and takes the
most it holds above the saved tensors:

1. the gradient of the layer's output (residual dtype) arrives; under Gemma's post-feedforward norm
   (``(x_normed * (1 + weight)).type_as(x)``) its fp32 upcast too, made before the recompute starts;
2. that norm's eager backward (:func:`rms_norm_backward`): its fp32 temporaries beside its saved input;
3. the gated MLP's backward op by op (:func:`~memplan.estimate.reserved_mlp_backward.mlp_backward`,
   the reserved schedule's own op order), then the rest of the MLP block freed;
4. the eager attention core's backward op by op
   (:func:`~memplan.estimate.reserved_attention_backward.core_backward`).

The layer's weight gradients made before the worst op are tallied apart (:class:`RecomputedBackward`):
they count only where gradients are made during the backward (``zero_grad(set_to_none=True)``).

Under torchtitan's per-op selective checkpointing (SAC) a layer's backward first makes its dropped ops
again, so the same walk applies from the whole layer's tensors; its kept ones are counted once (they are the
layer's kept figure), and the cached op outputs autograd does not save sit beside it, as in the general rule.

The walk applies to a whole-model job on one rank's whole weights
(:func:`~memplan.estimate.reserved_mlp_backward.whole_weights`; with ``save_on_cpu`` activation offload too:
the recompute runs in the backward, outside its hooks, so what it saves stays on the GPU), to an eager
unfused attention core and a gated MLP with separate projections, without post-norms or with Gemma's
fp32-scaled ones; elsewhere the layer keeps the general transient (None).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from memplan.estimate.activations import (
    NORM_COMPUTE_BYTES,
    UNFUSED_ATTENTION,
    divided,
    layer_terms,
)
from memplan.estimate.context import RunContext, StageContext
from memplan.estimate.memo import Same
from memplan.estimate.sac import sac_kept_terms

if TYPE_CHECKING:
    from memplan.estimate.reserved_replay import Block, Replay

#: The sentence --explain gives where a recomputed layer's backward was walked op by op.
NOTE = ("recomputed layers' backward walked op by op (after the recomputed forward or per-op SAC's recomputed ops: "
        "the output gradient, "
        "Gemma's post-norm backward in fp32, the gated MLP's and the eager attention core's backward, each op "
        "freeing what it no longer needs), not priced as two of the layer's largest saved tensors")

_POST_NORMALIZED = "post-norms normalized output"
_QKV = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight")


@dataclass(frozen=True)
class RecomputedBackward:
    """Bytes a recomputed layer's backward holds above its saved tensors at its worst op (one rank)."""

    #: Without the layer's own weight gradients (they are counted elsewhere, or already allocated).
    transient: int
    #: Where the backward makes the gradients (none allocated before): the worst op with the layer's
    #: weight gradients made before it, less ``transient``.
    with_gradients: int


def rms_norm_backward(replay: Replay, fp32: int, normalized: Block | None, upcast: Block | None) -> None:
    """Gemma's eager RMSNorm backward (``(x * rsqrt(mean(x^2) + eps)) * (1 + weight)`` in fp32), op by op as a
    trace shows it (``fp32``: one fp32 tensor of the norm's input size): the incoming gradient times the
    normalized input (summed into the weight's gradient) and times ``1 + weight``; the saved normalized
    input, the product and the gradient's fp32 ``upcast`` freed; the gradient through ``rsqrt`` (two
    products, one summed); then the mean's and the square's backward (``div``, ``pow``, ``* 2``, ``* grad``:
    the worst op), the two input gradients summed."""
    product, scaled = replay.take(fp32), replay.take(fp32)
    replay.give(normalized, product, upcast)
    through, grad_x = replay.take(fp32), replay.take(fp32)
    replay.give(through, scaled)
    mean, power, doubled, grad_square = (replay.take(fp32) for _ in range(4))
    replay.give(doubled, power, mean)
    summed = replay.take(fp32)
    replay.give(grad_x, grad_square, summed)


def recomputed_backward(ctx: StageContext, index: int, copies: int) -> RecomputedBackward | None:
    """Layer ``index``'s recomputed backward walked op by op (see the module), or None where the walk does
    not apply (the layer keeps its general transient). ``copies``: the autocast weight copies its recomputed
    forward made (:func:`~memplan.estimate.layer_costs.recomputed_copies_bytes`), each freed once its
    linear's backward is done: the MLP's and the output projection's before the core's backward, the
    q/k/v projections' after it. The layer's input, which its saved tensors count, is the checkpoint's
    own kept input (the recomputed forward reads it, no copy): the figures are net of it, except under
    ``save_on_cpu``, where the input brought back from host memory is a new tensor."""
    run = ctx.run
    layer, shape = run.model.layers[index], run.shape
    whole = index in ctx.recomputed and not run.policy.partial
    sac = sac_kept_terms(layer, shape) if run.policy.kind.per_op and not whole else None
    # activation offload (save_on_cpu) leaves it: the recompute runs in the backward, outside its hooks
    if (not (whole or sac is not None) or shape.kernels != "eager" or shape.attention not in UNFUSED_ATTENTION
            or (layer.num_post_norms and not shape.norm_fp32_scale)):
        return None
    # the reserved schedule's op plans (and the allocator's tally) are imported only for the jobs they serve
    from memplan.estimate.reserved_mlp_backward import whole_weights

    if not whole_weights(run):
        return None
    key = (Same(run.model), index, shape, run.policy, run.job.offload.activations, run.prec.grad_bytes, copies)
    return _figures(_Keyed(key, run), sac is not None)


class _Keyed:
    """A memo key: the values the walk reads (``key``), carrying the run that supplies them (not compared), so
    that estimates of one model under one shape and policy (a fit search's layouts) walk each layer once."""

    __slots__ = ("key", "run")

    def __init__(self, key: tuple[object, ...], run: RunContext) -> None:
        self.key, self.run = key, run

    def __hash__(self) -> int:
        return hash(self.key)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Keyed) and other.key == self.key


@lru_cache(maxsize=1024)
def _figures(keyed: _Keyed, per_op: bool) -> RecomputedBackward | None:
    """:func:`recomputed_backward`'s figures (``per_op``: a per-op SAC layer, else a whole recomputed one)."""
    from memplan.estimate.reserved_mlp_backward import layer_gradient_sizes

    run, index, copies = keyed.run, keyed.key[1], keyed.key[6]
    assert isinstance(index, int) and isinstance(copies, int)
    layer, shape = run.model.layers[index], run.shape
    tensors = _saved(run, index)
    without = _walk(run, index, copies, None, tensors)
    if without is None:
        return None
    with_grads = _walk(run, index, copies, layer_gradient_sizes(run.model, index, run.prec.grad_bytes), tensors)
    sac = sac_kept_terms(layer, shape) if per_op else None
    if sac is not None:
        # per-op SAC: the layer's kept tensors (its input among them) are not counted again in what it rebuilds;
        # the cached op outputs autograd does not save sit beside its backward (as in the general rule)
        extra = sum(divided(t, shape) for t in sac[1])
    else:
        # under save_on_cpu the kept input is in host memory: the copy brought back is the recompute's own
        extra = -sum(divided(t, shape) for t in layer_terms(layer, shape)
                     if t.keep == "input") if not run.job.offload.activations else 0
    return RecomputedBackward(transient=without + extra, with_gradients=max(0, (with_grads or 0) - without))


def _copies_split(run: RunContext, index: int, copies: int) -> tuple[int, int]:
    """The layer's autocast weight copies (``copies`` bytes) as (freed before the core's backward, after it):
    the q/k/v projections' are the latter (all of them where the layer has no separate q/k/v weights)."""
    from memplan.estimate.reserved_mlp_backward import grad_positions, layer_gradient_sizes

    model = run.model
    numels = layer_gradient_sizes(model, index, 1)
    positions = grad_positions(model, index, len(numels), _QKV)
    total = sum(numels)
    if not copies or positions is None or not total:
        return 0, copies
    late = copies * sum(numels[p] for p in positions) // total
    return copies - late, late


#: Roles of a saved tensor in the walk (:func:`_saved`) beside a slot of :data:`SLOTS` (0 and up).
_EARLY, _LATE, _NORMALIZED = -1, -2, -3


def _saved(run: RunContext, index: int) -> list[tuple[int, int]]:
    """The tensors layer ``index`` saves (its recomputed forward's), as (bytes, role): a slot of the op-by-op
    plans, or freed before the core's backward (``_EARLY``), after it (``_LATE``), or the last post-norm's
    normalized input (``_NORMALIZED``, freed in that norm's backward)."""
    from memplan.estimate.reserved_backward import early_terms  # beside the tally's classes (see _walk)
    from memplan.estimate.reserved_mlp_backward import term_slots
    from memplan.estimate.reserved_terms import term_tensors

    layer, shape = run.model.layers[index], run.shape
    out: list[tuple[int, int]] = []
    for term, early in zip(layer_terms(layer, shape), early_terms(layer, run)):
        size = divided(term, shape)
        if term.name == _POST_NORMALIZED:
            one = size // max(layer.num_post_norms, 1)
            out += [(size - one, _EARLY), (one, _NORMALIZED)]
            continue
        pieces = term_tensors(term.name, size, layer, run)
        found = term_slots(term.name, len(pieces), run)
        roles = [_EARLY if early else _LATE] * len(pieces) if found is None else found
        out += zip(pieces, roles)
    return out


def _walk(run: RunContext, index: int, copies: int, grads: Sequence[int] | None,
          tensors: list[tuple[int, int]]) -> int | None:
    """The most the layer's backward holds above its saved ``tensors`` (:func:`_saved`; ``grads``: the sizes
    of the layer's gradients, made where autograd makes them; None: not counted), or None when a plan does
    not apply."""
    from memplan.alloc.schedule import STREAM_BITS  # the tally's classes, only for the jobs it applies to
    from memplan.estimate.reserved_attention_backward import core_backward, core_plan
    from memplan.estimate.reserved_mlp_backward import SLOTS, layer_gradient_sizes, mlp_backward, mlp_plan
    from memplan.estimate.reserved_replay import Replay

    layer, shape = run.model.layers[index], run.shape
    replay = Replay(repeat=False)
    slots: list[Any] = [None] * len(SLOTS)  # the op-by-op plans' slots (their Block type is the schedule's int)
    freed: tuple[list[Block | None], list[Block | None]] = ([], [])  # before the core's backward, after it
    normalized: Block | None = None
    for (_, role), block in zip(tensors, replay.take_all([size for size, _ in tensors])):
        if role >= 0:
            slots[role] = block
        elif role == _NORMALIZED:
            normalized = block
        else:
            freed[0 if role == _EARLY else 1].append(block)
    saved = replay.requested
    count = len(layer_gradient_sizes(run.model, index, 0))
    # mlp_plan's blocks are typed memplan.alloc.blocks.Block; the replay's are ints (as in reserved_backward)
    mlp = mlp_plan(run, index, slots, count, lambda block: replay.ops[block] >> STREAM_BITS)  # type: ignore[call-overload]
    core = core_plan(run, index, slots, count)
    if mlp is None or core is None:
        return None
    tokens_hidden = shape.seq * shape.micro_batch * run.model.hidden_size
    early_copies, late_copies = (replay.take(size) for size in _copies_split(run, index, copies))
    freed[0].append(early_copies)
    freed[1].append(late_copies)
    incoming = replay.take(tokens_hidden * shape.residual_bytes)
    if layer.num_post_norms:
        fp32 = tokens_hidden * NORM_COMPUTE_BYTES
        rms_norm_backward(replay, fp32, normalized, replay.take(fp32))

    def made(positions: Sequence[int] | None) -> None:
        if grads is not None and positions is not None:
            replay.take_all([grads[p] for p in positions])

    mlp_backward(replay, mlp, slots, made)
    replay.give(*freed[0])
    core_backward(replay, core, slots, made, lambda: None)
    replay.give(incoming, *freed[1])
    return replay.peak_requested - saved
