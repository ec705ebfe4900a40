"""A gated MLP's backward, op by op, in the reserved-memory schedule (issue 25, item 8;
:mod:`memplan.estimate.reserved_sim`).

Hugging Face's gated MLP (``down_proj(act_fn(gate_proj(x)) * up_proj(x))``, separate gate and up
projections) saves four intermediate-sized tensors: the gate and up projections' outputs, ``act(gate)``
and the product that ``down_proj`` reads. A trace of its backward (``aten.mm``, ``aten.mul``,
``aten.silu_backward`` under ``model.layers.N.mlp``) makes and frees them one op at a time, each weight
gradient between the frees of its op's saved tensors:

1. ``down_proj``: its weight gradient, the gradient of its input (one intermediate-sized tensor), then
   its saved input freed;
2. the product's backward: the gradients of ``act(gate)`` and of the up output (two intermediate-sized
   tensors), the first gradient freed, then the up output and ``act(gate)`` freed;
3. ``up_proj``: its weight gradient, the gradient of its input (one hidden-sized tensor), the up
   output's gradient freed;
4. the activation's backward (one intermediate-sized tensor), ``act(gate)``'s gradient and the gate output
   freed;
5. ``gate_proj``: its weight gradient, the gradient of its input, the activation's gradient freed, then
   the two input gradients summed (one hidden-sized tensor) and freed.

The schedule used to make all the layer's gradients at once beside one transient; the allocator sees
the difference: the three large weight gradients land in the holes the MLP's frees open one by one.

The plan applies to a whole (not recomputed) layer of a job that trains the whole model without FSDP2,
when the layer's MLP is gated with separate projections and its four tensors are saved
(:func:`op_slots`); otherwise the layer's backward makes its gradients at once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache

from memplan.estimate.context import RunContext
from memplan.estimate.memo import Same
from memplan.estimate.reserved_experts_backward import EXPERT_TERMS, expert_index
from memplan.estimate.reserved_replay import Block, Replay
from memplan.estimate.terms import TermRole
from memplan.model.linears import model_parameters
from memplan.model.spec import ModelSpec

#: The tensors the plan frees op by op (their slots in a layer's saved lists): the MLP's, in forward order,
#: then the eager attention core's (:mod:`~memplan.estimate.reserved_attention_backward`; the soft-capped scores
#: only where the scores are soft-capped), then gpt-oss's sink softmax output (:mod:`~memplan.estimate.reserved_sinks`,
#: not one of the dense plans'), then gpt-oss's experts' tensors (:data:`~memplan.estimate.reserved_experts_backward.EXPERT_TERMS`).
#: transformers' grouped experts' saved tensors, in forward order (their terms' roles), last
#: (:mod:`~memplan.estimate.reserved_grouped_experts`: a recomputed layer's only).
GROUPED_TERMS = (TermRole.DISPATCHED_TOKENS, TermRole.EXPERT_FC1, TermRole.EXPERT_OTHER, TermRole.EXPERT_FC2,
                 TermRole.EXPERT_OUTPUTS)
SLOTS = ("gate", "up", "act", "product", "output projection input", "probabilities", "softmax output",
         "soft-capped scores", "sink softmax output", *(role.name.lower() for role in EXPERT_TERMS),
         *(f"grouped {role.name.lower()}" for role in GROUPED_TERMS))
SINK_SLOT = 8
#: The first of gpt-oss's experts' slots (:mod:`~memplan.estimate.reserved_experts_backward`, op_slots only).
EXPERT_SLOT = 9
#: The first of transformers' grouped experts' slots.
GROUPED_SLOT = EXPERT_SLOT + len(EXPERT_TERMS)
_ATTENTION_SLOTS = {TermRole.OUTPUT_PROJECTION_INPUT: 4, TermRole.SOFTMAX_CAST: 5, TermRole.SOFTMAX_FP32: 6,
                    TermRole.SOFTCAP_SCORES: 7}
#: The MLP's weights, in the order autograd makes their gradients.
_WEIGHTS = ("mlp.down_proj.weight", "mlp.up_proj.weight", "mlp.gate_proj.weight")


def whole_weights(run: RunContext) -> bool:
    """Whether the job trains the whole model (no adapters or frozen parts: their gradients are other
    tensors) on one rank's whole weights (no TP: the input gradients' sizes are the full hidden size)."""
    return run.counts is None and run.job.parallel.tp <= 1


def op_by_op(run: RunContext) -> bool:
    """Whether the job's layers may be laid out op by op: :func:`whole_weights`, and it keeps its saved
    activations on the GPU (no activation offload)."""
    return whole_weights(run) and not run.job.offload.activations


def op_slots(role: TermRole, pieces: int, run: RunContext, whole: bool) -> list[int] | None:
    """The slot (index in :data:`SLOTS`) of each of the ``pieces`` tensors of a term of ``role``, or None when the
    plan does not apply to it: the gated MLP's fc1 output (gate, up, ``act(gate)``) and its fc2 input, of a
    ``whole`` layer (none of its tensors dropped) in a job laid out :func:`op_by_op`. Under tensor parallelism
    (a whole-model job keeping its activations on the GPU) the gated MLP's alone: each rank holds its share of
    the four intermediate-sized tensors (Hugging Face's plan splits gate and up column-wise, down row-wise; their
    blocks are that share) and the full-width input gradients of gate and up, which :class:`MlpPlan` takes
    (a trace of llama-3.2-1b at TP 2: 8 MiB ``mm`` of 2048 x 2048 in bf16 each); the eager core's plans keep
    TP 1."""
    if not whole or run.counts is not None or run.job.offload.activations:
        return None
    if not whole_weights(run):
        return _mlp_slots(role, pieces)
    expert = expert_index(role, pieces, run)
    return term_slots(role, pieces, run) if expert is None else [EXPERT_SLOT + expert]


def grouped_slots(role: TermRole, pieces: int) -> list[int] | None:
    """The slot of a term of ``role`` (one tensor) among transformers' grouped experts' (:data:`GROUPED_TERMS`),
    else None."""
    return [GROUPED_SLOT + GROUPED_TERMS.index(role)] if pieces == 1 and role in GROUPED_TERMS else None


def term_slots(role: TermRole, pieces: int, run: RunContext) -> list[int] | None:
    """:func:`op_slots` of a whole layer's term, whatever the job (None: not one of :data:`SLOTS`)."""
    mlp = _mlp_slots(role, pieces)
    if mlp is not None:
        return mlp
    if role in _ATTENTION_SLOTS and pieces == 1 and run.shape.kernels == "eager":
        return [_ATTENTION_SLOTS[role]]
    if role is TermRole.SINK_SOFTMAX and pieces == 1 and run.shape.kernels == "eager":
        return [SINK_SLOT]
    return None


def _mlp_slots(role: TermRole, pieces: int) -> list[int] | None:
    """The gated MLP's slots of a term of ``role`` (its fc1 output's three tensors, its fc2 input), else None."""
    if role is TermRole.MLP_FC1 and pieces == 3:
        return [0, 1, 2]
    if role is TermRole.MLP_FC2 and pieces == 1:
        return [3]
    return None


@dataclass(frozen=True)
class MlpPlan:
    """Sizes (bytes) of the MLP backward's temporaries and the positions of its weight gradients."""

    intermediate: int
    hidden: int
    #: Positions in the layer's gradient list of down, up and gate projections' weight gradients.
    grads: tuple[int, int, int]
    #: Bytes of one projection's weight dequantized for its input gradient (a bitsandbytes base,
    #: :mod:`~memplan.estimate.frozen_mlp_backward`), freed after it; 0 otherwise.
    dequantized: int = 0


def mlp_weights() -> tuple[str, ...]:
    """The gated MLP's weights (names relative to the layer), in the order autograd makes their gradients."""
    return _WEIGHTS


def grad_positions(model: ModelSpec, index: int, count: int | None, weights: tuple[str, ...]) -> list[int] | None:
    """Positions of ``weights`` (names relative to the layer) in layer ``index``'s list of ``count`` gradients
    (one per parameter tensor, :func:`~memplan.model.linears.model_parameters` order); None when the list is
    not that (``count`` None: gradients not made in the backward, or under FSDP2) or a weight is missing."""
    if count is None:
        return None
    names = _layer_names(Same(model), index)
    if len(names) != count or any(w not in names for w in weights):
        return None
    return [names.index(w) for w in weights]


def attention_split(model: ModelSpec, index: int, count: int | None) -> tuple[list[int], list[int]] | None:
    """Layer ``index``'s ``count`` gradients split as autograd makes them around the attention core's backward,
    each part in reverse parameter order (autograd's): those made before it (the MLP block's, its norm's and
    the output projection's), and the others (the query, key and value projections', the input norm's, the
    sinks'); None where the list is not one per parameter tensor (see :func:`grad_positions`)."""
    if count is None:
        return None
    names = _layer_names(Same(model), index)
    if len(names) != count:
        return None
    from memplan.estimate.partial_freeze import after_attention_core

    late = [i for i, name in enumerate(names) if after_attention_core(name)]
    return [i for i in reversed(range(count)) if i not in late], late[::-1]


@lru_cache(maxsize=4096)
def _layer_names(model: Same, index: int) -> tuple[str, ...]:
    """Layer ``index``'s parameter tensors' names relative to the layer, in order (cached per model object)."""
    return tuple(p.name.rpartition(f".{index}.")[2] for p in model_parameters(model.obj)  # type: ignore[arg-type]
                 if p.layer == index)


def layer_gradient_sizes(model: ModelSpec, index: int, grad_bytes: int) -> list[int]:
    """Bytes of each of layer ``index``'s gradients (``grad_bytes`` per element), in the order of
    :func:`grad_positions`' list (:func:`~memplan.model.linears.model_parameters` order)."""
    return [numel * grad_bytes for numel in _layer_numels(Same(model), index)]


@lru_cache(maxsize=4096)
def _layer_numels(model: Same, index: int) -> tuple[int, ...]:
    """Layer ``index``'s parameter tensors' numels, in order (cached per model object, as :func:`_layer_names`)."""
    return tuple(p.numel for p in model_parameters(model.obj) if p.layer == index)  # type: ignore[arg-type]


def mlp_plan(run: RunContext, index: int, slots: Sequence[Block | None], count: int | None,
             sizes: Callable[[Block], int]) -> MlpPlan | None:
    """The plan for layer ``index`` whose MLP tensors are ``slots`` (:data:`SLOTS`, None where not saved as
    such), with ``count`` gradients made in its backward (None: not made there, or under FSDP2); ``sizes``:
    a block's bytes. None when a slot is empty or the layer's gradients are not its parameter tensors."""
    if any(block is None for block in slots[:4]):
        return None
    positions = grad_positions(run.model, index, count, _WEIGHTS)
    if positions is None:
        return None
    shape = run.shape
    hidden = shape.seq * shape.micro_batch * run.model.hidden_size * shape.act_bytes
    down, up, gate = positions
    return MlpPlan(intermediate=sizes(slots[3]), hidden=hidden, grads=(down, up, gate))  # type: ignore[arg-type]


#: One projection's step of the walk: ``(index, width, freed, position)``: the projection (0 down, 1 up, 2 gate),
#: the bytes of its input's gradient, the saved tensors its backward frees and its weight gradient's position in
#: the layer's list; returns the input's gradient (freed by the walk).
Step = Callable[[int, int, Sequence[Block | None], int], Block | None]


def mlp_backward(replay: Replay, plan: MlpPlan, slots: Sequence[Block | None],
                 made: Callable[[Sequence[int]], None]) -> None:
    """The MLP's backward op by op (see the module), its saved ``slots`` freed; ``made(positions)`` makes
    the weight gradients at those positions of the layer's gradient list (each projection's dequantized
    weight, :attr:`MlpPlan.dequantized`, taken before its input gradient and freed after it)."""

    def step(_: int, width: int, freed: Sequence[Block | None], position: int) -> Block | None:
        made((position,))
        weight = replay.take(plan.dequantized)
        grad_input = replay.take(width)
        replay.give(weight, *freed)
        return grad_input

    gated_walk(replay, plan, slots, step)


def gated_walk(replay: Replay, plan: MlpPlan, slots: Sequence[Block | None], step: Step) -> None:
    """The gated MLP's backward op by op around its projections (see the module): ``slots`` the saved gate, up,
    ``act(gate)`` and product; ``step`` lays out each projection's backward (weight gradient, input gradient,
    its saved tensors freed), which differs between a kept layer (:func:`mlp_backward`) and a fused-core layer
    recomputed whole (:mod:`~memplan.estimate.reserved_fused_recompute`: autocast's weight copies)."""
    gate, up, act, product = slots[:4]
    down_grad, up_grad, gate_grad = plan.grads
    size, hidden = plan.intermediate, plan.hidden
    grad_product = step(0, size, (product,), down_grad)
    grad_act, grad_up = replay.take(size), replay.take(size)
    replay.give(grad_product, up, act)
    up_input = step(1, hidden, (grad_up,), up_grad)
    grad_gate = replay.take(size)
    replay.give(grad_act, gate)
    gate_input = step(2, hidden, (grad_gate,), gate_grad)
    summed = replay.take(hidden)
    replay.give(up_input, gate_input, summed)
