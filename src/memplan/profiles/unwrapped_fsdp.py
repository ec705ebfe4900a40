"""``--fsdp`` over a shard group of one rank, where the framework does not wrap the model there.

torchtitan applies FSDP2 only when ``ParallelDims.fsdp_enabled`` (``dp_shard > 1`` or context parallelism), so a
torchtitan job whose shard group is one rank (``--fsdp full --gpus 1``, or a hybrid group of one) trains the model
unwrapped: no all-gather or reduce-scatter buffers, gradients on the parameters, the step on whole tensors; with
one replica it is a single-device run, with several it is data parallelism (torchtitan's ``replicate``).
accelerate wraps at one process too; the profile field ``FrameworkProfile.fsdp_at_one_rank`` says which. :func:`unwrapped` is the one place the
estimator moves such a job to ``--fsdp none``, with the sentence saying so; ``memplan trace`` asks
:func:`wraps_fsdp` whether to call ``fully_shard``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from memplan.errors import JobConfigError
from memplan.profiles.framework import get_profile

__all__ = ["shard_group", "unwrapped", "wraps_fsdp"]


def shard_group(job: Any) -> int:
    """Ranks a parameter is sharded over: every data-parallel rank under full sharding, one shard group's under
    hybrid sharding, 1 without FSDP. ``job`` is a :class:`memplan.job.Job` (this layer sits below it)."""
    sharding, dp = job.sharding, job.parallel.data_parallel
    if sharding.fsdp == "hybrid":
        return min(sharding.hybrid_shard_size(dp), dp)
    return dp if sharding.fsdp == "full" else 1


def wraps_fsdp(job: Any) -> bool:
    """Whether ``job``'s framework wraps the model with FSDP2: ``--fsdp`` over two or more ranks (the shard group,
    or with context parallelism), or at one where the profile says so (``fsdp_at_one_rank``)."""
    if job.sharding.fsdp == "none":
        return False
    return shard_group(job) > 1 or job.parallel.cp > 1 or get_profile(job.framework).fsdp_at_one_rank


def unwrapped(job: Any) -> tuple[Any, str | None]:
    """(``job`` as its framework runs it, the sentence saying so; None where ``--fsdp`` wraps the model as given).
    A setting that needs FSDP (parameter offload) is a ``JobConfigError`` naming ``--fsdp`` and the rule."""
    sharding = job.sharding
    if sharding.fsdp == "none" or wraps_fsdp(job):
        return job, None
    named = f"--framework {job.framework} --fsdp {sharding.fsdp}"
    try:
        moved = dataclasses.replace(job, sharding=dataclasses.replace(
            sharding, fsdp="none", fsdp_shard_size=None, zero=0 if sharding.zero == 3 else sharding.zero))
    except JobConfigError as exc:
        raise JobConfigError("--fsdp", f"{sharding.fsdp} over a shard group of one rank: {job.framework} does not "
                             f"wrap the model with FSDP2 there (its FSDP needs 2+ shard ranks, or context "
                             f"parallelism), so this job cannot run as given ({exc})", sharding.fsdp) from None
    return moved, (f"{named}: the shard group is one rank and {job.framework} applies FSDP2 only over two or more "
                   "(torchtitan's ParallelDims.fsdp_enabled), so the model trains unwrapped and the job is priced as "
                   "--fsdp none")
