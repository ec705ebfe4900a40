"""DTensor's loss parallelism: the cross-entropy of vocabulary-sharded logits under tensor parallelism.

torchtitan's output projection is column-parallel with its output left sharded on the vocabulary
(``ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)``), and its loss runs inside
``torch.distributed.tensor.parallel.loss_parallel()``: ``cross_entropy(pred.flatten(0, 1).float(),
labels)`` dispatches to DTensor's own log-softmax and NLL (``torch/distributed/tensor/parallel/loss.py``),
which work on each rank's shard with collectives for the max, the sum of exponentials and the picked
logits. What a rank holds, per element of its logits shard (traced on simulated ranks,
``tests/estimate/test_loss_parallel.py``):

* forward: the 16-bit logits, their fp32 copy, the shifted logits (``x - max``) and their exponential
  (summed, then freed), then the log-softmax result beside the shifted logits: compute bytes + 3 fp32;
* backward: the saved log-softmax output, the NLL's gradient (a zeroed fp32 tensor scattered into),
  the exponential of the output and one more fp32 temporary of the gradient's arithmetic: 4 fp32;
  the 16-bit logits are gone by then when the loop keeps only the loss (torchtitan ``del pred``).

The plain ``fp32-logits`` path (ATen's fused ``_log_softmax`` backward) holds 3 fp32 at its worst
(:func:`memplan.estimate.extras.logits_bytes`); DTensor's decomposed backward one more.
"""

from __future__ import annotations

from memplan.estimate.activations import ActivationShape
from memplan.job import Job, resolved_loss
from memplan.profiles.framework import FrameworkProfile, vocab_split

__all__ = ["NOTE", "applies", "loss_parallel_bytes"]

_FP32 = 4
#: fp32 logits-sized tensors alive at the worst moment of DTensor's log-softmax backward.
BACKWARD_FP32_TENSORS = 4
#: fp32 logits-sized tensors beside the 16-bit logits at the worst moment of its forward.
FORWARD_FP32_TENSORS = 3

NOTE = ("loss parallelism (DTensor loss_parallel, torchtitan under TP): log-softmax and NLL run on each rank's "
        "vocabulary shard; the forward holds the 16-bit logits, their fp32 copy, the shifted logits and their "
        "exponential, the backward four fp32 shard-sized tensors (saved output, its gradient, its exponential "
        "and one temporary)")


def applies(job: Job, profile: FrameworkProfile) -> bool:
    """Whether the job's loss runs under DTensor's ``loss_parallel`` (the profile's TP loss on fp32 logits)."""
    return (profile.dtensor_loss_parallel and vocab_split(profile, job.parallel.tp) > 1
            and resolved_loss(job) == "fp32-logits")


def loss_parallel_bytes(shape: ActivationShape, vocab_rows: int) -> int:
    """Logits and loss buffers of one micro-batch on one TP rank at the loss's worst moment."""
    elements = shape.seq * shape.micro_batch * (vocab_rows // (shape.vocab_tp or shape.tp))
    forward = (shape.act_bytes + FORWARD_FP32_TENSORS * _FP32) * elements
    return max(forward, BACKWARD_FP32_TENSORS * _FP32 * elements)
