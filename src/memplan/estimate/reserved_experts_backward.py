"""gpt-oss's experts' backward, op by op, in the reserved-memory schedule (session 10;
:mod:`memplan.estimate.reserved_sim`, the sink layer's path of :mod:`~memplan.estimate.reserved_backward`).

transformers' GptOss experts (grouped GEMMs over the dispatched rows, the clamped SwiGLU between them,
:mod:`~memplan.estimate.gpt_oss_terms`) save eight large tensors: the dispatched tokens, fc1's output
(gate and up interleaved, ``2f`` columns), the clamped gate, the sigmoid of the scaled clamped gate, the
GLU (``gate x sigmoid``), ``up + 1``, fc2's input (the product) and the expert outputs the weighted combine
keeps. A trace of the backward (``model.layers.N.mlp.experts``: ``aten.mul``, ``grouped_mm_fallback_backward``,
``sigmoid_backward``, ``where``, ``slice_backward``) makes one routed-rows tensor per op, frees each saved
tensor once its op is done, and makes each grouped GEMM's weight gradient between those frees:

1. the combine's backward: the sum over the ``k`` picks expanded (``clone``) and put back in the experts'
   row order (``new_zeros``, ``index_put``; the first two freed), then two routed-rows gradients of the
   weighted product, the first, the reordered gradient and the expert outputs freed;
2. fc2: its input's gradient, the down projection's weight gradient, fc2's input freed, its bias's
   gradient, the combine's second gradient freed;
3. ``(up + 1) * glu``: two gradients, then fc2's input gradient, the GLU and ``up + 1`` freed;
4. ``gate * sigmoid``: two gradients, the first and the clamped gate freed; the sigmoid's backward (one), the
   second and the sigmoid freed; the ``alpha *`` product's (one), the sigmoid's gradient freed; their sum
   (one), the two gate gradients freed;
5. the clamps' backward: one-byte masks, two for ``up`` and one for the gate, each clamp's gradient
   (``where``) made beside them; the gate's summed gradient and fc1's output freed after the gate's;
6. each clamp's gradient scattered into a ``2f``-column tensor (``slice_backward``), each freed once
   scattered, and their sum (one ``2f``-column tensor);
7. fc1: the dispatched tokens' gradient, the gate-up projection's weight gradient, the dispatched tokens
   freed, its bias's gradient, the sum freed; the tokens' gradient gathered back to hidden size
   (``new_zeros``, ``index_put``), then the zeros and the tokens' gradient freed.

The order is a trace's of a layer that is not recomputed (gpt-oss-20b s4096 b1 bf16-mixed, layer 23); a
recomputed layer's frees the same tensors, three pairs in the other order, and makes the expanded gradient before
its forward runs again (not laid out). Until this plan the schedule freed all eight beside the block's other tensors and made the gradients
after: the temporaries, up to three ``2f``-column ones beside fc1's output, did not exist, and the routed-rows
segments they reserve in a trace were free for the gradients and the next layer's score blocks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from memplan.estimate.context import RunContext
from memplan.estimate.reserved_replay import Block, Replay
from memplan.estimate.terms import TermRole
from memplan.model.spec import CLAMPED_SWIGLU

#: The experts' saved tensors the plan frees op by op, in forward order (their terms' roles).
EXPERT_TERMS = (TermRole.DISPATCHED_TOKENS, TermRole.EXPERT_FC1, TermRole.CLAMPED_GATE, TermRole.CLAMPED_SIGMOID,
                TermRole.CLAMPED_PRODUCT, TermRole.CLAMPED_UP_PLUS_ONE, TermRole.EXPERT_FC2, TermRole.EXPERT_OUTPUTS)
#: The experts' weights (names relative to the layer), in the order autograd makes their gradients.
EXPERT_WEIGHTS = ("mlp.experts.down_proj", "mlp.experts.down_proj_bias", "mlp.experts.gate_up_proj",
                  "mlp.experts.gate_up_proj_bias")


def clamped_experts(run: RunContext) -> bool:
    """Whether the job's model has gpt-oss's clamped-SwiGLU experts (the only experts laid out op by op)."""
    return any(layer.moe is not None and layer.moe.expert.activation == CLAMPED_SWIGLU for layer in run.model.layers)


def expert_index(role: TermRole, pieces: int, run: RunContext) -> int | None:
    """The index in :data:`EXPERT_TERMS` of a term of ``role`` (one tensor) of a clamped-experts model, else None."""
    if pieces != 1 or role not in EXPERT_TERMS or not clamped_experts(run):
        return None
    return EXPERT_TERMS.index(role)


@dataclass(frozen=True)
class ExpertsPlan:
    """Sizes (bytes) of the experts' backward temporaries and the positions of their gradients."""

    #: One routed-rows tensor (fc2's input), a ``2f``-column one (fc1's output), a clamp's one-byte mask,
    #: and a hidden-sized tensor of the layer's tokens (the experts' dtype).
    rows: int
    fc1: int
    mask: int
    hidden: int
    #: Positions in the layer's gradient list of :data:`EXPERT_WEIGHTS`' gradients (None: made elsewhere).
    grads: tuple[int, ...] | None


def experts_plan(run: RunContext, slots: Sequence[Block | None], sizes: Callable[[Block], int],
                 positions: list[int] | None) -> ExpertsPlan | None:
    """The plan for a layer whose experts' tensors are ``slots`` (:data:`EXPERT_TERMS` order), or None when
    one is missing; ``sizes``: a block's bytes; ``positions``: see :attr:`ExpertsPlan.grads`."""
    if len(slots) != len(EXPERT_TERMS) or any(block is None for block in slots):
        return None
    shape = run.shape
    rows = sizes(slots[6])  # type: ignore[arg-type]
    width = max(shape.expert_bytes, 1)  # the experts' dtype (fp32 under autocast: HF's grouped GEMMs upcast)
    return ExpertsPlan(rows=rows, fc1=sizes(slots[1]), mask=max(rows // width, 1),  # type: ignore[arg-type]
                       hidden=shape.seq * shape.micro_batch * run.model.hidden_size * width,
                       grads=None if positions is None else tuple(positions))


def experts_backward(replay: Replay, plan: ExpertsPlan, slots: Sequence[Block | None],
                     made: Callable[[Sequence[int]], None]) -> Block | None:
    """The experts' backward op by op (see the module), their saved ``slots`` freed; ``made(positions)``
    makes the gradients at those positions of the layer's gradient list. Returns the hidden-sized gradient of
    the tokens, alive until the router's backward (the caller frees it with the block's other tensors)."""
    dispatched, fc1, gate, sigmoid, glu, up1, fc2_input, outputs = slots
    rows, grads = plan.rows, plan.grads

    def make(part: slice) -> None:
        if grads is not None:
            made(grads[part])

    expanded, zeros = replay.take(rows), replay.take(rows)
    gathered = replay.take(rows)
    replay.give(zeros, expanded)
    first, second = replay.take(rows), replay.take(rows)
    replay.give(first, gathered, outputs)
    grad_input = replay.take(rows)
    make(slice(0, 1))
    replay.give(fc2_input)
    make(slice(1, 2))
    replay.give(second)
    grad_glu, grad_up = replay.take(rows), replay.take(rows)
    replay.give(grad_input, glu, up1)
    grad_sigmoid, grad_gate = replay.take(rows), replay.take(rows)
    replay.give(grad_glu, gate)
    sigmoid_grad = replay.take(rows)
    replay.give(grad_sigmoid, sigmoid)
    scaled = replay.take(rows)
    replay.give(sigmoid_grad)
    summed = replay.take(rows)
    replay.give(grad_gate, scaled)
    return _clamps_and_fc1(replay, plan, (grad_up, summed, fc1, dispatched), make)


def _clamps_and_fc1(replay: Replay, plan: ExpertsPlan, blocks: tuple[Block | None, ...],
                    make: Callable[[slice], None]) -> Block | None:
    """Steps 5 to 7 of the module's list: ``blocks`` the up and gate gradients, fc1's output, the dispatched
    tokens."""
    grad_up, grad_gate, fc1, dispatched = blocks
    low, high = replay.take(plan.mask), replay.take(plan.mask)
    up_clamped = replay.take(plan.rows)
    replay.give(high, low, grad_up)
    mask = replay.take(plan.mask)
    gate_clamped = replay.take(plan.rows)
    replay.give(mask, grad_gate, fc1)
    up_wide = replay.take(plan.fc1)
    replay.give(up_clamped)
    gate_wide = replay.take(plan.fc1)
    replay.give(gate_clamped)
    wide = replay.take(plan.fc1)
    replay.give(up_wide, gate_wide)
    grad_tokens = replay.take(plan.rows)
    make(slice(2, 3))
    replay.give(dispatched)
    make(slice(3, 4))
    replay.give(wide)
    zeros = replay.take(plan.hidden)
    gathered = replay.take(plan.hidden)
    replay.give(zeros, grad_tokens)
    return gathered


def experts_forward(replay: Replay, index: int, size: int, temps: dict[str, Block | None]) -> Block | None:
    """Make the experts' saved tensor ``index`` (:data:`EXPERT_TERMS`) of ``size`` bytes with the forward's
    temporaries around it, as a trace of the experts' forward makes them: the gate-up bias rows gathered per
    routed row (``2f`` columns; transformers' GptOss experts always have biases) before fc1, alive until the down bias rows are gathered;
    the clamped ``up`` and ``alpha x gate`` after the clamped gate, the second freed once the sigmoid is made,
    the first once fc2's input is; the down bias rows before the expert outputs, then the combine's weighted
    product and the outputs gathered back to token order (the product freed, the gathered ones left in
    ``temps["gathered"]`` for the caller to free at the layer's end). ``temps`` carries the temporaries between
    calls. Returns the saved tensor's block."""
    if index == 1:
        temps["bias"] = replay.take(size)
    if index == len(EXPERT_TERMS) - 1:
        down = replay.take(size)
        replay.give(temps.pop("bias", None))
        block = replay.take(size)
        weighted = replay.take(size)
        replay.give(down)
        temps["gathered"] = replay.take(size)
        replay.give(weighted)
        return block
    block = replay.take(size)
    if index == 2:
        temps["up"], temps["scaled"] = replay.take(size), replay.take(size)
    elif index == 3:
        replay.give(temps.pop("scaled", None))
    elif index == 6:
        replay.give(temps.pop("up", None))
    return block
