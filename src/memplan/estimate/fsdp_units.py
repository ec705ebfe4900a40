"""FSDP's units outside the decoder layers: where the final norm and the head are a unit of their own.

torchtitan's ``apply_fsdp`` and accelerate's ``fsdp2_prepare_model`` shard the input embedding as a unit and the
final norm with an untied head as another (``FrameworkProfile.fsdp_outer_units``, ``"embedding-and-head"``); a
tied head stays with the embedding, and under pipeline parallelism the schedule's stages are the units. The size
of that head unit on one GPU is what the communication rules (``stage_peak.communication``, HSDP's held buffers),
the loss's gathered copy (:mod:`memplan.estimate.fsdp_loss_gather`) and the reserved schedule
(:mod:`memplan.estimate.reserved_fsdp`) read.
"""

from __future__ import annotations

from memplan.estimate.context import StageContext
from memplan.model.params import embedding_params, final_norm_params

__all__ = ["head_unit"]


def head_unit(ctx: StageContext) -> int | None:
    """Numel of the final norm and untied head on this GPU when FSDP shards them as a unit apart from
    the embedding (``FrameworkProfile.fsdp_outer_units``); None when one root unit holds both, and under
    pipeline parallelism, where torchtitan keeps the embedding unsharded after its forward too."""
    run = ctx.run
    if (run.profile.fsdp_outer_units != "embedding-and-head" or run.model.tie_word_embeddings
            or run.job.parallel.pp > 1):
        return None
    if not ctx.layout.has_head:
        return 0
    return final_norm_params(run.model) + embedding_params(run.model, run.vocab_rows) // max(run.job.parallel.tp, 1)
