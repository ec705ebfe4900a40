"""Model states of one pipeline stage: parameters, gradients, master weights, optimizer moments.

What a stage holds comes from :mod:`memplan.model.params` (grouped by TP sharding); how ZeRO,
FSDP and the distributed optimizer divide it across data-parallel ranks is decided here.
Dense weights shard over DP x CP (Megatron's data-parallel-with-context group); routed-expert
weights over the expert-data-parallel group EDP = world / (EP x ETP x PP).
"""

from __future__ import annotations

from dataclasses import replace
from functools import lru_cache
from typing import ClassVar

from memplan.estimate.finetune import StageFinetune, adapter_bytes, frozen_bytes_per_element, zero3_flat_master
from memplan.estimate.layout import StageLayout
from memplan.estimate.memo import Same
from memplan.estimate.optimizers import (  # noqa: F401  (ADAM8BIT_BLOCK, optimizer_state_bytes: re-exported)
    ADAM8BIT_BLOCK,
    SmallTensors,
    optimizer_state_bytes,
    optimizer_states,
)
from memplan.estimate.precision import ResolvedPrecision
from memplan.frozen import frozen_dataclass
from memplan.job import Job, Offload, resolved_optimizer_impl
from memplan.profiles import FrameworkProfile, get_profile
from memplan.model.params import (
    ParamGroups,
    embedding_params,
    final_norm_params,
    norm_params,
    position_embedding_params,
)
from memplan.model.spec import ModelSpec
from memplan.optimizers import optimizer_kind
from memplan.optimizers.kind import WeightMatrix


@frozen_dataclass
class StageParams:
    """Parameters (numel) one GPU of a stage holds before any data-parallel sharding."""

    dense: int
    expert: int
    #: Largest single decoder layer on this stage (ZeRO-3/FSDP gather unit), numel.
    largest_layer: int
    #: Embedding + head + final norm (the FSDP root unit), numel.
    root: int
    #: Weights that FP8 GEMMs read (decoder-layer linear weights), numel on this rank.
    gemm_weights: int = 0
    #: Of ``gemm_weights``: the routed experts' (sharded over the expert data-parallel group, not the dense one).
    gemm_expert: int = 0
    #: Of ``dense``: router weights transformers keeps in fp32 (:attr:`MoESpec.router_fp32`), numel.
    fp32_routers: int = 0
    #: Of ``dense + expert``: the multi-token-prediction modules on this (last) stage, numel.
    mtp: int = 0
    #: Full training (:class:`FinetuneStageParams` under fine-tuning, which sets them): no peft adapters beside
    #: ``largest_layer``, whose every parameter an FSDP unit reduce-scatters. Class attributes, not fields, so a
    #: full-training stage builds no more than it did.
    layer_adapter_bytes: ClassVar[int] = 0
    layer_trainable: ClassVar[int | None] = None

    @property
    def total(self) -> int:
        return self.dense + self.expert


def padded_vocab(model: ModelSpec, tp: int, divisible_by: int) -> int:
    """Vocabulary rows after padding to a multiple of ``divisible_by * tp`` (Megatron's rule)."""
    multiple = divisible_by * tp
    return -(-model.vocab_size // multiple) * multiple


def _local_layer(groups: ParamGroups, job: Job) -> tuple[int, int]:
    """(dense, expert) numel of one layer's weights on one rank."""
    par = job.parallel
    ep_etp = par.ep * par.expert_tp
    dense = groups.tp_sharded // par.tp + groups.replicated
    expert = groups.expert // ep_etp
    if groups.shared_expert and job.moe.shared_expert_parallel == "expert":
        # Shared experts sit with the routed ones on every EP rank: split by ETP, not TP.
        dense -= groups.shared_expert // par.tp
        expert += groups.shared_expert // par.expert_tp
    return dense, expert


def fp32_router_weights(job: Job, prec: ResolvedPrecision) -> bool:
    """The job's framework keeps MoE router weights in fp32 while the model's weights are narrower."""
    return get_profile(job.framework).fp32_router_weights and prec.param_bytes < 4


def layer_numel_on_rank(groups: ParamGroups, job: Job) -> tuple[int, int]:
    """(dense, expert) parameters of one decoder layer on one rank (TP/EP/ETP-divided)."""
    return _local_layer(groups, job)


def layer_kinds(model: ModelSpec, indices: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    """(a representative index, how many) of each distinct layer object among ``indices`` (layers
    that share a spec object share every per-layer figure), in first-seen order."""
    return _kinds_of(Same(model), indices)


@lru_cache(maxsize=256)
def _kinds_of(model_key: Same, indices: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    """:func:`layer_kinds`, memoised per model object (a frozen spec) and stage."""
    seen: dict[int, list[int]] = {}
    layers = model_key.obj.layers  # type: ignore[attr-defined]
    for index in indices:
        entry = seen.get(id(layers[index]))
        if entry is None:
            seen[id(layers[index])] = [index, 1]
        else:
            entry[1] += 1
    return tuple((index, count) for index, count in seen.values())


def stage_params(model: ModelSpec, job: Job, stage: StageLayout, vocab_rows: int, *,
                 vocab_parallel: bool = True) -> StageParams:
    """Parameters one GPU of ``stage`` holds. ``vocab_parallel=False``: Hugging Face's TP plan keeps the
    embedding (and a head tied to it) whole on every rank and splits an untied head by columns."""
    tp = job.parallel.tp
    hidden = model.hidden_size
    dense = expert = largest = gemm = gemm_expert = 0
    all_groups, non_gemm = model.layer_param_groups, model.layer_non_gemm_params
    routers = 0
    for index, count in layer_kinds(model, stage.layer_indices):
        moe = model.layers[index].moe
        if moe is not None and moe.router_fp32:
            routers += count * (hidden * moe.num_experts + (
                moe.num_experts if moe.router_bias and not moe.router_bias_is_buffer else 0))
        local_dense, local_expert = _local_layer(all_groups[index], job)
        dense += count * local_dense
        expert += count * local_expert
        largest = max(largest, local_dense + local_expert)
        gemm += count * (local_dense + local_expert - non_gemm[index])
        gemm_expert += count * local_expert
    root = 0
    vocab_local = embedding_params(model, vocab_rows) // tp
    embedding_local = vocab_local if vocab_parallel else embedding_params(model, vocab_rows)
    if stage.has_embedding:
        root += embedding_local + position_embedding_params(model)
    mtp = 0
    if stage.has_head:
        root += final_norm_params(model)
        # An untied head has its own weight; a tied one needs a copy of the embedding on the last
        # stage when the embedding lives on another stage (Megatron's shared word embeddings).
        if not model.tie_word_embeddings or not stage.has_embedding:
            root += vocab_local if not model.tie_word_embeddings else embedding_local
        if job.mtp_layers:
            # Each MTP module: two input norms, a 2h -> h column-parallel projection, one decoder
            # layer shaped like the last one, a final norm; the modules read the token embedding,
            # so the last stage holds a copy of it when it lives elsewhere.
            layer_dense, layer_expert = _local_layer(all_groups[-1], job)
            per_module_dense = layer_dense + 3 * norm_params(hidden, model.norm_bias) + 2 * hidden * hidden // tp
            mtp = job.mtp_layers * (per_module_dense + layer_expert)
            dense += job.mtp_layers * per_module_dense
            expert += job.mtp_layers * layer_expert
            gemm += job.mtp_layers * (layer_dense + layer_expert + 2 * hidden * hidden // tp
                                      - non_gemm[-1])
            gemm_expert += job.mtp_layers * layer_expert
            if not stage.has_embedding and not model.tie_word_embeddings:
                root += vocab_local
    return StageParams(dense=dense + root, expert=expert, largest_layer=largest, root=root, gemm_weights=gemm,
                       gemm_expert=gemm_expert, mtp=mtp, fp32_routers=routers)


@frozen_dataclass
class FinetuneStageParams(StageParams):
    """:class:`StageParams` of a fine-tuning stage (:func:`memplan.estimate.stage_states.model_states`)."""

    #: The bytes of the largest decoder layer's peft adapters in its FSDP unit's unsharded copy (in the adapters'
    #: compute dtype, :func:`memplan.estimate.finetune.adapter_compute_bytes`), which ``largest_layer`` does not count.
    layer_adapter_bytes: int = 0  # type: ignore[misc]
    #: The most trainable parameters of one decoder layer (numel), the only ones an FSDP unit reduce-scatters.
    layer_trainable: int | None = None  # type: ignore[misc]


@frozen_dataclass
class StateBytes:
    """Model-state bytes on the GPU, and what offloading moved to CPU memory."""

    parameters: int
    gradients: int
    master: int
    optimizer: int
    #: Local numel the optimizer steps over (after sharding), for its temporaries.
    optimizer_numel: int
    #: FP8 weight copies and their transposes (part of ``parameters``).
    fp8_weights: int = 0
    #: Bytes offloaded to CPU memory: weights, gradients, optimizer state (master + moments).
    cpu_parameters: int = 0
    cpu_gradients: int = 0
    cpu_optimizer: int = 0
    #: bitsandbytes paged optimizer states in CUDA unified memory (not in ``optimizer``; outside
    #: PyTorch's caching allocator).
    paged_optimizer: int = 0
    #: Element size of the optimizer states the step's temporaries follow (0: the precision's);
    #: peft adapters are fp32 whatever the precision.
    state_element_bytes: int = 0
    #: Peak bytes of the step its registry entry prices from shapes (GaLore's projection); 0 for most.
    optimizer_step: int = 0
    #: When the stepped states have several dtypes (fine-tuning: trained weights, adapters, ``modules_to_save``
    #: copies), (numel, element bytes) per dtype; empty: one group of ``optimizer_numel`` elements.
    step_groups: tuple[tuple[int, int], ...] = ()

    @property
    def cpu_total(self) -> int:
        return self.cpu_parameters + self.cpu_gradients + self.cpu_optimizer


def _shard_sizes(job: Job) -> tuple[int, int]:
    """(dense, expert) data-parallel group sizes that shards divide over."""
    par, sh = job.parallel, job.sharding
    dense = par.data_parallel * par.cp
    expert = par.expert_dp
    if sh.distributed_optimizer and sh.distributed_optimizer_instances > 1:
        instances = sh.distributed_optimizer_instances
        return max(1, dense // instances), max(1, expert // instances)
    if sh.fsdp == "hybrid":
        size = sh.hybrid_shard_size(dense)
        return min(size, dense), min(size, expert)
    return dense, expert


def dense_shard_ranks(job: Job) -> int:
    """Ranks the dense parameters are sharded over (the data-parallel group, or its shard group)."""
    return _shard_sizes(job)[0]


def _sharded(numel_dense: int, numel_expert: int, shards: tuple[int, int], on: bool) -> int:
    if not on:
        return numel_dense + numel_expert
    return -(-numel_dense // shards[0]) + -(-numel_expert // shards[1])


def sharded_numel(job: Job, dense: int, expert: int) -> int:
    """Elements of ``dense`` and ``expert`` parameters one GPU keeps when they are sharded as the job's
    fully sharded states are (dense over the data-parallel group or its shard group, experts over theirs)."""
    return _sharded(dense, expert, _shard_sizes(job), True)


#: Bytes of one ``state["step"]`` tensor (float32 scalar) of torch.optim's Adam/AdamW.
STEP_COUNTER_BYTES = 4


def device_step_counters(job: Job, profile: FrameworkProfile, stage_tensors: int) -> int:
    """Step-counter tensors an optimizer keeps on the GPU for one stage's ``stage_tensors`` parameters.

    torch.optim's Adam and AdamW create ``state["step"]`` per parameter on the parameter's device
    when ``fused`` or ``capturable`` (torch/optim/adam.py ``_init_group``), on the host otherwise;
    FSDP and TP shard tensors but each local shard has its own step. SGD keeps none.
    """
    if not profile.torch_optimizer or not optimizer_kind(job.optimizer.name).fused_step_counters:
        return 0
    return stage_tensors if resolved_optimizer_impl(job) == "fused" else 0


def _fp32_router_extra(model: ModelSpec, job: Job, params: StageParams, prec: ResolvedPrecision,
                       shards: tuple[int, int], sharded: tuple[bool, bool, bool]) -> tuple[int, int, int]:
    """What transformers' fp32 routers under 16-bit weights add to the parameters, gradients and
    (torch) optimizer states over the stage's dtypes: they are fp32 (:attr:`memplan.model.spec.MoESpec.router_fp32`);
    ``sharded``: whether parameters, gradients and optimizer states are sharded."""
    fp32_routers = params.fp32_routers if fp32_router_weights(job, prec) else 0
    if not fp32_routers:
        return 0, 0, 0
    full_shard, grad_shard, opt_shard = sharded
    routers_o = _sharded(fp32_routers, 0, shards, opt_shard)
    return (_sharded(fp32_routers, 0, shards, full_shard) * (4 - prec.param_bytes),
            _sharded(fp32_routers, 0, shards, grad_shard) * (4 - prec.grad_bytes),
            optimizer_states(routers_o, job, 4, model.hidden_size).device_bytes
            - optimizer_states(routers_o, job, prec.state_bytes, model.hidden_size).device_bytes)


def state_bytes(
    model: ModelSpec,
    job: Job,
    params: StageParams,
    prec: ResolvedPrecision,
    *,
    offload_moves_gradients: bool = False,
    step_counters: int = 0,
    small: SmallTensors | None = None,
    finetune: StageFinetune | None = None,
    muon_scalar: int = 0,
    matrices: tuple[WeightMatrix, ...] = (),
) -> StateBytes:
    """Model states one GPU of a stage holds (and what offloading moves to CPU memory).

    ``step_counters``: per-parameter step tensors the optimizer keeps on the GPU
    (:func:`device_step_counters`), optimizer state like the moments.

    ``offload_moves_gradients``: the framework's optimizer offload also keeps the fp32 gradient
    partition in CPU memory (DeepSpeed ZeRO-Offload, FSDP CPU offload); otherwise (Megatron) the
    gradient buffer stays on the GPU and CPU memory holds a copy for the CPU optimizer step.

    ``muon_scalar``: with Muon, the stage's (dense) elements its scalar optimizer steps, sharded
    like the other dense parameters; ``matrices``: the 2-D weights it steps one at a time.
    """
    sh, off = job.sharding, job.offload
    shards = _shard_sizes(job)
    full_shard = sh.zero == 3 or sh.fsdp != "none"
    grad_shard = sh.zero >= 2 or sh.fsdp != "none"
    opt_shard = sh.zero >= 1 or sh.fsdp != "none" or sh.distributed_optimizer
    p_numel = _sharded(params.dense, params.expert, shards, full_shard)
    g_numel = _sharded(params.dense, params.expert, shards, grad_shard)
    o_numel = _sharded(params.dense, params.expert, shards, opt_shard)
    parameters = p_numel * prec.param_bytes
    if finetune is not None:
        # FSDP's CPU offload and ZeRO-3's offload_param move every sharded weight, the frozen (and
        # quantized) base included; optimizer offload moves the trained parameters' states
        return _offloaded(_finetune_state_bytes(model, job, params, prec, finetune,
                                                (full_shard, grad_shard, opt_shard), step_counters, small),
                          off, offload_moves_gradients)
    fp8, replaced = _fp8_weight_bytes(job, params, prec, shards, full_shard)
    parameters += fp8 - replaced
    gradients = g_numel * prec.grad_bytes
    routers = _fp32_router_extra(model, job, params, prec, shards, (full_shard, grad_shard, opt_shard))
    parameters += routers[0]
    gradients += routers[1]
    master = o_numel * prec.master_bytes
    # Optimizer hook (memplan.estimate.optimizers): ``small`` is the stage's split, scaled to the shard.
    shard_small = small.scaled(o_numel / max(params.total, 1)) if small is not None else None
    scalar = _sharded(muon_scalar, 0, shards, opt_shard)
    opt_states = optimizer_states(o_numel, job, prec.state_bytes, model.hidden_size, shard_small, muon_scalar=scalar,
                                  matrices=matrices)
    optimizer = opt_states.device_bytes + routers[2] + step_counters * STEP_COUNTER_BYTES
    on_gpu = StateBytes(parameters=parameters, gradients=gradients, master=master, optimizer=optimizer,
                        optimizer_numel=o_numel, fp8_weights=fp8, paged_optimizer=opt_states.paged_bytes,
                        optimizer_step=opt_states.step_bytes if o_numel else 0)
    return _offloaded(on_gpu, off, offload_moves_gradients)


def _fp8_weight_bytes(job: Job, params: StageParams, prec: ResolvedPrecision, shards: tuple[int, int],
                      full_shard: bool) -> tuple[int, int]:
    """(FP8 weight bytes, 16-bit weight bytes they replace) of the stage's GEMM weights, sharded as the
    weights are (``full_shard``: ZeRO-3 / FSDP; dense weights over ``shards[0]``, experts over ``shards[1]``)."""
    if job.precision.fp8 is None:
        return 0, 0
    gemm = _sharded(params.gemm_weights - params.gemm_expert, params.gemm_expert, shards, full_shard)
    if job.precision.fp8_params:
        # FP8 weights replace the 16-bit ones (1 byte) and keep an FP8 transpose (1 byte).
        return gemm, gemm * (prec.param_bytes - 1)
    # Transformer Engine casts each GEMM weight to FP8 once per step and caches it and its
    # transpose across micro-batches (Hopper FP8 GEMMs need both layouts).
    return 2 * gemm, 0


def _offloaded(on_gpu: StateBytes, off: Offload, moves_gradients: bool) -> StateBytes:
    """``on_gpu`` with what optimizer and weight offloading move to CPU memory."""
    if not off.optimizer and not off.params:
        return on_gpu
    parameters, gradients, master, optimizer = on_gpu.parameters, on_gpu.gradients, on_gpu.master, on_gpu.optimizer
    cpu_params = cpu_grads = cpu_opt = 0
    if off.optimizer:
        fraction = off.optimizer_fraction
        cpu_opt = int((master + optimizer) * fraction)
        master -= int(master * fraction)
        optimizer -= int(optimizer * fraction)
        # The CPU step reads fp32 gradients in CPU memory.
        cpu_grads = int(on_gpu.optimizer_numel * fraction) * 4
        if moves_gradients:
            gradients -= int(gradients * fraction)
    if off.params:
        cpu_params = parameters - on_gpu.fp8_weights
        parameters = on_gpu.fp8_weights
    return replace(on_gpu, parameters=parameters, gradients=gradients, master=master, optimizer=optimizer,
                   optimizer_numel=0 if off.optimizer and off.optimizer_fraction == 1.0 else on_gpu.optimizer_numel,
                   cpu_parameters=cpu_params, cpu_gradients=cpu_grads, cpu_optimizer=cpu_opt)


#: DeepSpeed ZeRO-3's flat master copy is fp32 whatever the parameter's dtype.
_FP32_MASTER = 4


def _mastered_like_weights(ft: StageFinetune, prec: ResolvedPrecision, adapter: int, base: int) -> StageFinetune:
    """Under a precision with a separate master copy (DeepSpeed's engine), adapters in the weights' dtype and peft
    ``modules_to_save`` copies in it (``base``: the frozen base's bytes per element) are mastered like the trained
    weights: an fp32 master and fp32 moments (stage3.py ``_create_fp32_partitions``; measured, helper zero18: Z11b)."""
    if prec.master_bytes and adapter == prec.param_bytes and ft.adapter:
        ft = replace(ft, full=ft.full + ft.adapter, adapter=0)
    if prec.master_bytes and base == prec.param_bytes and ft.copies:
        ft = replace(ft, full=ft.full + ft.copies, copies=0)
    return ft


def _finetune_state_bytes(model: ModelSpec, job: Job, params: StageParams, prec: ResolvedPrecision,
                          ft: StageFinetune, sharded: tuple[bool, bool, bool], step_counters: int,
                          small: SmallTensors | None = None) -> StateBytes:
    """Model states when part of the model is frozen (:mod:`memplan.estimate.finetune`).

    Fully trained weights follow the job's precision; adapters keep their dtype's gradients and no
    master copy, unless they are in the weights' dtype under a precision with a separate master copy (DeepSpeed
    casts them to the model's 16 bits: its optimizer keeps their fp32 master and moments as for every weight; so for
    peft's ``modules_to_save`` copies in the weights' dtype, which otherwise keep the frozen base's dtype) or
    DeepSpeed's ZeRO-3 steps them (:func:`zero3_flat_master`: an fp32 master, gradients in the gradients' dtype);
    frozen weights have no gradient, master or optimizer state. ZeRO/FSDP divide each
    over data parallelism as in full training (dense shard group). Offload is not applied here.
    """
    shards = _shard_sizes(job)
    full_shard, grad_shard, opt_shard = sharded

    def share(numel: int, on: bool) -> int:
        return _sharded(numel, 0, shards, on)

    adapter, base = adapter_bytes(job), frozen_bytes_per_element(job)
    ft = _mastered_like_weights(ft, prec, adapter, base)
    adapter_grad, adapter_master = adapter, 0
    if ft.adapter and zero3_flat_master(job, prec):
        adapter_grad, adapter_master = prec.grad_bytes, _FP32_MASTER
    frozen_bytes = ft.frozen * base + ft.quantized_bytes
    parameters = (share(ft.full, full_shard) * prec.param_bytes + share(ft.adapter, full_shard) * adapter
                  + share(ft.copies, full_shard) * base
                  + (-(-frozen_bytes // shards[0]) if full_shard else frozen_bytes))
    gradients = (share(ft.full, grad_shard) * prec.grad_bytes + share(ft.adapter, grad_shard) * adapter_grad
                 + share(ft.copies, grad_shard) * base)
    master = share(ft.full, opt_shard) * prec.master_bytes + share(ft.adapter, opt_shard) * adapter_master
    o_numel = share(ft.trainable, opt_shard)
    stepped = share(ft.full + ft.adapter, opt_shard)
    shard_small = small.scaled(stepped / max(ft.full + ft.adapter, 1)) if small is not None else None
    # torch optimizers keep states in each parameter's dtype: the precision's for trained weights,
    # the adapter dtype for adapters (bitsandbytes' own dtypes ignore this)
    full_n, adapter_n = share(ft.full, opt_shard), share(ft.adapter, opt_shard)
    if full_n and adapter_n:
        parts = [optimizer_states(n, job, nbytes, model.hidden_size,
                                  shard_small.scaled(n / stepped) if shard_small is not None else None)
                 for n, nbytes in ((full_n, prec.state_bytes), (adapter_n, adapter))]
        device, paged = sum(p.device_bytes for p in parts), sum(p.paged_bytes for p in parts)
    else:
        one = optimizer_states(stepped, job, prec.state_bytes if full_n else adapter, model.hidden_size,
                               shard_small)
        device, paged = one.device_bytes, one.paged_bytes
    optimizer = device
    if ft.copies:
        optimizer += optimizer_state_bytes(share(ft.copies, opt_shard), job, base, model.hidden_size)
    optimizer += step_counters * STEP_COUNTER_BYTES
    return StateBytes(parameters=parameters, gradients=gradients, master=master, optimizer=optimizer,
                      optimizer_numel=o_numel, paged_optimizer=paged,
                      state_element_bytes=prec.state_bytes if full_n else adapter,
                      step_groups=_dtype_groups(((full_n, prec.state_bytes), (adapter_n, adapter),
                                                 (share(ft.copies, opt_shard), base))))


def _dtype_groups(parts: tuple[tuple[int, int], ...]) -> tuple[tuple[int, int], ...]:
    """(numel, element bytes) per state dtype, as torch's optimizers group their tensors by dtype
    (``Optimizer._group_tensors_by_device_and_dtype``); empty when there is one dtype or none."""
    merged: dict[int, int] = {}
    for numel, nbytes in parts:
        if numel:
            merged[nbytes] = merged.get(nbytes, 0) + numel
    return tuple((numel, nbytes) for nbytes, numel in merged.items()) if len(merged) > 1 else ()
