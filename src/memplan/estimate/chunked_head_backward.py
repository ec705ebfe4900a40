"""The head's backward under torchtune's chunked loss (``--loss chunked``), where the head trains.

torchtune's decoder runs the output head once per sequence chunk (``tensor_split`` of the final hidden states), so
the backward runs one head linear per chunk. Autograd runs every chunk's cross-entropy backward first (made last,
highest sequence numbers), so each chunk's 16-bit logits gradient exists when the head's backwards start; each of
those makes a weight-sized gradient of the head (``vocab x hidden``, in the compute dtype: the matmul's output) and
frees its chunk's gradient, and autograd sums the chunks' weight gradients out of place (the sum so far and the new
one into a third tensor). Its worst step is the first sum: two chunk gradients used, three weight-sized tensors,
beside every layer's saved activations and what the final norm and the head saved (``memplan trace --loss chunked``:
llama_heavy in bf16, 6 of 8 chunk gradients and three weight-sized tensors at its peak; benchmarks/
compiled_chunked_loss.py). Compiled or eager alike (the eager loss's fp32 log-softmax is freed chunk by chunk
before). Not priced under TP (sharded logits) or where the head is frozen (no weight gradient).

Under PyTorch FSDP2 the moment holds the loss's collective buffers, not a layer backward's: the unit holding the
head is unsharded since its forward (the root unit, kept unsharded, with the last block the root's pre-backward
has prefetched; or accelerate's and torchtitan's [final norm, head] unit, ``reshard_after_forward=False``, alone:
its pre-backward hook is registered by the group's post-forward, which runs at the first chunk's head only, so it
and its prefetch of the last block come with the last chunk's backward), where a layer's backward holds two
blocks (``memplan trace --loss chunked`` on FSDP ranks, benchmarks/chunked_fsdp_witness.py; the buffers by phase:
:func:`memplan.estimate.extras.communication_by_phase`). :func:`fsdp_buffers_shift` is that difference.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from memplan.estimate.extras import CHUNKED_LOSS_CHUNKS, head_trains
from memplan.job import resolved_loss

if TYPE_CHECKING:
    from memplan.estimate.context import RunContext, StageContext
    from memplan.estimate.stage_states import StageStates

__all__ = ["FSDP_NOTE", "NOTE", "applies", "chunked_head_backward_bytes", "fsdp_buffers_shift"]

NOTE = (f"chunked loss with a trained head: the head's backward runs per chunk ({CHUNKED_LOSS_CHUNKS}), each making a "
        "weight-sized gradient that autograd sums out of place (three weight-sized tensors beside the chunks' logits "
        "gradients not yet used; memplan.estimate.chunked_head_backward)")

FSDP_NOTE = ("FSDP2 at the chunked head's backward: the loss's buffers (the unit holding the head, unsharded since its "
             "forward; under one root unit with the last block prefetched), not a layer backward's two blocks "
             "(the difference is counted with that moment's temporaries)")


def applies(run: RunContext) -> bool:
    """The job's loss is torchtune's chunked one on one TP rank and the head trains."""
    job, shape = run.job, run.shape
    return resolved_loss(job) == "chunked" and head_trains(job) and shape.tp == 1 and (shape.vocab_tp or 1) == 1


def chunked_head_backward_bytes(run: RunContext, head_saved: int, softcap: bool = False) -> int:
    """Temporaries of the chunked head's worst backward step beside every layer's activations (0: not this job's):
    the chunks' 16-bit logits gradients not yet used, three weight-sized gradients and ``head_saved`` (what the final
    norm and the head saved, their autocast copies included). ``softcap``: Gemma 2's soft-capping runs per chunk
    after the head and its saved tanh outputs are freed chunk by chunk too (those of the chunks not yet reached are
    alive; held on the GPU, not under ``save_on_cpu``)."""
    if not applies(run):
        return 0
    shape = run.shape
    c, chunks = shape.act_bytes, CHUNKED_LOSS_CHUNKS
    tokens = shape.seq * shape.micro_batch
    grads = c * tokens * run.vocab_rows * (chunks - 2) // chunks * (2 if softcap else 1)
    return grads + 3 * c * run.vocab_rows * shape.hidden + head_saved


def fsdp_buffers_shift(ctx: StageContext, st: StageStates) -> int:
    """FSDP2's collective buffers at the head's per-chunk backward less those of the backward phase (a layer's
    backward, which the ledger's phase carries): the loss's (see the module) less the backward's; 0 without
    FSDP2 and under pipeline parallelism (the schedule runs the loss and the head's backward; not traced)."""
    from memplan.estimate.extras import communication_by_phase, communication_bytes
    from memplan.estimate.fsdp_units import head_unit

    run = ctx.run
    if run.job.sharding.fsdp == "none" or not run.profile.torch_optimizer or run.job.parallel.pp > 1:
        return 0
    held = communication_bytes(run.job, run.profile, st.params, st.states, run.prec)
    at = communication_by_phase(run.job, run.profile, st.params, run.prec, held, tied=run.model.tie_word_embeddings,
                                head=head_unit(ctx))
    return at["loss"] - at["backward"]
