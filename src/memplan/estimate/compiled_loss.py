"""``--compile`` with a compiled cross-entropy: the 16-bit logits and two fp32 values per token.

torchtitan compiles its loss with the model by default (``[compile] components = ["model", "loss"]``;
``build_cross_entropy_loss`` wraps ``cross_entropy(pred.float(), labels, reduction="sum")`` in
``torch.compile``), and a Hugging Face causal LM computes ``ForCausalLMLoss`` (``logits.float()``, then
``cross_entropy``) inside the forward the Trainer compiles. Inductor's min-cut partitioner saves the
cross-entropy's 16-bit input and, per token, the fp32 row maximum and log-sum-exp
(:func:`memplan.trace.runners.partitioner.partitioned_saved_set`, held by tests/trace/test_compiled_trace.py),
where the eager loss keeps an fp32 log-softmax of the whole logits. Its forward is reductions over the
logits (no logits-sized fp32 buffer in the fused kernels), its backward one pointwise kernel that writes the
logits' gradient in their own dtype: at the loss the logits and their gradient are alive, ``2c`` bytes per
logit, plus the two fp32 values per token.

torchtune's chunked loss (``--loss chunked``, ``CEWithChunkedOutputLoss``): its ``compile_loss`` compiles only
the per-chunk ``compute_cross_entropy`` (the loss's ``apply_compile_strategy``), so each chunk's 16-bit logits are
that graph's input and the partitioner saves them with the chunk's two fp32 values per token
(:func:`memplan.trace.runners.compiled_loss.compile_chunk_cross_entropy`, the same partitioner): the fp32
log-softmax of every chunk is gone. Its backward runs chunk by chunk (each chunk's gradient made as its saved
logits are freed), so at the loss the 16-bit logits or their gradients of every chunk and one chunk's gradient.

Gemma 2's soft-capping runs before the loss and saves its tanh output as in eager mode. Priced for ``--loss
fp32-logits`` and ``--loss chunked`` on one TP rank (the loss-parallel and vocabulary-parallel losses, the
fused-linear loss and multi-token prediction keep their eager pricing and are listed in ``unmodelled_settings``).
Not modelled: inductor's kernels' own transients and workspaces.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from memplan.estimate.extras import CHUNKED_LOSS_CHUNKS
from memplan.job import resolved_loss
from memplan.settings import InputSetting

if TYPE_CHECKING:
    from memplan.estimate.activations import ActivationShape
    from memplan.estimate.context import RunContext
    from memplan.job import Job
    from memplan.profiles.framework import FrameworkProfile

__all__ = ["ROW_STATS_BYTES", "compiled_loss_bytes", "compiled_loss_note", "compiles_loss", "job_compiles_loss", "loss_chunks",
           "loss_settings", "priced"]

#: Per token, the fp32 row maximum and log-sum-exp the compiled cross-entropy saves.
ROW_STATS_BYTES = 2 * 4


def job_compiles_loss(job: Job, profile: FrameworkProfile) -> bool:
    """The job compiles its loss (``--compile-loss``, or for ``auto`` the framework's habit)."""
    if not job.compile:
        return False
    return job.compile_loss == "on" or (job.compile_loss == "auto" and profile.compiles_loss)


def compiles_loss(run: RunContext) -> bool:
    return job_compiles_loss(run.job, run.profile)


def _unpriced(run: RunContext) -> str | None:
    """Why a compiled loss keeps its eager pricing (None: it is priced here)."""
    shape, loss = run.shape, resolved_loss(run.job)
    checks = ((loss not in ("fp32-logits", "chunked"), f"the {loss!r} loss"),
              (shape.tp > 1 or (shape.vocab_tp or 1) > 1, "a loss over TP-sharded logits"),
              (run.job.mtp_layers > 0, "multi-token prediction losses"))
    return next((reason for failed, reason in checks if failed), None)


def priced(run: RunContext) -> bool:
    """The compiled loss of this job is priced by :func:`compiled_loss_bytes`."""
    return compiles_loss(run) and _unpriced(run) is None


def compiled_loss_bytes(shape: ActivationShape, vocab_rows: int, softcap: int = 0, chunks: int = 1) -> tuple[int, int]:
    """(alive at the loss, saved into the backward) for one micro-batch: the logits and the gradient of one
    chunk of them (``chunks``: 1, the whole logits; torchtune's chunked loss, its chunks) in the compute dtype
    with the per-token fp32 statistics; the logits with those statistics. ``softcap``: the bytes Gemma 2's
    soft-capping saves in the model's forward before the loss (its tanh output; the loss saves the capped
    logits as its own input)."""
    tokens = shape.seq * shape.micro_batch
    logits = shape.act_bytes * tokens * vocab_rows
    saved = logits + ROW_STATS_BYTES * tokens + softcap
    return saved + -(-logits // chunks), saved


def loss_chunks(run: RunContext) -> int:
    """The chunks the compiled cross-entropy runs on: torchtune's for ``--loss chunked``, else one."""
    return CHUNKED_LOSS_CHUNKS if resolved_loss(run.job) == "chunked" else 1


def loss_settings(run: RunContext) -> tuple[InputSetting, ...]:
    """A compiled loss memplan prices as eager, as a not-modelled setting (never silent)."""
    reason = _unpriced(run) if compiles_loss(run) else None
    if reason is None:
        return ()
    return (InputSetting(source="--compile", key="compiled loss", value=True, effect="not-modelled",
                         note=f"{reason}: no rule for the compiled loss, priced as eager"),)


def compiled_loss_note(run: RunContext) -> list[str]:
    """The assumption sentence of a priced compiled loss."""
    if not priced(run):
        return []
    chunks = loss_chunks(run)
    if chunks > 1:
        return [f"compiled chunked cross-entropy (torchtune compiles compute_cross_entropy, one graph per chunk of "
                f"{chunks}): each chunk's 16-bit logits and an fp32 maximum and log-sum-exp per token are saved, no fp32 "
                "log-softmax (inductor's min-cut partitioner); at the loss the logits and one chunk's gradient in the "
                "compute dtype (memplan.estimate.compiled_loss)"]
    return ["compiled cross-entropy: the 16-bit logits and an fp32 maximum and log-sum-exp per token are saved "
            "(inductor's min-cut partitioner); at the loss the logits and their gradient in the compute dtype "
            "(memplan.estimate.compiled_loss)"]
