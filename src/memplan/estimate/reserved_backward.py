"""An eager-attention layer's backward in the reserved-memory schedule (issue 25, item 8;
:mod:`memplan.estimate.reserved_sim`), in the order autograd runs it.

A Hugging Face eager layer's backward runs its MLP block first, then the attention core. By the time
the softmax backward runs, autograd has freed what the layer's later nodes saved (the MLP block's
tensors and autocast's weight copies of its linears, the output projection's input, the PV matmul's
16-bit probabilities); the softmax backward then holds two fp32 gradients of the probabilities (the
upcast of the incoming one and the one it makes), and casts the result back to the compute dtype
before the first is freed. A trace shows exactly this (``_to_copy`` 4 bytes per score,
``_softmax_backward_data`` 4 bytes, ``_to_copy`` back to 2 bytes); the estimate's ledger prices the
same step as one transient beside all the layer's saved tensors
(:func:`memplan.estimate.activations.backward_transient_bytes`). The allocator sees the difference:
the two fp32 gradients are made in the space the MLP's tensors left.

The plan applies when the layer's transient is the softmax backward's (the eager rule gave it) and no
recompute policy drops tensors of the layer; otherwise the schedule keeps its one-block transient (in pieces of the
residual stream's gradient's size where the attention module is checkpointed: :func:`transient_pieces`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from memplan.alloc.schedule import STREAM_BITS
from memplan.estimate.activations import (
    EAGER_SOFTMAX_BYTES,
    UNFUSED_ATTENTION,
    Term,
    divided,
    layer_terms,
    layer_terms_by_block,
    output_gradient_bytes,
)
from memplan.estimate.context import RunContext
from memplan.estimate.reserved_attention_backward import core_backward, core_plan
from memplan.estimate.reserved_experts_backward import EXPERT_WEIGHTS, experts_backward, experts_plan
from memplan.estimate.reserved_mlp_backward import (
    EXPERT_SLOT,
    GROUPED_SLOT,
    SINK_SLOT,
    attention_split,
    grad_positions,
    mlp_backward,
    mlp_plan,
)
from memplan.estimate.reserved_replay import Block, Replay
from memplan.estimate.reserved_sinks import applies, sink_backward
from memplan.estimate.terms import TermRole
from memplan.model.spec import LayerSpec

#: Attention terms the layer's backward frees before the softmax backward (beside the MLP block's).
_EARLY_ATTENTION = (TermRole.OUTPUT_PROJECTION_INPUT, TermRole.SOFTMAX_CAST)


@dataclass(frozen=True)
class EagerBackward:
    """The softmax backward's tensors (bytes, one rank): one fp32 gradient of the probabilities, and
    the compute-dtype gradient of the scores it is cast back to."""

    fp32: int
    scores: int


def early_terms(layer: LayerSpec, run: RunContext) -> list[bool]:
    """Per term of :func:`~memplan.estimate.activations.layer_terms` (same order), whether the layer's
    backward frees it before the softmax backward: the MLP block's (the layer input excepted) and the
    attention terms of :data:`_EARLY_ATTENTION`."""
    attention, rest = layer_terms_by_block(layer, run.shape)
    return ([t.role in _EARLY_ATTENTION for t in attention]
            + [t.keep != "input" for t in rest])


def eager_backward(layer: LayerSpec, run: RunContext, transient: int | None) -> EagerBackward | None:
    """The eager softmax backward's plan for ``layer``, or None when the schedule keeps one transient:
    no unfused eager attention core, a recompute policy that drops sites, or a ledger transient that
    is not the softmax backward's two fp32 gradients less what the layer freed before them (the
    general rule's two largest tensors outweigh it: tried as the MLP's transient before the frees,
    qwen3-8b bf16 eager +4.0% -> +6.0%, phi-3-mini fp32 eager +2.1% -> +3.4%, not kept). ``transient``
    None: no such check, for a layer recomputed whole whose forward the schedule made again tensor by
    tensor (:func:`recomputed_softmax`)."""
    shape, attn = run.shape, layer.attention
    if attn is None or shape.kernels != "eager" or shape.attention not in UNFUSED_ATTENTION or run.dropped:
        return None
    heads_scores = attn.num_heads * shape.micro_batch * shape.seq * shape.kv_seq
    fp32 = divided(Term("softmax gradient", EAGER_SOFTMAX_BYTES * heads_scores, "tp", "core"), shape)
    scores = divided(Term("scores gradient", shape.act_bytes * heads_scores, "tp", "core"), shape)
    terms = layer_terms(layer, shape)
    released = sum(divided(t, shape) for t, early in zip(terms, early_terms(layer, run)) if early)
    if fp32 <= 0 or (transient is not None and transient != 2 * fp32 - released):
        return None
    return EagerBackward(fp32=fp32, scores=scores)


def backward_layer(run: RunContext, visit: tuple[int, int, int],
                   saved: tuple[list[Block | None], list[Block | None], Sequence[Block | None]], replay: Replay,
                   hooks: tuple[Callable[[Sequence[int] | None], None], Callable[[], None]],
                   count: int | None, softmax: EagerBackward | None = None) -> None:
    """A layer's backward. ``saved``: the tensors freed early, the others, and the tensors of the op-by-op
    slots (:data:`~memplan.estimate.reserved_mlp_backward.SLOTS`, None where not saved as such); ``count``:
    the gradients made here (None: not made here, or under FSDP2); ``hooks[0]`` makes the gradients at the
    given positions of the layer's list (None: all not made yet), ``hooks[1]`` is the ledger's backward
    moment, at the layer's worst step. Where both op-by-op plans apply, the gated MLP's and the eager core's
    backward op by op (:mod:`~memplan.estimate.reserved_mlp_backward`,
    :mod:`~memplan.estimate.reserved_attention_backward`), the other gradients after; else gpt-oss's sink
    softmax backward (:func:`~memplan.estimate.reserved_sinks.sink_backward`, a recomputed layer's too), the
    gradients made around it; else an eager softmax backward as autograd runs it, the gradients made before
    it (:func:`eager_backward`, or ``softmax``: :func:`recomputed_softmax`'s); else the ledger's transient beside all the saved tensors, the gradients made,
    then all freed."""
    made, peak = hooks
    index, _, transient = visit
    early, rest, slots = saved
    core = core_plan(run, index, slots, count)
    mlp = mlp_plan(run, index, slots, count, lambda block: replay.ops[block] >> STREAM_BITS) if core else None
    if core is not None and mlp is not None:
        mlp_backward(replay, mlp, slots, made)
        replay.give(*early)
        core_backward(replay, core, slots, made, peak)
        made(None)
        replay.give(*rest, *slots[EXPERT_SLOT:])
        return
    layer = run.model.layers[index]
    plan = softmax or eager_backward(layer, run, transient)
    if applies(layer, run) and (plan is not None or slots[SINK_SLOT] is not None):
        # gpt-oss's sink attention (reserved_sinks): a recomputed layer's forward made again too; where the
        # probabilities and softmax output have no slot (a fine-tuning job), they go with the early and late ones
        # the MLP block's saved tensors freed before its gradients are made, as autograd frees them while it runs
        # the block's backward (gpt-oss's experts: each grouped GEMM's weight gradient after the combine's and the
        # SwiGLU's saved tensors are gone); the output projection's input after its gradient (sink_backward)
        split = attention_split(run.model, index, count)
        left, done = _experts(run, (index, count), slots[EXPERT_SLOT:GROUPED_SLOT], replay, made)
        replay.give(*early, *left)
        made(None if split is None else [i for i in split[0] if i not in done])
        sink_backward(layer, run, replay, peak,
                      (list(slots[:5]), [*rest, *slots[6:SINK_SLOT]], (slots[5], slots[SINK_SLOT])))
        if split is not None:
            made(split[1])
        return
    # without the op-by-op plan the slots are freed as before: the core's fp32 output with the late tensors
    early, rest = [*early, *slots[:6], *slots[EXPERT_SLOT:]], [*rest, *slots[6:EXPERT_SLOT]]
    if plan is None:
        temps = replay.take_all(transient_pieces(run, transient)) if run.policy.kind.checkpoints_attention else [
            replay.take(transient)]
        peak()
        made(None)
        replay.give(*temps, *early, *rest)
        return
    made(None)
    replay.give(*early)
    upcast, grad = replay.take(plan.fp32), replay.take(plan.fp32)
    peak()
    replay.give(upcast)
    cast = replay.take(plan.scores)
    replay.give(grad, cast, *rest)


def transient_pieces(run: RunContext, transient: int) -> list[int]:
    """The ``transient`` bytes of a layer's backward without an op-by-op plan under a policy that checkpoints its
    attention module (Hugging Face's selective recompute), as the tensors autograd makes: pieces of the residual
    stream's gradient's size (:func:`~memplan.estimate.activations.output_gradient_bytes`), the last taking the rest.
    A trace of qwen3-8b s1024 bf16-mixed SDPA selective (the second step's layer 35) makes 54 of its backward's 126
    non-gradient tensors of 1 MiB or more, 51% of their bytes, at that size (16 MiB, fp32: the norms' backward
    temporaries, the fp32 casts of the input gradients, their sums; the others 2 to 96 MiB: the recompute's weight
    copies, q/k/v, the MLP's activation gradients). Made as one 224 MiB block, it found no hole of that size, and the
    layer's gradients made beside it took the segments the trace leaves them (its 16 MiB key/value gradients the
    64 MiB ones, its 64 MiB query and output gradients the forward's 96 MiB ones, so the second step's optimizer made
    a new 2,374 MiB segment for its last temporary): +1.48% against the trace's simulated reserved, +0.04% so."""
    piece = output_gradient_bytes(run.shape, run.model.hidden_size)
    count = transient // piece if piece > 0 else 0
    if count < 2:
        return [transient]
    return [piece] * (count - 1) + [transient - piece * (count - 1)]


def recomputed_softmax(run: RunContext, index: int) -> EagerBackward | None:
    """The eager softmax backward's plan for layer ``index`` recomputed whole, alone in its checkpoint (a group's
    layers run their backward one after the other: not laid out), where the schedule made its forward again tensor by
    tensor and no walk lays its backward out (a fine-tuned layer: its adapters' gradients are other
    tensors), or None (no unfused eager core; gpt-oss's sinks: their own plan). The ledger prices such a layer's
    backward as one transient (:func:`~memplan.estimate.recomputed_backward.unwalked_backward`, a bound over several
    moments), which laid out as one block (qwen3-8b eager LoRA: 2.4 GiB) the allocator had to find in one piece;
    autograd runs the layer's backward as a kept layer's: the MLP block's tensors freed, then the probabilities'
    gradient upcast to fp32, the softmax backward's fp32 result, the cast back (a trace's ``_to_copy``,
    ``_softmax_backward_data``, ``_to_copy``)."""
    layer = run.model.layers[index]
    return None if applies(layer, run) else eager_backward(layer, run, None)


def _experts(run: RunContext, layer: tuple[int, int | None], slots: Sequence[Block | None], replay: Replay,
             made: Callable[[Sequence[int] | None], None]) -> tuple[list[Block | None], list[int]]:
    """gpt-oss's experts' backward op by op (:mod:`~memplan.estimate.reserved_experts_backward`) where their
    ``slots`` are all saved, their gradients made in it where the layer's are made in the backward (``layer``:
    its index and the count of its gradients, :func:`backward_layer`). Returns the blocks left for the caller
    to free (the hidden-sized gradient it leaves alive; the slots themselves where not laid out) and the
    positions of the gradients it made."""
    index, count = layer
    positions = grad_positions(run.model, index, count, EXPERT_WEIGHTS)
    plan = experts_plan(run, slots, lambda block: replay.ops[block] >> STREAM_BITS, positions)
    if plan is None:
        return list(slots), []
    return [experts_backward(replay, plan, slots, made)], positions or []
