"""PyTorch FSDP2's last all-gather output of the forward, alive at the loss when the loss runs inside the model.

In the forward, FSDP2 keeps each unit's all-gather output (the flat buffer the collective writes, the unit's
parameters in the compute dtype) past its copy-out into the unsharded parameters, so that the next unit's
all-gather can overlap the copy-out: torch ``FSDPParamGroup.wait_for_unshard`` parks it in
``comm_ctx.all_gather_state``, and frees it at the next unit's copy-out in the forward or, for the last unit, at
the root module's post-forward (``FSDPState._post_forward`` of the iteration's forward root). Where the loss is
computed inside the model's forward (a Hugging Face causal LM given ``labels``, as the Trainer calls it:
``FrameworkProfile.loss_in_model_forward``), the last unit's output is therefore alive through the loss's forward.
Under one root unit that unit is the last decoder layer, resharded after its forward: its output takes the place
of its parameters, which the loss moment's unsharded block already prices. Where the final norm and the head are a
unit of their own (``FrameworkProfile.fsdp_outer_units``), kept unsharded after its forward
(``reshard_after_forward=False``), the output is alive beside that unit's unsharded parameters: the head's weight
twice. Where the trainer computes the loss on the model's output (torchtitan's ``train.py``: ``loss_fn(pred,
labels)``), the root's post-forward has freed it before; so it has under torchtune's chunked loss (``--loss
chunked``), whose decoder runs the head on each chunk inside the model's forward and whose recipes compute the
cross-entropy on the returned chunks (``memplan trace --loss chunked`` on FSDP ranks: benchmarks/
chunked_fsdp_witness.py).

The loss moment of the ledger is the larger of the loss's forward and its backward (which holds more logits:
:class:`~memplan.estimate.stage_peak.LossPart`'s ``logits`` against ``forward_logits``); the buffer is priced there
as what it adds beyond that difference, after the autocast cache (alive in the loss's forward too) has taken its
share of it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from memplan.frozen import frozen_dataclass
from memplan.job import resolved_loss
from memplan.units import dtype_bytes

if TYPE_CHECKING:
    from memplan.estimate.context import StageContext


@frozen_dataclass
class LossGather:
    """The last unit's all-gather output at the loss: its bytes (the category's highest) and what it adds to the
    loss moment's sum."""

    nbytes: int = 0
    at_loss: int = 0

    @property
    def note(self) -> str:
        if not self.nbytes:
            return ""
        return (f"FSDP2 keeps the forward's last unit's all-gather output ({self.nbytes / 2**20:,.1f} MiB) until the "
                f"root module's forward returns: alive through the loss computed inside the model's forward, "
                f"{self.at_loss / 2**20:,.1f} MiB beyond the loss backward's larger logits")


def loss_gather(gathered: int, logits: int, forward_logits: int, forward_cache: int) -> LossGather:
    """``gathered``: the last unit's all-gather output, bytes (0: none alive at the loss); ``logits`` and
    ``forward_logits``: what the loss's backward and its forward hold of the logits; ``forward_cache``: the
    loss forward's other extra (autocast's cached copies), which the difference absorbs first."""
    if not gathered:
        return LossGather()
    room = logits - forward_logits
    return LossGather(gathered, max(0, gathered + forward_cache - room) - max(0, forward_cache - room))


def last_gathered(ctx: StageContext, head: int | None) -> int:
    """Bytes of the forward's last FSDP2 unit's all-gather output when it is alive at the loss beside that unit's
    unsharded parameters (:mod:`memplan.estimate.fsdp_loss_gather`): the [final norm, head] unit's where it is a
    unit apart and stays unsharded after its forward (``head``, its elements:
    :func:`~memplan.estimate.fsdp_units.head_unit`). 0 under one root unit (the last decoder layer reshards
    after its forward: its all-gather output takes the place of its parameters, which the loss moment's block
    already prices), where the loss runs outside the model's forward (the trainer's, or torchtune's chunked loss on
    the model's chunked logits), and under pipeline parallelism (the schedule calls the loss)."""
    run = ctx.run
    if run.job.sharding.fsdp == "none" or not (run.profile.torch_optimizer and run.profile.loss_in_model_forward):
        return 0
    if resolved_loss(run.job) == "chunked":
        return 0
    return 0 if head is None else head * dtype_bytes(run.prec.compute)


#: The sentence of :func:`chunked_loss_block`.
CHUNKED_NOTE = ("FSDP2 under one root unit at torchtune's chunked loss: its cross-entropy runs after the model's "
                "forward returns and before the root's pre-backward prefetches the last block, so the loss holds the "
                "root's unsharded parameters alone")


def chunked_loss_block(ctx: StageContext, head: int | None, at_loss: int, root: int) -> int:
    """What the loss moment holds less than ``at_loss`` (its collective buffers as priced by phase: under one root
    unit the root's and the last block's, ``root`` the root's) under torchtune's chunked loss (``--loss chunked``):
    the last block is resharded after its forward and its all-gather output freed by the root's post-forward, and
    the root's pre-backward hook, which prefetches it for the backward, runs at the first chunk's logits gradient,
    after the cross-entropy's forward (``memplan trace --loss chunked`` on FSDP ranks). 0 where the head is a unit
    apart (:func:`~memplan.estimate.fsdp_units.head_unit`: only that unit is priced at the loss), under pipeline
    parallelism (the schedule calls the loss; not traced) and for other losses."""
    if head is not None or ctx.run.job.parallel.pp > 1 or resolved_loss(ctx.run.job) != "chunked":
        return 0
    return max(0, at_loss - root)
