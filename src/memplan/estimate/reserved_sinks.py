"""gpt-oss's eager sink attention (:func:`memplan.estimate.gpt_oss_terms.sink_softmax_terms`) op by op in the
reserved-memory schedule (:mod:`memplan.estimate.reserved_sim`), for layers kept whole or recomputed whole.

A trace of transformers' gpt-oss ``eager_attention_forward`` (``memplan trace``, gpt-oss-20b) allocates, per
layer: the 16-bit scores (``bmm``) and their scaled copy (the scores freed), the masked scores (``+ mask``,
in the mask's dtype: the weights'; the scaled copy freed), the concatenation with the sink column
(``s + 1`` columns) and its max-subtracted copy (the concatenation freed), then the saved softmax output and
its cast; the masked scores and the max-subtracted logits are freed when the function returns. Its backward,
after the MLP block's: the gradient of the probabilities (``bmm``), the probabilities freed, its upcast to the
softmax's dtype, padded to ``s + 1`` columns (``slice_backward``), the softmax backward (the softmax output
freed), the max's backward (``neg``, ``new_zeros``, ``scatter``) and their sum, then the first ``s`` columns
cast back (where the softmax is wider than the compute dtype) and scaled. The allocator sees several
``s + 1``-column blocks made and freed in the forward whose segments the backward's reuse; a schedule without
them (the plain eager plan of :mod:`~memplan.estimate.reserved_backward`) reserved new segments there:
gpt-oss-20b s4096 b1 bf16-mixed was +9.3% against the trace's simulated reserved, +0.4% with this plan.

Under full recompute the trace makes the forward's tensors in the checkpointed forward (no autograd), again
in the layer's backward (its forward made again, :mod:`~memplan.estimate.reserved_recompute`), then runs the
backward above; the schedule does the same, the layer's gradients made where autograd makes them (the MLP
block's and the output projection's before the sink softmax backward, the others after it:
:func:`~memplan.estimate.reserved_mlp_backward.attention_split`). It used to keep the recomputed layer's
backward as one transient block: gpt-oss-20b s8192 b4 bf16 and b2 bf16-mixed were +9.2% and +14.2% against
the trace's simulated reserved (the forward's temporaries alone: +0.1% and +20.3%), now -0.3% and -1.7%. In
the checkpointed forward the schedule frees the softmax output (or its cast) once the next tensor is made,
where the decoder layer holds it to its end (holding it was tried: s8192 b2 bf16-mixed -1.4% -> -1.5% then,
b4 and s2048 unchanged; not kept). Under a selective policy the schedule keeps the plain eager plan or its
one-block transient.

The MLP block's saved tensors are freed before its gradients are made (session 10): the trace's experts make
each grouped GEMM's weight gradient after the combine's and the SwiGLU's saved tensors are freed, so the
gradients land in their holes (the experts' own backward is laid out op by op for the whole layers that
save every expert tensor: :mod:`~memplan.estimate.reserved_experts_backward`). Made beside them, the
gradients of gpt-oss-20b cut to 4 layers and 4 experts (s4096 b1 bf16, full recompute) sat packed in the score
segments, the first step's embedding gradient found no hole of its size there, and the second step reserved
one more 3,142 MiB logits segment: +11.8% against the trace's simulated reserved, now -0.2%.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from memplan.estimate.context import RunContext
from memplan.estimate.gpt_oss_terms import sink_softmax_bytes
from memplan.estimate.reserved_replay import Block, Replay
from memplan.estimate.reserved_terms import DROPPED, HELD
from memplan.model.spec import LayerSpec

def applies(layer: LayerSpec, run: RunContext) -> bool:
    """Whether ``layer`` runs gpt-oss's eager sink attention on one rank's whole heads in a job that keeps
    each layer's saved tensors whole or recomputes the layer whole (no recompute, full recompute: a selective
    policy's dropped sites are not laid out here)."""
    attn = layer.attention
    return (attn.sinks and run.shape.kernels == "eager" and not run.policy.partial and not run.dropped
            and run.job.parallel.tp <= 1)


def _sizes(layer: LayerSpec, run: RunContext) -> tuple[int, int, int]:
    """Bytes of a 16-bit scores tensor, of the masked scores (the weights' dtype) and of an ``s + 1``-column one."""
    shape = run.shape
    rows = layer.attention.num_heads * shape.micro_batch * shape.seq
    wide = sink_softmax_bytes(shape)
    return shape.act_bytes * rows * shape.kv_seq, wide * rows * shape.kv_seq, wide * rows * (shape.kv_seq + 1)


def sink_temporaries(layer: LayerSpec, run: RunContext) -> list[tuple[int, int, bool]]:
    """The forward's temporaries before the sink softmax output (the schedule's (size, kind, early) tensors of
    :func:`~memplan.estimate.reserved_forward.layer_blocks`): scores and scaled scores, each freed once the
    next is made; the masked scores held to the block's end; the concatenation, freed once the
    max-subtracted logits are made, those held to the block's end. Empty where :func:`applies` does not."""
    if not applies(layer, run):
        return []
    half, masked, wide = _sizes(layer, run)
    return [(half, DROPPED, False), (half, DROPPED, False), (masked, HELD, False), (wide, DROPPED, False),
            (wide, HELD, False)]


def sink_backward(layer: LayerSpec, run: RunContext, replay: Replay, peak: Callable[[], None],
                  saved: tuple[Sequence[Block | None], Sequence[Block | None], Sequence[Block | None]]) -> None:
    """The sink softmax backward as autograd runs it (see the module), once the layer's MLP block is done.
    ``saved``: the tensors freed before it (the output projection's input; the caller frees the MLP block's
    before it makes the block's gradients), those freed at its end, and the 16-bit probabilities (None where the softmax is 16-bit) with the softmax output, each
    freed where the trace frees it; ``peak``: the ledger's backward moment, where the most ``s + 1``-column
    blocks are alive."""
    early, rest, (probabilities, softmax) = saved
    half, masked, wide = _sizes(layer, run)
    replay.give(*early)
    grad_p = replay.take(half)  # the PV matmul's backward, then its saved probabilities freed
    replay.give(probabilities)
    if masked != half:
        upcast = replay.take(masked)
        replay.give(grad_p)
        grad_p = upcast
    padded = replay.take(wide)
    replay.give(grad_p)
    softmax_grad = replay.take(wide)
    replay.give(softmax, padded)
    replay.give(replay.take(wide))  # neg: the max's gradient, summed into a row vector
    zeros = replay.take(wide)
    scattered = replay.take(wide)
    replay.give(zeros)
    summed = replay.take(wide)
    peak()
    replay.give(softmax_grad, scattered)
    if masked != half:  # the first s columns cast back to the compute dtype
        cast = replay.take(half)
        replay.give(summed)
        summed = cast
    scaled = replay.take(half)
    replay.give(summed, scaled, *rest)


def sink_note(run: RunContext) -> str | None:
    """The --explain sentence where a layer runs the plan, else None."""
    if not run.model.has_attention_sinks or not any(applies(layer, run) for layer in run.model.layers):
        return None
    again = ("; a recomputed layer makes them in its checkpointed forward and again in its backward, before that "
             "backward, the ledger's backward moment in the stage's first layer" if run.policy.kind.recomputes else "")
    return ("gpt-oss's eager sink attention op by op as a trace makes it: the forward's scores, masked scores, "
            "the s + 1-column concatenation with the sink and its max-subtracted copy; the backward's upcast "
            "gradient padded to s + 1 columns, the softmax backward, the row maximum's scatter and their sum"
            + again)
