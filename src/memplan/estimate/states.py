"""Model states of one pipeline stage: parameters, gradients, master weights, optimizer moments.

What a stage holds comes from :mod:`memplan.model.params` (grouped by TP sharding); how ZeRO,
FSDP and the distributed optimizer divide it across data-parallel ranks is decided here.
Dense weights shard over DP x CP (Megatron's data-parallel-with-context group); routed-expert
weights over the expert-data-parallel group EDP = world / (EP x ETP x PP).
"""

from __future__ import annotations

from dataclasses import dataclass

from memplan.estimate.layout import StageLayout
from memplan.estimate.precision import ResolvedPrecision
from memplan.job import Job
from memplan.model.params import (
    embedding_params,
    final_norm_params,
    position_embedding_params,
)
from memplan.model.spec import ModelSpec

#: bitsandbytes 8-bit optimizers quantize each state block-wise with one fp32 absmax per block.
ADAM8BIT_BLOCK = 256


@dataclass(frozen=True, slots=True)
class StageParams:
    """Parameters (numel) one GPU of a stage holds before any data-parallel sharding."""

    dense: int
    expert: int
    #: Largest single decoder layer on this stage (ZeRO-3/FSDP gather unit), numel.
    largest_layer: int
    #: Embedding + head + final norm (the FSDP root unit), numel.
    root: int

    @property
    def total(self) -> int:
        return self.dense + self.expert


def padded_vocab(model: ModelSpec, tp: int, divisible_by: int) -> int:
    """Vocabulary rows after padding to a multiple of ``divisible_by * tp`` (Megatron's rule)."""
    multiple = divisible_by * tp
    return -(-model.vocab_size // multiple) * multiple


def stage_params(model: ModelSpec, job: Job, stage: StageLayout, vocab_rows: int) -> StageParams:
    par = job.parallel
    tp, ep_etp = par.tp, par.ep * par.expert_tp
    dense = expert = largest = 0
    all_groups = model.layer_param_groups
    for index in stage.layer_indices:
        groups = all_groups[index]
        local_dense = groups.tp_sharded // tp + groups.replicated
        local_expert = groups.expert // ep_etp
        dense += local_dense
        expert += local_expert
        largest = max(largest, local_dense + local_expert)
    root = 0
    vocab_local = embedding_params(model, vocab_rows) // tp
    if stage.has_embedding:
        root += vocab_local + position_embedding_params(model)
    if stage.has_head:
        root += final_norm_params(model)
        # An untied head has its own weight; a tied one needs a copy of the embedding on the last
        # stage when the embedding lives on another stage (Megatron's shared word embeddings).
        if not model.tie_word_embeddings or not stage.has_embedding:
            root += vocab_local
    return StageParams(dense=dense + root, expert=expert, largest_layer=largest, root=root)


@dataclass(frozen=True, slots=True)
class StateBytes:
    parameters: int
    gradients: int
    master: int
    optimizer: int
    #: Local numel the optimizer steps over (after sharding), for its temporaries.
    optimizer_numel: int


def _shard_sizes(job: Job) -> tuple[int, int]:
    """(dense, expert) data-parallel group sizes that shards divide over."""
    par, sh = job.parallel, job.sharding
    dense = par.data_parallel * par.cp
    expert = par.expert_dp
    if sh.distributed_optimizer and sh.distributed_optimizer_instances > 1:
        instances = sh.distributed_optimizer_instances
        return max(1, dense // instances), max(1, expert // instances)
    if sh.fsdp == "hybrid":
        size = sh.fsdp_shard_size or min(dense, 8)
        return min(size, dense), min(size, expert)
    return dense, expert


def _sharded(numel_dense: int, numel_expert: int, shards: tuple[int, int], on: bool) -> int:
    if not on:
        return numel_dense + numel_expert
    return -(-numel_dense // shards[0]) + -(-numel_expert // shards[1])


def optimizer_state_bytes(numel: int, job: Job, state_bytes: int, hidden: int) -> int:
    """Moments kept by the optimizer for ``numel`` parameters."""
    name = job.optimizer.name
    if name in ("adam", "adamw"):
        return 2 * numel * state_bytes
    if name == "adam8bit":
        return 2 * (numel + 4 * -(-numel // ADAM8BIT_BLOCK))
    if name == "sgd":
        return numel * state_bytes if job.optimizer.momentum > 0 else 0
    # Adafactor (no first moment): one row and one column factor per matrix, about
    # numel/cols + numel/rows; with one side of every matrix equal to the hidden size this is
    # about 2 * numel / hidden.
    return 2 * (numel // hidden) * state_bytes


def state_bytes(model: ModelSpec, job: Job, params: StageParams, prec: ResolvedPrecision) -> StateBytes:
    sh = job.sharding
    shards = _shard_sizes(job)
    full_shard = sh.zero == 3 or sh.fsdp != "none"
    grad_shard = sh.zero >= 2 or sh.fsdp != "none"
    opt_shard = sh.zero >= 1 or sh.fsdp != "none" or sh.distributed_optimizer
    p_numel = _sharded(params.dense, params.expert, shards, full_shard)
    g_numel = _sharded(params.dense, params.expert, shards, grad_shard)
    o_numel = _sharded(params.dense, params.expert, shards, opt_shard)
    return StateBytes(
        parameters=p_numel * prec.param_bytes,
        gradients=g_numel * prec.grad_bytes,
        master=o_numel * prec.master_bytes,
        optimizer=optimizer_state_bytes(o_numel, job, prec.state_bytes, model.hidden_size),
        optimizer_numel=o_numel,
    )
