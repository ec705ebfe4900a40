"""PyTorch FSDP2's all-gathers in the forward: the communication buffers alive at a unit's copy-out.

A unit's all-gather (torch ``foreach_all_gather``) allocates one flat output buffer, the unit's parameters in the
compute dtype over every rank of the shard group; its copy-out (``foreach_all_gather_copy_out``) then allocates the
unit's unsharded parameters (``FSDPParam.alloc_all_gather_outputs``) and copies the buffer into them. In the
forward ``FSDPParamGroup.wait_for_unshard`` parks each unit's buffer in ``comm_ctx.all_gather_state`` after its
copy-out, to overlap that copy-out with the next all-gather, and drops it at the next unit's ``wait_for_unshard``,
whose local reference (``prev_all_gather_state``) keeps it alive until that unit's copy-out has returned. So at a
unit's copy-out three copies are alive: the previous unit's buffer, the unit's buffer and its unsharded
parameters, beside the units kept unsharded after their forward (``reshard_after_forward=False``: the root unit,
or the [final norm, head] unit). With one rank in the shard group no buffer is made (the copy is from the local
shard).

Under one root unit (embedding, final norm and head, kept unsharded): the first block's copy-out holds the root's
parameters, its buffer and the block twice; a later block's the root and three blocks. Where the embedding and the
final norm with the head are units apart (``FrameworkProfile.fsdp_outer_units``): the first block's holds the
embedding's buffer and the block twice, a later block's three blocks, the head unit's the last block's buffer and
the head unit twice. While the last layer's forward computes, the layer's parameters and its buffer are alive
beside the kept units (the ledger's end-of-forward moment, where it has one).

The copy-outs are in the category's highest only: a block's comes before the later blocks' activations are saved,
the head unit's before the logits are made, and the ledger has neither moment.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from memplan.estimate.extras import unsharded_block
from memplan.estimate.states import dense_shard_ranks
from memplan.frozen import frozen_dataclass
from memplan.units import dtype_bytes

if TYPE_CHECKING:
    from memplan.estimate.context import StageContext
    from memplan.estimate.states import StageParams


@frozen_dataclass
class ForwardGathers:
    """The most communication alive at one copy-out of the forward, and while the last layer's forward computes."""

    most: int = 0
    last_layer: int = 0
    #: Which copy-out holds ``most``.
    where: str = ""

    @property
    def note(self) -> str:
        if not self.most:
            return ""
        return (f"FSDP2 keeps each unit's all-gather output past its copy-out in the forward until the next unit's "
                f"copy-out has run (FSDPParamGroup.wait_for_unshard): {self.most / 2**20:,.1f} MiB of all-gather "
                f"outputs and unsharded parameters at {self.where}, in the communication category's highest only "
                f"(no peak moment of the estimate is a copy-out)")


#: No forward all-gather output alive (no FSDP2, one rank in the shard group).
NONE = ForwardGathers()


def forward_gathers(ctx: StageContext, params: StageParams, head: int | None) -> ForwardGathers:
    """``head``: the [final norm, head] unit's numel where it is a unit apart, else None (one root unit:
    ``params.root``). Nothing outside PyTorch FSDP2, with one rank in the shard group (no all-gather output) or with
    no layer on the stage."""
    run = ctx.run
    if run.job.sharding.fsdp == "none":  # (the default job's fast path)
        return NONE
    layers = ctx.layout.num_layers
    if not run.profile.torch_optimizer or dense_shard_ranks(run.job) < 2 or not layers:
        return NONE
    c = dtype_bytes(run.prec.compute)
    block = unsharded_block(params, c)
    later = [(3 * block, "a later block's copy-out")] if layers > 1 else []
    if head is None:
        root = params.root * c
        moments = [(2 * root + 2 * block, "the first block's copy-out (the root unit's output parked)"),
                    *[(root + size, where) for size, where in later]]
        most, where = max(moments)
        return ForwardGathers(most, last_layer=root + 2 * block, where=where)
    embedding, head_bytes = (params.root - head) * c, head * c
    moments = [(embedding + 2 * block, "the first block's copy-out (the embedding unit's output parked)"), *later,
               (block + 2 * head_bytes, "the head unit's copy-out (the last block's output parked)")]
    most, where = max(moments)
    return ForwardGathers(most, last_layer=2 * block, where=where)
