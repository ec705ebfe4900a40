"""accelerate's ``convert_outputs_to_fp32``: the Hugging Face Trainer's model returns an fp32 copy of its logits.

Where the trainer's own precision is 16-bit (``native_amp``: accelerate's ``Accelerator`` under ``mixed_precision``
bf16 or fp16, FSDP included, not under DeepSpeed), ``Accelerator.prepare_model`` wraps ``model.forward`` in
``convert_outputs_to_fp32`` (accelerate/utils/operations.py): when the forward returns (the loss computed inside it,
from the labels), ``convert_to_fp32`` rebuilds the output (``recursively_apply`` makes a new mapping of the same
type) with ``.float()`` of every bf16/fp16 tensor in it, while the 16-bit output is still referenced. That is the
logits: the loss is fp32 already (``ForCausalLMLoss`` upcasts the logits first) and no cache is returned (the
Trainer sets ``use_cache`` from ``TrainingArguments.use_cache``, False). The 16-bit output is dropped when the
wrapper returns; ``Trainer.compute_loss`` keeps ``outputs["loss"]`` alone, so the copy dies before the backward.

The copy's moment holds the 16-bit logits, the copy (4 B per logit) and what the loss saved (log-softmax's fp32
output): with the eager ``fp32-logits`` loss exactly what its forward held (the 16-bit logits, their fp32 upcast,
freed by the time the wrapper runs and the same size as the copy, the log-softmax output), so the moment is never
above the loss's and adds no bytes; ``memplan trace`` runs accelerate's wrapper itself and ties on the witness cells
(benchmarks/fp32_outputs_witness.py). Switched by the profile's ``fp32_outputs`` (the engine's profile: a ``--zero``
job runs DeepSpeed's, which has none). Not modelled: with a compiled cross-entropy
(:mod:`memplan.estimate.compiled_loss`), whose forward keeps no logits-sized fp32 buffer, the copy stands 4 B per
logit above that loss's forward; the trace cannot show it (it runs the partitioned loss op by op).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from memplan.estimate import compiled_loss
from memplan.estimate.ledger import LOGITS, Contribution
from memplan.job import resolved_loss

if TYPE_CHECKING:
    from memplan.estimate.context import StageContext

__all__ = ["contributions", "copy_bytes"]

_FP32 = 4
_LOSS = ("loss",)


def copy_bytes(ctx: StageContext) -> int:
    """The fp32 copy of one micro-batch's logits on this rank (each multi-token-prediction depth has its own)."""
    shape = ctx.run.shape
    vocab_local = ctx.run.vocab_rows // (shape.vocab_tp or shape.tp)
    return _FP32 * shape.seq * shape.micro_batch * vocab_local * (1 + ctx.job.mtp_layers)


def contributions(ctx: StageContext) -> Iterator[Contribution]:
    """The wrapper's moment at the loss: no bytes above the loss's forward, and its sentence (none where the trainer
    does not wrap the forward, the precision is fp32, or the loss is not ``fp32-logits``: the chunked and fused-linear
    losses run on the decoder's hidden states, and Liger's patched forward returns no logits to convert)."""
    run = ctx.run
    if not run.profile.fp32_outputs or not ctx.layout.has_head or run.shape.act_bytes >= _FP32 \
            or resolved_loss(run.job) != "fp32-logits":
        return
    size = f"{copy_bytes(ctx) / 2**20:,.1f} MiB"
    if compiled_loss.priced(run):
        yield Contribution(LOGITS, 0, _LOSS, note=(
            f"not modelled: accelerate's convert_outputs_to_fp32 (the trainer's {run.job.precision.name}) makes an fp32 "
            f"copy of the logits ({size}) after the forward; beside the compiled cross-entropy, which keeps no "
            "fp32 logits, it would stand that much above the loss's forward (no trace witness)"))
        return
    yield Contribution(LOGITS, 0, _LOSS, note=(
        f"accelerate's convert_outputs_to_fp32 (the trainer's {run.job.precision.name}): an fp32 copy of the logits "
        f"({size}) made after the forward beside the 16-bit logits, dropped with the model's output before the "
        "backward (compute_loss keeps the loss); it takes the place of the loss's own fp32 upcast, freed by then, so "
        "it adds nothing above the loss's forward"))
