"""FSDP2's streams in the reserved-memory schedule (issue 25, item 8; :mod:`memplan.estimate.reserved_sim`).

PyTorch's caching allocator keeps one pool per stream: a block freed on one stream is reused only by
requests on that stream. FSDP2 (``torch/distributed/fsdp/_fully_shard``) allocates on three, as the
trace of a ``--fsdp`` job shows (``memplan trace --fsdp N``, events by stream):

- its all-gather stream: per unit (the root, then each block), in forward and again in backward,
  the all-gather input (the rank's shard in the compute dtype), freed once copied in, and output (the
  unit's unsharded parameters in the compute dtype), freed after the copy-out (below);
- the default stream: the unsharded parameters copied out of the all-gather (the root's kept from
  its forward to its reshard in its post-backward, a block's freed after its forward and its backward), and
  a block's unsharded gradients in the compute dtype until its reduce-scatter;
- its reduce-scatter stream: the reduce-scatter output, the rank's sharded gradients in the reduce
  dtype, cast there to the gradients' dtype where the two differ (torch ``foreach_reduce``'s
  ``_to_dtype_if_needed``: accelerate's bf16 reduce of fp32 gradients; the 16-bit output freed once cast),
  alive until the optimizer step's ``zero_grad``. The reduce-scatter input (on the default stream) is made in
  the reduce dtype too (``reduce_scatter_comm.allocate(..., dtype=reduce_dtype)``): an outer unit's is staged so
  (the tied root-unit cells that fell to -9.1% and -3.8% when fsdphead17 first tried it had witnesses recorded
  before accelerate's units; against today's traces they are +0.72% and +0.28%: helper fsdpcomm18).

When each all-gather output is freed (torch 2.13 ``FSDPParamGroup.wait_for_unshard``, ``FSDPState._post_forward``
and ``FSDPParamGroup._backward_prefetch``; a trace of ``--fsdp 2`` shows the same order):

- forward (implicit prefetch): a unit's output is kept in ``FSDPCommContext.all_gather_state`` past its
  copy-out and freed by the next unit's copy-out, after that unit's parameters are copied out (the local
  reference ``wait_for_unshard`` holds lives until it returns); the last block's output is freed when the
  root's forward ends, after the loss's forward (a Hugging Face model computes its loss inside);
- backward: the root's pre-backward hook, at the start of the backward (before the loss's backward),
  all-gathers the last block (``_backward_prefetch``: the unit before in ``post_forward_order``); each block's
  pre-backward then copies out its parameters, frees its output at once and all-gathers the block before it,
  whose output stays alive through the block's backward; the first block prefetches nothing (the root keeps
  its parameters from its forward to the end of the backward, ``reshard_after_forward=False``).

Not modelled: explicit prefetching (``set_modules_to_forward_prefetch``/``..._backward_prefetch``) issues the
next units' all-gathers before the current unit computes, so their outputs live through it; with
``unshard_async_op`` the all-gathers run on the default stream and each output is freed after its own copy-out.
``memplan trace --fsdp`` wraps the model without either, in the order above.

The root unit's gradients are made apart: the head's weight gradient (unsharded, compute dtype) at the
start of the backward, kept until the root's reduce-scatter at its end; there the embedding's gradient
(and, for tied embeddings, their sum as a third tensor) comes beside it, and then in torch's order
(``FSDPParamGroup.post_backward``, ``foreach_reduce``): the root's unsharded parameters freed (its reshard
comes before the reduce), the reduce-scatter's input (the root's unsharded gradients in the reduce dtype)
made, the gradients freed once copied in, the output made on the reduce-scatter stream; the input is held
(``reduce_scatter_states``) to the end of the backward.

torchtitan's and accelerate's outer units (``FrameworkProfile.fsdp_outer_units``, untied, no pipeline: the
ledger's :func:`~memplan.estimate.fsdp_units.head_unit`; ``memplan trace --framework torchtitan`` and ``hf``
wrap them so): the embedding is a unit (unit 0) and the final norm and head another (the last),
``reshard_after_forward=False``; the root holds no parameters. The embedding's unit reshards after its forward;
the head's is gathered after the blocks, its copy-out frees the last block's output and its own output is freed
as the root's forward ends, before the loss, as where the trainer computes it on the model's output
(torchtitan). Not modelled: where the model computes it (``FrameworkProfile.loss_in_model_forward``, the Hugging
Face Trainer) that output lives through the loss's forward (the ledger prices it:
:mod:`memplan.estimate.fsdp_loss_gather`), here freed before it; its pre-backward hook fires once the logits'
gradient is made, after the loss's backward, and prefetches the last block; its post-backward (reshard, then
reduce-scatter) comes after its gradients, its reduce-scatter input held through the last block's backward
(``reduce_scatter_states``, one buffer); the first block prefetches the embedding's unit, whose copy-out frees
that output, and whose post-backward ends the backward.

Under fine-tuning (PEFT adapters, trained modules) FSDP2 makes, reduce-scatters and keeps gradients only for
the parameters that require them (``FSDPParamGroup.post_backward`` collects those with a ``grad``; a unit with
none only reshards): the unsharded gradients are the trainable tensors' in the compute dtype, the root's all
made at its post-backward.

Not modelled: a block's post-backward in that order (the schedule frees its unsharded parameters after its
backward and makes no reduce-scatter input for it: its gradients go straight to the sharded output).

The sizes come from the estimate's own totals (its sharded parameters and gradients, spread over the
units' tensors in proportion to their numel), so the schedule is the estimate's, not the trace's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from memplan.estimate.context import StageContext
from memplan.estimate.ledger import GRADIENTS, PARAMETERS, Ledger
from memplan.units import dtype_bytes

#: Stream ids of the schedule (any distinct ids: the simulator only keeps their pools apart).
ALL_GATHER_STREAM = 1
REDUCE_SCATTER_STREAM = 3


@dataclass(frozen=True)
class FsdpSizes:
    """Per unit (root first, then the stage's blocks): the all-gather input, the unsharded parameter
    tensors in the compute dtype (also the unsharded gradients), and the sharded gradients."""

    gather_input: list[int]
    unsharded: list[list[int]]
    sharded_grads: list[list[int]]
    #: The root's head weight (the tied embedding when tied) in the compute dtype, and whether it is tied.
    head: int = 0
    tied: bool = False
    #: The ranks a unit is sharded over.
    shards: int = 1
    #: Under fine-tuning (only some tensors train): the factors (numerator, denominator) that turn a trainable
    #: tensor's sharded gradient into its unsharded one in the compute dtype (FSDP2 makes and reduces
    #: gradients only for the parameters that require them); None when every tensor trains.
    grad_scale: tuple[int, int] | None = None
    #: Whether the final norm and head are a unit apart from the embedding's (torchtitan's outer units): then
    #: unit 0 is the embedding's and the head's is the last one, after the blocks'.
    outer: bool = False
    #: The reduce-scatter output's bytes per element against the sharded gradients' (numerator, denominator):
    #: ``MixedPrecisionPolicy.reduce_dtype`` (``FrameworkProfile.fsdp_reduce_dtype``) against the gradient dtype.
    reduce_scale: tuple[int, int] = (1, 1)


def fsdp_sizes(ctx: StageContext, ledger: Ledger, units: list[list[int]],
               spread: Callable[[int, list[list[int]]], list[list[int]]],
               head: int | None, finetune: bool = False) -> FsdpSizes | None:
    """The FSDP2 sizes of the stage's schedule, or None when the job does not run FSDP2 (``head``: the
    numel of the head unit when the final norm and head are a unit apart from the embedding,
    :func:`~memplan.estimate.fsdp_units.head_unit`; ``finetune``: only some tensors train)."""
    job, prec = ctx.run.job, ctx.run.prec
    if job.sharding.fsdp == "none" or not ctx.run.profile.torch_optimizer:
        return None
    compute = dtype_bytes(prec.compute)
    # torchtitan's outer units (the ledger's head_unit): the embedding (the root's first tensor) apart
    outer = bool(head) and ctx.layout.has_embedding and len(units[0]) > 1
    if outer:
        units = [list(units[0][:1]), *units[1:], list(units[0][1:])]
    sharded_params = spread(ledger.total(PARAMETERS), units)
    param_bytes = max(prec.param_bytes, 1)
    gather_input = [sum(unit) * compute // param_bytes for unit in sharded_params]
    # ``units`` are the tensors' numels on one rank (reserved_sizes.stage_units): already split by TP
    unsharded = [[n * compute for n in unit] for unit in units]
    grads = spread(ledger.total(GRADIENTS, "end of backward"), units)
    head = max(unsharded[-1 if outer else 0], default=0) if ctx.layout.has_head else 0
    shards = round(sum(unsharded[1]) / gather_input[1]) if len(units) > 1 and gather_input[1] else 1
    scale = (max(shards, 1) * compute, max(prec.grad_bytes, 1)) if finetune else None
    return FsdpSizes(gather_input, unsharded, grads, head, ctx.run.model.tie_word_embeddings, max(shards, 1),
                     scale, outer, (prec.reduce_bytes, max(prec.grad_bytes, 1)))
