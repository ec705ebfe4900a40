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
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from memplan.estimate.extras import CHUNKED_LOSS_CHUNKS, head_trains
from memplan.job import resolved_loss

if TYPE_CHECKING:
    from memplan.estimate.context import RunContext

__all__ = ["NOTE", "applies", "chunked_head_backward_bytes"]

NOTE = (f"chunked loss with a trained head: the head's backward runs per chunk ({CHUNKED_LOSS_CHUNKS}), each making a "
        "weight-sized gradient that autograd sums out of place (three weight-sized tensors beside the chunks' logits "
        "gradients not yet used; memplan.estimate.chunked_head_backward)")


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
