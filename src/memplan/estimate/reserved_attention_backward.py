"""An eager attention core's backward, op by op, in the reserved-memory schedule (issue 25, item 8;
:mod:`memplan.estimate.reserved_sim`), after the layer's MLP (:mod:`~memplan.estimate.reserved_mlp_backward`).

A trace of Hugging Face's eager attention (``softmax(QK^T, dtype=float32).to(dtype)`` then ``@ V``) shows its
backward as: the output projection's weight gradient and the gradient of its input, its saved input freed;
the PV matmul's backward (the gradients of V and of the 16-bit probabilities), the probabilities freed; the
softmax backward's fp32 upcast of that gradient and its fp32 result, the upcast freed, then the saved fp32
softmax output freed; the result cast back to the compute dtype and scaled (one scores-sized tensor each,
the one before freed); the QK matmul's backward (the gradients of Q and K). Only then does autograd reach
the projections' weight gradients. The allocator sees the fp32 temporaries made beside the saved fp32
softmax output and the holes all three leave together.

The plan applies where the MLP's does (:func:`~memplan.estimate.reserved_mlp_backward.mlp_plan`) and the
layer saves its softmax output in fp32 and its cast to the compute dtype (an eager core; ``slots`` 4 to 6).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from memplan.estimate.activations import EAGER_SOFTMAX_BYTES, Term, divided
from memplan.estimate.context import RunContext
from memplan.estimate.reserved_mlp_backward import grad_positions
from memplan.estimate.reserved_replay import Block, Replay


#: The fp32 softmax output's slot (the 16-bit probabilities' is the one before it) and the soft-capped scores'.
SOFTMAX_SLOT, TANH_SLOT = 6, 7


def capped_first(tensors: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """A layer's tensors (:func:`~memplan.estimate.reserved_forward.layer_blocks`) with the soft-capped scores
    (Gemma 2's ``tanh`` output, saved) moved just before the softmax output, where the forward makes them."""
    capped = [t for t in tensors if t[2] == 2 + TANH_SLOT]
    softmax = next((i for i, t in enumerate(tensors) if t[2] == 2 + SOFTMAX_SLOT), None)
    if not capped or softmax is None:
        return tensors
    rest = [t for t in tensors if t[2] != 2 + TANH_SLOT]
    at = rest.index(tensors[softmax])
    return rest[:at] + capped + rest[at:]


def capped_forward(replay: Replay, scores: int) -> Block | None:
    """A soft-capped core's forward before its saved ``tanh`` output: the 16-bit scores, their scaled copy and
    its ``/ cap`` (each freeing the one before); returns the quotient, freed once the ``tanh`` output is made."""
    first = replay.take(scores)
    scaled = replay.take(scores)
    replay.give(first)
    quotient = replay.take(scores)
    replay.give(scaled)
    return quotient


def masked_fp32(run: RunContext) -> bool:
    """Whether an eager core's masked scores are fp32 in ``run``: Hugging Face builds the additive mask in the
    embeddings' dtype (the residual stream's), so 16-bit scores plus an fp32 mask (autocast over fp32 weights)
    make an fp32 sum, and ``softmax(..., dtype=float32)`` casts nothing (a trace of llama-3.2-1b bf16-mixed
    eager: ``bmm``, ``mul`` 2 bytes per score, ``add`` and ``_softmax`` 4 bytes)."""
    return run.shape.residual_bytes > run.shape.act_bytes


def core_forward(replay: Replay, sizes: tuple[int, int], capped: bool, fp32_mask: bool = False
                 ) -> tuple[Block | None, Block | None]:
    """The eager core's forward temporaries before its saved fp32 softmax output is made (``sizes``: the
    16-bit scores' and the fp32 output's bytes): the scores (``QK^T``) and their scaled copy, or for soft-capped
    scores (``capped``) their ``* cap``, then the masked scores (each freeing the one before), and the
    softmax's fp32 upcast. Returns the upcast, freed once the softmax output is made, and the masked
    scores, freed once the probabilities' cast is made (a trace's ``_to_copy``, ``_softmax``, ``_to_copy``)."""
    scores, fp32 = sizes
    first = replay.take(scores)
    if not capped:
        scaled = replay.take(scores)
        replay.give(first)
        first = scaled
    if fp32_mask:  # the masked scores in fp32 (masked_fp32): the softmax makes no upcast, the sum is freed after it
        masked = replay.take(fp32)
        replay.give(first)
        return masked, None
    masked = replay.take(scores)
    replay.give(first)
    return replay.take(fp32), masked


@dataclass(frozen=True)
class CorePlan:
    """Sizes (bytes) of the core's backward temporaries and the output projection's gradient position."""

    fp32: int
    scores: int
    hidden: int
    output_grad: int


def core_plan(run: RunContext, index: int, slots: Sequence[Block | None], count: int | None) -> CorePlan | None:
    """The plan for layer ``index`` (``slots``: the layer's op-by-op tensors, the output projection's input,
    the 16-bit probabilities and the fp32 softmax output at 4 to 6), or None."""
    attn = run.model.layers[index].attention
    if attn is None or any(block is None for block in slots[4:7]):
        return None
    positions = grad_positions(run.model, index, count, ("self_attn.o_proj.weight",))
    if positions is None:
        return None
    shape = run.shape
    heads_scores = attn.num_heads * shape.micro_batch * shape.seq * shape.kv_seq
    return CorePlan(fp32=divided(Term("softmax gradient", EAGER_SOFTMAX_BYTES * heads_scores, "tp", "core"), shape),
                    scores=divided(Term("scores gradient", shape.act_bytes * heads_scores, "tp", "core"), shape),
                    hidden=shape.seq * shape.micro_batch * run.model.hidden_size * shape.act_bytes,
                    output_grad=positions[0])


def core_backward(replay: Replay, plan: CorePlan, slots: Sequence[Block | None],
                  made: Callable[[Sequence[int]], None], peak: Callable[[], None]) -> None:
    """The core's backward op by op (see the module), its ``slots`` 4 to 6 freed; ``peak``: the ledger's
    backward moment, with the two fp32 tensors alive."""
    output_input, probabilities, softmax, capped = slots[4:8]
    made((plan.output_grad,))
    grad_output = replay.take(plan.hidden)
    replay.give(output_input)
    grad_v, grad_p = replay.take(plan.hidden), replay.take(plan.scores)
    replay.give(grad_output, probabilities)
    upcast = replay.take(plan.fp32)
    replay.give(grad_p)
    grad = replay.take(plan.fp32)
    peak()
    replay.give(upcast, softmax)
    cast = replay.take(plan.scores)
    replay.give(grad)
    if capped is not None:  # the soft cap's backward: * cap, tanh (its saved output freed), / cap
        outer = replay.take(plan.scores)
        replay.give(cast)
        inner = replay.take(plan.scores)
        replay.give(capped, outer)
        cast = replay.take(plan.scores)
        replay.give(inner)
    scaled = replay.take(plan.scores)
    replay.give(cast)
    grad_q, grad_k = replay.take(plan.hidden), replay.take(plan.hidden)
    replay.give(scaled, grad_v, grad_q, grad_k)
